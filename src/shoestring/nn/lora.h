// LoRA: low-rank adapters (Hu et al. 2021, "LoRA: Low-Rank Adaptation of
// Large Language Models", arXiv 2106.09685) on chosen Linear / Conv2d layers
// of any module tree, stored in kohya sd-scripts' file format
// (networks/lora.py) so the files load in the usual Stable Diffusion tools.
//
// An adapted layer computes
//     y = base(x) + multiplier * (alpha / rank) * up(down(x))
// with the base weights frozen. Linear: down [rank, in], up [out, rank].
// Conv2d (kohya's LoCon / conv_dim): down is a conv with the layer's kernel,
// stride and padding, [rank, in, k, k]; up a 1x1 conv [out, rank, 1, 1].
// up starts at zero, so an attached network leaves the model's output
// unchanged; down starts as kohya's kaiming_uniform_(a=sqrt(5)), i.e.
// U(-1/sqrt(fan_in), 1/sqrt(fan_in)) with fan_in = in * k * k.
//
// Adapters hook into shoestring's own nn::Linear / nn::Conv2d (layers.h,
// LayerAdapter): the delta is added to the layer's output, no merged weight is
// materialised. libtorch's torch::nn::Linear / Conv2d have no such hook; they
// are named but never adapted (LoraNetwork::not_adaptable() lists them).
//
// kohya names: <prefix>_<module path with '.' replaced by '_'>, where the
// module path is relative to the component (the UNet, a text encoder), e.g.
//   lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q   (SDXL, LDM names)
//   lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q   (SD 1.x, diffusers names)
//   lora_te_text_model_encoder_layers_0_self_attn_q_proj, lora_te1_..., lora_te2_...
// File keys: <name>.lora_down.weight, <name>.lora_up.weight, <name>.alpha (0-d).
// Names are looked up in a table built from the module tree (KohyaNameTable),
// never parsed back into paths.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include "shoestring/nn/layers.h"

namespace shoestring {
class SafetensorsFile;
}

namespace shoestring::nn {

/// A part of the module tree with its own kohya prefix: the modules whose
/// path (relative to the root given to KohyaNameTable / LoraNetwork) starts
/// with `module_prefix`; that prefix is removed before naming.
/// Examples: {"lora_unet", ""} for a bare UNet; {"lora_unet", "unet."} and
/// {"lora_te", "text_encoder."} for shoestring's TinyUNetModel;
/// {"lora_unet", "model.diffusion_model."} for a model holding LDM
/// checkpoint names; {"lora_te1", "conditioner.embedders.0.transformer."}.
struct LoraComponent {
  std::string kohya_prefix;   ///< "lora_unet", "lora_te", "lora_te1", "lora_te2"
  std::string module_prefix;  ///< "" or a path ending in '.'
};

enum class LoraLayerKind { kLinear, kConv2d };

/// A module that packs several Linear maps of the same input into one weight,
/// like torch.nn.MultiheadAttention's in_proj_weight [3c, c] = [W_q; W_k; W_v]
/// (Stable Cascade's attention, models/cascade.h). KohyaNameTable lists map i
/// as a Linear layer at "<module path>.<packed_names()[i]>" that carries its
/// own adapter: LoRA on a slice of the packed weight, merged into those rows.
/// This is how the public Stable Cascade trainers name and train these maps:
/// kohya sd-scripts' stable-cascade branch and ComfyUI replace
/// nn.MultiheadAttention by separate to_q / to_k / to_v / out_proj Linears
/// (the packed checkpoint tensors split into thirds on load), and OneTrainer
/// saves Stable Cascade LoRAs in that kohya form
/// (`lora_prior_unet_<block>_attention_attn_to_q`, ..., `..._attention_attn_out_proj`;
/// OneTrainer modules/util/convert/lora/convert_stable_cascade_lora.py).
/// (Stability's own StableCascade modules/lora.py instead puts one LoRA on the
/// whole packed in_proj_weight; its files are not in kohya's format.)
class PackedLinearHost {
 public:
  virtual ~PackedLinearHost() = default;
  /// Local names of the packed maps, in packing order ("to_q", "to_k", "to_v").
  virtual std::vector<std::string> packed_names() const = 0;
  /// Map i's weight [out_i, in]: a view of the packed parameter, so writing
  /// it (LoraNetwork::merge) writes the parameter.
  virtual torch::Tensor packed_weight(size_t i) const = 0;
  /// Map i's adapter slot: when set, the module adds slot(x) to map i's
  /// output, x being map i's input (see LayerAdapter).
  virtual LayerAdapter& packed_adapter(size_t i) = 0;
};

/// One Linear or Conv2d layer of the tree, with its kohya name.
struct LoraLayerRef {
  std::string path;        ///< full module path under the root ("unet.mid.attn.blocks.0.attn1.to_q")
  std::string local_path;  ///< path inside its component ("mid.attn.blocks.0.attn1.to_q")
  std::string kohya_name;  ///< "lora_unet_mid_attn_blocks_0_attn1_to_q"
  std::string kohya_prefix;
  LoraLayerKind kind = LoraLayerKind::kLinear;
  int64_t in = 0, out = 0;                      ///< features / channels
  int64_t kernel = 1, stride = 1, padding = 0;  ///< Conv2d geometry (square)
  /// Non-null for shoestring layers (nn::LinearImpl / nn::Conv2dImpl, groups 1):
  /// the only ones that can carry an adapter.
  std::shared_ptr<LinearImpl> linear;
  std::shared_ptr<Conv2dImpl> conv;
  /// Non-null for map `packed_index` of a PackedLinearHost (kind kLinear).
  std::shared_ptr<PackedLinearHost> packed;
  size_t packed_index = 0;
  std::string not_adaptable_reason;  ///< why linear/conv/packed are null, else empty
  bool adaptable() const { return linear || conv || packed; }
  /// The layer's weight ([out, in] or [out, in, k, k]; for a packed map a view
  /// of its rows of the packed weight); undefined if not adaptable.
  torch::Tensor weight() const;
};

/// kohya name -> layer, for every Linear / Conv2d (shoestring's or libtorch's)
/// inside the given components, built by walking named_modules().
class KohyaNameTable {
 public:
  /// Throws shoestring::Error if two layers get the same kohya name (their
  /// paths differ only in '.' vs '_'), naming both paths.
  static KohyaNameTable build(torch::nn::Module& root, const std::vector<LoraComponent>& components);

  /// The layer named `kohya_name`, or nullptr.
  const LoraLayerRef* find(const std::string& kohya_name) const;
  /// The layer named `kohya_name`. Throws shoestring::Error naming it, the
  /// number of known names and the closest known names (edit distance).
  const LoraLayerRef& at(const std::string& kohya_name) const;
  /// Every layer, in module-tree order.
  const std::vector<LoraLayerRef>& layers() const { return layers_; }

 private:
  std::vector<LoraLayerRef> layers_;
  std::map<std::string, size_t> index_;
};

/// Which layers a LoraNetwork adapts and how (kohya's network_dim,
/// network_alpha, network_args conv_dim / conv_alpha).
struct LoraOptions {
  int64_t rank = 4;         ///< network_dim
  double alpha = 1.0;       ///< network_alpha; 0 means alpha = rank (scale 1), as kohya
  double multiplier = 1.0;  ///< strength of the delta
  /// Attention projections, per architecture as its public trainers name them:
  ///  - LDM / diffusers UNets: to_q, to_k, to_v, to_out / to_out.0 (and CLIP's
  ///    q_proj, k_proj, v_proj, out_proj) — kohya networks/lora.py;
  ///  - SD3 / SD3.5 MMDiT(-X): the fused attn.qkv and attn.proj Linears of
  ///    both streams, and attn2.qkv / attn2.proj in MMDiT-X blocks, one LoRA on
  ///    each whole fused Linear (kohya networks/lora_sd3.py adapts every
  ///    Linear of each stream block, qkv unsplit by default; its names are
  ///    `lora_unet_joint_blocks_0_x_block_attn_qkv`, ...);
  ///  - Stable Cascade stage C: attention.attn.to_q / to_k / to_v (the thirds
  ///    of the packed in_proj_weight, see PackedLinearHost) and
  ///    attention.attn.out_proj — OneTrainer's Stable Cascade LoRA targets
  ///    (module filter "attention") under kohya names with prefix
  ///    "lora_prior_unet".
  bool attention = true;
  /// Transformer feed-forward and projections: every Linear / 1x1 Conv2d under
  /// a path component `ff` or `mlp`, proj_in / proj_out, and MMDiT's
  /// per-stream adaLN_modulation.1 (under context_block / x_block; with
  /// `attention` this is kohya lora_sd3's default set for SD3). (kohya's
  /// networks.lora adapts these too; shoestring makes them opt-in.)
  bool feed_forward = false;
  /// conv_dim: rank of LoRA on the remaining Conv2d layers (ResBlock convs,
  /// resamplers; not conv_in / conv_out / input_blocks.0.0 / out.2). 0 = none.
  /// 1x1 convs in this group use `rank` / `alpha`, as kohya.
  int64_t conv_rank = 0;
  double conv_alpha = 1.0;  ///< conv_alpha
  /// dtype of the adapter weights.
  torch::Dtype dtype = torch::kFloat32;
  /// Device of the adapter weights (and of their random initialisation);
  /// unset: each layer's weight's. A run whose block weights stay in host
  /// memory (offload_params) makes them on its device, as without offloading.
  std::optional<c10::Device> device;
};

/// Applies kohya-style `network_args` ("key=value") to `base`: conv_dim,
/// conv_alpha, train_ff (shoestring's name for LoraOptions::feed_forward:
/// true/false). Throws shoestring::Error on an unknown key (listing the valid
/// ones), a malformed entry or a value out of range.
LoraOptions apply_network_args(LoraOptions base, const std::vector<std::string>& network_args);

/// One adapter: kohya's LoRAModule. Parameters lora_down.weight,
/// lora_up.weight; buffer alpha (0-d fp32). Created by LoraNetwork.
class LoraModuleImpl : public torch::nn::Module {
 public:
  /// Builds down (kaiming-uniform as kohya) and up (zeros) for `layer`, of
  /// `dtype`, on `device` (unset: the layer's weight's). alpha <= 0 means
  /// alpha = rank. Throws shoestring::Error if the layer is not adaptable or
  /// rank < 1.
  LoraModuleImpl(LoraLayerRef layer, int64_t rank, double alpha, double multiplier, torch::Dtype dtype,
                 std::optional<c10::Device> device = std::nullopt);
  ~LoraModuleImpl() override;

  /// multiplier * (alpha / rank) * up(down(x)), computed in x's dtype (the
  /// adapter weights are cast to it). x: the layer's input; returns the
  /// layer's output shape.
  torch::Tensor delta(const torch::Tensor& x);
  /// The equivalent weight change multiplier * alpha / rank * (up @ down), in
  /// fp32, shaped like the layer's weight: Linear [out, in]; Conv2d
  /// (up.view(out, r) @ down.view(r, in*k*k)).view(out, in, k, k).
  torch::Tensor delta_weight() const;

  /// Sets / clears the layer's adapter. attach() throws shoestring::Error if
  /// the layer already carries an adapter.
  void attach();
  void detach();
  bool attached() const { return attached_; }

  double scale() const { return alpha_ / static_cast<double>(rank_); }
  double alpha() const { return alpha_; }
  int64_t rank() const { return rank_; }
  double multiplier = 1.0;
  /// Sets alpha (and the alpha buffer); <= 0 means rank.
  void set_alpha(double alpha);

  const LoraLayerRef& layer() const { return layer_; }
  /// How often delta() ran since construction: 0 after a forward pass means
  /// the model bypasses this layer's forward() (e.g. uses its weight directly),
  /// so the adapter has no effect.
  int64_t calls() const { return calls_; }
  torch::Tensor& down() { return down_weight_; }
  torch::Tensor& up() { return up_weight_; }

 private:
  LoraLayerRef layer_;
  int64_t rank_;
  double alpha_;
  bool attached_ = false;
  int64_t calls_ = 0;
  std::shared_ptr<torch::nn::Module> lora_down_, lora_up_;
  torch::Tensor down_weight_, up_weight_, alpha_buffer_;
};
TORCH_MODULE(LoraModule);

/// Keys that did not match when loading a LoRA file.
struct LoraLoadReport {
  std::vector<std::string> missing;     ///< network keys absent from the file
  std::vector<std::string> unexpected;  ///< file keys the network does not have
};

/// The set of adapters of one model (kohya's LoRANetwork). Its submodules are
/// named by kohya name, so named_parameters() / named_buffers() are exactly
/// the file's keys ("<name>.lora_down.weight", ..., "<name>.alpha").
/// parameters() are the trainable tensors; base weights are untouched except
/// by merge().
class LoraNetworkImpl : public torch::nn::Module {
 public:
  /// Creates and attaches adapters on the layers that `options` selects
  /// (see LoraOptions) and that are adaptable; others are listed by
  /// not_adaptable(). Does not change requires_grad of the base model (see
  /// freeze_parameters()). Throws shoestring::Error on bad options (rank < 1,
  /// conv_rank < 0) or when no layer is selected.
  LoraNetworkImpl(torch::nn::Module& root, const std::vector<LoraComponent>& components, const LoraOptions& options);

  /// Creates adapters for exactly the modules in a kohya LoRA file (rank from
  /// lora_down's shape, alpha from `.alpha`, or rank when absent, as kohya),
  /// loads their weights (converted to `dtype`) and attaches them.
  /// Throws shoestring::Error naming the file and key for: a name that is not
  /// in the module tree (with the closest names), a layer that cannot be
  /// adapted, a key other than lora_down.weight / lora_up.weight / alpha, a
  /// module lacking lora_down or lora_up, shapes that do not fit the layer.
  static std::shared_ptr<LoraNetworkImpl> from_file(torch::nn::Module& root,
                                                    const std::vector<LoraComponent>& components,
                                                    const std::string& path, double multiplier = 1.0,
                                                    torch::Dtype dtype = torch::kFloat32);

  /// Saves every adapter as a kohya LoRA file (atomic, via save_safetensors).
  /// `dtype` converts the weights and alphas (kohya's save_precision); by
  /// default they are stored as they are. Metadata values are strings
  /// (ss_* keys, see kohya_lora_metadata()).
  void save(const std::string& path, const std::map<std::string, std::string>& metadata = {},
            std::optional<torch::Dtype> dtype = std::nullopt) const;

  /// Loads adapter weights and alphas saved by save() (or by kohya) into this
  /// network, bit-exact when dtypes match. Without `partial`, throws
  /// shoestring::Error listing the missing and unexpected keys (up to 20 of
  /// each, and the counts) if the key sets differ; with `partial`, loads the
  /// common keys and returns the differences. Shape mismatches and NaN / inf
  /// values (named by key) always throw.
  LoraLoadReport load(const std::string& path, bool partial = false);

  /// The checks of load() without loading: the file's keys (from its header
  /// only) against this network's, and the shapes and dtypes of lora_down /
  /// lora_up and alpha. Works on a network built over a meta-device model,
  /// so a run checks network_weights before any slow work. Throws as load().
  LoraLoadReport check_file(const std::string& path, bool partial = false) const;
  LoraLoadReport check_file(const SafetensorsFile& file, bool partial = false) const;

  /// Adds each adapter's delta_weight() into its layer's weight (computed in
  /// fp32, rounded once to the weight's dtype) and detaches every adapter:
  /// afterwards the plain model computes what the adapted one did.
  /// Returns the number of layers merged.
  int64_t merge();

  /// Detaches / re-attaches every adapter (the network keeps its weights).
  void detach();
  void attach();

  /// Sets the multiplier of every adapter.
  void set_multiplier(double multiplier);

  /// Adapters in creation (module-tree) order.
  const std::vector<std::shared_ptr<LoraModuleImpl>>& modules() const { return modules_; }
  /// The adapter with this kohya name, or nullptr.
  LoraModuleImpl* find(const std::string& kohya_name) const;
  /// kohya names of attached adapters whose delta() never ran: after a
  /// forward pass, these layers' forward() is bypassed by the model's code.
  std::vector<std::string> never_called() const;
  /// Selected layers that could not be adapted: "path (reason)".
  const std::vector<std::string>& not_adaptable() const { return not_adaptable_; }
  const KohyaNameTable& names() const { return table_; }
  const LoraOptions& options() const { return options_; }

 private:
  LoraNetworkImpl(torch::nn::Module& root, const std::vector<LoraComponent>& components);
  void add(const LoraLayerRef& layer, int64_t rank, double alpha, double multiplier, torch::Dtype dtype,
           std::optional<c10::Device> device = std::nullopt);

  KohyaNameTable table_;
  LoraOptions options_;
  std::vector<std::shared_ptr<LoraModuleImpl>> modules_;
  std::map<std::string, size_t> by_name_;
  std::vector<std::string> not_adaptable_;
};
TORCH_MODULE(LoraNetwork);

/// Loads a kohya LoRA file and merges it into `root`'s weights with
/// `multiplier` (W += multiplier * alpha / rank * up @ down). Throws as
/// LoraNetworkImpl::from_file. Returns the number of layers changed.
int64_t merge_lora_file(torch::nn::Module& root, const std::vector<LoraComponent>& components, const std::string& path,
                        double multiplier = 1.0);

/// Sets requires_grad(false) on every parameter of `module` (the base model
/// of a LoRA run). Returns the number of parameters frozen.
int64_t freeze_parameters(torch::nn::Module& module);

/// kohya's metadata for a networks.lora file, as strings: ss_network_module
/// ("networks.lora"), ss_network_dim, ss_network_alpha, ss_network_args (JSON
/// object of conv_dim / conv_alpha / train_ff when set), ss_base_model_version.
std::map<std::string, std::string> kohya_lora_metadata(const LoraOptions& options,
                                                       const std::string& base_model_version);

}  // namespace shoestring::nn
