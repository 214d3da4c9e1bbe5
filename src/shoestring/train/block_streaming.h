// Streaming of block parameters in a training run: which blocks stream, and
// what fetching and releasing their parameters does. Two kinds, both on
// nn::BlockParameterStreaming (called around each block by nn::run_block):
//
//  - ZeRO stage 3 (ZeroBlockStreaming, over dist::ZeroSharding): the
//    trainable weights of each checkpointed block live on their owner rank
//    only, are gathered from the owners for the block's forward and its
//    recompute in backward, and released after; their gradients go to the
//    owners as soon as the block's backward has run.
//  - offload_params (HostBlockStreaming, one process): every weight of each
//    checkpointed block lives in host memory (the ledger's host_offload) and
//    is copied to the run's device for the block's use; gradients are moved
//    to host memory right after the block's backward, and the optimizer
//    updates the host copies (with its state in host memory). DeepSpeed's
//    ZeRO-Infinity parameter offload / ZeRO-Offload (Ren et al., "ZeRO-Offload:
//    Democratizing Billion-Scale Model Training", arXiv 2101.06840), per block.
//
// Parameters outside checkpointed blocks stay where they are. A block nested
// inside another checkpointed block streams with the outer one.
#pragma once
#include <cstddef>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "shoestring/dist/zero.h"
#include "shoestring/nn/block_precision.h"

namespace shoestring {

/// What the run calls on its block streaming besides the blocks' own fetch /
/// release (train/run.cpp, train/trainer.cpp).
class RunBlockStreaming : public nn::BlockParameterStreaming {
 public:
  /// Blocks that stream.
  virtual size_t blocks() const = 0;
  /// Elements of the trainable parameters that stream.
  virtual int64_t streamed_elements() const = 0;
  /// Starts streaming: the weights are final for the start (loaded,
  /// restored from a checkpoint). From now on a streamed parameter is an
  /// empty tensor outside its block's use on this process (ZeRO: unless
  /// this rank owns it).
  virtual void start() = 0;
  /// After a step's micro-batches, before clipping and the optimizer step /
  /// after the step and the EMA update. Default: nothing.
  virtual void before_step() {}
  virtual void after_step() {}
  /// The whole model present on rank 0, as its parameters' data, while it
  /// saves or samples (collective for ZeRO); release_held() ends it.
  virtual void hold_all() = 0;
  virtual void release_held() = 0;
};

/// The checkpointed blocks of `tables` holding parameters of `params`, as
/// groups of indices into `params` (a parameter in two nested blocks goes
/// with the outer one), ordered by their first index, so every rank finds the
/// same groups. `params` are the tensors to stream (same TensorImpl as the
/// module's parameters).
std::vector<std::pair<const torch::nn::Module*, std::vector<size_t>>> checkpointed_block_groups(
    const std::vector<nn::BlockTable*>& tables, const std::vector<at::Tensor>& params);

/// ZeRO stage 3's streaming of a model's checkpointed blocks over a
/// dist::ZeroSharding of stage 3.
class ZeroBlockStreaming final : public RunBlockStreaming {
 public:
  /// Declares, on `zero` (stage 3, built over `trainable` in that order),
  /// one streamed group per checkpointed block of `tables` holding trainable
  /// parameters (checkpointed_block_groups), and sets the returned object as
  /// each table's `streaming`. Throws what ZeroSharding::add_streamed_group
  /// throws.
  static std::shared_ptr<ZeroBlockStreaming> attach(dist::ZeroSharding& zero,
                                                    const std::vector<nn::BlockTable*>& tables,
                                                    const std::vector<std::pair<std::string, at::Tensor>>& trainable);

  bool streams(const torch::nn::Module* block) const override { return group_of_.count(block) != 0; }
  void fetch(const torch::nn::Module* block) override { zero_.fetch(group_of_.at(block)); }
  void release(const torch::nn::Module* block, bool gradients_complete) override {
    zero_.release(group_of_.at(block), gradients_complete);
  }
  size_t blocks() const override { return group_of_.size(); }
  int64_t streamed_elements() const override { return zero_.streamed_elements(); }
  void start() override { zero_.start_streaming(); }
  /// The step's fetches are over (dist::ZeroSharding::end_step_fetches: a
  /// prefetch never crosses the optimizer step).
  void before_step() override { zero_.end_step_fetches(); }
  void hold_all() override { zero_.hold_all_on(0); }
  void release_held() override { zero_.release_held(); }

 private:
  explicit ZeroBlockStreaming(dist::ZeroSharding& zero) : zero_(zero) {}
  dist::ZeroSharding& zero_;
  std::unordered_map<const torch::nn::Module*, size_t> group_of_;
};

/// offload_params: the parameters of a model's checkpointed blocks in host
/// memory, streamed to `device` block by block (see the file comment).
///
/// Per streamed parameter: its values in host memory (pinned on CUDA;
/// ledger category host_offload); between uses the module's tensor is empty.
/// fetch copies a block's parameters to the device (category weights);
/// release frees those copies, and after the block's backward first adds
/// each trainable parameter's .grad into its host gradient (host_offload;
/// summed over the step's micro-batches in the gradient's dtype, as autograd
/// sums .grad) and resets .grad. before_step makes each streamed parameter's
/// data its host tensor and its .grad the host sum, so clipping, the
/// optimizer and EMA work on the host copies in place; after_step empties
/// them again. The results are those of the run without offloading, bit for
/// bit: every copy is exact.
class HostBlockStreaming final : public RunBlockStreaming {
 public:
  /// Streams every parameter (trainable or frozen) of `module` inside a
  /// checkpointed block of `tables`; `trainable` says which get gradients.
  /// Sets the returned object as each table's `streaming`. Nothing moves
  /// before start().
  static std::shared_ptr<HostBlockStreaming> attach(const std::vector<nn::BlockTable*>& tables,
                                                    const torch::nn::Module& module,
                                                    const std::vector<std::pair<std::string, at::Tensor>>& trainable,
                                                    c10::Device device);

  bool streams(const torch::nn::Module* block) const override { return group_of_.count(block) != 0; }
  void fetch(const torch::nn::Module* block) override;
  void release(const torch::nn::Module* block, bool gradients_complete) override;
  size_t blocks() const override { return groups_.size(); }
  int64_t streamed_elements() const override;
  /// Copies the streamed parameters to host memory and empties them on the device.
  void start() override;
  void before_step() override;
  void after_step() override;
  void hold_all() override;
  void release_held() override;
  /// Bytes of the streamed parameters (all of them, trainable or not).
  int64_t streamed_bytes() const;
  /// Whether `param` (same TensorImpl as a module parameter) is one of the
  /// streamed weights kept in host memory.
  bool streams_parameter(const at::Tensor& param) const;

 private:
  HostBlockStreaming(c10::Device device) : device_(device) {}
  struct Group {
    std::vector<size_t> params;
    int fetched = 0;
  };
  void empty(size_t i);
  c10::Device device_;
  std::vector<at::Tensor> params_;  ///< the module's tensors that stream
  std::vector<bool> trainable_;
  std::vector<at::Tensor> host_;       ///< their values in host memory
  std::vector<at::Tensor> host_grad_;  ///< trainable ones: the step's gradient sum
  std::vector<Group> groups_;
  std::unordered_map<const torch::nn::Module*, size_t> group_of_;
  bool started_ = false;
  bool held_ = false;      ///< hold_all: the host tensors are the parameters' data
  bool stepping_ = false;  ///< between before_step and after_step
};

}  // namespace shoestring
