#include "shoestring/nn/lora.h"

#include <algorithm>
#include <cmath>
#include <set>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/core/units.h"
#include "shoestring/io/safetensors.h"
#include "shoestring/io/weight_files.h"

namespace shoestring::nn {
namespace {

const char* kDown = "lora_down.weight";
const char* kUp = "lora_up.weight";
const char* kAlpha = "alpha";

std::vector<std::string> split_path(const std::string& path) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (true) {
    size_t dot = path.find('.', start);
    parts.push_back(path.substr(start, dot == std::string::npos ? std::string::npos : dot - start));
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  return parts;
}

// Lists up to `limit` names, then "... and N more".
std::string list_names(const std::vector<std::string>& names, size_t limit = 20) {
  std::string s;
  for (size_t i = 0; i < names.size() && i < limit; ++i) s += (i ? ", " : "") + names[i];
  if (names.size() > limit) s += fmt::format(", ... and {} more", names.size() - limit);
  return s;
}

// Which group of LoraOptions selects a layer (by its path inside the
// component), and with which rank / alpha. Returns false if none does.
bool select(const LoraLayerRef& l, const LoraOptions& o, int64_t& rank, double& alpha) {
  const std::vector<std::string> parts = split_path(l.local_path);
  const std::string& last = parts.back();
  const std::string prev = parts.size() >= 2 ? parts[parts.size() - 2] : "";
  const bool one_by_one = l.kind == LoraLayerKind::kLinear || l.kernel == 1;

  static const std::set<std::string> attn = {"to_q",   "to_k",   "to_v",     "to_out", "q_proj",
                                             "k_proj", "v_proj", "out_proj", "qkv"};
  // MMDiT: attn.qkv / attn.proj, attn2.qkv / attn2.proj (kohya lora_sd3 names).
  const bool mmdit_proj = last == "proj" && (prev == "attn" || prev == "attn2");
  const bool is_attn =
      l.kind == LoraLayerKind::kLinear && (attn.count(last) || mmdit_proj || (last == "0" && prev == "to_out"));
  if (is_attn) {
    if (!o.attention) return false;
    rank = o.rank;
    alpha = o.alpha;
    return true;
  }
  bool is_ff = (last == "proj_in" || last == "proj_out");
  bool in_stream = false;    // inside an MMDiT stream block
  bool in_embedder = false;  // MMDiT's t_embedder.mlp / y_embedder.mlp: conditioning, not feed-forward
  for (const auto& p : parts) {
    is_ff = is_ff || p == "ff" || p == "mlp";
    in_stream = in_stream || p == "context_block" || p == "x_block";
    in_embedder = in_embedder || p == "t_embedder" || p == "y_embedder";
  }
  is_ff = (is_ff && !in_embedder) || (in_stream && prev == "adaLN_modulation");
  if (is_ff && one_by_one) {
    if (!o.feed_forward) return false;
    rank = o.rank;
    alpha = o.alpha;
    return true;
  }
  if (l.kind == LoraLayerKind::kConv2d && o.conv_rank > 0) {
    // kohya adapts convs inside ResnetBlock2D / Downsample2D / Upsample2D, not
    // the model's first and last conv.
    static const std::set<std::string> excluded = {"conv_in", "conv_out", "input_blocks.0.0", "out.2"};
    if (excluded.count(l.local_path)) return false;
    rank = one_by_one ? o.rank : o.conv_rank;
    alpha = one_by_one ? o.alpha : o.conv_alpha;
    return true;
  }
  return false;
}

// A float as Python's str() writes it ("1.0", "0.5"), as in kohya's metadata.
std::string python_float(double v) {
  std::string s = fmt::format("{}", v);
  if (s.find_first_of(".eE") == std::string::npos && s.find_first_of("in") == std::string::npos) s += ".0";
  return s;
}

double parse_number(const std::string& entry, const std::string& value) {
  try {
    size_t used = 0;
    double v = std::stod(value, &used);
    if (used != value.size() || !std::isfinite(v)) throw std::invalid_argument("x");
    return v;
  } catch (const std::exception&) {
    fail("network_args: '{}': '{}' is not a number", entry, value);
  }
}

}  // namespace

torch::Tensor LoraLayerRef::weight() const {
  if (linear) return linear->weight;
  if (conv) return conv->weight;
  if (packed) return packed->packed_weight(packed_index);
  return {};
}

// ---------------------------------------------------------------------------
// KohyaNameTable

KohyaNameTable KohyaNameTable::build(torch::nn::Module& root, const std::vector<LoraComponent>& components) {
  KohyaNameTable table;
  for (const auto& item : root.named_modules("", /*include_self=*/false)) {
    const std::string& path = item.key();
    // The component with the longest matching prefix owns the module.
    const LoraComponent* owner = nullptr;
    for (const auto& c : components) {
      if (path.size() > c.module_prefix.size() && path.compare(0, c.module_prefix.size(), c.module_prefix) == 0 &&
          (!owner || c.module_prefix.size() > owner->module_prefix.size())) {
        owner = &c;
      }
    }
    if (!owner) continue;
    // Names `ref` (path relative to the owner) and adds it to the table.
    auto add = [&](LoraLayerRef ref, const std::string& ref_path) {
      ref.path = ref_path;
      ref.local_path = ref_path.substr(owner->module_prefix.size());
      ref.kohya_prefix = owner->kohya_prefix;
      std::string local = ref.local_path;
      std::replace(local.begin(), local.end(), '.', '_');
      ref.kohya_name = owner->kohya_prefix + "_" + local;
      auto [it, inserted] = table.index_.emplace(ref.kohya_name, table.layers_.size());
      if (!inserted) {
        fail("LoRA: modules '{}' and '{}' both get the kohya name '{}'", table.layers_[it->second].path, ref_path,
             ref.kohya_name);
      }
      table.layers_.push_back(std::move(ref));
    };
    LoraLayerRef ref;
    torch::nn::Module* m = item.value().get();
    if (auto* host = dynamic_cast<PackedLinearHost*>(m)) {
      // Each packed map is a Linear layer of its own (see PackedLinearHost).
      std::shared_ptr<PackedLinearHost> shared(item.value(), host);
      const std::vector<std::string> names = host->packed_names();
      for (size_t i = 0; i < names.size(); ++i) {
        LoraLayerRef r;
        r.kind = LoraLayerKind::kLinear;
        const torch::Tensor w = host->packed_weight(i);
        r.out = w.size(0);
        r.in = w.size(1);
        r.packed = shared;
        r.packed_index = i;
        add(std::move(r), path + "." + names[i]);
      }
      continue;
    }
    if (auto* l = dynamic_cast<LinearImpl*>(m)) {
      ref.kind = LoraLayerKind::kLinear;
      ref.in = l->in_features;
      ref.out = l->out_features;
      ref.linear = std::dynamic_pointer_cast<LinearImpl>(item.value());
    } else if (auto* c = dynamic_cast<Conv2dImpl*>(m)) {
      ref.kind = LoraLayerKind::kConv2d;
      ref.in = c->in_channels;
      ref.out = c->out_channels;
      ref.kernel = c->kernel_size;
      ref.stride = c->stride;
      ref.padding = c->padding;
      if (c->groups == 1) {
        ref.conv = std::dynamic_pointer_cast<Conv2dImpl>(item.value());
      } else {
        ref.not_adaptable_reason = fmt::format("grouped convolution (groups = {})", c->groups);
      }
    } else if (auto* tl = dynamic_cast<torch::nn::LinearImpl*>(m)) {
      ref.kind = LoraLayerKind::kLinear;
      ref.in = tl->options.in_features();
      ref.out = tl->options.out_features();
      ref.not_adaptable_reason = "libtorch torch::nn::Linear has no adapter hook (use shoestring::nn::Linear)";
    } else if (auto* tc = dynamic_cast<torch::nn::Conv2dImpl*>(m)) {
      ref.kind = LoraLayerKind::kConv2d;
      ref.in = tc->options.in_channels();
      ref.out = tc->options.out_channels();
      ref.kernel = (*tc->options.kernel_size())[0];
      ref.not_adaptable_reason = "libtorch torch::nn::Conv2d has no adapter hook (use shoestring::nn::Conv2d)";
    } else {
      continue;
    }
    add(std::move(ref), path);
  }
  return table;
}

const LoraLayerRef* KohyaNameTable::find(const std::string& kohya_name) const {
  auto it = index_.find(kohya_name);
  return it == index_.end() ? nullptr : &layers_[it->second];
}

const LoraLayerRef& KohyaNameTable::at(const std::string& kohya_name) const {
  if (const LoraLayerRef* l = find(kohya_name)) return *l;
  std::vector<std::pair<size_t, std::string>> scored;
  for (const auto& l : layers_) scored.emplace_back(edit_distance(kohya_name, l.kohya_name), l.kohya_name);
  std::sort(scored.begin(), scored.end());
  std::vector<std::string> closest;
  for (size_t i = 0; i < scored.size() && i < 3; ++i) closest.push_back(scored[i].second);
  if (closest.empty())
    fail("LoRA: unknown module name '{}': the model has no Linear or Conv2d layers to name", kohya_name);
  fail(
      "LoRA: unknown module name '{}': no Linear or Conv2d layer of the model has this kohya name ({} names "
      "known; closest: {})",
      kohya_name, layers_.size(), list_names(closest));
}

// ---------------------------------------------------------------------------
// network_args

LoraOptions apply_network_args(LoraOptions o, const std::vector<std::string>& args) {
  for (const auto& entry : args) {
    auto eq = entry.find('=');
    if (eq == std::string::npos || eq == 0) fail("network_args: '{}' is not \"key=value\"", entry);
    std::string key = entry.substr(0, eq), value = entry.substr(eq + 1);
    if (key == "conv_dim") {
      double v = parse_number(entry, value);
      if (v < 0 || v != std::floor(v) || v > 65536)
        fail("network_args: conv_dim must be an integer >= 0, got '{}'", value);
      o.conv_rank = static_cast<int64_t>(v);
    } else if (key == "conv_alpha") {
      double v = parse_number(entry, value);
      if (v < 0) fail("network_args: conv_alpha must be >= 0, got '{}'", value);
      o.conv_alpha = v;
    } else if (key == "train_ff") {
      if (value == "true" || value == "True" || value == "1") {
        o.feed_forward = true;
      } else if (value == "false" || value == "False" || value == "0") {
        o.feed_forward = false;
      } else {
        fail("network_args: train_ff must be true or false, got '{}'", value);
      }
    } else {
      fail("network_args: unknown key '{}' (valid: conv_dim, conv_alpha, train_ff)", key);
    }
  }
  return o;
}

// ---------------------------------------------------------------------------
// LoraModule

LoraModuleImpl::LoraModuleImpl(LoraLayerRef layer, int64_t rank, double alpha, double mult, torch::Dtype dtype,
                               std::optional<c10::Device> device)
    : multiplier(mult), layer_(std::move(layer)), rank_(rank) {
  if (!layer_.adaptable()) fail("LoRA: layer '{}' cannot be adapted: {}", layer_.path, layer_.not_adaptable_reason);
  if (rank < 1) fail("LoRA: rank of '{}' must be >= 1, got {}", layer_.path, rank);
  LayerInit init(torch::TensorOptions().dtype(dtype).device(device.value_or(layer_.weight().device())));
  if (layer_.kind == LoraLayerKind::kLinear) {
    auto down = register_module("lora_down", Linear(layer_.in, rank, /*bias=*/false, init));
    auto up = register_module("lora_up", Linear(rank, layer_.out, /*bias=*/false, init));
    lora_down_ = down;
    lora_up_ = up;
    down_weight_ = down->weight;
    up_weight_ = up->weight;
  } else {
    auto down = register_module(
        "lora_down", Conv2d(layer_.in, rank, layer_.kernel, layer_.stride, layer_.padding, /*bias=*/false, init));
    auto up = register_module("lora_up", Conv2d(rank, layer_.out, 1, 1, 0, /*bias=*/false, init));
    lora_down_ = down;
    lora_up_ = up;
    down_weight_ = down->weight;
    up_weight_ = up->weight;
  }
  // down keeps the layers' default U(-1/sqrt(fan_in), 1/sqrt(fan_in)), which
  // is kaiming_uniform_(a=sqrt(5)); up starts at zero.
  {
    torch::NoGradGuard no_grad;
    up_weight_.zero_();
  }
  alpha_buffer_ = register_buffer(kAlpha, torch::zeros({}, torch::kFloat32));
  set_alpha(alpha);
}

LoraModuleImpl::~LoraModuleImpl() { detach(); }

void LoraModuleImpl::set_alpha(double alpha) {
  alpha_ = alpha > 0 ? alpha : static_cast<double>(rank_);
  torch::NoGradGuard no_grad;
  alpha_buffer_.fill_(alpha_);
}

torch::Tensor LoraModuleImpl::delta(const torch::Tensor& x) {
  ++calls_;
  const auto dt = x.scalar_type();
  const double s = multiplier * scale();
  torch::Tensor h;
  if (layer_.kind == LoraLayerKind::kLinear) {
    h = torch::linear(torch::linear(x, down_weight_.to(dt)), up_weight_.to(dt));
  } else {
    h = torch::conv2d(x, down_weight_.to(dt), {}, {layer_.stride, layer_.stride}, {layer_.padding, layer_.padding});
    h = torch::conv2d(h, up_weight_.to(dt));
  }
  return h * s;
}

torch::Tensor LoraModuleImpl::delta_weight() const {
  torch::Tensor up = up_weight_.to(torch::kFloat32).reshape({layer_.out, rank_});
  torch::Tensor down = down_weight_.to(torch::kFloat32).reshape({rank_, -1});
  torch::Tensor w = torch::matmul(up, down) * (multiplier * scale());
  if (layer_.kind == LoraLayerKind::kConv2d) w = w.view({layer_.out, layer_.in, layer_.kernel, layer_.kernel});
  return w;
}

void LoraModuleImpl::attach() {
  if (attached_) return;
  LayerAdapter& slot = layer_.linear ? layer_.linear->adapter
                       : layer_.conv ? layer_.conv->adapter
                                     : layer_.packed->packed_adapter(layer_.packed_index);
  if (slot) fail("LoRA: layer '{}' already carries an adapter", layer_.path);
  // A raw pointer: the layer must not own its adapter (that would be a
  // reference cycle); the destructor detaches.
  slot = [self = this](const torch::Tensor& x) { return self->delta(x); };
  attached_ = true;
}

void LoraModuleImpl::detach() {
  if (!attached_) return;
  if (layer_.linear) layer_.linear->adapter = nullptr;
  if (layer_.conv) layer_.conv->adapter = nullptr;
  if (layer_.packed) layer_.packed->packed_adapter(layer_.packed_index) = nullptr;
  attached_ = false;
}

// ---------------------------------------------------------------------------
// LoraNetwork

LoraNetworkImpl::LoraNetworkImpl(torch::nn::Module& root, const std::vector<LoraComponent>& components)
    : table_(KohyaNameTable::build(root, components)) {}

LoraNetworkImpl::LoraNetworkImpl(torch::nn::Module& root, const std::vector<LoraComponent>& components,
                                 const LoraOptions& options)
    : LoraNetworkImpl(root, components) {
  options_ = options;
  if (options.rank < 1) fail("LoRA: network_dim (rank) must be >= 1, got {}", options.rank);
  if (options.conv_rank < 0) fail("LoRA: conv_dim must be >= 0, got {}", options.conv_rank);
  if (options.alpha < 0 || options.conv_alpha < 0) fail("LoRA: network_alpha and conv_alpha must be >= 0");
  for (const auto& layer : table_.layers()) {
    int64_t rank = 0;
    double alpha = 0;
    if (!select(layer, options, rank, alpha)) continue;
    if (!layer.adaptable()) {
      not_adaptable_.push_back(fmt::format("{} ({})", layer.path, layer.not_adaptable_reason));
      continue;
    }
    add(layer, rank, alpha, options.multiplier, options.dtype, options.device);
  }
  if (modules_.empty()) {
    fail("LoRA: no layer to adapt: the options select none of the {} Linear/Conv2d layers{}", table_.layers().size(),
         not_adaptable_.empty()
             ? ""
             : fmt::format(" that can carry an adapter (not adaptable: {})", list_names(not_adaptable_, 5)));
  }
}

void LoraNetworkImpl::add(const LoraLayerRef& layer, int64_t rank, double alpha, double multiplier,
                          torch::Dtype dtype, std::optional<c10::Device> device) {
  std::shared_ptr<LoraModuleImpl> m =
      register_module(layer.kohya_name, LoraModule(layer, rank, alpha, multiplier, dtype, device));
  m->attach();
  by_name_[layer.kohya_name] = modules_.size();
  modules_.push_back(m);
}

std::vector<std::string> LoraNetworkImpl::never_called() const {
  std::vector<std::string> names;
  for (const auto& m : modules_) {
    if (m->attached() && m->calls() == 0) names.push_back(m->layer().kohya_name);
  }
  return names;
}

LoraModuleImpl* LoraNetworkImpl::find(const std::string& kohya_name) const {
  auto it = by_name_.find(kohya_name);
  return it == by_name_.end() ? nullptr : modules_[it->second].get();
}

std::shared_ptr<LoraNetworkImpl> LoraNetworkImpl::from_file(torch::nn::Module& root,
                                                            const std::vector<LoraComponent>& components,
                                                            const std::string& path, double multiplier,
                                                            torch::Dtype dtype) {
  auto file = SafetensorsFile::open(path);
  std::shared_ptr<LoraNetworkImpl> net(new LoraNetworkImpl(root, components));
  // Group the file's keys by module name (the text before the first '.').
  struct Entry {
    const TensorInfo* down = nullptr;
    const TensorInfo* up = nullptr;
    const TensorInfo* alpha = nullptr;
  };
  std::map<std::string, Entry> entries;
  std::vector<std::string> order;
  for (const auto& info : file.tensors()) {
    auto dot = info.name.find('.');
    if (dot == std::string::npos) fail("{}: key '{}' is not '<module>.<tensor>'", path, info.name);
    std::string name = info.name.substr(0, dot), what = info.name.substr(dot + 1);
    if (!entries.count(name)) order.push_back(name);
    Entry& e = entries[name];
    if (what == kDown) {
      e.down = &info;
    } else if (what == kUp) {
      e.up = &info;
    } else if (what == kAlpha) {
      e.alpha = &info;
    } else {
      fail("{}: key '{}': '{}' is not a networks.lora tensor (expected {}, {} or {})", path, info.name, what, kDown,
           kUp, kAlpha);
    }
  }
  // Module-tree order, so modules() is deterministic whatever the file order.
  std::vector<const LoraLayerRef*> layers;
  for (const auto& name : order) {
    const Entry& e = entries[name];
    if (!e.down || !e.up) fail("{}: module '{}' lacks {}", path, name, e.down ? kUp : kDown);
    const LoraLayerRef* found = net->table_.find(name);
    if (!found) {
      try {
        net->table_.at(name);  // throws with the closest names
      } catch (const Error& e) {
        fail("{}: {}", path, e.what());
      }
    }
    const LoraLayerRef& layer = *found;
    if (!layer.adaptable()) fail("{}: layer '{}' cannot be adapted: {}", path, layer.path, layer.not_adaptable_reason);
    layers.push_back(&layer);
  }
  std::sort(layers.begin(), layers.end());  // table storage is in tree order
  for (const LoraLayerRef* layer : layers) {
    const Entry& e = entries[layer->kohya_name];
    if (e.down->shape.empty()) fail("{}: '{}' is a scalar", path, e.down->name);
    const int64_t rank = e.down->shape[0];
    double alpha = static_cast<double>(rank);
    if (e.alpha) alpha = file.get(*e.alpha).to(torch::kFloat64).item<double>();
    net->add(*layer, rank, alpha, multiplier, dtype);
  }
  net->load(path, /*partial=*/false);
  return net;
}

void LoraNetworkImpl::save(const std::string& path, const std::map<std::string, std::string>& metadata,
                           std::optional<torch::Dtype> dtype) const {
  std::vector<NamedTensor> tensors;
  for (const auto& m : modules_) {
    const std::string& name = m->layer().kohya_name;
    torch::Tensor down = m->down().detach(), up = m->up().detach();
    torch::Tensor alpha = torch::full({}, m->alpha(), torch::kFloat32);
    if (dtype) {
      down = down.to(*dtype);
      up = up.to(*dtype);
      alpha = alpha.to(*dtype);
    }
    tensors.push_back({name + "." + kDown, down, std::nullopt});
    tensors.push_back({name + "." + kUp, up, std::nullopt});
    tensors.push_back({name + "." + kAlpha, alpha, std::nullopt});
  }
  save_safetensors(path, tensors, metadata);
}

LoraLoadReport LoraNetworkImpl::check_file(const SafetensorsFile& file, bool partial) const {
  const std::string& path = file.path();
  LoraLoadReport report;
  std::set<std::string> expected;
  for (const auto& m : modules_) {
    for (const char* what : {kDown, kUp, kAlpha}) expected.insert(m->layer().kohya_name + "." + what);
  }
  for (const auto& key : expected) {
    if (!file.find(key)) report.missing.push_back(key);
  }
  for (const auto& info : file.tensors()) {
    if (!expected.count(info.name)) report.unexpected.push_back(info.name);
  }
  std::sort(report.unexpected.begin(), report.unexpected.end());
  if (!partial && (!report.missing.empty() || !report.unexpected.empty())) {
    std::string msg = fmt::format("{}: LoRA keys do not match the network", path);
    if (!report.missing.empty()) {
      msg += fmt::format("; {} missing: {}", report.missing.size(), list_names(report.missing));
    }
    if (!report.unexpected.empty()) {
      msg += fmt::format("; {} unexpected: {}", report.unexpected.size(), list_names(report.unexpected));
    }
    fail("{}", msg);
  }
  for (const auto& m : modules_) {
    const std::string& name = m->layer().kohya_name;
    for (const auto* target : {&m->down(), &m->up()}) {
      const std::string key = name + "." + (target == &m->down() ? kDown : kUp);
      const TensorInfo* info = file.find(key);
      if (!info) continue;
      if (info->shape != target->sizes().vec()) {
        fail("{}: '{}' has shape {}, the network expects {}", path, key, format_shape(info->shape),
             format_shape(target->sizes()));
      }
      if (!at::isFloatingType(to_scalar_type(info->dtype))) fail("{}: '{}' is not a floating-point tensor", path, key);
    }
    const std::string key = name + "." + kAlpha;
    if (const TensorInfo* info = file.find(key)) {
      int64_t numel = 1;
      for (int64_t d : info->shape) numel *= d;
      if (numel != 1) fail("{}: '{}' must hold one value, has shape {}", path, key, format_shape(info->shape));
    }
  }
  return report;
}

LoraLoadReport LoraNetworkImpl::check_file(const std::string& path, bool partial) const {
  return check_file(SafetensorsFile::open(path), partial);
}

LoraLoadReport LoraNetworkImpl::load(const std::string& path, bool partial) {
  auto file = SafetensorsFile::open(path);
  const LoraLoadReport report = check_file(file, partial);
  torch::NoGradGuard no_grad;
  for (const auto& m : modules_) {
    const std::string& name = m->layer().kohya_name;
    for (auto* target : {&m->down(), &m->up()}) {
      const std::string key = name + "." + (target == &m->down() ? kDown : kUp);
      if (!file.find(key)) continue;
      const torch::Tensor t = file.get(key);
      require_finite(t, path, key);  // NaN adapters would train to NaN silently
      target->copy_(t);
    }
    const std::string key = name + "." + kAlpha;
    if (file.find(key)) {
      const torch::Tensor a = file.get(key);
      require_finite(a, path, key);
      m->set_alpha(a.to(torch::kFloat64).item<double>());
    }
  }
  return report;
}

int64_t LoraNetworkImpl::merge() {
  torch::NoGradGuard no_grad;
  int64_t n = 0;
  for (const auto& m : modules_) {
    const LoraLayerRef& layer = m->layer();
    if ((layer.linear && layer.linear->weight_fp8) || (layer.conv && layer.conv->weight_fp8))
      fail("LoRA merge: layer '{}' stores its weight as fp8 bytes (a frozen fp8 base); merge into a bf16 / fp32 model",
           layer.path);
  }
  for (const auto& m : modules_) {
    torch::Tensor w = m->layer().weight();
    w.copy_((w.to(torch::kFloat32) + m->delta_weight().to(w.device())).to(w.scalar_type()));
    m->detach();
    ++n;
  }
  return n;
}

void LoraNetworkImpl::detach() {
  for (const auto& m : modules_) m->detach();
}

void LoraNetworkImpl::attach() {
  for (const auto& m : modules_) m->attach();
}

void LoraNetworkImpl::set_multiplier(double multiplier) {
  options_.multiplier = multiplier;
  for (const auto& m : modules_) m->multiplier = multiplier;
}

int64_t merge_lora_file(torch::nn::Module& root, const std::vector<LoraComponent>& components, const std::string& path,
                        double multiplier) {
  auto net = LoraNetworkImpl::from_file(root, components, path, multiplier);
  return net->merge();
}

int64_t freeze_parameters(torch::nn::Module& module) {
  int64_t n = 0;
  for (auto& p : module.parameters(/*recurse=*/true)) {
    p.set_requires_grad(false);
    ++n;
  }
  return n;
}

std::map<std::string, std::string> kohya_lora_metadata(const LoraOptions& o, const std::string& base_model_version) {
  std::map<std::string, std::string> meta = {
      {"ss_network_module", "networks.lora"},
      {"ss_network_dim", std::to_string(o.rank)},
      {"ss_network_alpha", python_float(o.alpha)},
      {"ss_base_model_version", base_model_version},
  };
  nlohmann::json args = nlohmann::json::object();
  if (o.conv_rank > 0) {
    args["conv_dim"] = std::to_string(o.conv_rank);
    args["conv_alpha"] = python_float(o.conv_alpha);
  }
  if (o.feed_forward) args["train_ff"] = "true";
  if (!args.empty()) meta["ss_network_args"] = args.dump();
  return meta;
}

}  // namespace shoestring::nn
