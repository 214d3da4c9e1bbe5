#include "shoestring/plan/explain.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include "shoestring/models/architecture.h"
#include "shoestring/models/denoiser.h"
#include "shoestring/precision/policy.h"
#include "shoestring/train/diffusion_model.h"

namespace shoestring::plan {

std::string explain_precision(const TrainConfig& c, int64_t vocab_size) {
  // The module tree the trainer trains, on the meta device (nothing allocated).
  std::shared_ptr<torch::nn::Module> model;
  std::vector<nn::BlockTable*> tables;
  const auto& a = models::find_architecture(c.architecture);
  if (a.family == models::Family::tiny_unet) {
    DiffusionModelOptions o = DiffusionModelOptions::from_config(c, vocab_size);
    o.unet.init(nn::LayerInit{torch::kMeta});
    o.text.init(nn::LayerInit{torch::kMeta});
    DiffusionModel m(o);
    tables = m->block_tables();
    model = m.ptr();
  } else {
    // LDM UNets under their single-file prefix (the trainer's parameter names).
    model = a.prefix.empty() ? models::build_architecture(c.architecture, nn::LayerInit{torch::kMeta}, c.tiny)
                             : models::build_checkpoint_root(c.architecture, nn::LayerInit{torch::kMeta}, c.tiny);
    tables = models::denoiser_block_tables(*model);
  }
  const precision::Policy policy = precision_policy(c);
  const precision::Resolution resolution = precision::resolve(*model, policy, {tables.begin(), tables.end()});
  std::string out = precision::format_explain(resolution, policy);
  std::string state;
  if (c.optimizer_type == "AdamW8bit") {
    state = "8-bit blockwise (fp32 for tensors under min_8bit_size)";
  } else if (c.optimizer_type == "Adafactor") {
    state = "fp32 row/column factors (matrices), " + c.optimizer_state_dtype + " (vectors)";
  } else {
    state = c.optimizer_state_dtype;
  }
  out += fmt::format("optimizer state ({}): {}{}\n", c.optimizer_type, state,
                     c.offload_optimizer_state ? ", in host memory (offload_optimizer_state)" : "");
  if (c.ema_decay > 0) out += "EMA copy: fp32\n";
  return out;
}

}  // namespace shoestring::plan
