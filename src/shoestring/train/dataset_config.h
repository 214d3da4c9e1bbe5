// The datasets a run trains on, as kohya's sd-scripts describe them: the
// dataset TOML (`dataset_config`: [general], [[datasets]],
// [[datasets.subsets]]; kohya's library/config_util.py), the fine-tuning
// metadata JSON (`in_json`), or the main config's train_data_dir with the
// bucket keys. Each key of the dataset TOML is declared once here (level,
// type, meaning); docs/config.md lists them (config_reference_markdown).
#pragma once
#include <string>
#include <vector>

#include "shoestring/data/dataset.h"
#include "shoestring/train/config.h"

namespace shoestring {

/// True when `config` trains on kohya datasets (ImageCaptionDataset::load_buckets):
/// dataset_config or in_json set, or enable_bucket, flip_aug, random_crop,
/// caption_extension or dataset_repeats away from their defaults. Otherwise
/// the run loads train_data_dir square (ImageCaptionDataset::load).
bool uses_kohya_datasets(const TrainConfig& config);

/// The datasets of `config`. With dataset_config: the TOML's datasets, each
/// key resolved as kohya resolves it (subset, then dataset, then [general],
/// then the main config: resolution, train_batch_size as batch_size,
/// enable_bucket, min_bucket_reso, max_bucket_reso, bucket_reso_steps,
/// bucket_no_upscale, caption_extension, dataset_repeats as num_repeats,
/// flip_aug, random_crop, shuffle_caption, keep_tokens, caption_dropout_rate,
/// caption_tag_dropout_rate; then kohya's defaults). Paths expand as
/// expand_path and are taken from the working directory, as kohya takes them.
/// Else one dataset of train_data_dir (recursive, as load_folder) with
/// in_json as its metadata file when set.
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
