// The frozen parts of the released LDM checkpoints (SD 1.5, SDXL, SSD-1B)
// beside their UNet: the CLIP text encoders with their tokenizer, SDXL's
// vector conditioning y, and the VAE, built from a single-file checkpoint
// (ComfyUI / A1111 key layout) or, for tiny test variants without one,
// randomly initialised from a seed. Used by `shoestring sample`
// (train/ldm_sampling.h).
//
// Conditioning as Stability's configs define it: SD 1.x (v1-inference.yaml)
// conditions on CLIP ViT-L/14's last hidden state after the final layer norm
// (kohya's clip_skip picks an earlier layer); SDXL (sd_xl_base.yaml) on the
// penultimate hidden states of CLIP ViT-L and OpenCLIP bigG concatenated
// (768 + 1280 = 2048) and on y = [bigG's pooled output, sinusoidal
// embeddings of original size (h, w), crop (top, left), target size (h, w)].
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/torch.h>

#include "shoestring/data/clip_tokenizer.h"
#include "shoestring/data/tokenizer.h"
#include "shoestring/io/weight_files.h"
#include "shoestring/models/clip_text.h"
#include "shoestring/models/unet_ldm.h"
#include "shoestring/models/vae.h"
#include "shoestring/train/checkpoint_io.h"

namespace shoestring {

struct TrainConfig;
class ImageCaptionDataset;

/// Runs `build` with libtorch's global CPU generator seeded by `seed`,
/// restoring it after, also when `build` throws: random frozen parts (tiny
/// variants' encoders) and sample noise are reproducible and leave the
/// caller's random stream where it was.
template <class F>
auto with_seed(uint64_t seed, F&& build) {
  struct Restore {
    at::Tensor saved = cpu_rng_state();
    ~Restore() { set_cpu_rng_state(saved); }
  } restore;
  torch::manual_seed(static_cast<int64_t>(seed));
  return build();
}

/// Token ids of the text encoders: CLIP's BPE, or (tiny variants trained
/// without tokenizer_dir) the word tokenizer built from the captions.
struct LdmTokenizer {
  std::optional<ClipTokenizer> clip;
  std::optional<WordTokenizer> words;
  /// int64 [B, 77]. Throws shoestring::Error when neither is set.
  at::Tensor encode(const std::vector<std::string>& captions, ClipPadding pad) const;
};

/// The tokenizer of a run's CLIP text encoders: CLIP's BPE from
/// `tokenizer_dir` when set; else, for `tiny` runs, a word tokenizer (77
/// ids) built from `captions` and the sample prompts and their negatives.
/// Throws shoestring::Error for a non-tiny run without tokenizer_dir (`model`
/// names what conditions on CLIP, e.g. "sd15" or "Stable Cascade's bigG") and
/// what ClipTokenizer::load throws.
LdmTokenizer build_text_tokenizer(const std::string& tokenizer_dir, bool tiny, const std::vector<std::string>& captions,
                                  const std::vector<std::string>& sample_prompts, const std::string& model);

/// The tokenizer to sample a checkpoint with: CLIP's BPE from
/// `tokenizer_dir` (a command-line option), else from the run's
/// tokenizer_dir (`run`: the config of the run the file belongs to, or
/// null), else a tiny run's word tokenizer from the file's "tokenizer"
/// metadata. Throws shoestring::Error naming the file when there is none
/// (CLIP's files are not stored in checkpoints: pass --tokenizer-dir;
/// `model` names what conditions on CLIP), or as ClipTokenizer::load.
LdmTokenizer sampling_tokenizer(const WeightFiles& file, const std::string& tokenizer_dir, const TrainConfig* run,
                                const std::string& model);

/// Caption rows of the cached text embeddings: each distinct caption once, in
/// dataset order, then "" (caption dropout's row, the last).
struct CaptionRows {
  std::vector<std::string> texts;  ///< the distinct captions, then ""
  std::vector<int64_t> rows;       ///< per image: its caption's index in texts
};
CaptionRows caption_rows(const std::vector<std::string>& captions);

/// The sample prompts and their negatives (kohya's --n; "" by default), each
/// text once, in order; `row_of` is cleared and receives each text's index.
/// Throws shoestring::Error as parse_sample_prompt.
std::vector<std::string> sample_prompt_texts(const std::vector<std::string>& sample_prompts,
                                             std::map<std::string, int64_t>& row_of);

/// Every dataset image's latents, encoded once before training and kept in
/// host memory, grouped by bucket (one group without buckets), with the
/// mirror images' latents when a subset flips (flip_aug).
struct BucketLatents {
  std::vector<at::Tensor> latents;  ///< per bucket: [n_b, C, h, w] in the cache dtype
  std::vector<at::Tensor> flipped;  ///< per bucket, the mirror images' (empty without flip_aug)
  std::vector<int64_t> row;         ///< per image: its row in its bucket's tensors

  /// float32 x0 [B, C, h, w] of `idx` and their mirror latents (undefined
  /// without flip_aug). Throws shoestring::Error (internal) when the batch
  /// mixes buckets, which the batch sampler never does.
  std::pair<at::Tensor, at::Tensor> batch(const ImageCaptionDataset& dataset, const std::vector<int64_t>& idx) const;
  /// Host bytes of latents and mirror latents.
  int64_t bytes() const;
  /// For the run log: "12 x [4, 64, 64], 3 x [4, 48, 80]" (+ " (and their mirror images, flip_aug)").
  std::string describe() const;
};

/// The images of `dataset` in the groups their latents are encoded in:
/// each bucket's images in order, or (no buckets) all of them.
std::vector<std::vector<int64_t>> latent_groups(const ImageCaptionDataset& dataset);

/// How many images of `group` (one of latent_groups) are encoded at once:
/// about 256 K pixels x 4 at the group's size (bucket, else resolution^2), at least one.
int64_t latent_chunk_size(const ImageCaptionDataset& dataset, const std::vector<int64_t>& group);

/// Encodes every image of `dataset` with `encode` (pixels [n, 3, H, W] in
/// [-1, 1] on `device` -> latents [n, C, h, w]), bucket by bucket in chunks
/// of about 256 K pixels x 4 (at least one image), into `cache_dtype` host
/// tensors; with `flip` also each image's mirror image.
BucketLatents encode_bucket_latents(const ImageCaptionDataset& dataset, bool flip, at::Device device,
                                    at::ScalarType cache_dtype,
                                    const std::function<at::Tensor(const at::Tensor&)>& encode);

/// What a latent family draws for one micro-batch, before its objective's
/// own draws (timesteps): the latents with flip_aug's mirror images swapped
/// in, the caption rows with caption dropout applied, and the noise.
struct LatentBatchDraws {
  at::Tensor x0;                      ///< float32 [B, C, h, w]
  at::Tensor caption_rows;            ///< int64 [B]: rows of the cached text embeddings
  at::Tensor noise;                   ///< float32 [B, C, h, w]
  std::vector<bool> flipped;          ///< per sample: the mirror image's latents were used
};

/// The shared draws of the latent families (LDM UNets, Stable Cascade, SD3),
/// from libtorch's global CPU generator in this order, so a resumed run
/// replays them: flip_aug (torch::rand [B], only when `mirror` is defined: a
/// sample of a flipping subset takes its mirror latents when its draw is
/// < 1/2, kohya's flipped latents), caption dropout (torch::rand [B]: a
/// sample takes `empty_row`, the empty caption's cached row, when its draw is
/// below its subset's caption_dropout_rate, or the config's without
/// buckets), then the noise (randn_like(x0), then kohya's noise_offset /
/// adaptive_noise_scale and multires noise, in kohya's order). x0, mirror:
/// float32 [B, C, h, w]; rows: int64 [B] (the images' caption rows).
LatentBatchDraws draw_latent_batch(const ImageCaptionDataset& dataset, const TrainConfig& config,
                                   const std::vector<int64_t>& idx, at::Tensor x0, const at::Tensor& mirror,
                                   const at::Tensor& rows, int64_t empty_row);

/// The text encoders a UNet with `unet`'s options conditions on (one for SD
/// 1.x, two for SDXL / SSD-1B; `tiny`: the test-sized ones), loaded from
/// `files` under their single-file prefixes (models/clip_text.h), or randomly
/// initialised from `seed` + 101 + i when `files` is null (tiny only), in
/// eval mode, float32, on the CPU. Throws shoestring::Error when the file
/// holds no text encoder (naming the file and the prefix), when clip_skip
/// exceeds the encoder's layers, or when the tokenizer's vocabulary is larger
/// than the encoder's; warns that clip_skip is ignored for SDXL.
std::vector<models::ClipTextModel> build_ldm_text_encoders(const models::LdmUNetOptions& unet, bool tiny,
                                                           const WeightFiles* files, uint64_t seed, int64_t clip_skip,
                                                           const LdmTokenizer& tokenizer,
                                                           const std::string& architecture);

/// Context [N, 77, D] (in `dtype`, host memory) and, for SDXL, bigG's pooled
/// output [N, P] (float32, host memory; undefined otherwise) of `captions`,
/// computed in no-grad on `device` with the encoders of
/// build_ldm_text_encoders.
std::pair<at::Tensor, at::Tensor> encode_ldm_text(std::vector<models::ClipTextModel>& encoders,
                                                  const LdmTokenizer& tokenizer,
                                                  const std::vector<std::string>& captions, int64_t clip_skip,
                                                  at::Device device, at::ScalarType dtype);

/// SDXL's y [B, adm] in `dtype`: pooled [B, P] beside the sinusoidal
/// embeddings ((adm - P) / 6 channels each) of the 6 size values of each row
/// (original h, w, crop top, left, target h, w; `sizes` holds 6 x B). Throws
/// shoestring::Error when sizes does not hold 6 x B values.
at::Tensor sdxl_vector_y(const at::Tensor& pooled, const std::vector<double>& sizes, int64_t adm_in_channels,
                         at::ScalarType dtype);

/// The VAE (scaling factor 0.13025 for SDXL, 0.18215 otherwise; `tiny`: the
/// test-sized one), loaded from `files` (its keys under first_stage_model.,
/// or bare keys when `bare_keys_allowed`, a separate VAE file), or randomly
/// initialised from `seed` + 100 when `files` is null (tiny only); eval
/// mode, float32, CPU. Throws shoestring::Error when the file holds no VAE.
models::AutoencoderKL build_ldm_vae(bool sdxl, bool tiny, const WeightFiles* files, bool bare_keys_allowed,
                                    uint64_t seed);
/// The VAE of options `o` (already tiny where wanted) from `files` as
/// build_ldm_vae reads them, through models::load_vae (so an SD VAE given
/// for SD3's, or the reverse, is refused by its quant convs), or random from
/// `seed` + 100 when `files` is null; eval mode, float32, CPU. Throws
/// shoestring::Error as build_ldm_vae and load_vae.
models::AutoencoderKL build_vae_from(const models::VaeOptions& o, const WeightFiles* files, bool bare_keys_allowed,
                                     uint64_t seed);

}  // namespace shoestring
