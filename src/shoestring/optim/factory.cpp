#include "shoestring/optim/factory.h"

#include "shoestring/core/error.h"
#include "shoestring/optim/adafactor.h"
#include "shoestring/optim/adamw8bit.h"
#include "shoestring/optim/compass.h"
#include "shoestring/optim/lion.h"
#include "shoestring/optim/sparkles.h"

namespace shoestring {

const std::vector<std::string>& optimizer_names() {
  static const std::vector<std::string> names = {"AdamW", "AdamW8bit", "Adafactor", "Lion", "Compass", "SPARKLES"};
  return names;
}

namespace {
std::vector<OptimParam> with_decay(const std::vector<std::pair<std::string, at::Tensor>>& params, double wd) {
  std::vector<OptimParam> out;
  for (const auto& [name, p] : params) out.push_back({name, p, default_no_decay(name, p) ? 0.0 : wd});
  return out;
}
}  // namespace

void validate_optimizer(const std::string& type, const std::vector<std::string>& args) {
  if (type == "AdamW") {
    parse_adamw_args(args);
  } else if (type == "AdamW8bit") {
    parse_adamw8bit_args(args);
  } else if (type == "Adafactor") {
    parse_adafactor_args(args);
  } else if (type == "Lion") {
    parse_lion_args(args);
  } else if (type == "Compass") {
    parse_compass_args(args);
  } else if (type == "SPARKLES") {
    parse_sparkles_args(args);
  } else {
    fail("optimizer_type \"{}\" is not known (valid: {})", type, fmt::join(optimizer_names(), ", "));
  }
}

OptimizerStateSize optimizer_state_size(const std::string& type, const std::vector<std::string>& args,
                                        at::IntArrayRef shape, at::ScalarType param_dtype,
                                        const OptimizerOptions& options) {
  if (type == "AdamW") return AdamW::state_size(shape, options);
  if (type == "AdamW8bit") return AdamW8bit::state_size(shape, parse_adamw8bit_args(args));
  if (type == "Adafactor") return Adafactor::state_size(shape, parse_adafactor_args(args), options, param_dtype);
  if (type == "Lion") return Lion::state_size(shape, options);
  if (type == "Compass") return Compass::state_size(shape, options);
  if (type == "SPARKLES") {
    parse_sparkles_args(args);  // throws on a bad argument, as make_optimizer would
    return Sparkles::state_size(shape, options);
  }
  validate_optimizer(type, args);  // throws: unknown type
  return {};
}

std::unique_ptr<Optimizer> make_optimizer(const std::string& type, const std::vector<std::string>& args,
                                          const std::vector<std::pair<std::string, at::Tensor>>& params,
                                          const OptimizerOptions& options) {
  validate_optimizer(type, args);
  if (type == "AdamW") {
    auto o = parse_adamw_args(args);
    return std::make_unique<AdamW>(with_decay(params, o.weight_decay), o, options);
  }
  if (type == "AdamW8bit") {
    auto o = parse_adamw8bit_args(args);
    return std::make_unique<AdamW8bit>(with_decay(params, o.adam.weight_decay), o, options);
  }
  if (type == "Adafactor") {
    auto o = parse_adafactor_args(args);
    return std::make_unique<Adafactor>(with_decay(params, o.weight_decay), o, options);
  }
  if (type == "Lion") {
    auto o = parse_lion_args(args);
    return std::make_unique<Lion>(with_decay(params, o.weight_decay), o, options);
  }
  if (type == "SPARKLES") {
    auto o = parse_sparkles_args(args);
    return std::make_unique<Sparkles>(with_decay(params, o.weight_decay), o, options);
  }
  auto o = parse_compass_args(args);
  return std::make_unique<Compass>(with_decay(params, o.weight_decay), o, options);
}

}  // namespace shoestring
