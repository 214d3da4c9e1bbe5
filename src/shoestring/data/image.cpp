// Image decoding/encoding with stb (Debian's libstb holds the implementations),
// grids and the built-in bitmap font. See image.h.
#include "shoestring/data/image.h"

#include <cctype>
#include <cstring>
#include <memory>

#include <stb_image.h>
#include <stb_image_resize.h>
#include <stb_image_write.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/io/atomic_file.h"

namespace shoestring {
namespace {

constexpr int kMaxResolution = 16384;

/// Returns image as a uint8 [H, W, 3] view (no copy), accepting HWC or CHW.
at::Tensor as_hwc(const at::Tensor& image, const std::string& what) {
  if (!image.defined() || image.scalar_type() != at::kByte || image.dim() != 3) {
    fail("{}: expected a uint8 image [H, W, 3] or [3, H, W], got {}", what,
         image.defined()
             ? fmt::format("{} {}", std::string(c10::toString(image.scalar_type())), fmt::join(image.sizes(), "x"))
             : std::string("an undefined tensor"));
  }
  if (image.size(0) == 3) return image.permute({1, 2, 0});
  if (image.size(2) == 3) return image;
  fail("{}: expected a uint8 image [H, W, 3] or [3, H, W], got shape [{}]", what, fmt::join(image.sizes(), ", "));
}

// The file's pixels as 8-bit RGBA (w x h), freed with stb's allocator.
using RgbaPixels = std::unique_ptr<stbi_uc, void (*)(void*)>;

// Why stb_image could not read `bytes`: its own reason, except for a PNG
// whose header gives a size over stb's limit (2^30 bytes of decoded pixels),
// for which stb tries every other format after the PNG reader's "too large"
// and reports "unknown image type".
std::string stb_failure(std::string_view bytes, const char* fallback) {
  static constexpr unsigned char kPng[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};
  if (bytes.size() >= 24 && std::memcmp(bytes.data(), kPng, 8) == 0 && bytes.substr(12, 4) == "IHDR") {
    const auto be32 = [&](size_t at) {
      uint32_t v = 0;
      for (size_t i = 0; i < 4; ++i) v = (v << 8) | static_cast<unsigned char>(bytes[at + i]);
      return v;
    };
    const uint64_t w = be32(16), h = be32(20);
    if (w * h * 4 > (uint64_t{1} << 30)) {
      return fmt::format(
          "a {}x{} PNG is larger than stb_image decodes (at most 2^30 bytes of pixels, e.g. 16384x16384 RGBA); "
          "downscale it",
          w, h);
    }
  }
  const char* reason = stbi_failure_reason();
  return (reason && *reason) ? reason : fallback;
}

// Decodes `bytes` (PNG, JPEG, ... as stb_image reads them) to RGBA; sets w, h.
// Throws shoestring::Error naming `name` for files over 2 GiB and for what
// stb cannot decode (with its reason).
RgbaPixels decode_rgba(std::string_view bytes, const std::string& name, int& w, int& h) {
  if (bytes.size() > static_cast<size_t>(std::numeric_limits<int>::max())) {
    fail("image {}: file too large ({} bytes)", name, bytes.size());
  }
  int channels_in_file = 0;
  RgbaPixels rgba(stbi_load_from_memory(reinterpret_cast<const stbi_uc*>(bytes.data()), static_cast<int>(bytes.size()),
                                        &w, &h, &channels_in_file, 4),
                  &stbi_image_free);
  if (!rgba)
    fail("cannot decode image {}: {}", name, stb_failure(bytes, "corrupt, truncated or unsupported image data"));
  return rgba;
}

}  // namespace

at::Tensor decode_image(std::string_view bytes, const std::string& name, int resolution) {
  if (resolution < 1 || resolution > kMaxResolution) {
    fail("image {}: resolution {} is out of range, expected 1..{}", name, resolution, kMaxResolution);
  }
  int w = 0, h = 0;
  RgbaPixels rgba = decode_rgba(bytes, name, w, h);
  // Centre crop to a square, compositing alpha over white on the way.
  const int side = std::min(w, h);
  const int x0 = (w - side) / 2, y0 = (h - side) / 2;
  std::vector<uint8_t> square(static_cast<size_t>(side) * side * 3);
  for (int y = 0; y < side; ++y) {
    const stbi_uc* src = rgba.get() + (static_cast<size_t>(y0 + y) * w + x0) * 4;
    uint8_t* dst = square.data() + static_cast<size_t>(y) * side * 3;
    for (int x = 0; x < side; ++x, src += 4, dst += 3) {
      const uint32_t a = src[3];
      for (int c = 0; c < 3; ++c) {
        dst[c] = static_cast<uint8_t>((src[c] * a + 255u * (255u - a) + 127u) / 255u);
      }
    }
  }
  auto hwc = at::empty({resolution, resolution, 3}, at::kByte);
  if (side == resolution) {
    std::memcpy(hwc.data_ptr<uint8_t>(), square.data(), square.size());
  } else if (!stbir_resize_uint8(square.data(), side, side, side * 3, hwc.data_ptr<uint8_t>(), resolution, resolution,
                                 resolution * 3, 3)) {
    fail("image {}: stb_image_resize failed to resize {}x{} to {}x{}", name, side, side, resolution, resolution);
  }
  return hwc.permute({2, 0, 1}).contiguous();
}

std::pair<int, int> image_file_size(const std::string& path) {
  const std::string bytes = read_file(path);
  int w = 0, h = 0, c = 0;
  if (bytes.size() > static_cast<size_t>(std::numeric_limits<int>::max()) ||
      !stbi_info_from_memory(reinterpret_cast<const stbi_uc*>(bytes.data()), static_cast<int>(bytes.size()), &w, &h,
                             &c)) {
    fail("cannot read the size of image {}: {}", path, stb_failure(bytes, "not an image stb_image reads"));
  }
  return {w, h};
}

at::Tensor decode_image_fitted(std::string_view bytes, const std::string& name, int resized_width, int resized_height,
                               int crop_x, int crop_y, int crop_width, int crop_height) {
  if (resized_width < 1 || resized_height < 1 || resized_width > kMaxResolution || resized_height > kMaxResolution) {
    fail("image {}: resized size {}x{} is out of range, expected 1..{}", name, resized_width, resized_height,
         kMaxResolution);
  }
  if (crop_x < 0 || crop_y < 0 || crop_width < 1 || crop_height < 1 || crop_x + crop_width > resized_width ||
      crop_y + crop_height > resized_height) {
    fail("image {}: crop {}x{} at ({}, {}) does not lie inside the resized {}x{}", name, crop_width, crop_height,
         crop_x, crop_y, resized_width, resized_height);
  }
  int w = 0, h = 0;
  RgbaPixels rgba = decode_rgba(bytes, name, w, h);
  std::vector<uint8_t> rgb(static_cast<size_t>(w) * h * 3);
  for (size_t i = 0, n = static_cast<size_t>(w) * h; i < n; ++i) {
    const stbi_uc* src = rgba.get() + i * 4;
    const uint32_t a = src[3];
    for (int c = 0; c < 3; ++c) {
      rgb[i * 3 + c] = static_cast<uint8_t>((src[c] * a + 255u * (255u - a) + 127u) / 255u);
    }
  }
  rgba.reset();
  std::vector<uint8_t> resized;
  const uint8_t* full = rgb.data();
  if (w != resized_width || h != resized_height) {
    resized.resize(static_cast<size_t>(resized_width) * resized_height * 3);
    if (!stbir_resize_uint8(rgb.data(), w, h, w * 3, resized.data(), resized_width, resized_height, resized_width * 3,
                            3)) {
      fail("image {}: stb_image_resize failed to resize {}x{} to {}x{}", name, w, h, resized_width, resized_height);
    }
    full = resized.data();
  }
  auto hwc = at::empty({crop_height, crop_width, 3}, at::kByte);
  uint8_t* out = hwc.data_ptr<uint8_t>();
  for (int y = 0; y < crop_height; ++y) {
    std::memcpy(out + static_cast<size_t>(y) * crop_width * 3,
                full + (static_cast<size_t>(crop_y + y) * resized_width + crop_x) * 3,
                static_cast<size_t>(crop_width) * 3);
  }
  return hwc.permute({2, 0, 1}).contiguous();
}

at::Tensor load_image(const std::string& path, int resolution) {
  const std::string bytes = read_file(path);
  return decode_image(bytes, path, resolution);
}

void save_png(const std::string& path, const at::Tensor& image) {
  const at::Tensor hwc = as_hwc(image, "save_png " + path).contiguous();
  const int64_t h = hwc.size(0), w = hwc.size(1);
  if (h < 1 || w < 1 || h > kMaxResolution * 4 || w > kMaxResolution * 4) {
    fail("save_png {}: image size {}x{} is not writable", path, h, w);
  }
  std::string encoded;
  auto append = [](void* context, void* data, int size) {
    static_cast<std::string*>(context)->append(static_cast<const char*>(data), static_cast<size_t>(size));
  };
  if (!stbi_write_png_to_func(append, &encoded, static_cast<int>(w), static_cast<int>(h), 3, hwc.data_ptr<uint8_t>(),
                              static_cast<int>(w * 3))) {
    fail("save_png {}: PNG encoding failed", path);
  }
  write_bytes_atomic(path, encoded);
}

at::Tensor make_grid(const std::vector<at::Tensor>& images, int64_t columns, int64_t padding,
                     const std::vector<std::string>& row_captions) {
  if (images.empty()) fail("make_grid: expected at least one image, got none");
  if (columns < 1) fail("make_grid: columns must be >= 1, got {}", columns);
  if (padding < 0) fail("make_grid: padding must be >= 0, got {}", padding);
  const at::Tensor& first = images.front();
  if (!first.defined() || first.scalar_type() != at::kByte || first.dim() != 3 || first.size(0) != 3) {
    fail("make_grid: image 0: expected uint8 [3, H, W]");
  }
  const int64_t h = first.size(1), w = first.size(2);
  const int64_t n = static_cast<int64_t>(images.size());
  const int64_t cols = std::min(columns, n);
  const int64_t rows = (n + cols - 1) / cols;
  if (!row_captions.empty() && static_cast<int64_t>(row_captions.size()) != rows) {
    fail("make_grid: {} row captions given for {} rows", row_captions.size(), rows);
  }
  const int64_t band = row_captions.empty() ? 0 : kGridCaptionBand;
  const int64_t row_pitch = h + band + padding;
  const int64_t col_pitch = w + padding;
  auto grid = at::full({3, rows * row_pitch + padding, cols * col_pitch + padding}, 255, at::kByte);
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor& img = images[static_cast<size_t>(i)];
    if (!img.defined() || img.scalar_type() != at::kByte || img.dim() != 3 || img.size(0) != 3 || img.size(1) != h ||
        img.size(2) != w) {
      fail("make_grid: image {}: expected uint8 [3, {}, {}] like image 0", i, h, w);
    }
    const int64_t y = padding + (i / cols) * row_pitch, x = padding + (i % cols) * col_pitch;
    grid.narrow(1, y, h).narrow(2, x, w).copy_(img);
  }
  if (band > 0) {
    const int64_t max_chars = std::max<int64_t>(0, (grid.size(2) - padding) / kFontCellWidth);
    for (int64_t r = 0; r < rows; ++r) {
      std::string_view text = row_captions[static_cast<size_t>(r)];
      text = text.substr(0, static_cast<size_t>(max_chars));
      draw_text(grid, padding, padding + r * row_pitch + h + (band - 7) / 2, text);
    }
  }
  return grid;
}

// ---------------------------------------------------------------------------
// Built-in font: 5x7 glyphs, drawn for shoestring. Each string is one row,
// '#' = ink; rows top to bottom.
namespace {

struct GlyphArt {
  char c;
  const char* rows[7];
};

// clang-format off
constexpr GlyphArt kGlyphArt[] = {
  {' ', {".....", ".....", ".....", ".....", ".....", ".....", "....."}},
  {'A', {".###.", "#...#", "#...#", "#####", "#...#", "#...#", "#...#"}},
  {'B', {"####.", "#...#", "#...#", "####.", "#...#", "#...#", "####."}},
  {'C', {".###.", "#...#", "#....", "#....", "#....", "#...#", ".###."}},
  {'D', {"####.", "#...#", "#...#", "#...#", "#...#", "#...#", "####."}},
  {'E', {"#####", "#....", "#....", "####.", "#....", "#....", "#####"}},
  {'F', {"#####", "#....", "#....", "####.", "#....", "#....", "#...."}},
  {'G', {".###.", "#...#", "#....", "#.###", "#...#", "#...#", ".####"}},
  {'H', {"#...#", "#...#", "#...#", "#####", "#...#", "#...#", "#...#"}},
  {'I', {".###.", "..#..", "..#..", "..#..", "..#..", "..#..", ".###."}},
  {'J', {"..###", "...#.", "...#.", "...#.", "...#.", "#..#.", ".##.."}},
  {'K', {"#...#", "#..#.", "#.#..", "##...", "#.#..", "#..#.", "#...#"}},
  {'L', {"#....", "#....", "#....", "#....", "#....", "#....", "#####"}},
  {'M', {"#...#", "##.##", "#.#.#", "#.#.#", "#...#", "#...#", "#...#"}},
  {'N', {"#...#", "#...#", "##..#", "#.#.#", "#..##", "#...#", "#...#"}},
  {'O', {".###.", "#...#", "#...#", "#...#", "#...#", "#...#", ".###."}},
  {'P', {"####.", "#...#", "#...#", "####.", "#....", "#....", "#...."}},
  {'Q', {".###.", "#...#", "#...#", "#...#", "#.#.#", "#..#.", ".##.#"}},
  {'R', {"####.", "#...#", "#...#", "####.", "#.#..", "#..#.", "#...#"}},
  {'S', {".####", "#....", "#....", ".###.", "....#", "....#", "####."}},
  {'T', {"#####", "..#..", "..#..", "..#..", "..#..", "..#..", "..#.."}},
  {'U', {"#...#", "#...#", "#...#", "#...#", "#...#", "#...#", ".###."}},
  {'V', {"#...#", "#...#", "#...#", "#...#", "#...#", ".#.#.", "..#.."}},
  {'W', {"#...#", "#...#", "#...#", "#.#.#", "#.#.#", "#.#.#", ".#.#."}},
  {'X', {"#...#", "#...#", ".#.#.", "..#..", ".#.#.", "#...#", "#...#"}},
  {'Y', {"#...#", "#...#", ".#.#.", "..#..", "..#..", "..#..", "..#.."}},
  {'Z', {"#####", "....#", "...#.", "..#..", ".#...", "#....", "#####"}},
  {'0', {".###.", "#...#", "#..##", "#.#.#", "##..#", "#...#", ".###."}},
  {'1', {"..#..", ".##..", "..#..", "..#..", "..#..", "..#..", ".###."}},
  {'2', {".###.", "#...#", "....#", "...#.", "..#..", ".#...", "#####"}},
  {'3', {"#####", "...#.", "..#..", "...#.", "....#", "#...#", ".###."}},
  {'4', {"...#.", "..##.", ".#.#.", "#..#.", "#####", "...#.", "...#."}},
  {'5', {"#####", "#....", "####.", "....#", "....#", "#...#", ".###."}},
  {'6', {"..##.", ".#...", "#....", "####.", "#...#", "#...#", ".###."}},
  {'7', {"#####", "....#", "...#.", "..#..", ".#...", ".#...", ".#..."}},
  {'8', {".###.", "#...#", "#...#", ".###.", "#...#", "#...#", ".###."}},
  {'9', {".###.", "#...#", "#...#", ".####", "....#", "...#.", ".##.."}},
  {'.', {".....", ".....", ".....", ".....", ".....", ".##..", ".##.."}},
  {',', {".....", ".....", ".....", ".....", ".##..", "..#..", ".#..."}},
  {':', {".....", ".##..", ".##..", ".....", ".##..", ".##..", "....."}},
  {';', {".....", ".##..", ".##..", ".....", ".##..", "..#..", ".#..."}},
  {'!', {"..#..", "..#..", "..#..", "..#..", "..#..", ".....", "..#.."}},
  {'?', {".###.", "#...#", "....#", "...#.", "..#..", ".....", "..#.."}},
  {'-', {".....", ".....", ".....", "#####", ".....", ".....", "....."}},
  {'+', {".....", "..#..", "..#..", "#####", "..#..", "..#..", "....."}},
  {'_', {".....", ".....", ".....", ".....", ".....", ".....", "#####"}},
  {'/', {".....", "....#", "...#.", "..#..", ".#...", "#....", "....."}},
  {'(', {"...#.", "..#..", ".#...", ".#...", ".#...", "..#..", "...#."}},
  {')', {".#...", "..#..", "...#.", "...#.", "...#.", "..#..", ".#..."}},
  {'\'', {"..#..", "..#..", ".#...", ".....", ".....", ".....", "....."}},
  {'"', {".#.#.", ".#.#.", ".#.#.", ".....", ".....", ".....", "....."}},
  {'&', {".##..", "#..#.", "#.#..", ".#...", "#.#.#", "#..#.", ".##.#"}},
  {'#', {".#.#.", ".#.#.", "#####", ".#.#.", "#####", ".#.#.", ".#.#."}},
  {'%', {"##...", "##..#", "...#.", "..#..", ".#...", "#..##", "...##"}},
  {'=', {".....", ".....", "#####", ".....", "#####", ".....", "....."}},
  {'<', {"...#.", "..#..", ".#...", "#....", ".#...", "..#..", "...#."}},
  {'>', {".#...", "..#..", "...#.", "....#", "...#.", "..#..", ".#..."}},
  {'*', {".....", "..#..", "#.#.#", ".###.", "#.#.#", "..#..", "....."}},
  {'[', {".###.", ".#...", ".#...", ".#...", ".#...", ".#...", ".###."}},
  {']', {".###.", "...#.", "...#.", "...#.", "...#.", "...#.", ".###."}},
};
// clang-format on

constexpr std::array<uint8_t, 7> kHollowBox = {0x1F, 0x11, 0x11, 0x11, 0x11, 0x11, 0x1F};

/// Glyph bitmaps indexed by ASCII code, built once from kGlyphArt.
const std::array<std::array<uint8_t, 7>, 128>& glyph_table() {
  static const auto table = [] {
    std::array<std::array<uint8_t, 7>, 128> t{};
    for (auto& g : t) g = kHollowBox;
    for (const GlyphArt& art : kGlyphArt) {
      std::array<uint8_t, 7> bits{};
      for (int r = 0; r < 7; ++r) {
        for (int c = 0; c < 5; ++c) {
          if (art.rows[r][c] == '#') bits[r] |= static_cast<uint8_t>(1u << (4 - c));
        }
      }
      t[static_cast<unsigned char>(art.c)] = bits;
    }
    return t;
  }();
  return table;
}

}  // namespace

std::array<uint8_t, 7> font_glyph(char c) {
  const auto u = static_cast<unsigned char>(c);
  if (u >= 128) return kHollowBox;
  return glyph_table()[static_cast<unsigned char>(std::toupper(u))];
}

int64_t text_width(std::string_view text, int64_t scale) {
  if (text.empty()) return 0;
  return (static_cast<int64_t>(text.size()) * kFontCellWidth - 1) * scale;
}

int64_t draw_text(const at::Tensor& image, int64_t x, int64_t y, std::string_view text, int64_t scale,
                  std::array<uint8_t, 3> color) {
  if (scale < 1) fail("draw_text: scale must be >= 1, got {}", scale);
  at::Tensor hwc = as_hwc(image, "draw_text");
  auto px = hwc.accessor<uint8_t, 3>();
  const int64_t h = hwc.size(0), w = hwc.size(1);
  for (char ch : text) {
    const auto glyph = font_glyph(ch);
    for (int64_t r = 0; r < 7; ++r) {
      for (int64_t c = 0; c < 5; ++c) {
        if (!(glyph[static_cast<size_t>(r)] & (1u << (4 - c)))) continue;
        for (int64_t dy = 0; dy < scale; ++dy) {
          const int64_t py = y + r * scale + dy;
          if (py < 0 || py >= h) continue;
          for (int64_t dx = 0; dx < scale; ++dx) {
            const int64_t qx = x + c * scale + dx;
            if (qx < 0 || qx >= w) continue;
            for (int64_t k = 0; k < 3; ++k) px[py][qx][k] = color[static_cast<size_t>(k)];
          }
        }
      }
    }
    x += kFontCellWidth * scale;
  }
  return x;
}

}  // namespace shoestring
