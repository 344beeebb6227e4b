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
 *   3. (a cache in the other 16-bit type) the staged tile rewritten in the model dtype in
 *      place; an fp8 tile stays as it landed: the products turn its codes into f16 in
 *      registers (steps 4 and 6; they then run in f16, k_scale on the scores and the output,
 *      a bf16 q rewritten as f16 after step 1, common/fp8.cuh);
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
 *   MLA_CTAS       CTAs an SM holds (the launch bounds' minimum)
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
constexpr bool CONVERT = KV == 1;           // the other 16-bit type: rewritten in place
constexpr bool FP8 = KV >= 2;               // fp8: codes to f16 in the products' registers
// fp8 caches multiply in f16, k_scale applied to the scores and the output (common/fp8.cuh,
// "Products in f16"); a bf16 q is rewritten as f16 first, or in the fp8-query mode (QFP8) any
// q as its e4m3 codes, with P rounded to e4m3.
constexpr bool MMA_BF16 = BF16 && !FP8;
constexpr bool QFP8 = MLA_QFP8 != 0;
constexpr bool Q_TO_F16 = BF16 && FP8 && !QFP8;
constexpr int KV_ELEM = FP8 ? 1 : 2;        // bytes per cache element
constexpr int CHUNKS = D * KV_ELEM / 16;    // 16-byte chunks per cache row
// Bytes per staged key row. fp8 rows are padded by 16 bytes: the value product's 8-byte
// reads of keys 2c (c = 0..3) then fall 32 bytes apart in the banks (576 would put them on
// the same ones).
constexpr int STAGE_ROW = FP8 ? D + 16 : DP * 2;
constexpr int STAGE_BYTES = BN * STAGE_ROW;
constexpr int Q_BYTES = ROWS * DP * 2;
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
    __device__ u16* p() const { return (u16*)(base + Q_BYTES + STAGES * STAGE_BYTES); }
    __device__ float* red() const { return (float*)(base + Q_BYTES + STAGES * STAGE_BYTES + P_BYTES); }
    __device__ i64* offsets(int s) const {
        return (i64*)(base + Q_BYTES + STAGES * STAGE_BYTES + P_BYTES + RED_BYTES) + s * BN;
    }
};

}  // namespace

/// Shared memory the kernel needs, read by the host through the symbol below.
extern "C" __constant__ int mla_decode_smem_bytes =
    Q_BYTES + STAGES * STAGE_BYTES + P_BYTES + RED_BYTES + OFF_BYTES;
static_assert(StagedRows<BF16, L>::bytes(ROWS) <= Q_BYTES + STAGES * STAGE_BYTES,
              "the outputs' staging tile fits over q and the tiles");

namespace {

/// fp8 scores (see "fp8 products" below): the place in q's shared row of word w (columns 2w,
/// 2w + 1). The scores take the columns of a group of 16 NS in the order the key codes land
/// in a lane (step s of lane column c: columns 4 NS c + 4 s .. + 4); q is stored in that order,
/// step s's 16 columns together as one mma k-step, so that ldmatrix hands each lane its
/// fragment (a lane's pairs assembled from two rows' loads cost four register moves an mma).
/// Word x of a group (c = x / 2 NS, s = x % 2 NS / 2, h = x % 2) goes to 8 s + 4 h + c: the
/// fragment's pairs k = 2c, 2c + 1 (h = 0) and 2c + 8, 2c + 9 (h = 1) of step s.
__device__ __forceinline__ int q_word_place(int w) {
    constexpr int FULL = D / 64 * 32;            // words of the groups of 64 columns (NS 4)
    constexpr int HALF = D % 64 >= 32 ? 16 : 0;  // words of the group of 32 (NS 2), if any
    const int ns = w < FULL ? 4 : (w < FULL + HALF ? 2 : 1);
    const int base = w < FULL ? w / 32 * 32 : (w < FULL + HALF ? FULL : FULL + HALF);
    const int x = w - base;
    return base + 8 * (x % (2 * ns) / 2) + 4 * (x % 2) + x / (2 * ns);
}

/// Step 1: the CTA's q rows (heads head0 .. head0 + ROWS) into shared memory; missing heads are
/// 0. An fp8 cache's q goes a word at a time to its place in the scores' order
/// (`q_word_place`; the rewrites of q that follow are elementwise).
__device__ __forceinline__ void load_q(const DecodeParams& p, const Smem& sm, int row, int head0) {
    constexpr int QCH = D / 8;  // 16-byte chunks per q row
    for (int c = threadIdx.x; c < ROWS * QCH; c += THREADS) {
        const int r = c / QCH, k = c % QCH;
        const int head = head0 + r;
        const bool valid = head < p.heads;
        const u16* src = valid ? q_piece<L>(p, row, head, k) : (const u16*)p.q_nope;
        if constexpr (FP8) {
            const u32 dst = smem_addr(sm.q() + r * DP);
#pragma unroll
            for (int j = 0; j < 4; ++j) cp_async4(dst + 4 * q_word_place(4 * k + j), src + 2 * j, valid);
        } else {
            cp_async16(smem_addr(sm.q() + r * DP + k * 8), src, valid);
        }
    }
}

/// Step 2c: a tile of keys into stage `s`, from the offsets computed a tile earlier. Warp w
/// takes keys w, w + WARPS, ...; lane l the key's 16-byte chunks l, l + 32, ... Every trip
/// count is a compile-time constant, so each copy costs one instruction and a predicate.
/// Keys without an offset are zero-filled and never read. With one row group (a warp copies
/// 8 keys) the warp's offsets are all read before its first copy: a copy (asm with a memory
/// clobber) keeps a later shared load behind it, so each key's copy waited for its offset in
/// turn. With more row groups a warp copies 2 keys, and the 4-group scheduled variant had no
/// registers for it (it spilled). The same walk as common/keys.cuh's copy_keys, written out:
/// through copy_keys the 4-group scheduled variants spilled, 16 to 20 bytes with its
/// addresses formed per piece, 44 (sm_90a, the other 16-bit cache) with them formed per key
/// as here.
__device__ __forceinline__ void load_tile(const DecodeParams& p, const Smem& sm, const i64* offsets, int s) {
    constexpr int WARPS = THREADS / 32;
    constexpr int LANE_STEPS = (CHUNKS + 31) / 32;
    constexpr bool OFFSETS_FIRST = MW == 1;
    static_assert(BN % WARPS == 0, "every warp takes the same number of keys");
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    unsigned char* stage = sm.stage(s);
    i64 offs[BN / WARPS];
    if constexpr (OFFSETS_FIRST) {
#pragma unroll
        for (int jj = 0; jj < BN / WARPS; ++jj) offs[jj] = offsets[warp + jj * WARPS];
    }
#pragma unroll
    for (int jj = 0; jj < BN / WARPS; ++jj) {
        const int j = warp + jj * WARPS;
        const i64 off = OFFSETS_FIRST ? offs[jj] : offsets[j];
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

/// Step 3: a staged tile in the other 16-bit type rewritten in place in the model dtype (each
/// thread rewrites the 16 bytes it reads).
__device__ __forceinline__ void convert_tile(const Smem& sm, int s, float k_scale) {
    constexpr int GROUPS = D / 8;  // 8 elements per conversion
    constexpr int STEPS = (BN * GROUPS + THREADS - 1) / THREADS;
    u16* stage = (u16*)sm.stage(s);
#pragma unroll 2
    for (int i = 0; i < STEPS; ++i) {
        const int c = threadIdx.x + i * THREADS;
        if ((BN * GROUPS) % THREADS != 0 && c >= BN * GROUPS) break;
        u32x4* at = (u32x4*)(stage + (c / GROUPS) * DP + (c % GROUPS) * 8);
        *at = convert8<KV, BF16>(*at, k_scale);
    }
}

// fp8 products (steps 4 and 6) on the raw codes. An mma fragment pairs consecutive elements
// of the contracted index, but a thread of an 8-byte-or-wider load holds consecutive columns
// of one key; so each product permutes an index that the sums do not care about:
// - the scores permute the contracted columns within each group of 16 NS columns (NS steps of
//   16): step s of lane column c takes columns 4 NS c + 4 s .. + 4 of the group, so a lane
//   loads its key's 4 NS codes at once; q is stored in that order (q_word_place), so the same
//   columns of both operands meet and ldmatrix reads q's fragments as in the 16-bit path;
// - the value product permutes the output columns within each group of 8 VG columns (VG
//   n-tiles): fragment column g of n-tile j is column VG g + j, so a lane loads VG codes of
//   each of its four keys at once and pairs the keys' bytes with one prmt for two n-tiles.
//   The output is written back through the same map (v_col).

/// Scores over one group of 16 NS columns starting at col0: acc[s % S_CHAINS][n] += the
/// fragments of step s, for the warp's NT_S n-tiles of keys (rows of `keys`, 8 STAGE_ROW
/// apart). q_lane: the lane's ldmatrix address in q (stored in the scores' order,
/// `q_word_place`: step s of the group is columns col0 + 16 s .. + 16 there).
template <int NS>
__device__ __forceinline__ void scores_fp8(float (&acc)[S_CHAINS][NT_S][4], u32 q_lane, u32 keys, int col0, int c) {
    u32 qa[NS][4];
#pragma unroll
    for (int st = 0; st < NS; ++st) ldmatrix_x4(qa[st], q_lane + (col0 + 16 * st) * 2);
#pragma unroll
    for (int n = 0; n < NT_S; ++n) {
        u32 k[NS];  // the key's codes 4 NS c .. of the group, 4 a step
        ld_shared_words<NS>(k, keys + n * 8 * STAGE_ROW + col0 + 4 * NS * c);
#pragma unroll
        for (int st = 0; st < NS; ++st) {
            const u32x2 b = fp8x4_to_f16<KV>(k[st]);
            mma_16816<false>(acc[st % S_CHAINS][n], qa[st], b.x, b.y);
        }
    }
}

/// n-tiles of the value product's column groups (see above): 8 where they divide the warp's,
/// else 4 (L a multiple of 128, as the host requires, gives a multiple of 4).
constexpr int VG = NT_O % 8 == 0 ? 8 : 4;
/// Column groups of the scores unrolled: 3 (as the 16-bit loop), 1 under the 128 registers of
/// four row groups (3 spilled there).
constexpr int FP8_UNROLL = MW == 4 ? 1 : 3;
static_assert(!FP8 || NT_O % 4 == 0, "fp8 needs L a multiple of 128");

/// Output column of fragment column `col` (0..7) of n-tile i of warp wc (the map above).
__device__ __forceinline__ int v_col(int wc, int i, int col) {
    return wc * COLS_W + (i / VG) * 8 * VG + VG * col + i % VG;
}

/// o[i] += P V over 16 keys (`a`: P's fragment) for the warp's n-tiles, V's codes read from
/// the 4 keys of lane column c (k0 + 2c, + 1, + 8, + 9; `keys`: byte address of key k0 + 2c
/// at the warp's column 0 + VG g).
__device__ __forceinline__ void values_fp8(float (&o)[NT_O][4], const u32 (&a)[4], u32 keys) {
    constexpr int W = VG / 4;  // words of VG codes
#pragma unroll
    for (int grp = 0; grp < NT_O / VG; ++grp) {
        u32 v[4][W];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            ld_shared_words<W>(v[r], keys + ((r & 1) + (r >> 1) * 8) * STAGE_ROW + grp * 8 * VG);
        }
#pragma unroll
        for (int j = 0; j < VG; j += 2) {
            // Bytes j and j + 1 of keys (0, 1) and (8, 9): [k0.j, k1.j, k0.j+1, k1.j+1].
            const u32 sel = (j % 4) | (4 + j % 4) << 4 | (j % 4 + 1) << 8 | (5 + j % 4) << 12;
            const u32x2 lo = fp8x4_to_f16<KV>(__byte_perm(v[0][j / 4], v[1][j / 4], sel));
            const u32x2 hi = fp8x4_to_f16<KV>(__byte_perm(v[2][j / 4], v[3][j / 4], sel));
            mma_16816<false>(o[grp * VG + j], a, lo.x, hi.x);
            mma_16816<false>(o[grp * VG + j + 1], a, lo.y, hi.y);
        }
    }
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
        if (splits == 1) {
            write_empty<ROWS, THREADS, L>(p, row, head0);
        } else if (!MLA_SCHED) {  // stage 2 gives the split no weight (a scheduled piece has keys)
            write_empty_split_heads<ROWS, THREADS>(p, pc, row, head0);
        }
        return;
    }
    const int req = row / p.query_len;
    const int tiles = (keys.end - keys.start + BN - 1) / BN;
    const float k_scale = read_k_scale(p, threadIdx.x == 0 && pc.job == 0 && pc.split == 0);

    // Offsets of tiles 0 .. STAGES - 1 now; from then on the block ids of tile t + STAGES are
    // read during tile t (into `next_block`) and turned into offsets at the end of it.
    const int tid = threadIdx.x;
    first_offsets<KV_ELEM, BN, STAGES>(p, req, keys, tid, [sm](int t) { return sm.offsets(t); });
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
            convert_tile(sm, st, k_scale);
            __syncthreads();
        }

        // 4. S = Q K^T for keys wc * KEYS_W .. + KEYS_W of the tile, in S_CHAINS independent
        //    accumulators (one dependent chain of D / 16 mma would leave the tensor core idle).
        float acc[S_CHAINS][NT_S][4];
#pragma unroll
        for (int a = 0; a < S_CHAINS; ++a)
#pragma unroll
            for (int n = 0; n < NT_S; ++n) acc[a][n][0] = acc[a][n][1] = acc[a][n][2] = acc[a][n][3] = 0.0f;
        if constexpr (FP8) {
            const u32 keys_g = smem_addr(sm.stage(st) + (wc * KEYS_W + g) * STAGE_ROW);
#pragma unroll FP8_UNROLL
            for (int b = 0; b < D / 64; ++b) scores_fp8<4>(acc, q_lane, keys_g, 64 * b, c);
            if (D % 64 >= 32) scores_fp8<2>(acc, q_lane, keys_g, D / 64 * 64, c);
            if (D % 32 != 0) scores_fp8<1>(acc, q_lane, keys_g, D - 16, c);
        } else {
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

        // 6. O = O * alpha + P V for columns wc * COLS_W .. + COLS_W. A warp holds all 16 rows
        //    of its row group: where none of their maxima moved (alpha 1, most tiles after the
        //    first few), O stays as it is (x * 1 is x) and the warp skips 4 NT_O multiplies.
        if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
            for (int i = 0; i < NT_O; ++i) {
                o[i][0] *= alpha[0];
                o[i][1] *= alpha[0];
                o[i][2] *= alpha[1];
                o[i][3] *= alpha[1];
            }
        }
        // fp8: the codes of keys 2c, 2c + 1, 2c + 8, 2c + 9 of each 16 (values_fp8); else V
        // through ldmatrix.trans.
        const u32 v_lane = FP8 ? smem_addr(sm.stage(st) + 2 * c * STAGE_ROW + wc * COLS_W + VG * g)
                               : smem_addr(kt + (lane % 8 + ((lane / 8) % 2) * 8) * DP + wc * COLS_W + (lane / 16) * 8);
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            u32 a[4];
            ldmatrix_x4(a, p_lane + kk * 32);
            if constexpr (FP8) {
                values_fp8(o, a, v_lane + kk * 16 * STAGE_ROW);
            } else {
#pragma unroll
                for (int n = 0; n < NT_O / 2; ++n) {
                    u32 b[4];
                    ldmatrix_x4_trans(b, v_lane + (kk * 16 * DP + n * 16) * 2);
                    mma_16816<MMA_BF16>(o[2 * n], a, b[0], b[1]);
                    mma_16816<MMA_BF16>(o[2 * n + 1], a, b[2], b[3]);
                }
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
    // The outputs through shared memory (q and the stages are free now: every warp is past
    // the barriers above, so done with its products), then whole rows out.
    const StagedRows<BF16, L> out{smem_addr(sm.q()), splits > 1};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = rg * 16 + g + 8 * h, head = head0 + r;
        if constexpr (FP8) {
            // Pair i: n-tiles 2 (i / 2) and + 1 at fragment column 2c + i % 2 (v_col's map).
            out.put<NT_O>(r, [&](int i) { return v_col(wc, 2 * (i / 2), 2 * c + i % 2); },
                          [&](int i, int e) { return o[2 * (i / 2) + e][2 * h + i % 2] * inv[h]; });
        } else {
            out.put<NT_O>(r, [&](int i) { return wc * COLS_W + 2 * c + 8 * i; },
                          [&](int i, int e) { return o[i][2 * h + e] * inv[h]; });
        }
        if (wc == 0 && c == 0 && head < p.heads) store_lse(p, piece_at(p, pc, ROWS, r, row, head), row, head, lse[h]);
    }
    __syncthreads();
    out.store<ROWS, THREADS>(p, threadIdx.x, [&p, pc, row, head0](int r, i64& at, int& q_row, int& head) {
        q_row = row;
        head = head0 + r;
        at = piece_at(p, pc, ROWS, r, row, head);
        return head < p.heads;
    });
}

}  // namespace

// MLA_CTAS CTAs an SM (the host's choice, with a ring that leaves them room): up to two of
// one row group, three with an fp8 cache (registers: at most 168 a thread), one of more row
// groups; fewer where shared memory holds fewer.
#if MLA_SCHED
// Scheduled (grid: CTAs x head blocks): CTA (c, y) walks its stretch of the cost line for
// head block y, a piece per job it touches (common/schedule.cuh).
extern "C" __global__ void __launch_bounds__(THREADS, MLA_CTAS) mla_decode_split(const ScheduleParams sp) {
    allow_dependent_launch();  // the combine may start launching (it waits for our writes)
    wait_for_previous_grid();  // the scheduler's integers (a programmatic dependent launch on sm_90)
    const Smem sm = shared_layout();
    walk_pieces(sp, (sp.d.heads + ROWS - 1) / ROWS, [&](const Piece& pc) { decode_piece(sp.d, sm, pc); });
}
#else
extern "C" __global__ void __launch_bounds__(THREADS, MLA_CTAS) mla_decode_split(const DecodeParams p) {
    allow_dependent_launch();  // the combine may start launching (it waits for our writes)
    decode_piece(p, shared_layout(), grid_piece(p));
}
#endif

