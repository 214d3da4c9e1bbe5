// CPU runtime settings for libtorch: intra-op thread count, OpenMP wait
// policy and the C allocator's trim behaviour.
//
// libtorch 1.13 defaults to the number of *physical* cores that cpuinfo
// reports, which on small virtual machines whose vCPUs are presented as SMT
// siblings is 1 even when 2 CPUs are usable; bf16 kernels there run ~2x
// faster on both. shoestring defaults to every CPU the process may use.
//
// Measured on a 2-core AMD EPYC (AVX2) with the emoji example's step
// (examples/emoji.toml, batch 32): 5.0 s/step with libgomp's default
// (spinning) wait policy and glibc's default trimming, 3.3 s/step with
// OMP_WAIT_POLICY=PASSIVE and the allocator settings below; under load from
// other processes spinning workers were 3-4x slower still. The numbers come
// from bench/train_step (`--json` prints the machine line too).
#pragma once
#include <cstdint>
#include <string>

namespace shoestring {

/// Sets libtorch's intra-op threads: `requested` if > 0, else the number of
/// CPUs in this process's affinity mask; OpenBLAS's own pool too (when the
/// process has OpenBLAS and OPENBLAS_NUM_THREADS is unset): without it the
/// matrix products of every rank of `shoestring launch` used every core
/// (oversubscribed, and numerically unlike torchrun, which sets
/// OMP_NUM_THREADS = 1). Returns the count set.
int configure_threads(int64_t requested);

/// GOMP_SPINCOUNT set beside PASSIVE (when unset): an idle worker spins this
/// many times (libgomp's busy-wait loop, roughly 0.1 ms) before it sleeps.
/// libgomp uses an explicit GOMP_SPINCOUNT whatever OMP_WAIT_POLICY says
/// (env.c); with PASSIVE alone the spin count is 0, so every parallel region
/// wakes its workers through futex calls. Measured on a 2-core Xeon (Sapphire
/// Rapids, AVX-512 BF16, quiet machine, build/bench/model_step, emoji model,
/// batch 32): bf16 0.255 -> 0.175 s/step, fp32 0.235 -> 0.198 s/step; the
/// SDXL-shaped optimizer steps of bench/optimizer_memory (1680 tensors, two
/// parallel regions each) 1.7-2.8x faster (fp32 AdamW 118 -> 68 ms,
/// Adafactor 212 -> 77 ms). With a busy process on one of the two cores,
/// 3000 and 0 were alike (fp32 0.56 vs 0.66 s/step, bf16 1.1 vs 1.05), unlike
/// unbounded spinning (see above).
inline constexpr const char* kOmpSpinCount = "3000";

/// Makes libgomp's idle workers sleep instead of spinning for long, for a
/// program's main(): libgomp reads OMP_WAIT_POLICY once, when it is loaded, so
/// when the variable is unset this sets it to PASSIVE (and GOMP_SPINCOUNT to
/// kOmpSpinCount unless set) and re-executes the running binary
/// (/proc/self/exe) with the same `argv`. A value the user set, any
/// non-empty value, is kept (libgomp ignores values it does not know). Returns normally (without re-executing) when the
/// variable was already set or when the re-execution fails; never throws. Why: with 2 cores, libgomp's spinning workers
/// compete with OpenBLAS's own threads and with every other process (see the measurement above).
void prefer_passive_omp_wait(char** argv);

/// The OpenMP wait policy in effect for this process: the value of
/// OMP_WAIT_POLICY, or "default (spinning)" when it is unset, followed by
/// ", GOMP_SPINCOUNT N" when that is set.
std::string omp_wait_policy();

/// Keeps freed tensor memory in the process between training steps instead of
/// returning it to the kernel and faulting it in again, zeroed, next step:
/// glibc's mallopt with M_MMAP_THRESHOLD 32 MiB (its maximum on 64-bit;
/// larger blocks are still mmap'd), M_TRIM_THRESHOLD 1 GiB and M_TOP_PAD
/// 64 MiB. Resident memory after a step's peak stays near that peak, which
/// the memory ledger counts anyway. A no-op on other C libraries. Never throws.
void configure_allocator();

}  // namespace shoestring
