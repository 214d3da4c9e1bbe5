#include "shoestring/train/block_streaming.h"

#include <algorithm>
#include <map>

#include <torch/nn/module.h>

namespace shoestring {

std::shared_ptr<ZeroBlockStreaming> ZeroBlockStreaming::attach(
    dist::ZeroSharding& zero, const std::vector<nn::BlockTable*>& tables,
    const std::vector<std::pair<std::string, at::Tensor>>& trainable) {
  std::shared_ptr<ZeroBlockStreaming> self(new ZeroBlockStreaming(zero));
  std::unordered_map<const c10::TensorImpl*, size_t> index;
  for (size_t i = 0; i < trainable.size(); ++i) index.emplace(trainable[i].second.unsafeGetTensorImpl(), i);

  // Each checkpointed block's trainable parameters (its subtree's).
  struct Candidate {
    const torch::nn::Module* block;
    std::vector<size_t> params;
  };
  std::vector<Candidate> candidates;
  for (nn::BlockTable* table : tables) {
    if (!table) continue;
    for (const torch::nn::Module* block : table->checkpointed_blocks()) {
      Candidate c{block, {}};
      for (const at::Tensor& p : block->parameters(/*recurse=*/true)) {
        const auto it = index.find(p.unsafeGetTensorImpl());
        if (it != index.end()) c.params.push_back(it->second);
      }
      std::sort(c.params.begin(), c.params.end());
      c.params.erase(std::unique(c.params.begin(), c.params.end()), c.params.end());
      if (!c.params.empty()) candidates.push_back(std::move(c));
    }
  }
  // Outer blocks first (more parameters), so a nested block's parameters go
  // to the outer group; then by first parameter, the same on every rank.
  std::sort(candidates.begin(), candidates.end(), [](const Candidate& a, const Candidate& b) {
    if (a.params.size() != b.params.size()) return a.params.size() > b.params.size();
    return a.params.front() < b.params.front();
  });
  std::vector<bool> taken(trainable.size(), false);
  std::vector<Candidate> groups;
  for (Candidate& c : candidates) {
    std::vector<size_t> own;
    for (size_t i : c.params) {
      if (!taken[i]) own.push_back(i);
    }
    if (own.size() != c.params.size()) continue;  // nested inside a streamed block: streams with it
    for (size_t i : own) taken[i] = true;
    groups.push_back(std::move(c));
  }
  std::sort(groups.begin(), groups.end(),
            [](const Candidate& a, const Candidate& b) { return a.params.front() < b.params.front(); });
  for (const Candidate& g : groups) self->group_of_.emplace(g.block, zero.add_streamed_group(g.params));
  for (nn::BlockTable* table : tables) {
    if (table) table->streaming = self;
  }
  return self;
}

}  // namespace shoestring
