#include "shoestring/precision/save_guard.h"

#include <set>

#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include "shoestring/core/error.h"

namespace shoestring::precision {

bool NarrowingReport::bad(const SaveGuardOptions& o) const {
  return overflow > 0 || (nonzero > 0 && static_cast<double>(flushed) > o.max_flush_fraction * nonzero);
}

std::string NarrowingReport::describe(Dtype target) const {
  std::vector<std::string> parts;
  if (overflow > 0) {
    parts.push_back(fmt::format("{} of {} values overflow {} (max |x| {:.4g} > {:.6g})", overflow, numel,
                                to_string(target), max_abs, max_finite(target)));
  }
  if (flushed > 0) {
    parts.push_back(fmt::format("{} of {} nonzero values ({:.2f}%) flush to zero in {}", flushed, nonzero,
                                100.0 * flushed / std::max<int64_t>(1, nonzero), to_string(target)));
  }
  return fmt::format("{}: {}", name, parts.empty() ? "ok" : fmt::format("{}", fmt::join(parts, "; ")));
}

NarrowingReport check_narrowing(const std::string& name, const at::Tensor& t, Dtype target) {
  NarrowingReport r;
  r.name = name;
  r.numel = t.numel();
  if (!t.is_floating_point() || t.numel() == 0) return r;
  torch::NoGradGuard no_grad;
  at::Tensor x = t.detach().to(at::kFloat);
  at::Tensor finite = x.isfinite();
  at::Tensor nz = x.ne(0) & finite;
  r.nonzero = nz.sum().item<int64_t>();
  at::Tensor fin_abs = torch::where(finite, x.abs(), torch::zeros_like(x));
  r.max_abs = fin_abs.max().item<double>();
  if (target == Dtype::fp32) return r;
  at::Tensor y;
  if (is_fp8(target)) {
    y = quantize_fp8(x, target).dequantized;
  } else {
    y = x.to(container_dtype(target)).to(at::kFloat);
  }
  r.overflow = (finite & y.isfinite().logical_not()).sum().item<int64_t>();
  r.flushed = (nz & y.eq(0)).sum().item<int64_t>();
  return r;
}

std::vector<NamedTensor> convert_for_save(const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                                          const std::vector<std::optional<Dtype>>& targets,
                                          const SaveGuardOptions& options, const std::string& what) {
  if (targets.size() != tensors.size())
    fail("{}: {} save targets for {} tensors", what, targets.size(), tensors.size());
  std::set<std::string> names;  // of the targets, for the messages
  std::vector<std::string> problems;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!targets[i]) continue;
    const Dtype target = *targets[i];
    if (is_fp8(target)) fail("{}: saving weights as {} is not supported by this build", what, to_string(target));
    const auto& [name, t] = tensors[i];
    if (!t.is_floating_point() || t.scalar_type() == container_dtype(target)) continue;
    names.insert(to_string(target));
    NarrowingReport r = check_narrowing(name, t, target);
    if (r.bad(options)) problems.push_back(r.describe(target));
  }
  if (!problems.empty()) {
    const std::string in = fmt::format("{}", fmt::join(names, " / "));
    const size_t shown = std::min<size_t>(problems.size(), 20);
    std::string list = fmt::format("{}", fmt::join(problems.begin(), problems.begin() + shown, "\n  "));
    if (problems.size() > shown) list += fmt::format("\n  ... and {} more tensors", problems.size() - shown);
    if (!options.force) {
      fail(
          "{}: saving in {} would damage {} tensor(s) (overflow, or more than {:.3g}% of nonzero values flushed "
          "to zero):\n  {}\n{}",
          what, in, problems.size(), 100 * options.max_flush_fraction, list, options.override_hint);
    }
    spdlog::warn("{}: saving in {} anyway (forced) although {} tensor(s) lose values:\n  {}", what, in,
                 problems.size(), list);
  }
  std::vector<NamedTensor> out;
  out.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor v = tensors[i].second.detach();
    std::optional<at::ScalarType> cast;
    if (targets[i] && v.is_floating_point() && v.scalar_type() != container_dtype(*targets[i]))
      cast = container_dtype(*targets[i]);
    out.push_back({tensors[i].first, v, std::nullopt, cast});
  }
  return out;
}

std::vector<NamedTensor> convert_for_save(const std::vector<std::pair<std::string, at::Tensor>>& tensors, Dtype target,
                                          const SaveGuardOptions& options, const std::string& what) {
  if (is_fp8(target)) fail("{}: saving weights as {} is not supported by this build", what, to_string(target));
  return convert_for_save(tensors, std::vector<std::optional<Dtype>>(tensors.size(), target), options, what);
}

void save_with_guard(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                     std::optional<Dtype> target, const SaveGuardOptions& options,
                     std::map<std::string, std::string> metadata, const std::string& what) {
  if (!target) {
    std::vector<NamedTensor> out;
    out.reserve(tensors.size());
    for (const auto& [name, t] : tensors) out.push_back({name, t.detach(), std::nullopt});
    save_safetensors(path, out, metadata);
    return;
  }
  std::vector<NamedTensor> out = convert_for_save(tensors, *target, options, what);
  metadata["dtype"] = to_string(*target);
  save_safetensors(path, out, metadata);
}

Dtype parse_save_precision(const std::string& s) {
  if (s == "fp32" || s == "float") return Dtype::fp32;
  if (s == "fp16") return Dtype::fp16;
  if (s == "bf16") return Dtype::bf16;
  fail("save_precision: expected \"fp32\" (or kohya's \"float\"), \"fp16\" or \"bf16\", got \"{}\"", s);
}

}  // namespace shoestring::precision
