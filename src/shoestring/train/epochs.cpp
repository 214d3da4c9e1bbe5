// Epoch arithmetic and checkpoint retention. See epochs.h.
#include "shoestring/train/epochs.h"

#include <algorithm>
#include <functional>
#include <limits>

#include "shoestring/core/error.h"

namespace shoestring {

int64_t steps_per_epoch(int64_t batches_per_epoch, int64_t gradient_accumulation_steps) {
  if (batches_per_epoch < 1) fail("steps per epoch: an epoch needs at least one batch, got {}", batches_per_epoch);
  if (gradient_accumulation_steps < 1)
    fail("steps per epoch: gradient_accumulation_steps must be >= 1, got {}", gradient_accumulation_steps);
  return (batches_per_epoch + gradient_accumulation_steps - 1) / gradient_accumulation_steps;
}

int64_t steps_for_epochs(int64_t max_train_epochs, int64_t steps_per_epoch) {
  if (max_train_epochs < 1) fail("max_train_epochs must be >= 1, got {}", max_train_epochs);
  if (steps_per_epoch < 1) fail("steps per epoch must be >= 1, got {}", steps_per_epoch);
  if (max_train_epochs > std::numeric_limits<int64_t>::max() / steps_per_epoch)
    fail("max_train_epochs = {} x {} steps per epoch overflows", max_train_epochs, steps_per_epoch);
  return max_train_epochs * steps_per_epoch;
}

int64_t SaveSchedule::epoch_ending_at(int64_t step) const {
  if (steps_per_epoch < 1 || step < 1 || step % steps_per_epoch != 0) return 0;
  return step / steps_per_epoch;
}

int64_t SaveSchedule::saved_epoch(int64_t step) const {
  if (save_every_n_epochs < 1 || step >= max_train_steps) return 0;
  const int64_t epoch = epoch_ending_at(step);
  return epoch > 0 && epoch % save_every_n_epochs == 0 ? epoch : 0;
}

bool SaveSchedule::step_checkpoint(int64_t step) const {
  return step == max_train_steps || (save_every_n_steps > 0 && step % save_every_n_steps == 0);
}

CheckpointRecord retention_view(const CheckpointRecord& record, const SaveSchedule& schedule, int64_t current_step) {
  if (!record.run_last || record.step >= schedule.max_train_steps) return record;
  CheckpointRecord seen = record;
  seen.run_last = false;
  seen.epoch_end = schedule.saved_epoch(record.step);
  seen.step_checkpoint = schedule.save_every_n_steps > 0 && record.step % schedule.save_every_n_steps == 0;
  if (seen.epoch_end == 0 && !seen.step_checkpoint) {
    seen.step_checkpoint = true;
    seen.superseded = current_step >= schedule.max_train_steps;
  }
  return seen;
}

std::vector<int64_t> expired_checkpoints(const std::vector<CheckpointRecord>& existing, int64_t current_step,
                                         const RetentionPolicy& policy, const std::set<int64_t>& protected_steps) {
  // The epochs of the epoch checkpoints up to the current one, newest first:
  // the first save_last_n_epochs of them are kept.
  std::vector<int64_t> epochs;
  for (const CheckpointRecord& r : existing) {
    if (r.epoch_end > 0 && r.step <= current_step) epochs.push_back(r.epoch_end);
  }
  std::sort(epochs.begin(), epochs.end(), std::greater<>());
  epochs.erase(std::unique(epochs.begin(), epochs.end()), epochs.end());
  const int64_t oldest_kept_epoch =
      policy.save_last_n_epochs > 0 && static_cast<int64_t>(epochs.size()) > policy.save_last_n_epochs
          ? epochs[static_cast<size_t>(policy.save_last_n_epochs - 1)]
          : 0;

  std::vector<int64_t> out;
  for (const CheckpointRecord& r : existing) {
    if (r.step >= current_step || protected_steps.count(r.step)) continue;
    if (r.superseded) {
      out.push_back(r.step);
      continue;
    }
    if (!r.step_checkpoint && r.epoch_end == 0) continue;  // saved for no reason we know: kept
    const bool step_expired =
        !r.step_checkpoint || (policy.save_last_n_steps > 0 && r.step < current_step - policy.save_last_n_steps);
    const bool epoch_expired = r.epoch_end == 0 || (oldest_kept_epoch > 0 && r.epoch_end < oldest_kept_epoch);
    if (step_expired && epoch_expired) out.push_back(r.step);
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace shoestring
