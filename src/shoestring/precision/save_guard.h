// Save-time range guard: before weights are written in a narrower dtype
// (fp32 -> fp16 / bf16 / fp8), every value is checked. Converting is an
// error, naming each offending tensor and its counts, when
//  - any finite value would overflow (|x| beyond the target's largest finite
//    value: fp16 65504, bf16 3.39e38; fp8 cannot overflow because it is saved
//    with a per-tensor scale), or
//  - more than `max_flush_fraction` (default 1%) of a tensor's nonzero values
//    would flush to zero (fp16 flushes |x| < 2^-25, i.e. below half its
//    smallest subnormal 5.96e-8),
// unless `force` is set (config `save_precision_force = true`), in which case
// the same findings are logged as warnings and the tensors are converted.
// The 1% threshold: a handful of underflowing values is normal for small
// weights in fp16 (they were negligible anyway); one in a hundred means the
// tensor's scale does not fit fp16 and the saved model will differ.
#pragma once
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "shoestring/io/safetensors.h"
#include "shoestring/precision/dtype.h"

namespace shoestring::precision {

struct SaveGuardOptions {
  double max_flush_fraction = 0.01;
  bool force = false;
  /// The refusal's last sentence: how the user widens the dtype or forces
  /// the save, in the words of the command that saves (its config keys or
  /// its flags).
  std::string override_hint =
      "Save in a wider dtype (save_precision = \"fp32\" or \"bf16\"), or set save_precision_force = true to save "
      "anyway";
};

/// What converting one tensor would do.
struct NarrowingReport {
  std::string name;
  int64_t numel = 0;
  int64_t nonzero = 0;   ///< nonzero values before conversion
  int64_t overflow = 0;  ///< finite values that would become inf
  int64_t flushed = 0;   ///< nonzero values that would become 0
  double max_abs = 0;    ///< largest finite |x|
  /// True when this tensor breaks the guard's limits.
  bool bad(const SaveGuardOptions& o) const;
  /// "unet.conv_in.weight: 3 of 432 values overflow fp16 (max |x| 7.1e+04)".
  std::string describe(Dtype target) const;
};

/// Checks one tensor (any float dtype) against `target`. Non-float tensors
/// give an empty report.
NarrowingReport check_narrowing(const std::string& name, const at::Tensor& t, Dtype target);

/// Checks floating tensors against `target` (fp32, bf16 or fp16) and
/// returns them for save_safetensors with `cast` set where the dtype
/// changes (converted while writing, one tensor at a time: no converted
/// copy of the whole model is ever held), other tensors as they are. The
/// check reads one tensor at a time too (memory-mapped inputs stay mapped).
/// fp8 targets are rejected (this build writes no scaled fp8 files;
/// check_narrowing() still checks fp8). Throws shoestring::Error listing
/// every offending tensor (up to 20, then a count) unless options.force;
/// `what` names the file being written.
std::vector<NamedTensor> convert_for_save(const std::vector<std::pair<std::string, at::Tensor>>& tensors, Dtype target,
                                          const SaveGuardOptions& options, const std::string& what);
/// convert_for_save with a target per tensor (`targets[i]` for tensors[i],
/// one entry each; nullopt: written as it is): e.g. fp32 shadows rounded
/// back into their model tensors' own dtypes (`shoestring consolidate
/// --ema`). Throws as convert_for_save, and for a size mismatch.
std::vector<NamedTensor> convert_for_save(const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                                          const std::vector<std::optional<Dtype>>& targets,
                                          const SaveGuardOptions& options, const std::string& what);

/// Writes `tensors` to safetensors file `path` (atomic), in `target` when
/// given (through convert_for_save, with metadata "dtype" = the target's
/// name), else each in its own dtype: the one writer of model files (a
/// run's final model, `shoestring consolidate`). Throws what
/// convert_for_save and save_safetensors throw.
void save_with_guard(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                     std::optional<Dtype> target, const SaveGuardOptions& options,
                     std::map<std::string, std::string> metadata, const std::string& what);

/// Parses a save_precision value: "fp32" / "float", "fp16", "bf16" (kohya's
/// names plus fp32). Throws shoestring::Error otherwise.
Dtype parse_save_precision(const std::string& s);

}  // namespace shoestring::precision
