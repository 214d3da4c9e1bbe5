// Overflow guard for fp16 training: finds the blocks whose fp16 outputs leave
// fp16's range first, names them, and (auto_upcast) moves exactly those blocks
// to fp32 compute so training goes on with finite losses.
//
// A block is flagged in a forward pass when its output holds inf or NaN, or a
// value with |x| > threshold * 65504, while all of its inputs were finite and
// within that limit (so blocks that merely pass on an upstream overflow are
// not flagged), and no block nested inside it was flagged in the same pass.
// Only blocks that compute in fp16 are watched. Backward overflow (gradients
// beyond fp16) is the loss scaler's business, not this guard's.
#pragma once
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include <torch/nn/module.h>

#include "shoestring/nn/block_precision.h"

namespace shoestring::precision {

struct OverflowOptions {
  /// Fraction of fp16's largest finite value (65504) above which a block
  /// output counts as an overflow. In (0, 1]; 1 flags only inf/NaN.
  double threshold = 0.5;
  /// Move flagged blocks to fp32 compute.
  bool auto_upcast = false;
};

/// One flagged block in one forward pass.
struct OverflowEvent {
  std::string path;        ///< dotted module path of the block
  double max_abs = 0;      ///< largest |x| over the block's outputs (inf if any non-finite)
  bool nonfinite = false;  ///< the output held inf or NaN
};

/// Watches fp16 blocks of a model (install with attach()).
class OverflowMonitor : public nn::BlockObserver {
 public:
  /// `model`: the root module (for paths); `tables`: its block tables; only
  /// blocks configured with fp16 compute (emulated or native) are watched.
  OverflowMonitor(const torch::nn::Module& model, const std::vector<nn::BlockTable*>& tables, OverflowOptions options);

  /// Sets this monitor as the observer of every table.
  static std::shared_ptr<OverflowMonitor> attach(const torch::nn::Module& model,
                                                 const std::vector<nn::BlockTable*>& tables, OverflowOptions options);

  void observe(const torch::nn::Module* block, const std::vector<at::Tensor>& inputs,
               const std::vector<at::Tensor>& outputs) override;

  /// Watching on/off (off during sampling). Starts on.
  void set_enabled(bool on) { enabled_ = on; }
  /// Clears the events of the previous pass.
  void begin_pass();
  /// Blocks flagged since begin_pass(), in execution order.
  const std::vector<OverflowEvent>& events() const { return events_; }

  /// Moves the flagged blocks of the current pass to fp32 compute (keeping
  /// their checkpoint flag) and stops watching them. Returns their paths.
  std::vector<std::string> upcast_flagged();
  /// Moves the blocks at `paths` to fp32 compute (used to replay upcasts on
  /// resume). Throws shoestring::Error naming an unknown block path.
  void upcast(const std::vector<std::string>& paths);
  /// The paths of the blocks still watched, sorted (the same list on every
  /// rank of a data-parallel run while their upcasts agree).
  std::vector<std::string> watched_paths() const;
  /// Every block upcast so far, in order.
  const std::vector<std::string>& upcast_paths() const { return upcast_; }

  const OverflowOptions& options() const { return options_; }

 private:
  struct Watched {
    std::string path;
    nn::BlockTable* table;
  };
  OverflowOptions options_;
  double limit_;
  bool enabled_ = true;
  std::map<const torch::nn::Module*, Watched> watched_;
  std::map<std::string, const torch::nn::Module*> by_path_;
  std::vector<OverflowEvent> events_;
  std::vector<std::string> upcast_;
};

}  // namespace shoestring::precision
