// ZeRO's pieces (dist/zero.h) against formulas: the greedy ownership map,
// and on 2 and 3 local processes (FileStore) the reduction of gradients to
// their owners (stage 2) or to everyone (stage 1), the owners' broadcast of
// updated weights, the parameter a state key belongs to, the global sum.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "dist_testing.h"
#include "shoestring/core/error.h"
#include "shoestring/dist/process_group.h"
#include "shoestring/dist/zero.h"

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

TEST(TensorOwnership, GreedyByElementCountInParameterOrder) {
  // Each tensor to the rank owning the fewest elements so far (lowest on ties), worked by hand:
  // W=2: 100->r0 (100,0), 60->r1 (100,60), 50->r1 (100,110), 30->r0 (130,110), 30->r1 (130,140), 5->r0.
  const std::vector<int64_t> numels{100, 60, 50, 30, 30, 5};
  const TensorOwnership two(numels, 2);
  EXPECT_EQ((std::vector<int>{two.owner(0), two.owner(1), two.owner(2), two.owner(3), two.owner(4), two.owner(5)}),
            (std::vector<int>{0, 1, 1, 0, 1, 0}));
  EXPECT_EQ(two.elements_of(0), 135);
  EXPECT_EQ(two.elements_of(1), 140);
  EXPECT_EQ(two.owned_by(1), (std::vector<bool>{false, true, true, false, true, false}));
  // W=3: 100->r0, 60->r1, 50->r2, 30->r2 (100,60,80), 30->r1 (100,90,80), 5->r2 (100,90,85).
  const TensorOwnership three(numels, 3);
  EXPECT_EQ((std::vector<int>{three.owner(0), three.owner(1), three.owner(2), three.owner(3), three.owner(4),
                              three.owner(5)}),
            (std::vector<int>{0, 1, 2, 2, 1, 2}));
  // One rank owns everything; no rank owns more than total / W + the largest tensor.
  const TensorOwnership one(numels, 1);
  EXPECT_EQ(one.elements_of(0), 275);
  std::vector<int64_t> many;
  for (int64_t i = 0; i < 200; ++i) many.push_back((i * 7919) % 1000 + 1);
  const TensorOwnership four(many, 4);
  int64_t total = 0;
  for (int64_t n : many) total += n;
  int64_t sum = 0;
  for (int r = 0; r < 4; ++r) {
    EXPECT_LE(four.elements_of(r), total / 4 + 1000) << "rank " << r;
    sum += four.elements_of(r);
  }
  EXPECT_EQ(sum, total);
  EXPECT_THAT([] { TensorOwnership({1}, 0); }, ::testing::ThrowsMessage<Error>(HasSubstr("world size 0")));
}

std::unique_ptr<ProcessGroup> join_file_group() {
  return ProcessGroup::connect_file(worker_dir() + "/store", worker_rank(), worker_world(), 60s);
}

/// The test's parameters: fp32 tensors of several shapes and one bf16 one;
/// values don't matter (the collectives move gradients and copies).
NamedTensors make_params() {
  auto f32 = at::TensorOptions().dtype(at::kFloat);
  NamedTensors p;
  p.emplace_back("a.weight", at::zeros({7, 5}, f32));
  p.emplace_back("a.bias", at::zeros({3}, f32));
  p.emplace_back("b.weight", at::zeros({4, 4}, f32));
  p.emplace_back("c.bf16", at::zeros({6}, f32.dtype(at::kBFloat16)));
  p.emplace_back("d.weight", at::zeros({11}, f32));
  p.emplace_back("e.unused", at::zeros({2, 3, 2}, f32));  // no gradient on any rank
  for (auto& [n, t] : p) t.set_requires_grad(true);
  return p;
}

/// Parameter i's gradient on rank r: base_i * (r + 1), base_i = arange / 4 + i.
at::Tensor base_grad(const at::Tensor& p, size_t i) {
  return (at::arange(p.numel(), at::TensorOptions().dtype(at::kFloat)) / 4 + static_cast<double>(i)).view(p.sizes());
}

void set_grads(NamedTensors& params, int rank) {
  for (size_t i = 0; i < params.size(); ++i) {
    at::Tensor& p = params[i].second;
    if (params[i].first == "e.unused") continue;
    p.mutable_grad() = (base_grad(p, i) * (rank + 1)).to(p.scalar_type());
  }
}

/// The sum over W ranks of base * (r + 1): base * W (W + 1) / 2, in the
/// gradient's dtype (each rank's gradient being its share of the global
/// batch's, the sum is the global batch's: dist/data_parallel.h).
at::Tensor expected_sum(const at::Tensor& p, size_t i, int world) {
  return (base_grad(p, i) * (world * (world + 1) / 2.0)).to(p.scalar_type());
}

/// Stage 3: streamed groups {a.weight, a.bias, c.bf16} and {b.weight};
/// d.weight and e.unused stay resident. A released parameter this rank does
/// not own is empty; fetch gathers its owner's values bit for bit; release
/// after backward leaves each gradient's sum over the ranks, summed over two
/// micro-batches, on its owner only; hold_all_on gathers onto one rank,
/// hold_on gives it values from elsewhere (files) by name.
void check_zero_stage3(ProcessGroup& g) {
  const int r = g.rank();
  const int w = g.size();
  NamedTensors params = make_params();
  ZeroSharding zero(g, params, 3, /*bucket_bytes=*/48);
  EXPECT_THAT([&] { zero.add_streamed_group({0, 7}); }, ::testing::ThrowsMessage<Error>(HasSubstr("index 7")));
  const size_t first = zero.add_streamed_group({0, 1, 3});
  const size_t second = zero.add_streamed_group({2});
  EXPECT_THAT([&] { zero.add_streamed_group({1}); }, ::testing::ThrowsMessage<Error>(HasSubstr("a.bias")));
  EXPECT_EQ(zero.streamed_elements(), 35 + 3 + 6 + 16);
  auto value_of = [](size_t i) { return 1000.0 + 10.0 * static_cast<double>(i) + 0.5; };
  {
    at::NoGradGuard no_grad;
    // Each owner's values (other ranks' copies hold garbage: never read).
    for (size_t i = 0; i < params.size(); ++i) {
      params[i].second.fill_(zero.ownership().owner(i) == r ? value_of(i) : -1.0 - r);
    }
  }
  zero.start_streaming();
  auto present_as_owner = [&](size_t i) {
    const at::Tensor& p = params[i].second;
    return p.sizes() == make_params()[i].second.sizes() && p.equal(at::full(p.sizes(), value_of(i), p.options()));
  };
  const std::vector<size_t> streamed = {0, 1, 2, 3};
  for (size_t i : streamed) {
    if (zero.ownership().owner(i) == r) {
      EXPECT_TRUE(present_as_owner(i)) << params[i].first << " stays on its owner " << r;
    } else {
      EXPECT_EQ(params[i].second.numel(), 0) << params[i].first << " freed on rank " << r;
    }
  }
  for (int micro = 0; micro < 2; ++micro) {
    zero.fetch(first);
    zero.fetch(first);  // nested: gathers once
    for (size_t i : {0, 1, 3}) EXPECT_TRUE(present_as_owner(i)) << params[i].first << " fetched on rank " << r;
    if (zero.ownership().owner(2) != r) {
      EXPECT_EQ(params[2].second.numel(), 0) << "another group: not fetched";
    }
    zero.release(first, false);
    for (size_t i : {0, 1, 3}) EXPECT_TRUE(present_as_owner(i)) << "still in use by the outer fetch";
    // The group's backward: this micro-batch's gradients, then the release reduces them.
    for (size_t i : {0, 1, 3}) {
      at::Tensor& p = params[i].second;
      p.mutable_grad() = (base_grad(p, i) * (r + 1)).to(p.scalar_type());
    }
    zero.release(first, true);
    for (size_t i : {0, 1, 3}) {
      EXPECT_FALSE(params[i].second.grad().defined()) << "until reduce_gradients";
      if (zero.ownership().owner(i) != r) {
        EXPECT_EQ(params[i].second.numel(), 0) << params[i].first << " released";
      }
    }
  }
  zero.reduce_gradients();
  for (size_t i : {0, 1, 3}) {
    const at::Tensor& p = params[i].second;
    if (zero.ownership().owner(i) == r) {
      ASSERT_TRUE(p.grad().defined()) << params[i].first;
      // Two micro-batches, each the sum: 2 x base x W (W + 1) / 2, rounded per micro-batch for bf16.
      const at::Tensor sum = expected_sum(p, i, w);
      EXPECT_TRUE(p.grad().allclose(sum + sum, 1e-6, 0)) << params[i].first << " on rank " << r;
    } else {
      EXPECT_FALSE(p.grad().defined()) << params[i].first;
    }
  }
  // Resident parameters are stage 2's: the updated values go from owner to all.
  {
    at::NoGradGuard no_grad;
    if (zero.ownership().owner(4) == r) params[4].second.fill_(7.25);
  }
  zero.broadcast_updated_parameters();
  EXPECT_TRUE(params[4].second.equal(at::full({11}, 7.25, params[4].second.options())));
  // Everything on rank w - 1 (saving, sampling); fetch is then a no-op there.
  zero.hold_all_on(w - 1);
  for (size_t i : streamed) {
    if (r == w - 1 || zero.ownership().owner(i) == r) {
      EXPECT_TRUE(present_as_owner(i)) << params[i].first << " held on rank " << r;
    } else {
      EXPECT_EQ(params[i].second.numel(), 0) << params[i].first << " passes through rank " << r;
    }
  }
  if (r == w - 1) {
    zero.fetch(second);
    zero.release(second, false);
    EXPECT_TRUE(present_as_owner(2)) << "held: release does not free";
  }
  zero.release_held();
  for (size_t i : streamed) {
    if (zero.ownership().owner(i) != r) {
      EXPECT_EQ(params[i].second.numel(), 0) << params[i].first;
    }
  }
  // The same without a collective: rank w - 1 is given the others' values
  // (what their owned_streamed() wrote to files), checked by name, shape and dtype.
  std::vector<std::string> names;
  for (size_t i : streamed) names.push_back(params[i].first);
  EXPECT_EQ(zero.streamed_names(), names);
  const NamedTensors owned = zero.owned_streamed();
  size_t owned_count = 0;
  for (size_t i : streamed) {
    if (zero.ownership().owner(i) != r) continue;
    ASSERT_LT(owned_count, owned.size());
    EXPECT_EQ(owned[owned_count].first, params[i].first);
    EXPECT_TRUE(owned[owned_count].second.equal(params[i].second)) << params[i].first;
    ++owned_count;
  }
  EXPECT_EQ(owned_count, owned.size());
  std::map<std::string, at::Tensor> values;
  for (size_t i : streamed) {
    const at::Tensor shape = make_params()[i].second;
    values[params[i].first] = at::full(shape.sizes(), value_of(i), shape.options());
  }
  if (r == w - 1) {
    size_t other = streamed.size();
    for (size_t i : streamed) {
      if (zero.ownership().owner(i) != r) other = i;
    }
    if (other < streamed.size()) {
      std::map<std::string, at::Tensor> missing = values;
      missing.erase(params[other].first);
      EXPECT_THAT([&] { zero.hold_on(r, missing); },
                  ::testing::ThrowsMessage<Error>(HasSubstr("no values for parameter '" + params[other].first)));
      std::map<std::string, at::Tensor> reshaped = values;
      reshaped[params[other].first] = reshaped[params[other].first].reshape({-1, 1});
      EXPECT_THAT([&] { zero.hold_on(r, reshaped); },
                  ::testing::ThrowsMessage<Error>(HasSubstr("parameter '" + params[other].first + "' is")));
    }
  }
  zero.hold_on(w - 1, r == w - 1 ? values : std::map<std::string, at::Tensor>{});
  for (size_t i : streamed) {
    if (r == w - 1 || zero.ownership().owner(i) == r) {
      EXPECT_TRUE(present_as_owner(i)) << params[i].first << " held on rank " << r;
    } else {
      EXPECT_EQ(params[i].second.numel(), 0) << params[i].first << " not held on rank " << r;
    }
  }
  zero.release_held();
  for (size_t i : streamed) {
    if (zero.ownership().owner(i) != r) {
      EXPECT_EQ(params[i].second.numel(), 0) << params[i].first;
    }
  }
}

/// Stage 3 prefetch: three streamed groups fetched in a step's order
/// (forward 0, 1, 2, then the recomputes 2, 1, 0), each released before the
/// next. The first step records the order; from the second on, every gather
/// but the step's first and the last block's recompute (its own group came
/// just before) is served by the prefetch started at the previous fetch.
/// Values are the owners' current ones (changed between steps, as an
/// optimizer step changes them); a step that leaves the order gathers as
/// before and prefetches nothing, and the next step prefetches again.
/// With set_prefetch(false) (zero3_prefetch = false) nothing is prefetched.
void check_zero_stage3_prefetch(ProcessGroup& g, bool prefetch) {
  const int r = g.rank();
  NamedTensors params = make_params();
  ZeroSharding zero(g, params, 3, /*bucket_bytes=*/48);
  zero.set_prefetch(prefetch);
  const int64_t on = prefetch ? 1 : 0;
  const std::vector<std::vector<size_t>> groups = {{0, 1, 3}, {2}, {4}};
  for (const auto& members : groups) zero.add_streamed_group(members);
  auto value_of = [](size_t i, int step) { return 1000.0 + 10.0 * static_cast<double>(i) + step + 0.5; };
  auto set_owned = [&](int step) {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) {
      if (zero.ownership().owner(i) == r && params[i].second.numel() > 0) params[i].second.fill_(value_of(i, step));
    }
  };
  set_owned(0);
  zero.start_streaming();
  const std::vector<size_t> order = {0, 1, 2, 2, 1, 0};
  auto run_step = [&](const std::vector<size_t>& fetches, int step) {
    for (size_t group : fetches) {
      zero.fetch(group);
      for (size_t i : groups[group]) {
        const at::Tensor& p = params[i].second;
        EXPECT_TRUE(p.sizes() == make_params()[i].second.sizes() &&
                    p.equal(at::full(p.sizes(), value_of(i, step), p.options())))
            << params[i].first << " at step " << step << " on rank " << r;
      }
      zero.release(group, false);
      for (size_t i : groups[group]) {
        if (zero.ownership().owner(i) != r) {
          EXPECT_EQ(params[i].second.numel(), 0) << params[i].first << " released at step " << step;
        }
      }
    }
    zero.end_step_fetches();
  };
  run_step(order, 0);
  EXPECT_EQ(zero.prefetched_gathers(), 0) << "the first step records the order";
  set_owned(1);  // the optimizer step
  run_step(order, 1);
  EXPECT_EQ(zero.prefetched_gathers(), 4 * on) << "1, 2, then 1 and 0 in backward";
  set_owned(2);
  run_step({1, 0, 2}, 2);  // leaves the order at once
  EXPECT_EQ(zero.prefetched_gathers(), 4 * on);
  set_owned(3);
  run_step({0, 2, 1}, 3);  // group 1, prefetched after 0, is not fetched next: dropped
  EXPECT_EQ(zero.prefetched_gathers(), 4 * on);
  set_owned(4);
  run_step({0, 1, 2, 0}, 4);  // follows it for three fetches
  EXPECT_EQ(zero.prefetched_gathers(), 6 * on);
  set_owned(5);
  run_step(order, 5);
  EXPECT_EQ(zero.prefetched_gathers(), 10 * on);
}

void check_zero(ProcessGroup& g) {
  const int r = g.rank();
  const int w = g.size();
  // Stage 2: sums on the owners only; other ranks' gradients freed.
  {
    NamedTensors params = make_params();
    ZeroSharding zero(g, params, 2, /*bucket_bytes=*/64);  // small buckets: several per owner
    set_grads(params, r);
    int64_t held = 0, total = 0;
    zero.reduce_gradients();
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor& p = params[i].second;
      total += p.numel() * p.element_size();
      if (params[i].first == "e.unused") {
        EXPECT_FALSE(p.grad().defined()) << "an undefined gradient stays undefined";
        continue;
      }
      if (zero.ownership().owner(i) == r) {
        ASSERT_TRUE(p.grad().defined()) << params[i].first;
        EXPECT_TRUE(p.grad().allclose(expected_sum(p, i, w), 1e-6, 0))
            << params[i].first << " on rank " << r << ": " << p.grad() << " vs " << expected_sum(p, i, w);
        held += p.grad().numel() * p.grad().element_size();
      } else {
        EXPECT_FALSE(p.grad().defined()) << params[i].first << ": not this rank's (" << r << "), freed";
      }
    }
    // About 1/W of the gradient bytes: never more than total / W + the largest tensor (7 x 5 fp32).
    EXPECT_LE(held, total / w + 35 * 4) << "rank " << r;
    EXPECT_EQ(static_cast<int64_t>(g.all_reduce_sum(static_cast<double>(held))),
              total - 12 * 4)  // every gradient but the unused one, once
        << "rank " << r;
    EXPECT_EQ(zero.sum_over_ranks(r + 1.0), w * (w + 1) / 2.0);
  }
  // Stage 1: the sum on every rank.
  {
    NamedTensors params = make_params();
    ZeroSharding zero(g, params, 1);
    set_grads(params, r);
    zero.reduce_gradients();
    for (size_t i = 0; i + 1 < params.size(); ++i) {
      const at::Tensor& p = params[i].second;
      EXPECT_TRUE(p.grad().allclose(expected_sum(p, i, w), 1e-6, 0)) << params[i].first << " on rank " << r;
    }
  }
  // Broadcast: every rank ends with each tensor's owner's values, bit for bit.
  {
    NamedTensors params = make_params();
    ZeroSharding zero(g, params, 2, /*bucket_bytes=*/40);
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) params[i].second.fill_(100.0 * r + static_cast<double>(i) + 0.25);
    zero.broadcast_updated_parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor& p = params[i].second;
      const double owner_value = 100.0 * zero.ownership().owner(i) + static_cast<double>(i) + 0.25;
      EXPECT_TRUE(p.equal(at::full(p.sizes(), owner_value, p.options()))) << params[i].first << " on rank " << r;
    }
  }
  // State keys "<parameter name>.<state name>" name their parameter (what a
  // resume re-shards by); anything else belongs to none.
  {
    NamedTensors params = make_params();
    ZeroSharding zero(g, params, 1);
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_EQ(zero.parameter_of_state(params[i].first + ".exp_avg"), std::optional<size_t>(i));
    }
    EXPECT_EQ(zero.parameter_of_state(params[0].first), std::nullopt);
    EXPECT_EQ(zero.parameter_of_state("nothing.exp_avg"), std::nullopt);
    EXPECT_EQ(zero.parameter_of_state(params[0].first + ".exp_avg.more"), std::nullopt);
  }
  EXPECT_THAT([&] { ZeroSharding(g, make_params(), 4); }, ::testing::ThrowsMessage<Error>(HasSubstr("zero_stage = 4")));
  EXPECT_THAT([&] { ZeroSharding(g, make_params(), 2).add_streamed_group({0}); },
              ::testing::ThrowsMessage<Error>(HasSubstr("zero_stage = 3")));
  check_zero_stage3(g);
  check_zero_stage3_prefetch(g, /*prefetch=*/true);
  check_zero_stage3_prefetch(g, /*prefetch=*/false);
}

DIST_SCENARIO(zero_collectives) {
  try {
    auto g = join_file_group();
    check_zero(*g);
    g->barrier();
  } catch (const std::exception& e) {
    write_text(worker_dir() + "/error" + std::to_string(worker_rank()) + ".txt", e.what());
    ::_exit(4);
  }
  if (::testing::Test::HasFailure()) ::_exit(5);
}

void expect_zero_collectives(int world, const std::string& name) {
  const std::string dir = fresh_dist_dir(name);
  const std::vector<int> status = run_workers("zero_collectives", world, dir, {}, std::chrono::seconds(60));
  EXPECT_EQ(status, std::vector<int>(static_cast<size_t>(world), 0))
      << read_text(dir + "/error0.txt") << read_text(dir + "/error1.txt");
}

TEST(ZeroCollectives, TwoProcesses) { expect_zero_collectives(2, "zero2"); }
TEST(ZeroCollectives, ThreeProcesses) { expect_zero_collectives(3, "zero3"); }

}  // namespace
}  // namespace shoestring::dist
