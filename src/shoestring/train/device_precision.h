// The compute dtype a device can run: CUDA cards without bf16 arithmetic
// (compute capability < 8.0: Pascal, Volta, Turing — the "old GPUs" of the
// Stable Cascade forum recipe) compute in fp16 with dynamic loss scaling and
// the automatic upcast of overflowing blocks (precision/loss_scaler.h,
// precision/overflow.h) instead of bf16, where the config asks for bf16 only
// through its shorthands.
#pragma once
#include <string>

#include <c10/core/Device.h>

#include "shoestring/train/config.h"

namespace shoestring {

/// Rewrites `config` for a device without bf16 arithmetic (device_has_bf16 =
/// false): mixed_precision = "bf16" becomes "fp16"; full_bf16 becomes
/// full_fp16 (fp16 weights, stochastically rounded updates, fp16 compute);
/// precision.auto_upcast is switched on. What the config insists on is kept:
/// [[precision.rule]] entries naming bf16 stay as written, and a
/// fused_backward_pass run (which cannot use loss scaling) keeps bf16.
/// Returns the run-log line that says what changed and why (naming
/// `device_name`), or "" when nothing changed (device_has_bf16, or no bf16
/// shorthand set).
std::string adapt_precision_for_bf16_support(TrainConfig& config, bool device_has_bf16, const std::string& device_name);

/// adapt_precision_for_bf16_support for `device`: the CPU and CUDA devices of
/// compute capability >= 8.0 (or of unknown capability: a build without
/// SHOESTRING_WITH_CUDA) are left alone.
std::string adapt_precision_to_device(TrainConfig& config, const c10::Device& device);

}  // namespace shoestring
