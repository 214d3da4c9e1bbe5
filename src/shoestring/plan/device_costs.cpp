#include "shoestring/plan/device_costs.h"

#include <fmt/format.h>

#include "shoestring/core/error.h"
#include "shoestring/core/memory_ledger.h"
#include "shoestring/core/units.h"

namespace shoestring::plan {

CudaFixedCosts cuda_fixed_costs(int64_t resident_tensors) {
  if (resident_tensors < 0) fail("plan: resident tensor count must be >= 0 (got {})", resident_tensors);
  CudaFixedCosts c;
  c.rounding_bytes = resident_tensors * (kCudaBlockBytes / 2);
  c.workspace_bytes = kCudaBlasWorkspaceBytes;
  return c;
}

void add_cuda_fixed_costs(MemoryPlan& plan) {
  const CudaFixedCosts c = cuda_fixed_costs(plan.resident_tensors);
  plan.at_peak[static_cast<int>(MemoryCategory::temporaries)] += c.total();
  plan.predicted_peak_bytes += c.total();
  plan.first_step_peak_bytes += c.total();
  plan.device_fixed_bytes += c.total();
  plan.notes.push_back(fmt::format(
      "CUDA: includes the caching allocator's 512-byte rounding of {} resident tensors ({}) and the cuBLAS "
      "workspaces ({}); excludes the CUDA context and library handles (outside the allocator, driver-dependent) "
      "and unused segment tails (reserved beyond allocated)",
      plan.resident_tensors, format_bytes(c.rounding_bytes), format_bytes(c.workspace_bytes)));
}

}  // namespace shoestring::plan
