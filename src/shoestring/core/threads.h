// CPU runtime settings for libtorch: intra-op thread count, OpenMP wait
// policy, OpenBLAS's kernel set and the C allocator's trim behaviour.
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

#include "shoestring/core/cpu_features.h"

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

/// Sets the environment that libgomp and OpenBLAS read only when they are
/// loaded, for a program's main(), and re-executes the running binary
/// (/proc/self/exe) with the same `argv` when it changed anything:
/// - OMP_WAIT_POLICY = PASSIVE (and GOMP_SPINCOUNT = kOmpSpinCount) when
///   unset, so that libgomp's idle workers sleep instead of spinning for long.
///   Why: with 2 cores, spinning workers compete with OpenBLAS's own threads
///   and with every other process (see the measurement above).
/// - OPENBLAS_CORETYPE = openblas_core_override(...) when unset and OpenBLAS
///   picked kernels older than the CPU (see there).
/// A value the user set is kept (any non-empty OMP_WAIT_POLICY; any
/// OPENBLAS_CORETYPE, even empty: OpenBLAS reads an empty one as set).
/// libgomp and OpenBLAS ignore values they do not know. Returns normally
/// (without re-executing) when nothing needed setting, when the program was
/// started through the dynamic loader (`ld-linux-x86-64.so.2 PROGRAM`, where
/// /proc/self/exe is the loader; the variables then reach children only) or
/// when the re-execution fails; never throws.
void set_cpu_runtime_environment(char** argv);

/// The OpenBLAS kernel set ("core", the value of OPENBLAS_CORETYPE) to ask for
/// instead of `chosen`, the one OpenBLAS picked (openblas_get_corename()), on
/// a CPU with `cpu`'s features; "" to keep `chosen`. OpenBLAS's DYNAMIC_ARCH
/// build (Debian's) picks by CPU family and model, and one that it does not
/// know falls back to generic kernels: Debian 12's OpenBLAS 0.3.21 runs its
/// SSE3 "Prescott" sgemm on a Xeon of family 6 model 207 (Emerald Rapids,
/// AVX-512 BF16 and AMX). Measured there (2 vCPUs, build/bench/model_step,
/// emoji model, fp32, batch 32, unfused AdamW, alternating 3 rounds):
/// 0.162-0.171 s/step with Prescott, 0.115-0.126 with SkylakeX. So a
/// `chosen` without AVX2 kernels (not Haswell, Zen, SkylakeX, Cooperlake,
/// SapphireRapids or Excavator; compared case-insensitively) is replaced by
/// "SkylakeX" where the CPU has x86-64-v4 (AVX-512 F, BW, VL, DQ) and by
/// "Haswell" where it has x86-64-v3 (AVX2 and FMA). "" for an empty `chosen`
/// (no OpenBLAS in the process). Never throws.
std::string openblas_core_override(const std::string& chosen, const CpuFeatures& cpu);

/// The BLAS under libtorch's fp32 matrix products: "OpenBLAS <core>" (the
/// kernel set in use, openblas_get_corename()), with " (OPENBLAS_CORETYPE)"
/// when that variable chose it; "unknown" when the process has no OpenBLAS.
std::string blas_kernels();

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
