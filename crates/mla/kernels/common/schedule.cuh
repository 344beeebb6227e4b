/**
 * @file schedule.cuh
 * @brief The scheduled decode's pieces (docs/scheduler.md): what one CTA of a scheduled
 * stage-1 grid computes and where the combine finds it.
 *
 * The schedule (kernels/schedule/kernel.cu) gives CTA c of the cost line the (job, block)
 * cursors begin[c] .. begin[c + 1]. Its part of job j, the job's split c - first_cta[j], is
 * one *piece*; the pieces of all jobs, in job order, are numbered by the jobs' first slots
 * (first_slot is the prefix sum of the split counts). A scheduled stage-1 grid launches one
 * CTA per piece (at most jobs + ctas; the CTAs past the last piece exit), so the hardware
 * spreads pieces of about equal cost over the SMs, and a job split in n pieces writes n
 * partial slots that the combine merges in order.
 */
#pragma once
#include "common/keys.cuh"
#include "common/rows.cuh"
#include "params.cuh"

/// Piece `slot` of the schedule: blocks [lo, hi) of job `job` (64 keys a block, counted from
/// the block that holds the job's first key), its split `split` of `splits`.
struct Piece {
    int job, split, splits, slot, lo, hi;
};

/// Piece `i` (job -1: past the last piece).
__device__ __forceinline__ Piece piece_of(const ScheduleParams& sp, int i) {
    const int last = sp.jobs - 1;
    if (last < 0 || i >= sp.first_slot[last] + sp.splits[last]) return {-1, 0, 0, 0, 0, 0};
    int lo = 0, hi = last;  // the last job whose first slot is at or before i
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (sp.first_slot[mid] <= i) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    const int j = lo, split = i - sp.first_slot[j], c = sp.first_cta[j] + split;
    const int blocks = sp.line[j + 1] - sp.line[j] - sp.segment_cost;
    const int b_lo = sp.begin[2 * c] == j ? sp.begin[2 * c + 1] : 0;
    const int b_hi = sp.begin[2 * c + 2] == j ? sp.begin[2 * c + 3] : blocks;
    return {j, split, sp.splits[j], i, b_lo, b_hi};
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
