// What the training loop trains: one model family behind one interface.
//
// The loop (trainer.cpp) owns data order, micro-batching, the precision
// policy, the optimizer, EMA, checkpoints and metrics; a TrainingModel owns
// what differs between families: which module tree is trained (its parameter
// names are the checkpoint keys), how a batch of dataset images and captions
// becomes the model's inputs and regression target (the objective), how
// samples are drawn and which metadata goes into saved files.
//
// Two families exist (make_training_model picks by the registry family of
// `model.architecture`, models/architecture.h):
//  - tiny-unet (Family::tiny_unet): the emoji example (train/tiny_unet_model.h): a caption
//    encoder trained jointly with a small UNet, flow matching in pixel space.
//  - the released LDM UNets (Family::ldm_unet: sd15, sdxl, ssd1b; train/ldm_model.cpp): images
//    are encoded to VAE latents and captions to CLIP text embeddings once,
//    before training (kohya's cache_latents + cache_text_encoder_outputs),
//    then the VAE and text encoders are freed; the UNet trains on the DDPM
//    epsilon- or v-prediction objective and is saved in the LDM single-file
//    layout together with the base checkpoint's VAE and text encoders.
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include "shoestring/nn/block_precision.h"
#include "shoestring/nn/lora.h"
#include "shoestring/train/ldm_cache.h"
#include "shoestring/train/sampling.h"

namespace shoestring {

struct TrainConfig;
class ImageCaptionDataset;
struct DatasetSpec;

/// One micro-batch, prepared: the model's inputs (family-specific order) and
/// the regression target (fp32, the shape of the model's output).
struct TrainBatch {
  std::vector<at::Tensor> inputs;
  at::Tensor target;
  /// float32 [B] per-sample loss weights (min-SNR-gamma, debiased
  /// estimation: train/diffusion_loss.h); undefined = all 1.
  at::Tensor loss_weight;
  /// float32 [B] Huber thresholds for loss_type huber / smooth_l1, from the
  /// family's noise schedule; undefined = the constant huber_c x huber_scale.
  at::Tensor huber_c;
};

/// Where the weights of a new run come from.
struct ModelSource {
  /// Where the family runs its one-off work (the LDM families encode the
  /// dataset there; the caches it produces are kept in host memory). The
  /// trained module tree is built in host memory and moved by the run.
  c10::Device device{c10::kCPU};
  /// Base weights (pretrained_model_name_or_path, expanded); "" = random init.
  std::string pretrained;
  /// A checkpoint folder being resumed ("" = fresh run); its model.safetensors
  /// is loaded by the trainer after construction, but families read their
  /// metadata (e.g. the emoji tokenizer) from it.
  std::string resume_dir;
  bool quiet = false;
  /// LDM families: bring the disk caches (train/ldm_cache.h) up to date and
  /// stop, building no UNet (`shoestring cache`); the model returned is then
  /// only good for destruction.
  bool encode_only = false;
  /// LDM families: filled with what the disk caches held and did (when set).
  LdmCacheStats* cache_stats = nullptr;
  /// This process's share of the disk caches' encoding (train/ldm_cache.h):
  /// each rank writes as its own writer "r<rank>" (io/tensor_cache.h), so ranks
  /// never wait on each other's lock, encodes the missing entries it owns and
  /// waits for the rest; a rank whose entries are all cached only reads.
  CacheShare cache_share;
  /// When set, families whose construction does slow work (the LDM ones
  /// encode the dataset) call it first, with a meta-device copy of the module
  /// tree (named as module() will be) and its LoRA components; the run checks
  /// network_weights with it. Families that build quickly do not call it (the
  /// run's own later checks cover them). What it throws propagates.
  std::function<void(torch::nn::Module& module, const std::vector<nn::LoraComponent>& lora_components)> check_module;
};

/// Tensors keyed by the TensorImpl of the module tensor they stand for.
using TensorsByImpl = std::map<const c10::TensorImpl*, at::Tensor>;

class TrainingModel {
 public:
  virtual ~TrainingModel() = default;

  /// The trained module tree; named_parameters() are the keys of the
  /// checkpoint files (e.g. "unet.conv_in.weight" for tiny-unet,
  /// "model.diffusion_model.input_blocks.0.0.weight" for the LDM UNets).
  virtual torch::nn::Module& module() = 0;
  /// Block tables for precision::resolve / apply / OverflowMonitor (also the
  /// only gradient-checkpointing switch: precision rules set it per block).
  virtual std::vector<nn::BlockTable*> block_tables() = 0;
  /// LoRA components (kohya prefixes) of this family; `unet_only` drops the
  /// text encoder's where the family trains one.
  virtual std::vector<nn::LoraComponent> lora_components(bool unet_only) const = 0;

  /// Inputs and target of a micro-batch of dataset indices, with caption
  /// dropout, noise and timesteps drawn from libtorch's global CPU generator.
  virtual TrainBatch prepare(const std::vector<int64_t>& indices) = 0;
  /// The model's prediction for `batch.inputs` (in the compute dtype).
  virtual at::Tensor forward(const TrainBatch& batch) = 0;

  /// uint8 images [P*S, 3, R, R], row-major by prompt (see SampleRequest).
  virtual at::Tensor sample(const SampleRequest& request) = 0;

  /// String metadata of checkpoint and final files at `step`.
  virtual std::map<std::string, std::string> metadata(int64_t step) const = 0;
  /// Writes the final model file: module() tensors in the config's
  /// save_precision (or, with `storage_dtype`, each in its own dtype) through
  /// the save-time range guard, plus whatever the family ships beside them
  /// (the LDM families copy the base checkpoint's VAE and text encoders so the
  /// file loads in ComfyUI / A1111). `instead`: tensors written in place of
  /// module parameters, by the parameter's TensorImpl (the fp32 sources of
  /// weights stored narrower: EMA shadows, fp32 masters; same shapes).
  /// Throws shoestring::Error from the range guard, for a substitute of
  /// another shape, or on I/O failure.
  virtual void save_final(const std::string& path, int64_t step, bool storage_dtype = false,
                          const TensorsByImpl& instead = {}) = 0;

  /// True when the frozen base weights can be rebuilt exactly from the
  /// pretrained file (a resumed LoRA run reloads them), so a LoRA run saves
  /// only its adapters.
  virtual bool base_reloadable() const { return false; }

  /// Caption vocabulary size for the planner (0 when it does not matter).
  virtual int64_t plan_vocab_size() const { return 0; }
};

/// LoRA options of a config: rank = network_dim, alpha = network_alpha,
/// network_args applied (nn::apply_network_args), adapters in bf16 with
/// full_bf16 (as kohya casts the network too), else fp32. Throws
/// shoestring::Error for bad network_args.
nn::LoraOptions lora_options(const TrainConfig& config);

/// Checks, before any slow work, that `config.architecture` can be trained
/// from a config (and model.tiny fits it), and warns about keys the family
/// ignores. Throws shoestring::Error naming the key.
void check_training_config(const TrainConfig& config);

/// Checks, before any slow work, the kohya datasets of a run (train/dataset_config.h)
/// against its family: the LDM families refuse random_crop (latents are
/// encoded once; kohya refuses it with cache_latents), shuffle_caption and
/// caption_tag_dropout_rate (cached text-encoder outputs), and bucket sizes
/// their latent grid does not divide (bucket_reso_steps, or resolution without
/// buckets). Throws shoestring::Error naming the dataset / subset and key.
void check_training_datasets(const TrainConfig& config, const std::vector<DatasetSpec>& specs);

/// Builds the family `config.architecture` names (check_training_config first), loads `source.pretrained`
/// and prepares its data (for the LDM families: encodes every image and
/// caption of `dataset` once). Parameters are charged to the ledger's
/// `weights` category, caches to `other`.
/// Throws shoestring::Error for unknown architectures, unreadable or
/// mismatching weight files (listing missing / unexpected keys), a missing
/// tokenizer, and images whose size does not fit the architecture.
std::unique_ptr<TrainingModel> make_training_model(const TrainConfig& config, const ImageCaptionDataset& dataset,
                                                   const ModelSource& source);

}  // namespace shoestring
