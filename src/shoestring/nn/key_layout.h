// Parameter-name layouts of the building blocks, and registration of a
// submodule under a dotted path.
//
// The same block (ResBlock, Attention, ...) is stored under different key
// names by different checkpoint formats. A block takes a KeyLayout and
// registers its layers under that layout's names, so the module tree *is* the
// checkpoint's key tree (as stable-diffusion.cpp does) and no renaming is
// needed to load a released file. Conversions between formats live in
// io/key_map.h.
#pragma once
#include <memory>
#include <string>

#include <torch/nn/module.h>

namespace shoestring::nn {

/// Which checkpoint's key names a block registers its parameters under.
enum class KeyLayout {
  /// The engine's own short names (TinyUNet / CaptionEncoder checkpoints):
  /// ResBlock norm1/conv1/time_emb_proj/norm2/conv2/conv_shortcut, Attention
  /// to_out, FeedForward proj/out, SpatialTransformer blocks.<i>,
  /// TimestepEmbedding linear_1/linear_2.
  kShoestring,
  /// CompVis / Stability "LDM" single-file names (ldm/modules/diffusionmodules/
  /// openaimodel.py and ldm/modules/attention.py, as in the released SD 1.x /
  /// SDXL .safetensors): ResBlock in_layers.0, in_layers.2, emb_layers.1,
  /// out_layers.0, out_layers.3, skip_connection; Attention to_out.0;
  /// FeedForward net.0.proj, net.2; SpatialTransformer transformer_blocks.<i>;
  /// TimestepEmbedding 0 / 2 (inside time_embed / label_emb.0).
  kLdm,
  /// LDM first-stage (VAE) ResnetBlock names (ldm/modules/diffusionmodules/
  /// model.py): norm1, conv1, temb_proj, norm2, conv2, nin_shortcut.
  kLdmAutoencoder,
};

/// Registers `module` below `parent` under a dotted `path` ("in_layers.2",
/// "label_emb.0"), creating parameterless intermediate modules for the
/// leading components (or reusing ones registered earlier). libtorch forbids
/// dots in one child's name; nesting gives the same dotted named_parameters()
/// keys as PyTorch's nn.Sequential. Returns `module`.
/// Throws c10::Error if a component is empty or already names a leaf.
template <class ModuleHolder>
ModuleHolder register_at(torch::nn::Module& parent, const std::string& path, ModuleHolder module) {
  torch::nn::Module* current = &parent;
  size_t start = 0;
  for (size_t dot = path.find('.'); dot != std::string::npos; dot = path.find('.', start)) {
    const std::string part = path.substr(start, dot - start);
    std::shared_ptr<torch::nn::Module> child;
    for (const auto& item : current->named_children()) {
      if (item.key() == part) child = item.value();
    }
    if (!child) child = current->register_module(part, std::make_shared<torch::nn::Module>("Sequential"));
    current = child.get();
    start = dot + 1;
  }
  current->register_module(path.substr(start), module);
  return module;
}

}  // namespace shoestring::nn
