// `shoestring sample CHECKPOINT --prompt TEXT [--prompt TEXT]... [--negative-prompt TEXT] [--width W --height H]
// [--steps N] [--cfg X] [--sampler ddim|euler|euler_a|dpmpp_2m] [--seed S] [--count N] [--lora FILE
// [--lora-scale X]]... [--tokenizer-dir DIR] --out FILE.png [--device auto|cpu|cuda|cuda:N]`
#include <cmath>
#include <filesystem>

#include <CLI/CLI.hpp>
#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include "shoestring/cli/commands.h"
#include "shoestring/core/device.h"
#include "shoestring/core/error.h"
#include "shoestring/core/threads.h"
#include "shoestring/train/ldm_sampling.h"
#include "shoestring/train/samplers.h"
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

/// "1 prompt", "2 prompts".
std::string plural(size_t n, const char* noun) { return fmt::format("{} {}{}", n, noun, n == 1 ? "" : "s"); }

}  // namespace

void register_sample(CLI::App& app) {
  struct Args {
    std::string checkpoint;
    std::vector<std::string> prompts;
    std::string negative_prompt;
    int64_t steps = 30;
    double cfg = 4.0;
    int64_t seed = 0;
    int64_t count = 4;
    int64_t width = 0, height = 0;
    std::string sampler = "ddim";
    std::vector<std::string> loras;
    std::vector<double> lora_scales;
    std::string tokenizer_dir;
    int64_t clip_skip = 0;
    std::string prediction = "auto";
    std::string out;
    std::string device = "auto";
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand("sample", "generate images from a trained checkpoint");
  cmd->add_option("checkpoint", args->checkpoint,
                  "model .safetensors: the emoji example's, or a single-file SD 1.5 / SDXL / SSD-1B checkpoint (a "
                  "run's RUN_DIR/model.safetensors, or one from ComfyUI / A1111 / kohya)")
      ->required();
  cmd->add_option("--prompt", args->prompts, "prompt (repeatable; one grid row each)")
      ->required()
      ->allow_extra_args(false);
  CLI::Option* negative = cmd->add_option("--negative-prompt", args->negative_prompt,
                                          "SD 1.5 / SDXL: the prompt guidance steers away from (default empty)");
  cmd->add_option("--steps", args->steps, "sampler steps (UNet evaluations per image)")->check(CLI::Range(1, 1000));
  CLI::Option* cfg = cmd->add_option("--cfg", args->cfg,
                                     "classifier-free guidance scale (1 = off; default 4 for the emoji model, 7.5 "
                                     "for SD 1.5 / SDXL, as kohya's sample_prompts)")
                         ->check(finite_number())
                         ->check(CLI::Range(0.0, 100.0));
  cmd->add_option("--seed", args->seed, "first seed; columns use seed, seed+1, ...")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 62));
  cmd->add_option("--count", args->count, "images per prompt (grid columns)")->check(CLI::Range(1, 64));
  CLI::Option* width = cmd->add_option("--width", args->width,
                                       "SD 1.5 / SDXL: image width in pixels (default: --height when given, else the "
                                       "run's resolution, else 512 for SD 1.5 and 1024 for SDXL / SSD-1B)")
                           ->check(CLI::Range(8, 8192));
  CLI::Option* height =
      cmd->add_option("--height", args->height,
                      "SD 1.5 / SDXL: image height in pixels (default: --width when given, else as --width)")
          ->check(CLI::Range(8, 8192));
  CLI::Option* sampler = cmd->add_option("--sampler", args->sampler,
                                         "SD 1.5 / SDXL: ddim (default, as kohya's samples), euler, euler_a, "
                                         "dpmpp_2m (k-diffusion's)");
  CLI::Option* lora =
      cmd->add_option("--lora", args->loras, "SD 1.5 / SDXL: kohya LoRA file merged into the UNet (repeatable)")
          ->allow_extra_args(false);
  CLI::Option* lora_scale = cmd->add_option("--lora-scale", args->lora_scales,
                                            "LoRA multiplier: one for all --lora files, or one per file (default 1)")
                                ->allow_extra_args(false)
                                ->check(finite_number());
  CLI::Option* tokenizer =
      cmd->add_option("--tokenizer-dir", args->tokenizer_dir,
                      "SD 1.5 / SDXL: folder with CLIP's vocab.json and merges.txt (default: the run's tokenizer_dir)");
  CLI::Option* clip_skip =
      cmd->add_option("--clip-skip", args->clip_skip, "SD 1.5: clip_skip (default: the run's, else 1)")
          ->check(CLI::Range(1, 12));
  CLI::Option* prediction =
      cmd->add_option("--prediction", args->prediction,
                      "SD 1.5 / SDXL: what the UNet predicts: auto (the file's metadata, else the "
                      "run's v_parameterization, else epsilon), epsilon, v")
          ->check(CLI::IsMember({"auto", "epsilon", "v"}));
  cmd->add_option("--out", args->out, "output PNG")->required();
  cmd->add_option("--device", args->device,
                  "where to sample: auto (first CUDA device if any, else cpu), cpu, cuda, "
                  "cuda:N (the same noise, drawn on the CPU, on every device)");
  cmd->callback([=] {
    const at::Device device = resolve_device(args->device, "--device");  // before any work
    namespace fs = std::filesystem;
    fs::path out(args->out);
    fs::path parent = out.parent_path().empty() ? fs::path(".") : out.parent_path();
    if (!fs::is_directory(parent)) fail("--out '{}': folder '{}' does not exist", args->out, parent.string());
    if (fs::is_directory(out)) fail("--out '{}' is a directory, expected a .png file path", args->out);
    if (out.extension() != ".png") fail("--out '{}': the output is a PNG; use a .png file name", args->out);
    if (!fs::is_regular_file(args->checkpoint)) fail("checkpoint '{}': no such file", args->checkpoint);
    const SamplerKind sampler_kind = parse_sampler(args->sampler, "--sampler");
    configure_threads(0);
    SampleRequest req;
    req.prompts = args->prompts;
    for (int64_t i = 0; i < args->count; ++i) req.seeds.push_back(static_cast<uint64_t>(args->seed + i));
    req.steps = args->steps;
    req.cfg = args->cfg;
    if (is_ldm_checkpoint(args->checkpoint)) {
      LdmSampleRequest r;
      r.images = req;
      if (cfg->count() == 0) r.images.cfg = 7.5;
      r.negative_prompt = args->negative_prompt;
      // One of the two given: a square image of that side.
      r.width = args->width > 0 ? args->width : args->height;
      r.height = args->height > 0 ? args->height : args->width;
      r.sampler = sampler_kind;
      if (!args->lora_scales.empty() && args->lora_scales.size() != 1 &&
          args->lora_scales.size() != args->loras.size()) {
        fail("--lora-scale given {} times for {} --lora files: give one scale for all, or one per file",
             args->lora_scales.size(), args->loras.size());
      }
      if (!args->lora_scales.empty() && args->loras.empty()) fail("--lora-scale without --lora");
      for (size_t i = 0; i < args->loras.size(); ++i) {
        const double scale = args->lora_scales.empty()       ? 1.0
                             : args->lora_scales.size() == 1 ? args->lora_scales[0]
                                                             : args->lora_scales[i];
        r.loras.emplace_back(args->loras[i], scale);
      }
      r.tokenizer_dir = args->tokenizer_dir;
      r.clip_skip = args->clip_skip;
      r.prediction = args->prediction == "v"         ? LdmSampleRequest::Prediction::v
                     : args->prediction == "epsilon" ? LdmSampleRequest::Prediction::epsilon
                                                     : LdmSampleRequest::Prediction::automatic;
      r.device = device;
      const LdmSamples drawn = sample_ldm_checkpoint(args->checkpoint, r);
      save_sample_grid(args->out, drawn.images, r.images);
      spdlog::info("wrote {} ({} x {} seed{}; {}{}, {} x {} px, {} {} steps, cfg {}, {}-prediction, UNet in {})",
                   args->out, plural(req.prompts.size(), "prompt"), req.seeds.size(), req.seeds.size() == 1 ? "" : "s",
                   drawn.architecture, drawn.tiny ? " (tiny)" : "", drawn.width, drawn.height,
                   sampler_name(sampler_kind), req.steps, r.images.cfg, drawn.v_prediction ? "v" : "epsilon",
                   drawn.unet_dtype);
      return;
    }
    // The emoji model: flow matching, Euler, square at its training resolution.
    for (const CLI::Option* o :
         {negative, width, height, sampler, lora, lora_scale, tokenizer, clip_skip, prediction}) {
      if (o->count() > 0) {
        fail(
            "{} applies to SD 1.5 / SDXL / SSD-1B checkpoints; {} is the emoji example's model, which samples "
            "square images at its training resolution with its flow-matching Euler sampler",
            o->get_name(), args->checkpoint);
      }
    }
    TinyUNetCheckpoint loaded = load_tiny_unet_checkpoint(args->checkpoint, device);
    at::Tensor images = generate_images(loaded.model, loaded.tokenizer, req);
    save_sample_grid(args->out, images, req);
    spdlog::info("wrote {} ({} x {} seed{})", args->out, plural(req.prompts.size(), "prompt"), req.seeds.size(),
                 req.seeds.size() == 1 ? "" : "s");
  });
}

}  // namespace shoestring::cli
