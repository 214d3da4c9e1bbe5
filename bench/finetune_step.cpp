// bench/finetune_step: the whole user path of fine-tuning a released LDM
// architecture at real width, end to end through `train()`: a single-file
// checkpoint (UNet + VAE + CLIP text encoders in the LDM / ComfyUI layout)
// is loaded, images are encoded to latents and captions to text embeddings,
// the VAE and text encoders are freed, the UNet trains for a few steps, a
// sample is drawn and the final single file is written.
//
//   build/bench/finetune_step [--arch sd15] [--resolution 512] [--steps 2] [--lora] [--fp8-base]
//                             [--set key=value]... [--keep DIR] [--threads 0]
//
// --fp8-base (with --lora: kohya's fp8_base) stores the frozen UNet in
// fp8_e4m3 (one byte per weight of every Linear / Conv2d, nn/fp8_storage.h)
// through a precision rule; the bench then prints the last step's weights
// category (ledger) per base parameter: about 1 byte, against about 2 for the
// bf16 base (the same command without --fp8-base).
//
// No released checkpoint ships with the repository, so the bench first writes
// one with random weights (bf16; the numbers do not depend on the values) and
// uses the small CLIP tokenizer fixture of the tests and their Twemoji images.
// Defaults: full_bf16 (stochastic rounding), Adafactor fused into backward,
// gradient checkpointing, batch 1. Prints the trainer's log (which includes
// the planner's step-1 prediction beside the measured peak), then seconds per
// step and the run's peak bytes per ledger category.
#include <cstdio>
#include <filesystem>
#include <fstream>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include "bench_machine.h"
#include "shoestring/core/error.h"
#include "shoestring/core/units.h"
#include "shoestring/io/safetensors.h"
#include "shoestring/models/architecture.h"
#include "shoestring/models/clip_text.h"
#include "shoestring/models/vae.h"
#include "shoestring/nn/layers.h"
#include "shoestring/plan/memory_plan.h"
#include "shoestring/train/checkpoint_io.h"
#include "shoestring/train/config.h"
#include "shoestring/train/trainer.h"

using namespace shoestring;
namespace fs = std::filesystem;

namespace {

/// Writes a random single-file checkpoint of `arch` (UNet, VAE, text
/// encoders under their LDM prefixes), bf16, one component at a time.
void write_random_checkpoint(const std::string& arch, const std::string& path) {
  torch::manual_seed(0);
  nn::LayerInit init{torch::TensorOptions().dtype(torch::kBFloat16)};
  std::vector<NamedTensor> all;
  std::vector<std::shared_ptr<torch::nn::Module>> keep;
  auto add = [&](const std::string& prefix, const std::shared_ptr<torch::nn::Module>& m) {
    keep.push_back(m);
    for (const auto& [n, t] : module_tensors(*m)) all.push_back({prefix + n, t.to(torch::kBFloat16), std::nullopt});
  };
  add("", models::build_checkpoint_root(arch, init));
  add("first_stage_model.", models::build_architecture("vae", init));
  if (arch == "sd15") {
    add(models::kSd15ClipPrefix, models::ClipTextModel(models::ClipTextOptions::clip_l().init(init)).ptr());
  } else {
    add(models::kSdxlClipLPrefix, models::ClipTextModel(models::ClipTextOptions::clip_l().init(init)).ptr());
    add(models::kSdxlClipGPrefix, models::ClipTextModel(models::ClipTextOptions::clip_g().init(init)).ptr());
  }
  save_safetensors(path, all, {{"note", "random weights written by bench/finetune_step"}});
}

/// The CPU model and the instruction-set features the numbers depend on,
/// from /proc/cpuinfo (a local helper: core/cpu_features.h is not on main yet).
std::string cpu_description() {
  std::ifstream in("/proc/cpuinfo");
  std::string line, model = "unknown CPU", flags;
  while (std::getline(in, line)) {
    auto value = [&line] {
      const size_t colon = line.find(':');
      return colon == std::string::npos ? std::string() : line.substr(colon + 1 + (colon + 1 < line.size()));
    };
    if (line.rfind("model name", 0) == 0 && model == "unknown CPU") model = value();
    if (line.rfind("flags", 0) == 0 && flags.empty()) flags = " " + value() + " ";
  }
  std::string out = model + " |";
  for (const char* f : {"avx2", "avx512f", "avx512_bf16", "amx_bf16"}) {
    out += fmt::format(" {}{}", flags.find(std::string(" ") + f + " ") != std::string::npos ? "+" : "-", f);
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  shoestring::bench::prepare_process(argv);
  CLI::App app{"Fine-tune a real-width LDM architecture end to end (random single-file checkpoint)"};
  std::string arch = "sd15", keep;
  int64_t resolution = 0, steps = 2, threads = 0;
  bool lora = false, fp8_base = false;
  std::vector<std::string> sets;
  app.add_option("--arch", arch, "sd15, sdxl or ssd1b")->check(CLI::IsMember({"sd15", "sdxl", "ssd1b"}));
  app.add_option("--resolution", resolution, "pixels (default 512 for sd15, 1024 otherwise)");
  app.add_option("--steps", steps, "optimizer steps")->check(CLI::Range(1, 1000));
  app.add_flag("--lora", lora, "train a rank-16 LoRA instead of every UNet weight");
  app.add_flag("--fp8-base", fp8_base, "store the frozen UNet in fp8_e4m3 (with --lora: kohya's fp8_base)");
  app.add_option("--set", sets, "config override key=value (repeatable)");
  app.add_option("--keep", keep, "folder for the checkpoint and the run (kept); default: a temp folder, removed");
  app.add_option("--threads", threads, "intra-op threads (0 = every allowed CPU)");
  CLI11_PARSE(app, argc, argv);
  shoestring::bench::print_machine();
  if (resolution == 0) resolution = arch == "sd15" ? 512 : 1024;
  if (fp8_base && !lora) {
    std::fprintf(stderr, "error: --fp8-base needs --lora (fp8 weights are frozen)\n");
    return 1;
  }
  fmt::print("cpu: {}\n", cpu_description());
  const fs::path dir =
      keep.empty() ? fs::temp_directory_path() / fmt::format("shoestring_finetune_{}", ::getpid()) : fs::path(keep);
  try {
    fs::create_directories(dir);
    const std::string ckpt = (dir / (arch + "_random.safetensors")).string();
    if (!fs::exists(ckpt)) {
      spdlog::info("writing a random {} single-file checkpoint to {}", arch, ckpt);
      write_random_checkpoint(arch, ckpt);
    }
    fs::remove_all(dir / "run");
    std::string text = fmt::format(
        "pretrained_model_name_or_path = \"{}\"\n"
        "tokenizer_dir = \"{}/clip_tokenizer\"\n"
        "train_data_dir = \"{}/twemoji\"\n"
        "output_dir = \"{}\"\n"
        "resolution = {}\n"
        "train_batch_size = 1\n"
        "max_train_steps = {}\n"
        "learning_rate = 1e-5\n"
        "full_bf16 = true\n"
        "optimizer_type = \"{}\"\n"
        "fused_backward_pass = {}\n"
        "gradient_checkpointing = true\n"
        "num_threads = {}\n"
        "log_every_n_steps = 1\n"
        "sample_prompts = [\"red heart\"]\n"
        "sample_seeds = 1\n"
        "sample_steps = 2\n"
        "{}"
        "[model]\narchitecture = \"{}\"\n"
        "{}",
        ckpt, SHOESTRING_BENCH_SOURCE_DIR "/tests/data", SHOESTRING_BENCH_SOURCE_DIR "/tests/data",
        (dir / "run").string(), resolution, steps, lora ? "AdamW8bit" : "Adafactor", lora ? "false" : "true", threads,
        lora ? "network_module = \"networks.lora\"\nnetwork_dim = 16\nnetwork_alpha = 8\n" : "", arch,
        fp8_base ? "[[precision.rule]]\nmatch = \"*\"\nstorage = \"fp8_e4m3\"\ntrainable = false\n" : "");
    TrainConfig config = parse_config(text, "finetune_step.toml", sets);
    TrainRunOptions options;
    options.predict_memory = [](const TrainConfig& c, int64_t vocab) {
      try {
        return plan::plan_memory(c, vocab).to_json();
      } catch (const Error& e) {
        spdlog::warn("no memory prediction: {}", e.what());
        return nlohmann::json();
      }
    };
    TrainSummary s = train(config, options);
    // The last step's own time (the summary's average includes sampling and saving).
    double last_seconds = 0;
    int64_t step_weights = 0;
    {
      std::ifstream in(s.run_dir + "/metrics.jsonl");
      std::string line, last;
      while (std::getline(in, line)) {
        if (!line.empty()) last = line;
      }
      const nlohmann::json record = nlohmann::json::parse(last);
      last_seconds = record.at("seconds").get<double>();
      step_weights = record.value("peak_weights_bytes", int64_t{0});
    }
    fmt::print("{} @ {} px{}: {:.2f} s for step {} ({:.2f} s/step with sampling and saving); run peak {}\n", arch,
               resolution, lora ? " (LoRA)" : "", last_seconds, s.last_step, s.seconds_per_step,
               format_bytes(s.peak_memory["total"].get<int64_t>()));
    for (const auto& [k, v] : s.peak_memory.items()) {
      if (k != "total") fmt::print("  {:16s} {}\n", k, format_bytes(v.get<int64_t>()));
    }
    {
      // The base (UNet) parameters, counted on the meta device.
      const int64_t base = nn::parameter_count(*models::build_architecture(arch, nn::LayerInit{torch::kMeta}));
      fmt::print(
          "weights category at the last step: {} for {} UNet parameters = {:.3f} bytes per base parameter ({})\n",
          format_bytes(step_weights), base, static_cast<double>(step_weights) / static_cast<double>(base),
          fp8_base ? "fp8_e4m3 base" : "bf16 base");
    }
    // A LoRA run's final file holds the adapters only (kohya's layout).
    const std::string final_file = s.run_dir + (lora ? "/lora.safetensors" : "/model.safetensors");
    fmt::print("final {}: {} ({})\n", lora ? "LoRA file" : "single file", final_file,
               format_bytes(static_cast<int64_t>(fs::file_size(final_file))));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    if (keep.empty()) fs::remove_all(dir);
    return 1;
  }
  if (keep.empty()) fs::remove_all(dir);
  return 0;
}
