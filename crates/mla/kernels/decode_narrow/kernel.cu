/**
 * @file decode_narrow/kernel.cu
 * @brief Stage 1 of the split-KV decode for few heads on Hopper (sm_90a): one CTA attends up
 * to N query rows (the heads of one token, or of a few tokens of one request) to the keys of
 * one split, streaming the keys through a ring of TMA copies.
 *
 * With 16 heads a decode reads 1152 bytes a key for 35 kFLOP: memory-bound, so what counts is
 * bytes in flight. The products are turned around so that keys, not heads, fill wgmma's 64
 * rows (no padding rows) and the accumulators stay small:
 *   S^T [64 keys x N]  = K [64 x D]   Q^T [D x N]       (A = the key tile, K-major)
 *   O^T [L x N]       += V^T [L x 64] P^T [64 x N]      (A = the same tile read MN-major)
 * O^T is 8 blocks of 64 latent columns x N, 4 in each consumer warpgroup: N / 2 x 4
 * registers a thread.
 *
 * Outputs, grid and workspace are decode_mma's and decode_wgmma's (the plan, the workspace and
 * the combine are shared): grid x = (request * token_blocks + token_block), y = split; a CTA's
 * N columns are `tokens_per_cta` tokens x heads (column c: token c / heads, head c % heads).
 *
 * Block: two consumer warpgroups and a producer warpgroup of which one warp works (384
 * threads; `setmaxnreg` moves registers from the producer to the consumers).
 * - The producer streams the split's key tiles (64 keys, whole pages or 64-key pieces of
 *   them) as 64-column chunks of 8 KB (TMA, 128-byte swizzle) into a ring of SLOTS chunk
 *   slots, each with a "full" mbarrier (bytes landed) and an "empty" one (its readers are
 *   done). Tiles start at multiples of 64 keys (a split's first tile may begin before its
 *   keys and is masked), so a tile never straddles a page of 64 keys or more, and pages of 8,
 *   16 or 32 keys fill it whole. Its warpgroup then exits.
 * - Both consumer warpgroups take every tile: S^T chunk by chunk as each lands (36 wgmma
 *   m64nNk16; both compute it, it is cheap at N = 16), the softmax over keys (a column's max
 *   across the 4 warps through shared memory and a named barrier), P^T rounded to the model
 *   dtype into shared memory; then warpgroup w rescales its O^T and adds V^T P^T for its
 *   half of the latent columns (value chunks 4 w .. 4 w + 3), releasing each chunk as its
 *   products complete, and the chunks it does not multiply right after the scores. One tile
 *   is held at a time, so the ring keeps the next ~1.8 tiles in flight (NOTES.md: with
 *   warpgroups taking alternate tiles, two were held and under one was in flight).
 *   The two warpgroups run the same softmax on the same scores, so their maxima and sums
 *   agree bit for bit and each writes its columns with no merge.
 * - At the end O^T / l is transposed through the ring (now free) and written as rows: to o
 *   and lse (one split) or to the split's workspace slot.
 * Keys that a tile holds but no row of the CTA sees (before the split, past its end) are
 * zeroed in the value chunks before the products: P is 0 there, and 0 x garbage must not be
 * NaN. Pages past the block table or with a bad block id are never read (the box's block
 * coordinate is -1, which the TMA unit fills with zeros; a bad id raises the error flag).
 *
 * fp8 caches (MLA_KV 2, 3; consume_fp8) run another block: the two consumer warpgroups only
 * (256 threads, 254 registers: a producer warpgroup would cap every thread at 168, which
 * spilled), taking alternate tiles, each with its own maxima, sums and O^T of all L columns,
 * merged at the end; each warpgroup's warp 0 issues its own tiles' copies (issue_tile) into
 * a ring of TILE_GROUPS whole tiles with an mbarrier pair a tile. The products:
 *   S^T [64 x 2N] = K [64 x D] [q_hi q_lo]^T   fp8 wgmma m64n32k32, A the raw tile (K-major)
 *   O^T [L x N]  += V^T [L x 64] (P_hi + P_lo)^T  fp8 wgmma m64n16k32, A the codes in registers
 * with q and P x P_SCALE split into two e4m3 terms each (e4m3x2_split; split_q scales each
 * column's q by a power of two first), so that the tensor cores multiply the codes as they
 * landed: no conversion anywhere. NOTES.md, "fp8 caches", has the numbers and the error.
 *
 * Compile-time configuration (-D):
 *   MLA_L, MLA_R  latent and rotary widths (L = 512, (L + R) % 64 == 0)
 *   MLA_BF16      1: the model dtype is bf16, 0: f16
 *   MLA_KV        0: the cache in the model dtype; 2: fp8 e4m3, 3: fp8 e5m2 (chunks of 64 keys
 *                 x 128 codes as they land, 128-byte swizzle; the fp8 block above)
 *   MLA_N         columns (query rows) a CTA: 16 or 32 (fp8: 16)
 *   MLA_SLOTS     8 KB chunk slots in the ring (the host fills the device's shared memory;
 *                 fp8: TILE_GROUPS whole tiles)
 */
#include "common/fp8.cuh"
#include "common/keys.cuh"
#include "common/ptx.cuh"
#include "common/rows.cuh"
#include "common/tma.cuh"
#include "common/wgmma.cuh"
#include "params.cuh"

namespace {

constexpr bool BF16 = MLA_BF16 != 0;
constexpr int L = MLA_L;
constexpr int D = L + MLA_R;
constexpr int N = MLA_N;                 // columns: query rows of the CTA
constexpr int SLOTS = MLA_SLOTS;         // chunk slots in the ring
constexpr int BN = TMA_TILE;             // keys per tile: wgmma's M
constexpr int KV = MLA_KV;
constexpr bool FP8 = KV >= 2;
// Chunks of a key row, 128 bytes of it each: 64 elements of a 16-bit cache, 128 codes of an
// fp8 one (5 for D = 576: the last one's second half is past the row, which the TMA unit
// fills with zeros and no product reads).
constexpr int CHUNK_CODES = FP8 ? 128 : 64;
constexpr int CHUNKS = (D + CHUNK_CODES - 1) / CHUNK_CODES;
constexpr int V_CHUNKS = L / 64;         // the value part (16-bit: chunks)
constexpr int CHUNK_BYTES = BN * 128;    // a ring slot: one chunk of a tile as it lands, swizzled
constexpr int NX = FP8 ? 2 * N : N;      // S^T's columns: fp8 multiplies q's two e4m3 terms
constexpr float P_SCALE = 256.0f;        // fp8: P x 256 is split (e4m3's normal range)
constexpr int CONSUMERS = 2;             // warpgroups sharing each tile
constexpr int OWN = V_CHUNKS / CONSUMERS; // value chunks a consumer multiplies by P
constexpr int HALF = L / CONSUMERS;      // output columns a consumer writes
constexpr int S_CHAINS = 3;              // independent accumulators of S^T
// fp8: S^T's accumulators, a k-step of 32 each in turn (3 steps a chain). fp8 wgmma keeps
// 13 bits of its accumulator, truncated: each step shrinks a chain's sum by up to 2^-13,
// which biases the LSE (3 chains of 6 steps: 1.2e-3 to 1.5e-3 at scores scaled by 2; NOTES.md).
constexpr int FP8_CHAINS = 6;
// fp8: the value product's m-tiles a pass (4, all of a latent half, spilled 4 bytes with the
// 128-byte chunks and was about 1% slower; NOTES.md).
constexpr int FP8_PART_TILES = 2;
// + the producer warpgroup (one warp works). Under fp8 no producer: each consumer
// warpgroup's warp 0 issues its own tiles' copies (issue_tile), so that its threads get 254
// registers (ptxas gives every thread of a wgmma kernel the even split of its warpgroups,
// 168 with a third one, which spilled the fp8 consumers' O^T of all L columns).
constexpr int THREADS = CONSUMERS * 128 + (FP8 ? 0 : 128);
// fp8: the ring's tiles (the host's SLOTS = TILE_GROUPS x CHUNKS): tile t in group t %
// TILE_GROUPS, whose "full" and "empty" mbarriers (the first TILE_GROUPS of each) count
// whole tiles; a tile is issued once the tile TILE_GROUPS before it is released. An even
// count: a group's every tile is then one warpgroup's, which has consumed the group's last
// use when it waits on the next with the next parity (an odd count let the other warpgroup
// wait while that use might still be in flight, and the parity would pass it).
constexpr int TILE_GROUPS = SLOTS / CHUNKS;
constexpr int PRODUCER_WARP = CONSUMERS * 4;
// Registers a thread (setmaxnreg; 16-bit caches): the producer warpgroup gives up most of its
// share to the consumers, whose accumulators and softmax state need more than an even split
// (168).
constexpr int PRODUCER_REGS = 56;
constexpr int CONSUMER_REGS = 224;
static_assert(PRODUCER_REGS * 128 + CONSUMER_REGS * 128 * CONSUMERS <= 65536, "the register file");
// q: N x D 16-bit, swizzled; fp8: its two e4m3 terms, 2N rows of whole chunks (the 16-bit q
// lands there first, D / 64 chunks of N rows).
constexpr int Q_BYTES = CHUNKS * (FP8 ? 2 * N : N) * 128;
constexpr int PT_BYTES = N * 128;        // P^T of a tile: N rows of 64 keys
constexpr int RED_BYTES = 4 * N * 4;     // the 4 warps' column maxima
constexpr int UNIT_BYTES = FP8 ? N * 4 : 0;  // fp8: each column's q scale (unit())
constexpr int BAR_BYTES = 2 * SLOTS * 8;
// Padded row of the transposed outputs (no bank conflicts): a warpgroup's L / 2 columns, or
// under fp8 (each warpgroup has all of them, merged at the end) L.
constexpr int LP = (FP8 ? L : HALF) + 4;
constexpr int ALIGN = 1024;
constexpr float LN2 = 0.69314718055994530942f;
constexpr int COLS = N / 4;              // columns of a thread (its slots: see column())

static_assert(L == 512 && D % 64 == 0, "L = 512 and whole 64-column chunks");
static_assert(N == 16 || N == 32, "N = 16 or 32");
static_assert(!FP8 || N == 16, "fp8: S^T's 2N columns are one m64n32 product");
static_assert(!FP8 || (SLOTS == TILE_GROUPS * CHUNKS && TILE_GROUPS % CONSUMERS == 0),
              "fp8: a ring of whole tiles, as many for each warpgroup");
static_assert(!FP8 || TILE_GROUPS < SLOTS, "fp8: a spare mbarrier for the merge");
static_assert(SLOTS >= 2 * CHUNKS, "the ring holds a tile for each consumer");
static_assert(CONSUMERS * N * LP * 4 <= SLOTS * CHUNK_BYTES, "the transposed outputs fit in the ring");
static_assert(KV == 0 || KV == 2 || KV == 3, "a cache in the model dtype, or fp8");
static_assert(FP8 || (V_CHUNKS % CONSUMERS == 0 && CHUNKS / OWN >= CONSUMERS), "value chunks split evenly");
static_assert(!FP8 || (L % 128 == 0 && N * D * 2 <= Q_BYTES), "fp8: whole value chunks; q lands in its terms' bytes");

struct Smem {
    unsigned char* base;  // 1024-byte aligned
    __device__ unsigned char* slot(int s) const { return base + s * CHUNK_BYTES; }
    /// q as S^T's B operand: N x D 16-bit (swizzled), or under fp8 its two e4m3 terms, 2N x D
    /// bytes (128-byte swizzle: rows 0 .. N - 1 hi, N .. 2N - 1 lo), in the same bytes.
    __device__ unsigned char* q() const { return base + SLOTS * CHUNK_BYTES; }
    /// P^T of warpgroup w: N rows of 64 keys, 16-bit (swizzled), or under fp8 the two e4m3
    /// terms of P x P_SCALE, N x 64 bytes each (64-byte swizzle, hi then lo).
    __device__ unsigned char* pt(int w) const { return q() + Q_BYTES + w * PT_BYTES; }
    __device__ float* red(int w) const { return (float*)(pt(CONSUMERS) + w * RED_BYTES); }
    /// fp8: column c's q was scaled by 1 / unit()[c] (a power of two) before the split.
    __device__ float* unit() const { return red(CONSUMERS); }
    __device__ u64* full() const { return (u64*)(pt(CONSUMERS) + CONSUMERS * RED_BYTES + UNIT_BYTES); }
    /// fp8: the merge's mbarrier (every consumer thread's arrival a phase): the last "full"
    /// one, which tiles leave unused (they take the first TILE_GROUPS).
    __device__ u64* merge_bar() const { return full() + SLOTS - 1; }
    __device__ u64* empty() const { return full() + SLOTS; }
    // The end of the split, once every tile is consumed: the outputs transposed in the ring,
    // the row maxima where P^T was (the sums go where the column maxima were).
    __device__ float* merged(int w) const { return (float*)base + w * N * LP; }  // [N][LP]
    __device__ float* maxima(int w) const { return (float*)pt(w); }              // [N]
};

}  // namespace

/// Shared memory the kernel needs (the host checks it against its own count).
extern "C" __constant__ int mla_decode_smem_bytes =
    ALIGN + SLOTS * CHUNK_BYTES + Q_BYTES + CONSUMERS * (PT_BYTES + RED_BYTES) + UNIT_BYTES + BAR_BYTES;

namespace {

/// The CTA's columns: `tokens` query tokens of one request from token `tok0` (query row
/// `row0`) on, `heads` heads each.
struct Cols {
    int row0, tok0, tokens, heads;
    __device__ int nth(int c) const { return c / heads; }
    __device__ int row(int c) const { return row0 + nth(c); }
    __device__ int head(int c) const { return c % heads; }
    __device__ bool real(int c) const { return nth(c) < tokens; }
};

/// The producer warp. Each chunk must be issued in less time than the consumers take to eat
/// one (about 500 cycles at the H200's bandwidth an SM; NOTES.md: a producer slower than that
/// cost 1.55x), so lane 0 alone walks the chunks with nothing but the slot's wait, its byte
/// count and the copies, and the warp reads tile t + 1's block ids while lane 0 issues tile t.
__device__ __forceinline__ void produce(const TmaParams& np, const Smem& sm, int req, int first0, int tiles,
                                        const KeyRange& keys) {
    const DecodeParams& p = np.d;
    const int lane = threadIdx.x % 32;
    const TileBoxes boxes(p.page_size);
    const u32 full = smem_addr(sm.full()), empty = smem_addr(sm.empty()), ring = smem_addr(sm.slot(0));
    BoxLookup next;
    next.start(p, req, first0, boxes, keys, lane);
    int s = 0;
    u32 phase = 0;        // of slot s's current use; its previous use completed phase ^ 1 of "empty"
    bool reused = false;  // whether the ring has wrapped (slot s was used before)
    for (int t = 0; t < tiles; ++t) {
        const int first = first0 + t * BN;
        const TileBlocks blocks = gather_blocks(p, next, first, boxes);
        next = BoxLookup{};
        if (t + 1 < tiles) next.start(p, req, first + BN, boxes, keys, lane);
        if (lane == 0) {
            for (int c = 0; c < CHUNKS; ++c) {
                if (reused) mbar_wait(empty + 8 * s, phase ^ 1);
                mbar_expect_bytes(full + 8 * s, CHUNK_BYTES);
                copy_chunk<CHUNK_CODES>(&np.kv_map, blocks, boxes, ring + s * CHUNK_BYTES, full + 8 * s, c);
                if (++s == SLOTS) {
                    s = 0;
                    phase ^= 1;
                    reused = true;
                }
            }
        }
        __syncwarp();
    }
}

/// q of the CTA's columns, by the consumer warpgroups, as the K-major B operand of S^T: chunk
/// k of 64 columns holds N rows of 128 bytes, swizzled. Padding columns are zero. Returns
/// when this thread's copies landed, fenced for wgmma.
__device__ __forceinline__ void load_q(const DecodeParams& p, const Smem& sm, const Cols& cols) {
    copy_q<N, L, D, CONSUMERS * 128>(p, smem_addr(sm.q()), threadIdx.x, [&](int c, int& row, int& head) {
        row = cols.row(c);
        head = cols.head(c);
        return cols.real(c);
    });
    cp_async_commit();
    cp_async_wait_group<0>();
    fence_proxy_async();
}

/// Releases value chunk J of this warpgroup's (global chunk g0 + J) once its products are
/// done (wgmma groups retire in order: after chunk J's group, OWN - 1 - J are still
/// pending), then chunk J + 1.
template <int J>
__device__ __forceinline__ void release_values(u32 empty, int g0, int lane) {
    if constexpr (J < OWN) {
        wgmma_wait<OWN - 1 - J>();
        if (lane == 0) mbar_arrive(empty + 8 * ((g0 + J) % SLOTS));
        release_values<J + 1>(empty, g0, lane);
    }
}

/// The accumulator layout turned around (rows: keys or latent columns; columns: the CTA's
/// query rows). Of a thread's N / 2 values, value i lies in row key0 + row_step(i) (key0 =
/// 16 warp + lane / 4) and in the thread's column slot(i) of N / 4, which is CTA column
/// column(slot, lane).
__device__ __forceinline__ int row_step(int i) {
    return 8 * ((i / 2) % 2);
}
__device__ __forceinline__ int slot(int i) {
    return 2 * (i / 4) + i % 2;
}
__device__ __forceinline__ int column(int slot, int lane) {
    return 8 * (slot / 2) + 2 * (lane % 4) + slot % 2;
}

/// fp8: q (landed 16-bit, swizzled) rewritten in place as its two e4m3 terms, S^T's B
/// operand of 2N columns (K-major, 128-byte swizzle: column c's hi in row c, lo in row N + c):
/// column c times 2^e, e putting its largest magnitude in [128, 256) (bf16's every element
/// from 2^-2 on then splits exactly), split by e4m3x2_split; unit()[c] = 2^-e goes on the
/// scores. By both consumer warpgroups, 16 threads a column and 9 pieces of 4 elements a
/// thread; the caller's barrier then publishes the terms.
__device__ __forceinline__ void split_q(const Smem& sm) {
    constexpr int PIECES = D / 64;  // of 4 elements, a thread's (D / 4 a column, 16 threads)
    const int c = threadIdx.x / 16, sub = threadIdx.x % 16;
    float v[PIECES][4];
    float big = 0.0f;
#pragma unroll
    for (int k = 0; k < PIECES; ++k) {
        const int u = sub + 16 * k;
        const u32x2 w = *(const u32x2*)(sm.q() + swizzled<N>(c, u / 2) + (u % 2) * 8);
        const u32 h[4] = {w.x & 0xffffu, w.x >> 16, w.y & 0xffffu, w.y >> 16};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            v[k][e] = half_to_float<BF16>(h[e]);
            big = fmaxf(big, fabsf(v[k][e]));
        }
    }
#pragma unroll
    for (int o = 1; o < 16; o *= 2) big = fmaxf(big, __shfl_xor_sync(0xffffffffu, big, o));
    int e = 0;  // a zero (padding) or non-finite column keeps its values as they are
    if (big > 0.0f && isfinite(big)) {
        int x;
        frexpf(big, &x);  // big in [2^(x - 1), 2^x)
        e = min(max(8 - x, -126), 126);
    }
    const float scale = pow2(e);
    named_barrier(4, CONSUMERS * 128);  // every piece read before any is rewritten
#pragma unroll
    for (int k = 0; k < PIECES; ++k) {
        const int u = sub + 16 * k;
        const u32 a = e4m3x2_split(v[k][0] * scale, v[k][1] * scale);
        const u32 b = e4m3x2_split(v[k][2] * scale, v[k][3] * scale);
        // Elements 4u .. 4u + 3: piece u / 4 of the row (16 codes), bytes 4 (u % 4) on.
        *(u32*)(sm.q() + swizzled<NX>(c, u / 4) + (u % 4) * 4) = (a & 0xffffu) | b << 16;
        *(u32*)(sm.q() + swizzled<NX>(N + c, u / 4) + (u % 4) * 4) = a >> 16 | (b & 0xffff0000u);
    }
    if (sub == 0) sm.unit()[c] = pow2(-e);
    fence_proxy_async();  // the terms are read by wgmma
}

/// fp8: where P^T's term element (column c, key k) lies in its tile (N rows of 64 bytes,
/// 64-byte swizzle; key k is the value product's fragment key k: value_fragments).
__device__ __forceinline__ u32 pt8_offset(int c, int k) {
    return swizzled64<N>(c, k / 16) + k % 16;
}

/// y[b] = byte b of x[0], x[1], x[2], x[3] (x[e]'s in byte e): a 4 x 4 byte transpose, eight prmt.
__device__ __forceinline__ void transpose4(const u32 (&x)[4], u32* y) {
    const u32 t0 = __byte_perm(x[0], x[1], 0x5140u), t1 = __byte_perm(x[0], x[1], 0x7362u);
    const u32 t2 = __byte_perm(x[2], x[3], 0x5140u), t3 = __byte_perm(x[2], x[3], 0x7362u);
    y[0] = __byte_perm(t0, t2, 0x5410u);
    y[1] = __byte_perm(t0, t2, 0x7632u);
    y[2] = __byte_perm(t1, t3, 0x5410u);
    y[3] = __byte_perm(t1, t3, 0x7632u);
}

/// fp8: this thread's A fragments of V^T for k-step kk (keys 32 kk .. 32 kk + 31 of the tile)
/// of MT of its OWN m-tiles (from m-tile MT part on), from the raw value chunk at `chunk`
/// (128-byte swizzle), of which this warp's 64 latent columns start at 16-byte piece `piece0`
/// (0 or 4). Fragment row g + 8 r of m-tile i (g = lane / 4) is the warp's column 8 g + 2 i + r,
/// so one load of a key (8 bytes for all 4 m-tiles, 4 for 2) holds its codes for every m-tile
/// it covers; a lane's fragment keys 16 h + 4 c + e (c = lane % 4) are those keys, so that a
/// warp's load reads keys 4 apart, two with each half of the swizzle (two bank passes for 8
/// bytes a lane, the fewest). Keys outside `keys` are zeros where `edge` (P is 0 there, and
/// 0 x a NaN code must not be NaN).
template <int MT>
__device__ __forceinline__ void value_fragments(u32 chunk, int piece0, int kk, int part, int lane, int first,
                                                const KeyRange& keys, bool edge, u32 (&a)[MT][4]) {
    static_assert(MT == 2 || MT == 4, "loads of 4 or 8 bytes a key");
    const int g = lane / 4, c = lane % 4;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        u32 w[MT / 2][4];  // word i of key e's codes
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int k = 32 * kk + 16 * h + 4 * c + e;
            const u32 at = chunk + swizzled<BN>(k, piece0 + g / 2) + (g % 2) * 8 + 2 * MT * part;
            const bool zero = edge && (first + k < keys.start || first + k >= keys.end);
            if constexpr (MT == 4) {
                const u32x2 v = ld_shared_u32x2(at);
                w[0][e] = zero ? 0u : v.x;
                w[1][e] = zero ? 0u : v.y;
            } else {
                const u32 v = ld_shared_u32(at);
                w[0][e] = zero ? 0u : v;
            }
        }
        u32 b[2 * MT];  // b[j]: byte j of the four keys (column 8 g + 2 MT part + j)
#pragma unroll
        for (int i = 0; i < MT / 2; ++i) transpose4(w[i], b + 4 * i);
#pragma unroll
        for (int i = 0; i < MT; ++i) {
            a[i][2 * h] = b[2 * i];          // row g
            a[i][2 * h + 1] = b[2 * i + 1];  // row g + 8
        }
    }
}

/// Where P^T's element (column c, key k) lives: row c of 64 keys (128 bytes), swizzled.
__device__ __forceinline__ u32 pt_offset(int c, int k) {
    return c * 128 + (((k / 8) ^ (c % 8)) * 16) + (k % 8) * 2;
}

}  // namespace

/// fp8: tile t's copies into its group of slots (t % TILE_GROUPS), by warp 0 of a consumer
/// warpgroup, once the group's previous tile (t - TILE_GROUPS) is released: lane 0 waits for
/// that, arms the group's "full" mbarrier with the tile's bytes and issues its CHUNKS chunks
/// from gather_blocks of the tile's lookups, `look`, which the caller started a tile ahead:
/// the block table's latency is then behind the computation, as in produce(). The
/// warpgroup's other warps wait for it at their next wgmma: a mbarrier a tile, not a chunk,
/// keeps this short. The page's boxes are worked out again here, a few instructions: the
/// caller's, kept live across the tile loop, spilled 16 bytes.
__device__ __forceinline__ void issue_tile(const TmaParams& np, const Smem& sm, int t, int first, const BoxLookup& look,
                                           u32 full, u32 empty) {
    const TileBoxes boxes(np.d.page_size);
    const TileBlocks blocks = gather_blocks(np.d, look, first, boxes);
    if (threadIdx.x % 32 == 0) {
        const int use = t / TILE_GROUPS, g = t % TILE_GROUPS;
        const u32 ring = smem_addr(sm.slot(g * CHUNKS));
        if (use > 0) mbar_wait(empty + 8 * g, (use - 1) & 1);
        mbar_expect_bytes(full + 8 * g, CHUNKS * CHUNK_BYTES);
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c) {
            copy_chunk<CHUNK_CODES>(&np.kv_map, blocks, boxes, ring + c * CHUNK_BYTES, full + 8 * g, c);
        }
    }
    __syncwarp();
}

/// fp8 (MLA_KV 2, 3): the consumers (kernel header). The two warpgroups take alternate tiles (tile
/// t: warpgroup t % 2), each with its own running maxima, sums and O^T of all L latent
/// columns (two halves of OWN m-tiles, value chunks 4 h2 + w4 of warp w4), merged at the
/// end: a tile's scores, softmax and products run beside the other warpgroup's tile instead
/// of both warpgroups doing the same steps at once. Every consumer thread calls it.
__device__ __forceinline__ void consume_fp8(const TmaParams& np, const Smem& sm, const Cols& cols, int req, int len,
                                            const KeyRange& keys, const KeyRange& common, int first0, int tiles,
                                            u32 full, u32 empty) {
    const DecodeParams& p = np.d;
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, wg = warp / 4, w4 = warp % 4;
    // Warp 0 of each warpgroup issues its own of the first TILE_GROUPS tiles (wg, wg + 2,
    // ...), then after each tile t tile t + TILE_GROUPS (its own too, into t's slots), its
    // lookups started a tile ahead.
    const TileBoxes boxes(p.page_size);
    BoxLookup look;
    if (w4 == 0) {
        for (int t = wg; t < min(tiles, TILE_GROUPS); t += CONSUMERS) {
            look.start(p, req, first0 + t * BN, boxes, keys, lane);
            issue_tile(np, sm, t, first0 + t * BN, look, full, empty);
        }
        look = BoxLookup{};
        if (wg + TILE_GROUPS < tiles) look.start(p, req, first0 + (wg + TILE_GROUPS) * BN, boxes, keys, lane);
    }
    const int key0 = 16 * w4 + lane / 4;  // this thread's keys in a tile: key0, key0 + 8
    const int splits = p.num_kv_splits;
    const float k_scale = read_k_scale(p, tid == 0 && blockIdx.x == 0 && blockIdx.y == 0);
    // This thread's columns: slot ci is CTA column column(ci, lane); its scores' scale
    // (k_scale and the column's q scale folded in).
    int lo[COLS], hi[COLS];
    float m[COLS], l[COLS], scale[COLS];
#pragma unroll
    for (int ci = 0; ci < COLS; ++ci) {
        const int c = column(ci, lane);
        const KeyRange k = cols.real(c) ? split_keys(token_keys(p, len, cols.tok0 + cols.nth(c)), blockIdx.y, splits)
                                        : KeyRange{0, 0};
        lo[ci] = k.start;
        hi[ci] = k.end;
        m[ci] = bits_to_float(0xff800000u);
        l[ci] = 0.0f;
        scale[ci] = p.scale_log2 * k_scale * sm.unit()[c];
    }
    float ot[2][OWN][N / 2];  // O^T, latent half h2 (value chunks 4 h2 .. 4 h2 + 3)
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
#pragma unroll
        for (int j = 0; j < OWN; ++j) {
#pragma unroll
            for (int i = 0; i < N / 2; ++i) ot[h2][j][i] = 0.0f;
        }
    }
    const u32 ring = smem_addr(sm.slot(0)), q_addr = smem_addr(sm.q()), pt = smem_addr(sm.pt(wg));
    const u32 red_base = smem_addr(sm.red(wg));
    const auto chunk = [&](int t, int c) -> u32 { return ring + ((t % TILE_GROUPS) * CHUNKS + c) * CHUNK_BYTES; };

    for (int t = wg; t < tiles; t += CONSUMERS) {
        const int first = first0 + t * BN;
        // S^T = K Q^T, q's two terms side by side (2N columns), once the tile has landed (one
        // mbarrier a tile): k-step j into chain j % FP8_CHAINS.
        float sch[FP8_CHAINS][N];  // 2N columns, N / 2 values each
#pragma unroll
        for (int h = 0; h < FP8_CHAINS; ++h) {
#pragma unroll
            for (int i = 0; i < N; ++i) sch[h][i] = 0.0f;
            fence_operands(sch[h]);
        }
        mbar_wait(full + 8 * (t % TILE_GROUPS), (t / TILE_GROUPS) & 1);
        wgmma_fence();  // after the divergent wait (else ptxas serializes every wgmma)
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c) {
            const u64 kd = smem_desc(chunk(t, c), 16, 1024);
            const u64 qd = opaque(smem_desc(q_addr + c * NX * 128, 16, 1024));
            // 4 k-steps of 32 codes a chunk; the last chunk's past D are not read.
            constexpr int LAST = (D - (CHUNKS - 1) * CHUNK_CODES) / 32;
#pragma unroll
            for (int k = 0; k < (c + 1 < CHUNKS ? CHUNK_CODES / 32 : LAST); ++k) {
                wgmma_m64n32k32_fp8<KV>(sch[(4 * c + k) % FP8_CHAINS], desc_at(kd, 32 * k), desc_at(qd, 32 * k), 1);
            }
        }
        wgmma_commit();
        wgmma_wait<0>();
        // A column's score: its hi column's plus its lo column's (N on).
        float st[N / 2];
#pragma unroll
        for (int i = 0; i < N / 2; ++i) {
            st[i] = 0.0f;
#pragma unroll
            for (int h = 0; h < FP8_CHAINS; ++h) st[i] += sch[h][i] + sch[h][i + N / 2];
        }

        // Softmax over the tile's keys, per column: mask, the column max across the four
        // warps (each holds 16 keys), P x P_SCALE as its two e4m3 terms into P^T. (Through
        // bases made opaque each tile: else the compiler keeps every column's addresses
        // live across the loop, which spilled.)
        const u32 red_at = opaque_u32(red_base), pt_at = opaque_u32(pt);
        const bool inside = first >= common.start && first + BN <= common.end;
        float cmax[COLS];
#pragma unroll
        for (int ci = 0; ci < COLS; ++ci) cmax[ci] = bits_to_float(0xff800000u);
#pragma unroll
        for (int i = 0; i < N / 2; ++i) {
            const int ci = slot(i);
            const int pos = first + key0 + row_step(i);
            if (!inside && (pos < lo[ci] || pos >= hi[ci])) st[i] = bits_to_float(0xff800000u);
            cmax[ci] = fmaxf(cmax[ci], st[i]);
        }
#pragma unroll
        for (int ci = 0; ci < COLS; ++ci) {
            cmax[ci] = fmaxf(cmax[ci], __shfl_xor_sync(0xffffffffu, cmax[ci], 4));
            cmax[ci] = fmaxf(cmax[ci], __shfl_xor_sync(0xffffffffu, cmax[ci], 8));
            cmax[ci] = fmaxf(cmax[ci], __shfl_xor_sync(0xffffffffu, cmax[ci], 16));
            if (lane < 4) st_shared_f32(red_at + 4 * (w4 * N + column(ci, lane)), cmax[ci]);
        }
        named_barrier(1 + wg, 128);
        float alpha[COLS], base[COLS];
#pragma unroll
        for (int ci = 0; ci < COLS; ++ci) {
            const int c = column(ci, lane);
            const u32 at = red_at + 4 * c;
            const float tmax = fmaxf(fmaxf(ld_shared_f32(at), ld_shared_f32(at + 4 * N)),
                                     fmaxf(ld_shared_f32(at + 8 * N), ld_shared_f32(at + 12 * N)));
            const float m_new = fmaxf(m[ci], tmax * scale[ci]);
            alpha[ci] = m_new == m[ci] ? 1.0f : exp2_approx(m[ci] - m_new);
            // A column with no key yet (its keys start later, or padding) keeps P = 0.
            base[ci] = m_new == bits_to_float(0xff800000u) ? 0.0f : m_new;
            m[ci] = m_new;
            l[ci] *= alpha[ci];
        }
        // Values i, i + 1 are columns 2c, 2c + 1 of one key: one split a pair.
#pragma unroll
        for (int i = 0; i < N / 2; i += 2) {
            float pv[2];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int ci = slot(i + e);
                pv[e] = exp2_approx(fmaf(st[i + e], scale[ci], -base[ci]));
                l[ci] += pv[e];
            }
            const u32 codes = e4m3x2_split(pv[0] * P_SCALE, pv[1] * P_SCALE);
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const u32 at = pt_at + pt8_offset(column(slot(i + e), lane), key0 + row_step(i));
                st_shared_u8(at, codes >> 8 * e);                 // hi
                st_shared_u8(at + N * 64, codes >> (16 + 8 * e));  // lo
            }
        }
        fence_proxy_async();
        named_barrier(1 + wg, 128);  // P^T complete for the products

        // O^T += V^T P^T MT m-tiles of a latent half at a time: A from the codes
        // (value_fragments), each P term a product into the part's tile accumulator, added to
        // O^T in f32 (fp8 wgmma keeps 13 of its bits: one tile's sums, not the split's, go
        // through it).
        const bool edge = first < keys.start || first + BN > keys.end;
        const u64 pd = opaque(smem_desc64(pt, 16, 512));
        // The lane made opaque each tile: else the fragments' swizzled offsets (lane-dependent,
        // a dozen) are computed once and kept across the loop, which spilled.
        const int lane_now = (int)opaque_u32((u32)lane);
        constexpr int MT = FP8_PART_TILES;
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) {
#pragma unroll
            for (int part = 0; part < OWN / MT; ++part) {
                u32 a[BN / 32][MT][4];
#pragma unroll
                for (int kk = 0; kk < BN / 32; ++kk) {
                    // This warp's 64 columns: half (OWN h2 + w4) % 2 of value chunk (OWN h2 + w4) / 2.
                    const int v64 = OWN * h2 + w4;
                    value_fragments<MT>(chunk(t, v64 / 2), 4 * (v64 % 2), kk, part, lane_now, first, keys, edge, a[kk]);
                }
                if (h2 == 1 && part == OWN / MT - 1) {  // this warp's reads of the tile are done
                    __syncwarp();
                    if (lane == 0) mbar_arrive(empty + 8 * (t % TILE_GROUPS));
                }
                float acc[MT][N / 2];
#pragma unroll
                for (int j = 0; j < MT; ++j) {
#pragma unroll
                    for (int i = 0; i < N / 2; ++i) acc[j][i] = 0.0f;
                    fence_operands(acc[j]);
                }
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < BN / 32; ++kk) {
#pragma unroll
                    for (int term = 0; term < 2; ++term) {
#pragma unroll
                        for (int j = 0; j < MT; ++j) {
                            wgmma_m64n16k32_rs_fp8<KV>(acc[j], a[kk][j], desc_at(pd, term * N * 64 + kk * 32), 1);
                        }
                    }
                }
                wgmma_commit();
                wgmma_wait<0>();
#pragma unroll
                for (int j = 0; j < MT; ++j) {
#pragma unroll
                    for (int i = 0; i < N / 2; ++i) {
                        float& o = ot[h2][MT * part + j][i];
                        o = fmaf(o, alpha[slot(i)], acc[j][i]);
                    }
                }
            }
        }
        // Tile t + TILE_GROUPS into this one's slots, and the lookups of this warpgroup's next.
        const int next = t + TILE_GROUPS;
        if (w4 == 0 && next < tiles) {
            issue_tile(np, sm, next, first0 + next * BN, look, full, empty);
            look = BoxLookup{};
            if (next + CONSUMERS < tiles) look.start(p, req, first0 + (next + CONSUMERS) * BN, boxes, keys, lane);
        }
    }

    // The merge: each warpgroup's sums over its warps and its maxima through shared memory;
    // its O^T times 2^(its max - the max of both) transposed through the ring (free once
    // both are done with their tiles); then o = the two summed, over the sums likewise scaled.
    // (Shared memory through a base made opaque here: else its addresses are computed before
    // the loop and kept across it.) The merge's barriers are phases of an mbarrier of every
    // thread's arrival: compute-sanitizer's racecheck follows those, where across the named
    // barrier of all 256 threads it reported the maxima's and sums' exchange (its known
    // trouble with warpgroups crossing named barriers of their own, here unevenly).
    const Smem fin{(unsigned char*)opaque((u64)sm.base)};
    const u32 merge = smem_addr(fin.merge_bar());
    const auto merge_sync = [merge](u32 phase) {
        mbar_arrive(merge);
        mbar_wait(merge, phase & 1);
    };
#pragma unroll
    for (int ci = 0; ci < COLS; ++ci) {
        l[ci] += __shfl_xor_sync(0xffffffffu, l[ci], 4);
        l[ci] += __shfl_xor_sync(0xffffffffu, l[ci], 8);
        l[ci] += __shfl_xor_sync(0xffffffffu, l[ci], 16);
    }
    merge_sync(0);  // both warpgroups are done with the ring, red and P^T
#pragma unroll
    for (int ci = 0; ci < COLS; ++ci) {
        const int c = column(ci, lane);
        if (lane < 4) {
            fin.red(wg)[w4 * N + c] = l[ci];
            if (w4 == 0) fin.maxima(wg)[c] = m[ci];
        }
    }
    merge_sync(1);  // both warpgroups' maxima and sums
    // 2^(this warpgroup's max - the max of both), 0 where it saw no key of the column.
    const auto weight = [&](int w, int c) {
        const float mw = fin.maxima(w)[c], mx = fmaxf(fin.maxima(0)[c], fin.maxima(1)[c]);
        return mw == bits_to_float(0xff800000u) ? 0.0f : exp2_approx(mw - mx);
    };
    float f[COLS];
#pragma unroll
    for (int ci = 0; ci < COLS; ++ci) f[ci] = weight(wg, column(ci, lane));
    float* out = fin.merged(wg);  // [N][LP]: this warpgroup's O^T, all L columns
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
#pragma unroll
        for (int j = 0; j < OWN; ++j) {
#pragma unroll
            for (int i = 0; i < N / 2; ++i) {
                // Row g + 8 r of m-tile j: column 8 g + 2 j + r of value chunk 4 h2 + w4.
                const int col = 64 * (OWN * h2 + w4) + 8 * (lane / 4) + 2 * j + row_step(i) / 8;
                out[column(slot(i), lane) * LP + col] = ot[h2][j][i] * f[slot(i)];
            }
        }
    }
    merge_sync(2);  // both warpgroups' O^T in the ring

    // O / l and the LSE, four latent columns a thread. (k_scale read again: kept across the
    // loop, it spilled.)
    const float out_scale = read_k_scale(p, false) / P_SCALE;
    for (int i = tid; i < N * (L / 4); i += CONSUMERS * 128) {
        const int c = i / (L / 4), col = 4 * (i % (L / 4));
        if (!cols.real(c)) continue;
        float sum = 0.0f;
#pragma unroll
        for (int w = 0; w < CONSUMERS; ++w) {
            const float* r = fin.red(w);
            sum += (r[c] + r[N + c] + r[2 * N + c] + r[3 * N + c]) * weight(w, c);
        }
        // A column with no key in the split (sum 0) gets o = 0 and lse = -inf (the combine
        // gives the split no weight); the values were codes times P x P_SCALE.
        const float inv = sum > 0.0f ? out_scale / sum : 0.0f;
        const f32x4 v0 = *(const f32x4*)(fin.merged(0) + c * LP + col);
        const f32x4 v1 = *(const f32x4*)(fin.merged(1) + c * LP + col);
        const float o[4] = {(v0.x + v1.x) * inv, (v0.y + v1.y) * inv, (v0.z + v1.z) * inv, (v0.w + v1.w) * inv};
        const int row = cols.row(c), head = cols.head(c);
        const i64 at = grid_at(p, row, head);
        store_pairs<BF16, L, 2, 2>(p, at, row, head, col, [&](int i, int e) { return o[2 * i + e]; });
        if (col == 0) {
            const float mx = fmaxf(fin.maxima(0)[c], fin.maxima(1)[c]);
            store_lse(p, at, row, head, (mx + log2_approx(sum)) * LN2);
        }
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) mla_decode_narrow(const __grid_constant__ TmaParams np) {
    const DecodeParams& p = np.d;
    allow_dependent_launch();  // the combine may start launching (it waits for our writes)
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const Smem sm{(unsigned char*)(((u64)smem_raw + ALIGN - 1) & ~(u64)(ALIGN - 1))};
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int pack = p.tokens_per_cta;  // the host packs only when heads * pack <= N
    const int token_blocks = (p.query_len + pack - 1) / pack;
    const int req = blockIdx.x / token_blocks;
    const int tok0 = blockIdx.x % token_blocks * pack;
    const Cols cols{req * p.query_len + tok0, tok0, min(pack, p.query_len - tok0), p.heads};
    const int splits = p.num_kv_splits;

    const int len = request_len(p, req, tid == 0 && blockIdx.y == 0);
    const TokensKeys cta = tokens_keys(p, len, cols.tok0, cols.tokens, blockIdx.y, splits);
    const KeyRange keys = cta.keys, common = cta.common;
    if (keys.start >= keys.end) {
        if (splits == 1) {
            for (int t = 0; t < cols.tokens; ++t) write_empty<N, THREADS, L>(p, cols.row0 + t, 0);
        } else {  // stage 2 gives the split no weight
            write_empty_split<N, THREADS>(p, [&](int c) { return cols.real(c) ? grid_at(p, cols.row(c), cols.head(c)) : -1; });
        }
        return;
    }
    const int first0 = keys.start - keys.start % BN;
    const int tiles = (keys.end - first0 + BN - 1) / BN;

    const u32 full = smem_addr(sm.full()), empty = smem_addr(sm.empty());
    if (tid == 0) {
        for (int s = 0; s < SLOTS; ++s) {
            mbar_init(full + 8 * s, FP8 && s == SLOTS - 1 ? CONSUMERS * 128 : 1);
            // Every consumer warp reads each chunk; fp8 counts whole tiles (the first
            // TILE_GROUPS), each read by the four warps of one warpgroup.
            mbar_init(empty + 8 * s, FP8 ? 4 : 4 * CONSUMERS);
        }
        mbar_fence_init();
    }
    __syncthreads();  // the mbarriers are ready: the producer starts while q loads

    // (fp8 has no producer warpgroup: THREADS stops at the consumers.)
    if (!FP8 && warp >= PRODUCER_WARP) {
        // The producer warpgroup ends here: the consumers merge and write. (Code after its
        // setmaxnreg.dec must fit the registers it kept, so it shares none of theirs.)
        set_max_registers<false, PRODUCER_REGS>();
        if (warp == PRODUCER_WARP) produce(np, sm, req, first0, tiles, keys);
        return;
    }
    if (!FP8) set_max_registers<true, CONSUMER_REGS>();
    load_q(p, sm, cols);
    named_barrier(4, CONSUMERS * 128);  // q landed for both consumer warpgroups
    if (FP8) {
        split_q(sm);
        named_barrier(4, CONSUMERS * 128);  // q's terms written
        consume_fp8(np, sm, cols, req, len, keys, common, first0, tiles, full, empty);
        return;
    }
    const int wg = warp / 4, w4 = warp % 4;
    const int key0 = 16 * w4 + lane / 4;  // this thread's keys in a tile: key0, key0 + 8
    // This thread's columns: slot ci is CTA column column(ci, lane).
    int lo[COLS], hi[COLS];
    float m[COLS], l[COLS];
#pragma unroll
    for (int ci = 0; ci < COLS; ++ci) {
        const int c = column(ci, lane);
        const KeyRange k = cols.real(c) ? split_keys(token_keys(p, len, cols.tok0 + cols.nth(c)), blockIdx.y, splits)
                                        : KeyRange{0, 0};
        lo[ci] = k.start;
        hi[ci] = k.end;
        m[ci] = bits_to_float(0xff800000u);
        l[ci] = 0.0f;
    }
    float ot[OWN][N / 2];  // O^T of this warpgroup's value chunks OWN wg .. OWN wg + OWN - 1
#pragma unroll
    for (int j = 0; j < OWN; ++j) {
#pragma unroll
        for (int i = 0; i < N / 2; ++i) ot[j][i] = 0.0f;
    }
    const u32 ring = smem_addr(sm.slot(0)), q_addr = smem_addr(sm.q()), pt = smem_addr(sm.pt(wg));
    const float sc = p.scale_log2;
    float* red = sm.red(wg);
    // Chunk c of tile t: its ring slot.
    const auto operand = [&](int t, int c) -> u32 { return ring + ((t * CHUNKS + c) % SLOTS) * CHUNK_BYTES; };

    for (int t = 0; t < tiles; ++t) {
        const int first = first0 + t * BN;
        // S^T = K Q^T, chunk by chunk as the copies land (both warpgroups: each needs P), in
        // S_CHAINS independent accumulators (chunk c into chain c % S_CHAINS) so that the 36
        // products are not one chain of dependent wgmma.
        float sch[S_CHAINS][N / 2];
#pragma unroll
        for (int h = 0; h < S_CHAINS; ++h) {
#pragma unroll
            for (int i = 0; i < N / 2; ++i) sch[h][i] = 0.0f;
            fence_operands(sch[h]);
        }
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c) {
            const int g = t * CHUNKS + c;
            mbar_wait(full + 8 * (g % SLOTS), (g / SLOTS) & 1);
            // After the (divergent) wait, a fence of our own: else ptxas inserts one where it
            // serializes every wgmma.
            wgmma_fence();
            const u64 kd = smem_desc(operand(t, c), 16, 1024);
            const u64 qd = opaque(smem_desc(q_addr + c * N * 128, 16, 1024));
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                wgmma_m64nNk16_ss<N, BF16, 0>(sch[c % S_CHAINS], desc_at(kd, 32 * k), desc_at(qd, 32 * k), 1);
            }
        }
        wgmma_commit();
        wgmma_wait<0>();
        float st[N / 2];
#pragma unroll
        for (int i = 0; i < N / 2; ++i) {
            st[i] = sch[0][i];
#pragma unroll
            for (int h = 1; h < S_CHAINS; ++h) st[i] += sch[h][i];
        }
        // Done with the chunks this warpgroup does not multiply by P: the rotary one and the
        // other warpgroup's values.
        if (lane == 0) {
#pragma unroll
            for (int c = 0; c < CHUNKS; ++c) {
                if (c / OWN != wg) mbar_arrive(empty + 8 * ((t * CHUNKS + c) % SLOTS));
            }
        }

        // Softmax over the tile's keys, per column (the same in both warpgroups): mask, the
        // column max across the four warps (each holds 16 keys), P^T = 2^(S scale - m)
        // rounded into shared memory.
        const bool inside = first >= common.start && first + BN <= common.end;
        float cmax[COLS];
#pragma unroll
        for (int ci = 0; ci < COLS; ++ci) cmax[ci] = bits_to_float(0xff800000u);
#pragma unroll
        for (int i = 0; i < N / 2; ++i) {
            const int ci = slot(i);
            const int pos = first + key0 + row_step(i);
            if (!inside && (pos < lo[ci] || pos >= hi[ci])) st[i] = bits_to_float(0xff800000u);
            cmax[ci] = fmaxf(cmax[ci], st[i]);
        }
#pragma unroll
        for (int ci = 0; ci < COLS; ++ci) {
            cmax[ci] = fmaxf(cmax[ci], __shfl_xor_sync(0xffffffffu, cmax[ci], 4));
            cmax[ci] = fmaxf(cmax[ci], __shfl_xor_sync(0xffffffffu, cmax[ci], 8));
            cmax[ci] = fmaxf(cmax[ci], __shfl_xor_sync(0xffffffffu, cmax[ci], 16));
            if (lane < 4) red[w4 * N + column(ci, lane)] = cmax[ci];
        }
        named_barrier(1 + wg, 128);
        float alpha[COLS], base[COLS];
#pragma unroll
        for (int ci = 0; ci < COLS; ++ci) {
            const int c = column(ci, lane);
            const float tmax = fmaxf(fmaxf(red[c], red[N + c]), fmaxf(red[2 * N + c], red[3 * N + c]));
            const float m_new = fmaxf(m[ci], tmax * sc);
            alpha[ci] = m_new == m[ci] ? 1.0f : exp2_approx(m[ci] - m_new);
            // A column with no key yet (its keys start later, or padding) keeps P = 0.
            base[ci] = m_new == bits_to_float(0xff800000u) ? 0.0f : m_new;
            m[ci] = m_new;
            l[ci] *= alpha[ci];
        }
        unsigned char* ptp = sm.pt(wg);
#pragma unroll
        for (int i = 0; i < N / 2; ++i) {
            const int ci = slot(i);
            const float pv = exp2_approx(fmaf(st[i], sc, -base[ci]));
            l[ci] += pv;
            *(u16*)(ptp + pt_offset(column(ci, lane), key0 + row_step(i))) = (u16)pack2<BF16>(pv, 0.0f);
        }
        // Keys of the tile outside every column's range: zero their values in this warpgroup's
        // chunks (P is 0 there, and 0 x garbage must not be NaN).
        if (first < keys.start || first + BN > keys.end) {
            for (int i = tid % 128; i < BN * OWN * 8; i += 128) {
                const int key = i / (OWN * 8), jc = OWN * wg + (i / 8) % OWN;
                const int pos = first + key;
                if (pos >= keys.start && pos < keys.end) continue;
                *(u32x4*)(sm.slot((t * CHUNKS + jc) % SLOTS) + key * 128 + (i % 8) * 16) = u32x4{0u, 0u, 0u, 0u};
            }
        }
        fence_proxy_async();
        named_barrier(1 + wg, 128);  // P^T (and the zeros) complete for the products

        bool moved = false;
#pragma unroll
        for (int ci = 0; ci < COLS; ++ci) moved |= alpha[ci] != 1.0f;
        if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
            for (int j = 0; j < OWN; ++j) {
#pragma unroll
                for (int i = 0; i < N / 2; ++i) ot[j][i] *= alpha[slot(i)];
            }
        }
        // O^T += V^T P^T for this warpgroup's value chunks (64 latent columns x 64 keys each,
        // read MN-major); a commit group per chunk so that each is released as soon as its
        // products are done.
        const u64 pd = opaque(smem_desc(pt, 16, 1024));
        wgmma_fence();
#pragma unroll
        for (int j = 0; j < OWN; ++j) {
            const u64 vd = smem_desc(operand(t, OWN * wg + j), CHUNK_BYTES, 1024);
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) {
                wgmma_m64nNk16_ss<N, BF16, 1>(ot[j], desc_at(vd, kk * 2048), desc_at(pd, kk * 32), 1);
            }
            wgmma_commit();
        }
        release_values<0>(empty, t * CHUNKS + OWN * wg, lane);
    }

    // The row sums: this thread's keys reduced over the warp (lanes with the same lane % 4),
    // then over the four warps through shared memory, with the maxima beside them; O^T / l
    // transposed through the ring (free once both warpgroups are done with it) so that the
    // writes are whole rows of this warpgroup's L / 2 columns.
#pragma unroll
    for (int ci = 0; ci < COLS; ++ci) {
        l[ci] += __shfl_xor_sync(0xffffffffu, l[ci], 4);
        l[ci] += __shfl_xor_sync(0xffffffffu, l[ci], 8);
        l[ci] += __shfl_xor_sync(0xffffffffu, l[ci], 16);
    }
    named_barrier(3, CONSUMERS * 128);  // both warpgroups are done with the ring, red and P^T
#pragma unroll
    for (int ci = 0; ci < COLS; ++ci) {
        const int c = column(ci, lane);
        if (lane < 4) {
            red[w4 * N + c] = l[ci];
            if (w4 == 0) sm.maxima(wg)[c] = m[ci];
        }
    }
    float* out = sm.merged(wg);  // [N][LP]: this warpgroup's columns, unnormalized
#pragma unroll
    for (int j = 0; j < OWN; ++j) {
#pragma unroll
        for (int i = 0; i < N / 2; ++i) {
            out[column(slot(i), lane) * LP + 64 * j + key0 + row_step(i)] = ot[j][i];
        }
    }
    named_barrier(1 + wg, 128);

    // O / l and the LSE, four latent columns a thread.
    for (int i = tid % 128; i < N * (HALF / 4); i += 128) {
        const int c = i / (HALF / 4), col = 4 * (i % (HALF / 4));
        if (!cols.real(c)) continue;
        const float sum = red[c] + red[N + c] + red[2 * N + c] + red[3 * N + c];
        // A column with no key in the split (sum 0) gets o = 0 and lse = -inf (the combine
        // gives the split no weight).
        const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
        const f32x4 v = *(const f32x4*)(out + c * LP + col);
        const float o[4] = {v.x * inv, v.y * inv, v.z * inv, v.w * inv};
        const int row = cols.row(c), head = cols.head(c), at_col = HALF * wg + col;
        const i64 at = grid_at(p, row, head);
        store_pairs<BF16, L, 2, 2>(p, at, row, head, at_col, [&](int i, int e) { return o[2 * i + e]; });
        if (at_col == 0) store_lse(p, at, row, head, (sm.maxima(wg)[c] + log2_approx(sum)) * LN2);
    }
}
