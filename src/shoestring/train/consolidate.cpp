#include "shoestring/train/consolidate.h"

#include <algorithm>
#include <filesystem>
#include <list>
#include <map>
#include <set>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "shoestring/core/error.h"
#include "shoestring/core/text.h"
#include "shoestring/core/units.h"
#include "shoestring/io/safetensors.h"
#include "shoestring/io/weight_files.h"
#include "shoestring/precision/save_guard.h"
#include "shoestring/train/checkpoint_io.h"

namespace shoestring {
namespace fs = std::filesystem;

namespace {

constexpr const char* kEmaPrefix = "ema.";
constexpr const char* kOptimizerPrefix = "optimizer.";

/// A checkpoint's EMA shadows ("<param>" -> the mapped tensor "ema.<param>")
/// and the parameters that have optimizer state ("optimizer.<param>.<state>":
/// the trained ones, every one of which the EMA covers).
struct EmaShadows {
  std::map<std::string, at::Tensor> shadows;
  std::set<std::string> trained;
};

/// Sorts one tensor name of a checkpoint's state into `out`; `get` maps it.
template <typename Get>
void note_state_tensor(const std::string& name, EmaShadows& out, const Get& get) {
  if (has_prefix(name, kEmaPrefix)) {
    out.shadows.emplace(name.substr(std::string(kEmaPrefix).size()), get());
  } else if (has_prefix(name, kOptimizerPrefix)) {
    const std::string key = name.substr(std::string(kOptimizerPrefix).size());
    const size_t dot = key.rfind('.');
    if (dot != std::string::npos) out.trained.insert(key.substr(0, dot));
  }
}

/// The EMA shadows of checkpoint folder `dir`: through the index and its
/// optimizer shards when sharded, else from state.safetensors. Files opened
/// go to `mapped` and their names to `sources`.
EmaShadows ema_shadows(const fs::path& dir, bool sharded, std::list<WeightFiles>& mapped,
                       std::set<std::string>& sources) {
  EmaShadows out;
  std::map<std::string, const WeightFiles*> opened;
  auto open = [&](const std::string& file) -> const WeightFiles& {
    auto it = opened.find(file);
    if (it == opened.end())
      it = opened.emplace(file, &mapped.emplace_back(WeightFiles::open((dir / file).string()))).first;
    return *it->second;
  };
  if (sharded) {
    // With the optimizer shards: a missing or foreign shard is named here.
    const std::optional<CheckpointIndex> index = read_checkpoint_index(dir.string(), /*optimizer_shards=*/true);
    for (const auto& [name, file] : index->weight_map) {
      note_state_tensor(name, out, [&] { return open(file).get(name); });
      if (has_prefix(name, kEmaPrefix)) sources.insert(file);
    }
    return out;
  }
  // (Shards without an index were refused before: read_checkpoint_index.)
  const fs::path state = dir / "state.safetensors";
  if (!fs::exists(state))
    fail("consolidate --ema: '{}' holds no state.safetensors (where a run keeps its EMA)", dir.string());
  const SafetensorsFile file = SafetensorsFile::open(state.string());
  for (const auto& info : file.tensors()) {
    note_state_tensor(info.name, out, [&] { return open("state.safetensors").get(info.name); });
    if (has_prefix(info.name, kEmaPrefix)) sources.insert("state.safetensors");
  }
  return out;
}

/// The dtype a model tensor of `t`'s scalar type is saved as, for the guard.
std::optional<precision::Dtype> guard_dtype(at::ScalarType t) {
  if (t == at::kFloat) return precision::Dtype::fp32;
  if (t == at::kBFloat16) return precision::Dtype::bf16;
  if (t == at::kHalf) return precision::Dtype::fp16;
  return std::nullopt;
}

}  // namespace

ConsolidateResult consolidate_checkpoint(const std::string& checkpoint_dir, const std::string& out,
                                         const ConsolidateOptions& options) {
  const fs::path dir(checkpoint_dir);
  if (fs::is_regular_file(dir)) {
    fail("consolidate: '{}' is a file; give the checkpoint folder that holds it ({}), RUN_DIR/checkpoints/step-NNNNNN",
         checkpoint_dir, dir.parent_path().string());
  }
  if (!fs::is_directory(dir)) fail("consolidate: checkpoint folder '{}' does not exist", checkpoint_dir);
  if (out.empty()) fail("consolidate: the output path is empty, expected a .safetensors file path");
  if (fs::is_directory(out)) fail("consolidate: output '{}' is a folder, expected a .safetensors file path", out);
  {
    // Anywhere under the checkpoint folder (its files are what is read).
    std::error_code ec;
    const fs::path rel = fs::weakly_canonical(fs::absolute(out), ec).lexically_relative(fs::weakly_canonical(dir, ec));
    if (!ec && !rel.empty() && *rel.begin() != "..")
      fail("consolidate: output '{}' is inside the checkpoint folder it reads ({})", out, checkpoint_dir);
  }
  ConsolidateResult result;
  if (!fs::exists(dir / kCheckpointIndexFile) && !fs::exists(dir / "model.safetensors")) {
    fail("consolidate: '{}' holds no model.safetensors{}", checkpoint_dir,
         fs::exists(dir / "lora.safetensors")
             ? " (a LoRA run on a pretrained base checkpoints its adapters only: lora.safetensors is the file)"
             : "");
  }
  // The model alone is read: a checkpoint whose optimizer shards are lost
  // still gives its weights. Mapped: nothing read until a tensor is written.
  CheckpointModel model = read_checkpoint_model(checkpoint_dir);
  result.sharded = model.sharded;
  std::vector<std::pair<std::string, at::Tensor>>& tensors = model.tensors;
  std::map<std::string, std::string>& metadata = model.metadata;
  std::set<std::string> sources(model.files.begin(), model.files.end());
  std::list<WeightFiles> mapped;  // the EMA's files (a list: the mappings never move)
  metadata.erase("run_id");       // a sharded checkpoint's tie to its run (read_checkpoint_index), not the model's
  metadata["shoestring.consolidated_from"] = fs::path(checkpoint_dir).lexically_normal().string();
  // Each tensor's dtype in the output: --dtype's, else its own; with --ema
  // the shadowed ones are written from their fp32 shadows, rounded to nearest
  // into the model tensor's dtype (as EMA::swap_in copies them into the
  // parameters for the final file). Converted while writing, through the
  // range guard: no converted copy of the model is held.
  std::vector<std::optional<precision::Dtype>> targets(tensors.size(), options.dtype);
  if (options.ema) {
    const EmaShadows found = ema_shadows(dir, result.sharded, mapped, sources);
    const std::map<std::string, at::Tensor>& shadows = found.shadows;
    if (shadows.empty()) {
      fail("consolidate --ema: checkpoint '{}' holds no EMA weights (no \"ema.*\" tensors: the run had no ema_decay)",
           checkpoint_dir);
    }
    std::set<std::string> model_names;
    for (const auto& [name, t] : tensors) model_names.insert(name);
    for (const auto& [name, shadow] : shadows) {
      if (model_names.count(name)) continue;
      if (fs::exists(dir / "lora.safetensors")) {
        fail(
            "consolidate --ema: '{}' is a LoRA run's checkpoint: its EMA covers the adapters ('ema.{}'), which "
            "consolidate does not write; the run's final lora.safetensors holds the EMA adapters",
            checkpoint_dir, name);
      }
      fail("consolidate --ema: EMA tensor 'ema.{}' of '{}' has no model tensor of that name", name, checkpoint_dir);
    }
    for (const std::string& name : found.trained) {
      if (model_names.count(name) && !shadows.count(name)) {
        fail(
            "consolidate --ema: '{}' holds optimizer state for '{}' but no EMA shadow 'ema.{}': an incomplete EMA "
            "(a damaged index or state file)",
            checkpoint_dir, name, name);
      }
    }
    for (size_t i = 0; i < tensors.size(); ++i) {
      auto& [name, t] = tensors[i];
      const auto it = shadows.find(name);
      if (it == shadows.end()) continue;
      const at::Tensor& shadow = it->second;
      if (shadow.scalar_type() != at::kFloat) {
        fail("consolidate --ema: EMA tensor 'ema.{}' of '{}' is {}, expected an fp32 shadow", name, checkpoint_dir,
             c10::toString(shadow.scalar_type()));
      }
      if (shadow.sizes() != t.sizes()) {
        fail("consolidate --ema: EMA tensor 'ema.{}' of '{}' is {}, its model tensor {}", name, checkpoint_dir,
             format_shape(shadow.sizes()), format_shape(t.sizes()));
      }
      if (!at::isfinite(shadow).all().item<bool>()) {
        fail("consolidate --ema: EMA tensor 'ema.{}' of '{}' holds inf or NaN", name, checkpoint_dir);
      }
      if (!options.dtype) targets[i] = guard_dtype(t.scalar_type());
      t = shadow;
      ++result.ema_tensors;
    }
    metadata["shoestring.ema"] = "true";
  }
  if (options.dtype) metadata["dtype"] = precision::to_string(*options.dtype);
  precision::SaveGuardOptions guard;
  guard.force = options.force;
  guard.override_hint = "Write fp32 (--dtype fp32), or pass --force to write anyway";
  const std::vector<NamedTensor> named = precision::convert_for_save(tensors, targets, guard, out);
  save_safetensors(out, named, metadata);
  result.tensors = static_cast<int64_t>(named.size());
  for (const NamedTensor& t : named) {
    result.bytes += t.tensor.numel() * static_cast<int64_t>(c10::elementSize(t.cast.value_or(t.tensor.scalar_type())));
  }
  result.files_read = static_cast<int64_t>(sources.size());
  return result;
}

}  // namespace shoestring
