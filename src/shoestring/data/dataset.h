// Image/caption datasets held in memory (small sets: the Twemoji example is
// ~3,800 images of 64x64), and the deterministic, resumable batch order.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace shoestring {

/// An image that could not be loaded: skipped, counted, never fatal.
struct SkippedImage {
  std::string path;    ///< the image file
  std::string reason;  ///< why, naming the file (e.g. stb_image's decode error)
};

/// Something about a dataset folder worth a word that is not a skipped image:
/// a symlink loop not followed, a folder or image reached twice.
struct DatasetWarning {
  std::string path;     ///< the path (symlink) concerned
  std::string message;  ///< what happened, naming the path and what it points to
};

/// How the captions of the loaded images came about (folder layout; the
/// Twemoji layout builds every caption from emoji.json, so both stay 0).
struct CaptionStats {
  int64_t missing = 0;  ///< no caption file beside the image: caption "" (as kohya's sd-scripts)
  int64_t empty = 0;    ///< a caption file whose first line is empty or only whitespace: caption ""
};

/// In-memory image/caption dataset; images stored as uint8 [N, 3, R, R]
/// (RGB, alpha composited over white, centre-cropped and resized: see
/// decode_image in image.h).
class ImageCaptionDataset {
 public:
  /// Twemoji layout of the npm package emoji-datasource-twitter
  /// (scripts/fetch_twemoji.sh): <root>/emoji.json (iamcal/emoji-data) and
  /// <root>/img/twitter/64/<entry.image>. Takes entries with has_img_twitter
  /// true, in file order; each entry's skin-tone variations
  /// (entry.skin_variations, keys in sorted order) follow it.
  /// Caption: the lowercased Unicode name, then for a variation its tones
  /// ("medium skin tone"; two different tones "light skin tone, dark skin
  /// tone"), then each short name with '_' -> ' ' unless already present, then
  /// the lowercased category, joined by ", ". E.g. "grinning face, grinning,
  /// smileys & emotion"; "waving hand sign, medium skin tone, wave, people & body".
  /// Images listed but missing or corrupt are skipped (see skipped()).
  /// `categories` (case-insensitive, e.g. "Smileys & Emotion"), when not
  /// empty, keeps only the entries of those emoji-data categories.
  /// Throws shoestring::Error naming the file and entry/key when emoji.json is
  /// unreadable or malformed, when a category of `categories` names none of
  /// the file's (listing those), or when no image loads.
  static ImageCaptionDataset load_twemoji(const std::string& root, int resolution,
                                          const std::vector<std::string>& categories = {});

  /// kohya-ss layout: a folder searched recursively (names starting with '.'
  /// ignored, paths sorted) for images (.png .jpg .jpeg .bmp .gif .tga, any
  /// case), each captioned by the first line, trimmed, of the same-named .txt
  /// beside it (a.png + a.txt), as kohya's sd-scripts read captions; a UTF-8
  /// byte order mark at the start of the .txt is dropped.
  /// Symlinks are followed, each folder is visited once (by canonical path):
  /// a link to a folder above it (a loop) and a second link to a folder
  /// already visited are not followed, and are reported in warnings() and
  /// logged. An image reached through several paths with the same caption
  /// file (e.g. two links to one folder) loads once, from the first path in
  /// sorted order (also a warning); a symlinked image with a caption file of
  /// its own is a sample of its own.
  /// Captions: an image without a .txt, or with a .txt whose first line is
  /// empty, gets the caption "" (kohya's sd-scripts do the same for a missing
  /// file, with a warning); both are counted in caption_stats() and logged as
  /// one warning naming the first few images.
  /// .webp files are skipped with a reason (stb_image does not decode WebP);
  /// unreadable or corrupt images are skipped with stb's reason.
  /// Throws shoestring::Error if `dir` is not a folder or cannot be listed, if
  /// no image loads, or if a caption file is not valid UTF-8 (RFC 3629),
  /// naming the file and the byte offset (kohya stops on it too).
  static ImageCaptionDataset load_folder(const std::string& dir, int resolution);

  /// Picks the layout: `path`/emoji.json present (or `path` is an emoji.json
  /// file) -> load_twemoji, else a folder -> load_folder. Throws
  /// shoestring::Error if `path` does not exist, with a message saying how to
  /// fetch the emoji dataset (scripts/fetch_twemoji.sh), or if
  /// `twemoji_categories` is not empty and `path` is not the Twemoji layout.
  static ImageCaptionDataset load(const std::string& path, int resolution,
                                  const std::vector<std::string>& twemoji_categories = {});

  /// Number of images N.
  int64_t size() const { return static_cast<int64_t>(captions_.size()); }
  /// Side R of the square images, pixels.
  int resolution() const { return resolution_; }
  /// N captions, aligned with images().
  const std::vector<std::string>& captions() const { return captions_; }
  /// N source files, aligned with images().
  const std::vector<std::string>& paths() const { return paths_; }
  /// uint8 [N, 3, R, R].
  const at::Tensor& images() const { return images_; }
  /// Images that were skipped, with reasons.
  const std::vector<SkippedImage>& skipped() const { return skipped_; }
  /// Images loaded without a caption file (folder layout only); the same as
  /// caption_stats().missing.
  int64_t missing_captions() const { return caption_stats_.missing; }
  /// Counts of loaded images whose caption is missing or empty.
  const CaptionStats& caption_stats() const { return caption_stats_; }
  /// Loops and duplicates met while listing a folder (load_folder), in the
  /// order met; empty for the Twemoji layout.
  const std::vector<DatasetWarning>& warnings() const { return warnings_; }

  /// float32 [B, 3, R, R] in [-1, 1] (x / 127.5 - 1) for the given indices.
  /// Throws shoestring::Error for an index outside [0, N).
  at::Tensor batch_images(const std::vector<int64_t>& idx) const;
  /// The B captions for the given indices. Throws like batch_images.
  std::vector<std::string> batch_captions(const std::vector<int64_t>& idx) const;

 private:
  struct Candidate {
    std::string path;
    std::string caption;
    bool missing_caption = false;  ///< no caption file was found
    std::string skip_reason;       ///< non-empty: skip without decoding
    bool empty_caption = false;    ///< the caption file's first line is blank
  };
  /// Decodes candidates in parallel (at::parallel_for); failures go to skipped().
  static ImageCaptionDataset decode_all(std::vector<Candidate> candidates, int resolution, const std::string& source);

  int resolution_ = 0;
  std::vector<std::string> captions_;
  std::vector<std::string> paths_;
  at::Tensor images_;
  std::vector<SkippedImage> skipped_;
  CaptionStats caption_stats_;
  std::vector<DatasetWarning> warnings_;
};

/// Deterministic epoch-shuffled batch order, independent of torch's global RNG,
/// so that the data order is reproducible and a resumed run continues it.
/// Epoch e visits the permutation of [0, N) made by a Fisher-Yates
/// (Durstenfeld) shuffle driven by std::mt19937_64 seeded through
/// std::seed_seq{seed lo32, seed hi32, e lo32, e hi32}; the bounded draws use
/// rejection sampling (not std::uniform_int_distribution, whose output is
/// implementation-defined), so the order is the same on every platform.
/// drop_last semantics (as PyTorch's DataLoader(drop_last=True)): each epoch
/// yields floor(N / batch_size) full batches; the N mod batch_size samples at
/// the end of the epoch's permutation are not used that epoch, and a batch
/// never spans two epochs. Every sample is still seen, since each epoch's
/// permutation differs.
class BatchSampler {
 public:
  /// Throws shoestring::Error if batch_size < 1 or dataset_size < batch_size
  /// (no full batch could be formed).
  BatchSampler(int64_t dataset_size, int64_t batch_size, uint64_t seed);

  /// Indices (batch_size of them, distinct, in [0, N)) of the next batch;
  /// advances the position, moving to the next epoch after the last batch.
  std::vector<int64_t> next();

  /// Where the next batch comes from: epoch, and batch index within the epoch
  /// (0 <= index < batches_per_epoch()).
  struct Position {
    int64_t epoch = 0;
    int64_t index = 0;
  };
  Position position() const { return position_; }
  /// Resumes at `p`: next() then returns what it returned at that position in
  /// an uninterrupted run. Throws shoestring::Error if epoch < 0 or index is
  /// outside [0, batches_per_epoch()).
  void set_position(Position p);

  /// floor(dataset_size / batch_size).
  int64_t batches_per_epoch() const { return dataset_size_ / batch_size_; }
  int64_t batch_size() const { return batch_size_; }
  int64_t dataset_size() const { return dataset_size_; }

  /// The permutation of [0, dataset_size) used by `epoch` (see the class comment).
  std::vector<int64_t> epoch_permutation(int64_t epoch) const;

 private:
  int64_t dataset_size_;
  int64_t batch_size_;
  uint64_t seed_;
  Position position_;
  int64_t cached_epoch_ = -1;
  std::vector<int64_t> permutation_;
};

}  // namespace shoestring
