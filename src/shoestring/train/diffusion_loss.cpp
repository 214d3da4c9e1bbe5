#include "shoestring/train/diffusion_loss.h"

#include <algorithm>
#include <cmath>

#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/core/units.h"

namespace shoestring {

at::Tensor snr_of_timesteps(const at::Tensor& alphas_cumprod, const at::Tensor& t) {
  const int64_t steps = alphas_cumprod.size(0);
  if (t.numel() > 0 && (t.min().item<int64_t>() < 0 || t.max().item<int64_t>() >= steps))
    fail("snr_of_timesteps: timesteps must lie in [0, {}), got [{}, {}]", steps, t.min().item<int64_t>(),
         t.max().item<int64_t>());
  const at::Tensor ab = alphas_cumprod.to(at::kDouble).index_select(0, t.to(at::kLong).reshape({-1}));
  return ab / (1.0 - ab);
}

at::Tensor min_snr_weight(const at::Tensor& snr, double gamma, bool v_prediction) {
  if (!(gamma > 0)) fail("min_snr_gamma must be > 0, got {}", gamma);
  const at::Tensor clipped = at::clamp_max(snr, gamma);
  return (clipped / (v_prediction ? snr + 1.0 : snr)).to(at::kFloat);
}

at::Tensor debiased_weight(const at::Tensor& snr, bool v_prediction) {
  const at::Tensor s = at::clamp_max(snr, 1000.0);
  return (v_prediction ? 1.0 / (s + 1.0) : s.rsqrt()).to(at::kFloat);
}

at::Tensor huber_threshold(const std::string& schedule, double huber_c, double huber_scale, const at::Tensor& t,
                           const at::Tensor& alphas_cumprod) {
  const at::Tensor steps = t.to(at::kDouble).reshape({-1});
  if (schedule == "constant") return at::full({steps.size(0)}, huber_c * huber_scale, at::kFloat);
  if (schedule != "exponential" && schedule != "snr")
    fail("huber_schedule must be snr, exponential or constant, got \"{}\"", schedule);
  if (!(huber_c > 0 && huber_c <= 1))
    fail("huber_c must lie in (0, 1] with huber_schedule = \"{}\", got {}", schedule, huber_c);
  if (!alphas_cumprod.defined())
    fail("huber_schedule = \"{}\" needs the DDPM noise schedule; use huber_schedule = \"constant\"", schedule);
  if (schedule == "exponential") {
    const double alpha = -std::log(huber_c) / static_cast<double>(alphas_cumprod.size(0));
    return (at::exp(-alpha * steps) * huber_scale).to(at::kFloat);
  }
  const at::Tensor ab = alphas_cumprod.to(at::kDouble).index_select(0, t.to(at::kLong).reshape({-1}));
  const at::Tensor sigma = ((1.0 - ab) / ab).sqrt();
  return ((1.0 - huber_c) / (1.0 + sigma).pow(2) + huber_c).to(at::kFloat);
}

at::Tensor diffusion_loss(const at::Tensor& prediction, const at::Tensor& target, const std::string& loss_type,
                          const at::Tensor& weight, const at::Tensor& huber_c) {
  if (prediction.sizes() != target.sizes())
    fail("diffusion_loss: prediction {} and target {} differ in shape", format_shape(prediction.sizes()),
         format_shape(target.sizes()));
  const at::Tensor p = prediction.to(at::kFloat);
  if (loss_type == "l2" && !weight.defined()) return torch::mse_loss(p, target);
  const int64_t batch = p.size(0);
  if (weight.defined() && weight.numel() != batch)
    fail("diffusion_loss: {} sample weights for a batch of {}", weight.numel(), batch);
  const at::Tensor d = p - target;
  at::Tensor element;
  if (loss_type == "l2") {
    element = d.square();
  } else if (loss_type == "l1") {
    element = d.abs();
  } else if (loss_type == "huber" || loss_type == "smooth_l1") {
    if (!huber_c.defined() || huber_c.numel() != batch)
      fail("diffusion_loss: loss_type = \"{}\" needs one huber_c per sample", loss_type);
    std::vector<int64_t> shape(static_cast<size_t>(p.dim()), 1);
    shape[0] = batch;
    const at::Tensor c = huber_c.to(p.device(), at::kFloat).view(shape);
    element = (d.square() + c.square()).sqrt() - c;
    element = loss_type == "huber" ? 2 * c * element : 2 * element;
  } else {
    fail("loss_type must be l2, l1, huber or smooth_l1, got \"{}\"", loss_type);
  }
  const at::Tensor per_sample = element.reshape({batch, -1}).mean(1);
  return (weight.defined() ? per_sample * weight.to(p.device(), at::kFloat) : per_sample).mean();
}

at::Tensor apply_noise_offset(const at::Tensor& noise, const at::Tensor& latents, double noise_offset,
                              double adaptive_noise_scale) {
  const int64_t b = latents.size(0), c = latents.size(1);
  at::Tensor offset = at::full({b, c, 1, 1}, noise_offset, latents.options().dtype(at::kFloat));
  if (adaptive_noise_scale != 0) {
    offset = at::clamp_min(offset + adaptive_noise_scale * latents.mean({2, 3}, /*keepdim=*/true).abs(), 0.0);
  }
  return noise + offset * torch::randn({b, c, 1, 1}, latents.options().dtype(at::kFloat));
}

at::Tensor pyramid_noise(const at::Tensor& noise, int64_t iterations, double discount) {
  if (iterations < 1) fail("multires_noise_iterations must be >= 1, got {}", iterations);
  const int64_t b = noise.size(0), c = noise.size(1), h = noise.size(2), w = noise.size(3);
  at::Tensor out = noise.clone();
  for (int64_t i = 0; i < iterations; ++i) {
    const double r = torch::rand({1}, torch::kDouble).item<double>() * 2 + 2;
    const double shrink = std::pow(r, static_cast<double>(i));
    const int64_t hn = std::max<int64_t>(1, static_cast<int64_t>(static_cast<double>(h) / shrink));
    const int64_t wn = std::max<int64_t>(1, static_cast<int64_t>(static_cast<double>(w) / shrink));
    const at::Tensor level = torch::randn({b, c, hn, wn}, noise.options());
    out += at::upsample_bilinear2d(level, {h, w}, /*align_corners=*/false) * std::pow(discount, static_cast<double>(i));
    if (hn == 1 || wn == 1) break;
  }
  return out / out.std();
}

}  // namespace shoestring
