#include "shoestring/plan/memory_plan.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <optional>

#include "shoestring/core/device.h"
#include "shoestring/core/error.h"
#include "shoestring/core/units.h"
#include "shoestring/dist/data_parallel.h"
#include "shoestring/dist/zero.h"
#include "shoestring/models/architecture.h"
#include "shoestring/models/denoiser.h"
#include "shoestring/nn/key_layout.h"
#include "shoestring/nn/lora.h"
#include "shoestring/nn/memory_trace.h"
#include "shoestring/optim/factory.h"
#include "shoestring/optim/fused_backward.h"
#include "shoestring/plan/device_costs.h"
#include "shoestring/precision/policy.h"
#include "shoestring/train/tiny_unet_model.h"
#include "shoestring/train/training_model.h"

namespace shoestring::plan {
namespace {

constexpr int kW = static_cast<int>(MemoryCategory::weights);
constexpr int kG = static_cast<int>(MemoryCategory::gradients);
constexpr int kS = static_cast<int>(MemoryCategory::optimizer_state);
constexpr int kA = static_cast<int>(MemoryCategory::activations);
constexpr int kT = static_cast<int>(MemoryCategory::temporaries);

using nn::numel_of;

// The optimizer's state and update scratch for one parameter of `shape`
// stored in `weights` (the optimizer's tensor: the fp32 master where there
// is one), from each optimizer's own state_size() (optim/factory.h).
OptimizerStateSize optimizer_state_for(const TrainConfig& c, const std::vector<int64_t>& shape,
                                       at::ScalarType weights) {
  OptimizerOptions o;
  o.state_dtype = c.optimizer_state_dtype == "bf16" ? at::kBFloat16 : at::kFloat;
  return optimizer_state_size(c.optimizer_type, c.optimizer_args, shape, weights, o);
}

int elem_of(precision::Dtype d) { return static_cast<int>(precision::container_bytes(d)); }

// Bytes per activation element of a compute dtype; fp16 on the CPU (the
// trainer's device) is emulated in fp32 (nn/block_precision.h).
int compute_elem_of(precision::Dtype d) { return d == precision::Dtype::bf16 ? 2 : 4; }

// The model a training run of `c` trains, built on the meta device, with the
// config's precision policy resolved over it as setup_run (train/run.cpp) resolves it
// (precision::resolve over the model and its block tables).
struct ResolvedModel {
  std::shared_ptr<torch::nn::Module> root;  // what the rules' paths are relative to
  torch::nn::Module* denoiser = nullptr;    // the registered architecture (real architectures)
  TinyUNetModel emoji{nullptr};             // the emoji model (tiny-unet)
  precision::Resolution resolution;
  // Settings of every declared block and scope, from its resolved rule and
  // the parameters directly inside it (not inside an inner block).
  std::map<const torch::nn::Module*, nn::TracePrecision> blocks;
  // Config-wide settings: the root's compute, the parameters' storage and
  // trainable fraction, checkpointing of most checkpointable blocks.
  nn::TracePrecision whole;
};

// Real architectures built on meta, once per (name, tiny): the denoiser and,
// for architectures with a key prefix, the checkpoint root the trainer trains
// (rules match "model.diffusion_model.*" paths there).
std::pair<std::shared_ptr<torch::nn::Module>, std::shared_ptr<torch::nn::Module>> meta_model(
    const models::Architecture& a, bool tiny) {
  static std::mutex mutex;
  static std::map<std::pair<std::string, bool>,
                  std::pair<std::shared_ptr<torch::nn::Module>, std::shared_ptr<torch::nn::Module>>>
      cache;
  std::lock_guard<std::mutex> lock(mutex);
  auto& m = cache[{a.name, tiny}];
  if (!m.first) {
    m.first = a.build(nn::LayerInit{torch::kMeta}, tiny);
    m.second = m.first;
    std::string path = a.prefix;
    if (!path.empty() && path.back() == '.') path.pop_back();
    if (!path.empty()) {
      m.second = std::make_shared<torch::nn::Module>("CheckpointRoot");
      nn::register_at(*m.second, path, m.first);
    }
  }
  return m;
}

ResolvedModel resolve_model_uncached(const models::Architecture& arch, const TrainConfig& c, int64_t vocab) {
  ResolvedModel r;
  std::vector<nn::BlockTable*> tables;
  if (arch.family == models::Family::tiny_unet) {
    TinyUNetModelOptions o = TinyUNetModelOptions::from_config(c, vocab);
    o.unet.init(nn::LayerInit{torch::kMeta});
    o.text.init(nn::LayerInit{torch::kMeta});
    r.emoji = TinyUNetModel(o);
    r.root = r.emoji.ptr();
    tables = r.emoji->block_tables();
  } else {
    auto [denoiser, root] = meta_model(arch, c.tiny);
    r.denoiser = denoiser.get();
    r.root = root;
    tables = models::denoiser_block_tables(*root);
  }
  r.resolution = precision::resolve(*r.root, precision_policy(c), {tables.begin(), tables.end()});

  std::map<std::string, const torch::nn::Module*> module_at;
  for (const auto& item : r.root->named_modules("", /*include_self=*/true)) module_at[item.key()] = item.value().get();
  std::map<std::string, const precision::ModuleRow*> block_rows;
  for (const auto& m : r.resolution.modules) {
    if (m.block) block_rows[m.path] = &m;
  }
  // Parameters by their innermost enclosing block ("" when none).
  struct Own {
    int64_t numel = 0, trainable = 0, bytes = 0;
  };
  std::map<std::string, Own> own;
  Own all;
  for (const auto& p : r.resolution.params) {
    std::string owner;
    for (size_t i = p.path.size(); i-- > 0;) {
      if (p.path[i] == '.' && block_rows.count(p.path.substr(0, i))) {
        owner = p.path.substr(0, i);
        break;
      }
    }
    for (Own* o : {&own[owner], &all}) {
      o->numel += p.numel;
      o->trainable += p.settings.trainable ? p.numel : 0;
      o->bytes += p.numel * precision::storage_bytes(p);
    }
  }
  const bool lora = !c.network_module.empty();
  const int64_t chunk = c.attention_chunk_mib * (int64_t{1} << 20);
  auto settings = [&](const precision::Settings& s, const Own& o, bool checkpoint) {
    nn::TracePrecision t;
    t.compute_elem = compute_elem_of(s.compute);
    t.emulate_fp16 = s.compute == precision::Dtype::fp16;
    t.param_elem = o.numel > 0 ? (o.bytes < 3 * o.numel ? 2 : 4) : elem_of(s.storage);
    t.autocast = t.param_elem != t.compute_elem;
    // Mostly one byte per parameter: fp8 storage (Linear / Conv2d weights as bytes).
    t.fp8_weights = o.numel > 0 && 2 * o.bytes < 3 * o.numel;
    t.frozen = lora;  // LoRA: adapters on the frozen base (their gradients are added by plan_memory)
    t.trainable = o.numel > 0 ? static_cast<double>(o.trainable) / static_cast<double>(o.numel) : (s.trainable ? 1 : 0);
    t.checkpoint = checkpoint;
    t.attention_chunk_bytes = chunk;
    return t;
  };
  int64_t checkpointable = 0, checkpointed = 0;
  for (const auto& [path, row] : block_rows) {
    const bool ckpt = row->checkpointable && row->settings.checkpoint;
    checkpointable += row->checkpointable;
    checkpointed += ckpt;
    r.blocks[module_at.at(path)] = settings(row->settings, own[path], ckpt);
  }
  const precision::Settings root =
      r.resolution.modules.empty() ? precision::Settings{} : r.resolution.modules[0].settings;
  r.whole = settings(root, all, checkpointable > 0 && 2 * checkpointed >= checkpointable);
  return r;
}

// resolve_model_uncached, cached by everything it depends on (the advisor
// plans hundreds of variants of one config).
std::shared_ptr<const ResolvedModel> resolve_model(const models::Architecture& arch, const TrainConfig& c,
                                                   int64_t vocab) {
  std::string key = fmt::format("{}|{}|{}|{}|", arch.name, c.tiny, c.network_module, c.attention_chunk_mib);
  if (arch.family == models::Family::tiny_unet) key += TinyUNetModelOptions::from_config(c, vocab).to_json().dump();
  const precision::Policy policy = precision_policy(c);
  for (const auto& rule : policy.rules()) {
    key += fmt::format("|{}:{}:{}:{}:{}:{}:{}", rule.match, rule.kind.value_or("-"),
                       rule.storage ? precision::to_string(*rule.storage) : "-",
                       rule.compute ? precision::to_string(*rule.compute) : "-",
                       rule.trainable ? (*rule.trainable ? "t" : "f") : "-",
                       rule.checkpoint ? (*rule.checkpoint ? "t" : "f") : "-",
                       rule.master_fp32 ? (*rule.master_fp32 ? "t" : "f") : "-");
  }
  // bf16_compute and the device decide whether bf16 compute runs as fp32.
  if (const auto& sub = policy.compute_substitution()) {
    key += fmt::format("|sub:{}>{}", precision::to_string(sub->from), precision::to_string(sub->to));
  }
  static std::mutex mutex;
  static std::map<std::string, std::shared_ptr<const ResolvedModel>> cache;
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
  }
  auto r = std::make_shared<const ResolvedModel>(resolve_model_uncached(arch, c, vocab));
  std::lock_guard<std::mutex> lock(mutex);
  if (cache.size() > 64) cache.clear();
  cache.emplace(key, r);
  return r;
}

// Traces the model of `r` for one micro-batch of `c` into `tracer`.
void trace_model(nn::MemoryTracer& tracer, const models::Architecture& arch, const TrainConfig& c,
                 const ResolvedModel& r) {
  const int64_t B = c.train_batch_size;
  if (r.emoji) {
    tracer.set_block_lookup([&r](const torch::nn::Module* m) -> const nn::TracePrecision* {
      auto it = r.blocks.find(m);
      return it == r.blocks.end() ? nullptr : &it->second;
    });
    models::trace_text_to_image(*r.emoji->unet, *r.emoji->text_encoder, tracer, B, c.resolution);
  } else {
    models::DenoiserBatch in = models::denoiser_batch(arch, B, c.resolution);
    // SD3: 77 CLIP tokens, then T5's (t5xxl_max_token_length) or 77 zero tokens without T5 (train/sd3_model.cpp).
    if (arch.family == models::Family::mmdit)
      in.context_tokens = 77 + (c.t5xxl.empty() ? 77 : c.t5xxl_max_token_length);
    arch.trace(*r.denoiser, tracer, in);
  }
}

// The registry row of the config's architecture, if the planner models it
// (the denoisers: tiny-unet from the run config, the others by their trace).
const models::Architecture& planned_architecture(const std::string& name) {
  for (const auto& a : models::architectures()) {
    if (a.name == name && (a.trace || a.family == models::Family::tiny_unet)) return a;
  }
  fail("plan: architecture '{}' is not known to the planner (known: {})", name,
       models::join_names(models::denoiser_architectures()));
}

}  // namespace

nlohmann::json MemoryPlan::to_json() const {
  nlohmann::json j;
  j["predicted_peak_bytes"] = predicted_peak_bytes;
  j["first_step_peak_bytes"] = first_step_peak_bytes;
  for (int c = 0; c <= kT; ++c) j[fmt::format("{}_bytes", to_string(static_cast<MemoryCategory>(c)))] = at_peak[c];
  j["host_bytes"] = host_bytes;
  j["parameters"] = parameters;
  j["peak_phase"] = peak_phase;
  j["ema_bytes"] = ema_bytes;
  j["activations_kept_bytes"] = activation_bytes;
  j["checkpointing_saving_bytes"] = checkpointing_saving_bytes;
  j["device_fixed_bytes"] = device_fixed_bytes;
  j["world_size"] = world_size;
  j["zero_stage"] = zero_stage;
  j["communication_bytes"] = communication_bytes;
  j["notes"] = notes;
  return j;
}

namespace {

/// The fp32 buckets a gradient reduction after backward holds at once, two
/// in flight, each whole tensors of at most dist::kDefaultBucketBytes (a
/// larger tensor alone). Stages 0-1 (dist/data_parallel.h): the tensors in
/// (reverse) parameter order. ZeRO stage >= 2 (`owners` given;
/// dist::ZeroSharding::make_buckets): a bucket holds one owner's tensors,
/// filled per owner in parameter order, the buckets ordered by their first
/// tensor; `resident` (stage 3: the tensors in no streamed block; empty: all)
/// says which take part.
int64_t reduction_buffer_bytes(const std::vector<int64_t>& numels, const dist::TensorOwnership* owners,
                               const std::vector<bool>& resident) {
  const int64_t cap = dist::kDefaultBucketBytes / 4;
  struct Bucket {
    size_t first = 0;
    int64_t numel = 0;
  };
  std::vector<Bucket> done;
  std::map<int, Bucket> filling;  // per owner (-1: stages 0-1, one stream)
  for (size_t i = 0; i < numels.size(); ++i) {
    if (!resident.empty() && !resident[i]) continue;
    Bucket& b = filling[owners ? owners->owner(i) : -1];
    if (b.numel > 0 && b.numel + numels[i] > cap) {
      done.push_back(b);
      b = Bucket{};
    }
    if (b.numel == 0) b.first = i;
    b.numel += numels[i];
  }
  for (const auto& [owner, b] : filling) {
    if (b.numel > 0) done.push_back(b);
  }
  std::stable_sort(done.begin(), done.end(), [](const Bucket& x, const Bucket& y) { return x.first < y.first; });
  int64_t most = done.empty() ? 0 : done.front().numel;
  for (size_t i = 1; i < done.size(); ++i) most = std::max(most, done[i - 1].numel + done[i].numel);
  return most * 4;
}

/// The largest bucket of the owners' broadcast of updated weights after a
/// ZeRO step (dist::ZeroSharding::broadcast_updated_parameters: whole
/// tensors of one owner and dtype, at most dist::kDefaultBucketBytes each, a
/// larger one alone, one bucket at a time). `bytes`, `dtypes`: each trained
/// tensor's stored bytes and dtype; `resident` as in reduction_buffer_bytes.
int64_t weight_broadcast_bucket_bytes(const std::vector<int64_t>& bytes, const std::vector<at::ScalarType>& dtypes,
                                      const dist::TensorOwnership& owners, const std::vector<bool>& resident) {
  std::map<std::pair<int, int>, int64_t> filling;  // per (owner, dtype)
  int64_t largest = 0;
  for (size_t i = 0; i < bytes.size(); ++i) {
    if (!resident.empty() && !resident[i]) continue;
    int64_t& b = filling[{owners.owner(i), static_cast<int>(dtypes[i])}];
    if (b > 0 && b + bytes[i] > dist::kDefaultBucketBytes) b = 0;
    b += bytes[i];
    largest = std::max(largest, b);
  }
  return largest;
}

}  // namespace

MemoryPlan plan_memory(const TrainConfig& c, int64_t vocab_size, int world_size) {
  if (world_size < 1) fail("plan: world size must be >= 1 (got {})", world_size);
  const models::Architecture& arch = planned_architecture(c.architecture);
  const bool emoji = arch.family == models::Family::tiny_unet;
  if (emoji && vocab_size < 1) fail("plan: vocab_size must be >= 1 (got {})", vocab_size);
  if (emoji && !c.network_module.empty()) {
    fail(
        "plan: LoRA training (network_module = \"{}\") of tiny-unet is not modelled by the planner; it plans "
        "LoRA on the released architectures only",
        c.network_module);
  }
  if (emoji) {
    if (c.text_dim % c.num_heads != 0) fail("plan: text_dim {} not divisible by num_heads {}", c.text_dim, c.num_heads);
    const int64_t factor = int64_t{1} << (c.channel_mult.size() - 1);
    if (c.resolution % factor != 0) fail("plan: resolution {} must be divisible by {}", c.resolution, factor);
    for (int64_t l : c.attention_levels) {
      const int64_t levels = static_cast<int64_t>(c.channel_mult.size());
      if (l < 0 || l >= levels) fail("plan: attention level {} out of range [0, {})", l, levels);
    }
  }
  // ---- the model and its resolved precision policy ----
  const std::shared_ptr<const ResolvedModel> resolved = resolve_model(arch, c, vocab_size);
  const ResolvedModel& r = *resolved;
  nn::MemoryTracer tracer(r.whole);
  trace_model(tracer, arch, c, r);

  // ---- parameters: storage, trainable, fp32 masters (from the resolution) ----
  MemoryPlan p;
  std::vector<std::pair<std::vector<int64_t>, at::ScalarType>> trained;  // shape, the optimizer tensor's dtype
  int64_t masters = 0, grad_bytes_storage = 0, frozen_parameters = 0;
  bool fp16_training = false;
  // zero_stage = 3: the outermost checkpointed block holding each trained
  // tensor (-1: none, resident), as train/block_streaming.h groups them.
  std::vector<std::string> checkpointed_paths, all_checkpointed_paths;
  for (const auto& m : r.resolution.modules) {
    if (!m.block || !m.checkpointable || !m.settings.checkpoint) continue;
    all_checkpointed_paths.push_back(m.path + ".");
    if (m.trainable_parameters > 0) checkpointed_paths.push_back(m.path + ".");
  }
  // The outermost (shortest) of `paths` holding parameter `path`: -1 when none.
  auto outermost = [](const std::vector<std::string>& paths, const std::string& path) {
    int group = -1;
    size_t length = SIZE_MAX;
    for (size_t b = 0; b < paths.size(); ++b) {
      if (path.compare(0, paths[b].size(), paths[b]) == 0 && paths[b].size() < length) {
        group = static_cast<int>(b);
        length = paths[b].size();
      }
    }
    return group;
  };
  // offload_params (train/block_streaming.h): every parameter of a
  // checkpointed block in host memory, the block in use on the device.
  int64_t offload_weights = 0, offload_grads = 0, offload_trained_elements = 0;
  std::map<int, int64_t> offload_group_weights;
  std::vector<int> group_of_trained;       // per trained tensor
  std::vector<int64_t> weight_of_trained;  // its stored bytes
  std::vector<int64_t> master_of_trained;  // its fp32 master's bytes (0: none)
  const bool lora = !c.network_module.empty();
  for (const auto& q : r.resolution.params) {
    const precision::Settings& s = q.settings;
    // LoRA: `train` freezes every base weight, whatever the precision rules
    // say (it still takes fp16 loss scaling from them, as apply_precision).
    const bool trains = s.trainable && !lora;
    fp16_training = fp16_training || (s.trainable && s.storage == precision::Dtype::fp16);
    p.weights_bytes += q.numel * precision::storage_bytes(q);
    if (const int g = outermost(all_checkpointed_paths, q.path); g >= 0) {
      offload_weights += q.numel * precision::storage_bytes(q);
      offload_group_weights[g] += q.numel * precision::storage_bytes(q);
      if (trains) {
        offload_trained_elements += q.numel;
        offload_grads += q.numel * precision::container_bytes(s.storage);
      }
    }
    if (!trains) {
      frozen_parameters += q.numel;
      continue;
    }
    group_of_trained.push_back(outermost(checkpointed_paths, q.path));
    weight_of_trained.push_back(q.numel * precision::storage_bytes(q));
    const bool master = s.master_fp32 && s.storage != precision::Dtype::fp32;
    masters += master ? q.numel * 4 : 0;
    master_of_trained.push_back(master ? q.numel * 4 : 0);
    grad_bytes_storage += q.numel * precision::container_bytes(s.storage);
    trained.emplace_back(q.shape, master ? at::kFloat : precision::container_dtype(s.storage));
  }
  for (const auto& m : r.resolution.modules) {
    fp16_training = fp16_training || (m.block && m.settings.compute == precision::Dtype::fp16);
  }
  // Gradients reach the optimizer through the fp32 bridge (loss scaling or masters).
  const bool bridge = fp16_training || masters > 0;
  int64_t lora_elem = 0;
  if (lora) {
    // LoRA: the adapters the trainer would attach, on a fresh meta model
    // (nothing allocated); they are the trainable parameters.
    auto model = models::build_architecture(c.architecture, nn::LayerInit{torch::kMeta}, c.tiny);
    nn::LoraNetwork network(*model, std::vector<nn::LoraComponent>{{"lora_unet", ""}}, lora_options(c));
    lora_elem = c.full_bf16 ? 2 : 4;
    trained.clear();
    for (const auto& q : network->parameters()) {
      trained.emplace_back(q.sizes().vec(), lora_elem == 2 ? at::kBFloat16 : at::kFloat);
    }
  }
  for (const auto& [shape, dtype] : trained) p.parameters += nn::numel_of(shape);
  p.resident_tensors =
      static_cast<int64_t>(r.resolution.params.size() + (lora ? trained.size() : 0) + 3 * trained.size());
  if (lora) p.weights_bytes += p.parameters * lora_elem;
  // The dominant storage of the trained weights (their gradients' dtype).
  const int64_t weight_elem = lora ? lora_elem : (p.parameters > 0 && grad_bytes_storage < 3 * p.parameters) ? 2 : 4;
  if (r.denoiser) {
    p.notes.push_back(
        "the denoiser only: latents and text-encoder outputs are assumed cached (the latent encoder and the "
        "text encoders are not resident), inputs as bench/model_step feeds them");
    // Buffers stored with the weights (MMDiT's pos_embed: 226M elements at full size).
    const int64_t buffer_elem = (c.full_bf16 || c.full_fp16) ? 2 : 4;
    for (const auto& b : r.denoiser->buffers()) p.weights_bytes += b.numel() * buffer_elem;
    if (!c.precision_rules.empty()) {
      p.notes.push_back(
          "per-module [[precision.rule]] entries set each parameter's storage, trainable and master; "
          "the denoiser's forward is traced with the policy's dominant compute dtype and "
          "checkpointing");
    }
  }
  if (lora) {
    p.notes.push_back(
        fmt::format("LoRA: {} adapter parameters train, {} base parameters frozen; activations are planned as for full "
                    "training (a frozen layer's input is counted as saved), so the plan errs high",
                    p.parameters, frozen_parameters));
  }
  if (bridge) {
    p.notes.push_back(fmt::format("{}{}gradients reach the optimizer as fp32 copies",
                                  fp16_training ? "fp16 with loss scaling; " : "",
                                  masters > 0 ? fmt::format("fp32 master weights ({} bytes); ", masters) : ""));
  }
  int64_t state = 0, scratch = 0, largest = 0, largest_state = 0;
  std::vector<int64_t> state_of, numel_of_trained;  // per trained tensor, in parameter order
  for (const auto& [shape, dtype] : trained) {
    const OptimizerStateSize m = optimizer_state_for(c, shape, dtype);
    state += m.state;
    scratch = std::max(scratch, m.scratch);
    largest = std::max(largest, nn::numel_of(shape));
    largest_state = std::max(largest_state, m.state);
    state_of.push_back(m.state);
    numel_of_trained.push_back(nn::numel_of(shape));
  }
  // Several ranks (dist/): ZeRO stages 1-2 keep on each rank the state of
  // the tensors it owns (dist::TensorOwnership, whole tensors); the plan is
  // of the rank that owns the most state.
  p.world_size = world_size;
  p.zero_stage = world_size > 1 ? c.zero_stage : 0;
  int64_t ema_elements = p.parameters;  // ZeRO: the EMA of that rank's own tensors
  if (p.zero_stage >= 1) {
    const dist::TensorOwnership owners(numel_of_trained, world_size);
    std::vector<int64_t> per_rank(static_cast<size_t>(world_size), 0);
    for (size_t i = 0; i < state_of.size(); ++i) per_rank[static_cast<size_t>(owners.owner(i))] += state_of[i];
    const auto most = std::max_element(per_rank.begin(), per_rank.end());
    p.notes.push_back(fmt::format(
        "ZeRO stage {} at world size {}: rank {} owns the most optimizer state, {} of {} in all (whole tensors "
        "balanced by element count), and the EMA of those tensors{}",
        p.zero_stage, world_size, most - per_rank.begin(), format_bytes(*most), format_bytes(state),
        p.zero_stage >= 3   ? ""
        : p.zero_stage == 2 ? "; weights stay whole on every rank"
                            : "; weights and gradients stay whole on every rank"));
    const int most_rank = static_cast<int>(most - per_rank.begin());
    ema_elements = owners.elements_of(most_rank);
    // fp32 masters are optimizer state: that rank keeps its own tensors' only.
    masters = 0;
    for (size_t i = 0; i < master_of_trained.size(); ++i) {
      if (owners.owner(i) == most_rank) masters += master_of_trained[i];
    }
    if (p.zero_stage == 2 && c.fused_backward_pass) {
      p.notes.push_back(
          "stage 2 with fused backward: each step gradient is reduced to its owner inside backward, in buckets "
          "per owner, and the other ranks drop theirs");
    } else if (p.zero_stage == 2) {
      p.notes.push_back(
          "stage 2 reduces each gradient to its owner after backward, when every gradient exists on every rank: "
          "the peak (the start of that reduction) is stage 1's; only the optimizer step holds fewer gradients");
    }
    state = *most;
  }
  // Stage 3 (dist/zero.h): a rank keeps the streamed weights it owns, the
  // resident ones, and the block in use gathered; its gradients likewise
  // (each block's are reduced to their owners right after its backward).
  int64_t stage3_weights_saved = 0, stage3_gradients = -1;
  int64_t stage3_owned_gradients = 0;  // of the rank owning the most: in stage3_gradients
  int64_t stage3_in_use = 0;           // the blocks gathered in backward (none after it)
  // Stage 3: the trained elements whose micro-batch sums this rank keeps
  // (full_bf16 with accumulation: the resident ones and its own streamed ones).
  int64_t stage3_accumulated_elements = -1;
  // Fused at stage 3 (FusedReduction::every_micro_batch): every micro-batch's
  // gradients go to their owners, which alone buffer them.
  int64_t stage3_fused_accumulated_elements = -1;
  if (p.zero_stage == 3 && !lora) {
    const dist::TensorOwnership owners(numel_of_trained, world_size);
    std::vector<int64_t> owned_weights(static_cast<size_t>(world_size), 0);
    std::map<int, int64_t> group_weights;
    int64_t streamed_weights = 0, resident_grads = 0;
    std::vector<int64_t> owned_grads(static_cast<size_t>(world_size), 0);
    std::vector<int64_t> owned_elements(static_cast<size_t>(world_size), 0);
    int64_t resident_elements = 0;
    for (size_t i = 0; i < group_of_trained.size(); ++i) {
      const int64_t grad_bytes = numel_of_trained[i] * c10::elementSize(trained[i].second);
      if (group_of_trained[i] < 0) {
        resident_grads += grad_bytes;
        resident_elements += numel_of_trained[i];
        continue;
      }
      streamed_weights += weight_of_trained[i];
      group_weights[group_of_trained[i]] += weight_of_trained[i];
      owned_weights[static_cast<size_t>(owners.owner(i))] += weight_of_trained[i];
      owned_grads[static_cast<size_t>(owners.owner(i))] += grad_bytes;
      owned_elements[static_cast<size_t>(owners.owner(i))] += numel_of_trained[i];
    }
    stage3_accumulated_elements = resident_elements + *std::max_element(owned_elements.begin(), owned_elements.end());
    for (int r = 0; r < world_size; ++r)
      stage3_fused_accumulated_elements = std::max(stage3_fused_accumulated_elements, owners.elements_of(r));
    int64_t largest_group = 0;
    for (const auto& [g, bytes] : group_weights) largest_group = std::max(largest_group, bytes);
    const int64_t most_owned = *std::max_element(owned_weights.begin(), owned_weights.end());
    // The block running and, with zero3_prefetch, the next one gathered in flight.
    const int64_t in_use = largest_group * (c.zero3_prefetch ? 2 : 1);
    stage3_in_use = std::min(in_use, streamed_weights - most_owned);
    stage3_weights_saved = streamed_weights - most_owned - in_use;
    stage3_owned_gradients = *std::max_element(owned_grads.begin(), owned_grads.end());
    stage3_gradients = resident_grads + stage3_owned_gradients + largest_group;
    p.notes.push_back(fmt::format(
        "ZeRO stage 3: {} of the trained weights in {} checkpointed blocks are sharded (this rank keeps {} of "
        "them, plus the largest block, {}, while it runs{}); the rest stays on every rank",
        format_bytes(streamed_weights), group_weights.size(), format_bytes(most_owned), format_bytes(largest_group),
        c.zero3_prefetch ? ", and as much again for the next block, prefetched" : ""));
    if (group_weights.empty()) {
      p.notes.push_back("ZeRO stage 3 streams checkpointed blocks only: set gradient_checkpointing = true");
    }
  }
  if (p.zero_stage == 3 && lora) {
    p.notes.push_back(
        "a LoRA network at ZeRO stage 3: the run refuses it (the adapters live outside the checkpointed blocks, "
        "so nothing streams); planned as stage 2, which shards their optimizer state and gradients");
  }
  p.weights_bytes -= std::max<int64_t>(0, stage3_weights_saved);
  // offload_params (one process): the streamed weights and gradients in host
  // memory, the largest block's on the device while it runs; its optimizer
  // state in host memory as with offload_optimizer_state.
  // LoRA: the frozen base weights of the blocks stream (the adapters, outside
  // the blocks, stay on the device with their gradients).
  const bool offload = c.offload_params && world_size == 1;
  // What `train` refuses is planned as the run it would be, with a note.
  if (c.offload_params && world_size > 1) {
    p.notes.push_back(fmt::format(
        "offload_params is for one process: `train` refuses it at world size {} (planned without it)", world_size));
  } else if (c.offload_params && c.fused_backward_pass) {
    p.notes.push_back(
        "offload_params with fused_backward_pass: `train` refuses the pair (the fused backward steps each "
        "gradient where it is made); planned as offloaded");
  } else if (c.offload_params && (bridge || (c.full_bf16 && c.gradient_accumulation_steps > 1))) {
    p.notes.push_back(fmt::format(
        "offload_params with {}: `train` refuses it (offloading moves each block's gradients to host memory "
        "through autograd's .grad, and that gradient path keeps them elsewhere); planned as offloaded",
        bridge ? "fp16 loss scaling or fp32 master weights" : "full_bf16 and gradient_accumulation_steps > 1"));
  }
  if (offload) {
    // Their gradients leave the device block by block: the trace frees them
    // (TraceOptions::segment_gradients_leave below).
    int64_t block_weights = 0;
    for (const auto& [g, bytes] : offload_group_weights) block_weights = std::max(block_weights, bytes);
    p.weights_bytes -= offload_weights - block_weights;
    p.host_bytes += offload_weights + offload_grads;
    p.notes.push_back(fmt::format(
        "offload_params: {} of weights in {} checkpointed blocks and {} of their gradients live in host memory, "
        "with the optimizer state; the largest block, {}, is on the device while it runs",
        format_bytes(offload_weights), offload_group_weights.size(), format_bytes(offload_grads),
        format_bytes(block_weights)));
    if (offload_group_weights.empty())
      p.notes.push_back("offload_params streams checkpointed blocks only: set gradient_checkpointing = true");
  }
  p.largest_parameter = largest;
  p.ema_bytes = c.ema_decay > 0 ? ema_elements * 4 : 0;
  if (offload && p.ema_bytes > 0) {
    // The streamed weights' fp32 shadows beside their host copies (EMA::move_shadows_to_host).
    p.ema_bytes -= offload_trained_elements * 4;
    p.host_bytes += offload_trained_elements * 4;
  }
  const bool state_offloaded = c.offload_optimizer_state || offload;
  const int64_t device_state = state_offloaded ? 0 : state;
  p.host_bytes += state_offloaded ? state : 0;
  // The trainer charges fp32 masters to optimizer_state (as ZeRO counts them).
  p.optimizer_state_bytes = device_state + p.ema_bytes + masters;

  // Per-update scratch: fp32 copy of a bf16 gradient (fused: accumulator
  // finish; clipped non-fused step: g.to(fp32) * scale), the optimizer's own,
  // offload staging (a device copy of one parameter's state).
  const int64_t grad_elem = weight_elem;
  const int64_t staging = state_offloaded ? largest_state : 0;
  const int64_t accum = c.gradient_accumulation_steps;

  nn::TraceOptions to;
  to.fused = c.fused_backward_pass;
  to.segment_gradients_leave = offload && !lora;  // each block's gradients go to host memory after its backward
  // Fused update of one parameter: fp32 copy of a bf16 gradient + the
  // optimizer's scratch (per gradient byte, taken at the largest parameter).
  if (to.fused) {
    const double per_byte = (grad_elem == 2 ? 2.0 : 0.0) +
                            (largest > 0 ? static_cast<double>(scratch + staging) / (largest * grad_elem) : 0.0);
    to.fused_transient_per_grad_byte = per_byte;
  }
  const nn::TraceResult tr = tracer.sim.simulate(to);
  p.activation_bytes = tr.forward_kept;
  if (c.gradient_checkpointing || !c.precision_rules.empty()) {
    // The same policy with checkpointing off everywhere.
    TrainConfig off = c;
    off.gradient_checkpointing = false;
    for (auto& rule : off.precision_rules) rule.checkpoint.reset();
    const std::shared_ptr<const ResolvedModel> r_off = resolve_model(arch, off, vocab_size);
    nn::MemoryTracer t2(r_off->whole);
    trace_model(t2, arch, off, *r_off);
    p.checkpointing_saving_bytes = t2.sim.simulate(to).forward_kept - tr.forward_kept;
  }

  // Gradient-accumulation buffers alive through the step (gradients).
  // Several ranks: at stages 0-2 every rank buffers every gradient (no
  // communication before the last micro-batch); at stage 3 only what it
  // keeps: the accumulator its own streamed tensors' sums over the ranks
  // and the resident ones, the fused backward its own tensors' sums.
  int64_t accum_buffers = 0;
  const int64_t accumulated_elements =
      c.fused_backward_pass && stage3_fused_accumulated_elements >= 0 ? stage3_fused_accumulated_elements
      : !c.fused_backward_pass && stage3_accumulated_elements >= 0    ? stage3_accumulated_elements
                                                                      : p.parameters;
  if (accum > 1 && !bridge) {
    const bool sr16 = c.gradient_accumulation_dtype == "bf16_sr" && weight_elem == 2;
    if (c.fused_backward_pass || weight_elem == 2) accum_buffers = accumulated_elements * (sr16 ? 2 : 4);
  }

  Bytes persistent{};
  persistent[kW] = p.weights_bytes;
  persistent[kS] = p.optimizer_state_bytes;
  persistent[kG] = accum_buffers;
  // LoRA without fusion: the adapters' gradients (not in the trace, whose
  // base layers are frozen), counted from the start of backward (errs high).
  if (lora && !c.fused_backward_pass) persistent[kG] += p.parameters * lora_elem;

  // Phase A: forward + backward of a micro-batch. At stage 3 the
  // accumulator path's owned gradients are in its buffers (persistent).
  const bool accumulator = !c.fused_backward_pass && accum > 1 && weight_elem == 2 && !bridge;
  Bytes a = tr.at_peak;
  if (stage3_gradients >= 0) a[kG] = std::min(a[kG], stage3_gradients - (accumulator ? stage3_owned_gradients : 0));
  for (int k = 0; k < kNumMemoryCategories; ++k) a[k] += persistent[k];
  int64_t peak_a = 0;
  for (int64_t v : a) peak_a += v;

  // Phase B (not fused): every gradient present; the norm, then per
  // parameter: clipped fp32 copy, optimizer scratch, staging; EMA update's
  // fp32 copy of a bf16 weight. Through the fp32 bridge, every gradient is
  // first copied to fp32 (both alive until the copies replace them).
  Bytes b = persistent;
  b[kW] -= stage3_in_use;  // no block is gathered for the update
  int64_t peak_b = 0;
  // Bytes by which the gradient reduction (before the update, when step 1
  // has no optimizer state yet) exceeds the update's own temporaries in peak_b.
  int64_t reduction_excess = 0;
  if (!c.fused_backward_pass) {
    const int64_t fp32_grads = p.parameters * 4;
    if (accumulator) {
      // .grad is folded into the accumulation buffers after every
      // micro-batch; the step reads the buffers (bf16_sr: as fp32 copies).
      // Several ranks: each buffer becomes its fp32 sum before the
      // reduction (GradientPath::sum_into_grad), freed as it is converted.
      if (c.gradient_accumulation_dtype == "bf16_sr" && world_size > 1) {
        b[kG] += accumulated_elements * 4 - accum_buffers;
      } else if (c.gradient_accumulation_dtype == "bf16_sr") {
        b[kT] += accumulated_elements * 4;
      }
    } else if (bridge) {
      b[kG] += fp32_grads;
    } else {
      b[kG] += stage3_gradients >= 0 ? std::min(tr.gradients_after, stage3_gradients) : tr.gradients_after;
    }
    const int64_t norm_tmp = largest * ((grad_elem == 2 && !bridge) ? 8 : 4);
    const int64_t step_tmp = largest * 4 + scratch + staging;
    const int64_t ema_tmp = (p.ema_bytes > 0 && weight_elem == 2) ? largest * 4 : 0;
    if (world_size > 1) {
      std::optional<dist::TensorOwnership> owners;
      std::vector<bool> resident;
      if (p.zero_stage >= 2) owners.emplace(numel_of_trained, world_size);
      if (p.zero_stage == 3 && !lora) {
        for (int g : group_of_trained) resident.push_back(g < 0);
      }
      p.communication_bytes = reduction_buffer_bytes(numel_of_trained, owners ? &*owners : nullptr, resident);
    }
    const int64_t update_tmp = std::max({norm_tmp, step_tmp, ema_tmp});
    b[kT] += std::max(update_tmp, p.communication_bytes);
    reduction_excess = std::max<int64_t>(0, p.communication_bytes - update_tmp);
    for (int64_t v : b) peak_b += v;
    if (bridge) {
      // The moment of the copy: the gradients as backward left them and their fp32 copies.
      int64_t copy_peak = 0;
      for (int k = 0; k < kNumMemoryCategories; ++k) copy_peak += persistent[k];
      copy_peak += tr.gradients_after + fp32_grads;
      if (copy_peak > peak_b) {
        peak_b = copy_peak;
        reduction_excess = 0;
        b = persistent;
        b[kG] += tr.gradients_after + fp32_grads;
      }
    }
  }
  if (peak_a >= peak_b) {
    p.predicted_peak_bytes = peak_a;
    p.at_peak = a;
    p.peak_phase = tr.peak_op;
  } else {
    p.predicted_peak_bytes = peak_b;
    p.at_peak = b;
    p.peak_phase = "optimizer step";
  }
  // Step 1: no optimizer state before the update; it exists in full at the
  // end of the step's updates. Several ranks: the gradient reduction comes
  // before the update, so step 1 holds its buckets without the state.
  p.first_step_peak_bytes = std::max(peak_a - device_state, peak_b - std::min(reduction_excess, device_state));
  // Fused step 1: the state is made as the updates come, while the
  // accumulation buffers (last micro-batch) are freed as their parameters
  // are stepped: at most the larger of the two is whole.
  const int64_t fused_state_or_buffers = std::max(persistent[kG], persistent[kS] - p.ema_bytes);
  if (c.fused_backward_pass) {
    p.first_step_peak_bytes = std::max(peak_a - device_state, persistent[kW] + fused_state_or_buffers + p.ema_bytes +
                                                                  tr.at_peak[kA] / 8);  // rough tail of backward
    p.first_step_peak_bytes = std::min(p.first_step_peak_bytes, peak_a);
  }
  if (c.fused_backward_pass && world_size > 1) {
    // Several ranks (optim/fused_backward.h, FusedReduction): the step
    // gradients wait for their sums in fp32 buckets (fused_bucket_bytes): the one being
    // packed and its flat copy, two more in flight; a model whose gradients
    // fit one bucket holds all of them twice at the end of backward, when
    // the updates (and on step 1 the optimizer state, the EMA after them)
    // come. Errs high by the part of the state created after.
    // One bucket per receiver (ZeRO: the owner), in hook order, taken here
    // as reverse parameter order (fused_bucket_sizes simulates them).
    std::optional<dist::TensorOwnership> owners;
    if (p.zero_stage >= 1) owners.emplace(numel_of_trained, world_size);
    std::vector<int64_t> hook_bytes;
    std::vector<int> hook_roots;
    for (size_t k = numel_of_trained.size(); k-- > 0;) {
      hook_bytes.push_back(numel_of_trained[k] * 4);
      hook_roots.push_back(owners ? owners->owner(k) : -1);
    }
    const FusedBucketSizes sizes = fused_bucket_sizes(
        hook_bytes, hook_roots, fused_bucket_bytes(p.parameters, p.zero_stage >= 1 ? world_size : 1));
    const int64_t largest_bucket = sizes.largest;
    const int64_t buckets = std::min(2 * p.parameters * 4, sizes.peak);
    p.communication_bytes = buckets;
    Bytes e = persistent;  // the activations are freed by then
    e[kW] -= stage3_in_use;
    // With accumulation the buckets are made of the buffers, each freed
    // once packed: one bucket's copy beyond them at a time (not at stage 3,
    // whose buckets carry the last micro-batch's own gradients).
    e[kG] += accum_buffers > 0 && stage3_fused_accumulated_elements < 0 ? std::min(largest_bucket, buckets) : buckets;
    int64_t peak_e = 0;
    for (int64_t v : e) peak_e += v;
    if (peak_e > p.predicted_peak_bytes) {
      p.predicted_peak_bytes = peak_e;
      p.at_peak = e;
      p.peak_phase = "end of backward (fused gradient buckets of several ranks)";
    }
    // Step 1: the optimizer state is created bucket by bucket as the sums
    // arrive; its peak comes with the last bucket, the state (but the EMA,
    // made after the updates) nearly whole.
    int64_t others = 0;  // activations and temporaries that outlive backward
    for (int k = 0; k < kNumMemoryCategories; ++k) {
      if (k != kW && k != kS && k != kG) others += persistent[k];
    }
    p.first_step_peak_bytes = std::max(p.first_step_peak_bytes, persistent[kW] + fused_state_or_buffers + p.ema_bytes +
                                                                    others + std::min(largest_bucket, buckets));
    if (owners && !lora && weight_of_trained.size() == trained.size()) {
      // Then (ZeRO) the owners send their updated weights, a bucket at a
      // time, the step's gradients and buffers gone and the state whole.
      std::vector<at::ScalarType> dtypes;
      for (const auto& t : trained) dtypes.push_back(t.second);
      std::vector<bool> resident;
      if (p.zero_stage == 3 && !lora) {
        for (int g : group_of_trained) resident.push_back(g < 0);
      }
      Bytes f = persistent;
      f[kW] -= stage3_in_use;
      f[kG] = 0;
      f[kT] += weight_broadcast_bucket_bytes(weight_of_trained, dtypes, *owners, resident);
      int64_t peak_f = 0;
      for (int64_t v : f) peak_f += v;
      p.first_step_peak_bytes = std::max(p.first_step_peak_bytes, peak_f);
      if (peak_f > p.predicted_peak_bytes) {
        p.predicted_peak_bytes = peak_f;
        p.at_peak = f;
        p.peak_phase = "broadcast of the updated weights (ZeRO owners)";
      }
    }
  }
  // A run on CUDA (named, or "auto" on a machine with a CUDA device) pays
  // the caching allocator's rounding and the cuBLAS workspaces too.
  const CudaAvailability cuda = cuda_availability();
  if (c.device.rfind("cuda", 0) == 0 || (c.device == "auto" && cuda.built_with_cuda && cuda.device_count > 0)) {
    add_cuda_fixed_costs(p);
  }
  return p;
}

}  // namespace shoestring::plan
