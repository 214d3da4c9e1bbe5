// The tiny-unet family (models::Family::tiny_unet) of TrainingModel: the
// emoji example's DiffusionModel (caption encoder + small UNet, trained
// together) on the flow-matching objective in pixel space, with the
// WordTokenizer built from the captions.
#include <filesystem>

#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/core/memory_ledger.h"
#include "shoestring/data/dataset.h"
#include "shoestring/data/tokenizer.h"
#include "shoestring/io/safetensors.h"
#include "shoestring/models/architecture.h"
#include "shoestring/precision/save_guard.h"
#include "shoestring/train/checkpoint_io.h"
#include "shoestring/train/config.h"
#include "shoestring/train/diffusion_model.h"
#include "shoestring/train/flow_matching.h"
#include "shoestring/train/training_model.h"
#include "shoestring/train/training_model_impl.h"

namespace shoestring {
namespace fs = std::filesystem;

namespace {

class EmojiTrainingModel final : public TrainingModel {
 public:
  EmojiTrainingModel(const TrainConfig& config, const ImageCaptionDataset& dataset, const ModelSource& source)
      : config_(config), dataset_(dataset) {
    // A fine-tune or resume takes the tokenizer saved with the weights.
    const std::string file = !source.resume_dir.empty()
                                 ? (fs::path(source.resume_dir) / "model.safetensors").string()
                                 : source.pretrained;
    if (!file.empty()) {
      auto meta = SafetensorsFile::open(file).metadata();
      auto it = meta.find("tokenizer");
      if (it == meta.end()) {
        fail("{}: missing 'tokenizer' metadata (model.architecture = \"tiny-unet\" starts from a shoestring "
             "model.safetensors; for a released checkpoint set model.architecture)",
             file);
      }
      tokenizer_ = WordTokenizer::from_json(nlohmann::json::parse(it->second));
    } else {
      tokenizer_ = WordTokenizer::build(dataset.captions(), config.max_caption_length);
    }
    ScopedMemoryCategory category(MemoryCategory::weights);
    model_ = DiffusionModel(DiffusionModelOptions::from_config(config, tokenizer_.vocab_size()));
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
    std::vector<std::string> captions = dataset_.batch_captions(idx);
    at::Tensor drop = torch::rand({static_cast<int64_t>(captions.size())});
    for (size_t i = 0; i < captions.size(); ++i) {
      if (drop[static_cast<int64_t>(i)].item<double>() < config_.caption_dropout_rate) captions[i].clear();
    }
    at::Tensor tokens = tokenizer_.encode_batch(captions);
    at::Tensor eps = torch::randn_like(x0);
    at::Tensor t = sample_flow_times(x0.size(0), config_.timestep_sampling, config_.logit_mean, config_.logit_std);
    return {{flow_interpolate(x0, eps, t), t, tokens}, flow_target(x0, eps)};
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
            {"dtype", config_.full_bf16 ? "bf16" : config_.full_fp16 ? "fp16" : "fp32"}};
  }

  void save_final(const std::string& path, int64_t step, bool storage_dtype) override {
    TrainConfig c = config_;
    if (storage_dtype) c.save_precision = "auto";
    save_module_tensors(path, module_tensors(*model_), metadata(step), c);
  }

  int64_t plan_vocab_size() const override { return tokenizer_.vocab_size(); }

 private:
  TrainConfig config_;
  const ImageCaptionDataset& dataset_;
  WordTokenizer tokenizer_ = WordTokenizer::build({}, 2);
  DiffusionModel model_{nullptr};
};

}  // namespace

std::unique_ptr<TrainingModel> make_emoji_training_model(const TrainConfig& config,
                                                         const ImageCaptionDataset& dataset,
                                                         const ModelSource& source) {
  return std::make_unique<EmojiTrainingModel>(config, dataset, source);
}

}  // namespace shoestring
