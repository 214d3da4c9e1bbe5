// Rectified flow / flow matching objective and its Euler sampler.
//
// Formulation (Liu et al. 2022, "Flow Straight and Fast", arXiv 2209.03003;
// Lipman et al. 2022, arXiv 2210.02747; as used by Stable Diffusion 3,
// Esser et al. 2024, arXiv 2403.03206):
//   x_t = (1 - t) * x0 + t * eps,   t in [0, 1],  eps ~ N(0, I)
//   the model predicts the velocity v = dx_t/dt = eps - x0,
//   loss = mean((v_pred - (eps - x0))^2).
// Training times t follow SD3's logit-normal distribution
// (t = sigmoid(n), n ~ N(mean, std)) or the uniform distribution.
// Sampling integrates dx/dt = v from t = 1 (pure noise) to t = 0 with Euler
// steps; classifier-free guidance (Ho & Salimans 2022, arXiv 2207.12598)
// mixes conditional and unconditional velocities: v = v_u + s * (v_c - v_u).
//
// SD3 / SD3.5 specifics (Esser et al. 2024, arXiv 2403.03206; Stability-AI/sd3.5
// sd3_impls.py ModelSamplingDiscreteFlow, SkipLayerCFGDenoiser and sd3_infer.py
// get_sigmas; kohya sd-scripts library/sd3_train_utils.py; diffusers
// FlowMatchEulerDiscreteScheduler and training_utils
// compute_density_for_timestep_sampling / compute_loss_weighting_for_sd3):
// the time shift sigma(t) = shift t / (1 + (shift - 1) t), the "mode" time
// density, per-sample loss weights, the shifted sampling schedule and Euler
// over it with classifier-free and skip-layer guidance.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <ATen/ATen.h>

namespace shoestring {

/// The SD3 time shift (resolution-dependent shift of the noise schedule,
/// SD3 paper section 5.3.2; sd3.5 ModelSamplingDiscreteFlow.sigma; kohya
/// --training_shift; diffusers FlowMatchEulerDiscreteScheduler `shift`):
///   flow_shift(s) = shift * s / (1 + (shift - 1) * s).
/// Maps [0, 1] onto [0, 1] monotonically, fixing 0 and 1; shift > 1 moves
/// times towards the noisy end (1), shift < 1 towards the clean end; shift 1
/// is the identity. Throws shoestring::Error unless shift is finite and > 0.
double flow_shift(double sigma, double shift);
/// The same elementwise; sigma: any shape, any float dtype (computed and
/// returned in that dtype, on its device).
at::Tensor flow_shift(const at::Tensor& sigma, double shift);

/// The "mode" density's map from u ~ U(0, 1) to a training time (SD3 paper
/// eq. 20, "mode sampling with heavy tails"; diffusers
/// compute_density_for_timestep_sampling weighting_scheme "mode"; kohya
/// --weighting_scheme mode --mode_scale):
///   t = 1 - u - scale * (cos(pi u / 2)^2 - 1 + u).
/// scale 0 gives t = 1 - u (uniform); SD3 / kohya / diffusers default 1.29.
/// u: any shape, float dtype; returns the same shape and dtype. The map is
/// monotone from [0, 1] onto [0, 1] (t(0) = 1, t(1) = 0) only for
/// -1 <= scale <= 2 / (pi - 2) (~1.752), the paper's admissible range;
/// throws shoestring::Error outside it.
at::Tensor flow_mode_transform(const at::Tensor& u, double scale);

/// Default scale of the "mode" density (SD3 paper, kohya --mode_scale, diffusers --mode_scale).
inline constexpr double kFlowModeScale = 1.29;

/// Draws training times, float32 [batch], from libtorch's default CPU
/// generator (so they are covered by its saved RNG state).
/// mode: "logit_normal" (sigmoid of N(mean, std), in (0, 1)), "uniform"
/// (U[0, 1)) or "mode" (flow_mode_transform of U[0, 1) with mode_scale,
/// computed in float64, in [0, 1]; mean and std unused). Then, when shift != 1, every time goes
/// through flow_shift(t, shift) - kohya sd3_train_utils
/// get_noisy_model_input_and_timesteps (--training_shift, default 1), which
/// then also quantises to integer timesteps / 1000; here times stay
/// continuous. One draw per sample in every mode (randn for logit_normal,
/// rand otherwise), so the stream matches the unshifted draws.
/// Throws shoestring::Error on an unknown mode, a mode_scale outside
/// flow_mode_transform's range (mode "mode" only) or a shift that is not
/// finite and > 0.
at::Tensor sample_flow_times(int64_t batch, const std::string& mode, double mean, double std,
                             double mode_scale = kFlowModeScale, double shift = 1.0);

/// Per-sample loss weight for the flow-matching loss, float [B] in sigma's
/// dtype (sigma: [B] noise levels = training times, any float dtype). The
/// weighting half of kohya sd3_train / diffusers train_dreambooth_sd3's
/// --weighting_scheme (diffusers compute_loss_weighting_for_sd3):
///   "none"       1 (kohya / diffusers: every scheme other than the two below,
///                i.e. "uniform", "logit_normal", "mode")
///   "sigma_sqrt" sigma^-2 (infinite at sigma = 0; the caller keeps sigma > 0)
///   "cosmap"     2 / (pi (1 - 2 sigma + 2 sigma^2))  (SD3 paper eq. 21's weight)
/// In kohya / diffusers choosing "sigma_sqrt" or "cosmap" also means uniform
/// time sampling; here the two choices are independent. Multiply the
/// per-sample loss ([B], already reduced over the other dims) by it.
/// Throws shoestring::Error on an unknown scheme or a sigma that is not 1-D.
at::Tensor flow_loss_weight(const at::Tensor& sigma, const std::string& scheme);

/// x_t = (1 - t) x0 + t eps. x0, eps: [B, ...] any float dtype; t: [B] float32.
/// Returns [B, ...] in x0's dtype.
at::Tensor flow_interpolate(const at::Tensor& x0, const at::Tensor& eps, const at::Tensor& t);

/// Velocity target eps - x0, same shape and dtype as x0.
at::Tensor flow_target(const at::Tensor& x0, const at::Tensor& eps);

/// Velocity model: (x_t [B,C,H,W] float32, t [B] float32) -> v [B,C,H,W].
using VelocityFn = std::function<at::Tensor(const at::Tensor& x, const at::Tensor& t)>;

/// Euler integration of dx/dt = v from t = 1 to t = 0 in `steps` uniform
/// steps: x <- x + (t_next - t) * v(x, t). noise: float32 [B,C,H,W] (x at
/// t = 1). Returns float32 [B,C,H,W] (x at t = 0). Runs under no-grad.
/// Throws shoestring::Error if steps < 1.
at::Tensor sample_euler(const VelocityFn& velocity, const at::Tensor& noise, int64_t steps);

/// SD3's sampling schedule (Stability-AI/sd3.5 sd3_infer.py get_sigmas over
/// sd3_impls.py ModelSamplingDiscreteFlow; kohya sd3_train_utils do_sample):
///   sigma_max = 1, sigma_min = flow_shift(0.001, shift) (the table's first entry),
///   ts = linspace(1000 sigma_max, 1000 sigma_min, steps),
///   sigmas = [flow_shift(ts / 1000, shift) ..., 0]
/// (the smallest non-zero entry is shifted twice, as in the reference: 0.008929
/// for shift 3). float64 [steps + 1], CPU, decreasing from 1 to 0; the reference
/// computes the same values in float32 (differences ~1e-7).
/// Throws shoestring::Error if steps < 1 or shift is not finite and > 0.
at::Tensor sd3_sigmas(int64_t steps, double shift);

/// Euler integration of dx/dsigma = v over a given schedule (sd3.5
/// sd3_impls.py sample_euler with the flow model's denoised = x - sigma v,
/// which reduces to x <- x + v(x, sigma_i) (sigma_{i+1} - sigma_i)).
/// sigmas: 1-D, at least 2 entries, any float dtype, any device (read as
/// doubles; typically sd3_sigmas); the model is called at sigma_0 ..
/// sigma_{n-2}, never at the last entry. noise: float32 [B, ...] (x at
/// sigmas[0]; for sd3_sigmas, pure noise). The model gets t = sigma as float32
/// [B] on noise's device. Returns float32 [B, ...]. Runs under no-grad.
/// Throws shoestring::Error if sigmas is not 1-D with >= 2 finite entries.
at::Tensor sample_euler_sigmas(const VelocityFn& velocity, const at::Tensor& noise, const at::Tensor& sigmas);

/// The velocities of one guided evaluation: the conditional and unconditional
/// (negative-prompt) passes, and - only when the caller was asked for skip
/// layers - the conditional pass with those blocks skipped (undefined otherwise).
struct GuidedVelocities {
  at::Tensor cond, uncond, cond_skip;
};

/// The model side of guided sampling: (x float32 [B, ...], sigma float32 [B],
/// skip_layers) -> velocities. skip_layers is empty on steps where skip-layer
/// guidance is off; otherwise the function also fills cond_skip, the
/// conditional pass with those blocks skipped (for MMDiT:
/// forward(x, sigma, context, y, skip_layers)). The indices are opaque here.
using GuidedVelocityFn = std::function<GuidedVelocities(const at::Tensor& x, const at::Tensor& sigma,
                                                        const std::vector<int64_t>& skip_layers)>;

/// Classifier-free guidance (Ho & Salimans 2022) plus skip-layer guidance
/// (SD3.5 reference sd3_impls.py SkipLayerCFGDenoiser, sd3_infer.py
/// CONFIGS): v = v_u + cfg_scale (v_c - v_u) + slg_scale (v_c - v_c_skip),
/// the SLG term only on steps where slg_active(). The reference applies both
/// to the denoised outputs x - sigma v; since that map is affine in v with the
/// same x, applying them to v is the same.
struct FlowGuidance {
  /// CFG scale; 1 = the conditional velocity alone (the uncond pass still runs).
  double cfg_scale = 5.0;
  /// Skip-layer guidance scale; 0 (or empty slg_layers) = off.
  double slg_scale = 0.0;
  /// Blocks skipped in the skip pass (MMDiT joint-block indices for SD3.5).
  std::vector<int64_t> slg_layers;
  /// Active window as fractions of the step count: active on step i (0-based)
  /// when slg_start * steps < i < slg_end * steps (both strict, as the reference).
  double slg_start = 0.01, slg_end = 0.20;

  /// The sd3.5 reference's SD3.5 Medium settings: cfg 5, SLG scale 2.5 on
  /// joint blocks 7, 8, 9, window 0.01 .. 0.20 (sd3_infer.py CONFIGS
  /// "sd3.5_medium"; its skip_layer_config "cfg" 4.0 is never applied).
  static FlowGuidance sd35_medium() {
    FlowGuidance g;
    g.cfg_scale = 5.0;
    g.slg_scale = 2.5;
    g.slg_layers = {7, 8, 9};
    g.slg_start = 0.01;
    g.slg_end = 0.20;
    return g;
  }
  /// Whether step `step` (0-based) of `steps` runs the skip pass: slg_scale > 0,
  /// slg_layers non-empty and slg_start * steps < step < slg_end * steps.
  bool slg_active(int64_t step, int64_t steps) const;
};

/// v_u + cfg_scale (v_c - v_u), plus slg_scale (v_c - v_c_skip) when
/// v.cond_skip is defined. All velocities the same shape; result in cond's dtype.
/// Throws shoestring::Error if cond or uncond is undefined.
at::Tensor combine_guidance(const GuidedVelocities& v, double cfg_scale, double slg_scale);

/// sample_euler_sigmas with the guided velocity: on step i of n = numel(sigmas) - 1
/// the model is asked for cond / uncond (and, when guidance.slg_active(i, n), the
/// skip pass with guidance.slg_layers) and the step uses combine_guidance.
/// Throws shoestring::Error as sample_euler_sigmas, or if the model leaves
/// cond_skip undefined on an active step.
at::Tensor sample_euler_guided(const GuidedVelocityFn& model, const at::Tensor& noise, const at::Tensor& sigmas,
                               const FlowGuidance& guidance);

}  // namespace shoestring
