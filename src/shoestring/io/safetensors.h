// safetensors: our own reader (memory-mapped, validated, zero-copy) and
// writer (atomic, 8-byte aligned) for the format defined by
// https://github.com/huggingface/safetensors:
//
//   [u64 little-endian N][N bytes of UTF-8 JSON header][data buffer]
//
// The header maps each tensor name to {"dtype", "shape", "data_offsets":
// [begin, end]} (byte offsets relative to the start of the data buffer) and
// may hold "__metadata__", a string -> string map. The tensors must cover the
// data buffer exactly, without overlaps or holes.
//
// Byte order: the format is little-endian; shoestring only builds on
// little-endian machines (checked at compile time in safetensors.cpp), so
// tensor bytes are used as they are in the file.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <ATen/core/Tensor.h>

namespace shoestring {

/// Element types of the safetensors format (the subset shoestring reads and
/// writes; names as in the format's "dtype" field).
enum class StDtype { F64, F32, F16, BF16, F8_E4M3, F8_E5M2, I64, I32, I16, I8, U8, BOOL };

/// The format's name for `d`: "F64", "F32", "F16", "BF16", "F8_E4M3",
/// "F8_E5M2", "I64", "I32", "I16", "I8", "U8", "BOOL".
const char* to_string(StDtype d);

/// Parses a format dtype name (exact, case-sensitive, as written by to_string).
/// Throws shoestring::Error "<context>: unknown dtype '<s>' (expected one of ...)".
StDtype st_dtype_from_string(const std::string& s, const std::string& context);

/// Size of one element of `d` in bytes (1, 2, 4 or 8).
int64_t element_size(StDtype d);

/// libtorch dtype used to hold tensors of `d`. F8_E4M3 / F8_E5M2 map to
/// at::kFloat8_e4m3fn / at::kFloat8_e5m2 when libtorch has them
/// (SHOESTRING_HAS_FLOAT8, libtorch >= 2.1); otherwise to at::kByte, carrying
/// the raw 8-bit patterns.
at::ScalarType to_scalar_type(StDtype d);

/// Format dtype for a libtorch dtype (at::kByte -> U8, at::kBool -> BOOL, ...).
/// Throws shoestring::Error for dtypes the format does not have (complex,
/// quantized, uint16+ on new libtorch, ...).
StDtype st_dtype_of(at::ScalarType t);

/// One tensor entry of a safetensors header. Offsets are bytes relative to the
/// start of the data buffer; `end - begin == numel() * element_size(dtype)`.
struct TensorInfo {
  std::string name;
  StDtype dtype;
  std::vector<int64_t> shape;  ///< empty for 0-d (scalar) tensors
  uint64_t begin = 0;
  uint64_t end = 0;

  /// Number of elements (product of shape; 1 for a 0-d tensor).
  int64_t numel() const;
  /// Size of the tensor's data in bytes (end - begin).
  uint64_t nbytes() const { return end - begin; }
};

/// A memory-mapped, validated safetensors file.
///
/// open() maps the whole file (POSIX mmap, PROT_READ, MAP_PRIVATE), parses
/// and validates the header; nothing is read from the data buffer until a
/// tensor is requested. Copies of a SafetensorsFile share the mapping.
///
/// Tensors returned by get() are zero-copy views of the mapping whenever the
/// data is aligned to the element size (they keep the mapping alive through
/// the tensor's deleter, so they may outlive this object). The mapping is
/// read-only: writing into such a tensor (in-place ops) faults. Clone the
/// tensor, or use load_safetensors(), to get memory you can modify.
class SafetensorsFile {
 public:
  /// Maps and validates `path`. Throws shoestring::Error whose message names
  /// the path and the rule broken (and the tensor where relevant):
  /// file shorter than 8 bytes; header length above 100,000,000 bytes (the
  /// limit of the reference implementation) or past the end of the file;
  /// header not starting with '{' (the format requires it; trailing spaces
  /// are allowed), nesting objects / arrays deeper than 8 levels (a header
  /// needs 3) or holding an array of more than 1024 elements (both checked
  /// before the header is built in memory), header not valid JSON / not an
  /// object; an entry not an object; missing or
  /// wrong-typed "dtype", "shape", "data_offsets"; negative dimensions;
  /// "__metadata__" not a string -> string object; unknown dtype; byte size
  /// not matching shape and dtype; duplicate tensor names (or duplicate keys
  /// anywhere in the header); data offsets that overlap, leave holes, run past
  /// the end of the file, or leave unused bytes at the end of the buffer.
  /// Time and memory are linear in the header size (bench/safetensors_open).
  static SafetensorsFile open(const std::string& path);

  /// Path as given to open().
  const std::string& path() const;
  /// All tensors, in data-buffer order (sorted by begin offset).
  const std::vector<TensorInfo>& tensors() const;
  /// Tensor entry by name, or nullptr if the file has no such tensor.
  const TensorInfo* find(const std::string& name) const;
  /// The "__metadata__" map (empty if the file has none).
  const std::map<std::string, std::string>& metadata() const;

  /// Size of the whole file in bytes.
  uint64_t file_size() const;
  /// Length N of the JSON header in bytes (the data buffer starts at 8 + N).
  uint64_t header_size() const;
  /// Size of the data buffer in bytes (file_size() - 8 - header_size()).
  uint64_t data_size() const;

  /// The raw little-endian bytes of a tensor inside the mapping (valid while
  /// this object or a tensor from get() is alive).
  std::string_view bytes(const TensorInfo& info) const;

  /// The tensor `name` on the CPU, with shape info.shape and dtype
  /// to_scalar_type(info.dtype). A zero-copy view when the data is aligned to
  /// its element size, otherwise an (aligned) copy. Read-only (see above).
  /// Throws shoestring::Error naming the tensor and the file if absent, or if
  /// a BOOL tensor holds bytes other than 0 and 1.
  at::Tensor get(const std::string& name) const;
  /// Same as get(info.name), for an entry of tensors().
  at::Tensor get(const TensorInfo& info) const;

 private:
  struct State;
  explicit SafetensorsFile(std::shared_ptr<const State> s);
  std::shared_ptr<const State> s_;
};

/// A tensor to save. `dtype` overrides the stored dtype; it must have the same
/// byte size as the tensor's elements (used to store raw uint8 bytes as
/// F8_E4M3 / F8_E5M2 on libtorch without float8).
struct NamedTensor {
  std::string name;
  at::Tensor tensor;
  std::optional<StDtype> dtype;
  /// Convert to this dtype while writing (one tensor at a time, so saving a
  /// memory-mapped fp32 model as bf16 never holds a converted copy of it all).
  std::optional<at::ScalarType> cast = std::nullopt;
};

/// Writes a safetensors file atomically (via write_file_atomic).
/// Tensors may be on any device and non-contiguous; each is copied to the CPU
/// (one at a time, while writing) and written contiguous. The data buffer is laid out by decreasing element
/// size (stable, otherwise in the given order), like the reference
/// implementation, so that each tensor is aligned to its element size; the
/// header JSON is padded with spaces so that 8 + N is a multiple of 8.
/// Throws shoestring::Error naming the path and tensor for: an empty name, the
/// reserved name "__metadata__", duplicate names, an unsupported dtype, or a
/// byte size (numel * element size) that does not match the declared dtype;
/// and whatever write_file_atomic throws.
void save_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

/// Loads every tensor of a safetensors file into memory (owned copies, CPU),
/// as name -> tensor. Convenience for small files; throws as
/// SafetensorsFile::open.
std::map<std::string, at::Tensor> load_safetensors(const std::string& path);

}  // namespace shoestring
