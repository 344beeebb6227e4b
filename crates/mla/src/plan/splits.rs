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
//! Batch-invariant mode is its own rule ([`SplitRule::Single`]): one split per row.

use super::extents::KeyRange;

/// Rows (heads x packed query tokens) of a CTA of Hopper's wgmma kernel.
pub const WGMMA_ROWS: usize = 64;
/// The fewest rows a CTA gives the wgmma kernel for it to be chosen: at 16 rows its tile is
/// three-quarters padding and two mma.sync CTAs per SM are faster (H200: 175 us against
/// 233 us at 128 x 4096 keys, 16 heads); at 32 the wgmma kernel is 1.3x to 1.4x faster (64 x
/// 4096 keys, bf16 and fp8 caches).
pub const WGMMA_MIN_ROWS: usize = 17;

/// Whether a request's query tokens pack into the wgmma kernel's CTAs, and how many each
/// takes: as many as fit its 64 rows next to the heads (16 heads x 4 tokens, so one read of
/// the keys serves them all), when that is at least 2 and the rows reach [`WGMMA_MIN_ROWS`].
/// The one rule both the kernels' choice (`backend::cuda::registry::Stage1`) and the fill
/// rule's model of their grids follow.
pub fn packing(heads: usize, query_len: usize) -> Option<usize> {
    let tokens = query_len.min(WGMMA_ROWS / heads.max(1));
    (tokens > 1 && heads * tokens >= WGMMA_MIN_ROWS).then_some(tokens)
}

/// Query rows (heads x packed tokens) of a CTA of Hopper's narrow kernel, for few heads.
pub const NARROW_ROWS: usize = 16;

/// Whether a request's query tokens run in the narrow kernel (on sm_90a, for a cache in the
/// model dtype), and how many a CTA takes: when at least two of them fit its [`NARROW_ROWS`]
/// rows next to the heads and the wgmma kernel does not pack them ([`packing`] comes
/// first), as many tokens as fit (8 heads x 2: one read of the keys for both tokens, 1.7x the
/// mma kernel's CTA per token on the H200). One token a request stays on the mma kernel,
/// which measured as fast or faster there (BENCHMARKS.md); `MLA_KERNEL=narrow` forces it.
pub fn narrow_tokens(heads: usize, query_len: usize) -> Option<usize> {
    narrow_fit(heads, query_len).filter(|&tokens| tokens > 1)
}

/// The tokens a narrow CTA can take of a request, one or more, where the heads fit its
/// [`NARROW_ROWS`] rows and the wgmma kernel does not pack them: what [`narrow_tokens`] runs
/// as shipped and `MLA_KERNEL=narrow` runs for single tokens too.
pub fn narrow_fit(heads: usize, query_len: usize) -> Option<usize> {
    let fits = (1..=NARROW_ROWS).contains(&heads) && packing(heads, query_len).is_none();
    fits.then(|| query_len.clamp(1, NARROW_ROWS / heads))
}

/// The fewest keys a split must hold for the narrow kernel to take a single-token decode
/// ([`narrow_single`]): on the H200 at 16 heads it beats the mma kernel's two CTAs an SM on
/// twice the splits from 256 keys a split (8 x 16 x 4096: 21.7 us on 16 splits of 256 keys
/// against 22.1 on 32; 32 x 16 x 2048: 32.0 on 4 of 512 against 34.4 on 8; 128 x 16 x
/// 1024: 47.7 on one split against 54.8 on 2; BENCHMARKS.md, twenty-fourth session).
pub const NARROW_SINGLE_MIN_SPLIT_KEYS: usize = 256;

/// Whether the narrow kernel takes a single-token decode of `heads` heads whose splits hold
/// `split_keys` keys, launched as `ctas` CTAs (one an SM) on `sm_count` SMs, on a decoder
/// that runs it for single tokens (`registry::Stage1`, 16 heads, a cache in the model dtype,
/// pages it tiles): where its 16 rows are all heads, a split holds at least
/// [`NARROW_SINGLE_MIN_SPLIT_KEYS`] keys in whole 64-key tiles, and the CTAs fill each wave
/// to at least 90% of the SMs. The two conditions are what the fill rule's model does not
/// see and the H200 showed: the kernel's tiles start at multiples of 64 keys, so a split of
/// 373 keys reads seven tiles (6 x 16 x 8192 on 22 splits: 30.7 us against the mma kernel's
/// 29.1 on 43), and with one CTA an SM an idle SM is keys unread (48 x 16 x 2048, 96 CTAs:
/// 50.3 against 44.7; twenty-fourth session).
pub fn narrow_single(
    heads: usize,
    query_len: usize,
    split_keys: usize,
    ctas: usize,
    sm_count: usize,
) -> bool {
    let sm_count = sm_count.max(1);
    let waves = ctas.div_ceil(sm_count).max(1);
    heads == NARROW_ROWS
        && query_len == 1
        && split_keys >= NARROW_SINGLE_MIN_SPLIT_KEYS
        && split_keys.is_multiple_of(WGMMA_TILE_KEYS)
        && 10 * ctas >= 9 * sm_count * waves
}

/// Whether the TMA kernels' copies (the narrow and seesaw kernels, `common/tma.cuh`) tile
/// pages of `page_size` keys: their 64-key tiles start at multiples of 64, so a page must
/// hold whole tiles (a multiple of 64 keys) or a tile whole pages of at least 8 keys (8, 16,
/// 32: a page is a whole number of 1 KB swizzle atoms).
pub fn tma_pages(page_size: usize) -> bool {
    page_size.is_multiple_of(64) || (page_size.is_multiple_of(8) && 64 % page_size.max(1) == 0)
}

/// Keys per split that vLLM's rule aims at.
const KEYS_PER_SPLIT: usize = 512;
/// Keys per tile of the mma kernel (the fill rule's unit of work, and the tile it assumes
/// until a backend names its decode kernel's).
pub const TILE: usize = 32;
/// Keys per tile of the wgmma and narrow kernels (sm_90a).
pub const WGMMA_TILE_KEYS: usize = 64;
/// Fewest tiles a split of the fill rule holds.
const MIN_TILES: usize = 1;

/// How a backend cuts each row's keys into splits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SplitRule {
    /// vLLM's rule with this SM count: `min(next_pow2(max(1, len / 512)), 2 * sm_count)`.
    Vllm {
        /// SMs (or CPU threads).
        sm_count: usize,
    },
    /// The split count that minimizes a small cost model of the GPU kernels (see
    /// [`SplitRule::fill_cost`]), at most `max_splits`.
    Fill {
        /// SMs of the GPU.
        sm_count: usize,
        /// L: the width of each split's partial output.
        kv_lora_rank: usize,
        /// Most splits a row gets (the combine walks them in order).
        max_splits: usize,
        /// Whether the GPU runs the wgmma kernel's packed variant (sm_90a), which takes the
        /// query tokens of a few-head request in one CTA ([`packing`]).
        wgmma: bool,
        /// Whether it runs the narrow kernel for few heads (sm_90a, a cache in the model
        /// dtype): one CTA a request's [`narrow_tokens`], one CTA per SM.
        narrow: bool,
        /// Keys per tile of the kernel of the decodes that neither packs (the backend's
        /// single-token kernel): [`TILE`] for the mma kernel, [`WGMMA_TILE_KEYS`] for wgmma.
        decode_tile: usize,
        /// The fewest keys a split must hold for the seesaw kernel (sm_90a, one CTA an SM,
        /// 64-key tiles) to take the single-token decodes instead of the decode kernel; None
        /// where the decoder has no seesaw kernel or the pages are ones it cannot tile
        /// ([`SplitRule::for_pages`]).
        seesaw_keys: Option<usize>,
        /// Whether the narrow kernel takes the single-token decodes [`narrow_single`]
        /// allows (modelled as the seesaw kernel: one CTA an SM, 64-key tiles, the same
        /// rate), where the seesaw kernel does not take them.
        narrow_singles: bool,
    },
    /// One split per row: batch-invariant mode (a row's result never depends on the batch).
    Single,
    /// The same count for every batch (`MlaConfig::num_kv_splits`): for tuning and
    /// benchmarks.
    Fixed {
        /// Splits per row.
        splits: usize,
    },
}

impl SplitRule {
    /// The fill rule modelling the kernels a backend chose (`wgmma`: the wgmma kernel's
    /// packed variant, `narrow`: the narrow kernel, `decode_tile`: the keys a tile of the
    /// kernel of the other decodes, `seesaw_keys`: the fewest keys a split needs for the
    /// seesaw kernel to take them instead); other rules as they are.
    pub fn with_kernels(
        self,
        wgmma: bool,
        narrow: bool,
        decode_tile: usize,
        seesaw_keys: Option<usize>,
    ) -> SplitRule {
        match self {
            SplitRule::Fill {
                sm_count,
                kv_lora_rank,
                max_splits,
                ..
            } => SplitRule::Fill {
                sm_count,
                kv_lora_rank,
                max_splits,
                wgmma,
                narrow,
                decode_tile,
                seesaw_keys,
                narrow_singles: false,
            },
            other => other,
        }
    }

    /// The fill rule with the narrow kernel taking the single-token decodes
    /// [`narrow_single`] allows, or not; other rules as they are.
    pub fn with_narrow_singles(mut self, on: bool) -> SplitRule {
        if let SplitRule::Fill { narrow_singles, .. } = &mut self {
            *narrow_singles = on;
        }
        self
    }

    /// The rule for a cache of pages of `page_size` keys: the TMA kernels (narrow, seesaw)
    /// run only on pages they tile ([`tma_pages`]), so on others the fill rule models the
    /// kernels that run instead.
    pub fn for_pages(self, page_size: usize) -> SplitRule {
        if tma_pages(page_size) {
            self
        } else {
            self.without_tma()
        }
    }

    /// The fill rule without what it models as the seesaw kernel (the seesaw kernel, the
    /// narrow kernel on single tokens), which only ever lowers its count; other rules as
    /// they are.
    fn without_seesaw_model(mut self) -> SplitRule {
        if let SplitRule::Fill {
            seesaw_keys,
            narrow_singles,
            ..
        } = &mut self
        {
            *seesaw_keys = None;
            *narrow_singles = false;
        }
        self
    }

    /// The fill rule without the TMA kernels (narrow, seesaw); other rules as they are.
    fn without_tma(mut self) -> SplitRule {
        if let SplitRule::Fill { narrow, .. } = &mut self {
            *narrow = false;
        }
        self.without_seesaw_model()
    }

    /// The split count of a batch of `rows` query rows (`query_len` a request) and `heads`
    /// heads whose longest span is `max_kv_len`.
    pub fn splits(self, max_kv_len: usize, rows: usize, query_len: usize, heads: usize) -> usize {
        match self {
            SplitRule::Single => 1,
            SplitRule::Fixed { splits } => splits,
            SplitRule::Vllm { sm_count } => num_kv_splits(max_kv_len, sm_count),
            SplitRule::Fill { max_splits, .. } => {
                // A split keeps at least MIN_TILES tiles to amortize its fixed costs.
                let most = max_kv_len
                    .div_ceil(TILE * MIN_TILES)
                    .clamp(1, max_splits.max(1));
                // The cheapest count, ties to fewer splits, in one pass (this runs on every
                // decode). The seesaw kernel only ever takes fewer, longer splits than the
                // rule without it picks: so the count stays under that rule's, which grows
                // with the length, and a workspace reserved by it holds every batch. Both
                // searches share the pass: when a count is the cheapest without the seesaw
                // so far, the answer is the cheapest with it up to that count.
                let (mut best, mut best_without, mut chosen) =
                    ((f64::INFINITY, 1), f64::INFINITY, 1);
                for s in 1..=most {
                    let kernel = self.kernel(max_kv_len, rows, query_len, heads, s);
                    let cost = self.cost_on(kernel, max_kv_len, rows, query_len, heads, s);
                    let without = match kernel {
                        Modelled::Seesaw => {
                            self.cost_on(Modelled::Decode, max_kv_len, rows, query_len, heads, s)
                        }
                        _ => cost,
                    };
                    if cost < best.0 {
                        best = (cost, s);
                    }
                    if without < best_without {
                        best_without = without;
                        chosen = best.1;
                    }
                }
                chosen
            }
        }
    }

    /// The fill rule's estimate, in units of one CTA's time for one tile of keys, of a batch
    /// cut into `splits` splits:
    /// - stage 1 runs in waves of `slots` CTAs (one or two per SM, by kernel), each CTA
    ///   taking 2 units of fixed cost (q, epilogue) plus one per tile of 32 keys; a CTA
    ///   takes up to 64 heads of one query token, or on sm_90a the packed tokens of a
    ///   few-head request ([`SplitRule::ctas_per_split`]);
    /// - an SM moves keys at the same rate whichever of the decode kernel and the seesaw
    ///   kernel runs: at 16 heads (memory-bound) the seesaw's one CTA an SM takes a unit
    ///   for 64 keys where each of the mma kernel's two takes one for 32. Its grid is what
    ///   differs: half the CTAs in a wave (128 x 16 x 2048 keys: one seesaw split 87.4 us,
    ///   two mma splits 95.2; 64 x 16 x 8192: two seesaw splits 166.6 us, four 173.3; H200,
    ///   BENCHMARKS.md, eighteenth session);
    /// - the combine, when there are splits, costs a unit, a unit per 32 splits (its warps
    ///   read a row's splits side by side, 16 each at once), and the f32 partials it moves
    ///   (written and read) at the rate a wave moves key tiles (`slots` x 36 KB a unit).
    ///   For the seesaw kernel at 16 heads that is half the rate its units imply (64 keys,
    ///   72 KB an SM): the rule as measured (eighteenth session) charges its partials twice.
    ///   The consistent rate changes the count of 9% of the 16-head batches of 1 to 300
    ///   rows and 64 to 40k keys (7 x 37k keys: 37 mma splits to 18 seesaw ones); not
    ///   measured yet, so not taken (docs/wip/seesaw-rate.patch).
    ///
    /// A split holds at least one tile (32 keys): at batch 1 the fixed cost of a CTA is most
    /// of its time, and 32 splits of 1024 keys measured 10.8 us against 14.0 for 8 (H200,
    /// 16 heads).
    ///
    /// Crude on purpose: it only has to rank split counts, and it is checked by the GPU
    /// benchmarks (BENCHMARKS.md), not trusted.
    pub fn fill_cost(
        self,
        max_kv_len: usize,
        rows: usize,
        query_len: usize,
        heads: usize,
        splits: usize,
    ) -> f64 {
        let kernel = self.kernel(max_kv_len, rows, query_len, heads, splits);
        self.cost_on(kernel, max_kv_len, rows, query_len, heads, splits)
    }

    /// [`SplitRule::fill_cost`] with the splits on `kernel`.
    fn cost_on(
        self,
        kernel: Modelled,
        max_kv_len: usize,
        rows: usize,
        query_len: usize,
        heads: usize,
        splits: usize,
    ) -> f64 {
        let SplitRule::Fill {
            sm_count,
            kv_lora_rank,
            ..
        } = self
        else {
            return 0.0;
        };
        let split_keys = max_kv_len.div_ceil(splits.max(1));
        let (per_split, per_sm) = kernel.grid(rows, query_len, heads);
        let slots = (per_sm * sm_count).max(1);
        let ctas = per_split.max(1) * splits;
        let waves = ctas.div_ceil(slots) as f64;
        // A CTA's tiles start at its split's first key: a split of 222 keys takes four
        // 64-key tiles, as one of 256 does.
        let tile = kernel.tile_keys(self);
        let tiles = (split_keys.div_ceil(tile) * tile) as f64 / kernel.unit_keys(heads) as f64;
        let stage1 = waves * (2.0 + tiles);
        let combine = if splits > 1 {
            // A launch, the splits' partials read side by side, the bytes.
            let partial_bytes = (rows * heads * splits * (kv_lora_rank + 1) * 8) as f64;
            1.0 + splits as f64 / 32.0 + partial_bytes / (slots as f64 * 36_864.0)
        } else {
            0.0
        };
        stage1 + combine
    }

    /// The kernel that takes a decode of `rows` rows over `max_kv_len` keys cut into
    /// `splits` splits, as the backend picks it (`backend::cuda::registry::Stage1::launch_for`):
    /// a packed kernel (the wgmma kernel's, or on long splits the seesaw kernel's, with the
    /// same grid and tiles: one model), the narrow kernel, the seesaw kernel on long enough
    /// splits, the narrow kernel on the single tokens [`narrow_single`] allows (modelled as
    /// the seesaw kernel), else the decode kernel.
    fn kernel(
        self,
        max_kv_len: usize,
        rows: usize,
        query_len: usize,
        heads: usize,
        splits: usize,
    ) -> Modelled {
        let SplitRule::Fill {
            sm_count,
            wgmma,
            narrow,
            seesaw_keys,
            narrow_singles,
            ..
        } = self
        else {
            return Modelled::Decode;
        };
        let split_keys = max_kv_len.div_ceil(splits.max(1));
        if wgmma && let Some(tokens) = packing(heads, query_len) {
            return Modelled::Packed(tokens);
        }
        if narrow && let Some(tokens) = narrow_tokens(heads, query_len) {
            return Modelled::Narrow(tokens);
        }
        if seesaw_keys.is_some_and(|keys| split_keys >= keys) {
            return Modelled::Seesaw;
        }
        let ctas = rows * splits.max(1);
        if narrow_singles && narrow_single(heads, query_len, split_keys, ctas, sm_count) {
            return Modelled::Seesaw;
        }
        Modelled::Decode
    }

    /// The CTAs a split of the batch (`rows` rows over `max_kv_len` keys in `splits` splits)
    /// takes, and how many of them an SM runs at once: the kernels' grids (`backend::cuda`).
    /// One query token and up to 64 heads a CTA (two CTAs an SM for up to 16 heads: the mma
    /// kernel; one: the seesaw kernel and the narrow kernel on single tokens), except on
    /// sm_90a where a few-head request's tokens share a CTA: the wgmma kernel's when their
    /// rows reach [`WGMMA_MIN_ROWS`], else the narrow kernel's (one CTA an SM each).
    pub fn ctas_per_split(
        self,
        max_kv_len: usize,
        rows: usize,
        query_len: usize,
        heads: usize,
        splits: usize,
    ) -> (usize, usize) {
        self.kernel(max_kv_len, rows, query_len, heads, splits)
            .grid(rows, query_len, heads)
    }

    /// The most `rows x splits` any batch of at most `max_rows` rows over at most
    /// `max_kv_len` keys can need: what the workspace is reserved for.
    pub fn max_row_splits(self, max_rows: usize, max_kv_len: usize, heads: usize) -> usize {
        match self {
            SplitRule::Single | SplitRule::Fixed { .. } | SplitRule::Vllm { .. } => {
                max_rows.saturating_mul(self.splits(max_kv_len, max_rows, 1, heads))
            }
            // The count is not monotone in rows, and packed tokens make fewer CTAs than
            // rows: try every batch size, and where tokens pack, every query length that
            // divides it (cheap next to a reservation, which happens once).
            // Pages the TMA kernels cannot tile take the rule without them
            // (`for_pages`); the seesaw kernel never raises a count (`splits`).
            SplitRule::Fill { wgmma, narrow, .. } => {
                // Tokens pack when two fit next to the heads (at most 32 heads).
                let packs = (wgmma || narrow) && 2 * heads <= WGMMA_ROWS;
                let rules = [self.without_seesaw_model(), self.without_tma()];
                (1..=max_rows)
                    .flat_map(|r| {
                        let top = if packs { r.isqrt() } else { 1 };
                        (1..=top)
                            .filter(move |d| r.is_multiple_of(*d))
                            .flat_map(move |d| [d, r / d])
                            .flat_map(move |q| {
                                rules.map(|rule| r * rule.splits(max_kv_len, r, q, heads))
                            })
                    })
                    .max()
                    .unwrap_or(0)
            }
        }
    }
}

/// The kernel the fill rule models a decode on ([`SplitRule::fill_cost`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Modelled {
    /// A packed variant (the wgmma or the seesaw kernel's), this many tokens a CTA.
    Packed(usize),
    /// The narrow kernel, this many tokens a CTA.
    Narrow(usize),
    /// The seesaw kernel (sm_90a), one token a CTA; or the narrow kernel on single tokens
    /// ([`narrow_single`]), the same grid, tiles and rate.
    Seesaw,
    /// The backend's decode kernel (mma, wgmma), one token a CTA.
    Decode,
}

impl Modelled {
    /// The CTAs a split takes of `rows` query rows (`query_len` a request) of `heads` heads,
    /// and how many of them an SM runs at once ([`SplitRule::ctas_per_split`]).
    fn grid(self, rows: usize, query_len: usize, heads: usize) -> (usize, usize) {
        let per_token = rows * heads.div_ceil(64).max(1);
        match self {
            Modelled::Packed(tokens) | Modelled::Narrow(tokens) => (
                rows.div_ceil(query_len.max(1)) * query_len.div_ceil(tokens),
                1,
            ),
            Modelled::Seesaw => (per_token, 1),
            Modelled::Decode => (per_token, decode_per_sm(heads)),
        }
    }

    /// Keys per tile: a split rounds up to whole tiles.
    fn tile_keys(self, rule: SplitRule) -> usize {
        match (self, rule) {
            (Modelled::Decode, SplitRule::Fill { decode_tile, .. }) => decode_tile,
            (Modelled::Decode, _) => TILE,
            _ => WGMMA_TILE_KEYS,
        }
    }

    /// Keys a CTA moves in a unit of the cost model: [`TILE`], but the seesaw kernel's
    /// one CTA an SM moves what the decode kernel's CTAs on that SM move together.
    fn unit_keys(self, heads: usize) -> usize {
        match self {
            Modelled::Seesaw => TILE * decode_per_sm(heads),
            _ => TILE,
        }
    }
}

/// CTAs an SM runs at once of the decode kernel of `heads` heads: two mma CTAs up to 16
/// heads, else one.
fn decode_per_sm(heads: usize) -> usize {
    if heads <= 16 { 2 } else { 1 }
}

impl SplitRule {
    /// Every split count a decode over spans of at most `max_span` keys can use, so that
    /// warmup can prepare each: vLLM's powers of two and its cap; every count up to the
    /// fill rule's most (the GPU kernels take the count as an argument, so they serve all);
    /// just 1 for a single split.
    pub fn warmup_counts(self, max_span: usize, heads: usize) -> Vec<usize> {
        match self {
            SplitRule::Single => vec![1],
            SplitRule::Fixed { splits } => vec![splits],
            SplitRule::Vllm { sm_count } => warmup_split_counts(max_span, sm_count, false),
            SplitRule::Fill { .. } => {
                // The most splits come with the fewest CTAs: one request (its tokens packed
                // into one CTA on sm_90a), on pages the TMA kernels tile or not.
                let most = (1..=WGMMA_ROWS / heads.clamp(1, WGMMA_ROWS))
                    .flat_map(|q| {
                        [self.without_seesaw_model(), self.without_tma()]
                            .map(|rule| rule.splits(max_span, q, q, heads))
                    })
                    .max()
                    .unwrap_or(1);
                (1..=most).collect()
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

    /// The fill rule of an H200 (132 SMs, L = 512, up to 64 splits) running the token-packing
    /// kernels named, and the mma kernel for the other decodes.
    fn h200(wgmma: bool, narrow: bool) -> SplitRule {
        SplitRule::Fill {
            sm_count: 132,
            kv_lora_rank: 512,
            max_splits: 64,
            wgmma,
            narrow,
            decode_tile: TILE,
            seesaw_keys: None,
            narrow_singles: false,
        }
    }

    #[test]
    fn the_fill_rule_splits_small_batches_and_spares_large_ones() {
        let rule = h200(false, false);
        // (len, rows, heads) -> splits, as the cost model ranks them.
        let cases = [
            ((1024, 1, 16), 32),
            ((8192, 1, 16), 64),
            ((32768, 4, 16), 64),
            ((4096, 32, 16), 8),
            ((4096, 128, 16), 2),
            ((8192, 1, 128), 43),
            ((2048, 128, 128), 1),
            ((0, 1, 16), 1),
            ((1 << 20, 1, 16), 64),
        ];
        for ((len, rows, heads), want) in cases {
            assert_eq!(
                rule.splits(len, rows, 1, heads),
                want,
                "len {len} rows {rows} heads {heads}"
            );
        }
        // On Hopper 128 heads run the wgmma kernel's 64-key tiles, which start at a split's
        // first key: 37 splits of 222 keys take as many tiles as 32 of 256 (measured on the
        // H200: 27.2 us against 25.3), 43 of 191 one fewer.
        let hopper = |decode_tile| h200(false, false).with_kernels(true, true, decode_tile, None);
        assert_eq!(hopper(WGMMA_TILE_KEYS).splits(8192, 1, 1, 128), 43);
        assert_eq!(hopper(TILE).splits(8192, 1, 1, 16), 64);
        let vllm = SplitRule::Vllm { sm_count: 132 };
        assert_eq!(vllm.splits(8192, 1, 1, 16), 16);
    }

    #[test]
    fn packed_tokens_make_fewer_ctas_and_more_splits_on_hopper() {
        let rule = |wgmma| h200(wgmma, false);
        // 64 requests x 4 tokens x 16 heads: 64 CTAs a split packed (one per request, 64
        // rows each), 256 of 16 rows otherwise.
        // (CTAs, CTAs an SM runs at once.)
        assert_eq!(rule(true).ctas_per_split(0, 256, 4, 16, 1), (64, 1));
        assert_eq!(rule(false).ctas_per_split(0, 256, 4, 16, 1), (256, 2));
        // 8 heads x 2 tokens is 16 rows: the mma kernel's, one token a CTA, two an SM.
        assert_eq!(rule(true).ctas_per_split(0, 8, 2, 8, 1), (8, 2));
        // 20 heads x 3 tokens: 60 rows; 7 tokens make 3 CTAs a request.
        assert_eq!(rule(true).ctas_per_split(0, 14, 7, 20, 1), (6, 1));
        // 128 heads: two CTAs a row, whatever the tokens.
        assert_eq!(rule(true).ctas_per_split(0, 8, 4, 128, 1), (16, 1));
        // A split count that fills the GPU: packed requests get more splits than one CTA
        // each (64 of 132 SMs busy).
        let packed = rule(true).splits(8192, 256, 4, 16);
        assert!(packed >= 2, "{packed}");
        assert!(packed > rule(false).splits(8192, 256, 4, 16));
        // One token a request never packs: the rule is the same with or without wgmma.
        assert_eq!(
            rule(true).splits(8192, 64, 1, 16),
            rule(false).splits(8192, 64, 1, 16)
        );
    }

    #[test]
    fn the_narrow_kernel_takes_few_head_tokens_the_wgmma_tile_does_not() {
        // (heads, query_len) -> tokens a narrow CTA takes: two or more next to the heads, and
        // only where the wgmma kernel does not pack them (17 rows or more).
        for (heads, q, want) in [
            (8, 2, Some(2)),
            (8, 3, None), // 24 rows: the wgmma tile's
            (4, 4, Some(4)),
            (1, 12, Some(12)),
            (1, 40, None),
            (16, 2, None),
            (16, 1, None), // one token: the mma kernel
            (5, 1, None),
        ] {
            assert_eq!(narrow_tokens(heads, q), want, "{heads} heads, {q} tokens");
        }
        // Forced (MLA_KERNEL=narrow), single tokens of up to 16 heads too.
        assert_eq!(narrow_fit(16, 1), Some(1));
        assert_eq!(narrow_fit(5, 2), Some(2));
        assert_eq!(narrow_fit(16, 4), None); // the wgmma tile packs them
        assert_eq!(narrow_fit(17, 1), None);
        for page in [8, 16, 32, 64, 128, 1024] {
            assert!(tma_pages(page), "{page}");
        }
        for page in [1, 4, 12, 24, 48, 96] {
            assert!(!tma_pages(page), "{page}");
        }
        // One CTA a request (one per SM) where it runs, else the mma kernel's CTA per token.
        let rule = |narrow| h200(true, narrow);
        assert_eq!(rule(true).ctas_per_split(0, 128, 2, 8, 1), (64, 1));
        assert_eq!(rule(false).ctas_per_split(0, 128, 2, 8, 1), (128, 2));
        assert_eq!(rule(true).ctas_per_split(0, 64, 1, 16, 1), (64, 2));
    }

    #[test]
    fn a_backend_tells_the_fill_rule_which_packing_kernels_it_runs() {
        let fill = h200(false, false);
        let hopper = fill.with_kernels(true, true, TILE, None);
        assert_eq!(hopper, h200(true, true));
        // 8 heads x 2 tokens: one narrow CTA a request on Hopper, a CTA a token otherwise.
        assert_eq!(hopper.ctas_per_split(0, 128, 2, 8, 1), (64, 1));
        assert_eq!(fill.ctas_per_split(0, 128, 2, 8, 1), (128, 2));
        for other in [
            SplitRule::Single,
            SplitRule::Vllm { sm_count: 8 },
            SplitRule::Fixed { splits: 3 },
        ] {
            assert_eq!(
                other.with_kernels(true, true, WGMMA_TILE_KEYS, Some(512)),
                other
            );
        }
    }

    #[test]
    fn the_seesaw_kernel_takes_fewer_longer_splits_where_it_runs() {
        // 16 heads on Hopper: the seesaw kernel takes splits of 2048 keys or more, one CTA an
        // SM; the mma kernel shorter ones, two an SM.
        let plain = h200(true, true);
        let seesaw = plain.with_kernels(true, true, TILE, Some(2048));
        // (len, rows) -> splits without and with it. Measured on the H200 (BENCHMARKS.md,
        // eighteenth session): 64 x 8192 keys 166.6 us on 2 seesaw splits, 173.3 on 4;
        // 128 x 2048 keys 87.4 us on 1, 95.2 on 2 mma splits.
        assert_single_token_counts(
            plain,
            seesaw,
            &[
                ((8192, 64), (4, 2)),
                ((2048, 128), (2, 1)),
                ((2047, 128), (2, 2)),
                ((4096, 32), (8, 8)),
                ((8192, 1), (64, 64)),
                ((32768, 4), (64, 64)),
            ],
        );
        // The CTAs a split takes follow the kernel its length picks.
        assert_eq!(seesaw.ctas_per_split(2048, 64, 1, 16, 1), (64, 1));
        assert_eq!(seesaw.ctas_per_split(2047, 64, 1, 16, 1), (64, 2));
        // Pages the TMA kernels cannot tile run the mma kernel: the rule without them.
        assert_eq!(seesaw.for_pages(64), seesaw);
        assert_eq!(seesaw.for_pages(1), h200(true, false));
        assert_eq!(seesaw.for_pages(1).splits(2048, 128, 1, 16), 2);
        // Above 16 heads the seesaw kernel replaces the wgmma kernel, one CTA an SM and
        // 64-key tiles both: the model, and so the count, is the wgmma kernel's.
        let wgmma = plain.with_kernels(true, true, WGMMA_TILE_KEYS, None);
        let with = wgmma.with_kernels(true, true, WGMMA_TILE_KEYS, Some(512));
        for (len, rows) in [(8192, 64), (4096, 32), (8192, 1), (2048, 128), (700, 3)] {
            assert_eq!(
                with.splits(len, rows, 1, 128),
                wgmma.splits(len, rows, 1, 128)
            );
        }
        // It never raises a count, at any length: so a reservation at the longest length
        // holds the shorter ones.
        assert_never_raises(seesaw, plain);
    }

    /// A batch `(keys, rows)` and its split counts `(without, with)` a kernel.
    type CountCase = ((usize, usize), (usize, usize));

    /// `(without.splits, with.splits)` of single-token 16-head batches.
    fn assert_single_token_counts(without: SplitRule, with: SplitRule, cases: &[CountCase]) {
        for &((len, rows), want) in cases {
            let got = (
                without.splits(len, rows, 1, 16),
                with.splits(len, rows, 1, 16),
            );
            assert_eq!(got, want, "{rows} rows of {len} keys");
        }
    }

    /// `rule` never picks more splits than `plain` for single-token 16-head batches.
    fn assert_never_raises(rule: SplitRule, plain: SplitRule) {
        for rows in [1, 2, 5, 16, 33, 64, 100, 128, 256] {
            for len in (0..20_000).step_by(61) {
                assert!(
                    rule.splits(len, rows, 1, 16) <= plain.splits(len, rows, 1, 16),
                    "{rows} rows of {len} keys"
                );
            }
        }
    }

    #[test]
    fn the_narrow_kernel_takes_the_single_tokens_whose_grid_it_fills() {
        // 16 heads, one token, splits of 256 keys or more in whole 64-key tiles, CTAs filling
        // each wave to 90% of 132 SMs (at least 119 of them).
        assert!(narrow_single(16, 1, 256, 128, 132));
        assert!(narrow_single(16, 1, 1024, 119, 132));
        assert!(!narrow_single(16, 1, 1024, 118, 132));
        assert!(
            narrow_single(16, 1, 512, 384, 132),
            "three waves, 384 of 396 slots"
        );
        assert!(
            !narrow_single(16, 1, 512, 300, 132),
            "three waves, 300 of 396 slots"
        );
        assert!(!narrow_single(16, 1, 192, 128, 132), "too short");
        assert!(!narrow_single(16, 1, 373, 132, 132), "not whole tiles");
        assert!(!narrow_single(16, 2, 256, 128, 132), "two tokens");
        assert!(!narrow_single(8, 1, 256, 128, 132), "8 heads");
        assert!(!narrow_single(16, 1, 1024, 0, 132));
        // The rule modelling it, on the H200's measured cases (BENCHMARKS.md, twenty-fourth
        // session): (keys, rows) -> splits without and with it. Taken: 8 x 4096 (22.1 ->
        // 21.7 us), 32 x 4096 (53.9 -> 51.4), 4 x 32768 (54.0 -> 52.4), 128 x 1024 (54.8 ->
        // 47.7), 64 x 2048 (52.8 -> 51.1); left alone where the mma kernel was faster: batch
        // 1 and 3 x 4096 (too few CTAs), 6 x 8192 and 12 x 4096 (373 keys a split), 48 x 2048
        // (96 CTAs), 24 x 4096 (820 keys); and where the seesaw kernel takes the splits.
        let seesaw = h200(true, true).with_kernels(true, true, TILE, Some(2048));
        let narrow = seesaw.with_narrow_singles(true);
        assert_single_token_counts(
            seesaw,
            narrow,
            &[
                ((4096, 8), (32, 16)),
                ((4096, 32), (8, 4)),
                ((32768, 4), (64, 32)),
                ((1024, 128), (2, 1)),
                ((2048, 64), (4, 2)),
                ((8192, 1), (64, 64)),
                ((4096, 3), (43, 43)),
                ((8192, 6), (43, 43)),
                ((4096, 12), (22, 22)),
                ((2048, 48), (5, 5)),
                ((4096, 24), (11, 11)),
                ((8192, 64), (2, 2)),
                ((2048, 128), (1, 1)),
            ],
        );
        // One CTA an SM where it runs; multi-token rows and other head counts as before.
        assert_eq!(narrow.ctas_per_split(4096, 8, 1, 16, 16), (8, 1));
        assert_eq!(seesaw.ctas_per_split(4096, 8, 1, 16, 16), (8, 2));
        for (len, rows, q, heads) in [(4096, 16, 2, 16), (4096, 8, 1, 8), (4096, 32, 1, 128)] {
            assert_eq!(
                narrow.splits(len, rows, q, heads),
                seesaw.splits(len, rows, q, heads)
            );
        }
        // It never raises a count; pages the TMA kernels cannot tile take the rule without it.
        assert_never_raises(narrow, h200(true, true));
        assert_eq!(narrow.for_pages(1), h200(true, false));
        assert_eq!(narrow.without_seesaw_model(), h200(true, true));
        // Other rules as they are.
        for other in [SplitRule::Single, SplitRule::Fixed { splits: 3 }] {
            assert_eq!(other.with_narrow_singles(true), other);
        }
    }

    #[test]
    fn reservations_cover_every_batch() {
        for rule in [
            h200(false, false),
            h200(true, true),
            h200(true, true).with_kernels(true, true, TILE, Some(2048)),
            h200(true, true)
                .with_kernels(true, true, TILE, Some(2048))
                .with_narrow_singles(true),
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
                    for q in (1..=8).filter(|q| rows % q == 0) {
                        for len in [0, 1, max_len / 3, max_len] {
                            for page in [1, 64] {
                                let rule = rule.for_pages(page);
                                assert!(
                                    rows * rule.splits(len, rows, q, heads) <= reserved,
                                    "{rule:?} {rows} rows of {q} tokens, {len} keys"
                                );
                            }
                        }
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
    fn a_single_split_rule_is_one_split_everywhere() {
        let rule = SplitRule::Single;
        for (len, rows) in [(0, 1), (100_000, 1), (1 << 20, 64)] {
            assert_eq!(rule.splits(len, rows, 1, 128), 1);
        }
        assert_eq!(rule.max_row_splits(64, 1 << 20, 128), 64);
        assert_eq!(rule.warmup_counts(1 << 20, 128), [1]);
        let fixed = SplitRule::Fixed { splits: 5 };
        assert_eq!(fixed.splits(0, 1, 1, 16), 5);
        assert_eq!(fixed.splits(1 << 20, 64, 4, 16), 5);
        assert_eq!(fixed.max_row_splits(64, 1 << 20, 16), 320);
        assert_eq!(fixed.warmup_counts(8192, 16), [5]);
        let fill = h200(false, false);
        let counts = fill.warmup_counts(8192, 16);
        assert_eq!(
            counts,
            (1..=fill.splits(8192, 1, 1, 16)).collect::<Vec<_>>()
        );
        assert_eq!(
            SplitRule::Vllm { sm_count: 132 }.warmup_counts(8192, 16),
            [1, 2, 4, 8, 16]
        );
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
