#include "shoestring/io/weight_files.h"

#include <algorithm>
#include <filesystem>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/core/fp8.h"
#include "shoestring/core/text.h"
#include "shoestring/io/atomic_file.h"
#include "shoestring/io/json_structure.h"

namespace shoestring {
namespace fs = std::filesystem;

namespace {


std::string join_shape(const std::vector<int64_t>& shape) {
  if (shape.empty()) return "scalar";
  return fmt::format("{}", fmt::join(shape, "x"));
}

}  // namespace

WeightFiles WeightFiles::open(const std::string& path) {
  WeightFiles w;
  w.path_ = path;
  if (!has_suffix(path, ".json")) {
    w.files_.push_back(SafetensorsFile::open(path));
    for (const auto& info : w.files_[0].tensors()) w.owner_[info.name] = 0;
    w.metadata_ = w.files_[0].metadata();
    return w;
  }
  const std::string text = read_file(path);
  // An index is {"metadata": {...}, "weight_map": {name: file}}: 2 levels; a
  // margin for metadata holding objects of its own.
  constexpr int kMaxIndexDepth = 8;
  const JsonStructureIssues issues = scan_json_structure(text, kMaxIndexDepth, size_t{1} << 20);
  if (issues.too_deep_at) {
    fail("{}: not a sharded-checkpoint index: JSON nested deeper than {} levels (at byte {}); an index needs 2", path,
         kMaxIndexDepth, *issues.too_deep_at);
  }
  if (issues.syntax_error)
    fail("{}: not a valid sharded-checkpoint index (JSON error: {})", path, *issues.syntax_error);
  if (issues.duplicate_nested_key && issues.duplicate_nested_key->first == "weight_map") {
    fail("{}: weight_map lists \"{}\" twice (which shard holds it is ambiguous)", path,
         issues.duplicate_nested_key->second);
  }
  if (issues.duplicate_top_key || issues.duplicate_nested_key) {
    fail("{}: the index gives key \"{}\" twice", path,
         issues.duplicate_top_key ? *issues.duplicate_top_key : issues.duplicate_nested_key->second);
  }
  if (issues.long_array) fail("{}: the index holds an array of more than {} values", path, size_t{1} << 20);
  nlohmann::json index;
  try {
    index = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    fail("{}: not a valid sharded-checkpoint index (JSON error: {})", path, e.what());
  }
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object())
    fail("{}: a sharded-checkpoint index needs a \"weight_map\" object (tensor name -> shard file)", path);
  const fs::path folder = fs::path(path).parent_path();
  std::map<std::string, size_t> shard_of_file;
  std::map<std::string, std::string> assigned;  // tensor -> shard file name
  for (const auto& [name, shard] : index["weight_map"].items()) {
    if (!shard.is_string()) fail("{}: weight_map[\"{}\"] must be a file name string", path, name);
    const std::string file = shard.get<std::string>();
    const fs::path rel(file);
    if (file.empty() || rel.is_absolute() || file.find("..") != std::string::npos)
      fail("{}: weight_map[\"{}\"] = \"{}\" must be a file name inside the index's folder", path, name, file);
    assigned[name] = file;
    if (!shard_of_file.count(file)) {
      const std::string shard_path = (folder / rel).string();
      std::error_code ec;  // e.g. a name too long for the file system: an error, not an exception
      if (!fs::exists(shard_path, ec))
        fail("{}: shard \"{}\" (holding \"{}\") does not exist{}", path, shard_path, name,
             ec ? " (" + ec.message() + ")" : "");
      shard_of_file[file] = w.files_.size();
      w.files_.push_back(SafetensorsFile::open(shard_path));
    }
  }
  for (const auto& [name, file] : assigned) {
    const size_t k = shard_of_file.at(file);
    if (!w.files_[k].find(name))
      fail("{}: the index puts \"{}\" in \"{}\", which does not contain it", path, name, w.files_[k].path());
    w.owner_[name] = k;
  }
  // A tensor present in a shard but absent from the index would be silently
  // dropped; a tensor in two shards is ambiguous.
  std::map<std::string, std::string> seen;
  for (const auto& f : w.files_) {
    for (const auto& info : f.tensors()) {
      auto [it, fresh] = seen.emplace(info.name, f.path());
      if (!fresh) fail("{}: tensor \"{}\" is in two shards ({} and {})", path, info.name, it->second, f.path());
      if (!w.owner_.count(info.name))
        fail("{}: shard {} holds \"{}\", which the index's weight_map does not list", path, f.path(), info.name);
    }
  }
  if (!w.files_.empty()) w.metadata_ = w.files_[0].metadata();
  if (index.contains("metadata") && index["metadata"].is_object()) {
    for (const auto& [k, v] : index["metadata"].items())
      w.metadata_[k] = v.is_string() ? v.get<std::string>() : v.dump();
  }
  return w;
}

std::vector<std::string> WeightFiles::names() const {
  std::vector<std::string> out;
  out.reserve(owner_.size());
  for (const auto& [name, k] : owner_) out.push_back(name);
  return out;
}

const TensorInfo* WeightFiles::find(const std::string& name) const {
  auto it = owner_.find(name);
  return it == owner_.end() ? nullptr : files_[it->second].find(name);
}

const std::string& WeightFiles::file_of(const std::string& name) const {
  auto it = owner_.find(name);
  if (it == owner_.end()) fail("{}: no tensor named \"{}\"", path_, name);
  return files_[it->second].path();
}

at::Tensor WeightFiles::get(const std::string& name) const {
  auto it = owner_.find(name);
  if (it == owner_.end()) fail("{}: no tensor named \"{}\"", path_, name);
  return files_[it->second].get(name);
}

at::Tensor WeightFiles::get_values(const std::string& name) const {
  at::Tensor t = get(name);
  const TensorInfo* info = find(name);
  const bool f8 = info->dtype == StDtype::F8_E4M3 || info->dtype == StDtype::F8_E5M2;
  if (!f8 || t.scalar_type() != at::kByte) return t;
  return fp8_decode_tensor(t, info->dtype == StDtype::F8_E4M3 ? Fp8Format::e4m3fn : Fp8Format::e5m2, 1.0,
                           at::kBFloat16);
}

uint64_t WeightFiles::data_bytes() const {
  uint64_t n = 0;
  for (const auto& f : files_) n += f.data_size();
  return n;
}

std::string KeyDiff::describe(size_t limit) const {
  auto list = [limit](const std::vector<std::string>& v) {
    if (v.empty()) return std::string("none");
    std::string s = fmt::format("{}", fmt::join(v.begin(), v.begin() + std::min(v.size(), limit), ", "));
    if (v.size() > limit) s += fmt::format(", ... ({} in all)", v.size());
    return s;
  };
  return fmt::format("missing keys: {}; unexpected keys: {}; shape mismatches: {}", list(missing), list(unexpected),
                     list(mismatched));
}

KeyDiff diff_keys(const std::map<std::string, std::vector<int64_t>>& expected,
                  const std::map<std::string, std::vector<int64_t>>& found) {
  KeyDiff d;
  for (const auto& [name, shape] : expected) {
    auto it = found.find(name);
    if (it == found.end()) {
      d.missing.push_back(name);
    } else if (it->second != shape) {
      d.mismatched.push_back(fmt::format("{} (file {}, model {})", name, join_shape(it->second), join_shape(shape)));
    }
  }
  for (const auto& [name, shape] : found) {
    if (!expected.count(name)) d.unexpected.push_back(name);
  }
  return d;
}

void require_finite(const at::Tensor& t, const std::string& file, const std::string& key,
                    const std::string& converted_to) {
  if (!t.is_floating_point() || t.numel() == 0 || t.isfinite().all().item<bool>()) return;
  const at::Tensor bad = t.isfinite().logical_not();
  const int64_t n = bad.sum().item<int64_t>();
  const int64_t first = bad.reshape({-1}).nonzero()[0][0].item<int64_t>();
  if (converted_to.empty()) {
    fail(
        "{}: tensor \"{}\" holds {} non-finite value(s) (NaN or inf) of {}, the first at flat index {}; the "
        "weights are damaged (a corrupt file, or a run that diverged)",
        file, key, n, t.numel(), first);
  }
  fail(
      "{}: tensor \"{}\" overflows {}: {} of its {} values become inf when converted (the first at flat index "
      "{}); keep this module in a wider dtype (a precision rule with storage = \"fp32\" or \"bf16\")",
      file, key, converted_to, n, t.numel(), first);
}

LoadWeightsReport load_weights(torch::nn::Module& module, const WeightFiles& files, const LoadWeightsOptions& options) {
  torch::NoGradGuard no_grad;
  std::map<std::string, at::Tensor> targets;
  std::map<std::string, std::vector<int64_t>> expected, found;
  std::set<std::string> parameters;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    targets[item.key()] = item.value();
    parameters.insert(item.key());
  }
  for (const auto& item : module.named_buffers(/*recurse=*/true)) targets[item.key()] = item.value();
  for (const auto& [name, t] : targets) {
    if (t.is_meta()) fail("{}: cannot load into \"{}\": the model was built on the meta device", files.path(), name);
    expected[name] = t.sizes().vec();
  }
  std::map<std::string, std::string> source_of;  // module name -> file key
  for (const std::string& key : files.names()) {
    const std::string name = options.key_map ? options.key_map(key) : key;
    if (name.empty()) continue;
    auto [it, fresh] = source_of.emplace(name, key);
    if (!fresh) fail("{}: file keys \"{}\" and \"{}\" both map to \"{}\"", files.path(), it->second, key, name);
    found[name] = files.find(key)->shape;
  }
  LoadWeightsReport report;
  report.diff = diff_keys(expected, found);
  if (!report.diff.mismatched.empty() || (!options.allow_partial && !report.diff.empty()))
    fail("{}: checkpoint does not match the model: {}", files.path(), report.diff.describe());
  for (auto& [name, target] : targets) {
    auto it = source_of.find(name);
    if (it == source_of.end()) continue;
    const TensorInfo* info = files.find(it->second);
    at::Tensor source = files.get(it->second);
    const bool f8 = info->dtype == StDtype::F8_E4M3 || info->dtype == StDtype::F8_E5M2;
    if (f8 && source.scalar_type() != target.scalar_type()) {
      // F8 values into a float parameter: decoded first (then checked for
      // NaN like any weight). Without a float8 dtype (libtorch < 2.1) the
      // bytes are the F8 bit patterns (io/safetensors.h), decoded to the
      // values a float8 cast gives.
      if (!at::isFloatingType(target.scalar_type()))
        fail("{}: tensor \"{}\" is {} and cannot be loaded into \"{}\" of dtype {}", files.path(), it->second,
             to_string(info->dtype), name, c10::toString(target.scalar_type()));
      const at::ScalarType dtype = target.scalar_type() == at::kDouble ? at::kFloat : target.scalar_type();
      source = source.scalar_type() == at::kByte
                   ? fp8_decode_tensor(source, info->dtype == StDtype::F8_E4M3 ? Fp8Format::e4m3fn : Fp8Format::e5m2,
                                       1.0, dtype)
                   : source.to(dtype);
    }
    if (!f8 && at::isFloatingType(target.scalar_type()) && !source.is_floating_point())
      fail("{}: tensor \"{}\" is {} (integers) and cannot be loaded into the floating-point \"{}\" ({}); a "
           "file whose weights were written as raw bytes is damaged",
           files.path(), it->second, to_string(info->dtype), name, c10::toString(target.scalar_type()));
    const bool check = options.require_finite && parameters.count(name) && source.is_floating_point();
    if (check) require_finite(source, files.path(), it->second, "");
    target.copy_(source);
    if (check && target.scalar_type() != source.scalar_type()) {
      require_finite(target, files.path(), it->second, c10::toString(target.scalar_type()));
    }
    ++report.loaded;
    report.loaded_bytes += target.numel() * target.element_size();
  }
  return report;
}

}  // namespace shoestring
