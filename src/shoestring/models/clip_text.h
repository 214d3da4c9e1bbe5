// The CLIP text transformer (Radford et al. 2021, "Learning Transferable
// Visual Models From Natural Language Supervision") as used by Stable
// Diffusion to turn token ids into text conditioning, in the two key layouts
// the released single-file checkpoints store it in, so that named_parameters()
// and named_buffers() are the checkpoint keys below the encoder's prefix:
//
// Hugging Face CLIPTextModel layout (ClipTextLayout::kHuggingFace; SD 1.x's
// `cond_stage_model.transformer.`, SDXL's `conditioner.embedders.0.transformer.`;
// transformers' modeling_clip.py names):
//   text_model.embeddings.token_embedding.weight      [vocab, width]
//   text_model.embeddings.position_embedding.weight   [positions, width]
//   text_model.embeddings.position_ids                int64 buffer [1, positions] (see below)
//   text_model.encoder.layers.<i>.layer_norm1.{weight,bias}
//   text_model.encoder.layers.<i>.self_attn.{q_proj,k_proj,v_proj,out_proj}.{weight,bias}
//   text_model.encoder.layers.<i>.layer_norm2.{weight,bias}
//   text_model.encoder.layers.<i>.mlp.{fc1,fc2}.{weight,bias}
//   text_model.final_layer_norm.{weight,bias}
// and, for CLIPTextModelWithProjection (projection_dim > 0; SD3 / SD3.5's
// text_encoders/clip_g.safetensors and clip_l.safetensors, SD3.5 single files'
// `text_encoders.clip_g.transformer.` / `text_encoders.clip_l.transformer.`):
//   text_projection.weight                            [projection_dim, width]  (nn.Linear without
//                                                     bias: applied as x @ weight^T)
//
// OpenCLIP layout (ClipTextLayout::kOpenClip; SDXL's `conditioner.embedders.1.model.`,
// the ViT-bigG-14 text tower; open_clip's model.py / transformer.py names):
//   token_embedding.weight                            [vocab, width]
//   positional_embedding                              [positions, width]
//   transformer.resblocks.<i>.ln_1.{weight,bias}
//   transformer.resblocks.<i>.attn.in_proj_weight     [3 * width, width]  (q | k | v rows)
//   transformer.resblocks.<i>.attn.in_proj_bias       [3 * width]
//   transformer.resblocks.<i>.attn.out_proj.{weight,bias}
//   transformer.resblocks.<i>.ln_2.{weight,bias}
//   transformer.resblocks.<i>.mlp.{c_fc,c_proj}.{weight,bias}
//   ln_final.{weight,bias}
//   text_projection                                   [width, projection_dim], applied as x @ text_projection
//   logit_scale                                       fp32 buffer [] (scalar; unused by the text tower)
//
// Buffers that the files carry but the forward pass does not read:
// - `text_model.embeddings.position_ids` (int64 0..positions-1) is in SD 1.5's
//   v1-5-pruned and SDXL base's single files but not in files written by
//   transformers >= 4.31; some merged SD 1.x checkpoints hold it as corrupted
//   floats. The forward always uses positions 0..L-1, as ComfyUI does.
// - `logit_scale` (CLIP's contrastive temperature) is stored in SDXL files
//   (sgm keeps the whole open_clip model minus the visual tower) and is kept
//   so that a saved encoder has the released key set.
// load_clip_text_weights() tolerates files that lack either buffer.
//
// Layers are nn/layers.h layers, so the model builds on the meta device.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include "shoestring/io/weight_files.h"
#include "shoestring/nn/layers.h"

namespace shoestring::models {

/// Which checkpoint key layout the encoder registers its tensors under (see the file comment).
enum class ClipTextLayout { kHuggingFace, kOpenClip };

/// The MLP nonlinearity: OpenAI CLIP's quick_gelu x * sigmoid(1.702 x)
/// (CLIP-L), or the exact erf GELU (Hendrycks & Gimpel 2016; OpenCLIP bigG).
enum class ClipActivation { kQuickGelu, kGelu };

/// Key prefixes of the text encoders inside the released single-file checkpoints.
inline constexpr const char* kSd15ClipPrefix = "cond_stage_model.transformer.";
inline constexpr const char* kSdxlClipLPrefix = "conditioner.embedders.0.transformer.";
inline constexpr const char* kSdxlClipGPrefix = "conditioner.embedders.1.model.";
/// SD3 / SD3.5 single files that include their text encoders (HF layout with projection).
inline constexpr const char* kSd3ClipLPrefix = "text_encoders.clip_l.transformer.";
inline constexpr const char* kSd3ClipGPrefix = "text_encoders.clip_g.transformer.";

/// Hyper-parameters of ClipTextModel.
struct ClipTextOptions {
  TORCH_ARG(ClipTextLayout, layout) = ClipTextLayout::kHuggingFace;
  /// Token embedding rows (49408 for CLIP's BPE vocabulary).
  TORCH_ARG(int64_t, vocab_size) = 49408;
  /// Position embedding rows = the sequence length ids must have (77).
  TORCH_ARG(int64_t, max_positions) = 77;
  TORCH_ARG(int64_t, width) = 768;
  TORCH_ARG(int64_t, layers) = 12;
  /// Attention heads; must divide width.
  TORCH_ARG(int64_t, heads) = 12;
  /// Hidden width of the MLP.
  TORCH_ARG(int64_t, mlp_width) = 3072;
  TORCH_ARG(ClipActivation, activation) = ClipActivation::kQuickGelu;
  /// Output width of the text projection: OpenCLIP `text_projection`
  /// [width, projection_dim], HF `text_projection.weight` [projection_dim,
  /// width]; 0 = no projection (pooled output is then the final-normed EOS state).
  TORCH_ARG(int64_t, projection_dim) = 0;
  /// Register the OpenCLIP `logit_scale` buffer (SDXL files store it; OpenCLIP layout only).
  TORCH_ARG(bool, logit_scale) = false;
  TORCH_ARG(double, layer_norm_eps) = 1e-5;
  /// Device/dtype of the parameters; LayerInit{torch::kMeta} allocates nothing.
  TORCH_ARG(nn::LayerInit, init) = nn::LayerInit{};

 public:
  /// OpenAI CLIP ViT-L/14 text encoder (SD 1.x, SDXL embedder 0): HF layout,
  /// width 768, 12 layers, 12 heads, MLP 3072, quick_gelu, 77 positions,
  /// vocab 49408 (openai/clip-vit-large-patch14 config.json text_config).
  static ClipTextOptions clip_l();
  /// OpenCLIP ViT-bigG-14 text tower (SDXL embedder 1, laion2b_s39b_b160k):
  /// OpenCLIP layout, width 1280, 32 layers, 20 heads, MLP 5120, exact GELU,
  /// text_projection 1280x1280, logit_scale (open_clip model_configs/ViT-bigG-14.json).
  static ClipTextOptions clip_g();
  /// The same bigG text tower in Hugging Face CLIPTextModelWithProjection
  /// layout (SD3 / SD3.5 clip_g; diffusers SDXL text_encoder_2): clip_g()'s
  /// numbers with HF names, `text_projection.weight` 1280x1280, no logit_scale
  /// (laion/CLIP-ViT-bigG-14-laion2B-39B-b160k text_config, hidden_act "gelu").
  static ClipTextOptions clip_g_hf();
  /// The same layout, activation, vocabulary and positions (so real token ids
  /// work) at test size: `width` (default 32), 2 layers, 4 heads, MLP 4 * width,
  /// projection width x width when the preset has one.
  ClipTextOptions tiny(int64_t width = 32) const;
};

/// What ClipTextModel::forward returns. Shapes: B = batch, L = sequence
/// length, W = width, P = projection_dim (W when there is no projection).
/// All in the compute dtype (fp32 unless run in a lower-precision block).
struct ClipTextOutput {
  /// [B, L, W]: the last layer's output after the final LayerNorm (HF
  /// last_hidden_state; SD 1.5's context with clip_skip 1).
  torch::Tensor last_hidden;
  /// [B, L, W]: HF hidden_states[-skip] WITHOUT the final LayerNorm, i.e. the
  /// output of layer (layers - skip + 1) counted from 1 (skip 1: the last
  /// layer's output; skip 2: the penultimate layer's output = the last layer's
  /// input). SDXL uses skip 2 for both encoders unnormalised: sgm's
  /// sd_xl_base.yaml FrozenCLIPEmbedder(layer="hidden", layer_idx=11) and
  /// FrozenOpenCLIPEmbedder2(layer="penultimate", legacy=False), whose
  /// text_transformer_forward records x before the last resblock.
  torch::Tensor hidden;
  /// [B, L, W]: final_layer_norm(hidden): kohya sd-scripts' / A1111's
  /// clip_skip for SD 1.x (train_util get_hidden_states: hidden_states[-clip_skip]
  /// passed through text_model.final_layer_norm). Equals last_hidden for skip 1.
  torch::Tensor hidden_normed;
  /// [B, P]: the final-normed state at each row's EOS position (argmax of the
  /// ids, as HF CLIPTextTransformer and OpenCLIP encode_text pool; EOS 49407 is
  /// the largest id), times text_projection when the model has one (SDXL's
  /// 1280-wide pooled text vector: sgm FrozenOpenCLIPEmbedder2.pool). kohya's
  /// pool_workaround takes the first <|endoftext|> instead: the same position
  /// whenever no id exceeds EOS, as with CLIP's vocabulary.
  torch::Tensor pooled;
  /// [B, W]: the same EOS state before the projection (equals pooled without
  /// one). SD3 conditions on CLIP-L's unprojected pooled vector (Stability's
  /// sd3 reference SDClipModel(return_projected_pooled=False) for clip_l).
  torch::Tensor pooled_unprojected;
};

/// One pre-LayerNorm transformer block: x + attn(ln1(x), causal), then x + mlp(ln2(x)).
class ClipTextLayerImpl : public torch::nn::Module {
 public:
  ClipTextLayerImpl(const ClipTextOptions& o);
  /// x: [B, L, W] -> [B, L, W]; causal self-attention (position i sees 0..i),
  /// and, when `padding` (bool [B, L], true = a padding key) is given, no
  /// query sees a padding key.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& padding = {});
  nn::LayerNorm norm1{nullptr}, norm2{nullptr};
  /// HF layout: separate projections (q_proj/k_proj/v_proj); OpenCLIP: packed in_proj.
  nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, out_proj{nullptr};
  torch::Tensor in_proj_weight, in_proj_bias;
  nn::Linear fc1{nullptr}, fc2{nullptr};

 private:
  ClipTextOptions options_;
};
TORCH_MODULE(ClipTextLayer);

/// CLIP text transformer: token + position embeddings, `layers` causal
/// pre-LN blocks, final LayerNorm, EOS pooling and optional projection.
/// Throws shoestring::Error on bad options (non-positive sizes, heads not
/// dividing width, logit_scale in the HF layout).
class ClipTextModelImpl : public torch::nn::Module {
 public:
  explicit ClipTextModelImpl(const ClipTextOptions& options);
  /// ids: int64 [B, L] with 1 <= L <= max_positions (CLIP tokenizers pad to
  /// 77), every id in [0, vocab_size). skip: which hidden state `hidden`
  /// holds (1 <= skip <= layers; see ClipTextOutput). attention_mask: none
  /// (CLIP as SD 1.x / SDXL run it: padding tokens are attended to like any
  /// other), or [B, L] of any dtype with 1 for tokens and 0 for padding
  /// (Hugging Face's convention; Stable Cascade passes the tokenizer's mask,
  /// StableCascade train/base.py get_conditions; see clip_attention_mask()),
  /// which removes padding positions from every query's keys (changing only
  /// the states after EOS). Throws shoestring::Error on a bad ids shape or
  /// dtype, out-of-range ids, a bad skip, or a mask of another shape, with
  /// values other than 0 and 1, or masking a row's first position.
  ClipTextOutput forward(const torch::Tensor& ids, int64_t skip = 2, const torch::Tensor& attention_mask = {});
  /// final_layer_norm / ln_final: [.., W] -> [.., W].
  torch::Tensor final_norm(const torch::Tensor& x);
  /// The projection as a [W, P] matrix (pooled = eos_state @ projection_matrix()):
  /// text_projection itself (OpenCLIP) or a transposed view of it (HF); undefined
  /// without a projection.
  torch::Tensor projection_matrix() const;
  const ClipTextOptions& options() const { return options_; }

  nn::Embedding token_embedding{nullptr};
  /// HF layout: position_embedding.weight; OpenCLIP: positional_embedding. [positions, W].
  torch::Tensor position_table;
  torch::nn::ModuleList layers{nullptr};
  nn::LayerNorm final_layer_norm{nullptr};
  /// The registered projection parameter as the file stores it: OpenCLIP
  /// `text_projection` [W, P], HF `text_projection.weight` [P, W]; undefined
  /// when projection_dim is 0. See projection_matrix().
  torch::Tensor text_projection;

 private:
  ClipTextOptions options_;
};
TORCH_MODULE(ClipTextModel);

/// The attention mask a Hugging Face CLIP tokenizer returns with
/// padding="max_length" for `ids` (int64 [B, L], each row BOS, tokens, EOS,
/// then padding): int64 [B, L], 1 through each row's first EOS (`eos_id`,
/// 49407 for CLIP's vocabulary) and 0 after it; rows without EOS (truncated
/// without one) are all 1. Throws shoestring::Error on a bad shape or dtype.
torch::Tensor clip_attention_mask(const torch::Tensor& ids, int64_t eos_id = 49407);

/// What detect_clip_text_layout() reads from a file's keys under a prefix.
/// Sizes come from tensor shapes (for choosing a preset, e.g. width 768 for
/// CLIP-L, 1280 for bigG); heads and the activation are not stored in a file.
struct ClipTextFileLayout {
  ClipTextLayout layout = ClipTextLayout::kHuggingFace;
  /// P of `text_projection.weight` [P, W] (HF) / `text_projection` [W, P] (OpenCLIP); 0 = none.
  int64_t projection_dim = 0;
  /// The OpenCLIP `logit_scale` buffer is present.
  bool logit_scale = false;
  int64_t vocab_size = 0, max_positions = 0, width = 0, layers = 0, mlp_width = 0;

  /// `base` (a preset such as clip_l() or clip_g(), or its tiny()) with this
  /// layout, projection_dim and logit_scale, so that the model it builds has
  /// the file's key set; the sizes stay the preset's, and
  /// load_clip_text_weights() rejects a file whose shapes differ from them.
  ClipTextOptions options(ClipTextOptions base) const;
};

/// Reads the layout of the CLIP text encoder stored under `prefix` in `files`:
/// HF (`text_model.embeddings.token_embedding.weight`) or OpenCLIP
/// (`token_embedding.weight` with `transformer.resblocks.0.attn.in_proj_weight`),
/// with or without a projection (HF `text_projection.weight`, OpenCLIP
/// `text_projection`), and the sizes. Throws shoestring::Error naming the file,
/// the prefix and the key when no tensor lies under the prefix, neither or
/// both layouts' keys are there, a key the layout needs is absent, or a tensor
/// has a shape the layout does not allow (e.g. a projection whose input is not
/// the width, or the other layout's projection key).
ClipTextFileLayout detect_clip_text_layout(const WeightFiles& files, const std::string& prefix);

/// Keys (below the prefix) that a file may lack without harm: the buffers
/// `text_model.embeddings.position_ids` and `logit_scale` (see the file comment).
bool is_optional_clip_text_key(const std::string& key);

/// Loads the encoder stored under `prefix` in `files` (e.g. kSdxlClipGPrefix
/// of an SDXL single file, or "" for a file holding only the encoder) into
/// `model`, converting dtypes; tensors outside the prefix are ignored, and a
/// missing optional buffer (is_optional_clip_text_key) keeps its default.
/// Throws shoestring::Error naming the file and the keys when any other
/// tensor is missing, a tensor under the prefix is unknown, or a shape
/// differs (e.g. a CLIP-L file loaded into a bigG model), or when `model`
/// was built on the meta device; when the file's layout or projection differs
/// from the model's, the message says so (see detect_clip_text_layout()).
LoadWeightsReport load_clip_text_weights(ClipTextModelImpl& model, const WeightFiles& files, const std::string& prefix);

}  // namespace shoestring::models
