/**
 * @file dcp/kernel.cu
 * @brief Decode context parallelism around the decode kernels (docs/dcp.md): each rank's
 * local sequence lengths, and the merge of the ranks' (o, lse) by LSE, in f32:
 * lse = log sum_r e^(lse_r), o = sum_r e^(lse_r - lse) * o_r.
 *
 * Two merge paths (docs/dcp.md, "Merge"), each two kernels around NCCL:
 * - all-gather + reduce-scatter: `dcp_scale_partials` (after the lse all-gather) writes each
 *   head's weighted o in f32 into the slot of the rank that owns the head, NCCL sums the slots
 *   (reduce-scatter), `dcp_finish_sum` rounds this rank's H heads into o and writes their lse;
 * - all-to-all: `dcp_pack` copies each head's o and lse into the slot of its owner, NCCL swaps
 *   the slots, `dcp_merge_gathered` merges the N parts of this rank's heads.
 * A rank with no key for a row has lse_r = -inf: it weighs 0 and its o is never read (it may
 * hold anything), so no NaN can come from it. A head with no key anywhere gets o = 0,
 * lse = -inf.
 *
 * Grids: `dcp_local_seq_lens` x = request / 128. The others x = query row, y = head / 4;
 * block (64, 4): one head per y, each x-thread 8 columns (one 16-byte load) at a time.
 * Compile-time configuration: MODEL_BF16 (1: bf16, 0: f16).
 */
#include "common/half.cuh"
#include "dcp/params.cuh"

namespace {
constexpr bool BF16 = MODEL_BF16 != 0;
constexpr int COLS = 8;  // model-dtype values per 16-byte load
constexpr int LANES = 64;

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

/// Eight model-dtype values (16 bytes) as f32.
__device__ __forceinline__ void load8(const void* src, float v[COLS]) {
    const u32x4 b = *(const u32x4*)src;
    const u32 w[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        v[2 * i] = half_to_float<BF16>(w[i] & 0xffffu);
        v[2 * i + 1] = half_to_float<BF16>(w[i] >> 16);
    }
}

/// Eight f32 rounded into the model dtype (one 16-byte store).
__device__ __forceinline__ void store8(void* dst, const float v[COLS]) {
    *(u32x4*)dst = {pack2<BF16>(v[0], v[1]), pack2<BF16>(v[2], v[3]), pack2<BF16>(v[4], v[5]), pack2<BF16>(v[6], v[7])};
}

/// lse = m + log(sum_r e^(lse_r - m)) over `n` values `stride` apart; -inf when all are,
/// NaN when one is (its o is NaN too: the merge keeps both).
__device__ __forceinline__ float merged_lse(const float* lse, int n, i64 stride) {
    float m = neg_inf();
    for (int r = 0; r < n; ++r) m = fmax_nan(m, lse[r * stride]);
    if (m == neg_inf()) return m;  // no key on any rank: -inf - -inf would be NaN
    float s = 0.0f;
    for (int r = 0; r < n; ++r) s += expf(lse[r * stride] - m);  // e^-inf = 0
    return m + logf(s);
}

/// The weight of a part: e^(lse_r - lse), exactly 0 for a part with no key.
__device__ __forceinline__ float weight(float lse_r, float lse) {
    return lse_r == neg_inf() ? 0.0f : expf(lse_r - lse);
}
}  // namespace

/// Rank `rank` of N holds token p when (p / I) % N == rank, at local position
/// (p / (I N)) I + p % I: its length is I per full round of I N tokens plus its share of the
/// last, partial round. A negative length passes through (the decode flags it).
extern "C" __global__ void __launch_bounds__(128) dcp_local_seq_lens(const DcpParams p) {
    const int i = blockIdx.x * 128 + threadIdx.x;
    if (i >= p.requests) return;
    const int len = p.seq_lens_global[i];
    if (len < 0) {
        p.seq_lens_local[i] = len;
        return;
    }
    const int round = p.interleave * p.world;
    const int last = len % round - p.rank * p.interleave;
    p.seq_lens_local[i] = (len / round) * p.interleave + min(max(last, 0), p.interleave);
}

/// All-gather path, step 1: scaled_o[owner][row][head % H] = e^(lse_r - lse) * part_o, f32.
extern "C" __global__ void __launch_bounds__(256) dcp_scale_partials(const DcpParams p) {
    const int row = blockIdx.x;
    const int hn = p.heads * p.world;
    const int g = blockIdx.y * 4 + threadIdx.y;  // head among the H N this rank attended
    if (g >= hn) return;
    const i64 at = (i64)row * hn + g;
    const float lse = merged_lse(p.lse_all + at, p.world, (i64)p.rows * hn);
    const float w = weight(p.part_lse[at], lse);
    const int owner = g / p.heads;
    float* dst = p.scaled_o + (((i64)owner * p.rows + row) * p.heads + g % p.heads) * p.kv_lora_rank;
    const u16* src = (const u16*)p.part_o + at * p.kv_lora_rank;
    for (int c = threadIdx.x * COLS; c < p.kv_lora_rank; c += LANES * COLS) {
        float v[COLS] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        if (w != 0.0f) {  // a part with no key is never read: 0 * NaN would be NaN
            load8(src + c, v);
#pragma unroll
            for (int j = 0; j < COLS; ++j) v[j] *= w;
        }
        *(f32x4*)(dst + c) = {v[0], v[1], v[2], v[3]};
        *(f32x4*)(dst + c + 4) = {v[4], v[5], v[6], v[7]};
    }
}

/// All-gather path, step 2: o = round(summed_o), lse = the merged lse of this rank's heads.
extern "C" __global__ void __launch_bounds__(256) dcp_finish_sum(const DcpParams p) {
    const int row = blockIdx.x;
    const int h = blockIdx.y * 4 + threadIdx.y;
    if (h >= p.heads) return;
    const int hn = p.heads * p.world;
    const i64 at = (i64)row * hn + p.rank * p.heads + h;
    if (threadIdx.x == 0) {
        p.lse[row * p.lse_row + h] = merged_lse(p.lse_all + at, p.world, (i64)p.rows * hn);
    }
    const float* src = p.summed_o + ((i64)row * p.heads + h) * p.kv_lora_rank;
    u16* dst = (u16*)p.o + row * p.o_row + h * p.o_head;
    for (int c = threadIdx.x * COLS; c < p.kv_lora_rank; c += LANES * COLS) {
        const f32x4 a = *(const f32x4*)(src + c), b = *(const f32x4*)(src + c + 4);
        const float v[COLS] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        store8(dst + c, v);
    }
}

/// All-to-all path, step 1: packed[owner][row][head % H] = part (o zeroed where lse = -inf).
extern "C" __global__ void __launch_bounds__(256) dcp_pack(const DcpParams p) {
    const int row = blockIdx.x;
    const int hn = p.heads * p.world;
    const int g = blockIdx.y * 4 + threadIdx.y;
    if (g >= hn) return;
    const i64 at = (i64)row * hn + g;
    const float lse = p.part_lse[at];
    const i64 slot = ((i64)(g / p.heads) * p.rows + row) * p.heads + g % p.heads;
    if (threadIdx.x == 0) p.packed_lse[slot] = lse;
    const u32x4* src = (const u32x4*)((const u16*)p.part_o + at * p.kv_lora_rank);
    u32x4* dst = (u32x4*)((u16*)p.packed_o + slot * p.kv_lora_rank);
    for (int c = threadIdx.x; c < p.kv_lora_rank / COLS; c += LANES) {
        dst[c] = lse == neg_inf() ? u32x4{0u, 0u, 0u, 0u} : src[c];
    }
}

/// All-to-all path, step 2: this rank's heads merged from the N parts it received.
extern "C" __global__ void __launch_bounds__(256) dcp_merge_gathered(const DcpParams p) {
    const int row = blockIdx.x;
    const int h = blockIdx.y * 4 + threadIdx.y;
    if (h >= p.heads) return;
    const i64 at = (i64)row * p.heads + h;
    const i64 part = (i64)p.rows * p.heads;  // between ranks' slots
    const float lse = merged_lse(p.gathered_lse + at, p.world, part);
    if (threadIdx.x == 0) p.lse[row * p.lse_row + h] = lse;
    u16* dst = (u16*)p.o + row * p.o_row + h * p.o_head;
    for (int c = threadIdx.x * COLS; c < p.kv_lora_rank; c += LANES * COLS) {
        float acc[COLS] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        for (int r = 0; r < p.world; ++r) {
            const float w = weight(p.gathered_lse[at + r * part], lse);
            if (w == 0.0f) continue;  // never read: it may hold anything
            float v[COLS];
            load8((const u16*)p.gathered_o + (at + r * part) * p.kv_lora_rank + c, v);
#pragma unroll
            for (int j = 0; j < COLS; ++j) acc[j] += w * v[j];
        }
        store8(dst + c, acc);
    }
}
