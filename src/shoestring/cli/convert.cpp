// `shoestring convert IN --to ldm|diffusers [--dtype keep|fp32|bf16|fp16] [--component unet|vae]
//                    [--arch NAME] [--force] OUT`
//
// Rewrites a UNet or VAE checkpoint between the single-file LDM key layout
// (what ComfyUI / A1111 load: `model.diffusion_model.input_blocks...`,
// `first_stage_model.encoder...`) and the diffusers layout
// (`down_blocks.0.resnets.0...`, one component per file, as in a diffusers
// folder's `unet/diffusion_pytorch_model.safetensors`), optionally in
// another dtype. IN may be one .safetensors file or a sharded
// *.safetensors.index.json. Names are mapped by the tables of io/key_map.h;
// the architecture is detected from the tensor names and shapes (or given
// with --arch). Casting to a narrower dtype goes through the save-time range
// guard (precision/save_guard.h): values that would overflow or flush to zero
// in bulk are an error naming the tensors unless --force. OUT is written
// atomically, tensor by tensor (no converted copy of the whole model in
// memory).
#include <filesystem>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <torch/torch.h>

#include "shoestring/cli/commands.h"
#include "shoestring/core/error.h"
#include "shoestring/core/units.h"
#include "shoestring/io/key_map.h"
#include "shoestring/io/safetensors.h"
#include "shoestring/io/weight_files.h"
#include "shoestring/models/architecture.h"
#include "shoestring/models/unet_ldm.h"
#include "shoestring/precision/save_guard.h"
#include "shoestring/train/checkpoint_io.h"

namespace shoestring::cli {

namespace {

namespace fs = std::filesystem;

struct ConvertOptions {
  std::string in, out, to, dtype = "keep", component, arch;
  bool force = false;
};

bool is_unet(const std::string& arch) { return models::find_architecture(arch).family == models::Family::ldm_unet; }
bool is_vae(const std::string& arch) { return models::find_architecture(arch).family == models::Family::vae; }

// The architectures with a diffusers key map here (the LDM UNets and the SD
// VAE), in registry order: sd15, sdxl, ssd1b, vae.
std::vector<std::string> convertible() {
  std::vector<std::string> names;
  for (const auto& a : models::architectures()) {
    if (a.family == models::Family::ldm_unet || a.family == models::Family::vae) names.push_back(a.name);
  }
  return names;
}

// The UNet block layout of a registered LDM UNet architecture.
io::UNetKeyLayout layout_of(const std::string& arch) {
  if (!is_unet(arch)) {
    fail("convert: no LDM <-> diffusers key map for architecture '{}' (supported: {})", arch,
         models::join_names(convertible()));
  }
  return models::unet_key_layout(models::ldm_unet_options(arch));
}

// VAE mid-block attention: LDM stores q/k/v/proj_out as 1x1 convs [C, C, 1, 1],
// diffusers as Linear [C, C].
bool is_vae_attention_weight(const std::string& ldm_key) {
  return ldm_key.find("mid.attn_1.") != std::string::npos && ldm_key.size() > 7 &&
         ldm_key.compare(ldm_key.size() - 7, 7, ".weight") == 0 && ldm_key.find(".norm.") == std::string::npos;
}

struct Planned {
  std::string out_name;
  std::string in_name;
  std::vector<int64_t> out_shape;  // differs from the input only for VAE attention weights
};

// LDM -> diffusers: pick the detected component, map every tensor under its prefix.
std::vector<Planned> plan_to_diffusers(const WeightFiles& files, const ConvertOptions& o, std::string& arch_out,
                                       int64_t& dropped) {
  std::vector<models::TensorShape> shapes;
  for (const auto& n : files.names()) shapes.push_back({n, files.find(n)->shape});
  std::vector<models::Detection> found = models::detect_architectures(shapes);
  std::vector<models::Detection> usable;
  for (const auto& d : found) {
    if (!is_unet(d.architecture) && !is_vae(d.architecture)) continue;
    if (!o.arch.empty() && d.architecture != o.arch) continue;
    if (o.component == "unet" && !is_unet(d.architecture)) continue;
    if (o.component == "vae" && !is_vae(d.architecture)) continue;
    usable.push_back(d);
  }
  if (usable.empty()) {
    bool diffusers_names = false;
    for (const auto& n : files.names()) {
      if (n.rfind("down_blocks.", 0) == 0 || n.rfind("encoder.down_blocks.", 0) == 0) diffusers_names = true;
    }
    fail(
        "convert: {} holds no SD 1.5 / SDXL / SSD-1B UNet or SD VAE in the LDM layout{}{} (see `shoestring inspect "
        "{}`)",
        files.path(), o.arch.empty() ? "" : fmt::format(" matching --arch {}", o.arch),
        diffusers_names ? "; its names look like the diffusers layout already (use --to ldm to convert it back)" : "",
        files.path());
  }
  if (usable.size() > 1)
    fail(
        "convert: {} holds several models ({} and {}); pick one with --component unet|vae (diffusers keeps one "
        "component per file)",
        files.path(), usable[0].architecture, usable[1].architecture);
  const models::Detection& d = usable[0];
  if (!d.exact())
    fail("convert: {} is not a complete {} checkpoint: {} missing, {} unexpected, {} mis-shaped tensors (first: {})",
         files.path(), d.architecture, d.missing.size(), d.unexpected.size(), d.mismatched.size(),
         !d.missing.empty()      ? d.missing[0]
         : !d.unexpected.empty() ? d.unexpected[0]
                                 : d.mismatched[0]);
  arch_out = d.architecture;
  std::vector<Planned> plan;
  for (const auto& n : files.names()) {
    if (n.compare(0, d.prefix.size(), d.prefix) != 0) {
      ++dropped;
      continue;
    }
    const std::string key = n.substr(d.prefix.size());
    Planned p{"", n, files.find(n)->shape};
    if (is_unet(d.architecture)) {
      p.out_name = io::unet_ldm_to_diffusers(key, layout_of(d.architecture));
    } else {
      p.out_name = io::vae_ldm_to_diffusers(key);
      if (is_vae_attention_weight(key) && p.out_shape.size() == 4) p.out_shape.resize(2);
    }
    plan.push_back(std::move(p));
  }
  return plan;
}

// diffusers -> LDM: try each architecture's inverse map; keep the one whose
// result is an exact match for it.
std::vector<Planned> plan_to_ldm(const WeightFiles& files, const ConvertOptions& o, std::string& arch_out) {
  std::vector<std::string> candidates = o.arch.empty() ? convertible() : std::vector<std::string>{o.arch};
  std::string report;
  for (const auto& arch : candidates) {
    if (!is_unet(arch) && !is_vae(arch))
      fail("convert: --arch {} has no diffusers key map (supported: {})", arch, models::join_names(convertible()));
    const models::Architecture& a = models::find_architecture(arch);
    std::vector<Planned> plan;
    std::vector<models::TensorShape> shapes;
    std::string first_error;
    for (const auto& n : files.names()) {
      try {
        std::string key = is_unet(arch) ? io::unet_diffusers_to_ldm(n, layout_of(arch)) : io::vae_diffusers_to_ldm(n);
        Planned p{a.prefix + key, n, files.find(n)->shape};
        if (is_vae(arch) && is_vae_attention_weight(key) && p.out_shape.size() == 2)
          p.out_shape.insert(p.out_shape.end(), {1, 1});
        shapes.push_back({p.out_name, p.out_shape});
        plan.push_back(std::move(p));
      } catch (const Error& e) {
        if (first_error.empty()) first_error = e.what();
      }
    }
    if (!first_error.empty()) {
      report += fmt::format("\n  {}: {}", arch, first_error);
      continue;
    }
    for (const auto& d : models::detect_architectures(shapes)) {
      if (d.architecture == arch && d.prefix == a.prefix && d.exact()) {
        arch_out = arch;
        return plan;
      }
    }
    report += fmt::format("\n  {}: names map, but the tensor set or shapes are not a complete {}", arch, arch);
  }
  fail("convert: {} is not a diffusers-layout UNet or VAE this build knows:{}", files.path(), report);
}

void run_convert(const ConvertOptions& o) {
  if (o.to != "ldm" && o.to != "diffusers") fail("convert: --to must be ldm or diffusers, got '{}'", o.to);
  if (!o.component.empty() && o.component != "unet" && o.component != "vae")
    fail("convert: --component must be unet or vae, got '{}'", o.component);
  if (o.dtype != "keep" && o.dtype != "fp32" && o.dtype != "bf16" && o.dtype != "fp16")
    fail("convert: --dtype must be keep, fp32, bf16 or fp16, got '{}'", o.dtype);
  if (!o.arch.empty()) models::find_architecture(o.arch);  // unknown names: error listing the known ones
  {
    const fs::path parent = fs::path(o.out).parent_path();
    if (!parent.empty() && !fs::is_directory(parent))
      fail("convert: output folder '{}' does not exist", parent.string());
    if (fs::is_directory(o.out)) fail("convert: output '{}' is a folder, expected a .safetensors file path", o.out);
  }
  std::optional<at::ScalarType> cast;
  precision::Dtype target = precision::Dtype::fp32;
  if (o.dtype != "keep") {
    target = precision::parse_save_precision(o.dtype);
    cast = target == precision::Dtype::fp16 ? at::kHalf : target == precision::Dtype::bf16 ? at::kBFloat16 : at::kFloat;
  }
  refuse_partial_checkpoint_model(o.in, "convert");
  WeightFiles files = WeightFiles::open(o.in);
  // Never overwrite what is being read, however the path is spelled (./x, a
  // symlink, the shard of an index).
  if (fs::exists(o.out)) {
    std::error_code ec;
    if (fs::equivalent(o.out, o.in, ec)) fail("convert: input and output are the same file ({})", o.in);
    for (const auto& n : files.names()) {
      if (fs::equivalent(o.out, files.file_of(n), ec))
        fail("convert: output {} is a shard of the input {}", o.out, o.in);
    }
  }
  std::string arch;
  int64_t dropped = 0;
  std::vector<Planned> plan =
      o.to == "diffusers" ? plan_to_diffusers(files, o, arch, dropped) : plan_to_ldm(files, o, arch);

  // Range guard first (reads every value once), then write.
  std::vector<std::string> problems;
  int64_t problem_count = 0;
  precision::SaveGuardOptions guard;
  guard.force = o.force;
  std::vector<NamedTensor> out;
  int64_t bytes = 0;
  for (const auto& p : plan) {
    at::Tensor t = files.get_values(p.in_name);  // fp8 bytes (libtorch < 2.1) as bf16 values
    if (t.sizes().vec() != p.out_shape) t = t.reshape(p.out_shape);
    std::optional<at::ScalarType> c;
    if (cast && t.is_floating_point() && t.scalar_type() != *cast) {
      c = cast;
      const precision::NarrowingReport r = precision::check_narrowing(p.out_name, t, target);
      if (r.bad(guard)) {
        ++problem_count;
        if (problems.size() < 20) problems.push_back(r.describe(target));
        if (o.force) std::cerr << "warning: " << r.describe(target) << " (written anyway: --force)\n";
      }
    }
    bytes += t.numel() * (c ? static_cast<int64_t>(c10::elementSize(*c)) : static_cast<int64_t>(t.element_size()));
    out.push_back({p.out_name, t, std::nullopt, c});
  }
  if (problem_count > 0 && !o.force)
    fail("convert: writing {} as {} would damage {} tensor(s) (pass --force to write anyway): {}{}", o.out, o.dtype,
         problem_count, fmt::join(problems, "; "),
         problem_count > 20 ? fmt::format("; ... ({} in all)", problem_count) : "");
  std::map<std::string, std::string> metadata = files.metadata();
  metadata["shoestring.architecture"] = arch;
  metadata["shoestring.layout"] = o.to;
  metadata["shoestring.converted_from"] = o.in;
  save_safetensors(o.out, out, metadata);
  std::cout << fmt::format("{}: {} {} tensors -> {} layout, {}{}; wrote {} ({})\n", o.in, out.size(), arch, o.to,
                           o.dtype == "keep" ? "dtypes kept" : "dtype " + o.dtype,
                           dropped ? fmt::format(" ({} tensors of other components left out)", dropped) : "", o.out,
                           format_bytes(bytes));
}

}  // namespace

void register_convert(CLI::App& app) {
  auto o = std::make_shared<ConvertOptions>();
  CLI::App* cmd = app.add_subcommand("convert", "Convert a UNet/VAE checkpoint between LDM and diffusers key layouts");
  cmd->add_option("IN", o->in, "input .safetensors or sharded *.safetensors.index.json")->required();
  cmd->add_option("OUT", o->out, "output .safetensors (written atomically)")->required();
  cmd->add_option("--to", o->to, "target layout: ldm | diffusers")->required();
  cmd->add_option("--dtype", o->dtype, "keep | fp32 | bf16 | fp16 (floating tensors only)");
  cmd->add_option("--component", o->component, "unet | vae: which model of a full single file to convert");
  cmd->add_option("--arch", o->arch, "architecture (sd15, sdxl, ssd1b, vae) instead of detecting it");
  cmd->add_flag("--force", o->force, "write even if the dtype conversion overflows or flushes values to zero");
  cmd->callback([o] { run_convert(*o); });
}

}  // namespace shoestring::cli
