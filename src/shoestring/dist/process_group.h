// A group of processes that run collectives together: c10d's
// ProcessGroupGloo (libtorch's own CPU backend) over a rendezvous store for
// host tensors and, in a group joined on a CUDA device, c10d's
// ProcessGroupNCCL for that device's tensors (each collective goes to the
// backend of its tensor's device; barriers and store signals are Gloo's and
// the store's), behind an interface that keeps c10d and gloo headers out of
// the rest of shoestring and works around what Debian's libtorch 1.13 Gloo
// lacks. The workarounds apply to NCCL too (bf16 / fp16 summed in fp32,
// reduce-scatter and all-gather from rooted collectives), so a CUDA run
// reduces the same fp32 sums as a CPU run (in the same order at two ranks;
// NCCL's ring and tree orders differ from Gloo's beyond). Failures differ:
// a Gloo collective whose peer exited or stopped throws (below); an NCCL
// one waits, and c10d's watchdog ends the process once it outlives the
// timeout, with its own message naming the collective. barrier() is
// Gloo's and orders no GPU work.
//
// Facts relied on (probed on libtorch 1.13.1, /work/shared/research/zero.md
// section 1): Gloo reduces and broadcasts no bf16 (bf16 is reduced in fp32
// here and broadcast as its bits through a same-size fp16 view: Gloo copies,
// no arithmetic, so every pattern survives), fp16 sums accumulate in fp16
// (reduced in fp32 here), no AVG, no reduce_scatter / _allgather_base
// (built here from one reduce per chunk and one broadcast per rank, the
// latter 3-5x faster than Gloo's allgather on loopback), errors surface
// either at the call or at Work::wait() (both are caught), a peer that
// exits fails the next collective at once, a peer that stops fails it after
// the group's timeout. Collectives must be issued in the same order, with
// the same sizes, on every rank.
#pragma once
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/Device.h>

#include "shoestring/dist/launch_env.h"

namespace shoestring::dist {

/// How long a collective (and the rendezvous) may wait for the other ranks
/// by default: config `ddp_timeout` (Gloo's own default is 30 minutes).
inline constexpr std::chrono::seconds kDefaultTimeout{120};

class ProcessGroup;

/// A collective in flight (ProcessGroup's *_async calls). wait() blocks
/// until it is done on this rank (Gloo: host tensors) or, for tensors on
/// the group's GPU (NCCL), makes the calling thread's current CUDA stream
/// wait for it, which orders every later use of the tensors on that stream
/// (the host reads them through .item() / a copy to the CPU, which
/// synchronise); then it copies results back where needed. Destroying it
/// without wait() waits (errors then are logged, not thrown).
class PendingCollective {
 public:
  struct State;  ///< defined in process_group.cpp (holds the c10d work)
  PendingCollective();
  explicit PendingCollective(std::unique_ptr<State> state);
  PendingCollective(PendingCollective&&) noexcept;
  PendingCollective& operator=(PendingCollective&&) noexcept;
  ~PendingCollective();
  /// Throws shoestring::Error naming the collective and the rank when it
  /// failed (a peer exited or timed out). Idempotent.
  void wait();

 private:
  std::unique_ptr<State> state_;
};

/// One process's membership in a group of `size()` processes.
class ProcessGroup {
 public:
  /// Joins the group `env` describes over a TCP store at
  /// MASTER_ADDR:MASTER_PORT: hosted by rank 0, or, with
  /// env.use_agent_store, by torchrun's agent (every rank a client, keys
  /// under "/worker/attempt_<restart_count>", as torch.distributed does).
  /// Blocks until every rank has joined. `timeout` bounds the rendezvous and
  /// every collective. The Gloo device is GLOO_SOCKET_IFNAME's interfaces
  /// when set, loopback when MASTER_ADDR is a loopback address, else the
  /// address this host's name resolves to. Sets SIGPIPE to be ignored
  /// (unless a handler is installed), as Python does, so that a write to a
  /// dead peer's socket fails the collective instead of killing this process.
  /// `device` cuda:N: tensors on cuda:N are reduced over NCCL (a group of
  /// its own under the store prefix "shoestring/nccl"; NCCL joins at the
  /// first collective on the device), with `timeout` enforced by c10d's
  /// watchdog, which ends a rank whose collective outlives it
  /// (NCCL_ASYNC_ERROR_HANDLING = 1 unless set). Host tensors go through
  /// Gloo either way.
  /// Throws shoestring::Error naming the store and the rank when the
  /// rendezvous fails or times out, and naming the device when it is
  /// neither the CPU nor cuda:N, or this build (libtorch) has no CUDA / NCCL.
  static std::unique_ptr<ProcessGroup> connect(const LaunchEnvironment& env,
                                               std::chrono::milliseconds timeout = kDefaultTimeout,
                                               const c10::Device& device = c10::Device(c10::kCPU));
  /// Joins a group of `size` processes on one machine through a FileStore
  /// at `path` (a file every rank can see; remove it before reusing the
  /// path), on loopback; `device` as connect(). For tests. Throws
  /// shoestring::Error as connect().
  static std::unique_ptr<ProcessGroup> connect_file(const std::string& path, int rank, int size,
                                                    std::chrono::milliseconds timeout = kDefaultTimeout,
                                                    const c10::Device& device = c10::Device(c10::kCPU));
  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  /// The device whose tensors the group reduces besides host tensors
  /// (connect's `device`): cuda:N, or the CPU for a group joined on the CPU.
  const c10::Device& device() const;
  std::chrono::milliseconds timeout() const { return timeout_; }

  /// Every collective below takes host tensors, or tensors on the group's
  /// CUDA device (connect's `device`); another device throws
  /// shoestring::Error naming the collective and the device.
  ///
  /// Sums `tensor` over all ranks, in place (every rank gets the same bits).
  /// Any shape; any dtype Gloo sums (fp32, fp64, int32, int64, uint8, int8)
  /// directly; bf16 and fp16 are summed in fp32 and rounded to nearest once.
  /// Non-contiguous tensors go through a contiguous copy. Throws
  /// shoestring::Error naming the collective and this rank on failure.
  void all_reduce_sum(at::Tensor& tensor);
  /// all_reduce_sum of a contiguous fp32 / fp64 tensor, in flight; the
  /// tensor must stay alive and untouched until wait().
  PendingCollective all_reduce_sum_async(const at::Tensor& tensor);
  /// The sum over ranks of a double (e.g. a loss).
  double all_reduce_sum(double value);

  /// Sums a contiguous fp32 / fp64 / integer `tensor` over all ranks into
  /// rank `root`'s `tensor`, in flight (Gloo's reduce). On the other ranks
  /// the tensor is scratch afterwards (Gloo may leave partial sums in it).
  /// Every tensor must stay alive and untouched until wait(). Throws
  /// shoestring::Error for another dtype or layout, a root outside the
  /// group, and as all_reduce_sum.
  PendingCollective reduce_sum_async(const at::Tensor& tensor, int root);

  /// Copies rank `root`'s `tensor` into every rank's `tensor` (same shape and
  /// dtype on every rank), bit for bit, any dtype (bf16 and bool move as
  /// their bits). Throws shoestring::Error as all_reduce_sum.
  void broadcast(at::Tensor& tensor, int root);
  /// broadcast of a contiguous tensor, in flight: every rank's tensor must
  /// stay alive and untouched until wait(), after which it holds the root's
  /// bits. Throws shoestring::Error for a non-contiguous tensor and as
  /// broadcast.
  PendingCollective broadcast_async(const at::Tensor& tensor, int root);

  /// Reduce-scatter: `input` (1-D, numel = size() * n, any floating dtype)
  /// is summed over ranks and this rank receives chunk rank() (numel n) as
  /// fp32. Built from size() reduces (root i gets chunk i) on an fp32 copy.
  /// Throws shoestring::Error for a numel not divisible by size() (pad
  /// first), and as all_reduce_sum.
  at::Tensor reduce_scatter_sum(const at::Tensor& input);
  /// All-gather: every rank's `input` (1-D, numel n, same dtype everywhere)
  /// concatenated in rank order (numel size() * n). Built from one
  /// broadcast per rank into views of the output. Throws as broadcast.
  at::Tensor all_gather(const at::Tensor& input);

  /// Blocks until every rank has reached the barrier. Throws as all_reduce_sum.
  void barrier();

  /// Rank 0 tells the others that `key` happened, with `message` ("" = it
  /// went well); others wait for it with wait_for_signal.
  void signal(const std::string& key, const std::string& message = "");
  /// Waits up to `timeout` (longer than the group's: e.g. rank 0 writing a
  /// checkpoint) for rank 0's signal `key` and returns its message. Throws
  /// shoestring::Error naming `what` when it does not come in time or rank
  /// 0's store is gone.
  std::string wait_for_signal(const std::string& key, const std::string& what, std::chrono::milliseconds timeout);

  /// "rank 1 of 2" for messages.
  std::string where() const;
  /// The backends for the log: "Gloo", or "Gloo (host tensors), NCCL on cuda:1".
  std::string backends() const;

  struct Impl;  ///< defined in process_group.cpp (the store, the Gloo and NCCL groups)

 private:
  ProcessGroup(std::unique_ptr<Impl> impl, int rank, int size, std::chrono::milliseconds timeout);
  std::unique_ptr<Impl> impl_;
  int rank_;
  int size_;
  std::chrono::milliseconds timeout_;
};

}  // namespace shoestring::dist
