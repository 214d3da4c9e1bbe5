// The T5 v1.1 text encoder (Raffel et al. 2020, "Exploring the Limits of
// Transfer Learning with a Unified Text-to-Text Transformer"; v1.1: gated-GELU
// feed-forward, no dropout at inference, untied classifier) as SD3 / SD3.5 use
// its XXL size for the 4096-wide T5 half of their text context. The module
// tree is Hugging Face's T5EncoderModel (transformers modeling_t5.py), so
// named_parameters() are the released file keys:
//   shared.weight                                                   [vocab, d_model]
//   encoder.block.<i>.layer.0.layer_norm.weight                      [d_model]
//   encoder.block.<i>.layer.0.SelfAttention.{q,k,v}.weight           [heads * d_kv, d_model]
//   encoder.block.<i>.layer.0.SelfAttention.o.weight                 [d_model, heads * d_kv]
//   encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight  [num_buckets, heads] (block 0 only)
//   encoder.block.<i>.layer.1.layer_norm.weight                      [d_model]
//   encoder.block.<i>.layer.1.DenseReluDense.{wi_0,wi_1}.weight      [d_ff, d_model]
//   encoder.block.<i>.layer.1.DenseReluDense.wo.weight               [d_model, d_ff]
//   encoder.final_layer_norm.weight                                  [d_model]
// (XXL: 219 tensors, 4,762,310,656 parameters.) HF's state_dict also lists
// `encoder.embed_tokens.weight`, the same tensor as `shared.weight` (tied);
// only `shared.weight` is a parameter here, and the loader accepts either.
//
// Forward, per block (pre-norm, no biases anywhere):
//   x += o(softmax(q k^T + bias) v),  q, k, v from RMSNorm(x)   -- NO 1/sqrt(d_kv) scaling
//   x += wo(gelu_tanh(wi_0 h) * wi_1 h),  h = RMSNorm(x)
// then out = final RMSNorm(x). RMSNorm(x) = weight * x * rsqrt(mean(x^2) + eps)
// (no mean subtraction, no bias), computed in fp32 (nn::RMSNorm). `bias` is
// the relative position bias [1, heads, L, L] looked up once from block 0's
// table (t5_relative_position_bucket) and added in every block, plus, with an
// attention mask, the dtype's lowest value at padding keys (HF's extended
// attention mask: (1 - mask) * finfo(dtype).min).
//
// Dtypes: the encoder computes in the dtype of `shared.weight` (or of the
// current nn::ComputeDtypeGuard) and returns that dtype; fp32 and bf16 run on
// the CPU. As HF's T5DenseGatedActDense, the gated product is cast to `wo`'s
// weight dtype when that differs (outside a compute-dtype guard), so an fp16
// model whose `wo` weights are kept in fp32 (HF's `_keep_in_fp32_modules =
// ["wo"]`, applied when transformers loads T5 in fp16; see cast_t5_encoder)
// runs `wo` in fp32, and the residual stream is fp32 from the first
// feed-forward on (type promotion, as in HF); each RMSNorm output is cast back
// to the compute dtype. With an fp16 residual stream, values are clamped to
// +-(65504 - 1000) after each sub-layer when any is inf, as HF's T5Block does.
// fp16 on the CPU is refused (libtorch 1.13 has no CPU fp16 matmul, GELU or
// softmax kernels). Small difference to HF in bf16: HF rounds the normalised
// x to bf16 before multiplying by the bf16 weight; here the product is formed
// in fp32 and rounded once (<= 1 bf16 ulp per element).
//
// Sources: transformers modeling_t5.py (T5LayerNorm, T5Attention
// _relative_position_bucket / compute_bias, T5DenseGatedActDense, T5Block,
// T5Stack); Stability's sd3.5 other_impls.py T5*; ComfyUI comfy/text_encoders/t5.py.
#pragma once
#include <cstdint>
#include <string>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include "shoestring/io/weight_files.h"
#include "shoestring/nn/layers.h"

namespace shoestring::models {

/// Key prefix of T5-XXL inside SD3 / SD3.5 single files that include the text
/// encoders (sd3_medium_incl_clips_t5xxlfp16.safetensors; kohya sd3_utils.load_t5xxl).
inline constexpr const char* kSd3T5xxlPrefix = "text_encoders.t5xxl.transformer.";

/// Hyper-parameters of T5Encoder (HF T5Config names in comments).
struct T5EncoderOptions {
  TORCH_ARG(int64_t, vocab_size) = 32128;  ///< vocab_size (32100 used ids, padded to 32128)
  TORCH_ARG(int64_t, d_model) = 4096;      ///< d_model
  TORCH_ARG(int64_t, num_heads) = 64;      ///< num_heads
  TORCH_ARG(int64_t, d_kv) = 64;           ///< d_kv: width of one head (heads * d_kv need not be d_model)
  TORCH_ARG(int64_t, d_ff) = 10240;        ///< d_ff
  TORCH_ARG(int64_t, num_layers) = 24;     ///< num_layers
  TORCH_ARG(int64_t, num_buckets) = 32;    ///< relative_attention_num_buckets (>= 4)
  TORCH_ARG(int64_t, max_distance) = 128;  ///< relative_attention_max_distance
  TORCH_ARG(double, eps) = 1e-6;           ///< layer_norm_epsilon
  /// Device/dtype of the parameters; LayerInit{torch::kMeta} allocates nothing.
  TORCH_ARG(nn::LayerInit, init) = nn::LayerInit{};

 public:
  /// google/t5-v1_1-xxl's encoder (config.json): the defaults above.
  static T5EncoderOptions xxl();
  /// Test size: vocab 64, d_model 32, 4 heads of 8, d_ff 48, 2 layers, the
  /// released bucket settings.
  static T5EncoderOptions tiny();
};

/// Bucket of each relative position `relative` = key position - query
/// position (int64, any shape) for bidirectional attention (the encoder's):
/// half = num_buckets / 2 buckets per sign, positive distances offset by half;
/// |r| < half / 2 gets its own bucket, larger distances share logarithmic
/// buckets up to max_distance, and everything beyond the last bucket
/// (half - 1): bucket = (r > 0) * half + (|r| < e ? |r| : min(half - 1,
/// e + floor(log(|r| / e) / log(max_distance / e) * (half - e)))), e = half / 2,
/// in float32 arithmetic as HF's T5Attention._relative_position_bucket. With
/// 32 / 128: |r| 0..7 -> 0..7, 8 -> 8, 12 -> 9, 16 -> 10, 23 -> 11, 32 -> 12,
/// 46 -> 13, 64 -> 14, 91.. -> 15 (+16 for r > 0). Returns int64 of the same
/// shape. Throws shoestring::Error for a non-integer tensor, num_buckets < 4,
/// or max_distance <= e (the log would divide by log(1) = 0).
torch::Tensor t5_relative_position_bucket(const torch::Tensor& relative, int64_t num_buckets, int64_t max_distance);

/// One encoder block (HF T5Block without cross-attention): layer.0 =
/// T5LayerSelfAttention (layer_norm, SelfAttention.{q,k,v,o}[, relative_attention_bias]),
/// layer.1 = T5LayerFF (layer_norm, DenseReluDense.{wi_0,wi_1,wo}).
class T5BlockImpl : public torch::nn::Module {
 public:
  /// `has_relative_bias`: registers SelfAttention.relative_attention_bias (block 0).
  T5BlockImpl(const T5EncoderOptions& o, bool has_relative_bias);
  /// x: [B, L, d_model] (compute dtype, or fp32 after an fp32 `wo`);
  /// bias: [1 or B, heads, L, L] in the compute dtype -> [B, L, d_model].
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& bias);

  nn::RMSNorm attention_norm{nullptr};  ///< layer.0.layer_norm
  nn::Linear q{nullptr}, k{nullptr}, v{nullptr}, o{nullptr};
  nn::Embedding relative_attention_bias{nullptr};  ///< block 0 only: [num_buckets, heads]
  nn::RMSNorm ff_norm{nullptr};                    ///< layer.1.layer_norm
  nn::Linear wi_0{nullptr}, wi_1{nullptr}, wo{nullptr};

 private:
  T5EncoderOptions options_;
};
TORCH_MODULE(T5Block);

/// T5 v1.1 encoder stack (HF T5EncoderModel; see the file comment).
/// Throws shoestring::Error on bad options (non-positive sizes, bad bucket settings).
class T5EncoderImpl : public torch::nn::Module {
 public:
  explicit T5EncoderImpl(const T5EncoderOptions& options);
  /// ids: int64 [B, L], L >= 1, every id in [0, vocab_size) (T5's tokenizer:
  /// pieces, EOS 1, padding 0; data/t5_tokenizer.h). attention_mask:
  /// undefined (every position is a key: SD3's reference code, ComfyUI and
  /// kohya run T5 without a mask by default) or [B, L] of any dtype with 1 for
  /// tokens and 0 for padding, which removes padding keys from every query
  /// (padding positions still get outputs). Returns the final-RMS-normed last
  /// hidden state [B, L, d_model] (HF last_hidden_state) in the compute dtype.
  /// Throws shoestring::Error on a bad ids shape / dtype, out-of-range ids, a
  /// mask of another shape or with values other than 0 and 1, or fp16
  /// activations on the CPU.
  torch::Tensor forward(const torch::Tensor& ids, const torch::Tensor& attention_mask = {});
  /// The bias added to every block's attention scores: [1, H, L, L] from
  /// block 0's relative_attention_bias (HF compute_bias), plus the mask's
  /// [B, 1, 1, L] (lowest value of `dtype` at padding keys) when given ->
  /// [B, H, L, L]. In `dtype`.
  torch::Tensor attention_bias(int64_t length, const torch::Tensor& attention_mask, at::ScalarType dtype);
  const T5EncoderOptions& options() const { return options_; }

  nn::Embedding shared{nullptr};          ///< shared.weight [vocab, d_model]
  torch::nn::ModuleList blocks{nullptr};  ///< encoder.block
  nn::RMSNorm final_layer_norm{nullptr};  ///< encoder.final_layer_norm

 private:
  T5EncoderOptions options_;
};
TORCH_MODULE(T5Encoder);

/// Casts every parameter of `model` to `dtype`, except the feed-forward output
/// projections (`DenseReluDense.wo`) when `keep_wo_fp32`: they become fp32, as
/// transformers does when it loads T5 in fp16 (`_keep_in_fp32_modules = ["wo"]`,
/// against fp16 overflow in the last projection; see the file comment for how
/// forward then computes). Throws shoestring::Error for a non-floating dtype.
void cast_t5_encoder(T5EncoderImpl& model, at::ScalarType dtype, bool keep_wo_fp32 = false);

/// Loads a T5 encoder from `files` into `model`, converting dtypes (fp8 files
/// included, as load_weights). Keys are the HF names under `prefix`
/// ("" for a bare encoder file such as SD3's text_encoders/t5xxl_fp16.safetensors,
/// kSd3T5xxlPrefix for an SD3 "incl_clips" single file). `encoder.embed_tokens.weight`
/// (the tied copy) is accepted instead of `shared.weight`; when a file has
/// both, `shared.weight` is read. Keys under `prefix` + `decoder.` and
/// `lm_head.` (a whole T5ForConditionalGeneration file) are ignored, as are
/// tensors outside the prefix. Throws shoestring::Error naming the file and the
/// tensors (with the prefix) when a tensor is missing or mis-shaped (e.g. a
/// T5-XL file into an XXL model), when another tensor under the prefix is not
/// part of the encoder, when no tensor starts with the prefix, when a weight
/// holds NaN / inf, or when `model` was built on the meta device.
LoadWeightsReport load_t5_encoder_weights(T5EncoderImpl& model, const WeightFiles& files, const std::string& prefix);

/// As above with the prefix found from the file: kSd3T5xxlPrefix when any
/// tensor starts with it, else "" (a bare encoder file).
LoadWeightsReport load_t5_encoder_weights(T5EncoderImpl& model, const WeightFiles& files);

}  // namespace shoestring::models
