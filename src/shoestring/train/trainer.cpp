#include "shoestring/train/trainer.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <ATen/autocast_mode.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/core/memory_ledger.h"
#include "shoestring/core/threads.h"
#include "shoestring/core/units.h"
#include "shoestring/data/dataset.h"
#include "shoestring/io/atomic_file.h"
#include "shoestring/io/safetensors.h"
#include "shoestring/nn/lora.h"
#include "shoestring/nn/chunked_attention.h"
#include "shoestring/optim/factory.h"
#include "shoestring/precision/loss_scaler.h"
#include "shoestring/precision/master_weights.h"
#include "shoestring/precision/overflow.h"
#include "shoestring/precision/policy.h"
#include "shoestring/precision/save_guard.h"
#include "shoestring/optim/fused_backward.h"
#include "shoestring/optim/grad_accumulation.h"
#include "shoestring/optim/grad_hooks.h"
#include "shoestring/optim/optimizer.h"
#include "shoestring/train/checkpoint_io.h"
#include "shoestring/train/ema.h"
#include "shoestring/train/flow_matching.h"
#include "shoestring/train/lr_schedule.h"
#include "shoestring/train/sampling.h"
#include "shoestring/train/training_model.h"

namespace shoestring {
namespace fs = std::filesystem;

namespace {

using Clock = std::chrono::steady_clock;

std::string step_name(int64_t step) { return fmt::format("step-{:06d}", step); }

nlohmann::json ledger_peaks(const std::array<int64_t, kNumMemoryCategories>& peaks) {
  nlohmann::json j = nlohmann::json::object();
  for (int c = 0; c < kNumMemoryCategories; ++c) {
    j[to_string(static_cast<MemoryCategory>(c))] = peaks[c];
  }
  return j;
}

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "--:--";
  auto s = static_cast<int64_t>(seconds + 0.5);
  if (s >= 3600) return fmt::format("{}:{:02d}:{:02d}", s / 3600, (s / 60) % 60, s % 60);
  return fmt::format("{:02d}:{:02d}", s / 60, s % 60);
}

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

/// Everything the loop needs, built once.
struct Run {
  TrainConfig config;
  std::string run_dir;
  ImageCaptionDataset dataset;
  std::unique_ptr<TrainingModel> model;
  nn::LoraNetwork network{nullptr};  ///< set when network_module = "networks.lora" (then the only trainable part)
  std::vector<std::pair<std::string, at::Tensor>> trainable;
  std::unique_ptr<Optimizer> optimizer;
  std::unique_ptr<EMA> ema;
  std::unique_ptr<BatchSampler> sampler;
  PostAccumulateGradHooks grad_hooks;
  // Precision policy (docs/precision.md): fp32 masters and/or fp16 loss
  // scaling ("bridge": gradients reach the optimizer unscaled, in fp32), and
  // the fp16 overflow guard.
  std::unique_ptr<precision::MasterWeights> masters;
  std::unique_ptr<precision::LossScaler> scaler;
  std::shared_ptr<precision::OverflowMonitor> overflow;
  nlohmann::json counters = {{"images_seen", 0},         {"skipped_steps", 0},
                             {"loss_scale", nullptr},    {"loss_scale_growth_tracker", 0},
                             {"precision_upcast", nlohmann::json::array()},
                             {"consecutive_nonfinite", 0}, {"elapsed_seconds", 0.0},
                             {"fused_previous_grad_norm", nullptr}};
};

/// Writes the kohya LoRA file (networks.lora keys, ss_* metadata). The final
/// file follows save_precision; checkpoints keep the trained dtype (exact resume).
void save_lora(const Run& run, const std::string& path, int64_t step, bool final_file) {
  const TrainConfig& c = run.config;
  // kohya's ss_base_model_version values (A1111 and ComfyUI tell SDXL LoRAs
  // by them) and Stability's model-spec architecture for LoRA files.
  const bool sd1 = c.architecture == "sd15", xl = c.architecture == "sdxl" || c.architecture == "ssd1b";
  auto meta = nn::kohya_lora_metadata(run.network->options(), sd1 ? "sd_v1"
                                                              : xl ? "sdxl_base_v1-0"
                                                                   : "shoestring_" + c.architecture);
  if (sd1 || xl) {
    meta["modelspec.sai_model_spec"] = "1.0.0";
    meta["modelspec.architecture"] = sd1 ? "stable-diffusion-v1/lora" : "stable-diffusion-xl-v1-base/lora";
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

/// A LoRA run whose frozen base comes back from the pretrained file: its
/// checkpoints and final output hold the adapters only (as kohya's), not a
/// copy of the base model.
bool lora_only(const Run& run) { return run.network && run.model->base_reloadable(); }

void save_checkpoint(Run& run, int64_t step, const BatchSampler::Position& pos) {
  fs::path dir = fs::path(run.run_dir) / "checkpoints" / step_name(step);
  const bool created = fs::create_directories(dir);
  // A failed save (full disk, ...) leaves no empty checkpoint folder; files
  // are written atomically, so nothing partial either.
  struct RemoveIfEmpty {
    fs::path dir;
    bool armed;
    ~RemoveIfEmpty() {
      std::error_code ec;
      if (armed && fs::is_empty(dir, ec)) fs::remove(dir, ec);
    }
  } cleanup{dir, created};
  if (!lora_only(run)) save_module((dir / "model.safetensors").string(), run.model->module(), run.model->metadata(step));
  if (run.network) save_lora(run, (dir / "lora.safetensors").string(), step, /*final_file=*/false);

  std::vector<NamedTensor> state;
  for (auto& [name, t] : run.optimizer->state_tensors()) state.push_back({"optimizer." + name, t, std::nullopt});
  if (run.ema) {
    for (auto& [name, t] : run.ema->tensors()) state.push_back({"ema." + name, t, std::nullopt});
  }
  if (run.masters) {
    for (auto& [name, t] : run.masters->state_tensors()) state.push_back({"master." + name, t, std::nullopt});
  }
  state.push_back({"rng.cpu", cpu_rng_state(), std::nullopt});
  if (run.scaler && run.scaler->enabled()) {
    run.counters["loss_scale"] = run.scaler->scale();
    run.counters["loss_scale_growth_tracker"] = run.scaler->growth_tracker();
  }
  nlohmann::json meta = run.counters;
  meta["step"] = step;
  meta["optimizer_step_count"] = run.optimizer->step_count();
  meta["data_epoch"] = pos.epoch;
  meta["data_index"] = pos.index;
  save_safetensors((dir / "state.safetensors").string(), state, {{"training_state", meta.dump()}});
  set_latest_checkpoint(run.run_dir, dir.string(), step);
}

/// Restores weights, optimizer, EMA, RNG, data position and counters.
/// Returns the step the checkpoint was taken at.
int64_t load_checkpoint(Run& run, const std::string& dir) {
  if (!lora_only(run)) {
    auto model_file = SafetensorsFile::open((fs::path(dir) / "model.safetensors").string());
    std::map<std::string, at::Tensor> weights;
    for (const auto& info : model_file.tensors()) weights[info.name] = model_file.get(info.name);
    load_module(run.model->module(), weights, model_file.path());
  }
  if (run.network) run.network->load((fs::path(dir) / "lora.safetensors").string());

  auto state_file = SafetensorsFile::open((fs::path(dir) / "state.safetensors").string());
  auto it = state_file.metadata().find("training_state");
  if (it == state_file.metadata().end()) {
    fail("{}: missing 'training_state' metadata", state_file.path());
  }
  nlohmann::json meta;
  try {
    meta = nlohmann::json::parse(it->second);
  } catch (const nlohmann::json::exception& e) {
    fail("{}: 'training_state' metadata is not valid JSON: {}", state_file.path(), e.what());
  }
  std::map<std::string, at::Tensor> optim, ema, master;
  bool have_rng = false;
  for (const auto& info : state_file.tensors()) {
    const std::string& n = info.name;
    if (n.rfind("optimizer.", 0) == 0) {
      optim[n.substr(10)] = state_file.get(n);
    } else if (n.rfind("ema.", 0) == 0) {
      ema[n.substr(4)] = state_file.get(n);
    } else if (n.rfind("master.", 0) == 0) {
      master[n.substr(7)] = state_file.get(n);
    } else if (n == "rng.cpu") {
      set_cpu_rng_state(state_file.get(n));
      have_rng = true;
    } else {
      fail("{}: unexpected tensor '{}' in training state", state_file.path(), n);
    }
  }
  if (!have_rng) fail("{}: tensor 'rng.cpu' is missing", state_file.path());
  run.optimizer->load_state_tensors(optim);
  if (run.masters) run.masters->load_state_tensors(master);
  if (run.ema) {
    if (ema.empty()) {
      spdlog::warn("{}: no EMA state saved; EMA restarts from the current weights", state_file.path());
    } else {
      run.ema->load(ema);
    }
  }
  try {
    run.optimizer->set_step_count(meta.at("optimizer_step_count").get<int64_t>());
    run.sampler->set_position({meta.at("data_epoch").get<int64_t>(), meta.at("data_index").get<int64_t>()});
    for (auto& [k, v] : run.counters.items()) {
      if (meta.contains(k)) v = meta[k];
    }
    if (run.scaler && run.scaler->enabled() && run.counters["loss_scale"].is_number()) {
      run.scaler->load_state(run.counters["loss_scale"].get<double>(),
                             run.counters["loss_scale_growth_tracker"].get<int64_t>());
    }
    // Blocks the overflow guard moved to fp32 stay there.
    const auto upcast = run.counters["precision_upcast"].get<std::vector<std::string>>();
    if (!upcast.empty()) {
      if (!run.overflow) fail("{}: the run upcast fp16 blocks but this config has none", state_file.path());
      run.overflow->upcast(upcast);
    }
    return meta.at("step").get<int64_t>();
  } catch (const nlohmann::json::exception& e) {
    fail("{}: 'training_state' metadata lacks a field: {}", state_file.path(), e.what());
  }
}

void write_samples(Run& run, int64_t step, std::string& last_sample) {
  SampleRequest req;
  req.prompts = run.config.sample_prompts;
  for (int64_t s = 0; s < run.config.sample_seeds; ++s) req.seeds.push_back(static_cast<uint64_t>(s));
  req.steps = run.config.sample_steps;
  req.cfg = run.config.sample_cfg;
  std::vector<at::Tensor> saved;
  if (run.ema) saved = run.ema->swap_in();
  at::Tensor images;
  {
    ScopedMemoryCategory category(MemoryCategory::temporaries);
    images = run.model->sample(req);
  }
  if (run.ema) run.ema->restore(saved);
  fs::path dir = fs::path(run.run_dir) / "samples";
  fs::create_directories(dir);
  last_sample = (dir / (step_name(step) + ".png")).string();
  save_sample_grid(last_sample, images, req);
}

/// Refuses to resume `run_dir` with a config that differs from the run's own
/// config.toml in anything the checkpoint depends on (model, base files,
/// LoRA, optimizer, precision, data order), naming each difference, and
/// refuses a max_train_steps already reached, before any slow work.
void check_resume(const std::string& run_dir, const std::string& checkpoint_dir, const TrainConfig& now) {
  const fs::path recorded = fs::path(run_dir) / "config.toml";
  if (fs::exists(recorded)) {
    const TrainConfig was = load_config(recorded.string());
    auto path_of = [](const std::string& p) {
      if (p.empty()) return p;
      std::error_code ec;
      auto canonical = fs::weakly_canonical(expand_path(p), ec);
      return ec ? p : canonical.string();
    };
    std::vector<std::string> diffs;
    auto same = [&](const char* key, const std::string& a, const std::string& b) {
      if (a != b) diffs.push_back(fmt::format("{} (run: \"{}\", now: \"{}\")", key, a, b));
    };
    auto str = [](const auto& v) { return fmt::format("{}", v); };
    auto list = [](const auto& v) { return fmt::format("[{}]", fmt::join(v, ", ")); };
    same("model.architecture", was.architecture, now.architecture);
    same("model.tiny", str(was.tiny), str(now.tiny));
    same("pretrained_model_name_or_path", path_of(was.pretrained_model_name_or_path),
         path_of(now.pretrained_model_name_or_path));
    same("vae", path_of(was.vae), path_of(now.vae));
    same("tokenizer_dir", path_of(was.tokenizer_dir), path_of(now.tokenizer_dir));
    same("train_data_dir", path_of(was.train_data_dir), path_of(now.train_data_dir));
    same("clip_skip", str(was.clip_skip), str(now.clip_skip));
    same("v_parameterization", str(was.v_parameterization), str(now.v_parameterization));
    same("resolution", str(was.resolution), str(now.resolution));
    same("model.base_channels", str(was.base_channels), str(now.base_channels));
    same("model.channel_mult", list(was.channel_mult), list(now.channel_mult));
    same("model.num_res_blocks", str(was.num_res_blocks), str(now.num_res_blocks));
    same("model.attention_levels", list(was.attention_levels), list(now.attention_levels));
    same("model.num_heads", str(was.num_heads), str(now.num_heads));
    same("model.text_dim", str(was.text_dim), str(now.text_dim));
    same("model.text_layers", str(was.text_layers), str(now.text_layers));
    same("max_caption_length", str(was.max_caption_length), str(now.max_caption_length));
    same("network_module", was.network_module, now.network_module);
    same("network_dim", str(was.network_dim), str(now.network_dim));
    same("network_alpha", str(was.network_alpha), str(now.network_alpha));
    same("network_args", list(was.network_args), list(now.network_args));
    same("network_train_unet_only", str(was.network_train_unet_only), str(now.network_train_unet_only));
    same("optimizer_type", was.optimizer_type, now.optimizer_type);
    same("optimizer_state_dtype", was.optimizer_state_dtype, now.optimizer_state_dtype);
    same("full_bf16", str(was.full_bf16), str(now.full_bf16));
    same("full_fp16", str(was.full_fp16), str(now.full_fp16));
    same("train_batch_size", str(was.train_batch_size), str(now.train_batch_size));
    same("seed", str(was.seed), str(now.seed));
    same("ema_decay > 0", str(was.ema_decay > 0), str(now.ema_decay > 0));
    if (!diffs.empty()) {
      fail("--resume {}: this config differs from the run's own ({}) in what its checkpoint depends on: {}; "
           "resume with the run's config (`shoestring train --resume {}`, with --max-steps N to train further)",
           run_dir, recorded.string(), fmt::join(diffs, "; "), run_dir);
    }
  }
  // "step-000123" (checkpoint folders are named by step_name()).
  const std::string name = fs::path(checkpoint_dir).filename().string();
  if (name.rfind("step-", 0) == 0) {
    const int64_t step = std::strtoll(name.c_str() + 5, nullptr, 10);
    if (step >= now.max_train_steps) {
      fail("run '{}' is already at step {} >= max_train_steps {}; pass --max-steps N with N > {} to train further",
           run_dir, step, now.max_train_steps, step);
    }
  }
}

}  // namespace

TrainSummary train(const TrainConfig& cfg, const TrainRunOptions& options) {
  Run run;
  run.config = cfg;
  run.run_dir = options.resume_dir.value_or(expand_path(cfg.output_dir));
  const TrainConfig& c = run.config;
  const bool created_dir = !fs::exists(run.run_dir);
  ensure_writable_dir(run.run_dir);
  if (!options.resume_dir && !created_dir) {
    for (const char* marker : {"checkpoints/latest.json", "metrics.jsonl", "config.toml"}) {
      if (fs::exists(fs::path(run.run_dir) / marker)) {
        fail("output_dir '{}' already holds a run ({} exists); use --resume {} to continue it, or choose "
             "another --output-dir",
             run.run_dir, marker, run.run_dir);
      }
    }
  }
  // A run that fails before its first file is written leaves no empty folder behind.
  struct RemoveIfEmpty {
    std::string dir;
    bool armed;
    ~RemoveIfEmpty() {
      std::error_code ec;
      if (armed && fs::is_empty(dir, ec)) fs::remove(dir, ec);
    }
  } cleanup{run.run_dir, created_dir};
  std::string resume_from;
  if (options.resume_dir) {
    resume_from = latest_checkpoint_dir(run.run_dir);
    check_resume(run.run_dir, resume_from, c);
    run.config.output_dir = run.run_dir;  // the run folder, whatever the config names
  }

  check_training_config(c);
  MemoryLedger& ledger = MemoryLedger::global();
  ledger.install();
  const int threads = configure_threads(c.num_threads);
  torch::manual_seed(static_cast<uint64_t>(c.seed));

  // ---- data ----
  std::string data_dir = expand_path(c.train_data_dir);
  run.dataset = ImageCaptionDataset::load(data_dir, static_cast<int>(c.resolution));
  if (!options.quiet) {
    spdlog::info("dataset: {} images from {} ({} skipped)", run.dataset.size(), data_dir,
                 run.dataset.skipped().size());
  }
  run.sampler = std::make_unique<BatchSampler>(run.dataset.size(), c.train_batch_size,
                                               static_cast<uint64_t>(c.seed));

  // ---- model (base weights of a fine-tune / LoRA run: kohya's pretrained_model_name_or_path) ----
  {
    ModelSource source;
    // A resumed run's weights are then overwritten from its checkpoint (load_checkpoint below).
    if (!c.pretrained_model_name_or_path.empty()) source.pretrained = expand_path(c.pretrained_model_name_or_path);
    source.resume_dir = resume_from;
    source.quiet = options.quiet;
    run.model = make_training_model(c, run.dataset, source);
  }
  torch::nn::Module& model = run.model->module();
  // ---- precision policy: storage dtypes, trainable, per-block compute and checkpointing ----
  const precision::Policy policy = precision_policy(c);
  const std::vector<nn::BlockTable*> block_tables = run.model->block_tables();
  const precision::Resolution resolution =
      precision::resolve(model, policy, {block_tables.begin(), block_tables.end()});
  for (const auto& w : resolution.warnings) spdlog::warn("{}", w);
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
  nn::set_attention_chunk_bytes(c.attention_chunk_mib * (int64_t{1} << 20));
  model.train();
  if (!c.network_module.empty()) {
    // LoRA: the base model is frozen; only the adapters train (docs/lora.md).
    nn::freeze_parameters(model);
    run.network = nn::LoraNetwork(model, run.model->lora_components(c.network_train_unet_only), lora_options(c));
    if (!c.network_weights.empty()) run.network->load(expand_path(c.network_weights));
    if (c.pretrained_model_name_or_path.empty() && c.network_weights.empty()) {
      spdlog::warn("LoRA on a randomly initialised base (pretrained_model_name_or_path is not set): the adapters "
                   "learn on top of an untrained model");
    }
    if (!options.quiet) {
      spdlog::info("LoRA: {} modules, rank {}, alpha {}{}", run.network->modules().size(), c.network_dim,
                   c.network_alpha, c.network_weights.empty() ? "" : ", from " + c.network_weights);
    }
  }
  for (const auto& item : (run.network ? run.network->named_parameters(true) : model.named_parameters(true))) {
    if (item.value().requires_grad()) run.trainable.emplace_back(item.key(), item.value());
  }
  int64_t n_params = 0;
  for (auto& [n, p] : run.trainable) n_params += p.numel();

  // ---- optimizer ----
  OptimizerOptions oopts;
  oopts.stochastic_rounding = c.stochastic_rounding;
  oopts.seed = static_cast<uint64_t>(c.seed);
  oopts.state_dtype = c.optimizer_state_dtype == "bf16" ? torch::kBFloat16 : torch::kFloat32;
  oopts.offload_state = c.offload_optimizer_state;
  precision::LossScalerOptions so;
  so.enabled = fp16_training;
  so.init_scale = c.loss_scale_init;
  so.growth_interval = c.loss_scale_growth_interval;
  run.scaler = std::make_unique<precision::LossScaler>(so);
  {
    std::vector<bool> use_master;
    for (auto& [n, p] : run.trainable) use_master.push_back(wants_master.count(n) ? wants_master[n] : false);
    ScopedMemoryCategory category(MemoryCategory::optimizer_state);  // fp32 masters, as ZeRO counts them
    run.masters = std::make_unique<precision::MasterWeights>(run.trainable, use_master);
  }
  // The bridge: gradients are unscaled into fp32 and handed to the masters (or the weights).
  const bool bridge = run.scaler->enabled() || run.masters->master_count() > 0;
  if (!bridge) run.masters.reset();
  run.optimizer = make_optimizer(c.optimizer_type, c.optimizer_args,
                                 bridge ? run.masters->optimizer_params() : run.trainable, oopts);
  if (c.ema_decay > 0) run.ema = std::make_unique<EMA>(run.trainable, c.ema_decay);

  // Gradients are charged to the ledger's "gradients" category the moment
  // autograd accumulates them.
  std::vector<at::Tensor> params;
  for (auto& [n, p] : run.trainable) params.push_back(p);
  run.grad_hooks.install(params, [&ledger](size_t, at::Tensor& p) {
    if (p.grad().defined()) ledger.recharge(p.grad(), MemoryCategory::gradients);
  });

  nlohmann::json predicted_memory;
  if (options.predict_memory) predicted_memory = options.predict_memory(c, run.model->plan_vocab_size());

  // ---- run folder ----
  std::string metrics_path = (fs::path(run.run_dir) / "metrics.jsonl").string();
  int64_t start_step = 0;
  if (!resume_from.empty()) {
    start_step = load_checkpoint(run, resume_from);
    if (start_step >= c.max_train_steps) {
      fail("run '{}' is already at step {} >= max_train_steps {}; pass --max-steps N with N > {} to "
           "train further",
           run.run_dir, start_step, c.max_train_steps, start_step);
    }
    truncate_metrics(metrics_path, start_step);
    if (!options.quiet) spdlog::info("resumed from {} at step {}", resume_from, start_step);
  } else {
    write_bytes_atomic(metrics_path, "");
  }
  // The run folder always records the config that is running (a resume may
  // have raised max_train_steps).
  write_bytes_atomic((fs::path(run.run_dir) / "config.toml").string(), to_toml(c));
  if (!options.quiet) {
    spdlog::info("model: {:.2f}M trainable parameters, weights {}, {}, {} threads; optimizer {}{}", n_params / 1e6,
                 c.full_bf16 || c.full_fp16
                     ? fmt::format("{} ({})", c.full_bf16 ? "bf16" : "fp16",
                                   c.stochastic_rounding ? "stochastic rounding" : "round-to-nearest")
                     : std::string("fp32"),
                 c.mixed_precision == "no" ? "compute in weight dtype" : c.mixed_precision + " compute", threads,
                 c.optimizer_type, c.fused_backward_pass ? " (fused backward)" : "");
    spdlog::info("precision: {} rule(s) (docs/precision.md){}{}", policy.rules().size(),
                 run.scaler->enabled() ? fmt::format(", fp16 with dynamic loss scaling (init {})", run.scaler->scale())
                                       : std::string(),
                 run.masters && run.masters->master_count() > 0
                     ? fmt::format(", {} fp32 master weights ({})", run.masters->master_count(),
                                   format_bytes(run.masters->master_bytes()))
                     : std::string());
  }

  std::FILE* metrics = std::fopen(metrics_path.c_str(), "ab");
  if (!metrics) fail("cannot open '{}' for appending", metrics_path);
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> metrics_guard(metrics, &std::fclose);

  const bool tty = !options.quiet && ::isatty(::fileno(stderr));
  const int64_t accum = c.gradient_accumulation_steps;
  std::vector<at::Tensor> params_list;
  for (auto& [n, p] : run.trainable) params_list.push_back(p);
  // Non-fused accumulation: fp32 weights let autograd sum into their fp32
  // .grad; bf16 weights sum into a GradientAccumulator (fp32 or bf16 + SR).
  std::unique_ptr<GradientAccumulator> accumulator;
  if (!c.fused_backward_pass && accum > 1 && c.full_bf16 && !bridge) {
    accumulator = std::make_unique<GradientAccumulator>(
        params_list, parse_grad_accumulation_mode(c.gradient_accumulation_dtype), static_cast<uint64_t>(c.seed));
  }
  std::unique_ptr<FusedBackward> fused;
  if (c.fused_backward_pass) {
    FusedBackwardOptions fo;
    fo.accumulation_steps = accum;
    fo.max_grad_norm = c.max_grad_norm;
    fo.clip_method = parse_fused_clip_method(c.fused_clip_method);
    if (c.full_bf16) fo.accumulation_mode = parse_grad_accumulation_mode(c.gradient_accumulation_dtype);
    fo.seed = static_cast<uint64_t>(c.seed);
    fused = std::make_unique<FusedBackward>(*run.optimizer, fo);
    if (run.counters.contains("fused_previous_grad_norm") && run.counters["fused_previous_grad_norm"].is_number()) {
      fused->set_previous_grad_norm(run.counters["fused_previous_grad_norm"].get<double>());
    }
  }

  TrainSummary summary;
  summary.run_dir = run.run_dir;
  summary.first_step = start_step + 1;
  summary.skipped_images = static_cast<int64_t>(run.dataset.skipped().size());
  std::array<int64_t, kNumMemoryCategories> run_peaks{};
  int64_t run_peak_total = 0;
  std::vector<double> losses;
  double smoothed = std::nan("");
  auto run_start = Clock::now();

  for (int64_t step = start_step + 1; step <= c.max_train_steps; ++step) {
    auto t0 = Clock::now();
    ledger.reset_peaks();
    const double lr = learning_rate_at(c.lr_scheduler, c.learning_rate, step - 1, c.lr_warmup_steps,
                                       c.max_train_steps);
    if (fused) fused->begin_step(lr);
    if (run.overflow) run.overflow->begin_pass();
    double loss_sum = 0;
    for (int64_t micro = 0; micro < accum; ++micro) {
      std::vector<int64_t> idx = run.sampler->next();
      TrainBatch batch;
      {
        ScopedMemoryCategory category(MemoryCategory::activations);
        batch = run.model->prepare(idx);
      }
      // Forward + backward of this micro-batch. Run twice for fused two_pass
      // clipping, with the RNG (dropout) replayed exactly.
      at::Tensor rng_before = cpu_rng_state();
      auto forward_backward = [&]() {
        at::Tensor loss;
        {
          ScopedMemoryCategory category(MemoryCategory::activations);
          at::Tensor prediction = run.model->forward(batch);
          loss = torch::mse_loss(prediction.to(torch::kFloat32), batch.target);
        }
        ScopedMemoryCategory category(MemoryCategory::temporaries);
        (run.scaler->scale_loss(loss) / static_cast<double>(accum)).backward();
        return loss.item<double>();
      };
      if (fused) fused->begin_micro_batch(micro);
      loss_sum += forward_backward();
      if (fused && fused->needs_second_pass() && fused->begin_second_pass()) {
        set_cpu_rng_state(rng_before);
        forward_backward();
      }
      if (accumulator) {
        torch::NoGradGuard no_grad;
        for (size_t i = 0; i < params_list.size(); ++i) {
          at::Tensor& g = params_list[i].mutable_grad();
          if (g.defined()) accumulator->add(i, g, micro);
          g.reset();
        }
      }
    }
    const double loss_value = loss_sum / static_cast<double>(accum);

    // ---- fp16 overflow guard: name the blocks that left fp16's range first ----
    std::vector<std::string> overflowed;
    if (run.overflow) {
      for (const auto& e : run.overflow->events()) {
        overflowed.push_back(e.nonfinite ? e.path + " (inf/NaN)" : fmt::format("{} (max |x| {:.4g})", e.path, e.max_abs));
      }
      if (!overflowed.empty() && c.auto_upcast) {
        std::vector<std::string> moved = run.overflow->upcast_flagged();
        for (const auto& m : moved) run.counters["precision_upcast"].push_back(m);
        spdlog::warn("step {}: fp16 overflow in {}; moved to fp32 compute (precision.auto_upcast)", step,
                     fmt::join(overflowed, ", "));
      } else if (!overflowed.empty()) {
        spdlog::warn("step {}: fp16 overflow (beyond {} x 65504 or inf/NaN) first in {}; set "
                     "precision.auto_upcast = true, or add a rule with compute = \"fp32\" for these blocks",
                     step, c.overflow_threshold, fmt::join(overflowed, ", "));
      }
    }

    // ---- global-norm clipping, the optimizer step, the non-finite guard ----
    double grad_norm = 0;
    bool finite = true;
    if (fused) {
      FusedStepResult r = fused->end_step();
      grad_norm = r.grad_norm;
      finite = r.finite && std::isfinite(loss_value);
      run.counters["fused_previous_grad_norm"] = fused->previous_grad_norm();
      if (r.params_stepped > 0 && run.ema) run.ema->update();
    } else {
      std::vector<at::Tensor> grads;
      bool found_inf = false;
      if (run.masters) {
        // Unscaled fp32 gradients on the optimizer's tensors (masters or weights).
        found_inf = run.masters->collect_grads(*run.scaler);
        for (const auto& [n, p] : run.masters->optimizer_params()) grads.push_back(p.grad());
      } else {
        for (size_t i = 0; i < params_list.size(); ++i) {
          grads.push_back(accumulator ? (accumulator->has(i) ? accumulator->get(i) : at::Tensor())
                                      : params_list[i].grad());
        }
      }
      double sq = 0;
      {
        torch::NoGradGuard no_grad;
        for (const auto& g : grads) {
          if (g.defined()) sq += g.to(torch::kFloat32).pow(2).sum().item<double>();
        }
      }
      grad_norm = std::sqrt(sq);
      finite = std::isfinite(loss_value) && std::isfinite(grad_norm) && !found_inf;
      if (finite) {
        double scale = 1.0;
        if (c.max_grad_norm > 0 && grad_norm > c.max_grad_norm) scale = c.max_grad_norm / (grad_norm + 1e-6);
        ScopedMemoryCategory category(MemoryCategory::temporaries);
        if (accumulator) {
          for (size_t i = 0; i < grads.size(); ++i) params_list[i].mutable_grad() = grads[i];
        }
        run.optimizer->step(lr, scale);
        if (run.masters) run.masters->write_back();
        if (run.ema) run.ema->update();
      }
      for (auto& p : params_list) p.mutable_grad().reset();
      if (run.masters) run.masters->zero_grads();
      if (accumulator) accumulator->reset();
      run.scaler->update(!finite);
    }
    if (!finite && run.scaler->enabled() && std::isfinite(loss_value)) {
      // fp16 gradients overflowed at this loss scale: GradScaler's normal
      // skip-and-back-off, not a divergence.
      run.counters["skipped_steps"] = run.counters["skipped_steps"].get<int64_t>() + 1;
      if (!options.quiet) {
        spdlog::info("step {}: fp16 gradients overflowed; step skipped, loss scale now {}", step, run.scaler->scale());
      }
    } else if (finite) {
      run.counters["consecutive_nonfinite"] = 0;
    } else {
      run.counters["skipped_steps"] = run.counters["skipped_steps"].get<int64_t>() + 1;
      int64_t in_a_row = run.counters["consecutive_nonfinite"].get<int64_t>() + 1;
      run.counters["consecutive_nonfinite"] = in_a_row;
      spdlog::warn("step {}: non-finite loss ({}) or gradient norm ({}); step skipped ({} in a row)", step,
                   loss_value, grad_norm, in_a_row);
      if (in_a_row >= c.max_nonfinite_steps) {
        fail("training stopped at step {}: {} consecutive non-finite steps (max_nonfinite_steps = {}); "
             "lower learning_rate or use full precision{}",
             step, in_a_row, c.max_nonfinite_steps,
             overflowed.empty() ? std::string()
                                : fmt::format("; fp16 overflowed in {} (set precision.auto_upcast = true)",
                                              fmt::join(overflowed, ", ")));
      }
    }

    // ---- metrics ----
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    const int64_t images = c.train_batch_size * accum;
    run.counters["images_seen"] = run.counters["images_seen"].get<int64_t>() + images;
    run.counters["elapsed_seconds"] = run.counters["elapsed_seconds"].get<double>() + seconds;
    auto peaks = ledger.peak_breakdown();
    nlohmann::json rec = {{"step", step},
                          {"loss", loss_value},
                          {"lr", lr},
                          {"grad_norm", grad_norm},
                          {"seconds", seconds},
                          {"images_per_second", images / seconds},
                          {"peak_bytes", ledger.peak_total()},
                          {"peak_device_bytes", ledger.device_peak_total()},
                          {"skipped", !finite}};
    for (int cat = 0; cat < kNumMemoryCategories; ++cat) {
      int64_t peak = ledger.peak_bytes(static_cast<MemoryCategory>(cat));
      rec[fmt::format("peak_{}_bytes", to_string(static_cast<MemoryCategory>(cat)))] = peak;
      run_peaks[cat] = std::max(run_peaks[cat], peak);
    }
    run_peak_total = std::max(run_peak_total, ledger.peak_total());
    std::string line = rec.dump() + "\n";
    std::fwrite(line.data(), 1, line.size(), metrics);
    std::fflush(metrics);
    if (options.on_step) options.on_step(rec);

    if (step == summary.first_step) summary.first_loss = loss_value;
    losses.push_back(loss_value);
    if (std::isfinite(loss_value)) smoothed = std::isnan(smoothed) ? loss_value : 0.95 * smoothed + 0.05 * loss_value;

    if (step == summary.first_step && !predicted_memory.is_null()) {
      // The plan excludes the dataset held in memory (ledger "other").
      const int64_t predicted = predicted_memory.value("first_step_peak_bytes", int64_t{0});
      const int64_t measured = ledger.device_peak_total() - peaks[static_cast<int>(MemoryCategory::other)];
      if (!options.quiet) {
        spdlog::info("step {} memory: predicted {} (shoestring plan), measured {} ({:+.1f}%)", step,
                     format_bytes(predicted), format_bytes(measured),
                     100.0 * static_cast<double>(measured - predicted) / static_cast<double>(std::max<int64_t>(1, predicted)));
      }
    }
    if (run.network && step == summary.first_step && !run.network->never_called().empty()) {
      spdlog::warn("LoRA: {} adapters were never used by the forward pass (their layers' forward() is "
                   "bypassed, so they do not train): {}",
                   run.network->never_called().size(), fmt::join(run.network->never_called(), ", "));
    }
    if (!options.quiet && step == summary.first_step) {
      spdlog::info("step {} measured peak {} = {}", step, format_bytes(ledger.peak_total()),
                   fmt::join(
                       [&] {
                         std::vector<std::string> parts;
                         for (int cat = 0; cat < kNumMemoryCategories; ++cat) {
                           parts.push_back(fmt::format("{} {}", to_string(static_cast<MemoryCategory>(cat)),
                                                       format_bytes(peaks[cat])));
                         }
                         return parts;
                       }(),
                       ", "));
    }
    if (!options.quiet) {
      double elapsed = std::chrono::duration<double>(Clock::now() - run_start).count();
      int64_t done = step - start_step;
      double its = done / elapsed;
      double eta = (c.max_train_steps - step) / its;
      std::string progress =
          fmt::format("step {}/{} | {:.2f} it/s | ETA {} | loss {:.4f} | peak {}", step, c.max_train_steps,
                      its, format_duration(eta), smoothed, format_bytes(run_peak_total));
      if (tty) {
        fmt::print(stderr, "\r{}\033[K", progress);
        if (step == c.max_train_steps) fmt::print(stderr, "\n");
      } else if (step % c.log_every_n_steps == 0 || step == c.max_train_steps || step == summary.first_step) {
        fmt::print(stderr, "{}\n", progress);
      }
    }

    const bool last = step == c.max_train_steps;
    if ((c.save_every_n_steps > 0 && step % c.save_every_n_steps == 0) || last) {
      save_checkpoint(run, step, run.sampler->position());
    }
    if ((c.sample_every_n_steps > 0 && step % c.sample_every_n_steps == 0) || last) {
      if (tty) fmt::print(stderr, "\n");
      if (run.overflow) run.overflow->set_enabled(false);
      try {
        write_samples(run, step, summary.last_sample);
      } catch (const std::exception& e) {
        // A sample grid is a by-product: training and saving go on.
        spdlog::warn("step {}: no sample grid: {}", step, e.what());
      }
      if (run.overflow) run.overflow->set_enabled(true);
      if (!options.quiet) spdlog::info("step {}: sample grid {}", step, summary.last_sample);
    }
    summary.last_step = step;
  }

  // Final weights at the run root: EMA weights when EMA is on.
  {
    std::vector<at::Tensor> saved;
    if (run.ema) saved = run.ema->swap_in();
    const std::string final_path = (fs::path(run.run_dir) / "model.safetensors").string();
    if (!lora_only(run)) {
      try {
        run.model->save_final(final_path, summary.last_step);
      } catch (const Error& e) {
        // The range guard refused save_precision: keep the trained weights
        // anyway, in their storage dtype, and say how to narrow them.
        if (c.save_precision == "auto") throw;
        spdlog::warn("{}", e.what());
        run.model->save_final(final_path, summary.last_step, /*storage_dtype=*/true);
        spdlog::warn("wrote {} in the weights' storage dtype instead of save_precision = \"{}\"; {}", final_path,
                     c.save_precision,
                     c.architecture == "tiny-unet"
                         ? std::string("save_precision_force = true narrows anyway")
                         : fmt::format("`shoestring convert {} --to ldm --dtype {} --force OUT` narrows it anyway",
                                       final_path, c.save_precision == "float" ? "fp32" : c.save_precision));
      }
    }
    if (run.network) {
      save_lora(run, (fs::path(run.run_dir) / "lora.safetensors").string(), summary.last_step, /*final_file=*/true);
    }
    if (run.ema) run.ema->restore(saved);
  }

  const double total = std::chrono::duration<double>(Clock::now() - run_start).count();
  const int64_t steps_run = summary.last_step - start_step;
  summary.seconds_per_step = total / std::max<int64_t>(1, steps_run);
  summary.images_per_second = steps_run * c.train_batch_size * accum / total;
  size_t tail = std::max<size_t>(1, losses.size() / 10);
  double s = 0;
  for (size_t i = losses.size() - tail; i < losses.size(); ++i) s += losses[i];
  summary.final_loss = s / static_cast<double>(tail);
  summary.skipped_steps = run.counters["skipped_steps"].get<int64_t>();
  summary.peak_memory = ledger_peaks(run_peaks);
  summary.peak_memory["total"] = run_peak_total;
  if (!options.quiet) {
    spdlog::info("done: steps {}..{}, {:.3f} s/step, {:.1f} images/s, loss {:.4f} -> {:.4f}", summary.first_step,
                 summary.last_step, summary.seconds_per_step, summary.images_per_second, summary.first_loss,
                 summary.final_loss);
    std::vector<std::string> parts;
    for (int cat = 0; cat < kNumMemoryCategories; ++cat) {
      parts.push_back(fmt::format("{} {}", to_string(static_cast<MemoryCategory>(cat)), format_bytes(run_peaks[cat])));
    }
    spdlog::info("peak memory {} (per category peaks: {})", format_bytes(run_peak_total), fmt::join(parts, ", "));
    if (summary.skipped_images > 0) {
      spdlog::warn("{} unreadable images were skipped:", summary.skipped_images);
      for (const auto& sk : run.dataset.skipped()) spdlog::warn("  {}: {}", sk.path, sk.reason);
    }
    spdlog::info("final weights {}/{}; samples {}", run.run_dir, lora_only(run) ? "lora.safetensors" : "model.safetensors",
                 summary.last_sample);
  }
  return summary;
}

}  // namespace shoestring
