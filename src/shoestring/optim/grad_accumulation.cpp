#include "shoestring/optim/grad_accumulation.h"

#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/core/memory_ledger.h"
#include "shoestring/core/stochastic_rounding.h"

namespace shoestring {
namespace {
// Salt that separates the accumulator's rounding streams from the optimizer's
// (which use the plain seed): a different seed gives an independent stream.
constexpr uint64_t kAccumulationSalt = 0xA5C0'9F1B'77D2'3E41ull;
}  // namespace

const char* to_string(GradAccumulationMode mode) {
  switch (mode) {
    case GradAccumulationMode::fp32: return "fp32";
    case GradAccumulationMode::bf16_sr: return "bf16_sr";
    case GradAccumulationMode::native: return "native";
  }
  return "unknown";
}

GradAccumulationMode parse_grad_accumulation_mode(const std::string& name) {
  if (name == "fp32") return GradAccumulationMode::fp32;
  if (name == "bf16_sr") return GradAccumulationMode::bf16_sr;
  if (name == "native") return GradAccumulationMode::native;
  fail("gradient accumulation mode '{}' is not valid (valid: fp32, bf16_sr, native)", name);
}

GradientAccumulator::GradientAccumulator(std::vector<at::Tensor> params, GradAccumulationMode mode, uint64_t seed)
    : params_(std::move(params)), mode_(mode), seed_(seed), buffers_(params_.size()) {
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!params_[i].defined()) fail("GradientAccumulator: parameter {} is undefined", i);
    if (!at::isFloatingType(params_[i].scalar_type())) {
      fail("GradientAccumulator: parameter {} has non-float dtype {}", i, c10::toString(params_[i].scalar_type()));
    }
  }
}

at::ScalarType GradientAccumulator::buffer_dtype(size_t index) const {
  switch (mode_) {
    case GradAccumulationMode::fp32: return torch::kFloat32;
    case GradAccumulationMode::bf16_sr: return torch::kBFloat16;
    case GradAccumulationMode::native: break;
  }
  return params_.at(index).scalar_type();
}

void GradientAccumulator::check(size_t index, const at::Tensor& grad) const {
  if (index >= params_.size())
    fail("GradientAccumulator: index {} out of range ({} parameters)", index, params_.size());
  if (!grad.defined()) fail("GradientAccumulator: undefined gradient for parameter {}", index);
  if (!grad.sizes().equals(params_[index].sizes())) {
    fail("GradientAccumulator: gradient for parameter {} has {} elements in a different shape than the parameter ({})",
         index, grad.numel(), params_[index].numel());
  }
}

void GradientAccumulator::add(size_t index, const at::Tensor& grad_in, int64_t micro_step, bool may_alias) {
  check(index, grad_in);
  torch::NoGradGuard no_grad;
  at::Tensor grad = grad_in.detach();
  at::Tensor& buf = buffers_[index];
  const at::ScalarType dtype = buffer_dtype(index);
  ScopedMemoryCategory category(MemoryCategory::gradients);
  const RoundingKey key{seed_ ^ kAccumulationSalt, static_cast<uint64_t>(micro_step), static_cast<uint64_t>(index)};
  const bool sr = mode_ == GradAccumulationMode::bf16_sr;
  if (!buf.defined()) {
    // First micro-batch: the buffer takes the gradient's value.
    if (grad.scalar_type() == dtype) {
      if (may_alias && grad.is_contiguous()) {
        buf = grad;
        MemoryLedger::global().recharge(buf, MemoryCategory::gradients);
      } else {
        buf = grad.clone(at::MemoryFormat::Contiguous);
      }
    } else if (sr && grad.scalar_type() == torch::kFloat32) {
      buf = stochastic_round(grad.contiguous(), dtype, key);
    } else {
      // Wider-than-fp32 or other inputs: round through fp32 (SR) or to nearest.
      buf = sr ? stochastic_round(grad.to(torch::kFloat32).contiguous(), dtype, key) : grad.to(dtype).contiguous();
    }
    return;
  }
  switch (mode_) {
    case GradAccumulationMode::fp32:
    case GradAccumulationMode::native:
      buf.add_(grad);  // in the buffer's dtype (round-to-nearest for native bf16/fp16)
      return;
    case GradAccumulationMode::bf16_sr: {
      at::Tensor sum = buf.to(torch::kFloat32).add_(grad);
      stochastic_round_into(sum, buf, key);  // any device (core/stochastic_rounding.h)
      return;
    }
  }
}

const at::Tensor& GradientAccumulator::get(size_t index) const {
  if (index >= buffers_.size())
    fail("GradientAccumulator: index {} out of range ({} parameters)", index, buffers_.size());
  return buffers_[index];
}

bool GradientAccumulator::has(size_t index) const { return index < buffers_.size() && buffers_[index].defined(); }

at::Tensor GradientAccumulator::finish(size_t index, const at::Tensor& last_grad) {
  if (last_grad.defined()) check(index, last_grad);
  if (index >= buffers_.size())
    fail("GradientAccumulator: index {} out of range ({} parameters)", index, buffers_.size());
  torch::NoGradGuard no_grad;
  ScopedMemoryCategory category(MemoryCategory::gradients);
  at::Tensor buf = std::move(buffers_[index]);
  buffers_[index] = at::Tensor();
  if (!buf.defined()) {
    if (!last_grad.defined()) return at::Tensor();
    return last_grad.detach().to(torch::kFloat32);
  }
  at::Tensor out = buf.scalar_type() == torch::kFloat32 ? buf : buf.to(torch::kFloat32);
  buf = at::Tensor();
  if (last_grad.defined()) out.add_(last_grad.detach());
  return out;
}

void GradientAccumulator::release(size_t index) {
  if (index < buffers_.size()) buffers_[index] = at::Tensor();
}

void GradientAccumulator::reset() {
  for (auto& b : buffers_) b = at::Tensor();
}

int64_t GradientAccumulator::buffer_bytes() const {
  int64_t bytes = 0;
  for (const auto& b : buffers_) {
    if (b.defined()) bytes += b.numel() * static_cast<int64_t>(b.element_size());
  }
  return bytes;
}

}  // namespace shoestring
