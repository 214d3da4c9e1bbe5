// The config schema, internal to train/: every key once, with its
// TrainConfig member, help, range or choices and attributes (FieldFlag), and
// the lookups that parsing (config.cpp) and the generated reference
// (docs/config.md) share. The public interface is train/config.h.
#pragma once
#include <limits>
#include <string>
#include <variant>
#include <vector>

#include "shoestring/train/config.h"

namespace shoestring::config_detail {

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
  /// Only flow-matching architectures (tiny-unet, sd35m) read the key.
  kFlowMatchingOnly = 1u << 5,
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

/// Every key, in the order docs/config.md lists them.
const std::vector<Field>& schema();
/// The entry of `key`, or of a dotted key given without its section
/// ("base_channels" for "model.base_channels"); nullptr when none.
const Field* find_field(const std::string& key);
/// The valid key nearest to `key` by edit distance (for did-you-mean).
std::string nearest_key(const std::string& key);
/// What `f` accepts, in words ("an integer in [1, 16]", "one of ...").
std::string expected_text(const Field& f);

}  // namespace shoestring::config_detail
