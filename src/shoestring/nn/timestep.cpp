#include "shoestring/nn/timestep.h"

#include <cmath>

#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/nn/block_precision.h"

namespace shoestring::nn {

torch::Tensor timestep_embedding(const torch::Tensor& t, int64_t dim, double max_period) {
  if (!t.defined() || t.dim() != 1) fail("timestep_embedding: timesteps must be a 1-d tensor [B]");
  if (dim < 2) fail("timestep_embedding: dim must be >= 2, got {}", dim);
  const int64_t half = dim / 2;
  auto f32 = torch::TensorOptions().dtype(torch::kFloat32).device(t.device());
  torch::Tensor freqs = torch::exp(torch::arange(half, f32) * (-std::log(max_period)) / static_cast<double>(half));
  torch::Tensor args = t.to(torch::kFloat32).unsqueeze(1) * freqs.unsqueeze(0);
  torch::Tensor emb = torch::cat({torch::cos(args), torch::sin(args)}, -1);
  if (dim % 2 == 1) emb = torch::cat({emb, torch::zeros({t.size(0), 1}, f32)}, -1);
  return emb;
}

TimestepEmbeddingImpl::TimestepEmbeddingImpl(int64_t in_dim, int64_t time_dim, KeyLayout layout,
                                             const LayerInit& init) {
  if (in_dim <= 0 || time_dim <= 0) fail("TimestepEmbedding: bad sizes (in_dim {}, time_dim {})", in_dim, time_dim);
  const bool ldm = layout != KeyLayout::kShoestring;
  linear_1 = register_module(ldm ? "0" : "linear_1", Linear(in_dim, time_dim, true, init));
  linear_2 = register_module(ldm ? "2" : "linear_2", Linear(time_dim, time_dim, true, init));
}

torch::Tensor TimestepEmbeddingImpl::forward(const torch::Tensor& x) {
  return linear_2->forward(
      torch::silu(linear_1->forward(x.to(current_compute_dtype().value_or(value_dtype(linear_1->weight))))));
}

}  // namespace shoestring::nn
