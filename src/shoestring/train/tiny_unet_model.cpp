// The tiny-unet family (models::Family::tiny_unet): the emoji example's
// TinyUNetModel (caption encoder + small UNet, trained together) and its
// TrainingModel, on the flow-matching objective in pixel space with the
// WordTokenizer built from the captions.
#include "shoestring/train/tiny_unet_model.h"

#include <filesystem>

#include <torch/torch.h>

#include "shoestring/core/cpu_features.h"
#include "shoestring/core/error.h"
#include "shoestring/core/memory_ledger.h"
#include "shoestring/data/caption_processing.h"
#include "shoestring/data/dataset.h"
#include "shoestring/data/tokenizer.h"
#include "shoestring/io/safetensors.h"
#include "shoestring/models/architecture.h"
#include "shoestring/precision/compute_choice.h"
#include "shoestring/precision/save_guard.h"
#include "shoestring/train/checkpoint_io.h"
#include "shoestring/train/config.h"
#include "shoestring/train/flow_matching.h"
#include "shoestring/train/training_model.h"
#include "shoestring/train/training_model_impl.h"

namespace shoestring {

TinyUNetModelOptions TinyUNetModelOptions::from_config(const TrainConfig& c, int64_t vocab_size) {
  TinyUNetModelOptions o;
  o.unet.base_channels(c.base_channels);
  o.unet.channel_mult(c.channel_mult);
  o.unet.num_res_blocks(c.num_res_blocks);
  o.unet.attention_levels(c.attention_levels);
  o.unet.num_heads(c.num_heads);
  o.unet.context_dim(c.text_dim);
  o.unet.groups(c.norm_groups);
  o.unet.dropout(c.dropout);
  o.unet.pooled_context(c.pooled_context);
  o.unet.scale_shift_norm(c.scale_shift_norm);
  o.text.vocab_size(vocab_size);
  o.text.max_length(c.max_caption_length);
  o.text.dim(c.text_dim);
  o.text.layers(c.text_layers);
  o.text.heads(c.num_heads);
  o.resolution = c.resolution;
  o.predict_x0 = c.prediction == "x0";
  return o;
}

nlohmann::json TinyUNetModelOptions::to_json() const {
  return {
      {"architecture", models::kTinyUNet},
      {"resolution", resolution},
      {"prediction", predict_x0 ? "x0" : "velocity"},
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
        {"dropout", unet.dropout()},
        {"pooled_context", unet.pooled_context()},
        {"scale_shift_norm", unet.scale_shift_norm()}}},
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

TinyUNetModelOptions TinyUNetModelOptions::from_json(const nlohmann::json& j) {
  if (!j.is_object()) fail("model_config: expected a JSON object");
  TinyUNetModelOptions o;
  o.resolution = field<int64_t>(j, "", "resolution");
  if (o.resolution < 8 || o.resolution > 1024)
    fail("model_config: field 'resolution' must be in [8, 1024], got {}", o.resolution);
  // Checkpoints written before "prediction" existed predict the velocity.
  if (j.contains("prediction")) {
    const auto p = field<std::string>(j, "", "prediction");
    if (p != "x0" && p != "velocity")
      fail("model_config: field 'prediction' must be \"x0\" or \"velocity\", got \"{}\"", p);
    o.predict_x0 = p == "x0";
  }
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
  if (!(o.unet.dropout() >= 0 && o.unet.dropout() < 1)) {
    fail("model_config: field 'unet.dropout' must be in [0, 1), got {}", o.unet.dropout());
  }
  // Checkpoints written before pooled_context existed have no such field.
  o.unet.pooled_context(u.contains("pooled_context") ? field<bool>(u, "unet", "pooled_context") : false);
  o.unet.scale_shift_norm(u.contains("scale_shift_norm") ? field<bool>(u, "unet", "scale_shift_norm") : false);
  o.text.vocab_size(field<I>(t, "text", "vocab_size"))
      .max_length(field<I>(t, "text", "max_length"))
      .dim(field<I>(t, "text", "dim"))
      .layers(field<I>(t, "text", "layers"))
      .heads(field<I>(t, "text", "heads"))
      .mlp_ratio(field<I>(t, "text", "mlp_ratio"))
      .dropout(field<double>(t, "text", "dropout"));
  return o;
}

TinyUNetModelImpl::TinyUNetModelImpl(const TinyUNetModelOptions& options) : options_(options) {
  unet = register_module("unet", models::TinyUNet(options.unet));
  text_encoder = register_module("text_encoder", models::CaptionEncoder(options.text));
  // Whole-model scopes: they carry a compute dtype, never a checkpoint.
  scopes_->declare(unet.get(), /*checkpointable=*/false);
  scopes_->declare(text_encoder.get(), /*checkpointable=*/false);
}

at::Tensor TinyUNetModelImpl::forward(const at::Tensor& x_t, const at::Tensor& t, const at::Tensor& tokens) {
  return velocity(x_t, t, denoise(x_t, t, tokens));
}

at::Tensor TinyUNetModelImpl::velocity(const at::Tensor& x_t, const at::Tensor& t, const at::Tensor& out) const {
  if (!options_.predict_x0) return out;
  // Elementwise on [B, 3, H, W] in fp32, back in the UNet's output dtype; the
  // planner's trace leaves these image-sized tensors out (kilobytes per image).
  const at::Tensor tt = t.to(torch::kFloat32).clamp_min(TinyUNetModelOptions::kMinX0Time).view({-1, 1, 1, 1});
  return ((x_t.to(torch::kFloat32) - out.to(torch::kFloat32)) / tt).to(out.scalar_type());
}

at::Tensor TinyUNetModelImpl::denoise(const at::Tensor& x_t, const at::Tensor& t, const at::Tensor& tokens) {
  if (!scopes_->configured()) {
    auto text = text_encoder->forward(tokens);
    auto dtype = text.hidden.scalar_type();
    return unet->forward(x_t.to(dtype), t, text.hidden, text.mask);
  }
  std::shared_ptr<models::CaptionEncoderImpl> te = text_encoder.ptr();
  auto text = nn::run_block(scopes_.get(), te,
                            [te, tokens](const std::vector<at::Tensor>&) {
                              auto enc = te->forward(tokens);
                              return std::vector<at::Tensor>{enc.hidden, enc.mask};
                            },
                            {});
  std::shared_ptr<models::TinyUNetImpl> u = unet.ptr();
  const at::Tensor mask = text[1];
  return nn::run_block(scopes_.get(), u,
                       [u, t, mask](const std::vector<at::Tensor>& in) {
                         return std::vector<at::Tensor>{u->forward(in[0], t, in[1], mask)};
                       },
                       {x_t, text[0]})[0];
}

}  // namespace shoestring

namespace shoestring {
namespace fs = std::filesystem;

namespace {

class TinyUNetTrainingModel final : public TrainingModel {
 public:
  TinyUNetTrainingModel(const TrainConfig& config, const ImageCaptionDataset& dataset, const ModelSource& source)
      : config_(config), dataset_(dataset) {
    // A fine-tune or resume takes the tokenizer saved with the weights.
    const std::string file =
        !source.resume_dir.empty() ? (fs::path(source.resume_dir) / "model.safetensors").string() : source.pretrained;
    if (!file.empty()) {
      auto meta = SafetensorsFile::open(file).metadata();
      auto it = meta.find("tokenizer");
      if (it == meta.end()) {
        fail(
            "{}: missing 'tokenizer' metadata (model.architecture = \"tiny-unet\" starts from a shoestring "
            "model.safetensors; for a released checkpoint set model.architecture)",
            file);
      }
      tokenizer_ = WordTokenizer::from_json(nlohmann::json::parse(it->second));
    } else {
      tokenizer_ = WordTokenizer::build(dataset.captions(), config.max_caption_length);
    }
    ScopedMemoryCategory category(MemoryCategory::weights);
    model_ = TinyUNetModel(TinyUNetModelOptions::from_config(config, tokenizer_.vocab_size()));
    if (!source.pretrained.empty()) load_module(*model_, load_safetensors(source.pretrained), source.pretrained);
  }

  torch::nn::Module& module() override { return *model_; }
  std::vector<nn::BlockTable*> block_tables() override { return model_->block_tables(); }
  std::vector<nn::LoraComponent> lora_components(bool unet_only) const override {
    std::vector<nn::LoraComponent> c = {{"lora_unet", "unet."}};
    if (!unet_only) c.push_back({"lora_te", "text_encoder."});
    return c;
  }

  TrainBatch prepare(const std::vector<int64_t>& idx) override {
    at::Tensor x0 = dataset_.batch_images(idx);
    CaptionProcessing processing;
    processing.dropout_rate = config_.caption_dropout_rate;
    processing.shuffle = config_.shuffle_caption;
    processing.keep_tokens = config_.keep_tokens;
    processing.tag_dropout_rate = config_.caption_tag_dropout_rate;
    at::Tensor tokens = tokenizer_.encode_batch(process_captions(dataset_.batch_captions(idx), processing));
    at::Tensor eps = torch::randn_like(x0);
    at::Tensor t = sample_flow_times(x0.size(0), config_.timestep_sampling, config_.logit_mean, config_.logit_std);
    return {{flow_interpolate(x0, eps, t), t, tokens}, flow_target(x0, eps), {}, {}};
  }

  at::Tensor forward(const TrainBatch& b) override { return model_->forward(b.inputs[0], b.inputs[1], b.inputs[2]); }

  at::Tensor sample(const SampleRequest& request) override { return generate_images(model_, tokenizer_, request); }

  std::map<std::string, std::string> metadata(int64_t step) const override {
    return {{"format", "shoestring"},
            {"architecture", models::kTinyUNet},
            {"model_config", model_->options().to_json().dump()},
            {"tokenizer", tokenizer_.to_json().dump()},
            {"step", std::to_string(step)},
            {"config_hash", config_hash(config_)},
            {"objective", "flow_matching"},
            {"dtype", stored_dtype_name(*model_)}};
  }

  void save_final(const std::string& path, int64_t step, bool storage_dtype, const TensorsByImpl& instead) override {
    TrainConfig c = config_;
    if (storage_dtype) c.save_precision = "auto";
    save_module_tensors(path, module_tensors(*model_), metadata(step), c, instead);
  }

  int64_t plan_vocab_size() const override { return tokenizer_.vocab_size(); }

 private:
  TrainConfig config_;
  const ImageCaptionDataset& dataset_;
  WordTokenizer tokenizer_ = WordTokenizer::build({}, 2);
  TinyUNetModel model_{nullptr};
};

}  // namespace

std::unique_ptr<TrainingModel> make_tiny_unet_training_model(const TrainConfig& config,
                                                             const ImageCaptionDataset& dataset,
                                                             const ModelSource& source) {
  return std::make_unique<TinyUNetTrainingModel>(config, dataset, source);
}

namespace {
nlohmann::json metadata_json(const SafetensorsFile& file, const std::string& key) {
  auto it = file.metadata().find(key);
  if (it == file.metadata().end()) {
    fail("{}: not a shoestring model checkpoint (metadata '{}' is missing)", file.path(), key);
  }
  try {
    return nlohmann::json::parse(it->second);
  } catch (const nlohmann::json::exception& e) {
    fail("{}: metadata '{}' is not valid JSON: {}", file.path(), key, e.what());
  }
}
}  // namespace

TinyUNetCheckpoint load_tiny_unet_checkpoint(const std::string& path, at::Device device) {
  // A sharded checkpoint's index (ZeRO stage 3: the model in several files):
  // its model files' tensors, with model.safetensors' metadata.
  const bool index = std::filesystem::path(path).filename() == kCheckpointIndexFile;
  const std::string dir = std::filesystem::path(path).parent_path().string();
  auto file = SafetensorsFile::open(index ? (std::filesystem::path(dir) / "model.safetensors").string() : path);
  auto arch = file.metadata().find("architecture");
  if (arch != file.metadata().end() && arch->second != models::kTinyUNet) {
    fail(
        "{}: a {} checkpoint; `shoestring sample` draws from the emoji example's tiny-unet and from single-file "
        "SD 1.5 / SDXL / SSD-1B checkpoints (UNet, VAE and text encoders in one file, as RUN_DIR/model.safetensors); "
        "for {} the trainer writes sample grids during training (sample_prompts, sample_every_n_steps)",
        file.path(), arch->second, arch->second);
  }
  TinyUNetCheckpoint out;
  out.tokenizer = WordTokenizer::from_json(metadata_json(file, "tokenizer"));
  out.model = TinyUNetModel(TinyUNetModelOptions::from_json(metadata_json(file, "model_config")));
  std::map<std::string, at::Tensor> tensors;
  if (index) {
    const CheckpointModel model = read_checkpoint_model(dir.empty() ? "." : dir);
    tensors.insert(model.tensors.begin(), model.tensors.end());
  } else {
    for (const auto& info : file.tensors()) tensors[info.name] = file.get(info.name);
  }
  const bool bf16_file = !tensors.empty() && tensors.begin()->second.scalar_type() == torch::kBFloat16;
  const bool slow_bf16 = device.is_cpu() && precision::choose_bf16_compute(precision::Bf16Compute::automatic,
                                                                           precision::cpu_hardware(cpu_features()))
                                                .has_value();
  if (bf16_file && !slow_bf16) out.model->to(torch::kBFloat16);
  // Refuses NaN / inf weights by name (sampling from them gives a blank grid).
  load_module(*out.model, tensors, path);
  out.model->to(device);
  return out;
}

}  // namespace shoestring
