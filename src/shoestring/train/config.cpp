#include "shoestring/train/config.h"

#include <cstdlib>
#include <filesystem>
#include <limits>
#include <sstream>
#include <variant>

#include <toml++/toml.h>

#include "shoestring/core/error.h"
#include "shoestring/io/atomic_file.h"
#include "shoestring/models/architecture.h"
#include "shoestring/nn/lora.h"
#include "shoestring/optim/factory.h"

namespace shoestring {
namespace {

using Member =
    std::variant<bool TrainConfig::*, int64_t TrainConfig::*, double TrainConfig::*, std::string TrainConfig::*,
                 std::vector<int64_t> TrainConfig::*, std::vector<std::string> TrainConfig::*>;

/// Attributes of a key beyond its type and range (Field::flags).
enum FieldFlag : unsigned {
  /// A run's checkpoint depends on the value: --resume refuses a config that
  /// changes it (compared as rendered, e.g. "[1, 2]").
  kResumeValue = 1u << 0,
  /// As kResumeValue, for a path: compared after ${SHOESTRING_CACHE} / ~
  /// expansion and canonicalisation.
  kResumePath = 1u << 1,
  /// As kResumeValue, for whether the value is non-zero (ema_decay: EMA
  /// state exists or not; the decay itself may change).
  kResumeEnabled = 1u << 2,
  /// Only the emoji example's model (tiny-unet) reads the key.
  kEmojiModelOnly = 1u << 3,
  /// Only the released architectures (sd15, sdxl, ...) read the key.
  kReleasedModelOnly = 1u << 4,
};

/// One schema entry: key, where it lives in TrainConfig, what is allowed.
struct Field {
  const char* key;
  Member member;
  const char* help;
  double min = -std::numeric_limits<double>::infinity();  ///< numbers and list elements
  double max = std::numeric_limits<double>::infinity();
  std::vector<std::string> choices = {};  ///< strings
  unsigned flags = 0;                     ///< FieldFlag bits

  /// This entry with `bits` added to its flags.
  Field with(unsigned bits) const {
    Field f = *this;
    f.flags |= bits;
    return f;
  }
};

constexpr double kInf = std::numeric_limits<double>::infinity();

const std::vector<Field>& schema() {
  static const std::vector<Field> fields = {
      Field{"train_data_dir", &TrainConfig::train_data_dir,
            "dataset folder: Twemoji package (emoji.json) or kohya layout (image + .txt)"}
          .with(kResumePath),
      Field{"resolution", &TrainConfig::resolution, "training resolution in pixels (square)", 8, 1024}.with(
          kResumeValue),
      {"caption_dropout_rate", &TrainConfig::caption_dropout_rate,
       "probability of training on an empty caption (classifier-free guidance)", 0, 1},
      Field{"max_caption_length", &TrainConfig::max_caption_length, "caption tokens incl. <bos>", 2, 512}.with(
          kResumeValue),
      Field{"model.architecture", &TrainConfig::architecture,
            "model architecture: the emoji example's tiny-unet, or a released one (docs/architectures.md)", -kInf, kInf,
            models::denoiser_architectures()}
          .with(kResumeValue),
      Field{"model.tiny", &TrainConfig::tiny,
            "released architectures: the same block structure at test width (small channels)"}
          .with(kResumeValue),
      Field{"model.base_channels", &TrainConfig::base_channels, "UNet channels at full resolution", 8, 4096}.with(
          kResumeValue | kEmojiModelOnly),
      Field{"model.channel_mult", &TrainConfig::channel_mult, "channel multiplier per UNet level", 1, 64}.with(
          kResumeValue | kEmojiModelOnly),
      Field{"model.num_res_blocks", &TrainConfig::num_res_blocks, "ResBlocks per UNet level", 1, 16}.with(
          kResumeValue | kEmojiModelOnly),
      Field{"model.attention_levels", &TrainConfig::attention_levels,
            "UNet levels (0 = full resolution) with self- and cross-attention", 0, 16}
          .with(kResumeValue | kEmojiModelOnly),
      Field{"model.num_heads", &TrainConfig::num_heads, "attention heads", 1, 128}.with(kResumeValue | kEmojiModelOnly),
      Field{"model.norm_groups", &TrainConfig::norm_groups, "GroupNorm groups in the UNet", 1, 1024}.with(
          kEmojiModelOnly),
      Field{"model.text_dim", &TrainConfig::text_dim, "caption encoder width (UNet context_dim)", 8, 4096}.with(
          kResumeValue | kEmojiModelOnly),
      Field{"model.text_layers", &TrainConfig::text_layers, "caption encoder transformer layers", 0, 48}.with(
          kResumeValue | kEmojiModelOnly),
      {"model.dropout", &TrainConfig::dropout, "dropout in ResBlocks", 0, 0.99},
      Field{"timestep_sampling",
            &TrainConfig::timestep_sampling,
            "flow-matching time distribution (SD3: logit_normal)",
            -kInf,
            kInf,
            {"logit_normal", "uniform"}}
          .with(kEmojiModelOnly),
      {"logit_mean", &TrainConfig::logit_mean, "logit-normal mean", -10, 10},
      {"logit_std", &TrainConfig::logit_std, "logit-normal standard deviation", 1e-3, 10},
      Field{"optimizer_type",
            &TrainConfig::optimizer_type,
            "optimizer (kohya name)",
            -kInf,
            kInf,
            {"AdamW", "AdamW8bit", "Adafactor", "Lion", "Compass"}}
          .with(kResumeValue),
      {"optimizer_args", &TrainConfig::optimizer_args,
       "optimizer arguments as \"key=value\" strings, e.g. [\"weight_decay=0.01\", \"betas=0.9,0.999\"]"},
      Field{"optimizer_state_dtype",
            &TrainConfig::optimizer_state_dtype,
            "dtype of full-size optimizer state (bf16 is stochastically rounded)",
            -kInf,
            kInf,
            {"fp32", "bf16"}}
          .with(kResumeValue),
      {"stochastic_rounding", &TrainConfig::stochastic_rounding,
       "stochastically round bf16 weight and state updates (false: round-to-nearest, loses small updates)"},
      {"fused_backward_pass", &TrainConfig::fused_backward_pass,
       "apply the optimizer to each parameter inside backward and free its gradient at once"},
      {"fused_clip_method",
       &TrainConfig::fused_clip_method,
       "global-norm clipping with fused_backward_pass: previous step's norm (free) or an exact second "
       "backward (costs one more forward+backward)",
       -kInf,
       kInf,
       {"previous_step_norm", "two_pass"}},
      {"gradient_accumulation_dtype",
       &TrainConfig::gradient_accumulation_dtype,
       "buffer for summing bf16 gradients over micro-batches: fp32, or bf16 with stochastic rounding",
       -kInf,
       kInf,
       {"fp32", "bf16_sr"}},
      {"learning_rate", &TrainConfig::learning_rate, "peak learning rate", 0, 10},
      {"lr_scheduler",
       &TrainConfig::lr_scheduler,
       "learning-rate schedule after warmup",
       -kInf,
       kInf,
       {"constant", "constant_with_warmup", "cosine"}},
      {"lr_warmup_steps", &TrainConfig::lr_warmup_steps, "linear warmup length in optimizer steps", 0, 1e12},
      Field{"train_batch_size", &TrainConfig::train_batch_size, "images per micro-batch", 1, 65536}.with(kResumeValue),
      {"max_train_steps", &TrainConfig::max_train_steps, "optimizer steps to train", 1, 1e12},
      {"gradient_accumulation_steps", &TrainConfig::gradient_accumulation_steps, "micro-batches per optimizer step", 1,
       65536},
      {"max_grad_norm", &TrainConfig::max_grad_norm, "global gradient-norm clip (0 = off)", 0, 1e9},
      {"gradient_checkpointing", &TrainConfig::gradient_checkpointing, "recompute UNet block activations in backward"},
      {"attention_chunk_mib", &TrainConfig::attention_chunk_mib,
       "largest attention score matrix (MiB, per call) computed at once; larger ones run in query blocks "
       "(0 = never chunk)",
       0, 1e9},
      {"offload_optimizer_state", &TrainConfig::offload_optimizer_state,
       "keep optimizer state in host memory and stream it per parameter around each update"},
      {"mixed_precision",
       &TrainConfig::mixed_precision,
       "compute dtype with fp32 weights (shorthand for a precision rule; fp16 adds loss scaling)",
       -kInf,
       kInf,
       {"no", "bf16", "fp16"}},
      {"full_bf16", &TrainConfig::full_bf16, "bf16 weights and gradients; updates applied with stochastic rounding"},
      {"full_fp16", &TrainConfig::full_fp16,
       "fp16 weights (stochastically rounded updates) and fp16 compute, with dynamic loss scaling"},
      {"precision.overflow_threshold", &TrainConfig::overflow_threshold,
       "fp16 block outputs above this fraction of 65504 (or inf/NaN) count as overflow", 1e-6, 1},
      {"precision.auto_upcast", &TrainConfig::auto_upcast, "move fp16 blocks that overflow to fp32 compute and go on"},
      {"precision.loss_scale_init", &TrainConfig::loss_scale_init,
       "initial dynamic loss scale for fp16 (GradScaler init_scale)", 1, 1e38},
      {"precision.loss_scale_growth_interval", &TrainConfig::loss_scale_growth_interval,
       "clean fp16 steps before the loss scale doubles (GradScaler growth_interval)", 1, 1e12},
      {"save_precision",
       &TrainConfig::save_precision,
       "dtype of the final model.safetensors (auto = storage dtype; float = fp32, as kohya)",
       -kInf,
       kInf,
       {"auto", "fp32", "float", "fp16", "bf16"}},
      {"save_precision_force", &TrainConfig::save_precision_force,
       "save in save_precision even when values overflow or flush to zero (else an error)"},
      Field{"ema_decay", &TrainConfig::ema_decay, "EMA decay per optimizer step (0 = no EMA)", 0, 0.999999}.with(
          kResumeEnabled),
      {"max_nonfinite_steps", &TrainConfig::max_nonfinite_steps,
       "consecutive non-finite steps (skipped) before training stops", 1, 1e9},
      Field{"seed", &TrainConfig::seed, "seed for data order, noise, init and rounding", 0, 9.0e18}.with(kResumeValue),
      Field{"pretrained_model_name_or_path", &TrainConfig::pretrained_model_name_or_path,
            "base weights to start from: a shoestring model.safetensors (tiny-unet), or a single-file checkpoint "
            "(LDM / ComfyUI layout, or a sharded *.safetensors.index.json) for a released architecture; \"\" = random "
            "init"}
          .with(kResumePath),
      Field{"vae", &TrainConfig::vae,
            "VAE weights for an LDM architecture (a file with the VAE alone or under first_stage_model.); \"\" = the "
            "pretrained checkpoint's"}
          .with(kResumePath | kReleasedModelOnly),
      Field{"tokenizer_dir", &TrainConfig::tokenizer_dir,
            "folder holding CLIP's vocab.json and merges.txt (e.g. ComfyUI's comfy/sd1_tokenizer); \"\" = a word "
            "tokenizer built from the captions"}
          .with(kResumePath | kReleasedModelOnly),
      Field{"v_parameterization", &TrainConfig::v_parameterization,
            "LDM UNets: train the v-prediction target (SD 2.x style) instead of epsilon"}
          .with(kResumeValue | kReleasedModelOnly),
      Field{"clip_skip", &TrainConfig::clip_skip, "SD 1.x: condition on the N-th last CLIP layer's output", 1, 12}.with(
          kResumeValue | kReleasedModelOnly),
      Field{"network_module",
            &TrainConfig::network_module,
            "\"networks.lora\": train a LoRA (base weights frozen, output lora.safetensors); \"\": train every weight",
            -kInf,
            kInf,
            {"", "networks.lora"}}
          .with(kResumeValue),
      Field{"network_dim", &TrainConfig::network_dim, "LoRA rank", 1, 65536}.with(kResumeValue),
      Field{"network_alpha", &TrainConfig::network_alpha, "LoRA alpha: the delta is scaled by alpha / rank (0 = rank)",
            0, 1e6}
          .with(kResumeValue),
      Field{"network_args", &TrainConfig::network_args,
            "LoRA arguments as \"key=value\" strings: conv_dim, conv_alpha (LoRA on 3x3 convs), train_ff "
            "(feed-forward layers too)"}
          .with(kResumeValue),
      Field{"network_train_unet_only", &TrainConfig::network_train_unet_only,
            "LoRA on the UNet only, none on the text encoder"}
          .with(kResumeValue),
      {"network_weights", &TrainConfig::network_weights, "kohya LoRA file to start training from (\"\" = new LoRA)"},
      {"output_dir", &TrainConfig::output_dir, "run folder"},
      {"save_every_n_steps", &TrainConfig::save_every_n_steps,
       "checkpoint cadence in optimizer steps (0 = only at the end)", 0, 1e12},
      {"sample_every_n_steps", &TrainConfig::sample_every_n_steps,
       "sample-grid cadence in optimizer steps (0 = only at the end)", 0, 1e12},
      {"sample_prompts", &TrainConfig::sample_prompts, "prompts of the sample grid (one row each)"},
      {"sample_seeds", &TrainConfig::sample_seeds, "seeds per prompt (grid columns)", 1, 64},
      {"sample_steps", &TrainConfig::sample_steps, "sampler steps (Euler for tiny-unet, DDIM for the LDM UNets)", 1,
       1000},
      {"sample_cfg", &TrainConfig::sample_cfg, "classifier-free guidance scale", 0, 100},
      {"log_every_n_steps", &TrainConfig::log_every_n_steps, "progress line cadence (no TTY)", 1, 1e9},
      {"num_threads", &TrainConfig::num_threads, "intra-op threads (0 = every CPU this process may use)", 0, 1024},
  };
  return fields;
}

const Field* find_field(const std::string& key) {
  for (const auto& f : schema()) {
    if (key == f.key) return &f;
  }
  // A dotted key may also be given without its section ("base_channels").
  for (const auto& f : schema()) {
    std::string k = f.key;
    auto dot = k.rfind('.');
    if (dot != std::string::npos && k.substr(dot + 1) == key) return &f;
  }
  return nullptr;
}

std::string nearest_key(const std::string& key) {
  std::string best;
  size_t best_d = std::numeric_limits<size_t>::max();
  for (const auto& f : schema()) {
    std::string k = f.key;
    size_t d = edit_distance(key, k);
    auto dot = k.rfind('.');
    if (dot != std::string::npos) d = std::min(d, edit_distance(key, k.substr(dot + 1)));
    if (d < best_d) {
      best_d = d;
      best = k;
    }
  }
  return best;
}

std::string where(const std::string& source, const toml::node& node) {
  const auto& pos = node.source().begin;
  if (pos.line == 0) return source;
  return fmt::format("{}:{}", source, pos.line);
}

std::string describe(const toml::node& node) {
  std::ostringstream ss;
  if (node.is_string()) {
    ss << '"' << *node.value<std::string>() << '"';
  } else {
    node.visit([&](auto&& n) { ss << n; });
  }
  return ss.str();
}

std::string expected_text(const Field& f) {
  auto range = [&](const char* what) {
    if (std::isinf(f.min) && std::isinf(f.max)) return std::string(what);
    return fmt::format("{} in [{}, {}]", what, f.min, f.max);
  };
  return std::visit(
      [&](auto m) -> std::string {
        using T = std::decay_t<decltype(std::declval<TrainConfig>().*m)>;
        if constexpr (std::is_same_v<T, bool>) return "true or false";
        if constexpr (std::is_same_v<T, int64_t>) return range("an integer");
        if constexpr (std::is_same_v<T, double>) return range("a number");
        if constexpr (std::is_same_v<T, std::string>) {
          if (f.choices.empty()) return "a string";
          return fmt::format("one of \"{}\"", fmt::join(f.choices, "\", \""));
        }
        if constexpr (std::is_same_v<T, std::vector<int64_t>>) return range("an array of integers");
        if constexpr (std::is_same_v<T, std::vector<std::string>>) return "an array of strings";
      },
      f.member);
}

[[noreturn]] void bad_value(const std::string& at, const Field& f, const toml::node& node) {
  fail("{}: invalid value {} for '{}': expected {}", at, describe(node), f.key, expected_text(f));
}

void check_range(const std::string& at, const Field& f, const toml::node& node, double v) {
  if (v < f.min || v > f.max) bad_value(at, f, node);
}

/// Assigns one TOML value to its TrainConfig member, validating type and range.
void assign(TrainConfig& c, const Field& f, const toml::node& node, const std::string& at) {
  std::visit(
      [&](auto m) {
        using T = std::decay_t<decltype(c.*m)>;
        if constexpr (std::is_same_v<T, bool>) {
          if (!node.is_boolean()) bad_value(at, f, node);
          c.*m = *node.value<bool>();
        } else if constexpr (std::is_same_v<T, int64_t>) {
          if (!node.is_integer()) bad_value(at, f, node);
          int64_t v = *node.value<int64_t>();
          check_range(at, f, node, static_cast<double>(v));
          c.*m = v;
        } else if constexpr (std::is_same_v<T, double>) {
          if (!node.is_number()) bad_value(at, f, node);
          double v = *node.value<double>();
          if (!std::isfinite(v)) bad_value(at, f, node);
          check_range(at, f, node, v);
          c.*m = v;
        } else if constexpr (std::is_same_v<T, std::string>) {
          if (!node.is_string()) bad_value(at, f, node);
          std::string v = *node.value<std::string>();
          if (!f.choices.empty() && std::find(f.choices.begin(), f.choices.end(), v) == f.choices.end()) {
            bad_value(at, f, node);
          }
          c.*m = v;
        } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
          const toml::array* arr = node.as_array();
          if (!arr) bad_value(at, f, node);
          T out;
          for (const auto& el : *arr) {
            if (!el.is_integer()) bad_value(at, f, node);
            int64_t v = *el.value<int64_t>();
            check_range(at, f, node, static_cast<double>(v));
            out.push_back(v);
          }
          c.*m = out;
        } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
          const toml::array* arr = node.as_array();
          if (!arr) bad_value(at, f, node);
          T out;
          for (const auto& el : *arr) {
            if (!el.is_string()) bad_value(at, f, node);
            out.push_back(*el.value<std::string>());
          }
          c.*m = out;
        }
      },
      f.member);
}

/// Parses the [[precision.rule]] array of tables (appended to c.precision_rules).
void parse_precision_rules(TrainConfig& c, const toml::node& node, const std::string& source) {
  const toml::array* arr = node.as_array();
  if (!arr) {
    fail("{}: 'precision.rule' must be an array of tables, written [[precision.rule]]", where(source, node));
  }
  for (const auto& el : *arr) {
    const int index = static_cast<int>(c.precision_rules.size()) + 1;
    const std::string at = where(source, el);
    const toml::table* t = el.as_table();
    if (!t) fail("{}: precision rule {} must be a table with a 'match' key", at, index);
    precision::RuleSpec r;
    r.origin = at;
    auto str = [&](const std::string& key, const toml::node& v) {
      if (!v.is_string()) fail("{}: precision rule {}: '{}' must be a string", where(source, v), index, key);
      return *v.value<std::string>();
    };
    auto boolean = [&](const std::string& key, const toml::node& v) {
      if (!v.is_boolean()) fail("{}: precision rule {}: '{}' must be true or false", where(source, v), index, key);
      return *v.value<bool>();
    };
    for (const auto& [kk, v] : *t) {
      const std::string key(kk.str());
      if (key == "match") r.match = str(key, v);
      else if (key == "storage") r.storage = str(key, v);
      else if (key == "compute") r.compute = str(key, v);
      else if (key == "master") r.master = str(key, v);
      else if (key == "trainable") r.trainable = boolean(key, v);
      else if (key == "checkpoint") r.checkpoint = boolean(key, v);
      else {
        fail(
            "{}: precision rule {}: unknown key '{}' (expected match, storage, compute, trainable, checkpoint, "
            "master)",
            where(source, v), index, key);
      }
    }
    if (r.match.empty()) fail("{}: precision rule {} needs a non-empty 'match' glob", at, index);
    c.precision_rules.push_back(std::move(r));
  }
}

/// Walks a table; every leaf is looked up in the schema under its dotted path.
void apply_table(TrainConfig& c, const toml::table& table, const std::string& prefix, const std::string& source) {
  for (const auto& [k, node] : table) {
    std::string key = prefix.empty() ? std::string(k.str()) : prefix + "." + std::string(k.str());
    if (key == "precision.rule") {
      parse_precision_rules(c, node, source);
      continue;
    }
    const Field* f = find_field(key);
    if (!f && node.is_table()) {
      apply_table(c, *node.as_table(), key, source);
      continue;
    }
    if (!f) {
      fail("{}: unknown key '{}' (did you mean '{}'?)", where(source, node), key, nearest_key(key));
    }
    assign(c, *f, node, where(source, node));
  }
}

/// Cross-key checks that a single field's range cannot express.
void validate(const TrainConfig& c, const std::string& source) {
  if (c.full_bf16 && c.mixed_precision != "bf16" && c.mixed_precision != "no") {
    fail("{}: full_bf16 = true needs mixed_precision = \"bf16\" or \"no\"", source);
  }
  if (c.full_fp16 && c.mixed_precision != "fp16" && c.mixed_precision != "no") {
    fail("{}: full_fp16 = true needs mixed_precision = \"fp16\" or \"no\"", source);
  }
  precision::Policy policy;
  try {
    policy = precision_policy(c);
  } catch (const Error& e) {
    fail("{}: {}", source, e.what());
  }
  bool fp16 = false, master = false;
  for (const auto& r : policy.rules()) {
    fp16 = fp16 || r.storage == precision::Dtype::fp16 || r.compute == precision::Dtype::fp16;
    master = master || (r.master_fp32 && *r.master_fp32);
  }
  if (c.fused_backward_pass && (fp16 || master)) {
    fail(
        "{}: fused_backward_pass cannot be combined with fp16 (loss scaling must see every gradient before any "
        "step) or master = \"fp32\" rules",
        source);
  }
  for (int64_t level : c.attention_levels) {
    if (level >= static_cast<int64_t>(c.channel_mult.size())) {
      fail("{}: model.attention_levels has level {}, but model.channel_mult has only {} levels (0..{})", source, level,
           c.channel_mult.size(), c.channel_mult.size() - 1);
    }
  }
  if (c.channel_mult.empty()) fail("{}: model.channel_mult must not be empty", source);
  int64_t down = int64_t{1} << (c.channel_mult.size() - 1);
  if (c.resolution % down != 0) {
    fail("{}: resolution {} must be divisible by {} (2^(levels-1) for {} UNet levels)", source, c.resolution, down,
         c.channel_mult.size());
  }
  for (int64_t m : c.channel_mult) {
    if ((c.base_channels * m) % c.norm_groups != 0) {
      fail("{}: model.norm_groups ({}) must divide every level's channels (base_channels {} x {})", source,
           c.norm_groups, c.base_channels, m);
    }
  }
  if (c.text_dim % c.num_heads != 0) {
    fail("{}: model.text_dim ({}) must be divisible by model.num_heads ({})", source, c.text_dim, c.num_heads);
  }
  for (const auto& a : c.optimizer_args) {
    if (a.find('=') == std::string::npos) {
      fail("{}: optimizer_args entry \"{}\" must look like \"key=value\"", source, a);
    }
  }
  try {
    validate_optimizer(c.optimizer_type, c.optimizer_args);
  } catch (const Error& e) {
    fail("{}: {}", source, e.what());
  }
  if (c.sample_prompts.empty()) fail("{}: sample_prompts must hold at least one prompt", source);
  try {
    nn::apply_network_args({}, c.network_args);
  } catch (const Error& e) {
    fail("{}: {}", source, e.what());
  }
  if (c.network_module.empty() && (!c.network_args.empty() || !c.network_weights.empty())) {
    fail("{}: network_args / network_weights need network_module = \"networks.lora\"", source);
  }
}

void apply_overrides(TrainConfig& c, const std::vector<std::string>& overrides) {
  for (const auto& o : overrides) {
    auto eq = o.find('=');
    if (eq == std::string::npos || eq == 0) {
      fail("--set '{}': expected key=value (e.g. --set learning_rate=2e-4)", o);
    }
    std::string key = o.substr(0, eq);
    std::string value = o.substr(eq + 1);
    const Field* f = find_field(key);
    if (!f) fail("--set: unknown key '{}' (did you mean '{}'?)", key, nearest_key(key));
    toml::table t;
    try {
      t = toml::parse("v = " + value);
    } catch (const toml::parse_error&) {
      // A bare word is a string: --set output_dir=runs/x
      toml::table s;
      s.insert("v", value);
      t = std::move(s);
    }
    assign(c, *f, *t.get("v"), fmt::format("--set {}", key));
  }
}

}  // namespace

std::string expand_path(const std::string& path) {
  std::string out = path;
  const std::string var = "${SHOESTRING_CACHE}";
  auto pos = out.find(var);
  if (pos != std::string::npos) {
    const char* env = std::getenv("SHOESTRING_CACHE");
    std::string cache;
    if (env && *env) {
      cache = env;
    } else {
      const char* home = std::getenv("HOME");
      cache = std::string(home ? home : ".") + "/.cache/shoestring";
    }
    out.replace(pos, var.size(), cache);
  }
  if (!out.empty() && out[0] == '~') {
    const char* home = std::getenv("HOME");
    out = std::string(home ? home : ".") + out.substr(1);
  }
  return out;
}

TrainConfig parse_config(const std::string& toml_text, const std::string& source_name,
                         const std::vector<std::string>& overrides) {
  toml::table table;
  try {
    table = toml::parse(toml_text, source_name);
  } catch (const toml::parse_error& e) {
    fail("{}:{}: TOML syntax error: {}", source_name, e.source().begin.line, e.description());
  }
  TrainConfig c;
  apply_table(c, table, "", source_name);
  apply_overrides(c, overrides);
  validate(c, source_name);
  return c;
}

TrainConfig load_config(const std::string& path, const std::vector<std::string>& overrides) {
  return parse_config(read_file(path), path, overrides);
}

std::string to_toml(const TrainConfig& c) {
  toml::table root;
  for (const auto& f : schema()) {
    std::string key = f.key;
    toml::table* target = &root;
    auto dot = key.find('.');
    if (dot != std::string::npos) {
      std::string section = key.substr(0, dot);
      if (!root.contains(section)) root.insert(section, toml::table{});
      target = root.get_as<toml::table>(section);
      key = key.substr(dot + 1);
    }
    std::visit(
        [&](auto m) {
          using T = std::decay_t<decltype(c.*m)>;
          if constexpr (std::is_same_v<T, std::vector<int64_t>> || std::is_same_v<T, std::vector<std::string>>) {
            toml::array arr;
            for (const auto& v : c.*m) arr.push_back(v);
            target->insert(key, std::move(arr));
          } else {
            target->insert(key, c.*m);
          }
        },
        f.member);
  }
  {
    toml::array rules;
    for (const auto& r : c.precision_rules) {
      toml::table t;
      t.insert("match", r.match);
      if (r.storage) t.insert("storage", *r.storage);
      if (r.compute) t.insert("compute", *r.compute);
      if (r.trainable) t.insert("trainable", *r.trainable);
      if (r.checkpoint) t.insert("checkpoint", *r.checkpoint);
      if (r.master) t.insert("master", *r.master);
      rules.push_back(std::move(t));
    }
    if (!root.contains("precision")) root.insert("precision", toml::table{});
    root.get_as<toml::table>("precision")->insert("rule", std::move(rules));
  }
  std::ostringstream ss;
  ss << "# Resolved shoestring configuration (every key, defaults included).\n" << root << "\n";
  return ss.str();
}

std::string config_reference_markdown() {
  const TrainConfig defaults;
  std::string out =
      "# Config keys\n\n"
      "A run is described by one TOML file. Keys follow kohya sd-scripts' names where the concept is the\n"
      "same. Keys shown as `section.key` may be written inside a `[section]` table or dotted; the part\n"
      "after the dot alone is accepted too. `--set key=value` overrides any key from the command line.\n"
      "Paths may use `${SHOESTRING_CACHE}` (default `~/.cache/shoestring`) and `~`.\n\n"
      "This page is generated from the schema in `src/shoestring/train/config.cpp`\n"
      "(`config_reference_markdown()`); a test checks it is current.\n\n"
      "| key | default | allowed | meaning |\n|---|---|---|---|\n";
  for (const auto& f : schema()) {
    std::string def = std::visit(
        [&](auto m) -> std::string {
          using T = std::decay_t<decltype(defaults.*m)>;
          const T& v = defaults.*m;
          if constexpr (std::is_same_v<T, bool>) return v ? "true" : "false";
          if constexpr (std::is_same_v<T, std::string>) return "\"" + v + "\"";
          if constexpr (std::is_same_v<T, std::vector<int64_t>>) return fmt::format("[{}]", fmt::join(v, ", "));
          if constexpr (std::is_same_v<T, std::vector<std::string>>) {
            std::vector<std::string> q;
            for (const auto& s : v) q.push_back("\"" + s + "\"");
            return fmt::format("[{}]", fmt::join(q, ", "));
          }
          if constexpr (std::is_same_v<T, int64_t> || std::is_same_v<T, double>) return fmt::format("{}", v);
        },
        f.member);
    out += fmt::format("| `{}` | `{}` | {} | {} |\n", f.key, def, expected_text(f), f.help);
  }
  out +=
      "\n## Precision rules\n\n"
      "`[[precision.rule]]` entries (any number, later ones win key by key) set per-module precision; see\n"
      "[precision.md](precision.md). Keys of one rule:\n\n"
      "| key | allowed | meaning |\n|---|---|---|\n"
      "| `match` | a glob (`*` any run, `?` one character), required | module or parameter paths it applies to |\n"
      "| `storage` | `fp32`, `bf16`, `fp16`, `fp8_e4m3`, `fp8_e5m2` | dtype the weights are kept in (fp8: frozen "
      "only) |\n"
      "| `compute` | `fp32`, `bf16`, `fp16` | dtype the blocks compute in (fp16 is emulated on CPUs) |\n"
      "| `trainable` | true or false | false freezes the weights |\n"
      "| `checkpoint` | true or false | recompute the block's activations in backward |\n"
      "| `master` | `none`, `fp32` | keep an fp32 master copy of low-precision trainable weights |\n\n"
      "`mixed_precision`, `full_bf16`, `full_fp16` and `gradient_checkpointing` are shorthands that expand to\n"
      "rules placed before these.\n";
  return out;
}

precision::Policy precision_policy(const TrainConfig& c) {
  std::vector<precision::RuleSpec> specs =
      precision::shorthand_rules(c.mixed_precision, c.full_bf16, c.full_fp16, c.gradient_checkpointing);
  if (!c.network_module.empty()) {
    // LoRA: the base model is frozen (the trainer freezes it before adding
    // the adapters), so storage rules such as fp8 apply to frozen weights.
    precision::RuleSpec frozen;
    frozen.match = "*";
    frozen.trainable = false;
    frozen.origin = "shorthand network_module (LoRA: base weights frozen)";
    specs.push_back(frozen);
  }
  for (const auto& r : c.precision_rules) specs.push_back(r);
  return precision::Policy::from_specs(specs);
}

namespace {

/// The value of `f` in `c` as the resume message shows it: numbers and
/// booleans as fmt prints them, lists as "[a, b]".
std::string render_value(const TrainConfig& c, const Field& f) {
  return std::visit(
      [&](auto m) -> std::string {
        using T = std::decay_t<decltype(c.*m)>;
        if constexpr (std::is_same_v<T, std::vector<int64_t>> || std::is_same_v<T, std::vector<std::string>>) {
          return fmt::format("[{}]", fmt::join(c.*m, ", "));
        } else {
          return fmt::format("{}", c.*m);
        }
      },
      f.member);
}

std::string canonical_path(const std::string& p) {
  if (p.empty()) return p;
  std::error_code ec;
  auto canonical = std::filesystem::weakly_canonical(expand_path(p), ec);
  return ec ? p : canonical.string();
}

}  // namespace

std::vector<std::string> resume_differences(const TrainConfig& was, const TrainConfig& now) {
  std::vector<std::string> diffs;
  for (const auto& f : schema()) {
    std::string key = f.key, a, b;
    if (f.flags & kResumeValue) {
      a = render_value(was, f);
      b = render_value(now, f);
    } else if (f.flags & kResumePath) {
      const auto member = std::get<std::string TrainConfig::*>(f.member);
      a = canonical_path(was.*member);
      b = canonical_path(now.*member);
    } else if (f.flags & kResumeEnabled) {
      const auto member = std::get<double TrainConfig::*>(f.member);
      key += " > 0";
      a = fmt::format("{}", was.*member > 0);
      b = fmt::format("{}", now.*member > 0);
    } else {
      continue;
    }
    if (a != b) diffs.push_back(fmt::format("{} (run: \"{}\", now: \"{}\")", key, a, b));
  }
  return diffs;
}

std::vector<std::string> ignored_keys(const TrainConfig& config, bool emoji_model) {
  const TrainConfig defaults;
  const unsigned not_read = emoji_model ? kReleasedModelOnly : kEmojiModelOnly;
  std::vector<std::string> keys;
  for (const auto& f : schema()) {
    if ((f.flags & not_read) && render_value(config, f) != render_value(defaults, f)) keys.push_back(f.key);
  }
  return keys;
}

std::vector<std::string> config_keys() {
  std::vector<std::string> keys;
  for (const auto& f : schema()) keys.push_back(f.key);
  return keys;
}

}  // namespace shoestring
