//! The combine's launch shape (kernels/combine/kernel.cu): a CTA per query row, head block and
//! group of 128-column slices; eight warps, W of them a head and 8 / W heads a CTA.
//!
//! A small batch's combine is latency: a warp reading its splits' partials 8 at a time over
//! all 512 columns paid a round trip per 8 splits, so a row of 64 splits took 10 us on one
//! warp a head (Nsight Compute, 1 x 16 x 8192 on the H200). Slices of 128 columns give a lane
//! one float4 a split, so a warp reads 16 splits at once (staged in shared memory by
//! cp.async, so that the kernel's code stays short: it runs once a CTA), and more warps a head
//! read more splits at once. Where the batch already gives every SM several CTAs, one warp a
//! head taking the slices in turn keeps the CTA count (and the per-CTA work of finding the
//! row's largest LSE) down.

/// Warps of a combine CTA (its `WARPS`; `Variant::threads` reports 32 x this).
pub(crate) const WARPS: usize = 8;
/// Splits a warp reads at once (the kernel's `BATCH`).
const BATCH: usize = 16;
/// Columns a CTA's head takes (the kernel's `SLICE`).
const SLICE: usize = 128;
/// CTAs an SM should get before a head stops taking more warps.
const CTAS_PER_SM: usize = 4;
/// The largest grid y and z.
const MAX_GRID_YZ: usize = 65_535;

/// Grid, block and dynamic shared memory of a combine launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CombineShape {
    /// (rows, head blocks, column slices taken at once).
    pub grid: (u32, u32, u32),
    /// (32 x warps a head, heads a CTA).
    pub block: (u32, u32),
    /// Bytes: the warps' staging rows (a float4 a lane and split of a batch), then the warps'
    /// partial sums where a head has more than one warp.
    pub smem: u32,
}

impl CombineShape {
    /// The shape for `rows` query rows of `heads` heads, outputs `kv_lora_rank` wide (a
    /// multiple of 128), on `sm_count` SMs. `splits`: the split count of every row (the split
    /// grid), or None where rows differ (the schedule).
    ///
    /// `rows` must fit the grid's x (the plan checks it) and `heads` [`Self::MAX_HEADS`].
    pub fn new(
        rows: usize,
        heads: usize,
        kv_lora_rank: usize,
        splits: Option<usize>,
        sm_count: usize,
    ) -> CombineShape {
        let pairs = (rows * heads).max(1); // (row, head) pairs
        let target_warps = CTAS_PER_SM * sm_count.max(1) * WARPS;
        // Warps a head: one round trip for the row's splits, no more than the GPU holds.
        let for_splits = splits.map_or(WARPS, |s| s.div_ceil(BATCH));
        let mut per_head = for_splits
            .min(target_warps.div_ceil(pairs))
            .clamp(1, WARPS)
            .next_power_of_two();
        while per_head > 1 && heads.div_ceil(WARPS / per_head) > MAX_GRID_YZ {
            per_head /= 2;
        }
        // Slices a CTA at once (a power of two, at most L / 128): while the CTAs are few; a
        // batch that fills the GPU takes the slices in turn (8 x 128 x 4096, 8 splits: 44.4
        // us with every slice a CTA of its own, against 39.7 for the earlier combine's warp
        // a head over all 512 columns).
        let most = (kv_lora_rank / SLICE).max(1);
        let want = target_warps.div_ceil(pairs * per_head).clamp(1, most);
        let slices = 1 << want.ilog2();
        let heads_per_cta = WARPS / per_head;
        // The kernel's `rows_a_warp`: a batch's splits, or all of a warp's if fewer.
        let staged = splits.map_or(BATCH, |s| s.div_ceil(per_head).clamp(1, BATCH));
        let sums = if per_head > 1 { WARPS * SLICE * 4 } else { 0 };
        let smem = WARPS * staged * 32 * 16 + sums;
        CombineShape {
            grid: (
                rows as u32,
                heads.div_ceil(heads_per_cta) as u32,
                slices as u32,
            ),
            block: (32 * per_head as u32, heads_per_cta as u32),
            smem: smem as u32,
        }
    }

    /// The most heads `configure` may accept: the grid's y at one warp a head.
    pub const MAX_HEADS: usize = MAX_GRID_YZ * WARPS;

    /// The most shared memory a combine launch takes (the kernel's attribute is set to it).
    pub const MAX_SMEM: usize = WARPS * BATCH * 32 * 16 + WARPS * SLICE * 4;
}

#[cfg(test)]
mod tests {
    use super::*;

    const H200: usize = 132;

    fn warps_per_head(s: &CombineShape) -> u32 {
        s.block.0 / 32
    }

    #[test]
    fn small_batches_with_many_splits_get_more_warps_a_head() {
        // Batch 1, 16 heads, 64 splits: four warps of 16 splits a head, two heads a CTA.
        let s = CombineShape::new(1, 16, 512, Some(64), H200);
        assert_eq!(
            (s.grid, s.block, s.smem),
            ((1, 8, 4), (128, 2), 65536 + 4096)
        );
        // 43 splits: three warps would do; a power of two keeps the block whole.
        assert_eq!(
            warps_per_head(&CombineShape::new(1, 128, 512, Some(43), H200)),
            4
        );
        // 8 splits: one warp a head reads them at once; no shared memory.
        let s = CombineShape::new(1, 16, 512, Some(8), H200);
        assert_eq!((s.grid, s.block, s.smem), ((1, 2, 4), (32, 8), 8 * 8 * 512));
        // Many rows fill the GPU with one warp a head.
        assert_eq!(
            warps_per_head(&CombineShape::new(64, 128, 512, Some(64), H200)),
            1
        );
        // The schedule (rows differ): as many warps as the GPU holds.
        assert_eq!(
            warps_per_head(&CombineShape::new(1, 16, 512, None, H200)),
            8
        );
        let s = CombineShape::new(256, 128, 512, None, H200);
        assert_eq!((s.grid, s.block), ((256, 16, 1), (32, 8)));
        // 32 x 128, 2 splits: one warp a head, two slices a CTA at once.
        let s = CombineShape::new(32, 128, 512, Some(2), H200);
        assert_eq!((s.grid, s.block), ((32, 16, 2), (32, 8)));
    }

    #[test]
    fn every_head_and_column_is_covered_and_the_grid_fits() {
        for l in [128, 256, 384, 512] {
            for heads in [1, 3, 16, 17, 100, 128, 4096, CombineShape::MAX_HEADS] {
                for rows in [1, 2, 7, 64] {
                    for splits in [None, Some(2), Some(17), Some(64), Some(4096)] {
                        let s = CombineShape::new(rows, heads, l, splits, H200);
                        let (x, y, z) = s.grid;
                        let (tx, ty) = s.block;
                        let what = format!("L {l} heads {heads} rows {rows} splits {splits:?}");
                        assert_eq!(tx * ty, 256, "{what}");
                        assert!(tx % 32 == 0 && (tx / 32).is_power_of_two(), "{what}");
                        assert_eq!(x as usize, rows, "{what}");
                        assert!(y as usize * ty as usize >= heads, "{what}");
                        assert!((y as usize - 1) * (ty as usize) < heads, "{what}");
                        assert!(y as usize <= MAX_GRID_YZ, "{what}");
                        assert!(z.is_power_of_two() && z as usize * SLICE <= l, "{what}");
                        // Staging rows for every split a warp takes at once, and the
                        // warps' sums when a head has several.
                        let per_warp =
                            splits.map_or(BATCH, |n| n.div_ceil(tx as usize / 32).min(BATCH));
                        let sums = if tx > 32 { WARPS * SLICE * 4 } else { 0 };
                        assert_eq!(s.smem as usize, WARPS * per_warp * 512 + sums, "{what}");
                        assert!(s.smem as usize <= CombineShape::MAX_SMEM, "{what}");
                    }
                }
            }
        }
    }
}
