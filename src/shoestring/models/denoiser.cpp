#include "shoestring/models/denoiser.h"

namespace shoestring::models {

Denoiser* as_denoiser(torch::nn::Module& module) { return dynamic_cast<Denoiser*>(&module); }

const Denoiser* as_denoiser(const torch::nn::Module& module) { return dynamic_cast<const Denoiser*>(&module); }

std::vector<nn::BlockTable*> denoiser_block_tables(const torch::nn::Module& root) {
  std::vector<nn::BlockTable*> tables;
  for (const auto& item : root.named_modules("", /*include_self=*/true)) {
    if (const Denoiser* d = as_denoiser(*item.value())) tables.push_back(d->block_table());
  }
  return tables;
}

}  // namespace shoestring::models
