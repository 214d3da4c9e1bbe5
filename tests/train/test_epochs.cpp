// Epochs and checkpoint retention (train/epochs.h) against kohya's formulas:
// train_network.py's max_train_epochs x ceil(batches / accumulation), and
// train_util.py's get_remove_step_no / get_remove_epoch_no replayed over a
// simulated run; then a tiny emoji run whose step count and checkpoint
// folders follow the same formulas, resumed to more epochs.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <set>

#include <nlohmann/json.hpp>

#include "../error_testing.h"
#include "shoestring/data/dataset.h"
#include "shoestring/io/atomic_file.h"
#include "shoestring/train/config.h"
#include "shoestring/train/epochs.h"
#include "shoestring/train/trainer.h"
#include "train_testing.h"

namespace fs = std::filesystem;
using namespace shoestring;
using shoestring::testing::error_of;

namespace {

/// kohya's train_network.py: args.max_train_epochs * math.ceil(len(train_dataloader) /
/// args.gradient_accumulation_steps), in floating point as Python computes it.
int64_t kohya_steps(int64_t epochs, int64_t batches, int64_t accumulation) {
  return epochs * static_cast<int64_t>(std::ceil(static_cast<double>(batches) / static_cast<double>(accumulation)));
}

/// kohya's get_remove_step_no (library/train_util.py).
int64_t kohya_remove_step_no(int64_t step, int64_t last_n_steps, int64_t every_n_steps) {
  int64_t remove = step - last_n_steps - 1;
  remove = remove - (remove % every_n_steps + every_n_steps) % every_n_steps;  // Python's % (non-negative)
  return remove < 0 ? -1 : remove;
}

/// kohya's get_remove_epoch_no.
int64_t kohya_remove_epoch_no(int64_t epoch, int64_t last_n_epochs, int64_t every_n_epochs) {
  const int64_t remove = epoch - every_n_epochs * last_n_epochs;
  return remove < 0 ? -1 : remove;
}

/// Our side of a simulated run: at each step SaveSchedule saves, the record is
/// added, then expired_checkpoints is applied (the newest protected, as
/// latest.json names it). `after_save(step, kept)` sees the steps kept.
template <class F>
std::vector<CheckpointRecord> simulate(const SaveSchedule& schedule, const RetentionPolicy& policy, F after_save) {
  std::vector<CheckpointRecord> kept;
  for (int64_t step = 1; step <= schedule.max_train_steps; ++step) {
    if (!schedule.due(step)) continue;
    kept.push_back({step, schedule.saved_epoch(step), schedule.step_checkpoint(step)});
    const std::vector<int64_t> gone = expired_checkpoints(kept, step, policy, {step});
    std::vector<CheckpointRecord> next;
    for (const CheckpointRecord& r : kept) {
      if (std::find(gone.begin(), gone.end(), r.step) == gone.end()) next.push_back(r);
    }
    kept = next;
    after_save(step, kept);
  }
  return kept;
}

}  // namespace

TEST(Epochs, StepsFromEpochsAreKohyas) {
  for (int64_t batches : {1, 2, 7, 10, 42, 169}) {
    for (int64_t accumulation : {1, 2, 3, 4, 16, 200}) {
      for (int64_t epochs : {1, 3, 10}) {
        EXPECT_EQ(steps_for_epochs(epochs, steps_per_epoch(batches, accumulation)),
                  kohya_steps(epochs, batches, accumulation))
            << batches << " batches, accumulation " << accumulation << ", " << epochs << " epochs";
      }
    }
  }
  EXPECT_NE(error_of([] { steps_per_epoch(0, 1); }), "");
  EXPECT_NE(error_of([] { steps_per_epoch(5, 0); }), "");
  EXPECT_NE(error_of([] { steps_for_epochs(int64_t{1} << 40, int64_t{1} << 40); }).find("overflows"),
            std::string::npos);
}

TEST(Epochs, EpochCheckpointsAtEveryNthEpochEndButTheLast) {
  SaveSchedule s;
  s.save_every_n_epochs = 2;
  s.steps_per_epoch = 7;
  s.max_train_steps = 7 * 9;  // 9 epochs
  std::set<int64_t> epochs, steps;
  for (int64_t step = 1; step <= s.max_train_steps; ++step) {
    if (s.saved_epoch(step) > 0) {
      epochs.insert(s.saved_epoch(step));
      steps.insert(step);
    }
  }
  // kohya's (epoch + 1) % save_every_n_epochs == 0 and (epoch + 1) < num_train_epochs.
  std::set<int64_t> want_epochs, want_steps;
  for (int64_t e = 1; e < 9; ++e) {
    if (e % 2 == 0) {
      want_epochs.insert(e);
      want_steps.insert(e * 7);
    }
  }
  EXPECT_EQ(epochs, want_epochs);
  EXPECT_EQ(steps, want_steps);
  EXPECT_TRUE(s.due(s.max_train_steps));  // the last step always saves, as a step checkpoint
  EXPECT_TRUE(s.step_checkpoint(s.max_train_steps));
  EXPECT_EQ(s.saved_epoch(s.max_train_steps), 0);
  EXPECT_FALSE(s.due(7));  // epoch 1: not a multiple of 2
}

TEST(Epochs, SaveLastNStepsKeepsWhatKohyaKeeps) {
  for (int64_t every : {1, 3, 10}) {
    for (int64_t last_n : {1, 5, 10, 25, 30, 100}) {
      SaveSchedule schedule;
      schedule.save_every_n_steps = every;
      schedule.max_train_steps = every * 17;
      // kohya: each stepwise save writes step N, then removes get_remove_step_no(N).
      std::set<int64_t> kohya;
      simulate(schedule, RetentionPolicy{last_n, 0}, [&](int64_t step, const std::vector<CheckpointRecord>& kept) {
        kohya.insert(step);
        kohya.erase(kohya_remove_step_no(step, last_n, every));
        std::set<int64_t> ours;
        for (const CheckpointRecord& r : kept) ours.insert(r.step);
        ASSERT_EQ(ours, kohya) << "every " << every << ", save_last_n_steps " << last_n << ", at step " << step;
      });
    }
  }
}

TEST(Epochs, SaveLastNEpochsKeepsWhatKohyaKeeps) {
  for (int64_t every : {1, 2, 3}) {
    for (int64_t last_n : {1, 2, 4}) {
      SaveSchedule schedule;
      schedule.save_every_n_epochs = every;
      schedule.steps_per_epoch = 5;
      schedule.max_train_steps = 5 * 13;
      std::set<int64_t> kohya;  // epoch files
      const std::vector<CheckpointRecord> final_kept =
          simulate(schedule, RetentionPolicy{0, last_n}, [&](int64_t step, const std::vector<CheckpointRecord>& kept) {
            if (const int64_t e = schedule.saved_epoch(step)) {
              kohya.insert(e);
              kohya.erase(kohya_remove_epoch_no(e, last_n, every));
            }
            std::set<int64_t> ours;
            for (const CheckpointRecord& r : kept) {
              if (r.epoch_end > 0) ours.insert(r.epoch_end);
            }
            ASSERT_EQ(ours, kohya) << "every " << every << ", save_last_n_epochs " << last_n << ", at step " << step;
          });
      // Plus the last step's checkpoint, as kohya's final file.
      EXPECT_EQ(final_kept.back().step, schedule.max_train_steps);
      EXPECT_EQ(static_cast<int64_t>(final_kept.size()), static_cast<int64_t>(kohya.size()) + 1);
    }
  }
}

TEST(Epochs, RetentionNeverRemovesTheNewestOrTheProtected) {
  std::vector<CheckpointRecord> records;
  for (int64_t s = 10; s <= 100; s += 10) records.push_back({s, 0, true});
  // Only the last 10 steps: 90 and 100 remain, but 20 is protected (latest.json names it).
  EXPECT_EQ(expired_checkpoints(records, 100, {10, 0}, {20}), (std::vector<int64_t>{10, 30, 40, 50, 60, 70, 80}));
  // save_last_n_steps = 0: nothing expires; later checkpoints are never touched.
  EXPECT_TRUE(expired_checkpoints(records, 100, {0, 0}, {}).empty());
  EXPECT_EQ(expired_checkpoints(records, 50, {10, 0}, {}), (std::vector<int64_t>{10, 20, 30}));
  // A folder saved for both reasons stays while either keeps it.
  const std::vector<CheckpointRecord> both = {{10, 1, true}, {20, 2, false}, {30, 3, true}, {40, 0, true}};
  // Epoch rule keeps epochs 2, 3; step rule keeps step >= 30: 10 goes (both expired).
  EXPECT_EQ(expired_checkpoints(both, 40, {10, 2}, {}), (std::vector<int64_t>{10}));
  // Epoch rule keeps epoch 3 only; step rule off: 20 (epoch only) goes, 10 stays as a step checkpoint.
  EXPECT_EQ(expired_checkpoints(both, 40, {0, 1}, {}), (std::vector<int64_t>{20}));
}

// A run resumed with more steps or epochs keeps the checkpoints one
// uninterrupted run of its length keeps: the first invocation's last step is
// seen as the longer schedule would have saved it (retention_view), or
// superseded by the new last step.
TEST(Epochs, RetentionAcrossAResumeMatchesOneRun) {
  struct Case {
    int64_t every_steps, every_epochs, last_n_steps, last_n_epochs, per_epoch, first_max, max;
  };
  const std::vector<Case> cases = {{0, 1, 0, 2, 1, 5, 9},   {0, 1, 0, 2, 3, 15, 33}, {0, 2, 0, 2, 1, 5, 9},
                                   {0, 2, 0, 1, 2, 10, 12}, {3, 0, 0, 0, 1, 5, 10},  {3, 0, 4, 0, 1, 5, 10},
                                   {3, 0, 4, 0, 1, 6, 10},  {2, 1, 3, 2, 2, 8, 14},  {5, 2, 6, 1, 3, 9, 30},
                                   {0, 1, 0, 3, 1, 2, 3},   {4, 0, 4, 0, 1, 7, 8}};
  for (const Case& k : cases) {
    SaveSchedule first{k.every_steps, k.every_epochs, k.per_epoch, k.first_max};
    SaveSchedule longer{k.every_steps, k.every_epochs, k.per_epoch, k.max};
    const RetentionPolicy policy{k.last_n_steps, k.last_n_epochs};
    const bool retains = policy.save_last_n_steps > 0 || policy.save_last_n_epochs > 0;
    std::vector<CheckpointRecord> kept;
    auto save_and_expire = [&](const SaveSchedule& schedule, int64_t step) {
      CheckpointRecord r{step, schedule.saved_epoch(step), schedule.step_checkpoint(step)};
      r.run_last = step == schedule.max_train_steps;
      kept.push_back(r);
      if (!retains) return;  // as remove_expired_checkpoints: no retention keys, nothing removed
      std::vector<CheckpointRecord> seen;
      for (const CheckpointRecord& c : kept) seen.push_back(retention_view(c, schedule, step));
      const std::vector<int64_t> gone = expired_checkpoints(seen, step, policy, {step});
      std::vector<CheckpointRecord> next;
      for (const CheckpointRecord& c : kept) {
        if (std::find(gone.begin(), gone.end(), c.step) == gone.end()) next.push_back(c);
      }
      kept = next;
    };
    for (int64_t step = 1; step <= first.max_train_steps; ++step) {
      if (first.due(step)) save_and_expire(first, step);
    }
    for (int64_t step = first.max_train_steps + 1; step <= longer.max_train_steps; ++step) {
      if (longer.due(step)) save_and_expire(longer, step);
    }
    std::set<int64_t> resumed, one_run;
    for (const CheckpointRecord& r : kept) resumed.insert(r.step);
    if (retains) {
      for (const CheckpointRecord& r : simulate(longer, policy, [](int64_t, const auto&) {})) one_run.insert(r.step);
    } else {
      // No retention: every checkpoint either invocation saved stays.
      for (int64_t step = 1; step <= longer.max_train_steps; ++step) {
        if (step <= first.max_train_steps ? first.due(step) : longer.due(step)) one_run.insert(step);
      }
    }
    EXPECT_EQ(resumed, one_run) << "every " << k.every_steps << " steps / " << k.every_epochs << " epochs, last "
                                << k.last_n_steps << " steps / " << k.last_n_epochs << " epochs, " << k.per_epoch
                                << " steps per epoch, " << k.first_max << " then " << k.max << " steps";
  }
  // The view itself: the earlier last step becomes the epoch checkpoint the
  // longer schedule saves there; off every cadence, it is superseded only by
  // the new last step; this run's own last step is unchanged.
  CheckpointRecord last{5, 0, true};
  last.run_last = true;
  const CheckpointRecord as_epoch = retention_view(last, SaveSchedule{0, 1, 1, 9}, 6);
  EXPECT_EQ(as_epoch.epoch_end, 5);
  EXPECT_FALSE(as_epoch.step_checkpoint);
  EXPECT_FALSE(as_epoch.superseded);
  EXPECT_FALSE(retention_view(last, SaveSchedule{0, 2, 1, 9}, 8).superseded);
  EXPECT_TRUE(retention_view(last, SaveSchedule{0, 2, 1, 9}, 9).superseded);
  EXPECT_FALSE(retention_view(last, SaveSchedule{0, 1, 1, 5}, 5).superseded);
  EXPECT_EQ(retention_view(last, SaveSchedule{0, 1, 1, 5}, 5).epoch_end, 0);
}

TEST(Epochs, RetentionKeysNeedTheirCadence) {
  const std::string a = error_of([] { parse_config("save_last_n_steps = 3\n", "r.toml"); });
  EXPECT_NE(a.find("r.toml"), std::string::npos) << a;
  EXPECT_NE(a.find("save_every_n_steps"), std::string::npos) << a;
  const std::string b = error_of([] { parse_config("save_last_n_epochs = 3\n", "r.toml"); });
  EXPECT_NE(b.find("save_every_n_epochs"), std::string::npos) << b;
}

// A tiny emoji run by epochs: its step count is kohya's formula over the
// sampler's batches, its checkpoint folders those the simulation keeps, and
// it resumes to more epochs (the step count of the recorded config is not
// mistaken for the finished one).
TEST(Epochs, RunTrainsEpochsAndKeepsTheLastCheckpoints) {
  const std::string out = shoestring::testing::fresh_temp_dir("epochs", "run");
  TrainConfig c =
      shoestring::testing::tiny_emoji_config(out,
                                             "max_train_epochs = 4\nsave_every_n_epochs = 1\nsave_last_n_epochs = 2\n"
                                             "gradient_accumulation_steps = 2\nsample_every_n_steps = 1000\n");
  // The images the run loads, and the sampler's batches (drop_last, batch 4).
  const int64_t images = ImageCaptionDataset::load(c.train_data_dir, static_cast<int>(c.resolution)).size();
  const int64_t batches = images / c.train_batch_size;
  ASSERT_GE(batches, 1);
  const int64_t per_epoch = kohya_steps(1, batches, 2);
  const TrainSummary s = train(c, shoestring::testing::quiet());
  EXPECT_EQ(s.last_step, kohya_steps(4, batches, 2));
  EXPECT_EQ(shoestring::testing::losses_of(out + "/metrics.jsonl").size(), static_cast<size_t>(s.last_step));

  auto folders = [&] {
    std::set<int64_t> steps;
    for (const auto& e : fs::directory_iterator(fs::path(out) / "checkpoints")) {
      const std::string n = e.path().filename().string();
      EXPECT_EQ(n.find(".removing"), std::string::npos) << n;
      if (n.rfind("step-", 0) == 0) steps.insert(std::stoll(n.substr(5)));
    }
    return steps;
  };
  auto expected = [&](int64_t epochs) {
    SaveSchedule schedule;
    schedule.save_every_n_epochs = 1;
    schedule.steps_per_epoch = per_epoch;
    schedule.max_train_steps = epochs * per_epoch;
    std::set<int64_t> steps;
    for (const CheckpointRecord& r : simulate(schedule, {0, 2}, [](int64_t, const auto&) {})) steps.insert(r.step);
    return steps;
  };
  EXPECT_EQ(folders(), expected(4));  // epochs 2 and 3, and the last step

  // The recorded config says max_train_epochs = 4; resumed with 6 it trains
  // on to 6 epochs (the checkpoint's step is not taken for the finished one).
  // A removal killed half-way left a renamed folder: the next retention pass removes it.
  fs::create_directories(fs::path(out) / "checkpoints" / ".step-000001.removing");
  write_bytes_atomic((fs::path(out) / "checkpoints" / ".step-000001.removing" / "state.safetensors").string(), "x");
  TrainRunOptions resume = shoestring::testing::quiet();
  resume.resume_dir = out;
  // As recorded (4 epochs), the run is complete.
  const std::string done = error_of([&] { train(load_config(out + "/config.toml"), resume); });
  EXPECT_NE(done.find("already at step"), std::string::npos) << done;
  EXPECT_NE(done.find("raise max_train_epochs"), std::string::npos) << done;
  const TrainSummary more = train(load_config(out + "/config.toml", {"max_train_epochs=6"}), resume);
  EXPECT_EQ(more.first_step, 4 * per_epoch + 1);
  EXPECT_EQ(more.last_step, kohya_steps(6, batches, 2));
  // The first invocation's last step (epoch 4) counts as the epoch 4
  // checkpoint the longer run saves: the folders are those of one 6-epoch run.
  EXPECT_EQ(folders(), expected(6));
  EXPECT_EQ(folders(), (std::set<int64_t>{4 * per_epoch, 5 * per_epoch, 6 * per_epoch}));
  fs::remove_all(out);
}
