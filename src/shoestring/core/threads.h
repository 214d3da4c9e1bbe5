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

namespace shoestring {

/// Sets libtorch's intra-op threads: `requested` if > 0, else the number of
/// CPUs in this process's affinity mask. Returns the count set.
int configure_threads(int64_t requested);

/// Makes libgomp's idle workers sleep instead of spinning, for a program's
/// main(): libgomp reads OMP_WAIT_POLICY once, when it is loaded, so when the
/// variable is unset this sets it to PASSIVE and re-executes the running
/// binary (/proc/self/exe) with the same `argv`. A value the user set, any
/// non-empty value, is kept (libgomp ignores values it does not know). Returns normally (without re-executing) when the variable
/// was already set or when the re-execution fails; never throws.
/// Why: with 2 cores, libgomp's spinning workers compete with OpenBLAS's own
/// threads and with every other process (see the measurement above).
void prefer_passive_omp_wait(char** argv);

/// The OpenMP wait policy in effect for this process: the value of
/// OMP_WAIT_POLICY, or "default (spinning)" when it is unset.
const char* omp_wait_policy();

/// Keeps freed tensor memory in the process between training steps instead of
/// returning it to the kernel and faulting it in again, zeroed, next step:
/// glibc's mallopt with M_MMAP_THRESHOLD 32 MiB (its maximum on 64-bit;
/// larger blocks are still mmap'd), M_TRIM_THRESHOLD 1 GiB and M_TOP_PAD
/// 64 MiB. Resident memory after a step's peak stays near that peak, which
/// the memory ledger counts anyway. A no-op on other C libraries. Never throws.
void configure_allocator();

}  // namespace shoestring
