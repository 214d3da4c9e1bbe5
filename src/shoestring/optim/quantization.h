// 8-bit dynamic (tree) quantization and block-wise quantize / dequantize, the
// state compression of 8-bit optimizers.
//
// Source: Dettmers et al. 2021, "8-bit Optimizers via Block-wise
// Quantization" (arXiv 2110.02861), as bitsandbytes implements it:
// create_dynamic_map(signed, max_exponent_bits=7, total_bits=8) gives 256
// sorted code values in [-1, 1] (signed) or [0, 1] (unsigned) spread over
// seven decades (10^0 .. 10^-6); a tensor is cut into blocks of 256 elements,
// each block stores its absolute maximum (fp32) and every element stores the
// index of the map value nearest to x / absmax.
// Reference values: scripts/gen_dynamic_map.py -> tests/data/optim/dynamic_map.json.
#pragma once
#include <array>
#include <cstdint>
#include <cstring>
#include <vector>

#include <ATen/core/Tensor.h>

namespace shoestring {

/// Builds the dynamic quantization map exactly as bitsandbytes'
/// create_dynamic_map documents it: for exponent i in 0..max_exponent_bits-1,
/// the midpoints of [0.1, 1] cut into 2^i (signed) or 2^(i+1) (unsigned)
/// equal bins, scaled by 10^(i - max_exponent_bits + 1) (and negated too when
/// signed); then 0 and 1.0. Returns 2^total_bits float32 values sorted
/// ascending (signed 8-bit: min -0.99296875, includes 0, max 1.0).
/// Throws shoestring::Error unless 1 <= max_exponent_bits < total_bits <= 8
/// and the construction yields exactly 2^total_bits values.
std::vector<float> create_dynamic_map(bool is_signed, int max_exponent_bits = 7, int total_bits = 8);

/// A sorted 256-entry code book with nearest-value encoding.
class QuantizationMap {
 public:
  /// `values`: 256 distinct float32 values sorted ascending. Throws
  /// shoestring::Error otherwise.
  explicit QuantizationMap(const std::vector<float>& values);

  /// Index of the map value nearest to x (exact distance; ties go to the
  /// lower index; values outside the map's range clamp to its ends; NaN gives
  /// the index of the value nearest 0).
  /// Maps whose decision thresholds (midpoints between neighbours) are sparse
  /// enough (the dynamic maps; see fast_table()) encode with one table load:
  /// encode_with_table(). Other maps: a 16K-entry table indexed by the top 14
  /// bits of x gives the first map value at or above x's bucket, then at most
  /// max_steps_ branch-free steps find the pair of map values around x.
  uint8_t encode(float x) const {
    return fast_table_.empty() ? encode_by_search(x) : encode_with_table(fast_table_.data(), x, zero_code_);
  }
  /// The map value of `code`.
  float decode(uint8_t code) const { return values_[code]; }
  const std::array<float, 256>& values() const { return values_; }
  /// encode(0.0f): the code of the value nearest 0 (also NaN's code).
  uint8_t zero_code() const { return zero_code_; }

  // ---- one-load encoding ----------------------------------------------------
  // encode(x) is a non-decreasing step function of x with 255 thresholds.
  // |x| is clamped to [2^-23, 1] (kFastMinBits, kFastMaxBits: the code is
  // constant below 2^-23 and above 1 for the maps that get a table), then the
  // sign, exponent and top 7 mantissa bits of the clamped value pick a bucket
  // (kFastSignStride buckets per sign). Every bucket holds at most one
  // threshold, so one 32-bit entry describes it:
  //   bits 0-15: the low 16 bits of the threshold (0 if none); bits 16-23:
  //   the code below it; bits 24-31: the code at and above it
  // (in the order of the low 16 bits of |x|, i.e. of the magnitude).
  static constexpr uint32_t kFastMinBits = 0x34000000u;  // 2^-23
  static constexpr uint32_t kFastMaxBits = 0x3F800000u;  // 1.0
  static constexpr uint32_t kFastSignStride = ((kFastMaxBits - kFastMinBits) >> 16) + 1;

  /// The one-load table (2 * kFastSignStride entries), or nullptr when this
  /// map's thresholds are too dense (or lie outside [2^-23, 1] in magnitude)
  /// for it; then encode() searches.
  const uint32_t* fast_table() const { return fast_table_.empty() ? nullptr : fast_table_.data(); }

  /// encode(x) through a fast_table() (`zero_code` = zero_code()).
  static uint8_t encode_with_table(const uint32_t* table, float x, uint8_t zero_code) {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof(bits));
    uint32_t mag = bits & 0x7FFFFFFFu;
    if (mag > 0x7F800000u) return zero_code;  // NaN
    mag = mag < kFastMinBits ? kFastMinBits : (mag > kFastMaxBits ? kFastMaxBits : mag);
    const uint32_t entry = table[(bits >> 31) * kFastSignStride + ((mag - kFastMinBits) >> 16)];
    return static_cast<uint8_t>((mag & 0xFFFFu) >= (entry & 0xFFFFu) ? entry >> 24 : (entry >> 16) & 0xFFu);
  }

  /// The search encode (any map); equals encode(). For tests and table building.
  uint8_t encode_by_search(float x) const {
    if (!(x == x)) return zero_code_;
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof(bits));
    int i = bucket_start_[bits >> kBucketShift];
    for (int k = 0; k < max_steps_; ++k) i += (padded_[i] <= x) ? 1 : 0;  // padded_[256] = NaN
    // now values_[i - 1] <= x < values_[i] (i = 256: x >= the last value)
    if (i == 0) return 0;
    if (i == 256) return 255;
    // Distances in double: exact for neighbouring floats, so ties are true ties.
    const double xd = x;
    return (xd - padded_[i - 1] <= padded_[i] - xd) ? static_cast<uint8_t>(i - 1) : static_cast<uint8_t>(i);
  }

 private:
  void build_fast_table();
  static constexpr int kBucketShift = 18;
  std::array<float, 256> values_{};
  std::array<float, 257> padded_{};     // values_ then NaN
  std::vector<uint16_t> bucket_start_;  // [1 << (32 - kBucketShift)]
  std::vector<uint32_t> fast_table_;    // [2 * kFastSignStride] or empty
  int max_steps_ = 0;
  uint8_t zero_code_ = 0;
};

/// The signed 8-bit dynamic map (create_dynamic_map(true, 7, 8)), built once.
const QuantizationMap& signed_dynamic_map();
/// The unsigned 8-bit dynamic map (create_dynamic_map(false, 7, 8)), built once.
const QuantizationMap& unsigned_dynamic_map();

/// Block size of bitsandbytes' block-wise 8-bit optimizers (elements).
constexpr int64_t kQuantizationBlockSize = 256;

/// Quantizes one block: absmax <- max |x[i]|; codes[i] <- map.encode(x[i] / absmax).
/// An all-zero block gets absmax 0 and the code of the value nearest 0.
/// x: n finite floats (non-finite input gives unspecified codes; callers keep
/// state finite). No allocation.
void quantize_block(const float* x, int64_t n, const QuantizationMap& map, uint8_t* codes, float* absmax);

/// Dequantizes one block: x[i] <- map.decode(codes[i]) * absmax. No allocation.
inline void dequantize_block(const uint8_t* codes, int64_t n, float absmax, const QuantizationMap& map, float* x) {
  for (int64_t i = 0; i < n; ++i) x[i] = map.decode(codes[i]) * absmax;
}

/// Result of quantize_blockwise.
struct BlockwiseQuantized {
  at::Tensor codes;   ///< uint8, same shape as the input
  at::Tensor absmax;  ///< float32 [ceil(numel / block_size)]
};

/// Block-wise quantization of a float32 tensor (any shape; blocks run over
/// the row-major flattening, the last block may be short). CPU tensors: blocks
/// are processed in parallel (at::parallel_for); other devices take
/// quantize_blockwise_generic (the same codes and absmax). Results are on x's
/// device. Throws shoestring::Error if x is not float32, holds a non-finite
/// value, or block_size < 1.
BlockwiseQuantized quantize_blockwise(const at::Tensor& x, const QuantizationMap& map,
                                      int64_t block_size = kQuantizationBlockSize);

/// Inverse of quantize_blockwise: float32 tensor with the shape of `codes`,
/// on its device (non-CPU tensors: dequantize_blockwise_generic). Throws
/// shoestring::Error if codes is not uint8, absmax not float32 with
/// ceil(numel / block_size) elements on codes' device, or block_size < 1.
at::Tensor dequantize_blockwise(const at::Tensor& codes, const at::Tensor& absmax, const QuantizationMap& map,
                                int64_t block_size = kQuantizationBlockSize);

/// quantize_blockwise built from ATen ops (any device): per block absmax =
/// max |x| (amax over a zero-padded [blocks, block_size] view), codes = the
/// map value nearest to x * (1 / absmax) by a binary search of the map
/// (searchsorted) and the same double-precision distance comparison as
/// QuantizationMap::encode (ties to the lower code; an all-zero block gets
/// zero_code()). The same bits as the CPU path. x must be finite (not
/// checked here; quantize_blockwise checks).
BlockwiseQuantized quantize_blockwise_generic(const at::Tensor& x, const QuantizationMap& map, int64_t block_size);

/// dequantize_blockwise built from ATen ops (any device): map value of each
/// code (a gather) times its block's absmax, in fp32. The same bits as the CPU
/// path.
at::Tensor dequantize_blockwise_generic(const at::Tensor& codes, const at::Tensor& absmax, const QuantizationMap& map,
                                        int64_t block_size);

}  // namespace shoestring
