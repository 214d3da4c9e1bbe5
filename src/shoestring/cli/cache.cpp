// `shoestring cache CONFIG [--set key=value]... [--device D]`: encode a latent
// architecture's (LDM, SD3.5, Stable Cascade) config's dataset into its disk caches (train/ldm_cache.h) without training.
#include <filesystem>

#include <CLI/CLI.hpp>
#include <spdlog/spdlog.h>

#include "shoestring/cli/commands.h"
#include "shoestring/core/device.h"
#include "shoestring/core/error.h"
#include "shoestring/dist/launch_env.h"
#include "shoestring/train/config.h"
#include "shoestring/train/ldm_cache.h"

namespace shoestring::cli {
namespace fs = std::filesystem;

void register_cache(CLI::App& app) {
  struct Args {
    std::string config;
    std::vector<std::string> sets;
    std::string device;
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand(
      "cache", "encode a latent model's (SD 1.5 / SDXL / SSD-1B / SD3.5 / Cascade) images and captions into its "
      "disk caches (latents, text-encoder outputs)");
  cmd->add_option("config", args->config, "run config (TOML)")->required();
  cmd->add_option("--set", args->sets, "override a config key: --set cache_dir=/data/cache (repeatable)")
      ->allow_extra_args(false);
  CLI::Option* device_flag =
      cmd->add_option("--device", args->device, "where to encode: auto, cpu, cuda, cuda:N (overrides the config's)");
  cmd->callback([args, device_flag] {
    if (device_flag->count() > 0) resolve_device(args->device, "--device");
    if (!fs::exists(args->config)) fail("config file '{}' does not exist", args->config);
    if (fs::is_directory(args->config)) fail("config '{}' is a directory, expected a TOML file", args->config);
    TrainConfig config = load_config(args->config, args->sets);
    if (device_flag->count() > 0) config.device = args->device;
    // Ranks of `shoestring launch --nproc N -- cache` (or torchrun) encode a share each.
    const dist::LaunchEnvironment env = dist::launch_environment();
    const LdmCacheStats stats =
        build_ldm_caches(config, false, cache_share(env.rank, env.world_size, config.ddp_timeout));
    if (!stats.problems.empty()) {
      spdlog::warn("{} damaged shard{} replaced (listed above)", stats.problems.size(),
                   stats.problems.size() == 1 ? "" : "s");
    }
    if (env.world_size > 1) {
      fmt::print("cache {} (rank {} of {}): latents {} encoded, {} by the other ranks, {} reused; text {} encoded, {} "
                 "by the other ranks, {} reused\n",
                 stats.dir, env.rank, env.world_size, stats.latents_encoded, stats.latents_waited,
                 stats.latent_entries - stats.latents_encoded - stats.latents_waited, stats.text_encoded,
                 stats.text_waited, stats.text_entries - stats.text_encoded - stats.text_waited);
    } else {
      fmt::print("cache {}: latents {} encoded, {} reused; text {} encoded, {} reused\n", stats.dir,
                 stats.latents_encoded, stats.latent_entries - stats.latents_encoded, stats.text_encoded,
                 stats.text_entries - stats.text_encoded);
    }
  });
}

}  // namespace shoestring::cli
