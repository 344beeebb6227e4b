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
    // The split grid's split is the piece's (blockIdx.y).
    if (pc.slot < 0) return grid_at(p, row, head, pc.split);
    return pc.splits == 1 ? -1 : (i64)pc.slot * job_rows + r;
}

/// The tile rows of a stage-1 CTA of M rows whose grid job (row x head blocks + head block,
/// or with PACK, request x token blocks x head blocks) is `job`: `tokens` query tokens of
/// request `req` from token `tok0` (query row `row0`) on, `per_token` heads each from `head0`
/// on. Tile row r is head head0 + r % per_token of token r / per_token; unpacked that is head
/// head0 + r of the one token. The host packs only when heads x tokens_per_cta <= M.
template <bool PACK, int M>
struct CtaRows {
    int req, row0, tok0, tokens, per_token, head0;

    __device__ CtaRows(const DecodeParams& p, int job) {
        const int pack = PACK ? p.tokens_per_cta : 1;
        per_token = PACK ? p.heads : M;
        const int head_blocks = (p.heads + per_token - 1) / per_token;
        const int token_blocks = (p.query_len + pack - 1) / pack;
        req = job / (head_blocks * token_blocks);
        tok0 = (job / head_blocks) % token_blocks * pack;
        row0 = req * p.query_len + tok0;
        tokens = PACK ? min(pack, p.query_len - tok0) : 1;
        head0 = (job % head_blocks) * per_token;
    }

    __device__ int nth(int r) const { return PACK ? r / per_token : 0; }
    __device__ int token(int r) const { return tok0 + nth(r); }
    __device__ int row(int r) const { return row0 + nth(r); }
    __device__ int head(int r) const { return head0 + (PACK ? r % per_token : r); }
    /// Whether tile row r is a real (query row, head); padding rows are never written.
    __device__ bool real(int r, const DecodeParams& p) const { return nth(r) < tokens && head(r) < p.heads; }

    /// Where the CTA's piece `pc` reads (common/rows.cuh, tokens_keys; piece_keys): with one
    /// token, its keys (`keys` and `common` alike).
    __device__ TokensKeys keys(const DecodeParams& p, int len, const Piece& pc) const {
        if (!PACK) {
            const KeyRange r = piece_keys(token_keys(p, len, tok0), pc);
            return {r, r};
        }
        return tokens_keys(p, len, tok0, tokens, pc.split, pc.splits);
    }

    /// The keys tile row r of piece `pc` sees (packed: its token's; empty for a padding row).
    __device__ KeyRange row_keys(const DecodeParams& p, int len, const Piece& pc, int r) const {
        return real(r, p) ? piece_keys(token_keys(p, len, token(r)), pc) : KeyRange{0, 0};
    }

    /// A piece with no keys: o = 0 and lse = -inf with one split (each token's rows), else
    /// lse = -inf in its split's partials (the combine gives the split no weight), by a CTA of
    /// THREADS threads.
    template <int THREADS, int L>
    __device__ void write_empty_piece(const DecodeParams& p, const Piece& pc) const {
        if (pc.splits == 1) {
            for (int t = 0; t < tokens; ++t) write_empty<M, THREADS, L>(p, row0 + t, head0);
        } else {
            write_empty_split<M, THREADS>(
                p, [&](int r) { return real(r, p) ? piece_at(p, pc, M, r, row(r), head(r)) : i64(-1); });
        }
    }
};

/// write_empty_split (common/keys.cuh) for a piece whose ROWS tile rows are heads head0 .. of
/// query row `row` (the unpacked kernels' CTA), padding heads skipped.
template <int ROWS, int THREADS>
__device__ __forceinline__ void write_empty_split_heads(const DecodeParams& p, const Piece& pc, int row, int head0) {
    write_empty_split<ROWS, THREADS>(
        p, [&](int r) { return head0 + r < p.heads ? piece_at(p, pc, ROWS, r, row, head0 + r) : i64(-1); });
}
