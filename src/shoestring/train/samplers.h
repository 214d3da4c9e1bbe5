// Samplers of the released LDM UNets (DDPM-trained, epsilon or v
// prediction): DDIM, Euler, Euler ancestral and DPM++ 2M, written against a
// denoiser D(x, sigma) in the variance-exploding parametrisation of Karras et
// al. 2022 (arXiv 2206.00364): x = x0 + sigma * eps, sigma = sqrt((1 -
// alpha_bar) / alpha_bar), as k-diffusion (crowsonkb/k-diffusion, the
// samplers A1111 and ComfyUI run) wraps a CompVis model.
//
// - euler: k-diffusion sample_euler (s_churn 0): x += (x - D) / sigma * (sigma_next - sigma).
// - euler_a: sample_euler_ancestral (eta 1): the Euler step to sigma_down, then
//   fresh noise of sigma_up, sigma_up = min(sigma_next, sqrt(sigma_next^2 (sigma^2 -
//   sigma_next^2) / sigma^2)), sigma_down = sqrt(sigma_next^2 - sigma_up^2).
// - dpmpp_2m: sample_dpmpp_2m (Lu et al. 2022, DPM-Solver++, arXiv 2211.01095,
//   multistep second order): with lambda = -log sigma, h = lambda_next - lambda,
//   x = (sigma_next / sigma) x - expm1(-h) D', where D' = D on the first and
//   last step and (1 + 1/(2r)) D - 1/(2r) D_previous with r = h_previous / h otherwise.
// - ddim: DDIM with eta 0 (Song et al. 2020, arXiv 2010.02502) is the Euler
//   step in these coordinates; its levels are diffusers' DDIMScheduler
//   timesteps (DdpmSchedule::ddim_timesteps) and it ends at alpha_bar_0, as
//   DDIMScheduler with set_alpha_to_one = false, so it reproduces the DDIM of
//   training-time samples.
//
// Noise levels for euler / euler_a / dpmpp_2m: k-diffusion's
// DiscreteSchedule.get_sigmas(n): timesteps linspace(999, 0, n), sigma
// interpolated linearly in log sigma between the table's entries, then a
// final 0 (SD 1.x: sigma_max 14.6146, sigma_min 0.0292).
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "shoestring/train/ddpm.h"

namespace shoestring {

/// The sampling algorithms `shoestring sample --sampler` accepts.
enum class SamplerKind { ddim, euler, euler_a, dpmpp_2m };

/// "ddim", "euler", "euler_a", "dpmpp_2m", and kohya's sample_sampler names
/// of the same algorithms, "k_euler", "k_euler_a", "dpmsolver++"
/// (diffusers' DPMSolverMultistepScheduler, second order). Throws
/// shoestring::Error for any other name, listing the accepted ones; `what`
/// names the option.
SamplerKind parse_sampler(const std::string& name, const std::string& what);
/// The name parse_sampler accepts for `kind`.
const char* sampler_name(SamplerKind kind);

/// One noise level of a sampling run: sigma (>= 0; 0 = clean) and the UNet
/// timestep that has it (fractional between the table's entries; unused
/// where sigma is 0).
struct NoiseLevel {
  double sigma = 0;
  double timestep = 0;
};

/// sqrt((1 - alpha_bar_t) / alpha_bar_t) for each of the schedule's
/// timesteps, float64 [num_steps].
at::Tensor ddpm_sigmas(const DdpmSchedule& schedule);

/// The levels `kind` visits in `steps` model evaluations: steps + 1 levels,
/// descending (see the file comment). Throws shoestring::Error unless 1 <=
/// steps <= schedule.num_steps().
std::vector<NoiseLevel> sampling_levels(const DdpmSchedule& schedule, SamplerKind kind, int64_t steps);

/// The denoiser: the model's estimate of x0 (float32, x's shape) for x
/// (float32, variance-exploding, at `level`).
using DenoiseFn = std::function<at::Tensor(const at::Tensor& x, const NoiseLevel& level)>;

/// Runs `kind` from unit Gaussian `noise` (float32 [B, ...]) through
/// `levels` (descending, as sampling_levels gives; at least 2), calling
/// `denoise` once per step. The start is noise x sigma_0 (k-diffusion) or,
/// for ddim, noise x sqrt(1 + sigma_0^2) (DDIM starts from unit noise in the
/// variance-preserving x_t); the result is the variance-preserving sample at
/// the last level, x / sqrt(1 + sigma_last^2) (x itself when the last sigma
/// is 0). euler_a draws its noise on the CPU from `generator` (the same on
/// every device) and moves it to noise's device. Throws shoestring::Error for
/// fewer than 2 levels, levels not descending, or a missing generator for
/// euler_a.
at::Tensor run_sampler(SamplerKind kind, const DenoiseFn& denoise, const at::Tensor& noise,
                       const std::vector<NoiseLevel>& levels, at::Generator* generator = nullptr);

/// The DDPM UNet's output (epsilon, or v when `v_prediction`) at `level` as a
/// denoised estimate: x - sigma eps, or x / (sigma^2 + 1) - v sigma /
/// sqrt(sigma^2 + 1) (k-diffusion's CompVisDenoiser / CompVisVDenoiser).
/// The model's input is x / sqrt(sigma^2 + 1) (model_input).
at::Tensor denoised_from_output(const at::Tensor& x, const at::Tensor& output, double sigma, bool v_prediction);
/// x / sqrt(sigma^2 + 1): the variance-preserving x_t a DDPM UNet takes.
at::Tensor model_input(const at::Tensor& x, double sigma);

}  // namespace shoestring
