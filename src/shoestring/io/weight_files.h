// Model weight files as users download them: one `.safetensors` file, or a
// sharded set described by a Hugging Face `*.safetensors.index.json`
// ({"metadata": {...}, "weight_map": {"<tensor>": "<shard file>", ...}};
// format of huggingface_hub / transformers' sharded checkpoints), and loading
// them into a module by parameter name.
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include "shoestring/io/safetensors.h"

namespace shoestring {

/// A read-only, memory-mapped view of one weight file or of every shard of a
/// sharded checkpoint. Tensors are mapped lazily; nothing is read until get().
class WeightFiles {
 public:
  /// Opens `path`: a `.safetensors` file, or an index `.json` whose
  /// weight_map names shard files relative to the index's folder.
  /// Throws shoestring::Error naming the file for: unreadable files, invalid
  /// safetensors (see SafetensorsFile::open), an index that is not JSON or has
  /// no "weight_map" object of strings, a shard path that escapes the folder
  /// or does not exist, a tensor the index assigns to a shard that lacks it,
  /// and a tensor found in two shards.
  static WeightFiles open(const std::string& path);

  /// Path given to open().
  const std::string& path() const { return path_; }
  /// Every tensor name, sorted.
  std::vector<std::string> names() const;
  /// Entry of `name` (dtype, shape, byte range), or nullptr.
  const TensorInfo* find(const std::string& name) const;
  /// The shard file that holds `name` (path() for a single file).
  /// Throws shoestring::Error when absent.
  const std::string& file_of(const std::string& name) const;
  /// A read-only CPU view of `name` in its file dtype (see SafetensorsFile::get).
  /// Throws shoestring::Error naming the tensor and path when absent.
  at::Tensor get(const std::string& name) const;
  /// get(name) as values: an F8_E4M3 / F8_E5M2 tensor that this libtorch
  /// holds as its bit patterns (uint8, libtorch < 2.1) comes back decoded to
  /// bf16, which holds every fp8 value exactly (core/fp8.h); with a float8
  /// dtype (>= 2.1) and for every other dtype it is get(name). For code that
  /// copies or casts a file's tensors (final files, convert), so fp8 bytes are
  /// never written out as integers (U8). Throws as get().
  at::Tensor get_values(const std::string& name) const;
  /// "__metadata__" of the single file, or of the index's first shard merged
  /// with the index's own "metadata" strings.
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  /// Number of files mapped (1 for a single file).
  size_t file_count() const { return files_.size(); }
  /// Sum of the tensors' data sizes in bytes.
  uint64_t data_bytes() const;

 private:
  std::string path_;
  std::vector<SafetensorsFile> files_;
  std::map<std::string, size_t> owner_;  // tensor name -> index in files_
  std::map<std::string, std::string> metadata_;
};

/// How two sets of named tensor shapes differ: the model's expected set and a
/// file's. Lists are sorted.
struct KeyDiff {
  std::vector<std::string> missing;     ///< in the model, not in the file
  std::vector<std::string> unexpected;  ///< in the file, not in the model
  std::vector<std::string> mismatched;  ///< in both with other shapes: "name (file AxB, model CxD)"
  bool empty() const { return missing.empty() && unexpected.empty() && mismatched.empty(); }
  /// "missing keys: a, b, ... (N in all); unexpected keys: none; shape mismatches: ..."
  /// (at most `limit` names per list).
  std::string describe(size_t limit = 8) const;
};

/// Compares expected name -> shape with found name -> shape.
KeyDiff diff_keys(const std::map<std::string, std::vector<int64_t>>& expected,
                  const std::map<std::string, std::vector<int64_t>>& found);

/// Throws shoestring::Error naming `file`, tensor `key`, how many values are
/// NaN / inf and the first one's flat index, when floating tensor `t` holds
/// any; `converted_to` names the dtype the values overflowed in after a
/// conversion ("" = the file's own values). Non-floating tensors pass.
void require_finite(const at::Tensor& t, const std::string& file, const std::string& key,
                    const std::string& converted_to = "");

/// Options of load_weights().
struct LoadWeightsOptions {
  /// Maps a file key to the module's name for it ("" = skip the key). Default:
  /// identity. Used for key-layout conversion (e.g. diffusers -> LDM).
  std::function<std::string(const std::string&)> key_map;
  /// Load what matches and report the rest instead of failing (missing
  /// parameters keep their current values). Shape mismatches always fail.
  bool allow_partial = false;
  /// Refuse parameters holding NaN / inf, in the file or after conversion to
  /// the parameter's dtype (buffers are not checked: some hold -inf masks).
  bool require_finite = true;
};

/// What load_weights() did.
struct LoadWeightsReport {
  int64_t loaded = 0;        ///< tensors copied
  int64_t loaded_bytes = 0;  ///< bytes of the module's tensors written
  KeyDiff diff;              ///< missing / unexpected (non-empty only with allow_partial)
};

/// Copies every matching tensor of `files` into `module`'s parameters and
/// buffers (converted to each target's dtype; targets must be allocated, not
/// meta), one tensor at a time, so peak extra memory is one tensor.
/// F8_E4M3 / F8_E5M2 tensors convert to the targets' float dtype by their
/// published values on every libtorch (native float8 casts on >= 2.1; the
/// bit patterns decoded by fp8_decode_tensor, core/fp8.h, on 1.13), so an
/// fp8 pretrained file (kohya's and ComfyUI's fp8 checkpoints) can be a base.
/// Parameters are checked for NaN / inf (see require_finite) in the same pass.
/// Throws shoestring::Error naming `files.path()` and listing missing,
/// unexpected and mis-shaped keys (unless allow_partial: then only shape
/// mismatches fail, and the report lists the rest), or naming a tensor
/// holding NaN / inf and how many.
LoadWeightsReport load_weights(torch::nn::Module& module, const WeightFiles& files,
                               const LoadWeightsOptions& options = {});

}  // namespace shoestring
