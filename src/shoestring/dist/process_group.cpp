// ProcessGroup over c10d::ProcessGroupGloo for host tensors (libtorch 1.13;
// the class is behind USE_C10D_GLOO, which libtorch's CMake target defines)
// and, in a group joined on a CUDA device, c10d::ProcessGroupNCCL for CUDA
// tensors (dist/nccl_collectives_cuda.cpp). Only these two files see c10d
// headers, and only this one gloo's.
#include "shoestring/dist/process_group.h"

#include <signal.h>

#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>

#include <spdlog/spdlog.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "shoestring/core/error.h"
#include "shoestring/core/units.h"
#include "shoestring/dist/c10d_collectives.h"

namespace shoestring::dist {

namespace {

std::string seconds_text(std::chrono::milliseconds t) { return fmt::format("{:g} s", t.count() / 1000.0); }

/// The Gloo devices for a group whose store is at `master_addr`.
std::vector<std::shared_ptr<::gloo::transport::Device>> gloo_devices(const std::string& master_addr) {
  std::vector<std::shared_ptr<::gloo::transport::Device>> devices;
  if (const char* names = std::getenv("GLOO_SOCKET_IFNAME"); names && *names) {
    std::stringstream list(names);
    std::string name;
    while (std::getline(list, name, ',')) {
      if (!name.empty()) devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(name));
    }
  }
  if (!devices.empty()) return devices;
  const bool loopback = master_addr == "localhost" || master_addr.rfind("127.", 0) == 0 || master_addr == "::1";
  devices.push_back(loopback ? c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1")
                             : c10d::ProcessGroupGloo::createDefaultDevice());
  return devices;
}

/// Gloo's collectives (host tensors).
class GlooCollectives final : public C10dCollectives {
 public:
  explicit GlooCollectives(c10::intrusive_ptr<c10d::ProcessGroupGloo> group) : group_(std::move(group)) {}
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors) override {
    return group_->allreduce(tensors);
  }
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, int root) override {
    c10d::ReduceOptions o;
    o.rootRank = root;
    return group_->reduce(tensors, o);
  }
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors, int root) override {
    c10d::BroadcastOptions o;
    o.rootRank = root;
    return group_->broadcast(tensors, o);
  }
  c10::intrusive_ptr<c10d::Work> barrier() { return group_->barrier(); }
  std::string describe() const override { return "Gloo"; }

 private:
  c10::intrusive_ptr<c10d::ProcessGroupGloo> group_;
};

}  // namespace

struct ProcessGroup::Impl {
  c10::intrusive_ptr<c10d::Store> store;
  std::unique_ptr<GlooCollectives> host;    ///< host tensors, barriers
  std::unique_ptr<C10dCollectives> device;  ///< CUDA tensors (NCCL); null in a group joined on the CPU
  c10::Device device_of_group = c10::kCPU;  ///< the device `device` serves
  int rank = 0, size = 1;

  /// The backend for `tensor`'s device: Gloo for host tensors, NCCL for
  /// those on the group's CUDA device. Throws shoestring::Error naming
  /// `what` for a tensor on another device.
  C10dCollectives& backend_for(const at::Tensor& tensor, const std::string& what) {
    if (tensor.device().is_cpu()) return *host;
    if (device && tensor.device() == device_of_group) return *device;
    fail("{}: the tensor is on {}, and this group reduces {} tensors only{}", what, tensor.device().str(),
         device ? "host and " + device_of_group.str() : std::string("host"),
         device ? std::string() : " (it was joined on the CPU)");
  }
  std::optional<std::string> diagnosis;  ///< the first failure's (unresponsive_ranks)

  /// After a collective failed: which ranks do not answer. Every rank that
  /// sees a collective fail leaves "shoestring/failed/<rank>" in the store
  /// and looks for the others' for 1.5 s; a rank that left none is
  /// the stopped, hung or dead one (or still computing, or blocked on this
  /// rank, which reports only once this rank exits). Asked once per
  /// group (later failures reuse the answer), within about 3 s even when the
  /// store itself does not answer (its host, rank 0, stopped).
  std::string unresponsive_ranks() {
    if (diagnosis) return *diagnosis;
    struct Shared {
      std::mutex m;
      std::condition_variable done;
      bool finished = false;
      std::vector<int> silent;
      std::string error;
    };
    auto shared = std::make_shared<Shared>();
    std::thread([shared, store = store, rank = rank, size = size] {
      std::vector<int> silent;
      std::string error;
      try {
        const std::string value = "1";
        store->set("shoestring/failed/" + std::to_string(rank), std::vector<uint8_t>(value.begin(), value.end()));
        std::vector<bool> answered(static_cast<size_t>(size), false);
        answered[static_cast<size_t>(rank)] = true;
        const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(1500);
        for (;;) {
          bool all = true;
          for (int r = 0; r < size; ++r) {
            if (!answered[static_cast<size_t>(r)])
              answered[static_cast<size_t>(r)] = store->check({"shoestring/failed/" + std::to_string(r)});
            all = all && answered[static_cast<size_t>(r)];
          }
          if (all || std::chrono::steady_clock::now() >= until) break;
          std::this_thread::sleep_for(std::chrono::milliseconds(100));
        }
        for (int r = 0; r < size; ++r) {
          if (!answered[static_cast<size_t>(r)]) silent.push_back(r);
        }
      } catch (const std::exception& e) {
        error = e.what();
      }
      std::lock_guard<std::mutex> lock(shared->m);
      shared->silent = std::move(silent);
      shared->error = std::move(error);
      shared->finished = true;
      shared->done.notify_all();
    }).detach();
    std::unique_lock<std::mutex> lock(shared->m);
    const bool finished = shared->done.wait_for(lock, std::chrono::seconds(3), [&] { return shared->finished; });
    if (!finished || !shared->error.empty()) {
      diagnosis = "; the store does not answer either (rank 0 or torchrun's agent hosts it: stopped or gone?)";
    } else if (shared->silent.empty()) {
      diagnosis = "; every rank saw a collective fail (a mismatch of collectives, or a network fault?)";
    } else {
      diagnosis = fmt::format(
          "; rank{} {} did not report this failure within 1.5 s: stopped, hung or exited (or still "
          "computing, or blocked on this rank in the collective)",
          shared->silent.size() == 1 ? "" : "s", fmt::join(shared->silent, ", "));
    }
    return *diagnosis;
  }
};

struct PendingCollective::State {
  std::string what;                     ///< "all_reduce_sum on rank 1 of 2"
  std::string hint;                     ///< what the timeout is
  ProcessGroup::Impl* group = nullptr;  ///< asked which ranks do not answer when it failed
  c10::intrusive_ptr<c10d::Work> work;
  std::function<void()> finish;  ///< copies results back after the wait
  bool done = false;
};

PendingCollective::PendingCollective() = default;
PendingCollective::PendingCollective(std::unique_ptr<State> state) : state_(std::move(state)) {}
PendingCollective::PendingCollective(PendingCollective&&) noexcept = default;
PendingCollective& PendingCollective::operator=(PendingCollective&&) noexcept = default;
PendingCollective::~PendingCollective() {
  if (!state_ || state_->done) return;
  // Dropped while an error unwinds or is being handled (a peer failed:
  // every collective in flight fails alike): that error is the one
  // reported; this one only in the debug log, so a rank does not print the
  // same failure twice.
  const bool unwinding = std::uncaught_exceptions() > 0 || std::current_exception() != nullptr;
  try {
    wait();
  } catch (const std::exception& e) {
    if (unwinding) {
      spdlog::debug("{}", e.what());
    } else {
      spdlog::error("{}", e.what());
    }
  }
}

void PendingCollective::wait() {
  if (!state_ || state_->done) return;
  state_->done = true;
  try {
    state_->work->wait();
  } catch (const std::exception& e) {
    fail("{} failed: {}; {}{}", state_->what, e.what(), state_->hint,
         state_->group ? state_->group->unresponsive_ranks() : std::string());
  }
  if (state_->finish) state_->finish();
}

namespace {

/// Issues a collective (`issue` returns its Work) and returns it in flight;
/// an error raised by the call itself becomes shoestring::Error like one
/// raised at wait(). `finish` runs after a successful wait.
PendingCollective start(ProcessGroup::Impl* group, std::string what, std::string hint,
                        const std::function<c10::intrusive_ptr<c10d::Work>()>& issue,
                        std::function<void()> finish = {}) {
  auto state = std::make_unique<PendingCollective::State>();
  state->group = group;
  try {
    state->work = issue();
  } catch (const std::exception& e) {
    fail("{} failed: {}; {}{}", what, e.what(), hint, group ? group->unresponsive_ranks() : std::string());
  }
  state->what = std::move(what);
  state->hint = std::move(hint);
  state->finish = std::move(finish);
  return PendingCollective(std::move(state));
}

bool gloo_sums(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kInt || t == at::kLong || t == at::kByte || t == at::kChar;
}

}  // namespace

ProcessGroup::ProcessGroup(std::unique_ptr<Impl> impl, int rank, int size, std::chrono::milliseconds timeout)
    : impl_(std::move(impl)), rank_(rank), size_(size), timeout_(timeout) {
  impl_->rank = rank;
  impl_->size = size;
}

ProcessGroup::~ProcessGroup() = default;

namespace {

c10::intrusive_ptr<c10d::ProcessGroupGloo> make_gloo(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                     std::chrono::milliseconds timeout,
                                                     const std::string& master_addr) {
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices = gloo_devices(master_addr);
  options->threads = 2 * static_cast<int>(options->devices.size());  // as torch.distributed
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
}

/// A peer that exits closes its sockets; Gloo's next write to one of them
/// raises SIGPIPE, whose default action killed this rank silently (status
/// 141) instead of letting the write fail with EPIPE and the collective
/// throw its error naming the peer (seen in Collectives.DeadPeerOfThree).
/// Python, under which torch.distributed usually runs, ignores SIGPIPE from
/// start-up; a rank does the same here, unless a handler is installed.
void ignore_sigpipe() {
  struct sigaction current {};
  if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) ::signal(SIGPIPE, SIG_IGN);
}

/// Gives `impl` its NCCL backend for CUDA tensors on `device` (nothing for
/// the CPU), through the group's store under a prefix of its own.
void join_device(ProcessGroup::Impl& impl, int rank, int size, std::chrono::milliseconds timeout,
                 const c10::Device& device) {
  if (device.is_cpu()) return;
  if (!device.is_cuda() || !device.has_index())
    fail("rank {} of {}: a process group reduces host tensors and those of one CUDA device (cuda:N), not '{}'", rank,
         size, device.str());
#if defined(SHOESTRING_WITH_CUDA)
  auto store = c10::make_intrusive<c10d::PrefixStore>("shoestring/nccl", impl.store);
  try {
    impl.device = make_nccl_collectives(store, rank, size, timeout, device.index());
  } catch (const Error&) {
    throw;  // names the rank already
  } catch (const std::exception& e) {
    fail("rank {} of {} on {}: cannot create the NCCL group: {}", rank, size, device.str(), e.what());
  }
  impl.device_of_group = device;
#else
  (void)timeout;
  fail("rank {} of {} on {}: this build of shoestring has no CUDA (libtorch without CUDA)", rank, size, device.str());
#endif
}

/// What the NCCL backend reads from the environment, set before the store
/// and Gloo start their threads.
void prepare_environment(const c10::Device& device) {
#if defined(SHOESTRING_WITH_CUDA)
  if (device.is_cuda()) prepare_nccl_environment();
#else
  (void)device;
#endif
}

}  // namespace

std::unique_ptr<ProcessGroup> ProcessGroup::connect(const LaunchEnvironment& env, std::chrono::milliseconds timeout,
                                                    const c10::Device& device) {
  if (env.world_size < 1 || env.rank < 0 || env.rank >= env.world_size)
    fail("ProcessGroup::connect: rank {} of world size {} is not a valid rank", env.rank, env.world_size);
  ignore_sigpipe();
  prepare_environment(device);
  auto impl = std::make_unique<Impl>();
  const std::string where = fmt::format("rank {} of {}", env.rank, env.world_size);
  try {
    c10d::TCPStoreOptions so;
    so.port = static_cast<std::uint16_t>(env.master_port);
    so.isServer = !env.use_agent_store && env.rank == 0;
    so.numWorkers = env.use_agent_store ? c10::optional<std::size_t>() : c10::optional<std::size_t>(env.world_size);
    so.waitWorkers = !env.use_agent_store;
    so.timeout = timeout;
    c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, so);
    if (env.use_agent_store) {
      store = c10::make_intrusive<c10d::PrefixStore>(fmt::format("/worker/attempt_{}", env.restart_count), store);
    }
    impl->store = store;
    impl->host =
        std::make_unique<GlooCollectives>(make_gloo(store, env.rank, env.world_size, timeout, env.master_addr));
  } catch (const std::exception& e) {
    fail(
        "cannot join the process group as {} through the store at {}:{} ({}): {}; every rank must start within "
        "ddp_timeout = {} (is MASTER_PORT free and the same on every rank?)",
        where, env.master_addr, env.master_port, env.use_agent_store ? "torchrun's agent store" : "hosted by rank 0",
        e.what(), seconds_text(timeout));
  }
  join_device(*impl, env.rank, env.world_size, timeout, device);
  return std::unique_ptr<ProcessGroup>(new ProcessGroup(std::move(impl), env.rank, env.world_size, timeout));
}

std::unique_ptr<ProcessGroup> ProcessGroup::connect_file(const std::string& path, int rank, int size,
                                                         std::chrono::milliseconds timeout, const c10::Device& device) {
  if (size < 1 || rank < 0 || rank >= size)
    fail("ProcessGroup::connect_file: rank {} of world size {} is not a valid rank", rank, size);
  ignore_sigpipe();
  prepare_environment(device);
  auto impl = std::make_unique<Impl>();
  try {
    auto store = c10::make_intrusive<c10d::FileStore>(path, size);
    store->setTimeout(timeout);
    impl->store = store;
    impl->host = std::make_unique<GlooCollectives>(make_gloo(store, rank, size, timeout, "127.0.0.1"));
  } catch (const std::exception& e) {
    fail("cannot join the process group as rank {} of {} through the file store '{}': {}", rank, size, path, e.what());
  }
  join_device(*impl, rank, size, timeout, device);
  return std::unique_ptr<ProcessGroup>(new ProcessGroup(std::move(impl), rank, size, timeout));
}

const c10::Device& ProcessGroup::device() const { return impl_->device_of_group; }

std::string ProcessGroup::where() const { return fmt::format("rank {} of {}", rank_, size_); }

std::string ProcessGroup::backends() const {
  if (!impl_->device) return impl_->host->describe();
  return fmt::format("{} (host tensors), {}", impl_->host->describe(), impl_->device->describe());
}

namespace {
std::string hint_for(std::chrono::milliseconds timeout) {
  return fmt::format(
      "another rank exited, stopped, or issued different collectives (they wait at most ddp_timeout = {})",
      seconds_text(timeout));
}

/// Issues one rooted collective per rank r on chunk r (`n` elements) of the
/// flat tensor `flat`, all in flight together, and waits for them: the
/// reduce-scatter (per-chunk reduce) and all-gather (per-rank broadcast) that
/// Debian 1.13 Gloo lacks. `op(v, root)` issues the collective on v = {chunk}.
void for_each_root_chunk(ProcessGroup::Impl* group, const std::string& what, const std::string& hint,
                         const at::Tensor& flat, int64_t n, int size,
                         const std::function<c10::intrusive_ptr<c10d::Work>(std::vector<at::Tensor>&, int)>& op) {
  std::vector<PendingCollective> pending;
  for (int root = 0; root < size; ++root) {
    std::vector<at::Tensor> v{flat.narrow(0, root * n, n)};
    pending.push_back(start(group, what, hint, [&] { return op(v, root); }));
  }
  for (auto& p : pending) p.wait();
}
}  // namespace

PendingCollective ProcessGroup::all_reduce_sum_async(const at::Tensor& tensor) {
  const std::string what = "all_reduce_sum on " + where();
  if (!tensor.is_contiguous() || !gloo_sums(tensor.scalar_type()))
    fail("{}: all_reduce_sum_async needs a contiguous fp32 / fp64 / integer tensor, got {} {}", what,
         c10::toString(tensor.scalar_type()), format_shape(tensor.sizes()));
  C10dCollectives& backend = impl_->backend_for(tensor, what);
  return start(impl_.get(), what, hint_for(timeout_), [&] {
    std::vector<at::Tensor> v{tensor};
    return backend.allreduce(v);
  });
}

PendingCollective ProcessGroup::reduce_sum_async(const at::Tensor& tensor, int root) {
  const std::string what = fmt::format("reduce_sum to rank {} on {}", root, where());
  if (root < 0 || root >= size_) fail("{}: root {} is not a rank of the group", what, root);
  if (!tensor.is_contiguous() || !gloo_sums(tensor.scalar_type()))
    fail("{}: reduce_sum_async needs a contiguous fp32 / fp64 / integer tensor, got {} {}", what,
         c10::toString(tensor.scalar_type()), format_shape(tensor.sizes()));
  C10dCollectives& backend = impl_->backend_for(tensor, what);
  return start(impl_.get(), what, hint_for(timeout_), [&] {
    std::vector<at::Tensor> v{tensor};
    return backend.reduce(v, root);
  });
}

void ProcessGroup::all_reduce_sum(at::Tensor& tensor) {
  if (tensor.is_contiguous() && gloo_sums(tensor.scalar_type())) {
    all_reduce_sum_async(tensor).wait();
    return;
  }
  const bool low = tensor.scalar_type() == at::kBFloat16 || tensor.scalar_type() == at::kHalf;
  at::Tensor work = low ? tensor.to(at::kFloat).contiguous() : tensor.contiguous().clone();
  if (!gloo_sums(work.scalar_type()))
    fail("all_reduce_sum on {}: dtype {} cannot be summed (expected a floating or integer tensor)", where(),
         c10::toString(tensor.scalar_type()));
  all_reduce_sum_async(work).wait();
  tensor.copy_(work);
}

double ProcessGroup::all_reduce_sum(double value) {
  at::Tensor t = at::full({1}, value, at::TensorOptions().dtype(at::kDouble));
  all_reduce_sum(t);
  return t.item<double>();
}

PendingCollective ProcessGroup::broadcast_async(const at::Tensor& tensor, int root) {
  const std::string what = fmt::format("broadcast from rank {} on {}", root, where());
  if (root < 0 || root >= size_) fail("{}: root {} is not a rank of the group", what, root);
  if (!tensor.is_contiguous()) fail("{}: broadcast_async needs a contiguous tensor", what);
  // bf16 moves as its bits (Gloo copies without arithmetic); bool as bytes.
  at::Tensor wire = tensor;
  if (tensor.scalar_type() == at::kBFloat16) wire = tensor.view(at::kHalf);
  if (tensor.scalar_type() == at::kBool || tensor.scalar_type() == at::kShort) wire = tensor.view(at::kByte);
  C10dCollectives& backend = impl_->backend_for(tensor, what);
  return start(impl_.get(), what, hint_for(timeout_), [&] {
    std::vector<at::Tensor> v{wire};
    return backend.broadcast(v, root);
  });
}

void ProcessGroup::broadcast(at::Tensor& tensor, int root) {
  at::Tensor work = tensor.is_contiguous() ? tensor : tensor.contiguous();
  broadcast_async(work, root).wait();
  if (!work.is_same(tensor)) tensor.copy_(work);
}

at::Tensor ProcessGroup::reduce_scatter_sum(const at::Tensor& input) {
  const std::string what = "reduce_scatter_sum on " + where();
  if (input.dim() != 1 || input.numel() % size_ != 0)
    fail("{}: expected a 1-D tensor whose numel is a multiple of the world size {} (pad it), got shape {}", what, size_,
         format_shape(input.sizes()));
  if (!at::isFloatingType(input.scalar_type()))
    fail("{}: expected a floating-point tensor, got {}", what, c10::toString(input.scalar_type()));
  // Gloo's reduce may use every rank's buffer as scratch: work on an fp32 copy.
  at::Tensor work = input.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true).contiguous();
  const int64_t n = input.numel() / size_;
  C10dCollectives& backend = impl_->backend_for(work, what);
  for_each_root_chunk(impl_.get(), what, hint_for(timeout_), work, n, size_,
                      [&](std::vector<at::Tensor>& v, int root) { return backend.reduce(v, root); });
  return work.narrow(0, rank_ * n, n).clone();
}

at::Tensor ProcessGroup::all_gather(const at::Tensor& input) {
  const std::string what = "all_gather on " + where();
  if (input.dim() != 1) fail("{}: expected a 1-D tensor, got shape {}", what, format_shape(input.sizes()));
  const int64_t n = input.numel();
  at::Tensor out = at::empty({n * size_}, input.options());
  out.narrow(0, rank_ * n, n).copy_(input);
  // Same-size views only: the chunks are counted in elements.
  at::Tensor wire = out;
  if (out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kShort) wire = out.view(at::kHalf);
  if (out.scalar_type() == at::kBool) wire = out.view(at::kByte);
  C10dCollectives& backend = impl_->backend_for(wire, what);
  for_each_root_chunk(impl_.get(), what, hint_for(timeout_), wire, n, size_,
                      [&](std::vector<at::Tensor>& v, int root) { return backend.broadcast(v, root); });
  return out;
}

void ProcessGroup::barrier() {
  start(impl_.get(), "barrier on " + where(), hint_for(timeout_), [&] { return impl_->host->barrier(); }).wait();
}

void ProcessGroup::signal(const std::string& key, const std::string& message) {
  try {
    impl_->store->set("shoestring/signal/" + key, std::vector<uint8_t>(message.begin(), message.end()));
  } catch (const std::exception& e) {
    fail("signal '{}' from {} failed: {}", key, where(), e.what());
  }
}

std::string ProcessGroup::wait_for_signal(const std::string& key, const std::string& what,
                                          std::chrono::milliseconds timeout) {
  const std::string full = "shoestring/signal/" + key;
  try {
    impl_->store->wait({full}, timeout);
    const std::vector<uint8_t> bytes = impl_->store->get(full);
    return std::string(bytes.begin(), bytes.end());
  } catch (const std::exception& e) {
    fail("{} waited for rank 0 ({}) and gave up: {} (rank 0 exited, or took longer than {})", where(), what, e.what(),
         seconds_text(timeout));
  }
}

}  // namespace shoestring::dist
