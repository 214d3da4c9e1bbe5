// Tests for image decoding (alpha over white, crop, resize), PNG writing,
// grids and the built-in font.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <set>

#include <unistd.h>

#include <stb_image.h>
#include <stb_image_write.h>
#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/data/image.h"

namespace fs = std::filesystem;
using shoestring::Error;

namespace {

const std::string kData = SHOESTRING_TEST_DATA;
const std::string kGrinning = kData + "/twemoji/img/twitter/64/1f600.png";

/// A fresh, empty temporary folder, removed when the test ends.
struct TempDir {
  fs::path path;
  TempDir() {
    static int counter = 0;
    path = fs::temp_directory_path() /
           ("shoestring_test_image_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
  std::string file(const std::string& name) const { return (path / name).string(); }
};

/// Writes RGBA pixels (w*h*4 bytes) as PNG with stb_image_write directly.
void write_rgba_png(const std::string& path, int w, int h, const std::vector<uint8_t>& rgba) {
  ASSERT_TRUE(stbi_write_png(path.c_str(), w, h, 4, rgba.data(), w * 4));
}

}  // namespace

TEST(Image, AlphaIsCompositedOverWhite) {
  int w = 0, h = 0, n = 0;
  stbi_uc* ref = stbi_load(kGrinning.c_str(), &w, &h, &n, 4);
  ASSERT_NE(ref, nullptr);
  ASSERT_EQ(w, 64);
  ASSERT_EQ(h, 64);
  const at::Tensor img = shoestring::load_image(kGrinning, 64);  // native size: no resampling
  ASSERT_EQ(img.sizes(), (std::vector<int64_t>{3, 64, 64}));
  ASSERT_EQ(img.scalar_type(), at::kByte);
  auto px = img.accessor<uint8_t, 3>();
  int transparent = 0, opaque = 0, partial = 0;
  for (int y = 0; y < 64; ++y) {
    for (int x = 0; x < 64; ++x) {
      const stbi_uc* p = ref + (y * 64 + x) * 4;
      for (int c = 0; c < 3; ++c) {
        if (p[3] == 0) {
          EXPECT_EQ(px[c][y][x], 255) << "transparent pixel " << x << "," << y;
        } else if (p[3] == 255) {
          EXPECT_EQ(px[c][y][x], p[c]) << "opaque pixel " << x << "," << y;
        } else {
          const double want = (p[c] * p[3] + 255.0 * (255 - p[3])) / 255.0;
          EXPECT_NEAR(px[c][y][x], want, 0.5 + 1e-9) << "pixel " << x << "," << y;
        }
      }
      transparent += p[3] == 0;
      opaque += p[3] == 255;
      partial += p[3] != 0 && p[3] != 255;
    }
  }
  stbi_image_free(ref);
  // The fixture must exercise all three cases.
  EXPECT_GT(transparent, 100);
  EXPECT_GT(opaque, 100);
  EXPECT_GT(partial, 10);
}

TEST(Image, ResizeGivesRequestedSizeAndKeepsContent) {
  const at::Tensor full = shoestring::load_image(kGrinning, 64);
  for (int r : {16, 32, 100}) {
    const at::Tensor small = shoestring::load_image(kGrinning, r);
    ASSERT_EQ(small.sizes(), (std::vector<int64_t>{3, r, r}));
    ASSERT_EQ(small.scalar_type(), at::kByte);
    // Per-channel means are preserved by resampling up to a few levels.
    const auto m_full = full.to(at::kFloat).mean({1, 2});
    const auto m_small = small.to(at::kFloat).mean({1, 2});
    EXPECT_LT((m_full - m_small).abs().max().item<float>(), 4.0f) << "resolution " << r;
  }
  // 64 -> 32 is close to a 2x2 box average (the filters differ only at edges).
  const at::Tensor box = at::avg_pool2d(full.to(at::kFloat).unsqueeze(0), {2, 2}).squeeze(0);
  const at::Tensor half = shoestring::load_image(kGrinning, 32).to(at::kFloat);
  EXPECT_LT((box - half).abs().mean().item<float>(), 6.0f);
}

TEST(Image, NonSquareIsCentreCropped) {
  TempDir tmp;
  // 40x20: columns 0-9 red, 10-19 green, 20-29 blue, 30-39 black.
  const int w = 40, h = 20;
  std::vector<uint8_t> rgba(w * h * 4, 255);
  for (int y = 0; y < h; ++y) {
    for (int x = 0; x < w; ++x) {
      uint8_t* p = &rgba[(y * w + x) * 4];
      const int band = x / 10;
      p[0] = band == 0 ? 255 : 0;
      p[1] = band == 1 ? 255 : 0;
      p[2] = band == 2 ? 255 : 0;
    }
  }
  write_rgba_png(tmp.file("wide.png"), w, h, rgba);
  const at::Tensor img = shoestring::load_image(tmp.file("wide.png"), 20);
  auto px = img.accessor<uint8_t, 3>();
  for (int y = 0; y < 20; ++y) {
    for (int x = 0; x < 20; ++x) {
      const bool green = x < 10;  // the crop keeps columns 10..29
      EXPECT_EQ(px[0][y][x], 0);
      EXPECT_EQ(px[1][y][x], green ? 255 : 0);
      EXPECT_EQ(px[2][y][x], green ? 0 : 255);
    }
  }
}

TEST(Image, JpegDecodes) {
  TempDir tmp;
  std::vector<uint8_t> rgb(16 * 16 * 3);
  for (size_t i = 0; i < rgb.size(); i += 3) {
    rgb[i] = 200;
    rgb[i + 1] = 100;
    rgb[i + 2] = 50;
  }
  ASSERT_TRUE(stbi_write_jpg(tmp.file("a.jpg").c_str(), 16, 16, 3, rgb.data(), 95));
  const at::Tensor img = shoestring::load_image(tmp.file("a.jpg"), 16);
  const auto mean = img.to(at::kFloat).mean({1, 2});
  EXPECT_NEAR(mean[0].item<float>(), 200, 3);
  EXPECT_NEAR(mean[1].item<float>(), 100, 3);
  EXPECT_NEAR(mean[2].item<float>(), 50, 3);
}

TEST(Image, CorruptAndMissingFilesThrowNamingTheFile) {
  const std::string corrupt = kData + "/folder/corrupt.png";
  try {
    shoestring::load_image(corrupt, 32);
    FAIL() << "no error for a truncated PNG";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("corrupt.png"), std::string::npos) << e.what();
  }
  try {
    shoestring::load_image(kData + "/folder/does_not_exist.png", 32);
    FAIL() << "no error for a missing file";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("does_not_exist.png"), std::string::npos) << e.what();
  }
  EXPECT_THROW(shoestring::decode_image("not an image", "text", 8), Error);
  EXPECT_THROW(shoestring::load_image(kGrinning, 0), Error);
}

// A PNG header announcing 60000 x 60000 RGB pixels (PNG spec: signature, then
// the IHDR chunk: big-endian width and height): stb_image refuses it as too
// large, then tries its other readers and would report "unknown image type";
// the error gives the size instead.
TEST(Image, OversizedPngNamesItsSize) {
  std::string png("\x89PNG\r\n\x1a\n", 8);
  png += std::string("\0\0\0\x0d", 4) + "IHDR";
  for (uint32_t side : {60000u, 60000u}) {
    for (int shift = 24; shift >= 0; shift -= 8) png += static_cast<char>((side >> shift) & 0xFF);
  }
  png += std::string("\x08\x02\0\0\0", 5) + std::string(4, '\0');  // 8-bit RGB, CRC not checked by stb
  for (const auto& call : std::vector<std::function<void()>>{
           [&] { shoestring::decode_image(png, "huge.png", 8); },
           [&] {
             const std::filesystem::path path = std::filesystem::temp_directory_path() / "shoestring_huge_test.png";
             {
               std::ofstream out(path, std::ios::binary);
               out << png;
             }
             struct Remove {
               std::filesystem::path p;
               ~Remove() { std::filesystem::remove(p); }
             } remove{path};
             shoestring::image_file_size(path.string());
           }}) {
    try {
      call();
      FAIL() << "no error for a 60000x60000 PNG";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("60000x60000"), std::string::npos) << e.what();
      EXPECT_EQ(std::string(e.what()).find("unknown image type"), std::string::npos) << e.what();
    }
  }
}

TEST(Image, SavePngRoundTrip) {
  TempDir tmp;
  at::manual_seed(0);
  const at::Tensor chw = at::randint(0, 256, {3, 17, 23}, at::kByte);
  shoestring::save_png(tmp.file("chw.png"), chw);
  int w = 0, h = 0, n = 0;
  stbi_uc* back = stbi_load(tmp.file("chw.png").c_str(), &w, &h, &n, 3);
  ASSERT_NE(back, nullptr);
  EXPECT_EQ(w, 23);
  EXPECT_EQ(h, 17);
  const at::Tensor decoded = at::from_blob(back, {17, 23, 3}, at::kByte).permute({2, 0, 1}).clone();
  stbi_image_free(back);
  EXPECT_TRUE(decoded.equal(chw));

  // HWC input, square: load_image gives the same pixels back (opaque, native size).
  const at::Tensor hwc = at::randint(0, 256, {16, 16, 3}, at::kByte);
  shoestring::save_png(tmp.file("hwc.png"), hwc);
  EXPECT_TRUE(shoestring::load_image(tmp.file("hwc.png"), 16).equal(hwc.permute({2, 0, 1})));
  // No temporary files are left behind.
  EXPECT_EQ(std::distance(fs::directory_iterator(tmp.path), fs::directory_iterator()), 2);

  EXPECT_THROW(shoestring::save_png(tmp.file("f.png"), at::zeros({3, 4, 4})), Error);
  EXPECT_THROW(shoestring::save_png(tmp.file("g.png"), at::zeros({4, 4, 4}, at::kByte)), Error);
  EXPECT_THROW(shoestring::save_png(tmp.file("missing_dir/x.png"), hwc), Error);
}

TEST(Image, MakeGridPlacesImagesWithWhitePadding) {
  std::vector<at::Tensor> images;
  for (int i = 0; i < 5; ++i) images.push_back(at::full({3, 8, 10}, i * 10, at::kByte));
  const at::Tensor grid = shoestring::make_grid(images, 3, 2);
  // rows = 2, cols = 3: H = 2*(8+2)+2, W = 3*(10+2)+2.
  ASSERT_EQ(grid.sizes(), (std::vector<int64_t>{3, 22, 38}));
  for (int i = 0; i < 5; ++i) {
    const int64_t y = 2 + (i / 3) * 10, x = 2 + (i % 3) * 12;
    EXPECT_TRUE(grid.narrow(1, y, 8).narrow(2, x, 10).equal(images[i])) << "image " << i;
  }
  // Padding and the empty sixth cell are white: exactly 5 images' worth of non-white pixels.
  EXPECT_EQ((grid != 255).sum().item<int64_t>(), 5 * 3 * 8 * 10);
  // Fewer images than columns: one row as wide as the images.
  EXPECT_EQ(shoestring::make_grid({images[0], images[1]}, 8, 1).sizes(), (std::vector<int64_t>{3, 10, 23}));

  const at::Tensor captioned = shoestring::make_grid(images, 3, 2, {"ROW 1", "row 2"});
  ASSERT_EQ(captioned.sizes(), (std::vector<int64_t>{3, 22 + 2 * shoestring::kGridCaptionBand, 38}));
  const at::Tensor band = captioned.narrow(1, 2 + 8, shoestring::kGridCaptionBand);
  EXPECT_GT((band == 0).sum().item<int64_t>(), 20);  // black text ink

  EXPECT_THROW(shoestring::make_grid({}, 3, 2), Error);
  EXPECT_THROW(shoestring::make_grid({images[0], at::zeros({3, 8, 9}, at::kByte)}, 3, 2), Error);
  EXPECT_THROW(shoestring::make_grid(images, 0, 2), Error);
  EXPECT_THROW(shoestring::make_grid(images, 3, 2, {"only one"}), Error);
}

TEST(Font, GlyphsAreDistinctAndCaseInsensitive) {
  const std::string charset = " ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,:;!?-+_/()'\"&#%=<>*[]";
  const auto box = shoestring::font_glyph('\x01');
  std::set<std::array<uint8_t, 7>> seen;
  for (char c : charset) {
    const auto g = shoestring::font_glyph(c);
    EXPECT_NE(g, box) << "character '" << c << "' has no glyph";
    EXPECT_TRUE(seen.insert(g).second) << "glyph of '" << c << "' repeats another";
    for (uint8_t row : g) EXPECT_EQ(row & ~0x1F, 0) << "glyph '" << c << "' wider than 5";
    if (c >= 'A' && c <= 'Z') {
      EXPECT_EQ(shoestring::font_glyph(static_cast<char>(c + 32)), g);
    }
  }
  EXPECT_EQ(shoestring::font_glyph('~'), box);
  EXPECT_EQ(shoestring::text_width("AB", 1), 11);
  EXPECT_EQ(shoestring::text_width("", 3), 0);
}

TEST(Font, DrawTextPlacesScaledGlyphsAndClips) {
  // 'L' at (3, 2), scale 2, in an HWC image: the vertical stroke and the base.
  at::Tensor hwc = at::full({20, 20, 3}, 255, at::kByte);
  const int64_t end = shoestring::draw_text(hwc, 3, 2, "L", 2, {10, 20, 30});
  EXPECT_EQ(end, 3 + 12);
  const auto glyph = shoestring::font_glyph('L');
  int64_t bits = 0;
  for (uint8_t row : glyph) bits += __builtin_popcount(row);
  EXPECT_EQ((hwc.select(2, 0) == 10).sum().item<int64_t>(), bits * 4);
  EXPECT_EQ(hwc[2][3][0].item<int>(), 10);  // top-left of the stroke
  EXPECT_EQ(hwc[2][3][2].item<int>(), 30);
  EXPECT_EQ(hwc[15][12][1].item<int>(), 20);  // right end of the base, scaled
  EXPECT_EQ(hwc[2][5][0].item<int>(), 255);   // right of the stroke: paper

  // CHW, partly outside the image: no crash, only the visible part is drawn.
  at::Tensor chw = at::full({3, 5, 5}, 255, at::kByte);
  shoestring::draw_text(chw, -3, -3, "HELLO");
  EXPECT_GT((chw == 0).sum().item<int64_t>(), 0);
  EXPECT_THROW(shoestring::draw_text(chw, 0, 0, "x", 0), Error);
  EXPECT_THROW(shoestring::draw_text(at::zeros({4, 5, 5}, at::kByte), 0, 0, "x"), Error);
}
