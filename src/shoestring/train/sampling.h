// Text-to-image sampling with a trained TinyUNetModel: Euler integration of
// the flow-matching ODE with classifier-free guidance (see flow_matching.h),
// and the sample grid written during training and by `shoestring sample`.
#pragma once
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "shoestring/train/tiny_unet_model.h"

namespace shoestring {

class WordTokenizer;
class WeightFiles;
struct TrainConfig;
namespace models {
enum class Family;
}

/// What to sample: every prompt with every seed.
struct SampleRequest {
  std::vector<std::string> prompts;
  std::vector<uint64_t> seeds;  ///< the noise of seed s is the same for every prompt
  int64_t steps = 30;           ///< sampler steps (Euler; DDIM for the LDM UNets)
  double cfg = 4.0;             ///< guidance scale; 1 disables the unconditional pass
  int64_t max_batch = 64;       ///< images per forward pass (memory bound)
};

/// One line of sample_prompts with kohya's inline options (sd-scripts
/// library/train_util.py, sample_images: "PROMPT --n NEGATIVE --w W --h H
/// --s STEPS --l CFG --d SEED", split at " --"), each overriding the run's
/// default for that prompt's row of the grid.
struct SamplePrompt {
  std::string prompt;            ///< the text before the first " --"
  std::string negative;          ///< --n: the unconditional prompt of guidance ("" by default)
  int64_t width = 0;             ///< --w: pixels (0 = the run's)
  int64_t height = 0;            ///< --h
  int64_t steps = 0;             ///< --s (0 = sample_steps)
  std::optional<double> cfg;     ///< --l: guidance scale (default sample_cfg)
  std::optional<uint64_t> seed;  ///< --d: the row's first seed; columns use seed, seed + 1, ...
};

/// Parses `text` as above. Throws shoestring::Error naming `where` (e.g.
/// "sample_prompts[2]"), the option and what was expected for an option
/// other than n, w, h, s, l, d (kohya ignores others silently), a value that
/// is not a number in range (w, h in [8, 8192], s in [1, 1000], l finite in
/// [0, 100], d in [0, 2^62]), an option given twice, or an empty prompt.
SamplePrompt parse_sample_prompt(const std::string& text, const std::string& where);

/// Throws shoestring::Error "sample: WHAT is not valid UTF-8 (byte N): 'TEXT'"
/// (TEXT escaped, core/text.h printable) unless `text` is valid UTF-8.
void require_utf8_prompt(const std::string& text, const std::string& what);

/// The prompts of a grid drawn from a checkpoint, parsed, and every text to
/// encode once (the prompts, then their negatives).
struct SampleTexts {
  std::vector<SamplePrompt> prompts;   ///< one per grid row; --n defaults to the request's negative prompt
  std::vector<std::string> texts;      ///< each distinct text once
  std::map<std::string, int64_t> row;  ///< text -> its index in texts
  /// The grid's image size: the prompts' --w / --h (all rows share one), else
  /// `width` / `height`, else `fallback` (pixels).
  std::pair<int64_t, int64_t> size(int64_t width, int64_t height, int64_t fallback) const;
};

/// Parses `request.prompts` (kohya's inline options) with `negative` as the
/// default --n. Throws shoestring::Error when there are no prompts or seeds,
/// a text is not UTF-8, or rows ask for different sizes (--w / --h).
SampleTexts sample_texts(const SampleRequest& request, const std::string& negative);

/// What a checkpoint sampler (SD3, Stable Cascade) drew.
struct CheckpointSamples {
  at::Tensor images;  ///< uint8 [P*S, 3, H, W], row-major by prompt, on the CPU
  std::string architecture;
  bool tiny = false;
  int64_t width = 0, height = 0;  ///< the size asked for (pixels)
  std::string denoiser_dtype;     ///< the denoiser's compute dtype ("fp32", "bf16", "fp16")
  std::string notes;              ///< for the log line, e.g. "T5 as zeros", "previewer decode at 1/4 size"
};

/// Refuses a kohya LoRA file for `shoestring sample` before any merge unless
/// every key starts with `prefix` + "_" (the denoiser's modules, e.g.
/// lora_unet). Throws shoestring::Error naming the file and the first other
/// key (text-encoder modules, lora_te*, are named as such: they are not
/// applied, the text conditioning is computed without them).
void check_denoiser_lora(const std::string& path, const std::string& prefix);

/// The seeds of `prompt`'s row: request.seeds, or --d S, S + 1, ... (as many).
std::vector<uint64_t> row_seeds(const SamplePrompt& prompt, const SampleRequest& request);

/// Generates prompts.size() x seeds.size() images, row-major by prompt.
/// Returns uint8 [P*S, 3, R, R] with R the model's training resolution.
/// The model is put in eval mode for the duration and restored after; runs
/// under no-grad; does not touch libtorch's global RNG (noise comes from a
/// generator per seed). Each prompt may carry kohya's --s, --l and --d
/// (parse_sample_prompt); --n, --w and --h are refused (the emoji model is
/// square and guides with the empty caption). Throws shoestring::Error for an
/// empty request, a prompt that is not valid UTF-8 (naming it and the byte),
/// a bad inline option, or when the model produced a non-finite value (see
/// samples_to_uint8).
/// Runs on the model's device (module_device); noise is drawn on the CPU and
/// moved, so a seed gives the same starting noise on every device; the
/// result is on the CPU.
at::Tensor generate_images(TinyUNetModel& model, const WordTokenizer& tokenizer, const SampleRequest& request);

/// A trainable denoiser in a checkpoint, as the architecture registry detects it.
struct FoundDenoiser {
  std::string architecture;  ///< registry name, e.g. "sdxl", "sd35m", "cascade-c"
  bool tiny = false;         ///< the test-width variant
  std::string prefix;        ///< where the file keeps it ("" when bare)
};

/// The denoiser of `family` that is trainable from a config in `file`: the
/// detection its metadata's "architecture" names, else the first detected
/// (none when the file holds no such model).
std::optional<FoundDenoiser> find_denoiser(const WeightFiles& file, models::Family family);

/// The config of the run a model file belongs to: RUN_DIR/config.toml for a
/// final file (RUN_DIR/model.safetensors, RUN_DIR/lora.safetensors) or a
/// step checkpoint's (RUN_DIR/checkpoints/step-N/model.safetensors); none
/// when there is no such file, or (with a warning) when it does not parse.
std::optional<TrainConfig> run_config_beside(const std::string& model_path);

/// The path of that config.toml when it exists (readable or not), else "".
std::string run_config_path_beside(const std::string& model_path);

/// The weight file an option or config key (`what`, e.g. "--vae", "the run's
/// vae") names, opened. Throws shoestring::Error "WHAT 'PATH': why".
WeightFiles open_named_weights(const std::string& what, const std::string& path);

/// Refuses to sample a tiny run's file (`path`, of `architecture`) without
/// its run's config: its `part` (e.g. "previewer") was made at random from
/// the run's seed. Names the config when one exists but cannot be read.
[[noreturn]] void fail_tiny_part_without_run(const std::string& path, const std::string& architecture,
                                             const std::string& part);

/// The compute dtype to sample a denoiser with: bf16 on a CUDA device with
/// native bf16, fp16 on older ones; on the CPU bf16 when the file stores the
/// denoiser (its first tensor under `prefix`) in bf16 and the CPU has fast
/// bf16 units, else float32.
at::ScalarType sample_compute_dtype(const at::Device& device, const WeightFiles& file, const std::string& prefix);

/// Puts `module` in eval mode and back in its previous mode however the
/// scope ends (a failed sample grid is a warning and training goes on).
class EvalModeScope {
 public:
  explicit EvalModeScope(torch::nn::Module& module) : module_(module), was_training_(module.is_training()) {
    module_.eval();
  }
  ~EvalModeScope() { module_.train(was_training_); }
  EvalModeScope(const EvalModeScope&) = delete;
  EvalModeScope& operator=(const EvalModeScope&) = delete;

 private:
  torch::nn::Module& module_;
  bool was_training_;
};

/// The device of a module's first parameter (else its first buffer; the CPU
/// for a module with neither).
at::Device module_device(const torch::nn::Module& module);

/// Sampled images, floating [P*S, 3, R, R] in about [-1, 1] (row-major by
/// prompt as generate_images), to uint8 [P*S, 3, R, R]: (clamp(x, -1, 1) + 1)
/// * 127.5, rounded. Throws shoestring::Error if any value is NaN or
/// infinite (a cast would turn them into black or arbitrary pixels), naming
/// the first such image's prompt and seed, how many of its R*R pixels are
/// non-finite (a pixel: any of its channels), and how many of the images are
/// affected; also if the tensor's first dimension is not P*S.
at::Tensor samples_to_uint8(const at::Tensor& images, const SampleRequest& request);

/// Writes a grid (rows = prompts, columns = seeds) with each prompt printed
/// under its row, and a sidecar `<path minus .png>.txt` listing row prompts and
/// seeds: a header line, then one line per prompt, with newlines and other
/// control characters escaped (core/text.h printable) so that line i + 1 is
/// always row i's prompt. Images smaller than 64 px are enlarged (nearest) for legibility.
/// Both files are written atomically.
void save_sample_grid(const std::string& path, const at::Tensor& images, const SampleRequest& request);

}  // namespace shoestring
