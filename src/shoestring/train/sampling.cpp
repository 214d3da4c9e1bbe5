#include "shoestring/train/sampling.h"

#include <cmath>
#include <filesystem>
#include <set>

#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include "shoestring/core/cpu_features.h"
#include "shoestring/core/device.h"
#include "shoestring/core/error.h"
#include "shoestring/core/text.h"
#include "shoestring/core/utf8.h"
#include "shoestring/data/image.h"
#include "shoestring/data/tokenizer.h"
#include "shoestring/io/atomic_file.h"
#include "shoestring/io/weight_files.h"
#include "shoestring/models/architecture.h"
#include "shoestring/precision/compute_choice.h"
#include "shoestring/train/config.h"
#include "shoestring/train/flow_matching.h"

namespace shoestring {

SamplePrompt parse_sample_prompt(const std::string& text, const std::string& where) {
  SamplePrompt out;
  std::vector<std::string> parts;
  size_t from = 0;
  for (size_t at = text.find(" --"); at != std::string::npos; at = text.find(" --", from)) {
    parts.push_back(text.substr(from, at - from));
    from = at + 3;
  }
  parts.push_back(text.substr(from));
  out.prompt = parts[0];
  auto trim = [](std::string v) {
    const size_t b = v.find_first_not_of(' ');
    if (b == std::string::npos) return std::string();
    return v.substr(b, v.find_last_not_of(' ') - b + 1);
  };
  std::set<std::string> seen;
  for (size_t i = 1; i < parts.size(); ++i) {
    const std::string& part = parts[i];
    const size_t space = part.find(' ');
    const std::string option = part.substr(0, space);
    const std::string value = space == std::string::npos ? std::string() : trim(part.substr(space + 1));
    const std::string known = "--n negative prompt, --w width, --h height, --s steps, --l guidance scale, --d seed";
    if (option != "n" && option != "w" && option != "h" && option != "s" && option != "l" && option != "d") {
      fail("{}: '--{}' is not a sample prompt option (kohya's: {}); prompt: '{}'", where, option, known,
           printable(text));
    }
    if (!seen.insert(option).second) fail("{}: --{} is given twice; prompt: '{}'", where, option, printable(text));
    if (option == "n") {
      out.negative = value;
      continue;
    }
    auto number = [&](double lo, double hi, bool integer) {
      size_t used = 0;
      double v = 0;
      try {
        v = std::stod(value, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (value.empty() || used != value.size() || !std::isfinite(v) || v < lo || v > hi ||
          (integer && v != std::floor(v))) {
        fail("{}: --{} expects {} in [{}, {}], got '{}'; prompt: '{}'", where, option,
             integer ? "an integer" : "a number", lo, hi, printable(value), printable(text));
      }
      return v;
    };
    if (option == "w") out.width = static_cast<int64_t>(number(8, 8192, true));
    if (option == "h") out.height = static_cast<int64_t>(number(8, 8192, true));
    if (option == "s") out.steps = static_cast<int64_t>(number(1, 1000, true));
    if (option == "l") out.cfg = number(0, 100, false);
    if (option == "d") out.seed = static_cast<uint64_t>(number(0, 4611686018427387904.0, true));
  }
  out.prompt = trim(out.prompt);
  if (out.prompt.empty() && parts.size() > 1) fail("{}: no prompt before its options: '{}'", where, printable(text));
  return out;
}

void require_utf8_prompt(const std::string& text, const std::string& what) {
  const size_t bad = utf8_error_offset(text);
  if (bad != std::string_view::npos) fail("sample: {} is not valid UTF-8 (byte {}): '{}'", what, bad, printable(text));
}

std::vector<uint64_t> row_seeds(const SamplePrompt& prompt, const SampleRequest& request) {
  if (!prompt.seed) return request.seeds;
  std::vector<uint64_t> seeds;
  for (size_t i = 0; i < request.seeds.size(); ++i) seeds.push_back(*prompt.seed + i);
  return seeds;
}

at::Tensor generate_images(TinyUNetModel& model, const WordTokenizer& tokenizer, const SampleRequest& request) {
  if (request.prompts.empty() || request.seeds.empty()) fail("sampling: no prompts or no seeds given");
  std::vector<SamplePrompt> prompts;
  for (size_t i = 0; i < request.prompts.size(); ++i) {
    require_utf8_prompt(request.prompts[i], fmt::format("prompt {}", i + 1));
    prompts.push_back(parse_sample_prompt(request.prompts[i], fmt::format("sample prompt {}", i + 1)));
    const SamplePrompt& p = prompts.back();
    if (!p.negative.empty() || p.width > 0 || p.height > 0) {
      fail(
          "sample prompt {}: --{} applies to the LDM UNets; the emoji model samples square images at its training "
          "resolution and guides with the empty caption: '{}'",
          i + 1,
          !p.negative.empty() ? "n"
          : p.width > 0       ? "w"
                              : "h",
          printable(request.prompts[i]));
    }
  }
  torch::NoGradGuard no_grad;
  const EvalModeScope eval_mode(*model);
  const int64_t r = model->options().resolution;
  const int64_t c = model->options().unet.in_channels();
  // Noise is drawn on the CPU (the same images whatever the device), then moved.
  const at::Device device = module_device(*model);

  std::vector<at::Tensor> outputs;
  for (const SamplePrompt& p : prompts) {
    const double cfg = p.cfg.value_or(request.cfg);
    const int64_t steps = p.steps > 0 ? p.steps : request.steps;
    const bool guided = cfg != 1.0;
    const std::vector<uint64_t> seeds = row_seeds(p, request);
    const auto n = static_cast<int64_t>(seeds.size());
    const int64_t chunk = std::max<int64_t>(1, request.max_batch / (guided ? 2 : 1));
    for (int64_t start = 0; start < n; start += chunk) {
      const int64_t end = std::min(n, start + chunk);
      std::vector<at::Tensor> noises;
      for (int64_t k = start; k < end; ++k) {
        auto gen = at::make_generator<at::CPUGeneratorImpl>(seeds[static_cast<size_t>(k)]);
        noises.push_back(torch::randn({1, c, r, r}, gen, torch::kFloat32));
      }
      at::Tensor noise = torch::cat(noises).to(device);
      at::Tensor tokens = tokenizer.encode_batch(std::vector<std::string>(end - start, p.prompt)).to(device);
      if (guided) {
        tokens = torch::cat({tokens, tokenizer.encode_batch(std::vector<std::string>(end - start, "")).to(device)});
      }
      VelocityFn velocity = [&](const at::Tensor& x, const at::Tensor& t) {
        if (!guided) return model->forward(x, t, tokens).to(torch::kFloat32);
        at::Tensor v = model->forward(torch::cat({x, x}), torch::cat({t, t}), tokens).to(torch::kFloat32);
        auto parts = v.chunk(2);
        return parts[1] + cfg * (parts[0] - parts[1]);
      };
      outputs.push_back(sample_euler(velocity, noise, steps));
    }
  }
  return samples_to_uint8(torch::cat(outputs).cpu(), request);
}

at::Device module_device(const torch::nn::Module& module) {
  for (const auto& p : module.parameters()) return p.device();
  for (const auto& b : module.buffers()) return b.device();
  return at::Device(at::kCPU);
}

at::Tensor samples_to_uint8(const at::Tensor& images, const SampleRequest& request) {
  const int64_t n = images.size(0);
  const auto seeds = static_cast<int64_t>(request.seeds.size());
  if (n != static_cast<int64_t>(request.prompts.size()) * seeds) {
    fail("sampling: {} images for {} prompts x {} seeds", n, request.prompts.size(), seeds);
  }
  const at::Tensor bad = ~at::isfinite(images);  // [N, 3, R, R]
  if (bad.any().item<bool>()) {
    const at::Tensor bad_pixels = bad.any(1).flatten(1).sum(1);  // [N]: non-finite pixels per image
    const at::Tensor affected = bad_pixels.nonzero().flatten();
    const int64_t first = affected[0].item<int64_t>();
    const bool has_nan = at::isnan(images).any().item<bool>();
    const bool has_inf = at::isinf(images).any().item<bool>();
    const char* kind = has_nan && has_inf ? "NaN and inf" : has_nan ? "NaN" : "inf";
    fail(
        "sample: the model produced {} in {} of {} pixels for prompt '{}' seed {} ({} of {} images affected); no "
        "image written. Non-finite weights (a diverged run: inspect the checkpoint) or an extreme guidance scale "
        "(cfg {}) cause this",
        kind, bad_pixels[first].item<int64_t>(), images.size(-2) * images.size(-1),
        request.prompts[static_cast<size_t>(first / seeds)], request.seeds[static_cast<size_t>(first % seeds)],
        affected.size(0), n, request.cfg);
  }
  return ((images.to(torch::kFloat32).clamp(-1, 1) + 1) * 127.5).round().to(torch::kUInt8);
}

void save_sample_grid(const std::string& path, const at::Tensor& images, const SampleRequest& request) {
  at::Tensor imgs = images;
  if (imgs.size(-1) < 64) {
    int64_t factor = (64 + imgs.size(-1) - 1) / imgs.size(-1);
    imgs = imgs.repeat_interleave(factor, 2).repeat_interleave(factor, 3);
  }
  std::vector<at::Tensor> list;
  for (int64_t i = 0; i < imgs.size(0); ++i) list.push_back(imgs[i]);
  at::Tensor grid = make_grid(list, static_cast<int64_t>(request.seeds.size()), 2, request.prompts);
  save_png(path, grid);
  std::string sidecar = path;
  if (sidecar.size() > 4 && sidecar.substr(sidecar.size() - 4) == ".png") sidecar.resize(sidecar.size() - 4);
  sidecar += ".txt";
  std::string text = fmt::format("# rows: prompts; columns: seeds {}; {} sampler steps; cfg {}\n",
                                 fmt::join(request.seeds, ", "), request.steps, request.cfg);
  for (const auto& p : request.prompts) text += printable(p) + "\n";  // one line each, whatever they hold
  write_bytes_atomic(sidecar, text);
}

std::optional<FoundDenoiser> find_denoiser(const WeightFiles& file, models::Family family) {
  std::vector<models::TensorShape> shapes;
  for (const auto& name : file.names()) shapes.emplace_back(name, file.find(name)->shape);
  const auto meta = file.metadata().find("architecture");
  std::optional<FoundDenoiser> first;
  for (const auto& d : models::detect_architectures(shapes)) {
    const models::Architecture& a = models::find_architecture(d.architecture);
    if (a.family != family || !a.trainable_from_config) continue;
    FoundDenoiser f{d.architecture, d.tiny, d.prefix};
    if (meta != file.metadata().end() && meta->second == d.architecture) return f;
    // Variants with the same tensors (the tiny cascade-c and cascade-c-lite):
    // the one the metadata names.
    if (meta != file.metadata().end() && meta->second != d.architecture) {
      for (const models::Architecture& other : models::architectures()) {
        if (other.name != meta->second || other.family != family || !other.trainable_from_config) continue;
        const auto& mine = models::architecture_tensors(d.architecture, d.tiny);
        const auto& theirs = models::architecture_tensors(other.name, d.tiny);
        bool same = mine.size() == theirs.size();
        for (size_t i = 0; same && i < mine.size(); ++i)
          same = mine[i].name == theirs[i].name && mine[i].shape == theirs[i].shape;
        if (same) return FoundDenoiser{other.name, d.tiny, d.prefix};
      }
    }
    if (!first) first = f;
  }
  return first;
}

std::string run_config_path_beside(const std::string& model_path) {
  namespace fs = std::filesystem;
  const fs::path folder = fs::absolute(fs::path(model_path)).parent_path();
  fs::path config = folder / "config.toml";
  if (!fs::exists(config) && folder.parent_path().filename() == "checkpoints") {
    config = folder.parent_path().parent_path() / "config.toml";
  }
  return fs::exists(config) ? config.string() : std::string();
}

std::optional<TrainConfig> run_config_beside(const std::string& model_path) {
  const std::string config = run_config_path_beside(model_path);
  if (config.empty()) return std::nullopt;
  try {
    return load_config(config);
  } catch (const Error& e) {
    spdlog::warn("{}: cannot be read, so the run's settings are not used: {}", config, e.what());
    return std::nullopt;
  }
}

WeightFiles open_named_weights(const std::string& what, const std::string& path) {
  try {
    return WeightFiles::open(path);
  } catch (const Error& e) {
    fail("{} '{}': {}", what, path, e.what());
  }
}

void fail_tiny_part_without_run(const std::string& path, const std::string& architecture, const std::string& part) {
  const std::string config = run_config_path_beside(path);
  if (!config.empty())
    fail(
        "{}: its run's {} cannot be read (see the warning above), and a tiny {} file's {} is made at random from "
        "the run's seed: fix the config",
        path, config, architecture, part);
  fail(
      "{}: a tiny {} file outside its run folder: its {} was made at random from the run's seed; sample it where "
      "RUN_DIR/config.toml is",
      path, architecture, part);
}

at::ScalarType sample_compute_dtype(const at::Device& device, const WeightFiles& file, const std::string& prefix) {
  if (device.is_cuda()) {
    const auto cc = cuda_compute_capability(device);
    return cc && cuda_capability_has_bf16(cc->first, cc->second) ? torch::kBFloat16 : torch::kHalf;
  }
  at::ScalarType stored = torch::kFloat32;
  for (const auto& name : file.names()) {
    if (has_prefix(name, prefix)) {
      stored = file.find(name)->dtype == StDtype::BF16 ? torch::kBFloat16 : torch::kFloat32;
      break;
    }
  }
  const bool fast_bf16 =
      !precision::choose_bf16_compute(precision::Bf16Compute::automatic, precision::cpu_hardware(cpu_features()))
           .has_value();
  return stored == torch::kBFloat16 && fast_bf16 ? torch::kBFloat16 : torch::kFloat32;
}

SampleTexts sample_texts(const SampleRequest& request, const std::string& negative) {
  if (request.prompts.empty() || request.seeds.empty()) fail("sample: no prompts or no seeds given");
  require_utf8_prompt(negative, "the negative prompt");
  SampleTexts out;
  for (size_t i = 0; i < request.prompts.size(); ++i) {
    require_utf8_prompt(request.prompts[i], fmt::format("prompt {}", i + 1));
    out.prompts.push_back(parse_sample_prompt(request.prompts[i], fmt::format("prompt {}", i + 1)));
    if (out.prompts.back().negative.empty()) out.prompts.back().negative = negative;
    const SamplePrompt& p = out.prompts.back();
    const SamplePrompt& first = out.prompts.front();
    if (i > 0 && (p.width != first.width || p.height != first.height)) {
      fail("prompt {}: --w {} --h {} differs from prompt 1's --w {} --h {}: the rows of one grid share a size", i + 1,
           p.width, p.height, first.width, first.height);
    }
  }
  auto add = [&](const std::string& t) {
    if (out.row.emplace(t, static_cast<int64_t>(out.texts.size())).second) out.texts.push_back(t);
  };
  for (const SamplePrompt& p : out.prompts) add(p.prompt);
  for (const SamplePrompt& p : out.prompts) add(p.negative);
  return out;
}

std::pair<int64_t, int64_t> SampleTexts::size(int64_t width, int64_t height, int64_t fallback) const {
  const SamplePrompt& p = prompts.at(0);
  return {p.width > 0 ? p.width
          : width > 0 ? width
                      : fallback,
          p.height > 0 ? p.height
          : height > 0 ? height
                       : fallback};
}

void check_denoiser_lora(const std::string& path, const std::string& prefix) {
  std::optional<WeightFiles> opened;
  try {
    opened.emplace(WeightFiles::open(path));
  } catch (const Error& e) {
    fail("--lora {}: {}", path, e.what());
  }
  const WeightFiles& lora = *opened;
  if (lora.names().empty()) fail("--lora {}: holds no tensors, so no LoRA modules to merge", path);
  int64_t text_keys = 0;
  std::string example;
  for (const auto& name : lora.names()) {
    if (has_prefix(name, prefix + "_")) continue;
    if (has_prefix(name, "lora_te")) {
      if (text_keys++ == 0) example = name;
      continue;
    }
    fail("--lora {}: key '{}' is not a kohya LoRA module of the denoiser ({}_*)", path, name, prefix);
  }
  if (text_keys > 0) {
    fail(
        "--lora {}: holds {} text-encoder tensors (e.g. '{}'); `shoestring sample` merges the denoiser's LoRA "
        "modules ({}_*) only, which is what shoestring trains; text-encoder LoRA is not applied yet",
        path, text_keys, example, prefix);
  }
}

}  // namespace shoestring
