// kohya-style optimizer arguments: `optimizer_args = ["weight_decay=0.01",
// "betas=0.9,0.999", "relative_step=False"]`, parsed once for every optimizer.
#pragma once
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace shoestring {

/// Parsed "key=value" strings for one optimizer. Construction rejects entries
/// without '=', duplicate keys, and keys not in `valid` (the error lists the
/// valid keys); getters reject values of the wrong form, naming the key.
class OptimizerArgs {
 public:
  /// Throws shoestring::Error as described above. `optimizer` names the
  /// optimizer in messages, e.g. "AdamW8bit".
  OptimizerArgs(const std::vector<std::string>& args, std::string optimizer, std::vector<std::string> valid);

  bool has(const std::string& key) const { return values_.count(key) != 0; }
  /// A number ("1e-3", "0.9").
  double get_double(const std::string& key, double fallback) const;
  /// true/false in Python or TOML spelling ("True", "false", "1", "0").
  bool get_bool(const std::string& key, bool fallback) const;
  /// Two numbers "a,b" (betas, eps pairs). Also accepts "(a,b)" / "[a,b]".
  std::pair<double, double> get_pair(const std::string& key, std::pair<double, double> fallback) const;
  /// A word, e.g. "global"; surrounding single or double quotes are dropped
  /// (kohya passes Python literals). Values outside `allowed` are rejected,
  /// naming the key and listing `allowed`.
  std::string get_choice(const std::string& key, const std::string& fallback,
                         const std::vector<std::string>& allowed) const;
  /// An optional number: "None" gives std::nullopt (Adafactor's beta1).
  std::optional<double> get_optional_double(const std::string& key, std::optional<double> fallback) const;

 private:
  [[noreturn]] void bad(const std::string& key, const std::string& expected) const;
  std::string optimizer_;
  std::map<std::string, std::string> values_;
};

}  // namespace shoestring
