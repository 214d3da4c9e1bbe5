#include "shoestring/optim/quantization.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "shoestring/core/error.h"

namespace shoestring {

std::vector<float> create_dynamic_map(bool is_signed, int max_exponent_bits, int total_bits) {
  if (total_bits < 2 || total_bits > 8 || max_exponent_bits < 1 || max_exponent_bits >= total_bits) {
    fail(
        "create_dynamic_map: need 1 <= max_exponent_bits < total_bits <= 8 (got max_exponent_bits={}, "
        "total_bits={})",
        max_exponent_bits, total_bits);
  }
  // One bit is the sign (signed) or one more fraction bit (unsigned); as in
  // bitsandbytes, the non-sign bits number total_bits - 1 in both cases.
  const int non_sign_bits = total_bits - 1;
  // float32 arithmetic like the reference (float32 linspace boundaries and means).
  std::vector<float> data;
  auto add_means = [&](int64_t items, double scale) {
    for (int64_t k = 0; k < items; ++k) {
      // midpoint of bin k of [0.1, 1] cut into `items` equal bins
      const auto lo = static_cast<float>(0.1 + 0.9 * static_cast<double>(k) / static_cast<double>(items));
      const auto hi = static_cast<float>(0.1 + 0.9 * static_cast<double>(k + 1) / static_cast<double>(items));
      const float mean = (lo + hi) / 2.0f;
      const auto value = static_cast<float>(mean * scale);
      data.push_back(value);
      if (is_signed) data.push_back(-value);
    }
  };
  const int64_t additional_items = (int64_t{1} << (non_sign_bits - max_exponent_bits)) - 1;
  for (int i = 0; i < max_exponent_bits; ++i) {
    const int64_t items = int64_t{1} << (i + non_sign_bits - max_exponent_bits + (is_signed ? 0 : 1));
    add_means(items, std::pow(10.0, i - (max_exponent_bits - 1)));
  }
  if (additional_items > 0) add_means(additional_items, 1.0);
  data.push_back(0.0f);
  data.push_back(1.0f);
  const size_t expected = size_t{1} << total_bits;
  if (data.size() != expected) {
    fail("create_dynamic_map: construction gave {} values, expected {}", data.size(), expected);
  }
  std::sort(data.begin(), data.end());
  return data;
}

QuantizationMap::QuantizationMap(const std::vector<float>& values) {
  if (values.size() != 256) fail("QuantizationMap: expected 256 values, got {}", values.size());
  for (size_t i = 0; i < 256; ++i) {
    if (!std::isfinite(values[i])) fail("QuantizationMap: value {} is not finite", i);
    if (i > 0 && !(values[i - 1] < values[i])) {
      fail("QuantizationMap: values must be distinct and sorted ascending (index {}: {} after {})", i, values[i],
           values[i - 1]);
    }
    values_[i] = values[i];
    padded_[i] = values[i];
  }
  padded_[256] = std::numeric_limits<float>::quiet_NaN();  // compares false: encode stops at 256
  // For every bucket of floats sharing their top (32 - kBucketShift) bits:
  // the first map index whose value is >= the bucket's smallest float, and
  // the number of map values inside the bucket (the steps encode() may need).
  const uint32_t buckets = uint32_t{1} << (32 - kBucketShift);
  bucket_start_.resize(buckets);
  auto to_float = [](uint32_t b) {
    float f;
    std::memcpy(&f, &b, sizeof(f));
    return f;
  };
  for (uint32_t b = 0; b < buckets; ++b) {
    const uint32_t first = b << kBucketShift;
    const uint32_t last = first | ((uint32_t{1} << kBucketShift) - 1);
    const bool negative = (first >> 31) != 0;
    float lo = negative ? to_float(last) : to_float(first);
    float hi = negative ? to_float(first) : to_float(last);
    // exponent 255: +-inf and NaNs; NaN never reaches the table
    if (std::isnan(lo) && std::isnan(hi)) {
      bucket_start_[b] = 0;
      continue;
    }
    if (std::isnan(lo)) lo = -std::numeric_limits<float>::infinity();
    if (std::isnan(hi)) hi = std::numeric_limits<float>::infinity();
    const auto begin = std::lower_bound(values_.begin(), values_.end(), lo);
    const auto end = std::upper_bound(values_.begin(), values_.end(), hi);
    bucket_start_[b] = static_cast<uint16_t>(begin - values_.begin());
    max_steps_ = std::max(max_steps_, static_cast<int>(end - begin));
  }
  zero_code_ = encode_by_search(0.0f);
  build_fast_table();
}

void QuantizationMap::build_fast_table() {
  auto to_float = [](uint32_t b) {
    float f;
    std::memcpy(&f, &b, sizeof(f));
    return f;
  };
  std::vector<uint32_t> table(2 * kFastSignStride);
  for (uint32_t sign = 0; sign < 2; ++sign) {
    const uint32_t s = sign << 31;
    // The clamps must not change the code: constant on [0, 2^-23] and on
    // [1, inf] in magnitude (encode is monotone, so the ends suffice).
    if (encode_by_search(to_float(s)) != encode_by_search(to_float(s | kFastMinBits)) ||
        encode_by_search(to_float(s | kFastMaxBits)) != encode_by_search(to_float(s | 0x7F800000u))) {
      return;
    }
    for (uint32_t k = 0; k < kFastSignStride; ++k) {
      const uint32_t high = s | (kFastMinBits + (k << 16));
      auto code_at = [&](uint32_t low) { return static_cast<int>(encode_by_search(to_float(high | low))); };
      const int lo = code_at(0);
      const int hi = code_at(0xFFFFu);
      if (std::abs(hi - lo) > 1) return;  // two thresholds in one bucket: keep the search
      uint32_t t = 0;
      if (hi != lo) {
        // first low half with the code of the bucket's top (monotone in low)
        uint32_t a = 1, b = 0xFFFFu;
        while (a < b) {
          const uint32_t mid = a + (b - a) / 2;
          if (code_at(mid) == hi) {
            b = mid;
          } else {
            a = mid + 1;
          }
        }
        t = a;
      }
      table[sign * kFastSignStride + k] = (static_cast<uint32_t>(hi) << 24) | (static_cast<uint32_t>(lo) << 16) | t;
    }
  }
  fast_table_ = std::move(table);
}

const QuantizationMap& signed_dynamic_map() {
  static const QuantizationMap map(create_dynamic_map(true, 7, 8));
  return map;
}

const QuantizationMap& unsigned_dynamic_map() {
  static const QuantizationMap map(create_dynamic_map(false, 7, 8));
  return map;
}

void quantize_block(const float* x, int64_t n, const QuantizationMap& map, uint8_t* codes, float* absmax) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  *absmax = amax;
  if (amax == 0.0f) {
    const uint8_t zero = map.encode(0.0f);
    std::fill(codes, codes + n, zero);
    return;
  }
  const float inv = 1.0f / amax;
  for (int64_t i = 0; i < n; ++i) codes[i] = map.encode(x[i] * inv);
}

namespace {

// The map's 256 values as a float32 tensor on `device`.
at::Tensor map_values(const QuantizationMap& map, const c10::Device& device) {
  const auto& v = map.values();
  return at::tensor(c10::ArrayRef<float>(v.data(), v.size()), at::TensorOptions().dtype(at::kFloat)).to(device);
}

// absmax per block broadcast back to the elements: [n].
at::Tensor per_element(const at::Tensor& absmax, int64_t n, int64_t block_size) {
  return absmax.repeat_interleave(block_size).narrow(0, 0, n);
}

}  // namespace

BlockwiseQuantized quantize_blockwise_generic(const at::Tensor& x_in, const QuantizationMap& map, int64_t block_size) {
  if (block_size < 1) fail("quantize_blockwise: block_size must be >= 1, got {}", block_size);
  const at::Tensor x = x_in.contiguous().view({-1});
  const int64_t n = x.numel();
  const int64_t blocks = (n + block_size - 1) / block_size;
  BlockwiseQuantized out;
  if (n == 0) {
    out.codes = at::empty(x_in.sizes(), x.options().dtype(at::kByte));
    out.absmax = at::empty({0}, x.options());
    return out;
  }
  // [blocks, block_size], the short last block padded with zeros (|0| never raises a max).
  const at::Tensor padded = at::constant_pad_nd(x, {0, blocks * block_size - n}, 0).view({blocks, block_size});
  out.absmax = padded.abs().amax(1);  // [blocks]
  const at::Tensor amax = per_element(out.absmax, n, block_size);
  const at::Tensor inv = at::ones_like(amax).div_(amax);  // 1.0f / absmax, as quantize_block
  const at::Tensor scaled = x * inv;                      // [n]
  // encode_by_search: i = #values <= x, then the nearer of values[i-1], values[i] (ties: lower).
  const at::Tensor values = map_values(map, x.device());
  const at::Tensor i = at::searchsorted(values, scaled, /*out_int32=*/false, /*right=*/true);
  const at::Tensor lo_index = (i - 1).clamp_(0, 255);
  const at::Tensor hi_index = i.clamp(0, 255);
  const at::Tensor xd = scaled.to(at::kDouble);
  const at::Tensor lo = values.index_select(0, lo_index).to(at::kDouble);
  const at::Tensor hi = values.index_select(0, hi_index).to(at::kDouble);
  at::Tensor code = at::where((xd - lo).le(hi - xd), lo_index, hi_index);
  code = at::where(i.eq(0), at::zeros_like(code), code);
  code = at::where(i.eq(256), at::full_like(code, 255), code);
  // NaN (an all-zero block's 0 * inf) and zero blocks: the code nearest 0.
  code = at::where(amax.eq(0).logical_or(scaled.isnan()), at::full_like(code, map.zero_code()), code);
  out.codes = code.to(at::kByte).view(x_in.sizes());
  return out;
}

at::Tensor dequantize_blockwise_generic(const at::Tensor& codes_in, const at::Tensor& absmax_in,
                                        const QuantizationMap& map, int64_t block_size) {
  if (block_size < 1) fail("dequantize_blockwise: block_size must be >= 1, got {}", block_size);
  const int64_t n = codes_in.numel();
  const at::Tensor codes = codes_in.contiguous().view({-1});
  const at::Tensor values = map_values(map, codes.device());
  const at::Tensor decoded = values.index_select(0, codes.to(at::kLong));
  return decoded.mul_(per_element(absmax_in.contiguous().view({-1}), n, block_size)).view(codes_in.sizes());
}

BlockwiseQuantized quantize_blockwise(const at::Tensor& x_in, const QuantizationMap& map, int64_t block_size) {
  if (block_size < 1) fail("quantize_blockwise: block_size must be >= 1, got {}", block_size);
  if (!x_in.defined() || x_in.scalar_type() != at::kFloat) {
    fail("quantize_blockwise: expected a float32 tensor");
  }
  if (!at::isfinite(x_in).all().item<bool>()) fail("quantize_blockwise: input holds non-finite values");
  if (!x_in.device().is_cpu()) return quantize_blockwise_generic(x_in, map, block_size);
  const at::Tensor x = x_in.contiguous();
  const int64_t n = x.numel();
  const int64_t blocks = (n + block_size - 1) / block_size;
  BlockwiseQuantized out;
  out.codes = at::empty(x.sizes(), x.options().dtype(at::kByte));
  out.absmax = at::empty({blocks}, x.options());
  const float* src = x.data_ptr<float>();
  uint8_t* codes = out.codes.data_ptr<uint8_t>();
  float* amax = out.absmax.data_ptr<float>();
  at::parallel_for(0, blocks, 64, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t start = b * block_size;
      quantize_block(src + start, std::min(block_size, n - start), map, codes + start, amax + b);
    }
  });
  return out;
}

at::Tensor dequantize_blockwise(const at::Tensor& codes_in, const at::Tensor& absmax_in, const QuantizationMap& map,
                                int64_t block_size) {
  if (block_size < 1) fail("dequantize_blockwise: block_size must be >= 1, got {}", block_size);
  if (!codes_in.defined() || codes_in.scalar_type() != at::kByte) {
    fail("dequantize_blockwise: codes must be a uint8 tensor");
  }
  const int64_t n = codes_in.numel();
  const int64_t blocks = (n + block_size - 1) / block_size;
  if (!absmax_in.defined() || absmax_in.scalar_type() != at::kFloat || absmax_in.numel() != blocks) {
    fail("dequantize_blockwise: absmax must be float32 with {} elements (one per block of {})", blocks, block_size);
  }
  if (absmax_in.device() != codes_in.device()) {
    fail("dequantize_blockwise: absmax is on {} but codes on {}", absmax_in.device().str(), codes_in.device().str());
  }
  if (!codes_in.device().is_cpu()) return dequantize_blockwise_generic(codes_in, absmax_in, map, block_size);
  const at::Tensor codes = codes_in.contiguous();
  const at::Tensor absmax = absmax_in.contiguous();
  at::Tensor out = at::empty(codes.sizes(), codes.options().dtype(at::kFloat));
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const float* a = absmax.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, blocks, 64, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t start = b * block_size;
      dequantize_block(c + start, std::min(block_size, n - start), a[b], map, dst + start);
    }
  });
  return out;
}

}  // namespace shoestring
