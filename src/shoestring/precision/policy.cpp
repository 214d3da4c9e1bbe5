#include "shoestring/precision/policy.h"

#include <map>
#include <set>

#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/core/units.h"
#include "shoestring/nn/fp8_storage.h"

namespace shoestring::precision {
namespace {

std::vector<std::string> prefixes(const std::string& path) {
  // "", "a", "a.b", ..., path
  std::vector<std::string> out{""};
  for (size_t i = 0; i < path.size(); ++i) {
    if (path[i] == '.') out.push_back(path.substr(0, i));
  }
  if (!path.empty()) out.push_back(path);
  return out;
}

std::string rule_label(int index, const std::vector<Rule>& rules) {
  if (index <= 0) return "default";
  return rules[index - 1].describe();
}

}  // namespace

std::string Rule::describe() const {
  const std::string pattern = kind ? fmt::format("'{}' kind {}", match, *kind) : fmt::format("'{}'", match);
  return origin.empty() ? fmt::format("rule {} ({})", index, pattern)
                        : fmt::format("rule {} ({}, {})", index, pattern, origin);
}

std::string module_kind(const torch::nn::Module& module) {
  std::string n = module.name();
  const size_t colon = n.rfind("::");
  if (colon != std::string::npos) n = n.substr(colon + 2);
  if (n.size() > 4 && n.compare(n.size() - 4, 4, "Impl") == 0) n.resize(n.size() - 4);
  return n;
}

std::string Settings::describe() const {
  return fmt::format("storage {}, compute {}{}, {}{}, master {}", to_string(storage), to_string(compute),
                     compute_substituted ? " (substituted)" : "", trainable ? "trainable" : "frozen",
                     checkpoint ? ", checkpoint" : "", master_fp32 ? "fp32" : "none");
}

bool glob_match(const std::string& pattern, const std::string& path) {
  // Iterative wildcard matching with backtracking to the last '*'.
  size_t p = 0, s = 0, star = std::string::npos, mark = 0;
  while (s < path.size()) {
    if (p < pattern.size() && (pattern[p] == '?' || pattern[p] == path[s])) {
      ++p;
      ++s;
    } else if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      mark = s;
    } else if (star != std::string::npos) {
      p = star + 1;
      s = ++mark;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

std::vector<RuleSpec> shorthand_rules(const std::string& mixed_precision, bool full_bf16, bool full_fp16,
                                      bool gradient_checkpointing) {
  if (full_bf16 && full_fp16) fail("full_bf16 and full_fp16 cannot both be true");
  std::vector<RuleSpec> out;
  if (mixed_precision == "bf16" || mixed_precision == "fp16") {
    RuleSpec r;
    r.match = "*";
    r.compute = mixed_precision;
    r.origin = "shorthand mixed_precision = \"" + mixed_precision + "\"";
    out.push_back(r);
  } else if (mixed_precision != "no") {
    fail("mixed_precision: expected \"no\", \"bf16\" or \"fp16\", got \"{}\"", mixed_precision);
  }
  if (full_bf16 || full_fp16) {
    RuleSpec r;
    r.match = "*";
    r.storage = r.compute = full_bf16 ? "bf16" : "fp16";
    r.master = "none";
    r.origin = full_bf16 ? "shorthand full_bf16" : "shorthand full_fp16";
    out.push_back(r);
  }
  if (gradient_checkpointing) {
    RuleSpec r;
    r.match = "*";
    r.checkpoint = true;
    r.origin = "shorthand gradient_checkpointing";
    out.push_back(r);
  }
  return out;
}

Policy Policy::from_specs(const std::vector<RuleSpec>& specs) {
  Policy policy;
  int index = 0;
  for (const auto& s : specs) {
    Rule r;
    r.index = ++index;
    r.match = s.match;
    r.kind = s.kind;
    r.origin = s.origin;
    const std::string who = r.describe();
    if (s.match.empty()) fail("precision {}: 'match' must be a non-empty glob (e.g. \"*\" or \"unet.down.*\")", who);
    if (s.kind && s.kind->empty())
      fail(
          "precision {}: 'kind' must name a module class (e.g. \"CascadeResBlock\"; `shoestring plan --explain` "
          "shows each block's)",
          who);
    if (s.storage) {
      Dtype d;
      if (!parse_dtype(*s.storage, d)) {
        fail("precision {}: storage = \"{}\" is not a dtype; expected one of fp32, bf16, fp16, fp8_e4m3, fp8_e5m2", who,
             *s.storage);
      }
      r.storage = d;
    }
    if (s.compute) {
      Dtype d;
      if (!parse_dtype(*s.compute, d) || is_fp8(d)) {
        fail("precision {}: compute = \"{}\" is not a compute dtype; expected one of fp32, bf16, fp16", who,
             *s.compute);
      }
      r.compute = d;
    }
    if (s.master) {
      if (*s.master == "fp32") {
        r.master_fp32 = true;
      } else if (*s.master == "none") {
        r.master_fp32 = false;
      } else {
        fail("precision {}: master = \"{}\" is not allowed; expected \"none\" or \"fp32\"", who, *s.master);
      }
    }
    r.trainable = s.trainable;
    r.checkpoint = s.checkpoint;
    if (r.storage && is_fp8(*r.storage)) {
      if (r.trainable && *r.trainable) {
        fail(
            "precision {}: storage = \"{}\" with trainable = true is contradictory: fp8 storage is for frozen "
            "weights only (set trainable = false, or store in bf16/fp16)",
            who, to_string(*r.storage));
      }
      if (r.master_fp32 && *r.master_fp32) {
        fail(
            "precision {}: storage = \"{}\" with master = \"fp32\" is contradictory: fp8 weights are frozen and "
            "have no master copy",
            who, to_string(*r.storage));
      }
    }
    policy.rules_.push_back(r);
  }
  return policy;
}

namespace {

// Whether `rule` matches the path prefix `p` itself (glob, and kind when set).
bool matches_at(const Rule& rule, const std::string& p, const KindOf& kind_of) {
  if (!glob_match(rule.match, p)) return false;
  return !rule.kind || (kind_of && kind_of(p) == *rule.kind);
}

// KindOf over a path -> kind map (which must outlive it).
KindOf kind_lookup(const std::map<std::string, std::string>& kinds) {
  return [&kinds](const std::string& p) {
    auto it = kinds.find(p);
    return it == kinds.end() ? std::string() : it->second;
  };
}

}  // namespace

bool Policy::applies(const Rule& rule, const std::string& path, const KindOf& kind_of) const {
  for (const auto& p : prefixes(path)) {
    if (matches_at(rule, p, kind_of)) return true;
  }
  return false;
}

Settings Policy::resolve(const std::string& path, const KindOf& kind_of) const {
  Settings s;
  const auto pre = prefixes(path);
  for (const auto& r : rules_) {
    bool hit = false;
    for (const auto& p : pre) {
      if (matches_at(r, p, kind_of)) {
        hit = true;
        break;
      }
    }
    if (!hit) continue;
    if (r.storage) s.storage = *r.storage, s.storage_rule = r.index;
    if (r.compute) s.compute = *r.compute, s.compute_rule = r.index;
    if (r.trainable) s.trainable = *r.trainable, s.trainable_rule = r.index;
    if (r.checkpoint) s.checkpoint = *r.checkpoint, s.checkpoint_rule = r.index;
    if (r.master_fp32) s.master_fp32 = *r.master_fp32, s.master_rule = r.index;
  }
  if (substitution_ && s.compute == substitution_->from) {
    s.compute = substitution_->to;
    s.compute_substituted = true;
  }
  return s;
}

int64_t storage_bytes(const ParamRow& p) { return p.fp8_packed ? 1 : container_bytes(p.settings.storage); }

Resolution resolve(const torch::nn::Module& model, const Policy& policy,
                   const std::vector<const nn::BlockTable*>& tables) {
  Resolution res;
  std::map<std::string, size_t> row_of;
  std::map<std::string, std::string> kinds;
  for (const auto& item : model.named_modules("", /*include_self=*/true))
    kinds[item.key()] = module_kind(*item.value());
  const KindOf kind_of = kind_lookup(kinds);
  for (const auto& item : model.named_modules("", /*include_self=*/true)) {
    ModuleRow row;
    row.path = item.key();
    row.kind = kinds[row.path];
    row.settings = policy.resolve(row.path, kind_of);
    for (const auto* t : tables) {
      if (t && t->is_block(item.value().get())) {
        row.block = true;
        row.checkpointable = row.checkpointable || t->is_checkpointable(item.value().get());
      }
    }
    row_of[row.path] = res.modules.size();
    res.modules.push_back(row);
  }
  const auto& rules = policy.rules();
  std::map<std::string, const torch::nn::Module*> module_at;
  for (const auto& item : model.named_modules("", /*include_self=*/true)) module_at[item.key()] = item.value().get();
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    ParamRow p;
    p.path = item.key();
    p.settings = policy.resolve(p.path, kind_of);
    p.numel = item.value().numel();
    p.shape = item.value().sizes().vec();
    const Settings& s = p.settings;
    if (is_fp8(s.storage) && s.trainable) {
      fail(
          "precision: {} sets storage = \"{}\" on parameter '{}', which is trainable ({}); fp8 storage is for "
          "frozen weights only: add trainable = false to that rule or a later one",
          rule_label(s.storage_rule, rules), to_string(s.storage), p.path,
          s.trainable_rule ? "set by " + rule_label(s.trainable_rule, rules) : std::string("the default"));
    }
    if (is_fp8(s.storage)) {
      const size_t dot = p.path.rfind('.');
      const std::string owner = dot == std::string::npos ? "" : p.path.substr(0, dot);
      auto m = module_at.find(owner);
      p.fp8_packed = m != module_at.end() && nn::can_store_fp8(*m->second, p.path.substr(dot + 1));
    }
    const bool master = s.master_fp32 && s.trainable && s.storage != Dtype::fp32;
    // Charge the parameter to its module and every ancestor.
    for (const auto& pre : prefixes(p.path)) {
      auto it = row_of.find(pre);
      if (it == row_of.end()) continue;
      ModuleRow& m = res.modules[it->second];
      m.parameters += p.numel;
      if (s.trainable) m.trainable_parameters += p.numel;
      m.weight_bytes += p.numel * storage_bytes(p);
      if (master) m.master_bytes += p.numel * 4;
    }
    res.params.push_back(std::move(p));
  }
  // Rules that match nothing.
  for (const auto& r : rules) {
    bool any = false;
    for (const auto& m : res.modules) {
      if (matches_at(r, m.path, kind_of)) {
        any = true;
        break;
      }
    }
    for (size_t i = 0; !any && !r.kind && i < res.params.size(); ++i) any = glob_match(r.match, res.params[i].path);
    if (any) continue;
    if (r.kind) {
      // A kind no module has is a misspelling, not a rule for another model: an error, or a recipe such as
      // "ResBlocks in fp32" would run without its rule.
      std::set<std::string> blocks;
      bool exists = false;
      for (const auto& m : res.modules) {
        exists = exists || m.kind == *r.kind;
        if (m.block) blocks.insert(m.kind);
      }
      if (!exists) {
        fail("precision {}: no module of this model is of kind {} (its blocks' kinds: {})", r.describe(), *r.kind,
             fmt::join(blocks, ", "));
      }
      std::set<std::string> there;
      for (const auto& m : res.modules) {
        if (glob_match(r.match, m.path)) there.insert(m.kind);
      }
      res.warnings.push_back(fmt::format(
          "precision {} matches no module: none of kind {} where '{}' matches{}", r.describe(), *r.kind, r.match,
          there.empty() ? std::string() : fmt::format(" (kinds there: {})", fmt::join(there, ", "))));
      continue;
    }
    std::string hint;
    for (const std::string& alt : {"*." + r.match, "*" + r.match + "*"}) {
      bool alt_hits = false;
      for (const auto& m : res.modules) alt_hits = alt_hits || glob_match(alt, m.path);
      for (size_t i = 0; !alt_hits && i < res.params.size(); ++i) alt_hits = glob_match(alt, res.params[i].path);
      if (alt_hits) {
        hint = fmt::format(" (paths are matched whole; did you mean \"{}\"?)", alt);
        break;
      }
    }
    std::string example =
        res.modules.size() > 1 ? fmt::format("; module paths look like '{}'", res.modules[1].path) : "";
    res.warnings.push_back(fmt::format("precision {} matches no module or parameter{}{}", r.describe(), hint,
                                       hint.empty() ? example : ""));
  }
  return res;
}

std::string format_explain(const Resolution& r, const Policy& policy) {
  std::string out = fmt::format("{:<56} {:>11} {:>10} {:>8} {:>8} {:>6} {:>5} {:>6}  {}\n", "module", "params", "bytes",
                                "storage", "compute", "train", "ckpt", "master", "rules");
  for (const auto& m : r.modules) {
    const int depth = m.path.empty() ? 0 : 1 + static_cast<int>(std::count(m.path.begin(), m.path.end(), '.'));
    std::string name = std::string(2 * depth, ' ') + (m.path.empty() ? "(model)" : m.path) +
                       (m.block ? fmt::format(m.checkpointable ? " [block {}]" : " [scope {}]", m.kind) : "");
    const Settings& s = m.settings;
    std::set<int> used{s.storage_rule, s.compute_rule, s.trainable_rule, s.checkpoint_rule, s.master_rule};
    used.erase(0);
    std::vector<std::string> ids;
    for (int i : used) ids.push_back(std::to_string(i));
    out += fmt::format("{:<56} {:>11} {:>10} {:>8} {:>8} {:>6} {:>5} {:>6}  {}\n", name, m.parameters,
                       format_bytes(m.weight_bytes + m.master_bytes), to_string(s.storage), to_string(s.compute),
                       s.trainable ? "yes" : "no", m.checkpointable ? (s.checkpoint ? "yes" : "no") : "-",
                       s.master_fp32 ? "fp32" : "none", ids.empty() ? "-" : fmt::format("{}", fmt::join(ids, ",")));
  }
  out += "rules (later rules win, key by key):\n";
  for (const auto& rule : policy.rules()) {
    int64_t governed = 0;
    std::map<std::string, std::string> kinds;
    for (const auto& m : r.modules) kinds[m.path] = m.kind;
    const KindOf kind_of = kind_lookup(kinds);
    for (const auto& p : r.params) {
      if (policy.applies(rule, p.path, kind_of)) governed += p.numel;
    }
    out += fmt::format("  {}: applies to {} parameters\n", rule.describe(), governed);
  }
  if (policy.rules().empty()) out += "  (none: everything fp32, trainable)\n";
  if (const auto& sub = policy.compute_substitution()) {
    out += fmt::format("compute {} runs as {} ({}); the compute column shows what runs\n", to_string(sub->from),
                       to_string(sub->to), sub->reason);
  }
  for (const auto& w : r.warnings) out += "warning: " + w + "\n";
  return out;
}

nn::BlockPrecision block_precision(const Settings& s, const c10::Device& device) {
  nn::BlockPrecision b;
  b.checkpoint = s.checkpoint;
  switch (s.compute) {
    case Dtype::bf16: b.compute = at::kBFloat16; break;
    case Dtype::fp16:
      if (device.is_cpu()) {
        b.compute = at::kFloat;
        b.emulate_fp16 = true;
      } else {
        b.compute = at::kHalf;
      }
      break;
    default: b.compute = at::kFloat; break;
  }
  return b;
}

int64_t apply(torch::nn::Module& model, const Resolution& resolution, const std::vector<nn::BlockTable*>& tables) {
  torch::NoGradGuard no_grad;
  std::map<std::string, const ParamRow*> by_path;
  for (const auto& p : resolution.params) by_path[p.path] = &p;
  int64_t changed = 0;
  c10::Device device(c10::kCPU);
  // Packed fp8 parameters: (owner module, parameter name) by path.
  std::map<std::string, std::pair<torch::nn::Module*, std::string>> owner_of;
  for (const auto& item : model.named_modules("", /*include_self=*/true)) {
    for (const auto& p : item.value()->named_parameters(/*recurse=*/false)) {
      owner_of[item.key().empty() ? p.key() : item.key() + "." + p.key()] = {item.value().get(), p.key()};
    }
  }
  for (auto& item : model.named_parameters(/*recurse=*/true)) {
    auto it = by_path.find(item.key());
    if (it == by_path.end())
      fail("precision::apply: parameter '{}' is not in the resolution (model changed?)", item.key());
    const ParamRow& row = *it->second;
    const Settings& s = row.settings;
    at::Tensor p = item.value();
    device = p.device();
    const at::ScalarType target = container_dtype(s.storage);
    if (is_fp8(s.storage)) {
      auto& [owner, name] = owner_of.at(item.key());
      std::optional<nn::Fp8Storage>* slot = nn::fp8_slot(*owner, name);
      if (row.fp8_packed != (slot != nullptr))
        fail("precision::apply: parameter '{}' changed layer type since the resolution", item.key());
      if (slot && slot->has_value()) {
        // Already packed (policy applied twice): the bytes stay as they are.
        p.requires_grad_(false);
        continue;
      }
      Fp8Quantized q = quantize_fp8(p, s.storage);
      if (q.flushed > 0) {
        spdlog::warn("precision: {} of {} nonzero values of '{}' flush to zero in {} (per-tensor scale {})", q.flushed,
                     p.ne(0).sum().item<int64_t>(), item.key(), to_string(s.storage), q.scale);
      }
      p.requires_grad_(false);  // a one-byte tensor cannot require grad
      if (slot) {
        const nn::Fp8Storage storage{fp8_format(s.storage), q.scale};
        at::Tensor bits = q.bits.to(p.device());
        q = {};  // free the fp32 copies before the bytes replace the weight
        p.set_data(bits);
        *slot = storage;
      } else {
        p.set_data(q.dequantized.to(target).to(p.device()));
      }
      ++changed;
      continue;
    } else if (p.scalar_type() != target) {
      p.set_data(p.data().to(target));
      ++changed;
    }
    p.requires_grad_(s.trainable);
  }
  std::map<const torch::nn::Module*, std::string> path_of;
  for (const auto& item : model.named_modules("", true)) path_of[item.value().get()] = item.key();
  std::map<std::string, const ModuleRow*> row_of;
  for (const auto& m : resolution.modules) row_of[m.path] = &m;
  for (const auto& item : model.named_modules("", true)) {
    const torch::nn::Module* mod = item.value().get();
    for (auto* t : tables) {
      if (!t || !t->is_block(mod)) continue;
      auto it = row_of.find(item.key());
      if (it == row_of.end()) fail("precision::apply: module '{}' is not in the resolution", item.key());
      t->set(mod, block_precision(it->second->settings, device));
    }
  }
  return changed;
}

}  // namespace shoestring::precision
