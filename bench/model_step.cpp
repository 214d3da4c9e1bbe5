// bench/model_step: one full training step of a real-width architecture on
// this machine, as a user would run a full fine-tune with cached latents and
// text embeddings: bf16 weights updated with stochastic rounding, Adafactor
// (factored, fused into backward: no gradient buffers), gradient
// checkpointing, batch 1 — and the memory planner's prediction of the same
// step beside the measurement.
//
//   build/bench/model_step [--arch sd15] [--resolution 512] [--batch 1] [--steps 2]
//                          [--optimizer Adafactor] [--no-checkpointing] [--no-fused] [--fp32]
//                          [--offload-params]
//                          [--attention-chunk-mib 64]
//                          [--tiny] [--threads 0] [--json]
//   build/bench/model_step --arch tiny-unet --config examples/emoji.toml --resolution 16 --batch 32 ...
//
// Prints seconds per step (the last step; the first includes one-time
// allocations) and the memory ledger's measured peak: total, and each
// category's bytes at that peak and its own peak, with plan_memory's
// prediction per category. The step itself is plan::measure_model_step
// (plan/measure.h): random weights (the numbers do not depend on values),
// random inputs of the registry row's shapes (models::denoiser_batch: LDM latents [B,4,R/8,R/8]
// with text states [B,77,768|2048] and SDXL's 2816-wide y; SD3.5M latents
// [B,16,R/8,R/8], T5+CLIP states [B,154,4096], pooled [B,2048]; stage C
// latents of side 3R/128 (24 at 1024 px), CLIP text [B,77,1280], pooled
// [B,1,1280], image [B,1,768]).
// With --json: one object with arch, resolution, batch, seconds_per_step,
// peak_bytes, <category>_bytes (at the peak), <category>_peak_bytes,
// predicted_peak_bytes, predicted_<category>_bytes, predicted_peak_phase and
// prediction_error (predicted / measured - 1), and step_seconds (every
// step's wall time).
// --arch tiny-unet builds the UNet of a run config's [model] section (the
// emoji example's by default) and runs it on pixels with random caption
// states of max_caption_length tokens (its caption encoder is not part of
// the step); it has no planner prediction (the predicted_* fields are null).
// --offload-params (with --no-fused): the checkpointed blocks' weights,
// gradients and optimizer state in host memory (offload_params,
// train/block_streaming.h), copied block by block: the ledger's
// host_offload category holds them, the device categories the rest; the
// device peak (peak_bytes) excludes host_offload.
#include <cstdio>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "bench_machine.h"
#include "shoestring/core/memory_ledger.h"
#include "shoestring/core/threads.h"
#include "shoestring/core/units.h"
#include "shoestring/plan/measure.h"
#include "shoestring/plan/memory_plan.h"
#include "shoestring/train/config.h"
#include "shoestring/train/tiny_unet_model.h"

using namespace shoestring;

int main(int argc, char** argv) {
  shoestring::bench::prepare_process(argv);
  CLI::App app{"One training step of a real architecture: time, measured and predicted memory by category"};
  plan::ModelStepOptions o;
  int64_t threads = 0;
  bool no_checkpointing = false, no_fused = false, fp32 = false, json = false;
  std::string config = std::string(SHOESTRING_BENCH_SOURCE_DIR) + "/examples/emoji.toml";
  app.add_option("--arch", o.architecture, "architecture (sd15, sdxl, ssd1b, sd35m, cascade-c, cascade-c-lite)");
  app.add_option("--resolution", o.resolution, "image side in pixels")->check(CLI::Range(8, 4096));
  app.add_option("--batch", o.batch, "images per step")->check(CLI::Range(1, 64));
  app.add_option("--steps", o.steps, "training steps (the last one is reported)")->check(CLI::Range(1, 100));
  app.add_option("--optimizer", o.optimizer, "optimizer_type (Adafactor, AdamW8bit, AdamW, Lion)");
  app.add_option("--attention-chunk-mib", o.attention_chunk_mib,
                 "attention score matrices above this size are computed in query blocks (0 = never)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 20));
  app.add_option("--config", config, "run config whose [model] is the tiny-unet (--arch tiny-unet only)");
  app.add_option("--threads", threads, "intra-op threads (0 = every allowed CPU)");
  app.add_flag("--no-checkpointing", no_checkpointing, "keep every activation (no gradient checkpointing)");
  app.add_flag("--no-fused", no_fused, "backward first, then the optimizer step (gradients held)");
  app.add_flag("--fp32", fp32, "fp32 weights and optimizer state (default: bf16 + stochastic rounding)");
  app.add_flag("--offload-params", o.offload_params,
               "checkpointed blocks' weights, gradients and optimizer state in host memory (needs --no-fused)");
  app.add_flag("--tiny", o.tiny, "the architecture's tiny-width variant (quick check)");
  bool machine_only = false;
  app.add_flag("--json", json, "one JSON object");
  app.add_flag("--machine", machine_only,
               "print the machine line (with --json its JSON object) and exit: the runtime settings shoestring "
               "gives itself here (bench/peer_step.py gives its peer the same)");
  CLI11_PARSE(app, argc, argv);
  shoestring::bench::print_machine(json);
  if (machine_only) return 0;
  try {
    configure_threads(threads);
    o.checkpointing = !no_checkpointing;
    o.fused = !no_fused;
    o.bf16 = !fp32;
    const bool tiny_unet = o.architecture == models::kTinyUNet;
    if (tiny_unet) {
      const TrainConfig cfg = load_config(config);
      o.tiny_unet = TinyUNetModelOptions::from_config(cfg, plan::kDefaultVocabSize).unet;
      o.tiny_unet_context_tokens = cfg.max_caption_length;
    }
    const plan::MemoryPlan predicted =
        tiny_unet ? plan::MemoryPlan{} : plan::plan_memory(plan::model_step_config(o), plan::kDefaultVocabSize);
    const plan::ModelStepResult r = plan::measure_model_step(o);
    const plan::MeasuredStep& m = r.step;
    nlohmann::json j;
    j["arch"] = o.architecture + (o.tiny ? " (tiny)" : "");
    j["resolution"] = o.resolution;
    j["batch"] = o.batch;
    j["parameters"] = r.parameters;
    j["optimizer"] = o.optimizer;
    j["checkpointing"] = o.checkpointing;
    j["fused"] = o.fused;
    j["bf16"] = o.bf16;
    j["offload_params"] = o.offload_params;
    j["seconds_per_step"] = r.seconds_per_step;
    j["step_seconds"] = r.step_seconds;
    j["threads"] = configure_threads(threads);
    j["loss"] = r.loss;
    j["peak_bytes"] = m.peak_bytes;
    auto prediction = [&](auto value) { return tiny_unet ? nlohmann::json() : nlohmann::json(value); };
    j["predicted_peak_bytes"] = prediction(predicted.predicted_peak_bytes);
    j["predicted_peak_phase"] = prediction(predicted.peak_phase);
    j["prediction_error"] =
        prediction(static_cast<double>(predicted.predicted_peak_bytes) / static_cast<double>(m.peak_bytes) - 1);
    for (int c = 0; c < kNumMemoryCategories; ++c) {
      const auto cat = static_cast<MemoryCategory>(c);
      j[fmt::format("{}_bytes", to_string(cat))] = m.at_peak[c];
      j[fmt::format("{}_peak_bytes", to_string(cat))] = m.peak_per_category[c];
      j[fmt::format("predicted_{}_bytes", to_string(cat))] = prediction(predicted.at_peak[c]);
    }
    if (json) {
      std::printf("%s\n", j.dump().c_str());
    } else {
      std::printf("%s at %lld px, batch %lld, %s, %s, %s%s, checkpointing %s: %.2f s/step (loss %.4f)\n",
                  j["arch"].get<std::string>().c_str(), static_cast<long long>(o.resolution),
                  static_cast<long long>(o.batch),
                  (r.parameters >= 100000000 ? fmt::format("{:.3f}B params", r.parameters / 1e9)
                                             : fmt::format("{:.3f}M params", r.parameters / 1e6))
                      .c_str(),
                  o.bf16 ? "bf16 + SR" : "fp32", o.optimizer.c_str(), o.fused ? " fused" : "",
                  o.checkpointing ? "on" : "off", r.seconds_per_step, r.loss);
      if (o.offload_params) std::printf("offload_params: host memory %s\n", format_bytes(m.peak_per_category[static_cast<int>(MemoryCategory::host_offload)]).c_str());
      if (tiny_unet) {
        // No plan of a bare tiny-unet step (the planner plans the emoji example's whole run: `shoestring plan`).
        std::printf("measured peak %s (%.2f GiB), not planned\n", format_bytes(m.peak_bytes).c_str(),
                    m.peak_bytes / 1073741824.0);
      } else {
        std::printf("measured peak %s (%.2f GiB), predicted %s (%+.1f%%, at %s)\n", format_bytes(m.peak_bytes).c_str(),
                    m.peak_bytes / 1073741824.0, format_bytes(predicted.predicted_peak_bytes).c_str(),
                    100.0 * j["prediction_error"].get<double>(), predicted.peak_phase.c_str());
      }
      std::printf("%-16s %12s %12s %12s\n", "category", "at peak", "own peak", "predicted");
      for (int c = 0; c < kNumMemoryCategories; ++c) {
        const auto cat = static_cast<MemoryCategory>(c);
        std::printf("%-16s %12s %12s %12s\n", to_string(cat), format_bytes(m.at_peak[c]).c_str(),
                    format_bytes(m.peak_per_category[c]).c_str(), format_bytes(predicted.at_peak[c]).c_str());
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "model_step: %s\n", e.what());
    return 1;
  }
  return 0;
}
