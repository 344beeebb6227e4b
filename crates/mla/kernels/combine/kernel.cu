/**
 * @file combine/kernel.cu
 * @brief Stage 2 of the split-KV decode: merges each row's splits into o (model dtype) and
 * lse (f32, natural log), skipping the splits that hold no key.
 *
 * Grid: x = query row, y = head block, z = 128-column slices (up to L / 128; a CTA takes
 * slices z, z + gridDim.z, ... in turn). Block:
 * (32 W, G) with W G = 8 warps: G heads a CTA (threadIdx.y), W warps a head (threadIdx.x / 32;
 * src/backend/cuda/combine.rs picks W). Lane i owns the slice's columns 4 i .. 4 i + 3.
 *
 * The time of a small batch's combine is memory latency, not bytes: one warp walking 64
 * splits 8 at a time over all 512 columns paid 8 round trips (10 us at 1 x 16 x 8192 in
 * Nsight Compute). So:
 * 1. every warp reads all of its head's split LSEs (the lanes side by side) and reduces them
 *    to the largest m and the sum of 2^(lse_s - m), both the same bits on every lane;
 * 2. warp w takes splits w, w + W, w + 2 W, ..., up to 16 at a time with their loads issued
 *    together (the weights are known before the partials arrive): one round trip for up to
 *    16 W splits, the slices spreading the bytes over up to 4x more CTAs (and SMs);
 * 3. the W partial sums meet in shared memory (dynamic, only when W > 1), added in warp order
 *    by the head's warp 0, which writes o = sum / total (and the first CTA the LSE). The order is
 *    fixed: a row's result does not depend on the run.
 * A row with no key at all gets o = 0 and lse = -inf.
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
constexpr int WARPS = 8;   // warps a CTA: W a head x G heads
constexpr int SLICE = 128; // columns a CTA's head takes (a float4 a lane)
constexpr int BATCH = 16;  // splits a warp reads at once
constexpr float LOG2E = 1.44269504088896340736f;
constexpr float LN2 = 0.69314718055994530942f;
static_assert(L % SLICE == 0, "L must be a multiple of 128");

/// Merges (max, sum of 2^(x - max)) pairs; -inf maxima hold a sum of 0. Commutative bit for
/// bit, so a butterfly leaves the same result on every lane.
__device__ __forceinline__ void merge_max_sum(float& m, float& sum, float m2, float sum2) {
    const float top = fmaxf(m, m2);
    if (top == bits_to_float(0xff800000u)) return;  // both empty
    const float a = m == top ? sum : sum * exp2_approx(m - top);
    const float b = m2 == top ? sum2 : sum2 * exp2_approx(m2 - top);
    m = top;
    sum = a + b;
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
    extern __shared__ f32x4 partial[];  // [WARPS][SLICE / 4]: the warps' sums (W > 1)
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
#else
    const int splits = p.num_kv_splits;
    const KeyRange keys = row_keys(p, row, false);  // stage 1 already raised any error
    const int per = split_len(keys, splits);           // the division once, not once a split
    const i64 slot0 = split_slot(p, row, 0, head);    // split s's slot: slot0 + s heads
#endif

    // A split's partial LSE (base 2), -inf when it holds no key (then it is never read).
    const auto split_lse = [&](int s) -> float {
#if MLA_SCHED
        return p.part_lse[first + s * step] * LOG2E;
#else
        const KeyRange k = split_at(keys, s, per);
        return k.start < k.end ? p.part_lse[slot0 + (i64)s * p.heads] * LOG2E : bits_to_float(0xff800000u);
#endif
    };
    // Four columns of a split's partial output.
    const auto split_o = [&](int s, int col) -> f32x4 {
#if MLA_SCHED
        return *(const f32x4*)(p.part_o + (first + s * step) * L + col);
#else
        return *(const f32x4*)(p.part_o + (slot0 + (i64)s * p.heads) * L + col);
#endif
    };

    // 1. The largest LSE m and the total weight sum_s 2^(lse_s - m), the lanes side by side.
    float m = bits_to_float(0xff800000u), total = 0.0f;  // base 2
    for (int s0 = 0; s0 < splits; s0 += 4 * 32) {  // the loads first: one round trip
        float v[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int s = s0 + 32 * k + lane;
            v[k] = s < splits ? split_lse(s) : bits_to_float(0xff800000u);
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) merge_max_sum(m, total, v[k], 1.0f);
    }
#pragma unroll
    for (int d = 16; d > 0; d /= 2) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, d);
        const float t2 = __shfl_xor_sync(0xffffffffu, total, d);
        merge_max_sum(m, total, m2, t2);
    }

    // 2 and 3, for each of this CTA's slices (gridDim.z of the L / 128 at a time: where the
    // batch fills the GPU, a warp takes several slices in turn rather than the grid more CTAs).
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
    const int nb = min(BATCH, max(0, (splits - w + W - 1) / W));  // this warp's splits a batch
    for (int slice = blockIdx.z; slice < L / SLICE; slice += gridDim.z) {
        const int col = SLICE * slice + 4 * lane;  // this lane's four columns
        // 2. This warp's splits, BATCH at a time: the weights and partials of a batch are
        // loaded together, before any is used.
        f32x4 acc = {0.0f, 0.0f, 0.0f, 0.0f};
        if (m != bits_to_float(0xff800000u)) {  // else o = 0, lse = -inf
            for (int s0 = w; s0 < splits; s0 += BATCH * W) {
                f32x4 x[BATCH];
                float lse[BATCH];
#pragma unroll
                for (int b = 0; b < BATCH; ++b) {
                    if (b < nb) {
                        const int s = min(s0 + b * W, splits - 1);  // past the last: weight 0
                        lse[b] = s0 + b * W < splits ? split_lse(s) : bits_to_float(0xff800000u);
                        x[b] = split_o(s, col);
                    }
                }
#pragma unroll
                for (int b = 0; b < BATCH; ++b) {
                    // An empty split's partial is garbage: weight 0, and its values replaced
                    // (0 x NaN is NaN). A select, not a branch: a branch lets the compiler
                    // sink each load under its own test, one round trip a split.
                    if (b < nb) {
                        const bool empty = lse[b] == bits_to_float(0xff800000u);
                        const f32x4 v = empty ? f32x4{0.0f, 0.0f, 0.0f, 0.0f} : x[b];
                        add_scaled(acc, exp2_approx(lse[b] - m), v);
                    }
                }
            }
        }

        // 3. The head's W sums, added in warp order by its warp 0.
        if (W > 1) {  // uniform over the CTA
            const int slot = threadIdx.y * W + w;
            if (w > 0) partial[slot * (SLICE / 4) + lane] = acc;
            __syncthreads();
            if (w == 0) {
                for (int v = 1; v < W; ++v) add_scaled(acc, 1.0f, partial[(slot + v) * (SLICE / 4) + lane]);
            }
            __syncthreads();  // read before the next slice overwrites it
        }
        if (live && w == 0) {
            u16* out = (u16*)p.o + row * p.o_row + head * p.o_head + col;
            // Two 4-byte stores: o need only be 4-byte aligned (mod.rs, `pointers`).
            ((u32*)out)[0] = pack2<BF16>(acc.x * inv, acc.y * inv);
            ((u32*)out)[1] = pack2<BF16>(acc.z * inv, acc.w * inv);
        }
    }
    if (live && w == 0 && lane == 0 && blockIdx.z == 0) {
        p.lse[row * p.lse_row + head] = total > 0.0f ? (m + log2_approx(total)) * LN2 : bits_to_float(0xff800000u);
    }
}
