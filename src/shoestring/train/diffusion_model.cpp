#include "shoestring/train/diffusion_model.h"

#include "shoestring/core/error.h"
#include "shoestring/train/config.h"

namespace shoestring {

DiffusionModelOptions DiffusionModelOptions::from_config(const TrainConfig& c, int64_t vocab_size) {
  DiffusionModelOptions o;
  o.unet.base_channels = c.base_channels;
  o.unet.channel_mult = c.channel_mult;
  o.unet.num_res_blocks = c.num_res_blocks;
  o.unet.attention_levels = c.attention_levels;
  o.unet.num_heads = c.num_heads;
  o.unet.context_dim = c.text_dim;
  o.unet.groups = c.norm_groups;
  o.unet.dropout = c.dropout;
  o.text.vocab_size = vocab_size;
  o.text.max_length = c.max_caption_length;
  o.text.dim = c.text_dim;
  o.text.layers = c.text_layers;
  o.text.heads = c.num_heads;
  o.resolution = c.resolution;
  return o;
}

nlohmann::json DiffusionModelOptions::to_json() const {
  return {
      {"architecture", "tiny-unet"},
      {"resolution", resolution},
      {"unet",
       {{"in_channels", unet.in_channels},
        {"out_channels", unet.out_channels},
        {"base_channels", unet.base_channels},
        {"channel_mult", unet.channel_mult},
        {"num_res_blocks", unet.num_res_blocks},
        {"attention_levels", unet.attention_levels},
        {"num_heads", unet.num_heads},
        {"context_dim", unet.context_dim},
        {"groups", unet.groups},
        {"dropout", unet.dropout}}},
      {"text",
       {{"vocab_size", text.vocab_size},
        {"max_length", text.max_length},
        {"dim", text.dim},
        {"layers", text.layers},
        {"heads", text.heads},
        {"mlp_ratio", text.mlp_ratio},
        {"dropout", text.dropout}}},
  };
}

DiffusionModelOptions DiffusionModelOptions::from_json(const nlohmann::json& j) {
  DiffusionModelOptions o;
  auto get = [&](const nlohmann::json& obj, const char* section, const char* key, auto& out) {
    if (!obj.is_object() || !obj.contains(key)) {
      fail("model_config: missing field '{}{}{}'", section, *section ? "." : "", key);
    }
    try {
      obj.at(key).get_to(out);
    } catch (const nlohmann::json::exception&) {
      fail("model_config: field '{}{}{}' has the wrong type ({})", section, *section ? "." : "", key,
           obj.at(key).dump());
    }
  };
  if (!j.is_object()) fail("model_config: expected a JSON object");
  get(j, "", "resolution", o.resolution);
  if (!j.contains("unet") || !j.contains("text")) fail("model_config: missing 'unet' or 'text' section");
  const auto& u = j.at("unet");
  get(u, "unet", "in_channels", o.unet.in_channels);
  get(u, "unet", "out_channels", o.unet.out_channels);
  get(u, "unet", "base_channels", o.unet.base_channels);
  get(u, "unet", "channel_mult", o.unet.channel_mult);
  get(u, "unet", "num_res_blocks", o.unet.num_res_blocks);
  get(u, "unet", "attention_levels", o.unet.attention_levels);
  get(u, "unet", "num_heads", o.unet.num_heads);
  get(u, "unet", "context_dim", o.unet.context_dim);
  get(u, "unet", "groups", o.unet.groups);
  get(u, "unet", "dropout", o.unet.dropout);
  const auto& t = j.at("text");
  get(t, "text", "vocab_size", o.text.vocab_size);
  get(t, "text", "max_length", o.text.max_length);
  get(t, "text", "dim", o.text.dim);
  get(t, "text", "layers", o.text.layers);
  get(t, "text", "heads", o.text.heads);
  get(t, "text", "mlp_ratio", o.text.mlp_ratio);
  get(t, "text", "dropout", o.text.dropout);
  return o;
}

DiffusionModelImpl::DiffusionModelImpl(const DiffusionModelOptions& options) : options_(options) {
  unet = register_module("unet", TinyUNet(options.unet));
  text_encoder = register_module("text_encoder", CaptionEncoder(options.text));
}

at::Tensor DiffusionModelImpl::forward(const at::Tensor& x_t, const at::Tensor& t,
                                       const at::Tensor& tokens) {
  auto text = text_encoder->forward(tokens);
  auto dtype = text.hidden.scalar_type();
  return unet->forward(x_t.to(dtype), t, text.hidden, text.mask);
}

}  // namespace shoestring
