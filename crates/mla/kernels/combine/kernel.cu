/**
 * @file combine/kernel.cu
 * @brief Stage 2 of the split-KV decode: merges each row's splits in ascending order into o
 * (model dtype) and lse (f32, natural log), skipping the splits that hold no key.
 *
 * Grid: x = query row, y = head / 4. Block: 4 warps, one head each; lane i owns output
 * columns 4 * (i + 32 * j) .. + 4. The merge takes two passes: the largest split LSE m, then
 * o = sum_s e^(lse_s - m) o_s / sum_s e^(lse_s - m) over the non-empty splits in ascending
 * order, the partials of 8 splits read at a time (the weights are known before they are
 * read). A row with no key at all gets o = 0 and lse = -inf.
 *
 * Scheduled (MLA_SCHED 1: the argument is a ScheduleParams, docs/scheduler.md,
 * common/schedule.cuh): the schedule's job is the row; a row of one split was written by
 * stage 1, the others' pieces are merged from their slots in order (slot (first_slot[row] +
 * split) x head blocks + head block, job_rows rows each), and an empty piece (lse -inf) is
 * skipped.
 *
 * Compile-time configuration: MLA_L (a multiple of 128), MLA_BF16, MLA_SCHED.
 */
#include "common/ptx.cuh"
#include "common/rows.cuh"
#include "params.cuh"

namespace {
constexpr int L = MLA_L;
constexpr bool BF16 = MLA_BF16 != 0;
constexpr int PER_LANE = L / 128;  // float4 groups per lane
constexpr float LOG2E = 1.44269504088896340736f;
constexpr float LN2 = 0.69314718055994530942f;
static_assert(L % 128 == 0, "L must be a multiple of 128");
}  // namespace

#if MLA_SCHED
extern "C" __global__ void __launch_bounds__(128) mla_decode_combine(const ScheduleParams sp) {
    const DecodeParams& p = sp.d;
#else
extern "C" __global__ void __launch_bounds__(128) mla_decode_combine(const DecodeParams p) {
#endif
    wait_for_previous_grid();  // stage 1's partials (a programmatic dependent launch on sm_90)
    const int lane = threadIdx.x % 32;
    const int row = blockIdx.x;
    const int head = blockIdx.y * 4 + threadIdx.x / 32;
    if (head >= p.heads) return;
#if MLA_SCHED
    const int splits = sp.splits[row];
    if (splits == 1) return;  // stage 1 wrote o and lse
    const int head_blocks = (p.heads + sp.job_rows - 1) / sp.job_rows;
    const i64 first = ((i64)sp.first_slot[row] * head_blocks + head / sp.job_rows) * sp.job_rows + head % sp.job_rows;
    const i64 step = (i64)head_blocks * sp.job_rows;  // from one split's slot to the next
#else
    const int splits = p.num_kv_splits;
    const KeyRange keys = row_keys(p, row, false);  // stage 1 already raised any error
#endif

    // A split's partial LSE (base 2), -inf when it holds no key (then it is never read).
    const auto split_lse = [&](int s) -> float {
#if MLA_SCHED
        return p.part_lse[first + s * step] * LOG2E;
#else
        const KeyRange k = split_keys(keys, s, splits);
        return k.start < k.end ? p.part_lse[((i64)row * splits + s) * p.heads + head] * LOG2E
                               : bits_to_float(0xff800000u);
#endif
    };
    const auto split_o = [&](int s) -> const f32x4* {
#if MLA_SCHED
        return (const f32x4*)(p.part_o + (first + s * step) * L);
#else
        return (const f32x4*)(p.part_o + (((i64)row * splits + s) * p.heads + head) * L);
#endif
    };

    // Pass 1: the largest LSE, the lanes reading the splits' LSEs side by side.
    float m = bits_to_float(0xff800000u);  // base 2
    for (int s = lane; s < splits; s += 32) m = fmaxf(m, split_lse(s));
#pragma unroll
    for (int d = 16; d > 0; d /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, d));

    // Pass 2: o = sum_s 2^(lse_s - m) o_s / sum_s 2^(lse_s - m), in ascending split order.
    // The weights are known before the partials are read, so BATCH splits' loads are issued
    // together with no branch between them (a split past the last one reads the first split's
    // row with weight 0): the walk pays one memory latency a batch, not one a split (a batch
    // of one request spreads its keys over up to 64 splits).
    f32x4 acc[PER_LANE];
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) acc[j] = {0.0f, 0.0f, 0.0f, 0.0f};
    float sum = 0.0f;
    if (m != bits_to_float(0xff800000u)) {  // else no split holds a key: o = 0, lse = -inf
        constexpr int BATCH = 8;
        for (int s0 = 0; s0 < splits; s0 += 32) {
            // Lane i holds the weight of split s0 + i (0 when empty or past the end).
            const float w_lane = s0 + lane < splits ? exp2_approx(split_lse(s0 + lane) - m) : 0.0f;
            const int n = min(32, splits - s0);
            for (int b0 = 0; b0 < n; b0 += BATCH) {
                f32x4 x[BATCH][PER_LANE];
#pragma unroll
                for (int b = 0; b < BATCH; ++b) {
                    const f32x4* part = split_o(b0 + b < n ? s0 + b0 + b : s0);
#pragma unroll
                    for (int j = 0; j < PER_LANE; ++j) x[b][j] = part[lane + 32 * j];
                }
#pragma unroll
                for (int b = 0; b < BATCH; ++b) {
                    const float w = __shfl_sync(0xffffffffu, w_lane, (b0 + b) % 32);
                    if (w == 0.0f) continue;  // warp-uniform; an empty split's row is garbage
#pragma unroll
                    for (int j = 0; j < PER_LANE; ++j) {
                        acc[j].x = fmaf(w, x[b][j].x, acc[j].x);
                        acc[j].y = fmaf(w, x[b][j].y, acc[j].y);
                        acc[j].z = fmaf(w, x[b][j].z, acc[j].z);
                        acc[j].w = fmaf(w, x[b][j].w, acc[j].w);
                    }
                    sum += w;
                }
            }
        }
    }
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    u16* out = (u16*)p.o + row * p.o_row + head * p.o_head;
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) {
        const int col = 4 * (lane + 32 * j);
        *(u32*)(out + col) = pack2<BF16>(acc[j].x * inv, acc[j].y * inv);
        *(u32*)(out + col + 2) = pack2<BF16>(acc[j].z * inv, acc[j].w * inv);
    }
    if (lane == 0) {
        p.lse[row * p.lse_row + head] = sum > 0.0f ? (m + log2_approx(sum)) * LN2 : bits_to_float(0xff800000u);
    }
}
