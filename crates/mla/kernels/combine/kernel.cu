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
 * Nsight Compute). So, for each of the CTA's slices:
 * 1. warp w takes splits w, w + W, w + 2 W, ..., up to 16 at a time, their LSEs and this
 *    lane's columns of their partials loaded together (one round trip for up to 16 W splits;
 *    the slices spread the bytes over up to 4x more CTAs and SMs), merged online: the warp's
 *    running max m (base 2), weight sum_s 2^(lse_s - m) and weighted sum of the partials.
 *    A split that holds no key of the row has lse -inf (stage 1 writes it; its partial is
 *    never written, so it is replaced by zeros), so the merge needs neither the row's length
 *    nor the split rule: until the sixteenth session a first pass read the length and the
 *    LSEs, a round trip each, before the partials were asked for;
 * 2. the W warps of a head meet in shared memory (only when W > 1), merged in warp order by
 *    the head's warp 0, which writes o = sum / weight (and the first CTA the LSE). The order
 *    is fixed: a row's result does not depend on the run.
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
    Stamps stamps;             // MLA_EXP_STAMPS only
    stamps.begin();
    wait_for_previous_grid();  // stage 1's partials (a programmatic dependent launch on sm_90)
    stamps.mark(1);
    extern __shared__ f32x4 partial[];  // [WARPS][SLICE / 4]: the warps' sums (W > 1)
    __shared__ f32x2 stats[WARPS];      // the warps' (max, weight) (W > 1)
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
    const i64 first = split_slot(p, row, 0, head);  // split s's slot: first + s heads
    const i64 step = p.heads;
#endif
    const float NO_KEY_LSE = bits_to_float(0xff800000u);  // -inf
    const int nb = min(BATCH, max(0, (splits - w + W - 1) / W));  // this warp's splits a batch

    for (int slice = blockIdx.z; slice < L / SLICE; slice += gridDim.z) {
        const int col = SLICE * slice + 4 * lane;  // this lane's four columns
        // 1. This warp's splits, BATCH at a time, merged online.
        float m = NO_KEY_LSE, total = 0.0f;  // base 2
        f32x4 acc = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int s0 = w; s0 < splits; s0 += BATCH * W) {
            f32x4 x[BATCH];
            float lse[BATCH];
#pragma unroll
            for (int b = 0; b < BATCH; ++b) {
                lse[b] = NO_KEY_LSE;
                if (b < nb) {
                    const int s = min(s0 + b * W, splits - 1);  // past the last: weight 0
                    const i64 slot = first + s * step;
                    if (s0 + b * W < splits) lse[b] = p.part_lse[slot] * LOG2E;
                    x[b] = *(const f32x4*)(p.part_o + slot * L + col);
                }
            }
            float top = m;
#pragma unroll
            for (int b = 0; b < BATCH; ++b) top = fmaxf(top, lse[b]);
            if (top == NO_KEY_LSE) continue;  // no key in any split so far
            const float keep = exp2_approx(m - top);  // 0 while m is -inf
            acc = scaled(acc, keep);
            total *= keep;
#pragma unroll
            for (int b = 0; b < BATCH; ++b) {
                if (b >= nb) break;
                // A split with no key: weight 0, and its partial (never written, maybe NaN)
                // replaced; a select, not a branch, so that every load stays in flight.
                const bool empty = lse[b] == NO_KEY_LSE;
                const float weight = exp2_approx(lse[b] - top);
                add_scaled(acc, weight, empty ? f32x4{0.0f, 0.0f, 0.0f, 0.0f} : x[b]);
                total += weight;
            }
            m = top;
        }

        // 2. The head's W warps merged in warp order by its warp 0.
        if (W > 1) {  // uniform over the CTA
            const int slot = threadIdx.y * W + w;
            if (w > 0) {
                partial[slot * (SLICE / 4) + lane] = acc;
                if (lane == 0) stats[slot] = f32x2{m, total};
            }
            __syncthreads();
            if (w == 0) {
                for (int v = 1; v < W; ++v) {
                    const f32x2 st = stats[slot + v];
                    const float top = fmaxf(m, st.x);
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
                p.lse[row * p.lse_row + head] = total > 0.0f ? (m + log2_approx(total)) * LN2 : NO_KEY_LSE;
            }
        }
    }
    stamps.mark(2);
    stamps.print("combine");
}
