// The frozen parts of Stable Cascade around stage C, shared by training
// (train/cascade_model.cpp) and `shoestring sample` (train/cascade_sampling.h):
//  - text: OpenCLIP bigG's last-layer states with the tokenizer's attention
//    mask and its projected pooled vector (Stability's StableCascade
//    train/train_c.py get_conditions; models/clip_text.h);
//  - the EfficientNet latent encoder and the previewer (models/cascade_coders.h);
//  - one image's latent drawn by GDF's DDPM sampler with classifier-free
//    guidance (train/gdf.h), decoded for previews by the previewer.
// Released files, or (tiny test variants without files) random parts from
// the run's seed, so that a tiny run's samples can be drawn again later.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "shoestring/io/weight_files.h"
#include "shoestring/models/cascade.h"
#include "shoestring/models/cascade_coders.h"
#include "shoestring/models/clip_text.h"
#include "shoestring/train/ldm_components.h"

namespace shoestring {

/// kohya's stage C sampling shift (stable_cascade_utils sample_image_inference) and ComfyUI's default.
inline constexpr double kCascadeSampleShift = 2.0;
/// GDF.sample's default cfg_rho.
inline constexpr double kCascadeGuidanceRho = 0.7;

/// The largest image side (pixels at the EfficientNet's scale) stage C takes:
/// 128 x 128 latents, 16 K tokens in its attention (Stability trains at 24 x 24).
inline constexpr int64_t kCascadeMaxSide = 4096;

/// The pixel multiple an image side must be for stage C with `o` (32 for
/// the EfficientNet, times patch_size and 2 per level switch).
int64_t cascade_pixel_multiple(const models::StageCOptions& o);

/// Refuses an image size (pixels at the EfficientNet's scale) that stage C
/// with `o` cannot take: not a multiple of cascade_pixel_multiple, or past kCascadeMaxSide. Throws shoestring::Error starting with `what` and
/// naming `architecture`.
void check_cascade_size(const models::StageCOptions& o, int64_t height, int64_t width, const std::string& what,
                        const std::string& architecture);

/// Cached bigG conditioning of N texts.
struct CascadeText {
  at::Tensor text;    ///< [N, 77, 1280]: bigG's last-layer states (no final LayerNorm)
  at::Tensor pooled;  ///< [N, 1, 1280]: the projected pooled vector
  /// Rows `rows` (int64 [B]) of both.
  CascadeText select(const at::Tensor& rows) const;
  /// Bytes held.
  int64_t bytes() const;
};

/// OpenCLIP bigG's text tower from `files` (an SDXL single file's
/// conditioner.embedders.1.model., or bare open_clip keys), or, when `files`
/// is null, random at the tiny test width `tiny_width` from seed + 101 (tiny
/// runs only). Float32, CPU. Throws shoestring::Error naming `name` (the
/// config key or option) when the file holds no OpenCLIP text tower or it
/// does not fit bigG.
models::ClipTextModel build_cascade_text_encoder(const WeightFiles* files, const std::string& name, bool tiny,
                                                 int64_t tiny_width, uint64_t seed);

/// The conditioning of `texts` (encoded 16 at a time, no-grad, on `te`'s
/// device) in `dtype`, host memory. The attention mask is CLIP's (1 through
/// EOS) or, for a tiny run's word tokenizer, 1 for <bos> and the words.
/// Throws shoestring::Error when the tokenizer has more ids than te's vocabulary.
CascadeText encode_cascade_text(models::ClipTextModel& te, const LdmTokenizer& tokenizer,
                                const std::vector<std::string>& texts, at::ScalarType dtype);

/// The previewer (`tiny`: hidden width 32) or the EfficientNet encoder
/// (`tiny`: the micro test width) from `files` in the released layout, or
/// random from seed + 102 / seed + 100 when `files` is null; eval mode,
/// float32, CPU. Throws shoestring::Error naming `name` when the file does
/// not hold it (e.g. the other coder, or the other width).
models::Previewer build_cascade_previewer(const WeightFiles* files, const std::string& name, bool tiny, uint64_t seed);
models::EfficientNetEncoder build_cascade_effnet(const WeightFiles* files, const std::string& name, bool tiny,
                                                 uint64_t seed);

/// One latent [1, 16, height / 32, width / 32] (float32, CPU; sides in
/// pixels) drawn with `stage_c` (eval, no-grad; its dtype and device) by
/// gdf_sample over `steps` with shift kCascadeSampleShift, guided by `cfg`
/// (rho kCascadeGuidanceRho; cfg 1 runs the conditional pass alone), the
/// image embedding zeros. Row 0 of `cond` conditions, row 0 of `uncond`
/// guides away. Noise and the sampler's noise come from libtorch's global
/// CPU generator seeded by `seed`, restored after (a training run's stream is
/// untouched), the same on every device.
at::Tensor sample_stage_c_latent(models::StageCImpl& stage_c, const CascadeText& cond, const CascadeText& uncond,
                                 uint64_t seed, int64_t height, int64_t width, int64_t steps, double cfg);

/// Images in [-1, 1] (float32 [B, 3, 8 h, 8 w], CPU) of stage C latents
/// [B, 16, h, w] through `previewer` (its device; its RGB is about [0, 1],
/// clamped).
at::Tensor preview_images(models::PreviewerImpl& previewer, const at::Tensor& latents);

}  // namespace shoestring
