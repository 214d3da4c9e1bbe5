// bench/model_step: one full training step of a real-width architecture on
// this machine, as a user would run a full fine-tune: bf16 weights updated
// with stochastic rounding, Adafactor (factored, fused into backward: no
// gradient buffers), gradient checkpointing, batch 1.
//
//   build/bench/model_step [--arch sd15] [--resolution 512] [--batch 1] [--steps 2]
//                          [--optimizer Adafactor] [--no-checkpointing] [--tiny] [--threads 0] [--json]
//
// Prints seconds per step (the last step; the first includes one-time
// allocations) and the memory ledger's measured peak: total, and each
// category's bytes at that peak and its own peak. Weights are random (the
// numbers do not depend on values); inputs are random latents, timesteps
// and text-encoder states of the architecture's shapes (see make_runner).
// With --json: one object with arch, resolution, batch, seconds_per_step,
// peak_bytes and <category>_bytes (at the peak) and <category>_peak_bytes.
#include <chrono>
#include <functional>
#include <cstdio>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/core/memory_ledger.h"
#include "shoestring/core/threads.h"
#include "shoestring/core/units.h"
#include "shoestring/models/architecture.h"
#include "shoestring/models/cascade.h"
#include "shoestring/models/mmdit.h"
#include "shoestring/models/unet_ldm.h"
#include "shoestring/optim/factory.h"
#include "shoestring/optim/fused_backward.h"

namespace {

using namespace shoestring;
using Clock = std::chrono::steady_clock;

// One architecture's training forward on random inputs of its shapes.
// LDM UNets: latents [B,4,R/8,R/8], DDPM timesteps, text states [B,77,768|2048]
// (+ the 2816-wide vector for SDXL). SD3.5M: latents [B,16,R/8,R/8], t in
// [0,1], T5+CLIP states [B,154,4096], pooled [B,2048]. Stable Cascade stage
// C: its 24x24 latents at 1024 px (R/42.67), r in [0,1], CLIP text
// [B,77,1280], pooled [B,1,1280], image [B,1,768].
struct Runner {
  std::function<at::Tensor()> forward;
  at::Tensor target;
};

Runner make_runner(torch::nn::Module& module, int64_t batch, int64_t resolution, at::ScalarType dtype,
                   bool checkpointing) {
  auto randn = [&](std::vector<int64_t> shape) { return torch::randn(shape).to(dtype); };
  Runner r;
  if (auto* unet = dynamic_cast<models::LdmUNetImpl*>(&module)) {
    unet->set_gradient_checkpointing(checkpointing);
    const auto& o = unet->options();
    at::Tensor x = randn({batch, o.in_channels(), resolution / 8, resolution / 8});
    at::Tensor t = torch::randint(0, 1000, {batch}).to(torch::kFloat32);
    at::Tensor ctx = randn({batch, 77, o.context_dim()});
    at::Tensor y = o.adm_in_channels() > 0 ? randn({batch, o.adm_in_channels()}) : at::Tensor();
    r.forward = [unet, x, t, ctx, y] { return unet->forward(x, t, ctx, y); };
    r.target = x;
  } else if (auto* dit = dynamic_cast<models::MMDiTImpl*>(&module)) {
    dit->set_gradient_checkpointing(checkpointing);
    const auto& o = dit->options();
    at::Tensor x = randn({batch, o.in_channels(), resolution / 8, resolution / 8});
    at::Tensor t = torch::rand({batch});
    at::Tensor ctx = randn({batch, 154, o.context_dim()});
    at::Tensor y = randn({batch, o.adm_in_channels()});
    r.forward = [dit, x, t, ctx, y] { return dit->forward(x, t, ctx, y); };
    r.target = x;
  } else if (auto* c = dynamic_cast<models::StageCImpl*>(&module)) {
    c->set_gradient_checkpointing(checkpointing);
    const auto& o = c->options();
    const int64_t side = std::max<int64_t>(8, (resolution * 3) / 128);  // 24 at 1024 px (compression 42.67)
    at::Tensor x = randn({batch, o.in_channels(), side, side});
    at::Tensor rr = torch::rand({batch});
    at::Tensor text = randn({batch, 77, o.clip_text_dim()});
    at::Tensor pooled = randn({batch, 1, o.clip_text_pooled_dim()});
    at::Tensor img = randn({batch, 1, o.clip_image_dim()});
    r.forward = [c, x, rr, text, pooled, img] { return c->forward(x, rr, text, pooled, img); };
    r.target = x;
  } else {
    fail("model_step: no example inputs for this architecture (LDM UNets, sd35m, cascade-c, cascade-c-lite)");
  }
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"One training step of a real architecture: time and measured memory by category"};
  std::string arch = "sd15", optimizer_type = "Adafactor";
  int64_t resolution = 512, batch = 1, steps = 2, threads = 0;
  bool no_checkpointing = false, tiny = false, json = false;
  app.add_option("--arch", arch, "architecture (sd15, sdxl, ssd1b, sd35m, cascade-c, cascade-c-lite)");
  app.add_option("--resolution", resolution, "image side in pixels (latents are /8)")->check(CLI::Range(64, 4096));
  app.add_option("--batch", batch, "images per step")->check(CLI::Range(1, 64));
  app.add_option("--steps", steps, "training steps (the last one is reported)")->check(CLI::Range(1, 100));
  app.add_option("--optimizer", optimizer_type, "optimizer_type (Adafactor, AdamW8bit, AdamW, Lion)");
  app.add_option("--threads", threads, "intra-op threads (0 = every allowed CPU)");
  app.add_flag("--no-checkpointing", no_checkpointing, "keep every activation (no gradient checkpointing)");
  app.add_flag("--tiny", tiny, "the architecture's tiny-width variant (quick check)");
  app.add_flag("--json", json, "one JSON object");
  CLI11_PARSE(app, argc, argv);
  try {
    configure_threads(threads);
    MemoryLedger& ledger = MemoryLedger::global();
    ledger.install();
    const at::ScalarType dtype = at::kBFloat16;

    std::shared_ptr<torch::nn::Module> module;
    {
      ScopedMemoryCategory category(MemoryCategory::weights);
      nn::LayerInit init{torch::TensorOptions().dtype(dtype)};
      module = models::build_architecture(arch, init, tiny);
    }
    module->train();

    std::vector<std::pair<std::string, at::Tensor>> params;
    int64_t n_params = 0;
    for (const auto& p : module->named_parameters()) {
      params.emplace_back(p.key(), p.value());
      n_params += p.value().numel();
    }
    OptimizerOptions oo;
    oo.stochastic_rounding = true;
    oo.state_dtype = at::kBFloat16;
    std::vector<std::string> optimizer_args;
    if (optimizer_type == "Adafactor")
      optimizer_args = {"scale_parameter=False", "relative_step=False", "warmup_init=False"};
    std::unique_ptr<Optimizer> optimizer = make_optimizer(optimizer_type, optimizer_args, params, oo);
    FusedBackward fused(*optimizer, FusedBackwardOptions{});

    Runner runner;
    {
      ScopedMemoryCategory category(MemoryCategory::activations);
      runner = make_runner(*module, batch, resolution, dtype, !no_checkpointing);
    }
    double seconds = 0, loss_value = 0;
    for (int64_t s = 0; s < steps; ++s) {
      ledger.reset_peaks();
      const auto t0 = Clock::now();
      fused.begin_step(1e-5);
      fused.begin_micro_batch(0);
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
      fused.end_step();
      loss_value = loss.item<double>();
      seconds = std::chrono::duration<double>(Clock::now() - t0).count();
      if (!json) std::fprintf(stderr, "step %lld: %.2f s, loss %.4f\n", static_cast<long long>(s + 1), seconds, loss_value);
    }
    const auto at_peak = ledger.peak_breakdown();
    nlohmann::json j;
    j["arch"] = arch + (tiny ? " (tiny)" : "");
    j["resolution"] = resolution;
    j["batch"] = batch;
    j["parameters"] = n_params;
    j["optimizer"] = optimizer_type;
    j["checkpointing"] = !no_checkpointing;
    j["seconds_per_step"] = seconds;
    j["loss"] = loss_value;
    j["peak_bytes"] = ledger.device_peak_total();
    for (int c = 0; c < kNumMemoryCategories; ++c) {
      const auto cat = static_cast<MemoryCategory>(c);
      j[fmt::format("{}_bytes", to_string(cat))] = at_peak[c];
      j[fmt::format("{}_peak_bytes", to_string(cat))] = ledger.peak_bytes(cat);
    }
    if (json) {
      std::printf("%s\n", j.dump().c_str());
    } else {
      std::printf("%s at %lld px, batch %lld, %s, bf16 + SR, %s fused, checkpointing %s: %.2f s/step\n",
                  j["arch"].get<std::string>().c_str(), static_cast<long long>(resolution),
                  static_cast<long long>(batch), fmt::format("{:.3f}B params", n_params / 1e9).c_str(),
                  optimizer_type.c_str(), no_checkpointing ? "off" : "on", seconds);
      std::printf("measured peak %s (%.2f GiB)\n", format_bytes(ledger.device_peak_total()).c_str(),
                  ledger.device_peak_total() / 1073741824.0);
      std::printf("%-16s %12s %12s\n", "category", "at peak", "own peak");
      for (int c = 0; c < kNumMemoryCategories; ++c) {
        const auto cat = static_cast<MemoryCategory>(c);
        std::printf("%-16s %12s %12s\n", to_string(cat), format_bytes(at_peak[c]).c_str(),
                    format_bytes(ledger.peak_bytes(cat)).c_str());
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "model_step: %s\n", e.what());
    return 1;
  }
  return 0;
}
