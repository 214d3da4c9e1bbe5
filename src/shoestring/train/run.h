// A training run, set up: what train() (trainer.cpp) works on.
//
// setup_run turns a config into a Run, in this order: the run folder (refusing
// to overwrite another run, checking a resume against the run's own config),
// the dataset and batch sampler, the model family (train/training_model.h)
// with its base weights, the precision policy applied to it (storage dtypes,
// trainable modules, per-block compute and checkpointing, the fp16 overflow
// guard), LoRA adapters, the gradient path with its optimizer
// (optim/gradient_path.h), EMA, and, when resuming, the latest checkpoint.
// write_checkpoint / commit_checkpoint / restore_checkpoint write, publish
// and read a run's checkpoints
// (the formats are in train/checkpoint_io.h); save_final_files writes the
// run's final model (EMA weights when EMA is on) and LoRA files.
#pragma once
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "shoestring/data/dataset.h"
#include "shoestring/dist/data_parallel.h"
#include "shoestring/dist/process_group.h"
#include "shoestring/dist/zero.h"
#include "shoestring/io/atomic_file.h"
#include "shoestring/nn/lora.h"
#include "shoestring/optim/grad_hooks.h"
#include "shoestring/optim/gradient_path.h"
#include "shoestring/precision/overflow.h"
#include "shoestring/train/block_streaming.h"
#include "shoestring/train/checkpoint_io.h"
#include "shoestring/train/config.h"
#include "shoestring/train/ema.h"
#include "shoestring/train/epochs.h"
#include "shoestring/train/trainer.h"
#include "shoestring/train/training_model.h"

namespace shoestring {

/// Removes a folder on destruction if it is empty and was created by this
/// run (a run that fails before writing anything leaves nothing behind).
/// A file named `ignored` does not count: it goes with the folder.
struct RemoveIfEmpty {
  std::string dir;
  bool armed = false;
  std::string ignored;
  ~RemoveIfEmpty();
};

/// The run folder's lock file: one process trains in a run folder at a time.
inline constexpr const char* kRunLockFile = ".shoestring.lock";

/// Everything the loop needs, built once by setup_run.
struct Run {
  RemoveIfEmpty created_dir;         ///< first member: checked after everything else is gone
  std::unique_ptr<FolderLock> lock;  ///< on run_dir/kRunLockFile, held while the run is set up and trains
  TrainConfig config;
  /// The other processes of a data-parallel run (launched by torchrun or
  /// `shoestring launch`, dist/launch_env.h); null for a single process.
  /// Rank 0 alone writes the run folder. Declared before everything that
  /// may hold a collective in flight (the gradient path's fused buckets,
  /// the reducer's, ZeRO's), so that it is destroyed after them: a pending
  /// collective's destructor waits on the group.
  std::unique_ptr<dist::ProcessGroup> group;
  std::string run_dir;
  std::string resume_from;  ///< checkpoint folder resumed from ("" for a fresh run)
  ImageCaptionDataset dataset;
  std::unique_ptr<BatchSampler> sampler;
  std::unique_ptr<TrainingModel> model;
  nn::LoraNetwork network{nullptr};  ///< set when network_module = "networks.lora" (then the only trainable part)
  std::vector<std::pair<std::string, at::Tensor>> trainable;
  int64_t trainable_parameters = 0;
  std::shared_ptr<precision::OverflowMonitor> overflow;  ///< fp16 compute or storage only
  PostAccumulateGradHooks ledger_hooks;                  ///< charge gradients to the ledger as autograd makes them
  std::unique_ptr<GradientPath> gradients;               ///< owns the optimizer
  std::unique_ptr<EMA> ema;
  TrainingCounters counters;
  /// Optimizer steps of one epoch of `sampler` (train/epochs.h, kohya's
  /// ceil(batches / gradient_accumulation_steps)): where epochs end.
  int64_t steps_per_epoch = 1;
  nlohmann::json predicted_memory;  ///< TrainRunOptions::predict_memory's answer (null without one)
  int threads = 0;
  size_t precision_rules = 0;
  /// What the blocks compute in, for the log: "fp32", "bf16", "fp32 (bf16 asked; <reason>)", "fp32 / bf16".
  std::string compute_summary;
  std::string compute_note;  ///< "; bf16 compute runs as fp32: <reason>" for the log, "" without substitution
  /// Where the module tree, gradients, optimizer state, EMA and masters live
  /// (config `device`, resolved); the dataset and caches stay in host memory.
  c10::Device device{c10::kCPU};
  std::string device_note;  ///< why the compute dtype was changed for the device ("" when it was not)
  /// With `group` at zero_stage = 0: sums the step's gradients (each rank's share of the mean) on every rank.
  std::unique_ptr<dist::GradientReducer> gradient_reducer;
  /// Tell `gradient_reducer` each gradient's arrival, so its all-reduces overlap backward.
  PostAccumulateGradHooks reducer_hooks;
  /// With `group` at zero_stage = 1, 2 or 3 (dist/zero.h): which rank owns each
  /// trainable tensor (its optimizer updates and keeps state for those
  /// only), the reduction of the gradients, the broadcast of the updated weights.
  std::unique_ptr<dist::ZeroSharding> zero;
  /// zero_stage = 3 (the checkpointed blocks whose weights `zero` shards) or
  /// offload_params (their weights in host memory): fetched and released
  /// around each use (train/block_streaming.h); null otherwise.
  std::shared_ptr<RunBlockStreaming> block_streaming;

  int rank() const { return group ? group->rank() : 0; }
  int world_size() const { return group ? group->size() : 1; }
  /// This process writes the run folder, checkpoints, samples and logs (rank 0).
  bool writes_files() const { return rank() == 0; }

  /// A LoRA run whose frozen base comes back from the pretrained file: its
  /// checkpoints and final output hold the adapters only (as kohya's).
  bool lora_only() const { return network && model->base_reloadable(); }
};

/// Sets up (or resumes, with options.resume_dir) the run `config` describes,
/// as one rank of a data-parallel run when the launch environment says so
/// (dist/launch_env.h: joins the process group first, within ddp_timeout;
/// every rank then prepares each whole global batch and trains on its own
/// rows, rank 0's trainable weights are copied to the others, and only rank 0
/// touches the run folder),
/// writes config.toml and starts or truncates metrics.jsonl; see the file
/// comment for the order. Locks the run folder (a second process training
/// there is refused), removes the temporaries that interrupted saves left in
/// it, and starts a resumed run without a checkpoint over. Throws shoestring::Error for an output_dir holding
/// another run, a resume whose config differs in what the checkpoint depends
/// on or whose step count is reached, and whatever loading the dataset,
/// model or checkpoint throws.
std::unique_ptr<Run> setup_run(const TrainConfig& config, const TrainRunOptions& options);

/// Sets the run's max_train_steps to `steps` (the time budget's sizing,
/// train/time_budget.h; with several ranks rank 0's, which every rank
/// passes), and on the rank that writes files logs `why` and rewrites the
/// run's config.toml, so that `--resume` goes on to the same last step
/// (max_train_epochs, which would size it again, is cleared). Throws
/// shoestring::Error on I/O failure.
void set_max_train_steps(Run& run, int64_t steps, const std::string& why);

/// When `run` saves checkpoints (train/epochs.h): its save_every_n_steps,
/// save_every_n_epochs, steps_per_epoch and max_train_steps.
SaveSchedule save_schedule(const Run& run);

/// Retention (save_last_n_steps, save_last_n_epochs; train/epochs.h,
/// expired_checkpoints), called on rank 0 after the checkpoint of `step` is
/// committed: removes the checkpoints/step-NNNNNN folders whose reasons to be
/// kept have expired, as their state.safetensors counters record them
/// (epoch_end, step_checkpoint), never that of `step` nor the one
/// latest.json names. A folder is first renamed to .step-NNNNNN.removing,
/// then removed, so an interrupted removal never leaves a torn step-NNNNNN
/// folder; leftovers of one are removed at the next call. Folders whose
/// state cannot be read are kept. Failures are warnings: training goes on.
void remove_expired_checkpoints(Run& run, int64_t step);

/// True when `run`'s checkpoints are sharded (ZeRO stage 1 or 2 on several
/// ranks; train/checkpoint_io.h): each rank writes its optimizer shard.
bool shards_checkpoints(const Run& run);

/// True when `run`'s EMA is sharded with its parameters (ZeRO on several
/// ranks: EMA's owned mask): each rank keeps, and writes into its checkpoint
/// shard, the shadows of the tensors it owns; samples and final files need
/// them swapped in and gathered by every rank (train/trainer.cpp).
bool shards_ema(const Run& run);

/// True when the streamed weights of `run` reach rank 0 through files, not
/// a gather, for checkpoints, samples and final files: ZeRO stage 3 on
/// several ranks (a LoRA network is refused there). Each rank writes the
/// streamed weights it owns (a checkpoint's model shard); rank 0 maps the
/// others' files. So no rank ever holds the whole model in its memory: the
/// mapped pages are the page cache's, which the kernel can drop.
bool streams_weights_through_files(const Run& run);

/// Every rank of a sharded run (nothing otherwise): writes this rank's
/// optimizer shard (and, when streams_weights_through_files, its model
/// shard) into checkpoints/step-NNNNNN/, then learns from every rank
/// whether theirs is on disk (a collective), so that rank 0 indexes the
/// checkpoint (write_checkpoint) only when all are. Returns the folder
/// (empty when not sharded). Throws shoestring::Error on every rank naming
/// the ranks that failed (and this rank's own I/O error), and as the
/// collective when a peer died.
std::string write_checkpoint_shards(Run& run, int64_t step);

/// When streams_weights_through_files, on every rank: makes every streamed
/// weight present on rank 0 (dist::ZeroSharding::hold_on, ended by
/// release_held) from the model shards of `checkpoint_dir` (this step's,
/// from write_checkpoint_shards) or, when that is empty, from the files
/// every rank first writes into RUN_DIR/.streamed-weights/ (collective, as
/// write_checkpoint_shards). Returns that scratch folder (empty when the
/// checkpoint's shards served) for remove_streamed_weights. Throws as
/// write_checkpoint_shards, and shoestring::Error naming a shard that
/// cannot be read (a missing one: the ranks do not share the run folder),
/// having removed the scratch files first.
std::string hold_streamed_weights_on_rank_zero(Run& run, int64_t step, const std::string& checkpoint_dir);

/// Removes what hold_streamed_weights_on_rank_zero wrote into `scratch`
/// (nothing for ""): every rank its own file, rank 0 the folder; a failure
/// is a warning. Call on every rank once rank 0 is done with the files.
void remove_streamed_weights(const Run& run, const std::string& scratch);

/// Rank 0 (one process: the process): writes checkpoints/step-NNNNNN/
/// (weights or LoRA adapters, and the training state, with the whole
/// optimizer state, or, for a sharded run, after write_checkpoint_shards:
/// the state every rank holds alike, then checkpoint.index.json) and
/// returns the folder; latest.json does not move yet. A failed save leaves
/// no empty folder. Throws shoestring::Error on I/O failure.
std::string write_checkpoint(Run& run, int64_t step);

/// Points checkpoints/latest.json at checkpoint folder `dir` of `step`
/// (one atomic write): the moment the checkpoint counts for --resume.
/// Throws shoestring::Error on I/O failure.
void commit_checkpoint(Run& run, const std::string& dir, int64_t step);

/// Restores weights, optimizer, gradient-path state, EMA, RNG, data position
/// and counters from checkpoint folder `dir` (single-file or sharded, of any
/// world size and zero stage: each rank keeps the optimizer state of the
/// tensors it owns now); returns its step. A global batch (world x
/// train_batch_size x gradient_accumulation_steps) other than the
/// checkpoint's is logged as a warning naming both. Throws
/// shoestring::Error naming the file for missing or mismatching contents.
int64_t restore_checkpoint(Run& run, const std::string& dir);

/// Writes the final model.safetensors (EMA weights swapped in when EMA is
/// on; adapters only for lora_only runs) and lora.safetensors, in
/// save_precision. A save_precision the range guard refuses is replaced by
/// the storage dtype, with a warning saying how to narrow. Throws
/// shoestring::Error on I/O failure.
void save_final_files(Run& run, int64_t step);

/// Draws the sample grid of `step` (EMA weights when EMA is on) into
/// samples/step-NNNNNN.png and returns its path. Throws what sampling or
/// writing throws.
std::string write_samples(Run& run, int64_t step);

}  // namespace shoestring
