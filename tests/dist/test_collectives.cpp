// ProcessGroup's collectives on 2 and 3 local processes (FileStore and
// TCPStore rendezvous), each checked against a formula over the known
// per-rank inputs; bf16 moved bit for bit; a dead or stuck peer turns into
// an error naming the collective and the rank.
#include <chrono>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "dist_testing.h"
#include "shoestring/core/error.h"
#include "shoestring/dist/data_parallel.h"
#include "shoestring/dist/process_group.h"
#include "shoestring/optim/grad_hooks.h"

namespace shoestring::dist {
namespace {

using namespace std::chrono_literals;
using shoestring::testing::fresh_dist_dir;
using shoestring::testing::read_text;
using shoestring::testing::run_workers;
using shoestring::testing::worker_dir;
using shoestring::testing::worker_rank;
using shoestring::testing::worker_world;
using shoestring::testing::write_text;
using ::testing::AllOf;
using ::testing::HasSubstr;

std::unique_ptr<ProcessGroup> join_file_group(std::chrono::milliseconds timeout = 60s) {
  return ProcessGroup::connect_file(worker_dir() + "/store", worker_rank(), worker_world(), timeout);
}

/// Every 16-bit pattern once (bf16 NaNs, infs, subnormals included).
at::Tensor all_bf16_patterns() {
  return at::arange(-32768, 32768, at::TensorOptions().dtype(at::kInt)).to(at::kShort).view(at::kBFloat16);
}

bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes() == b.sizes() && a.view(at::kShort).equal(b.view(at::kShort));
}

/// The collectives against formulas; every check runs on every rank.
void check_collectives(ProcessGroup& g) {
  const int r = g.rank();
  const int w = g.size();
  const double ranks_sum = w * (w - 1) / 2.0;  // 0 + 1 + ... + (w-1)
  auto f32 = at::TensorOptions().dtype(at::kFloat);

  // fp32 sum of (r + 1) * x + r over ranks = x * w(w+1)/2 + w(w-1)/2.
  at::Tensor x = at::arange(12, f32).reshape({3, 4});
  at::Tensor t = x * (r + 1) + r;
  g.all_reduce_sum(t);
  EXPECT_TRUE(t.equal(x * (w * (w + 1) / 2.0) + ranks_sum)) << t;

  // A non-contiguous (transposed) tensor is summed in place too.
  at::Tensor nc = (x * (r + 1)).t();
  ASSERT_FALSE(nc.is_contiguous());
  g.all_reduce_sum(nc);
  EXPECT_TRUE(nc.equal(x.t() * (w * (w + 1) / 2.0)));

  // A double.
  EXPECT_EQ(g.all_reduce_sum(static_cast<double>(r) + 0.5), ranks_sum + 0.5 * w);

  // bf16: the fp32 sum of every rank's bf16 values, rounded to bf16 once.
  auto bf16_of = [&](int k) { return (at::arange(1, 9, f32) * 0.1f * (k + 1)).to(at::kBFloat16); };
  at::Tensor b = bf16_of(r);
  at::Tensor expected = at::zeros({8}, f32);
  for (int k = 0; k < w; ++k) expected += bf16_of(k).to(at::kFloat);
  g.all_reduce_sum(b);
  EXPECT_EQ(b.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(same_bits(b, expected.to(at::kBFloat16))) << b << expected;

  // fp16 sums in fp32 (Gloo alone would accumulate in fp16).
  at::Tensor h = at::full({5}, 1.0 / 3.0, f32).to(at::kHalf);
  const at::Tensor h_expected = (h.to(at::kFloat) * w).to(at::kHalf);
  g.all_reduce_sum(h);
  EXPECT_TRUE(h.equal(h_expected));

  // Broadcast of bf16 from the last rank: every bit pattern survives.
  at::Tensor patterns = all_bf16_patterns();
  at::Tensor mine = r == w - 1 ? patterns.clone() : at::zeros_like(patterns);
  g.broadcast(mine, w - 1);
  EXPECT_TRUE(same_bits(mine, patterns));
  // ... and of fp32 from rank 0, into a non-contiguous view.
  at::Tensor base = at::full({4, 6}, static_cast<float>(r), f32);
  at::Tensor view = base.narrow(1, 1, 3);
  g.broadcast(view, 0);
  EXPECT_TRUE(base.narrow(1, 1, 3).equal(at::zeros({4, 3}, f32)));
  EXPECT_TRUE(base.narrow(1, 0, 1).equal(at::full({4, 1}, static_cast<float>(r), f32)));

  // Reduce-scatter: input = arange(w * 5) + 100 r, chunk r of the sum =
  // w * arange(5 r .. 5 r + 4) + 100 w(w-1)/2.
  at::Tensor rs_in = (at::arange(w * 5, f32) + 100.0f * r).to(at::kBFloat16).to(at::kFloat);
  at::Tensor chunk = g.reduce_scatter_sum(rs_in);
  EXPECT_TRUE(chunk.equal(at::arange(5 * r, 5 * r + 5, f32) * w + 100.0f * ranks_sum)) << chunk;
  EXPECT_TRUE(rs_in.equal(at::arange(w * 5, f32) + 100.0f * r)) << "the input is left alone";
  // bf16 input is reduced in fp32.
  at::Tensor rs_bf = at::full({w * 2}, 0.1f, f32).to(at::kBFloat16);
  EXPECT_TRUE(g.reduce_scatter_sum(rs_bf).equal(at::full({2}, 0.1f, f32).to(at::kBFloat16).to(at::kFloat) * w));

  // All-gather: rank k contributes k * 10 + arange(4).
  at::Tensor gathered = g.all_gather(at::arange(4, f32) + 10.0f * r);
  at::Tensor gathered_expected = at::cat([&] {
    std::vector<at::Tensor> parts;
    for (int k = 0; k < w; ++k) parts.push_back(at::arange(4, f32) + 10.0f * k);
    return parts;
  }());
  EXPECT_TRUE(gathered.equal(gathered_expected)) << gathered;
  // bf16 all-gather: rank k's slice of the bit patterns, bit for bit.
  const int64_t n = 65536 / 4;
  at::Tensor slices = all_bf16_patterns().narrow(0, 0, n * w);
  at::Tensor bf_gathered = g.all_gather(slices.narrow(0, r * n, n).clone());
  EXPECT_TRUE(same_bits(bf_gathered, slices));

  // int16 all-gather: 2-byte elements counted as such (they once moved as
  // twice as many bytes, half of each rank's chunk at the wrong offset).
  auto shorts_of = [](int k) {
    return (at::arange(3, at::TensorOptions().dtype(at::kInt)) - 20000 + 1000 * k).to(at::kShort);
  };
  std::vector<at::Tensor> short_parts;
  for (int k = 0; k < w; ++k) short_parts.push_back(shorts_of(k));
  EXPECT_TRUE(g.all_gather(shorts_of(r)).equal(at::cat(short_parts))) << g.all_gather(shorts_of(r));

  // Bad input is refused before any communication (on every rank alike).
  EXPECT_THAT([&] { g.reduce_scatter_sum(at::zeros({w * 3 + 1}, f32)); },
              ::testing::ThrowsMessage<Error>(AllOf(HasSubstr("reduce_scatter_sum"), HasSubstr("multiple of"))));

  // GradientReducer: two parameters whose gradients are (r + 1) * g0, a
  // third with no gradient; a 1-element bucket size forces one bucket each.
  at::Tensor p1 = at::zeros({3, 2}, f32).requires_grad_();
  at::Tensor p2 = at::zeros({5}, f32).to(at::kBFloat16).requires_grad_();
  at::Tensor p3 = at::zeros({2}, f32).requires_grad_();
  p1.mutable_grad() = at::arange(6, f32).reshape({3, 2}) * (r + 1);
  p2.mutable_grad() = (at::arange(5, f32) * (r + 1)).to(at::kBFloat16);
  for (int64_t bucket_bytes : {int64_t{4}, kDefaultBucketBytes}) {
    at::Tensor g1 = p1.grad().clone(), g2 = p2.grad().clone();
    GradientReducer reducer(g, {p1, p2, p3}, bucket_bytes);
    EXPECT_EQ(reducer.bucket_count(), bucket_bytes == 4 ? 3u : 1u);
    reducer.all_reduce_gradients();
    const double sum_factor = w * (w + 1) / 2.0;  // 1 + .. + w
    EXPECT_TRUE(p1.grad().allclose(at::arange(6, f32).reshape({3, 2}) * sum_factor, 0, 1e-6)) << p1.grad();
    EXPECT_TRUE(
        same_bits(p2.grad(), (at::arange(5, f32).to(at::kBFloat16).to(at::kFloat) * sum_factor).to(at::kBFloat16)));
    EXPECT_FALSE(p3.grad().defined());
    p1.mutable_grad() = g1;
    p2.mutable_grad() = g2;
  }

  // GradientReducer overlapping backward: post-accumulate-grad hooks tell
  // it each gradient's arrival. The first armed backward only counts; from
  // the second on, every bucket (one per tensor here) starts during
  // backward, and the summed gradients are the plain call's: the loss is
  // linear in the rank's input (r + 1) * x, so each sum is w (w + 1) / 2
  // times the gradient at x (torch::autograd::grad, which fires no hook).
  {
    at::Tensor a = (at::arange(16, f32).reshape({4, 4}) / 16).requires_grad_();
    at::Tensor b = (at::arange(4, f32) / 4 + 1).requires_grad_();
    at::Tensor c = at::full({1}, 2.0f, f32).requires_grad_();
    const at::Tensor x = at::arange(4, f32).reshape({1, 4});
    auto loss_of = [&](const at::Tensor& input, bool c_twice) {
      at::Tensor loss = (at::matmul(input, a) * b).sum() * c.sum();
      return c_twice ? loss + c.sum() * input.sum() : loss;
    };
    // c_twice: a second backward pass reaches c again before the reduction
    // (as a re-entrant checkpoint recompute or a repeated pass would).
    auto backward = [&](const at::Tensor& input, bool c_twice) {
      loss_of(input, false).backward();
      if (c_twice) (c.sum() * input.sum()).backward();
    };
    for (const bool c_twice : {false, true}) {
      const std::vector<at::Tensor> at_x = torch::autograd::grad({loss_of(x, c_twice)}, {a, b, c});
      GradientReducer reducer(g, {a, b, c}, 4);
      PostAccumulateGradHooks hooks;
      hooks.install({a, b, c}, [&](size_t i, at::Tensor&) { reducer.gradient_ready(i); });
      for (int step = 0; step < 3; ++step) {
        for (at::Tensor* p : {&a, &b, &c}) p->mutable_grad().reset();
        reducer.start_overlap();
        backward(x * (r + 1), c_twice);
        // A tensor reached twice before the reduction keeps the overlap off.
        EXPECT_EQ(reducer.buckets_started_in_backward(), step == 0 || c_twice ? 0u : reducer.bucket_count())
            << "step " << step << (c_twice ? ", c used twice" : "");
        reducer.all_reduce_gradients();
        const double sum_factor = w * (w + 1) / 2.0;
        const std::vector<at::Tensor> got = {a.grad(), b.grad(), c.grad()};
        for (size_t i = 0; i < got.size(); ++i)
          EXPECT_TRUE(got[i].allclose(at_x[i] * sum_factor, 1e-6, 0)) << "tensor " << i << ": " << got[i];
      }
    }
    // With the overlap on, a second gradient into one tensor (the graph changed) is an error naming it.
    GradientReducer reducer(g, {a, b, c}, 4);
    PostAccumulateGradHooks hooks;
    hooks.install({a, b, c}, [&](size_t i, at::Tensor&) { reducer.gradient_ready(i); });
    for (int step = 0; step < 2; ++step) {
      reducer.start_overlap();
      backward(x, false);
      reducer.all_reduce_gradients();
    }
    reducer.start_overlap();
    EXPECT_THAT([&] { backward(x, true); },
                ::testing::ThrowsMessage<std::exception>(
                    AllOf(HasSubstr("trainable tensor 2 of 3"), HasSubstr("second gradient in one backward"))));
  }

  // Parameters differing per rank become rank 0's.
  at::Tensor q = at::full({3}, static_cast<float>(r), f32).requires_grad_();
  broadcast_tensors(g, {q});
  EXPECT_TRUE(q.equal(at::zeros({3}, f32)));

  g.barrier();
}

DIST_SCENARIO(collectives_file) {
  auto g = join_file_group();
  ASSERT_EQ(g->size(), worker_world());
  check_collectives(*g);
}

DIST_SCENARIO(collectives_tcp) {
  // The rendezvous of a torchrun --standalone or `shoestring launch` run.
  auto g = ProcessGroup::connect(launch_environment(), 60s);
  check_collectives(*g);
}

DIST_SCENARIO(collectives_agent_store) {
  // torchrun's static launch: the agent (here the test process) hosts the store.
  auto g = ProcessGroup::connect(launch_environment(), 60s);
  check_collectives(*g);
}

std::string rank_file(int rank) { return worker_dir() + "/rank" + std::to_string(rank) + ".txt"; }

DIST_SCENARIO(dead_peer) {
  auto g = join_file_group(30s);
  g->barrier();
  if (g->rank() == g->size() - 1) ::_exit(3);  // dies between two collectives
  at::Tensor t = at::ones({1000});
  try {
    for (int i = 0; i < 3; ++i) g->all_reduce_sum(t);  // the first may still be summed with the peer's pending data
    write_text(rank_file(g->rank()), "(no error)");
  } catch (const Error& e) {
    write_text(rank_file(g->rank()), e.what());
  }
}

DIST_SCENARIO(stuck_peer) {
  auto g = join_file_group(2s);
  g->barrier();
  const std::string flag = worker_dir() + "/done";
  if (g->rank() == g->size() - 1) {
    // Alive but never joins the collective, until the others are through.
    while (read_text(flag).empty()) std::this_thread::sleep_for(20ms);
    return;
  }
  at::Tensor t = at::ones({1000});
  try {
    g->all_reduce_sum(t);
    write_text(rank_file(g->rank()), "(no error)");
  } catch (const Error& e) {
    write_text(rank_file(g->rank()), e.what());
  }
  write_text(flag, "done");
}

std::map<std::string, std::string> torchrun_env(int rank, int world, int port, bool agent, int restart = 0) {
  return {{"RANK", std::to_string(rank)},
          {"LOCAL_RANK", std::to_string(rank)},
          {"WORLD_SIZE", std::to_string(world)},
          {"LOCAL_WORLD_SIZE", std::to_string(world)},
          {"MASTER_ADDR", "127.0.0.1"},
          {"MASTER_PORT", std::to_string(port)},
          {"TORCHELASTIC_USE_AGENT_STORE", agent ? "True" : "False"},
          {"TORCHELASTIC_RESTART_COUNT", std::to_string(restart)}};
}

TEST(Collectives, TwoProcessesFileStore) {
  const std::string dir = fresh_dist_dir("coll2");
  EXPECT_EQ(run_workers("collectives_file", 2, dir), (std::vector<int>{0, 0}));
}

TEST(Collectives, ThreeProcessesFileStore) {
  const std::string dir = fresh_dist_dir("coll3");
  EXPECT_EQ(run_workers("collectives_file", 3, dir), (std::vector<int>{0, 0, 0}));
}

TEST(Collectives, TwoProcessesTcpStoreOnRankZero) {
  const std::string dir = fresh_dist_dir("colltcp");
  const int port = shoestring::testing::free_tcp_port();
  EXPECT_EQ(run_workers("collectives_tcp", 2, dir, [&](int r) { return torchrun_env(r, 2, port, false); }),
            (std::vector<int>{0, 0}));
}

TEST(Collectives, ThreeProcessesTorchrunAgentStore) {
  // The agent hosts the store; every rank is a client under the attempt's prefix.
  const std::string dir = fresh_dist_dir("collagent");
  const int port = shoestring::testing::free_tcp_port();
  c10d::TCPStoreOptions so;
  so.port = static_cast<std::uint16_t>(port);
  so.isServer = true;
  so.waitWorkers = false;
  so.timeout = 60s;
  auto agent = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", so);
  for (int attempt : {0, 1}) {
    // A restarted attempt rendezvous again on the same agent store: its keys
    // are apart from the first attempt's ("/worker/attempt_<n>" prefix).
    EXPECT_EQ(
        run_workers("collectives_agent_store", 3, dir, [&](int r) { return torchrun_env(r, 3, port, true, attempt); }),
        (std::vector<int>{0, 0, 0}))
        << "attempt " << attempt;
    EXPECT_GT(agent->getNumKeys(), 0);
  }
}

TEST(Collectives, DeadPeerFailsTheNextCollectiveNamingIt) {
  const std::string dir = fresh_dist_dir("dead");
  const std::vector<int> status = run_workers("dead_peer", 2, dir);
  EXPECT_EQ(status, (std::vector<int>{0, 3}));
  EXPECT_THAT(read_text(dir + "/rank0.txt"),
              AllOf(HasSubstr("all_reduce_sum on rank 0 of 2 failed"), HasSubstr("another rank exited"),
                    HasSubstr("rank 1 did not report this failure")));
}

/// The ranks named in a failure's "rank(s) ... did not report" clause.
std::string silent_ranks(const std::string& message) {
  const std::string tail = " did not report this failure";
  const size_t end = message.find(tail);
  const size_t start = message.rfind("; rank", end);
  if (end == std::string::npos || start == std::string::npos) return "(none named)";
  std::string ranks = message.substr(start + 6, end - start - 6);  // "s 0, 2" or " 2"
  if (!ranks.empty() && ranks[0] == 's') ranks.erase(0, 1);
  return ranks.substr(ranks.find_first_not_of(' '));
}

TEST(Collectives, DeadPeerOfThree) {
  const std::string dir = fresh_dist_dir("dead3");
  const std::vector<int> status = run_workers("dead_peer", 3, dir);
  EXPECT_EQ(status, (std::vector<int>{0, 0, 3}));
  // Both survivors see the failure and name the dead rank. The first to fail
  // may also name the other survivor: in a ring all-reduce that one can be
  // blocked on the first (not on rank 2) and fail only when the first exits,
  // after its 1.5 s window. The later one always finds the first's report,
  // so at least one names the dead rank alone.
  std::vector<std::string> silent;
  for (int r : {0, 1}) {
    const std::string message = read_text(dir + "/rank" + std::to_string(r) + ".txt");
    EXPECT_THAT(message, HasSubstr(fmt::format("all_reduce_sum on rank {} of 3 failed", r)));
    silent.push_back(silent_ranks(message));
    EXPECT_THAT(silent.back(), ::testing::AnyOf(std::string("2"), fmt::format("{}, 2", 1 - r))) << message;
  }
  EXPECT_TRUE(silent[0] == "2" || silent[1] == "2") << silent[0] << " / " << silent[1];
}

TEST(Collectives, StuckPeerTimesOut) {
  const std::string dir = fresh_dist_dir("stuck");
  EXPECT_EQ(run_workers("stuck_peer", 2, dir), (std::vector<int>{0, 0}));
  EXPECT_THAT(read_text(dir + "/rank0.txt"),
              AllOf(HasSubstr("all_reduce_sum on rank 0 of 2 failed"), HasSubstr("Timed out"),
                    HasSubstr("ddp_timeout = 2 s"), HasSubstr("rank 1 did not report this failure")));
}

TEST(Collectives, RendezvousTimesOutNamingTheStore) {
  // Rank 1 of 2 alone: rank 0 never hosts the store.
  LaunchEnvironment env;
  env.rank = 1;
  env.world_size = 2;
  env.local_world_size = 2;
  env.local_rank = 1;
  env.master_addr = "127.0.0.1";
  env.master_port = shoestring::testing::free_tcp_port();
  EXPECT_THAT([&] { ProcessGroup::connect(env, 1s); },
              ::testing::ThrowsMessage<Error>(AllOf(HasSubstr("cannot join the process group as rank 1 of 2"),
                                                    HasSubstr(fmt::format("127.0.0.1:{}", env.master_port)),
                                                    HasSubstr("ddp_timeout = 1 s"))));
}

}  // namespace
}  // namespace shoestring::dist
