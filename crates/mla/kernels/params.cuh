/**
 * @file params.cuh
 * @brief The one argument of every decode kernel: what the host plan decided, by value.
 *
 * Mirrored field for field by `DecodeParams` in `src/backend/cuda/params.rs`; the size is
 * checked on both sides. Strides are in elements of the tensor's own dtype. Device headers
 * include no host header, so NVRTC takes them as they are.
 */
#pragma once

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

struct DecodeParams {
    const void* q_nope;       // [rows, H, L] model dtype
    const void* q_rope;       // [rows, H, R] model dtype (may alias q_nope + L for a packed q)
    i64 q_nope_row, q_nope_head;
    i64 q_rope_row, q_rope_head;
    const void* kv;           // [num_blocks, page_size, D] cache dtype
    i64 page_stride, token_stride;
    const int* block_table;   // [requests, max_blocks]
    i64 block_table_stride;
    const int* seq_lens;      // [requests]: KV length of each request, its query tokens included
    void* o;                  // [rows, H, L] model dtype; written by stage 1 when num_kv_splits == 1
    i64 o_row, o_head;
    float* lse;               // [rows, H] natural log
    i64 lse_row;
    float* part_o;            // [rows, splits, H, L] f32 workspace: normalized split outputs
    float* part_lse;          // [rows, splits, H] f32 workspace: split LSEs (natural log)
    u32* error_flag;          // device word; bits of MLA_ERR_* raised by the kernels
    int num_blocks, page_size, max_blocks;
    int rows, query_len, heads, num_kv_splits;
    int causal;               // 1: token t of Q sees keys up to seq_len - (Q - 1 - t)
    int window;               // sliding window in keys; 0: none
    float scale_log2;         // softmax scale * log2(e): scores go to base 2 with the scale folded in
    float k_scale;            // fp8 caches: value = decoded * k_scale
    int tokens_per_cta;       // query tokens of one request a CTA takes (decode_wgmma packs the
                              // tokens of few-head decodes into its 64 rows; 1 otherwise)
    const float* k_scale_ptr; // when not null, k_scale is read here (on the device, so a captured
                              // graph sees a new scale); may be null
    const float* q_scale_ptr; // the fp8-query mode (MLA_QFP8): when not null, q_scale is read here
    float q_scale;            // the fp8-query mode: q is rewritten as e4m3(q / q_scale)
    int pad_;
};
static_assert(sizeof(DecodeParams) == 232, "DecodeParams must match src/backend/cuda/params.rs");

/// 1: the kernel is the scheduled variant of its family (its argument is a ScheduleParams).
#ifndef MLA_SCHED
#define MLA_SCHED 0
#endif

/// 1: a stage-1 kernel's variant whose CTAs take `tokens_per_cta` query tokens of a request,
/// tokens x heads in its tile rows, each row masked to its own token's keys.
#ifndef MLA_PACK
#define MLA_PACK 0
#endif

/// 1: the fp8-query mode of a stage-1 kernel with an fp8 cache (common/fp8.cuh): q and P as
/// e4m3 codes, q_scale on the scores (docs/contract.md).
#ifndef MLA_QFP8
#define MLA_QFP8 0
#endif

/// Keys of a block, the schedule's unit of work (plan::schedule::BLOCK), counted from the
/// block that holds a job's first key.
constexpr int SCHEDULE_BLOCK = 64;

/// How much longer than the even share a stretch may be to line up with the jobs (1 / this
/// of it; plan::schedule::ALIGN_SLACK, aligned_share).
constexpr int SCHEDULE_ALIGN_SLACK = 10;

/// The work schedule of a decode (docs/scheduler.md), computed on the device by
/// kernels/schedule/kernel.cu, and the argument of the scheduled stage-1 and combine variants
/// (`MLA_SCHED`), which read it (mirrored by `ScheduleParams` in src/backend/cuda/params.rs).
struct ScheduleParams {
    DecodeParams d;    // the decode (the scheduled variants' partials go to d.part_o, d.part_lse)
    int head_blocks;   // head blocks a token block of a request takes
    int ctas;          // CTAs the cost line is shared among
    int segment_cost;  // fixed cost of a segment, in blocks
    int min_blocks;    // fewest blocks a stretch holds beyond one segment cost
    int jobs;          // requests x token blocks x head blocks
    int job_rows;      // rows of a job (a stage-1 CTA's tile rows): a partial slot's rows
    int* line;         // [jobs + 1]: where each job starts on the cost line; line[jobs] = total
    int* begin;        // [ctas + 1][2]: CTA c's first (job, block); the last is (jobs, 0)
    int* first_cta;    // [jobs]
    int* splits;       // [jobs]
    int* first_slot;   // [jobs]: the job's first partial slot (a prefix sum of splits)
    int* share;        // [1]
};
static_assert(sizeof(ScheduleParams) == 304, "ScheduleParams must match src/backend/cuda/params.rs");

// Bits of *error_flag (src/backend/cuda/mod.rs reads them).
#define MLA_ERR_NEGATIVE_LEN 1u     // a seq_len below zero (treated as 0)
#define MLA_ERR_BEYOND_TABLE 2u     // a seq_len beyond max_blocks * page_size (extra keys skipped)
#define MLA_ERR_BAD_BLOCK 4u        // a block id outside [0, num_blocks) (its page never read)
#define MLA_ERR_BAD_SCALE 8u        // a k_scale or q_scale tensor not finite and positive (outputs unspecified)
