// LoRA (nn/lora.h): kohya names on an LDM-named module tree, the PyTorch
// reference (scripts/gen_lora_reference.py), alpha/rank scaling, the file
// round trip and its errors. TinyUNet cases are in tests/models/test_lora_tiny_unet.cpp.
#include <gtest/gtest.h>

#include <filesystem>
#include <set>

#include <torch/torch.h>

#include "../error_testing.h"
#include "reference_data.h"
#include "shoestring/core/error.h"
#include "shoestring/io/safetensors.h"
#include "shoestring/nn/layers.h"
#include "shoestring/nn/lora.h"

namespace fs = std::filesystem;
using namespace shoestring;
using namespace shoestring::nn;

using shoestring::testing::error_of;

namespace {

std::string temp_file(const std::string& name) {
  fs::path dir = fs::temp_directory_path() / ("shoestring_lora_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  return (dir / name).string();
}

/// Registers `m` under a dotted path below `root`, creating plain modules for
/// the intermediate components (as nn.Sequential / ModuleList nesting does).
template <class Holder>
Holder put(torch::nn::Module& root, const std::string& path, Holder m) {
  torch::nn::Module* cur = &root;
  size_t start = 0;
  for (size_t dot = path.find('.'); dot != std::string::npos; dot = path.find('.', start)) {
    std::string part = path.substr(start, dot - start);
    std::shared_ptr<torch::nn::Module> child;
    for (const auto& c : cur->named_children()) {
      if (c.key() == part) child = c.value();
    }
    if (!child) child = cur->register_module(part, std::make_shared<torch::nn::Module>());
    cur = child.get();
    start = dot + 1;
  }
  cur->register_module(path.substr(start), m);
  return m;
}

const std::string kUnet = "model.diffusion_model.";
const std::string kTe1 = "conditioner.embedders.0.transformer.";

/// A small module tree whose parameters carry SDXL's single-file (LDM) names.
std::shared_ptr<torch::nn::Module> ldm_model(const LayerInit& init = {}) {
  auto root = std::make_shared<torch::nn::Module>();
  const std::string u = kUnet;
  put(*root, u + "input_blocks.0.0", Conv2d(4, 8, 3, 1, 1, true, init));
  put(*root, u + "input_blocks.1.0.in_layers.2", Conv2d(8, 8, 3, 1, 1, true, init));
  put(*root, u + "input_blocks.1.0.emb_layers.1", Linear(16, 8, true, init));
  put(*root, u + "input_blocks.1.0.skip_connection", Conv2d(8, 8, 1, 1, 0, true, init));
  put(*root, u + "input_blocks.4.1.proj_in", Linear(8, 8, true, init));
  const std::string tb = u + "input_blocks.4.1.transformer_blocks.0.";
  put(*root, tb + "attn1.to_q", Linear(8, 8, false, init));
  put(*root, tb + "attn1.to_k", Linear(8, 8, false, init));
  put(*root, tb + "attn1.to_v", Linear(8, 8, false, init));
  put(*root, tb + "attn1.to_out.0", Linear(8, 8, true, init));
  put(*root, tb + "ff.net.0.proj", Linear(8, 32, true, init));
  put(*root, tb + "ff.net.2", Linear(16, 8, true, init));
  put(*root, u + "output_blocks.2.2.conv", Conv2d(8, 8, 3, 1, 1, true, init));
  put(*root, u + "out.2", Conv2d(8, 4, 3, 1, 1, true, init));
  put(*root, kTe1 + "text_model.encoder.layers.0.self_attn.q_proj", Linear(8, 8, true, init));
  put(*root, kTe1 + "text_model.encoder.layers.0.mlp.fc1", Linear(8, 16, true, init));
  put(*root, "first_stage_model.decoder.conv_in", Conv2d(4, 4, 3, 1, 1, true, init));
  return root;
}

const std::vector<LoraComponent> kRoot = {{"lora_unet", ""}};

std::vector<LoraComponent> ldm_components() { return {{"lora_unet", kUnet}, {"lora_te1", kTe1}}; }

std::vector<std::string> module_names(const LoraNetworkImpl& net) {
  std::vector<std::string> names;
  for (const auto& m : net.modules()) names.push_back(m->layer().kohya_name);
  return names;
}

void randomize(LoraNetworkImpl& net, uint64_t seed) {
  torch::manual_seed(seed);
  torch::NoGradGuard no_grad;
  for (auto& p : net.parameters()) p.normal_(0.0, 0.3);
}

}  // namespace

TEST(Lora, KohyaNamesOfLdmLayout) {
  auto root = ldm_model();
  auto table = KohyaNameTable::build(*root, ldm_components());
  // Every Linear / Conv2d under the two components, none from first_stage_model.
  EXPECT_EQ(table.layers().size(), 15u);
  const LoraLayerRef& q = table.at("lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q");
  EXPECT_EQ(q.path, "model.diffusion_model.input_blocks.4.1.transformer_blocks.0.attn1.to_q");
  EXPECT_EQ(q.local_path, "input_blocks.4.1.transformer_blocks.0.attn1.to_q");
  EXPECT_EQ(table.at("lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_out_0").path,
            kUnet + "input_blocks.4.1.transformer_blocks.0.attn1.to_out.0");
  EXPECT_EQ(table.at("lora_te1_text_model_encoder_layers_0_self_attn_q_proj").path,
            kTe1 + "text_model.encoder.layers.0.self_attn.q_proj");
  EXPECT_EQ(table.find("lora_unet_first_stage_model_decoder_conv_in"), nullptr);

  // Default: attention projections only.
  LoraNetwork net(*root, ldm_components(), LoraOptions{});
  EXPECT_EQ(module_names(*net), (std::vector<std::string>{
                                    "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q",
                                    "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_k",
                                    "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_v",
                                    "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_out_0",
                                    "lora_te1_text_model_encoder_layers_0_self_attn_q_proj",
                                }));
  // The network's own keys are the file's keys.
  std::set<std::string> keys;
  for (const auto& p : net->named_parameters()) keys.insert(p.key());
  for (const auto& b : net->named_buffers()) keys.insert(b.key());
  EXPECT_TRUE(keys.count("lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q.lora_down.weight"));
  EXPECT_TRUE(keys.count("lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q.lora_up.weight"));
  EXPECT_TRUE(keys.count("lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q.alpha"));
  EXPECT_EQ(keys.size(), 15u);
}

// LoraOptions::device: the adapters are made there, not beside their layer's
// weight (an offload_params run keeps base weights in host memory while its
// adapters belong on the device); unset, they follow the weight.
TEST(Lora, AdaptersAreMadeOnTheNamedDevice) {
  const LayerInit meta{torch::TensorOptions().device(torch::kMeta)};
  auto root_a = ldm_model(meta), root_b = ldm_model(meta);  // a layer carries one adapter
  LoraNetwork follows(*root_a, ldm_components(), LoraOptions{});
  LoraOptions on_cpu;
  on_cpu.device = torch::kCPU;
  LoraNetwork named(*root_b, ldm_components(), on_cpu);
  ASSERT_FALSE(named->parameters().empty());
  for (const auto& p : follows->parameters()) EXPECT_TRUE(p.is_meta());
  for (const auto& p : named->parameters()) {
    EXPECT_TRUE(p.device().is_cpu());
    EXPECT_TRUE(p.isfinite().all().item<bool>());  // initialised there, not just allocated
  }
}

TEST(Lora, FeedForwardAndConvTargets) {
  auto root = ldm_model();
  LoraOptions o;
  o.rank = 4;
  o.feed_forward = true;
  o.conv_rank = 2;
  o.conv_alpha = 0.5;
  LoraNetwork net(*root, ldm_components(), o);
  std::map<std::string, int64_t> ranks;
  for (const auto& m : net->modules()) ranks[m->layer().kohya_name] = m->rank();
  const std::map<std::string, int64_t> expected = {
      {"lora_unet_input_blocks_1_0_in_layers_2", 2},      // 3x3: conv_dim
      {"lora_unet_input_blocks_1_0_skip_connection", 4},  // 1x1: network_dim, as kohya
      {"lora_unet_input_blocks_4_1_proj_in", 4},
      {"lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q", 4},
      {"lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_k", 4},
      {"lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_v", 4},
      {"lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_out_0", 4},
      {"lora_unet_input_blocks_4_1_transformer_blocks_0_ff_net_0_proj", 4},
      {"lora_unet_input_blocks_4_1_transformer_blocks_0_ff_net_2", 4},
      {"lora_unet_output_blocks_2_2_conv", 2},
      {"lora_te1_text_model_encoder_layers_0_self_attn_q_proj", 4},
      {"lora_te1_text_model_encoder_layers_0_mlp_fc1", 4},
  };
  EXPECT_EQ(ranks, expected);  // not conv_in (input_blocks.0.0), out.2, emb_layers.1
  auto* conv = net->find("lora_unet_input_blocks_1_0_in_layers_2");
  ASSERT_NE(conv, nullptr);
  EXPECT_EQ(conv->down().sizes(), (std::vector<int64_t>{2, 8, 3, 3}));
  EXPECT_EQ(conv->up().sizes(), (std::vector<int64_t>{8, 2, 1, 1}));
  EXPECT_DOUBLE_EQ(conv->scale(), 0.25);
  auto* ff = net->find("lora_unet_input_blocks_4_1_transformer_blocks_0_ff_net_2");
  EXPECT_EQ(ff->down().sizes(), (std::vector<int64_t>{4, 16}));
  EXPECT_EQ(ff->up().sizes(), (std::vector<int64_t>{8, 4}));
  // kohya's initialisation: up zero, down U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
  EXPECT_EQ(conv->up().abs().max().item<float>(), 0.0f);
  EXPECT_LE(conv->down().abs().max().item<float>(), 1.0 / std::sqrt(8.0 * 9.0));
  EXPECT_GT(conv->down().abs().max().item<float>(), 0.5 / std::sqrt(8.0 * 9.0));
}

TEST(Lora, UnknownKohyaNameFailsClearly) {
  auto root = ldm_model();
  auto table = KohyaNameTable::build(*root, ldm_components());
  std::string msg = error_of([&] { table.at("lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_z"); });
  EXPECT_NE(msg.find("unknown module name 'lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_z'"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("15 names known"), std::string::npos) << msg;
  EXPECT_NE(msg.find("lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q"), std::string::npos) << msg;

  // A file naming a module the model lacks.
  std::string path = temp_file("unknown.safetensors");
  save_safetensors(path, {{"lora_unet_middle_block_1_proj_in.lora_down.weight", torch::zeros({2, 8}), std::nullopt},
                          {"lora_unet_middle_block_1_proj_in.lora_up.weight", torch::zeros({8, 2}), std::nullopt}});
  msg = error_of([&] { LoraNetworkImpl::from_file(*root, ldm_components(), path); });
  EXPECT_NE(msg.find("unknown module name 'lora_unet_middle_block_1_proj_in'"), std::string::npos) << msg;
}

TEST(Lora, CollidingKohyaNamesAreAnError) {
  auto root = std::make_shared<torch::nn::Module>();
  put(*root, "a_b.c", Linear(2, 2));
  put(*root, "a.b_c", Linear(2, 2));
  std::string msg = error_of([&] { KohyaNameTable::build(*root, {{"lora_unet", ""}}); });
  EXPECT_NE(msg.find("'a_b.c' and 'a.b_c' both get the kohya name 'lora_unet_a_b_c'"), std::string::npos) << msg;
}

TEST(Lora, LibtorchLayersAreNamedButNotAdapted) {
  auto root = std::make_shared<torch::nn::Module>();
  put(*root, "attn.to_q", torch::nn::Linear(4, 4));
  put(*root, "attn.to_k", Linear(4, 4));
  LoraNetwork net(*root, kRoot, LoraOptions{});
  EXPECT_EQ(module_names(*net), std::vector<std::string>{"lora_unet_attn_to_k"});
  ASSERT_EQ(net->not_adaptable().size(), 1u);
  EXPECT_NE(net->not_adaptable()[0].find("attn.to_q (libtorch torch::nn::Linear has no adapter hook"),
            std::string::npos);
  EXPECT_FALSE(net->names().at("lora_unet_attn_to_q").adaptable());
}

// Forward, merge and the file reader against PyTorch (kohya's formulas).
TEST(Lora, MatchesPyTorchReference) {
  auto ref = shoestring::testing::load_reference("lora_merge");
  for (const std::string c : {"linear", "conv1x1", "conv3x3"}) {
    SCOPED_TRACE(c);
    torch::Tensor W = ref.at(c + ".weight"), x = ref.at(c + ".x");
    const int64_t rank = static_cast<int64_t>(ref.at(c + ".rank").item<float>());
    const double alpha = ref.at(c + ".alpha").item<float>(), mult = ref.at(c + ".multiplier").item<float>();
    auto root = std::make_shared<torch::nn::Module>();
    std::function<torch::Tensor(const torch::Tensor&)> forward;
    if (c == "linear") {
      auto l = put(*root, "layer", Linear(W.size(1), W.size(0)));
      forward = [l](const torch::Tensor& in) mutable { return l->forward(in); };
    } else {
      const bool k3 = c == "conv3x3";
      auto l = put(*root, "layer", Conv2d(W.size(1), W.size(0), W.size(2), k3 ? 2 : 1, k3 ? 1 : 0));
      forward = [l](const torch::Tensor& in) mutable { return l->forward(in); };
    }
    {
      torch::NoGradGuard no_grad;
      for (auto& p : root->named_parameters()) p.value().copy_(ref.at(c + "." + p.key().substr(6)));
    }
    std::string path = temp_file(c + ".safetensors");
    save_safetensors(path, {{"lora_unet_layer.lora_down.weight", ref.at(c + ".down"), std::nullopt},
                            {"lora_unet_layer.lora_up.weight", ref.at(c + ".up"), std::nullopt},
                            {"lora_unet_layer.alpha", torch::full({}, alpha, torch::kFloat16), std::nullopt}});
    auto net = LoraNetworkImpl::from_file(*root, {{"lora_unet", ""}}, path, mult);
    ASSERT_EQ(net->modules().size(), 1u);
    EXPECT_EQ(net->modules()[0]->rank(), rank);
    EXPECT_DOUBLE_EQ(net->modules()[0]->alpha(), alpha);
    torch::NoGradGuard no_grad;
    torch::Tensor adapted = forward(x);
    EXPECT_TRUE(torch::allclose(adapted, ref.at(c + ".adapted"), 1e-5, 1e-5))
        << (adapted - ref.at(c + ".adapted")).abs().max();
    EXPECT_EQ(net->merge(), 1);
    torch::Tensor merged_w = root->named_parameters()["layer.weight"];
    EXPECT_TRUE(torch::allclose(merged_w, ref.at(c + ".merged"), 1e-6, 1e-6))
        << (merged_w - ref.at(c + ".merged")).abs().max();
    torch::Tensor merged_out = forward(x);  // adapter detached: plain layer with merged weight
    EXPECT_TRUE(torch::allclose(merged_out, ref.at(c + ".merged_out"), 1e-5, 1e-5));
    EXPECT_TRUE(torch::allclose(merged_out, adapted, 1e-5, 1e-5));
  }
}

TEST(Lora, ScaleIsMultiplierTimesAlphaOverRank) {
  torch::manual_seed(5);
  auto root = std::make_shared<torch::nn::Module>();
  auto layer = put(*root, "attn.to_v", Linear(6, 5, false, LayerInit(torch::TensorOptions().dtype(torch::kFloat64))));
  LoraOptions o;
  o.rank = 4;
  o.alpha = 2.0;
  o.multiplier = 0.5;
  o.dtype = torch::kFloat64;
  LoraNetwork net(*root, kRoot, o);
  randomize(*net, 6);
  auto* m = net->find("lora_unet_attn_to_v");
  ASSERT_NE(m, nullptr);
  EXPECT_DOUBLE_EQ(m->scale(), 0.5);
  torch::Tensor x = torch::randn({3, 6}, torch::kFloat64);
  torch::NoGradGuard no_grad;
  torch::Tensor base = torch::matmul(x, layer->weight.t());
  torch::Tensor lora = torch::matmul(torch::matmul(x, m->down().t()), m->up().t());
  EXPECT_TRUE(torch::allclose(layer->forward(x), base + 0.5 * (2.0 / 4.0) * lora, 1e-12, 1e-12));
  net->set_multiplier(1.0);
  EXPECT_TRUE(torch::allclose(layer->forward(x), base + (2.0 / 4.0) * lora, 1e-12, 1e-12));
  m->set_alpha(0.0);  // kohya: alpha 0 means alpha = rank, scale 1
  EXPECT_DOUBLE_EQ(m->alpha(), 4.0);
  EXPECT_TRUE(torch::allclose(layer->forward(x), base + lora, 1e-12, 1e-12));
  net->detach();
  EXPECT_TRUE(torch::equal(layer->forward(x), torch::linear(x, layer->weight)));
}

TEST(Lora, SaveLoadRoundTripIsBitExact) {
  torch::manual_seed(7);
  LoraOptions o;
  o.rank = 3;
  o.alpha = 1.5;
  o.conv_rank = 2;
  o.conv_alpha = 1.0;
  o.feed_forward = true;
  auto a_model = ldm_model();
  LoraNetwork a(*a_model, ldm_components(), o);
  randomize(*a, 8);
  std::string path = temp_file("roundtrip.safetensors");
  a->save(path, kohya_lora_metadata(o, "sdxl_base_v1-0"));

  auto file = SafetensorsFile::open(path);
  EXPECT_EQ(file.tensors().size(), 3 * a->modules().size());
  const auto& meta = file.metadata();
  EXPECT_EQ(meta.at("ss_network_module"), "networks.lora");
  EXPECT_EQ(meta.at("ss_network_dim"), "3");
  EXPECT_EQ(meta.at("ss_network_alpha"), "1.5");
  EXPECT_EQ(meta.at("ss_base_model_version"), "sdxl_base_v1-0");
  EXPECT_EQ(nlohmann::json::parse(meta.at("ss_network_args")),
            (nlohmann::json{{"conv_dim", "2"}, {"conv_alpha", "1.0"}, {"train_ff", "true"}}));
  const TensorInfo* alpha = file.find("lora_unet_output_blocks_2_2_conv.alpha");
  ASSERT_NE(alpha, nullptr);
  EXPECT_TRUE(alpha->shape.empty());  // a 0-d tensor, as kohya
  EXPECT_EQ(file.get(*alpha).item<float>(), 1.0f);

  // Into a fresh network on a differently initialised model: equal bit for bit.
  torch::manual_seed(9);
  auto b_model = ldm_model();
  LoraNetwork b(*b_model, ldm_components(), o);
  LoraLoadReport report = b->load(path);
  EXPECT_TRUE(report.missing.empty() && report.unexpected.empty());
  auto pa = a->named_parameters(), pb = b->named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (const auto& p : pa) EXPECT_TRUE(torch::equal(p.value(), pb[p.key()])) << p.key();
  for (const auto& m : a->modules()) EXPECT_EQ(m->alpha(), b->find(m->layer().kohya_name)->alpha());

  // And rebuilt from the file alone (ranks and alphas from the tensors).
  torch::manual_seed(10);
  auto c_model = ldm_model();
  auto c = LoraNetworkImpl::from_file(*c_model, ldm_components(), path);
  EXPECT_EQ(module_names(*c), module_names(*a));
  auto pc = c->named_parameters();
  for (const auto& p : pa) EXPECT_TRUE(torch::equal(p.value(), pc[p.key()])) << p.key();
  EXPECT_EQ(c->find("lora_unet_input_blocks_1_0_in_layers_2")->rank(), 2);

  // Saved as bf16 (kohya's save_precision): loads as the bf16-rounded values.
  std::string bf16_path = temp_file("roundtrip_bf16.safetensors");
  a->save(bf16_path, {}, torch::kBFloat16);
  EXPECT_EQ(SafetensorsFile::open(bf16_path).tensors()[0].dtype, StDtype::BF16);
  b->load(bf16_path);
  for (const auto& p : pa) {
    EXPECT_TRUE(torch::equal(p.value().to(torch::kBFloat16).to(torch::kFloat32), pb[p.key()])) << p.key();
  }
}

TEST(Lora, LoadListsMissingAndUnexpectedKeys) {
  auto model = ldm_model();
  LoraNetwork net(*model, ldm_components(), LoraOptions{});
  randomize(*net, 11);
  // A file without to_k's up weight and with one extra module.
  std::vector<NamedTensor> tensors;
  for (const auto& p : net->named_parameters()) {
    if (p.key() == "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_k.lora_up.weight") continue;
    tensors.push_back({p.key(), p.value(), std::nullopt});
  }
  for (const auto& b : net->named_buffers()) tensors.push_back({b.key(), b.value(), std::nullopt});
  tensors.push_back({"lora_unet_out_2.lora_down.weight", torch::zeros({4, 8, 3, 3}), std::nullopt});
  std::string path = temp_file("partial.safetensors");
  save_safetensors(path, tensors);

  auto model2 = ldm_model();
  LoraNetwork other(*model2, ldm_components(), LoraOptions{});
  std::string msg = error_of([&] { other->load(path); });
  EXPECT_NE(msg.find("1 missing: lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_k.lora_up.weight"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("1 unexpected: lora_unet_out_2.lora_down.weight"), std::string::npos) << msg;
  // A strict load that fails changes nothing.
  EXPECT_EQ(other->find("lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q")->up().abs().max().item<float>(),
            0.0f);

  LoraLoadReport r = other->load(path, /*partial=*/true);
  EXPECT_EQ(r.missing,
            std::vector<std::string>{"lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_k.lora_up.weight"});
  EXPECT_EQ(r.unexpected, std::vector<std::string>{"lora_unet_out_2.lora_down.weight"});
  EXPECT_TRUE(torch::equal(other->find("lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q")->up(),
                           net->find("lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q")->up()));

  // Shape mismatch: always an error.
  LoraOptions wide;
  wide.rank = 8;
  auto model3 = ldm_model();
  LoraNetwork rank8(*model3, ldm_components(), wide);
  msg = error_of([&] { rank8->load(path, true); });
  EXPECT_NE(msg.find("has shape [4, 8], the network expects [8, 8]"), std::string::npos) << msg;

  // from_file: a module without its up weight, or a foreign tensor kind.
  msg = error_of([&] { LoraNetworkImpl::from_file(*ldm_model(), ldm_components(), path); });
  EXPECT_NE(msg.find("lacks lora_up.weight"), std::string::npos) << msg;
  std::string dora = temp_file("dora.safetensors");
  save_safetensors(dora, {{"lora_unet_out_2.dora_scale", torch::zeros({4}), std::nullopt}});
  msg = error_of([&] { LoraNetworkImpl::from_file(*ldm_model(), ldm_components(), dora); });
  EXPECT_NE(msg.find("'dora_scale' is not a networks.lora tensor"), std::string::npos) << msg;
}

TEST(Lora, Bf16BaseWeightsTrainOnlyTheAdapter) {
  torch::manual_seed(12);
  auto root = std::make_shared<torch::nn::Module>();
  LayerInit bf16(torch::TensorOptions().dtype(torch::kBFloat16));
  auto q = put(*root, "attn.to_q", Linear(8, 8, true, bf16));
  auto conv = put(*root, "block.conv", Conv2d(8, 8, 3, 1, 1, true, bf16));
  EXPECT_EQ(freeze_parameters(*root), 4);
  LoraOptions o;
  o.conv_rank = 2;
  LoraNetwork net(*root, kRoot, o);
  randomize(*net, 13);
  for (const auto& p : net->parameters()) EXPECT_EQ(p.scalar_type(), torch::kFloat32);
  torch::Tensor x = torch::randn({2, 8, 4, 4}).to(torch::kBFloat16);
  torch::Tensor y = conv->forward(x);
  torch::Tensor z = q->forward(y.permute({0, 2, 3, 1}));
  EXPECT_EQ(z.scalar_type(), torch::kBFloat16);
  z.to(torch::kFloat32).pow(2).mean().backward();
  for (const auto& p : net->parameters()) {
    ASSERT_TRUE(p.grad().defined());
    EXPECT_EQ(p.grad().scalar_type(), torch::kFloat32);
    EXPECT_GT(p.grad().abs().sum().item<float>(), 0.0f);
  }
  for (const auto& p : root->parameters()) EXPECT_FALSE(p.grad().defined());

  // Merging rounds W + delta once into bf16.
  torch::Tensor before = q->weight.clone();
  torch::Tensor delta = net->find("lora_unet_attn_to_q")->delta_weight();
  net->merge();
  EXPECT_TRUE(torch::equal(q->weight, (before.to(torch::kFloat32) + delta).to(torch::kBFloat16)));
}

TEST(Lora, NetworkArgs) {
  LoraOptions o = apply_network_args(LoraOptions{}, {"conv_dim=4", "conv_alpha=0.5", "train_ff=true"});
  EXPECT_EQ(o.conv_rank, 4);
  EXPECT_DOUBLE_EQ(o.conv_alpha, 0.5);
  EXPECT_TRUE(o.feed_forward);
  EXPECT_NE(error_of([] {
              apply_network_args({}, {"conv_rank=4"});
            }).find("unknown key 'conv_rank' (valid: conv_dim, conv_alpha, train_ff)"),
            std::string::npos);
  EXPECT_NE(error_of([] { apply_network_args({}, {"conv_dim=four"}); }).find("'four' is not a number"),
            std::string::npos);
  EXPECT_NE(error_of([] { apply_network_args({}, {"conv_dim=1.5"}); }).find("conv_dim must be an integer"),
            std::string::npos);
  EXPECT_NE(error_of([] { apply_network_args({}, {"conv_dim"}); }).find("is not \"key=value\""), std::string::npos);
}
