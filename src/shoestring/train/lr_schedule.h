// Learning-rate schedules, as in kohya sd-scripts / diffusers
// (`get_scheduler`): linear warmup for lr_warmup_steps, then constant or
// half-cosine decay to zero at max_train_steps.
#pragma once
#include <cstdint>
#include <string>

namespace shoestring {

/// Learning rate at optimizer step `step` (0-based: the first update uses step 0).
/// schedule: "constant" (warmup ignored, as in diffusers), "constant_with_warmup", or
/// "cosine" (warmup, then 0.5 * (1 + cos(pi * progress))). Returns base_lr * factor.
/// Throws shoestring::Error on an unknown schedule.
double learning_rate_at(const std::string& schedule, double base_lr, int64_t step, int64_t warmup_steps,
                        int64_t total_steps);

}  // namespace shoestring
