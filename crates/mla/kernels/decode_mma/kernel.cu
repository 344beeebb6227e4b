/**
 * @file decode_mma/kernel.cu
 * @brief Stage 1 of the split-KV decode on tensor cores with mma.sync (sm_80 and up): one CTA
 * attends ROWS heads of one query row to the keys of one split.
 *
 * Grid: x = row * head_blocks + head_block (head blocks of a row side by side, so the CTAs
 * that read the same keys run together and share them in L2), y = split.
 * Block: 4 * MW warps. Warp (rg, wc): row group rg (16 heads), quarter wc. In the score
 * phase a warp owns BN / 4 keys of the tile; in the value phase it owns L / 4 output columns.
 * The schedule, numbered as in NOTES.md:
 *   1. q of the CTA's heads -> shared memory, once (cp.async);
 *   2. keys -> shared memory (cp.async) STAGES - 1 tiles ahead of the tile being computed,
 *      from byte offsets computed a tile earlier (tile t + STAGES's block ids are read during
 *      tile t, so no load waits on the block table);
 *   3. (caches not in the model dtype) staged tile -> a tile the products read: fp8 codes
 *      as f16 into a tile of its own (the products then run in f16, k_scale on the scores
 *      and the output; a bf16 q is rewritten as f16 after step 1, common/fp8.cuh), the other
 *      16-bit type in the model dtype in place;
 *   4. S = Q K^T for the warp's keys (four independent accumulator chains), scaled to base 2,
 *      masked past the split's end;
 *   5. tile row max across the 4 warps of a row group (shared memory), running max m,
 *      P = 2^(S - m) rounded to the model dtype (the fp8-query mode: e4m3) -> shared
 *      memory, row sums of unrounded P;
 *   6. O = O * 2^(m_old - m) + P V for the warp's columns (V = the tile's first L columns);
 *   7. O / l and the LSE -> the split's workspace slot, or straight to o and lse when the
 *      decode has a single split.
 *
 * Compile-time configuration (-D, chosen by the host plan):
 *   MLA_L, MLA_R   latent and rotary widths (L % 64 == 0, R % 16 == 0)
 *   MLA_BF16       1: the model dtype is bf16, 0: f16
 *   MLA_KV         0: cache in the model dtype; 1: the other 16-bit type; 2: fp8 e4m3; 3: fp8 e5m2
 *   MLA_QFP8       1: the fp8-query mode (an fp8 cache): q and P as e4m3 codes (common/fp8.cuh)
 *   MLA_MW         row groups per CTA: ROWS = 16 * MW heads
 *   MLA_BN         keys per tile (a multiple of 32)
 *   MLA_STAGES     tiles in the shared-memory ring (2 or more): STAGES - 1 tiles in flight
 *   MLA_SCHED      1: the argument is a ScheduleParams, the grid (CTAs, head blocks), and
 *                  CTA (c, y) walks the pieces of its stretch of the schedule for head block
 *                  y (docs/scheduler.md; common/schedule.cuh) instead of computing split
 *                  blockIdx.y of row x head block blockIdx.x; partials go to the pieces' slots
 */
#include "common/fp8.cuh"
#include "common/keys.cuh"
#include "common/ptx.cuh"
#include "common/rows.cuh"
#include "common/schedule.cuh"
#include "params.cuh"

namespace {

constexpr bool BF16 = MLA_BF16 != 0;
constexpr int KV = MLA_KV;
constexpr int L = MLA_L;
constexpr int R = MLA_R;
constexpr int D = L + R;
constexpr int MW = MLA_MW;
constexpr int ROWS = 16 * MW;
constexpr int BN = MLA_BN;
constexpr int STAGES = MLA_STAGES;
constexpr int NW = 4;                       // warps per row group
constexpr int THREADS = 32 * NW * MW;
constexpr int DP = D + 8;                   // padded shared row: 8 rows hit 8 distinct 16-byte bank groups
constexpr int BNP = BN + 8;                 // padded P row, for the same reason
constexpr int KEYS_W = BN / NW;             // keys per warp in the score phase
constexpr int NT_S = KEYS_W / 8;            // score n-tiles per warp
constexpr int COLS_W = L / NW;              // output columns per warp
constexpr int NT_O = COLS_W / 8;            // output n-tiles per warp
constexpr bool CONVERT = KV != 0;
constexpr bool FP8 = KV >= 2;               // fp8 converts into a tile of its own; 16-bit in place
// fp8 caches multiply in f16, k_scale applied to the scores and the output (common/fp8.cuh,
// "Products in f16"); a bf16 q is rewritten as f16 first, or in the fp8-query mode (QFP8) any
// q as its e4m3 codes, with P rounded to e4m3.
constexpr bool MMA_BF16 = BF16 && !FP8;
constexpr bool QFP8 = MLA_QFP8 != 0;
constexpr bool Q_TO_F16 = BF16 && FP8 && !QFP8;
constexpr int KV_ELEM = FP8 ? 1 : 2;        // bytes per cache element
constexpr int CHUNKS = D * KV_ELEM / 16;    // 16-byte chunks per cache row
constexpr int STAGE_ROW = FP8 ? D : DP * 2; // bytes per staged key row
constexpr int STAGE_BYTES = BN * STAGE_ROW;
constexpr int Q_BYTES = ROWS * DP * 2;
constexpr int KT_BYTES = FP8 ? BN * DP * 2 : 0;             // the converted fp8 tile
constexpr int P_BYTES = ROWS * BNP * 2;
constexpr int RED_BYTES = MW * NW * 16 * 4;
constexpr int OFF_BYTES = STAGES * BN * 8;   // byte offsets of STAGES tiles' keys (-1: not read)
constexpr int S_CHAINS = 4;                  // independent accumulators in the score phase
constexpr float LN2 = 0.69314718055994530942f;

static_assert(L % 64 == 0 && R % 16 == 0, "L must be a multiple of 64 and R of 16");
static_assert(BN % 32 == 0, "BN must be a multiple of 32");
static_assert(STAGES >= 2, "at least two stages");
static_assert((D * KV_ELEM) % 16 == 0, "cache rows must be whole 16-byte chunks");
static_assert(!QFP8 || FP8, "the fp8-query mode needs an fp8 cache");

struct Smem {
    unsigned char* base;
    __device__ u16* q() const { return (u16*)base; }
    __device__ unsigned char* stage(int s) const { return base + Q_BYTES + s * STAGE_BYTES; }
    __device__ u16* kt() const { return (u16*)(base + Q_BYTES + STAGES * STAGE_BYTES); }
    __device__ u16* p() const { return (u16*)(base + Q_BYTES + STAGES * STAGE_BYTES + KT_BYTES); }
    __device__ float* red() const {
        return (float*)(base + Q_BYTES + STAGES * STAGE_BYTES + KT_BYTES + P_BYTES);
    }
    __device__ i64* offsets(int s) const {
        return (i64*)(base + Q_BYTES + STAGES * STAGE_BYTES + KT_BYTES + P_BYTES + RED_BYTES) + s * BN;
    }
};

}  // namespace

/// Shared memory the kernel needs, read by the host through the symbol below.
extern "C" __constant__ int mla_decode_smem_bytes =
    Q_BYTES + STAGES * STAGE_BYTES + KT_BYTES + P_BYTES + RED_BYTES + OFF_BYTES;

namespace {

/// Step 1: the CTA's q rows (heads head0 .. head0 + ROWS) into shared memory; missing heads are 0.
__device__ __forceinline__ void load_q(const DecodeParams& p, const Smem& sm, int row, int head0) {
    constexpr int QCH = D / 8;  // 16-byte chunks per q row
    for (int c = threadIdx.x; c < ROWS * QCH; c += THREADS) {
        const int r = c / QCH, k = c % QCH;
        const int head = head0 + r;
        const bool valid = head < p.heads;
        const u16* src = q_piece<L>(p, row, head, k);
        cp_async16(smem_addr(sm.q() + r * DP + k * 8), valid ? (const void*)src : p.q_nope, valid);
    }
}

/// Step 2c: a tile of keys into stage `s`, from the offsets computed a tile earlier. Warp w
/// takes keys w, w + WARPS, ...; lane l the key's 16-byte chunks l, l + 32, ... Every trip
/// count is a compile-time constant, so each copy costs one instruction and a predicate.
/// Keys without an offset are zero-filled and never read.
__device__ __forceinline__ void load_tile(const DecodeParams& p, const Smem& sm, const i64* offsets, int s) {
    constexpr int WARPS = THREADS / 32;
    constexpr int LANE_STEPS = (CHUNKS + 31) / 32;
    static_assert(BN % WARPS == 0, "every warp takes the same number of keys");
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    unsigned char* stage = sm.stage(s);
#pragma unroll
    for (int jj = 0; jj < BN / WARPS; ++jj) {
        const int j = warp + jj * WARPS;
        const i64 off = offsets[j];
        const bool valid = off >= 0;
        // An invalid key copies nothing; its address stays inside the cache's first row.
        const unsigned char* src = (const unsigned char*)p.kv + (valid ? off : 0) + lane * 16;
        const u32 dst = smem_addr(stage + j * STAGE_ROW + lane * 16);
#pragma unroll
        for (int k = 0; k < LANE_STEPS; ++k) {
            if (CHUNKS % 32 == 0 || k + 1 < LANE_STEPS || lane < CHUNKS % 32) {
                cp_async16(dst + k * 512, src + (valid ? k * 512 : 0), valid);
            }
        }
    }
}

/// Step 3: a staged tile not in the model dtype into one the products read: fp8 codes as f16
/// (unscaled) into the tile of its own, the other 16-bit type in place, in the model dtype
/// (each thread rewrites the 16 bytes it read). Returns the tile the products read.
__device__ __forceinline__ const u16* convert_tile(const Smem& sm, int s, float k_scale) {
    constexpr int GROUPS = D / 8;  // 8 elements per conversion
    constexpr int STEPS = (BN * GROUPS + THREADS - 1) / THREADS;
    unsigned char* stage = sm.stage(s);
    u16* kt = FP8 ? sm.kt() : (u16*)stage;
#pragma unroll 2
    for (int i = 0; i < STEPS; ++i) {
        const int c = threadIdx.x + i * THREADS;
        if ((BN * GROUPS) % THREADS != 0 && c >= BN * GROUPS) break;
        const int j = c / GROUPS, g = c % GROUPS;
        const unsigned char* src = stage + j * STAGE_ROW + g * 8 * KV_ELEM;
        u32x4 out;
        if (FP8) {
            out = fp8x8_to_f16<KV>(*(const u32x2*)src);
        } else {
            out = convert8<KV, BF16>(*(const u32x4*)src, k_scale);
        }
        *(u32x4*)(kt + j * DP + g * 8) = out;
    }
    return kt;
}

/// The CTA's shared memory.
__device__ __forceinline__ Smem shared_layout() {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    return Smem{smem_raw};
}

/// One piece of work (common/schedule.cuh): on the split grid the CTA's whole split, in the
/// scheduled grid one of the pieces on its stretch.
__device__ __forceinline__ void decode_piece(const DecodeParams& p, const Smem& sm, const Piece& pc) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int rg = warp / NW, wc = warp % NW;
    const int g = lane / 4, c = lane % 4;  // mma fragment row and column group
    const int head_blocks = (p.heads + ROWS - 1) / ROWS;
    const int row = pc.job / head_blocks;
    const int head0 = (pc.job % head_blocks) * ROWS;
    const int splits = pc.splits;

    const KeyRange keys = piece_keys(row_keys(p, row, threadIdx.x == 0 && pc.split == 0), pc);
    if (keys.start >= keys.end) {
        if (splits == 1) write_empty<ROWS, THREADS, L>(p, row, head0);
        return;  // an empty split writes nothing; stage 2 skips it
    }
    const int req = row / p.query_len;
    const int tiles = (keys.end - keys.start + BN - 1) / BN;
    const float k_scale = read_k_scale(p, threadIdx.x == 0 && pc.job == 0 && pc.split == 0);

    // Offsets of tiles 0 .. STAGES - 1 now; from then on the block ids of tile t + STAGES are
    // read during tile t (into `next_block`) and turned into offsets at the end of it.
    const int tid = threadIdx.x;
    if (tid < BN) {
        for (int t = 0; t < STAGES; ++t) {
            const int pos = keys.start + t * BN + tid;
            sm.offsets(t)[tid] = key_offset<KV_ELEM>(p, pos, block_of(p, req, pos, keys.end));
        }
    }
    load_q(p, sm, row, head0);
    cp_async_commit();  // q in a group of its own: an fp8 decode rewrites it while tiles fly
    __syncthreads();
    // Tiles 0 .. STAGES - 2 in flight, one commit group each.
    for (int t = 0; t < STAGES - 1; ++t) {
        if (t < tiles) load_tile(p, sm, sm.offsets(t), t);
        cp_async_commit();
    }
    // The scores' scale, base 2: fp8 takes k_scale here (and a bf16 q's power of two, or the
    // fp8-query mode's q_scale).
    float sc = p.scale_log2;
    if (FP8) sc *= k_scale;
    if (Q_TO_F16 || QFP8) {
        cp_async_wait_group<STAGES - 1>();  // q landed (the tiles may fly on)
        __syncthreads();
        constexpr int QCH = D / 8;
        const auto at = [](int i) { return (i / QCH) * DP * 2 + (i % QCH) * 16; };
        if (QFP8) {
            const float q_scale = read_q_scale(p, threadIdx.x == 0 && pc.job == 0 && pc.split == 0);
            q_to_e4m3<THREADS, BF16>((unsigned char*)sm.q(), ROWS * QCH, at, q_scale);
            sc *= q_scale;
        } else {
            sc *= q_to_f16<THREADS>((unsigned char*)sm.q(), ROWS * QCH, at, (u32*)sm.red());
        }
    }

    float o[NT_O][4];
#pragma unroll
    for (int i = 0; i < NT_O; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float m[2] = {bits_to_float(0xff800000u), bits_to_float(0xff800000u)};  // rows g, g + 8
    float l[2] = {0.0f, 0.0f};  // this thread's share of the row sums

    const u32 q_lane = smem_addr(sm.q() + (rg * 16 + lane % 16) * DP + (lane / 16) * 8);
    const u32 p_lane = smem_addr(sm.p() + (rg * 16 + lane % 16) * BNP + (lane / 16) * 8);
    float* red = sm.red() + (rg * NW) * 16;

    for (int t = 0; t < tiles; ++t) {
        const int first = keys.start + t * BN;
        const int st = t % STAGES;
        cp_async_wait_group<STAGES - 2>();  // tile t landed (the newer STAGES - 2 may fly on)
        __syncthreads();                     // ... for every thread; all are done with tile t - 1
        const int issue = t + STAGES - 1;    // into the stage tile t - 1 used
        if (issue < tiles) load_tile(p, sm, sm.offsets(issue % STAGES), issue % STAGES);
        cp_async_commit();
        const int ahead = first + STAGES * BN + tid;  // the key whose block id this thread reads now
        const i64 next_block = tid < BN ? block_of(p, req, ahead, keys.end) : NO_KEY;

        const u16* kt = (const u16*)sm.stage(st);
        if (CONVERT) {
            kt = convert_tile(sm, st, k_scale);
            __syncthreads();
        }

        // 4. S = Q K^T for keys wc * KEYS_W .. + KEYS_W of the tile, in S_CHAINS independent
        //    accumulators (one dependent chain of D / 16 mma would leave the tensor core idle).
        float acc[S_CHAINS][NT_S][4];
#pragma unroll
        for (int a = 0; a < S_CHAINS; ++a)
#pragma unroll
            for (int n = 0; n < NT_S; ++n) acc[a][n][0] = acc[a][n][1] = acc[a][n][2] = acc[a][n][3] = 0.0f;
        const u32 k_lane = smem_addr(kt + (wc * KEYS_W + lane % 8) * DP + ((lane / 8) % 2) * 8);
#pragma unroll 3
        for (int k0 = 0; k0 < D / 16; k0 += S_CHAINS) {
#pragma unroll
            for (int a = 0; a < S_CHAINS; ++a) {
                if ((D / 16) % S_CHAINS != 0 && k0 + a >= D / 16) break;
                u32 qa[4];
                ldmatrix_x4(qa, q_lane + (k0 + a) * 32);
#pragma unroll
                for (int n = 0; n < NT_S; ++n) {
                    u32 b[2];
                    ldmatrix_x2(b, k_lane + n * 8 * DP * 2 + (k0 + a) * 32);
                    mma_16816<MMA_BF16>(acc[a][n], qa, b[0], b[1]);
                }
            }
        }
        float s[NT_S][4];
#pragma unroll
        for (int n = 0; n < NT_S; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float x = 0.0f;
#pragma unroll
                for (int a = 0; a < S_CHAINS; ++a) x += acc[a][n][e];
                s[n][e] = x;
            }

        // 5. scale to base 2, mask past the end, tile max across the row group's warps.
        float mx[2] = {bits_to_float(0xff800000u), bits_to_float(0xff800000u)};
#pragma unroll
        for (int n = 0; n < NT_S; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int pos = first + wc * KEYS_W + n * 8 + 2 * c + (e & 1);
                s[n][e] = pos < keys.end ? s[n][e] * sc : bits_to_float(0xff800000u);
                mx[e / 2] = fmaxf(mx[e / 2], s[n][e]);
            }
        }
        mx[0] = quad_max(mx[0]);
        mx[1] = quad_max(mx[1]);
        if (c == 0) {
            red[wc * 16 + g] = mx[0];
            red[wc * 16 + g + 8] = mx[1];
        }
        __syncthreads();
        float alpha[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float tile_max = red[g + 8 * h];
#pragma unroll
            for (int w = 1; w < NW; ++w) tile_max = fmaxf(tile_max, red[w * 16 + g + 8 * h]);
            const float m_new = fmaxf(m[h], tile_max);  // finite: every tile holds a valid key
            alpha[h] = exp2_approx(m[h] - m_new);
            m[h] = m_new;
            l[h] *= alpha[h];
        }
        u16* prow = sm.p() + (rg * 16 + g) * BNP + wc * KEYS_W + 2 * c;
#pragma unroll
        for (int n = 0; n < NT_S; ++n) {
            const float p0 = exp2_approx(s[n][0] - m[0]), p1 = exp2_approx(s[n][1] - m[0]);
            const float p2 = exp2_approx(s[n][2] - m[1]), p3 = exp2_approx(s[n][3] - m[1]);
            l[0] += p0 + p1;
            l[1] += p2 + p3;
            *(u32*)(prow + n * 8) = pack_p<QFP8, MMA_BF16>(p0, p1);
            *(u32*)(prow + 8 * BNP + n * 8) = pack_p<QFP8, MMA_BF16>(p2, p3);
        }
        __syncthreads();  // P of the whole row group is in shared memory

        // 6. O = O * alpha + P V for columns wc * COLS_W .. + COLS_W.
#pragma unroll
        for (int i = 0; i < NT_O; ++i) {
            o[i][0] *= alpha[0];
            o[i][1] *= alpha[0];
            o[i][2] *= alpha[1];
            o[i][3] *= alpha[1];
        }
        const u32 v_lane = smem_addr(kt + (lane % 8 + ((lane / 8) % 2) * 8) * DP + wc * COLS_W + (lane / 16) * 8);
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            u32 a[4];
            ldmatrix_x4(a, p_lane + kk * 32);
#pragma unroll
            for (int n = 0; n < NT_O / 2; ++n) {
                u32 b[4];
                ldmatrix_x4_trans(b, v_lane + (kk * 16 * DP + n * 16) * 2);
                mma_16816<MMA_BF16>(o[2 * n], a, b[0], b[1]);
                mma_16816<MMA_BF16>(o[2 * n + 1], a, b[2], b[3]);
            }
        }
        // Tile t + STAGES's offsets go where tile t's were (issued STAGES - 1 iterations ago);
        // the next iteration's barrier publishes them.
        if (tid < BN) sm.offsets(st)[tid] = key_offset<KV_ELEM>(p, ahead, next_block);
    }

    // 7. row sums across the quad and the row group's warps, then O / l and the LSE.
    l[0] = quad_sum(l[0]);
    l[1] = quad_sum(l[1]);
    __syncthreads();  // every warp is past its last read of red
    if (c == 0) {
        red[wc * 16 + g] = l[0];
        red[wc * 16 + g + 8] = l[1];
    }
    __syncthreads();
    float inv[2], lse[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float sum = 0.0f;
#pragma unroll
        for (int w = 0; w < NW; ++w) sum += red[w * 16 + g + 8 * h];
        // V's k_scale, for fp8 (in the fp8-query mode over P's factor)
        inv[h] = (FP8 ? (QFP8 ? k_scale * (1.0f / FP8_P_SCALE) : k_scale) : 1.0f) / sum;
        lse[h] = (m[h] + log2_approx(sum)) * LN2;
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int head = head0 + rg * 16 + g + 8 * h;
        if (head >= p.heads) continue;
        const int col0 = wc * COLS_W + 2 * c;
        const i64 at = piece_at(p, pc, ROWS, head - head0, row, head);
        store_pairs<BF16, L, NT_O, 8>(p, at, row, head, col0, [&](int i, int e) { return o[i][2 * h + e] * inv[h]; });
        if (wc == 0 && c == 0) store_lse(p, at, row, head, lse[h]);
    }
}

}  // namespace

// One row group: two CTAs per SM (the host picks a ring that leaves room for both). More row
// groups have too many threads for two CTAs' registers.
#if MLA_SCHED
// Scheduled (grid: CTAs x head blocks): CTA (c, y) walks its stretch of the cost line for
// head block y, a piece per job it touches (common/schedule.cuh).
extern "C" __global__ void __launch_bounds__(THREADS, MW == 1 ? 2 : 1) mla_decode_split(const ScheduleParams sp) {
    allow_dependent_launch();  // the combine may start launching (it waits for our writes)
    wait_for_previous_grid();  // the scheduler's integers (a programmatic dependent launch on sm_90)
    const Smem sm = shared_layout();
    walk_pieces(sp, (sp.d.heads + ROWS - 1) / ROWS, [&](const Piece& pc) { decode_piece(sp.d, sm, pc); });
}
#else
extern "C" __global__ void __launch_bounds__(THREADS, MW == 1 ? 2 : 1) mla_decode_split(const DecodeParams p) {
    allow_dependent_launch();  // the combine may start launching (it waits for our writes)
    decode_piece(p, shared_layout(), grid_piece(p));
}
#endif

