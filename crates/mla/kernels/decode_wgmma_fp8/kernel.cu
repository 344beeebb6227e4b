/**
 * @file decode_wgmma_fp8/kernel.cu
 * @brief Stage 1 on Hopper's warpgroup MMA (sm_90a) for an fp8 cache: decode_wgmma's grid
 * and outputs (one query token's 64 heads a CTA, 64 keys a tile), with both products turned
 * around so that the raw fp8 codes reach the tensor cores from registers (converted there
 * under a 16-bit query, as loaded on fp8 wgmma in the fp8-query mode, MLA_QFP8) instead of
 * through a converted tile in shared memory:
 *
 *     S^T [64 keys x 64 heads] = K [64 x D] Q^T [D x 64]    A: the key codes, in registers
 *     O^T [L x 64 heads]      += V^T [L x 64] P^T [64 x 64]  A: the value codes, in registers
 *
 * wgmma takes only its A operand from registers, and A is what a thread can build from the
 * raw codes it loads; B (q, then P^T) comes from shared memory in the 128-byte swizzle (the
 * 64-byte one, K-major, in the fp8-query mode: quantize_q, softmax_of).
 * NOTES.md beside this file has the design and the measurements.
 *
 * Each product permutes an index its sums ignore, so that one load a lane feeds its
 * fragments (as decode_mma's fp8 products do):
 * - S^T's contracted columns, within each group of 64: k-step s of lane column c (lane % 4)
 *   takes columns 16 c + 4 s .. + 4, so a lane's 16-byte load of a key's 16 codes is its A
 *   fragment for the group's four k-steps; q is rewritten once in the same order (permute_q);
 * - O^T's rows (latent columns) within each warp's 64: m-tile i, fragment row g + 8 h of
 *   warp w is column 64 w + 8 g + 2 i + h of the warpgroup's 256, so a lane's 8-byte load of
 *   one key is its rows of all four m-tiles, and one prmt pairs two keys' bytes; the output
 *   goes back through the same map, 8 consecutive columns a head and thread (store_run8).
 *
 * Block: two warpgroups (256 threads), one CTA an SM. Shared memory: q (64 x D f16,
 * swizzled), P^T (64 keys x 64 heads f16, swizzled, MN-major; two in the fp8-query mode,
 * tile t's in buffer t % 2), a ring of STAGES raw tiles (64 keys x D codes, rows padded to
 * D + 16 bytes: the lanes of a quad then load from different banks), key offsets, the four
 * warps' column maxima and the rescale factors (two tiles' in the fp8-query mode), the
 * mbarriers (Smem). Under a 16-bit query, per tile t (`in_step`):
 *   1. every thread waits for its copies of tile t (cp.async), barrier; warpgroup 1 issues
 *      tile t + STAGES - 1 and reads the block ids of the tile after it;
 *   2. warpgroup 0: S^T (36 wgmma of k = 16, A converted a 64-column group at a time, two
 *      groups' registers alternating so that one converts while the other multiplies); the
 *      softmax per head (a column): mask past the split, the column max over the four warps
 *      through shared memory (an mbarrier), P^T = 2^(S scale - m) as f16 into shared
 *      memory, the rescale factors beside it; each thread keeps partial column sums;
 *   3. barrier; both warpgroups: O^T = O^T alpha + V^T P^T for their 256 latent columns
 *      (4 m-tiles of 64 x 64 f32, 128 registers a thread), A converted a k-step at a time.
 * In the fp8-query mode, whose products are short, warpgroup 1 runs a tile behind warpgroup
 * 0 with no CTA barrier in the tile loop (mbarriers hand over each buffer and stage):
 *   warpgroup 0 (`lead_tiles`), tile t: waits for the stage to land; S^T; the softmax (the
 *      column max as above), then, once warpgroup 1 is done with buffer t % 2 (tile t - 2),
 *      P^T and the rescale factors into it; its half of O^T (latent columns 0 .. 255);
 *   warpgroup 1 (`lag_tiles`), tile t: once P^T of tile t is ready, its half of O^T (latent
 *      columns 256 .. 511), beside warpgroup 0's half and its S^T of tile t + 1; then, once both are done with the stage, the copies of tile t + STAGES
 *      into it (cp.async, landing counted by the stage's mbarrier), their block ids read a
 *      tile before. 1.20x the in-step schedule in this mode; 3% to 10% slower under a
 *      16-bit query, whose conversions keep both warpgroups' issue slots busy (NOTES.md,
 *      "The lag schedule").
 * At the end, the sums over the warps, O / l and the LSE, to o and lse (one split) or the
 * split's workspace slot. k_scale (one scale for K and V) goes on the scores and the output;
 * a bf16 q is rewritten as f16 times a power of two (common/fp8.cuh, "Products in f16").
 *
 * Compile-time configuration (-D):
 *   MLA_L, MLA_R   latent and rotary widths (L = 512; (L + R) % 64 == 0)
 *   MLA_BF16       1: the model dtype is bf16, 0: f16
 *   MLA_KV         2: fp8 e4m3; 3: fp8 e5m2
 *   MLA_STAGES     raw tiles in the ring (at least 2)
 */
#include "common/fp8.cuh"
#include "common/keys.cuh"
#include "common/ptx.cuh"
#include "common/rows.cuh"
#include "common/schedule.cuh"
#include "common/tma.cuh"
#include "common/wgmma.cuh"
#include "params.cuh"

namespace {

constexpr bool BF16 = MLA_BF16 != 0;
constexpr bool QFP8 = MLA_QFP8 != 0;  // the fp8-query mode: both products on fp8 wgmma
constexpr int L = MLA_L;
constexpr int R = MLA_R;
constexpr int D = L + R;
constexpr int KV = MLA_KV;
constexpr int STAGES = MLA_STAGES;
constexpr int M = 64;            // heads per CTA
constexpr int BN = 64;           // keys per tile
constexpr int THREADS = 256;     // two warpgroups
constexpr int ROW = D + 16;      // bytes per staged key (codes, padded)
constexpr int KEY_PIECES = D / 16;
constexpr int GROUPS = D / 64;   // the scores' 64-column groups
constexpr int COLS = L / 2;      // latent columns per warpgroup
constexpr int MT = COLS / 64;    // m-tiles of O^T per warpgroup
constexpr float LN2 = 0.69314718055994530942f;

static_assert(L == 512, "two warpgroups of four 64-row m-tiles cover L = 512");
static_assert(D % 64 == 0, "rows must be whole 64-column groups");
static_assert(KV == 2 || KV == 3, "an fp8 cache");
static_assert(STAGES >= 2, "a ring of at least two tiles");

constexpr int Q_BYTES = M * D * 2;
constexpr int P_BYTES = BN * M * 2;
constexpr int STAGE_BYTES = BN * ROW;
constexpr int OFF_BYTES = STAGES * BN * 8;
constexpr int BUFS = QFP8 ? 2 : 1;       // P^T, column maxima and alpha buffers (tiles in flight)
constexpr int RED_BYTES = BUFS * 4 * M * 4;  // a float per warp of warpgroup 0 and head, a buffer
constexpr int STAT_BYTES = (BUFS + 1) * M * 4;  // alpha a buffer, then the final maxima
constexpr int BARS = QFP8 ? 6 + 2 * STAGES : 1;  // Smem's mbarriers
constexpr int BAR_BYTES = 8 * BARS;
constexpr int ALIGN = 1024;            // swizzle atoms must be 1024-byte aligned
static_assert(Q_BYTES % ALIGN == 0 && STAGE_BYTES % 16 == 0, "layout alignment");

struct Smem {
    unsigned char* base;  // 1024-byte aligned in the shared space (the swizzle atoms)
    u32 at;               // base's shared-space address
    /// The shared-space address of `x` (inside the layout). The lag schedule's as `at` plus
    /// its offset: its loops then keep one 32-bit base live, not a 64-bit generic one (64-bit
    /// sums, converted at each use), which cost the registers that spilled. The in-step
    /// loop's converted from the generic pointer, as before the lag schedule (with the sum
    /// its code moved and ran 1% slower).
    __device__ u32 addr(const void* x) const {
        return QFP8 ? at + (u32)((const unsigned char*)x - base) : smem_addr(x);
    }
    __device__ unsigned char* q() const { return base; }
    /// P^T of buffer b (tile t's in buffer t % BUFS).
    __device__ unsigned char* pt(int b) const { return base + Q_BYTES + b * P_BYTES; }
    __device__ unsigned char* stage(int s) const { return base + Q_BYTES + BUFS * P_BYTES + s * STAGE_BYTES; }
    __device__ i64* offsets(int s) const { return (i64*)stage(STAGES) + s * BN; }
    __device__ float* red(int b) const { return (float*)offsets(STAGES) + b * 4 * M; }
    __device__ float* alpha(int b) const { return red(BUFS) + b * M; }
    __device__ float* maxima() const { return alpha(BUFS); }
    // The mbarriers, a phase a tile of theirs (tile t: buffer b = t % BUFS, stage s = t %
    // STAGES), addressed from an opaque base: else the loops keep each one's address live.
    __device__ u32 bar(int i) const { return opaque_u32(addr(maxima() + M)) + 8 * i; }
    /// Warpgroup 0's column maxima of buffer b's tiles in red(b) (warpgroup 0's 128 arrivals).
    __device__ u32 maxima_ready(int b) const { return bar(b); }
    // The fp8-query mode's lag schedule only:
    /// P^T and alpha of buffer b written (warpgroup 0's 128 arrivals).
    __device__ u32 p_ready(int b) const { return bar(2 + b); }
    /// P^T and alpha of buffer b read by warpgroup 1 (its 128 arrivals).
    __device__ u32 p_free(int b) const { return bar(4 + b); }
    /// Stage s landed (warpgroup 1's 128 cp.async arrivals: it issues every copy).
    __device__ u32 landed(int s) const { return bar(6 + s); }
    /// Stage s read by everyone (256 arrivals).
    __device__ u32 stage_free(int s) const { return bar(6 + STAGES + s); }
};

}  // namespace

/// Shared memory the kernel needs (the host checks it against its own count).
extern "C" __constant__ int mla_decode_smem_bytes =
    ALIGN + Q_BYTES + BUFS * P_BYTES + STAGES * STAGE_BYTES + OFF_BYTES + RED_BYTES + STAT_BYTES + BAR_BYTES;

namespace {

/// A tile of keys into stage `s`, row-major raw codes (ROW bytes a key), by WARPS warps from
/// `first_warp` on (common/keys.cuh, copy_keys; offset(j) < 0 zero-fills key j).
template <int WARPS, typename Offset>
__device__ __forceinline__ void load_tile(const DecodeParams& p, const Smem& sm, Offset offset, int s, int first_warp) {
    const u32 stage = sm.addr(sm.stage(s));
    copy_keys<BN, KEY_PIECES, WARPS, 1>(p, offset, first_warp, [stage](int j, int c) { return stage + j * ROW + c * 16; });
}

/// The in-step loop's: key j's offset from the stage's tile of offsets.
__device__ __forceinline__ auto from_table(const i64* offsets) {
    return [offsets](int j) { return offsets[j]; };
}

/// The lag schedule's tile loads: by warpgroup 1, whose threads then arrive on the stage's
/// `landed` mbarrier as their copies land.
template <typename Offset>
__device__ __forceinline__ void load_tile_counted(const DecodeParams& p, const Smem& sm, Offset offset, int s) {
    load_tile<4>(p, sm, offset, s, 4);
    cp_async_arrive_on(sm.landed(s));
}

/// q (f16, swizzled) rewritten in the scores' column order: within each 64-column group,
/// logical column 16 s + 8 hi + 2 c + e holds column 16 c + 4 s + 2 hi + e (the A fragment
/// order of a 16-byte load, above). A thread a (row, group): its 8 pieces in, permuted in
/// registers, out in place. Every thread calls it; it ends with a barrier.
__device__ __forceinline__ void permute_q(const Smem& sm) {
    for (int task = threadIdx.x; task < M * GROUPS; task += THREADS) {
        const int r = task / GROUPS, grp = task % GROUPS;
        u32 in[32];  // pair (2 columns) 4 k + i of the group: piece k, word i
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const u32x4 v = *(const u32x4*)(sm.q() + swizzled<M>(r, 8 * grp + k));
            in[4 * k] = v.x;
            in[4 * k + 1] = v.y;
            in[4 * k + 2] = v.z;
            in[4 * k + 3] = v.w;
        }
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            // Logical piece k = 2 s + hi holds pairs 8 c + 2 s + hi for c = 0 .. 3.
            *(u32x4*)(sm.q() + swizzled<M>(r, 8 * grp + k)) = u32x4{in[k], in[8 + k], in[16 + k], in[24 + k]};
        }
    }
    fence_proxy_async();  // q is read by wgmma
    __syncthreads();
}

/// The fp8-query mode: q (16-bit, as it landed in q's swizzled tile) as its e4m3 codes
/// e4m3(q / q_scale) in the scores' column order, into the first M x D bytes of the same
/// region, 64-byte swizzled, a 64-column group a chunk (wgmma's K-major fp8 B). Within a
/// group, logical column 32 s + 16 t + 4 c + e holds column 16 c + 8 s + 4 t + e, so that
/// word 2 s + t of a lane's 16-byte load of a key is its A register t of k-step s (scores):
/// the group's word w (its columns 4 w .. 4 w + 3) goes to logical piece w % 4, word w / 4.
/// Every thread takes as many of q's 16-byte pieces (two words of codes each), all read
/// before a barrier (the codes overwrite what others read), then written. Every thread
/// calls it; it ends with a barrier.
__device__ __forceinline__ void quantize_q(const Smem& sm, float q_scale) {
    constexpr int PIECES = D / 8;  // 16-byte pieces of a row of 16-bit q
    constexpr int TASKS = M * PIECES / THREADS;
    static_assert(M * PIECES % THREADS == 0, "quantize_q: as many pieces a thread");
    const Divider by(q_scale);
    u32x2 codes[TASKS];
#pragma unroll
    for (int i = 0; i < TASKS; ++i) {
        const int piece = threadIdx.x + i * THREADS, r = piece / PIECES, k = piece % PIECES;
        codes[i] = q_codes8<BF16>(*(const u32x4*)(sm.q() + swizzled<M>(r, k)), by);
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < TASKS; ++i) {
        const int piece = threadIdx.x + i * THREADS, r = piece / PIECES, k = piece % PIECES;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int w = 2 * (k % 8) + e;  // the word within its group
            *(u32*)(sm.q() + swizzled64<M>(r, 4 * (k / 8) + w % 4) + 4 * (w / 4)) = e ? codes[i].y : codes[i].x;
        }
    }
    fence_proxy_async();  // q is read by wgmma
    __syncthreads();
}

/// Step 2's products: s = S^T for the tile staged at `keys` (byte address of this thread's
/// key 16 w + g at its column 16 c), B = q (descriptor `qd`). Group grp's A fragments: the
/// 16 codes of keys g and g + 8 at columns 64 grp + 16 c, four k-steps of four registers.
/// A commit group a k-step and two fragments alternating (a wait for the one before last
/// before each conversion): the conversion of step ks + 1 runs while step ks multiplies, in
/// the few registers that o, s and the softmax's state leave.
__device__ __forceinline__ void scores(float (&s)[32], u32 keys, u64 qd) {
    u32 a[2][4];
#pragma unroll
    for (int grp = 0; grp < GROUPS; ++grp) {
        const u32x4 kg = ld_shared_u32x4(keys + 64 * grp);
        const u32x4 kh = ld_shared_u32x4(keys + 8 * ROW + 64 * grp);
        const u32 wr[4] = {kg.x, kg.y, kg.z, kg.w}, wh[4] = {kh.x, kh.y, kh.z, kh.w};
        if (QFP8) {
            // The fp8-query mode: the codes are the A fragments as loaded (quantize_q's
            // order), two k-steps of 32 a group (q's chunk grp, 32 bytes a step).
#pragma unroll
            for (int st = 0; st < 2; ++st) {
                const int ks = 2 * grp + st;
                if (ks >= 2) wgmma_wait<1>();  // step ks - 2 is done with a[ks % 2]
                u32(&f)[4] = a[ks % 2];
                f[0] = wr[2 * st];      // row g, logical columns 4c .. 4c + 3 of the step
                f[1] = wh[2 * st];      // row g + 8
                f[2] = wr[2 * st + 1];  // row g, 16 columns on
                f[3] = wh[2 * st + 1];
                wgmma_fence();
                wgmma_m64n64k32_rs_fp8<KV>(s, f, desc_at(qd, grp * (M * 64) + st * 32), ks > 0);
                wgmma_commit();
            }
            continue;
        }
#pragma unroll
        for (int st = 0; st < 4; ++st) {
            const int ks = 4 * grp + st;
            if (ks >= 2) wgmma_wait<1>();  // step ks - 2 is done with a[ks % 2]
            const u32x2 x = fp8x4_to_f16<KV>(wr[st]), y = fp8x4_to_f16<KV>(wh[st]);
            u32(&f)[4] = a[ks % 2];
            f[0] = x.x;  // row g, logical columns 2c, 2c + 1
            f[1] = y.x;  // row g + 8
            f[2] = x.y;  // row g, 2c + 8, 2c + 9
            f[3] = y.y;
            wgmma_fence();
            wgmma_m64n64k16_rs_f16<0>(s, f, desc_at(qd, grp * (M * 128) + st * 32), ks > 0);
            wgmma_commit();
        }
    }
    wgmma_wait<0>();
}

/// Two keys' codes of m-tile i's rows g and g + 8 (bytes 2 i and 2 i + 1 of each key's 8-byte
/// load `a`, `b`): [a.2i, b.2i, a.2i+1, b.2i+1], one prmt.
__device__ __forceinline__ u32 pair_rows(u32x2 a, u32x2 b, int i) {
    const int j = (2 * i) % 4;
    const u32 sel = j | (4 + j) << 4 | (j + 1) << 8 | (5 + j) << 12;
    return __byte_perm(i < 2 ? a.x : a.y, i < 2 ? b.x : b.y, sel);
}

/// Step 3's products: o[i] += V^T P^T over the tile staged at `keys` (byte address of key 2c
/// at this thread's latent column 64 w + 8 g of the warpgroup's), B = P^T (descriptor `pd`,
/// MN-major). k-step kk: the 8 codes of keys 16 kk + 2c, + 1, + 8, + 9; bytes 2 i + h of a
/// key are row g + 8 h of m-tile i, and one prmt pairs two keys' bytes for both rows. A
/// commit group a product, fragments alternating, as in scores.
__device__ __forceinline__ void values(float (&o)[MT][32], u32 keys, u64 pd) {
    u32 a[2][4];
    if (QFP8) {
        // The fp8-query mode: k-steps of 32 keys in softmax_of's order (logical key 32 kk +
        // 2 m + e is key 32 kk + 16 (m / 8) + m % 8 + 8 e), so that this lane's A registers
        // h, h + 2 of step kk hold keys 32 kk + 16 h + 2c + {0, 8, 1, 9} (logical 16 h + 4c ..
        // + 3): byte 2 i + r (m-tile i, row g + 8 r) of each, paired by three prmt.
#pragma unroll
        for (int kk = 0; kk < BN / 32; ++kk) {
            u32x2 v[2][4];  // keys 32 kk + 16 h + 2c + {0, 8, 1, 9}
#pragma unroll
            for (int h = 0; h < 2; ++h) {
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    v[h][r] = ld_shared_u32x2(keys + (32 * kk + 16 * h + (r >> 1) + (r & 1) * 8) * ROW);
                }
            }
#pragma unroll
            for (int i = 0; i < MT; ++i) {
                const int n = MT * kk + i;
                if (n >= 2) wgmma_wait<1>();
                u32(&f)[4] = a[n % 2];
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const u32 t0 = pair_rows(v[h][0], v[h][1], i), t1 = pair_rows(v[h][2], v[h][3], i);
                    f[2 * h] = __byte_perm(t0, t1, 0x5410);      // row g: keys 0, 8, 1, 9
                    f[2 * h + 1] = __byte_perm(t0, t1, 0x7632);  // row g + 8
                }
                wgmma_fence();
                wgmma_m64n64k32_rs_fp8<KV>(o[i], f, desc_at(pd, kk * 32), 1);
                wgmma_commit();
            }
        }
        wgmma_wait<0>();
        return;
    }
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
        u32x2 v[4];  // keys 2c, 2c + 1, 2c + 8, 2c + 9 of the step
#pragma unroll
        for (int r = 0; r < 4; ++r) v[r] = ld_shared_u32x2(keys + (16 * kk + (r & 1) + (r >> 1) * 8) * ROW);
#pragma unroll
        for (int i = 0; i < MT; ++i) {
            const int n = MT * kk + i;
            if (n >= 2) wgmma_wait<1>();
            const u32x2 lo = fp8x4_to_f16<KV>(pair_rows(v[0], v[1], i));
            const u32x2 hi = fp8x4_to_f16<KV>(pair_rows(v[2], v[3], i));
            u32(&f)[4] = a[n % 2];
            f[0] = lo.x;  // row g, keys 2c, 2c + 1
            f[1] = lo.y;  // row g + 8
            f[2] = hi.x;  // row g, keys 2c + 8, 2c + 9
            f[3] = hi.y;
            wgmma_fence();
            wgmma_m64n64k16_rs_f16<1>(o[i], f, desc_at(pd, kk * 2048), 1);
            wgmma_commit();
        }
    }
    wgmma_wait<0>();
}

/// Step 2's first half on warpgroup 0's S^T (s[4 j + e]: key 16 w + g + 8 (e / 2) of the
/// tile, head 8 j + 2 c + e % 2): keys at or past `end` masked (only the last tile has any:
/// `inside` false), each head's (column's) max over this warp's 16 keys into red, for
/// `softmax_of` to take the max over the four warps after the hand-over.
template <bool MASKED>
__device__ __forceinline__ void column_max(float (&s)[32], int first, int end, u32 red_b, int w, int g, int c) {
    float cm[16];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            if (MASKED && first + 16 * w + g + 8 * (e / 2) >= end) s[4 * j + e] = bits_to_float(0xff800000u);
        }
#pragma unroll
        for (int b = 0; b < 2; ++b) cm[2 * j + b] = fmaxf(s[4 * j + b], s[4 * j + 2 + b]);
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        cm[i] = fmaxf(cm[i], __shfl_xor_sync(0xffffffffu, cm[i], 4));
        cm[i] = fmaxf(cm[i], __shfl_xor_sync(0xffffffffu, cm[i], 8));
        cm[i] = fmaxf(cm[i], __shfl_xor_sync(0xffffffffu, cm[i], 16));
    }
    // Shared memory through 32-bit addresses from bases the compiler cannot see through:
    // else it keeps a 64-bit generic address per access live across the tile loop (spills).
    const u32 red = opaque_u32(red_b) + 4 * (2 * c);  // head 2c; + 4 (M w + 8 j) below
    if (g == 0) {
#pragma unroll
        for (int j = 0; j < 8; ++j) st_shared_f32x2(red + 4 * (w * M + 8 * j), cm[2 * j], cm[2 * j + 1]);
    }
}

/// Step 2's first half on warpgroup 0: S^T of the tile staged at `stage` (`scores`, B = q
/// at descriptor `qd`) and each head's max over this warp's keys into `red` (`column_max`;
/// keys from `first` on, masked at `end` on a split's last tile).
__device__ __forceinline__ void scores_to_red(float (&s)[32], u32 stage, u64 qd, int first, int end, u32 red, int w,
                                              int g, int c) {
#pragma unroll
    for (int i = 0; i < 32; ++i) s[i] = 0.0f;
    scores(s, stage + (16 * w + g) * ROW + 16 * c, opaque(qd));
    if (first + BN <= end) {
        column_max<false>(s, first, end, red, w, g, c);
    } else {
        column_max<true>(s, first, end, red, w, g, c);
    }
}

/// Step 2's second half, after the hand-over that publishes `column_max`'s red (buffer b):
/// per head, the max over the four warps, the running max m (base 2, scaled) and this
/// thread's partial sums l (head 8 j + 2 c + b at index 2 j + b) rescaled, P^T into buffer
/// b and the rescale factors (exactly 1 when the max did not move) into alpha(b).
__device__ __forceinline__ void softmax_of(const float (&s)[32], float (&m)[16], float (&l)[16], float sc,
                                           const Smem& sm, int buf, int w, int g, int c) {
    const u32 red = opaque_u32(sm.addr(sm.red(buf))) + 4 * (2 * c);
    // The lag schedule stores the rescale factors as soon as they are known: kept to the end,
    // their 16 registers would be live beside s, m, l and o through P^T (the loop's peak).
    const u32 alpha_at = QFP8 ? opaque_u32(sm.addr(sm.alpha(buf))) + 4 * (2 * c) : 0;
    float alpha[16];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        f32x2 t = ld_shared_f32x2(red + 4 * 8 * j);
#pragma unroll
        for (int ww = 1; ww < 4; ++ww) {
            const f32x2 u = ld_shared_f32x2(red + 4 * (ww * M + 8 * j));
            t.x = fmaxf(t.x, u.x);
            t.y = fmaxf(t.y, u.y);
        }
#pragma unroll
        for (int b = 0; b < 2; ++b) {
            const int i = 2 * j + b;
            // Every tile holds a key of the CTA's (tiles start inside its range), so m is
            // finite from the first tile on.
            const float m_new = fmaxf(m[i], (b ? t.y : t.x) * sc);
            alpha[i] = m_new == m[i] ? 1.0f : exp2_approx(m[i] - m_new);
            m[i] = m_new;
            l[i] *= alpha[i];
        }
        if (QFP8 && w == 0 && g == 0) st_shared_f32x2(alpha_at + 4 * 8 * j, alpha[2 * j], alpha[2 * j + 1]);
    }
    if (QFP8) {
        // P^T as e4m3(P FP8_P_SCALE) codes, [head][key] (K-major, 64-byte swizzled), keys in
        // values' order: this thread's keys 16 w + g, + 8 are logical 16 w + 2 g, + 1. Head
        // 8 j + 2 c + b's piece w sits at swizzled64<M>(8 j + 2 c + b, w) = 512 j + 64 b +
        // 128 c + 16 (w ^ c) (its row's pair 4 j + c, c mod 4): one base, then immediates
        // (the compiler, not knowing c < 4, otherwise keeps the 16 offsets live across the loop).
        const u32 pt = opaque_u32(sm.addr(sm.pt(buf))) + 2 * g + 128 * c + 16 * (w ^ c);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
#pragma unroll
            for (int b = 0; b < 2; ++b) {
                const float p0 = exp2_approx(fmaf(s[4 * j + b], sc, -m[2 * j + b]));
                const float p1 = exp2_approx(fmaf(s[4 * j + 2 + b], sc, -m[2 * j + b]));
                l[2 * j + b] += p0 + p1;
                st_shared_u16(pt + 512 * j + 64 * b, e4m3x2_bits(p0 * FP8_P_SCALE, p1 * FP8_P_SCALE));
            }
        }
    } else {
        // P^T as f16, [key][head] (MN-major, 128-byte swizzled): heads 2 c, 2 c + 1 of key
        // 16 w + g + 8 h in one word.
        const u32 pt = opaque_u32(sm.addr(sm.pt(buf))) + 4 * c;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float p0 = exp2_approx(fmaf(s[4 * j + 2 * h], sc, -m[2 * j]));
                const float p1 = exp2_approx(fmaf(s[4 * j + 2 * h + 1], sc, -m[2 * j + 1]));
                l[2 * j] += p0;
                l[2 * j + 1] += p1;
                const int key = 16 * w + g + 8 * h;
                st_shared_u32(pt + swizzled<BN>(key, j), pack2<false>(p0, p1));
            }
        }
    }
    if (!QFP8 && w == 0 && g == 0) {
#pragma unroll
        for (int j = 0; j < 8; ++j) st_shared_f32x2(red + 4 * (4 * M + 8 * j), alpha[2 * j], alpha[2 * j + 1]);
    }
    fence_proxy_async();  // P^T is read by wgmma next
}

/// O^T *= alpha of buffer b, skipped when no max of the warp's heads moved (most tiles).
__device__ __forceinline__ void rescale(float (&o)[MT][32], const Smem& sm, int b, int c) {
    const u32 alpha_at = opaque_u32(sm.addr(sm.alpha(b))) + 4 * (2 * c);  // heads 8 j + 2 c, 4 bytes a float
    float al[16];  // heads 8 j + 2 c + e at index 2 j + e
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const f32x2 a = ld_shared_f32x2(alpha_at + 4 * 8 * j);
        al[2 * j] = a.x;
        al[2 * j + 1] = a.y;
    }
    bool moved = false;
#pragma unroll
    for (int i = 0; i < 16; ++i) moved |= al[i] != 1.0f;
    if (__any_sync(0xffffffffu, moved)) {  // most tiles keep every max
#pragma unroll
        for (int i = 0; i < MT; ++i) {
#pragma unroll
            for (int k = 0; k < 32; ++k) o[i][k] *= al[2 * (k / 4) + k % 2];
        }
    }
}

/// The B descriptor of P^T in buffer b for `values`.
__device__ __forceinline__ u64 pt_desc(const Smem& sm, int b) {
    const u32 at = sm.addr(sm.pt(b));
    return opaque(QFP8 ? smem_desc64(at, 16, 512) : smem_desc(at, BN * 128, 1024));
}

/// The tiles under a 16-bit query, both warpgroups in step (the header's steps 1 to 3): a CTA
/// barrier hands each landed tile to everyone, another P^T and alpha to both warpgroups.
__device__ __forceinline__ void in_step_tiles(const DecodeParams& p, const Smem& sm, int req, const KeyRange& keys,
                                              int tiles, float sc, float (&o)[MT][32], float (&m)[16],
                                              float (&l)[16]) {
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int wg = warp / 4, w = warp % 4;  // warpgroup, warp within it
    const int g = lane / 4, c = lane % 4;
    const u64 qd = smem_desc(smem_addr(sm.q()), 16, 1024);
    const u32 pt_addr = smem_addr(sm.pt(0));  // hoisted, as before the lag schedule (pt_desc in the loop moves the code)

    for (int t = 0; t < tiles; ++t) {
        const int first = keys.start + t * BN;
        const int st = t % STAGES;
        // 1. Tile t landed for this thread; the barrier hands it to every thread. Everyone is
        //    also done with tile t - 1 (its stage is free) and P^T.
        cp_async_wait_group<STAGES - 2>();
        __syncthreads();
        const int lt = tid - THREADS / 2;  // warpgroup 1's thread index
        const bool reads_ahead = lt >= 0 && lt < BN;  // a key of tile t + STAGES's each
        const int ahead = first + STAGES * BN + lt;
        if (wg == 1 && t + STAGES - 1 < tiles) {
            load_tile<4>(p, sm, from_table(sm.offsets((t + STAGES - 1) % STAGES)), (t + STAGES - 1) % STAGES, 4);
        }
        cp_async_commit();
        const u32 stage = smem_addr(sm.stage(st));

        const i64 next_block = reads_ahead ? block_of(p, req, ahead, keys.end) : NO_KEY;
        if (wg == 0) {
            // 2. S^T and the softmax, whose column max crosses the four warps through shared
            //    memory and an mbarrier of warpgroup 0 (a named barrier there runs as fast,
            //    but compute-sanitizer's racecheck then reports hazards across the CTA
            //    barriers, and a CTA barrier costs 8%: NOTES.md, "racecheck").
            float s[32];
            scores_to_red(s, stage, qd, first, keys.end, sm.addr(sm.red(0)), w, g, c);
            mbar_arrive(sm.maxima_ready(0));
            mbar_wait(sm.maxima_ready(0), t & 1);
            softmax_of(s, m, l, sc, sm, 0, w, g, c);
        }
        __syncthreads();  // P^T and alpha of tile t are in shared memory

        // 3. O^T = O^T alpha + V^T P^T.
        rescale(o, sm, 0, c);
        values(o, stage + 2 * c * ROW + wg * COLS + 64 * w + 8 * g, opaque(smem_desc(pt_addr, BN * 128, 1024)));
        // Tile t + STAGES's offsets go where tile t's were (issued STAGES - 1 tiles ago); the
        // next iteration's barrier publishes them.
        if (reads_ahead) sm.offsets(st)[lt] = key_offset<1>(p, ahead, next_block);
    }
}

/// The fp8-query mode's warpgroup 0 (the header's lag schedule): S^T, the softmax (P^T into
/// buffer t % 2) and its half of V^T P^T (latent columns 0 .. COLS - 1), a tile ahead of
/// warpgroup 1.
__device__ __forceinline__ void lead_tiles(const DecodeParams& p, const Smem& sm, const KeyRange& keys, int tiles,
                                           float sc, float (&o)[MT][32], float (&m)[16], float (&l)[16], int w,
                                           int g, int c) {
    const u64 qd = smem_desc64(sm.addr(sm.q()), 16, 512);
    for (int t = 0; t < tiles; ++t) {
        const int first = keys.start + t * BN;
        const int st = t % STAGES, b = t % 2;
        const u32 stage = opaque_u32(sm.addr(sm.stage(0))) + st * STAGE_BYTES;
        mbar_wait(sm.landed(st), (t / STAGES) & 1);
        // S^T and the softmax, whose column max crosses the four warps through shared memory
        // and an mbarrier (a named barrier runs as fast, but compute-sanitizer's racecheck
        // then reports false hazards: NOTES.md, "racecheck").
        float s[32];
        scores_to_red(s, stage, qd, first, keys.end, sm.addr(sm.red(b)), w, g, c);
        mbar_arrive(sm.maxima_ready(b));  // also tells warpgroup 1 that S^T of tile t is done
        mbar_wait(sm.maxima_ready(b), (t / 2) & 1);
        if (t >= 2) mbar_wait(sm.p_free(b), (t / 2 - 1) & 1);  // warpgroup 1 is done with tile t - 2
        softmax_of(s, m, l, sc, sm, b, w, g, c);
        mbar_arrive(sm.p_ready(b));
        mbar_wait(sm.p_ready(b), (t / 2) & 1);  // every warp's P^T, for this warpgroup's product too
        rescale(o, sm, b, c);
        values(o, stage + 2 * c * ROW + 64 * w + 8 * g, pt_desc(sm, b));
        mbar_arrive(sm.stage_free(st));
    }
}

/// The fp8-query mode's warpgroup 1: its half of V^T P^T (latent columns COLS .. L - 1) of
/// tile t once P^T of tile t is ready, then the copies of tile t + STAGES into the stage
/// tile t leaves. The block ids of that tile's keys are read at the top of the iteration
/// (register `next_block`: lanes l and l + 16 of warp w both hold key w + 4 (l % 16)), a tile
/// before they are needed.
__device__ __forceinline__ void lag_tiles(const DecodeParams& p, const Smem& sm, int req, const KeyRange& keys,
                                          int tiles, float (&o)[MT][32], int w, int g, int c) {
    const int lane = threadIdx.x % 32;
    for (int t = 0; t < tiles; ++t) {
        const int st = t % STAGES, b = t % 2;
        const bool refill = t + STAGES < tiles;
        const int ahead = keys.start + (t + STAGES) * BN + w + 4 * (lane % 16);
        const i64 next_block = refill ? block_of(p, req, ahead, keys.end) : NO_KEY;
        mbar_wait(sm.p_ready(b), (t / 2) & 1);
        mbar_wait(sm.landed(st), (t / STAGES) & 1);  // the codes other threads copied
        rescale(o, sm, b, c);
        values(o, opaque_u32(sm.addr(sm.stage(0))) + st * STAGE_BYTES + 2 * c * ROW + COLS + 64 * w + 8 * g,
               pt_desc(sm, b));
        mbar_arrive(sm.p_free(b));
        mbar_arrive(sm.stage_free(st));
        if (refill) {
            const i64 off = key_offset<1>(p, ahead, next_block);
            mbar_wait(sm.stage_free(st), (t / STAGES) & 1);  // warpgroup 0 is done with it too
            load_tile_counted(p, sm, [off](int j) { return __shfl_sync(0xffffffffu, off, j / 4); }, st);
        }
    }
}

/// The CTA's shared memory, aligned for the swizzle atoms (their shared-space addresses: the
/// padding is counted there, from the buffer's own shared address).
__device__ __forceinline__ Smem shared_layout() {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    if (!QFP8) return Smem{(unsigned char*)(((u64)smem_raw + ALIGN - 1) & ~(u64)(ALIGN - 1)), 0};  // `at` unused
    const u32 raw = (u32)__cvta_generic_to_shared(smem_raw);
    const u32 pad = ((raw + ALIGN - 1) & ~(u32)(ALIGN - 1)) - raw;
    return Smem{smem_raw + pad, raw + pad};
}

__device__ __forceinline__ void decode_piece(const DecodeParams& p, const Smem& sm, const Piece& pc) {
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int wg = warp / 4, w = warp % 4;  // warpgroup, warp within it
    const int g = lane / 4, c = lane % 4;
    const int head_blocks = (p.heads + M - 1) / M;
    const int req = pc.job / (head_blocks * p.query_len);
    const int tok = (pc.job / head_blocks) % p.query_len;
    const int row = req * p.query_len + tok;
    const int head0 = (pc.job % head_blocks) * M;

    const int len = request_len(p, req, tid == 0 && pc.split == 0);
    const KeyRange keys = piece_keys(token_keys(p, len, tok), pc);
    if (keys.start >= keys.end) {
        if (pc.splits == 1) {
            write_empty<M, THREADS, L>(p, row, head0);
        } else {  // stage 2 gives the split no weight
            write_empty_split_heads<M, THREADS>(p, pc, row, head0);
        }
        return;
    }
    const int tiles = (keys.end - keys.start + BN - 1) / BN;
    const float k_scale = read_k_scale(p, tid == 0 && pc.job == 0 && pc.split == 0);

    // Offsets of the ring's first tiles now; tile t + STAGES's block ids are read during tile t.
    first_offsets<1, BN, STAGES>(p, req, keys, tid, [sm](int t) { return sm.offsets(t); });
    copy_q<M, L, D, THREADS>(p, smem_addr(sm.q()), tid, [&](int r, int& qrow, int& head) {
        qrow = row;
        head = head0 + r;
        return head < p.heads;
    });
    cp_async_commit();
    if (tid == 0) {
        for (int b = 0; b < BUFS; ++b) mbar_init(sm.maxima_ready(b), THREADS / 2);
        if (QFP8) {
            for (int b = 0; b < 2; ++b) {
                mbar_init(sm.p_ready(b), THREADS / 2);
                mbar_init(sm.p_free(b), THREADS / 2);
            }
            for (int s = 0; s < STAGES; ++s) {
                mbar_init(sm.landed(s), THREADS / 2);
                mbar_init(sm.stage_free(s), THREADS);
            }
        }
        mbar_fence_init();
    }
    __syncthreads();  // the offsets, the mbarriers
    if (QFP8) {  // the lag schedule: warpgroup 1 issues every tile, the whole ring now
        if (wg == 1) {
            for (int t = 0; t < STAGES && t < tiles; ++t) load_tile_counted(p, sm, from_table(sm.offsets(t)), t);
        }
        cp_async_commit();
    } else {
#pragma unroll
        for (int t = 0; t < STAGES - 1; ++t) {
            if (t < tiles) load_tile<THREADS / 32>(p, sm, from_table(sm.offsets(t)), t, 0);
            cp_async_commit();
        }
    }
    float sc = p.scale_log2 * k_scale;
    cp_async_wait_group<QFP8 ? 1 : STAGES - 1>();  // q landed (the first tiles may fly on)
    __syncthreads();
    if (QFP8) {
        const float q_scale = read_q_scale(p, tid == 0 && pc.job == 0 && pc.split == 0);
        quantize_q(sm, q_scale);
        sc *= q_scale;
    } else {
        if (BF16) sc *= q_to_f16<THREADS>(sm.q(), M * (D / 8), [](int i) { return i * 16; }, (u32*)sm.alpha(0));
        permute_q(sm);
    }

    float o[MT][32];
#pragma unroll
    for (int i = 0; i < MT; ++i) {
#pragma unroll
        for (int k = 0; k < 32; ++k) o[i][k] = 0.0f;
    }
    float m[16], l[16];  // warpgroup 0: heads 8 j + 2 c + b (index 2 j + b)
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        m[i] = bits_to_float(0xff800000u);
        l[i] = 0.0f;
    }
    if (!QFP8) {
        in_step_tiles(p, sm, req, keys, tiles, sc, o, m, l);
    } else if (wg == 0) {
        lead_tiles(p, sm, keys, tiles, sc, o, m, l, w, g, c);
    } else {
        lag_tiles(p, sm, req, keys, tiles, o, w, g, c);
    }

    // 4. The column sums over the lanes of a column (same c) and the four warps, the final
    //    maxima beside them; then O / l and the LSE.
    if (wg == 0) {
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            l[i] += __shfl_xor_sync(0xffffffffu, l[i], 4);
            l[i] += __shfl_xor_sync(0xffffffffu, l[i], 8);
            l[i] += __shfl_xor_sync(0xffffffffu, l[i], 16);
        }
        if (g == 0) {
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                *(f32x2*)(sm.red(0) + w * M + 8 * j + 2 * c) = f32x2{l[2 * j], l[2 * j + 1]};
                if (w == 0) *(f32x2*)(sm.maxima() + 8 * j + 2 * c) = f32x2{m[2 * j], m[2 * j + 1]};
            }
        }
    }
    __syncthreads();
    const int col0 = wg * COLS + 64 * w + 8 * g;
    const float v_scale = QFP8 ? k_scale * (1.0f / FP8_P_SCALE) : k_scale;  // the fp8-query mode's P carries FP8_P_SCALE
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int b = 0; b < 2; ++b) {
            const int r = 8 * j + 2 * c + b, head = head0 + r;
            if (head >= p.heads) continue;
            const float* red = sm.red(0);
            const float sum = red[r] + red[M + r] + red[2 * M + r] + red[3 * M + r];
            const float inv = sum > 0.0f ? v_scale / sum : 0.0f;
            float v[8];
#pragma unroll
            for (int i = 0; i < MT; ++i) {
                v[2 * i] = o[i][4 * j + b] * inv;
                v[2 * i + 1] = o[i][4 * j + 2 + b] * inv;
            }
            const i64 at = piece_at(p, pc, M, r, row, head);
            store_run8<BF16, L>(p, at, row, head, col0, v);
            if (wg == 0 && w == 0 && g == 0) {
                store_lse(p, at, row, head, (sm.maxima()[r] + log2_approx(sum)) * LN2);
            }
        }
    }
}

}  // namespace

// One CTA per SM: the accumulators take 128 registers a thread.
extern "C" __global__ void __launch_bounds__(THREADS, 1) mla_decode_wgmma_fp8(const DecodeParams p) {
    allow_dependent_launch();  // the combine may start launching (it waits for our writes)
    decode_piece(p, shared_layout(), grid_piece(p));
}
