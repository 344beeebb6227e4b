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

// Warps of a combine CTA (its `WARPS`; `Variant::threads` reports 32 x this).
use crate::kernels::variant::COMBINE_WARPS as WARPS;
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
    /// multiple of 128), on `sm_count` SMs, merging `splits` a row: the split grid's count, or
    /// on the schedule, where rows differ, their mean (a row with more takes more batches).
    /// Sizing the schedule's combine for the most a row could have (every CTA's) instead gave
    /// 8 warps a head that mostly idled, 64 KB of staging a CTA and a grid of several waves:
    /// 16 to 23 us where the split grid's combine of the same cuts takes 6 (Nsight Compute,
    /// H200: 8 x 128 x 4096, 64 varlen x 16 x 8192, 64 varlen x 128 x 8192).
    ///
    /// `rows` must fit the grid's x (the plan checks it) and `heads` [`Self::MAX_HEADS`].
    pub fn new(
        rows: usize,
        heads: usize,
        kv_lora_rank: usize,
        splits: usize,
        sm_count: usize,
    ) -> CombineShape {
        let splits = splits.max(1);
        let pairs = (rows * heads).max(1); // (row, head) pairs
        let target_warps = CTAS_PER_SM * sm_count.max(1) * WARPS;
        // Warps a head: one round trip for the row's splits, no more than the GPU holds.
        let for_splits = splits.div_ceil(BATCH);
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
        // The kernel's `rows_a_warp` (it reads it back from the shared memory): a batch's
        // splits, or all of a warp's if fewer.
        let staged = splits.div_ceil(per_head).clamp(1, BATCH);
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
        let s = CombineShape::new(1, 16, 512, 64, H200);
        assert_eq!(
            (s.grid, s.block, s.smem),
            ((1, 8, 4), (128, 2), 65536 + 4096)
        );
        // 43 splits: three warps would do; a power of two keeps the block whole.
        assert_eq!(warps_per_head(&CombineShape::new(1, 128, 512, 43, H200)), 4);
        // 8 splits: one warp a head reads them at once; no shared memory.
        let s = CombineShape::new(1, 16, 512, 8, H200);
        assert_eq!((s.grid, s.block, s.smem), ((1, 2, 4), (32, 8), 8 * 8 * 512));
        // Many rows fill the GPU with one warp a head.
        assert_eq!(
            warps_per_head(&CombineShape::new(64, 128, 512, 64, H200)),
            1
        );
        // The schedule's mean count: one request over 132 CTAs gets eight warps a head.
        let s = CombineShape::new(1, 16, 512, 133, H200);
        assert_eq!((s.block, s.smem), ((256, 1), 65536 + 4096));
        // 64 x 128 on 66 CTAs a head block: about 3 a row, one warp a head staging 3.
        let s = CombineShape::new(64, 128, 512, 3, H200);
        assert_eq!(
            (s.grid, s.block, s.smem),
            ((64, 16, 1), (32, 8), 8 * 3 * 512)
        );
        // 32 x 128, 2 splits: one warp a head, two slices a CTA at once.
        let s = CombineShape::new(32, 128, 512, 2, H200);
        assert_eq!((s.grid, s.block), ((32, 16, 2), (32, 8)));
    }

    #[test]
    fn every_head_and_column_is_covered_and_the_grid_fits() {
        for l in [128, 256, 384, 512] {
            for heads in [1, 3, 16, 17, 100, 128, 4096, CombineShape::MAX_HEADS] {
                for rows in [1, 2, 7, 64] {
                    for splits in [1, 2, 17, 64, 4096] {
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
                        let per_warp = splits.div_ceil(tx as usize / 32).min(BATCH);
                        let sums = if tx > 32 { WARPS * SLICE * 4 } else { 0 };
                        assert_eq!(s.smem as usize, WARPS * per_warp * 512 + sums, "{what}");
                        assert!(s.smem as usize <= CombineShape::MAX_SMEM, "{what}");
                    }
                }
            }
        }
    }
}
