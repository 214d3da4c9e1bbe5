// `shoestring consolidate RUN_DIR/checkpoints/step-N OUT.safetensors [--dtype keep|fp32|bf16|fp16] [--force] [--ema]`
//
// The model of one checkpoint of a run (single-file, or sharded by several
// ZeRO ranks) as one .safetensors file in the model's own key layout,
// streamed tensor by tensor (train/consolidate.h); narrowing goes through
// the save-time range guard.
#include <iostream>
#include <memory>
#include <string>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "shoestring/cli/commands.h"
#include "shoestring/core/error.h"
#include "shoestring/core/units.h"
#include "shoestring/precision/save_guard.h"
#include "shoestring/train/consolidate.h"

namespace shoestring::cli {

namespace {

struct ConsolidateArgs {
  std::string checkpoint, out, dtype = "keep";
  bool force = false, ema = false;
};

void run_consolidate(const ConsolidateArgs& a) {
  ConsolidateOptions o;
  if (a.dtype != "keep") {
    if (a.dtype != "fp32" && a.dtype != "bf16" && a.dtype != "fp16")
      fail("consolidate: --dtype must be keep, fp32, bf16 or fp16, got '{}'", a.dtype);
    o.dtype = precision::parse_save_precision(a.dtype);
  }
  o.force = a.force;
  o.ema = a.ema;
  const ConsolidateResult r = consolidate_checkpoint(a.checkpoint, a.out, o);
  std::cout << fmt::format("{}: {} tensors{} from {} file(s) of a {} checkpoint, {}; wrote {} ({})\n", a.checkpoint,
                           r.tensors, a.ema ? fmt::format(" ({} from their EMA)", r.ema_tensors) : std::string(),
                           r.files_read, r.sharded ? "sharded" : "single-file",
                           a.dtype == "keep" ? "dtypes kept" : "dtype " + a.dtype, a.out, format_bytes(r.bytes));
}

}  // namespace

void register_consolidate(CLI::App& app) {
  auto a = std::make_shared<ConsolidateArgs>();
  CLI::App* cmd = app.add_subcommand(
      "consolidate", "Write the model of a (sharded or single-file) checkpoint folder as one .safetensors file");
  cmd->add_option("CHECKPOINT", a->checkpoint, "checkpoint folder: RUN_DIR/checkpoints/step-NNNNNN")->required();
  cmd->add_option("OUT", a->out, "output .safetensors (written atomically)")->required();
  cmd->add_option("--dtype", a->dtype, "keep | fp32 | bf16 | fp16 (floating tensors only; default keep)");
  cmd->add_flag("--force", a->force, "write even if the dtype conversion overflows or flushes values to zero");
  cmd->add_flag("--ema", a->ema,
                "write the EMA weights (runs with ema_decay), as the run's final model.safetensors holds them");
  cmd->callback([a] { run_consolidate(*a); });
}

}  // namespace shoestring::cli
