// `shoestring plan --explain`: the precision rules of every module.
//
// Builds the model on the meta device (no storage), resolves the config's
// precision policy against it (precision/policy.h: shorthands such as
// full_bf16 plus [[precision.rule]] entries) and prints
// precision::format_explain's table, followed by the optimizer-state dtypes.
#pragma once
#include <string>

#include "shoestring/train/config.h"

namespace shoestring::plan {

/// Text listing every module of the config's model with its resolved
/// precision rule (storage, compute, trainable, checkpoint), then the dtype of
/// the optimizer state. `vocab_size` sizes the caption embedding. Throws
/// shoestring::Error for an invalid policy or model options.
std::string explain_precision(const TrainConfig& config, int64_t vocab_size);

}  // namespace shoestring::plan
