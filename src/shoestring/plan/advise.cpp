// The advisor behind `shoestring plan --budget`: searches the switches a
// user can flip, cheapest in expected speed first, and returns the config
// lines to paste (plan/memory_plan.h: advise).
#include <algorithm>
#include <cctype>
#include <cmath>
#include <functional>

#include "shoestring/core/error.h"
#include "shoestring/plan/memory_plan.h"

namespace shoestring::plan {
namespace {

constexpr int kW = static_cast<int>(MemoryCategory::weights);
constexpr int kG = static_cast<int>(MemoryCategory::gradients);
constexpr int kS = static_cast<int>(MemoryCategory::optimizer_state);
constexpr int kA = static_cast<int>(MemoryCategory::activations);
constexpr int kT = static_cast<int>(MemoryCategory::temporaries);

std::string fmt_bytes(int64_t b) {
  const double v = static_cast<double>(b);
  if (v >= (1LL << 30)) return fmt::format("{:.2f} GiB", v / (1LL << 30));
  if (v >= (1LL << 20)) return fmt::format("{:.1f} MiB", v / (1LL << 20));
  return fmt::format("{:.1f} KiB", v / 1024.0);
}

}  // namespace

int64_t parse_byte_size(const std::string& text) {
  std::string s;
  for (char ch : text) {
    if (!std::isspace(static_cast<unsigned char>(ch))) s += ch;
  }
  size_t pos = 0;
  double v = 0;
  try {
    v = std::stod(s, &pos);
  } catch (const std::exception&) {
    fail("'{}' is not a memory size (expected e.g. 8GiB, 512MiB, 1.5G, 2e9)", text);
  }
  std::string unit = s.substr(pos);
  for (auto& ch : unit) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  double mult = 1;
  if (unit.empty() || unit == "b") mult = 1;
  else if (unit == "k" || unit == "kib" || unit == "kb") mult = 1024.0;
  else if (unit == "m" || unit == "mib" || unit == "mb") mult = 1024.0 * 1024;
  else if (unit == "g" || unit == "gib" || unit == "gb") mult = 1024.0 * 1024 * 1024;
  else if (unit == "t" || unit == "tib" || unit == "tb") mult = 1024.0 * 1024 * 1024 * 1024;
  else fail("'{}': unknown unit '{}' (use B, KiB, MiB, GiB or TiB)", text, unit);
  if (!(v > 0) || !std::isfinite(v * mult)) fail("'{}' is not a positive memory size", text);
  if (v * mult >= 9.0e18) fail("'{}' is too large (at most 8 EiB)", text);
  return static_cast<int64_t>(v * mult);
}

Advice advise(const TrainConfig& config, int64_t vocab_size, int64_t budget, int world_size) {
  Advice advice;
  MemoryPlan base = plan_memory(config, vocab_size, world_size);
  if (base.predicted_peak_bytes <= budget) {
    advice.fits_already = true;
    advice.found = true;
    advice.best.plan = base;
    advice.best.cost = "none";
    return advice;
  }
  // Switches, in the order of expected speed cost (factor on time per image).
  struct Switch {
    const char* line;
    double slowdown;
    const char* cost;
    std::function<bool(const TrainConfig&)> applicable;
    std::function<void(TrainConfig&)> apply;
  };
  std::vector<Switch> switches = {
      {"fused_backward_pass = true", 1.0, "fused backward: about free",
       [](const TrainConfig& c) { return !c.fused_backward_pass; },
       [](TrainConfig& c) { c.fused_backward_pass = true; }},
      {"optimizer_type = \"AdamW8bit\"", 1.02, "8-bit AdamW state: ~2% slower steps",
       [](const TrainConfig& c) {
         return c.optimizer_type == "AdamW" || c.optimizer_type == "Compass" || c.optimizer_type == "SPARKLES";
       },
       [](TrainConfig& c) {
         c.optimizer_type = "AdamW8bit";
         c.optimizer_args.erase(std::remove_if(c.optimizer_args.begin(), c.optimizer_args.end(),
                                               [](const std::string& a) {
                                                 return a.rfind("weight_decay", 0) != 0 && a.rfind("betas", 0) != 0 &&
                                                        a.rfind("eps", 0) != 0;
                                               }),
                                c.optimizer_args.end());
       }},
      {"optimizer_type = \"Adafactor\"", 1.03, "Adafactor factored state: ~3% slower, different dynamics",
       [](const TrainConfig& c) { return c.optimizer_type != "Adafactor"; },
       [](TrainConfig& c) {
         c.optimizer_type = "Adafactor";
         c.optimizer_args.clear();
       }},
      {"optimizer_state_dtype = \"bf16\"", 1.0, "bf16 optimizer state (stochastic rounding): about free",
       [](const TrainConfig& c) { return c.optimizer_state_dtype != "bf16"; },
       [](TrainConfig& c) { c.optimizer_state_dtype = "bf16"; }},
      {"full_bf16 = true", 1.0, "bf16 weights with stochastic rounding: faster on bf16 hardware",
       [](const TrainConfig& c) { return !c.full_bf16 && !c.full_fp16; }, [](TrainConfig& c) { c.full_bf16 = true; }},
      {"attention_chunk_mib = 16", 1.05, "chunked attention: ~5% on attention layers",
       [](const TrainConfig& c) { return c.attention_chunk_mib == 0 || c.attention_chunk_mib > 16; },
       [](TrainConfig& c) { c.attention_chunk_mib = 16; }},
      {"offload_optimizer_state = true", 1.15, "optimizer state offload: two PCIe transfers of the state per step",
       [](const TrainConfig& c) { return !c.offload_optimizer_state; },
       [](TrainConfig& c) { c.offload_optimizer_state = true; }},
      {"gradient_checkpointing = true", 1.3, "gradient checkpointing: ~30% more compute (one extra forward)",
       [](const TrainConfig& c) { return !c.gradient_checkpointing; },
       [](TrainConfig& c) { c.gradient_checkpointing = true; }},
  };
  // Optimizer choices are exclusive: AdamW8bit xor Adafactor.
  std::vector<size_t> usable;
  for (size_t i = 0; i < switches.size(); ++i) {
    if (switches[i].applicable(config)) usable.push_back(i);
  }
  // Batch splits keeping images per step: batch / k with accumulation * k.
  std::vector<int64_t> splits{1};
  for (int64_t k = 2; k <= config.train_batch_size; k *= 2) {
    if (config.train_batch_size % k == 0) splits.push_back(k);
  }
  bool have = false;
  Proposal best, smallest;
  int64_t smallest_peak = INT64_MAX, smallest_batch = config.train_batch_size;
  const size_t n = usable.size();
  for (size_t mask = 0; mask < (size_t{1} << n); ++mask) {
    bool both_opt = false;
    {
      int opts = 0;
      for (size_t i = 0; i < n; ++i) {
        if ((mask >> i & 1) && std::string(switches[usable[i]].line).rfind("optimizer_type", 0) == 0) ++opts;
      }
      both_opt = opts > 1;
    }
    if (both_opt) continue;
    for (int64_t k : splits) {
      TrainConfig c = config;
      Proposal prop;
      prop.slowdown = 1.0;
      for (size_t i = 0; i < n; ++i) {
        if (!(mask >> i & 1)) continue;
        const Switch& s = switches[usable[i]];
        s.apply(c);
        prop.config_lines.push_back(s.line);
        prop.slowdown *= s.slowdown;
        prop.cost += (prop.cost.empty() ? "" : "; ") + std::string(s.cost);
      }
      if (k > 1) {
        c.train_batch_size = config.train_batch_size / k;
        c.gradient_accumulation_steps = config.gradient_accumulation_steps * k;
        prop.config_lines.push_back(fmt::format("train_batch_size = {}", c.train_batch_size));
        prop.config_lines.push_back(fmt::format("gradient_accumulation_steps = {}", c.gradient_accumulation_steps));
        // Smaller micro-batches use the hardware less well: ~10% per halving.
        prop.slowdown *= std::pow(1.1, std::log2(static_cast<double>(k)));
        prop.cost +=
            (prop.cost.empty() ? "" : "; ") +
            fmt::format("batch {} x {} accumulation steps: smaller matrices, ~{}% slower", c.train_batch_size,
                        c.gradient_accumulation_steps,
                        static_cast<int>(std::round((std::pow(1.1, std::log2(static_cast<double>(k))) - 1) * 100)));
      }
      if (!prop.config_lines.empty() && c.optimizer_type != config.optimizer_type) {
        // Show the arguments that go with a new optimizer.
        prop.config_lines.push_back(fmt::format("optimizer_args = [{}]", [&] {
          std::string s;
          for (const auto& a : c.optimizer_args) s += (s.empty() ? "\"" : ", \"") + a + "\"";
          return s;
        }()));
      }
      prop.plan = plan_memory(c, vocab_size, world_size);
      if (prop.plan.predicted_peak_bytes < smallest_peak) {
        smallest_peak = prop.plan.predicted_peak_bytes;
        smallest = prop;
        smallest_batch = c.train_batch_size;
      }
      if (prop.plan.predicted_peak_bytes <= budget) {
        const bool better = !have || prop.slowdown < best.slowdown - 1e-9 ||
                            (std::abs(prop.slowdown - best.slowdown) < 1e-9 &&
                             (prop.config_lines.size() < best.config_lines.size() ||
                              (prop.config_lines.size() == best.config_lines.size() &&
                               prop.plan.predicted_peak_bytes < best.plan.predicted_peak_bytes)));
        if (better) {
          best = prop;
          have = true;
        }
      }
    }
  }
  advice.found = have;
  if (have) {
    advice.best = best;
  } else {
    advice.best = smallest;
    const MemoryPlan& f = smallest.plan;
    advice.floor_reason = fmt::format(
        "the smallest configuration found needs {} (weights {}, optimizer state + EMA {}, activations {} at "
        "train_batch_size {}, gradients {}, temporaries {}); lower the resolution or the model size, or drop EMA "
        "(ema_decay = 0, {})",
        fmt_bytes(f.predicted_peak_bytes), fmt_bytes(f.at_peak[kW]), fmt_bytes(f.at_peak[kS]), fmt_bytes(f.at_peak[kA]),
        smallest_batch, fmt_bytes(f.at_peak[kG]), fmt_bytes(f.at_peak[kT]), fmt_bytes(f.ema_bytes));
  }
  return advice;
}

}  // namespace shoestring::plan
