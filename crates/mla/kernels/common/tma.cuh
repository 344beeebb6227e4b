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
#include "common/keys.cuh"
#include "params.cuh"

/// The driver's opaque CUtensorMap (128 bytes, 64-byte aligned).
struct __align__(64) TensorMap {
    u64 opaque[16];
};

/// The argument of the stage-1 kernels that copy the keys by TMA (decode_narrow,
/// decode_seesaw): the decode's parameters and the cache's tensor map (dims: D elements,
/// page_size slots, num_blocks pages; box: 64 elements x min(page_size, 64) slots).
struct TmaParams {
    DecodeParams d;
    TensorMap kv_map;
};
static_assert(sizeof(TmaParams) == 384, "TmaParams must match src/backend/cuda/params.rs");

/// The argument of the scheduled variant of a TMA kernel (decode_seesaw): the schedule's
/// parameters (params.cuh) and the cache's tensor map.
struct TmaScheduleParams {
    ScheduleParams s;
    TensorMap kv_map;
};
static_assert(sizeof(TmaScheduleParams) == 384 + 64, "TmaScheduleParams must match src/backend/cuda/params.rs");

/// Sets up an mbarrier at shared address `bar` expecting `count` arrivals a phase.
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
/// Makes the initialized mbarriers visible to the async proxy (the TMA unit) and other threads.
__device__ __forceinline__ void mbar_fence_init() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
/// Ends an mbarrier's life (every phase complete, nobody waiting), so that its place may be
/// set up again (mbar_init).
__device__ __forceinline__ void mbar_inval(u32 bar) {
    asm volatile("mbarrier.inval.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
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
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, "
        "%4}], [%5];" ::"r"(dst),
        "l"((u64)map), "r"(x), "r"(y), "r"(z), "r"(bar)
        : "memory");
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

/// Keys of a tile read by TMA: wgmma's 64 rows. Tiles start at multiples of it, so a tile
/// never straddles a page of 64 keys or more, and pages of 8, 16 or 32 keys fill it whole.
constexpr int TMA_TILE = 64;

/// Most boxes a tile is copied in: pages of 8 keys.
constexpr int MAX_BOXES = TMA_TILE / 8;

/// How a 64-key tile is copied: in `count` boxes of `box` keys, a box being one page's piece
/// (min(page_size, TMA_TILE) keys).
struct TileBoxes {
    int box, count;
    __device__ explicit TileBoxes(int page_size) : box(min(page_size, TMA_TILE)), count(TMA_TILE / box) {}
};

/// Whether box `lane` of the tile from `first` (a multiple of TMA_TILE) holds some of `keys`:
/// box_entry's rule but for the table's bound. A page wholly before the keys is never looked
/// up (its entry may be stale).
__device__ __forceinline__ bool box_holds_keys(int first, const TileBoxes& boxes, const KeyRange& keys, int lane) {
    const int pos = first + lane * boxes.box;
    return lane < boxes.count && pos + boxes.box > keys.start && max(pos, keys.start) < keys.end;
}

/// Whether box `lane` of the tile from `first` has a block-table entry to read, and where
/// (`i`): not when the box holds none of `keys` or lies past the table. A box lies in one
/// page, that of its first key in `keys`.
__device__ __forceinline__ bool box_entry(const DecodeParams& p, int req, int first, const TileBoxes& boxes,
                                          const KeyRange& keys, int lane, i64& i) {
    return box_holds_keys(first, boxes, keys, lane) &&
           table_entry(p, req, max(first + lane * boxes.box, keys.start), keys.end, i);
}

/// A box's block coordinate for its copies: its table entry (`has`: it has one), or -1 (the
/// TMA unit writes zeros) for none and for a block id outside the cache (bad_block raises
/// the error flag).
__device__ __forceinline__ int box_block(const DecodeParams& p, bool has, int entry) {
    return has && !bad_block(p, entry) ? entry : -1;
}

/// One lane's read of the block table for box `lane` of a tile, started now and used later:
/// the issuing warp starts tile t + 1's reads before it issues tile t and takes their values
/// after, so the read's latency hides behind the issue (an issuing thread has about 500
/// cycles a chunk at the H200's bandwidth an SM; a read it waits on costs more than that).
struct BoxLookup {
    const int* at = nullptr;  // the entry, or nullptr: no box, or none of the keys in it
    int entry = 0;

    /// Starts the read of box `lane` of the tile from `first` (box_entry's rule).
    __device__ void start(const DecodeParams& p, int req, int first, const TileBoxes& boxes, const KeyRange& keys,
                          int lane) {
        i64 i;
        at = box_entry(p, req, first, boxes, keys, lane, i) ? p.block_table + i : nullptr;
        entry = at != nullptr ? *at : 0;
    }

    /// The box's block coordinate (box_block's).
    __device__ int block(const DecodeParams& p) const { return box_block(p, at != nullptr, entry); }
};

/// A tile's block coordinates, box by box (static indices: registers), and the slot of its
/// first key in a page of 64 keys or more.
struct TileBlocks {
    int block[MAX_BOXES];
    int slot_in_page;
};

/// The whole warp: the tile from `first`'s block coordinates gathered from the lanes' lookups
/// (lane b: box b).
__device__ __forceinline__ TileBlocks gather_blocks(const DecodeParams& p, const BoxLookup& mine, int first,
                                                    const TileBoxes& boxes) {
    TileBlocks t;
    const int block = mine.block(p);
#pragma unroll
    for (int b = 0; b < MAX_BOXES; ++b) t.block[b] = __shfl_sync(0xffffffffu, block, b);
    t.slot_in_page = boxes.count == 1 ? slot_of(p, first) : 0;
    return t;
}

/// One thread: the copies of chunk `c` of a tile (ELEMENTS elements, 128 bytes, of each key
/// row: 64 of a 16-bit cache, 128 of fp8) into `dst` (landing as the swizzled wgmma operand,
/// 1024-byte aligned), completing on `bar`, which the caller armed with the chunk's bytes.
template <int ELEMENTS>
__device__ __forceinline__ void copy_chunk(const TensorMap* map, const TileBlocks& t, const TileBoxes& boxes, u32 dst,
                                           u32 bar, int c) {
#pragma unroll
    for (int b = 0; b < MAX_BOXES; ++b) {
        if (b < boxes.count) tma_load_3d(dst + b * boxes.box * 128, map, bar, c * ELEMENTS, t.slot_in_page, t.block[b]);
    }
}
