// `shoestring consolidate`: the model of one checkpoint folder of a run
// (single-file or sharded, train/checkpoint_io.h) as one .safetensors file
// in the model's own key layout (the module tree's names: what the run's
// final model.safetensors holds), optionally in another dtype through the
// save-time range guard (precision/save_guard.h).
//
// Streaming: the checkpoint's files are memory-mapped (WeightFiles over the
// index), each tensor is checked, then converted and appended one at a time
// while the output is written (save_safetensors' per-tensor cast), so no
// converted or gathered copy of the whole model is ever in memory. The
// output is written atomically.
#pragma once
#include <cstdint>
#include <optional>
#include <string>

#include "shoestring/precision/dtype.h"

namespace shoestring {

struct ConsolidateOptions {
  /// Output dtype of the floating tensors (fp32, bf16 or fp16); nullopt:
  /// each tensor keeps the checkpoint's dtype (the storage dtype).
  std::optional<precision::Dtype> dtype;
  /// Write even when narrowing overflows or flushes values in bulk (the
  /// guard's findings are then logged as warnings).
  bool force = false;
  /// Write the EMA weights: every model tensor that has an EMA shadow
  /// ("ema.<name>", fp32: state.safetensors of a single-file checkpoint, the
  /// optimizer shards of a sharded one) takes the shadow's values, rounded
  /// to nearest into the tensor's dtype (or to `dtype` when given, from the
  /// fp32 shadow directly), as the run's final model.safetensors holds them
  /// (train/ema.h, swap_in).
  bool ema = false;
};

/// What consolidate_checkpoint wrote.
struct ConsolidateResult {
  int64_t tensors = 0;      ///< tensors written
  int64_t bytes = 0;        ///< their data bytes in the output
  int64_t files_read = 0;   ///< checkpoint files the tensors came from
  bool sharded = false;     ///< the checkpoint had an index (several ranks)
  int64_t ema_tensors = 0;  ///< tensors written from their EMA shadow (options.ema)
};

/// Writes the model of checkpoint folder `checkpoint_dir`
/// (RUN_DIR/checkpoints/step-NNNNNN) to `out`: every tensor the checkpoint
/// index maps to a model file (model.safetensors and, from ZeRO stage 3,
/// the ranks' model shards; a single-file checkpoint: every tensor of
/// model.safetensors), under its own name, with model.safetensors' metadata
/// (plus "shoestring.consolidated_from" and, when converting, "dtype").
/// Throws shoestring::Error naming the folder or file: no such folder, no
/// model in it (a LoRA run on a pretrained base keeps lora.safetensors
/// only), an invalid index or file, `out` inside the checkpoint folder or a
/// folder, tensors the range guard refuses (unless options.force), and on
/// I/O failure. With options.ema also: a checkpoint without EMA shadows
/// (ema_decay was not set, or an optimizer shard is missing), and a shadow
/// whose model tensor is missing or of another shape.
ConsolidateResult consolidate_checkpoint(const std::string& checkpoint_dir, const std::string& out,
                                         const ConsolidateOptions& options = {});

}  // namespace shoestring
