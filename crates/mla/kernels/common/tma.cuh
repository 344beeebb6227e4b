/**
 * @file tma.cuh
 * @brief Hopper's tensor memory accelerator (sm_90a) and the mbarriers that track it: a
 * bulk tensor copy global -> shared described by a tensor map (built on the host by
 * cuTensorMapEncodeTiled and passed as a __grid_constant__ kernel parameter), and the
 * arrive / expect-bytes / wait-on-parity operations of a shared-memory mbarrier.
 * PTX: https://docs.nvidia.com/cuda/parallel-thread-execution/#tensor-copy-instructions and
 * #parallel-synchronization-and-communication-instructions-mbarrier
 *
 * An mbarrier completes a phase when its expected arrivals have arrived and the bytes it was
 * told to expect have landed; waiters name the phase by its parity (0, 1, 0, ...).
 */
#pragma once
#include "params.cuh"

/// The driver's opaque CUtensorMap (128 bytes, 64-byte aligned).
struct __align__(64) TensorMap {
    u64 opaque[16];
};

/// Sets up an mbarrier at shared address `bar` expecting `count` arrivals a phase.
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
/// Makes the initialized mbarriers visible to the async proxy (the TMA unit) and other threads.
__device__ __forceinline__ void mbar_fence_init() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
/// One arrival that also tells the barrier to expect `bytes` more of asynchronous copies.
__device__ __forceinline__ void mbar_expect_bytes(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
/// One arrival.
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
/// Waits until the phase of parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    u32 done;
    do {
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
}

/// A box of the 3-D tensor `map` at element coordinates (x, y, z) into shared memory at
/// `dst`, completing `bytes` (the box's size, zero-filled where it lies outside the tensor,
/// negative coordinates included) on the mbarrier `bar`.
__device__ __forceinline__ void tma_load_3d(u32 dst, const TensorMap* map, u32 bar, int x, int y, int z) {
#ifdef MLA_EXP_EVICT_FIRST
    u64 policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint [%0], "
        "[%1, {%2, %3, %4}], [%5], %6;" ::"r"(dst),
        "l"((u64)map), "r"(x), "r"(y), "r"(z), "r"(bar), "l"(policy)
        : "memory");
#else
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, "
        "%4}], [%5];" ::"r"(dst),
        "l"((u64)map), "r"(x), "r"(y), "r"(z), "r"(bar)
        : "memory");
#endif
}

/// Raises (INC) or lowers this warpgroup's registers a thread to REGS (a multiple of 8, 24 to
/// 256): warpgroups of one CTA with different roles split the register file unevenly.
template <bool INC, int REGS>
__device__ __forceinline__ void set_max_registers() {
    if (INC) {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(REGS));
    } else {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(REGS));
    }
}

/// Waits at named barrier `id` (1 to 15; 0 is __syncthreads) for `threads` threads.
__device__ __forceinline__ void named_barrier(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
