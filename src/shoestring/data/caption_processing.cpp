// Batch-time caption processing (kohya's caption options). See caption_processing.h.
#include "shoestring/data/caption_processing.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include "shoestring/core/error.h"

namespace shoestring {

std::vector<std::string> caption_tags(std::string_view caption) {
  std::vector<std::string> tags;
  size_t start = 0;
  while (start <= caption.size()) {
    size_t end = caption.find(',', start);
    if (end == std::string_view::npos) end = caption.size();
    std::string_view tag = caption.substr(start, end - start);
    const size_t first = tag.find_first_not_of(" \t");
    if (first != std::string_view::npos) {
      const size_t last = tag.find_last_not_of(" \t");
      tags.emplace_back(tag.substr(first, last - first + 1));
    }
    start = end + 1;
  }
  return tags;
}

std::vector<std::string> process_captions(std::vector<std::string> captions, const CaptionProcessing& p) {
  auto check_rate = [](double r, const char* key) {
    if (!(r >= 0.0 && r <= 1.0)) fail("{} must be in [0, 1], got {}", key, r);
  };
  check_rate(p.dropout_rate, "caption_dropout_rate");
  check_rate(p.tag_dropout_rate, "caption_tag_dropout_rate");
  if (p.keep_tokens < 0) fail("keep_tokens must be >= 0, got {}", p.keep_tokens);
  const auto n = static_cast<int64_t>(captions.size());
  const at::Tensor drop = torch::rand({n});  // float32, as before tag processing existed
  const auto* u = drop.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    std::string& caption = captions[static_cast<size_t>(i)];
    if (static_cast<double>(u[i]) < p.dropout_rate) {
      caption.clear();
      continue;
    }
    if (!p.edits_tags()) continue;
    std::vector<std::string> tags = caption_tags(caption);
    const auto keep = static_cast<size_t>(std::min<int64_t>(p.keep_tokens, static_cast<int64_t>(tags.size())));
    std::vector<std::string> out(tags.begin(), tags.begin() + static_cast<std::ptrdiff_t>(keep));
    const auto flexible = static_cast<int64_t>(tags.size() - keep);
    if (flexible > 0) {
      std::vector<int64_t> order(static_cast<size_t>(flexible));
      if (p.shuffle) {
        const at::Tensor perm = torch::randperm(flexible, torch::kInt64);
        std::copy(perm.data_ptr<int64_t>(), perm.data_ptr<int64_t>() + flexible, order.begin());
      } else {
        for (int64_t k = 0; k < flexible; ++k) order[static_cast<size_t>(k)] = k;
      }
      at::Tensor keep_u;
      if (p.tag_dropout_rate > 0.0) keep_u = torch::rand({flexible});
      for (int64_t k = 0; k < flexible; ++k) {
        if (keep_u.defined() && static_cast<double>(keep_u.data_ptr<float>()[k]) < p.tag_dropout_rate) continue;
        out.push_back(tags[keep + static_cast<size_t>(order[static_cast<size_t>(k)])]);
      }
    }
    caption = fmt::format("{}", fmt::join(out, ", "));
  }
  return captions;
}

}  // namespace shoestring
