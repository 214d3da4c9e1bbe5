// The frozen parts of SD3.5 Medium beside its MMDiT, shared by training
// (train/sd3_model.cpp) and `shoestring sample` (train/sd3_sampling.h):
//  - text: CLIP-L's and OpenCLIP bigG's penultimate states (no final
//    LayerNorm; CLIP-L pads with <|endoftext|>, bigG with 0) side by side,
//    zero-padded to the MMDiT's context width, followed by T5-XXL's last
//    states (or 77 zero tokens without T5, as kohya and diffusers allow);
//    the pooled vector is CLIP-L's unprojected EOS state beside bigG's
//    projected one (Stability's sd3.5 sd3_infer.py / other_impls.py);
//  - the SD3 VAE (models/vae.h VaeOptions::sd3);
//  - one image's latent drawn by Euler on SD3's shifted sigmas with
//    classifier-free and skip-layer guidance (train/flow_matching.h).
// Released files, or (tiny test variants without files) random parts from
// the run's seed, so that a tiny run's samples can be drawn again later.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "shoestring/data/t5_tokenizer.h"
#include "shoestring/io/weight_files.h"
#include "shoestring/models/clip_text.h"
#include "shoestring/models/mmdit.h"
#include "shoestring/models/t5_encoder.h"
#include "shoestring/models/vae.h"
#include "shoestring/train/flow_matching.h"
#include "shoestring/train/ldm_components.h"

namespace shoestring {

/// Where SD3 single files keep the MMDiT and the VAE.
inline constexpr const char* kSd3MMDiTPrefix = "model.diffusion_model.";
inline constexpr const char* kSd3VaePrefix = "first_stage_model.";
/// The SD3.5 release's scheduler shift (scheduler_config.json; Stability's sd3_infer.py for sd3.5_medium).
inline constexpr double kSd3SampleShift = 3.0;
/// CLIP's token count; T5's states without a T5 file are this many zero tokens.
inline constexpr int64_t kSd3ClipTokens = 77;

/// Cached text conditioning of N texts, unpadded (sd3_context assembles the
/// MMDiT's context from it).
struct Sd3Text {
  at::Tensor clip;    ///< [N, 77, 768 + 1280]: CLIP-L's and bigG's penultimate states side by side
  at::Tensor t5;      ///< [N, T, 4096]: T5's last states; undefined without T5
  at::Tensor pooled;  ///< [N, 768 + 1280]
  /// Rows `rows` (int64 [B]) of each tensor.
  Sd3Text select(const at::Tensor& rows) const;
  /// Bytes held.
  int64_t bytes() const;
};

/// The text encoders of SD3 and their tokenizers, built for one encoding pass.
struct Sd3TextEncoders {
  models::ClipTextModel clip_l{nullptr}, clip_g{nullptr};
  std::optional<models::T5Encoder> t5;  ///< none: T5's states are zeros
  LdmTokenizer tokenizer;               ///< CLIP's BPE (or a tiny run's word tokenizer)
  std::optional<T5Tokenizer> t5_tokenizer;
  int64_t t5_max_length = 256;  ///< kohya's t5xxl_max_token_length

  /// Moves the encoders to `device` in eval mode.
  void to(at::Device device);
  /// The conditioning of `texts` (encoded 16 at a time, no-grad, on the
  /// encoders' device), in `dtype` in host memory. Throws shoestring::Error
  /// when the widths do not fit `mmdit` (context_dim, adm_in_channels).
  Sd3Text encode(const std::vector<std::string>& texts, at::ScalarType dtype,
                 const models::MMDiTOptions& mmdit);
};

/// What the text encoders are built from: their files (null for a tiny
/// run's random ones), T5's optional.
struct Sd3TextSources {
  const WeightFiles* clip_l = nullptr;
  const WeightFiles* clip_g = nullptr;
  const WeightFiles* t5 = nullptr;  ///< none: no T5 (zeros)
  std::string t5_spiece;            ///< T5's spiece.model (needed with t5)
  bool tiny = false;
  uint64_t seed = 0;  ///< tiny random encoders: CLIP-L from seed + 101, bigG from seed + 102
  /// How errors name each source (config keys; `shoestring sample` passes its options).
  std::string clip_l_name = "clip_l", clip_g_name = "clip_g", t5_name = "t5xxl";
};

/// CLIP-L and bigG from their files (Hugging Face CLIPTextModelWithProjection
/// or OpenCLIP layout, under the SD3 single-file prefix, bare, or bigG under
/// SDXL's conditioner prefix), random test-width ones (width 32) for tiny
/// runs without files, and T5-XXL (bf16; float32 at the tiny test width)
/// with its tokenizer when `sources.t5` is set. Float32 CLIPs on the CPU.
/// `tokenizer` is CLIP's (or a tiny run's word tokenizer). Throws
/// shoestring::Error naming the source (Sd3TextSources' names) when a
/// file holds no such encoder or does not fit, when T5's spiece.model is
/// unreadable or larger than its vocabulary, or when CLIP's tokenizer has more
/// ids than an encoder's vocabulary.
Sd3TextEncoders build_sd3_text_encoders(const Sd3TextSources& sources, LdmTokenizer tokenizer);

/// T5's SentencePiece model, `tokenizer_dir`/spiece.model (beside CLIP's
/// vocab.json and merges.txt). Throws shoestring::Error naming `t5_name` (the
/// T5 file's key or option) and `dir_name` when the folder is not given or
/// holds no spiece.model.
std::string sd3_t5_spiece(const std::string& tokenizer_dir, const std::string& t5_name, const std::string& dir_name);

/// The MMDiT's context [N, 77 + T, width] from Sd3Text's clip [N, 77, Wc] and
/// t5 [N, T, Wt] (or undefined: 77 zero tokens), each zero-padded on the
/// feature axis to `width`. Throws shoestring::Error when a part is wider.
at::Tensor sd3_context(const at::Tensor& clip, const at::Tensor& t5, int64_t width);

/// Refuses an image size (pixels) `mmdit` cannot take: sides must be
/// multiples of the VAE's 8 x the patch size and within the position
/// embedding (pos_embed_max_size patches). Throws shoestring::Error
/// starting with `what` and naming `architecture`.
void check_sd3_size(const models::MMDiTOptions& mmdit, int64_t height, int64_t width, const std::string& what,
                    const std::string& architecture);

/// The SD3 VAE (`tiny`: the test width) from `files` (under first_stage_model.,
/// or bare keys when `bare_keys_allowed`), or random from seed + 100 when
/// `files` is null; eval mode, float32, CPU. Throws as build_vae_from.
models::AutoencoderKL build_sd3_vae(bool tiny, const WeightFiles* files, bool bare_keys_allowed, uint64_t seed);

/// The guidance of SD3.5 Medium's samples: Stability's (FlowGuidance::sd35_medium:
/// skip-layer guidance on joint blocks 7-9) with CFG scale `cfg`; the tiny
/// test MMDiT skips its block 1.
FlowGuidance sd3_sample_guidance(bool tiny, double cfg);

/// One latent [1, C, height / 8, width / 8] (float32, CPU) drawn with
/// `mmdit` (eval, no-grad; its dtype and device) by Euler over
/// sd3_sigmas(steps, kSd3SampleShift) with `guidance`, conditioned on row 0
/// of `cond` and guided away from row 0 of `uncond` (both already in the
/// MMDiT's context layout: sd3_context). The noise is libtorch's global CPU
/// generator seeded by `seed`, restored after (a training run's stream is
/// untouched), the same on every device.
at::Tensor sample_sd3_latent(models::MMDiTImpl& mmdit, const at::Tensor& cond_context, const at::Tensor& cond_pooled,
                             const at::Tensor& uncond_context, const at::Tensor& uncond_pooled, uint64_t seed,
                             int64_t height, int64_t width, int64_t steps, const FlowGuidance& guidance);

}  // namespace shoestring
