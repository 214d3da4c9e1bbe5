#include "shoestring/train/lr_schedule.h"

#include <algorithm>
#include <cmath>

#include "shoestring/core/error.h"

namespace shoestring {

double learning_rate_at(const std::string& schedule, double base_lr, int64_t step, int64_t warmup_steps,
                        int64_t total_steps) {
  if (schedule == "constant") return base_lr;
  if (schedule != "constant_with_warmup" && schedule != "cosine") {
    fail("lr_scheduler: unknown schedule \"{}\" (expected constant, constant_with_warmup, cosine)", schedule);
  }
  if (step < warmup_steps) {
    return base_lr * static_cast<double>(step) / static_cast<double>(std::max<int64_t>(1, warmup_steps));
  }
  if (schedule == "constant_with_warmup") return base_lr;
  double progress =
      static_cast<double>(step - warmup_steps) / static_cast<double>(std::max<int64_t>(1, total_steps - warmup_steps));
  progress = std::clamp(progress, 0.0, 1.0);
  return base_lr * 0.5 * (1.0 + std::cos(M_PI * progress));
}

}  // namespace shoestring
