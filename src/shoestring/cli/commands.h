// Subcommands of the `shoestring` executable, one file each under cli/.
// Each register_* adds its subcommand (options + callback) to the app;
// callbacks throw shoestring::Error on bad input, which main() prints.
#pragma once

namespace CLI {
class App;
}

namespace shoestring::cli {

/// `shoestring train CONFIG [--set k=v]... [--max-steps N] [--output-dir DIR] [--resume RUN_DIR]`
void register_train(CLI::App& app);
/// `shoestring cache CONFIG [--set k=v]... [--device D]` (an LDM config's disk caches, train/ldm_cache.h)
void register_cache(CLI::App& app);
/// `shoestring sample CHECKPOINT --prompt TEXT... [--steps N] [--cfg X] [--seed S] --out FILE.png`
void register_sample(CLI::App& app);
/// `shoestring inspect FILE.safetensors [--json]` or `shoestring inspect --arch NAME [--tiny] [--json]`
void register_inspect(CLI::App& app);
/// `shoestring plan CONFIG [--set k=v]... [--budget 8GiB] [--vocab-size N] [--json] [--explain]`
void register_plan(CLI::App& app);

/// `shoestring launch --nproc N [--master-port P] -- COMMAND...` (N local ranks of one data-parallel run)
void register_launch(CLI::App& app);

/// `shoestring convert IN --to ldm|diffusers [--dtype keep|fp32|bf16|fp16] [--component unet|vae] [--arch NAME]
/// [--force] OUT`
void register_convert(CLI::App& app);

/// `shoestring consolidate RUN_DIR/checkpoints/step-N OUT.safetensors [--dtype keep|fp32|bf16|fp16] [--force]`
void register_consolidate(CLI::App& app);

/// `shoestring report RUN_DIR [--max-points N] [--max-grids N]` (rewrites RUN_DIR/report.html)
void register_report(CLI::App& app);

}  // namespace shoestring::cli
