#include "shoestring/train/flow_matching.h"

#include <cmath>

#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/core/units.h"

namespace shoestring {

namespace {
void check_shift(double shift) {
  if (!std::isfinite(shift) || shift <= 0) fail("flow shift must be finite and > 0 (got {})", shift);
}

void check_mode_scale(double scale) {
  const double max_scale = 2.0 / (M_PI - 2.0);
  if (!(scale >= -1.0 && scale <= max_scale))
    fail("mode_scale must be in [-1, 2 / (pi - 2) = {:.6f}] for a monotone density (got {})", max_scale, scale);
}
}  // namespace

double flow_shift(double sigma, double shift) {
  check_shift(shift);
  return shift * sigma / (1.0 + (shift - 1.0) * sigma);
}

at::Tensor flow_shift(const at::Tensor& sigma, double shift) {
  check_shift(shift);
  if (shift == 1.0) return sigma.clone();
  return sigma * shift / (sigma * (shift - 1.0) + 1.0);
}

at::Tensor flow_mode_transform(const at::Tensor& u, double scale) {
  check_mode_scale(scale);
  const at::Tensor c = torch::cos(u * (M_PI / 2));
  return 1.0 - u - scale * (c * c - 1.0 + u);
}

at::Tensor sample_flow_times(int64_t batch, const std::string& mode, double mean, double std, double mode_scale,
                             double shift) {
  check_shift(shift);
  at::Tensor t;
  if (mode == "logit_normal") {
    t = torch::sigmoid(torch::randn({batch}, torch::kFloat32) * std + mean);
  } else if (mode == "uniform") {
    t = torch::rand({batch}, torch::kFloat32);
  } else if (mode == "mode") {
    check_mode_scale(mode_scale);  // before drawing: a bad scale consumes no random numbers
    t = flow_mode_transform(torch::rand({batch}, torch::kFloat32).to(torch::kFloat64), mode_scale)
            .clamp(0.0, 1.0)
            .to(torch::kFloat32);
  } else {
    fail("timestep_sampling: unknown mode \"{}\" (expected \"logit_normal\", \"uniform\" or \"mode\")", mode);
  }
  if (shift == 1.0) return t;
  return flow_shift(t.to(torch::kFloat64), shift).to(torch::kFloat32);
}

at::Tensor flow_loss_weight(const at::Tensor& sigma, const std::string& scheme) {
  if (sigma.dim() != 1) fail("flow_loss_weight: expected sigma [B], got {} dims", sigma.dim());
  if (scheme == "none") return torch::ones_like(sigma);
  if (scheme == "sigma_sqrt") return sigma.pow(-2.0);
  if (scheme == "cosmap") return 2.0 / (M_PI * (1.0 - 2.0 * sigma + 2.0 * sigma * sigma));
  fail("flow loss weighting: unknown scheme \"{}\" (expected \"none\", \"sigma_sqrt\" or \"cosmap\")", scheme);
}

namespace {
at::Tensor broadcast_time(const at::Tensor& t, const at::Tensor& like) {
  std::vector<int64_t> shape(like.dim(), 1);
  shape[0] = t.size(0);
  return t.to(like.scalar_type()).view(shape);
}
}  // namespace

at::Tensor flow_interpolate(const at::Tensor& x0, const at::Tensor& eps, const at::Tensor& t) {
  auto tb = broadcast_time(t, x0);
  return x0 + tb * (eps.to(x0.scalar_type()) - x0);
}

at::Tensor flow_target(const at::Tensor& x0, const at::Tensor& eps) { return eps.to(x0.scalar_type()) - x0; }

at::Tensor sample_euler(const VelocityFn& velocity, const at::Tensor& noise, int64_t steps) {
  if (steps < 1) fail("sampling steps must be >= 1 (got {})", steps);
  torch::NoGradGuard no_grad;
  at::Tensor x = noise.to(torch::kFloat32).clone();
  const int64_t b = x.size(0);
  for (int64_t i = 0; i < steps; ++i) {
    double t = 1.0 - static_cast<double>(i) / steps;
    double t_next = 1.0 - static_cast<double>(i + 1) / steps;
    at::Tensor tt = torch::full({b}, t, x.options());  // on the noise's device
    at::Tensor v = velocity(x, tt).to(torch::kFloat32);
    x.add_(v, t_next - t);
  }
  return x;
}

at::Tensor sd3_sigmas(int64_t steps, double shift) {
  check_shift(shift);
  if (steps < 1) fail("sampling steps must be >= 1 (got {})", steps);
  // The reference's timestep table is sigma(1..1000 / 1000): sigma_max = sigma(1) = 1 and
  // sigma_min = sigma(0.001); its schedule goes through sigma() once more.
  const double sigma_max = 1.0, sigma_min = flow_shift(0.001, shift);
  at::Tensor out = torch::zeros({steps + 1}, torch::kFloat64);
  auto a = out.accessor<double, 1>();
  for (int64_t i = 0; i < steps; ++i) {
    // torch.linspace(start, end, steps): start + i * (end - start) / (steps - 1); [start] for one step.
    const double ts = steps == 1
                          ? 1000.0 * sigma_max
                          : 1000.0 * sigma_max + static_cast<double>(i) * (1000.0 * sigma_min - 1000.0 * sigma_max) /
                                                     static_cast<double>(steps - 1);
    a[i] = flow_shift(ts / 1000.0, shift);
  }
  return out;  // a[steps] stays 0
}

namespace {

std::vector<double> schedule(const at::Tensor& sigmas) {
  if (!sigmas.defined() || sigmas.dim() != 1 || sigmas.size(0) < 2)
    fail("sampling sigmas must be 1-D with at least 2 entries (got {})",
         sigmas.defined() ? format_shape(sigmas.sizes()) : std::string("undefined"));
  at::Tensor s = sigmas.detach().to(torch::kCPU, torch::kFloat64).contiguous();
  std::vector<double> out(s.data_ptr<double>(), s.data_ptr<double>() + s.numel());
  for (double v : out)
    if (!std::isfinite(v)) fail("sampling sigmas must be finite (got {})", v);
  return out;
}

// x <- x + v_i (sigma_{i+1} - sigma_i) with v_i = step_velocity(x, sigma_i as float32 [B], i).
at::Tensor euler_over(const std::function<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t)>& step_velocity,
                      const at::Tensor& noise, const std::vector<double>& sig) {
  torch::NoGradGuard no_grad;
  at::Tensor x = noise.to(torch::kFloat32).clone();
  const int64_t b = x.size(0);
  for (size_t i = 0; i + 1 < sig.size(); ++i) {
    at::Tensor tt = torch::full({b}, sig[i], x.options());  // on the noise's device
    at::Tensor v = step_velocity(x, tt, static_cast<int64_t>(i)).to(torch::kFloat32);
    x.add_(v, sig[i + 1] - sig[i]);
  }
  return x;
}

}  // namespace

at::Tensor sample_euler_sigmas(const VelocityFn& velocity, const at::Tensor& noise, const at::Tensor& sigmas) {
  const std::vector<double> sig = schedule(sigmas);
  return euler_over([&](const at::Tensor& x, const at::Tensor& t, int64_t) { return velocity(x, t); }, noise, sig);
}

bool FlowGuidance::slg_active(int64_t step, int64_t steps) const {
  const double i = static_cast<double>(step), n = static_cast<double>(steps);
  return slg_scale > 0 && !slg_layers.empty() && i > slg_start * n && i < slg_end * n;
}

at::Tensor combine_guidance(const GuidedVelocities& v, double cfg_scale, double slg_scale) {
  if (!v.cond.defined() || !v.uncond.defined()) fail("guidance: the cond and uncond velocities must be defined");
  at::Tensor out = v.uncond.to(v.cond.scalar_type()) + cfg_scale * (v.cond - v.uncond.to(v.cond.scalar_type()));
  if (v.cond_skip.defined()) out = out + slg_scale * (v.cond - v.cond_skip.to(v.cond.scalar_type()));
  return out;
}

at::Tensor sample_euler_guided(const GuidedVelocityFn& model, const at::Tensor& noise, const at::Tensor& sigmas,
                               const FlowGuidance& guidance) {
  const std::vector<double> sig = schedule(sigmas);
  const int64_t steps = static_cast<int64_t>(sig.size()) - 1;
  const std::vector<int64_t> none;
  return euler_over(
      [&](const at::Tensor& x, const at::Tensor& t, int64_t i) {
        const bool slg = guidance.slg_active(i, steps);
        GuidedVelocities v = model(x, t, slg ? guidance.slg_layers : none);
        if (slg && !v.cond_skip.defined()) fail("guidance: step {} needs the skip-layer velocity (cond_skip)", i);
        if (!slg) v.cond_skip = at::Tensor();  // only active steps get the SLG term
        return combine_guidance(v, guidance.cfg_scale, guidance.slg_scale);
      },
      noise, sig);
}

}  // namespace shoestring
