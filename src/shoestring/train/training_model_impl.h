// Internal to train/: the TrainingModel families' constructors and the
// helpers they share. Not part of the public API.
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "shoestring/train/ldm_cache.h"
#include "shoestring/train/training_model.h"

namespace shoestring {

std::unique_ptr<TrainingModel> make_tiny_unet_training_model(const TrainConfig& config,
                                                             const ImageCaptionDataset& dataset,
                                                             const ModelSource& source);
std::unique_ptr<TrainingModel> make_ldm_training_model(const TrainConfig& config, const ImageCaptionDataset& dataset,
                                                       const ModelSource& source);
std::unique_ptr<TrainingModel> make_cascade_training_model(const TrainConfig& config,
                                                           const ImageCaptionDataset& dataset,
                                                           const ModelSource& source);

std::unique_ptr<TrainingModel> make_sd3_training_model(const TrainConfig& config, const ImageCaptionDataset& dataset,
                                                       const ModelSource& source);
/// The dtype a family builds its trained module in before loading the base
/// file: `storage` (full_bf16 / full_fp16's), or fp32 when a precision rule
/// keeps some weights in fp32 (e.g. the fp16 recipe's frozen ResBlocks), so
/// those hold the file's values rather than their half-precision rounding;
/// precision::apply casts the rest down after loading (the whole module is
/// then fp32 in host memory for a moment).
torch::Dtype build_dtype(const TrainConfig& config, torch::Dtype storage);

/// 16 hex digits: 64-bit FNV-1a of to_toml(config), the resolved config as the
/// run folder's config.toml records it (the "training config hash" metadata).
std::string config_hash(const TrainConfig& config);

/// The missing entries of a text-encoder disk cache (`missing`: indices
/// into `texts`, whose first `caption_count` are the dataset's captions and
/// the rest sample prompts), in the batches the in-memory encoding makes,
/// so that the same rows are encoded together and give the same bits:
/// captions first, then sample prompts, each in runs of at most `chunk`
/// (0: one run each), `encode(indices, their texts)` per run; no call for
/// an empty run.
void for_each_text_batch(
    const std::vector<size_t>& missing, size_t caption_count, const std::vector<std::string>& texts, size_t chunk,
    const std::function<void(const std::vector<size_t>& indices, const std::vector<std::string>& part)>& encode);

/// The "dtype" metadata of a model file: the storage dtype of `module`'s
/// floating-point parameters ("fp32", "bf16", "fp16") when they all share
/// it, else "mixed" (precision rules that keep some modules in another
/// dtype, fp8-packed frozen weights). save_precision overrides it with the
/// dtype a final file is cast to (precision/save_guard.h).
std::string stored_dtype_name(const torch::nn::Module& module);

/// Writes `tensors` (+ `extra`, written as they are but cast alike) to `path`
/// in config.save_precision ("auto": each tensor's own dtype) through the
/// save-time range guard (precision/save_guard.h; save_precision_force skips
/// the refusal); a tensor whose TensorImpl is a key of `instead` is written
/// from that value (TrainingModel::save_final). Throws shoestring::Error
/// naming the tensors the guard refuses, a substitute of another shape, or
/// on I/O failure.
void save_module_tensors(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                         std::map<std::string, std::string> metadata, const TrainConfig& config,
                         const TensorsByImpl& instead = {});

/// How a family fills its disk caches for `source`: its rank's share, writer
/// "r<rank>", tidy for `shoestring cache` (encode_only), quiet as the source.
DiskCacheRun disk_cache_run(const ModelSource& source);

}  // namespace shoestring
