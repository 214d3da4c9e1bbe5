#include "shoestring/nn/block_precision.h"

#include <torch/torch.h>

#include "shoestring/core/error.h"

namespace shoestring::nn {
namespace {

thread_local std::optional<at::ScalarType> tls_compute_dtype;

std::vector<at::Tensor> cast_floating(const std::vector<at::Tensor>& xs, at::ScalarType dtype) {
  std::vector<at::Tensor> out;
  out.reserve(xs.size());
  for (const auto& x : xs) {
    out.push_back(x.defined() && x.is_floating_point() && x.scalar_type() != dtype ? x.to(dtype) : x);
  }
  return out;
}

}  // namespace

void BlockTable::declare(const torch::nn::Module* block, bool checkpointable) {
  if (!block) fail("BlockTable::declare: null module");
  declared_[block] = checkpointable;
}

bool BlockTable::is_checkpointable(const torch::nn::Module* m) const {
  auto it = declared_.find(m);
  return it != declared_.end() && it->second;
}

void BlockTable::set(const torch::nn::Module* block, const BlockPrecision& p) {
  if (!is_block(block)) fail("BlockTable::set: module '{}' is not a declared block", block ? block->name() : "null");
  settings_[block] = p;
}

const BlockPrecision* BlockTable::find(const torch::nn::Module* block) const {
  auto it = settings_.find(block);
  return it == settings_.end() ? nullptr : &it->second;
}

std::vector<const torch::nn::Module*> BlockTable::checkpointed_blocks() const {
  std::vector<const torch::nn::Module*> out;
  for (const auto& [block, setting] : settings_) {
    if (setting.checkpoint && is_checkpointable(block)) out.push_back(block);
  }
  return out;
}

std::optional<at::ScalarType> current_compute_dtype() { return tls_compute_dtype; }

ComputeDtypeGuard::ComputeDtypeGuard(std::optional<at::ScalarType> dtype) : previous_(tls_compute_dtype) {
  tls_compute_dtype = dtype;
}

ComputeDtypeGuard::~ComputeDtypeGuard() { tls_compute_dtype = previous_; }

at::Tensor to_compute_dtype(const at::Tensor& t) {
  if (!tls_compute_dtype || !t.defined() || !t.is_floating_point() || t.scalar_type() == *tls_compute_dtype) return t;
  return t.to(*tls_compute_dtype);
}

std::vector<at::Tensor> run_block(const BlockTable* table, const std::shared_ptr<torch::nn::Module>& block,
                                  const SegmentFn& fn, const std::vector<at::Tensor>& inputs) {
  const BlockPrecision* p = table ? table->find(block.get()) : nullptr;
  const bool grad_on = torch::GradMode::is_enabled();
  const bool checkpoint_it =
      grad_on && block->is_training() && p && p->checkpoint && table->is_checkpointable(block.get());

  SegmentFn segment = fn;
  if (p) {
    const BlockPrecision settings = *p;  // by value: the segment may run again in backward
    segment = [fn, settings](const std::vector<at::Tensor>& in) {
      ComputeDtypeGuard guard(settings.compute);
      std::vector<at::Tensor> out = fn(cast_floating(in, settings.compute));
      if (settings.emulate_fp16) {
        for (auto& y : out) {
          if (y.defined() && y.is_floating_point()) y = y.to(at::kHalf).to(at::kFloat);
        }
      }
      return out;
    };
  }

  BlockParameterStreaming* streaming =
      table && table->streaming && table->streaming->streams(block.get()) ? table->streaming.get() : nullptr;
  if (streaming) {
    if (grad_on && !checkpoint_it) {
      fail(
          "block '{}' streams its parameters (zero_stage = 3 / offload_params) but runs with autograd without "
          "gradient checkpointing; its weights would have to stay for backward: set gradient_checkpointing = true",
          block->name());
    }
    // Fetched for the run (the forward, or the recompute in backward);
    // released after a run without autograd, or after the recompute's
    // backward (checkpoint's after_backward).
    std::shared_ptr<BlockParameterStreaming> keep = table->streaming;
    const torch::nn::Module* which = block.get();
    SegmentFn inner = segment;
    segment = [inner, keep, which](const std::vector<at::Tensor>& in) {
      keep->fetch(which);
      std::vector<at::Tensor> out;
      try {
        out = inner(in);
      } catch (...) {
        keep->release(which, false);
        throw;
      }
      if (!torch::GradMode::is_enabled()) keep->release(which, false);
      return out;
    };
    if (checkpoint_it) {
      std::vector<at::Tensor> outputs = checkpoint(segment, inputs, [keep, which] { keep->release(which, true); });
      if (p && table->observer) table->observer->observe(block.get(), inputs, outputs);
      return outputs;
    }
  }

  std::vector<at::Tensor> outputs;
  if (checkpoint_it) {
    outputs = checkpoint(segment, inputs);
  } else if (grad_on) {
    std::vector<at::Tensor> aliases;
    aliases.reserve(inputs.size());
    for (const auto& x : inputs) aliases.push_back(x.defined() ? x.alias() : x);
    outputs = segment(aliases);
  } else {
    outputs = segment(inputs);
  }
  if (p && table->observer) table->observer->observe(block.get(), inputs, outputs);
  return outputs;
}

}  // namespace shoestring::nn
