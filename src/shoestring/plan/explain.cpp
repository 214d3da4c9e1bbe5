#include "shoestring/plan/explain.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include "shoestring/core/units.h"
#include "shoestring/models/architecture.h"
#include "shoestring/models/denoiser.h"
#include "shoestring/optim/factory.h"
#include "shoestring/precision/policy.h"
#include "shoestring/train/tiny_unet_model.h"

namespace shoestring::plan {

std::string explain_precision(const TrainConfig& c, int64_t vocab_size) {
  // The module tree the trainer trains, on the meta device (nothing allocated).
  std::shared_ptr<torch::nn::Module> model;
  std::vector<nn::BlockTable*> tables;
  const auto& a = models::find_architecture(c.architecture);
  if (a.family == models::Family::tiny_unet) {
    TinyUNetModelOptions o = TinyUNetModelOptions::from_config(c, vocab_size);
    o.unet.init(nn::LayerInit{torch::kMeta});
    o.text.init(nn::LayerInit{torch::kMeta});
    TinyUNetModel m(o);
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
  // Bytes from each optimizer's own state_size (optim/factory.h), per
  // trainable parameter in its resolved storage dtype.
  OptimizerOptions state_options;
  state_options.state_dtype = c.optimizer_state_dtype == "bf16" ? at::kBFloat16 : at::kFloat;
  int64_t state_bytes = 0;
  for (const auto& p : resolution.params) {
    if (!p.settings.trainable) continue;
    state_bytes += optimizer_state_size(c.optimizer_type, c.optimizer_args, p.shape,
                                        precision::container_dtype(p.settings.storage), state_options)
                       .state;
  }
  // LoRA: the adapters are not in this tree (the plan counts their state).
  const std::string bytes = c.network_module.empty() ? ", " + format_bytes(state_bytes) : std::string();
  out += fmt::format("optimizer state ({}): {}{}{}\n", c.optimizer_type, state, bytes,
                     c.offload_optimizer_state ? ", in host memory (offload_optimizer_state)" : "");
  if (c.ema_decay > 0) out += "EMA copy: fp32\n";
  return out;
}

}  // namespace shoestring::plan
