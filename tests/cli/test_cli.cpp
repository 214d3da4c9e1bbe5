// Runs the real `shoestring` executable: the flows a user types, and the
// errors bad command lines and files must produce.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>
#include "run_cli.h"

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <set>

#include <nlohmann/json.hpp>

#include <torch/torch.h>

#include "shoestring/core/cpu_features.h"
#include "shoestring/core/threads.h"
#include "shoestring/io/safetensors.h"
#include "shoestring/models/architecture.h"

namespace fs = std::filesystem;

namespace {

using Result = shoestring::testing::CliResult;

Result run(const std::string& args) { return shoestring::testing::run_cli(args); }

std::string temp_path(const std::string& name) {
  return (fs::temp_directory_path() / ("shoestring_cli_" + name + "_" + std::to_string(::getpid()))).string();
}

std::string write_config(const std::string& extra = "") {
  static int counter = 0;
  std::string path = temp_path("cfg" + std::to_string(counter++)) + ".toml";
  std::ofstream(path) << "train_data_dir = \"" << SHOESTRING_TEST_DATA << "/twemoji\"\n"
                      << "resolution = 16\ntrain_batch_size = 2\nmax_train_steps = 3\nnum_threads = 1\n"
                      << "sample_prompts = [\"red heart\"]\nsample_seeds = 1\nsample_steps = 2\n"
                      << extra << "[model]\nbase_channels = 16\nchannel_mult = [1, 2]\nnum_res_blocks = 1\n"
                      << "attention_levels = [1]\nnum_heads = 2\nnorm_groups = 8\ntext_dim = 32\ntext_layers = 1\n";
  return path;
}

}  // namespace

TEST(Cli, TrainSampleInspectFlow) {
  std::string cfg = write_config();
  std::string out = temp_path("run");
  fs::remove_all(out);
  // Without OpenMP settings of the user's, the CLI re-executes itself with
  // PASSIVE and a bounded spin count (core/threads.h).
  // OpenBLAS's kernels: ours where it did not know this CPU (the same rule
  // applied to what it picks in this test process, which does not re-execute).
  Result t = shoestring::testing::run_cli("train " + cfg + " --output-dir " + out + " --set seed=4",
                                          "env -u OMP_WAIT_POLICY -u GOMP_SPINCOUNT -u OPENBLAS_CORETYPE");
  ASSERT_EQ(t.code, 0) << t.output;
  EXPECT_NE(t.output.find("OpenMP wait PASSIVE, GOMP_SPINCOUNT 3000)"), std::string::npos) << t.output;
  const std::string here = shoestring::blas_kernels();  // "OpenBLAS <core>" as OpenBLAS picked it
  const char* user_core = std::getenv("OPENBLAS_CORETYPE");
  if (here.rfind("OpenBLAS ", 0) == 0 && (user_core == nullptr || *user_core == '\0')) {
    const std::string picked = here.substr(9);
    const std::string ours = shoestring::openblas_core_override(picked, shoestring::cpu_features());
    EXPECT_NE(t.output.find("| BLAS OpenBLAS " + (ours.empty() ? picked + "\n" : ours + " (OPENBLAS_CORETYPE)")),
              std::string::npos)
        << here << "\n" << t.output;
  }
  EXPECT_NE(t.output.find("step 1 measured peak"), std::string::npos) << t.output;
  EXPECT_NE(t.output.find("step 3/3"), std::string::npos) << t.output;
  EXPECT_TRUE(fs::exists(out + "/model.safetensors"));

  // Resume further; the step counter continues.
  // A spin count the user set is kept.
  // So is a kernel set the user chose (Prescott: SSE3, on every x86-64).
  Result r = shoestring::testing::run_cli("train --resume " + out + " --max-steps 5",
                                          "env -u OMP_WAIT_POLICY GOMP_SPINCOUNT=77 OPENBLAS_CORETYPE=Prescott");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("OpenMP wait PASSIVE, GOMP_SPINCOUNT 77)"), std::string::npos) << r.output;
  if (here.rfind("OpenBLAS ", 0) == 0) {
    EXPECT_NE(r.output.find("| BLAS OpenBLAS Prescott (OPENBLAS_CORETYPE)"), std::string::npos) << r.output;
  }
  EXPECT_NE(r.output.find("resumed from"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("step 5/5"), std::string::npos) << r.output;

  std::string png = temp_path("grid") + ".png";
  Result s =
      run("sample " + out + "/model.safetensors --prompt \"red heart\" --prompt sun --steps 2 --count 2 --out " + png);
  ASSERT_EQ(s.code, 0) << s.output;
  EXPECT_TRUE(fs::exists(png));
  // SD options on the emoji model are refused by name.
  Result e = run("sample " + out + "/model.safetensors --prompt sun --sampler euler --out " + png);
  EXPECT_NE(e.code, 0);
  EXPECT_NE(e.output.find("--sampler applies to the released architectures"), std::string::npos) << e.output;
  Result bad = run("sample " + out + "/model.safetensors --prompt sun --sampler heun --out " + png);
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.output.find("dpmpp_2m"), std::string::npos) << bad.output;

  Result i = run("inspect " + out + "/model.safetensors --json");
  ASSERT_EQ(i.code, 0) << i.output;
  auto j = nlohmann::json::parse(i.output);
  auto file = shoestring::SafetensorsFile::open(out + "/model.safetensors");
  int64_t params = 0;
  for (const auto& info : file.tensors()) params += info.numel();
  EXPECT_EQ(j["parameters"].get<int64_t>(), params);
  EXPECT_EQ(j["metadata"]["format"], "shoestring");
  fs::remove_all(out);
  fs::remove(png);
  fs::remove(cfg);
}

TEST(Cli, RunsThroughTheDynamicLoader) {
  // `ld-linux-x86-64.so.2 shoestring ...`: /proc/self/exe is the loader, so
  // the CPU runtime's re-exec (core/threads.h) must not happen; it runs on.
  const std::string loader = "/lib64/ld-linux-x86-64.so.2";
  if (!fs::exists(loader)) GTEST_SKIP() << "no " << loader;
  for (const char* env : {"env -u OMP_WAIT_POLICY -u OPENBLAS_CORETYPE", "env -u OPENBLAS_CORETYPE OMP_WAIT_POLICY=PASSIVE"}) {
    Result r = shoestring::testing::run_cli("--version", std::string(env) + " " + loader);
    EXPECT_EQ(r.code, 0) << env << ": " << r.output;
    EXPECT_NE(r.output.find("shoestring 0.1.0"), std::string::npos) << env << ": " << r.output;
  }
}

TEST(Cli, BadInputsGiveClearErrors) {
  Result unknown = run("trian x.toml");
  EXPECT_EQ(unknown.code, 2);
  EXPECT_NE(unknown.output.find("unknown command 'trian'; the commands are train, cache, sample"), std::string::npos)
      << unknown.output;

  Result missing = run("train /nonexistent/run.toml");
  EXPECT_EQ(missing.code, 1);
  EXPECT_NE(missing.output.find("/nonexistent/run.toml"), std::string::npos) << missing.output;

  std::string cfg = write_config();
  Result bad_set = run("train " + cfg + " --set learning_rat=1");
  EXPECT_EQ(bad_set.code, 1);
  EXPECT_NE(bad_set.output.find("did you mean 'learning_rate'"), std::string::npos) << bad_set.output;

  std::string bad_cfg = write_config("learning_rate = \"fast\"\n");
  Result bad_value = run("train " + bad_cfg);
  EXPECT_EQ(bad_value.code, 1);
  EXPECT_NE(bad_value.output.find("learning_rate"), std::string::npos) << bad_value.output;
  EXPECT_NE(bad_value.output.find(".toml:9: invalid value \"fast\" for 'learning_rate'"), std::string::npos)
      << bad_value.output;  // file:line

  Result unwritable = run("train " + cfg + " --output-dir /proc/nope");
  EXPECT_EQ(unwritable.code, 1);
  EXPECT_NE(unwritable.output.find("/proc/nope"), std::string::npos) << unwritable.output;

  std::string junk = temp_path("junk") + ".safetensors";
  std::ofstream(junk) << "not a safetensors file at all";
  Result insp = run("inspect " + junk);
  EXPECT_EQ(insp.code, 1);
  EXPECT_NE(insp.output.find(junk), std::string::npos) << insp.output;
  Result samp = run("sample " + junk + " --prompt x --out " + temp_path("x") + ".png");
  EXPECT_EQ(samp.code, 1);

  Result no_resume = run("train --resume /nonexistent_run_dir");
  EXPECT_EQ(no_resume.code, 1);
  EXPECT_NE(no_resume.output.find("/nonexistent_run_dir"), std::string::npos) << no_resume.output;
  // Names quoted in error messages are escaped: a tensor name holding a
  // terminal escape (JSON \u001b) cannot colour the terminal.
  {
    const std::string entry = R"({"dtype":"F32","shape":[0],"data_offsets":[0,0]})";
    const std::string header = R"({"\u001b[31mEVIL":)" + entry + R"(,"\u001b[31mEVIL":)" + entry + "}";
    std::string bytes(8, '\0');
    for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
    const std::string evil = temp_path("evil") + ".safetensors";
    std::ofstream(evil, std::ios::binary) << bytes << header;
    Result r = run("inspect " + evil);
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find("duplicate tensor name '\\x1b[31mEVIL'"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find('\x1b'), std::string::npos) << r.output;
    fs::remove(evil);
  }
  // A folder without config.toml (a run killed before writing it) says what to do instead.
  const std::string empty_run = temp_path("empty_run");
  fs::create_directories(empty_run);
  Result not_a_run = run("train --resume " + empty_run);
  EXPECT_EQ(not_a_run.code, 1);
  EXPECT_NE(not_a_run.output.find("it has no config.toml"), std::string::npos) << not_a_run.output;
  EXPECT_NE(not_a_run.output.find("original command"), std::string::npos) << not_a_run.output;
  fs::remove_all(empty_run);

  // A directory given as the config, and --set before the positional CONFIG.
  fs::path dir_cfg = temp_path("dir") + ".toml";
  fs::create_directories(dir_cfg);
  Result dir = run("train " + dir_cfg.string());
  EXPECT_EQ(dir.code, 1);
  EXPECT_NE(dir.output.find("is a directory"), std::string::npos) << dir.output;
  fs::remove(dir_cfg);
  Result set_first = run("train --set seed=1 " + bad_cfg);
  EXPECT_NE(set_first.output.find("learning_rate"), std::string::npos) << set_first.output;  // CONFIG was parsed

  // An existing folder that holds someone's files is not a run to overwrite.
  fs::path mine = temp_path("mine");
  fs::create_directories(mine);
  std::ofstream(mine / "metrics.jsonl") << "{\"mine\":1}\n";
  Result clobber = run("train " + cfg + " --output-dir " + mine.string());
  EXPECT_EQ(clobber.code, 1);
  EXPECT_NE(clobber.output.find("already holds a run"), std::string::npos) << clobber.output;
  fs::remove_all(mine);

  // A failed run leaves no empty folder; sample refuses a missing output folder before working.
  std::string empty_out = temp_path("never");
  Result nodata = run("train " + cfg + " --set train_data_dir=/nonexistent --output-dir " + empty_out);
  EXPECT_EQ(nodata.code, 1);
  EXPECT_FALSE(fs::exists(empty_out));
  Result noout = run("sample " + junk + " --prompt x --out /nonexistent_dir/x.png");
  EXPECT_EQ(noout.code, 1);
  EXPECT_NE(noout.output.find("/nonexistent_dir"), std::string::npos) << noout.output;
  EXPECT_EQ(noout.output.find(".tmp."), std::string::npos) << noout.output;

  Result usage = run("train " + cfg + " --max-steps -3");
  EXPECT_NE(usage.code, 0);
  Result nothing = run("");
  EXPECT_NE(nothing.code, 0);
  fs::remove(cfg);
  fs::remove(bad_cfg);
  fs::remove(junk);
}

// The device setting: a CUDA request on a machine that cannot meet it fails
// before any work (no run folder), naming the flag or key, the value and why;
// a malformed value names the accepted forms.
TEST(Cli, DeviceRequestsTheMachineCannotMeetFailFirst) {
  const std::string cfg = write_config();
  const std::string out = temp_path("device");
  Result bad_form = run("train " + cfg + " --device gpu --output-dir " + out);
  EXPECT_EQ(bad_form.code, 1);
  EXPECT_NE(bad_form.output.find("--device = \"gpu\""), std::string::npos) << bad_form.output;
  EXPECT_NE(bad_form.output.find("\"cuda:N\""), std::string::npos) << bad_form.output;
  EXPECT_FALSE(fs::exists(out));

  // An empty value is a bad value too, not "use the config's".
  Result empty = run("train " + cfg + " --device '' --output-dir " + out);
  EXPECT_EQ(empty.code, 1) << empty.output;
  EXPECT_NE(empty.output.find("--device = \"\""), std::string::npos) << empty.output;
  EXPECT_FALSE(fs::exists(out));

  Result key_form = run("train " + cfg + " --set device=tpu --output-dir " + out);
  EXPECT_EQ(key_form.code, 1);
  EXPECT_NE(key_form.output.find("device = \"tpu\""), std::string::npos) << key_form.output;
  EXPECT_FALSE(fs::exists(out));

  // This machine (Debian's CPU-only libtorch): CUDA cannot be had.
  Result cuda = run("train " + cfg + " --device cuda:1 --output-dir " + out);
  if (cuda.code != 0) {
    EXPECT_EQ(cuda.code, 1);
    EXPECT_NE(cuda.output.find("--device = \"cuda:1\""), std::string::npos) << cuda.output;
    const bool says_why = cuda.output.find("built without CUDA") != std::string::npos ||
                          cuda.output.find("no CUDA device") != std::string::npos ||
                          cuda.output.find("only") != std::string::npos;
    EXPECT_TRUE(says_why) << cuda.output;
    EXPECT_FALSE(fs::exists(out));
  }
  Result key_cuda = run("train " + cfg + " --set device=cuda --output-dir " + out);
  if (key_cuda.code != 0) {
    EXPECT_NE(key_cuda.output.find("device = \"cuda\""), std::string::npos) << key_cuda.output;
    EXPECT_FALSE(fs::exists(out));
  }
  Result sample = run("sample /nonexistent.safetensors --prompt x --device cuda:7 --out " + temp_path("d") + ".png");
  EXPECT_EQ(sample.code, 1);
  EXPECT_NE(sample.output.find("--device = \"cuda:7\""), std::string::npos) << sample.output;
  fs::remove_all(out);
  fs::remove(cfg);
}

// NaN passes CLI::Range, and NaN weights sampled to a black grid with exit
// code 0: both are errors now, and no PNG (or sidecar) is written.
TEST(Cli, SampleRefusesNonFiniteArgumentsAndWeights) {
  std::string cfg = write_config();
  std::string out = temp_path("nanrun");
  fs::remove_all(out);
  Result t = run("train " + cfg + " --output-dir " + out);
  ASSERT_EQ(t.code, 0) << t.output;
  const std::string model = out + "/model.safetensors";
  const std::string png = temp_path("nangrid") + ".png";
  const std::string sidecar = png.substr(0, png.size() - 4) + ".txt";
  fs::remove(png);

  for (const char* bad : {"nan", "NaN", "inf", "-inf"}) {
    Result r = run("sample " + model + " --prompt \"red heart\" --steps 2 --cfg " + bad + " --out " + png);
    EXPECT_NE(r.code, 0) << bad << ": " << r.output;
    EXPECT_NE(r.output.find("--cfg"), std::string::npos) << r.output;
    EXPECT_FALSE(fs::exists(png)) << bad;
  }

  // The same checkpoint with every floating tensor NaN, written with the project's writer.
  auto file = shoestring::SafetensorsFile::open(model);
  std::vector<shoestring::NamedTensor> tensors;
  std::set<std::string> floating;
  for (const auto& info : file.tensors()) {
    at::Tensor x = file.get(info.name).clone();
    if (x.is_floating_point()) {
      x.fill_(std::numeric_limits<double>::quiet_NaN());
      floating.insert(info.name);
    }
    tensors.push_back({info.name, x, std::nullopt});
  }
  ASSERT_FALSE(floating.empty());
  const std::string nan_model = temp_path("nanmodel") + ".safetensors";
  shoestring::save_safetensors(nan_model, tensors, file.metadata());
  Result r = run("sample " + nan_model + " --prompt \"red heart\" --steps 2 --count 2 --out " + png);
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find(nan_model), std::string::npos) << r.output;
  // Names one of the NaN tensors (the first the loader meets), all of whose values are bad.
  const size_t at = r.output.find("tensor \"");
  ASSERT_NE(at, std::string::npos) << r.output;
  const std::string named = r.output.substr(at + 8, r.output.find('"', at + 8) - (at + 8));
  EXPECT_TRUE(floating.count(named)) << named;
  const at::Tensor bad = file.get(named);
  EXPECT_NE(r.output.find(fmt::format("holds {} non-finite value(s) (NaN or inf) of {}", bad.numel(), bad.numel())),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("non-finite"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(png));
  EXPECT_FALSE(fs::exists(sidecar));

  // The finite checkpoint still samples.
  Result ok = run("sample " + model + " --prompt \"red heart\" --steps 2 --count 1 --out " + png);
  EXPECT_EQ(ok.code, 0) << ok.output;
  EXPECT_TRUE(fs::exists(png));
  fs::remove(png);
  fs::remove(sidecar);
  fs::remove(nan_model);
  fs::remove_all(out);
  fs::remove(cfg);
}

// `inspect --arch`: sizes a registered architecture without allocating it;
// `inspect FILE`: names the architecture a checkpoint holds. SDXL base UNet:
// 2,567,463,684 parameters (diffusers num_parameters() of
// stabilityai/stable-diffusion-xl-base-1.0/unet).
TEST(Cli, InspectArchitectureAndDetection) {
  Result j = run("inspect --arch sdxl --json");
  ASSERT_EQ(j.code, 0) << j.output;
  auto doc = nlohmann::json::parse(j.output);
  EXPECT_EQ(doc["parameters"].get<int64_t>(), 2'567'463'684);
  EXPECT_EQ(doc["bytes_per_dtype"]["fp8"].get<int64_t>(), 2'567'463'684);
  EXPECT_EQ(doc["bytes_per_dtype"]["bf16"].get<int64_t>(), 2 * 2'567'463'684LL);
  EXPECT_EQ(doc["bytes_per_dtype"]["fp32"].get<int64_t>(), 4 * 2'567'463'684LL);
  Result t = run("inspect --arch sd15");
  ASSERT_EQ(t.code, 0) << t.output;
  EXPECT_NE(t.output.find("parameters: 859520964"), std::string::npos) << t.output;
  Result bad = run("inspect --arch sd14");
  EXPECT_EQ(bad.code, 1);
  EXPECT_NE(bad.output.find("unknown architecture 'sd14'"), std::string::npos) << bad.output;
  EXPECT_EQ(run("inspect").code, 1);

  // A bare tiny-width VAE file with one tensor left out.
  std::vector<shoestring::NamedTensor> tensors;
  const std::string vae = "vae";  // an lvalue: see test_registry.cpp on -Wdangling-reference
  for (const auto& t : shoestring::models::architecture_tensors(vae, /*tiny=*/true)) {
    if (t.name == "decoder.conv_out.bias") continue;
    tensors.push_back({t.name, torch::zeros({1}, torch::kBFloat16).expand(t.shape), {}});
  }
  const std::string file = temp_path("vae") + ".safetensors";
  shoestring::save_safetensors(file, tensors);
  Result d = run("inspect " + file);
  ASSERT_EQ(d.code, 0) << d.output;
  EXPECT_NE(d.output.find("architecture: vae (tiny width) under '' (" + std::to_string(tensors.size()) +
                          " tensors match; 1 missing, 0 unexpected, 0 other shape)"),
            std::string::npos)
      << d.output;
  EXPECT_NE(d.output.find("    decoder.conv_out.bias"), std::string::npos) << d.output;
  Result dj = run("inspect " + file + " --json");
  ASSERT_EQ(dj.code, 0) << dj.output;
  auto dd = nlohmann::json::parse(dj.output);
  ASSERT_EQ(dd["architectures"].size(), 1u);
  EXPECT_EQ(dd["architectures"][0]["architecture"], "vae");
  EXPECT_EQ(dd["architectures"][0]["missing"][0], "decoder.conv_out.bias");
  fs::remove(file);
}

// `shoestring report RUN_DIR` redraws a run folder's report.html (as after a
// crash: the run's own file removed); a folder without metrics.jsonl is refused.
TEST(Cli, ReportRedrawsARunFolder) {
  const fs::path dir = temp_path("report_run");
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::ofstream(dir / "metrics.jsonl")
      << "{\"step\":1,\"loss\":0.5,\"lr\":0.001}\n{\"step\":2,\"loss\":0.4,\"lr\":0.001}\n";
  std::ofstream(dir / "config.toml") << "learning_rate = 0.001\n";
  Result r = run("report " + dir.string() + " --max-points 10");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("wrote " + (dir / "report.html").string()), std::string::npos) << r.output;
  std::ifstream in(dir / "report.html");
  const std::string html((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(html.find("<svg class=\"plot\" id=\"plot-loss\""), std::string::npos);
  EXPECT_NE(html.find("redrawn by `shoestring report`"), std::string::npos);
  Result none = run("report " + temp_path("report_none"));
  EXPECT_EQ(none.code, 1);
  EXPECT_NE(none.output.find("not a run folder"), std::string::npos) << none.output;
  Result bad = run("report " + dir.string() + " --max-points 2");
  EXPECT_NE(bad.code, 0);
  fs::remove_all(dir);
}

// `shoestring sample` of an LDM file: the size flags. One of --width /
// --height alone gives a square of that side (the other's default is "as
// the given one"), both give that size, neither the run's resolution.
TEST(Cli, SampleLdmSizeFlags) {
  const std::string cfg = temp_path("ldm_cfg") + ".toml";
  const std::string out = temp_path("ldm_run");
  fs::remove_all(out);
  std::ofstream(cfg) << "train_data_dir = \"" << SHOESTRING_TEST_DATA << "/twemoji/img/twitter/64\"\n"
                     << "resolution = 32\ntrain_batch_size = 2\nmax_train_steps = 1\nnum_threads = 1\n"
                     << "sample_prompts = [\"red heart\"]\nsample_seeds = 1\nsample_steps = 1\n"
                     << "output_dir = \"" << out << "\"\n[model]\narchitecture = \"sdxl\"\ntiny = true\n";
  Result t = run("train " + cfg);
  ASSERT_EQ(t.code, 0) << t.output;
  const std::string model = out + "/model.safetensors", png = temp_path("ldm_grid") + ".png";
  // The log line names the drawn size (the grid adds padding and a caption band).
  const auto drawn = [&](const std::string& flags) {
    Result r = run("sample " + model + " --prompt \"red heart\" --steps 1 --cfg 1 " + flags + " --out " + png);
    EXPECT_EQ(r.code, 0) << r.output;
    const size_t at = r.output.find(" px, ");
    if (at == std::string::npos) return std::string("no size in: ") + r.output;
    return r.output.substr(r.output.rfind(", ", at - 1) + 2, at - r.output.rfind(", ", at - 1) - 2);
  };
  EXPECT_EQ(drawn("--width 64"), "64 x 64");
  EXPECT_EQ(drawn("--height 64"), "64 x 64");
  EXPECT_EQ(drawn("--width 64 --height 32"), "64 x 32");
  EXPECT_EQ(drawn(""), "32 x 32");
  fs::remove_all(out);
  fs::remove(cfg);
  fs::remove(png);
}

// `shoestring sample` of an SD3.5 Medium file and a Stable Cascade stage C
// file (tiny runs): the architecture is recognised, the log line says what
// was drawn (the size asked, the denoiser's dtype, the conditioning), and the
// other architectures' options are refused by name.
TEST(Cli, SampleSd3AndCascadeFiles) {
  for (const std::string arch : {"sd35m", "cascade-c"}) {
    const std::string cfg = temp_path(arch + "_cfg") + ".toml";
    const std::string out = temp_path(arch + "_run");
    fs::remove_all(out);
    std::ofstream(cfg) << "train_data_dir = \"" << SHOESTRING_TEST_DATA << "/twemoji/img/twitter/64\"\n"
                       << "resolution = 64\ntrain_batch_size = 2\nmax_train_steps = 1\nnum_threads = 1\n"
                       << "sample_prompts = [\"red heart\"]\nsample_seeds = 1\nsample_steps = 1\n"
                       << "output_dir = \"" << out << "\"\n[model]\narchitecture = \"" << arch << "\"\ntiny = true\n";
    Result t = run("train " + cfg);
    ASSERT_EQ(t.code, 0) << t.output;
    const std::string model = out + "/model.safetensors", png = temp_path(arch + "_grid") + ".png";
    Result r = run("sample " + model + " --prompt \"red heart\" --negative-prompt blurry --steps 2 --count 2 --width 128 "
                   "--out " + png);
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_TRUE(fs::exists(png));
    const bool sd3 = arch == "sd35m";
    EXPECT_NE(r.output.find(arch + " (tiny), 128 x 128 px, 2 steps, cfg " + (sd3 ? "5" : "4")), std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find(sd3 ? "MMDiT in fp32; CLIP-L + bigG, T5 as zeros" : "stage C in fp32; previews 32 x 32 px"),
              std::string::npos)
        << r.output;
    const std::string foreign = sd3 ? "--previewer p.safetensors" : "--t5xxl t5.safetensors";
    Result e = run("sample " + model + " --prompt x " + foreign + " --out " + png);
    EXPECT_EQ(e.code, 1);
    EXPECT_NE(e.output.find((sd3 ? "--previewer" : "--t5xxl") + std::string(" does not apply to ") + model),
              std::string::npos)
        << e.output;
    // A LoRA file given as the checkpoint: the base goes there, the LoRA with --lora.
    const std::string lora = out + "/lora.safetensors";
    shoestring::save_safetensors(lora, {{"lora_unet_x.lora_down.weight", torch::zeros({2, 4}), std::nullopt}});
    Result l = run("sample " + lora + " --prompt x --out " + png);
    EXPECT_EQ(l.code, 1);
    EXPECT_NE(l.output.find("is a LoRA file"), std::string::npos) << l.output;
    EXPECT_NE(l.output.find("--lora"), std::string::npos) << l.output;
    fs::remove_all(out);
    fs::remove(cfg);
    fs::remove(png);
  }
}
