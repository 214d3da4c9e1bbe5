#include "shoestring/train/diffusion_model.h"

#include "shoestring/core/error.h"
#include "shoestring/models/architecture.h"
#include "shoestring/train/config.h"

namespace shoestring {

DiffusionModelOptions DiffusionModelOptions::from_config(const TrainConfig& c, int64_t vocab_size) {
  DiffusionModelOptions o;
  o.unet.base_channels(c.base_channels);
  o.unet.channel_mult(c.channel_mult);
  o.unet.num_res_blocks(c.num_res_blocks);
  o.unet.attention_levels(c.attention_levels);
  o.unet.num_heads(c.num_heads);
  o.unet.context_dim(c.text_dim);
  o.unet.groups(c.norm_groups);
  o.unet.dropout(c.dropout);
  o.text.vocab_size(vocab_size);
  o.text.max_length(c.max_caption_length);
  o.text.dim(c.text_dim);
  o.text.layers(c.text_layers);
  o.text.heads(c.num_heads);
  o.resolution = c.resolution;
  return o;
}

nlohmann::json DiffusionModelOptions::to_json() const {
  return {
      {"architecture", models::kTinyUNet},
      {"resolution", resolution},
      {"unet",
       {{"in_channels", unet.in_channels()},
        {"out_channels", unet.out_channels()},
        {"base_channels", unet.base_channels()},
        {"channel_mult", unet.channel_mult()},
        {"num_res_blocks", unet.num_res_blocks()},
        {"attention_levels", unet.attention_levels()},
        {"num_heads", unet.num_heads()},
        {"context_dim", unet.context_dim()},
        {"groups", unet.groups()},
        {"dropout", unet.dropout()}}},
      {"text",
       {{"vocab_size", text.vocab_size()},
        {"max_length", text.max_length()},
        {"dim", text.dim()},
        {"layers", text.layers()},
        {"heads", text.heads()},
        {"mlp_ratio", text.mlp_ratio()},
        {"dropout", text.dropout()}}},
  };
}

namespace {
/// Reads obj[key] as T; errors name "section.key".
template <typename T>
T field(const nlohmann::json& obj, const std::string& section, const char* key) {
  std::string name = section.empty() ? key : section + "." + key;
  if (!obj.is_object() || !obj.contains(key)) fail("model_config: missing field '{}'", name);
  try {
    return obj.at(key).get<T>();
  } catch (const nlohmann::json::exception&) {
    fail("model_config: field '{}' has the wrong type ({})", name, obj.at(key).dump());
  }
}
}  // namespace

DiffusionModelOptions DiffusionModelOptions::from_json(const nlohmann::json& j) {
  if (!j.is_object()) fail("model_config: expected a JSON object");
  DiffusionModelOptions o;
  o.resolution = field<int64_t>(j, "", "resolution");
  const nlohmann::json& u = j.contains("unet") ? j.at("unet") : nlohmann::json();
  const nlohmann::json& t = j.contains("text") ? j.at("text") : nlohmann::json();
  using I = int64_t;
  using V = std::vector<int64_t>;
  o.unet.in_channels(field<I>(u, "unet", "in_channels"))
      .out_channels(field<I>(u, "unet", "out_channels"))
      .base_channels(field<I>(u, "unet", "base_channels"))
      .channel_mult(field<V>(u, "unet", "channel_mult"))
      .num_res_blocks(field<I>(u, "unet", "num_res_blocks"))
      .attention_levels(field<V>(u, "unet", "attention_levels"))
      .num_heads(field<I>(u, "unet", "num_heads"))
      .context_dim(field<I>(u, "unet", "context_dim"))
      .groups(field<I>(u, "unet", "groups"))
      .dropout(field<double>(u, "unet", "dropout"));
  o.text.vocab_size(field<I>(t, "text", "vocab_size"))
      .max_length(field<I>(t, "text", "max_length"))
      .dim(field<I>(t, "text", "dim"))
      .layers(field<I>(t, "text", "layers"))
      .heads(field<I>(t, "text", "heads"))
      .mlp_ratio(field<I>(t, "text", "mlp_ratio"))
      .dropout(field<double>(t, "text", "dropout"));
  return o;
}

DiffusionModelImpl::DiffusionModelImpl(const DiffusionModelOptions& options) : options_(options) {
  unet = register_module("unet", models::TinyUNet(options.unet));
  text_encoder = register_module("text_encoder", models::CaptionEncoder(options.text));
  // Whole-model scopes: they carry a compute dtype, never a checkpoint.
  scopes_->declare(unet.get(), /*checkpointable=*/false);
  scopes_->declare(text_encoder.get(), /*checkpointable=*/false);
}

at::Tensor DiffusionModelImpl::forward(const at::Tensor& x_t, const at::Tensor& t,
                                       const at::Tensor& tokens) {
  if (!scopes_->configured()) {
    auto text = text_encoder->forward(tokens);
    auto dtype = text.hidden.scalar_type();
    return unet->forward(x_t.to(dtype), t, text.hidden, text.mask);
  }
  std::shared_ptr<models::CaptionEncoderImpl> te = text_encoder.ptr();
  auto text = nn::run_block(
      scopes_.get(), te,
      [te, tokens](const std::vector<at::Tensor>&) {
        auto enc = te->forward(tokens);
        return std::vector<at::Tensor>{enc.hidden, enc.mask};
      },
      {});
  std::shared_ptr<models::TinyUNetImpl> u = unet.ptr();
  const at::Tensor mask = text[1];
  return nn::run_block(
      scopes_.get(), u,
      [u, t, mask](const std::vector<at::Tensor>& in) {
        return std::vector<at::Tensor>{u->forward(in[0], t, in[1], mask)};
      },
      {x_t, text[0]})[0];
}

}  // namespace shoestring
