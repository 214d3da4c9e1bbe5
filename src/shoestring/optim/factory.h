// Optimizer selection by kohya sd-scripts' names and arguments:
//   optimizer_type = "AdamW8bit"
//   optimizer_args = ["weight_decay=0.01", "betas=0.9,0.999"]
#pragma once
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "shoestring/optim/optimizer.h"

namespace shoestring {

/// Valid optimizer_type values: "AdamW", "AdamW8bit", "Adafactor", "Lion", "Compass",
/// "SPARKLES".
const std::vector<std::string>& optimizer_names();

/// Builds the optimizer `type` over named trainable parameters. Weight decay
/// comes from the optimizer's arguments and is applied to tensors with two or
/// more dimensions only (no decay on biases and norm weights, as kohya and
/// diffusers scripts do by default).
/// Throws shoestring::Error for an unknown type (listing the valid names) or
/// argument (listing the valid arguments of that optimizer).
std::unique_ptr<Optimizer> make_optimizer(const std::string& type, const std::vector<std::string>& args,
                                          const std::vector<std::pair<std::string, at::Tensor>>& params,
                                          const OptimizerOptions& options);

/// The state and update scratch optimizer `type` (with `args` parsed as
/// make_optimizer parses them and `options`' state dtype) holds for one
/// parameter of `shape` stored in `param_dtype`: the optimizer class's static
/// state_size() (AdamW, AdamW8bit, Adafactor, Lion, Compass,
/// SPARKLES). Throws
/// shoestring::Error for an unknown type or argument, as validate_optimizer.
OptimizerStateSize optimizer_state_size(const std::string& type, const std::vector<std::string>& args,
                                        at::IntArrayRef shape, at::ScalarType param_dtype,
                                        const OptimizerOptions& options);

/// Checks `type` and `args` without building anything (config validation).
void validate_optimizer(const std::string& type, const std::vector<std::string>& args);

}  // namespace shoestring
