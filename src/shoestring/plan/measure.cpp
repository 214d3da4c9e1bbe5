#include "shoestring/plan/measure.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <functional>

#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/core/memory_ledger.h"
#include "shoestring/models/architecture.h"
#include "shoestring/models/denoiser.h"
#include "shoestring/nn/chunked_attention.h"
#include "shoestring/optim/factory.h"
#include "shoestring/optim/fused_backward.h"
#include "shoestring/optim/grad_hooks.h"
#include "shoestring/precision/policy.h"
#include "shoestring/train/block_streaming.h"
#include "shoestring/train/config.h"
#include "shoestring/train/trainer.h"

namespace shoestring::plan {
namespace fs = std::filesystem;

Measurement measure_training(TrainConfig config, int64_t steps) {
  static std::atomic<int> counter{0};
  const fs::path dir =
      fs::temp_directory_path() / fmt::format("shoestring_plan_measure_{}_{}", ::getpid(), counter.fetch_add(1));
  fs::remove_all(dir);
  config.output_dir = dir.string();
  config.max_train_steps = steps;
  config.max_train_epochs = 0;  // would size max_train_steps again
  config.save_every_n_steps = 0;
  config.save_every_n_epochs = 0;
  config.save_last_n_steps = 0;
  config.save_last_n_epochs = 0;
  config.sample_every_n_steps = 0;
  config.sample_steps = 1;
  config.sample_seeds = 1;
  config.sample_prompts = {"x"};
  Measurement m;
  TrainRunOptions options;
  options.quiet = true;
  options.predict_memory = [&m](const TrainConfig& c, int64_t vocab) {
    m.vocab_size = vocab;
    m.plan = plan_memory(c, vocab);
    return m.plan.to_json();
  };
  options.on_step = [&m](const nlohmann::json&) {
    MemoryLedger& ledger = MemoryLedger::global();
    MeasuredStep s;
    const auto breakdown = ledger.device_peak_breakdown();  // the categories at peak_bytes' moment
    const int other = static_cast<int>(MemoryCategory::other);
    s.peak_bytes = ledger.device_peak_total() - ledger.current_bytes(MemoryCategory::other);
    for (int c = 0; c < kNumMemoryCategories; ++c) {
      s.at_peak[c] = breakdown[c];
      s.peak_per_category[c] = ledger.peak_bytes(static_cast<MemoryCategory>(c));
    }
    s.at_peak[other] -= ledger.current_bytes(MemoryCategory::other);
    m.steps.push_back(s);
  };
  try {
    train(config, options);
  } catch (...) {
    fs::remove_all(dir);
    throw;
  }
  fs::remove_all(dir);
  return m;
}

}  // namespace shoestring::plan

// ---- one denoiser step (bench/model_step, tests/plan) ----

namespace shoestring::plan {
namespace {

std::vector<std::string> optimizer_args_for(const std::string& type) {
  if (type == "Adafactor") return {"scale_parameter=False", "relative_step=False", "warmup_init=False"};
  return {};
}

}  // namespace

TrainConfig model_step_config(const ModelStepOptions& o) {
  TrainConfig c;
  c.architecture = o.architecture;
  c.tiny = o.tiny;
  c.resolution = o.resolution;
  c.train_batch_size = o.batch;
  c.gradient_accumulation_steps = 1;
  c.optimizer_type = o.optimizer;
  c.optimizer_args = optimizer_args_for(o.optimizer);
  c.optimizer_state_dtype = o.bf16 ? "bf16" : "fp32";
  c.full_bf16 = o.bf16;
  c.full_fp16 = false;
  c.mixed_precision = "no";
  c.fused_backward_pass = o.fused;
  c.gradient_checkpointing = o.checkpointing;
  c.ema_decay = 0;
  c.offload_optimizer_state = false;
  c.offload_params = o.offload_params;
  c.attention_chunk_mib = o.attention_chunk_mib;
  c.network_module.clear();
  c.precision_rules.clear();
  return c;
}

ModelStepResult measure_model_step(const ModelStepOptions& o) {
  using Clock = std::chrono::steady_clock;
  MemoryLedger& ledger = MemoryLedger::global();
  ledger.install();
  const at::ScalarType dtype = o.bf16 ? at::kBFloat16 : at::kFloat;
  ModelStepResult result;
  const bool tiny_unet = o.architecture == models::kTinyUNet;
  std::shared_ptr<torch::nn::Module> module;
  {
    ScopedMemoryCategory category(MemoryCategory::weights);
    const nn::LayerInit init{torch::TensorOptions().dtype(dtype)};
    if (tiny_unet) {
      models::TinyUNetOptions u = o.tiny_unet;
      module = models::TinyUNet(u.init(init)).ptr();
    } else {
      module = models::build_architecture(o.architecture, init, o.tiny);
    }
  }
  // The precision policy as the trainer applies it: the config's shorthand
  // rules (full_bf16, gradient_checkpointing) on the model's block table, so
  // blocks are checkpointed the way a training run checkpoints them.
  {
    const std::vector<nn::BlockTable*> tables = models::denoiser_block_tables(*module);
    const precision::Resolution resolution =
        precision::resolve(*module, precision_policy(model_step_config(o)), {tables.begin(), tables.end()});
    ScopedMemoryCategory category(MemoryCategory::weights);
    precision::apply(*module, resolution, tables);
  }
  module->train();
  std::vector<std::pair<std::string, at::Tensor>> params;
  for (const auto& p : module->named_parameters()) {
    params.emplace_back(p.key(), p.value());
    result.parameters += p.value().numel();
  }
  std::shared_ptr<HostBlockStreaming> offload;
  if (o.offload_params) {
    if (o.fused || !o.checkpointing) {
      fail("model step: offload_params needs gradient checkpointing and no fused backward (--no-fused)");
    }
    offload = HostBlockStreaming::attach(models::denoiser_block_tables(*module), *module, params, at::kCPU);
  }
  OptimizerOptions oo;
  oo.stochastic_rounding = o.bf16;
  oo.state_dtype = o.bf16 ? at::kBFloat16 : at::kFloat;
  oo.offload_state = o.offload_params;
  std::unique_ptr<Optimizer> optimizer = make_optimizer(o.optimizer, optimizer_args_for(o.optimizer), params, oo);
  std::unique_ptr<FusedBackward> fused;
  // Without fusion, gradients are charged to `gradients` the moment autograd
  // accumulates them, as the trainer does.
  PostAccumulateGradHooks grad_hooks;
  if (o.fused) {
    fused = std::make_unique<FusedBackward>(*optimizer, FusedBackwardOptions{});
  } else {
    std::vector<at::Tensor> tensors;
    for (auto& [name, p] : params) tensors.push_back(p);
    grad_hooks.install(tensors, [&ledger](size_t, at::Tensor& p) {
      if (p.grad().defined()) ledger.recharge(p.grad(), MemoryCategory::gradients);
    });
  }
  // After the hooks: autograd's gradient accumulators keep the shape their
  // parameter had when they were made, and streaming empties the parameters.
  if (offload) offload->start();  // the blocks' weights to host memory

  models::DenoiserExample runner;
  {
    ScopedMemoryCategory category(MemoryCategory::activations);
    if (tiny_unet) {
      auto* unet = module->as<models::TinyUNetImpl>();
      const models::TinyUNetOptions& u = unet->options();
      at::Tensor x = torch::randn({o.batch, u.in_channels(), o.resolution, o.resolution}).to(dtype);
      at::Tensor t = torch::rand({o.batch});
      at::Tensor ctx = torch::randn({o.batch, o.tiny_unet_context_tokens, u.context_dim()}).to(dtype);
      runner.forward = [unet, x, t, ctx] { return unet->forward(x, t, ctx); };
      runner.target = x;
    } else {
      const models::Architecture& arch = models::find_architecture(o.architecture);
      if (!arch.example) fail("model step: no example inputs for architecture '{}' (not a denoiser)", o.architecture);
      runner = arch.example(*module, models::denoiser_batch(arch, o.batch, o.resolution), dtype);
    }
  }
  const double lr = 1e-5;
  struct RestoreChunk {
    int64_t bytes = nn::attention_chunk_bytes();
    ~RestoreChunk() { nn::set_attention_chunk_bytes(bytes); }
  } restore_chunk;
  nn::set_attention_chunk_bytes(o.attention_chunk_mib << 20);
  for (int64_t s = 0; s < o.steps; ++s) {
    ledger.reset_peaks();
    const auto t0 = Clock::now();
    if (fused) {
      fused->begin_step(lr);
      fused->begin_micro_batch(0);
    }
    at::Tensor loss;
    {
      ScopedMemoryCategory category(MemoryCategory::activations);
      at::Tensor out = runner.forward();
      loss = torch::mse_loss(out.to(torch::kFloat32), runner.target.to(torch::kFloat32));
    }
    {
      ScopedMemoryCategory category(MemoryCategory::temporaries);
      loss.backward();
    }
    if (fused) {
      fused->end_step();
    } else {
      {
        ScopedMemoryCategory category(MemoryCategory::temporaries);
        if (offload) offload->before_step();  // the host copies and their gradients
        optimizer->step(lr);
      }
      for (auto& [name, p] : params) p.mutable_grad().reset();
      if (offload) offload->after_step();
    }
    result.loss = loss.item<double>();
    loss = at::Tensor();
    result.seconds_per_step = std::chrono::duration<double>(Clock::now() - t0).count();
    result.step_seconds.push_back(result.seconds_per_step);
  }
  const auto breakdown = ledger.device_peak_breakdown();
  result.step.peak_bytes = ledger.device_peak_total();
  for (int c = 0; c < kNumMemoryCategories; ++c) {
    result.step.at_peak[c] = breakdown[c];
    result.step.peak_per_category[c] = ledger.peak_bytes(static_cast<MemoryCategory>(c));
  }
  return result;
}

}  // namespace shoestring::plan
