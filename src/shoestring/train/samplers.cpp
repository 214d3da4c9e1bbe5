#include "shoestring/train/samplers.h"

#include <cmath>

#include <torch/torch.h>

#include "shoestring/core/error.h"

namespace shoestring {

namespace {

struct SamplerName {
  SamplerKind kind;
  const char* name;
};
constexpr SamplerName kSamplers[] = {{SamplerKind::ddim, "ddim"},
                                     {SamplerKind::euler, "euler"},
                                     {SamplerKind::euler_a, "euler_a"},
                                     {SamplerKind::dpmpp_2m, "dpmpp_2m"}};

}  // namespace

SamplerKind parse_sampler(const std::string& name, const std::string& what) {
  // kohya's sample_sampler names of the same algorithms (train_util.py get_my_scheduler).
  if (name == "k_euler") return SamplerKind::euler;
  if (name == "k_euler_a") return SamplerKind::euler_a;
  if (name == "dpmsolver++") return SamplerKind::dpmpp_2m;
  std::string known;
  for (const SamplerName& s : kSamplers) {
    if (name == s.name) return s.kind;
    known += known.empty() ? s.name : std::string(", ") + s.name;
  }
  fail("{} = \"{}\": not a sampler; expected one of {}", what, name, known);
}

const char* sampler_name(SamplerKind kind) {
  for (const SamplerName& s : kSamplers) {
    if (s.kind == kind) return s.name;
  }
  return "?";
}

at::Tensor ddpm_sigmas(const DdpmSchedule& schedule) {
  const at::Tensor& ab = schedule.alphas_cumprod();
  return ((1.0 - ab) / ab).sqrt();
}

std::vector<NoiseLevel> sampling_levels(const DdpmSchedule& schedule, SamplerKind kind, int64_t steps) {
  const int64_t n = schedule.num_steps();
  if (steps < 1 || steps > n) fail("sampler steps must be in [1, {}] (got {})", n, steps);
  const at::Tensor sigmas = ddpm_sigmas(schedule);
  const auto* sigma = sigmas.data_ptr<double>();
  std::vector<NoiseLevel> levels;
  if (kind == SamplerKind::ddim) {
    for (const int64_t t : schedule.ddim_timesteps(steps)) levels.push_back({sigma[t], static_cast<double>(t)});
    levels.push_back({sigma[0], 0.0});  // DDIMScheduler's final alpha_bar_0 (set_alpha_to_one = false)
    return levels;
  }
  // k-diffusion DiscreteSchedule.get_sigmas / t_to_sigma.
  const double t_max = static_cast<double>(n - 1);
  for (int64_t i = 0; i < steps; ++i) {
    const double t = steps == 1 ? t_max : t_max * static_cast<double>(steps - 1 - i) / static_cast<double>(steps - 1);
    const auto low = static_cast<int64_t>(std::floor(t));
    const auto high = static_cast<int64_t>(std::ceil(t));
    const double w = t - static_cast<double>(low);
    const double log_sigma = (1.0 - w) * std::log(sigma[low]) + w * std::log(sigma[high]);
    levels.push_back({std::exp(log_sigma), t});
  }
  levels.push_back({0.0, 0.0});
  return levels;
}

at::Tensor model_input(const at::Tensor& x, double sigma) { return x / std::sqrt(sigma * sigma + 1.0); }

at::Tensor denoised_from_output(const at::Tensor& x, const at::Tensor& output, double sigma, bool v_prediction) {
  if (!v_prediction) return x - sigma * output;
  const double s2 = sigma * sigma + 1.0;
  return x / s2 - output * (sigma / std::sqrt(s2));
}

at::Tensor run_sampler(SamplerKind kind, const DenoiseFn& denoise, const at::Tensor& noise,
                       const std::vector<NoiseLevel>& levels, at::Generator* generator) {
  if (levels.size() < 2) fail("sampler: {} noise levels, need at least 2 (a start and an end)", levels.size());
  for (size_t i = 0; i + 1 < levels.size(); ++i) {
    if (!(levels[i + 1].sigma < levels[i].sigma) || levels[i + 1].sigma < 0) {
      fail("sampler: noise levels must descend to >= 0 (level {} has sigma {}, level {} sigma {})", i, levels[i].sigma,
           i + 1, levels[i + 1].sigma);
    }
  }
  if (kind == SamplerKind::euler_a && generator == nullptr) fail("sampler euler_a: needs a noise generator");
  const double sigma_0 = levels.front().sigma;
  at::Tensor x = noise.to(torch::kFloat32) * (kind == SamplerKind::ddim ? std::sqrt(sigma_0 * sigma_0 + 1) : sigma_0);
  at::Tensor previous;  // dpmpp_2m: the last step's denoised
  for (size_t i = 0; i + 1 < levels.size(); ++i) {
    const double sigma = levels[i].sigma, next = levels[i + 1].sigma;
    const at::Tensor d = denoise(x, levels[i]).to(torch::kFloat32);
    switch (kind) {
      case SamplerKind::ddim:
      case SamplerKind::euler: x = x + (x - d) * ((next - sigma) / sigma); break;
      case SamplerKind::euler_a: {
        const double up =
            std::min(next, std::sqrt(std::max(0.0, next * next * (sigma * sigma - next * next) / (sigma * sigma))));
        const double down = std::sqrt(std::max(0.0, next * next - up * up));
        x = x + (x - d) * ((down - sigma) / sigma);
        if (next > 0) {
          at::Tensor z = torch::randn(x.sizes(), *generator, torch::kFloat32).to(x.device());
          x = x + z * up;
        }
        break;
      }
      case SamplerKind::dpmpp_2m: {
        if (next == 0) {
          x = d;  // (sigma_next / sigma) x - expm1(-inf) D
          break;
        }
        const double h = std::log(sigma) - std::log(next);  // lambda_next - lambda, lambda = -log sigma
        at::Tensor d_used = d;
        if (previous.defined()) {
          const double h_last = std::log(levels[i - 1].sigma) - std::log(sigma);
          const double r = h_last / h;
          d_used = d * (1.0 + 1.0 / (2.0 * r)) - previous * (1.0 / (2.0 * r));
        }
        x = x * (next / sigma) - d_used * std::expm1(-h);
        previous = d;
        break;
      }
    }
  }
  const double last = levels.back().sigma;
  return last > 0 ? x / std::sqrt(last * last + 1) : x;
}

}  // namespace shoestring
