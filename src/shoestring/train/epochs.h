// Epochs as kohya's sd-scripts count them, the checkpoints they save, and
// which old checkpoints a run keeps (kohya's train_network.py and
// library/train_util.py: max_train_epochs, save_every_n_epochs,
// save_last_n_steps, save_last_n_epochs).
//
// An epoch is one pass of the batch sampler (data/dataset.h): its
// batches_per_epoch micro-batches, each image counted num_repeats times.
// kohya steps the optimizer ceil(batches / gradient_accumulation_steps) times
// per epoch (accelerate steps early at the end of the data loader); the
// shoestring loop always sums gradient_accumulation_steps micro-batches and
// the sampler runs on into the next epoch, so epoch e ends at optimizer step
// e x steps_per_epoch, the step count kohya gives it, and when batches are
// not a multiple of gradient_accumulation_steps the last step of an epoch
// also takes the first micro-batches of the next (the log says so).
//
// Pure functions here; the loop (train/trainer.cpp) asks SaveSchedule when to
// save, and remove_expired_checkpoints (train/run.h) applies
// expired_checkpoints to the run folder after each checkpoint is committed.
#pragma once
#include <cstdint>
#include <set>
#include <string>
#include <vector>

namespace shoestring {

/// kohya's num_update_steps_per_epoch (train_network.py): optimizer steps of
/// one epoch, ceil(batches_per_epoch / gradient_accumulation_steps).
/// `batches_per_epoch`: micro-batches of one pass of the sampler (>= 1).
/// Throws shoestring::Error when either argument is < 1.
int64_t steps_per_epoch(int64_t batches_per_epoch, int64_t gradient_accumulation_steps);

/// kohya's override of max_train_steps by max_train_epochs (train_network.py):
/// max_train_epochs x steps_per_epoch. Throws shoestring::Error for
/// epochs < 1 or steps_per_epoch < 1, or when the product overflows.
int64_t steps_for_epochs(int64_t max_train_epochs, int64_t steps_per_epoch);

/// When the loop saves a checkpoint, and why.
struct SaveSchedule {
  int64_t save_every_n_steps = 0;   ///< 0: no step cadence
  int64_t save_every_n_epochs = 0;  ///< 0: no epoch cadence
  int64_t steps_per_epoch = 1;      ///< steps_per_epoch(); >= 1
  int64_t max_train_steps = 1;      ///< the last step (always saved)

  /// The epoch (1-based) that optimizer step `step` ends, or 0 when it ends
  /// none (step is not a multiple of steps_per_epoch).
  int64_t epoch_ending_at(int64_t step) const;
  /// save_every_n_epochs: the epoch whose end `step` is and saves
  /// (epoch % save_every_n_epochs == 0, as kohya's (epoch + 1) %
  /// save_every_n_epochs), or 0. The run's last step is no epoch save, as
  /// kohya's (epoch + 1) < num_train_epochs: its checkpoint is the run's last
  /// (a step checkpoint), as kohya writes the last epoch as the final file.
  int64_t saved_epoch(int64_t step) const;
  /// save_every_n_steps, or the run's last step: a "step checkpoint" (what
  /// save_last_n_steps applies to).
  bool step_checkpoint(int64_t step) const;
  /// Whether `step` writes a checkpoint at all.
  bool due(int64_t step) const { return step_checkpoint(step) || saved_epoch(step) > 0; }
};

/// What a checkpoint folder was saved for (its TrainingCounters, train/checkpoint_io.h).
struct CheckpointRecord {
  int64_t step = 0;             ///< its optimizer step
  int64_t epoch_end = 0;        ///< the epoch it was saved at the end of (save_every_n_epochs), 0 = none
  bool step_checkpoint = true;  ///< saved by save_every_n_steps or as a run's last step
  bool run_last = false;        ///< saved as the last step of the invocation that wrote it
  bool superseded = false;      ///< removed whatever the policy (retention_view)
};

/// How retention sees `record` when this invocation's schedule is
/// `schedule` and its checkpoint of `current_step` was just written. A
/// checkpoint an earlier invocation saved as its last step (run_last), before
/// this one resumed with more steps or epochs and trained past it, is seen as
/// `schedule` would have saved it: an epoch checkpoint where
/// save_every_n_epochs saves its epoch, a step checkpoint where
/// save_every_n_steps saves its step, so that a resumed run keeps the
/// checkpoints one uninterrupted run would. Where neither saves it, this
/// run's last checkpoint supersedes it (as kohya overwrites its final file on
/// the next run): `superseded` once current_step is schedule.max_train_steps,
/// a step checkpoint until then. Any other record is returned unchanged.
CheckpointRecord retention_view(const CheckpointRecord& record, const SaveSchedule& schedule, int64_t current_step);

/// kohya's retention keys (0 = keep every checkpoint of that kind).
struct RetentionPolicy {
  /// Keep step checkpoints whose step is within the last N steps (step >=
  /// current - N), as kohya's get_remove_step_no removes, at each stepwise
  /// save, the checkpoint of step current - N - 1 rounded down to a multiple
  /// of save_every_n_steps.
  int64_t save_last_n_steps = 0;
  /// Keep the last N epoch checkpoints (by epoch, the current one included),
  /// as kohya's get_remove_epoch_no removes epoch current -
  /// save_every_n_epochs x N at each epoch save.
  int64_t save_last_n_epochs = 0;
};

/// The steps of the checkpoints in `existing` that retention removes once
/// the checkpoint of `current_step` is written and committed, ascending. A
/// checkpoint goes when every reason it was saved for has expired: as a step
/// checkpoint when save_last_n_steps > 0 and its step < current_step -
/// save_last_n_steps, as an epoch checkpoint when save_last_n_epochs > 0 and
/// save_last_n_epochs newer epoch checkpoints exist (a folder saved for both
/// reasons, which kohya writes as two files, stays while either keeps it).
/// A `superseded` record goes whatever the policy. Never removed:
/// `current_step` and every step of `protected_steps` (the checkpoint
/// latest.json names, which a resume needs), nor checkpoints after
/// current_step.
std::vector<int64_t> expired_checkpoints(const std::vector<CheckpointRecord>& existing, int64_t current_step,
                                         const RetentionPolicy& policy, const std::set<int64_t>& protected_steps);

}  // namespace shoestring
