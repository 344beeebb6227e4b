/**
 * @file ptx.cuh
 * @brief The PTX the decode kernels use, wrapped as small functions named for what they do:
 * shared-memory addresses, cp.async, ldmatrix, mma.sync, exp2/log2 (16-bit float packing
 * and the vector types are in half.cuh).
 *
 * No CUDA header is included: NVRTC compiles these with nothing but this tree, so a machine
 * needs only the driver and libnvrtc. bf16/f16 values travel as raw 16-bit patterns.
 * MODEL_BF16 (1: bf16, 0: f16) picks the 16-bit type of q, P and o.
 */
#pragma once
#include "common/half.cuh"
#include "params.cuh"

/// 2^x (approximate; 2^-inf = 0), and log2(x).
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float log2_approx(float x) {
    float y;
    asm("lg2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

/// Bytes of dynamic shared memory the launch gave this CTA.
__device__ __forceinline__ u32 dynamic_smem_bytes() {
    u32 n;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(n));
    return n;
}

/// 16 bytes global -> shared, asynchronously; with `valid` false, 16 zero bytes and no read.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool valid) {
    const int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(n) : "memory");
}
/// A 4-byte piece (through L1: the .cg form copies 16 bytes only); `valid` false fills it
/// with zeros.
__device__ __forceinline__ void cp_async4(u32 dst, const void* src, bool valid) {
    const int n = valid ? 4 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(n) : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}
/// One arrival on the mbarrier at `bar` (which counts it among its expected arrivals) once
/// every cp.async this thread has issued so far has landed.
__device__ __forceinline__ void cp_async_arrive_on(u32 bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
/// Waits until at most N of the committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait_group() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

/// Four 8x8 b16 matrices from shared memory (lane i addresses row i % 8 of matrix i / 8).
__device__ __forceinline__ void ldmatrix_x4(u32 r[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
/// The same, each matrix transposed.
__device__ __forceinline__ void ldmatrix_x4_trans(u32 r[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
/// Two 8x8 b16 matrices (lanes 0-15 address them).
__device__ __forceinline__ void ldmatrix_x2(u32 r[2], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(addr));
}

/// 8 bytes from shared memory at a 32-bit shared address, in program order (volatile, a
/// memory clobber: the compiler neither hoists it nor keeps its address live ahead of time).
__device__ __forceinline__ u32x2 ld_shared_u32x2(u32 addr) {
    u32x2 v;
    asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(addr) : "memory");
    return v;
}
/// 16 bytes from shared memory at a 32-bit shared address, in program order.
__device__ __forceinline__ u32x4 ld_shared_u32x4(u32 addr) {
    u32x4 v;
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr)
                 : "memory");
    return v;
}
/// 16 bytes to shared memory at a 32-bit shared address, in program order.
__device__ __forceinline__ void st_shared_u32x4(u32 addr, u32x4 v) {
    asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}
/// The low byte of `v` to shared memory at a 32-bit shared address, in program order.
__device__ __forceinline__ void st_shared_u8(u32 addr, u32 v) {
    asm volatile("st.shared.u8 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}
/// The low 2 bytes of `v` to shared memory at a 32-bit shared address, in program order.
__device__ __forceinline__ void st_shared_u16(u32 addr, u32 v) {
    asm volatile("st.shared.u16 [%0], %1;" ::"r"(addr), "h"((u16)v) : "memory");
}
/// 4 bytes to and from shared memory at a 32-bit shared address, in program order.
__device__ __forceinline__ void st_shared_u32(u32 addr, u32 v) {
    asm volatile("st.shared.u32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void st_shared_f32(u32 addr, float v) {
    asm volatile("st.shared.f32 [%0], %1;" ::"r"(addr), "f"(v) : "memory");
}
/// 8 bytes (two floats) to and from shared memory at a 32-bit shared address, in program order.
__device__ __forceinline__ void st_shared_f32x2(u32 addr, float x, float y) {
    asm volatile("st.shared.v2.f32 [%0], {%1,%2};" ::"r"(addr), "f"(x), "f"(y) : "memory");
}
__device__ __forceinline__ f32x2 ld_shared_f32x2(u32 addr) {
    f32x2 v;
    asm volatile("ld.shared.v2.f32 {%0,%1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(addr) : "memory");
    return v;
}
__device__ __forceinline__ u32 ld_shared_u32(u32 addr) {
    u32 v;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
    return v;
}
__device__ __forceinline__ float ld_shared_f32(u32 addr) {
    float v;
    asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
    return v;
}
/// W 32-bit words (W = 1, 2 or a multiple of 4; 16-byte aligned for a multiple of 4) from
/// shared memory at a 32-bit shared address, in as few loads as their width allows.
template <int W>
__device__ __forceinline__ void ld_shared_words(u32 (&w)[W], u32 addr) {
    static_assert(W == 1 || W == 2 || W % 4 == 0, "1, 2 or a multiple of 4 words");
    if constexpr (W == 1) {
        w[0] = ld_shared_u32(addr);
    } else if constexpr (W == 2) {
        const u32x2 v = ld_shared_u32x2(addr);
        w[0] = v.x;
        w[1] = v.y;
    } else {
#pragma unroll
        for (int i = 0; i < W / 4; ++i) {
            const u32x4 v = ld_shared_u32x4(addr + 16 * i);
            w[4 * i] = v.x;
            w[4 * i + 1] = v.y;
            w[4 * i + 2] = v.z;
            w[4 * i + 3] = v.w;
        }
    }
}

/// Waits at named barrier `id` (1 to 15; 0 is __syncthreads) for `threads` threads.
__device__ __forceinline__ void named_barrier(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

/// `x` as a value the compiler cannot see through: an address computed from it inside a loop
/// is computed there, not hoisted out of the loop and kept in a register all along.
__device__ __forceinline__ u32 opaque_u32(u32 x) {
    u32 r;
    asm volatile("mov.b32 %0, %1;" : "=r"(r) : "r"(x));
    return r;
}

/// c[16x8] += a[16x16] * b[16x8], f32 accumulate
/// (fragments: https://docs.nvidia.com/cuda/parallel-thread-execution/#warp-level-matrix-fragment-mma-16816-float).
template <bool BF16>
__device__ __forceinline__ void mma_16816(float c[4], const u32 a[4], u32 b0, u32 b1) {
    if (BF16) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

/// Programmatic dependent launch (sm_90 and up; no-ops before): a stage-1 kernel lets the
/// combine, launched after it as a programmatic dependent, start launching now; the combine
/// waits for every write of stage 1 before it reads one (with an ordinary launch, the wait
/// returns at once).
__device__ __forceinline__ void allow_dependent_launch() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_previous_grid() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

/// Max and sum over the four lanes of a quad (the lanes that share an mma row).
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}
/// Max and sum over the 32 lanes of a warp (the max NaN when any lane's is: fmax_nan).
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int d = 16; d > 0; d /= 2) x = fmax_nan(x, __shfl_xor_sync(0xffffffffu, x, d));
    return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int d = 16; d > 0; d /= 2) x += __shfl_xor_sync(0xffffffffu, x, d);
    return x;
}
