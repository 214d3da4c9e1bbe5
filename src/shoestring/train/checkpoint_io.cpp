#include "shoestring/train/checkpoint_io.h"

#include <filesystem>

#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/io/weight_files.h"
#include "shoestring/io/atomic_file.h"
#include "shoestring/io/safetensors.h"

namespace shoestring {
namespace fs = std::filesystem;

std::vector<std::pair<std::string, at::Tensor>> module_tensors(const torch::nn::Module& module) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& item : module.named_parameters(true)) out.emplace_back(item.key(), item.value());
  for (const auto& item : module.named_buffers(true)) out.emplace_back(item.key(), item.value());
  return out;
}

void save_module(const std::string& path, const torch::nn::Module& module,
                 const std::map<std::string, std::string>& metadata) {
  std::vector<NamedTensor> tensors;
  for (auto& [name, t] : module_tensors(module)) tensors.push_back({name, t.detach(), std::nullopt});
  save_safetensors(path, tensors, metadata);
}

void load_module(torch::nn::Module& module, const std::map<std::string, at::Tensor>& tensors,
                 const std::string& source) {
  torch::NoGradGuard no_grad;
  auto targets = module_tensors(module);
  std::map<std::string, std::vector<int64_t>> expected, found;
  for (const auto& [name, t] : targets) expected[name] = t.sizes().vec();
  for (const auto& [name, t] : tensors) found[name] = t.sizes().vec();
  const KeyDiff diff = diff_keys(expected, found);
  if (!diff.empty()) fail("{}: checkpoint does not match the model: {}", source, diff.describe());
  for (auto& [name, t] : targets) t.copy_(tensors.at(name));
}

at::Tensor cpu_rng_state() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state().clone();
}

void set_cpu_rng_state(const at::Tensor& state) {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state.to(torch::kUInt8).contiguous());
}

std::string latest_checkpoint_dir(const std::string& run_dir) {
  fs::path latest = fs::path(run_dir) / "checkpoints" / "latest.json";
  if (!fs::exists(latest)) {
    fail("cannot resume from '{}': no checkpoint found ({} is missing; the run saved none yet — set "
         "save_every_n_steps)",
         run_dir, latest.string());
  }
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_file(latest.string()));
  } catch (const nlohmann::json::exception& e) {
    fail("{}: invalid JSON: {}", latest.string(), e.what());
  }
  if (!j.contains("checkpoint") || !j["checkpoint"].is_string()) {
    fail("{}: expected a \"checkpoint\" field naming the checkpoint folder", latest.string());
  }
  fs::path dir = fs::path(run_dir) / "checkpoints" / j["checkpoint"].get<std::string>();
  // LoRA runs over a pretrained base keep lora.safetensors instead of the model.
  if ((!fs::exists(dir / "model.safetensors") && !fs::exists(dir / "lora.safetensors")) ||
      !fs::exists(dir / "state.safetensors")) {
    fail("{}: checkpoint folder '{}' lacks model.safetensors (or lora.safetensors) or state.safetensors", latest.string(),
         dir.string());
  }
  return dir.string();
}

void set_latest_checkpoint(const std::string& run_dir, const std::string& checkpoint_dir, int64_t step) {
  nlohmann::json j = {{"checkpoint", fs::path(checkpoint_dir).filename().string()}, {"step", step}};
  write_bytes_atomic((fs::path(run_dir) / "checkpoints" / "latest.json").string(), j.dump(2) + "\n");
}

}  // namespace shoestring
