// Per-block precision: how a model's blocks (ResBlocks, transformer blocks,
// encoder layers, ...) compute, and whether they are checkpointed.
//
// libtorch has no forward hooks, so a model routes each block call through
// run_block(), which looks the block up in the model's BlockTable:
//  - no entry (the table was never configured): the block runs as before this
//    mechanism existed, in the dtype its inputs arrive in, checkpointed when
//    the caller's legacy flag says so;
//  - an entry: the block's floating-point inputs are cast to the entry's
//    compute dtype and the block runs under a ComputeDtypeGuard, so every
//    Linear / Conv2d / norm / embedding inside it casts its weights (whatever
//    their storage dtype) to that dtype. The block's outputs are returned in
//    the compute dtype, except for emulated fp16 (below).
//  - emulated fp16 (compute fp16 on a CPU, which has no fp16 kernels in
//    libtorch 1.13): the math runs in fp32 and every floating output of the
//    block is rounded to fp16 and returned as an fp32 tensor holding fp16
//    values (x.to(fp16).to(fp32), differentiable): values above 65504 become
//    inf exactly where a GPU's fp16 block output would, and the backward
//    rounds the incoming activation gradient to fp16 the same way.
//  - checkpoint: the block runs through nn::checkpoint (activations
//    recomputed in backward, RNG restored).
//  - an observer (overflow detection) sees each block's inputs and outputs
//    after the forward.
// The precision policy (src/shoestring/precision/) fills the table from the
// user's rules; models only declare which of their submodules are blocks.
#pragma once
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include "shoestring/nn/checkpoint.h"

namespace shoestring::nn {

/// How one block runs.
struct BlockPrecision {
  /// dtype of the block's arithmetic: kFloat or kBFloat16 (or kHalf on a
  /// device with fp16 kernels). With emulate_fp16 this is kFloat.
  at::ScalarType compute = at::kFloat;
  /// fp16 compute emulated on the CPU: fp32 math, outputs rounded to fp16.
  bool emulate_fp16 = false;
  /// Recompute the block's activations in backward.
  bool checkpoint = false;
};

/// Sees every configured block's inputs and outputs after its forward, in
/// execution order (for overflow detection). Called outside any checkpoint
/// recomputation (once per forward), with autograd state unchanged.
class BlockObserver {
 public:
  virtual ~BlockObserver() = default;
  virtual void observe(const torch::nn::Module* block, const std::vector<at::Tensor>& inputs,
                       const std::vector<at::Tensor>& outputs) = 0;
};

/// Makes a block's parameters present only while the block runs: ZeRO stage
/// 3 (each rank holds 1/W of the weights and gathers a block's before use)
/// and, on the same machinery, streaming weights from host memory. run_block
/// calls it around every block it streams():
///  - a block run without autograd (a checkpointed block's forward, sampling):
///    fetch(), the block, release(block, false);
///  - a checkpointed block's recompute in backward: fetch(), the recompute
///    and its backward, then release(block, true) once the gradients of the
///    block's parameters are complete (nn::checkpoint's after_backward);
///  - a block run with autograd but not checkpointed cannot be streamed (its
///    saved activations would hold the weights): run_block throws.
/// fetch / release calls nest and must balance (a block inside another
/// streamed block is fetched twice); what they do is the implementation's.
class BlockParameterStreaming {
 public:
  virtual ~BlockParameterStreaming() = default;
  /// True when `block`'s parameters are fetched and released around its use.
  virtual bool streams(const torch::nn::Module* block) const = 0;
  /// Makes the parameters of `block` present (may communicate).
  virtual void fetch(const torch::nn::Module* block) = 0;
  /// Lets the parameters go again; `gradients_complete`: the backward of
  /// the block has just run, so its parameters' .grad hold this pass's
  /// gradients (may communicate).
  virtual void release(const torch::nn::Module* block, bool gradients_complete) = 0;
};

/// The blocks of one model and their precision settings. Models declare
/// blocks at construction; precision::apply_policy() configures them.
class BlockTable {
 public:
  /// Declares `block` as a block of this model. `checkpointable` is false
  /// for wrapper scopes (e.g. a whole UNet) that may carry a compute dtype
  /// but must never be checkpointed as one piece.
  void declare(const torch::nn::Module* block, bool checkpointable = true);
  bool is_block(const torch::nn::Module* m) const { return declared_.count(m) != 0; }
  bool is_checkpointable(const torch::nn::Module* m) const;
  /// Sets a declared block's settings; marks the table configured. Throws
  /// shoestring::Error when `block` was not declared.
  void set(const torch::nn::Module* block, const BlockPrecision& p);
  /// Settings of `block`, or nullptr when the table is not configured or the
  /// block has none.
  const BlockPrecision* find(const torch::nn::Module* block) const;
  bool configured() const { return !settings_.empty(); }
  /// The declared, checkpointable blocks whose settings checkpoint them (in
  /// no particular order): those a BlockParameterStreaming may stream.
  std::vector<const torch::nn::Module*> checkpointed_blocks() const;
  /// Removes every setting (back to the legacy behaviour).
  void clear() { settings_.clear(); }
  /// Optional observer of block outputs (not owned by the settings).
  std::shared_ptr<BlockObserver> observer;
  /// Optional streaming of block parameters (ZeRO stage 3, offloading).
  std::shared_ptr<BlockParameterStreaming> streaming;

 private:
  std::unordered_map<const torch::nn::Module*, bool> declared_;  // -> checkpointable
  std::unordered_map<const torch::nn::Module*, BlockPrecision> settings_;
};

/// Thread-local compute dtype that layers honour (like autocast's state).
/// nullopt outside any configured block.
std::optional<at::ScalarType> current_compute_dtype();

/// RAII: sets current_compute_dtype() for its lifetime (restores the previous value).
class ComputeDtypeGuard {
 public:
  explicit ComputeDtypeGuard(std::optional<at::ScalarType> dtype);
  ~ComputeDtypeGuard();
  ComputeDtypeGuard(const ComputeDtypeGuard&) = delete;
  ComputeDtypeGuard& operator=(const ComputeDtypeGuard&) = delete;

 private:
  std::optional<at::ScalarType> previous_;
};

/// `t` cast to the current compute dtype when one is set and `t` is floating
/// point; otherwise `t` itself (for layers: weights, biases, embeddings).
at::Tensor to_compute_dtype(const at::Tensor& t);

/// Runs `fn(inputs)` as block `block` of the model owning `table` (see the
/// file comment), its parameters fetched and released around it when the
/// table's streaming streams it (BlockParameterStreaming; throws
/// shoestring::Error naming the block when it would run with autograd
/// without checkpointing). `block` is held by shared pointer because a checkpointed
/// segment is called again during backward. A block is checkpointed when its
/// table entry says so (precision rules); checkpointing happens only in training mode with autograd on.
/// Without checkpointing and with autograd on, the inputs are passed as
/// aliases, so gradients from inside the block are summed before those from
/// outside, the association the checkpointed path has (checkpointing then
/// changes no bit of the result).
std::vector<at::Tensor> run_block(const BlockTable* table, const std::shared_ptr<torch::nn::Module>& block,
                                  const SegmentFn& fn, const std::vector<at::Tensor>& inputs);

}  // namespace shoestring::nn
