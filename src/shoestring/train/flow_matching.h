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
#pragma once
#include <functional>
#include <string>

#include <ATen/ATen.h>

namespace shoestring {

/// Draws training times, float32 [batch] in (0, 1), from libtorch's default
/// CPU generator (so they are covered by its saved RNG state).
/// mode: "logit_normal" (sigmoid of N(mean, std)) or "uniform".
/// Throws shoestring::Error on an unknown mode.
at::Tensor sample_flow_times(int64_t batch, const std::string& mode, double mean, double std);

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

}  // namespace shoestring
