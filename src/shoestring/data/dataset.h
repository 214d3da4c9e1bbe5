// Image/caption datasets held in memory (small sets: the Twemoji example is
// ~3,800 images of 64x64), square or in kohya's aspect-ratio buckets
// (data/buckets.h), and the deterministic, resumable batch order.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "shoestring/data/buckets.h"

namespace shoestring {

/// One image folder or fine-tuning metadata file of a dataset: a kohya
/// [[datasets.subsets]] entry with its keys resolved (train/dataset_config.h
/// reads them; kohya's library/config_util.py defines them).
struct DatasetSubset {
  /// Folder of the images (not searched recursively, as kohya's glob_images);
  /// with metadata_file, the folder relative image keys are joined to.
  std::string image_dir;
  /// kohya's fine-tuning metadata JSON (`in_json`, `metadata_file`): an object
  /// {image key: {"caption": ..., "tags": ..., "image_size": [w, h]}}, or
  /// JSON Lines {"image_path", "caption", "tags", "image_size"} for a .jsonl
  /// file. "" = caption files beside the images (kohya's DreamBooth subset).
  std::string metadata_file;
  int64_t num_repeats = 1;  ///< each image is this many entries of its bucket per epoch (kohya's repeats)
  std::string caption_extension = ".txt";  ///< caption file of a.png: a + caption_extension
  std::string class_tokens;                ///< caption of an image without a caption file ("" = the empty caption)
  bool flip_aug = false;                   ///< also train on the mirrored image (drawn with probability 1/2)
  bool random_crop = false;                ///< crop at a random offset instead of the centre
  /// List image_dir recursively (as load_folder; the main config's
  /// train_data_dir) instead of its own files only (kohya's TOML subsets).
  bool recursive = false;
  // Caption options at batch time (data/caption_processing.h), kept for the
  // model families that read or refuse them.
  double caption_dropout_rate = 0.0;
  bool shuffle_caption = false;
  int64_t keep_tokens = 0;
  double caption_tag_dropout_rate = 0.0;
  std::string where;  ///< names the subset in messages ("d.toml: datasets[0].subsets[1]")
};

/// One dataset (a kohya [[datasets]] entry): its buckets, batch size and subsets.
struct DatasetSpec {
  BucketSettings buckets;  ///< resolution and bucket options (adjusted by adjust_bucket_settings when loaded)
  int64_t batch_size = 1;  ///< images per batch of this dataset's buckets
  std::vector<DatasetSubset> subsets;
  std::string where;  ///< names the dataset in messages
};

/// The images of one dataset that train at one size; a batch never mixes buckets.
struct DatasetBucket {
  int64_t dataset = 0;          ///< index of its DatasetSpec
  BucketReso reso;              ///< training size, pixels
  int64_t batch_size = 1;       ///< its dataset's batch_size
  std::vector<int64_t> images;  ///< dataset image indices (aligned with bucket_images rows)
  int64_t entries = 0;          ///< images counted with their repeats (kohya's "count")
};

/// How an image of a bucketed dataset was fitted into its bucket.
struct ImageGeometry {
  BucketReso original;  ///< the file's size
  BucketReso resized;   ///< size it was resized to (covering the bucket)
  CropOffset crop;      ///< top-left of the bucket-sized crop in the resized image
  CropLtrb crop_ltrb;   ///< kohya's get_crop_ltrb box (SDXL's crop conditioning)
};

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
  int64_t missing =
      0;  ///< no caption file (nor metadata caption, nor class_tokens): caption "" (as kohya's sd-scripts)
  int64_t class_tokens = 0;  ///< no caption file, captioned by the subset's class_tokens (kohya's DreamBooth rule)
  int64_t empty = 0;         ///< a caption file whose first line is empty or only whitespace: caption ""
};

/// Which of a dataset's images to load and how to hold them: a seeded subset
/// for quick experiments on part of it (the config's max_train_images,
/// max_train_images_seed), decoded at load or on demand.
struct DatasetSelection {
  int64_t max_images = 0;  ///< keep this many of the images listed (0 = every one)
  uint64_t seed = 0;       ///< which ones (seeded_subset)
  /// Decode an image only when batch_images asks for it, not once at load
  /// into memory: for runs whose images go into a latent cache on disk
  /// (cache_latents_to_disk), where an image already cached is never decoded
  /// and host memory does not grow with the dataset. Loading then reads only
  /// the files' headers (image_file_size), so a file whose header reads but
  /// whose pixels do not is not skipped: batch_images names it.
  bool decode_on_demand = false;
};

/// `count` distinct indices of [0, n), ascending (all of them when count >=
/// n): the first `count` positions of a forward Fisher-Yates shuffle of
/// [0, n) (position i swapped with i + a draw in [0, n - 1 - i]) driven by
/// std::mt19937_64 seeded through std::seed_seq{seed lo32, seed hi32}, with
/// the bounded draws of data/random_draw.h (the same on every platform).
/// Each index is in the subset with probability count / n; the same seed
/// gives the same subset, and the subset of a smaller count is contained in
/// that of a larger one. Throws shoestring::Error for n < 0 or count < 0.
std::vector<int64_t> seeded_subset(int64_t n, int64_t count, uint64_t seed);

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
  /// `selection` keeps a seeded subset of the images listed (after
  /// `categories`), chosen before any is decoded; one of them that then does
  /// not load is skipped as usual, so a dataset may hold fewer.
  static ImageCaptionDataset load_twemoji(const std::string& root, int resolution,
                                          const std::vector<std::string>& categories = {},
                                          const DatasetSelection& selection = {});

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
  /// `selection` keeps a seeded subset of the images listed, as load_twemoji.
  static ImageCaptionDataset load_folder(const std::string& dir, int resolution,
                                         const DatasetSelection& selection = {});

  /// Picks the layout: `path`/emoji.json present (or `path` is an emoji.json
  /// file) -> load_twemoji, else a folder -> load_folder. Throws
  /// shoestring::Error if `path` does not exist, with a message saying how to
  /// fetch the emoji dataset (scripts/fetch_twemoji.sh), or if
  /// `twemoji_categories` is not empty and `path` is not the Twemoji layout.
  static ImageCaptionDataset load(const std::string& path, int resolution,
                                  const std::vector<std::string>& twemoji_categories = {},
                                  const DatasetSelection& selection = {});

  /// kohya's datasets with aspect-ratio buckets (library/train_util.py
  /// BaseDataset.make_buckets): for each spec, its subsets' images (in subset
  /// order, then sorted by path; DreamBooth subsets: images of image_dir with
  /// their caption files as load_folder reads them, class_tokens for a missing
  /// one; fine-tuning subsets: the metadata file's entries, caption then
  /// tags joined by ',' as kohya joins them), one BucketManager per spec
  /// (BucketManager::for_settings after adjust_bucket_settings, whose notes
  /// are logged), each image's bucket from its file's size (select_bucket),
  /// the buckets sorted. Each image is decoded (alpha over white), resized to
  /// its BucketChoice::resized size (stb_image_resize) and cropped to its
  /// bucket at bucket_crop_offset (random_crop seeded by `seed` and the
  /// image's index). Subsets with num_repeats < 1 are left out with a
  /// warning, as kohya does. Unreadable images are skipped as load_folder
  /// skips them. Throws shoestring::Error naming the file / key: a folder or
  /// metadata file that cannot be read, a malformed metadata entry (unknown
  /// key, wrong type), an image of a metadata file that does not exist,
  /// invalid UTF-8 captions, bad bucket settings, no image at all.
  /// `selection` keeps a seeded subset of the images listed over all specs
  /// (in the order above), chosen before their sizes are read; each keeps its
  /// subset's num_repeats.
  static ImageCaptionDataset load_buckets(const std::vector<DatasetSpec>& specs, uint64_t seed,
                                          const DatasetSelection& selection = {});

  /// True for a dataset made by load_buckets.
  bool bucketed() const { return !buckets_.empty(); }
  /// load_buckets: the buckets, per spec, each spec's sorted by size.
  const std::vector<DatasetBucket>& buckets() const { return buckets_; }
  /// load_buckets: uint8 [n_b, 3, H, W] of bucket `b` (rows aligned with
  /// buckets()[b].images). Throws shoestring::Error when decoding on demand
  /// (nothing is held: use batch_images).
  const at::Tensor& bucket_images(int64_t b) const;
  /// load_buckets: the bucket of image `i`.
  int64_t bucket_of(int64_t i) const { return bucket_of_.at(static_cast<size_t>(i)); }
  /// load_buckets: how image `i` was fitted into its bucket.
  const ImageGeometry& geometry(int64_t i) const { return geometry_.at(static_cast<size_t>(i)); }
  /// load_buckets: whether image `i`'s subset has flip_aug.
  bool flip_aug(int64_t i) const { return !flip_.empty() && flip_.at(static_cast<size_t>(i)); }
  /// load_buckets: image `i`'s subset's caption_dropout_rate.
  double caption_dropout_rate(int64_t i) const { return dropout_.at(static_cast<size_t>(i)); }
  /// load_buckets: image `i`'s subset's num_repeats.
  int64_t num_repeats(int64_t i) const { return repeats_.at(static_cast<size_t>(i)); }
  /// load_buckets: whether any subset has random_crop (the crops were drawn once, at load).
  bool random_crop() const { return random_crop_; }
  /// load_buckets: the resolution of dataset `d` (its DatasetSpec's buckets.resolution).
  BucketReso dataset_resolution(int64_t d) const { return resolutions_.at(static_cast<size_t>(d)); }
  /// load_buckets: kohya's "mean ar error (without repeats)": mean |ar_error| over the images.
  double mean_ar_error() const { return mean_ar_error_; }
  /// load_buckets: one line per bucket with images, as kohya logs them
  /// ("bucket 0: resolution 512x768, count 12" with the count including
  /// repeats, and the dataset and batch size), then the mean aspect-ratio error.
  std::vector<std::string> bucket_report() const;

  /// Number of images N.
  int64_t size() const { return static_cast<int64_t>(captions_.size()); }
  /// Images listed before a DatasetSelection kept its subset (loaded or
  /// skipped; size() + skipped().size() without a selection).
  int64_t listed_images() const { return listed_; }
  /// Side R of the square images, pixels (0 for a bucketed dataset).
  int resolution() const { return resolution_; }
  /// N captions, aligned with images().
  const std::vector<std::string>& captions() const { return captions_; }
  /// N source files, aligned with images().
  const std::vector<std::string>& paths() const { return paths_; }
  /// uint8 [N, 3, R, R] (undefined for a bucketed dataset, see bucket_images,
  /// and when decoding on demand).
  const at::Tensor& images() const { return images_; }
  /// True when loaded with DatasetSelection::decode_on_demand.
  bool decodes_on_demand() const { return on_demand_; }
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

  /// float32 [B, 3, R, R] in [-1, 1] (x / 127.5 - 1) for the given indices;
  /// bucketed: [B, 3, H, W] of their bucket. Throws shoestring::Error for an
  /// index outside [0, N), or indices of different buckets; decoding on
  /// demand, also for a file that cannot be read or decoded (naming it).
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
  /// batch_images when decoding on demand: decodes the images of `idx` as
  /// loading would have (float32, [-1, 1]).
  at::Tensor decode_batch(const std::vector<int64_t>& idx) const;
  /// Decodes candidates in parallel (at::parallel_for); failures go to skipped().
  static ImageCaptionDataset decode_all(std::vector<Candidate> candidates, int resolution, const std::string& source,
                                        const DatasetSelection& selection);

  int resolution_ = 0;
  int64_t listed_ = 0;
  bool on_demand_ = false;  // DatasetSelection::decode_on_demand
  // load_buckets only:
  std::vector<DatasetBucket> buckets_;
  std::vector<at::Tensor> bucket_images_;
  std::vector<int64_t> bucket_of_, row_in_bucket_;
  std::vector<ImageGeometry> geometry_;
  std::vector<bool> flip_;
  std::vector<int64_t> repeats_;
  std::vector<double> dropout_;
  std::vector<BucketReso> resolutions_;
  bool random_crop_ = false;
  double mean_ar_error_ = 0;
  std::vector<std::string> captions_;
  std::vector<std::string> paths_;
  at::Tensor images_;
  std::vector<SkippedImage> skipped_;
  CaptionStats caption_stats_;
  std::vector<DatasetWarning> warnings_;
};

/// The entries of one bucket for BatchSampler: dataset indices (an index may
/// repeat: kohya's num_repeats) and the batch size of the bucket.
struct SamplerBucket {
  std::vector<int64_t> samples;
  int64_t batch_size = 1;
};

/// The sampler buckets of a bucketed dataset (load_buckets): per bucket, each
/// of its images num_repeats times in a row, in the bucket's image order, with
/// its dataset's batch_size (as kohya's make_buckets fills its buckets).
std::vector<SamplerBucket> sampler_buckets(const ImageCaptionDataset& dataset);

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

  /// Bucketed order (kohya's BaseDataset.make_buckets / shuffle_buckets):
  /// each epoch, the same generator (seeded as above) first shuffles each
  /// bucket's entries (Fisher-Yates, bucket by bucket), the entries are cut
  /// into batches of the bucket's batch_size, and then, with more than one
  /// bucket, the list of all buckets' batches is shuffled; a batch never
  /// mixes buckets. `partial_batches` (kohya's behaviour): a bucket's last
  /// entries form a smaller batch (ceil(entries / batch_size) batches);
  /// otherwise they are not used that epoch (drop_last). With one bucket of
  /// [0, N), without partial batches, the order is that of the constructor
  /// above. Throws shoestring::Error if there is no bucket, a batch size is
  /// < 1, or no batch could be formed.
  BatchSampler(std::vector<SamplerBucket> buckets, uint64_t seed, bool partial_batches);

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

  /// Batches of an epoch: floor(dataset_size / batch_size); bucketed, the sum
  /// over buckets (ceil with partial batches, else floor).
  int64_t batches_per_epoch() const { return batches_per_epoch_; }
  /// The (largest) batch size.
  int64_t batch_size() const { return batch_size_; }
  /// Entries of an epoch (all buckets').
  int64_t dataset_size() const { return dataset_size_; }

  /// The permutation of [0, dataset_size) used by `epoch` (see the class
  /// comment; bucketed: the buckets' shuffled entries, bucket after bucket).
  std::vector<int64_t> epoch_permutation(int64_t epoch) const;
  /// Every batch of `epoch`, in order.
  std::vector<std::vector<int64_t>> epoch_batches(int64_t epoch) const;

 private:
  std::vector<SamplerBucket> buckets_;
  bool partial_batches_ = false;
  int64_t dataset_size_ = 0;
  int64_t batch_size_ = 0;
  int64_t batches_per_epoch_ = 0;
  uint64_t seed_;
  Position position_;
  int64_t cached_epoch_ = -1;
  std::vector<std::vector<int64_t>> batches_;
};

}  // namespace shoestring
