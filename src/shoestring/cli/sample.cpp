// `shoestring sample CHECKPOINT --prompt TEXT [--prompt TEXT]... [--negative-prompt TEXT] [--width W --height H]
// [--steps N] [--cfg X] [--sampler ddim|euler|euler_a|dpmpp_2m] [--seed S] [--count N] [--lora FILE
// [--lora-scale X]]... [--tokenizer-dir DIR] [--clip-l FILE] [--clip-g FILE] [--t5xxl FILE] [--vae FILE]
// [--previewer FILE] --out FILE.png [--device auto|cpu|cuda|cuda:N]`
// The checkpoint's architecture picks the path: the emoji example's model,
// the LDM UNets (train/ldm_sampling.h), SD3.5 Medium (train/sd3_sampling.h),
// Stable Cascade stage C (train/cascade_sampling.h).
#include <cmath>
#include <filesystem>

#include <CLI/CLI.hpp>
#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include "shoestring/cli/commands.h"
#include "shoestring/core/device.h"
#include "shoestring/core/error.h"
#include "shoestring/core/threads.h"
#include "shoestring/io/weight_files.h"
#include "shoestring/train/cascade_sampling.h"
#include "shoestring/train/checkpoint_io.h"
#include "shoestring/train/ldm_sampling.h"
#include "shoestring/train/samplers.h"
#include "shoestring/train/sampling.h"
#include "shoestring/train/sd3_sampling.h"
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

/// kohya LoRA files with their multipliers: one --lora-scale for all, one per file, or none (1).
std::vector<std::pair<std::string, double>> lora_list(const std::vector<std::string>& loras,
                                                      const std::vector<double>& scales) {
  if (!scales.empty() && scales.size() != 1 && scales.size() != loras.size()) {
    fail("--lora-scale given {} times for {} --lora files: give one scale for all, or one per file", scales.size(),
         loras.size());
  }
  if (!scales.empty() && loras.empty()) fail("--lora-scale without --lora");
  std::vector<std::pair<std::string, double>> out;
  for (size_t i = 0; i < loras.size(); ++i)
    out.emplace_back(loras[i], scales.empty() ? 1.0 : scales.size() == 1 ? scales[0] : scales[i]);
  return out;
}

/// Refuses options that apply to other architectures than `family` (named in the message).
void refuse_options(const std::vector<const CLI::Option*>& options, const std::string& checkpoint,
                    const std::string& family) {
  for (const CLI::Option* o : options)
    if (o->count() > 0) fail("{} does not apply to {}: {} is {}", o->get_name(), checkpoint, checkpoint, family);
}

/// Whether `path` holds kohya LoRA tensors only (a run's lora.safetensors).
bool is_lora_file(const std::string& path) {
  const WeightFiles f = WeightFiles::open(path);
  if (f.names().empty()) return false;
  for (const auto& n : f.names())
    if (n.rfind("lora_", 0) != 0) return false;
  return true;
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
    std::string clip_l, clip_g, t5xxl, vae, previewer;
    std::string out;
    std::string device = "auto";
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand("sample", "generate images from a trained checkpoint");
  cmd->add_option("checkpoint", args->checkpoint,
                  "model .safetensors: the emoji example's, a single-file SD 1.5 / SDXL / SSD-1B or SD3.5 Medium "
                  "checkpoint, or a Stable Cascade stage C file (a run's RUN_DIR/model.safetensors, a step "
                  "checkpoint, or a released / ComfyUI / A1111 / kohya file); a step checkpoint of a ZeRO stage-3 "
                  "run: its checkpoint.index.json")
      ->required();
  cmd->add_option("--prompt", args->prompts, "prompt (repeatable; one grid row each)")
      ->required()
      ->allow_extra_args(false);
  CLI::Option* negative = cmd->add_option("--negative-prompt", args->negative_prompt,
                                          "the prompt guidance steers away from (default empty; not the emoji model)");
  cmd->add_option("--steps", args->steps, "sampler steps (denoiser evaluations per image; default 30)")
      ->check(CLI::Range(1, 1000));
  CLI::Option* cfg = cmd->add_option("--cfg", args->cfg,
                                     "classifier-free guidance scale (1 = off; default 4 for the emoji model and "
                                     "Stable Cascade, 7.5 for SD 1.5 / SDXL as kohya's sample_prompts, 5 for SD3.5 "
                                     "Medium as Stability's sd3_infer.py)")
                         ->check(finite_number())
                         ->check(CLI::Range(0.0, 100.0));
  cmd->add_option("--seed", args->seed, "first seed; columns use seed, seed+1, ...")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 62));
  cmd->add_option("--count", args->count, "images per prompt (grid columns)")->check(CLI::Range(1, 64));
  CLI::Option* width = cmd->add_option("--width", args->width,
                                       "image width in pixels (default: --height when given, else the run's "
                                       "resolution, else 512 for SD 1.5, 1024 for SDXL / SSD-1B / SD3.5, 768 for "
                                       "Stable Cascade, whose previews are a quarter of it)")
                           ->check(CLI::Range(8, 8192));
  CLI::Option* height =
      cmd->add_option("--height", args->height, "image height in pixels (default: --width when given, else as --width)")
          ->check(CLI::Range(8, 8192));
  CLI::Option* sampler = cmd->add_option("--sampler", args->sampler,
                                         "SD 1.5 / SDXL: ddim (default, as kohya's samples), euler, euler_a, "
                                         "dpmpp_2m (k-diffusion's)");
  CLI::Option* lora =
      cmd->add_option("--lora", args->loras,
                      "kohya LoRA file merged into the UNet / MMDiT / stage C (repeatable; not the emoji model)")
          ->allow_extra_args(false);
  CLI::Option* lora_scale = cmd->add_option("--lora-scale", args->lora_scales,
                                            "LoRA multiplier: one for all --lora files, or one per file (default 1)")
                                ->allow_extra_args(false)
                                ->check(finite_number());
  CLI::Option* tokenizer =
      cmd->add_option("--tokenizer-dir", args->tokenizer_dir,
                      "folder with CLIP's vocab.json and merges.txt (SD3 with T5: and spiece.model; "
                      "default: the run's tokenizer_dir)");
  CLI::Option* clip_skip =
      cmd->add_option("--clip-skip", args->clip_skip, "SD 1.5: clip_skip (default: the run's, else 1)")
          ->check(CLI::Range(1, 12));
  CLI::Option* prediction =
      cmd->add_option("--prediction", args->prediction,
                      "SD 1.5 / SDXL: what the UNet predicts: auto (the file's metadata, else the "
                      "run's v_parameterization, else epsilon), epsilon, v")
          ->check(CLI::IsMember({"auto", "epsilon", "v"}));
  CLI::Option* clip_l =
      cmd->add_option("--clip-l", args->clip_l,
                      "SD3.5: CLIP-L's file (default: the checkpoint's text_encoders.clip_l, else the "
                      "run's clip_l)");
  CLI::Option* clip_g = cmd->add_option("--clip-g", args->clip_g,
                                        "SD3.5 / Stable Cascade: OpenCLIP bigG's file (default SD3.5: the checkpoint's "
                                        "text_encoders.clip_g, else the run's clip_g; Cascade: the run's "
                                        "text_model_checkpoint_path)");
  CLI::Option* t5xxl = cmd->add_option("--t5xxl", args->t5xxl,
                                       "SD3.5: T5-XXL's file, may be the checkpoint itself (default: the run's t5xxl, "
                                       "else none: 77 zero tokens)");
  CLI::Option* vae = cmd->add_option("--vae", args->vae, "SD3.5: the SD3 VAE's file (default: the checkpoint's)");
  CLI::Option* previewer =
      cmd->add_option("--previewer", args->previewer,
                      "Stable Cascade: previewer.safetensors (default: the run's previewer_checkpoint_path)");
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
    if (fs::is_directory(args->checkpoint))
      fail("checkpoint '{}' is a directory, expected a .safetensors file", args->checkpoint);
    if (!fs::is_regular_file(args->checkpoint)) fail("checkpoint '{}': no such file", args->checkpoint);
    refuse_partial_checkpoint_model(args->checkpoint, "sample");
    if (is_lora_file(args->checkpoint)) {
      fail(
          "checkpoint '{}' is a LoRA file (kohya lora_* tensors only): pass its base model as CHECKPOINT and this "
          "file with --lora",
          args->checkpoint);
    }
    const SamplerKind sampler_kind = parse_sampler(args->sampler, "--sampler");
    configure_threads(0);
    SampleRequest req;
    req.prompts = args->prompts;
    for (int64_t i = 0; i < args->count; ++i) req.seeds.push_back(static_cast<uint64_t>(args->seed + i));
    req.steps = args->steps;
    req.cfg = args->cfg;
    const std::vector<std::pair<std::string, double>> loras = lora_list(args->loras, args->lora_scales);
    // The fields SD3's and Cascade's requests share; one of --width / --height alone: a square.
    auto request_of = [&](auto r, double cfg_scale) {
      r.images = req;
      r.images.cfg = cfg_scale;
      r.negative_prompt = args->negative_prompt;
      r.width = args->width > 0 ? args->width : args->height;
      r.height = args->height > 0 ? args->height : args->width;
      r.loras = loras;
      r.tokenizer_dir = args->tokenizer_dir;
      r.device = device;
      return r;
    };
    auto draw_and_save = [&](const CheckpointSamples& d, const SampleRequest& images) {
      save_sample_grid(args->out, d.images, images);
      const double cfg = images.cfg;
      spdlog::info("wrote {} ({} x {} seed{}; {}{}, {} x {} px, {} steps, cfg {}, {} in {}; {})", args->out,
                   plural(req.prompts.size(), "prompt"), req.seeds.size(), req.seeds.size() == 1 ? "" : "s",
                   d.architecture, d.tiny ? " (tiny)" : "", d.width, d.height, req.steps, cfg,
                   d.architecture == "sd35m" ? "MMDiT" : "stage C", d.denoiser_dtype, d.notes);
    };
    if (is_sd3_checkpoint(args->checkpoint)) {
      refuse_options({sampler, clip_skip, prediction, previewer}, args->checkpoint, "an SD3.5 Medium checkpoint");
      Sd3SampleRequest r = request_of(Sd3SampleRequest{}, cfg->count() == 0 ? 5.0 : args->cfg);
      r.clip_l = args->clip_l;
      r.clip_g = args->clip_g;
      r.t5xxl = args->t5xxl;
      r.vae = args->vae;
      draw_and_save(sample_sd3_checkpoint(args->checkpoint, r), r.images);
      return;
    }
    if (is_cascade_checkpoint(args->checkpoint)) {
      refuse_options({sampler, clip_skip, prediction, clip_l, t5xxl, vae}, args->checkpoint,
                     "a Stable Cascade stage C checkpoint");
      CascadeSampleRequest r = request_of(CascadeSampleRequest{}, args->cfg);
      r.clip_g = args->clip_g;
      r.previewer = args->previewer;
      draw_and_save(sample_cascade_checkpoint(args->checkpoint, r), r.images);
      return;
    }
    if (is_ldm_checkpoint(args->checkpoint)) {
      refuse_options({clip_l, clip_g, t5xxl, vae, previewer}, args->checkpoint, "an SD 1.5 / SDXL / SSD-1B checkpoint");
      LdmSampleRequest r;
      r.images = req;
      if (cfg->count() == 0) r.images.cfg = 7.5;
      r.negative_prompt = args->negative_prompt;
      // One of the two given: a square image of that side.
      r.width = args->width > 0 ? args->width : args->height;
      r.height = args->height > 0 ? args->height : args->width;
      r.sampler = sampler_kind;
      r.loras = loras;
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
    for (const CLI::Option* o : {negative, width, height, sampler, lora, lora_scale, tokenizer, clip_skip, prediction,
                                 clip_l, clip_g, t5xxl, vae, previewer}) {
      if (o->count() > 0) {
        fail(
            "{} applies to the released architectures' checkpoints; {} is the emoji example's model, which samples "
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
