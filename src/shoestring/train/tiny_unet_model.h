// The emoji example's text-to-image model: a caption encoder trained jointly
// with a small text-conditioned UNet; forward() returns the flow-matching
// velocity, predicted directly or derived from a predicted clean image (x0).
// Parameter names are "unet.*" and "text_encoder.*".
#pragma once
#include <string>

#include <nlohmann/json.hpp>
#include <torch/nn/module.h>

#include "shoestring/data/tokenizer.h"
#include "shoestring/models/caption_encoder.h"
#include "shoestring/models/tiny_unet.h"

namespace shoestring {

struct TrainConfig;

/// Architecture hyper-parameters of TinyUNetModel; stored as JSON in every
/// checkpoint's metadata ("model_config") so `shoestring sample` can rebuild it.
struct TinyUNetModelOptions {
  models::TinyUNetOptions unet;
  models::CaptionEncoderOptions text{1};
  int64_t resolution = 32;  ///< pixels the model was trained at
  /// The UNet outputs the clean image x0_hat and forward() returns the
  /// velocity (x_t - x0_hat) / max(t, kMinX0Time) (x-prediction with a
  /// velocity loss, Li & He 2025, "Back to Basics: Let Denoising Generative
  /// Models Denoise"). At high noise the velocity is then almost x_t by
  /// construction; a UNet predicting it directly must learn that identity
  /// and, early in training, lets the noise through into the samples.
  bool predict_x0 = false;
  static constexpr double kMinX0Time = 0.05;

  static TinyUNetModelOptions from_config(const TrainConfig& config, int64_t vocab_size);
  nlohmann::json to_json() const;
  /// Throws shoestring::Error naming the missing or mistyped field.
  static TinyUNetModelOptions from_json(const nlohmann::json& j);
};

/// UNet + caption encoder. forward(x_t [B,3,H,W], t [B] float32 in [0,1],
/// tokens [B,L] int64) -> velocity [B,3,H,W].
/// Without a precision policy: in the weights' dtype; inputs are cast to it
/// (fp32 or bf16). With one (precision::apply on block_tables()): `unet` and
/// `text_encoder` are scopes with their own compute dtype (the dtype of the
/// modules outside any inner block: embeddings, conv_in/out, norms), each
/// ResBlock / SpatialTransformer / encoder layer is a block with its own, and
/// the velocity comes back in the unet scope's compute dtype (fp32 holding
/// fp16 values when fp16 is emulated).
class TinyUNetModelImpl : public torch::nn::Module {
 public:
  explicit TinyUNetModelImpl(const TinyUNetModelOptions& options);
  at::Tensor forward(const at::Tensor& x_t, const at::Tensor& t, const at::Tensor& tokens);
  /// The UNet's own output for the same inputs: the velocity, or x0_hat with
  /// options().predict_x0.
  at::Tensor denoise(const at::Tensor& x_t, const at::Tensor& t, const at::Tensor& tokens);
  /// The velocity from the UNet's output `out` [B, 3, H, W]: `out` itself, or
  /// (x_t - out) / max(t, kMinX0Time) with predict_x0 (computed in fp32,
  /// returned in out's dtype). t: [B] in [0, 1].
  at::Tensor velocity(const at::Tensor& x_t, const at::Tensor& t, const at::Tensor& out) const;
  const TinyUNetModelOptions& options() const { return options_; }
  /// Every block table of the model: the two scopes, then the UNet's and the
  /// encoder's blocks (for precision::resolve / apply / OverflowMonitor).
  std::vector<nn::BlockTable*> block_tables() const {
    return {scopes_.get(), unet->block_table(), text_encoder->block_table()};
  }
  models::TinyUNet unet{nullptr};
  models::CaptionEncoder text_encoder{nullptr};

 private:
  TinyUNetModelOptions options_;
  std::shared_ptr<nn::BlockTable> scopes_ = std::make_shared<nn::BlockTable>();
};
TORCH_MODULE(TinyUNetModel);

/// A trained emoji-example model read back from its final file or a
/// checkpoint: the model (eval-ready, on the requested device) and the
/// tokenizer it was trained with.
struct TinyUNetCheckpoint {
  TinyUNetModel model{nullptr};
  WordTokenizer tokenizer = WordTokenizer::build({}, 2);
};

/// Loads a tiny-unet .safetensors written by `shoestring train` (metadata
/// "model_config" and "tokenizer"). A bf16 file computes in bf16 where bf16
/// math is fast and in fp32 on a CPU without bf16 units (the values are exact
/// in fp32), the choice precision.bf16_compute = "auto" makes in training.
/// Throws shoestring::Error naming the file when it is not a tiny-unet
/// checkpoint (another architecture: says how that one is sampled), when the
/// metadata is missing or not JSON, or when a tensor is missing, misshapen or
/// not finite.
TinyUNetCheckpoint load_tiny_unet_checkpoint(const std::string& path, at::Device device);

}  // namespace shoestring
