// The datasets a run trains on, as kohya's sd-scripts describe them: the
// dataset TOML (`dataset_config`: [general], [[datasets]],
// [[datasets.subsets]]; kohya's library/config_util.py), the fine-tuning
// metadata JSON (`in_json`), or the main config's train_data_dir with the
// bucket keys. Each key of the dataset TOML is declared once here (level,
// type, meaning); docs/config.md lists them (config_reference_markdown).
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "shoestring/data/dataset.h"
#include "shoestring/train/config.h"

namespace shoestring {

/// kohya's DreamBooth folder name "<repeats>_<class tokens>", as
/// library/config_util.py's generate_dreambooth_subsets_config_by_subdirs
/// (extract_dreambooth_params) reads it.
struct RepeatsFolderName {
  int64_t num_repeats = 0;   ///< the leading number
  std::string class_tokens;  ///< the rest after the first '_' ("" for a name of digits only)
};

/// Parses a folder name as kohya splits it: name.split("_"), the first part
/// the repeats, the others joined by '_' the class tokens ("10_sks dog" ->
/// 10, "sks dog"; "10_sks_dog" -> 10, "sks_dog"; "3" -> 3, ""). The repeats
/// must be decimal digits only (kohya's int() also takes a sign or spaces).
/// nullopt when the name does not start so (kohya ignores such a folder with
/// a warning; shoestring refuses it, see dataset_specs). Throws
/// shoestring::Error naming the folder for repeats above 1e6 (num_repeats' range).
std::optional<RepeatsFolderName> parse_repeats_folder_name(const std::string& name);

/// True when `dir` (an existing folder) has a subfolder, not hidden, whose
/// name parse_repeats_folder_name reads: kohya's DreamBooth layout of
/// train_data_dir. False for anything else, a missing `dir` included.
bool has_repeats_folders(const std::string& dir);

/// True when `config` trains on kohya datasets (ImageCaptionDataset::load_buckets):
/// dataset_config or in_json set, enable_bucket, flip_aug, random_crop,
/// caption_extension or dataset_repeats away from their defaults, or a
/// train_data_dir in kohya's DreamBooth layout (has_repeats_folders).
/// Otherwise the run loads train_data_dir square (ImageCaptionDataset::load).
bool uses_kohya_datasets(const TrainConfig& config);

/// The datasets of `config`. With dataset_config: the TOML's datasets, each
/// key resolved as kohya resolves it (subset, then dataset, then [general],
/// then the main config: resolution, train_batch_size as batch_size,
/// enable_bucket, min_bucket_reso, max_bucket_reso, bucket_reso_steps,
/// bucket_no_upscale, caption_extension, dataset_repeats as num_repeats,
/// flip_aug, random_crop, shuffle_caption, keep_tokens, caption_dropout_rate,
/// caption_tag_dropout_rate; then kohya's defaults). Paths expand as
/// expand_path and are taken from the working directory, as kohya takes them.
/// Else one dataset of train_data_dir: with in_json, its metadata file;
/// without, in kohya's DreamBooth layout (has_repeats_folders), one subset
/// per subfolder "<repeats>_<class tokens>" (its own files, not recursive,
/// num_repeats and class_tokens from the name, in name order; kohya's
/// generate_dreambooth_subsets_config_by_subdirs), else one subset of the
/// whole folder (recursive, as load_folder). In that layout a subfolder of
/// another name, an image directly in train_data_dir (kohya ignores both) or
/// dataset_repeats away from 1 (the names give the repeats) are errors
/// naming the folder / file and the expected form.
/// Throws shoestring::Error naming the file, the table
/// (datasets[i].subsets[j]) and the key: unreadable file, TOML syntax error,
/// unknown key (with the nearest valid one), a kohya key shoestring does not
/// implement, a key at a level where kohya does not take it, wrong type or
/// range, a subset without image_dir / metadata_file, a dataset mixing
/// fine-tuning and DreamBooth subsets, and dataset_config given together with
/// in_json or a train_data_dir away from its default.
std::vector<DatasetSpec> dataset_specs(const TrainConfig& config);

/// Same, from TOML text (`source_name` in messages), for tests.
std::vector<DatasetSpec> parse_dataset_config(const std::string& toml_text, const std::string& source_name,
                                              const TrainConfig& config);

/// Markdown table of the dataset TOML's keys: key, where it may be written
/// ([general], [[datasets]], [[datasets.subsets]]), default, meaning.
std::string dataset_config_reference_markdown();

}  // namespace shoestring
