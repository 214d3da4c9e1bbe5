#include "shoestring/train/gdf.h"

#include <cmath>

#include <ATen/Functions.h>
#include <torch/torch.h>

#include "shoestring/core/error.h"

namespace shoestring {

namespace {

constexpr double kPi = 3.14159265358979323846;

double min_var(double s) {
  const double c = std::cos(s / (1.0 + s) * kPi * 0.5);
  return c * c;
}

// logSNR of the unshifted, unclamped-in-logSNR schedule at one time (the
// limits), in double.
double log_snr_at(const GdfCosineSchedule& sc, double t) {
  const double c = std::cos((sc.s + t) / (1.0 + sc.s) * kPi * 0.5);
  double var = std::min(std::max(c, 0.0), 1.0);
  var = var * var / min_var(sc.s);
  var = std::min(std::max(var, sc.var_min), sc.var_max);
  return std::log(var / (1.0 - var));
}

}  // namespace

std::pair<double, double> GdfCosineSchedule::limits() const { return {log_snr_at(*this, 1.0), log_snr_at(*this, 0.0)}; }

at::Tensor GdfCosineSchedule::log_snr(const at::Tensor& t_in, double shift) const {
  if (!(shift > 0) || !std::isfinite(shift)) fail("GDF: shift must be > 0 (got {})", shift);
  const at::Tensor t = t_in.to(at::kDouble).clamp(0.0, 1.0);
  at::Tensor var = at::cos((t + s) / (1.0 + s) * (kPi * 0.5)).clamp(0.0, 1.0).pow(2).div(min_var(s));
  var = var.clamp(var_min, var_max);
  at::Tensor lsnr = (var / (1.0 - var)).log();
  if (shift != 1.0) lsnr = lsnr + 2.0 * std::log(1.0 / shift);
  const auto [lo, hi] = limits();
  return lsnr.clamp(lo, hi);
}

at::Tensor GdfCosineSchedule::noise_cond(const at::Tensor& log_snr) const {
  const at::Tensor var = log_snr.to(at::kDouble).sigmoid().clamp(0.0, 1.0);
  const at::Tensor r = (var * min_var(s)).sqrt().acos() / (kPi * 0.5) * (1.0 + s) - s;
  return r.clamp(0.0, 1.0).to(at::kFloat);
}

at::Tensor gdf_sample_times(int64_t batch) {
  if (batch < 1) fail("GDF: batch must be >= 1 (got {})", batch);
  return (1.0 - torch::rand({batch}, torch::kFloat32)).add_(0.001).clamp_(0.001, 1.0);
}

std::pair<at::Tensor, at::Tensor> gdf_vp_scalers(const at::Tensor& log_snr) {
  const at::Tensor a2 = log_snr.to(at::kDouble).sigmoid();
  return {a2.sqrt(), (1.0 - a2).sqrt()};
}

namespace {

at::Tensor per_sample(const at::Tensor& v, const at::Tensor& like) {
  std::vector<int64_t> shape(static_cast<size_t>(like.dim()), 1);
  shape[0] = like.size(0);
  return v.to(like.scalar_type() == at::kDouble ? at::kDouble : at::kFloat).view(shape);
}

}  // namespace

at::Tensor gdf_diffuse(const at::Tensor& x0, const at::Tensor& eps, const at::Tensor& log_snr) {
  if (x0.sizes() != eps.sizes()) {
    fail("GDF: latents {} and noise {} differ in shape", c10::str(x0.sizes()), c10::str(eps.sizes()));
  }
  if (x0.dim() < 1 || log_snr.dim() != 1 || log_snr.size(0) != x0.size(0)) {
    fail("GDF: logSNR {} must be [B] for latents {}", c10::str(log_snr.sizes()), c10::str(x0.sizes()));
  }
  const auto [a, b] = gdf_vp_scalers(log_snr);
  return (x0.to(at::kFloat) * per_sample(a, x0) + eps.to(at::kFloat) * per_sample(b, x0)).to(x0.scalar_type());
}

at::Tensor gdf_p2_weight(const at::Tensor& log_snr) {
  return (1.0 + log_snr.to(at::kDouble).exp()).reciprocal().to(at::kFloat);
}

GdfAdaptiveLossWeight::GdfAdaptiveLossWeight()
    : edges_(torch::linspace(-10.0, 10.0, kBuckets - 1, torch::kDouble)),
      losses_(torch::ones({kBuckets}, torch::kDouble)) {}

at::Tensor GdfAdaptiveLossWeight::bucket_index(const at::Tensor& log_snr) const {
  return at::searchsorted(edges_, log_snr.to(at::kDouble).contiguous());
}

at::Tensor GdfAdaptiveLossWeight::weight(const at::Tensor& log_snr) const {
  return losses_.index_select(0, bucket_index(log_snr)).reciprocal().clamp(1e-7, 1e7).to(at::kFloat);
}

void GdfAdaptiveLossWeight::update(const at::Tensor& log_snr, const at::Tensor& loss, double beta) {
  if (log_snr.numel() != loss.numel()) {
    fail("GDF adaptive loss weight: {} logSNR values for {} losses", log_snr.numel(), loss.numel());
  }
  const at::Tensor idx = bucket_index(log_snr.reshape({-1}));
  const at::Tensor l = loss.detach().reshape({-1}).to(at::kDouble);
  const at::Tensor old = losses_.clone();
  const int64_t* ip = idx.data_ptr<int64_t>();
  const double* lp = l.contiguous().data_ptr<double>();
  const double* op = old.data_ptr<double>();
  double* out = losses_.data_ptr<double>();
  for (int64_t i = 0; i < idx.numel(); ++i) out[ip[i]] = op[ip[i]] * beta + lp[i] * (1.0 - beta);
}

at::Tensor GdfAdaptiveLossWeight::bucket_losses() const { return losses_.clone(); }

void GdfAdaptiveLossWeight::set_bucket_losses(const at::Tensor& losses) {
  if (losses.dim() != 1 || losses.size(0) != kBuckets) {
    fail("GDF adaptive loss weight: bucket losses have shape {}, expected [{}]", c10::str(losses.sizes()), kBuckets);
  }
  const at::Tensor l = losses.to(at::kDouble);
  if (!l.isfinite().all().item<bool>() || !(l > 0).all().item<bool>()) {
    fail("GDF adaptive loss weight: bucket losses must be finite and > 0");
  }
  losses_ = l.clone();
}

at::Tensor gdf_sample_log_snrs(const GdfCosineSchedule& schedule, int64_t steps, double shift, double t_start) {
  if (steps < 1) fail("GDF sampler: steps must be >= 1 (got {})", steps);
  if (!(t_start > 0 && t_start <= 1)) fail("GDF sampler: t_start must be in (0, 1] (got {})", t_start);
  return schedule.log_snr(torch::linspace(t_start, 0.0, steps + 1, torch::kDouble), shift);
}

at::Tensor gdf_guidance(const at::Tensor& cond, const at::Tensor& uncond, double cfg, double rho) {
  if (cond.sizes() != uncond.sizes()) {
    fail("GDF guidance: conditional {} and unconditional {} predictions differ in shape", c10::str(cond.sizes()),
         c10::str(uncond.sizes()));
  }
  const at::Tensor g = at::lerp(uncond, cond, cfg);
  if (rho <= 0) return g;
  return g * (cond.std() / (g.std() + 1e-9)) * rho + g * (1.0 - rho);
}

at::Tensor gdf_sample(const GdfPredictFn& predict, const at::Tensor& noise, const GdfCosineSchedule& schedule,
                      int64_t steps, double shift, double eta) {
  torch::NoGradGuard no_grad;
  const at::Tensor log_snrs = gdf_sample_log_snrs(schedule, steps, shift);
  const int64_t batch = noise.size(0);
  at::Tensor x = noise.to(at::kFloat).clone();
  at::Tensor x0;
  for (int64_t i = 0; i < steps; ++i) {
    const at::Tensor now = log_snrs.slice(0, i, i + 1).expand({batch});
    const at::Tensor next = log_snrs.slice(0, i + 1, i + 2).expand({batch});
    const at::Tensor eps = predict(x, schedule.noise_cond(now)).to(at::kFloat);
    const auto [a, b] = gdf_vp_scalers(now);
    const auto [a_next, b_next] = gdf_vp_scalers(next);
    x0 = (x - eps * per_sample(b, x)) / per_sample(a, x);
    at::Tensor sigma = at::zeros_like(a);
    if (eta > 0) sigma = eta * (b_next.pow(2) / b.pow(2)).sqrt() * (1.0 - a.pow(2) / a_next.pow(2)).sqrt();
    x = x0 * per_sample(a_next, x) + eps * per_sample((b_next.pow(2) - sigma.pow(2)).sqrt(), x);
    if (eta > 0) x = x + torch::randn_like(x) * per_sample(sigma, x);
  }
  return x0;
}

}  // namespace shoestring
