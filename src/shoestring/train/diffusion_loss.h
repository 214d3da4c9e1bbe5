// The training loss and the loss options users carry over from kohya
// sd-scripts: the loss type (l2 / l1 / huber / smooth_l1 with its threshold
// schedule), per-sample weights by signal-to-noise ratio (min-SNR-gamma,
// debiased estimation), and the noise options (offset noise, multi-resolution
// "pyramid" noise). Formulas follow kohya's library/custom_train_functions.py
// and library/train_util.py (conditional_loss, get_huber_threshold_if_needed,
// apply_snr_weight, apply_debiased_estimation, apply_noise_offset,
// pyramid_noise_like); the papers are cited per function.
//
// Order in a step, as kohya's train_network.py: noise = randn, then offset
// noise, then pyramid noise (either or both); the per-element loss of the
// chosen type is averaged per sample, multiplied by the sample's weights
// (min-SNR, then debiased), and averaged over the batch. Random draws come
// from libtorch's global CPU generator, after the plain noise, and only for
// the options that are on (a run without them draws what it always drew).
#pragma once
#include <cstdint>
#include <string>

#include <ATen/ATen.h>

namespace shoestring {

/// Per-sample signal-to-noise ratio of the DDPM forward process,
/// SNR_t = alpha_bar_t / (1 - alpha_bar_t) (Kingma et al. 2021,
/// arXiv 2107.00630; kohya's all_snr). `alphas_cumprod`: float64 [T];
/// `t`: int64 [B] in [0, T). Returns float64 [B]. Throws shoestring::Error
/// for a timestep out of range.
at::Tensor snr_of_timesteps(const at::Tensor& alphas_cumprod, const at::Tensor& t);

/// Min-SNR-gamma loss weight (Hang et al., "Efficient Diffusion Training via
/// Min-SNR Weighting Strategy", arXiv 2303.09556; kohya's apply_snr_weight):
/// min(SNR, gamma) / SNR for epsilon prediction, min(SNR, gamma) / (SNR + 1)
/// for v-prediction. `snr`: float64 [B] (> 0); gamma > 0. Returns float32 [B].
at::Tensor min_snr_weight(const at::Tensor& snr, double gamma, bool v_prediction);

/// Debiased-estimation loss weight (Yu et al., "Debias the Training of
/// Diffusion Models", arXiv 2310.08442; kohya's apply_debiased_estimation):
/// 1 / sqrt(min(SNR, 1000)) for epsilon prediction, 1 / (min(SNR, 1000) + 1)
/// for v-prediction (the clamp keeps t = 0's large SNR finite, as kohya's).
/// `snr`: float64 [B]. Returns float32 [B].
at::Tensor debiased_weight(const at::Tensor& snr, bool v_prediction);

/// kohya's Huber threshold per sample (get_huber_threshold_if_needed), for
/// loss_type huber / smooth_l1:
///   "constant":    huber_c * huber_scale
///   "exponential": exp(-alpha t) * huber_scale, alpha = -ln(huber_c) / T
///   "snr":         (1 - huber_c) / (1 + sigma_t)^2 + huber_c,
///                  sigma_t = sqrt((1 - alpha_bar_t) / alpha_bar_t)
///                  (kohya applies no huber_scale here)
/// `t`: int64 [B]; `alphas_cumprod`: float64 [T] (T = its length; only read by
/// "exponential" and "snr", may be undefined for "constant"). Returns float32
/// [B]. Throws shoestring::Error for another schedule, huber_c outside (0, 1]
/// with "exponential" / "snr", or a missing schedule where one is needed.
at::Tensor huber_threshold(const std::string& schedule, double huber_c, double huber_scale, const at::Tensor& t,
                           const at::Tensor& alphas_cumprod);

/// The training loss of a batch, a float32 scalar with autograd:
///   mean_b( weight_b * mean_over_elements( loss_type(prediction_b - target_b) ) )
/// with the element losses of kohya's conditional_loss, d = prediction - target:
///   l2: d^2; l1: |d|; huber: 2 c (sqrt(d^2 + c^2) - c); smooth_l1:
///   2 (sqrt(d^2 + c^2) - c), c = `huber_c` [B] of the sample.
/// `prediction`: any floating dtype [B, ...] (computed in float32); `target`:
/// float32 of the same shape; `weight`: float32 [B] or undefined (all 1);
/// `huber_c`: float32 [B], required for huber / smooth_l1. With l2 and no
/// weight this is exactly torch's mse_loss (the same bits as before the
/// options existed). Throws shoestring::Error for another loss_type, shapes
/// that do not match, or a missing huber_c.
at::Tensor diffusion_loss(const at::Tensor& prediction, const at::Tensor& target, const std::string& loss_type,
                          const at::Tensor& weight, const at::Tensor& huber_c);

/// Offset noise (Guttenberg, "Diffusion with Offset Noise", crosslabs.org
/// 2023; kohya's apply_noise_offset): noise + offset_b,c * n_b,c with n a
/// standard normal draw of shape [B, C, 1, 1], offset = noise_offset, or with
/// adaptive_noise_scale != 0, max(0, noise_offset + adaptive_noise_scale *
/// |mean_hw(latents)|) per sample and channel. `noise`, `latents`: float32
/// [B, C, H, W]. Draws B*C normals from the global CPU generator. Returns a
/// new tensor.
at::Tensor apply_noise_offset(const at::Tensor& noise, const at::Tensor& latents, double noise_offset,
                              double adaptive_noise_scale);

/// Multi-resolution ("pyramid") noise (Whitaker, "Multi-Resolution Noise for
/// Diffusion Model Training", wandb report 2023; kohya's pyramid_noise_like):
/// for i = 0 .. iterations-1, r = 2 + 2u (u uniform in [0, 1)), a normal draw
/// of size [B, C, max(1, floor(H / r^i)), max(1, floor(W / r^i))] upsampled
/// bilinearly (half-pixel centres, as torch.nn.Upsample) to H x W is added,
/// scaled by discount^i; the loop stops after a level of height or width 1;
/// the sum is divided by its standard deviation (unbiased, over every
/// element). `noise`: float32 [B, C, H, W]; iterations >= 1. Returns a new
/// tensor. Throws shoestring::Error for iterations < 1.
at::Tensor pyramid_noise(const at::Tensor& noise, int64_t iterations, double discount);

}  // namespace shoestring
