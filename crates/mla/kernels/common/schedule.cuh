/**
 * @file schedule.cuh
 * @brief The scheduled decode (docs/scheduler.md): which pieces of work a persistent stage-1
 * CTA takes and where the combine finds their partials.
 *
 * The schedule (kernels/schedule/kernel.cu) lays the jobs (query rows) end to end on a cost
 * line and gives CTA c the (job, block) cursors begin[c] .. begin[c + 1]. The scheduled grid
 * is (CTAs, head blocks): CTA (c, y) walks its stretch for head block y, one *piece* per job
 * it touches (a whole job, or the part of one cut at either end of the stretch), so every
 * head block of a row reads the row's keys at the same time (they share them in L2). The
 * piece of job j on CTA c is the job's split c - first_cta[j]; its partials go to slot
 * first_slot[j] + split (first_slot is the prefix sum of the split counts), for each head
 * block, and the combine merges a job's slots in order.
 */
#pragma once
#include "common/keys.cuh"
#include "common/rows.cuh"
#include "params.cuh"

/// A piece of a stage-1 CTA's work: blocks [lo, hi) (64 keys a block, counted from the block
/// that holds the job's first key) of grid job `job` (row x head blocks + head block, as the
/// split grid numbers its CTAs), its split `split` of `splits`, partial slot `slot` (-1 on
/// the split grid, whose CTA is split blockIdx.y of job blockIdx.x).
struct Piece {
    int job, split, splits, slot, lo, hi;
};

/// CTA c's piece of job j for head block `hb` of `head_blocks`, where j walks from CTA c's
/// first job on (job -1 once j is past its stretch). A job with no keys is one empty piece.
/// Everything but j is read again from the schedule, so a persistent CTA carries one
/// register from piece to piece.
__device__ __forceinline__ Piece piece_of(const ScheduleParams& sp, int c, int j, int hb, int head_blocks) {
    const int lo = j == sp.begin[2 * c] ? sp.begin[2 * c + 1] : 0;
    const int end_job = sp.begin[2 * c + 2], end_block = sp.begin[2 * c + 3];
    if (j >= sp.jobs || j > end_job || (j == end_job && lo >= end_block)) return {-1, 0, 0, 0, 0, 0};
    const int blocks = sp.line[j + 1] - sp.line[j] - sp.segment_cost;
    const int split = c - sp.first_cta[j];
    return {j * head_blocks + hb, split, sp.splits[j], (sp.first_slot[j] + split) * head_blocks + hb, lo,
            j == end_job ? end_block : blocks};
}

/// A persistent CTA's work: `decode(piece)` for each piece of CTA blockIdx.x's stretch, for
/// head block blockIdx.y of `head_blocks`, with a barrier after each (the next piece reuses
/// the shared memory the last one's epilogue read).
template <typename Decode>
__device__ __forceinline__ void walk_pieces(const ScheduleParams& sp, int head_blocks, Decode decode) {
    for (int j = sp.begin[2 * blockIdx.x];; ++j) {
        const Piece pc = piece_of(sp, blockIdx.x, j, blockIdx.y, head_blocks);
        if (pc.job < 0) break;
        decode(pc);
        __syncthreads();
    }
}

/// The split grid's piece (slot -1): job blockIdx.x, split blockIdx.y of the decode's count.
__device__ __forceinline__ Piece grid_piece(const DecodeParams& p) {
    return {(int)blockIdx.x, (int)blockIdx.y, p.num_kv_splits, -1, 0, 0};
}

/// The keys piece `pc` of a job whose keys are `job` reads: scheduled, its blocks clipped to
/// the job's keys; on the split grid, its split's share (common/rows.cuh, split_keys).
__device__ __forceinline__ KeyRange piece_keys(KeyRange job, const Piece& pc) {
    if (pc.slot < 0) return split_keys(job, pc.split, pc.splits);
    const int base = job.start - job.start % SCHEDULE_BLOCK;
    return {max(job.start, base + SCHEDULE_BLOCK * pc.lo), min(job.end, base + SCHEDULE_BLOCK * pc.hi)};
}

/// Where tile row r (query row `row`, head `head`) of piece `pc` goes: o and lse (-1) when
/// the job has one split; else the partial's workspace row: slot x job_rows + r when
/// scheduled, the split grid's row otherwise.
__device__ __forceinline__ i64 piece_at(const DecodeParams& p, const Piece& pc, int job_rows, int r, int row,
                                        int head) {
    if (pc.slot < 0) return grid_at(p, row, head);
    return pc.splits == 1 ? -1 : (i64)pc.slot * job_rows + r;
}

/// write_empty_split (common/keys.cuh) for a piece whose ROWS tile rows are heads head0 .. of
/// query row `row` (the unpacked kernels' CTA), padding heads skipped.
template <int ROWS, int THREADS>
__device__ __forceinline__ void write_empty_split_heads(const DecodeParams& p, const Piece& pc, int row, int head0) {
    write_empty_split<ROWS, THREADS>(
        p, [&](int r) { return head0 + r < p.heads ? piece_at(p, pc, ROWS, r, row, head0 + r) : i64(-1); });
}
