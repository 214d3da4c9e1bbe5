// The discrete DDPM noise schedule of Stable Diffusion 1.x / 2.x / SDXL, the
// epsilon- and v-prediction training targets, and a deterministic DDIM
// sampler step.
//
// Schedule: 1000 steps, betas linear in sqrt(beta) from sqrt(0.00085) to
// sqrt(0.012), then squared (LDM's make_beta_schedule("linear"), diffusers'
// "scaled_linear"); alpha_bar_t = prod_{s<=t} (1 - beta_s).
// Forward process (Ho et al. 2020, arXiv 2006.11239):
//   x_t = sqrt(alpha_bar_t) x_0 + sqrt(1 - alpha_bar_t) eps.
// v-prediction (Salimans & Ho 2022, arXiv 2202.00512, as SD 2.x):
//   v = sqrt(alpha_bar_t) eps - sqrt(1 - alpha_bar_t) x_0.
// DDIM (Song et al. 2020, arXiv 2010.02502), eta = 0, with diffusers'
// DDIMScheduler "leading" timestep spacing and steps_offset 1, and
// set_alpha_to_one = false (the final step uses alpha_bar_0), as SD's
// scheduler_config.json.
#pragma once
#include <cstdint>
#include <vector>

#include <ATen/ATen.h>

namespace shoestring {

class DdpmSchedule {
 public:
  /// Stable Diffusion's schedule (see the file comment).
  static DdpmSchedule stable_diffusion();

  /// float64 [1000]: alpha_bar_t.
  const at::Tensor& alphas_cumprod() const { return alphas_cumprod_; }
  int64_t num_steps() const { return alphas_cumprod_.size(0); }

  /// Uniform integer timesteps in [0, num_steps), int64 [B], from libtorch's
  /// global CPU generator.
  at::Tensor sample_timesteps(int64_t batch) const;
  /// x_t for x0, eps [B, ...] float32 and t int64 [B]. Returns float32.
  at::Tensor add_noise(const at::Tensor& x0, const at::Tensor& eps, const at::Tensor& t) const;
  /// The v-prediction target for the same arguments. Returns float32.
  at::Tensor v_target(const at::Tensor& x0, const at::Tensor& eps, const at::Tensor& t) const;

  /// Timesteps of an `steps`-step DDIM run, descending (diffusers "leading"
  /// spacing, steps_offset 1: (steps-1-i) * (1000 / steps) + 1).
  /// Throws shoestring::Error unless 1 <= steps <= num_steps.
  std::vector<int64_t> ddim_timesteps(int64_t steps) const;
  /// One DDIM step (eta 0) from x_t at timestep t to the previous timestep
  /// t_prev (< 0: the end, alpha_bar_0 is used), given the model's epsilon
  /// prediction. All float32 of one shape.
  at::Tensor ddim_step(const at::Tensor& x_t, const at::Tensor& eps, int64_t t, int64_t t_prev) const;
  /// epsilon from a v-prediction at timestep t: sqrt(ab) v + sqrt(1-ab) x_t.
  at::Tensor eps_from_v(const at::Tensor& x_t, const at::Tensor& v, int64_t t) const;

 private:
  explicit DdpmSchedule(at::Tensor alphas_cumprod) : alphas_cumprod_(std::move(alphas_cumprod)) {}
  /// [B, 1, ..., 1] float32 gathers of sqrt(ab) and sqrt(1-ab) shaped like x.
  std::pair<at::Tensor, at::Tensor> coefficients(const at::Tensor& t, const at::Tensor& like) const;
  at::Tensor alphas_cumprod_;
};

}  // namespace shoestring
