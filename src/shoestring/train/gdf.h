// Wuerstchen v3's GDF ("generalized diffusion framework") as Stable Cascade
// stage C trains and samples with it: the objective of
// model.architecture = "cascade-c" / "cascade-c-lite".
//
// Source: Stability-AI/StableCascade, gdf/ (schedulers.py CosineSchedule,
// scalers.py VPScaler, targets.py EpsilonTarget, noise_conditions.py
// CosineTNoiseCond, loss_weights.py P2LossWeight and AdaptiveLossWeight,
// samplers.py DDPMSampler, __init__.py GDF.diffuse / GDF.sample) with the
// settings of train/train_c.py; kohya's stable-cascade branch and OneTrainer
// use the same schedule. Paper: Pernias et al., "Wuerstchen: An Efficient
// Architecture for Large-Scale Text-to-Image Diffusion Models" (arXiv
// 2306.00637); the cosine schedule is Nichol & Dhariwal 2021 (arXiv
// 2102.09672), P2 weighting Choi et al. 2022 (arXiv 2204.00227).
//
// With t in [0, 1] (1 = pure noise), s = 0.008 and
// min_var = cos(s / (1 + s) * pi / 2)^2:
//   var(t)    = clamp(cos((s + t) / (1 + s) * pi / 2)^2 / min_var, 1e-4, 0.9999)
//   logSNR(t) = log(var / (1 - var)) + 2 log(1 / shift), clamped to
//               [logSNR(1), logSNR(0)] of the unshifted schedule (+-9.21024)
//   a = sqrt(sigmoid(logSNR)), b = sqrt(1 - sigmoid(logSNR))    (variance preserving)
//   x_t = a x0 + b eps; the model predicts eps (epsilon target)
//   r = acos(sqrt(sigmoid(logSNR) min_var)) / (pi / 2) (1 + s) - s, clamped to [0, 1]:
//       the time the model is given (t itself where the clamp on var does not bite)
//   loss = mean_b(w_b mse_b), w = P2 (1 / (1 + exp(logSNR))) or the adaptive weight.
// Training draws t = clamp(1 - U[0, 1) + 0.001, 0.001, 1).
#pragma once
#include <cstdint>
#include <functional>

#include <ATen/ATen.h>

namespace shoestring {

/// The cosine schedule of GDF (CosineSchedule(clamp_range=[1e-4, 0.9999]),
/// s = 0.008) and its inverse, the noise condition CosineTNoiseCond.
struct GdfCosineSchedule {
  double s = 0.008;
  double var_min = 1e-4, var_max = 0.9999;

  /// logSNR of times `t` (float [B], clamped to [0, 1] first), float64 [B].
  /// shift > 0 moves it by 2 log(1 / shift) (shift 2: noisier, as the stage C
  /// sampler's default); the result is clamped to the unshifted schedule's
  /// range [logSNR(1), logSNR(0)]. Throws shoestring::Error for shift <= 0.
  at::Tensor log_snr(const at::Tensor& t, double shift = 1.0) const;

  /// The model's time input r for a logSNR (float [B]), float32 [B] in [0, 1].
  at::Tensor noise_cond(const at::Tensor& log_snr) const;

  /// The range [logSNR(1), logSNR(0)] every logSNR is clamped to.
  std::pair<double, double> limits() const;
};

/// Training times of GDF.diffuse, float32 [batch] in [0.001, 1]:
/// clamp(1 - U[0, 1) + 0.001, 0.001, 1), drawn from libtorch's default CPU
/// generator (so a checkpoint's saved RNG state covers them).
at::Tensor gdf_sample_times(int64_t batch);

/// The variance-preserving scalers a = sqrt(sigmoid(logSNR)) and
/// b = sqrt(1 - sigmoid(logSNR)) of logSNR [B] (float64), as float64 [B].
std::pair<at::Tensor, at::Tensor> gdf_vp_scalers(const at::Tensor& log_snr);

/// x_t = a x0 + b eps (a, b of gdf_vp_scalers, broadcast over dims >= 1).
/// x0, eps: [B, ...] float; log_snr: [B]. Returns [B, ...] in x0's dtype.
/// Throws shoestring::Error when the shapes do not match.
at::Tensor gdf_diffuse(const at::Tensor& x0, const at::Tensor& eps, const at::Tensor& log_snr);

/// P2 loss weight (k + exp(s logSNR))^-gamma with GDF's defaults k = gamma =
/// s = 1, i.e. 1 / (1 + SNR); float32 [B].
at::Tensor gdf_p2_weight(const at::Tensor& log_snr);

/// GDF's AdaptiveLossWeight: the logSNR axis cut at 299 points
/// linspace(-10, 10, 299) into 300 buckets (bucket i holds logSNR in
/// (edge[i-1], edge[i]], as torch.searchsorted finds it), each with a running
/// mean of the unweighted loss (start 1); a sample's weight is
/// clamp(1 / loss of its bucket, 1e-7, 1e7). After each step the buckets of
/// the batch move towards its per-sample losses: L <- 0.99 L + 0.01 loss.
/// Within one update every sample reads the bucket's old value; when several
/// samples fall in one bucket the last one's value is kept (what PyTorch's
/// CPU index assignment in the reference does). The bucket losses are
/// training state: checkpoints save them (Stable Cascade keeps them in its
/// info file), so a resumed run weights as the uninterrupted one.
class GdfAdaptiveLossWeight {
 public:
  static constexpr int64_t kBuckets = 300;

  GdfAdaptiveLossWeight();
  /// Weights of logSNR [B] (float), float32 [B].
  at::Tensor weight(const at::Tensor& log_snr) const;
  /// Moves the buckets of logSNR [B] towards `loss` [B] (float, detached).
  /// Throws shoestring::Error when the sizes differ.
  void update(const at::Tensor& log_snr, const at::Tensor& loss, double beta = 0.99);
  /// The bucket losses, float64 [300] (a copy), and their restore.
  at::Tensor bucket_losses() const;
  /// Throws shoestring::Error unless `losses` is [300] with finite positive values.
  void set_bucket_losses(const at::Tensor& losses);
  /// Bucket of each logSNR, int64 [B].
  at::Tensor bucket_index(const at::Tensor& log_snr) const;

 private:
  at::Tensor edges_;   // float64 [299]
  at::Tensor losses_;  // float64 [300]
};

/// GDF.sample's time grid: r = linspace(t_start, 0, steps + 1) and its
/// logSNR under `shift` (float64 [steps + 1]). Throws shoestring::Error for
/// steps < 1 or t_start outside (0, 1].
at::Tensor gdf_sample_log_snrs(const GdfCosineSchedule& schedule, int64_t steps, double shift, double t_start = 1.0);

/// Classifier-free guidance as GDF.sample applies it: g = lerp(uncond, cond,
/// cfg), then with rho > 0 rescaled towards the conditional prediction's
/// spread: rho g std(cond) / (std(g) + 1e-9) + (1 - rho) g (std over the whole
/// batch tensor, unbiased). Shapes equal; returns cond's shape and dtype.
at::Tensor gdf_guidance(const at::Tensor& cond, const at::Tensor& uncond, double cfg, double rho);

/// The noise prediction at x (float32 [B, C, H, W]) for the model time r
/// (float32 [B]), guidance already applied.
using GdfPredictFn = std::function<at::Tensor(const at::Tensor& x, const at::Tensor& r)>;

/// GDF.sample with the DDPM sampler (DDIM with eta = 1): from x = noise
/// (float32 [B, C, H, W]) over gdf_sample_log_snrs(schedule, steps, shift),
/// each step predicts eps, forms x0 = (x - b eps) / a and moves to
///   x = a' x0 + sqrt(b'^2 - sigma^2) eps + sigma z,
///   sigma = eta sqrt(b'^2 / b^2) sqrt(1 - a^2 / a'^2),   z ~ N(0, I)
/// (a', b' of the next logSNR; z from libtorch's default CPU generator).
/// Returns the last step's x0 prediction (float32, as kohya's stable cascade
/// sampler returns it). Runs under no-grad. Throws shoestring::Error as
/// gdf_sample_log_snrs.
at::Tensor gdf_sample(const GdfPredictFn& predict, const at::Tensor& noise, const GdfCosineSchedule& schedule,
                      int64_t steps, double shift, double eta = 1.0);

}  // namespace shoestring
