//! What each family supports: the variant of a family a decoder's shape can run on a device
//! of a given shared memory, and every variant an architecture can need (what `mla
//! precompile` and CI build).

use super::family::Family;
use super::variant::{CacheCode, Grid, NARROW_ROWS, QueryMode, Rows, Variant, WGMMA_ROWS};
use crate::dtype::{KvFormat, ModelDtype};

/// What a decoder's kernels are specialized on: the widths and the dtypes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct KernelShape {
    /// L.
    pub kv_lora_rank: usize,
    /// R.
    pub rope_dim: usize,
    /// The model dtype (q, o).
    pub model: ModelDtype,
    /// The cache format.
    pub kv: KvFormat,
    /// The query's numerics (the fp8-query mode needs an fp8 cache).
    pub query: QueryMode,
}

impl KernelShape {
    /// DeepSeek's widths (L = 512, R = 64) with these dtypes.
    pub(crate) fn deepseek(model: ModelDtype, kv: KvFormat) -> KernelShape {
        KernelShape {
            kv_lora_rank: 512,
            rope_dim: 64,
            model,
            kv,
            query: QueryMode::Model,
        }
    }

    /// The same in the fp8-query mode.
    pub(crate) fn fp8_query(self) -> KernelShape {
        KernelShape {
            query: QueryMode::Fp8,
            ..self
        }
    }

    /// The cache's elements as the kernels take them.
    pub(crate) fn cache(&self) -> CacheCode {
        CacheCode::of(self.model, self.kv)
    }

    /// A stage-1 variant of this shape on the split grid, one token a CTA.
    fn variant(&self, family: Family, row_warps: usize, stages: usize) -> Variant {
        Variant {
            family,
            kv_lora_rank: self.kv_lora_rank,
            rope_dim: self.rope_dim,
            model: self.model,
            cache: self.cache(),
            row_warps,
            stages,
            rows: Rows::OneToken,
            grid: Grid::Split,
            query: self.query,
            // The mma kernel's count is `mma_variant`'s.
            ctas_per_sm: 1,
        }
    }

    /// L = 512 in whole 64-column chunks: what the Hopper kernels' tiles take.
    fn hopper_widths(&self) -> bool {
        self.kv_lora_rank == 512 && (self.kv_lora_rank + self.rope_dim).is_multiple_of(64)
    }
}

/// The mma kernel (sm_80 and up): the most row groups (up to 4, fewer for few heads) that fit
/// the device's shared memory, then the ring of tiles (up to 4, 6 for fp8 whose tiles are half
/// the bytes). None if not even the smallest fits.
pub(crate) fn mma_variant(heads: usize, shape: KernelShape, smem_limit: usize) -> Option<Variant> {
    let want = match heads {
        0..=16 => 1,
        17..=32 => 2,
        // An fp8 cache's products convert its codes in registers, which the 128 registers a
        // thread of four row groups cannot hold without spills.
        _ if shape.kv.is_fp8() => 2,
        _ => 4,
    };
    let max_stages = if shape.kv.is_fp8() { 6 } else { 4 };
    let variant = |row_warps, stages, ctas| Variant {
        ctas_per_sm: ctas,
        ..shape.variant(Family::DecodeMma, row_warps, stages)
    };
    // Several CTAs on an SM hide each other's latencies better than a deeper ring in one CTA
    // (H200: 252 us against 394 us at 128 x 4096 keys, 16 heads), so a variant takes the most
    // CTAs an SM that its registers allow and shared memory holds, then the deepest ring that
    // keeps that many. Registers: one row group two CTAs, or three with an fp8 cache (154 of
    // the 168 a thread three allow; three with a ring of two tiles beat two of four by 1% to
    // 9% on the large 16-head batches, 128 x 16 x 16384: 585.5 -> 536.3 us; H100,
    // 2026-12-06); more row groups one. The SM has 1 KB more than a block may take, and each
    // resident block reserves 1 KB.
    let fits = |v: &Variant| v.ctas_per_sm * (v.smem_bytes() + 1024) <= smem_limit + 1024;
    [4, 2, 1]
        .into_iter()
        .filter(|&mw| mw <= want)
        .find_map(|mw| {
            let most = match mw {
                1 if shape.kv.is_fp8() => 3,
                1 => 2,
                _ => 1,
            };
            (1..=most).rev().find_map(|ctas| {
                (2..=max_stages)
                    .rev()
                    .map(|stages| variant(mw, stages, ctas))
                    .find(fits)
            })
        })
}

/// The wgmma kernel (sm_90a): L = 512 in whole 64-column chunks, where it fits.
pub(crate) fn wgmma_variant(shape: KernelShape, smem_limit: usize) -> Option<Variant> {
    let v = shape.variant(Family::DecodeWgmma, WGMMA_ROWS / 16, 2);
    (shape.hopper_widths() && v.smem_bytes() <= smem_limit).then_some(v)
}

/// The narrow kernel's ring under fp8, in tiles (its `TILE_GROUPS`): the two consumer
/// warpgroups take alternate tiles and issue their own copies, two tiles each (an even count:
/// the kernel's static_assert says why).
const NARROW_FP8_TILES: usize = 4;

/// The narrow kernel (sm_90a, [`NARROW_ROWS`] rows a CTA): a cache in the model dtype or fp8
/// (not the other 16-bit type), L = 512 in whole 64-column chunks, a 16-bit query, and room
/// for a ring of at least two tiles; the ring takes all the shared memory the rest leaves
/// (fp8: exactly four whole tiles, two a consumer warpgroup, or none).
pub(crate) fn narrow_variant(shape: KernelShape, smem_limit: usize) -> Option<Variant> {
    let base = shape.variant(Family::DecodeNarrow, NARROW_ROWS / 16, 0);
    let fixed = base.smem_bytes();
    // A slot's bytes and mbarriers, from the one layout formula.
    let per_slot = Variant { stages: 1, ..base }.smem_bytes() - fixed;
    let chunks = base.narrow_chunks();
    let slots = if base.fp8() {
        NARROW_FP8_TILES * chunks
    } else {
        smem_limit.saturating_sub(fixed) / per_slot
    };
    let v = Variant {
        stages: slots,
        ..base
    };
    // Its fp8 products split a 16-bit q and P into two e4m3 terms each: no fp8-query mode.
    let applies = base.cache != CacheCode::OtherHalf
        && shape.query == QueryMode::Model
        && shape.hopper_widths()
        && slots >= 2 * chunks
        && v.smem_bytes() <= smem_limit;
    applies.then_some(v)
}

/// The seesaw kernel (sm_90a): a cache in the model dtype (the keys land by TMA as the products
/// read them) or fp8 (the codes land beside and are rewritten as f16 in place), a 16-bit
/// query, L = 512 and R = 64 (eight value chunks split between the warpgroups, and one rotary
/// chunk, where P0 goes once the scores have read it).
pub(crate) fn seesaw_variant(shape: KernelShape, smem_limit: usize) -> Option<Variant> {
    let v = shape.variant(Family::DecodeSeesaw, WGMMA_ROWS / 16, 2);
    let applies = v.cache != CacheCode::OtherHalf
        && shape.query == QueryMode::Model
        && shape.kv_lora_rank == 512
        && shape.rope_dim == 64
        && v.smem_bytes() <= smem_limit;
    applies.then_some(v)
}

/// The most raw tiles the fp8 twin's ring holds (the third hides a DRAM latency the second
/// leaves; a fourth does not fit beside q).
const WGMMA_FP8_STAGES: usize = 3;

/// The wgmma kernel's fp8 twin (sm_90a; f16 wgmma on codes converted in registers, or in the
/// fp8-query mode fp8 wgmma on the codes as loaded): an fp8 cache, L = 512 in whole 64-column
/// chunks, and a ring of at least two tiles (the deepest up to three that fits).
pub(crate) fn wgmma_fp8_variant(shape: KernelShape, smem_limit: usize) -> Option<Variant> {
    if !(shape.kv.is_fp8() && shape.hopper_widths()) {
        return None;
    }
    (2..=WGMMA_FP8_STAGES)
        .rev()
        .map(|stages| shape.variant(Family::DecodeWgmmaFp8, WGMMA_ROWS / 16, stages))
        .find(|v| v.smem_bytes() <= smem_limit)
}

/// The combine of a decoder.
pub(crate) fn combine_variant(kv_lora_rank: usize, model: ModelDtype) -> Variant {
    Variant {
        family: Family::Combine,
        kv_lora_rank,
        rope_dim: 0,
        model,
        cache: CacheCode::Model,
        row_warps: 0,
        stages: 0,
        rows: Rows::OneToken,
        grid: Grid::Split,
        query: QueryMode::Model,
        ctas_per_sm: 1,
    }
}

/// The scheduler kernel (one for every decode; its defines are the base ones).
pub(crate) fn schedule_variant() -> Variant {
    Variant {
        family: Family::Schedule,
        ..combine_variant(512, ModelDtype::Bf16)
    }
}

/// Largest dynamic shared memory per block by architecture, for compiling without a device.
pub(crate) fn smem_limit_of_arch(major: u32, minor: u32) -> usize {
    match (major, minor) {
        (8, 0) => 166_912,
        (9, 0) | (10, _) => 232_448,
        (8, _) | (12, _) => 101_376,
        _ => 49_152,
    }
}

/// Every variant the DeepSeek shapes (L = 512, R = 64) can use on an architecture: both model
/// dtypes, every cache format (fp8 with and without the fp8-query mode), every row-group count
/// that fits, their scheduled twins, and on sm_90a (`hopper`) the wgmma kernels (one token a
/// CTA, and packed), the narrow kernel, the seesaw kernel and the fp8 twin.
pub(crate) fn all_variants(smem_limit: usize, hopper: bool) -> Vec<Variant> {
    let mut out = Vec::new();
    for model in [ModelDtype::Bf16, ModelDtype::F16] {
        let shapes = [
            KvFormat::Bf16,
            KvFormat::F16,
            KvFormat::Fp8E4m3,
            KvFormat::Fp8E5m2,
        ]
        .into_iter()
        .flat_map(|kv| {
            let plain = KernelShape::deepseek(model, kv);
            std::iter::once(plain).chain(kv.is_fp8().then_some(plain.fp8_query()))
        });
        for shape in shapes {
            for heads in [16, 32, 128] {
                if let Some(v) = mma_variant(heads, shape, smem_limit)
                    && !out.contains(&v)
                {
                    out.extend([v, v.scheduled()]);
                }
            }
            if !hopper {
                continue;
            }
            if let Some(v) = wgmma_variant(shape, smem_limit) {
                out.extend([v, v.scheduled(), v.packed()]);
            }
            out.extend(narrow_variant(shape, smem_limit));
            if let Some(v) = seesaw_variant(shape, smem_limit) {
                out.extend([v, v.scheduled(), v.packed()]);
            }
            out.extend(wgmma_fp8_variant(shape, smem_limit));
        }
        let combine = combine_variant(512, model);
        out.extend([combine, combine.scheduled()]);
    }
    out.push(schedule_variant());
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::variant::TmaBox;

    fn bf16(kv: KvFormat) -> KernelShape {
        KernelShape::deepseek(ModelDtype::Bf16, kv)
    }

    #[test]
    fn row_groups_follow_heads_and_shared_memory() {
        let pick = |h, limit| mma_variant(h, bf16(KvFormat::Bf16), limit).map(|v| v.row_warps);
        assert_eq!(pick(8, 232_448), Some(1));
        assert_eq!(pick(32, 232_448), Some(2));
        assert_eq!(pick(128, 232_448), Some(4));
        assert_eq!(pick(128, 166_912), Some(4)); // A100
        assert_eq!(pick(128, 101_376), Some(1)); // sm_86/89: one row group fits
        let stages = |h, kv: KvFormat, limit| mma_variant(h, bf16(kv), limit).map(|v| v.stages);
        assert_eq!(stages(16, KvFormat::Bf16, 232_448), Some(2)); // two CTAs per SM
        assert_eq!(stages(32, KvFormat::Bf16, 232_448), Some(4)); // one CTA: the deepest
        assert_eq!(stages(16, KvFormat::Fp8E4m3, 232_448), Some(2)); // three CTAs
        assert_eq!(stages(16, KvFormat::Fp8E4m3, 166_912), Some(3)); // A100: two CTAs
        let ctas = |h, kv: KvFormat, limit| mma_variant(h, bf16(kv), limit).map(|v| v.ctas_per_sm);
        assert_eq!(ctas(16, KvFormat::Fp8E4m3, 232_448), Some(3));
        assert_eq!(ctas(16, KvFormat::Fp8E4m3, 166_912), Some(2));
        assert_eq!(ctas(16, KvFormat::Bf16, 232_448), Some(2));
        assert_eq!(ctas(32, KvFormat::Fp8E4m3, 232_448), Some(1));
        assert_eq!(ctas(16, KvFormat::Bf16, 101_376), Some(1)); // sm_86/89: one fits
        assert_eq!(stages(128, KvFormat::Bf16, 232_448), Some(4)); // one CTA: the deepest
        assert_eq!(stages(128, KvFormat::Bf16, 166_912), Some(2));
        assert_eq!(stages(16, KvFormat::Bf16, 166_912), Some(3));
        assert_eq!(stages(16, KvFormat::Bf16, 101_376), Some(2));
        assert_eq!(pick(128, 49_152), None);
        let fp8 = |h| mma_variant(h, bf16(KvFormat::Fp8E4m3), 232_448).map(|v| v.row_warps);
        assert_eq!(fp8(128), Some(2)); // at most two row groups: registers
        assert_eq!(fp8(16), Some(1));
    }

    #[test]
    fn every_architecture_gets_every_dtype() {
        for (major, minor) in [(8, 0), (8, 9), (9, 0)] {
            let all = all_variants(smem_limit_of_arch(major, minor), (major, minor) == (9, 0));
            assert!(all.len() >= 10, "{major}.{minor}: {}", all.len());
            for code in [
                CacheCode::Model,
                CacheCode::OtherHalf,
                CacheCode::E4m3,
                CacheCode::E5m2,
            ] {
                assert!(
                    all.iter().any(|v| v.cache == code),
                    "{major}.{minor}: no variant for {code:?}"
                );
            }
        }
        // What CI compiles: the Hopper families on sm_90a only.
        let seesaw = |hopper| {
            all_variants(232_448, hopper)
                .iter()
                .filter(|v| v.family == Family::DecodeSeesaw)
                .count()
        };
        // Two model dtypes x (the model's cache, e4m3, e5m2) x (split grid, scheduled, packed).
        assert_eq!((seesaw(true), seesaw(false)), (18, 0));
    }

    #[test]
    fn the_fp8_query_mode_has_its_own_variants_and_no_narrow_or_seesaw_kernel() {
        for (major, minor) in [(8, 0), (8, 9), (9, 0)] {
            let all = all_variants(smem_limit_of_arch(major, minor), (major, minor) == (9, 0));
            let qfp8: Vec<_> = all.iter().filter(|v| v.query == QueryMode::Fp8).collect();
            assert!(!qfp8.is_empty(), "{major}.{minor}");
            for v in &qfp8 {
                assert!(v.fp8() && v.family != Family::DecodeNarrow, "{v}");
                assert!(v.defines().contains(&"-DMLA_QFP8=1".to_string()), "{v}");
                // Every one has its twin without the mode.
                assert!(all.contains(&Variant {
                    query: QueryMode::Model,
                    ..**v
                }));
            }
        }
        let q8 = bf16(KvFormat::Fp8E4m3).fp8_query();
        assert_eq!(narrow_variant(q8, 232_448), None);
        assert!(narrow_variant(bf16(KvFormat::Fp8E4m3), 232_448).is_some());
        assert_eq!(
            seesaw_variant(bf16(KvFormat::Bf16).fp8_query(), 232_448),
            None
        );
        let twin = wgmma_fp8_variant(q8, 232_448).unwrap();
        assert!(twin.defines().contains(&"-DMLA_QFP8=1".to_string()));
    }

    #[test]
    fn every_schedulable_variant_has_a_scheduled_twin_that_precompile_builds() {
        for (major, minor) in [(8, 0), (8, 9), (9, 0)] {
            let all = all_variants(smem_limit_of_arch(major, minor), (major, minor) == (9, 0));
            for v in &all {
                let sched = v.defines().contains(&"-DMLA_SCHED=1".to_string());
                assert_eq!(sched, v.grid == Grid::Scheduled, "{v}");
                let combine = v.family == Family::Combine;
                if v.grid == Grid::Split && (v.schedulable() || combine) {
                    assert!(
                        all.contains(&v.scheduled()),
                        "{major}.{minor}: no scheduled twin of {v}"
                    );
                }
                if v.grid == Grid::Scheduled {
                    assert!(v.schedulable() || combine, "{v}");
                }
            }
            assert!(all.contains(&schedule_variant()));
        }
        // Packed rows and the narrow kernel's keep the split grid: their jobs are not the
        // schedule's single tokens.
        let w = wgmma_variant(bf16(KvFormat::Bf16), 232_448).unwrap();
        assert!(w.schedulable() && !w.packed().schedulable());
        let n = narrow_variant(bf16(KvFormat::Bf16), 232_448).unwrap();
        assert!(!n.schedulable());
        let mma = |h| mma_variant(h, bf16(KvFormat::Bf16), 232_448).unwrap();
        assert_eq!(
            (mma(16).ctas_per_sm, mma(128).ctas_per_sm, w.ctas_per_sm),
            (2, 1, 1)
        );
    }

    #[test]
    fn the_hopper_kernels_need_their_widths_and_caches() {
        let f16 = KernelShape::deepseek(ModelDtype::F16, KvFormat::F16);
        let l256 = KernelShape {
            kv_lora_rank: 256,
            ..f16
        };
        assert!(wgmma_variant(l256, 232_448).is_none());
        assert!(wgmma_variant(f16, 166_912).is_none());
        assert!(seesaw_variant(bf16(KvFormat::Bf16), 200_000).is_none());
        let r128 = KernelShape {
            rope_dim: 128,
            ..bf16(KvFormat::Bf16)
        };
        assert!(seesaw_variant(r128, 232_448).is_none());
        assert!(seesaw_variant(f16, 232_448).is_some_and(|v| v.model == ModelDtype::F16));
        // The other 16-bit type is refused; fp8 codes are rewritten as f16, and the fp8-query
        // mode stays with the fp8 twin.
        assert!(seesaw_variant(bf16(KvFormat::F16), 232_448).is_none());
        for kv in [KvFormat::Fp8E4m3, KvFormat::Fp8E5m2] {
            let v = seesaw_variant(bf16(kv), 232_448);
            assert!(
                v.is_some_and(|v| v.fp8() && v.tma_box() == TmaBox::Codes64),
                "{kv:?}"
            );
            assert!(
                seesaw_variant(bf16(kv).fp8_query(), 232_448).is_none(),
                "{kv:?}"
            );
        }
        let bf16_seesaw = seesaw_variant(bf16(KvFormat::Bf16), 232_448);
        assert_eq!(bf16_seesaw.map(|v| v.tma_box()), Some(TmaBox::Swizzled128));
        assert_eq!(wgmma_fp8_variant(bf16(KvFormat::Bf16), 232_448), None);
        let r32 = KernelShape {
            rope_dim: 32,
            ..bf16(KvFormat::Fp8E4m3)
        };
        assert_eq!(wgmma_fp8_variant(r32, 232_448), None);
        assert_eq!(
            wgmma_fp8_variant(bf16(KvFormat::Fp8E4m3), 232_448).map(|v| v.stages),
            Some(3)
        );
    }

    #[test]
    fn each_stage1_family_names_its_tile_and_grid() {
        let mma = mma_variant(16, bf16(KvFormat::Bf16), 232_448).unwrap();
        let wgmma = wgmma_variant(bf16(KvFormat::Bf16), 232_448).unwrap();
        let narrow = narrow_variant(bf16(KvFormat::Bf16), 232_448).unwrap();
        let seesaw = seesaw_variant(bf16(KvFormat::Bf16), 232_448).unwrap();
        assert!(
            mma.defines()
                .contains(&format!("-DMLA_BN={}", mma.tile_keys()))
        );
        assert_eq!((wgmma.tile_keys(), narrow.tile_keys()), (64, 64));
        assert_eq!(narrow.heads_per_cta(8), 8);
        assert_eq!(
            mma_variant(128, bf16(KvFormat::Bf16), 232_448)
                .unwrap()
                .heads_per_cta(128),
            64
        );
        assert_eq!(
            (wgmma.heads_per_cta(128), wgmma.packed().heads_per_cta(16)),
            (64, 16)
        );
        assert!(narrow.takes_tensor_map() && seesaw.takes_tensor_map());
        assert!(!mma.takes_tensor_map() && !wgmma.takes_tensor_map());
        assert_eq!(
            (
                seesaw.threads(),
                seesaw.heads_per_cta(128),
                seesaw.tile_keys(),
                seesaw.ctas_per_sm
            ),
            (256, 64, 64, 1)
        );
        assert!(seesaw.schedulable() && !seesaw.packed().schedulable());
        assert!(
            seesaw
                .packed()
                .defines()
                .contains(&"-DMLA_PACK=1".to_string())
        );
        assert!(seesaw.defines().contains(&"-DMLA_PACK=0".to_string()));
    }
}
