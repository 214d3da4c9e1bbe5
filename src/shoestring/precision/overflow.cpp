#include "shoestring/precision/overflow.h"

#include <cmath>
#include <limits>

#include <torch/torch.h>

#include "shoestring/core/error.h"

namespace shoestring::precision {
namespace {

constexpr double kFp16Max = 65504.0;

/// Largest |x| over the floating tensors (inf if any element is inf or NaN).
double max_abs(const std::vector<at::Tensor>& xs) {
  torch::NoGradGuard no_grad;
  double m = 0;
  for (const auto& x : xs) {
    if (!x.defined() || !x.is_floating_point() || x.numel() == 0) continue;
    at::Tensor d = x.detach();
    if (!d.isfinite().all().item<bool>()) return std::numeric_limits<double>::infinity();
    m = std::max(m, d.abs().max().item<double>());
  }
  return m;
}

}  // namespace

OverflowMonitor::OverflowMonitor(const torch::nn::Module& model, const std::vector<nn::BlockTable*>& tables,
                                 OverflowOptions options)
    : options_(options) {
  if (!(options_.threshold > 0 && options_.threshold <= 1)) {
    fail("precision.overflow_threshold must lie in (0, 1], got {}", options_.threshold);
  }
  limit_ = options_.threshold * kFp16Max;
  for (const auto& item : model.named_modules("", true)) {
    const torch::nn::Module* m = item.value().get();
    for (auto* t : tables) {
      if (!t) continue;
      const nn::BlockPrecision* p = t->find(m);
      if (p && (p->emulate_fp16 || p->compute == at::kHalf)) {
        watched_[m] = {item.key(), t};
        by_path_[item.key()] = m;
      }
    }
  }
}

std::shared_ptr<OverflowMonitor> OverflowMonitor::attach(const torch::nn::Module& model,
                                                         const std::vector<nn::BlockTable*>& tables,
                                                         OverflowOptions options) {
  auto monitor = std::make_shared<OverflowMonitor>(model, tables, options);
  for (auto* t : tables) {
    if (t) t->observer = monitor;
  }
  return monitor;
}

void OverflowMonitor::begin_pass() { events_.clear(); }

void OverflowMonitor::observe(const torch::nn::Module* block, const std::vector<at::Tensor>& inputs,
                              const std::vector<at::Tensor>& outputs) {
  if (!enabled_) return;
  auto it = watched_.find(block);
  if (it == watched_.end()) return;
  const double out_max = max_abs(outputs);
  const bool out_bad = !std::isfinite(out_max) || out_max > limit_;
  if (!out_bad) return;
  const double in_max = max_abs(inputs);
  if (!std::isfinite(in_max) || in_max > limit_) return;  // passing on an upstream overflow
  const std::string& path = it->second.path;
  for (const auto& e : events_) {
    // A nested block already explains this one's output.
    if (path.empty() || e.path.rfind(path + ".", 0) == 0) return;
  }
  events_.push_back({path, out_max, !std::isfinite(out_max)});
}

std::vector<std::string> OverflowMonitor::upcast_flagged() {
  std::vector<std::string> paths;
  for (const auto& e : events_) {
    if (by_path_.count(e.path)) paths.push_back(e.path);
  }
  upcast(paths);
  return paths;
}

std::vector<std::string> OverflowMonitor::watched_paths() const {
  std::vector<std::string> paths;
  for (const auto& [path, module] : by_path_) paths.push_back(path);
  return paths;
}

void OverflowMonitor::upcast(const std::vector<std::string>& paths) {
  for (const auto& path : paths) {
    auto it = by_path_.find(path);
    if (it == by_path_.end()) {
      fail("precision: cannot upcast '{}': not an fp16 block of this model", path);
    }
    const torch::nn::Module* m = it->second;
    Watched w = watched_.at(m);
    nn::BlockPrecision p = *w.table->find(m);
    p.compute = at::kFloat;
    p.emulate_fp16 = false;
    w.table->set(m, p);
    watched_.erase(m);
    by_path_.erase(it);
    upcast_.push_back(path);
  }
}

}  // namespace shoestring::precision
