#include "shoestring/train/sampling.h"

#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/core/text.h"
#include "shoestring/core/utf8.h"
#include "shoestring/data/image.h"
#include "shoestring/data/tokenizer.h"
#include "shoestring/io/atomic_file.h"
#include "shoestring/train/flow_matching.h"

namespace shoestring {

at::Tensor generate_images(TinyUNetModel& model, const WordTokenizer& tokenizer, const SampleRequest& request) {
  if (request.prompts.empty() || request.seeds.empty()) fail("sampling: no prompts or no seeds given");
  for (size_t i = 0; i < request.prompts.size(); ++i) {
    const size_t bad = utf8_error_offset(request.prompts[i]);
    if (bad != std::string_view::npos) {
      fail("sampling: prompt {} is not valid UTF-8 (byte {}): '{}'", i + 1, bad, printable(request.prompts[i]));
    }
  }
  torch::NoGradGuard no_grad;
  const bool was_training = model->is_training();
  model->eval();
  const int64_t r = model->options().resolution;
  const int64_t c = model->options().unet.in_channels();
  // Noise is drawn on the CPU (the same images whatever the device), then moved.
  const at::Device device = module_device(*model);

  std::vector<std::string> captions;
  std::vector<at::Tensor> noises;
  for (const auto& prompt : request.prompts) {
    for (uint64_t seed : request.seeds) {
      captions.push_back(prompt);
      auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
      noises.push_back(torch::randn({1, c, r, r}, gen, torch::kFloat32));
    }
  }
  const int64_t n = static_cast<int64_t>(captions.size());
  const bool guided = request.cfg != 1.0;
  const int64_t chunk = std::max<int64_t>(1, request.max_batch / (guided ? 2 : 1));
  std::vector<at::Tensor> outputs;
  for (int64_t start = 0; start < n; start += chunk) {
    int64_t end = std::min(n, start + chunk);
    std::vector<std::string> caps(captions.begin() + start, captions.begin() + end);
    at::Tensor noise = torch::cat(std::vector<at::Tensor>(noises.begin() + start, noises.begin() + end)).to(device);
    at::Tensor cond = tokenizer.encode_batch(caps).to(device);
    at::Tensor tokens = cond;
    if (guided) {
      std::vector<std::string> empty(caps.size(), "");
      tokens = torch::cat({cond, tokenizer.encode_batch(empty).to(device)});
    }
    const double cfg = request.cfg;
    VelocityFn velocity = [&](const at::Tensor& x, const at::Tensor& t) {
      if (!guided) return model->forward(x, t, tokens).to(torch::kFloat32);
      at::Tensor v = model->forward(torch::cat({x, x}), torch::cat({t, t}), tokens).to(torch::kFloat32);
      auto parts = v.chunk(2);
      return parts[1] + cfg * (parts[0] - parts[1]);
    };
    outputs.push_back(sample_euler(velocity, noise, request.steps));
  }
  if (was_training) model->train();
  return samples_to_uint8(torch::cat(outputs).cpu(), request);
}

at::Device module_device(const torch::nn::Module& module) {
  for (const auto& p : module.parameters()) return p.device();
  for (const auto& b : module.buffers()) return b.device();
  return at::Device(at::kCPU);
}

at::Tensor samples_to_uint8(const at::Tensor& images, const SampleRequest& request) {
  const int64_t n = images.size(0);
  const auto seeds = static_cast<int64_t>(request.seeds.size());
  if (n != static_cast<int64_t>(request.prompts.size()) * seeds) {
    fail("sampling: {} images for {} prompts x {} seeds", n, request.prompts.size(), seeds);
  }
  const at::Tensor bad = ~at::isfinite(images);  // [N, 3, R, R]
  if (bad.any().item<bool>()) {
    const at::Tensor bad_pixels = bad.any(1).flatten(1).sum(1);  // [N]: non-finite pixels per image
    const at::Tensor affected = bad_pixels.nonzero().flatten();
    const int64_t first = affected[0].item<int64_t>();
    const bool has_nan = at::isnan(images).any().item<bool>();
    const bool has_inf = at::isinf(images).any().item<bool>();
    const char* kind = has_nan && has_inf ? "NaN and inf" : has_nan ? "NaN" : "inf";
    fail(
        "sample: the model produced {} in {} of {} pixels for prompt '{}' seed {} ({} of {} images affected); no "
        "image written. Non-finite weights (a diverged run: inspect the checkpoint) or an extreme guidance scale "
        "(cfg {}) cause this",
        kind, bad_pixels[first].item<int64_t>(), images.size(-2) * images.size(-1),
        request.prompts[static_cast<size_t>(first / seeds)], request.seeds[static_cast<size_t>(first % seeds)],
        affected.size(0), n, request.cfg);
  }
  return ((images.to(torch::kFloat32).clamp(-1, 1) + 1) * 127.5).round().to(torch::kUInt8);
}

void save_sample_grid(const std::string& path, const at::Tensor& images, const SampleRequest& request) {
  at::Tensor imgs = images;
  if (imgs.size(-1) < 64) {
    int64_t factor = (64 + imgs.size(-1) - 1) / imgs.size(-1);
    imgs = imgs.repeat_interleave(factor, 2).repeat_interleave(factor, 3);
  }
  std::vector<at::Tensor> list;
  for (int64_t i = 0; i < imgs.size(0); ++i) list.push_back(imgs[i]);
  at::Tensor grid = make_grid(list, static_cast<int64_t>(request.seeds.size()), 2, request.prompts);
  save_png(path, grid);
  std::string sidecar = path;
  if (sidecar.size() > 4 && sidecar.substr(sidecar.size() - 4) == ".png") sidecar.resize(sidecar.size() - 4);
  sidecar += ".txt";
  std::string text = fmt::format("# rows: prompts; columns: seeds {}; {} sampler steps; cfg {}\n",
                                 fmt::join(request.seeds, ", "), request.steps, request.cfg);
  for (const auto& p : request.prompts) text += printable(p) + "\n";  // one line each, whatever they hold
  write_bytes_atomic(sidecar, text);
}

}  // namespace shoestring
