#include "shoestring/train/config.h"

#include <cstdlib>
#include <filesystem>
#include <limits>
#include <sstream>
#include <variant>

#include <toml++/toml.h>

#include "shoestring/core/cpu_features.h"
#include "shoestring/core/device.h"
#include "shoestring/core/error.h"
#include "shoestring/io/atomic_file.h"
#include "shoestring/models/architecture.h"
#include "shoestring/nn/lora.h"
#include "shoestring/optim/factory.h"
#include "shoestring/train/config_schema.h"
#include "shoestring/train/sampling.h"

namespace shoestring {

using namespace config_detail;

namespace {

std::string where(const std::string& source, const toml::node& node) {
  const auto& pos = node.source().begin;
  if (pos.line == 0) return source;
  return fmt::format("{}:{}", source, pos.line);
}

/// `text` (toml++'s output) with each `key = <float>` line's value in its
/// shortest form that reads back as the same double (0.3, not toml++'s
/// 0.29999999999999999), still a TOML float (1.0, not 1). Lines of other
/// values (strings, arrays, tables) are left alone.
std::string shortest_floats(const std::string& text) {
  std::istringstream in(text);
  std::string line, out;
  while (std::getline(in, line)) {
    const size_t eq = line.find(" = ");
    if (eq != std::string::npos) {
      const std::string value = line.substr(eq + 3);
      const bool numeric = !value.empty() && value.find_first_not_of("+-0123456789.eE") == std::string::npos;
      if (numeric && value.find_first_of(".eE") != std::string::npos) {
        char* end = nullptr;
        const double v = std::strtod(value.c_str(), &end);
        if (end == value.c_str() + value.size()) {
          std::string shortest = fmt::format("{}", v);
          if (shortest.find_first_of(".eEn") == std::string::npos) shortest += ".0";  // n: inf / nan stay as they are
          line = line.substr(0, eq + 3) + shortest;
        }
      }
    }
    out += line;
    out += '\n';
  }
  if (!out.empty() && (text.empty() || text.back() != '\n')) out.pop_back();
  return out;
}

std::string describe(const toml::node& node) {
  std::ostringstream ss;
  if (node.is_string()) {
    ss << '"' << *node.value<std::string>() << '"';
  } else if (node.is_floating_point()) {
    ss << fmt::format("{}", *node.value<double>());  // shortest exact form: 0.05, not toml++'s 0.050000000000000003
  } else {
    node.visit([&](auto&& n) { ss << n; });
  }
  return ss.str();
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
      else if (key == "kind") r.kind = str(key, v);
      else {
        fail(
            "{}: precision rule {}: unknown key '{}' (expected match, kind, storage, compute, trainable, "
            "checkpoint, master)",
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
  // The emoji UNet's rule (model.channel_mult); a released architecture's own
  // rule (a multiple of 8 x 2^(levels-1)) is checked where its model is built.
  const bool emoji_unet = models::find_architecture(c.architecture).family == models::Family::tiny_unet;
  if (emoji_unet && c.resolution % down != 0) {
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
  std::optional<std::pair<int64_t, int64_t>> sample_size;
  for (size_t i = 0; i < c.sample_prompts.size(); ++i) {
    const std::string where = fmt::format("{}: sample_prompts[{}]", source, i);
    const SamplePrompt p = parse_sample_prompt(c.sample_prompts[i], where);
    const std::pair<int64_t, int64_t> size{p.width, p.height};
    if (sample_size && *sample_size != size) {
      fail(
          "{}: --w {} --h {} differs from an earlier prompt's --w {} --h {}: the rows of one sample grid share a "
          "size (0 = the run's)",
          where, p.width, p.height, sample_size->first, sample_size->second);
    }
    sample_size = size;
  }
  // kohya's retention keys thin out the checkpoints of a cadence; without it they have nothing to act on.
  if (c.save_last_n_steps > 0 && c.save_every_n_steps == 0) {
    fail(
        "{}: save_last_n_steps = {} needs save_every_n_steps: of the checkpoints saved every save_every_n_steps "
        "steps, it keeps those of the last {} steps",
        source, c.save_last_n_steps, c.save_last_n_steps);
  }
  if (c.save_last_n_epochs > 0 && c.save_every_n_epochs == 0) {
    fail(
        "{}: save_last_n_epochs = {} needs save_every_n_epochs: of the checkpoints saved every "
        "save_every_n_epochs epochs, it keeps the last {}",
        source, c.save_last_n_epochs, c.save_last_n_epochs);
  }
  try {
    nn::apply_network_args({}, c.network_args);
  } catch (const Error& e) {
    fail("{}: {}", source, e.what());
  }
  if (c.network_module.empty() && (!c.network_args.empty() || !c.network_weights.empty())) {
    fail("{}: network_args / network_weights need network_module = \"networks.lora\"", source);
  }
  // The form only: whether the machine has the device is checked when a run starts (resolve_device).
  try {
    parse_device(c.device, "device");
  } catch (const Error& e) {
    fail("{}: {}", source, e.what());
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
  if (const auto other = out.find("${"); other != std::string::npos) {
    const auto end = out.find('}', other);
    fail("path '{}': unknown variable {}; paths may use ${{SHOESTRING_CACHE}} and a leading ~", path,
         out.substr(other, end == std::string::npos ? std::string::npos : end - other + 1));
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
      if (r.kind) t.insert("kind", *r.kind);
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
  ss << root;
  return "# Resolved shoestring configuration (every key, defaults included).\n" + shortest_floats(ss.str()) + "\n";
}

precision::ComputeHardware compute_hardware(const TrainConfig& c) {
  // A CUDA device without bf16 (compute capability < 8.0) has had its bf16
  // settings turned into fp16 by adapt_precision_to_device before the policy
  // is built; what remains of bf16 there runs on the device's own units.
  // A config that names cuda computes there, even when this process has no
  // CUDA (`plan` for a GPU run, made on a CPU machine).
  const DeviceSetting::Kind kind = parse_device(c.device, "device").kind;
  const CudaAvailability cuda = cuda_availability();
  if (kind == DeviceSetting::Kind::cpu ||
      (kind == DeviceSetting::Kind::automatic && (!cuda.built_with_cuda || cuda.device_count == 0))) {
    return precision::cpu_hardware(cpu_features());
  }
  precision::ComputeHardware hw;
  hw.name = "CUDA device";
  hw.bf16_units = true;
  hw.units = "CUDA";
  return hw;
}

precision::Policy precision_policy(const TrainConfig& c) { return precision_policy(c, compute_hardware(c)); }

precision::Policy precision_policy(const TrainConfig& c, const precision::ComputeHardware& hardware) {
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
  precision::Policy policy = precision::Policy::from_specs(specs);
  if (auto sub = precision::choose_bf16_compute(precision::parse_bf16_compute(c.bf16_compute), hardware)) {
    policy.set_compute_substitution(std::move(*sub));
  }
  return policy;
}

}  // namespace shoestring
