// Model checkpoints and training state on disk.
//
// A run folder holds:
//   config.toml                      resolved configuration (every key)
//   metrics.jsonl                    one JSON object per optimizer step
//   samples/step-NNNNNN.png (+ .txt) sample grids with their prompts
//   checkpoints/step-NNNNNN/model.safetensors   weights (storage dtype) + metadata
//   checkpoints/step-NNNNNN/state.safetensors   optimizer state, EMA, RNG, counters
//   checkpoints/latest.json          names the newest complete checkpoint
//   model.safetensors                final weights (EMA weights when EMA is on)
// A LoRA run adds lora.safetensors beside each model.safetensors; a LoRA run
// on a released architecture's pretrained file writes lora.safetensors only
// (its frozen base is reloaded from that file on resume).
// Every file is written atomically (temp, fsync, rename), and latest.json is
// written last, so a crash leaves the previous checkpoint as the latest.
#pragma once
#include <map>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>
#include <torch/nn/module.h>

namespace shoestring {

/// Named parameters and buffers of a module, in registration order.
std::vector<std::pair<std::string, at::Tensor>> module_tensors(const torch::nn::Module& module);

/// Writes every parameter and buffer of `module` (in its storage dtype) to a
/// .safetensors file with string metadata. Throws shoestring::Error on I/O failure.
void save_module(const std::string& path, const torch::nn::Module& module,
                 const std::map<std::string, std::string>& metadata);

/// Copies tensors from `tensors` into the module's parameters and buffers by
/// name, converting dtype to the module's. Throws shoestring::Error listing
/// missing keys, unexpected keys and shape mismatches (`source` names the file).
void load_module(torch::nn::Module& module, const std::map<std::string, at::Tensor>& tensors,
                 const std::string& source);

/// Serializes libtorch's default CPU generator state (uint8 tensor) and restores it.
at::Tensor cpu_rng_state();
void set_cpu_rng_state(const at::Tensor& state);

/// Reads checkpoints/latest.json of a run folder; returns the checkpoint
/// folder path. Throws shoestring::Error when the run has no checkpoint.
std::string latest_checkpoint_dir(const std::string& run_dir);

/// Points checkpoints/latest.json at `checkpoint_dir` (atomic write).
void set_latest_checkpoint(const std::string& run_dir, const std::string& checkpoint_dir, int64_t step);

}  // namespace shoestring
