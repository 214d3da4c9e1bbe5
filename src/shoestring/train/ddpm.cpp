#include "shoestring/train/ddpm.h"

#include <cmath>

#include <torch/torch.h>

#include "shoestring/core/error.h"

namespace shoestring {

DdpmSchedule DdpmSchedule::stable_diffusion() {
  const int64_t n = 1000;
  at::Tensor sqrt_beta = torch::linspace(std::sqrt(0.00085), std::sqrt(0.012), n, torch::kFloat64);
  at::Tensor alphas = 1.0 - sqrt_beta * sqrt_beta;
  return DdpmSchedule(torch::cumprod(alphas, 0));
}

at::Tensor DdpmSchedule::sample_timesteps(int64_t batch) const {
  return torch::randint(0, num_steps(), {batch}, torch::kInt64);
}

std::pair<at::Tensor, at::Tensor> DdpmSchedule::coefficients(const at::Tensor& t, const at::Tensor& like) const {
  if (t.dim() != 1 || t.size(0) != like.size(0)) {
    fail("DDPM: timesteps must be [B] with B = {} (got {})", like.size(0), t.dim() == 1 ? t.size(0) : -1);
  }
  at::Tensor ab = alphas_cumprod_.index_select(0, t.to(torch::kInt64).cpu());
  std::vector<int64_t> shape(static_cast<size_t>(like.dim()), 1);
  shape[0] = like.size(0);
  at::Tensor a = ab.sqrt().to(torch::kFloat32).view(shape);
  at::Tensor s = (1.0 - ab).sqrt().to(torch::kFloat32).view(shape);
  return {a, s};
}

at::Tensor DdpmSchedule::add_noise(const at::Tensor& x0, const at::Tensor& eps, const at::Tensor& t) const {
  auto [a, s] = coefficients(t, x0);
  return a * x0.to(torch::kFloat32) + s * eps.to(torch::kFloat32);
}

at::Tensor DdpmSchedule::v_target(const at::Tensor& x0, const at::Tensor& eps, const at::Tensor& t) const {
  auto [a, s] = coefficients(t, x0);
  return a * eps.to(torch::kFloat32) - s * x0.to(torch::kFloat32);
}

std::vector<int64_t> DdpmSchedule::ddim_timesteps(int64_t steps) const {
  if (steps < 1 || steps > num_steps()) fail("DDIM: steps must be in [1, {}] (got {})", num_steps(), steps);
  const int64_t ratio = num_steps() / steps;
  std::vector<int64_t> ts;
  for (int64_t i = steps - 1; i >= 0; --i) ts.push_back(std::min(i * ratio + 1, num_steps() - 1));
  return ts;
}

at::Tensor DdpmSchedule::ddim_step(const at::Tensor& x_t, const at::Tensor& eps, int64_t t, int64_t t_prev) const {
  const double ab = alphas_cumprod_[t].item<double>();
  const double ab_prev = t_prev >= 0 ? alphas_cumprod_[t_prev].item<double>() : alphas_cumprod_[0].item<double>();
  at::Tensor x0 = (x_t - std::sqrt(1.0 - ab) * eps) / std::sqrt(ab);
  return std::sqrt(ab_prev) * x0 + std::sqrt(1.0 - ab_prev) * eps;
}

at::Tensor DdpmSchedule::eps_from_v(const at::Tensor& x_t, const at::Tensor& v, int64_t t) const {
  const double ab = alphas_cumprod_[t].item<double>();
  return std::sqrt(ab) * v + std::sqrt(1.0 - ab) * x_t;
}

}  // namespace shoestring
