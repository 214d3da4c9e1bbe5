// Image files in and out: decoding (stb_image) to the square uint8 RGB
// tensors the datasets hold, PNG writing for sample grids, grid assembly, and
// a tiny built-in 5x7 bitmap font to caption grids without a font library.
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

namespace shoestring {

/// Decodes an encoded image (PNG, JPEG, BMP, GIF, TGA: whatever stb_image
/// reads) held in memory into uint8 [3, resolution, resolution] RGB.
/// Steps: decode to 4 channels (RGBA); composite alpha over white
/// (c' = (c*a + 255*(255-a)) / 255, rounded), so transparent pixels become
/// 255; centre-crop to a square (side = min(w, h), the excess split evenly,
/// odd pixel dropped on the right/bottom); resize with stb_image_resize's
/// stbir_resize_uint8 (its default Mitchell filter for downsampling,
/// Catmull-Rom for upsampling) unless the square already has the requested
/// side, in which case pixels are copied unchanged.
/// `name` names the source in error messages (usually the file path).
/// Throws shoestring::Error naming `name` and stb's reason when the bytes
/// cannot be decoded, and when resolution is not in [1, 16384].
at::Tensor decode_image(std::string_view bytes, const std::string& name, int resolution);

/// Reads the file at `path` and decodes it with decode_image.
/// Returns uint8 [3, resolution, resolution].
/// Throws shoestring::Error naming the file when it cannot be read, or when it
/// is corrupt or in a format stb_image does not read (with stb's reason).
at::Tensor load_image(const std::string& path, int resolution);

/// Width and height, pixels, of the image file at `path`, from its header
/// (stbi_info; nothing decoded). Throws shoestring::Error naming the file
/// when it cannot be read or is not an image stb_image reads.
std::pair<int, int> image_file_size(const std::string& path);

/// Decodes an image (as decode_image: RGBA, alpha composited over white)
/// and fits it into a bucket the way kohya's trim_and_resize_if_required
/// (sd-scripts library/train_util.py) does: the whole image resized to
/// resized_width x resized_height (stb_image_resize as decode_image; pixels
/// copied when the size is unchanged), then the crop_width x crop_height
/// window whose top-left is (crop_x, crop_y) in the resized image.
/// Returns uint8 [3, crop_height, crop_width]. Throws shoestring::Error naming
/// `name` when the bytes cannot be decoded or the window does not lie inside
/// the resized image.
at::Tensor decode_image_fitted(std::string_view bytes, const std::string& name, int resized_width, int resized_height,
                               int crop_x, int crop_y, int crop_width, int crop_height);

/// Writes an RGB uint8 image as PNG, atomically (encoded in memory with
/// stbi_write_png_to_func, then written with write_bytes_atomic).
/// `image`: uint8 [H, W, 3] (HWC) or [3, H, W] (CHW); a tensor whose first and
/// last dimensions are both 3 is taken as CHW, the library's convention.
/// Throws shoestring::Error naming the path for a wrong dtype/shape or when the
/// file cannot be written.
void save_png(const std::string& path, const at::Tensor& image);

/// Tiles images into one grid with white (255) padding, row-major, like
/// torchvision.utils.make_grid: cols = min(columns, N), rows = ceil(N / cols),
/// padding pixels between images and around the border.
/// `images`: N >= 1 tensors uint8 [3, H, W], all the same shape.
/// `row_captions`: empty, or exactly `rows` strings; each is drawn with the
/// built-in font (scale 1, black) in a band kGridCaptionBand pixels high
/// under its row, cut to the grid's width.
/// Returns uint8 [3, rows*(H + band + padding) + padding, cols*(W + padding) + padding]
/// where band = kGridCaptionBand if captions are given, else 0.
/// Throws shoestring::Error for an empty list, mismatched shapes/dtypes,
/// columns < 1, padding < 0, or a caption count that differs from rows.
at::Tensor make_grid(const std::vector<at::Tensor>& images, int64_t columns, int64_t padding,
                     const std::vector<std::string>& row_captions = {});

/// Height in pixels of the caption band make_grid adds under each row.
inline constexpr int64_t kGridCaptionBand = 10;

/// Glyph cell of the built-in font at scale 1, in pixels: 5x7 glyphs with one
/// column of spacing to the right and one row below.
inline constexpr int64_t kFontCellWidth = 6;
inline constexpr int64_t kFontCellHeight = 8;

/// The 5x7 bitmap of character `c` from the built-in font (shoestring's own
/// design): 7 rows top to bottom, bit 4 of each row is the leftmost pixel.
/// Covers A-Z, 0-9, space and . , : ; ! ? - + _ / ( ) ' " & # % = < > * [ ];
/// lowercase letters use the uppercase glyphs; any other character is drawn
/// as a hollow box.
std::array<uint8_t, 7> font_glyph(char c);

/// Width in pixels of `text` drawn at `scale` (the last glyph's spacing column
/// excluded); 0 for empty text.
int64_t text_width(std::string_view text, int64_t scale = 1);

/// Draws `text` in place into `image` (uint8 [H, W, 3] or [3, H, W], same
/// convention as save_png; any strides) with the built-in font, top-left
/// corner of the first glyph at (x, y) pixels, each font pixel a
/// scale x scale square of `color`. Pixels outside the image are clipped.
/// '\n' is not special. Returns the x just past the last glyph cell.
/// Throws shoestring::Error for a wrong dtype/shape or scale < 1.
int64_t draw_text(const at::Tensor& image, int64_t x, int64_t y, std::string_view text, int64_t scale = 1,
                  std::array<uint8_t, 3> color = {0, 0, 0});

}  // namespace shoestring
