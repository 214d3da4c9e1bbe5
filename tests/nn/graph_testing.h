// Size of an autograd graph, for tests that check gradient checkpointing
// keeps fewer nodes alive.
#pragma once
#include <unordered_set>
#include <vector>

#include <torch/torch.h>

namespace shoestring::testing {

/// Number of distinct autograd nodes reachable from t.grad_fn() (0 for a leaf).
inline size_t count_graph_nodes(const torch::Tensor& t) {
  std::unordered_set<torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack{t.grad_fn().get()};
  while (!stack.empty()) {
    auto* n = stack.back();
    stack.pop_back();
    if (!n || !seen.insert(n).second) continue;
    for (const auto& e : n->next_edges()) stack.push_back(e.function.get());
  }
  return seen.size();
}

}  // namespace shoestring::testing
