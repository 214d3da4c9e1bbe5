// `shoestring sample CHECKPOINT --prompt TEXT [--prompt TEXT]... [--steps N] [--cfg X] [--seed S] --out FILE.png
// [--device auto|cpu|cuda|cuda:N]`
#include <cmath>
#include <filesystem>

#include <CLI/CLI.hpp>
#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include "shoestring/cli/commands.h"
#include "shoestring/core/device.h"
#include "shoestring/core/error.h"
#include "shoestring/core/threads.h"
#include "shoestring/train/sampling.h"
#include "shoestring/train/tiny_unet_model.h"

namespace shoestring::cli {

namespace {
/// CLI11 check for a floating option: NaN and inf are refused (NaN passes
/// CLI::Range, as every comparison with it is false).
CLI::Validator finite_number() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        double v = 0;
        if (!CLI::detail::lexical_cast(text, v)) return "expected a number, got '" + text + "'";
        if (!std::isfinite(v)) return "must be a finite number, got '" + text + "'";
        return "";
      },
      "FINITE", "finite");
}

}  // namespace

void register_sample(CLI::App& app) {
  struct Args {
    std::string checkpoint;
    std::vector<std::string> prompts;
    int64_t steps = 30;
    double cfg = 4.0;
    int64_t seed = 0;
    int64_t count = 4;
    std::string out;
    std::string device = "auto";
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand("sample", "generate images from a trained checkpoint");
  cmd->add_option("checkpoint", args->checkpoint, "model .safetensors written by shoestring train")->required();
  cmd->add_option("--prompt", args->prompts, "prompt (repeatable; one grid row each)")
      ->required()
      ->allow_extra_args(false);
  cmd->add_option("--steps", args->steps, "Euler steps")->check(CLI::Range(1, 1000));
  cmd->add_option("--cfg", args->cfg, "classifier-free guidance scale (1 = off)")
      ->check(finite_number())
      ->check(CLI::Range(0.0, 100.0));
  cmd->add_option("--seed", args->seed, "first seed; columns use seed, seed+1, ...")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 62));
  cmd->add_option("--count", args->count, "images per prompt (grid columns)")->check(CLI::Range(1, 64));
  cmd->add_option("--out", args->out, "output PNG")->required();
  cmd->add_option("--device", args->device,
                  "where to sample: auto (first CUDA device if any, else cpu), cpu, cuda, "
                  "cuda:N (the same noise, drawn on the CPU, on every device)");
  cmd->callback([args] {
    const at::Device device = resolve_device(args->device, "--device");  // before any work
    namespace fs = std::filesystem;
    fs::path out(args->out);
    fs::path parent = out.parent_path().empty() ? fs::path(".") : out.parent_path();
    if (!fs::is_directory(parent)) fail("--out '{}': folder '{}' does not exist", args->out, parent.string());
    if (fs::is_directory(out)) fail("--out '{}' is a directory, expected a .png file path", args->out);
    if (out.extension() != ".png") fail("--out '{}': the output is a PNG; use a .png file name", args->out);
    configure_threads(0);
    TinyUNetCheckpoint loaded = load_tiny_unet_checkpoint(args->checkpoint, device);
    SampleRequest req;
    req.prompts = args->prompts;
    for (int64_t i = 0; i < args->count; ++i) req.seeds.push_back(static_cast<uint64_t>(args->seed + i));
    req.steps = args->steps;
    req.cfg = args->cfg;
    at::Tensor images = generate_images(loaded.model, loaded.tokenizer, req);
    save_sample_grid(args->out, images, req);
    spdlog::info("wrote {} ({} prompt{} x {} seed{})", args->out, req.prompts.size(),
                 req.prompts.size() == 1 ? "" : "s", req.seeds.size(), req.seeds.size() == 1 ? "" : "s");
  });
}

}  // namespace shoestring::cli
