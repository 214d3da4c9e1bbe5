// The precision policy: rules that match module paths and say, per parameter
// and per block, how it is stored, computed, trained and checkpointed
// (docs/precision.md; ARCHITECTURE.md, "precision").
//
// A rule is written in the run config as
//   [[precision.rule]]
//   match = "*resblock*"      # glob on dotted module / parameter paths
//   storage = "fp32"          # fp32 | bf16 | fp16 | fp8_e4m3 | fp8_e5m2 (fp8: frozen weights only)
//   compute = "fp32"          # fp32 | bf16 | fp16
//   trainable = false
//   checkpoint = true
//   master = "none"           # none | fp32
//   kind = "CascadeResBlock"  # only modules of this class (module_kind)
// Every key but `match` is optional. Later rules win, key by key.
//
// Matching: the glob is anchored and matched against whole dotted paths;
// `*` matches any run of characters (dots included), `?` any one character,
// everything else itself. A rule applies to a module when it matches the
// module's path or the path of any ancestor module (the root's path is ""),
// and to a parameter when it matches the parameter's full path or the path
// of any module above it. So `unet.down.1.*` covers every module and
// parameter below unet.down.1, `*.bias` every bias, `*` everything. With
// `kind`, only paths of modules of that class count (the module itself or an
// ancestor): match "*" with kind "CascadeResBlock" covers every ResBlock of
// Stable Cascade's stage C and everything in them, which paths alone cannot
// say (its blocks are numbered, ResBlocks every third).
//
// Defaults (no rule): storage fp32, compute fp32, trainable, no checkpoint,
// master none.
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <torch/nn/module.h>

#include "shoestring/nn/block_precision.h"
#include "shoestring/precision/dtype.h"

namespace shoestring::precision {

/// A rule as written in the config (strings not yet validated).
struct RuleSpec {
  std::string match;
  std::optional<std::string> storage, compute, master;
  std::optional<std::string> kind;  ///< module class (module_kind); unset = any
  std::optional<bool> trainable, checkpoint;
  /// Where the rule came from, for messages: "run.toml:12" or "shorthand full_bf16".
  std::string origin;
  bool operator==(const RuleSpec& o) const {
    return match == o.match && storage == o.storage && compute == o.compute && master == o.master &&
           trainable == o.trainable && checkpoint == o.checkpoint && kind == o.kind;
  }
};

/// A validated rule.
struct Rule {
  std::string match;
  std::optional<std::string> kind;
  std::optional<Dtype> storage, compute;
  std::optional<bool> trainable, checkpoint, master_fp32;
  std::string origin;
  int index = 0;  ///< 1-based position in the policy's rule list
  /// "rule 3 ('*resblock*', run.toml:12)".
  std::string describe() const;
};

/// Resolved settings of one module or parameter. `*_rule` is the 1-based
/// index of the rule that set the key, 0 for the default.
struct Settings {
  Dtype storage = Dtype::fp32;
  Dtype compute = Dtype::fp32;
  bool trainable = true;
  bool checkpoint = false;
  bool master_fp32 = false;
  int storage_rule = 0, compute_rule = 0, trainable_rule = 0, checkpoint_rule = 0, master_rule = 0;
  /// True when the rules asked for another compute dtype and the policy's
  /// ComputeSubstitution replaced it (e.g. bf16 -> fp32 on a CPU without bf16 units).
  bool compute_substituted = false;
  /// "storage fp16, compute fp16, trainable, master none" ("compute fp32 (for bf16)" when substituted).
  std::string describe() const;
};

/// Anchored glob match: `*` any run of characters (dots too), `?` one character.
bool glob_match(const std::string& pattern, const std::string& path);

/// The kind a rule's `kind` names for `module`: its C++ class without
/// namespace and libtorch's `Impl` suffix ("CascadeResBlock", "Linear",
/// "LdmUNet"), or the name it was registered with for plain containers
/// ("Sequential", "ModuleList").
std::string module_kind(const torch::nn::Module& module);

/// The module kind at each dotted path (path -> module_kind), for resolve().
using KindOf = std::function<std::string(const std::string& path)>;

/// The rules that the kohya-style shorthands expand to, in this order, placed
/// before the user's rules (so user rules override them):
///   mixed_precision = "bf16"  ->  { match "*", compute bf16 }           (fp32 weights)
///   mixed_precision = "fp16"  ->  { match "*", compute fp16 }           (fp32 weights, loss scaling)
///   full_bf16 = true          ->  { match "*", storage bf16, compute bf16, master none }
///   full_fp16 = true          ->  { match "*", storage fp16, compute fp16, master none }
///   gradient_checkpointing    ->  { match "*", checkpoint true }
/// mixed_precision "no" adds nothing. Throws shoestring::Error for an unknown
/// mixed_precision value or full_bf16 together with full_fp16.
std::vector<RuleSpec> shorthand_rules(const std::string& mixed_precision, bool full_bf16, bool full_fp16,
                                      bool gradient_checkpointing);

/// A compute dtype that the hardware runs badly, and what runs instead: every
/// module whose rules resolve to compute `from` computes in `to`. Chosen by
/// precision/compute_choice.h from the config's precision.bf16_compute and
/// the device (bf16 -> fp32 on CPUs without bf16 units).
struct ComputeSubstitution {
  Dtype from = Dtype::bf16;
  Dtype to = Dtype::fp32;
  std::string reason;  ///< for the run log: "AMD EPYC has no AVX-512 BF16 / AMX BF16 units"
};

/// An ordered list of validated rules.
class Policy {
 public:
  Policy() = default;
  /// Validates every rule. Throws shoestring::Error naming the rule (index,
  /// pattern, origin) and the key for: an empty match; a dtype name that is
  /// not fp32 | bf16 | fp16 | fp8_e4m3 | fp8_e5m2 (compute: not fp8 either);
  /// master other than none | fp32; fp8 storage together with
  /// trainable = true or master = fp32 in the same rule.
  static Policy from_specs(const std::vector<RuleSpec>& specs);

  const std::vector<Rule>& rules() const { return rules_; }

  /// Makes resolve() compute in `s.to` wherever the rules say `s.from`.
  /// Storage, trainable, checkpoint and master are untouched (bf16 weights
  /// keep their memory saving and their stochastic rounding).
  void set_compute_substitution(ComputeSubstitution s) { substitution_ = std::move(s); }
  const std::optional<ComputeSubstitution>& compute_substitution() const { return substitution_; }

  /// Settings of the module or parameter at dotted `path` ("" = root).
  /// `kind_of` gives the module kind at a path (rules with a `kind` apply
  /// nowhere without it).
  Settings resolve(const std::string& path, const KindOf& kind_of = {}) const;

  /// True if rule `index` (1-based) applies to `path` (see the file comment).
  bool applies(const Rule& rule, const std::string& path, const KindOf& kind_of = {}) const;

 private:
  std::vector<Rule> rules_;
  std::optional<ComputeSubstitution> substitution_;
};

/// One module of a resolved model (for `shoestring plan --explain`).
struct ModuleRow {
  std::string path;             ///< dotted module path, "" for the root
  std::string kind;             ///< module_kind of the module
  Settings settings;            ///< resolved settings of the module itself
  bool block = false;           ///< a declared block (compute / checkpoint take effect here)
  bool checkpointable = false;  ///< a block that may be checkpointed (false for whole-model scopes)
  int64_t parameters = 0;       ///< parameters in this module's subtree
  int64_t trainable_parameters = 0;
  int64_t weight_bytes = 0;  ///< subtree parameters as stored (see storage_bytes)
  int64_t master_bytes = 0;  ///< fp32 master copies in the subtree (4 bytes each)
};

/// One parameter of a resolved model.
struct ParamRow {
  std::string path;
  Settings settings;
  int64_t numel = 0;
  std::vector<int64_t> shape;
  /// fp8 storage packed as one byte per element: the weight of an nn::Linear
  /// or nn::Conv2d (nn::can_store_fp8). Other fp8 parameters keep fp8 values
  /// in a bf16 container (container_dtype).
  bool fp8_packed = false;
};

/// Bytes per element `p` is stored in: 1 when fp8_packed, else
/// container_bytes(p.settings.storage).
int64_t storage_bytes(const ParamRow& p);

/// The policy resolved against a concrete module tree.
struct Resolution {
  std::vector<ModuleRow> modules;  ///< every module, in named_modules() order (root first)
  std::vector<ParamRow> params;    ///< every parameter, in named_parameters() order
  /// One warning per rule that matches no module or parameter, naming the
  /// pattern (and suggesting a nearby pattern that would match).
  std::vector<std::string> warnings;
};

/// Resolves `policy` for every module and parameter of `model` (which may
/// live on the meta device: only names, shapes and numel are read). `tables`
/// are the model's block tables (a module is a block if any table declares it).
/// Throws shoestring::Error when a parameter ends up with fp8 storage while
/// trainable, naming the parameter, the rule that set the storage and the
/// rule (or default) that made it trainable.
Resolution resolve(const torch::nn::Module& model, const Policy& policy,
                   const std::vector<const nn::BlockTable*>& tables = {});

/// Human-readable table of every module with its resolved rule, parameter
/// count and bytes, indented by depth, then a line per rule with how many
/// parameters it governs, then the warnings. Blocks are marked "[block]",
/// whole-model scopes "[scope]"; the ckpt column is "-" where checkpointing
/// cannot apply (not a checkpointable block); compute takes effect in blocks
/// and scopes (other modules compute in their enclosing block's dtype).
/// This is what `shoestring plan CONFIG --explain` prints.
std::string format_explain(const Resolution& resolution, const Policy& policy);

/// The runtime settings for a block with resolved settings `s` on `device`:
/// compute fp16 on a CPU is emulated (fp32 math, outputs rounded to fp16).
nn::BlockPrecision block_precision(const Settings& s, const c10::Device& device);

/// Applies a resolution to `model`: casts each parameter to its storage
/// dtype (fp8: quantized with a per-tensor power-of-two scale, see
/// quantize_fp8; a packed parameter (ParamRow::fp8_packed) then holds the fp8
/// bytes and its layer's nn::Fp8Storage slot the scale, others the fp8 values
/// in a bf16 container), sets requires_grad from `trainable`, and configures every
/// declared block in `tables` with its compute dtype and checkpoint flag.
/// Returns the number of parameters whose dtype changed. fp8 quantization
/// that flushes nonzero weights to zero is logged as a warning.
int64_t apply(torch::nn::Module& model, const Resolution& resolution, const std::vector<nn::BlockTable*>& tables);

}  // namespace shoestring::precision
