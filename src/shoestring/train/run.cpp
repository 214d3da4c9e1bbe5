#include "shoestring/train/run.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <list>
#include <map>
#include <optional>
#include <random>
#include <set>

#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include "shoestring/core/cpu_features.h"
#if defined(SHOESTRING_WITH_CUDA)
#include "shoestring/core/cuda_host.h"
#endif
#include "shoestring/core/device.h"
#include "shoestring/core/error.h"
#include "shoestring/core/memory_ledger.h"
#include "shoestring/core/threads.h"
#include "shoestring/core/units.h"
#include "shoestring/dist/launch_env.h"
#include "shoestring/io/atomic_file.h"
#include "shoestring/io/safetensors.h"
#include "shoestring/io/weight_files.h"
#include "shoestring/models/architecture.h"
#include "shoestring/nn/chunked_attention.h"
#include "shoestring/optim/factory.h"
#include "shoestring/precision/compute_choice.h"
#include "shoestring/precision/dtype.h"
#include "shoestring/precision/policy.h"
#include "shoestring/train/dataset_config.h"
#include "shoestring/train/device_precision.h"
#include "shoestring/train/sampling.h"

namespace shoestring {
namespace fs = std::filesystem;

RemoveIfEmpty::~RemoveIfEmpty() {
  if (!armed) return;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    if (e.path().filename() != ignored || ignored.empty()) return;  // something else is there
  }
  if (!ignored.empty()) fs::remove(fs::path(dir) / ignored, ec);
  fs::remove(dir, ec);
}

namespace {

std::string step_name(int64_t step) { return fmt::format("step-{:06d}", step); }

/// "step-000123" -> 123 (checkpoint folders are named by step_name); nullopt for any other name.
std::optional<int64_t> step_of_folder(const std::string& name) {
  if (name.size() <= 5 || name.rfind("step-", 0) != 0) return std::nullopt;
  if (!std::all_of(name.begin() + 5, name.end(), [](char ch) { return ch >= '0' && ch <= '9'; })) return std::nullopt;
  return std::strtoll(name.c_str() + 5, nullptr, 10);
}

/// The EMA weights swapped into the model for the lifetime of this object
/// (nothing without EMA); the trained weights come back even when sampling
/// or saving throws.
class EmaWeightsIn {
 public:
  explicit EmaWeightsIn(EMA* ema) : ema_(ema) {
    if (ema_) saved_ = ema_->swap_in();
  }
  ~EmaWeightsIn() {
    if (ema_) ema_->restore(saved_);
  }
  EmaWeightsIn(const EmaWeightsIn&) = delete;
  EmaWeightsIn& operator=(const EmaWeightsIn&) = delete;

 private:
  EMA* ema_;
  std::vector<at::Tensor> saved_;
};

/// The EMA that the rank writing files swaps in by itself (EmaWeightsIn):
/// null without EMA and when it is sharded over the ranks (the trainer then
/// swaps and gathers it on every rank, EmaWeightsOnRankZero).

/// Keeps only metrics records with step <= `keep_through` (used on resume so
/// steps after the checkpoint are not listed twice). Atomic rewrite.
void truncate_metrics(const std::string& path, int64_t keep_through) {
  if (!fs::exists(path)) return;
  std::ifstream in(path);
  std::string line, kept;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    try {
      auto j = nlohmann::json::parse(line);
      if (j.value("step", int64_t{0}) <= keep_through) kept += line + "\n";
    } catch (const nlohmann::json::exception&) {
      break;  // a torn last line from a crash: drop it and everything after
    }
  }
  write_bytes_atomic(path, kept);
}

/// Refuses to go on with a run already at `step` >= max_train_steps: at
/// max_train_steps it is complete (its final files were written before
/// latest.json named its last step; see train()); beyond it, the config
/// asks for fewer steps than the run has. `max_train_epochs` > 0: the step
/// count came from it, and the refusal says to raise it.
void refuse_if_finished(const std::string& run_dir, int64_t step, int64_t max_train_steps, int64_t max_train_epochs) {
  if (step < max_train_steps) return;
  if (max_train_epochs > 0) {
    fail(
        "run '{}' is already at step {} >= max_train_steps {} (max_train_epochs = {}; it is complete: its final "
        "files are in the run folder); raise max_train_epochs (--set max_train_epochs=N) or pass --max-steps N with "
        "N > {} to train further",
        run_dir, step, max_train_steps, max_train_epochs, step);
  }
  if (step > max_train_steps) {
    fail(
        "run '{}' is at step {}, beyond max_train_steps {}: a run does not go back; pass --max-steps N with N > {} "
        "to train further (its checkpoints are in {}/checkpoints)",
        run_dir, step, max_train_steps, step, run_dir);
  }
  fail(
      "run '{}' is already at step {} >= max_train_steps {} (it is complete: its final files are in the run "
      "folder); pass --max-steps N with N > {} to train further",
      run_dir, step, max_train_steps, step);
}

/// Refuses to resume `run_dir` with a config that differs from the run's own
/// config.toml in anything the checkpoint depends on (the schema's resume
/// keys: model, base files, LoRA, optimizer, precision, data order), naming
/// each difference, and refuses a max_train_steps already reached, before
/// any slow work. `checkpoint_dir` is "" for a run that saved none.
void check_resume(const std::string& run_dir, const std::string& checkpoint_dir, const TrainConfig& now, int world) {
  const fs::path recorded = fs::path(run_dir) / "config.toml";
  if (fs::exists(recorded)) {
    const TrainConfig was = load_config(recorded.string());
    TrainConfig compared = now;
    if (!checkpoint_dir.empty() && now.train_batch_size != was.train_batch_size) {
      // Another world size with world x train_batch_size unchanged draws the
      // same images, noise and timesteps per micro-batch: allowed.
      const int64_t was_world =
          load_training_state((fs::path(checkpoint_dir) / "state.safetensors").string()).counters.world_size;
      if (was_world > 0 && was_world * was.train_batch_size == world * now.train_batch_size)
        compared.train_batch_size = was.train_batch_size;
    }
    const std::vector<std::string> diffs = resume_differences(was, compared);
    if (!diffs.empty()) {
      fail(
          "--resume {}: this config differs from the run's own ({}) in what its checkpoint depends on: {}; "
          "resume with the run's config (`shoestring train --resume {}`, with --max-steps N to train further)",
          run_dir, recorded.string(), fmt::join(diffs, "; "), run_dir);
    }
    // What may change on resume (as kohya's --resume allows) is said, since
    // config.toml is rewritten with the new values.
    // With max_train_epochs the step count comes from the epochs (the
    // recorded max_train_steps is the resolved one): not a change by itself.
    TrainConfig now_resolved = now;
    if (now.max_train_epochs > 0) now_resolved.max_train_steps = was.max_train_steps;
    const std::vector<std::string> changed = changed_keys(was, now_resolved);
    if (!changed.empty())
      spdlog::warn("--resume {}: from here on the run trains with changed settings: {}", run_dir,
                   fmt::join(changed, "; "));
  }
  // With max_train_epochs the step count is known once the dataset is
  // loaded: setup_run checks it then (after apply_epochs).
  const auto step = step_of_folder(fs::path(checkpoint_dir).filename().string());
  if (step && now.max_train_epochs == 0) refuse_if_finished(run_dir, *step, now.max_train_steps, 0);
}

/// TrainingCounters::run_id of a run that starts: 64 random bits drawn on
/// rank 0 (std::random_device; all ranks get rank 0's: a collective), as 16
/// hex digits.
std::string draw_run_id(Run& run) {
  std::random_device device;
  const uint64_t bits = (static_cast<uint64_t>(device()) << 32) ^ device();
  at::Tensor id = at::empty({1}, at::TensorOptions().dtype(at::kLong));
  id[0] = static_cast<int64_t>(bits);
  if (run.group) dist::broadcast_tensors(*run.group, {id});
  return fmt::format("{:016x}", static_cast<uint64_t>(id[0].item<int64_t>()));
}

/// Where every rank writes its streamed weights for rank 0's samples and
/// final files when no checkpoint of the step holds them (ZeRO stage 3).
fs::path streamed_weights_dir_of(const std::string& run_dir) { return fs::path(run_dir) / ".streamed-weights"; }

/// Removes the temporaries that writes interrupted by a crash or kill left
/// in the run folder (io/atomic_file.h), saying how much space came back:
/// only those of the files a run writes, in the folders it writes them in
/// (the README's run folder layout), so nothing else in an output_dir is
/// touched. The caller holds the run folder's lock.
void remove_stale_temporaries_of(const std::string& run_dir, bool quiet) {
  auto any_of = [](std::initializer_list<const char*> names) {
    std::set<std::string> set(names.begin(), names.end());
    return [set](const std::string& name) { return set.count(name) > 0; };
  };
  auto step_file = [](const std::string& name, const char* extension) {
    const std::string ext(extension);
    if (name.rfind("step-", 0) != 0 || name.size() <= 5 + ext.size()) return false;
    if (name.compare(name.size() - ext.size(), ext.size(), ext) != 0) return false;
    return std::all_of(name.begin() + 5, name.end() - static_cast<std::ptrdiff_t>(ext.size()),
                       [](char c) { return c >= '0' && c <= '9'; });
  };
  const fs::path root(run_dir);
  StaleTemporaries stale = remove_temporaries(run_dir, any_of({"config.toml", "metrics.jsonl", "model.safetensors",
                                                               "lora.safetensors", "report.html", ".write_probe"}));
  auto add = [&stale](StaleTemporaries more) {
    stale.paths.insert(stale.paths.end(), more.paths.begin(), more.paths.end());
    stale.bytes += more.bytes;
  };
  add(remove_temporaries((root / "checkpoints").string(), any_of({"latest.json"})));
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root / "checkpoints", ec)) {
    if (!e.is_symlink() && e.is_directory() && step_file(e.path().filename().string(), "")) {
      add(remove_temporaries(e.path().string(), [](const std::string& name) {
        return name == "model.safetensors" || name == "lora.safetensors" || name == "state.safetensors" ||
               name == kCheckpointIndexFile || is_optimizer_shard_name(name) ||
               is_model_shard_name(name);  // sharded checkpoints
      }));
    }
  }
  // ZeRO stage 3's streamed weights for samples and final files
  // (hold_streamed_weights_on_rank_zero), left by a run stopped meanwhile.
  const fs::path scratch = streamed_weights_dir_of(run_dir);
  if (fs::is_symlink(scratch, ec)) {
    fs::remove(scratch, ec);  // not ours to empty: only the link goes
  } else if (fs::is_directory(scratch, ec)) {
    for (const auto& e : fs::recursive_directory_iterator(scratch, ec)) {
      if (e.is_regular_file(ec)) {
        stale.paths.push_back(e.path().string());
        stale.bytes += e.file_size(ec);
      }
    }
    fs::remove_all(scratch, ec);
  }
  add(remove_temporaries((root / "samples").string(),
                         [&](const std::string& name) { return step_file(name, ".png") || step_file(name, ".txt"); }));
  if (!stale.paths.empty() && !quiet) {
    spdlog::info("removed {} temporary file(s) ({}) left in {} by interrupted saves", stale.paths.size(),
                 format_bytes(static_cast<int64_t>(stale.bytes)), run_dir);
  }
}

/// The run folder: created, or checked to hold no other run (fresh runs) /
/// the run being resumed (its config must match). Temporaries of
/// interrupted saves are removed. A resumed run that saved no checkpoint
/// starts over from step 0.
void prepare_run_dir(Run& run, const TrainRunOptions& options) {
  run.created_dir.dir = run.run_dir;
  run.created_dir.armed = !fs::exists(run.run_dir);
  run.created_dir.ignored = kRunLockFile;
  ensure_writable_dir(run.run_dir);
  run.lock = std::make_unique<FolderLock>(run.run_dir, kRunLockFile);
  if (!options.resume_dir && !run.created_dir.armed) {
    for (const char* marker : {"checkpoints/latest.json", "metrics.jsonl", "config.toml"}) {
      if (fs::exists(fs::path(run.run_dir) / marker)) {
        fail(
            "output_dir '{}' already holds a run ({} exists); use --resume {} to continue it, or choose "
            "another --output-dir",
            run.run_dir, marker, run.run_dir);
      }
    }
  }
  remove_stale_temporaries_of(run.run_dir, options.quiet);
  if (options.resume_dir) {
    if (fs::exists(fs::path(run.run_dir) / "checkpoints" / "latest.json")) {
      run.resume_from = latest_checkpoint_dir(run.run_dir);
    } else {
      spdlog::warn("--resume {}: the run stopped before its first checkpoint; starting it over from step 0",
                   run.run_dir);
    }
    check_resume(run.run_dir, run.resume_from, run.config, run.world_size());
    run.config.output_dir = run.run_dir;  // the run folder, whatever the config names
  }
}

/// The blocks' compute dtypes as the run log states them: "fp32", or
/// "fp32 / bf16" when blocks differ, "fp32 (instead of bf16)" when the
/// policy's compute substitution took effect.
std::string compute_summary(const precision::Resolution& resolution, const precision::Policy& policy) {
  std::vector<std::string> dtypes;
  bool substituted = false;
  for (const auto& m : resolution.modules) {
    if (!m.block) continue;
    const std::string d = precision::to_string(m.settings.compute);
    if (std::find(dtypes.begin(), dtypes.end(), d) == dtypes.end()) dtypes.push_back(d);
    substituted = substituted || m.settings.compute_substituted;
  }
  if (dtypes.empty()) dtypes.push_back("fp32");
  std::string out = fmt::format("{}", fmt::join(dtypes, " / "));
  if (substituted && policy.compute_substitution()) {
    const auto& sub = *policy.compute_substitution();
    out += fmt::format(" (instead of {})", precision::to_string(sub.from));
  }
  return out;
}

/// Applies the precision policy to the model (storage dtypes, trainable,
/// per-block compute and checkpointing) and attaches the fp16 overflow guard
/// when anything trains or computes in fp16. Returns the per-parameter
/// "keep an fp32 master" choice and whether fp16 training needs loss scaling.
std::pair<std::map<std::string, bool>, bool> apply_precision(Run& run, const TrainRunOptions& options) {
  const TrainConfig& c = run.config;
  torch::nn::Module& model = run.model->module();
  const precision::ComputeHardware hardware = compute_hardware(c);
  const precision::Policy policy = precision_policy(c, hardware);
  run.precision_rules = policy.rules().size();
  const std::vector<nn::BlockTable*> block_tables = run.model->block_tables();
  const precision::Resolution resolution =
      precision::resolve(model, policy, {block_tables.begin(), block_tables.end()});
  for (const auto& w : resolution.warnings) spdlog::warn("{}", w);
  run.compute_summary = compute_summary(resolution, policy);
  if (run.compute_summary.find("instead of") != std::string::npos) {
    const auto& sub = *policy.compute_substitution();
    run.compute_note = fmt::format("; {} compute runs as {}: {}", precision::to_string(sub.from),
                                   precision::to_string(sub.to), sub.reason);
  }
  if (std::any_of(resolution.modules.begin(), resolution.modules.end(), [](const precision::ModuleRow& m) {
        return m.block && m.settings.compute == precision::Dtype::bf16;
      })) {
    const precision::Bf16Compute mode = precision::parse_bf16_compute(c.bf16_compute);
    if (mode == precision::Bf16Compute::bf16 && !hardware.bf16_units) {
      spdlog::warn("{}", precision::bf16_compute_warning(mode, hardware, measure_bf16_matmul_slowdown()));
    }
  }
  {
    ScopedMemoryCategory category(MemoryCategory::weights);
    precision::apply(model, resolution, block_tables);
  }
  if (options.on_model_ready) options.on_model_ready(model);
  bool fp16_training = false;
  std::map<std::string, bool> wants_master;
  for (const auto& p : resolution.params) {
    wants_master[p.path] = p.settings.master_fp32;
    if (p.settings.trainable && p.settings.storage == precision::Dtype::fp16) fp16_training = true;
  }
  for (const auto& m : resolution.modules) {
    if (m.block && m.settings.compute == precision::Dtype::fp16) fp16_training = true;
  }
  if (fp16_training) {
    precision::OverflowOptions oo;
    oo.threshold = c.overflow_threshold;
    oo.auto_upcast = c.auto_upcast;
    run.overflow = precision::OverflowMonitor::attach(model, block_tables, oo);
  }
  return {wants_master, fp16_training};
}

/// The weights a block streaming keeps off a CUDA device from the start
/// (train/block_streaming.h): with offload_params every weight inside a
/// checkpointed block, with zero_stage = 3 on several ranks the trainable
/// ones (each rank keeps only its own there). Empty on the CPU, where the
/// model is built: there is nothing to move.
std::vector<at::Tensor> weights_kept_in_host_memory(const Run& run) {
  const TrainConfig& c = run.config;
  if (run.device.is_cpu()) return {};
  const bool offload = c.offload_params && !run.group;
  const bool zero3 = run.group && c.zero_stage == 3 && c.network_module.empty();
  if (!offload && !zero3) return {};
  const std::vector<at::Tensor> all = run.model->module().parameters(/*recurse=*/true);
  std::vector<at::Tensor> out;
  for (const auto& [block, group] : checkpointed_block_groups(run.model->block_tables(), all)) {
    for (size_t i : group) {
      if (offload || all[i].requires_grad()) out.push_back(all[i]);
    }
  }
  return out;
}

/// Moves the model (built in host memory) to the run's device, except the
/// `kept` weights (weights_kept_in_host_memory), which stay where they are:
/// the device never holds the whole model, so a model larger than the
/// device can start (DeepSpeed's zero.Init and ZeRO-Infinity leave the
/// device out likewise).
void move_model_to_device(Run& run, const std::vector<at::Tensor>& kept) {
  if (run.device.is_cpu()) return;
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> values;
  values.reserve(kept.size());
  for (at::Tensor p : kept) {
    values.push_back(p.data());  // the same storage, outside the module's reach
    p.set_data(at::empty({0}, p.options()));
  }
  {
    // Weights move in their storage dtypes; LoRA adapters, gradients,
    // optimizer state, EMA and masters are then created beside them.
    ScopedMemoryCategory category(MemoryCategory::weights);
    run.model->module().to(run.device);
  }
  for (size_t i = 0; i < kept.size(); ++i) {
    at::Tensor p = kept[i];
    p.set_data(values[i]);
  }
}

/// ZeRO stage 3 on a device: the streamed weights this rank owns join it
/// (before masters, optimizer state and EMA shadows are made beside them);
/// the others stay in host memory until ZeroSharding::start_streaming
/// empties them.
void move_owned_weights_to_device(Run& run) {
  if (run.device.is_cpu() || !run.zero) return;
  at::NoGradGuard no_grad;
  ScopedMemoryCategory category(MemoryCategory::weights);
  const std::vector<bool> owned = run.zero->owned();
  for (size_t i = 0; i < run.trainable.size(); ++i) {
    at::Tensor p = run.trainable[i].second;
    if (owned[i] && p.device() != run.device) p.set_data(p.data().to(run.device));
  }
}

/// LoRA (docs/lora.md): the base model is frozen; only the adapters train.
void attach_lora(Run& run, const TrainRunOptions& options) {
  const TrainConfig& c = run.config;
  torch::nn::Module& model = run.model->module();
  nn::freeze_parameters(model);
  nn::LoraOptions adapters = lora_options(c);
  adapters.device = run.device;  // also for base weights kept in host memory (offload_params)
  run.network = nn::LoraNetwork(model, run.model->lora_components(c.network_train_unet_only), adapters);
  if (!c.network_weights.empty()) run.network->load(expand_path(c.network_weights));
  if (c.pretrained_model_name_or_path.empty() && c.network_weights.empty()) {
    spdlog::warn(
        "LoRA on a randomly initialised base (pretrained_model_name_or_path is not set): the adapters "
        "learn on top of an untrained model");
  }
  if (!options.quiet) {
    spdlog::info("LoRA: {} modules, rank {}, alpha {}{}", run.network->modules().size(), c.network_dim, c.network_alpha,
                 c.network_weights.empty() ? "" : ", from " + c.network_weights);
  }
}

/// The gradient path and its optimizer over run.trainable (optim/gradient_path.h).
std::unique_ptr<GradientPath> make_run_gradient_path(const Run& run, const std::map<std::string, bool>& wants_master,
                                                     bool fp16_training) {
  const TrainConfig& c = run.config;
  OptimizerOptions oopts;
  oopts.stochastic_rounding = c.stochastic_rounding;
  oopts.seed = static_cast<uint64_t>(c.seed);
  oopts.state_dtype = c.optimizer_state_dtype == "bf16" ? torch::kBFloat16 : torch::kFloat32;
  oopts.offload_state = c.offload_optimizer_state || c.offload_params;  // offloaded weights: their state too
  GradientPathOptions go;
  go.accumulation_steps = c.gradient_accumulation_steps;
  go.max_grad_norm = c.max_grad_norm;
  go.fused_backward = c.fused_backward_pass;
  go.fused_clip_method = parse_fused_clip_method(c.fused_clip_method);
  go.low_precision_weights = c.full_bf16;
  go.accumulation_mode = parse_grad_accumulation_mode(c.gradient_accumulation_dtype);
  go.seed = static_cast<uint64_t>(c.seed);
  go.loss_scaling.enabled = fp16_training;
  go.loss_scaling.init_scale = c.loss_scale_init;
  go.loss_scaling.growth_interval = c.loss_scale_growth_interval;
  go.reduced_across_ranks = run.group != nullptr;
  go.world_size = run.world_size();
  if (run.zero && (run.zero->stage() >= 2 || c.fused_backward_pass)) {
    // Each rank holds its own tensors' gradients: the global norm sums every rank's part.
    dist::ZeroSharding* zero = run.zero.get();
    go.sum_squared_norm = [zero](double squared) { return zero->sum_over_ranks(squared); };
  }
  if (run.group && c.fused_backward_pass) {
    // Each parameter's step gradient is summed over the ranks inside
    // backward, in buckets: all-reduced at stage 0, reduced to its owner at
    // stages 1-2 (which alone steps it; dist::ZeroSharding's owners).
    FusedReduction reduction;
    reduction.rank = run.rank();
    reduction.bucket_bytes = fused_bucket_bytes(run.trainable_parameters, run.zero ? run.world_size() : 1);
    reduction.root_of.assign(run.trainable.size(), -1);
    // Stage 3: a rank keeps its own tensors' accumulation buffers only, so
    // every micro-batch's gradients are summed over the ranks.
    reduction.every_micro_batch = run.zero && run.zero->stage() == 3;
    if (run.zero) {
      for (size_t i = 0; i < run.trainable.size(); ++i) reduction.root_of[i] = run.zero->ownership().owner(i);
    }
    dist::ProcessGroup* group = run.group.get();
    reduction.start = [group](const at::Tensor& flat, int root) -> std::function<void()> {
      auto pending = std::make_shared<dist::PendingCollective>(root < 0 ? group->all_reduce_sum_async(flat)
                                                                        : group->reduce_sum_async(flat, root));
      return [pending] { pending->wait(); };
    };
    go.fused_reduction = std::move(reduction);
  }
  // ZeRO: an fp32 master is optimizer state (the ZeRO paper's K = 12 bytes
  // per parameter with Adam count it), kept by the tensor's owner only.
  const std::vector<bool> owned = run.zero ? run.zero->owned() : std::vector<bool>(run.trainable.size(), true);
  std::vector<bool> use_master;
  for (size_t i = 0; i < run.trainable.size(); ++i) {
    auto it = wants_master.find(run.trainable[i].first);
    use_master.push_back(it != wants_master.end() && it->second && owned[i]);
  }
  return make_gradient_path(
      run.trainable, use_master,
      [&](const std::vector<std::pair<std::string, at::Tensor>>& params) {
        return make_optimizer(c.optimizer_type, c.optimizer_args, params, oopts);
      },
      go);
}

/// The trainable weights' storage for the setup log: "fp32"; "bf16
/// (stochastic rounding)" or "(round-to-nearest)" where the optimizer
/// writes them, "(from fp32 masters)" where masters do; or, when precision
/// rules mix dtypes, each with its tensor count ("fp16 x 12, fp32 x 215").
std::string trainable_weights_summary(const Run& run) {
  std::map<std::string, int64_t> tensors;  // dtype -> trainable tensors
  for (const auto& [n, p] : run.trainable) tensors[precision::name_of(p.scalar_type())] += 1;
  if (tensors.size() > 1) {
    std::vector<std::string> parts;
    for (const auto& [dtype, count] : tensors) parts.push_back(fmt::format("{} x {}", dtype, count));
    return fmt::format("{}", fmt::join(parts, ", "));
  }
  if (tensors.empty() || tensors.begin()->first == "fp32") return "fp32";
  const char* how = run.gradients->master_count() > 0 ? "from fp32 masters"
                    : run.config.stochastic_rounding  ? "stochastic rounding"
                                                      : "round-to-nearest";
  return fmt::format("{} ({})", tensors.begin()->first, how);
}

void log_setup(const Run& run) {
  const TrainConfig& c = run.config;
  spdlog::info("{} | BLAS {}", describe(cpu_features()), blas_kernels());
  spdlog::info("device: {}{}", describe_device(run.device),
               run.device.is_cpu() ? "" : "; dataset and caches in host memory, sent a batch at a time");
  if (!run.device_note.empty()) spdlog::info("{}", run.device_note);
  spdlog::info("model: {:.2f}M trainable parameters, weights {}, {}, {} threads (OpenMP wait {}); optimizer {}{}",
               run.trainable_parameters / 1e6, trainable_weights_summary(run), "compute " + run.compute_summary,
               run.threads, omp_wait_policy(), c.optimizer_type, c.fused_backward_pass ? " (fused backward)" : "");
  const precision::LossScaler* scaler = run.gradients->loss_scaler();
  spdlog::info("precision: {} rule(s) (docs/precision.md){}{}{}", run.precision_rules,
               scaler ? fmt::format(", fp16 with dynamic loss scaling (init {})", scaler->scale()) : std::string(),
               run.gradients->master_count() > 0
                   ? fmt::format(", {} fp32 master weights ({})", run.gradients->master_count(),
                                 format_bytes(run.gradients->master_bytes()))
                   : std::string(),
               run.compute_note);
}

/// Writes the kohya LoRA file (networks.lora keys, ss_* metadata). The final
/// file follows save_precision; checkpoints keep the trained dtype (exact resume).
void save_lora(const Run& run, const std::string& path, int64_t step, bool final_file) {
  const TrainConfig& c = run.config;
  // kohya's ss_base_model_version (A1111 and ComfyUI tell SDXL LoRAs by it)
  // and Stability's model-spec architecture for LoRA files, from the registry.
  const models::Architecture& arch = models::find_architecture(c.architecture);
  auto meta = nn::kohya_lora_metadata(run.network->options(), arch.kohya_base_model_version.empty()
                                                                  ? "shoestring_" + c.architecture
                                                                  : arch.kohya_base_model_version);
  if (!arch.modelspec_lora_architecture.empty()) {
    meta["modelspec.sai_model_spec"] = "1.0.0";
    meta["modelspec.architecture"] = arch.modelspec_lora_architecture;
    meta["modelspec.implementation"] = "https://github.com/Stability-AI/generative-models";
    meta["modelspec.title"] = fmt::format("{} step {}", fs::path(run.run_dir).filename().string(), step);
  }
  meta["ss_steps"] = std::to_string(step);
  meta["ss_max_train_steps"] = std::to_string(c.max_train_steps);
  meta["ss_learning_rate"] = fmt::format("{}", c.learning_rate);
  meta["ss_optimizer"] = c.optimizer_type;
  meta["ss_seed"] = std::to_string(c.seed);
  meta["ss_mixed_precision"] = c.full_bf16 ? "bf16" : c.mixed_precision;
  meta["ss_full_bf16"] = c.full_bf16 ? "True" : "False";
  // kohya's save_precision applies to the LoRA file too ("auto": as trained).
  std::optional<torch::Dtype> dtype;
  if (final_file && c.save_precision == "fp16") dtype = torch::kHalf;
  if (final_file && c.save_precision == "bf16") dtype = torch::kBFloat16;
  if (final_file && (c.save_precision == "fp32" || c.save_precision == "float")) dtype = torch::kFloat32;
  run.network->save(path, meta, dtype);
}

/// Joins the process group when the launch environment `env` (torchrun,
/// `shoestring launch`; dist/launch_env.h) makes this process one rank of
/// several: Gloo for host tensors, and NCCL for the rank's GPU when the run
/// is on CUDA. Ranks other than 0 then log errors only.
void join_process_group(Run& run, const dist::LaunchEnvironment& env) {
  if (!env.distributed()) {
    if (run.config.zero_stage > 0)
      spdlog::warn("zero_stage = {} has no effect in one process (WORLD_SIZE unset or 1): nothing is sharded",
                   run.config.zero_stage);
    return;
  }
  if (env.rank != 0) spdlog::set_level(spdlog::level::err);
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(run.config.ddp_timeout * 60'000));
  run.group = dist::ProcessGroup::connect(env, timeout, run.device);
  spdlog::info("data parallel (zero_stage = {}): {} processes, {}; {}; ddp_timeout = {} min", run.config.zero_stage,
               env.world_size, dist::describe(env), run.group->backends(), run.config.ddp_timeout);
}

/// A rank other than 0 reads the run folder rank 0 prepares (and writes):
/// the checkpoint it resumes from.
void follow_run_dir(Run& run, const TrainRunOptions& options) {
  if (!options.resume_dir) return;
  if (fs::exists(fs::path(run.run_dir) / "checkpoints" / "latest.json"))
    run.resume_from = latest_checkpoint_dir(run.run_dir);
  run.config.output_dir = run.run_dir;
}

/// What data parallel does not cover yet, refused before the first step.
void check_data_parallel(const Run& run) {
  const TrainConfig& c = run.config;
  const std::string stage = c.zero_stage > 0 ? fmt::format(", zero_stage = {}", c.zero_stage) : std::string();
  // Every gradient path runs with several processes: autograd's and the
  // master-weights path (fp16 loss scaling, fp32 masters) read the reduced
  // .grad, and an overflowing step's skip follows the global norm, which
  // every rank agrees on; the accumulator path (full_bf16 with accumulation)
  // sums the micro-batches in its buffers, then into .grad in fp32 before
  // the reduction (GradientPath::sum_into_grad); at stage 3 its buffers
  // take the streamed blocks' gradients summed over the ranks after each
  // backward (ZeroSharding::set_streamed_gradient_sink); the fused path
  // reduces each parameter's step gradient inside backward (fused_reduction),
  // at stage 3 the streamed ones too.
  if (c.offload_params) {
    fail(
        "WORLD_SIZE = {}{}: offload_params is for one process for now (zero_stage = 3 shards the weights over the "
        "ranks instead)",
        run.world_size(), stage);
  }
  if (c.zero_stage == 3 && run.block_streaming && run.block_streaming->blocks() == 0 && run.network) {
    fail(
        "WORLD_SIZE = {}{}: stage 3 shards the weights inside the model's checkpointed blocks, and a LoRA "
        "network's adapters (network_module = \"{}\") live outside them, so there is nothing to stream; use "
        "zero_stage = 2, which shards the adapters' optimizer state and gradients (the adapters themselves are small)",
        run.world_size(), stage, c.network_module);
  }
  if (c.zero_stage == 3 && run.block_streaming && run.block_streaming->blocks() == 0) {
    fail(
        "WORLD_SIZE = {}{}: stage 3 shards the weights of the checkpointed blocks (gathered again for their "
        "recompute in backward), and this run checkpoints no block holding trainable weights: set "
        "gradient_checkpointing = true (or precision rules with checkpoint = true)",
        run.world_size(), stage);
  }
}

/// What a rank restores of checkpoint `dir` beside the weights.
struct RestoredState {
  /// The optimizer state this rank keeps, by key ("<param>.<state>"): with
  /// ZeRO, that of the tensors it owns under this run's TensorOwnership (so
  /// a checkpoint of any world size and stage re-shards on load); otherwise
  /// all of it.
  std::map<std::string, at::Tensor> optimizer;
  /// Every EMA shadow of the checkpoint, by parameter name (EMA::load keeps
  /// its own): a sharded checkpoint's are in its ranks' shards.
  std::map<std::string, at::Tensor> ema;
  /// The fp32 master weights by parameter name (MasterWeights keeps those it
  /// has: with ZeRO, its owned tensors'): a sharded checkpoint's are in its
  /// ranks' shards.
  std::map<std::string, at::Tensor> master;
};

/// Reads RestoredState through the index of a sharded checkpoint (read and
/// its files mapped once; each rank reads only its tensors), or from `state`
/// (a single-file checkpoint's state.safetensors, lazily mapped). Throws
/// shoestring::Error naming the file of an optimizer key that belongs to no
/// trainable parameter, and what read_checkpoint_index throws.
RestoredState restored_state(const Run& run, const std::string& dir, const TrainingState& state) {
  auto keeps = [&](const std::string& key, const std::string& file) {
    if (!run.zero) return true;
    const std::optional<size_t> param = run.zero->parameter_of_state(key);
    if (!param) fail("{}: optimizer state '{}' belongs to no trainable parameter of this run", file, key);
    return run.zero->ownership().owner(*param) == run.rank();
  };
  RestoredState out;
  std::map<std::string, const at::Tensor*> trainable;
  for (const auto& [name, p] : run.trainable) trainable.emplace(name, &p);
  // An fp32 master becomes its weight (rounded) on every rank: one that is
  // not fp32, not finite or misshapen is refused, naming its file.
  auto take_master = [&](const std::string& name, const at::Tensor& t, const std::string& file) {
    const auto it = trainable.find(name);
    if (it != trainable.end()) {
      if (t.scalar_type() != at::kFloat) {
        fail("{}: the fp32 master weight 'master.{}' is {}, expected float32", file, name,
             c10::toString(t.scalar_type()));
      }
      if (t.sizes() != it->second->sizes()) {
        fail("{}: the fp32 master weight 'master.{}' has shape {}, its parameter {}", file, name,
             format_shape(t.sizes()), format_shape(it->second->sizes()));
      }
      if (!at::isfinite(t).all().item<bool>())
        fail("{}: the fp32 master weight 'master.{}' holds inf or NaN", file, name);
    }
    out.master.emplace(name, t);
  };
  const std::string state_file = (fs::path(dir) / "state.safetensors").string();
  out.ema.insert(state.ema.begin(), state.ema.end());
  for (const auto& [name, t] : state.master) take_master(name, t, state_file);
  const std::optional<CheckpointIndex> index = read_checkpoint_index(dir);
  if (!index) {
    for (const auto& [key, t] : state.optimizer) {
      if (keeps(key, state_file)) out.optimizer.emplace(key, t);
    }
    return out;
  }
  const std::string optimizer_prefix = "optimizer.", ema_prefix = "ema.", master_prefix = "master.";
  const WeightFiles files = WeightFiles::open((fs::path(dir) / kCheckpointIndexFile).string());
  for (const auto& [name, file] : index->weight_map) {
    if (name.rfind(optimizer_prefix, 0) == 0) {
      const std::string key = name.substr(optimizer_prefix.size());
      if (keeps(key, files.file_of(name))) out.optimizer.emplace(key, files.get(name));
    } else if (name.rfind(ema_prefix, 0) == 0) {
      out.ema.emplace(name.substr(ema_prefix.size()), files.get(name));
    } else if (name.rfind(master_prefix, 0) == 0) {
      take_master(name.substr(master_prefix.size()), files.get(name), (fs::path(dir) / files.file_of(name)).string());
    }
  }
  return out;
}

/// The sampler position to resume at. Its index counts global micro-batches
/// of world x train_batch_size images; when that product differs from the
/// checkpoint's, the position is converted through the images drawn so far
/// of the epoch (rounded down), and the change of the global batch is
/// logged.
BatchSampler::Position resumed_data_position(const Run& run, const TrainingCounters& saved, const std::string& file) {
  BatchSampler::Position p{saved.data_epoch, saved.data_index};
  if (saved.world_size <= 0 || saved.train_batch_size <= 0) return p;  // an older checkpoint: as it was
  const TrainConfig& c = run.config;
  const int64_t was_rows = saved.world_size * saved.train_batch_size;
  const int64_t now_rows = run.world_size() * c.train_batch_size;
  const int64_t was_global = was_rows * saved.gradient_accumulation_steps;
  const int64_t now_global = now_rows * c.gradient_accumulation_steps;
  if (saved.world_size != run.world_size() || was_global != now_global) {
    const std::string now_shape = fmt::format("{} rank(s) x train_batch_size {} x gradient_accumulation_steps {}",
                                              run.world_size(), c.train_batch_size, c.gradient_accumulation_steps);
    const std::string was_shape = fmt::format("{} rank(s) x {} x {}", saved.world_size, saved.train_batch_size,
                                              saved.gradient_accumulation_steps);
    if (was_global == now_global) {
      spdlog::info("resumed at {} rank(s) from a checkpoint of {} ({}): global batch {} images per step ({}) as before",
                   run.world_size(), saved.world_size, file, now_global, now_shape);
    } else {
      spdlog::warn(
          "resumed at {} rank(s) from a checkpoint of {} ({}): the global batch is now {} images per step ({}), it "
          "was {} ({}); learning rate and schedule stay as configured (not rescaled); to keep {} images per step, "
          "set train_batch_size x gradient_accumulation_steps = {} per rank",
          run.world_size(), saved.world_size, file, now_global, now_shape, was_global, was_shape, was_global,
          was_global % run.world_size() == 0
              ? std::to_string(was_global / run.world_size())
              : fmt::format("{} / {} (not a whole number)", was_global, run.world_size()));
    }
  }
  if (was_rows != now_rows) {
    const int64_t images = p.index * was_rows;
    p.index = images / now_rows;
    if (p.index >= run.sampler->batches_per_epoch()) p = {p.epoch + 1, 0};
  }
  return p;
}

/// kohya's "num train images * repeats": "20 images x 10 repeats + 5 images x
/// 1 repeat = 205 entries" (repeats from the largest; square datasets: 1 each).
/// "1 image", "2 images": `n`, then `one` when n is 1, else `many`.
std::string count_of(int64_t n, const char* one, const char* many) {
  return fmt::format("{} {}", n, n == 1 ? one : many);
}

std::string entries_text(const ImageCaptionDataset& dataset, int64_t entries) {
  std::map<int64_t, int64_t, std::greater<>> images_of;  // repeats -> images
  for (int64_t i = 0; i < dataset.size(); ++i) ++images_of[dataset.bucketed() ? dataset.num_repeats(i) : 1];
  std::vector<std::string> parts;
  for (const auto& [repeats, images] : images_of) {
    parts.push_back(count_of(images, "image", "images") + " x " + count_of(repeats, "repeat", "repeats"));
  }
  return fmt::format("{} = {}", fmt::join(parts, " + "), count_of(entries, "entry", "entries"));
}

/// Epochs (train/epochs.h): the run's steps_per_epoch, and max_train_epochs
/// turned into max_train_steps as kohya's train_network.py does (epochs win
/// over max_train_steps; the log says so).
void apply_epochs(Run& run, bool quiet) {
  TrainConfig& c = run.config;
  const int64_t batches = run.sampler->batches_per_epoch();
  run.steps_per_epoch = steps_per_epoch(batches, c.gradient_accumulation_steps);
  if (c.max_train_epochs == 0 && c.save_every_n_epochs == 0) return;
  const int64_t configured_steps = c.max_train_steps;
  if (c.max_train_epochs > 0) c.max_train_steps = steps_for_epochs(c.max_train_epochs, run.steps_per_epoch);
  if (quiet) return;
  const std::string per_epoch =
      fmt::format("epochs: {} per epoch; {} / gradient_accumulation_steps {} = {} per epoch",
                  entries_text(run.dataset, run.sampler->dataset_size()), count_of(batches, "batch", "batches"),
                  c.gradient_accumulation_steps, count_of(run.steps_per_epoch, "step", "steps"));
  if (c.max_train_epochs > 0) {
    spdlog::info("{}; {} = {} (max_train_epochs overrides max_train_steps = {}, as in kohya)", per_epoch,
                 count_of(c.max_train_epochs, "epoch", "epochs"), count_of(c.max_train_steps, "step", "steps"),
                 configured_steps);
  } else {
    spdlog::info("{}", per_epoch);
  }
  if (batches % c.gradient_accumulation_steps != 0) {
    spdlog::info(
        "epochs: {} batches are not a multiple of gradient_accumulation_steps {}: the last step of each epoch also "
        "takes the first {} micro-batch(es) of the next (kohya's sums only the {} left); epoch e still ends at step "
        "e x {}",
        batches, c.gradient_accumulation_steps, c.gradient_accumulation_steps - batches % c.gradient_accumulation_steps,
        batches % c.gradient_accumulation_steps, run.steps_per_epoch);
  }
}

}  // namespace

std::unique_ptr<Run> setup_run(const TrainConfig& config, const TrainRunOptions& options_in) {
  TrainRunOptions options = options_in;  // an elastic restart resumes (below)
  auto owned = std::make_unique<Run>();
  Run& run = *owned;
  run.config = config;
  // The device first: a request the machine cannot meet fails before any
  // work. Each rank of several on CUDA takes its own GPU.
  const dist::LaunchEnvironment launch = dist::launch_environment();
  run.device = dist::rank_device(launch, resolve_device(config.device, "device"),
                                 config.device.find(':') != std::string::npos, cuda_availability().device_count);
#if defined(SHOESTRING_WITH_CUDA)
  if (run.device.is_cuda()) cuda_host::set_device(run.device.index());
#endif
  run.device_note = adapt_precision_to_device(run.config, run.device);
  run.run_dir = options.resume_dir.value_or(expand_path(config.output_dir));
  // Contradictions in the config fail before the run folder is touched.
  check_training_config(run.config);
  std::vector<DatasetSpec> dataset_specs_of_run;  // kohya datasets (train/dataset_config.h), when used
  if (uses_kohya_datasets(run.config)) {
    dataset_specs_of_run = dataset_specs(run.config);
    check_training_datasets(run.config, dataset_specs_of_run);
  }
  join_process_group(run, launch);
  if (launch.restart_count > 0 && !options.resume_dir) {
    // torchrun --max_restarts started this group again after a rank failed:
    // the run goes on in its folder from its latest checkpoint (from step 0
    // when it saved none), as `--resume` would.
    options.resume_dir = run.run_dir;
    spdlog::info("restart {} of an elastic launch (TORCHELASTIC_RESTART_COUNT): resuming {} from its latest checkpoint",
                 launch.restart_count, run.run_dir);
  }
  if (run.writes_files()) {
    prepare_run_dir(run, options);
  } else {
    follow_run_dir(run, options);
  }
  const TrainConfig& c = run.config;

  MemoryLedger::global().install();
  // Processes on one machine share its CPUs (unless num_threads says otherwise).
  run.threads = c.num_threads > 0 || launch.local_world_size == 1
                    ? configure_threads(c.num_threads)
                    : configure_threads(std::max(1, configure_threads(0) / launch.local_world_size));
  torch::manual_seed(static_cast<uint64_t>(c.seed));

  // ---- data ----
  // Latents cached on disk: an image is decoded only when its entry is missing.
  const DatasetSelection selection{c.max_train_images, static_cast<uint64_t>(c.max_train_images_seed),
                                   /*decode_on_demand=*/c.cache_latents_to_disk};
  if (!dataset_specs_of_run.empty()) {
    // kohya's datasets in aspect-ratio buckets: a batch is one bucket's.
    run.dataset = ImageCaptionDataset::load_buckets(dataset_specs_of_run, static_cast<uint64_t>(c.seed), selection);
    std::vector<SamplerBucket> buckets = sampler_buckets(run.dataset);
    int64_t entries = 0;
    for (SamplerBucket& b : buckets) {
      entries += static_cast<int64_t>(b.samples.size());
      if (run.world_size() > 1) {
        // Every rank trains on its rows of one global batch of the bucket.
        if (b.batch_size != c.train_batch_size) {
          fail("with {} processes every dataset's batch_size must equal train_batch_size ({}); a dataset has {}",
               run.world_size(), c.train_batch_size, b.batch_size);
        }
        b.batch_size *= run.world_size();
      }
    }
    if (!options.quiet) {
      spdlog::info(
          "dataset: {} images ({} with repeats) in {} bucket{} from {} dataset{} ({} skipped; captions: {} "
          "missing, {} empty, {} from class_tokens)",
          run.dataset.size(), entries, run.dataset.buckets().size(), run.dataset.buckets().size() == 1 ? "" : "s",
          dataset_specs_of_run.size(), dataset_specs_of_run.size() == 1 ? "" : "s", run.dataset.skipped().size(),
          run.dataset.caption_stats().missing, run.dataset.caption_stats().empty,
          run.dataset.caption_stats().class_tokens);
      for (const std::string& line : run.dataset.bucket_report()) spdlog::info("  {}", line);
    }
    // One process: a bucket's leftovers form a smaller last batch (kohya);
    // several: they wait for the next epoch (every rank needs its rows).
    run.sampler = std::make_unique<BatchSampler>(std::move(buckets), static_cast<uint64_t>(c.seed),
                                                 /*partial_batches=*/run.world_size() == 1);
  } else {
    const std::string data_dir = expand_path(c.train_data_dir);
    run.dataset = ImageCaptionDataset::load(data_dir, static_cast<int>(c.resolution), c.twemoji_categories, selection);
    if (!options.quiet) {
      spdlog::info("dataset: {} images from {} ({} skipped; captions: {} missing, {} empty)", run.dataset.size(),
                   data_dir, run.dataset.skipped().size(), run.dataset.caption_stats().missing,
                   run.dataset.caption_stats().empty);
    }
    // Every rank draws the same global batches (world x train_batch_size) and
    // trains on its own rows of each (train_step).
    const int64_t global_batch = c.train_batch_size * run.world_size();
    if (run.dataset.size() < global_batch) {
      fail(
          "{}: {} image{} loaded{}, fewer than train_batch_size {}{}: no full batch can be formed (without "
          "buckets only full batches are trained); lower train_batch_size{}",
          data_dir, run.dataset.size(), run.dataset.size() == 1 ? "" : "s",
          c.max_train_images > 0 ? fmt::format(" (max_train_images = {})", c.max_train_images) : "", c.train_batch_size,
          run.world_size() > 1 ? fmt::format(" x {} ranks = {}", run.world_size(), global_batch) : "",
          c.max_train_images > 0 ? " or raise max_train_images" : " or add images");
    }
    run.sampler = std::make_unique<BatchSampler>(run.dataset.size(), c.train_batch_size * run.world_size(),
                                                 static_cast<uint64_t>(c.seed));
  }

  if (c.max_train_images > 0 && !options.quiet) {
    spdlog::info("max_train_images = {} (max_train_images_seed = {}): {} of the {} images listed, {} loaded{}",
                 c.max_train_images, c.max_train_images_seed, std::min(c.max_train_images, run.dataset.listed_images()),
                 run.dataset.listed_images(), run.dataset.size(),
                 c.max_train_images >= run.dataset.listed_images() ? " (the whole dataset: it has no more)" : "");
  }
  apply_epochs(run, options.quiet);  // max_train_epochs, save_every_n_epochs
  if (c.max_train_epochs > 0 && !run.resume_from.empty()) {
    // The step count is known now: a finished run is refused before the model is built (check_resume could not).
    if (const auto step = step_of_folder(fs::path(run.resume_from).filename().string()))
      refuse_if_finished(run.run_dir, *step, c.max_train_steps, c.max_train_epochs);
  }

  // ---- model (base weights of a fine-tune / LoRA run: kohya's pretrained_model_name_or_path) ----
  {
    ModelSource source;
    // A resumed run's weights are then overwritten from its checkpoint (restore_checkpoint below).
    if (!c.pretrained_model_name_or_path.empty()) source.pretrained = expand_path(c.pretrained_model_name_or_path);
    source.resume_dir = run.resume_from;
    source.quiet = options.quiet;
    source.device = run.device;
    source.cache_share = cache_share(run.rank(), run.world_size(), c.ddp_timeout);
    if (!c.network_module.empty() && !c.network_weights.empty()) {
      // network_weights must fit the network before the dataset is encoded.
      source.check_module = [&c](torch::nn::Module& module, const std::vector<nn::LoraComponent>& components) {
        nn::LoraNetwork(module, components, lora_options(c))->check_file(expand_path(c.network_weights));
      };
    }
    run.model = make_training_model(c, run.dataset, source);
  }
  const auto [wants_master, fp16_training] = apply_precision(run, options);
  move_model_to_device(run, weights_kept_in_host_memory(run));
  nn::set_attention_chunk_bytes(c.attention_chunk_mib * (int64_t{1} << 20));
  run.model->module().train();
  if (!c.network_module.empty()) attach_lora(run, options);
  for (const auto& item :
       (run.network ? run.network->named_parameters(true) : run.model->module().named_parameters(true))) {
    if (item.value().requires_grad()) run.trainable.emplace_back(item.key(), item.value());
  }
  for (const auto& [n, p] : run.trainable) run.trainable_parameters += p.numel();
  if (run.group) {
    // Every rank starts from rank 0's weights (a resumed run's are then
    // restored from the same checkpoint on every rank).
    std::vector<at::Tensor> shared;
    for (const auto& [n, p] : run.trainable) shared.push_back(p);
    for (const auto& b : run.model->module().buffers(true)) shared.push_back(b);
    dist::broadcast_tensors(*run.group, shared);
  }

  // ---- gradients and optimizer ----
  // Gradients are charged to the ledger's "gradients" category the moment
  // autograd accumulates them (before the fused path's own hooks run).
  std::vector<at::Tensor> params;
  for (const auto& [n, p] : run.trainable) params.push_back(p);
  run.ledger_hooks.install(params, [](size_t, at::Tensor& p) {
    if (p.grad().defined()) MemoryLedger::global().recharge(p.grad(), MemoryCategory::gradients);
  });
  // ZeRO: each rank's optimizer updates, and keeps state for, the tensors it owns.
  if (run.group && c.zero_stage > 0) {
    run.zero = std::make_unique<dist::ZeroSharding>(*run.group, run.trainable, c.zero_stage);
    run.zero->set_prefetch(c.zero3_prefetch);
    if (c.zero_stage == 3) {
      run.block_streaming = ZeroBlockStreaming::attach(*run.zero, run.model->block_tables(), run.trainable);
      move_owned_weights_to_device(run);
    }
  }
  run.gradients = make_run_gradient_path(run, wants_master, fp16_training);
  if (run.group) {
    check_data_parallel(run);
    if (run.zero) {
      run.gradients->optimizer().set_update_subset(run.zero->owned());
      if (run.zero->stage() == 3 && run.gradients->reduced_in_backward()) {
        run.zero->set_streamed_gradients_reduced_in_backward();
      } else if (run.zero->stage() == 3 && run.gradients->takes_reduced_gradients()) {
        GradientPath* path = run.gradients.get();
        run.zero->set_streamed_gradient_sink(
            [path](size_t i, const at::Tensor& sum) { path->add_reduced_gradient(i, sum); });
      }
    } else {
      run.gradient_reducer = std::make_unique<dist::GradientReducer>(*run.group, params);
      dist::GradientReducer* reducer = run.gradient_reducer.get();
      run.reducer_hooks.install(params, [reducer](size_t i, at::Tensor&) { reducer->gradient_ready(i); });
    }
  }
  if (c.offload_params && !run.group) {
    // Gradients go to host memory block by block: only autograd's .grad path.
    if (run.gradients->name() != "autograd") {
      fail(
          "offload_params streams each block's weights and moves its gradients to host memory after its backward; "
          "the '{}' gradient path ({}) keeps them elsewhere: remove it to offload",
          run.gradients->name(),
          run.gradients->name() == "fused backward" ? "fused_backward_pass = true"
          : run.gradients->name() == "accumulator"
              ? "full_bf16 = true with gradient_accumulation_steps > 1"
              : "fp16 loss scaling, from mixed_precision = \"fp16\" or full_fp16 = true, or fp32 master weights, from "
                "precision rules with master = \"fp32\"");
    }
    run.block_streaming =
        HostBlockStreaming::attach(run.model->block_tables(), run.model->module(), run.trainable, run.device);
    if (run.block_streaming->blocks() == 0) {
      fail(
          "offload_params streams the weights of checkpointed blocks (copied to the device again for their "
          "recompute in backward), and this run checkpoints none: set gradient_checkpointing = true (or precision "
          "rules with checkpoint = true)");
    }
  }
  // ZeRO: each rank keeps the EMA of the tensors it owns (their updated
  // values are on the owner first), saved in its checkpoint shard.
  if (c.ema_decay > 0)
    run.ema = std::make_unique<EMA>(run.trainable, c.ema_decay, run.zero ? run.zero->owned() : std::vector<bool>{});
  if (options.predict_memory) run.predicted_memory = options.predict_memory(c, run.model->plan_vocab_size());

  // ---- run folder ----
  const std::string metrics_path = (fs::path(run.run_dir) / "metrics.jsonl").string();
  if (!run.resume_from.empty()) {
    const int64_t step = restore_checkpoint(run, run.resume_from);
    refuse_if_finished(run.run_dir, step, c.max_train_steps, c.max_train_epochs);
  }
  // A fresh run (or one resumed from a checkpoint older than run ids) draws its id.
  if (run.counters.run_id.empty()) run.counters.run_id = draw_run_id(run);
  // The run folder always records the config that is running (a resume may
  // have raised max_train_steps), first: a run killed from here on can be
  // resumed (`--resume` reads this file).
  if (run.writes_files()) write_bytes_atomic((fs::path(run.run_dir) / "config.toml").string(), to_toml(c));
  if (!run.resume_from.empty()) {
    if (run.writes_files()) truncate_metrics(metrics_path, run.counters.step);
    if (!options.quiet) spdlog::info("resumed from {} at step {}", run.resume_from, run.counters.step);
    if (c.max_train_minutes > 0 && !options.quiet) {
      spdlog::info("max_train_minutes sizes a run's first invocation only: this one goes on to max_train_steps {}",
                   c.max_train_steps);
    }
  } else if (run.writes_files()) {
    write_bytes_atomic(metrics_path, "");
  }
  if (run.block_streaming) {
    // The weights are final for the start (loaded, restored, equal on every
    // rank): ZeRO stage 3 keeps each rank's own streamed tensors from now
    // on, offload_params moves the streamed weights to host memory.
    run.block_streaming->start();
    const int64_t total = run.trainable_parameters;
    const int64_t streamed = run.block_streaming->streamed_elements();
    const double percent = total > 0 ? 100.0 * static_cast<double>(streamed) / static_cast<double>(total) : 0.0;
    if (!options.quiet && run.zero) {
      spdlog::info(
          "zero_stage = 3: {} of {} trainable weights ({:.1f}%) in {} checkpointed blocks are sharded, each rank "
          "keeping about 1/{} and gathering a block's for its use; the other {} stay on every rank",
          streamed, total, percent, run.block_streaming->blocks(), run.world_size(), total - streamed);
    } else if (!options.quiet) {
      spdlog::info(
          "offload_params: {} of {} trainable weights ({:.1f}%) in {} checkpointed blocks live in host memory ({} "
          "with the frozen ones), copied to the device block by block; their gradients and optimizer state{} live "
          "there too",
          streamed, total, percent, run.block_streaming->blocks(),
          format_bytes(static_cast<HostBlockStreaming&>(*run.block_streaming).streamed_bytes()),
          run.ema ? ", EMA" : "");
    }
    if (c.offload_params && !run.group && run.ema) {
      // offload_params: the streamed weights' EMA shadows beside their host copies.
      const auto& host = static_cast<const HostBlockStreaming&>(*run.block_streaming);
      run.ema->move_shadows_to_host([&host](const at::Tensor& p) { return host.streams_parameter(p); });
    }
  }
  if (!options.quiet) log_setup(run);
  return owned;
}

void set_max_train_steps(Run& run, int64_t steps, const std::string& why) {
  run.config.max_train_steps = steps;
  run.config.max_train_epochs = 0;  // the sized count is the run's now, on resume too
  if (!run.writes_files()) return;
  write_bytes_atomic((fs::path(run.run_dir) / "config.toml").string(), to_toml(run.config));
  spdlog::info("{}", why);
}

bool shards_checkpoints(const Run& run) { return run.zero != nullptr && run.world_size() > 1; }

bool shards_ema(const Run& run) { return run.ema != nullptr && shards_checkpoints(run); }

EMA* local_ema(Run& run) { return shards_ema(run) ? nullptr : run.ema.get(); }

bool streams_weights_through_files(const Run& run) {
  return run.zero != nullptr && run.zero->stage() == 3 && run.world_size() > 1 && run.block_streaming != nullptr &&
         !run.network;
}

namespace {

/// Every rank says whether `write` (its shard(s) into `dir`) succeeded, so
/// that rank 0 uses the folder only when all did. Throws shoestring::Error
/// on every rank naming the ranks that failed (and this rank's own error),
/// and as the collective when a peer died. `context` ("checkpoint of step
/// N") and `what` (the files) are for the message; a folder left empty is
/// removed (rank 0).
void write_on_every_rank(Run& run, const fs::path& dir, const std::string& context, const std::string& what,
                         const std::function<void()>& write) {
  std::string error;
  try {
    fs::create_directories(dir);
    write();
  } catch (const std::exception& e) {
    error = e.what();
  }
  at::Tensor failed = at::zeros({run.world_size()}, at::TensorOptions().dtype(at::kInt));
  if (!error.empty()) failed[run.rank()].fill_(1);
  run.group->all_reduce_sum(failed);
  std::vector<int> ranks;
  for (int r = 0; r < run.world_size(); ++r) {
    if (failed[r].item<int>() != 0) ranks.push_back(r);
  }
  if (ranks.empty()) return;
  if (run.writes_files()) {
    std::error_code ec;
    if (fs::is_empty(dir, ec)) fs::remove(dir, ec);  // a failed save leaves no empty folder
  }
  fail("{}: rank(s) {} could not write their {} in {}{}", context, fmt::join(ranks, ", "), what, dir.string(),
       error.empty() ? std::string() : ": " + error);
}

}  // namespace

std::string write_checkpoint_shards(Run& run, int64_t step) {
  if (!shards_checkpoints(run)) return {};
  const fs::path dir = fs::path(run.run_dir) / "checkpoints" / step_name(step);
  const bool model_shard = streams_weights_through_files(run);
  write_on_every_rank(
      run, dir, fmt::format("checkpoint of step {}", step),
      model_shard ? "optimizer and model shards" : "optimizer shard", [&] {
        save_optimizer_shard((dir / optimizer_shard_name(run.rank(), run.world_size())).string(),
                             run.gradients->optimizer().state_tensors(),
                             shards_ema(run) ? run.ema->tensors() : std::vector<std::pair<std::string, at::Tensor>>{},
                             run.rank(), run.world_size(), step, run.counters.run_id, run.gradients->state().masters);
        if (model_shard) {
          save_model_shard((dir / model_shard_name(run.rank(), run.world_size())).string(), run.zero->owned_streamed(),
                           run.rank(), run.world_size(), step, run.counters.run_id);
        }
      });
  return dir.string();
}

std::string hold_streamed_weights_on_rank_zero(Run& run, int64_t step, const std::string& checkpoint_dir) {
  fs::path dir = checkpoint_dir;
  std::string scratch;
  if (dir.empty()) {
    dir = streamed_weights_dir_of(run.run_dir);
    scratch = dir.string();
    try {
      write_on_every_rank(run, dir, fmt::format("samples and final files of step {}", step), "streamed weights", [&] {
        if (run.writes_files()) return;  // rank 0 holds its own
        save_model_shard((dir / model_shard_name(run.rank(), run.world_size())).string(), run.zero->owned_streamed(),
                         run.rank(), run.world_size(), step);
      });
    } catch (...) {
      remove_streamed_weights(run, scratch);
      throw;
    }
  }
  std::map<std::string, at::Tensor> values;
  try {
    if (run.writes_files()) {
      // Mapped, not read: the pages come in as the weights are used.
      for (int r = 0; r < run.world_size(); ++r) {
        if (r == run.rank()) continue;
        const fs::path path = dir / model_shard_name(r, run.world_size());
        if (!fs::exists(path)) {
          fail(
              "{} is missing although rank {} wrote it: rank 0 reads the other ranks' files from the run folder, so "
              "every rank must train in the same folder (a file system they share)",
              path.string(), r);
        }
        const SafetensorsFile shard = SafetensorsFile::open(path.string());
        for (const auto& info : shard.tensors()) values.emplace(info.name, shard.get(info));
      }
    }
    run.zero->hold_on(0, values);
  } catch (...) {
    remove_streamed_weights(run, scratch);
    throw;
  }
  return scratch;
}

void remove_streamed_weights(const Run& run, const std::string& scratch) {
  if (scratch.empty()) return;
  std::error_code ec;
  // Each rank its own file (a run folder that is not shared keeps no
  // leftovers either), rank 0 the folder.
  fs::remove(fs::path(scratch) / model_shard_name(run.rank(), run.world_size()), ec);
  if (!run.writes_files()) return;
  // Every rank's file by name first: a rank may remove its own at the same
  // moment, which fs::remove takes as done but would abort a remove_all
  // walking the folder (ENOENT), leaving the folder behind.
  for (int r = 0; r < run.world_size(); ++r) {
    fs::remove(fs::path(scratch) / model_shard_name(r, run.world_size()), ec);
  }
  fs::remove_all(scratch, ec);
  if (ec) spdlog::warn("cannot remove {}: {}", scratch, ec.message());
}

std::string write_checkpoint(Run& run, int64_t step) {
  fs::path dir = fs::path(run.run_dir) / "checkpoints" / step_name(step);
  const bool sharded = shards_checkpoints(run);
  // A failed save (full disk, ...) leaves no empty checkpoint folder; files
  // are written atomically, so nothing partial either.
  RemoveIfEmpty cleanup{dir.string(), fs::create_directories(dir), ""};
  if (!sharded) remove_sharded_files(dir.string());  // of an interrupted sharded save of this step
  if (!run.lora_only()) {
    std::set<std::string> in_shards;  // ZeRO stage 3: each rank's model shard holds its streamed weights
    if (streams_weights_through_files(run)) {
      for (const std::string& name : run.zero->streamed_names()) in_shards.insert(name);
    }
    std::map<std::string, std::string> metadata = run.model->metadata(step);
    if (sharded) metadata["run_id"] = run.counters.run_id;  // checked against the shards' (read_checkpoint_index)
    save_module((dir / "model.safetensors").string(), run.model->module(), metadata, in_shards);
  }
  if (run.network) save_lora(run, (dir / "lora.safetensors").string(), step, /*final_file=*/false);

  TrainingCounters& counters = run.counters;
  counters.step = step;
  counters.optimizer_step_count = run.gradients->optimizer().step_count();
  counters.data_epoch = run.sampler->position().epoch;
  counters.data_index = run.sampler->position().index;
  counters.world_size = run.world_size();
  counters.train_batch_size = run.config.train_batch_size;
  counters.gradient_accumulation_steps = run.config.gradient_accumulation_steps;
  const SaveSchedule schedule = save_schedule(run);
  counters.epoch_end = schedule.saved_epoch(step);  // what retention reads (remove_expired_checkpoints)
  counters.step_checkpoint = schedule.step_checkpoint(step);
  counters.run_last = step == schedule.max_train_steps;
  const GradientPathState path_state = run.gradients->state();
  if (path_state.loss_scale) {
    counters.loss_scale = path_state.loss_scale;
    counters.loss_scale_growth_tracker = path_state.loss_scale_growth_tracker;
  }
  if (path_state.previous_grad_norm) counters.fused_previous_grad_norm = path_state.previous_grad_norm;
  TrainingState state;
  state.counters = counters;
  // Sharded: every rank's optimizer state is in its shard (write_checkpoint_shards).
  if (!sharded) state.optimizer = run.gradients->optimizer().state_tensors();
  if (run.ema && !shards_ema(run)) state.ema = run.ema->tensors();  // sharded: in the shards
  if (!sharded) state.master = path_state.masters;                  // sharded: each owner's in its shard
  state.rng_cpu = cpu_rng_state();
  save_training_state((dir / "state.safetensors").string(), state);
  if (sharded) write_checkpoint_index(dir.string(), step, run.world_size(), run.zero->stage());
  return dir.string();
}

void commit_checkpoint(Run& run, const std::string& dir, int64_t step) {
  set_latest_checkpoint(run.run_dir, dir, step);
}

SaveSchedule save_schedule(const Run& run) {
  SaveSchedule s;
  s.save_every_n_steps = run.config.save_every_n_steps;
  s.save_every_n_epochs = run.config.save_every_n_epochs;
  s.steps_per_epoch = run.steps_per_epoch;
  s.max_train_steps = run.config.max_train_steps;
  return s;
}

void remove_expired_checkpoints(Run& run, int64_t step) {
  const TrainConfig& c = run.config;
  if (c.save_last_n_steps == 0 && c.save_last_n_epochs == 0) return;
  const fs::path root = fs::path(run.run_dir) / "checkpoints";
  auto remove_folder = [](const fs::path& dir) {
    std::error_code ec;
    fs::remove_all(dir, ec);
    if (ec) spdlog::warn("retention: cannot remove {}: {}", dir.string(), ec.message());
    return !ec;
  };
  const SaveSchedule schedule = save_schedule(run);
  std::vector<CheckpointRecord> records;
  std::map<int64_t, fs::path> folders;
  std::error_code ec;
  std::vector<fs::path> leftovers;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const std::string name = e.path().filename().string();
    if (e.is_symlink() || !e.is_directory()) continue;
    // .step-NNNNNN.removing: a removal interrupted before it finished.
    const std::string tail = ".removing";
    if (name.size() > 1 + tail.size() && name[0] == '.' &&
        name.compare(name.size() - tail.size(), tail.size(), tail) == 0 &&
        step_of_folder(name.substr(1, name.size() - 1 - tail.size()))) {
      leftovers.push_back(e.path());
      continue;
    }
    const std::optional<int64_t> s = step_of_folder(name);
    if (!s) continue;
    const fs::path state = e.path() / "state.safetensors";
    if (!fs::exists(state)) continue;  // not a complete checkpoint (or not ours): kept
    try {
      const TrainingCounters counters = load_training_counters(state.string());
      CheckpointRecord record{*s, counters.epoch_end, counters.step_checkpoint};
      record.run_last = counters.run_last;
      records.push_back(retention_view(record, schedule, step));
      folders.emplace(*s, e.path());
    } catch (const Error& err) {
      spdlog::warn("retention: keeping {}: {}", e.path().string(), err.what());
    }
  }
  if (ec) spdlog::warn("retention: cannot list {}: {}", root.string(), ec.message());
  for (const fs::path& p : leftovers) remove_folder(p);
  std::set<int64_t> protected_steps{step};
  try {
    // The checkpoint a resume reads (the one just committed, unless that failed).
    if (auto latest = step_of_folder(fs::path(latest_checkpoint_dir(run.run_dir)).filename().string()))
      protected_steps.insert(*latest);
  } catch (const Error&) {
  }
  const RetentionPolicy policy{c.save_last_n_steps, c.save_last_n_epochs};
  for (const int64_t s : expired_checkpoints(records, step, policy, protected_steps)) {
    const fs::path dir = folders.at(s);
    const fs::path doomed = root / fmt::format(".{}.removing", dir.filename().string());
    fs::rename(dir, doomed, ec);
    if (ec) {
      spdlog::warn("retention: cannot move {} aside to remove it: {}", dir.string(), ec.message());
      continue;
    }
    if (remove_folder(doomed))
      spdlog::info("removed old checkpoint {} (save_last_n_steps = {}, save_last_n_epochs = {})", dir.string(),
                   c.save_last_n_steps, c.save_last_n_epochs);
  }
}

int64_t restore_checkpoint(Run& run, const std::string& dir) {
  if (!run.lora_only()) {
    const CheckpointModel model = read_checkpoint_model(dir);
    load_module(run.model->module(), {model.tensors.begin(), model.tensors.end()}, model.source);
  }
  if (run.network) run.network->load((fs::path(dir) / "lora.safetensors").string());

  const std::string state_path = (fs::path(dir) / "state.safetensors").string();
  TrainingState state = load_training_state(state_path);
  set_cpu_rng_state(state.rng_cpu);
  RestoredState restored = restored_state(run, dir, state);
  run.gradients->optimizer().load_state_tensors(restored.optimizer);
  GradientPathState path_state;
  path_state.loss_scale = state.counters.loss_scale;
  path_state.loss_scale_growth_tracker = state.counters.loss_scale_growth_tracker;
  path_state.previous_grad_norm = state.counters.fused_previous_grad_norm;
  path_state.masters = {restored.master.begin(), restored.master.end()};
  run.gradients->load_state(path_state);
  if (run.zero && !restored.master.empty()) {
    // Each owner's master, rounded into its weight, is the weight on every
    // rank (the others read it from the model file, which the master wins).
    run.zero->broadcast_updated_parameters();
  }
  double masters_kept = static_cast<double>(run.gradients->master_count());
  if (!restored.master.empty() && run.group) masters_kept = run.group->all_reduce_sum(masters_kept);
  if (!restored.master.empty() && masters_kept == 0 && run.writes_files()) {
    spdlog::warn(
        "{}: the checkpoint keeps fp32 master weights for {} tensors, which this config's precision rules do not "
        "(master = \"fp32\"): the weights go on from the model file, rounded",
        dir, restored.master.size());
  }
  if (run.ema) {
    if (restored.ema.empty()) {
      spdlog::warn("{}: no EMA state saved; EMA restarts from the current weights", state_path);
    } else {
      run.ema->load(restored.ema);  // each rank keeps its own tensors' shadows
    }
  }
  run.gradients->optimizer().set_step_count(state.counters.optimizer_step_count);
  run.sampler->set_position(resumed_data_position(run, state.counters, state_path));
  run.counters = state.counters;
  // Blocks the overflow guard moved to fp32 stay there.
  if (!run.counters.precision_upcast.empty()) {
    if (!run.overflow) fail("{}: the run upcast fp16 blocks but this config has none", state_path);
    run.overflow->upcast(run.counters.precision_upcast);
  }
  return run.counters.step;
}

/// The fp32 sources of trained weights stored narrower, by the weight's
/// TensorImpl: the fp32 master weights, overridden by the EMA's shadows
/// (the final file holds the EMA weights). What a final file in
/// save_precision is cast from. Kept here whole: this process's own. Sharded
/// over the ranks (ZeRO on several processes): rank 0 maps each owner's
/// "master.<param>" / "ema.<param>" from the optimizer shards of `step`'s
/// checkpoint (every run saves its last step), through `mapped`, which must
/// outlive the result; nothing is read into memory until the write casts it.
TensorsByImpl fp32_sources(Run& run, int64_t step, std::list<WeightFiles>& mapped) {
  std::map<std::string, const at::Tensor*> param_of;
  for (const auto& [name, p] : run.trainable) param_of.emplace(name, &p);
  TensorsByImpl out;
  auto take = [&](const std::string& name, const at::Tensor& t) {
    const auto it = param_of.find(name);
    if (it != param_of.end() && it->second->scalar_type() != at::kFloat) out[it->second->unsafeGetTensorImpl()] = t;
  };
  if (!shards_checkpoints(run)) {
    for (const auto& [name, t] : run.gradients->state().masters) take(name, t);
    if (EMA* ema = local_ema(run)) {
      for (const auto& [name, t] : ema->tensors()) take(name, t);
    }
    return out;
  }
  // Every run saves its last step: a folder missing or damaged since is
  // said, and the file is cast from the stored (rounded) weights instead.
  const fs::path index = fs::path(run.run_dir) / "checkpoints" / step_name(step) / "checkpoint.index.json";
  const std::string fallback = fmt::format(
      "; the final file's weights stored narrower are cast to {} from their stored values, not from the owners' "
      "fp32 {}",
      run.config.save_precision, run.ema ? "EMA shadows" : "master weights");
  if (!fs::exists(index)) {
    spdlog::warn("{} is missing (the last step's checkpoint index, where the ranks' shards keep them){}",
                 index.string(), fallback);
    return out;
  }
  try {
    const WeightFiles& files = mapped.emplace_back(WeightFiles::open(index.string()));
    for (const std::string prefix : {"master.", "ema."}) {
      if (prefix == "ema." && !run.ema) continue;
      for (const auto& [name, p] : param_of) {
        if (files.find(prefix + name)) take(name, files.get(prefix + name));
      }
    }
  } catch (const Error& e) {
    spdlog::warn("cannot read the fp32 sources of the final file: {}{}", e.what(), fallback);
    return {};
  }
  return out;
}

void save_final_files(Run& run, int64_t step) {
  const TrainConfig& c = run.config;
  EmaWeightsIn ema_weights(local_ema(run));
  const std::string final_path = (fs::path(run.run_dir) / "model.safetensors").string();
  if (!run.lora_only()) {
    // A save_precision other than "auto" casts the final file once from
    // the fp32 sources (EMA shadows, fp32 masters), not from the weights
    // they were rounded into.
    std::list<WeightFiles> mapped;
    const TensorsByImpl sources = c.save_precision == "auto" ? TensorsByImpl() : fp32_sources(run, step, mapped);
    try {
      run.model->save_final(final_path, step, /*storage_dtype=*/false, sources);
    } catch (const Error& e) {
      // The range guard refused save_precision: keep the trained weights
      // anyway, in their storage dtype, and say how to narrow them.
      if (c.save_precision == "auto") throw;
      spdlog::warn("{}", e.what());
      run.model->save_final(final_path, step, /*storage_dtype=*/true);
      spdlog::warn("wrote {} in the weights' storage dtype instead of save_precision = \"{}\"; {}", final_path,
                   c.save_precision,
                   models::find_architecture(c.architecture).family == models::Family::tiny_unet
                       ? std::string("save_precision_force = true narrows anyway")
                       : fmt::format("`shoestring convert {} --to ldm --dtype {} --force OUT` narrows it anyway",
                                     final_path, c.save_precision == "float" ? "fp32" : c.save_precision));
    }
  }
  if (run.network) save_lora(run, (fs::path(run.run_dir) / "lora.safetensors").string(), step, /*final_file=*/true);
}

std::string write_samples(Run& run, int64_t step) {
  SampleRequest req;
  req.prompts = run.config.sample_prompts;
  for (int64_t s = 0; s < run.config.sample_seeds; ++s) req.seeds.push_back(static_cast<uint64_t>(s));
  req.steps = run.config.sample_steps;
  req.cfg = run.config.sample_cfg;
  at::Tensor images;
  {
    EmaWeightsIn ema_weights(local_ema(run));
    ScopedMemoryCategory category(MemoryCategory::temporaries);
    images = run.model->sample(req);
  }
  fs::path dir = fs::path(run.run_dir) / "samples";
  fs::create_directories(dir);
  const std::string path = (dir / (step_name(step) + ".png")).string();
  save_sample_grid(path, images, req);
  return path;
}

}  // namespace shoestring
