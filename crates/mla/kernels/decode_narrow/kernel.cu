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
 * Compile-time configuration (-D):
 *   MLA_L, MLA_R  latent and rotary widths (L = 512, (L + R) % 64 == 0)
 *   MLA_BF16      1: the model dtype is bf16, 0: f16
 *   MLA_KV        0: the cache in the model dtype; 2: fp8 e4m3, 3: fp8 e5m2. fp8 chunks land
 *                 raw (64 keys x 64 bytes, half the bytes) and both consumer warpgroups convert
 *                 each tile (decoded, times k_scale, rounded: bit-exact with the CPU backend)
 *                 into a 72 KB tile of the model dtype that the products read; values outside
 *                 the keys become zeros on the way.
 *   MLA_N         columns (query rows) a CTA: 16 or 32
 *   MLA_SLOTS     8 KB chunk slots in the ring (the host fills the device's shared memory)
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
constexpr int CHUNKS = D / 64;           // 64-column chunks of a key row
constexpr int V_CHUNKS = L / 64;         // the value part
constexpr int CHUNK_BYTES = BN * 128;    // one chunk of a tile in the model dtype, swizzled
constexpr int KV = MLA_KV;
constexpr bool FP8 = KV >= 2;
constexpr int RAW_ROW = FP8 ? 64 : 128;  // bytes of a key's chunk as it lands
constexpr int RAW_BYTES = BN * RAW_ROW;  // a ring slot
constexpr int CT_BYTES = FP8 ? CHUNKS * CHUNK_BYTES : 0;  // fp8: the converted tile
constexpr int CONSUMERS = 2;             // warpgroups sharing each tile
constexpr int OWN = V_CHUNKS / CONSUMERS; // value chunks a consumer multiplies by P
constexpr int HALF = L / CONSUMERS;      // output columns a consumer writes
constexpr int S_CHAINS = 3;              // independent accumulators of S^T
constexpr int THREADS = (CONSUMERS + 1) * 128;  // + the producer warpgroup (one warp works)
constexpr int PRODUCER_WARP = CONSUMERS * 4;
// Registers a thread (setmaxnreg): the producer warpgroup gives up most of its share to the
// consumers, whose accumulators and softmax state need more than an even split (168).
constexpr int PRODUCER_REGS = 56;
constexpr int CONSUMER_REGS = 224;
static_assert(PRODUCER_REGS * 128 + CONSUMER_REGS * 128 * CONSUMERS <= 65536, "the register file");
constexpr int Q_BYTES = CHUNKS * N * 128;
constexpr int PT_BYTES = N * 128;        // P^T of a tile: N rows of 64 keys
constexpr int RED_BYTES = 4 * N * 4;     // the 4 warps' column maxima
constexpr int BAR_BYTES = 2 * SLOTS * 8;
constexpr int LP = HALF + 4;             // padded row of the transposed outputs (no bank conflicts)
constexpr int ALIGN = 1024;
constexpr float LN2 = 0.69314718055994530942f;
constexpr int COLS = N / 4;              // columns of a thread (its slots: see column())

static_assert(L == 512 && D % 64 == 0, "L = 512 and whole 64-column chunks");
static_assert(N == 16 || N == 32, "N = 16 or 32");
static_assert(SLOTS >= 2 * CHUNKS, "the ring holds a tile for each consumer");
static_assert(CONSUMERS * N * LP * 4 <= SLOTS * RAW_BYTES, "the transposed outputs fit in the ring");
static_assert(KV == 0 || KV == 2 || KV == 3, "a cache in the model dtype, or fp8");
static_assert(V_CHUNKS % CONSUMERS == 0 && CHUNKS / OWN >= CONSUMERS, "value chunks split evenly");

struct Smem {
    unsigned char* base;  // 1024-byte aligned
    __device__ unsigned char* slot(int s) const { return base + s * RAW_BYTES; }
    __device__ unsigned char* ct(int c) const { return base + SLOTS * RAW_BYTES + c * CHUNK_BYTES; }
    __device__ unsigned char* q() const { return ct(0) + CT_BYTES; }
    __device__ unsigned char* pt(int w) const { return q() + Q_BYTES + w * PT_BYTES; }
    __device__ float* red(int w) const { return (float*)(pt(CONSUMERS) + w * RED_BYTES); }
    __device__ u64* full() const { return (u64*)(pt(CONSUMERS) + CONSUMERS * RED_BYTES); }
    __device__ u64* empty() const { return full() + SLOTS; }
    // The end of the split, once every tile is consumed: the outputs transposed in the ring,
    // the row maxima where P^T was (the sums go where the column maxima were).
    __device__ float* merged(int w) const { return (float*)base + w * N * LP; }  // [N][LP]
    __device__ float* maxima(int w) const { return (float*)pt(w); }              // [N]
};

}  // namespace

/// Shared memory the kernel needs (the host checks it against its own count).
extern "C" __constant__ int mla_decode_smem_bytes =
    ALIGN + SLOTS * RAW_BYTES + CT_BYTES + Q_BYTES + CONSUMERS * (PT_BYTES + RED_BYTES) + BAR_BYTES;

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
                mbar_expect_bytes(full + 8 * s, RAW_BYTES);
                copy_chunk<RAW_ROW>(&np.kv_map, blocks, boxes, ring + s * RAW_BYTES, full + 8 * s, c);
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

/// fp8: tile `t`'s raw chunks (from `first`) converted into the tile of the model dtype, by
/// both consumer warpgroups (the caller fences and waits for all of them before the products):
/// each chunk awaited, its keys decoded, times k_scale and rounded (zeros outside `keys`),
/// written swizzled as the wgmma operand; then each warp releases the raw chunks.
__device__ __forceinline__ void convert_tile(const Smem& sm, int t, int first, const KeyRange& keys, float k_scale,
                                             u32 full, u32 empty, int lane) {
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
        const int g = t * CHUNKS + c;
        mbar_wait(full + 8 * (g % SLOTS), (g / SLOTS) & 1);
    }
    constexpr int GROUPS = CHUNKS * BN * 8;  // of 8 elements
    for (int i = threadIdx.x; i < GROUPS; i += CONSUMERS * 128) {
        const int c = i / (BN * 8), key = (i / 8) % BN, grp = i % 8;
        const int pos = first + key;
        u32x4 v = {0u, 0u, 0u, 0u};
        if (pos >= keys.start && pos < keys.end) {
            const u32x2 raw = *(const u32x2*)(sm.slot((t * CHUNKS + c) % SLOTS) + key * RAW_ROW + grp * 8);
            v = convert8<KV, BF16>(u32x4{raw.x, raw.y, 0u, 0u}, k_scale);
        }
        *(u32x4*)(sm.ct(c) + swizzled<BN>(key, grp)) = v;
    }
    __syncwarp();  // the warp's reads of the raw chunks are done
    if (lane == 0) {
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c) mbar_arrive(empty + 8 * ((t * CHUNKS + c) % SLOTS));
    }
}

/// Where P^T's element (column c, key k) lives: row c of 64 keys (128 bytes), swizzled.
__device__ __forceinline__ u32 pt_offset(int c, int k) {
    return c * 128 + (((k / 8) ^ (c % 8)) * 16) + (k % 8) * 2;
}

}  // namespace

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
            mbar_init(full + 8 * s, 1);
            mbar_init(empty + 8 * s, 4 * CONSUMERS);  // every consumer warp
        }
        mbar_fence_init();
    }
    __syncthreads();  // the mbarriers are ready: the producer starts while q loads

    if (warp >= PRODUCER_WARP) {
        // The producer warpgroup ends here: the consumers merge and write. (Code after its
        // setmaxnreg.dec must fit the registers it kept, so it shares none of theirs.)
        set_max_registers<false, PRODUCER_REGS>();
        if (warp == PRODUCER_WARP) produce(np, sm, req, first0, tiles, keys);
        return;
    }
    set_max_registers<true, CONSUMER_REGS>();
    load_q(p, sm, cols);
    named_barrier(4, CONSUMERS * 128);  // q landed for both consumer warpgroups
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
    [[maybe_unused]] const float k_scale = FP8 ? read_k_scale(p, tid == 0 && blockIdx.x == 0 && blockIdx.y == 0) : 1.0f;
    // Chunk c of tile t as the products read it: its ring slot, or (fp8) the converted tile.
    const auto operand = [&](int t, int c) -> u32 {
        return FP8 ? smem_addr(sm.ct(c)) : ring + ((t * CHUNKS + c) % SLOTS) * RAW_BYTES;
    };

    for (int t = 0; t < tiles; ++t) {
        const int first = first0 + t * BN;
        if (FP8) {
            // Once both warpgroups are done with the last tile's products, this one's raw
            // chunks into the converted tile, and the conversion complete before the scores.
            named_barrier(5, CONSUMERS * 128);
            convert_tile(sm, t, first, keys, k_scale, full, empty, lane);
            fence_proxy_async();
            named_barrier(5, CONSUMERS * 128);
        }
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
            if (!FP8) mbar_wait(full + 8 * (g % SLOTS), (g / SLOTS) & 1);
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
        // other warpgroup's values (fp8: all were released after the conversion).
        if (!FP8 && lane == 0) {
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
        // chunks (P is 0 there, and 0 x garbage must not be NaN; fp8 converted them to zeros).
        if (!FP8 && (first < keys.start || first + BN > keys.end)) {
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
        if (FP8) {
            wgmma_wait<0>();
        } else {
            release_values<0>(empty, t * CHUNKS + OWN * wg, lane);
        }
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
