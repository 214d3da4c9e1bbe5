// The training-state file (train/checkpoint_io.h): written and read in one
// place; the JSON names are the format (older files must keep loading).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/io/atomic_file.h"
#include "shoestring/io/safetensors.h"
#include "shoestring/nn/layers.h"
#include "shoestring/train/checkpoint_io.h"
#include "train_testing.h"

using namespace shoestring;
namespace fs = std::filesystem;

TEST(TrainingState, RoundTripsCountersAndTensorGroups) {
  const std::string dir = shoestring::testing::fresh_temp_dir("ckpt_io", "round_trip");
  fs::create_directories(dir);
  const std::string path = dir + "/state.safetensors";
  TrainingState s;
  s.counters.step = 12;
  s.counters.optimizer_step_count = 11;
  s.counters.data_epoch = 2;
  s.counters.data_index = 5;
  s.counters.micro_steps = 24;
  s.counters.images_seen = 96;
  s.counters.skipped_steps = 1;
  s.counters.consecutive_nonfinite = 0;
  s.counters.elapsed_seconds = 3.5;
  s.counters.loss_scale = 32768.0;
  s.counters.loss_scale_growth_tracker = 7;
  s.counters.precision_upcast = {"unet.mid", "unet.out"};
  s.counters.epoch_end = 3;
  s.counters.step_checkpoint = false;
  s.optimizer = {{"w.exp_avg", torch::arange(6, torch::kFloat32)}};
  s.ema = {{"w", torch::ones({2, 3})}};
  s.master = {{"w", torch::full({3}, 0.5)}};
  s.rng_cpu = cpu_rng_state();
  save_training_state(path, s);

  // The on-disk names, as earlier versions wrote them.
  auto file = SafetensorsFile::open(path);
  auto meta = nlohmann::json::parse(file.metadata().at("training_state"));
  EXPECT_EQ(meta["step"], 12);
  EXPECT_EQ(meta["images_seen"], 96);
  EXPECT_EQ(meta["loss_scale"], 32768.0);
  EXPECT_TRUE(meta["fused_previous_grad_norm"].is_null());
  EXPECT_EQ(meta["precision_upcast"], nlohmann::json::array({"unet.mid", "unet.out"}));
  EXPECT_TRUE(file.metadata().size() == 1u);
  EXPECT_NO_THROW(file.get("optimizer.w.exp_avg"));
  EXPECT_NO_THROW(file.get("ema.w"));
  EXPECT_NO_THROW(file.get("master.w"));

  const TrainingState r = load_training_state(path);
  EXPECT_EQ(r.counters.step, 12);
  EXPECT_EQ(r.counters.optimizer_step_count, 11);
  EXPECT_EQ(r.counters.data_epoch, 2);
  EXPECT_EQ(r.counters.data_index, 5);
  EXPECT_EQ(r.counters.micro_steps, 24);
  EXPECT_EQ(r.counters.skipped_steps, 1);
  EXPECT_DOUBLE_EQ(r.counters.elapsed_seconds, 3.5);
  EXPECT_EQ(r.counters.loss_scale, std::optional<double>(32768.0));
  EXPECT_EQ(r.counters.loss_scale_growth_tracker, 7);
  EXPECT_EQ(r.counters.precision_upcast, s.counters.precision_upcast);
  EXPECT_FALSE(r.counters.fused_previous_grad_norm.has_value());
  EXPECT_EQ(r.counters.epoch_end, 3);
  EXPECT_FALSE(r.counters.step_checkpoint);
  // What retention reads, from the header alone.
  const TrainingCounters header = load_training_counters(path);
  EXPECT_EQ(header.step, 12);
  EXPECT_EQ(header.epoch_end, 3);
  EXPECT_FALSE(header.step_checkpoint);
  ASSERT_EQ(r.optimizer.size(), 1u);
  EXPECT_EQ(r.optimizer[0].first, "w.exp_avg");
  EXPECT_TRUE(torch::equal(r.optimizer[0].second, s.optimizer[0].second));
  ASSERT_EQ(r.ema.size(), 1u);
  ASSERT_EQ(r.master.size(), 1u);
  EXPECT_TRUE(torch::equal(r.master[0].second, s.master[0].second));
  EXPECT_TRUE(torch::equal(r.rng_cpu, s.rng_cpu));
  fs::remove_all(dir);
}

TEST(TrainingState, OlderFilesLoadAndBrokenOnesAreNamed) {
  const std::string dir = shoestring::testing::fresh_temp_dir("ckpt_io", "older");
  fs::create_directories(dir);
  const std::string path = dir + "/state.safetensors";
  auto write = [&](const nlohmann::json& meta, bool rng = true, const std::string& extra = "") {
    std::vector<NamedTensor> t;
    if (rng) t.push_back({"rng.cpu", cpu_rng_state(), std::nullopt});
    if (!extra.empty()) t.push_back({extra, torch::zeros({1}), std::nullopt});
    save_safetensors(path, t, {{"training_state", meta.dump()}});
  };
  auto error_of = [&]() -> std::string {
    try {
      load_training_state(path);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  // A file from before micro_steps existed: the required four are enough.
  const nlohmann::json minimal = {{"step", 3}, {"optimizer_step_count", 3}, {"data_epoch", 0}, {"data_index", 3}};
  write(minimal);
  EXPECT_EQ(load_training_state(path).counters.micro_steps, 0);
  EXPECT_EQ(load_training_state(path).counters.epoch_end, 0);  // a step checkpoint, as every older one
  EXPECT_TRUE(load_training_state(path).counters.step_checkpoint);
  auto no_step = minimal;
  no_step.erase("data_index");
  write(no_step);
  EXPECT_NE(error_of().find("lacks the integer field 'data_index'"), std::string::npos) << error_of();
  EXPECT_NE(error_of().find(path), std::string::npos);
  write(minimal, /*rng=*/false);
  EXPECT_NE(error_of().find("'rng.cpu' is missing"), std::string::npos) << error_of();
  write(minimal, true, "stray.tensor");
  EXPECT_NE(error_of().find("unexpected tensor 'stray.tensor'"), std::string::npos) << error_of();
  auto wrong_type = minimal;
  wrong_type["images_seen"] = "many";
  write(wrong_type);
  EXPECT_NE(error_of().find("wrong type"), std::string::npos) << error_of();
  // The loss scale: null (no scaling) or a number; anything else refused,
  // not taken as a fresh start of the scale (helper-23).
  for (const nlohmann::json& bad :
       {nlohmann::json("abc"), nlohmann::json("8192"), nlohmann::json(true), nlohmann::json::array({8192})}) {
    auto scale = minimal;
    scale["loss_scale"] = bad;
    write(scale);
    EXPECT_NE(error_of().find("wrong type"), std::string::npos) << bad.dump() << ": " << error_of();
  }
  auto no_scale = minimal;
  no_scale["loss_scale"] = nullptr;
  write(no_scale);
  EXPECT_FALSE(load_training_state(path).counters.loss_scale.has_value());
  fs::remove_all(dir);
}

TEST(ModuleFiles, Fp8WeightsAreSavedAsTheirValuesAndLoadBackToTheSameBytes) {
  // A model with a Linear stored as fp8 bytes: the file holds its values in
  // BF16 (never U8 bytes, never scaled F8 without the scale), and loading that
  // file into the same fp8 layer gives back the same bytes.
  const std::string dir = shoestring::testing::fresh_temp_dir("ckpt_io", "fp8");
  fs::create_directories(dir);
  struct Net : torch::nn::Module {
    Net() { lin = register_module("lin", nn::Linear(6, 3)); }
    nn::Linear lin{nullptr};
  };
  torch::manual_seed(4);
  auto pack = [](Net& n) {
    torch::NoGradGuard no_grad;
    const nn::Fp8Storage s{Fp8Format::e4m3fn, 8.0};
    n.lin->weight.requires_grad_(false);
    n.lin->weight.set_data(nn::encode_fp8(n.lin->weight, s));
    n.lin->weight_fp8 = s;
  };
  Net a, b;
  pack(a);
  pack(b);
  ASSERT_FALSE(torch::equal(a.lin->weight.view(at::kByte), b.lin->weight.view(at::kByte)));
  const std::string path = dir + "/model.safetensors";
  save_module(path, a, {});
  const auto file = SafetensorsFile::open(path);
  ASSERT_NE(file.find("lin.weight"), nullptr);
  EXPECT_EQ(file.find("lin.weight")->dtype, StDtype::BF16);
  EXPECT_TRUE(torch::equal(file.get("lin.weight").to(at::kFloat),
                           nn::dequantize_fp8(a.lin->weight, *a.lin->weight_fp8, at::kFloat)));
  load_module(b, load_safetensors(path), path);
  EXPECT_TRUE(torch::equal(a.lin->weight.view(at::kByte), b.lin->weight.view(at::kByte)));
  EXPECT_TRUE(torch::equal(a.lin->bias, b.lin->bias));
  // Raw bytes are refused, naming the tensor.
  auto raw = load_safetensors(path);
  raw["lin.weight"] = torch::zeros({3, 6}, at::kByte);
  try {
    load_module(b, raw, "raw.safetensors");
    ADD_FAILURE() << "bytes loaded into an fp8 weight";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("lin.weight"), std::string::npos) << e.what();
  }
}

// A sharded checkpoint folder (docs/training.md): shard names, the index
// over every file's tensors, stale shards of another world size removed,
// and a single-file rewrite of the folder dropping the sharded parts.
TEST(ShardedCheckpoint, IndexNamesEveryTensorsFile) {
  EXPECT_EQ(optimizer_shard_name(1, 3), "optimizer-rank-00001-of-00003.safetensors");
  EXPECT_TRUE(is_optimizer_shard_name("optimizer-rank-00001-of-00003.safetensors"));
  EXPECT_FALSE(is_optimizer_shard_name("optimizer-rank-0001-of-00003.safetensors"));
  EXPECT_FALSE(is_optimizer_shard_name("optimizer-rank-0000x-of-00003.safetensors"));
  EXPECT_FALSE(is_optimizer_shard_name("state.safetensors"));

  const std::string dir = shoestring::testing::fresh_temp_dir("ckpt_io", "sharded");
  fs::create_directories(dir);
  save_safetensors(dir + "/model.safetensors", {{"w", torch::ones({2, 3}), std::nullopt}});
  TrainingState s;
  s.rng_cpu = cpu_rng_state();
  save_training_state(dir + "/state.safetensors", s);
  // Each rank's optimizer state and EMA of the tensors it owns.
  save_optimizer_shard(dir + "/" + optimizer_shard_name(0, 2), {{"w.exp_avg", torch::zeros({2, 3})}},
                       {{"w", torch::ones({2, 3})}}, 0, 2, 4);
  save_optimizer_shard(dir + "/" + optimizer_shard_name(1, 2), {{"b.exp_avg", torch::zeros({3})}}, {}, 1, 2, 4);
  // Left by an interrupted save of this step at 3 ranks.
  save_optimizer_shard(dir + "/" + optimizer_shard_name(2, 3), {{"c.exp_avg", torch::zeros({1})}}, {}, 2, 3, 4);
  // Shards without their index (not written yet, or lost): not a checkpoint to read.
  EXPECT_THAT([&] { read_checkpoint_index(dir); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("but no " + std::string(kCheckpointIndexFile))));

  write_checkpoint_index(dir, 4, 2, 2);
  EXPECT_FALSE(fs::exists(dir + "/" + optimizer_shard_name(2, 3)));
  const std::optional<CheckpointIndex> index = read_checkpoint_index(dir);
  ASSERT_TRUE(index.has_value());
  EXPECT_EQ(index->step, 4);
  EXPECT_EQ(index->world_size, 2);
  EXPECT_EQ(index->zero_stage, 2);
  const std::map<std::string, std::string> want = {{"w", "model.safetensors"},
                                                   {"ema.w", optimizer_shard_name(0, 2)},
                                                   {"rng.cpu", "state.safetensors"},
                                                   {"optimizer.w.exp_avg", optimizer_shard_name(0, 2)},
                                                   {"optimizer.b.exp_avg", optimizer_shard_name(1, 2)}};
  EXPECT_EQ(index->weight_map, want);
  const auto j = nlohmann::json::parse(read_file(dir + "/" + kCheckpointIndexFile));
  EXPECT_EQ(j["files"][optimizer_shard_name(1, 2)]["rank"], 1);
  EXPECT_EQ(j["files"]["model.safetensors"]["bytes"], fs::file_size(dir + "/model.safetensors"));

  // A shard of another step copied over this one's, or an index edited to
  // another world size: named, with what its metadata says.
  auto error_of = [&] {
    try {
      read_checkpoint_index(dir);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  save_optimizer_shard(dir + "/" + optimizer_shard_name(1, 2), {{"b.exp_avg", torch::zeros({3})}}, {}, 1, 2, 3);
  std::string error = error_of();
  EXPECT_NE(error.find(optimizer_shard_name(1, 2)), std::string::npos) << error;
  EXPECT_NE(error.find("metadata step 3"), std::string::npos) << error;
  save_optimizer_shard(dir + "/" + optimizer_shard_name(1, 2), {{"b.exp_avg", torch::zeros({3})}}, {}, 1, 2, 4);
  EXPECT_EQ(error_of(), "no error");
  const std::string index_text = read_file(dir + "/" + kCheckpointIndexFile);
  nlohmann::json edited = nlohmann::json::parse(index_text);
  edited["world_size"] = 5;
  write_bytes_atomic(dir + "/" + kCheckpointIndexFile, edited.dump());
  error = error_of();
  EXPECT_NE(error.find("world size 5"), std::string::npos) << error;
  write_bytes_atomic(dir + "/" + kCheckpointIndexFile, index_text);

  // A shard of this run and step replaced by another with more tensors
  // (the weight_map does not list the extra one): its size is not the one
  // the index recorded.
  save_optimizer_shard(dir + "/" + optimizer_shard_name(1, 2),
                       {{"b.exp_avg", torch::zeros({3})}, {"b.exp_avg_sq", torch::zeros({3})}}, {}, 1, 2, 4);
  error = error_of();
  EXPECT_NE(error.find(optimizer_shard_name(1, 2) + " is "), std::string::npos) << error;
  EXPECT_NE(error.find("replaced or cut"), std::string::npos) << error;
  save_optimizer_shard(dir + "/" + optimizer_shard_name(1, 2), {{"b.exp_avg", torch::zeros({3})}}, {}, 1, 2, 4);
  EXPECT_EQ(error_of(), "no error");
  // An index whose "files" misses a file of its weight_map.
  edited = nlohmann::json::parse(index_text);
  edited["files"].erase(optimizer_shard_name(0, 2));
  write_bytes_atomic(dir + "/" + kCheckpointIndexFile, edited.dump());
  error = error_of();
  EXPECT_NE(error.find("which \"files\" does not list"), std::string::npos) << error;
  write_bytes_atomic(dir + "/" + kCheckpointIndexFile, index_text);

  // A shard the index needs is missing: named.
  fs::remove(dir + "/" + optimizer_shard_name(1, 2));
  try {
    read_checkpoint_index(dir);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(optimizer_shard_name(1, 2)), std::string::npos) << e.what();
  }
  try {
    write_checkpoint_index(dir, 4, 2, 2);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1"), std::string::npos) << e.what();
  }
  // Rewritten as a single-file checkpoint: the sharded parts go.
  remove_sharded_files(dir);
  EXPECT_FALSE(fs::exists(dir + "/" + kCheckpointIndexFile));
  EXPECT_FALSE(fs::exists(dir + "/" + optimizer_shard_name(0, 2)));
  EXPECT_TRUE(fs::exists(dir + "/model.safetensors"));
  EXPECT_TRUE(fs::exists(dir + "/state.safetensors"));
}

// ZeRO stage 3: each rank's model shard (the streamed weights it owns)
// beside model.safetensors (the others); the index maps every weight to its
// file, model shards of another world size go, and a model shard of another
// step is named even when the optimizer shards are not read (consolidate).
TEST(ShardedCheckpoint, Stage3ModelShardsAreIndexedAndChecked) {
  EXPECT_EQ(model_shard_name(1, 3), "model-rank-00001-of-00003.safetensors");
  EXPECT_TRUE(is_model_shard_name("model-rank-00001-of-00003.safetensors"));
  EXPECT_FALSE(is_model_shard_name("model-rank-00001-of-0003.safetensors"));
  EXPECT_FALSE(is_model_shard_name(optimizer_shard_name(1, 3)));
  EXPECT_FALSE(is_optimizer_shard_name(model_shard_name(1, 3)));
  EXPECT_TRUE(is_checkpoint_model_file("model.safetensors"));
  EXPECT_TRUE(is_checkpoint_model_file(model_shard_name(0, 2)));
  EXPECT_FALSE(is_checkpoint_model_file("state.safetensors"));

  const std::string dir = shoestring::testing::fresh_temp_dir("ckpt_io", "stage3");
  fs::create_directories(dir);
  const std::string run_id = "0123456789abcdef";
  save_safetensors(dir + "/model.safetensors", {{"resident", torch::ones({2}), std::nullopt}}, {{"run_id", run_id}});
  TrainingState s;
  s.rng_cpu = cpu_rng_state();
  s.counters.run_id = run_id;
  save_training_state(dir + "/state.safetensors", s);
  EXPECT_EQ(load_training_counters(dir + "/state.safetensors").run_id, s.counters.run_id);
  for (int r = 0; r < 2; ++r) {
    save_optimizer_shard(dir + "/" + optimizer_shard_name(r, 2), {}, {}, r, 2, 6, s.counters.run_id);
    save_model_shard(dir + "/" + model_shard_name(r, 2), {{"block" + std::to_string(r) + ".weight", torch::zeros({3})}},
                     r, 2, 6, s.counters.run_id);
  }
  // Left by an interrupted save of this step at 3 ranks.
  save_model_shard(dir + "/" + model_shard_name(2, 3), {{"block2.weight", torch::zeros({1})}}, 2, 3, 6);
  write_checkpoint_index(dir, 6, 2, 3);
  EXPECT_FALSE(fs::exists(dir + "/" + model_shard_name(2, 3)));
  const std::optional<CheckpointIndex> index = read_checkpoint_index(dir, /*optimizer_shards=*/false);
  ASSERT_TRUE(index.has_value());
  EXPECT_EQ(index->weight_map.at("resident"), "model.safetensors");
  EXPECT_EQ(index->weight_map.at("block0.weight"), model_shard_name(0, 2));
  EXPECT_EQ(index->weight_map.at("block1.weight"), model_shard_name(1, 2));
  EXPECT_EQ(SafetensorsFile::open(dir + "/" + model_shard_name(1, 2)).metadata().at("rank"), "1");

  // The model alone is read (consolidate), and still its shards are checked.
  auto model_index_error = [&] {
    try {
      read_checkpoint_index(dir, /*optimizer_shards=*/false);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  save_model_shard(dir + "/" + model_shard_name(1, 2), {{"block1.weight", torch::zeros({3})}}, 1, 2, 5);
  std::string error = model_index_error();
  EXPECT_NE(error.find("this model shard is not part of the checkpoint"), std::string::npos) << error;
  EXPECT_NE(error.find("metadata step 5"), std::string::npos) << error;
  // The same step, rank and world size, but another run's: named as such.
  save_model_shard(dir + "/" + model_shard_name(1, 2), {{"block1.weight", torch::zeros({3})}}, 1, 2, 6,
                   "fedcba9876543210");
  error = model_index_error();
  EXPECT_NE(error.find("written by another run (run_id fedcba9876543210"), std::string::npos) << error;
  // Or one without an id (stripped, or of an older version) while the state has one.
  save_model_shard(dir + "/" + model_shard_name(1, 2), {{"block1.weight", torch::zeros({3})}}, 1, 2, 6);
  error = model_index_error();
  EXPECT_NE(error.find("written by another run (run_id (none)"), std::string::npos) << error;
  // The model.safetensors of another run (the weights that do not stream).
  save_model_shard(dir + "/" + model_shard_name(1, 2), {{"block1.weight", torch::zeros({3})}}, 1, 2, 6,
                   s.counters.run_id);
  save_safetensors(dir + "/model.safetensors", {{"resident", torch::ones({2}), std::nullopt}},
                   {{"run_id", "fedcba9876543210"}});
  error = model_index_error();
  EXPECT_NE(error.find("this model file was written by another run"), std::string::npos) << error;
  save_safetensors(dir + "/model.safetensors", {{"resident", torch::ones({2}), std::nullopt}}, {{"run_id", run_id}});
  save_model_shard(dir + "/" + model_shard_name(1, 2), {{"block1.weight", torch::zeros({3})}}, 1, 2, 6,
                   s.counters.run_id);
  EXPECT_TRUE(read_checkpoint_index(dir, /*optimizer_shards=*/false).has_value());
  // The folder as the model alone (resume, sample, consolidate read it so).
  const CheckpointModel model = read_checkpoint_model(dir);
  const std::map<std::string, at::Tensor> by_name(model.tensors.begin(), model.tensors.end());
  EXPECT_EQ(by_name.size(), 3u);
  EXPECT_TRUE(by_name.count("block1.weight"));
  EXPECT_FALSE(by_name.count("rng.cpu"));
  EXPECT_EQ(model.files,
            (std::vector<std::string>{"model.safetensors", model_shard_name(0, 2), model_shard_name(1, 2)}));
  EXPECT_EQ(model.metadata.at("run_id"), run_id);  // model.safetensors', not a shard's
  EXPECT_TRUE(model.sharded);
  // The step saved again at stage 2 (a resume after a stage-3 save was
  // interrupted): the stage-3 model shards are stale, not indexed.
  write_checkpoint_index(dir, 6, 2, 2);
  EXPECT_FALSE(fs::exists(dir + "/" + model_shard_name(0, 2)));
  EXPECT_FALSE(fs::exists(dir + "/" + model_shard_name(1, 2)));
  EXPECT_EQ(read_checkpoint_index(dir)->weight_map.count("block0.weight"), 0u);
  remove_sharded_files(dir);
  EXPECT_TRUE(fs::exists(dir + "/model.safetensors"));
}

TEST(TrainingState, RecordsTheGlobalBatchShape) {
  const std::string dir = shoestring::testing::fresh_temp_dir("ckpt_io", "batch_shape");
  fs::create_directories(dir);
  TrainingState s;
  s.counters.world_size = 3;
  s.counters.train_batch_size = 2;
  s.counters.gradient_accumulation_steps = 4;
  s.rng_cpu = cpu_rng_state();
  save_training_state(dir + "/state.safetensors", s);
  const auto meta =
      nlohmann::json::parse(SafetensorsFile::open(dir + "/state.safetensors").metadata().at("training_state"));
  EXPECT_EQ(meta["world_size"], 3);
  EXPECT_EQ(meta["train_batch_size"], 2);
  EXPECT_EQ(meta["gradient_accumulation_steps"], 4);
  const TrainingState r = load_training_state(dir + "/state.safetensors");
  EXPECT_EQ(r.counters.world_size, 3);
  EXPECT_EQ(r.counters.train_batch_size, 2);
  EXPECT_EQ(r.counters.gradient_accumulation_steps, 4);
}
