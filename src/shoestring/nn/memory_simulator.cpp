#include "shoestring/nn/memory_simulator.h"

#include <algorithm>
#include <limits>
#include <map>

#include "shoestring/core/error.h"

namespace shoestring::nn {
namespace {

constexpr int kAct = static_cast<int>(MemoryCategory::activations);
constexpr int kTmp = static_cast<int>(MemoryCategory::temporaries);
constexpr int kGrad = static_cast<int>(MemoryCategory::gradients);
constexpr int kNone = std::numeric_limits<int>::max();

struct Tracker {
  Bytes now{};
  TraceResult* r;
  void check(const std::string& where) {
    int64_t total = 0;
    for (int c = 0; c < kNumMemoryCategories; ++c) {
      total += now[c];
      r->peak_per_category[c] = std::max(r->peak_per_category[c], now[c]);
    }
    if (total > r->peak_total) {
      r->peak_total = total;
      r->at_peak = now;
      r->peak_op = where;
    }
  }
};

}  // namespace

int MemorySimulator::tensor(int64_t bytes, bool persistent) {
  if (bytes < 0) fail("memory simulator: negative tensor size {}", bytes);
  const int id = static_cast<int>(tensors_.size());
  tensors_.push_back({bytes, id, persistent, false});
  return id;
}

int MemorySimulator::alias(int base, int64_t bytes) {
  const int id = static_cast<int>(tensors_.size());
  tensors_.push_back({bytes, tensors_.at(base).base, false, false});
  return id;
}

int MemorySimulator::op(TraceOp op) {
  // Bounds checks (std::out_of_range for an unknown id); at() is [[nodiscard]] in GCC 14's libstdc++.
  for (int id : op.inputs) static_cast<void>(tensors_.at(id));
  for (int id : op.outputs) static_cast<void>(tensors_.at(id));
  ops_.push_back(std::move(op));
  return static_cast<int>(ops_.size()) - 1;
}

void MemorySimulator::segment(int first, int last, std::vector<int> inputs) {
  if (first < 0 || last < first || last >= static_cast<int>(ops_.size())) {
    fail("memory simulator: bad segment [{}, {}] of {} ops", first, last, ops_.size());
  }
  segments_.push_back({first, last, std::move(inputs)});
}

TraceResult MemorySimulator::simulate(const TraceOptions& options) const {
  const int n_ops = static_cast<int>(ops_.size());
  const int n_t = static_cast<int>(tensors_.size());
  std::vector<int> seg_of(n_ops, -1);
  for (size_t s = 0; s < segments_.size(); ++s) {
    for (int k = segments_[s].first; k <= segments_[s].last; ++k) seg_of[k] = static_cast<int>(s);
  }
  auto base = [&](int id) { return tensors_[id].base; };

  // Per storage: last forward use, first (lowest-index) op saving it in
  // forward, and per segment the lowest inner op saving it on recompute.
  std::vector<int> last_use(n_t, -1), saver(n_t, kNone);
  std::vector<std::map<int, int>> inner_saver(segments_.size());
  for (int k = 0; k < n_ops; ++k) {
    const TraceOp& o = ops_[k];
    for (int id : o.inputs) last_use[base(id)] = std::max(last_use[base(id)], k);
    for (int id : o.outputs) last_use[base(id)] = std::max(last_use[base(id)], k);
    for (int id : o.saved) {
      if (seg_of[k] >= 0) {
        auto& m = inner_saver[seg_of[k]];
        auto it = m.find(base(id));
        if (it == m.end() || k < it->second) m[base(id)] = k;
      } else {
        saver[base(id)] = std::min(saver[base(id)], k);
      }
    }
  }
  for (const Segment& s : segments_) {
    for (int id : s.inputs) saver[base(id)] = std::min(saver[base(id)], s.first);
  }

  TraceResult r;
  Tracker tr{{}, &r};
  std::vector<char> alive(n_t, 0);
  for (int id = 0; id < n_t; ++id) {
    if (tensors_[id].base == id && tensors_[id].persistent) {
      alive[id] = 1;
      tr.now[kAct] += tensors_[id].bytes;
    }
  }
  tr.check("forward start");

  // ---- forward ----
  for (int k = 0; k < n_ops; ++k) {
    const TraceOp& o = ops_[k];
    for (int id : o.outputs) {
      if (base(id) == id && !alive[id]) {
        alive[id] = 1;
        tr.now[kAct] += tensors_[id].bytes;
      }
    }
    if (seg_of[k] < 0) tr.now[kAct] += o.saved_extra;
    tr.now[kAct] += o.forward_transient;
    tr.check("forward " + o.name);
    tr.now[kAct] -= o.forward_transient;
    auto release = [&](int id) {
      const int b = base(id);
      if (alive[b] && last_use[b] <= k && saver[b] == kNone && !tensors_[b].persistent && !tensors_[b].kept) {
        alive[b] = 0;
        tr.now[kAct] -= tensors_[b].bytes;
      }
    };
    for (int id : o.inputs) release(id);
    for (int id : o.outputs) release(id);
  }
  r.forward_kept = tr.now[kAct];
  tr.check("end of forward");

  // ---- backward ----
  // Gradient storages with reference counts (passthrough ops share them).
  std::vector<int64_t> g_bytes;
  std::vector<int> g_refs;
  std::vector<int> grad_of(n_t, -1);
  auto new_grad = [&](int64_t bytes) {
    g_bytes.push_back(bytes);
    g_refs.push_back(1);
    tr.now[kTmp] += bytes;
    return static_cast<int>(g_bytes.size()) - 1;
  };
  auto drop_grad = [&](int g) {
    if (g < 0) return;
    if (--g_refs[g] == 0) tr.now[kTmp] -= g_bytes[g];
  };
  for (int id = 0; id < n_t; ++id) {
    if (tensors_[id].kept) grad_of[id] = new_grad(tensors_[id].bytes);
  }
  // Storages recomputed by a segment: alive (as temporaries) until their saver.
  std::vector<int> recomputed_until(n_t, -1);
  // Per op: storages saved in forward whose last backward user it is, and
  // storages recomputed by a segment that die after it.
  std::vector<std::vector<int>> freed_after(n_ops), recompute_freed_after(n_ops);
  for (int b = 0; b < n_t; ++b) {
    if (alive[b] && saver[b] != kNone && !tensors_[b].persistent && !tensors_[b].kept)
      freed_after[saver[b]].push_back(b);
  }
  std::vector<char> extra_live(n_ops, 0);
  // segment_gradients_leave: per segment, the parameter-gradient bytes its
  // backward has made so far.
  std::vector<int64_t> segment_grads(segments_.size(), 0);

  for (int k = n_ops - 1; k >= 0; --k) {
    const TraceOp& o = ops_[k];
    const int s = seg_of[k];
    if (s >= 0 && segments_[s].last == k) {
      // Recompute the segment (autograd on): its saves come back.
      for (const auto& [b, first_saver] : inner_saver[s]) {
        if (alive[b] || recomputed_until[b] >= 0) continue;
        recomputed_until[b] = first_saver;
        recompute_freed_after[first_saver].push_back(b);
        tr.now[kTmp] += tensors_[b].bytes;
      }
      for (int j = segments_[s].first; j <= segments_[s].last; ++j) {
        tr.now[kTmp] += ops_[j].saved_extra;
        extra_live[j] = 1;
      }
      tr.check("recompute " + o.name);
    }
    bool has_grad = false;
    for (int id : o.outputs) has_grad = has_grad || grad_of[id] >= 0;
    if (has_grad) {
      int out_grad = -1;
      for (int id : o.outputs) {
        if (grad_of[id] >= 0) {
          out_grad = grad_of[id];
          break;
        }
      }
      std::vector<int> done;
      for (int id : o.grad_inputs) {
        if (std::find(done.begin(), done.end(), id) != done.end()) continue;
        done.push_back(id);
        int g;
        if (o.passthrough && !(o.broadcast && tensors_[id].bytes < g_bytes[out_grad])) {
          g = out_grad;
          ++g_refs[g];
        } else {
          g = new_grad(tensors_[id].bytes);
        }
        if (grad_of[id] >= 0) {
          // Accumulated into the existing gradient (in place); the new one dies.
          tr.now[kTmp] += 0;
          tr.check("backward " + o.name + " (accumulate)");
          drop_grad(g);
        } else {
          grad_of[id] = g;
        }
      }
      tr.now[kTmp] += o.backward_transient;
      int64_t pg = 0;
      for (int64_t b : o.param_grads) pg += b;
      tr.now[kGrad] += pg;
      tr.check("backward " + o.name);
      tr.now[kTmp] -= o.backward_transient;
      if (options.fused) {
        for (int64_t b : o.param_grads) {
          const int64_t t = static_cast<int64_t>(options.fused_transient_per_grad_byte * static_cast<double>(b));
          tr.now[kTmp] += t;
          tr.check("fused update after " + o.name);
          tr.now[kTmp] -= t;
        }
        tr.now[kGrad] -= pg;
      } else if (options.segment_gradients_leave && s >= 0) {
        segment_grads[s] += pg;
      }
    }
    if (s >= 0 && segments_[s].first == k && segment_grads[s] > 0) {
      tr.now[kGrad] -= segment_grads[s];  // the block's backward is done: its gradients leave
      segment_grads[s] = 0;
    }
    for (int id : o.outputs) {
      drop_grad(grad_of[id]);
      grad_of[id] = -1;
    }
    // Saved storages whose last backward user was this op.
    for (int b : freed_after[k]) {
      if (alive[b]) {
        alive[b] = 0;
        tr.now[kAct] -= tensors_[b].bytes;
      }
    }
    for (int b : recompute_freed_after[k]) {
      if (recomputed_until[b] == k) {
        recomputed_until[b] = -2;
        tr.now[kTmp] -= tensors_[b].bytes;
      }
    }
    if (s < 0) {
      tr.now[kAct] -= o.saved_extra;
    } else if (extra_live[k]) {
      tr.now[kTmp] -= o.saved_extra;
      extra_live[k] = 0;
    }
  }
  r.gradients_after = tr.now[kGrad];
  return r;
}

}  // namespace shoestring::nn
