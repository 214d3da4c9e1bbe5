// Model checkpoints and training state on disk.
//
// A run folder holds:
//   config.toml                      resolved configuration (every key)
//   metrics.jsonl                    one JSON object per optimizer step
//   samples/step-NNNNNN.png (+ .txt) sample grids with their prompts
//   checkpoints/step-NNNNNN/model.safetensors   weights (storage dtype) + metadata
//   checkpoints/step-NNNNNN/state.safetensors   optimizer state, EMA, RNG, counters (TrainingState)
//   (ZeRO stages 1-3 on several ranks, a sharded checkpoint: state.safetensors
//   holds no optimizer state and no EMA; instead
//   checkpoints/step-NNNNNN/optimizer-rank-RRRRR-of-WWWWW.safetensors  rank R's own tensors' state and EMA
//   checkpoints/step-NNNNNN/model-rank-RRRRR-of-WWWWW.safetensors  ZeRO stage 3: rank R's own streamed
//                                    weights (model.safetensors then holds the others)
//   checkpoints/step-NNNNNN/checkpoint.index.json  every tensor of the folder -> the file holding it)
//   checkpoints/latest.json          names the newest complete checkpoint
//   model.safetensors                final weights (EMA weights when EMA is on)
// A LoRA run adds lora.safetensors beside each model.safetensors; a LoRA run
// on a released architecture's pretrained file writes lora.safetensors only
// (its frozen base is reloaded from that file on resume).
// Every file is written atomically (temp, fsync, rename), and latest.json is
// written last, so a crash leaves the previous checkpoint as the latest.
//
// A sharded checkpoint (docs/training.md, "Checkpoints of several
// processes"): each rank writes its shard (the optimizer state of the
// tensors it owns, "optimizer.<param>.<state>", and their EMA shadows,
// "ema.<param>"; at ZeRO stage 3 also its model shard, the streamed
// weights it owns, which no other rank holds), the ranks agree that every
// shard is on disk (a collective), then rank 0 writes what every rank holds
// alike once (model.safetensors / lora.safetensors, state.safetensors with
// masters, RNG and counters), then the index, then latest.json. So the
// folder holds the model and the state once, not once per rank, and counts
// only when latest.json names it. A resume at any world size and zero stage
// (one process included) reads, through the index, the state (and EMA) of
// the tensors each rank owns then; a single-file checkpoint resumes into a
// sharded run the same way (its state.safetensors holds every optimizer and
// EMA tensor).
#pragma once
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>
#include <torch/nn/module.h>

namespace shoestring {

/// Named parameters and buffers of a module, in registration order. A
/// parameter stored as fp8 bytes (nn/fp8_storage.h) is given as its values in
/// bf16 (exact: fp8 value / power-of-two scale), a new tensor, so that no
/// file ever holds scaled fp8 bytes without their scale, or bytes labelled U8.
std::vector<std::pair<std::string, at::Tensor>> module_tensors(const torch::nn::Module& module);

/// Writes every parameter and buffer of `module` (in its storage dtype; fp8
/// bytes as bf16 values, see module_tensors), except those named in
/// `excluded` (ZeRO stage 3's streamed weights, in the ranks' model shards),
/// to a .safetensors file with string metadata. Throws shoestring::Error on
/// I/O failure.
void save_module(const std::string& path, const torch::nn::Module& module,
                 const std::map<std::string, std::string>& metadata, const std::set<std::string>& excluded = {});

/// Copies tensors from `tensors` into the module's parameters and buffers by
/// name, converting dtype to the module's (a parameter stored as fp8 bytes is
/// encoded with its own scale: values saved by save_module give back the
/// same bytes). Throws shoestring::Error listing
/// missing keys, unexpected keys and shape mismatches, or naming a parameter
/// that holds NaN / inf (`source` names the file).
void load_module(torch::nn::Module& module, const std::map<std::string, at::Tensor>& tensors,
                 const std::string& source);

/// Serializes libtorch's default CPU generator state (uint8 tensor) and restores it.
at::Tensor cpu_rng_state();
void set_cpu_rng_state(const at::Tensor& state);

/// Reads checkpoints/latest.json of a run folder; returns the checkpoint
/// folder path. Throws shoestring::Error when the run has no checkpoint.
std::string latest_checkpoint_dir(const std::string& run_dir);

/// Points checkpoints/latest.json at `checkpoint_dir` (atomic write).
void set_latest_checkpoint(const std::string& run_dir, const std::string& checkpoint_dir, int64_t step);

/// The index of a sharded checkpoint folder.
inline constexpr const char* kCheckpointIndexFile = "checkpoint.index.json";

/// "optimizer-rank-RRRRR-of-WWWWW.safetensors": rank `rank`'s optimizer
/// shard in a checkpoint of a `world`-rank run.
std::string optimizer_shard_name(int rank, int world);
/// True for a name optimizer_shard_name gives (any rank and world).
bool is_optimizer_shard_name(const std::string& name);
/// "model-rank-RRRRR-of-WWWWW.safetensors": rank `rank`'s model shard (ZeRO
/// stage 3: the streamed weights it owns) in a checkpoint of a `world`-rank run.
std::string model_shard_name(int rank, int world);
/// True for a name model_shard_name gives (any rank and world).
bool is_model_shard_name(const std::string& name);
/// True for the files of a checkpoint folder that hold model tensors under
/// their own names: model.safetensors and the model shards.
bool is_checkpoint_model_file(const std::string& name);

/// Writes one rank's optimizer shard: `optimizer` ("<param>.<state>"
/// tensors) as "optimizer.<param>.<state>", when the EMA is sharded the
/// rank's EMA shadows `ema` ("<param>") as "ema.<param>", and the fp32
/// master weights it keeps `master` ("<param>", fp32) as "master.<param>"
/// (the name state.safetensors gives them in one process), with metadata
/// "rank", "world_size", "step" and (when not empty) "run_id" (atomic).
/// Throws shoestring::Error on I/O failure.
void save_optimizer_shard(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& optimizer,
                          const std::vector<std::pair<std::string, at::Tensor>>& ema, int rank, int world, int64_t step,
                          const std::string& run_id = "",
                          const std::vector<std::pair<std::string, at::Tensor>>& master = {});

/// Writes one rank's model shard: `weights` (the streamed parameters it
/// owns, under their module names, in their storage dtype) with metadata
/// as save_optimizer_shard's (atomic). Throws shoestring::Error on I/O
/// failure.
void save_model_shard(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& weights, int rank,
                      int world, int64_t step, const std::string& run_id = "");

/// Writes `dir`/checkpoint.index.json (atomic), after the files it names are
/// complete: {"format": "shoestring.sharded_checkpoint", "version": 1,
/// "step", "world_size", "zero_stage", "files": {file: {"bytes", "rank"}},
/// "weight_map": {tensor: file}}: model.safetensors and lora.safetensors
/// (when present) and state.safetensors (rank 0), the `world` optimizer
/// shards (their rank) and, at `zero_stage` 3 with a model.safetensors (a
/// full fine-tune), the `world` model shards, every tensor of each (the
/// weight_map of a Hugging Face index, so WeightFiles opens it). Removes
/// the shards an interrupted save left in `dir` that are not this
/// checkpoint's: of another world size, and model shards below stage 3. Throws
/// shoestring::Error naming the file that is missing or invalid, or a tensor
/// name two files hold.
void write_checkpoint_index(const std::string& dir, int64_t step, int world, int zero_stage);

/// Removes checkpoint.index.json and every optimizer and model shard from checkpoint
/// folder `dir` (left there by an interrupted sharded save of the same step)
/// before a single-file checkpoint is written into it, so that the folder
/// is read as what it now holds. Throws shoestring::Error naming a file
/// that cannot be removed.
void remove_sharded_files(const std::string& dir);

/// What a checkpoint index says (read_checkpoint_index).
struct CheckpointIndex {
  int64_t step = 0;
  int world_size = 1;
  int zero_stage = 0;
  std::map<std::string, std::string> weight_map;  ///< tensor -> file (relative to the folder)
};

/// Reads `dir`/checkpoint.index.json; nullopt when the folder has none (a
/// single-file checkpoint). Throws shoestring::Error naming the index when
/// it is not JSON or lacks a field, or names a file outside the folder or
/// missing from it, and naming an optimizer or model shard whose metadata
/// (step, rank, world size) is not the index's, or a shard or
/// model.safetensors whose "run_id" metadata is not state.safetensors'
/// (a file of another run; checked where the state has one). Without an
/// index, throws naming a shard the folder holds (a save interrupted
/// before its index, or a damaged folder). Without `optimizer_shards`
/// (to read the model alone: consolidate) the optimizer shards are not
/// looked at.
std::optional<CheckpointIndex> read_checkpoint_index(const std::string& dir, bool optimizer_shards = true);

/// The model held by a checkpoint folder (read_checkpoint_model).
struct CheckpointModel {
  /// Every model tensor, mapped (nothing read until used), file by file in
  /// each file's data order: model.safetensors, then (ZeRO stage 3) the
  /// ranks' model shards by rank.
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  std::map<std::string, std::string> metadata;  ///< model.safetensors' (not a shard's)
  std::vector<std::string> files;               ///< the files read, relative to the folder
  std::string source;                           ///< the path to name in errors: the index or model.safetensors
  bool sharded = false;                         ///< read through checkpoint.index.json
};

/// The model of checkpoint folder `dir`: through its index when sharded
/// (every file the index maps a model tensor to: model.safetensors and the
/// model shards, each holding exactly what the index maps to it, and every
/// rank's model shard or, older checkpoints, none), else model.safetensors.
/// The optimizer shards are not read (a checkpoint that lost one still
/// gives its model). Throws shoestring::Error naming the folder or file:
/// what read_checkpoint_index throws, a model file the index does not
/// match, a model shard the index leaves out, an unreadable file.
CheckpointModel read_checkpoint_model(const std::string& dir);

/// Throws shoestring::Error when `path` is the model.safetensors of a
/// checkpoint folder whose index maps weights to model shards (ZeRO stage
/// 3): that file alone holds only the weights that do not stream. The
/// message names the index to give instead and the `consolidate` command;
/// `command` ("sample", "convert") starts it. Nothing for any other path.
void refuse_partial_checkpoint_model(const std::string& path, const std::string& command);

/// The counters of a run that a resume restores: what the loop has done so
/// far and the state of its fp16 machinery. Stored as the JSON
/// "training_state" metadata of state.safetensors under the names given.
struct TrainingCounters {
  int64_t step = 0;                           ///< "step": optimizer steps taken (the checkpoint's step)
  int64_t optimizer_step_count = 0;           ///< "optimizer_step_count": the optimizer's own count (bias correction)
  int64_t data_epoch = 0;                     ///< "data_epoch": BatchSampler position of the next batch
  int64_t data_index = 0;                     ///< "data_index"
  int64_t micro_steps = 0;                    ///< "micro_steps": micro-batches run (forward + backward passes)
  int64_t images_seen = 0;                    ///< "images_seen"
  int64_t skipped_steps = 0;                  ///< "skipped_steps": non-finite steps skipped
  int64_t consecutive_nonfinite = 0;          ///< "consecutive_nonfinite": skipped steps in a row (divergence guard)
  double elapsed_seconds = 0;                 ///< "elapsed_seconds": wall time of the steps so far
  std::optional<double> loss_scale;           ///< "loss_scale": fp16 dynamic loss scale (null without fp16)
  int64_t loss_scale_growth_tracker = 0;      ///< "loss_scale_growth_tracker": clean steps since the last change
  std::vector<std::string> precision_upcast;  ///< "precision_upcast": blocks the overflow guard moved to fp32
  std::optional<double> fused_previous_grad_norm;  ///< "fused_previous_grad_norm": fused clipping's last norm
  /// The shape of the global batch when the checkpoint was written (absent
  /// from older files: 0 = unknown): "world_size" ranks x
  /// "train_batch_size" x "gradient_accumulation_steps".
  int64_t world_size = 0;
  int64_t train_batch_size = 0;
  int64_t gradient_accumulation_steps = 0;
  /// What the checkpoint was saved for (train/epochs.h, CheckpointRecord), read
  /// by retention: "epoch_end", the epoch save_every_n_epochs saved it at the
  /// end of (0 = none), and "step_checkpoint", saved by save_every_n_steps or
  /// as the run's last step (older files: true), and "run_last", saved as
  /// the last step of the invocation that wrote it (older files: false).
  int64_t epoch_end = 0;
  bool step_checkpoint = true;
  bool run_last = false;
  /// "run_id": random, drawn when a run starts fresh and kept by its
  /// resumes; its checkpoint shards carry it, so a shard of another run is
  /// refused (read_checkpoint_index). Empty in older files (not checked).
  std::string run_id;
};

/// Everything state.safetensors holds: the counters and the optimizer, EMA
/// and fp32-master tensors (names without their
/// "optimizer." / "ema." / "master." prefix) and libtorch's CPU generator state.
struct TrainingState {
  TrainingCounters counters;
  std::vector<std::pair<std::string, at::Tensor>> optimizer;
  std::vector<std::pair<std::string, at::Tensor>> ema;
  std::vector<std::pair<std::string, at::Tensor>> master;
  at::Tensor rng_cpu;  ///< uint8, cpu_rng_state()
};

/// Writes `state` to `path` (atomic): tensors "optimizer.<name>", "ema.<name>",
/// "master.<name>", "rng.cpu", and the counters as JSON metadata
/// "training_state". Throws shoestring::Error on I/O failure.
void save_training_state(const std::string& path, const TrainingState& state);

/// Reads a file written by save_training_state. "step",
/// "optimizer_step_count", "data_epoch" and "data_index" are required; other
/// counters missing from older files keep their defaults. Throws
/// shoestring::Error naming the file: unreadable, no or invalid
/// "training_state" metadata, a missing required counter, a tensor outside
/// the four groups, or no "rng.cpu".
TrainingState load_training_state(const std::string& path);

/// The counters of a file written by save_training_state, from its header
/// alone (no tensor is read). Throws shoestring::Error as load_training_state
/// for the metadata.
TrainingCounters load_training_counters(const std::string& path);

}  // namespace shoestring
