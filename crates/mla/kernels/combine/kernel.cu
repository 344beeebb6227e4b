/**
 * @file combine/kernel.cu
 * @brief Stage 2 of the split-KV decode: merges each row's splits in ascending order into o
 * (model dtype) and lse (f32, natural log), skipping the splits that hold no key.
 *
 * Grid: x = query row, y = head / 4. Block: 4 warps, one head each; lane i owns output
 * columns 4 * (i + 32 * j) .. + 4. The merge is vLLM's: for each non-empty split s,
 * m' = max(m, lse_s); acc = acc * e^(m - m') + e^(lse_s - m') * o_s; sum likewise. A row with
 * no key at all gets o = 0 and lse = -inf.
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

    f32x4 acc[PER_LANE];
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) acc[j] = {0.0f, 0.0f, 0.0f, 0.0f};
    float m = bits_to_float(0xff800000u), sum = 0.0f;  // m in base 2
    // Splits go in batches of BATCH: their loads are issued together, so the walk pays one
    // memory latency per batch, not per split. The merge itself stays in ascending order.
    constexpr int BATCH = 4;
    for (int s0 = 0; s0 < splits; s0 += BATCH) {
        float lse_s[BATCH];
        f32x4 x[BATCH][PER_LANE];
#pragma unroll
        for (int b = 0; b < BATCH; ++b) {
            const int s = s0 + b;
            lse_s[b] = bits_to_float(0xff800000u);  // an empty or missing split weighs 0
#if MLA_SCHED
            if (s < splits) {
                const i64 at = first + s * step;
#else
            const KeyRange k = split_keys(keys, s, splits);
            if (s < splits && k.start < k.end) {
                const i64 at = ((i64)row * splits + s) * p.heads + head;
#endif
                lse_s[b] = p.part_lse[at] * LOG2E;
                const f32x4* part = (const f32x4*)(p.part_o + at * L);
#pragma unroll
                for (int j = 0; j < PER_LANE; ++j) x[b][j] = part[lane + 32 * j];
            }
        }
#pragma unroll
        for (int b = 0; b < BATCH; ++b) {
            if (lse_s[b] == bits_to_float(0xff800000u)) continue;  // skipped, never read
            const float m_new = fmaxf(m, lse_s[b]);
            const float old = exp2_approx(m - m_new);
            const float w = exp2_approx(lse_s[b] - m_new);
#pragma unroll
            for (int j = 0; j < PER_LANE; ++j) {
                acc[j].x = acc[j].x * old + w * x[b][j].x;
                acc[j].y = acc[j].y * old + w * x[b][j].y;
                acc[j].z = acc[j].z * old + w * x[b][j].z;
                acc[j].w = acc[j].w * old + w * x[b][j].w;
            }
            sum = sum * old + w;
            m = m_new;
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
