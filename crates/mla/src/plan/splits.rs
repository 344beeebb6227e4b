//! Split-KV: how many splits a batch uses and which keys each split of a row covers.
//!
//! Two rules ([`SplitRule`]):
//! - vLLM's (`_compute_num_kv_splits`): one split per 512 keys of the batch's longest span,
//!   rounded up to a power of two, at most two per SM. The CPU backend follows it exactly so
//!   that it stays the reference.
//! - Fill, for the GPU: enough splits that the batch gives every SM work (a batch of one
//!   request under vLLM's rule occupies 2 to 16 of 132 SMs), each split keeping enough keys
//!   to amortize its fixed costs. Where the splits fall never changes which keys a row sees.
//!
//! Batch-invariant mode uses one split under either rule.

use super::extents::KeyRange;

/// Keys per split that vLLM's rule aims at.
const KEYS_PER_SPLIT: usize = 512;

/// How a backend cuts each row's keys into splits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SplitRule {
    /// vLLM's rule with this SM count: `min(next_pow2(max(1, len / 512)), 2 * sm_count)`.
    Vllm {
        /// SMs (or CPU threads).
        sm_count: usize,
    },
    /// `ceil(target / work)` splits, where work = rows x ceil(heads / 64) (the CTAs a split
    /// count of one gives), at most `ceil(len / min_keys)` and at most `max_splits` (each
    /// split costs the combine a step).
    Fill {
        /// Work items to aim at (a multiple of the SM count).
        target: usize,
        /// Fewest keys a split should hold.
        min_keys: usize,
        /// Most splits a row gets.
        max_splits: usize,
    },
}

impl SplitRule {
    /// The split count of a batch of `rows` query rows and `heads` heads whose longest span
    /// is `max_kv_len`.
    pub fn splits(self, max_kv_len: usize, rows: usize, heads: usize) -> usize {
        match self {
            SplitRule::Vllm { sm_count } => num_kv_splits(max_kv_len, sm_count),
            SplitRule::Fill {
                target,
                min_keys,
                max_splits,
            } => {
                let work = rows.max(1) * heads.div_ceil(64).max(1);
                let cap = max_kv_len.div_ceil(min_keys.max(1)).min(max_splits).max(1);
                target.div_ceil(work).clamp(1, cap)
            }
        }
    }

    /// The most `rows x splits` any batch of at most `max_rows` rows over at most
    /// `max_kv_len` keys can need: what the workspace is reserved for.
    pub fn max_row_splits(self, max_rows: usize, max_kv_len: usize, heads: usize) -> usize {
        match self {
            SplitRule::Vllm { .. } => {
                max_rows.saturating_mul(self.splits(max_kv_len, max_rows, heads))
            }
            // rows x ceil(target / work) shrinks as rows grow, but not monotonically: try
            // every count up to where one split per row is all that is left.
            SplitRule::Fill { target, .. } => {
                let bound = max_rows.min(target.saturating_add(1));
                let most = (1..=bound)
                    .map(|r| r * self.splits(max_kv_len, r, heads))
                    .max()
                    .unwrap_or(0);
                most.max(max_rows)
            }
        }
    }
}

/// `min(next_pow2(max(1, max_kv_len / 512)), 2 * sm_count)`, at least 1.
pub fn num_kv_splits(max_kv_len: usize, sm_count: usize) -> usize {
    let want = (max_kv_len / KEYS_PER_SPLIT).max(1).next_power_of_two();
    want.min(2 * sm_count).max(1)
}

/// The split counts a decode can pick for lengths up to `max_kv_len`: the powers of two below
/// the maximum's bit length and the maximum itself; only 1 in batch-invariant mode.
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

/// Split `s` of `splits` of a row's keys: `per = ceil(len / splits)`, keys
/// `[start + s * per, min(start + (s + 1) * per, end))`; empty when the row is short.
pub fn split_range(row: KeyRange, s: usize, splits: usize) -> KeyRange {
    let per = row.len().div_ceil(splits);
    let start = (row.start + s * per).min(row.end);
    let end = (start + per).min(row.end);
    KeyRange { start, end }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fill_rule_gives_small_batches_many_splits() {
        let rule = SplitRule::Fill {
            target: 264,
            min_keys: 128,
            max_splits: 64,
        };
        assert_eq!(rule.splits(1024, 1, 16), 8); // capped by keys: 1024 / 128
        assert_eq!(rule.splits(8192, 1, 16), 64);
        assert_eq!(rule.splits(1 << 20, 1, 16), 64); // capped
        assert_eq!(rule.splits(32768, 4, 16), 64);
        assert_eq!(rule.splits(32768, 4, 128), 33); // two 64-head tiles per row
        assert_eq!(rule.splits(4096, 128, 16), 3);
        assert_eq!(rule.splits(4096, 512, 16), 1);
        assert_eq!(rule.splits(0, 1, 16), 1);
        let vllm = SplitRule::Vllm { sm_count: 132 };
        assert_eq!(vllm.splits(8192, 1, 16), 16);
    }

    #[test]
    fn reservations_cover_every_batch() {
        for rule in [
            SplitRule::Fill {
                target: 264,
                min_keys: 128,
                max_splits: 64,
            },
            SplitRule::Vllm { sm_count: 132 },
        ] {
            for (max_rows, max_len, heads) in [
                (1, 1024, 16),
                (256, 163_840, 128),
                (7, 100, 3),
                (1000, 8192, 16),
            ] {
                let reserved = rule.max_row_splits(max_rows, max_len, heads);
                for rows in 1..=max_rows {
                    for len in [0, 1, max_len / 3, max_len] {
                        assert!(
                            rows * rule.splits(len, rows, heads) <= reserved,
                            "{rule:?} {rows} {len}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn split_count_follows_vllm() {
        // (max_kv_len, sm_count, expected)
        let cases = [
            (0, 132, 1),
            (1, 132, 1),
            (1023, 132, 1),
            (1024, 132, 2),
            (1536, 132, 4), // 3 -> next power of two
            (8192, 132, 16),
            (32768, 132, 64),
            (131072, 132, 256),
            (1 << 20, 132, 264), // capped at 2 * SMs, not a power of two
            (1 << 20, 66, 132),
            (4096, 2, 4),
        ];
        for (len, sms, want) in cases {
            assert_eq!(num_kv_splits(len, sms), want, "len {len} sms {sms}");
        }
    }

    #[test]
    fn warmup_counts_cover_every_choice() {
        assert_eq!(warmup_split_counts(8192, 132, false), [1, 2, 4, 8, 16]);
        assert_eq!(
            warmup_split_counts(1 << 20, 132, false),
            [1, 2, 4, 8, 16, 32, 64, 128, 256, 264]
        );
        assert_eq!(warmup_split_counts(100, 132, false), [1]);
        assert_eq!(warmup_split_counts(1 << 20, 132, true), [1]);
        // Every count the rule can produce at or below the maximum length is in the set.
        let set = warmup_split_counts(300_000, 7, false);
        for len in (0..300_000).step_by(977) {
            assert!(set.contains(&num_kv_splits(len, 7)), "len {len}");
        }
    }

    #[test]
    fn splits_tile_the_row_in_order() {
        for (start, end, splits) in [(0, 0, 4), (0, 1, 4), (3, 1000, 7), (5, 9, 16), (0, 512, 1)] {
            let row = KeyRange { start, end };
            let mut next = start;
            for s in 0..splits {
                let r = split_range(row, s, splits);
                if r.is_empty() {
                    continue;
                }
                assert_eq!(r.start, next, "{row:?} split {s}");
                next = r.end;
            }
            assert_eq!(next, end, "{row:?} in {splits}");
        }
        // ceil(10 / 4) = 3: [0,3) [3,6) [6,9) [9,10)
        let r = KeyRange { start: 0, end: 10 };
        assert_eq!(split_range(r, 3, 4), KeyRange { start: 9, end: 10 });
        // ceil(3 / 4) = 1: the fourth split is empty
        let r = KeyRange { start: 0, end: 3 };
        assert!(split_range(r, 3, 4).is_empty());
    }
}
