//! The work schedule of a persistent decode: an even share of the batch's key blocks for each
//! CTA, split only where a CTA's share ends inside a job (issue 4, deliverable 2).
//!
//! Scheduled decodes (`MlaConfig::device_schedule`, docs/scheduler.md) run it on the device. This is the
//! reference the GPU scheduler must reproduce bit for bit:
//! the same integer walk, run on the device from the device's sequence lengths (so that it is
//! captured in a CUDA graph and needs no host synchronization), and checked against this one.
//!
//! A *job* is what one CTA of today's grid does for all splits: the rows of one request's
//! packed tokens and one block of heads, over the union of their keys, in blocks of
//! [`BLOCK`] keys. Laid end to end, each job costs a fixed amount (loading q, the first
//! tile's latency, writing the partial, its part of the merge) and then one unit a block.
//! CTA c takes the stretch `[c * share, (c + 1) * share)` of that line, where share is the
//! total over the CTAs (but at least a few blocks): the blocks whose units fall in it, and the
//! jobs whose fixed cost starts in it. So a CTA's work is one range of (job, block) positions
//! (a few whole jobs and a piece of one at either end), each CTA finds its own start with a
//! binary search (the device computes the schedule with every thread busy, not in one
//! thread's loop), and a job is cut only where a stretch ends inside its blocks: a job left
//! whole needs no merge, and a batch of very different lengths keeps every SM busy, where one
//! split count for the whole batch cannot.

use std::ops::Range;

use super::extents::{Mask, key_range};
use crate::config::ScheduleCosts;

/// Keys of a block: the schedule's unit of work (the kernels' tile).
pub const BLOCK: usize = 64;

/// The shipped cost of a segment beyond its blocks, in blocks ([`ScheduleCosts`]).
pub const SEGMENT_COST: usize = ScheduleCosts::SHIPPED.segment;

/// The shipped fewest blocks a CTA's stretch holds beyond one segment cost
/// ([`ScheduleCosts`]).
pub const MIN_BLOCKS: usize = ScheduleCosts::SHIPPED.min_blocks;

/// How much longer than the even share a stretch may be to line up with the jobs (1 /
/// ALIGN_SLACK of it): see [`aligned_share`].
pub const ALIGN_SLACK: usize = 10;

/// The stretch of the cost line a CTA takes: the even share `even`, or, where one is at most
/// 1 / [`ALIGN_SLACK`] longer, one that lines the stretches up with the jobs when they all
/// cost the longest job's `longest`: a whole number of such jobs (`longest` below `even`), or
/// a whole fraction of one. Equal lengths then are cut at the same place in every job, or
/// not at all, where the even share drifts through them and cuts nearly every job of a
/// one-wave batch in two (64 x 8192 keys at 128 heads on 132 CTAs: 130 units a job, stretches
/// of 127); varied lengths keep the even share.
pub fn aligned_share(even: usize, longest: usize) -> usize {
    if longest == 0 || even == 0 {
        return even;
    }
    let candidate = if longest >= even {
        longest.div_ceil(longest / even)
    } else {
        longest * even.div_ceil(longest)
    };
    if candidate * ALIGN_SLACK <= even * (ALIGN_SLACK + 1) {
        candidate
    } else {
        even
    }
}

/// Where a CTA's work starts or ends: block `block` of job `job`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct Cursor {
    /// The job.
    pub job: usize,
    /// The block within the job.
    pub block: usize,
}

/// One CTA's piece of one job: blocks `blocks` of job `job`, the job's split `split`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    /// The job.
    pub job: usize,
    /// Its blocks (empty for a job with no keys, which still writes o = 0 and lse = -inf).
    pub blocks: Range<usize>,
    /// The job's split this segment is (0 .. [`Schedule::splits`] of the job).
    pub split: usize,
}

/// The schedule of one decode: per CTA, the range of (job, block) positions it takes; per
/// job, the CTAs it spans. What the device holds (a few integers a CTA and a job).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    /// Per CTA: `begin[c] .. begin[c + 1]`, the last ending at (jobs, 0). A CTA with no
    /// work has `begin[c] == begin[c + 1]`.
    pub begin: Vec<Cursor>,
    /// Per job: the first CTA that takes a segment of it.
    pub first_cta: Vec<usize>,
    /// Per job: its split count (the CTAs that take a segment of it; 1: no merge).
    pub splits: Vec<usize>,
    /// Per job: its first workspace slot (the slots of its splits follow in order).
    pub first_slot: Vec<usize>,
    /// The stretch of the cost line each CTA takes, in blocks.
    pub share: usize,
}

impl Schedule {
    /// The schedule of jobs of `blocks[j]` blocks each over `ctas` CTAs (at least 1), with
    /// `segment_cost` blocks of fixed cost a job and stretches of at least `segment_cost +
    /// min_blocks`.
    ///
    /// A CTA's real cost (its blocks and one segment cost a segment) stays within `share +
    /// segment_cost`: its stretch holds the fixed cost of every job it starts, and a job cut
    /// at its start costs it one more (the tests check it).
    pub fn build(
        blocks: &[usize],
        ctas: usize,
        segment_cost: usize,
        min_blocks: usize,
    ) -> Schedule {
        let ctas = ctas.max(1);
        let jobs = blocks.len();
        // Where each job starts on the cost line, and where the line ends.
        let mut starts = Vec::with_capacity(jobs + 1);
        let mut at = 0;
        for &b in blocks {
            starts.push(at);
            at += b + segment_cost;
        }
        starts.push(at);
        let total = at;
        let longest = blocks.iter().map(|&b| b + segment_cost).max().unwrap_or(0);
        let share = aligned_share(total.div_ceil(ctas), longest)
            .max(segment_cost + min_blocks)
            .max(1);
        // The (job, block) position at point x of the line: the job whose stretch holds x
        // (the last one whose start is at most x), and its block there (0 in its fixed cost);
        // past a job's last block, the next job.
        let cursor = |x: usize| -> Cursor {
            if x >= total {
                return Cursor {
                    job: jobs,
                    block: 0,
                };
            }
            let job = starts[1..].partition_point(|&s| s <= x);
            let block = (x - starts[job])
                .saturating_sub(segment_cost)
                .min(blocks[job]);
            if block == blocks[job] && block > 0 {
                Cursor {
                    job: job + 1,
                    block: 0,
                }
            } else {
                Cursor { job, block }
            }
        };
        // CTA 0 starts at the first job even when jobs of no cost come first (the cursor
        // passes over them; elsewhere the CTA before takes them).
        let begin: Vec<Cursor> = (0..=ctas)
            .map(|c| {
                if c == 0 {
                    Cursor::default()
                } else {
                    cursor((c * share).min(total))
                }
            })
            .collect();
        // The CTA whose range holds position `at`.
        let cta_of = |at: Cursor| begin[1..].partition_point(|&b| b <= at);
        let mut first_cta = Vec::with_capacity(jobs);
        let mut splits = Vec::with_capacity(jobs);
        let mut first_slot = Vec::with_capacity(jobs);
        let mut slot = 0;
        for (job, &b) in blocks.iter().enumerate() {
            let first = cta_of(Cursor { job, block: 0 });
            let last = cta_of(Cursor {
                job,
                block: b.max(1) - 1,
            });
            first_cta.push(first);
            splits.push(last - first + 1);
            first_slot.push(slot);
            slot += last - first + 1;
        }
        Schedule {
            begin,
            first_cta,
            splits,
            first_slot,
            share,
        }
    }

    /// The CTAs of the schedule.
    pub fn ctas(&self) -> usize {
        self.begin.len() - 1
    }

    /// Workspace slots the schedule's partials take (one per split of every job).
    pub fn slots(&self) -> usize {
        self.splits.iter().sum()
    }

    /// CTA `c`'s segments, in order, for jobs of `blocks[j]` blocks: how a persistent CTA
    /// walks its range.
    pub fn segments(&self, c: usize, blocks: &[usize]) -> Vec<Segment> {
        let (from, to) = (self.begin[c], self.begin[c + 1]);
        let mut out = Vec::new();
        let mut j = from.job;
        while j < blocks.len() && (j < to.job || (j == to.job && to.block > 0)) {
            let start = if j == from.job { from.block } else { 0 };
            let end = if j == to.job { to.block } else { blocks[j] };
            out.push(Segment {
                job: j,
                blocks: start..end,
                split: c - self.first_cta[j],
            });
            j += 1;
        }
        out
    }
}

/// The jobs of a decode, as the device's scheduler numbers them: job (request x token_blocks
/// + token_block) x head_blocks + head_block, over the union of its tokens' keys.
#[derive(Debug, Clone)]
pub struct Jobs<'a> {
    /// KV length of each request (a negative one counts as 0).
    pub seq_lens: &'a [i32],
    /// Query tokens a request.
    pub query_len: usize,
    /// How the tokens see each other.
    pub mask: Mask,
    /// Sliding window, if any.
    pub window: Option<usize>,
    /// Tokens of a request a job takes.
    pub tokens_per_cta: usize,
    /// Jobs a token block takes (one per block of heads).
    pub head_blocks: usize,
}

impl Jobs<'_> {
    /// Query tokens a request (at least 1) and tokens a job (1 to that).
    pub fn tokens(&self) -> (usize, usize) {
        let q = self.query_len.max(1);
        (q, self.tokens_per_cta.clamp(1, q))
    }

    /// How many jobs: requests x token blocks x head blocks.
    pub fn count(&self) -> usize {
        let (q, pack) = self.tokens();
        self.seq_lens.len() * q.div_ceil(pack) * self.head_blocks
    }

    /// Each job's blocks ([`job_blocks`] of the union of its tokens' keys).
    pub fn blocks(&self) -> Vec<usize> {
        let (q, pack) = self.tokens();
        let mut out = Vec::with_capacity(self.count());
        for &len in self.seq_lens {
            let len = len.max(0) as usize;
            for tok0 in (0..q).step_by(pack) {
                let (mut start, mut end) = (usize::MAX, 0);
                for t in tok0..(tok0 + pack).min(q) {
                    let k = key_range(len, t, q, self.mask, self.window);
                    if k.start < k.end {
                        start = start.min(k.start);
                        end = end.max(k.end);
                    }
                }
                let b = job_blocks(start, end);
                out.extend(std::iter::repeat_n(b, self.head_blocks));
            }
        }
        out
    }
}

/// Blocks of a job over keys `[start, end)`: the blocks of [`BLOCK`] keys it touches, block
/// boundaries at multiples of [`BLOCK`] (as the TMA tiles are).
pub fn job_blocks(start: usize, end: usize) -> usize {
    if start >= end {
        0
    } else {
        end.div_ceil(BLOCK) - start / BLOCK
    }
}

/// The shape of a scheduled decode on the GPU (kernels/common/schedule.cuh): the schedule's
/// jobs are the query rows (one token a CTA), its CTAs a head block's share of the device, and
/// the grid is those CTAs times the head blocks, so that a row's head blocks read its keys at
/// the same time; and from those the workspace it needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScheduledGrid {
    /// Jobs: the query rows.
    pub jobs: usize,
    /// Head blocks of a query row (the grid's y).
    pub head_blocks: usize,
    /// CTAs the cost line is shared among (the grid's x): the CTAs the device holds at once,
    /// divided among the head blocks (at least 1).
    pub ctas: usize,
    /// Heads of a stage-1 CTA: a partial slot's rows.
    pub job_rows: usize,
}

impl ScheduledGrid {
    /// A decode of `rows` query rows over `heads` heads by a stage-1 kernel of `job_rows`
    /// heads a CTA and `ctas_per_sm` CTAs an SM, on `sm_count` SMs.
    pub fn new(
        rows: usize,
        heads: usize,
        job_rows: usize,
        ctas_per_sm: usize,
        sm_count: usize,
    ) -> Self {
        let head_blocks = heads.div_ceil(job_rows.max(1));
        ScheduledGrid {
            jobs: rows,
            head_blocks,
            ctas: (sm_count * ctas_per_sm / head_blocks.max(1)).max(1),
            job_rows,
        }
    }

    /// Partial rows the decode may write: its slots (fewer than jobs + CTAs, [`Schedule`]),
    /// each of every head block's `job_rows` rows.
    pub fn partial_rows(&self) -> usize {
        (self.jobs + self.ctas) * self.head_blocks * self.job_rows
    }

    /// A job's split count on average: its pieces (fewer than jobs + CTAs) over the jobs.
    pub fn mean_splits(&self) -> usize {
        (self.jobs + self.ctas).div_ceil(self.jobs.max(1))
    }

    /// Where the schedule's i32 arrays start, in the order the backend lays them out: the
    /// cost line (jobs + 1), the cursors (2 x (CTAs + 1)), first CTAs, split counts, first
    /// slots (jobs each), the share (1).
    pub fn int_offsets(&self) -> [usize; 6] {
        let begin = self.jobs + 1;
        let first_cta = begin + 2 * (self.ctas + 1);
        [
            0,
            begin,
            first_cta,
            first_cta + self.jobs,
            first_cta + 2 * self.jobs,
            first_cta + 3 * self.jobs,
        ]
    }

    /// The schedule's i32s in all.
    pub fn ints(&self) -> usize {
        self.int_offsets()[5] + 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::{Just, prop_assert, prop_assert_eq};

    #[test]
    fn one_long_request_spreads_over_the_gpu_and_a_short_batch_stays_whole() {
        // Batch 1, 8192 keys (128 blocks) on 132 CTAs: stretches of 5 (the minimum), the
        // first with the fixed cost and 3 blocks, then 5 blocks each: 26 splits.
        let s = Schedule::build(&[128], 132, SEGMENT_COST, MIN_BLOCKS);
        assert_eq!((s.share, s.splits[0]), (5, 26));
        assert_eq!(s.segments(0, &[128])[0].blocks, 0..3);
        assert_eq!(s.segments(1, &[128])[0].blocks, 3..8);
        assert_eq!(s.segments(25, &[128])[0].blocks, 123..128);
        assert!(s.segments(26, &[128]).is_empty());
        // 264 requests of 4096 keys on 132 CTAs: two whole jobs a CTA, no merge.
        let blocks = vec![64; 264];
        let s = Schedule::build(&blocks, 132, SEGMENT_COST, MIN_BLOCKS);
        assert!(s.splits.iter().all(|&n| n == 1));
        assert_eq!(s.slots(), 264);
        assert_eq!(s.segments(7, &blocks).len(), 2);
    }

    #[test]
    fn the_kernels_mirror_the_schedules_constants() {
        // kernels/params.cuh restates these for the schedule kernel and the scheduled
        // decodes (cuda_schedule holds the kernel to this reference on a GPU only).
        let header = include_str!("../../kernels/params.cuh");
        assert!(header.contains(&format!("constexpr int SCHEDULE_BLOCK = {BLOCK};")));
        assert!(header.contains(&format!(
            "constexpr int SCHEDULE_ALIGN_SLACK = {ALIGN_SLACK};"
        )));
    }

    #[test]
    fn equal_lengths_line_up_with_the_stretches() {
        // One wave at 128 heads: 64 requests x 2 head blocks of 8192 keys (128 blocks, 130
        // units) on 132 CTAs: the even share (127) cut all 128 jobs; stretches of one job
        // cut none.
        let blocks = vec![128; 128];
        let s = Schedule::build(&blocks, 132, SEGMENT_COST, MIN_BLOCKS);
        assert_eq!(s.share, 130);
        assert!(s.splits.iter().all(|&n| n == 1));
        // Two jobs a CTA (256 jobs of 32 blocks: 34 units, even share 66).
        let blocks = vec![32; 256];
        let s = Schedule::build(&blocks, 132, SEGMENT_COST, MIN_BLOCKS);
        assert_eq!(s.share, 68);
        assert!(s.splits.iter().all(|&n| n == 1));
        // Half a job a CTA (64 jobs of 64 blocks: 66 units, even share 32): every job in
        // exactly two pieces.
        let blocks = vec![64; 64];
        let s = Schedule::build(&blocks, 132, SEGMENT_COST, MIN_BLOCKS);
        assert_eq!(s.share, 33);
        assert!(s.splits.iter().all(|&n| n == 2));
        // Varied lengths keep the even share; so do equal ones whose aligned share would be
        // more than a tenth longer.
        assert_eq!(aligned_share(127, 130), 130);
        assert_eq!(aligned_share(100, 300), 100);
        assert_eq!(aligned_share(8, 66), 8);
        assert_eq!(aligned_share(60, 0), 60);
    }

    #[test]
    fn long_requests_get_more_ctas_than_short_ones() {
        // 64 requests from 64 to 8192 keys (the varlen case of the benchmark): the longest
        // gets the most splits, and every CTA's cost stays within its share.
        let blocks: Vec<usize> = (0..64).map(|i| 1 + i * 2).collect();
        let s = Schedule::build(&blocks, 132, SEGMENT_COST, MIN_BLOCKS);
        assert!(s.splits[63] > s.splits[0]);
        assert_eq!(s.splits[0], 1);
    }

    proptest::proptest! {
        #[test]
        fn every_block_once_in_order_and_no_cta_far_over_its_share(
            blocks in proptest::collection::vec(
                proptest::prop_oneof![Just(0usize), 1usize..4, 1usize..300], 1..120),
            ctas in 1usize..200,
            cost in 0usize..5,
            min_blocks in 1usize..6,
        ) {
            let s = Schedule::build(&blocks, ctas, cost, min_blocks);
            prop_assert_eq!(s.ctas(), ctas);
            prop_assert_eq!(s.begin[0], Cursor { job: 0, block: 0 });
            prop_assert_eq!(s.begin[ctas], Cursor { job: blocks.len(), block: 0 });
            prop_assert!(s.begin.windows(2).all(|w| w[0] <= w[1]));
            // Each job: its segments, CTA by CTA, cover its blocks once, in order, split
            // 0, 1, ... from its first CTA; a job with no keys has one empty segment.
            let mut seen: Vec<Vec<(usize, Segment)>> = vec![Vec::new(); blocks.len()];
            for c in 0..ctas {
                let segs = s.segments(c, &blocks);
                let cost_of: usize = segs.iter().map(|g| g.blocks.len() + cost).sum();
                prop_assert!(cost_of <= s.share + cost, "CTA {} takes {} of {}", c, cost_of, s.share);
                for g in segs {
                    prop_assert!(!g.blocks.is_empty() || blocks[g.job] == 0);
                    seen[g.job].push((c, g));
                }
            }
            let mut slot = 0;
            for (j, segs) in seen.iter().enumerate() {
                prop_assert_eq!(segs.len(), s.splits[j], "job {}", j);
                prop_assert_eq!(s.first_cta[j], segs[0].0);
                prop_assert_eq!(s.first_slot[j], slot);
                slot += s.splits[j];
                let mut next = 0;
                for (i, (c, g)) in segs.iter().enumerate() {
                    prop_assert_eq!(g.split, i);
                    prop_assert_eq!(*c, s.first_cta[j] + i);
                    prop_assert_eq!(g.blocks.start, next);
                    next = g.blocks.end;
                }
                prop_assert_eq!(next, blocks[j]);
            }
            // Each cut adds one split: at most one per CTA boundary. So the grid's mean
            // (what the combine is sized for) is at least the schedule's.
            prop_assert!(s.slots() < blocks.len() + ctas);
            let grid = ScheduledGrid { jobs: blocks.len(), head_blocks: 1, ctas, job_rows: 64 };
            prop_assert!(grid.mean_splits() >= s.slots().div_ceil(blocks.len()));
        }
    }

    #[test]
    fn jobs_take_the_union_of_their_tokens_keys() {
        // Two requests of 4 causal tokens, two tokens a job, two head blocks: request 0
        // (200 keys) token block 0 sees [0, 198), block 1 [0, 200): 4 blocks each; request 1
        // (a negative length) has no keys.
        let jobs = Jobs {
            seq_lens: &[200, -5],
            query_len: 4,
            mask: Mask::Causal,
            window: None,
            tokens_per_cta: 2,
            head_blocks: 2,
        };
        assert_eq!(jobs.blocks(), vec![4, 4, 4, 4, 0, 0, 0, 0]);
        assert_eq!(jobs.count(), 8);
        let windowed = Jobs {
            window: Some(100),
            tokens_per_cta: 1,
            head_blocks: 1,
            ..jobs
        };
        // Token t ends at 197 + t: [97, 197) .. [100, 200).
        assert_eq!(windowed.blocks(), vec![3, 3, 3, 3, 0, 0, 0, 0]);
    }

    #[test]
    fn job_blocks_follow_the_tile_grid() {
        assert_eq!(job_blocks(0, 0), 0);
        assert_eq!(job_blocks(5, 5), 0);
        assert_eq!(job_blocks(0, 1), 1);
        assert_eq!(job_blocks(0, 64), 1);
        assert_eq!(job_blocks(63, 65), 2);
        assert_eq!(job_blocks(64, 128), 1);
        assert_eq!(job_blocks(100, 8192), 127);
    }
}
