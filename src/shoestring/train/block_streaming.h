// Streaming of block parameters in a training run: which blocks stream, and
// what fetching and releasing them does. ZeRO stage 3 (dist/zero.h): the
// parameters of each checkpointed block are one streamed group of the run's
// dist::ZeroSharding, gathered from their owners for the block's forward and
// its recompute in backward (nn::BlockParameterStreaming, called by
// nn::run_block), and released after; their gradients go to their owners as
// soon as the block's backward has run. Parameters outside checkpointed
// blocks stay resident on every rank.
#pragma once
#include <cstddef>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "shoestring/dist/zero.h"
#include "shoestring/nn/block_precision.h"

namespace shoestring {

/// ZeRO stage 3's streaming of a model's checkpointed blocks over a
/// dist::ZeroSharding of stage 3.
class ZeroBlockStreaming final : public nn::BlockParameterStreaming {
 public:
  /// Declares, on `zero` (stage 3, built over `trainable` in that order),
  /// one streamed group per checkpointed block of `tables` holding trainable
  /// parameters (its whole subtree's; groups ordered by their first
  /// parameter's index, so every rank declares the same groups), and sets
  /// the returned object as each table's `streaming`. A parameter in two
  /// checkpointed blocks (nested blocks) belongs to the outer one's group.
  /// Throws what ZeroSharding::add_streamed_group throws.
  static std::shared_ptr<ZeroBlockStreaming> attach(dist::ZeroSharding& zero,
                                                    const std::vector<nn::BlockTable*>& tables,
                                                    const std::vector<std::pair<std::string, at::Tensor>>& trainable);

  bool streams(const torch::nn::Module* block) const override { return group_of_.count(block) != 0; }
  void fetch(const torch::nn::Module* block) override { zero_.fetch(group_of_.at(block)); }
  void release(const torch::nn::Module* block, bool gradients_complete) override {
    zero_.release(group_of_.at(block), gradients_complete);
  }
  /// Blocks that stream.
  size_t blocks() const { return group_of_.size(); }

 private:
  explicit ZeroBlockStreaming(dist::ZeroSharding& zero) : zero_(zero) {}
  dist::ZeroSharding& zero_;
  std::unordered_map<const torch::nn::Module*, size_t> group_of_;
};

}  // namespace shoestring
