/**
 * @file decode_wgmma/kernel.cu
 * @brief Stage 1 of the split-KV decode on Hopper's warpgroup MMA (sm_90a): one CTA attends
 * 64 query rows (heads, or heads x query tokens of one request) to the keys of one split,
 * 64 keys a tile.
 *
 * Outputs are those of decode_mma (each row's split output and LSE to the workspace, or o
 * and lse with one split), so the plan, the workspace and the combine are shared. Grid: x =
 * (request * token_blocks + token_block) * head_blocks + head_block, y = split. A CTA takes
 * `tokens_per_cta` query tokens of its request: 1 (then its 64 rows are heads, and x is
 * decode_mma's row * head_blocks + head_block), or, for few heads, up to 64 / heads tokens
 * whose rows share one read of the keys (row r: token r / heads, head r % heads). Each row
 * keeps its own keys: the CTA loads the union of its tokens' split ranges and masks per row.
 * NOTES.md beside this file has the design and the measurements.
 *
 * Block: two warpgroups (256 threads). Shared memory holds q (64 x D), a ring of two key
 * tiles (64 x D each) and P (64 x 64), all in wgmma's 128-byte swizzled layout
 * (common/wgmma.cuh). Per tile t:
 *   1. wait for tile t's keys (cp.async); warpgroup 1 issues tile t + 1's into the other
 *      stage and reads the block ids of tile t + 2 (warpgroup 0 goes straight to step 2);
 *   2. warpgroup 0: S = Q K^T (64 x 64, 36 wgmma of k = 16), masked; row max, P =
 *      2^(S * scale - m) (base 2, the scale folded into one FMA) rounded to the model dtype
 *      into shared memory, the rescale factor of each row beside it (exactly 1 when the max
 *      did not move, and then the rescale is skipped); row sums of the unrounded P stay in
 *      its registers;
 *   3. both warpgroups: O = O * alpha + P V for their half of the L output columns
 *      (warpgroup w owns columns 256 w .. 256 w + 255: 64 x 256 f32, 128 registers a thread);
 *      V is the first L columns of the same key tile, read MN-major.
 *   4. At the end O / l and the LSE, as in decode_mma.
 * Caches not in the model dtype are converted after step 1, as decode_mma does: the other
 * 16-bit type in place, in the model dtype (bit-exact with the CPU backend); fp8 codes from
 * a raw row-major stage (half the bytes) as f16 into a swizzled tile of its own, the
 * products then in f16 with k_scale on the scores and the output, and a bf16 q rewritten as
 * f16 before the first tile (common/fp8.cuh, "Products in f16"); one more barrier a tile.
 *
 * Compile-time configuration (-D):
 *   MLA_L, MLA_R   latent and rotary widths (L = 512: two warpgroups of 256 columns;
 *                  (L + R) % 64 == 0)
 *   MLA_BF16       1: the model dtype is bf16, 0: f16
 *   MLA_KV         0: cache in the model dtype; 1: the other 16-bit type; 2: fp8 e4m3; 3: fp8 e5m2
 *   MLA_QFP8       1: the fp8-query mode (an fp8 cache): q and P as e4m3 codes (common/fp8.cuh);
 *                  the scores on fp8 wgmma (m64n64k32) from q's codes and the raw stage, both
 *                  in the 64-byte swizzle; each warpgroup converts the V columns of its P V
 *                  to f16, warpgroup 0 between its score wgmma (VHalf); in the packed and
 *                  scheduled variants warpgroup 1 converts all of V beside the scores
 *   MLA_PACK       1: the CTA's rows are `tokens_per_cta` tokens x heads, each masked to its own
 *                  keys; 0: one token's 64 heads (tokens_per_cta must be 1), whose keys are the
 *                  CTA's (fewer registers and no division in the q loader)
 *   MLA_SCHED      1 (unpacked only): the argument is a ScheduleParams, the grid (CTAs, head
 *                  blocks), and CTA (c, y) walks the pieces of its stretch of the schedule for
 *                  head block y (docs/scheduler.md; common/schedule.cuh) instead of computing
 *                  split blockIdx.y of job blockIdx.x; partials go to the pieces' slots
 */
#include "common/fp8.cuh"
#include "common/keys.cuh"
#include "common/ptx.cuh"
#include "common/rows.cuh"
#include "common/schedule.cuh"
#include "common/wgmma.cuh"
#include "params.cuh"

namespace {

constexpr bool BF16 = MLA_BF16 != 0;
constexpr int L = MLA_L;
constexpr int R = MLA_R;
constexpr int D = L + R;
constexpr int M = 64;           // heads per CTA: one wgmma row block
constexpr int BN = 64;          // keys per tile
constexpr int STAGES = 2;       // key tiles in the ring
constexpr int THREADS = 256;    // two warpgroups
constexpr int PIECES = D / 8;   // 16-byte pieces per row
constexpr int KV = MLA_KV;
constexpr bool CONVERT = KV != 0;
constexpr bool FP8 = KV >= 2;             // fp8 stages raw rows and converts into a tile of its own
// fp8 caches multiply in f16, k_scale applied to the scores and the output (common/fp8.cuh,
// "Products in f16"); a bf16 q is rewritten as f16 first, or in the fp8-query mode (QFP8) any
// q as its e4m3 codes, with P rounded to e4m3.
constexpr bool MMA_BF16 = BF16 && !FP8;
constexpr bool QFP8 = MLA_QFP8 != 0;
constexpr bool Q_TO_F16 = BF16 && FP8 && !QFP8;
// The fp8-query mode: each warpgroup converts the V columns its P V reads (VHalf), or
// warpgroup 1 all of V: the packed and scheduled variants, which have no registers left
// for it (they would spill).
constexpr bool V_OWN_HALF = !MLA_PACK && !MLA_SCHED;
constexpr bool PACK = MLA_PACK != 0;      // rows of several query tokens
constexpr int KV_ELEM = FP8 ? 1 : 2;      // bytes per cache element
constexpr int KEY_PIECES = D * KV_ELEM / 16;  // 16-byte pieces per cache row
// Keys a warp's copies read the offsets of before copying them (common/keys.cuh, copy_keys).
constexpr int KEYS_AHEAD = 4;
constexpr int TILE_BYTES = M * D * 2;     // a swizzled 16-bit tile of 64 rows (BN == M)
// q: 16-bit, or in the fp8-query mode its e4m3 codes (64-byte swizzle), which the scores
// multiply with the raw fp8 keys on fp8 wgmma; the 16-bit q lands in the converted tile first.
constexpr int Q_BYTES = QFP8 ? M * D : TILE_BYTES;
constexpr int STAGE_BYTES = FP8 ? BN * D : TILE_BYTES;
constexpr int KT_BYTES = FP8 ? TILE_BYTES : 0;
constexpr int P_BYTES = M * BN * 2;
constexpr int OFF_BYTES = STAGES * BN * 8;
constexpr int STAT_BYTES = 3 * M * 4;  // alpha, then the final row sums and maxima
constexpr int ALIGN = 1024;            // swizzle atoms must be 1024-byte aligned
constexpr float LN2 = 0.69314718055994530942f;
constexpr int COLS = L / 2;            // output columns per warpgroup

static_assert(L == 512, "two warpgroups of m64n256 cover L = 512");
static_assert(D % 64 == 0, "rows must be whole 64-column chunks");
static_assert(KV >= 0 && KV <= 3, "cache format code");
static_assert(!QFP8 || FP8, "the fp8-query mode needs an fp8 cache");
static_assert(!(MLA_SCHED && PACK), "the schedule's jobs are single tokens here");

struct Smem {
    unsigned char* base;  // 1024-byte aligned
    __device__ unsigned char* q() const { return base; }
    __device__ unsigned char* stage(int s) const { return base + Q_BYTES + s * STAGE_BYTES; }
    __device__ unsigned char* kt() const { return base + Q_BYTES + STAGES * STAGE_BYTES; }
    __device__ unsigned char* p() const { return kt() + KT_BYTES; }
    __device__ i64* offsets(int s) const { return (i64*)(p() + P_BYTES) + s * BN; }
    __device__ float* alpha() const { return (float*)(p() + P_BYTES + OFF_BYTES); }
    __device__ float* sums() const { return alpha() + M; }
    __device__ float* maxima() const { return alpha() + 2 * M; }
};

}  // namespace

/// Shared memory the kernel needs (the host checks it against its own count).
extern "C" __constant__ int mla_decode_smem_bytes =
    ALIGN + Q_BYTES + STAGES * STAGE_BYTES + KT_BYTES + P_BYTES + OFF_BYTES + STAT_BYTES;
static_assert(StagedRows<BF16, L>::bytes(M) <= Q_BYTES + STAGES * STAGE_BYTES + KT_BYTES,
              "the outputs' staging tile fits over q and the tiles");

namespace {

/// The CTA's rows (common/schedule.cuh): tokens x heads packed, or heads of one token.
using Rows = CtaRows<PACK, M>;

/// q of the tile's rows, swizzled; padding rows are zero. In the fp8-query mode into the
/// converted tile, free until the first tile, for quantize_q.
__device__ __forceinline__ void load_q(const DecodeParams& p, const Smem& sm, const Rows& rows) {
    copy_q<M, L, D, THREADS>(p, smem_addr(QFP8 ? sm.kt() : sm.q()), threadIdx.x, [&](int r, int& row, int& head) {
        row = rows.row(r);
        head = rows.head(r);
        return rows.real(r, p);
    });
}

/// A tile of keys into stage `s`: swizzled for 16-bit caches, row-major raw bytes for fp8
/// (64-byte swizzled in the fp8-query mode). By WARPS warps from `first_warp` on
/// (common/keys.cuh, copy_keys).
template <int WARPS>
__device__ __forceinline__ void load_tile(const DecodeParams& p, const Smem& sm, const i64* offsets, int s,
                                          int first_warp) {
    const u32 stage = smem_addr(sm.stage(s));
    copy_keys<BN, KEY_PIECES, WARPS, KEYS_AHEAD>(p, [offsets](int j) { return offsets[j]; }, first_warp, [stage](int j, int c) {
        return stage + (QFP8  ? swizzled64<BN>(j, c)
                        : FP8 ? j * (D * KV_ELEM) + c * 16
                              : swizzled<BN>(j, c));
    });
}

/// Group `c` of 8 elements (key c / GROUPS, column group g0 + c % GROUPS) of a staged tile,
/// as convert_tile converts it: fp8 codes as f16 (unscaled) from the raw stage (row-major,
/// or in the fp8-query mode 64-byte swizzled) into the swizzled tile `kt`, the other 16-bit
/// type in place, in the model dtype (decoded, rounded).
template <int GROUPS>
__device__ __forceinline__ void convert_group(const unsigned char* stage, unsigned char* kt, int c, int g0,
                                              float k_scale) {
    const int j = c / GROUPS, g = g0 + c % GROUPS;
    u32x4 out;
    if (QFP8) {
        out = fp8x8_to_f16<KV>(*(const u32x2*)(stage + swizzled64<BN>(j, g / 2) + (g % 2) * 8));
    } else if (FP8) {
        out = fp8x8_to_f16<KV>(*(const u32x2*)(stage + j * D + g * 8));
    } else {
        out = convert8<KV, BF16>(*(const u32x4*)(stage + swizzled<BN>(j, g)), k_scale);
    }
    *(u32x4*)(kt + swizzled<BN>(j, g)) = out;
}

/// A staged tile not in the model dtype into one the products read (convert_group), its
/// GROUPS column groups from `g0` on; returns that tile. NT threads call it, `t` the caller's
/// index among them. In the fp8-query mode the scores read the raw stage and each warpgroup
/// converts only the V columns its P V reads: warpgroup 1 here, beside the scores, and
/// warpgroup 0 a group at a time between its score wgmma (V_STEPS, in decode_piece).
template <int NT, int GROUPS = D / 8>
__device__ __forceinline__ unsigned char* convert_tile(const Smem& sm, int s, float k_scale, int t, int g0 = 0) {
    constexpr int STEPS = (BN * GROUPS + NT - 1) / NT;
    unsigned char* kt = FP8 ? sm.kt() : sm.stage(s);
#pragma unroll 2
    for (int i = 0; i < STEPS; ++i) {
        const int c = t + i * NT;
        if ((BN * GROUPS) % NT != 0 && c >= BN * GROUPS) break;
        convert_group<GROUPS>(sm.stage(s), kt, c, g0, k_scale);
    }
    return kt;
}

/// The fp8-query mode: warpgroup 0's half of V (columns 0 .. L / 2) to f16, a group of 8
/// elements after each of its score wgmma, so that the conversion runs while the tensor cores
/// take the scores. Thread t converts column group t % 32 of keys t / 32 + 4 i (step i <
/// V_STEPS); keys 8 apart share both swizzles, so two bases each (even and odd steps) plus
/// constant offsets address every step, and the shared accesses are volatile: no address or
/// load is hoisted ahead (the warpgroup's 128 output and 32 score registers leave about ten).
struct VHalf {
    static constexpr int GROUPS = L / 16;                       // groups of 8 a key in the half
    static constexpr int STEPS = BN * GROUPS / (THREADS / 2);   // groups a thread
    u32 src[2], dst[2];
    __device__ __forceinline__ VHalf(const Smem& sm, int st, int t) {
        const int g = t % GROUPS;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int j = t / GROUPS + e * (THREADS / 2 / GROUPS);
            src[e] = smem_addr(sm.stage(st)) + swizzled64<BN>(j, g / 2) + (g % 2) * 8;
            dst[e] = smem_addr(sm.kt()) + swizzled<BN>(j, g);
        }
    }
    /// Step i (a compile-time constant once unrolled).
    __device__ __forceinline__ void step(int i) const {
        const u32x2 codes = ld_shared_u32x2(src[i % 2] + (i / 2) * 8 * 64);
        st_shared_u32x4(dst[i % 2] + (i / 2) * 8 * 128, fp8x8_to_f16<KV>(codes));
    }
};
static_assert(!QFP8 || (THREADS / 2 / VHalf::GROUPS == 4 && BN * VHalf::GROUPS % (THREADS / 2) == 0),
              "VHalf: four keys a step, keys 8 apart two steps apart");

/// The fp8-query mode: the 16-bit q in the converted tile (load_q) as its e4m3 codes
/// e4m3(q / q_scale) into q's own 64-byte-swizzled tile, 8 elements a step. Every thread
/// calls it after q landed and a barrier; the first tile's barrier publishes the codes.
__device__ __forceinline__ void quantize_q(const Smem& sm, float q_scale) {
    const Divider by(q_scale);
    for (int c = threadIdx.x; c < M * PIECES; c += THREADS) {
        const int r = c / PIECES, k = c % PIECES;
        const u32x4 v = *(const u32x4*)(sm.kt() + swizzled<M>(r, k));
        *(u32x2*)(sm.q() + swizzled64<M>(r, k / 2) + (k % 2) * 8) = q_codes8<BF16>(v, by);
    }
}

/// Where P's pair (kk, i) of this thread lives in shared memory (common/wgmma.cuh).
__device__ __forceinline__ unsigned char* p_slot(const Smem& sm, int r0, int lane, int kk, int i) {
    return sm.p() + p_fragment_at(r0, lane, kk, i);
}

/// Step 2's softmax on this thread's 32 raw scores of a tile whose keys start at `first`:
/// unless the tile lies inside every row's keys (`inside`: only a split's first and last
/// tiles do not), keys outside the thread's row h's range [lo[h], hi[h]) are masked; the
/// running max m (base 2, scaled; the scale is positive, so the max of raw scores times the
/// scale is the max of the scaled ones) and the row sums l (of the unrounded P) updated,
/// alpha = 2^(m_old - m), exactly 1 when the max did not move. P = 2^(s * scale - m)
/// rounded to the model dtype goes to shared memory pair by pair as it is made. A packed row
/// with no key yet (m = -inf: its keys start later, or it is padding) gets P = 0.
/// s[4j + e]: row r0 + 8 (e / 2), key 8j + 2 (lane % 4) + e % 2.
template <bool MASKED>
__device__ __forceinline__ void softmax_tile_of(float (&s)[BN / 2], float (&m)[2], float (&l)[2], float (&alpha)[2],
                                                int first, const int (&lo)[2], const int (&hi)[2], float sc, int lane,
                                                const Smem& sm, int r0) {
    float mx[2] = {bits_to_float(0xff800000u), bits_to_float(0xff800000u)};
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int pos = first + 8 * j + 2 * (lane % 4) + (e & 1);
            const int h = e / 2;
            // Unpacked, no tile starts before the CTA's keys: only the end needs a mask.
            if (MASKED && ((PACK && pos < lo[h]) || pos >= hi[h])) s[4 * j + e] = bits_to_float(0xff800000u);
            mx[h] = fmaxf(mx[h], s[4 * j + e]);
        }
    }
    float base[2];  // the exponent's offset: m, or 0 while the row has no key (2^-inf = 0)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const float m_new = fmaxf(m[h], quad_max(mx[h]) * sc);
        alpha[h] = m_new == m[h] ? 1.0f : exp2_approx(m[h] - m_new);
        m[h] = m_new;
        l[h] *= alpha[h];
        // Unpacked, every row (padding rows too: their scores are 0) has a key in every tile.
        base[h] = PACK && m_new == bits_to_float(0xff800000u) ? 0.0f : m_new;
    }
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int h = i % 2;
            const float p0 = exp2_approx(fmaf(s[8 * kk + 2 * i], sc, -base[h]));
            const float p1 = exp2_approx(fmaf(s[8 * kk + 2 * i + 1], sc, -base[h]));
            l[h] += p0 + p1;
            *(u32*)p_slot(sm, r0, lane, kk, i) = pack_p<QFP8, MMA_BF16>(p0, p1);
        }
    }
}

/// softmax_tile_of, the masks only where the tile is not `inside` every row's keys (a uniform
/// branch: the masks' compares and selects on every tile cost more than the softmax needs).
__device__ __forceinline__ void softmax_tile(float (&s)[BN / 2], float (&m)[2], float (&l)[2], float (&alpha)[2],
                                             int first, bool inside, const int (&lo)[2], const int (&hi)[2],
                                             float sc, int lane, const Smem& sm, int r0) {
    if (inside) {
        softmax_tile_of<false>(s, m, l, alpha, first, lo, hi, sc, lane, sm, r0);
    } else {
        softmax_tile_of<true>(s, m, l, alpha, first, lo, hi, sc, lane, sm, r0);
    }
}

/// Step 3: O = O * alpha + P V for this warpgroup's columns (warpgroup w: 256 w ..). V is
/// the key tile at k_addr read MN-major: 64-column chunks (lbo) of 8-key groups (sbo); step
/// kk covers keys 16 kk .. 16 kk + 15. Returns when the products are done.
__device__ __forceinline__ void pv_step(float (&o)[COLS / 2], const Smem& sm, int r0, u32 p_addr, u32 k_addr,
                                        int wg) {
    const float a0 = sm.alpha()[r0], a1 = sm.alpha()[r0 + 8];
    if (__any_sync(0xffffffffu, a0 != 1.0f || a1 != 1.0f)) {  // most tiles keep the max
#pragma unroll
        for (int i = 0; i < COLS / 2; ++i) o[i] *= (i % 4) < 2 ? a0 : a1;
    }
    const u64 pd = opaque(smem_desc(p_addr, 16, 1024));
    const u64 vd = smem_desc(k_addr + (COLS / 64) * wg * (BN * 128), BN * 128, 1024);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
        wgmma_m64n256k16_ss<MMA_BF16>(o, desc_at(pd, kk * 32), desc_at(vd, kk * 2 * 1024), 1);
    }
    wgmma_commit();
    wgmma_wait<0>();
}

/// The CTA's shared memory, aligned for the swizzle atoms.
__device__ __forceinline__ Smem shared_layout() {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    return Smem{(unsigned char*)(((u64)smem_raw + ALIGN - 1) & ~(u64)(ALIGN - 1))};
}

/// One piece of work (common/schedule.cuh): on the split grid the CTA's whole split, in the
/// scheduled grid one of the pieces on its stretch.
__device__ __forceinline__ void decode_piece(const DecodeParams& p, const Smem& sm, const Piece& pc) {
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int wg = warp / 4;                          // warpgroup
    const int r0 = (warp % 4) * 16 + lane / 4;        // this thread's rows: r0 and r0 + 8
    const Rows rows(p, pc.job);
    const int req = rows.req;
    const int splits = pc.splits;

    const int len = request_len(p, req, tid == 0 && pc.split == 0);  // read once, for every row
    const TokensKeys cta = rows.keys(p, len, pc);
    const KeyRange keys = cta.keys;
    if (keys.start >= keys.end) {
        if (splits == 1 || !MLA_SCHED) rows.write_empty_piece<THREADS, L>(p, pc);  // a scheduled piece has keys
        return;
    }
    // This thread's rows' own keys (packed: empty for padding rows, so they stay at P = 0;
    // unpacked: the CTA's, for every row).
    int lo[2], hi[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = r0 + 8 * h;
        KeyRange k = keys;
        if (PACK) {
            k = rows.row_keys(p, len, pc, r);
        }
        lo[h] = k.start;
        hi[h] = k.end;
    }
    const int tiles = (keys.end - keys.start + BN - 1) / BN;
    [[maybe_unused]] const float k_scale = CONVERT ? read_k_scale(p, tid == 0 && pc.job == 0 && pc.split == 0) : 1.0f;

    // Offsets of tiles 0 and 1 now; tile t + 2's block ids are read during tile t.
    first_offsets<KV_ELEM, BN, STAGES>(p, req, keys, tid, [sm](int t) { return sm.offsets(t); });
    load_q(p, sm, rows);
    cp_async_commit();  // q in a group of its own: an fp8 decode rewrites it while tile 0 flies
    __syncthreads();
    load_tile<THREADS / 32>(p, sm, sm.offsets(0), 0, 0);
    cp_async_commit();
    // The scores' scale, base 2: fp8 takes k_scale here (and a bf16 q's power of two, or the
    // fp8-query mode's q_scale).
    float sc = p.scale_log2;
    if (FP8) sc *= k_scale;
    if (Q_TO_F16 || QFP8) {
        cp_async_wait_group<1>();  // q landed (tile 0 may fly on)
        __syncthreads();
        // The whole tile, padding rows (zeros) included; alpha is free until the first tile.
        if (QFP8) {
            const float q_scale = read_q_scale(p, tid == 0 && pc.job == 0 && pc.split == 0);
            quantize_q(sm, q_scale);
            sc *= q_scale;
        } else {
            sc *= q_to_f16<THREADS>(sm.q(), M * PIECES, [](int i) { return i * 16; }, (u32*)sm.alpha());
        }
    }

    float o[COLS / 2];  // this thread's share of the warpgroup's 64 x 256 outputs
#pragma unroll
    for (int i = 0; i < COLS / 2; ++i) o[i] = 0.0f;
    float m[2] = {bits_to_float(0xff800000u), bits_to_float(0xff800000u)};  // rows r0, r0 + 8
    float l[2] = {0.0f, 0.0f};  // warpgroup 0: this thread's share of the row sums

    const u32 q_addr = smem_addr(sm.q());
    const u32 p_addr = smem_addr(sm.p());

    for (int t = 0; t < tiles; ++t) {
        const int first = keys.start + t * BN;
        const int st = t % STAGES;
        // 1. Tile t (and q) landed for this thread; the fence hands them to the async proxy,
        //    the barrier to every thread. Everyone is also done with tile t - 1 and P.
        cp_async_wait_group<0>();
        fence_proxy_async();
        __syncthreads();
        // Warpgroup 1 waits through the scores anyway: it loads the next tile and reads the
        // block ids of the one after, so warpgroup 0 goes straight to the scores.
        if (t + 1 < tiles && wg == 1) {
            load_tile<4>(p, sm, sm.offsets((t + 1) % STAGES), (t + 1) % STAGES, 4);
        }
        cp_async_commit();
        const int lt = tid - THREADS / 2;  // warpgroup 1's thread index
        const int ahead = first + STAGES * BN + lt;
        const i64 next_block = lt >= 0 && lt < BN ? block_of(p, req, ahead, keys.end) : NO_KEY;
        u32 k_addr = smem_addr(sm.stage(st));
        if (QFP8) k_addr = smem_addr(sm.kt());
        if (CONVERT && !QFP8) {
            // Everyone finished tile t - 1's products (the barrier above), so the converted
            // tile is free; the fence hands the converted values to the async proxy.
            k_addr = smem_addr(convert_tile<THREADS>(sm, st, k_scale, tid));
            fence_proxy_async();
            __syncthreads();
        }
        if (QFP8 && wg == 1) {
            // The scores read the raw stage: V's columns of warpgroup 1 (all of V where
            // warpgroup 0 converts none) convert beside them, published for P V by the
            // barrier after the softmax.
            if (V_OWN_HALF) {
                convert_tile<THREADS / 2, L / 16>(sm, st, k_scale, lt, L / 16);
            } else {
                convert_tile<THREADS / 2, L / 8>(sm, st, k_scale, lt);
            }
            fence_proxy_async();
        }

        if (wg == 0) {
            // 2. S = Q K^T over D / 16 steps of k = 16: step ks reads 64-column chunk ks / 4
            //    at byte 32 * (ks % 4) of each 128-byte row.
            float s[BN / 2];
#pragma unroll
            for (int i = 0; i < BN / 2; ++i) s[i] = 0.0f;
            if (QFP8) {
                // fp8 wgmma over D / 32 steps of k = 32 on the codes (q's and the raw stage's,
                // both 64-byte swizzled): step ks reads 64-column chunk ks / 2 at byte
                // 32 * (ks % 2) of each 64-byte row.
                const u64 qd = opaque(smem_desc64(q_addr, 16, 512));
                const u64 kd = smem_desc64(smem_addr(sm.stage(st)), 16, 512);
                wgmma_fence();
                // While the tensor cores take the scores, this warpgroup's V columns to f16,
                // a group after each wgmma (they read neither; the barrier after the softmax
                // publishes them). Not a loop of its own: one between the wgmma and their
                // wait makes ptxas serialize them (C7519), and unrolled it spills.
                static_assert(VHalf::STEPS <= D / 32, "a group per wgmma");
                const VHalf v_half(sm, st, tid);
#pragma unroll
                for (int ks = 0; ks < D / 32; ++ks) {
                    const u32 at = (ks / 2) * (M * 64) + (ks % 2) * 32;
                    wgmma_m64n64k32_fp8<KV>(s, desc_at(qd, at), desc_at(kd, at), ks > 0);
                    if (V_OWN_HALF && ks < VHalf::STEPS) v_half.step(ks);
                }
                if (V_OWN_HALF) fence_proxy_async();
            } else {
                const u64 qd = opaque(smem_desc(q_addr, 16, 1024)), kd = smem_desc(k_addr, 16, 1024);
                wgmma_fence();
#pragma unroll
                for (int ks = 0; ks < D / 16; ++ks) {
                    const u32 at = (ks / 4) * (M * 128) + (ks % 4) * 32;
                    wgmma_m64n64k16_ss<MMA_BF16>(s, desc_at(qd, at), desc_at(kd, at), ks > 0);
                }
            }
            wgmma_commit();
            wgmma_wait<0>();

            float alpha[2];
            const bool inside = (!PACK || first >= cta.common.start) && first + BN <= cta.common.end;
            softmax_tile(s, m, l, alpha, first, inside, lo, hi, sc, lane, sm, r0);
            if (lane % 4 == 0) {
                sm.alpha()[r0] = alpha[0];
                sm.alpha()[r0 + 8] = alpha[1];
            }
            fence_proxy_async();  // P is read by wgmma next
        }
        __syncthreads();  // P and alpha of tile t are in shared memory

        pv_step(o, sm, r0, p_addr, k_addr, wg);
        // Tile t + 2's offsets go where tile t's were; the next iteration's barrier publishes them.
        if (lt >= 0 && lt < BN) sm.offsets(st)[lt] = key_offset<KV_ELEM>(p, ahead, next_block);
    }

    // 4. Row sums and the final max (warpgroup 0 holds them) to every thread, then O / l
    //    and the LSE.
    if (wg == 0) {
        l[0] = quad_sum(l[0]);
        l[1] = quad_sum(l[1]);
        if (lane % 4 == 0) {
            sm.sums()[r0] = l[0];
            sm.sums()[r0 + 8] = l[1];
            sm.maxima()[r0] = m[0];
            sm.maxima()[r0 + 8] = m[1];
        }
    }
    __syncthreads();
    // A packed row with no key in the split (sum 0, max -inf) gets o = 0 and lse = -inf:
    // with one split that is the contract's empty row; with more, the combine gives the split
    // no weight.
    // V's k_scale, for fp8 (in the fp8-query mode over P's factor)
    const float v_scale = FP8 ? (QFP8 ? k_scale * (1.0f / FP8_P_SCALE) : k_scale) : 1.0f;
    // The outputs through shared memory (q and the stages are free now: every warp is past
    // the barrier above, so done with its products), then whole rows out, each with its LSE.
    const StagedRows<BF16, L> out{smem_addr(sm.q()), splits > 1};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const float sum = sm.sums()[r0 + 8 * h];
        const float inv = sum > 0.0f ? v_scale / sum : 0.0f;
        out.put<COLS / 8>(r0 + 8 * h, [&](int j) { return wg * COLS + 2 * (lane % 4) + 8 * j; },
                          [&](int j, int e) { return o[4 * j + 2 * h + e] * inv; });
    }
    __syncthreads();
    out.store<M, THREADS>(p, tid, [&](int r, i64& at, int& row, int& head) {
        row = rows.row(r);
        head = rows.head(r);
        at = piece_at(p, pc, M, r, row, head);
        if (lane == 0 && rows.real(r, p)) {
            store_lse(p, at, row, head, (sm.maxima()[r] + log2_approx(sm.sums()[r])) * LN2);
        }
        return rows.real(r, p);
    });
}

}  // namespace

// One CTA per SM: the accumulators take 128 registers a thread and the tiles 226 KB.
#if MLA_SCHED
// Scheduled (grid: CTAs x head blocks): CTA (c, y) walks its stretch of the cost line for
// head block y, a piece per job it touches (common/schedule.cuh).
extern "C" __global__ void __launch_bounds__(THREADS, 1) mla_decode_wgmma(const ScheduleParams sp) {
    allow_dependent_launch();  // the combine may start launching (it waits for our writes)
    wait_for_previous_grid();  // the scheduler's integers (a programmatic dependent launch on sm_90)
    const Smem sm = shared_layout();
    walk_pieces(sp, (sp.d.heads + M - 1) / M, [&](const Piece& pc) { decode_piece(sp.d, sm, pc); });
}
#else
extern "C" __global__ void __launch_bounds__(THREADS, 1) mla_decode_wgmma(const DecodeParams p) {
    allow_dependent_launch();  // the combine may start launching (it waits for our writes)
    decode_piece(p, shared_layout(), grid_piece(p));
}
#endif

