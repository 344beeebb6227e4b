/**
 * @file wgmma.cuh
 * @brief Hopper's warpgroup matrix multiply (sm_90a): shared-memory matrix descriptors for the
 * 128-byte swizzled layout, the two products the wgmma decode issues, and the fences around
 * them. PTX: https://docs.nvidia.com/cuda/parallel-thread-execution/#asynchronous-warpgroup-level-matrix-instructions
 *
 * Layout (the "128B swizzle" canonical layouts): a tile is stored as 64-element-wide column
 * chunks; inside a chunk each row is 128 bytes and 8 rows form a 1024-byte atom in which the
 * 16-byte piece c of row r sits at piece c ^ (r % 8). Atoms must be 1024-byte aligned.
 * The same bytes serve as a K-major operand (rows = M or N, the 64 columns = K) and, with the
 * transpose bit, as an MN-major one (rows = K, columns = N): the decode uses one key tile as
 * K for Q.K^T and as V for P.V.
 *
 * The asm operand lists are long because wgmma names every accumulator register (MLA_ACC32,
 * MLA_ACC128).
 */
#pragma once
#include "common/ptx.cuh"
#include "common/rows.cuh"
#include "params.cuh"

/// Byte offset of 16-byte piece `c` (counted over the whole row) of row `r` in a swizzled
/// tile of `rows` rows.
template <int ROWS>
__device__ __forceinline__ u32 swizzled(int r, int c) {
    return (u32)((c / 8) * (ROWS * 128) + r * 128 + (((c % 8) ^ (r % 8)) * 16));
}

/// q of a tile of ROWS rows into the swizzled tile at `q`, as a K-major wgmma operand:
/// `where(r, row, head)` names the query row and head of tile row r, false for a padding row
/// (zero-filled, never read). By NT threads, `t` this one's index (cp.async: the caller
/// commits and waits).
template <int ROWS, int L, int D, int NT, typename Where>
__device__ __forceinline__ void copy_q(const DecodeParams& p, u32 q, int t, Where where) {
    constexpr int PIECES = D / 8;  // 16-byte pieces a row
    for (int c = t; c < ROWS * PIECES; c += NT) {
        const int r = c / PIECES, k = c % PIECES;
        int row, head;
        const bool valid = where(r, row, head);
        const u16* src = q_piece<L>(p, row, head, k);
        cp_async16(q + swizzled<ROWS>(r, k), valid ? (const void*)src : p.q_nope, valid);
    }
}

/// Where pair i (0 .. 3) of k-step kk of this thread's A fragment of P (64 rows x 64 keys,
/// m16n8k16's A layout, as wgmma reads P from shared memory) lies in its swizzled tile: key
/// group j = 2 kk + i / 2 of row r0 (i even) or r0 + 8 (i odd), which share the swizzle
/// (r % 8); r0 = 16 (warp % 4) + lane / 4.
__device__ __forceinline__ u32 p_fragment_at(int r0, int lane, int kk, int i) {
    const int j = 2 * kk + i / 2;
    return (r0 + (i % 2) * 8) * 128 + ((j ^ (r0 % 8)) * 16) + (lane % 4) * 4;
}

/// A shared-memory matrix descriptor with the 128-byte swizzle. `lbo`: bytes between 64-wide
/// column chunks (MN-major operands only; K-major ones ignore it), `sbo`: bytes between 8-row
/// groups.
__device__ __forceinline__ u64 smem_desc(u32 addr, u32 lbo, u32 sbo) {
    return (u64)((addr & 0x3ffffu) >> 4) | ((u64)((lbo >> 4) & 0x3fffu) << 16) |
           ((u64)((sbo >> 4) & 0x3fffu) << 32) | (1ull << 62);
}

/// Byte offset of 16-byte piece `c` (counted over the whole row) of row `r` in a tile of
/// `rows` rows with the 64-byte swizzle (fp8 operands: 64 elements a row of a column chunk):
/// chunks of 64-byte rows, 8 rows an atom of 512 bytes in which piece c of row r sits at
/// piece c ^ (r / 2 % 4). Atoms must be 512-byte aligned.
template <int ROWS>
__device__ __forceinline__ u32 swizzled64(int r, int c) {
    return (u32)((c / 4) * (ROWS * 64) + r * 64 + (((c % 4) ^ ((r / 2) % 4)) * 16));
}

/// A shared-memory matrix descriptor with the 64-byte swizzle (K-major operands: `sbo` bytes
/// between 8-row groups, `lbo` unused).
__device__ __forceinline__ u64 smem_desc64(u32 addr, u32 lbo, u32 sbo) {
    return (smem_desc(addr, lbo, sbo) & ~(3ull << 62)) | (2ull << 62);
}

/// A descriptor `bytes` further on (a multiple of 16; the address field has room up to 256 KB).
__device__ __forceinline__ u64 desc_at(u64 desc, u32 bytes) {
    return desc + (bytes >> 4);
}

/// `desc` as a value the compiler cannot see through: computed inside a loop, it keeps the
/// per-step descriptors (desc_at) from being hoisted out of the loop, where 36 of them would
/// hold 72 registers.
__device__ __forceinline__ u64 opaque(u64 desc) {
    u64 r;
    asm volatile("mov.b64 %0, %1;" : "=l"(r) : "l"(desc));
    return r;
}

/// Pins accumulator registers' current values here: the compiler may not move their
/// definitions (a zeroing, say) past this point, between wgmma that are in flight, where
/// ptxas would have to inject waits (its C7517/C7519 notes).
template <int K>
__device__ __forceinline__ void fence_operands(float (&d)[K]) {
#pragma unroll
    for (int i = 0; i < K; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

/// Orders this thread's register and shared-memory accesses before the warpgroup's next wgmma.
__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
/// Waits until at most N committed wgmma groups are pending.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
/// Makes this thread's ordinary shared-memory writes visible to the async proxy (wgmma reads).
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

/// wgmma's accumulator operands: the 32 (m64n64) or 128 (m64n256) f32 registers of `d`, in
/// order, as the asm statements below name them (%0 ..), and their names in the instruction.
#define MLA_D32 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define MLA_D128 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
    "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define MLA_ACC32(d) \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define MLA_ACC128(d) \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
    "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
    "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
    "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
    "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
    "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
    "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
    "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
    "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])

/// d[64 x 64] (f32, this thread's 32 values) += A[64 x 16] * B[16 x 64], both from shared memory
/// through descriptors; B K-major. `accumulate` 0 overwrites d.
template <bool BF16>
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[32], u64 desc_a, u64 desc_b, int accumulate) {
#define MLA_WGMMA_64(TYPE)                                                                        \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                  \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " {"                 \
                 MLA_D32 "}, %32, %33, p, 1, 1, 0, 0;\n}\n"               \
                 : MLA_ACC32(d)                                                                   \
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate))
    if (BF16) {
        MLA_WGMMA_64("bf16");
    } else {
        MLA_WGMMA_64("f16");
    }
#undef MLA_WGMMA_64
}

/// d[64 x 64] (f32, this thread's 32 values) += A[64 x 32] * B[32 x 64] on fp8 codes: A e4m3,
/// B e4m3 (KV_FORMAT 2) or e5m2 (3), both K-major from shared memory (fp8 wgmma has no
/// transpose). `accumulate` 0 overwrites d.
template <int KV_FORMAT>
__device__ __forceinline__ void wgmma_m64n64k32_fp8(float (&d)[32], u64 desc_a, u64 desc_b, int accumulate) {
#define MLA_WGMMA_64_FP8(BTYPE)                                                                     \
    asm volatile(                                                                                 \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                                \
        "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3." BTYPE " {" MLA_D32 "}, "                 \
        "%32, %33, p, 1, 1;\n}\n"                                                                     \
        : MLA_ACC32(d)                                                                            \
        : "l"(desc_a), "l"(desc_b), "r"(accumulate))
    if (KV_FORMAT == 3) {
        MLA_WGMMA_64_FP8("e5m2");
    } else {
        MLA_WGMMA_64_FP8("e4m3");
    }
#undef MLA_WGMMA_64_FP8
}

/// d[64 x 64] (f32, this thread's 32 values) += A[64 x 32] * B[32 x 64] on fp8 codes, A from
/// this thread's registers (the 8-bit A fragment: a[0] row g = lane / 4 of the warp's 16,
/// columns 4 (lane % 4) .. + 3, a[1] row g + 8, a[2], a[3] the same rows 16 columns on), A in
/// the cache's format (KV_FORMAT 2: e4m3, 3: e5m2), B e4m3 K-major from shared memory. `a`
/// must not change until the product is waited for; `accumulate` 0 overwrites d.
template <int KV_FORMAT>
__device__ __forceinline__ void wgmma_m64n64k32_rs_fp8(float (&d)[32], const u32 (&a)[4], u64 desc_b,
                                                       int accumulate) {
#define MLA_WGMMA_64_RS_FP8(ATYPE)                                                                 \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                     \
                 "wgmma.mma_async.sync.aligned.m64n64k32.f32." ATYPE ".e4m3 {" MLA_D32 "}, "        \
                 "{%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"                                          \
                 : MLA_ACC32(d)                                                                    \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate))
    if (KV_FORMAT == 3) {
        MLA_WGMMA_64_RS_FP8("e5m2");
    } else {
        MLA_WGMMA_64_RS_FP8("e4m3");
    }
#undef MLA_WGMMA_64_RS_FP8
}

/// d[64 x 32] (f32, this thread's 16 values) += A[64 x 32] * B[32 x 32] on fp8 codes, both
/// K-major from shared memory: A in the cache's format (KV_FORMAT 2: e4m3, 3: e5m2), B e4m3.
/// The narrow kernel's fp8 scores (S^T = K Q^T, q's two e4m3 terms side by side in N).
/// `accumulate` 0 overwrites d.
template <int KV_FORMAT>
__device__ __forceinline__ void wgmma_m64n32k32_fp8(float (&d)[16], u64 desc_a, u64 desc_b, int accumulate) {
#define MLA_WGMMA_32_FP8(ATYPE)                                                                   \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"                                     \
                 "wgmma.mma_async.sync.aligned.m64n32k32.f32." ATYPE ".e4m3"                        \
                 " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "      \
                 "%16, %17, p, 1, 1;\n}\n"                                                          \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),        \
                   "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),      \
                   "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])                            \
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate))
    if (KV_FORMAT == 3) {
        MLA_WGMMA_32_FP8("e5m2");
    } else {
        MLA_WGMMA_32_FP8("e4m3");
    }
#undef MLA_WGMMA_32_FP8
}

/// d[64 x 16] (f32, this thread's 8 values) += A[64 x 32] * B[32 x 16] on fp8 codes, A from
/// this thread's registers (the 8-bit A fragment, as wgmma_m64n64k32_rs_fp8) in the cache's
/// format, B e4m3 K-major from shared memory. The narrow kernel's fp8 values (O^T = V^T P^T).
/// `a` must not change until the product is waited for; `accumulate` 0 overwrites d.
template <int KV_FORMAT>
__device__ __forceinline__ void wgmma_m64n16k32_rs_fp8(float (&d)[8], const u32 (&a)[4], u64 desc_b, int accumulate) {
#define MLA_WGMMA_16_RS_FP8(ATYPE)                                                                \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"                                     \
                 "wgmma.mma_async.sync.aligned.m64n16k32.f32." ATYPE ".e4m3"                        \
                 " {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1;\n}\n"       \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),        \
                   "+f"(d[6]), "+f"(d[7])                                                        \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate))
    if (KV_FORMAT == 3) {
        MLA_WGMMA_16_RS_FP8("e5m2");
    } else {
        MLA_WGMMA_16_RS_FP8("e4m3");
    }
#undef MLA_WGMMA_16_RS_FP8
}

/// d[64 x 256] (f32, this thread's 128 values) += A[64 x 16] * B[16 x 256], both from shared memory
/// through descriptors; B MN-major (transposed). `accumulate` 0 overwrites d.
template <bool BF16>
__device__ __forceinline__ void wgmma_m64n256k16_ss(float (&d)[128], u64 desc_a, u64 desc_b, int accumulate) {
#define MLA_WGMMA_256(TYPE)                                                                       \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"                                 \
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32." TYPE "." TYPE " {"                \
                 MLA_D128 "}, %128, %129, p, 1, 1, 0, 1;\n}\n"            \
                 : MLA_ACC128(d)                                                                  \
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate))
    if (BF16) {
        MLA_WGMMA_256("bf16");
    } else {
        MLA_WGMMA_256("f16");
    }
#undef MLA_WGMMA_256
}

/// d[64 x 256] (f32, this thread's 128 values) += A[64 x 16] * B[16 x 256], A from this thread's
/// registers `a` (wgmma's A fragment: a[0] row r0, a[1] row r0 + 8, keys 2 (lane % 4) + 0, 1;
/// a[2], a[3] the same rows 8 keys on: the m64n64 accumulator's pairs in order, packed), B MN-major
/// (transposed) from shared memory. `a` must not change until the product is waited for.
template <bool BF16>
__device__ __forceinline__ void wgmma_m64n256k16_rs(float (&d)[128], const u32 (&a)[4], u64 desc_b, int accumulate) {
#define MLA_WGMMA_256_RS(TYPE)                                                                    \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"                                 \
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32." TYPE "." TYPE " {"                \
                 MLA_D128 "}, {%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"                   \
                 : MLA_ACC128(d)                                                                  \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate))
    if (BF16) {
        MLA_WGMMA_256_RS("bf16");
    } else {
        MLA_WGMMA_256_RS("f16");
    }
#undef MLA_WGMMA_256_RS
}

/// d[64 x 64] (f32, this thread's 32 values) += A[64 x 16] * B[16 x 64] in f16, A from this
/// thread's registers `a` (wgmma's A fragment, as wgmma_m64n256k16_rs), B from shared memory,
/// K-major (TRANS_B 0) or MN-major (1). The products of decode_wgmma_fp8, whose A operands are
/// fp8 codes converted in registers. `a` must not change until the product is waited for.
template <int TRANS_B>
__device__ __forceinline__ void wgmma_m64n64k16_rs_f16(float (&d)[32], const u32 (&a)[4], u64 desc_b, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {" MLA_D32 "}, "
                 "{%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
                 : MLA_ACC32(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate), "n"(TRANS_B));
}

/// d[64 x N] (f32, this thread's N / 2 values) += A[64 x 16] * B[16 x N] for a narrow N (16
/// or 32), both from shared memory; B K-major; A K-major, or MN-major with TRANS_A. The
/// narrow kernel's products, whose 64 rows are keys (S^T = K Q^T) or latent columns
/// (O^T = V^T P^T). `accumulate` 0 overwrites d.
template <int N, bool BF16, int TRANS_A>
__device__ __forceinline__ void wgmma_m64nNk16_ss(float (&d)[N / 2], u64 desc_a, u64 desc_b, int accumulate) {
    static_assert(N == 16 || N == 32, "narrow wgmma: N = 16 or 32");
#define MLA_WGMMA_N16(TYPE)                                                                     \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"                                   \
                 "wgmma.mma_async.sync.aligned.m64n16k16.f32." TYPE "." TYPE                     \
                 " {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, %11, 0;\n}\n"             \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),       \
                   "+f"(d[6]), "+f"(d[7])                                                       \
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(TRANS_A))
#define MLA_WGMMA_N32(TYPE)                                                                     \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"                                   \
                 "wgmma.mma_async.sync.aligned.m64n32k16.f32." TYPE "." TYPE                     \
                 " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "     \
                 "%16, %17, p, 1, 1, %19, 0;\n}\n"                                               \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),       \
                   "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),     \
                   "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])                           \
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(TRANS_A))
    if constexpr (N == 16) {
        if (BF16) {
            MLA_WGMMA_N16("bf16");
        } else {
            MLA_WGMMA_N16("f16");
        }
    } else {
        if (BF16) {
            MLA_WGMMA_N32("bf16");
        } else {
            MLA_WGMMA_N32("f16");
        }
    }
#undef MLA_WGMMA_N16
#undef MLA_WGMMA_N32
}
