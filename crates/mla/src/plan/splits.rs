//! Split-KV: how many splits a batch uses and which keys each split of a row covers.
//!
//! Four rules ([`SplitRule`]):
//! - vLLM's (`_compute_num_kv_splits`): one split per 512 keys of the batch's longest span,
//!   rounded up to a power of two, at most two per SM. The CPU backend follows it exactly so
//!   that it stays the reference.
//! - Fill, for the GPU: the count that a small cost model of the kernels ranks cheapest
//!   (`fill_cost`): enough splits that the batch gives every SM work (a batch of one request
//!   under vLLM's rule occupies 2 to 16 of 132 SMs), each split keeping enough keys to
//!   amortize its fixed costs. The model weighs each count on the kernel the plan would pick
//!   for it (`KernelSet::pick`). Where the splits fall never changes which keys a row sees.
//! - Single: one split per row, batch-invariant mode's.
//! - Fixed: the configuration's count.

use super::extents::KeyRange;
use super::kernel::{Call, KernelSet, Pick};
use crate::kernels::variant::MMA_TILE_KEYS;

/// Keys per split that vLLM's rule aims at.
const KEYS_PER_SPLIT: usize = 512;
/// The fill rule's unit of work: a tile of the mma kernel.
const TILE: usize = MMA_TILE_KEYS;
/// Most splits a row gets from the fill rule (the combine walks them in order).
pub(crate) const FILL_MAX_SPLITS: usize = 64;

/// How a decoder cuts each row's keys into splits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SplitRule {
    /// vLLM's rule with this SM count: `min(next_pow2(max(1, len / 512)), 2 * sm_count)`.
    Vllm {
        /// SMs (or CPU threads).
        sm_count: usize,
    },
    /// The count that minimizes a cost model of the GPU kernels (`fill_cost`), at most
    /// `FILL_MAX_SPLITS`.
    Fill {
        /// SMs of the GPU.
        sm_count: usize,
        /// L: the width of each split's partial output.
        kv_lora_rank: usize,
    },
    /// One split per row: batch-invariant mode (a row's result never depends on the batch).
    Single,
    /// The same count for every batch (`MlaConfig::num_kv_splits`): for tuning and benchmarks.
    Fixed {
        /// Splits per row.
        splits: usize,
    },
}

/// A batch as the split rules see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Batch {
    /// The most keys a row's splits cover (the longest length, within the window).
    pub max_span: usize,
    /// Query rows.
    pub rows: usize,
    /// Query tokens a request.
    pub query_len: usize,
    /// Query heads.
    pub heads: usize,
    /// Keys a page of the cache.
    pub page_size: usize,
}

impl Batch {
    /// The call the kernel pick sees when the batch is cut into `splits` splits (on the split
    /// grid: the fill rule weighs the grid a count launches).
    pub(crate) fn call(&self, splits: usize) -> Call {
        let splits = splits.max(1);
        Call {
            heads: self.heads,
            query_len: self.query_len,
            page_size: self.page_size,
            split_keys: split_keys(self.max_span, splits),
            ctas: self.rows * splits,
            scheduled: false,
        }
    }
}

impl SplitRule {
    /// The split count of a batch; `kernels` are the GPU decoder's (the fill rule weighs each
    /// count on the kernel they pick; a rule other than the fill rule ignores them).
    pub(crate) fn splits(self, kernels: Option<&KernelSet>, b: &Batch) -> usize {
        match (self, kernels) {
            (SplitRule::Single, _) => 1,
            (SplitRule::Fixed { splits }, _) => splits,
            (
                SplitRule::Fill {
                    sm_count,
                    kv_lora_rank,
                },
                Some(k),
            ) => fill_splits(k, sm_count, kv_lora_rank, b),
            // A decoder without GPU kernels is never given the fill rule.
            (SplitRule::Vllm { sm_count } | SplitRule::Fill { sm_count, .. }, _) => {
                num_kv_splits(b.max_span, sm_count)
            }
        }
    }

    /// The most `rows x splits` any batch of at most `max_rows` rows over at most `max_span`
    /// keys can need, on any page size: what the workspace is reserved for.
    pub(crate) fn max_row_splits(
        self,
        kernels: Option<&KernelSet>,
        max_rows: usize,
        max_span: usize,
        heads: usize,
    ) -> usize {
        let batch = |rows, query_len, page_size| Batch {
            max_span,
            rows,
            query_len,
            heads,
            page_size,
        };
        let (SplitRule::Fill { .. }, Some(k)) = (self, kernels) else {
            return max_rows.saturating_mul(self.splits(kernels, &batch(max_rows, 1, 64)));
        };
        // The kernels that only take long splits only ever lower the count: weigh without
        // them. The count is not monotone in rows, and packed tokens make fewer CTAs than
        // rows: try every batch size, and where tokens pack, every query length that divides
        // it, on pages the TMA kernels tile and on pages they do not (cheap next to a
        // reservation, which happens once).
        let plain = k.without_long_split_kernels();
        let packs = (plain.packed.is_some() || plain.narrow.is_some()) && 2 * heads <= 64;
        (1..=max_rows)
            .flat_map(|r| {
                let top = if packs { r.isqrt() } else { 1 };
                (1..=top)
                    .filter(move |d| r.is_multiple_of(*d))
                    .flat_map(move |d| [d, r / d])
                    .flat_map(move |q| [(q, 64), (q, 1)])
                    .map(move |(q, page)| (r, batch(r, q, page)))
            })
            .map(|(r, b)| r * self.splits(Some(&plain), &b))
            .max()
            .unwrap_or(0)
    }

    /// Every split count a decode over spans of at most `max_span` keys can use, so that
    /// warmup can prepare each: vLLM's powers of two and its cap; every count up to the fill
    /// rule's most (the GPU kernels take the count as an argument, so they serve all); just 1
    /// for a single split.
    pub(crate) fn warmup_counts(
        self,
        kernels: Option<&KernelSet>,
        max_span: usize,
        heads: usize,
    ) -> Vec<usize> {
        match (self, kernels) {
            (SplitRule::Single, _) => vec![1],
            (SplitRule::Fixed { splits }, _) => vec![splits],
            (SplitRule::Fill { .. }, Some(k)) => {
                // The most splits come with the fewest CTAs: one request (its tokens packed
                // into one CTA on sm_90a), on pages the TMA kernels tile or not.
                let plain = k.without_long_split_kernels();
                let most = (1..=64 / heads.clamp(1, 64))
                    .flat_map(|q| [(q, 64), (q, 1)])
                    .map(|(q, page_size)| {
                        let b = Batch {
                            max_span,
                            rows: q,
                            query_len: q,
                            heads,
                            page_size,
                        };
                        self.splits(Some(&plain), &b)
                    })
                    .max()
                    .unwrap_or(1);
                (1..=most).collect()
            }
            (SplitRule::Vllm { sm_count } | SplitRule::Fill { sm_count, .. }, _) => {
                warmup_split_counts(max_span, sm_count, false)
            }
        }
    }
}

/// The fill rule's count: the cheapest by `fill_cost`, ties to fewer splits. The kernels
/// that only take long splits (seesaw, the narrow kernel's single tokens) only ever take
/// fewer, longer splits than the rule without them picks, so the count stays under that rule's,
/// which grows with the length, and a workspace reserved by it holds every batch. Both
/// searches share one pass (this runs on every decode): when a count is the cheapest without
/// those kernels so far, the answer is the cheapest with them up to that count.
fn fill_splits(kernels: &KernelSet, sm_count: usize, kv_lora_rank: usize, b: &Batch) -> usize {
    // A split keeps at least one tile.
    let most = b.max_span.div_ceil(TILE).clamp(1, FILL_MAX_SPLITS);
    let plain = kernels.without_long_split_kernels();
    let cost = |set: &KernelSet, s| {
        let pick = set.pick(&b.call(s));
        fill_cost(&pick, kernels, sm_count, kv_lora_rank, b, s)
    };
    let (mut best, mut best_without, mut chosen) = ((f64::INFINITY, 1), f64::INFINITY, 1);
    for s in 1..=most {
        let with = cost(kernels, s);
        let without = cost(&plain, s);
        if with < best.0 {
            best = (with, s);
        }
        if without < best_without {
            best_without = without;
            chosen = best.1;
        }
    }
    chosen
}

/// The fill rule's estimate, in units of one CTA's time for one tile of 32 keys, of a batch
/// cut into `splits` splits on `pick`:
/// - stage 1 runs in waves of `slots` CTAs (the CTAs an SM holds of the picked variant, times
///   the SMs), each CTA taking 2 units of fixed cost (q, epilogue) plus one per 32 keys of
///   its split, rounded up to whole tiles of the variant (a split of 222 keys takes four
///   64-key tiles, as one of 256 does);
/// - a CTA runs at the pace of the CTAs sharing its SM ([`sm_rate`]): one or two CTAs an SM
///   each take a unit a tile, a third shares what the two leave. A wave's pace is its
///   busiest SM's: the last wave of `n` CTAs puts `ceil(n / SMs)` on an SM;
/// - an SM moves keys at the same rate whichever single-token kernel runs: a kernel of one CTA
///   an SM replacing the decoder's two (the seesaw or narrow kernel at 16 heads) moves a unit's
///   keys for each of the two (128 x 16 x 2048: one seesaw split 87.4 us, two mma splits 95.2;
///   H200, 2026-12-03);
/// - the combine, when there are splits, costs a unit, a unit per 32 splits (its warps read a
///   row's splits side by side), and the f32 partials it moves (written and read) at the rate
///   a full wave moves key tiles (36 KB a unit at each CTA's pace).
///
/// A split holds at least one tile (32 keys): at batch 1 the fixed cost of a CTA is most of its
/// time, and 32 splits of 1024 keys measured 10.8 us against 14.0 for 8 (H200, 16 heads).
///
/// Crude on purpose: it only has to rank split counts, and it is checked by the GPU benchmarks
/// (BENCHMARKS.md), not trusted.
pub(crate) fn fill_cost(
    pick: &Pick,
    kernels: &KernelSet,
    sm_count: usize,
    kv_lora_rank: usize,
    b: &Batch,
    splits: usize,
) -> f64 {
    let splits = splits.max(1);
    let split_keys = split_keys(b.max_span, splits);
    let sm_count = sm_count.max(1);
    let per_sm = pick.variant.ctas_per_sm.max(1);
    let slots = per_sm * sm_count;
    let ctas = pick.ctas_per_split(b.rows, b.query_len, b.heads).max(1) * splits;
    let tile = pick.variant.tile_keys().max(1);
    let unit_keys = if pick.tokens == 1 {
        TILE as f64 * (sm_rate(kernels.decode.ctas_per_sm) / sm_rate(per_sm)).max(1.0)
    } else {
        TILE as f64
    };
    let tiles = (split_keys.div_ceil(tile) * tile) as f64 / unit_keys;
    // One CTA's time among `k` on its SM.
    let cta = |k: usize| (2.0 + tiles) * k as f64 / sm_rate(k);
    let (full_waves, last) = (ctas / slots, ctas % slots);
    let mut stage1 = full_waves as f64 * cta(per_sm);
    if last > 0 {
        stage1 += cta(last.div_ceil(sm_count));
    }
    let combine = if splits > 1 {
        // A launch, the splits' partials read side by side, the bytes.
        let partial_bytes = (b.rows * b.heads * splits * (kv_lora_rank + 1) * 8) as f64;
        let wave_bytes = sm_count as f64 * sm_rate(per_sm) * 36_864.0;
        1.0 + splits as f64 / 32.0 + partial_bytes / wave_bytes
    } else {
        0.0
    };
    stage1 + combine
}

/// Tiles an SM moves a unit of time with `ctas` CTAs of one variant on it. One CTA is a chain
/// of latencies that leaves the SM idle most of the time, so two move twice what one does; a
/// third (the fp8 mma kernel's) adds a tenth of that, not half: on the H100 (2026-12-06,
/// `0428a47`, one wave each) three CTAs an SM beat two by 1.09x where splits are long (128 x
/// 16 x 16384 fp8: 3 splits 536.9 us, 2 splits 584.6) and lost where they are short (8 x 16 x
/// 4096 fp8: 43 splits 23.8 us, 32 splits 21.7; 16 x 16 x 4096: 22 splits 33.0, 16 splits
/// 30.4).
fn sm_rate(ctas: usize) -> f64 {
    ctas.min(2) as f64 + 0.2 * ctas.saturating_sub(2) as f64
}

/// `min(next_pow2(max(1, max_kv_len / 512)), 2 * sm_count)`, at least 1.
pub fn num_kv_splits(max_kv_len: usize, sm_count: usize) -> usize {
    let want = (max_kv_len / KEYS_PER_SPLIT).max(1).next_power_of_two();
    want.min(sm_count.saturating_mul(2)).max(1)
}

/// The split counts vLLM's rule can pick for lengths up to `max_kv_len`: the powers of two
/// below the maximum's bit length and the maximum itself; only 1 in batch-invariant mode.
pub fn warmup_split_counts(
    max_kv_len: usize,
    sm_count: usize,
    batch_invariant: bool,
) -> Vec<usize> {
    if batch_invariant {
        return vec![1];
    }
    let max = num_kv_splits(max_kv_len, sm_count);
    let bits = usize::BITS - max.leading_zeros();
    let mut counts: Vec<usize> = (0..bits).map(|i| 1usize << i).collect();
    if !counts.contains(&max) {
        counts.push(max);
    }
    counts
}

/// The most keys one split of a row of `span` keys holds when cut into `splits` splits (its
/// first split, [`split_range`]): what decides between the kernels for long and short splits.
pub fn split_keys(span: usize, splits: usize) -> usize {
    split_range(
        KeyRange {
            start: 0,
            end: span,
        },
        0,
        splits.max(1),
    )
    .len()
}

/// Split `s` of `splits` of a row's keys: `per = ceil(len / splits)`, keys
/// `[start + s * per, min(start + (s + 1) * per, end))`; empty when the row is short.
pub fn split_range(row: KeyRange, s: usize, splits: usize) -> KeyRange {
    let per = row.len().div_ceil(splits);
    let start = (row.start + s * per).min(row.end);
    let end = (start + per).min(row.end);
    KeyRange { start, end }
}

#[cfg(test)]
mod tests;
