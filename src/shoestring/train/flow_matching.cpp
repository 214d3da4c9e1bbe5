#include "shoestring/train/flow_matching.h"

#include <torch/torch.h>

#include "shoestring/core/error.h"

namespace shoestring {

at::Tensor sample_flow_times(int64_t batch, const std::string& mode, double mean, double std) {
  if (mode == "logit_normal") {
    return torch::sigmoid(torch::randn({batch}, torch::kFloat32) * std + mean);
  }
  if (mode == "uniform") return torch::rand({batch}, torch::kFloat32);
  fail("timestep_sampling: unknown mode \"{}\" (expected \"logit_normal\" or \"uniform\")", mode);
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

}  // namespace shoestring
