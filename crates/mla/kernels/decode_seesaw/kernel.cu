/**
 * @file decode_seesaw/kernel.cu
 * @brief Stage 1 of the split-KV decode on Hopper (sm_90a) for a cache in the model dtype:
 * one CTA attends the 64 heads of one query row to the keys of one split, two 64-key tiles a
 * step, its two warpgroups taking turns ("seesaw") so that one's softmax runs while the
 * other's products keep the tensor cores busy, the keys streamed by TMA chunk by chunk.
 *
 * Outputs, grid and workspace are decode_wgmma's (grid x = row * head_blocks + head_block, y
 * = split; packed, request x token blocks), so the plan, the workspace and the combine are
 * shared. NOTES.md beside this file has the design and the measurements.
 *
 * The 64 x L f32 output takes half the register file, so it is split by columns: warpgroup w
 * holds O's columns 256 w .. 256 w + 255 (O_w, 128 registers a thread). A step takes tiles
 * t0 (stage K0) and t1 = t0 + 1 (stage K1); S_i = Q K_i^T, P_i = 2^(S_i scale - m), V_i =
 * the first L columns of K_i, V_iw its columns of warpgroup w.
 *   warpgroup 0: S0 (computed the step before) -> m0 = max(m, rowmax S0) -> hand-over 1 ->
 *                O_0 *= 2^(m - m0), P0 into registers -> O_0 += P0 V00 (P0 from registers)
 *                -> K0's first half is read: its copies of tile t0 + 2 -> hand-over 2 -> P0
 *                *= 2^(m0 - m1) where a row's max moved, to shared memory -> hand-over 3 ->
 *                O_0 *= 2^(m0 - m1) -> hand-over 4 -> O_0 += P1 V10 and right behind it S0
 *                of tile t0 + 2 over K0's first half -> K1's first half is read: its copies
 *                of tile t1 + 2 -> the rest of S0, chunk by chunk as it lands.
 *   warpgroup 1: hand-over 1 -> m1 = max(m0, rowmax S1) -> hand-over 2 -> P1 into registers
 *                and to shared memory, O_1 *= 2^(m - m1) -> O_1 += P1 V11 (P1 from registers)
 *                -> hand-over 3 -> O_1 += P0 V01 -> hand-over 4 -> K1's second half and
 *                rotary chunk, then K0's second half and rotary chunk (P0's place) are read:
 *                their copies -> S1 of tile t1 + 2, K1's second half first.
 * This is FlashMLA's order (its wg0_subroutine and wg1_subroutine) but for the hand-over of m1
 * before P1 is computed. The hand-overs are mbarriers of 128 arrivals (the producing
 * warpgroup's threads): 1 carries m0 and 2^(m - m0), 2 m1 and 2^(m0 - m1), 3 the rescaled P0,
 * 4 P1 (and that P0 V01 is in the tensor cores' queue ahead of P1 V10). Both warpgroups' outputs
 * and row sums are relative to the same running max (in shared memory), so at the end the
 * two sums add and each warpgroup writes its columns. P is rounded at its own tile's running
 * max (P0 again where warpgroup 1's tile moved a row's max); the row sums keep the unrounded
 * values.
 *
 * Shared memory: q (64 x D) and two key stages (64 x D each), in wgmma's 128-byte swizzle,
 * as the TMA unit lands 64-column chunks of 8 KB, and P1 (64 x 64); P0 takes the place of
 * K0's rotary chunk, which only the scores read (a tile of its own would not fit in the 227
 * KB a CTA may take). An mbarrier per chunk and stage: the scores start on each chunk as it
 * lands, and each chunk is copied again as soon as its last reader is done. Tiles start at
 * multiples of 64 keys (a split's first tile may begin before its keys), so a tile never
 * straddles a page of 64 keys or more and pages of 8, 16 or 32 keys fill it whole; keys of a
 * tile outside the split are masked in the scores and zeroed in the value chunks before P V
 * (P is 0 there, and 0 x garbage must not be NaN). Pages past the block table or with a bad
 * block id are never read (block coordinate -1, which the TMA unit fills with zeros; a bad id
 * raises the error flag).
 *
 * fp8 caches (MLA_KV 2, 3): each chunk's codes land by TMA, unswizzled, in the upper half of
 * the chunk's place, and the warpgroup whose scores wait for the chunk rewrites it there as
 * the f16 of its codes in the 128-byte swizzle (every code read, a barrier, every f16
 * written; two chunks a round, scores()), the tile then multiplied as a cache in the model
 * dtype: the same two-tile order and the same tensor-core work as a 16-bit cache, for half
 * its bytes. The products run in f16, as the other kernels' fp8 paths do (common/fp8.cuh,
 * "Products in f16"): q rewritten once as f16 times a power of two, P rounded to f16,
 * k_scale on the scores and the output.
 *
 * Registers are what the design is held to: the outputs take 128 a thread, a tile's scores
 * 32. Shared memory is reached through 32-bit addresses from a base made opaque every step
 * (else the compiler keeps dozens of 64-bit addresses live across the loop and spills).
 *
 * Compile-time configuration (-D):
 *   MLA_L, MLA_R  latent and rotary widths (L = 512, R = 64: 8 value chunks and one rotary)
 *   MLA_BF16      1: the model dtype (q, P, o) is bf16, 0: f16
 *   MLA_KV        0: the cache in the model dtype (the keys land as the products read them);
 *                 2: fp8 e4m3, 3: fp8 e5m2 (see "fp8 caches" below)
 *   MLA_PACK      1: the CTA's rows are `tokens_per_cta` query tokens x heads of one request
 *                 (multi-token decodes of few heads: one read of the keys for every token),
 *                 each row masked to its own token's keys, which shared memory holds for the
 *                 masked tiles (registers have no room for them)
 *   MLA_SCHED     1 (unpacked only): the argument is a TmaScheduleParams, the grid (CTAs, head
 *                 blocks); each persistent CTA walks the device schedule's pieces
 *                 (common/schedule.cuh), the mbarriers set up again after each piece
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
constexpr int KV = MLA_KV;
constexpr bool FP8 = KV >= 2;
// The products' 16-bit type: the model dtype, or f16 for fp8 codes (exact for every code).
constexpr bool MMA_BF16 = BF16 && !FP8;
constexpr bool PACK = MLA_PACK != 0;
constexpr int L = MLA_L;
constexpr int D = L + MLA_R;
constexpr int M = 64;                    // rows (heads of one query row) a CTA: wgmma's M
constexpr int BN = TMA_TILE;             // keys a tile
constexpr int THREADS = 256;             // two warpgroups
constexpr int CHUNKS = D / 64;           // 64-column chunks of a key row
constexpr int ROTARY = CHUNKS - 1;       // the rotary chunk, then P's place
constexpr int HALF = L / 128;            // value chunks a warpgroup multiplies by P
constexpr int COLS = L / 2;              // output columns a warpgroup holds
constexpr int CHUNK_BYTES = BN * 128;    // a chunk of a tile (or of q, or P), swizzled
constexpr int TILE_BYTES = CHUNKS * CHUNK_BYTES;
constexpr int STAT_BYTES = 5 * M * 4;    // running max, the two rescales, the two row sums
constexpr int BAR_BYTES = (2 * CHUNKS + 5) * 8;  // a chunk's of each stage, 4 hand-overs, the sums'
// Packed: each row's keys, then the common ones; scheduled: the piece's job, slot and splits.
constexpr int RANGE_BYTES = PACK ? (M + 1) * 8 : MLA_SCHED ? 16 : 0;
constexpr int ALIGN = 1024;
constexpr float LN2 = 0.69314718055994530942f;

static_assert(L == 512 && D == L + 64, "L = 512 and one rotary chunk (R = 64)");
static_assert(CHUNKS == 2 * HALF + 1, "value chunks split between the warpgroups, then the rotary one");
static_assert(KV == 0 || FP8, "a cache in the model dtype or fp8");
// fp8: a chunk's codes land in the upper half of its place, 64 bytes a key, unswizzled.
constexpr int CODES_AT = FP8 ? CHUNK_BYTES / 2 : 0;
constexpr int LANDED_BYTES = FP8 ? CHUNK_BYTES / 2 : CHUNK_BYTES;  // a chunk's copied bytes
constexpr int BOX_ROW_BYTES = FP8 ? 64 : 128;                      // a key's bytes in a box
static_assert(!(MLA_SCHED && PACK), "the schedule's jobs are single tokens (and range() and piece() share a place)");

/// The CTA's shared memory as 32-bit shared addresses.
struct Smem {
    u32 base;  // 1024-byte aligned
    __device__ u32 q() const { return base; }
    __device__ u32 k(int st) const { return base + (1 + st) * TILE_BYTES; }
    /// P of tile t0 where its rotary chunk was, and of tile t1 (a tile of its own).
    __device__ u32 p(int st) const { return st == 0 ? k(0) + ROTARY * CHUNK_BYTES : base + 3 * TILE_BYTES; }
    __device__ u32 max(int r) const { return base + 3 * TILE_BYTES + CHUNK_BYTES + 4 * r; }  // base 2, scaled
    __device__ u32 scale0(int r) const { return max(M + r); }                 // 2^(m - m0)
    __device__ u32 scale1(int r) const { return max(2 * M + r); }             // 2^(m0 - m1)
    __device__ u32 sums(int wg, int r) const { return max((3 + wg) * M + r); }
    /// fp8: the scores' scale, in the row sums' place until the epilogue.
    __device__ u32 scale_at() const { return sums(1, 0); }
    __device__ u32 bar(int st, int c) const { return max(5 * M) + 8 * (st * CHUNKS + c); }
    /// Hand-over k's mbarrier (1 .. 4: see the file's note; 128 arrivals a phase).
    __device__ u32 hand(int k) const { return bar(2, k - 1); }
    /// The row sums' exchange at the end (256 arrivals).
    __device__ u32 sums_ready() const { return bar(2, 4); }
    /// Packed: the keys tile row r sees (start, end), and at r = M the keys every row sees,
    /// written once before the loop.
    __device__ u32 range(int r) const { return bar(2, 5) + 8 * r; }
    /// Scheduled: the piece's job, slot and split count, for the epilogue (no register is
    /// left to keep them across the loop).
    __device__ u32 piece() const { return bar(2, 5); }
    /// The same addresses, computed afresh where they are used (see the file's note).
    __device__ Smem fresh() const { return Smem{opaque_u32(base)}; }
};

}  // namespace

/// Shared memory the kernel needs (the host checks it against its own count).
extern "C" __constant__ int mla_decode_smem_bytes =
    ALIGN + 3 * TILE_BYTES + CHUNK_BYTES + STAT_BYTES + BAR_BYTES + RANGE_BYTES;
static_assert(StagedRows<BF16, L>::bytes(M) <= 3 * TILE_BYTES, "the outputs' staging tile fits over q and the tiles");

namespace {

/// The CTA's rows (common/schedule.cuh): tokens x heads packed, or heads of one token.
using Rows = CtaRows<PACK, M>;

/// q of the CTA's rows (padding rows zero), swizzled, by every thread (cp.async, one commit
/// group).
__device__ __forceinline__ void load_q(const DecodeParams& p, const Smem& sm, const Rows& rows, int tid) {
    copy_q<M, L, D, THREADS>(p, sm.q(), tid, [&](int r, int& q_row, int& head) {
        q_row = rows.row(r);
        head = rows.head(r);
        return rows.real(r, p);
    });
    cp_async_commit();
}

/// Packed: the keys this thread's rows (r0, r0 + 8) see, from shared memory (a padding row the
/// CTA's, so that its scores, 0, keep a finite max as an unpacked kernel's padding heads do).
__device__ __forceinline__ void row_ranges(const Smem& sm, int r0, KeyRange (&k)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const u32 at = sm.range(r0 + 8 * h);
        k[h] = KeyRange{(int)ld_shared_u32(at), (int)ld_shared_u32(at + 4)};
    }
}

/// The issuing lane's box of a tile (lane b: box b, TileBoxes' split of a 64-key tile) as the
/// loop walks its tiles: the box's page in the request's row of the block table and its first
/// key's slot there, advanced without a division (tiles start at multiples of 64 keys and a
/// page holds a divisor or a multiple of 64 keys), and its entry, read ahead of the copies.
/// The issuing lanes belong to the warpgroups' critical path: a division a tile (and the
/// box's rule recomputed at each issue) cost them about 800 cycles a step (NOTES.md).
struct Box {
    int page, slot;     // slot: on pages of more than 64 keys (one box a tile); else 0
    int entry = 0;      // the table's entry, once read
    bool has = false;   // whether the box has one (box_entry's rule)

    __device__ Box(const DecodeParams& p, int first, const TileBoxes& boxes, int lane)
        : page(page_of(p, first + lane * boxes.box)), slot(slot_of(p, first + lane * boxes.box)) {}

    /// The same box two tiles on.
    __device__ void skip_two(const DecodeParams& p, const TileBoxes& boxes) {
        if (p.page_size <= TMA_TILE) {
            page += 2 * boxes.count;
        } else {
            slot += 2 * TMA_TILE;
            if (slot >= p.page_size) {
                slot -= p.page_size;
                ++page;
            }
        }
    }

    /// Starts the read of its entry in the tile from `first` (box_entry's rule, on the page kept).
    __device__ void read(const DecodeParams& p, int req, int first, const TileBoxes& boxes, const KeyRange& keys,
                         int lane) {
        i64 at;
        has = box_holds_keys(first, boxes, keys, lane) && page_entry(p, req, page, at);
        entry = has ? p.block_table[at] : 0;
    }

    /// Its copies' block coordinate (box_block's).
    __device__ int block(const DecodeParams& p) const { return box_block(p, has, entry); }
};

/// The copies of chunks [C0, C1), and the rotary chunk with ROT, of the tile in `box` into
/// stage `st`, each completing on its chunk's mbarrier, which lane 0 arms with the chunk's
/// bytes. The whole warp calls it; lane b copies box b of each chunk, so that no lane gathers
/// the tile's block ids (registers the kernel lacks).
template <int C0, int C1, bool ROT>
__device__ __forceinline__ void issue(const DecodeParams& p, const TensorMap* map, const Smem& sm, int st,
                                      const TileBoxes& boxes,
                                      const Box& box, int lane) {
    const int block = box.block(p);
    if (lane == 0) {
#pragma unroll
        for (int c = C0; c < C1 + (ROT ? 1 : 0); ++c) mbar_expect_bytes(sm.bar(st, c < C1 ? c : ROTARY), LANDED_BYTES);
    }
    __syncwarp();
    if (lane < boxes.count) {
#pragma unroll
        for (int c = C0; c < C1 + (ROT ? 1 : 0); ++c) {
            const int chunk = c < C1 ? c : ROTARY;
            tma_load_3d(sm.k(st) + chunk * CHUNK_BYTES + CODES_AT + lane * boxes.box * BOX_ROW_BYTES, map,
                        sm.bar(st, chunk),
                        chunk * 64, box.slot, block);
        }
    }
}

/// fp8: the codes of `n` (1 or 2, known once the loop is unrolled) chunks from `chunk`, each
/// one's landed at CODES_AT, 64 bytes a key: this thread's share, 16-byte pieces wt and
/// wt + 128 of each (key i / 4, codes 16 (i % 4) ..).
__device__ __forceinline__ void load_codes(u32x4 (&in)[2][2], u32 chunk, int wt, int n) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        if (i < n) {
#pragma unroll
            for (int h = 0; h < 2; ++h) in[i][h] = ld_shared_u32x4(chunk + i * CHUNK_BYTES + CODES_AT + 16 * (wt + 128 * h));
        }
    }
}

/// fp8: load_codes' pieces of `n` chunks written back as f16 in the 128-byte swizzle, each two
/// pieces of f16 in its key's row (over other keys' codes: every thread of the warpgroup must
/// have read its codes first).
__device__ __forceinline__ void store_f16(const u32x4 (&in)[2][2], u32 chunk, int wt, int n) {
    // Key wt / 4 + 32 h swizzles as key wt / 4 (32 rows on), and piece g + 1 (g even) sits at
    // piece g's place with bit 4 flipped (the chunk is 1024-byte aligned).
    const u32 at = chunk + swizzled<BN>(wt / 4, 2 * (wt % 4));
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        if (i < n) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const u32 step = i * CHUNK_BYTES + h * 32 * 128;
                st_shared_u32x4(at + step, fp8x8_to_f16<KV>(u32x2{in[i][h].x, in[i][h].y}));
                st_shared_u32x4((at ^ 16u) + step, fp8x8_to_f16<KV>(u32x2{in[i][h].z, in[i][h].w}));
            }
        }
    }
}

/// The copies of `n` chunks from chunk `c` of stage `st` landed.
__device__ __forceinline__ void wait_chunks(const Smem& sm, int st, int c, int n, u32 parity) {
#pragma unroll
    for (int i = 0; i < n; ++i) mbar_wait(sm.bar(st, c + i), parity);
}

/// fp8: the chunk at `chunk` rewritten in place as the f16 of its codes by the 128 threads of
/// warpgroup `wg` (`wt`: this one's index), fenced for wgmma: every code read before a
/// barrier, every f16 written after it, and a second barrier publishes them.
__device__ __forceinline__ void codes_to_f16(u32 chunk, int wg, int wt) {
    u32x4 in[2][2];
    load_codes(in, chunk, wt, 1);
    named_barrier(1 + wg, 128);
    store_f16(in, chunk, wt, 1);
    fence_proxy_async();
    named_barrier(1 + wg, 128);
}

/// Chunks a round of scores converts together (fp8): two, but for packed rows (their masks
/// leave no registers for a second chunk's codes: the f16 variant spilled); else one, so that
/// each chunk's products start as it lands.
constexpr int SCORE_GROUP = FP8 && !PACK ? 2 : 1;

/// S = Q K^T over chunks [C0, C1) of stage `st` (added to S with ADD, else S starts at C0),
/// each as its copies land (`parity`: the stage's use count % 2), in the caller's commit group;
/// fp8 codes rewritten as f16 first, by the calling warpgroup `wg` (`wt`: the thread's index
/// in it). Two chunks a round (SCORE_GROUP 2): what a round costs is latency (the loads' return,
/// the fence's wait for the stores, the barrier: Nsight Compute, NOTES.md), so a round converts
/// a pair, and reads the next pair's codes before its barrier, which then also stands for
/// theirs: one barrier a pair, and the loads' latency under the fence's.
template <int C0, int C1, bool ADD>
__device__ __forceinline__ void scores(float (&s)[32], const Smem& sm, int st, u32 parity, int wg, int wt) {
    [[maybe_unused]] u32x4 in[2][2];  // SCORE_GROUP 2: the codes of the pair next converted
#pragma unroll
    for (int c = C0; c < C1; ++c) {
        if constexpr (SCORE_GROUP == 1) {
            mbar_wait(sm.bar(st, c), parity);
            if (FP8) codes_to_f16(sm.k(st) + c * CHUNK_BYTES, wg, wt);
            // After the (divergent) wait, a fence of our own: else ptxas inserts one where it
            // serializes every wgmma.
            wgmma_fence();
        } else if ((c - C0) % 2 == 0) {
            // This pair's chunks and the next pair's (1 or 2 each, 0 past C1).
            const u32 chunk = sm.k(st) + c * CHUNK_BYTES;
            const int n = min(2, C1 - c), next = min(2, C1 - c - 2);
            if (c == C0) {
                wait_chunks(sm, st, c, n, parity);
                load_codes(in, chunk, wt, n);
                named_barrier(1 + wg, 128);
            }
            store_f16(in, chunk, wt, n);
            if (next > 0) {
                wait_chunks(sm, st, c + 2, next, parity);
                load_codes(in, chunk + 2 * CHUNK_BYTES, wt, next);
            }
            fence_proxy_async();
            named_barrier(1 + wg, 128);
            wgmma_fence();
        }
        const u64 qd = opaque(smem_desc(sm.q() + c * CHUNK_BYTES, 16, 1024));
        const u64 kd = opaque(smem_desc(sm.k(st) + c * CHUNK_BYTES, 16, 1024));
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            wgmma_m64n64k16_ss<MMA_BF16>(s, desc_at(qd, 32 * kk), desc_at(kd, 32 * kk), ADD || c > C0 || kk > 0);
        }
    }
}

/// O += P V over the HALF value chunks at `v` (this warpgroup's half of a stage), P from the
/// swizzled 64 x 64 tile at `p` (the other warpgroup's), in one commit group.
__device__ __forceinline__ void pv(float (&o)[COLS / 2], u32 p, u32 v) {
    const u64 pd = opaque(smem_desc(p, 16, 1024)), vd = opaque(smem_desc(v, CHUNK_BYTES, 1024));
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
        wgmma_m64n256k16_ss<MMA_BF16>(o, desc_at(pd, 32 * kk), desc_at(vd, kk * 2048), 1);
    }
    wgmma_commit();
}

/// O += P V as pv, P this warpgroup's own, from its registers (`pb`: exponentiate's), in one
/// commit group; `pb` stays read until the group is waited for.
__device__ __forceinline__ void pv_own(float (&o)[COLS / 2], const u32 (&pb)[16], u32 v) {
    const u64 vd = opaque(smem_desc(v, CHUNK_BYTES, 1024));
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
        const u32 a[4] = {pb[4 * kk], pb[4 * kk + 1], pb[4 * kk + 2], pb[4 * kk + 3]};
        wgmma_m64n256k16_rs<MMA_BF16>(o, a, desc_at(vd, kk * 2048), 1);
    }
    wgmma_commit();
}

/// Which of this thread's scores s[i] of the tile from `first` are its rows' keys, on a masked
/// tile (a split's first or last): s[4 j + e] is row r0 + 8 (e / 2), key 8 j + 2 (lane % 4) + e
/// % 2. Unpacked, every row sees the CTA's keys: two compares a score. Packed, each row its
/// own (row_ranges'), kept as a bit a score: one register through the masked softmax instead
/// of two rows' ranges (the kernel has none to spare).
struct MaskedSeen {
    int first;
    KeyRange keys;
    int lane;
    u32 bits = 0;

    __device__ MaskedSeen(int first_, const KeyRange& keys_, const Smem& sm, int r0, int lane_)
        : first(first_), keys(keys_), lane(lane_) {
        if constexpr (PACK) {
            KeyRange k[2];
            row_ranges(sm, r0, k);
#pragma unroll
            for (int i = 0; i < 32; ++i) {
                const KeyRange& r = k[(i % 4) / 2];
                if (pos(i) >= r.start && pos(i) < r.end) bits |= 1u << i;
            }
        }
    }
    __device__ int pos(int i) const { return first + 8 * (i / 4) + 2 * (lane % 4) + (i & 1); }
    __device__ bool operator()(int i) const {
        if constexpr (PACK) return ((bits >> i) & 1u) != 0;
        return pos(i) >= keys.start && pos(i) < keys.end;
    }
};

/// An unmasked tile (inside every row's keys): every score is a key of its row. The masks
/// (MaskedSeen) only on the others, behind a uniform branch: their compares and selects cost a
/// softmax more than its arithmetic.
struct AllSeen {
    __device__ bool operator()(int) const { return true; }
};

/// This thread's two rows' maxima of the raw scores of the tile from `first` over the keys
/// it sees (over the quad). The scores are only read: warpgroup 1 computes this while a wgmma
/// of its is in flight, and a write to an accumulator register then would make ptxas
/// serialize the wgmma (its C7515).
template <typename Seen>
__device__ __forceinline__ void tile_max_of(const Seen& seen, const float (&s)[32], float (&mx)[2]) {
    // Two chains a row, so that 16 dependent maxima are 8.
    float c[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) c[j] = bits_to_float(0xff800000u);
#pragma unroll
    for (int i = 0; i < 32; ++i) {
        if (seen(i)) c[i % 4] = fmaxf(c[i % 4], s[i]);
    }
    mx[0] = quad_max(fmaxf(c[0], c[1]));
    mx[1] = quad_max(fmaxf(c[2], c[3]));
}

/// This thread's rows' running max `m` moved past the tile from `first` (m_new = max(m, its
/// scores' max times the scale, which is positive)), and the factors 2^(m - m_new) that
/// rescale what was relative to m: exactly 1 where the max did not move (the rescale is then
/// skipped; packed, a row that has seen no key yet keeps m = -inf and the factor 1).
__device__ __forceinline__ void next_max(const float (&s)[32], float (&m)[2], float (&factor)[2], int first,
                                         bool inside, const KeyRange& keys, const Smem& sm, int r0, float sc,
                                         int lane) {
    float mx[2];
    if (inside) {
        tile_max_of(AllSeen{}, s, mx);
    } else {
        tile_max_of(MaskedSeen(first, keys, sm, r0, lane), s, mx);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const float m_new = fmaxf(m[h], mx[h] * sc);
        factor[h] = m_new == m[h] ? 1.0f : exp2_approx(m[h] - m_new);
        m[h] = m_new;
    }
}

/// The running max and its rescale factor after warpgroup `wg`'s tile (its 2^(m - m0) or
/// 2^(m0 - m1)) into shared memory for the other warpgroup, by each quad's lane 0 once the
/// quad has read the max it replaces.
__device__ __forceinline__ void publish_max(const Smem& sm, int wg, const float (&m)[2], const float (&factor)[2],
                                            int r0, int lane) {
    __syncwarp();
    if (lane % 4 == 0) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            st_shared_f32(sm.max(r0 + 8 * h), m[h]);
            st_shared_f32(wg == 0 ? sm.scale0(r0 + 8 * h) : sm.scale1(r0 + 8 * h), factor[h]);
        }
    }
}

/// P = 2^(s scale - m) of this thread's scores (0 for keys it does not see), rounded to the
/// model dtype into `pb` as wgmma's A fragment (pair i of k-step kk: pb[4 kk + i], row r0 + 8
/// (i % 2)), the unrounded values added to the row sums `l`. Every row's m is finite on an
/// unmasked tile (each holds a key of every row); on a masked one a packed row's m may still be
/// -inf, its P then 0 by the mask.
template <typename Seen>
__device__ __forceinline__ void exponentiate_of(const Seen& seen, const float (&s)[32], float sc, const float (&m)[2],
                                                float (&l)[2], u32 (&pb)[16]) {
    const auto p_of = [&](int j, int h) {
        const float p = exp2_approx(fmaf(s[j], sc, -m[h]));
        return seen(j) ? p : 0.0f;
    };
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int h = i % 2;
            const float p0 = p_of(8 * kk + 2 * i, h);
            const float p1 = p_of(8 * kk + 2 * i + 1, h);
            l[h] += p0 + p1;
            pb[4 * kk + i] = pack2<MMA_BF16>(p0, p1);
        }
    }
}

/// exponentiate_of, the masks only where the tile is not `inside` every row's keys.
__device__ __forceinline__ void exponentiate(const float (&s)[32], float sc, const float (&m)[2], float (&l)[2],
                                             u32 (&pb)[16], int first, bool inside, const KeyRange& keys,
                                             const Smem& sm, int r0, int lane) {
    if (inside) {
        exponentiate_of(AllSeen{}, s, sc, m, l, pb);
    } else {
        exponentiate_of(MaskedSeen(first, keys, sm, r0, lane), s, sc, m, l, pb);
    }
}

/// exponentiate's P times a (row r0) and b (row r0 + 8), rounded again, unless both are 1.
__device__ __forceinline__ void rescale_p(u32 (&pb)[16], float a, float b) {
    if (a != 1.0f || b != 1.0f) {
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const float f = i % 2 == 0 ? a : b;
            pb[i] = pack2<MMA_BF16>(half_to_float<MMA_BF16>(pb[i] & 0xffffu) * f,
                                    half_to_float<MMA_BF16>(pb[i] >> 16) * f);
        }
    }
}

/// exponentiate's P into the swizzled 64 x 64 tile at `tile`, where the other warpgroup's wgmma
/// reads it (the caller fences it for them).
__device__ __forceinline__ void store_p(const u32 (&pb)[16], u32 tile, int r0, int lane) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
        for (int i = 0; i < 4; ++i) st_shared_u32(tile + p_fragment_at(r0, lane, kk, i), pb[4 * kk + i]);
    }
}

/// O *= a (row r0) and b (row r0 + 8), unless both are 1 across the warp.
__device__ __forceinline__ void rescale(float (&o)[COLS / 2], float a, float b) {
    if (__any_sync(0xffffffffu, a != 1.0f || b != 1.0f)) {
#pragma unroll
        for (int i = 0; i < COLS / 2; ++i) o[i] *= (i % 4) < 2 ? a : b;
    }
}

/// The keys of the tile from `first` outside `keys`: their rows of value chunks c0 .. c0 +
/// HALF of the stage at `tile` zeroed, by the 128 threads of a warpgroup (`wt`: this one's
/// index), fenced for wgmma; the caller's barrier publishes them.
__device__ __forceinline__ void zero_outside(u32 tile, int c0, int first, const KeyRange& keys, int wt) {
    for (int i = wt; i < BN * HALF * 8; i += 128) {
        const int key = i / (HALF * 8), c = c0 + (i / 8) % HALF;
        const int pos = first + key;
        if (pos >= keys.start && pos < keys.end) continue;
        st_shared_u32x4(tile + c * CHUNK_BYTES + key * 128 + (i % 8) * 16, u32x4{0u, 0u, 0u, 0u});
    }
    fence_proxy_async();
}

extern __shared__ __align__(1024) unsigned char smem_raw[];

/// The CTA's shared memory, aligned for the 128-byte swizzle.
__device__ __forceinline__ Smem shared_layout() {
    return Smem{(smem_addr(smem_raw) + ALIGN - 1) & ~(u32)(ALIGN - 1)};
}

/// A generic pointer to the shared-memory byte at `at` (for the helpers that take one).
__device__ __forceinline__ unsigned char* generic_of(u32 at) {
    return smem_raw + (at - smem_addr(smem_raw));
}

/// The mbarriers set up (by one thread; a barrier publishes them): a chunk's of each stage
/// (one arrival, the issuing lane's, and the copies' bytes), the four hand-overs (128
/// arrivals: a warpgroup's threads) and the row sums' exchange (every thread).
__device__ __forceinline__ void init_barriers(const Smem& sm) {
    for (int st = 0; st < 2; ++st) {
        for (int c = 0; c < CHUNKS; ++c) mbar_init(sm.bar(st, c), 1);
    }
    for (int k = 1; k <= 4; ++k) mbar_init(sm.hand(k), 128);
    mbar_init(sm.sums_ready(), THREADS);
    mbar_fence_init();
}

/// The scheduled variant, after a piece (every thread past its last wait, no copy in
/// flight): the mbarriers set up again, so that the next piece starts at phase 0.
__device__ __forceinline__ void reset_barriers(const Smem& sm) {
    for (int i = 0; i < BAR_BYTES / 8; ++i) mbar_inval(sm.bar(0, 0) + 8 * i);
    init_barriers(sm);
}

/// One piece of work (common/schedule.cuh): on the split grid the CTA's whole split, on the
/// scheduled grid one of the pieces on its stretch.
__device__ __forceinline__ void decode_piece(const DecodeParams& p, const TensorMap* map, const Smem& sm0,
                                             const Piece& pc) {
    // Scheduled, the thread's index is made opaque each piece: else the compiler keeps what
    // the prologue derives from it live across the whole walk (spills).
    const int tid = MLA_SCHED ? (int)opaque_u32(threadIdx.x) : (int)threadIdx.x;
    const int lane = tid % 32, warp = tid / 32, wg = warp / 4, wt = tid % 128;
    const int r0 = 16 * (warp % 4) + lane / 4;  // this thread's rows: r0 and r0 + 8
    const bool issuer = warp % 4 == 0;          // the warp of its warpgroup that issues copies
    const Rows rows(p, pc.job);
    const int req = rows.req;
    const int len = request_len(p, req, tid == 0 && pc.split == 0);
    // keys: the union of the rows' keys (tiles, copies, zeroed values); common: the keys every
    // row sees (a tile inside them needs no mask).
    const TokensKeys cta = rows.keys(p, len, pc);
    const KeyRange keys = cta.keys;
    if (keys.start >= keys.end) {
        // Stage 2 gives an empty split no weight (a scheduled piece has keys).
        if (pc.splits == 1 || !MLA_SCHED) rows.write_empty_piece<THREADS, L>(p, pc);
        return;
    }
    const int first0 = keys.start - keys.start % BN;
    const int tiles = (keys.end - first0 + BN - 1) / BN;

    // q, the mbarriers, then the first two tiles' copies while q lands.
    load_q(p, sm0, rows, tid);
    if (!MLA_SCHED && tid == 0) init_barriers(sm0);  // scheduled: set up before the first piece
    __syncthreads();
    // The issuing lanes' boxes of tiles 0 and 1, then (two tiles a step) of t0 + 2 and t0 + 3.
    const TileBoxes boxes(p.page_size);
    Box box[2] = {Box(p, first0, boxes, lane), Box(p, first0 + BN, boxes, lane)};
    if (warp == 0) {
        for (int t = 0; t < 2 && t < tiles; ++t) {
            box[t].read(p, req, first0 + t * BN, boxes, keys, lane);
            issue<0, CHUNKS, false>(p, map, sm0, t, boxes, box[t], lane);
        }
    }
    cp_async_wait_group<0>();
    // fp8: the scores' scale, base 2, takes k_scale, and a bf16 q's power of two (q rewritten
    // as f16); kept in shared memory (scale_at) for the loop.
    if constexpr (FP8) {
        float sc = p.scale_log2 * read_k_scale(p, tid == 0 && pc.job == 0 && pc.split == 0);
        if constexpr (BF16) {
            __syncthreads();  // every thread's share of q landed
            sc *= q_to_f16<THREADS>(generic_of(sm0.q()), M * (D / 8), [](int i) { return i * 16; },
                                    (u32*)generic_of(sm0.sums(0, 0)));
        }
        if (tid == 0) st_shared_f32(sm0.scale_at(), sc);
    }
    fence_proxy_async();  // q's copies (or its rewrite), for wgmma
    if (wg == 0 && lane % 4 == 0) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = r0 + 8 * h;
            st_shared_f32(sm0.max(r), bits_to_float(0xff800000u));
            if (PACK) {
                const KeyRange k = rows.real(r, p) ? rows.row_keys(p, len, pc, r) : keys;
                st_shared_u32(sm0.range(r), (u32)k.start);
                st_shared_u32(sm0.range(r) + 4, (u32)k.end);
            }
        }
    }
    if (PACK && tid == 0) {
        st_shared_u32(sm0.range(M), (u32)cta.common.start);
        st_shared_u32(sm0.range(M) + 4, (u32)cta.common.end);
    }
    if (MLA_SCHED && tid == 0) {
        st_shared_u32(sm0.piece(), (u32)pc.job);
        st_shared_u32(sm0.piece() + 4, (u32)pc.slot);
        st_shared_u32(sm0.piece() + 8, (u32)pc.splits);
    }
    __syncthreads();

    float o[COLS / 2];  // this warpgroup's 64 x 256 outputs, relative to the running max
#pragma unroll
    for (int i = 0; i < COLS / 2; ++i) o[i] = 0.0f;
    float l[2] = {0.0f, 0.0f};  // this warpgroup's share of the row sums (its tiles' P)
    float s[32];                // the scores of this warpgroup's tile of the step
    // Each warpgroup's first scores: tile 0 (warpgroup 0), tile 1 (warpgroup 1).
    if (wg == 0 || tiles > 1) {
        scores<0, CHUNKS, false>(s, sm0, wg, 0, wg, wt);
        wgmma_commit();
        wgmma_wait<0>();
    }

    for (int t0 = 0, step = 0; t0 < tiles; t0 += 2, ++step) {
        const Smem sm = sm0.fresh();
        // The scores' scale, read where it is used (fp8: from shared memory; no register is
        // left to keep it across the step).
        const auto sc = [&] { return FP8 ? ld_shared_f32(sm.scale_at()) : p.scale_log2; };
        const bool has1 = t0 + 1 < tiles, more = t0 + 2 < tiles, more1 = t0 + 3 < tiles;
        const int first = first0 + t0 * BN;  // tile t0's first key; tile t1's is first + BN
        // Tiles inside the keys every row sees (unpacked, the CTA's keys, and tile t1 starts
        // inside them; packed, from shared memory: no registers are left to keep them).
        const KeyRange common = PACK ? KeyRange{(int)ld_shared_u32(sm.range(M)), (int)ld_shared_u32(sm.range(M) + 4)}
                                     : keys;
        const bool in0 = first >= common.start && first + BN <= common.end;
        const bool in1 = (!PACK || first + BN >= common.start) && first + 2 * BN <= common.end;
        const u32 parity = step & 1;                 // of this step's hand-overs
        const int next0 = first + 2 * BN, next1 = first + 3 * BN;  // tiles t0 + 2, t1 + 2
        if (issuer) {
            box[0].skip_two(p, boxes);
            box[1].skip_two(p, boxes);
            if (more) box[0].read(p, req, next0, boxes, keys, lane);
            if (more1) box[1].read(p, req, next1, boxes, keys, lane);
        }
        u32 pb[16];  // this warpgroup's P of the step, wgmma's A fragment
        if (wg == 0) {
            float m[2] = {ld_shared_f32(sm.max(r0)), ld_shared_f32(sm.max(r0 + 8))}, a[2];
            next_max(s, m, a, first, in0, keys, sm, r0, sc(), lane);
            publish_max(sm, 0, m, a, r0, lane);
            mbar_arrive(sm.hand(1));  // m0, 2^(m - m0): warpgroup 1's softmax starts meanwhile
            rescale(o, a[0], a[1]);
            l[0] *= a[0];
            l[1] *= a[1];
            exponentiate(s, sc(), m, l, pb, first, in0, keys, sm, r0, lane);
            if (!in0) {
                zero_outside(sm.k(0), 0, first, keys, wt);
                named_barrier(1, 128);  // this warpgroup's zeros, for its own products
            }
            pv_own(o, pb, sm.k(0));
            wgmma_wait<0>();
            // K0's first half is read (S0, P0 V00): tile t0 + 2's copies.
            if (issuer && more) issue<0, HALF, false>(p, map, sm, 0, boxes, box[0], lane);
            float b[2] = {1.0f, 1.0f};
            if (has1) {
                mbar_wait(sm.hand(2), parity);  // m1, 2^(m0 - m1)
                b[0] = ld_shared_f32(sm.scale1(r0));
                b[1] = ld_shared_f32(sm.scale1(r0 + 8));
                rescale_p(pb, b[0], b[1]);  // P0 relative to m1, for warpgroup 1's product
            }
            store_p(pb, sm.p(0), r0, lane);
            fence_proxy_async();
            mbar_arrive(sm.hand(3));  // P0, final
            if (has1) {
                rescale(o, b[0], b[1]);
                l[0] *= b[0];
                l[1] *= b[1];
                if (!in1) {
                    zero_outside(sm.k(1), 0, first + BN, keys, wt);
                    named_barrier(1, 128);
                }
                mbar_wait(sm.hand(4), parity);  // P1, and warpgroup 1's P0 V01 issued before this product
                pv(o, sm.p(1), sm.k(1));
                // One branch holds the next scores whole: a branch that a wgmma is in flight
                // across, on one side of it only, makes ptxas serialize every wgmma of the
                // kernel (its C7518 and C7520; `mla precompile --deny-spills` fails then).
                if (more) {
                    // The scores over K0's first half (copied again long ago) right behind P1
                    // V10, so that the tensor cores do not drain between them.
                    scores<0, HALF, false>(s, sm, 0, parity ^ 1, wg, wt);
                    wgmma_commit();
                    wgmma_wait<1>();
                    // K1's first half is read (S1, P1 V10): tile t1 + 2's copies.
                    if (issuer && more1) issue<0, HALF, false>(p, map, sm, 1, boxes, box[1], lane);
                    scores<HALF, CHUNKS, true>(s, sm, 0, parity ^ 1, wg, wt);
                    wgmma_commit();
                }
                wgmma_wait<0>();
            }
        } else {
            mbar_wait(sm.hand(1), parity);
            float m[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) m[h] = ld_shared_f32(sm.max(r0 + 8 * h));
            float a[2] = {ld_shared_f32(sm.scale0(r0)), ld_shared_f32(sm.scale0(r0 + 8))};
            if (has1) {
                // The softmax of tile t1, relative to m1 = max(m0, its scores).
                float b[2];
                next_max(s, m, b, first + BN, in1, keys, sm, r0, sc(), lane);
                publish_max(sm, 1, m, b, r0, lane);
                mbar_arrive(sm.hand(2));  // m1, 2^(m0 - m1): warpgroup 0 rescales P0 meanwhile
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    a[h] *= b[h];
                    l[h] *= a[h];
                }
                exponentiate(s, sc(), m, l, pb, first + BN, in1, keys, sm, r0, lane);
                store_p(pb, sm.p(1), r0, lane);  // for warpgroup 0's product
                rescale(o, a[0], a[1]);
                if (!in1) {
                    zero_outside(sm.k(1), HALF, first + BN, keys, wt);
                    named_barrier(2, 128);  // this warpgroup's zeros, for its own products
                }
                // The own P first, from registers: it waits for nothing of warpgroup 0's.
                pv_own(o, pb, sm.k(1) + HALF * CHUNK_BYTES);
                fence_proxy_async();  // P1 for warpgroup 0's wgmma (hand-over 4)
            } else {
                rescale(o, a[0], a[1]);
                l[0] *= a[0];
                l[1] *= a[1];
            }
            if (!in0) {
                zero_outside(sm.k(0), HALF, first, keys, wt);
                named_barrier(2, 128);
            }
            mbar_wait(sm.hand(3), parity);  // P0, relative to m1
            pv(o, sm.p(0), sm.k(0) + HALF * CHUNK_BYTES);
            if (has1) {
                // P1, and P0 V01 ahead of warpgroup 0's P1 V10 in the tensor cores' queue:
                // K0's second half, which warpgroup 0's next scores wait for, is free sooner.
                mbar_arrive(sm.hand(4));
                wgmma_wait<1>();
                // K1's second half and rotary chunk are read (S1, P1 V11): tile t1 + 2's copies.
                if (issuer && more1) issue<HALF, 2 * HALF, true>(p, map, sm, 1, boxes, box[1], lane);
            }
            wgmma_wait<0>();
            // K0's second half and P0 (in its rotary chunk) are read: tile t0 + 2's copies.
            if (issuer && more) issue<HALF, 2 * HALF, true>(p, map, sm, 0, boxes, box[0], lane);
            if (more1) {
                // K1's second half first: warpgroup 0 copies its first half only once P1 V10 is
                // done (its first chunk in a call of its own).
                scores<HALF, HALF + 1, false>(s, sm, 1, parity ^ 1, wg, wt);
                scores<HALF + 1, CHUNKS, true>(s, sm, 1, parity ^ 1, wg, wt);
                scores<0, HALF, true>(s, sm, 1, parity ^ 1, wg, wt);
                wgmma_commit();
                wgmma_wait<0>();
            }
        }
    }

    // Both warpgroups' outputs and sums are relative to the last running max: the sums add.
    const Smem sm = sm0.fresh();
    // The piece and its rows again, not kept live across the loop: scheduled, the piece's job,
    // slot and splits from shared memory; packed, the rows from the (opaque) job.
    Piece out_pc = pc;
    if (MLA_SCHED) {
        out_pc.job = (int)ld_shared_u32(sm.piece());
        out_pc.slot = (int)ld_shared_u32(sm.piece() + 4);
        out_pc.splits = (int)ld_shared_u32(sm.piece() + 8);
    }
    const Rows out_rows = MLA_SCHED ? Rows(p, out_pc.job) : PACK ? Rows(p, (int)opaque_u32(pc.job)) : rows;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        l[h] = quad_sum(l[h]);
        if (lane % 4 == 0) st_shared_f32(sm.sums(wg, r0 + 8 * h), l[h]);
    }
    // Every thread's sums written: an mbarrier, not __syncthreads, whose ordering of these
    // writes compute-sanitizer's racecheck did not follow after the warpgroups' mbarrier
    // hand-overs (NOTES.md).
    mbar_arrive(sm.sums_ready());
    mbar_wait(sm.sums_ready(), 0);
    // The outputs through shared memory (the tiles are free: every thread is past its loop),
    // then whole rows out; the same mbarrier's next phase says every row is staged.
    const StagedRows<BF16, L> out{sm.q(), out_pc.splits > 1};
    // fp8: k_scale is V's too (read again after the loop: no register was left to keep it).
    const float v_scale = FP8 ? read_k_scale(p, false) : 1.0f;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = r0 + 8 * h;
        const float sum = ld_shared_f32(sm.sums(0, r)) + ld_shared_f32(sm.sums(1, r));
        const float inv = sum > 0.0f ? v_scale / sum : 0.0f;
        out.put<COLS / 8>(r, [&](int j) { return wg * COLS + 2 * (lane % 4) + 8 * j; },
                          [&](int j, int e) { return o[4 * j + 2 * h + e] * inv; });
        // A packed row with no key in the split (sum 0, max -inf): o = 0 and lse = -inf.
        if (wg == 0 && lane % 4 == 0 && out_rows.real(r, p)) {
            const int q_row = out_rows.row(r), head = out_rows.head(r);
            store_lse(p, piece_at(p, out_pc, M, r, q_row, head), q_row, head, (ld_shared_f32(sm.max(r)) + log2_approx(sum)) * LN2);
        }
    }
    mbar_arrive(sm.sums_ready());
    mbar_wait(sm.sums_ready(), 1);
    out.store<M, THREADS>(p, tid, [&](int r, i64& at, int& q_row, int& head) {
        q_row = out_rows.row(r);
        head = out_rows.head(r);
        at = piece_at(p, out_pc, M, r, q_row, head);
        return out_rows.real(r, p);
    });
    if (MLA_SCHED) {
        __syncthreads();  // every thread past its last wait on the mbarriers
        if (tid == 0) reset_barriers(sm);
    }
}

}  // namespace

// One CTA per SM: the outputs take 128 registers a thread and the tiles 216 KB.
#if MLA_SCHED
// Scheduled (grid: CTAs x head blocks): CTA (c, y) walks its stretch of the cost line for
// head block y, a piece per job it touches (common/schedule.cuh), the mbarriers set up
// before the first piece and again after each.
extern "C" __global__ void __launch_bounds__(THREADS, 1)
    mla_decode_seesaw(const __grid_constant__ TmaScheduleParams tp) {
    allow_dependent_launch();  // the combine may start launching (it waits for our writes)
    wait_for_previous_grid();  // the scheduler's integers (a programmatic dependent launch on sm_90)
    const Smem sm = shared_layout();
    if (threadIdx.x == 0) init_barriers(sm);
    __syncthreads();
    walk_pieces(tp.s, (tp.s.d.heads + M - 1) / M, [&](const Piece& pc) { decode_piece(tp.s.d, &tp.kv_map, sm, pc); });
}
#else
extern "C" __global__ void __launch_bounds__(THREADS, 1) mla_decode_seesaw(const __grid_constant__ TmaParams tp) {
    allow_dependent_launch();  // the combine may start launching (it waits for our writes)
    decode_piece(tp.d, &tp.kv_map, shared_layout(), grid_piece(tp.d));
}
#endif
