// train(): setup (train/run.h), the step loop, finish. The step is
// train_step() below; everything it does not need to show lives in the
// gradient path (optim/gradient_path.h), the run (train/run.h) and the
// report (train/report.h).
#include "shoestring/train/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <exception>
#include <functional>
#include <map>

#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/core/memory_ledger.h"
#include "shoestring/models/architecture.h"
#include "shoestring/train/diffusion_loss.h"
#include "shoestring/train/lr_schedule.h"
#include "shoestring/train/report.h"
#include "shoestring/train/run.h"
#include "shoestring/train/run_report_html.h"
#include "shoestring/train/time_budget.h"

namespace shoestring {

namespace {
// Consecutive steps with an exactly zero gradient norm before train() warns.
constexpr int64_t kZeroGradientSteps = 3;
}  // namespace

namespace {

using Clock = std::chrono::steady_clock;

/// The batch on the run's device: prepared in host memory (the dataset and
/// caches live there; noise and timesteps come from the CPU generator), then
/// sent over, through pinned memory and without blocking on CUDA (the copies
/// queue on the stream ahead of the forward that reads them).
TrainBatch to_device(TrainBatch batch, const at::Device& device) {
  if (device.is_cpu()) return batch;
  auto send = [&](at::Tensor& t) {
    if (!t.defined()) return;
    t = (device.is_cuda() ? t.pin_memory() : t).to(device, /*non_blocking=*/device.is_cuda());
  };
  for (auto& t : batch.inputs) send(t);
  send(batch.target);
  send(batch.loss_weight);
  send(batch.huber_c);
  return batch;
}

/// This rank's rows of a global batch. Data parallel: every rank prepares
/// the whole global batch (the same images, caption dropout, noise and
/// timesteps one process with batch world x train_batch_size would draw) and
/// trains on rows [rank x b, (rank + 1) x b) of it; one process trains on all.
TrainBatch this_ranks_rows(const Run& run, TrainBatch global) {
  if (run.world_size() == 1) return global;
  const int64_t rows = run.config.train_batch_size * run.world_size();
  auto take = [&](at::Tensor& t, const std::string& what) {
    if (t.defined() && t.dim() > 0 && t.size(0) == rows) t = dist::rank_rows(t, run.rank(), run.world_size(), what);
  };
  for (size_t i = 0; i < global.inputs.size(); ++i) take(global.inputs[i], fmt::format("model input {}", i));
  take(global.target, "target");
  take(global.loss_weight, "loss weights");
  take(global.huber_c, "huber thresholds");
  return global;
}

/// Several ranks: sums the gradients over them (bucketed fp32 reductions);
/// each rank's backward was its share of the global batch's mean loss
/// (GradientPath::backward_loss), so the sum is the whole global batch's
/// mean gradient and the update the one of the whole global batch.
/// zero_stage 0 and 1 (dist/data_parallel.h, dist/zero.h): every rank then
/// holds every gradient; stage 2: each tensor's owner alone holds it.
void reduce_gradients(Run& run, bool quiet) {
  ScopedMemoryCategory category(MemoryCategory::temporaries);  // the buckets
  if (run.gradient_reducer) {
    dist::GradientReducer& reducer = *run.gradient_reducer;
    const bool was_overlapping = reducer.overlapping();
    reducer.all_reduce_gradients();
    if (!was_overlapping && reducer.overlapping() && !quiet && run.writes_files()) {
      spdlog::info("from the next step on, the gradient all-reduce ({} bucket{}) overlaps backward",
                   reducer.bucket_count(), reducer.bucket_count() == 1 ? "" : "s");
    }
  }
  if (run.zero) run.zero->reduce_gradients();
}

/// ZeRO: each rank's optimizer updated the tensors it owns; their owners
/// send them to every rank, so that all ranks hold the same weights again.
void share_updated_weights(Run& run) {
  if (!run.zero) return;
  ScopedMemoryCategory category(MemoryCategory::temporaries);  // the buckets
  run.zero->broadcast_updated_parameters();
}

/// The mean over ranks of each rank's mean loss: the global batch's loss.
double mean_over_ranks(Run& run, double loss) {
  return run.group ? run.group->all_reduce_sum(loss) / run.world_size() : loss;
}

/// Forward, loss and backward of one micro-batch; returns the loss.
double forward_backward(Run& run, const TrainBatch& batch) {
  at::Tensor loss;
  {
    ScopedMemoryCategory category(MemoryCategory::activations);
    const at::Tensor prediction = run.model->forward(batch);
    const TrainConfig& c = run.config;
    const bool huber = c.loss_type == "huber" || c.loss_type == "smooth_l1";
    const at::Tensor huber_c = !huber || batch.huber_c.defined()
                                   ? batch.huber_c
                                   : huber_threshold("constant", c.huber_c, c.huber_scale,
                                                     torch::zeros({prediction.size(0)}, torch::kLong), at::Tensor());
    loss = diffusion_loss(prediction, batch.target, c.loss_type, batch.loss_weight, huber_c);
  }
  ScopedMemoryCategory category(MemoryCategory::temporaries);
  run.gradients->backward_loss(loss).backward();
  return loss.item<double>();
}

/// What a user can set against fp16 overflow in this run's architecture.
std::string overflow_remedies(const TrainConfig& c) {
  const bool cascade = models::find_architecture(c.architecture).family == models::Family::stage_c;
  return cascade && c.activation_rescale == 1.0
             ? "set precision.auto_upcast = true or precision.activation_rescale = 0.5 (Stable Cascade's fp16 fix)"
             : "set precision.auto_upcast = true";
}

/// The fp16 overflow guard: names the blocks whose outputs left fp16's range
/// during this step's forward passes and, with precision.auto_upcast, moves
/// them to fp32 compute. Returns their descriptions (empty: none).
std::vector<std::string> check_fp16_overflow(Run& run, int64_t step) {
  std::vector<std::string> overflowed;
  if (!run.overflow) return overflowed;
  std::vector<std::string> flagged;              // in the order this rank saw them
  std::map<std::string, std::string> described;  // path -> what this rank saw
  for (const auto& e : run.overflow->events()) {
    if (described.count(e.path)) continue;  // again in a later micro-batch
    described[e.path] = e.nonfinite ? e.path + " (inf/NaN)" : fmt::format("{} (max |x| {:.4g})", e.path, e.max_abs);
    flagged.push_back(e.path);
  }
  const std::vector<std::string> watched = run.overflow->watched_paths();
  if (run.group) {
    // Every rank takes the blocks any rank flagged (each ran its own rows of
    // the batch), so that all upcast alike and keep computing the same model.
    std::vector<int32_t> seen(watched.size() + 1, 0);  // + 1: never an empty tensor
    for (size_t i = 0; i < watched.size(); ++i) seen[i] = described.count(watched[i]) ? 1 : 0;
    at::Tensor flags = at::tensor(seen, at::kInt);
    run.group->all_reduce_sum(flags);
    const int32_t* any = flags.data_ptr<int32_t>();
    for (size_t i = 0; i < watched.size(); ++i) {
      if (any[i] == 0 || described.count(watched[i])) continue;
      described[watched[i]] = watched[i] + " (on another rank)";
      flagged.push_back(watched[i]);
    }
  }
  for (const auto& path : flagged) overflowed.push_back(described.at(path));
  if (overflowed.empty()) return overflowed;
  if (run.config.auto_upcast) {
    std::vector<std::string> moved;
    for (const auto& path : flagged) {
      if (std::binary_search(watched.begin(), watched.end(), path)) moved.push_back(path);
    }
    run.overflow->upcast(moved);
    for (const auto& path : moved) run.counters.precision_upcast.push_back(path);
    spdlog::warn("step {}: fp16 overflow in {}; moved to fp32 compute (precision.auto_upcast)", step,
                 fmt::join(overflowed, ", "));
  } else {
    spdlog::warn(
        "step {}: fp16 overflow (beyond {} x 65504 or inf/NaN) first in {}; {}, or add a rule with compute = "
        "\"fp32\" for these blocks",
        step, run.config.overflow_threshold, fmt::join(overflowed, ", "), overflow_remedies(run.config));
  }
  return overflowed;
}

/// Counts a skipped step. An fp16 overflow at the current loss scale is
/// GradScaler's normal skip-and-back-off; any other non-finite step counts
/// toward max_nonfinite_steps in a row, after which training stops (throws
/// shoestring::Error).
void count_nonfinite(Run& run, int64_t step, double loss, const GradientStepResult& r,
                     const std::vector<std::string>& overflowed, bool quiet) {
  TrainingCounters& n = run.counters;
  if (r.finite) {
    n.consecutive_nonfinite = 0;
    return;
  }
  ++n.skipped_steps;
  if (const precision::LossScaler* scaler = run.gradients->loss_scaler(); scaler && std::isfinite(loss)) {
    if (!quiet)
      spdlog::info("step {}: fp16 gradients overflowed; step skipped, loss scale now {}", step, scaler->scale());
    return;
  }
  ++n.consecutive_nonfinite;
  spdlog::warn("step {}: non-finite loss ({}) or gradient norm ({}); step skipped ({} in a row)", step, loss,
               r.grad_norm, n.consecutive_nonfinite);
  if (n.consecutive_nonfinite >= run.config.max_nonfinite_steps) {
    fail(
        "training stopped at step {}: {} consecutive non-finite steps (max_nonfinite_steps = {}); "
        "lower learning_rate or use full precision{}",
        step, n.consecutive_nonfinite, run.config.max_nonfinite_steps,
        overflowed.empty()
            ? std::string()
            : fmt::format("; fp16 overflowed in {} ({})", fmt::join(overflowed, ", "), overflow_remedies(run.config)));
  }
}

/// One optimizer step: gradient_accumulation_steps micro-batches (batch,
/// forward, loss, backward), the fp16 overflow guard, with several ranks the
/// reduction of the gradients, then the gradient path sums, clips and
/// applies the update (ZeRO: each rank its own tensors, then shared); EMA
/// follows the weights.
StepRecord train_step(Run& run, int64_t step, bool quiet) {
  const TrainConfig& c = run.config;
  const auto t0 = Clock::now();
  GradientPath& gradients = *run.gradients;
  const double lr = learning_rate_at(c.lr_scheduler, c.learning_rate, step - 1, c.lr_warmup_steps, c.max_train_steps);
  gradients.begin_step(lr);
  if (run.overflow) run.overflow->begin_pass();

  double loss_sum = 0;
  for (int64_t micro = 0; micro < c.gradient_accumulation_steps; ++micro) {
    TrainBatch batch;
    {
      ScopedMemoryCategory category(MemoryCategory::activations);
      // caption dropout, noise, timesteps; with several ranks, this rank's rows of the global batch
      batch = to_device(this_ranks_rows(run, run.model->prepare(run.sampler->next())), run.device);
    }
    const at::Tensor rng = cpu_rng_state();  // a repeated pass replays the same dropout
    gradients.begin_micro_batch(micro);
    // zero_stage 0: the last micro-batch's backward starts the gradient all-reduces as buckets fill.
    if (run.gradient_reducer && micro + 1 == c.gradient_accumulation_steps && gradients.sums_in_grad())
      run.gradient_reducer->start_overlap();
    loss_sum += forward_backward(run, batch);
    while (gradients.repeat_micro_batch()) {
      set_cpu_rng_state(rng);
      forward_backward(run, batch);
    }
    gradients.end_micro_batch(micro);
    ++run.counters.micro_steps;
  }
  if (run.group) {
    ScopedMemoryCategory category(MemoryCategory::gradients);
    gradients.sum_into_grad();  // full_bf16 with accumulation: the fp32 sum of the micro-batches
  }
  // several ranks: the global batch's mean gradient (zero_stage 2: on its owner; fused: done in backward)
  if (!gradients.reduced_in_backward()) reduce_gradients(run, quiet);
  const double loss = mean_over_ranks(run, loss_sum / static_cast<double>(c.gradient_accumulation_steps));

  const std::vector<std::string> overflowed = check_fp16_overflow(run, step);
  // offload_params: the host copies and gradients; ZeRO 3: no prefetch past this point.
  if (run.block_streaming) run.block_streaming->before_step();
  const GradientStepResult result = gradients.end_step(lr, std::isfinite(loss));
  if (result.stepped) share_updated_weights(run);  // every rank agrees on `stepped` (the norm is global)
  if (result.stepped && run.ema) {
    ScopedMemoryCategory category(MemoryCategory::temporaries);
    run.ema->update(gradients.optimizer().step_count());  // 1-based, across resumes
  }
  if (run.block_streaming) run.block_streaming->after_step();
  count_nonfinite(run, step, loss, result, overflowed, quiet);

  StepRecord record;
  record.step = step;
  record.loss = loss;
  record.lr = lr;
  record.grad_norm = result.grad_norm;
  record.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  record.images = c.train_batch_size * c.gradient_accumulation_steps * run.world_size();
  record.skipped = !result.finite;
  run.counters.images_seen += record.images;
  run.counters.elapsed_seconds += record.seconds;
  return record;
}

/// Draws the sample grid of `step`; a failure is a warning (a sample grid
/// is a by-product: training and saving go on).
void sample(Run& run, RunReport& report, int64_t step) {
  report.end_progress_line();
  if (run.overflow) run.overflow->set_enabled(false);
  try {
    report.sample_grid(step, write_samples(run, step));
  } catch (const std::exception& e) {
    spdlog::warn("step {}: no sample grid: {}", step, e.what());
  }
  if (run.overflow) run.overflow->set_enabled(true);
}

/// Rewrites RUN_DIR/report.html (train/run_report_html.h) from the run
/// folder's files; a failure is a warning (the page is a by-product:
/// training and saving go on, `shoestring report RUN_DIR` redraws it).
void update_report(const Run& run) {
  try {
    write_run_report(run.run_dir, report_machine_line(run.device.str(), run.threads, run.world_size()));
  } catch (const std::exception& e) {
    spdlog::warn("no report.html: {}", e.what());
  }
}

bool every(int64_t n, int64_t step) { return n > 0 && step % n == 0; }

/// Streamed blocks (ZeRO stage 3, offload_params): every weight present on
/// rank 0 while it writes the checkpoint, samples and final files of a step,
/// then released; nothing otherwise. A full fine-tune at ZeRO stage 3
/// (streams_weights_through_files) gives rank 0 the other ranks' weights
/// from the files they wrote (the step's checkpoint shards `checkpoint_dir`,
/// or a scratch folder), and only when `needs_weights` (samples, final
/// files: the checkpoint itself takes them from each rank's shard); others
/// gather them there (RunBlockStreaming::hold_all). Collective for ZeRO.
class WeightsOnRankZero {
 public:
  WeightsOnRankZero(Run& run, int64_t step, const std::string& checkpoint_dir, bool needs_weights)
      : run_(run), streaming_(run.block_streaming.get()) {
    if (!streaming_) return;
    if (!streams_weights_through_files(run)) {
      streaming_->hold_all();
    } else if (needs_weights) {
      scratch_ = hold_streamed_weights_on_rank_zero(run, step, checkpoint_dir);
    }
  }
  ~WeightsOnRankZero() {
    if (!streaming_) return;
    streaming_->release_held();
    remove_streamed_weights(run_, scratch_);
  }
  WeightsOnRankZero(const WeightsOnRankZero&) = delete;
  WeightsOnRankZero& operator=(const WeightsOnRankZero&) = delete;

 private:
  Run& run_;
  RunBlockStreaming* streaming_;
  std::string scratch_;
};

/// A sharded EMA (shards_ema: ZeRO on several ranks, each rank keeping the
/// shadows of its own tensors): for this object's lifetime, every rank's own
/// tensors hold their EMA weights and rank 0 holds all of them (the owners
/// broadcast the resident ones, as after an optimizer step; ZeRO stage 3
/// gives rank 0 the streamed ones, as WeightsOnRankZero does, always through
/// scratch files for a full fine-tune), so that rank 0 samples and writes
/// the final files from the EMA weights. Collective, construction and
/// destruction both; nothing without a sharded EMA. The trained weights come
/// back, bit for bit, on every rank; when leaving by an exception the
/// destructor does no collective (the run is over and a peer may be gone).
class EmaWeightsOnRankZero {
 public:
  EmaWeightsOnRankZero(Run& run, int64_t step) : run_(shards_ema(run) ? &run : nullptr) {
    if (!run_) return;
    ScopedMemoryCategory category(MemoryCategory::temporaries);
    saved_ = run_->ema->swap_in();
    run_->zero->broadcast_updated_parameters();
    if (!run_->block_streaming) return;
    if (streams_weights_through_files(*run_)) {
      scratch_ = hold_streamed_weights_on_rank_zero(*run_, step, "");
    } else {
      run_->block_streaming->hold_all();
    }
  }
  ~EmaWeightsOnRankZero() {
    if (!run_) return;
    if (run_->block_streaming) run_->block_streaming->release_held();
    remove_streamed_weights(*run_, scratch_);
    run_->ema->restore(saved_);
    if (std::uncaught_exceptions() > 0) return;
    ScopedMemoryCategory category(MemoryCategory::temporaries);
    run_->zero->broadcast_updated_parameters();
  }
  EmaWeightsOnRankZero(const EmaWeightsOnRankZero&) = delete;
  EmaWeightsOnRankZero& operator=(const EmaWeightsOnRankZero&) = delete;

 private:
  Run* run_;
  std::vector<at::Tensor> saved_;
  std::string scratch_;
};

/// Runs `write` (`what`: the checkpoint, samples, final files of `step`) on
/// rank 0 only; the other ranks wait for it, longer than ddp_timeout (a
/// large checkpoint on a slow disk), and stop with rank 0's error when it
/// failed. One process just runs it.
void on_rank_zero(Run& run, int64_t step, const std::string& what, const std::function<void()>& write) {
  if (!run.group) return write();
  const std::string key = fmt::format("written/step-{}/{}", step, what);
  if (run.writes_files()) {
    try {
      write();
    } catch (const std::exception& e) {
      run.group->signal(key, e.what());
      throw;
    }
    run.group->signal(key, "ok");
    return;
  }
  const auto timeout = std::max<std::chrono::milliseconds>(run.group->timeout(), std::chrono::minutes(30));
  const std::string answer = run.group->wait_for_signal(key, fmt::format("its {} of step {}", what, step), timeout);
  if (answer != "ok") fail("rank 0 failed writing step {}: {}", step, answer);
}

double seconds_now() { return std::chrono::duration<double>(Clock::now().time_since_epoch()).count(); }

}  // namespace

TrainSummary train(const TrainConfig& config, const TrainRunOptions& options) {
  const double started = seconds_now();
  std::unique_ptr<Run> run = setup_run(config, options);
  const TrainConfig& c = run->config;
  TrainRunOptions rank_options = options;
  rank_options.quiet = options.quiet || !run->writes_files();  // other ranks log errors only
  RunReport report(*run, rank_options);
  int64_t step = run->counters.step;
  TimeBudget budget(c, step, started);
  if (!run->resume_from.empty() && run->writes_files()) update_report(*run);  // the earlier invocations' steps
  int64_t zero_gradient_steps = 0;  // consecutive steps whose gradient norm is exactly 0
  while (step < c.max_train_steps) {
    ++step;
    MemoryLedger::global().reset_peaks();
    const StepRecord record = train_step(*run, step, options.quiet);
    report.step(record);
    zero_gradient_steps = record.grad_norm == 0.0 ? zero_gradient_steps + 1 : 0;
    if (zero_gradient_steps == kZeroGradientSteps && !options.quiet && run->writes_files()) {
      spdlog::warn(
          "steps {}..{}: the gradient norm is exactly 0, so no trainable weight changes: the loss does not depend "
          "on them (e.g. a LoRA on a randomly initialised base, whose output convolution starts at zero as Stable "
          "Diffusion's does: train the base first or set pretrained_model_name_or_path)",
          step - kZeroGradientSteps + 1, step);
    }
    if (auto sized = budget.observe(step, record.seconds, seconds_now())) {  // max_train_minutes
      // Several ranks observe the same steps; rank 0's timing sizes the run for all.
      if (run->group)
        *sized =
            static_cast<int64_t>(run->group->all_reduce_sum(run->writes_files() ? static_cast<double>(*sized) : 0.0));
      set_max_train_steps(*run, *sized, budget.explanation());
    }
    const bool last = step == c.max_train_steps;
    const bool saves = save_schedule(*run).due(step);  // save_every_n_steps / _epochs, the last step
    const bool samples = every(c.sample_every_n_steps, step) || last;
    if (!saves && !samples) continue;
    // ZeRO on several ranks: each rank its optimizer shard (stage 3: and its model shard).
    const std::string shards = saves ? write_checkpoint_shards(*run, step) : std::string();
    std::string checkpoint;
    auto samples_and_final_files = [&] {
      if (samples) sample(*run, report, step);
      if (last) save_final_files(*run, step);  // EMA weights when EMA is on
    };
    {
      // zero_stage 3: the whole model on rank 0 meanwhile
      WeightsOnRankZero held(*run, step, shards, !shards_ema(*run) && (samples || last));
      on_rank_zero(*run, step, "checkpoint and samples", [&] {
        if (saves) checkpoint = write_checkpoint(*run, step);  // sharded: indexed last
        if (!shards_ema(*run)) samples_and_final_files();      // the EMA weights swapped in there
      });
    }
    if (shards_ema(*run) && (samples || last)) {
      EmaWeightsOnRankZero ema_weights(*run, step);  // every rank swaps its EMA shards in, rank 0 holds them
      on_rank_zero(*run, step, "EMA samples and final files", samples_and_final_files);
    }
    on_rank_zero(*run, step, "report", [&] {
      update_report(*run);  // the steps so far and the grids
      // latest.json moves last: a checkpoint counts once everything of its
      // step is written, and a run is complete when latest.json names its
      // last step. Killed before, a run resumes from its previous checkpoint
      // (or starts over) and writes it all again, the same bytes.
      if (!checkpoint.empty()) {
        commit_checkpoint(*run, checkpoint, step);
        remove_expired_checkpoints(*run, step);  // save_last_n_steps / _epochs: once the new one counts
      }
    });
  }
  // Rank 0 hosts the rendezvous store: it must not exit (closing the store)
  // while another rank is still reading the signal of the last step's files
  // from it, which failed as "Connection reset by peer" on a loaded machine.
  if (run->group) run->group->barrier();
  return report.finish(step);
}

}  // namespace shoestring
