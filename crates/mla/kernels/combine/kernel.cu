/**
 * @file combine/kernel.cu
 * @brief Stage 2 of the split-KV decode: merges each row's splits into o (model dtype) and
 * lse (f32, natural log), skipping the splits that hold no key.
 *
 * Grid: x = query row, y = head block, z = 128-column slices (up to L / 128; a CTA takes
 * slices z, z + gridDim.z, ... in turn). Block:
 * (32 W, G) with W G = 8 warps: G heads a CTA (threadIdx.y), W warps a head (threadIdx.x / 32;
 * src/backend/cuda/combine.rs picks W and the shared memory). Lane i owns the slice's columns
 * 4 i .. 4 i + 3.
 *
 * A small batch's combine is latency: its loads' round trip and the fetching of its code,
 * which each CTA runs once. One warp walking 64 splits 8 at a time paid 8 round trips (10 us
 * at 1 x 16 x 8192 in Nsight Compute); the one-pass version after it, with 16 splits' loads
 * unrolled into registers, ran 1,250 instructions of straight code and took 8,900 cycles
 * after stage 1 (4,400 when run again at once, warm), about 5 us of a
 * 1 x 16 x 1024 decode of 11.6. So, for each of the CTA's slices, in a loop that is not
 * unrolled:
 * 1. warp w takes splits w, w + W, w + 2 W, ..., up to BATCH at a time: lane b of the warp
 *    loads split b's LSE, and every lane copies its 16 bytes of each split's partial into the
 *    warp's staging rows in shared memory (cp.async: issued by a rolled loop, all in flight
 *    together); the warp's max and weights by shuffles; the partials merged from shared
 *    memory into the warp's running max m (base 2), weight sum and weighted sum. A split
 *    that holds no key of the row has lse -inf (stage 1 writes it; its partial is never
 *    written) and weight 0, and is skipped; so the merge needs neither the row's length nor
 *    the split rule;
 * 2. the W warps of a head meet in shared memory (only when W > 1), merged in warp order by
 *    the head's warp 0, which writes o = sum / weight (and the first CTA the LSE). The order
 *    is fixed: a row's result does not depend on the run.
 * A row with no key at all gets o = 0 and lse = -inf; a split whose LSE is NaN (a NaN in q or
 * in a key it read) makes the row's o and lse NaN: the maxima are taken with fmax_nan, which
 * keeps a NaN, where fmaxf would drop it.
 *
 * Shared memory (dynamic): the staging rows, [8 warps][ROWS][32 lanes] float4, then, when
 * W > 1, the warps' sums [8][SLICE / 4] float4. ROWS, the splits a warp stages at once (at
 * most BATCH): on the split grid min(BATCH, a warp's splits), counted the same by
 * combine.rs; on the schedule a warp's share of the mean count, the host's choice, which the
 * kernel reads back from the launch's dynamic shared memory.
 *
 * Scheduled (MLA_SCHED 1: the argument is a ScheduleParams, docs/scheduler.md,
 * common/schedule.cuh): the schedule's job is the row; a row of one split was written by
 * stage 1, the others' pieces are merged from their slots (slot (first_slot[row] + split) x
 * head blocks + head block, job_rows rows each), and an empty piece (lse -inf) is skipped.
 *
 * Compile-time configuration: MLA_L (a multiple of 128), MLA_BF16, MLA_SCHED.
 */
#include "common/keys.cuh"
#include "common/ptx.cuh"
#include "common/rows.cuh"
#include "params.cuh"

namespace {
constexpr int L = MLA_L;
constexpr bool BF16 = MLA_BF16 != 0;
constexpr int WARPS = 8;    // warps a CTA: W a head x G heads
constexpr int SLICE = 128;  // columns a CTA's head takes (a float4 a lane)
constexpr int BATCH = 16;   // splits a warp reads at once (combine.rs: the same)
constexpr float LOG2E = 1.44269504088896340736f;
constexpr float LN2 = 0.69314718055994530942f;
static_assert(L % SLICE == 0, "L must be a multiple of 128");

__device__ __forceinline__ f32x4 scaled(const f32x4& x, float w) {
    return {x.x * w, x.y * w, x.z * w, x.w * w};
}

__device__ __forceinline__ void add_scaled(f32x4& acc, float w, const f32x4& x) {
    acc.x = fmaf(w, x.x, acc.x);
    acc.y = fmaf(w, x.y, acc.y);
    acc.z = fmaf(w, x.z, acc.z);
    acc.w = fmaf(w, x.w, acc.w);
}
}  // namespace

#if MLA_SCHED
extern "C" __global__ void __launch_bounds__(32 * WARPS) mla_decode_combine(const ScheduleParams sp) {
    const DecodeParams& p = sp.d;
#else
extern "C" __global__ void __launch_bounds__(32 * WARPS) mla_decode_combine(const DecodeParams p) {
#endif
    wait_for_previous_grid();  // stage 1's partials (a programmatic dependent launch on sm_90)
    extern __shared__ f32x4 smem[];
    __shared__ f32x2 stats[WARPS];  // the warps' (max, weight) (W > 1)
    const int lane = threadIdx.x % 32;
    const int w = threadIdx.x / 32, W = blockDim.x / 32;  // this warp of the head's W
    const int row = blockIdx.x;
    const int head_wanted = blockIdx.y * blockDim.y + threadIdx.y;
    const bool live = head_wanted < p.heads;  // a padding head reads head 0 and writes nothing
    const int head = live ? head_wanted : 0;
#if MLA_SCHED
    const int splits = sp.splits[row];
    if (splits == 1) return;  // stage 1 wrote o and lse (the whole CTA: one row)
    const int head_blocks = (p.heads + sp.job_rows - 1) / sp.job_rows;
    const i64 first = ((i64)sp.first_slot[row] * head_blocks + head / sp.job_rows) * sp.job_rows + head % sp.job_rows;
    const i64 step = (i64)head_blocks * sp.job_rows;  // from one split's slot to the next
    // The staging rows a warp has (sized by the host for the mean count: a row with more
    // takes more batches): what the launch's shared memory holds beyond the sums.
    const int rows_a_warp =
        (int)(dynamic_smem_bytes() - (W > 1 ? WARPS * SLICE * 4 : 0)) / (WARPS * 32 * (int)sizeof(f32x4));
#else
    const int splits = p.num_kv_splits;
    const i64 first = split_slot(p, row, 0, head);  // split s's slot: first + s heads
    const i64 step = p.heads;
    // combine.rs counts the same (a batch, or all of a warp's splits if fewer): reading it
    // back from the shared memory's size, as the schedule does, cost 0.3 to 0.5 us a decode
    // here (1 x 16 x 8192: 14.9 -> 15.4 us; H200, 2026-12-03, ece2f1c).
    const int rows_a_warp = min(BATCH, (splits + W - 1) / W);
#endif
    const int slot = threadIdx.y * W + w;  // this warp in the CTA
    const auto split_at = [&](int s) { return first + (i64)s * step; };  // split s's workspace row
    const f32x4* rows = smem + slot * rows_a_warp * 32 + lane;  // this lane's staging: row b at rows[32 b]
    const u32 staging = smem_addr(rows);                            // row b: + 512 b bytes
    f32x4* partial = smem + WARPS * rows_a_warp * 32;  // [WARPS][SLICE / 4]: the warps' sums (W > 1)
    const float NO_KEY_LSE = bits_to_float(0xff800000u);  // -inf

    for (int slice = blockIdx.z; slice < L / SLICE; slice += gridDim.z) {
        const int col = SLICE * slice + 4 * lane;  // this lane's four columns
        // 1. This warp's splits, rows_a_warp at a time, merged online.
        float m = NO_KEY_LSE, total = 0.0f;  // base 2
        f32x4 acc = {0.0f, 0.0f, 0.0f, 0.0f};
        // A warp's next batch (on the split grid a warp takes a second only after a full one:
        // rows_a_warp is BATCH then).
        for (int s0 = w; s0 < splits; s0 += rows_a_warp * W) {
            const int n = min(rows_a_warp, (splits - s0 + W - 1) / W);  // this batch's splits
#pragma unroll 1
            for (int b = 0; b < n; ++b) {
                cp_async16(staging + 512 * b, p.part_o + split_at(s0 + b * W) * L + col, true);
            }
            cp_async_commit();
            const float lse = lane < n ? p.part_lse[split_at(s0 + lane * W)] * LOG2E : NO_KEY_LSE;
            const float top = fmax_nan(m, warp_max(lse));  // a NaN split's LSE makes the row NaN
            cp_async_wait_group<0>();  // this lane's rows (no other lane reads them)
            if (top == NO_KEY_LSE) continue;  // no key in any split so far
            const float keep = exp2_approx(m - top);  // 0 while m is -inf
            const float weight = exp2_approx(lse - top);  // lane b: split b's; 0 for no key
            acc = scaled(acc, keep);
            total = total * keep + warp_sum(weight);
#pragma unroll 1
            for (int b = 0; b < n; ++b) {
                const float wb = __shfl_sync(0xffffffffu, weight, b);
                // A split with no key (weight 0): its partial was never written (maybe NaN).
                if (wb > 0.0f) add_scaled(acc, wb, rows[32 * b]);
            }
            m = top;
        }

        // 2. The head's W warps merged in warp order by its warp 0.
        if (W > 1) {  // uniform over the CTA
            if (w > 0) {
                partial[slot * (SLICE / 4) + lane] = acc;
                if (lane == 0) stats[slot] = f32x2{m, total};
            }
            __syncthreads();
            if (w == 0) {
                for (int v = 1; v < W; ++v) {
                    const f32x2 st = stats[slot + v];
                    const float top = fmax_nan(m, st.x);
                    if (top == NO_KEY_LSE) continue;
                    const float a = exp2_approx(m - top), b = exp2_approx(st.x - top);
                    acc = scaled(acc, a);
                    add_scaled(acc, b, partial[(slot + v) * (SLICE / 4) + lane]);
                    total = total * a + st.y * b;
                    m = top;
                }
            }
            __syncthreads();  // read before the next slice overwrites it
        }
        if (live && w == 0) {
            const float inv = total > 0.0f ? 1.0f / total : 0.0f;  // a row with no key: o = 0
            u16* out = (u16*)p.o + row * p.o_row + head * p.o_head + col;
            // Two 4-byte stores: o need only be 4-byte aligned (mod.rs, `pointers`).
            ((u32*)out)[0] = pack2<BF16>(acc.x * inv, acc.y * inv);
            ((u32*)out)[1] = pack2<BF16>(acc.z * inv, acc.w * inv);
            if (lane == 0 && slice == 0) {
                // total is 0 (no key), NaN (a NaN split: lse NaN too) or at least 1.
                p.lse[row * p.lse_row + head] = total == 0.0f ? NO_KEY_LSE : (m + log2_approx(total)) * LN2;
            }
        }
    }
}
