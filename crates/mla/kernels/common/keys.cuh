/**
 * @file keys.cuh
 * @brief Where a key lives, where a row's results go and what a row with no keys writes,
 * shared by the stage-1 kernels:
 * the block-table lookup with the contract's bounds checks (docs/contract.md, "Errors": a
 * block id outside the cache or a length beyond the block table is never read and raises the
 * device flag), and the empty-row output.
 */
#pragma once
#include "common/ptx.cuh"
#include "common/rows.cuh"
#include "params.cuh"

/// No key: past the split's end or past the block table. Not an i32, so that every table
/// entry stays distinguishable from it.
constexpr i64 NO_KEY = -(1ll << 40);

/// The page of key `pos` (>= 0): a shift on pages of a power of two keys (every usual size),
/// else a division, which is about 20 dependent instructions on a loader's path every tile.
__device__ __forceinline__ int page_of(const DecodeParams& p, int pos) {
    const int ps = p.page_size;
    return (ps & (ps - 1)) == 0 ? pos >> (__ffs(ps) - 1) : pos / ps;
}

/// The slot of key `pos` (>= 0) in its page.
__device__ __forceinline__ int slot_of(const DecodeParams& p, int pos) {
    return pos - page_of(p, pos) * p.page_size;
}

/// Whether page `page` of request `req` has an entry in the block table, and where (`at`):
/// not when it lies outside the table (the row-level check raised the flag).
__device__ __forceinline__ bool page_entry(const DecodeParams& p, int req, int page, i64& at) {
    if (page >= p.max_blocks) return false;
    at = req * p.block_table_stride + page;
    return true;
}

/// Whether key `pos` of request `req` has an entry in the block table, and where (`at`): not
/// when the key is past `end` or its page lies outside the table (page_entry). Apart from the
/// load, so that a kernel can start the load and use it later.
__device__ __forceinline__ bool table_entry(const DecodeParams& p, int req, int pos, int end, i64& at) {
    return pos < end && page_entry(p, req, page_of(p, pos), at);
}

/// The block id of key `pos` of request `req`; NO_KEY where it has no table entry. The
/// kernels issue this a tile or two ahead of its use, so the load's latency hides behind work.
__device__ __forceinline__ i64 block_of(const DecodeParams& p, int req, int pos, int end) {
    i64 at;
    return table_entry(p, req, pos, end, at) ? p.block_table[at] : NO_KEY;
}

/// Whether `block` (a table entry, not NO_KEY) lies outside the cache: then it raises the
/// error flag, and its page is never read.
__device__ __forceinline__ bool bad_block(const DecodeParams& p, i64 block) {
    if (block < 0 || block >= p.num_blocks) {
        raise_error(p, MLA_ERR_BAD_BLOCK);
        return true;
    }
    return false;
}

/// The byte offset of key `pos` in the cache (ELEM bytes an element), or -1 (never read; the
/// kernels zero-fill it) when there is no such key or its block id is outside the cache.
template <int ELEM>
__device__ __forceinline__ i64 key_offset(const DecodeParams& p, int pos, i64 block) {
    if (block == NO_KEY || bad_block(p, block)) return -1;
    return (block * p.page_stride + (i64)slot_of(p, pos) * p.token_stride) * ELEM;
}

/// The byte offsets (key_offset) of the first TILES tiles of BN keys from keys.start, by the
/// threads j < BN: key j of tile t at offsets(t)[j], one tile's block ids loaded after the
/// last's offsets are stored. Loading them all first, before q's copies, spilled in the
/// kernels at their register limit and did not start a batch-1 CTA sooner (clock stamps,
/// H200, 2026-12-03, ff76794), so every kernel takes this one.
template <int ELEM, int BN, int TILES, typename Offsets>
__device__ __forceinline__ void first_offsets(const DecodeParams& p, int req, KeyRange keys, int j,
                                              Offsets offsets) {
    if (j >= BN) return;
    for (int t = 0; t < TILES; ++t) {
        const int pos = keys.start + t * BN + j;
        offsets(t)[j] = key_offset<ELEM>(p, pos, block_of(p, req, pos, keys.end));
    }
}

/// A tile of BN keys into shared memory by cp.async, by WARPS warps from `first_warp` on:
/// warp w takes keys w, w + WARPS, ...; lane l the key's 16-byte pieces l, l + 32, ... (PIECES
/// a key; compile-time trip counts). offset(j): key j's byte offset in the cache, < 0 for a
/// key that is zero-filled and never read (called once a key by every lane of its warp);
/// dst(j, c): the shared address of piece c of key j.
///
/// A warp reads AHEAD keys' offsets before it copies them. A copy is asm with a memory
/// clobber, so an offset read from shared memory after a copy waits behind it: read one at a
/// time (AHEAD 1), each key's copies wait on their own offset's load (in the mma kernel's
/// copies, which read all of a warp's offsets first now, that was about 9% of the stall
/// samples at 16 heads: decode_mma/NOTES.md). More AHEAD costs two registers an offset.
template <int BN, int PIECES, int WARPS, int AHEAD, typename Offset, typename Dst>
__device__ __forceinline__ void copy_keys(const DecodeParams& p, Offset offset, int first_warp, Dst dst) {
    constexpr int KEYS = BN / WARPS;  // a warp's
    constexpr int LANE_STEPS = (PIECES + 31) / 32;
    static_assert(BN % WARPS == 0 && KEYS % AHEAD == 0, "every warp takes whole groups of keys");
    const int warp = threadIdx.x / 32 - first_warp, lane = threadIdx.x % 32;
#pragma unroll
    for (int j0 = 0; j0 < KEYS; j0 += AHEAD) {
        i64 offs[AHEAD];
#pragma unroll
        for (int a = 0; a < AHEAD; ++a) offs[a] = offset(warp + (j0 + a) * WARPS);
#pragma unroll
        for (int a = 0; a < AHEAD; ++a) {
            const int j = warp + (j0 + a) * WARPS;
            const bool valid = offs[a] >= 0;
            const unsigned char* src = (const unsigned char*)p.kv + (valid ? offs[a] : 0);
#pragma unroll
            for (int k = 0; k < LANE_STEPS; ++k) {
                const int c = lane + 32 * k;
                if (PIECES % 32 == 0 || k + 1 < LANE_STEPS || c < PIECES) {
                    cp_async16(dst(j, c), src + (valid ? c * 16 : 0), valid);
                }
            }
        }
    }
}

/// The workspace slot of split `split` of row `row`, head `head` on the split grid
/// ([rows, splits, H]); split s + 1 is p.heads slots further on.
__device__ __forceinline__ i64 split_slot(const DecodeParams& p, int row, int split, int head) {
    return ((i64)row * p.num_kv_splits + split) * p.heads + head;
}

/// Where split `split` of the split grid writes row `row`, head `head`: o and lse with one
/// split (-1), else the split's workspace row.
__device__ __forceinline__ i64 grid_at(const DecodeParams& p, int row, int head, int split) {
    return p.num_kv_splits == 1 ? -1 : split_slot(p, row, split, head);
}

/// grid_at for this CTA's split, blockIdx.y.
__device__ __forceinline__ i64 grid_at(const DecodeParams& p, int row, int head) {
    return grid_at(p, row, head, (int)blockIdx.y);
}

/// Output pairs i = 0 .. PAIRS - 1 of row `row`, head `head`, at latent columns col(i) and
/// col(i) + 1, valued value(i, 0) and value(i, 1): rounded into o when `at` < 0 (one split),
/// else a normalized partial (f32) into the workspace's row `at` (grid_at, or
/// common/schedule.cuh's piece_at).
template <bool BF16, int L, int PAIRS, typename Col, typename Value>
__device__ __forceinline__ void store_pairs_at(const DecodeParams& p, i64 at, int row, int head, Col col,
                                               Value value) {
    if (at < 0) {
        u16* o = (u16*)p.o + row * p.o_row + head * p.o_head;
#pragma unroll
        for (int i = 0; i < PAIRS; ++i) *(u32*)(o + col(i)) = pack2<BF16>(value(i, 0), value(i, 1));
    } else {
        float* w = p.part_o + at * L;
#pragma unroll
        for (int i = 0; i < PAIRS; ++i) *(f32x2*)(w + col(i)) = f32x2{value(i, 0), value(i, 1)};
    }
}

/// store_pairs_at for pairs evenly spaced: pair i at columns col0 + STRIDE i and + 1.
template <bool BF16, int L, int PAIRS, int STRIDE, typename Value>
__device__ __forceinline__ void store_pairs(const DecodeParams& p, i64 at, int row, int head, int col0,
                                            Value value) {
    store_pairs_at<BF16, L, PAIRS>(p, at, row, head, [col0](int i) { return col0 + STRIDE * i; }, value);
}

/// A CTA's results through shared memory (the stage-1 kernels' tiles are free once their loop
/// is done): each thread puts its fragments, f32, into a staging tile (`put`), and after a CTA
/// barrier the warps copy whole rows out (`store`), a warp's stores one contiguous run: f32
/// partials into the workspace (16 bytes a lane), or with one split rounded into o. Stored
/// from the fragments directly (pairs 8 columns apart, 8 rows a warp instruction), a 64-head
/// CTA's rounded outputs took 8,600 cycles after a one-tile split, its partials 5,400
/// (clock stamps, H200, 2026-12-03, ff76794); the fp8 products' permuted columns
/// (decode_mma's v_col) go back in place here too.
template <bool BF16, int L>
struct StagedRows {
    u32 base;      // shared address of the staging tile, 16-byte aligned
    bool partial;  // partials (the piece has several splits): the same for every row of a CTA
    // Rows padded by 32 bytes: a warp's fragment stores (8 rows x 4 lanes x 8 bytes) then
    // take two bank wavefronts, the fewest for 256 bytes.
    static constexpr int ROW = L * 4 + 32;
    static_assert(L % 128 == 0, "rows of whole 16-byte pieces for every lane");
    /// Bytes the staging tile of `rows` rows takes.
    __host__ __device__ static constexpr int bytes(int rows) { return rows * ROW; }

    /// Pairs i < PAIRS of tile row r at columns col(i) and col(i) + 1, valued value(i, 0) and
    /// value(i, 1).
    template <int PAIRS, typename Col, typename Value>
    __device__ __forceinline__ void put(int r, Col col, Value value) const {
        const u32 at = base + r * ROW;
#pragma unroll
        for (int i = 0; i < PAIRS; ++i) st_shared_f32x2(at + 4 * col(i), value(i, 0), value(i, 1));
    }

    /// After a CTA barrier, tile rows r < ROWS out by NT threads (`t` this one's index), warp w
    /// taking rows w, w + NT / 32, ...: where(r, at, row, head), called by each lane of that
    /// warp once a row (so a caller may store the row's LSE from one lane there), is false for
    /// a padding row, else gives the row's piece_at and its query row and head.
    template <int ROWS, int NT, typename Where>
    __device__ __forceinline__ void store(const DecodeParams& p, int t, Where where) const {
        constexpr int WARPS = NT / 32;
        const int warp = t / 32, lane = t % 32;
#pragma unroll 1
        for (int r = warp; r < ROWS; r += WARPS) {
            i64 at = -1;
            int row = 0, head = 0;
            if (!where(r, at, row, head)) continue;
            const u32 src = base + r * ROW;
            if (partial) {
                float* dst = p.part_o + at * L;
#pragma unroll
                for (int k = 0; k < L / 128; ++k) {
                    const int col = 4 * lane + 128 * k;
                    *(u32x4*)(dst + col) = ld_shared_u32x4(src + 4 * col);
                }
            } else {
                // Four columns a lane and piece: 8-byte stores (o need only be 4-byte aligned,
                // src/backend/cuda/mod.rs, `pointers`: two 4-byte ones).
                u16* o = (u16*)p.o + row * p.o_row + head * p.o_head;
#pragma unroll
                for (int k = 0; k < L / 128; ++k) {
                    const int col = 4 * lane + 128 * k;
                    const f32x2 a = ld_shared_f32x2(src + 4 * col), b = ld_shared_f32x2(src + 4 * col + 8);
                    *(u32*)(o + col) = pack2<BF16>(a.x, a.y);
                    *(u32*)(o + col + 2) = pack2<BF16>(b.x, b.y);
                }
            }
        }
    }
};

/// Output columns col .. col + 4 of row `row`, head `head`, valued x[0 .. 4) (col a multiple
/// of 4): rounded into o when `at` < 0 (two 4-byte stores: o is only 4-byte aligned), else
/// f32 into the workspace's row `at` (one 16-byte store).
template <bool BF16, int L>
__device__ __forceinline__ void store_run4(const DecodeParams& p, i64 at, int row, int head, int col,
                                           const float* x) {
    if (at < 0) {
        u16* o = (u16*)p.o + row * p.o_row + head * p.o_head + col;
        *(u32*)o = pack2<BF16>(x[0], x[1]);
        *(u32*)(o + 2) = pack2<BF16>(x[2], x[3]);
    } else {
        *(f32x4*)(p.part_o + at * L + col) = f32x4{x[0], x[1], x[2], x[3]};
    }
}

/// Output columns col0 .. col0 + 8 of row `row`, head `head`, valued v[0 .. 8) (col0 a
/// multiple of 8): two runs of four (store_run4).
template <bool BF16, int L>
__device__ __forceinline__ void store_run8(const DecodeParams& p, i64 at, int row, int head, int col0,
                                           const float (&v)[8]) {
    store_run4<BF16, L>(p, at, row, head, col0, v);
    store_run4<BF16, L>(p, at, row, head, col0 + 4, v + 4);
}

/// The LSE (natural log) of row `row`, head `head`: to lse when `at` < 0, else the partial's.
__device__ __forceinline__ void store_lse(const DecodeParams& p, i64 at, int row, int head, float lse) {
    if (at < 0) {
        p.lse[row * p.lse_row + head] = lse;
    } else {
        p.part_lse[at] = lse;
    }
}

/// A split of a decode of several that holds no key of its CTA's rows: each row's partial LSE
/// at -inf (`at(r)`: tile row r's workspace row, or -1 for a padding row), which the combine
/// gives no weight, never reading the split's partial outputs (they stay unwritten).
template <int ROWS, int THREADS, typename At>
__device__ void write_empty_split(const DecodeParams& p, At at) {
    for (int r = threadIdx.x; r < ROWS; r += THREADS) {
        const i64 slot = at(r);
        if (slot >= 0) p.part_lse[slot] = bits_to_float(0xff800000u);
    }
}

/// A row whose keys all fall outside its (single) split: o = 0 and lse = -inf for heads
/// head0 .. head0 + ROWS of `row`, by a CTA of THREADS threads.
template <int ROWS, int THREADS, int L>
__device__ void write_empty(const DecodeParams& p, int row, int head0) {
    for (int c = threadIdx.x; c < ROWS * (L / 2); c += THREADS) {
        const int r = c / (L / 2), col = 2 * (c % (L / 2));
        const int head = head0 + r;
        if (head >= p.heads) continue;
        *(u32*)((u16*)p.o + row * p.o_row + head * p.o_head + col) = 0u;
        if (col == 0) p.lse[row * p.lse_row + head] = bits_to_float(0xff800000u);
    }
}
