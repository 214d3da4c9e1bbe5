// Internal to train/: the TrainingModel families' constructors and the
// helpers they share. Not part of the public API.
#pragma once
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "shoestring/train/training_model.h"

namespace shoestring {

std::unique_ptr<TrainingModel> make_tiny_unet_training_model(const TrainConfig& config,
                                                             const ImageCaptionDataset& dataset,
                                                             const ModelSource& source);
std::unique_ptr<TrainingModel> make_ldm_training_model(const TrainConfig& config, const ImageCaptionDataset& dataset,
                                                       const ModelSource& source);
/// Stable Cascade: the pixel multiple an image side must be for stage C with
/// `o` (32 for the EfficientNet, times patch_size and 2 per level switch).
int64_t cascade_pixel_multiple(const models::StageCOptions& o);
std::unique_ptr<TrainingModel> make_cascade_training_model(const TrainConfig& config,
                                                           const ImageCaptionDataset& dataset,
                                                           const ModelSource& source);

/// 16 hex digits: 64-bit FNV-1a of to_toml(config), the resolved config as the
/// run folder's config.toml records it (the "training config hash" metadata).
std::string config_hash(const TrainConfig& config);

/// Writes `tensors` (+ `extra`, written as they are but cast alike) to `path`
/// in config.save_precision ("auto": each tensor's own dtype) through the
/// save-time range guard (precision/save_guard.h; save_precision_force skips
/// the refusal). Throws shoestring::Error naming the tensors the guard
/// refuses, or on I/O failure.
void save_module_tensors(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                         std::map<std::string, std::string> metadata, const TrainConfig& config);

}  // namespace shoestring
