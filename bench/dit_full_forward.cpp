// One bf16 forward (and optionally backward) pass of a full-width released
// architecture on the CPU: Stable Cascade stage C (3.6B / 1B lite) or SD3.5
// Medium's MMDiT-X. Checks that the real widths run end to end and reports
// wall time and peak resident memory. Weights are random N(0, 0.02), not the
// released values.
//
// Usage: dit_full_forward <cascade-c | cascade-c-lite | sd35m> [latent side, default 24 / 32] [--backward]
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>

#include <torch/torch.h>

#include "bench_machine.h"
#include "shoestring/models/cascade.h"
#include "shoestring/models/mmdit.h"

using namespace shoestring;

namespace {

double peak_rss_gib() {
  std::ifstream f("/proc/self/status");
  for (std::string line; std::getline(f, line);)
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) / (1024.0 * 1024.0);  // kB
  return 0;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  shoestring::bench::prepare_process(argv);
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s <cascade-c | cascade-c-lite | sd35m> [latent side] [--backward]\n", argv[0]);
    return 2;
  }
  shoestring::bench::print_machine();
  const std::string name = argv[1];
  const bool backward = argc > 2 && std::strcmp(argv[argc - 1], "--backward") == 0;
  const bool cascade = name.rfind("cascade", 0) == 0;
  const int64_t side = (argc > 2 && argv[2][0] != '-') ? std::stoll(argv[2]) : (cascade ? 24 : 32);

  nn::LayerInit init(torch::TensorOptions().dtype(torch::kBFloat16));
  init.initialize = false;
  auto t0 = std::chrono::steady_clock::now();
  std::shared_ptr<torch::nn::Module> module;
  models::StageC stage_c{nullptr};
  models::MMDiT mmdit{nullptr};
  if (name == "cascade-c" || name == "cascade-c-lite") {
    stage_c = name == "cascade-c" ? models::build_cascade_c(init) : models::build_cascade_c_lite(init);
    module = stage_c.ptr();
  } else if (name == "sd35m") {
    mmdit = models::build_sd35_medium(init);
    module = mmdit.ptr();
  } else {
    std::fprintf(stderr, "unknown model '%s'\n", name.c_str());
    return 2;
  }
  {
    torch::NoGradGuard no_grad;
    torch::manual_seed(0);
    for (auto& p : module->parameters()) p.normal_(0.0, 0.02);
    if (mmdit) mmdit->pos_embed.copy_(models::sincos_pos_embed_2d(mmdit->options().hidden(), 384).unsqueeze(0));
  }
  std::printf("%s: %lld parameters, built in %.1f s\n", name.c_str(),
              static_cast<long long>(nn::parameter_count(*module)), seconds_since(t0));

  c10::AutoGradMode grad_mode(/*enabled=*/backward);  // no autograd graph for a forward-only pass
  const auto bf16 = torch::kBFloat16;
  t0 = std::chrono::steady_clock::now();
  torch::Tensor out;
  if (stage_c) {
    out = stage_c->forward(torch::randn({1, 16, side, side}).to(bf16), torch::rand({1}),
                           torch::randn({1, 77, 1280}).to(bf16), torch::randn({1, 1, 1280}).to(bf16),
                           torch::randn({1, 1, 768}).to(bf16));
  } else {
    out = mmdit->forward(torch::randn({1, 16, side, side}).to(bf16), torch::rand({1}),
                         torch::randn({1, 154, 4096}).to(bf16), torch::randn({1, 2048}).to(bf16));
  }
  const double fwd = seconds_since(t0);
  std::printf("forward %lldx%lld latent: %.1f s, output finite: %s\n", static_cast<long long>(side),
              static_cast<long long>(side), fwd, torch::isfinite(out).all().item<bool>() ? "yes" : "NO");
  if (backward) {
    t0 = std::chrono::steady_clock::now();
    out.to(torch::kFloat32).square().mean().backward();
    std::printf("backward: %.1f s\n", seconds_since(t0));
  }
  std::printf("peak resident memory: %.2f GiB\n", peak_rss_gib());
  return 0;
}
