#include "shoestring/train/checkpoint_io.h"

#include <algorithm>
#include <filesystem>
#include <optional>
#include <set>
#include <utility>

#include <fmt/format.h>

#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/io/atomic_file.h"
#include "shoestring/io/safetensors.h"
#include "shoestring/io/weight_files.h"
#include "shoestring/nn/fp8_storage.h"

namespace shoestring {
namespace fs = std::filesystem;

std::vector<std::pair<std::string, at::Tensor>> module_tensors(const torch::nn::Module& module) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  const std::map<std::string, nn::Fp8Storage> fp8 = nn::fp8_parameters(module);
  for (const auto& item : module.named_parameters(true)) {
    auto it = fp8.find(item.key());
    out.emplace_back(item.key(),
                     it == fp8.end() ? item.value() : nn::dequantize_fp8(item.value(), it->second, at::kBFloat16));
  }
  for (const auto& item : module.named_buffers(true)) out.emplace_back(item.key(), item.value());
  return out;
}

void save_module(const std::string& path, const torch::nn::Module& module,
                 const std::map<std::string, std::string>& metadata, const std::set<std::string>& excluded) {
  std::vector<NamedTensor> tensors;
  for (auto& [name, t] : module_tensors(module)) {
    if (!excluded.count(name)) tensors.push_back({name, t.detach(), std::nullopt});
  }
  save_safetensors(path, tensors, metadata);
}

void load_module(torch::nn::Module& module, const std::map<std::string, at::Tensor>& tensors,
                 const std::string& source) {
  torch::NoGradGuard no_grad;
  std::vector<std::pair<std::string, at::Tensor>> targets;
  for (const auto& item : module.named_parameters(true)) targets.emplace_back(item.key(), item.value());
  for (const auto& item : module.named_buffers(true)) targets.emplace_back(item.key(), item.value());
  const std::map<std::string, nn::Fp8Storage> fp8 = nn::fp8_parameters(module);
  std::map<std::string, std::vector<int64_t>> expected, found;
  for (const auto& [name, t] : targets) expected[name] = t.sizes().vec();
  for (const auto& [name, t] : tensors) found[name] = t.sizes().vec();
  const KeyDiff diff = diff_keys(expected, found);
  if (!diff.empty()) fail("{}: checkpoint does not match the model: {}", source, diff.describe());
  std::set<std::string> parameters;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) parameters.insert(item.key());
  for (auto& [name, t] : targets) {
    const at::Tensor& source_tensor = tensors.at(name);
    if (parameters.count(name)) require_finite(source_tensor, source, name);  // a damaged checkpoint
    auto packed = fp8.find(name);
    if (packed == fp8.end()) {
      t.copy_(source_tensor);
    } else if (!source_tensor.is_floating_point() || nn::is_fp8_storage_dtype(source_tensor.scalar_type())) {
      fail("{}: tensor \"{}\" is {}; the model stores it as fp8 and loads it from its values (fp32 / bf16 / fp16)",
           source, name, c10::toString(source_tensor.scalar_type()));
    } else {
      t.copy_(nn::encode_fp8(source_tensor, packed->second));
    }
  }
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
    fail(
        "cannot resume from '{}': no checkpoint found ({} is missing; the run saved none yet — set "
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
    fail("{}: checkpoint folder '{}' lacks model.safetensors (or lora.safetensors) or state.safetensors",
         latest.string(), dir.string());
  }
  return dir.string();
}

void set_latest_checkpoint(const std::string& run_dir, const std::string& checkpoint_dir, int64_t step) {
  nlohmann::json j = {{"checkpoint", fs::path(checkpoint_dir).filename().string()}, {"step", step}};
  write_bytes_atomic((fs::path(run_dir) / "checkpoints" / "latest.json").string(), j.dump(2) + "\n");
}

}  // namespace shoestring

namespace shoestring {
namespace {

nlohmann::json counters_to_json(const TrainingCounters& c) {
  auto optional = [](const std::optional<double>& v) { return v ? nlohmann::json(*v) : nlohmann::json(nullptr); };
  return {{"step", c.step},
          {"optimizer_step_count", c.optimizer_step_count},
          {"data_epoch", c.data_epoch},
          {"data_index", c.data_index},
          {"micro_steps", c.micro_steps},
          {"images_seen", c.images_seen},
          {"skipped_steps", c.skipped_steps},
          {"consecutive_nonfinite", c.consecutive_nonfinite},
          {"elapsed_seconds", c.elapsed_seconds},
          {"loss_scale", optional(c.loss_scale)},
          {"loss_scale_growth_tracker", c.loss_scale_growth_tracker},
          {"precision_upcast", c.precision_upcast},
          {"fused_previous_grad_norm", optional(c.fused_previous_grad_norm)},
          {"world_size", c.world_size},
          {"train_batch_size", c.train_batch_size},
          {"gradient_accumulation_steps", c.gradient_accumulation_steps},
          {"epoch_end", c.epoch_end},
          {"step_checkpoint", c.step_checkpoint},
          {"run_last", c.run_last},
          {"run_id", c.run_id}};
}

TrainingCounters counters_from_json(const nlohmann::json& j, const std::string& source) {
  TrainingCounters c;
  auto required = [&](const char* key, int64_t& out) {
    if (!j.contains(key) || !j[key].is_number_integer()) {
      fail("{}: 'training_state' metadata lacks the integer field '{}'", source, key);
    }
    out = j[key].get<int64_t>();
  };
  required("step", c.step);
  required("optimizer_step_count", c.optimizer_step_count);
  required("data_epoch", c.data_epoch);
  required("data_index", c.data_index);
  try {
    // Fields added over time: an older file keeps the defaults.
    c.micro_steps = j.value("micro_steps", int64_t{0});
    c.images_seen = j.value("images_seen", int64_t{0});
    c.skipped_steps = j.value("skipped_steps", int64_t{0});
    c.consecutive_nonfinite = j.value("consecutive_nonfinite", int64_t{0});
    c.elapsed_seconds = j.value("elapsed_seconds", 0.0);
    // null (no loss scaling) or a number; anything else is refused (the
    // .get below throws), not taken as "start the scale afresh".
    if (j.contains("loss_scale") && !j["loss_scale"].is_null()) c.loss_scale = j["loss_scale"].get<double>();
    c.loss_scale_growth_tracker = j.value("loss_scale_growth_tracker", int64_t{0});
    c.world_size = j.value("world_size", int64_t{0});
    c.train_batch_size = j.value("train_batch_size", int64_t{0});
    c.gradient_accumulation_steps = j.value("gradient_accumulation_steps", int64_t{0});
    c.epoch_end = j.value("epoch_end", int64_t{0});
    c.step_checkpoint = j.value("step_checkpoint", true);
    c.run_last = j.value("run_last", false);
    c.run_id = j.value("run_id", std::string());
    if (j.contains("precision_upcast")) c.precision_upcast = j["precision_upcast"].get<std::vector<std::string>>();
    if (j.contains("fused_previous_grad_norm") && !j["fused_previous_grad_norm"].is_null()) {
      c.fused_previous_grad_norm = j["fused_previous_grad_norm"].get<double>();
    }
  } catch (const nlohmann::json::exception& e) {
    fail("{}: 'training_state' metadata has a field of the wrong type: {}", source, e.what());
  }
  return c;
}

}  // namespace

void save_training_state(const std::string& path, const TrainingState& state) {
  std::vector<NamedTensor> tensors;
  for (const auto& [name, t] : state.optimizer) tensors.push_back({"optimizer." + name, t, std::nullopt});
  for (const auto& [name, t] : state.ema) tensors.push_back({"ema." + name, t, std::nullopt});
  for (const auto& [name, t] : state.master) tensors.push_back({"master." + name, t, std::nullopt});
  tensors.push_back({"rng.cpu", state.rng_cpu, std::nullopt});
  save_safetensors(path, tensors, {{"training_state", counters_to_json(state.counters).dump()}});
}

namespace {

TrainingCounters counters_of(const SafetensorsFile& file) {
  auto it = file.metadata().find("training_state");
  if (it == file.metadata().end()) fail("{}: missing 'training_state' metadata", file.path());
  nlohmann::json meta;
  try {
    meta = nlohmann::json::parse(it->second);
  } catch (const nlohmann::json::exception& e) {
    fail("{}: 'training_state' metadata is not valid JSON: {}", file.path(), e.what());
  }
  return counters_from_json(meta, file.path());
}

}  // namespace

TrainingCounters load_training_counters(const std::string& path) { return counters_of(SafetensorsFile::open(path)); }

TrainingState load_training_state(const std::string& path) {
  auto file = SafetensorsFile::open(path);
  TrainingState state;
  state.counters = counters_of(file);
  const std::pair<const char*, std::vector<std::pair<std::string, at::Tensor>>*> groups[] = {
      {"optimizer.", &state.optimizer}, {"ema.", &state.ema}, {"master.", &state.master}};
  for (const auto& info : file.tensors()) {
    const std::string& n = info.name;
    if (n == "rng.cpu") {
      state.rng_cpu = file.get(n);
      continue;
    }
    bool known = false;
    for (const auto& [prefix, group] : groups) {
      const std::string p = prefix;
      if (n.rfind(p, 0) == 0) {
        group->emplace_back(n.substr(p.size()), file.get(n));
        known = true;
        break;
      }
    }
    if (!known) fail("{}: unexpected tensor '{}' in training state", file.path(), n);
  }
  if (!state.rng_cpu.defined()) fail("{}: tensor 'rng.cpu' is missing", file.path());
  return state;
}

}  // namespace shoestring

namespace shoestring {

namespace {

/// "<kind>-rank-RRRRR-of-WWWWW.safetensors"
std::string rank_file_name(const char* kind, int rank, int world) {
  return fmt::format("{}-rank-{:05d}-of-{:05d}.safetensors", kind, rank, world);
}

/// The rank and world size of a name rank_file_name(kind, ...) gives; nullopt for any other name.
std::optional<std::pair<int, int>> parse_rank_file_name(const std::string& name, const char* kind) {
  const std::string head = std::string(kind) + "-rank-", mid = "-of-", tail = ".safetensors";
  const size_t n = head.size() + 5 + mid.size() + 5 + tail.size();
  if (name.size() != n || name.compare(0, head.size(), head) != 0) return std::nullopt;
  if (name.compare(head.size() + 5, mid.size(), mid) != 0 || name.compare(n - tail.size(), tail.size(), tail) != 0)
    return std::nullopt;
  auto number = [&](size_t at) -> std::optional<int> {
    const auto first = name.begin() + static_cast<std::ptrdiff_t>(at);
    if (!std::all_of(first, first + 5, [](char c) { return c >= '0' && c <= '9'; })) return std::nullopt;
    return std::stoi(name.substr(at, 5));
  };
  const std::optional<int> rank = number(head.size()), world = number(head.size() + 5 + mid.size());
  if (!rank || !world) return std::nullopt;
  return std::make_pair(*rank, *world);
}

constexpr const char* kOptimizerShard = "optimizer";
constexpr const char* kModelShard = "model";

/// A rank file of either kind: its rank and world size.
std::optional<std::pair<int, int>> parse_shard_name(const std::string& name) {
  if (auto r = parse_rank_file_name(name, kOptimizerShard)) return r;
  return parse_rank_file_name(name, kModelShard);
}

void save_rank_file(const std::string& path, const std::vector<NamedTensor>& tensors, int rank, int world, int64_t step,
                    const std::string& run_id) {
  std::map<std::string, std::string> metadata = {
      {"rank", std::to_string(rank)}, {"world_size", std::to_string(world)}, {"step", std::to_string(step)}};
  if (!run_id.empty()) metadata["run_id"] = run_id;
  save_safetensors(path, tensors, metadata);
}

}  // namespace

std::string optimizer_shard_name(int rank, int world) { return rank_file_name(kOptimizerShard, rank, world); }

bool is_optimizer_shard_name(const std::string& name) {
  return parse_rank_file_name(name, kOptimizerShard).has_value();
}

std::string model_shard_name(int rank, int world) { return rank_file_name(kModelShard, rank, world); }

bool is_model_shard_name(const std::string& name) { return parse_rank_file_name(name, kModelShard).has_value(); }

bool is_checkpoint_model_file(const std::string& name) {
  return name == "model.safetensors" || is_model_shard_name(name);
}

void save_model_shard(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& weights, int rank,
                      int world, int64_t step, const std::string& run_id) {
  std::vector<NamedTensor> tensors;
  for (const auto& [name, t] : weights) tensors.push_back({name, t.detach(), std::nullopt});
  save_rank_file(path, tensors, rank, world, step, run_id);
}

void save_optimizer_shard(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& optimizer,
                          const std::vector<std::pair<std::string, at::Tensor>>& ema, int rank, int world, int64_t step,
                          const std::string& run_id, const std::vector<std::pair<std::string, at::Tensor>>& master) {
  std::vector<NamedTensor> tensors;
  for (const auto& [name, t] : optimizer) tensors.push_back({"optimizer." + name, t, std::nullopt});
  for (const auto& [name, t] : ema) tensors.push_back({"ema." + name, t, std::nullopt});
  for (const auto& [name, t] : master) tensors.push_back({"master." + name, t, std::nullopt});
  save_rank_file(path, tensors, rank, world, step, run_id);
}

void write_checkpoint_index(const std::string& dir, int64_t step, int world, int zero_stage) {
  const fs::path folder(dir);
  // Shards of another world size (an interrupted save at another world
  // size): not part of this checkpoint.
  std::error_code ec;
  std::vector<fs::path> stale;
  for (const auto& e : fs::directory_iterator(folder, ec)) {
    const std::string name = e.path().filename().string();
    const std::optional<std::pair<int, int>> shard = parse_shard_name(name);
    // Model shards exist at stage 3 only: others are an interrupted stage-3
    // save of this step, which a resume at another stage saves again.
    if (shard && (shard->second != world || shard->first >= world || (zero_stage != 3 && is_model_shard_name(name))))
      stale.push_back(e.path());
  }
  for (const fs::path& p : stale) {
    if (!fs::remove(p, ec) && ec)
      fail("cannot remove {} (a shard of another world size): {}", p.string(), ec.message());
  }
  std::vector<std::pair<std::string, int>> files;  // (file, rank that wrote it)
  for (const char* replicated : {"model.safetensors", "lora.safetensors"}) {
    if (fs::exists(folder / replicated)) files.emplace_back(replicated, 0);
  }
  files.emplace_back("state.safetensors", 0);
  for (int r = 0; r < world; ++r) files.emplace_back(optimizer_shard_name(r, world), r);
  // ZeRO stage 3: each rank's streamed weights (a full fine-tune: model.safetensors holds the rest).
  if (zero_stage == 3 && fs::exists(folder / "model.safetensors")) {
    for (int r = 0; r < world; ++r) files.emplace_back(model_shard_name(r, world), r);
  }
  nlohmann::ordered_json index = {{"format", "shoestring.sharded_checkpoint"},
                                  {"version", 1},
                                  {"step", step},
                                  {"world_size", world},
                                  {"zero_stage", zero_stage}};
  nlohmann::ordered_json listed = nlohmann::ordered_json::object();
  std::map<std::string, std::string> weight_map;
  for (const auto& [name, rank] : files) {
    const fs::path path = folder / name;
    if (!fs::exists(path)) fail("{}: the checkpoint of step {} lacks {} (rank {} writes it)", dir, step, name, rank);
    const SafetensorsFile file = SafetensorsFile::open(path.string());
    listed[name] = {{"bytes", file.file_size()}, {"rank", rank}};
    for (const auto& info : file.tensors()) {
      const auto [it, fresh] = weight_map.emplace(info.name, name);
      if (!fresh) fail("{}: tensor '{}' is in both {} and {}", dir, info.name, it->second, name);
    }
  }
  index["files"] = std::move(listed);
  index["weight_map"] = weight_map;
  write_bytes_atomic((folder / kCheckpointIndexFile).string(), index.dump(2) + "\n");
}

void remove_sharded_files(const std::string& dir) {
  std::error_code ec;
  std::vector<fs::path> stale;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name == kCheckpointIndexFile || parse_shard_name(name)) stale.push_back(e.path());
  }
  for (const fs::path& p : stale) {
    if (!fs::remove(p, ec) && ec)
      fail("cannot remove {} (a stale part of a sharded checkpoint): {}", p.string(), ec.message());
  }
}

CheckpointModel read_checkpoint_model(const std::string& dir_path) {
  const fs::path dir(dir_path);
  const std::optional<CheckpointIndex> index = read_checkpoint_index(dir_path, /*optimizer_shards=*/false);
  CheckpointModel out;
  out.sharded = index.has_value();
  out.source = (dir / (index ? kCheckpointIndexFile : "model.safetensors")).string();
  if (!index) {
    out.files.push_back("model.safetensors");
  } else {
    // model.safetensors first, then (ZeRO stage 3) the ranks' model shards.
    std::set<std::string> seen;
    for (const auto& [name, file] : index->weight_map) {
      if (is_checkpoint_model_file(file) && seen.insert(file).second) out.files.push_back(file);
    }
    if (!seen.count("model.safetensors"))
      fail("{}: its index maps no tensor to its model file (model.safetensors)", dir_path);
    std::stable_partition(out.files.begin(), out.files.end(),
                          [](const std::string& f) { return f == "model.safetensors"; });
    std::sort(out.files.begin() + 1, out.files.end());
    // Every rank's model shard, or (older stage-3 checkpoints) none.
    const bool shards = out.files.size() > 1;
    for (int r = 0; r < index->world_size; ++r) {
      const std::string shard = model_shard_name(r, index->world_size);
      if (!seen.count(shard) && (shards || fs::exists(dir / shard))) {
        fail(
            "{}: holds {} but its index maps no weight to it: the index is damaged or of another save (every "
            "rank's model shard holds its part of the model)",
            dir_path, shard);
      }
    }
  }
  for (const std::string& name : out.files) {
    const SafetensorsFile file = SafetensorsFile::open((dir / name).string());
    if (name == "model.safetensors") out.metadata = file.metadata();
    if (index) {
      // Exactly the tensors the index maps to this file.
      std::set<std::string> listed;
      for (const auto& [tensor, in] : index->weight_map) {
        if (in == name) listed.insert(tensor);
      }
      for (const auto& info : file.tensors()) {
        if (!listed.erase(info.name))
          fail("{} holds '{}', which the index of '{}' does not map to it", file.path(), info.name, dir_path);
      }
      if (!listed.empty())
        fail("the index of '{}' puts '{}' in {}, which does not hold it", dir_path, *listed.begin(), file.path());
    }
    for (const auto& info : file.tensors()) out.tensors.emplace_back(info.name, file.get(info));
  }
  return out;
}

void refuse_partial_checkpoint_model(const std::string& path, const std::string& command) {
  const fs::path file(path);
  if (file.filename() != "model.safetensors") return;
  const fs::path dir = file.parent_path().empty() ? fs::path(".") : file.parent_path();
  std::error_code ec;
  if (!fs::exists(dir / kCheckpointIndexFile, ec)) return;
  std::optional<CheckpointIndex> index;
  try {
    index = read_checkpoint_index(dir.string(), /*optimizer_shards=*/false);
  } catch (const Error&) {
    return;  // a damaged index: the model file is read (and judged) on its own
  }
  for (const auto& [name, in] : index->weight_map) {
    if (!is_model_shard_name(in)) continue;
    fail(
        "{}: {} is one part of a ZeRO stage-3 checkpoint's model (the weights that do not stream; each rank's "
        "model shard holds the rest, e.g. '{}' in {}): give {} instead, or write the whole model as one file with "
        "`shoestring consolidate {} OUT.safetensors`",
        command, path, name, in, (dir / kCheckpointIndexFile).string(), dir.string());
  }
}

std::optional<CheckpointIndex> read_checkpoint_index(const std::string& dir, bool optimizer_shards) {
  const fs::path path = fs::path(dir) / kCheckpointIndexFile;
  if (!fs::exists(path)) {
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(dir, ec)) {
      const std::string name = e.path().filename().string();
      if (!parse_shard_name(name)) continue;
      fail(
          "'{}' holds {}, a part of a sharded checkpoint, but no {}: a save interrupted before its index (it does "
          "not count: resume from the checkpoint checkpoints/latest.json names) or a damaged folder",
          dir, name, kCheckpointIndexFile);
    }
    return std::nullopt;
  }
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_file(path.string()));
  } catch (const nlohmann::json::exception& e) {
    fail("{}: invalid JSON: {}", path.string(), e.what());
  }
  CheckpointIndex out;
  try {
    if (j.value("format", std::string()) != "shoestring.sharded_checkpoint")
      fail("{}: \"format\" is not \"shoestring.sharded_checkpoint\"", path.string());
    out.step = j.at("step").get<int64_t>();
    out.world_size = j.at("world_size").get<int>();
    out.zero_stage = j.at("zero_stage").get<int>();
    out.weight_map = j.at("weight_map").get<std::map<std::string, std::string>>();
  } catch (const nlohmann::json::exception& e) {
    fail("{}: a field is missing or of the wrong type: {}", path.string(), e.what());
  }
  for (const auto& [tensor, file] : out.weight_map) {
    if (file.empty() || file.find('/') != std::string::npos || file == "." || file == "..")
      fail("{}: weight_map[\"{}\"] = \"{}\" must be a file of the checkpoint folder", path.string(), tensor, file);
    if (!optimizer_shards && is_optimizer_shard_name(file)) continue;
    if (!fs::exists(fs::path(dir) / file))
      fail("{}: weight_map[\"{}\"] names {}, which is missing", path.string(), tensor, file);
    if (is_model_shard_name(file) && out.zero_stage != 3)
      fail(
          "{}: weight_map[\"{}\"] names the model shard {}, but model shards exist at zero_stage 3 only, and the "
          "index says zero_stage {}",
          path.string(), tensor, file, out.zero_stage);
  }
  // Every shard is this checkpoint's: its own metadata (written with it)
  // names the index's step and world size and the rank of its name.
  std::set<std::string> shards;
  for (const auto& [tensor, file] : out.weight_map) {
    if ((optimizer_shards && is_optimizer_shard_name(file)) || is_model_shard_name(file)) shards.insert(file);
  }
  // The run that wrote the checkpoint (state.safetensors, rank 0's): every
  // shard, and the model.safetensors beside them, must be that run's.
  std::string run_id;
  const fs::path state = fs::path(dir) / "state.safetensors";
  if (fs::exists(state)) run_id = load_training_counters(state.string()).run_id;
  auto require_run = [&](const SafetensorsFile& file, const char* what) {
    if (run_id.empty()) return;  // an older checkpoint: no ids
    const auto it = file.metadata().find("run_id");
    if (it != file.metadata().end() && it->second == run_id) return;
    fail(
        "{}: this {} was written by another run (run_id {}; the checkpoint's state.safetensors says {}): a file of "
        "another run was copied here",
        file.path(), what, it == file.metadata().end() ? std::string("(none)") : it->second, run_id);
  };
  const bool has_model = std::any_of(out.weight_map.begin(), out.weight_map.end(),
                                     [](const auto& entry) { return entry.second == "model.safetensors"; });
  if (has_model) require_run(SafetensorsFile::open((fs::path(dir) / "model.safetensors").string()), "model file");
  for (const std::string& file : shards) {
    const auto [rank, world] = *parse_shard_name(file);
    const SafetensorsFile shard = SafetensorsFile::open((fs::path(dir) / file).string());
    auto meta = [&](const char* key) {
      const auto it = shard.metadata().find(key);
      return it == shard.metadata().end() ? std::string("(none)") : it->second;
    };
    const std::string want_step = std::to_string(out.step), want_world = std::to_string(out.world_size);
    if (world != out.world_size || meta("world_size") != want_world || meta("rank") != std::to_string(rank) ||
        meta("step") != want_step) {
      fail(
          "{}: this {} shard is not part of the checkpoint {} indexes (step {}, world size {}): its name says "
          "rank {} of {}, its metadata step {}, rank {}, world_size {}; a shard of another checkpoint was copied "
          "here",
          shard.path(), is_model_shard_name(file) ? "model" : "optimizer", path.string(), out.step, out.world_size,
          rank, world, meta("step"), meta("rank"), meta("world_size"));
    }
    require_run(shard, is_model_shard_name(file) ? "model shard" : "optimizer shard");
  }
  // "files" records each file's size when the checkpoint was saved: a file
  // replaced or cut since (by hand, a copy of another save: those of another
  // step or run are named above) is named here, before any of its tensors is
  // read.
  if (j.contains("files")) {
    std::map<std::string, int64_t> recorded;
    try {
      for (const auto& [file, entry] : j.at("files").items()) recorded[file] = entry.at("bytes").get<int64_t>();
    } catch (const nlohmann::json::exception& e) {
      fail("{}: \"files\" must map each file to {{\"bytes\", \"rank\"}}: {}", path.string(), e.what());
    }
    for (const auto& [tensor, file] : out.weight_map) {
      if (!recorded.count(file))
        fail("{}: weight_map[\"{}\"] names {}, which \"files\" does not list", path.string(), tensor, file);
    }
    for (const auto& [file, bytes] : recorded) {
      if (!optimizer_shards && is_optimizer_shard_name(file)) continue;
      std::error_code ec;
      const uintmax_t size = fs::file_size(fs::path(dir) / file, ec);
      if (ec) fail("{}: \"files\" lists {}, which cannot be read: {}", path.string(), file, ec.message());
      if (static_cast<int64_t>(size) != bytes) {
        fail(
            "{}: {} is {} bytes, but the checkpoint's index recorded {} when it was saved: the file was replaced or "
            "cut since",
            path.string(), file, size, bytes);
      }
    }
  }
  return out;
}

}  // namespace shoestring
