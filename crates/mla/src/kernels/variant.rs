//! A variant: a kernel family plus the compile-time options that specialize it, the key that
//! names a compiled kernel in memory and on disk.

use std::fmt;

use super::family::Family;
use crate::dtype::{KvFormat, ModelDtype};

/// Keys per tile of the mma kernel (its `BN`).
pub(crate) const MMA_TILE_KEYS: usize = 32;
/// Keys per tile of the Hopper kernels (wgmma, narrow, seesaw, the fp8 twin).
pub(crate) const HOPPER_TILE_KEYS: usize = 64;
/// Rows (heads, or heads x packed tokens) of a CTA of the wgmma, seesaw and fp8-twin kernels.
pub(crate) const WGMMA_ROWS: usize = 64;
/// Query rows of a CTA of the narrow kernel.
pub(crate) const NARROW_ROWS: usize = 16;
/// Warps of a combine CTA (its `WARPS`).
pub(crate) const COMBINE_WARPS: usize = 8;
/// The most CTAs an SM of a scheduled stage-1 variant: a scheduled mma CTA walks its pieces in
/// 186 to 200 registers, too many for three (what the scheduled workspace is sized for).
pub(crate) const SCHEDULED_CTAS_PER_SM: usize = 2;

/// How the cache's elements reach the products (the kernels' `MLA_KV`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum CacheCode {
    /// The model dtype: the keys are used as they are stored.
    Model,
    /// The other 16-bit type (an f16 cache under a bf16 model, or the reverse): converted.
    OtherHalf,
    /// fp8 e4m3 codes, decoded and scaled by `k_scale`.
    E4m3,
    /// fp8 e5m2 codes, decoded and scaled by `k_scale`.
    E5m2,
}

impl CacheCode {
    /// The code of a cache format under a model dtype.
    pub(crate) fn of(model: ModelDtype, kv: KvFormat) -> CacheCode {
        match (model, kv) {
            (ModelDtype::Bf16, KvFormat::Bf16) | (ModelDtype::F16, KvFormat::F16) => {
                CacheCode::Model
            }
            (_, KvFormat::Bf16 | KvFormat::F16) => CacheCode::OtherHalf,
            (_, KvFormat::Fp8E4m3) => CacheCode::E4m3,
            (_, KvFormat::Fp8E5m2) => CacheCode::E5m2,
        }
    }

    /// The number the kernels' `MLA_KV` takes (`kernels/params.cuh`).
    fn define(self) -> u8 {
        match self {
            CacheCode::Model => 0,
            CacheCode::OtherHalf => 1,
            CacheCode::E4m3 => 2,
            CacheCode::E5m2 => 3,
        }
    }

    /// Whether the codes are fp8.
    pub(crate) fn is_fp8(self) -> bool {
        matches!(self, CacheCode::E4m3 | CacheCode::E5m2)
    }
}

/// What a CTA's rows are (the kernels' `MLA_PACK`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Rows {
    /// The heads of one query token.
    OneToken,
    /// The heads of several query tokens of a request: each row masks to its own keys.
    PackedTokens,
}

/// How the CTAs find their work (the kernels' `MLA_SCHED`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Grid {
    /// A CTA a (token block, head block, split) of the split grid.
    Split,
    /// Persistent CTAs walking the schedule the scheduler kernel computed on the device
    /// (stage 1), or the slots of the rows that schedule cut (the combine).
    Scheduled,
}

/// The query's numerics (the kernels' `MLA_QFP8`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum QueryMode {
    /// q in the model dtype against the decoded cache.
    Model,
    /// The fp8-query mode: q quantized to e4m3, P rounded to e4m3 (docs/contract.md).
    Fp8,
}

/// How a TMA kernel's copies land a chunk of a key ([`Variant::tma_box`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum TmaBox {
    /// 128 bytes a key (64 16-bit elements or 128 fp8 codes), in the 128-byte swizzle.
    Swizzled128,
    /// 64 fp8 codes a key, unswizzled.
    Codes64,
}

impl TmaBox {
    /// A key's bytes in a box.
    pub(crate) fn bytes(self) -> usize {
        match self {
            TmaBox::Swizzled128 => 128,
            TmaBox::Codes64 => 64,
        }
    }
}

/// One compiled kernel: the family and its specialization.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Variant {
    /// The family.
    pub family: Family,
    /// L.
    pub kv_lora_rank: usize,
    /// R (unused by the combine and the scheduler).
    pub rope_dim: usize,
    /// The model dtype (q and o).
    pub model: ModelDtype,
    /// The cache's elements (unused by the combine and the scheduler).
    pub cache: CacheCode,
    /// Row groups of 16 rows a CTA (the mma kernel's `MLA_MW`; the narrow kernel's rows are
    /// 16 x this).
    pub row_warps: usize,
    /// Tiles of the shared-memory ring (the narrow kernel's counts its 8 KB chunks).
    pub stages: usize,
    /// What a CTA's rows are.
    pub rows: Rows,
    /// How the CTAs find their work.
    pub grid: Grid,
    /// The query's numerics.
    pub query: QueryMode,
    /// CTAs of this variant an SM holds at once: the mma kernel's launch bounds (`MLA_CTAS`)
    /// and the slots the fill rule counts; one for the other families.
    pub ctas_per_sm: usize,
}

impl Variant {
    /// The `-D` options that specialize the source.
    pub(crate) fn defines(&self) -> Vec<String> {
        let mut d = vec![
            format!("-DMLA_L={}", self.kv_lora_rank),
            format!("-DMLA_BF16={}", u8::from(self.model == ModelDtype::Bf16)),
        ];
        let r = format!("-DMLA_R={}", self.rope_dim);
        let kv = format!("-DMLA_KV={}", self.cache.define());
        let pack = format!("-DMLA_PACK={}", u8::from(self.rows == Rows::PackedTokens));
        match self.family {
            Family::DecodeMma => d.extend([
                r,
                kv,
                format!("-DMLA_MW={}", self.row_warps),
                format!("-DMLA_BN={MMA_TILE_KEYS}"),
                format!("-DMLA_STAGES={}", self.stages),
                format!("-DMLA_CTAS={}", self.ctas_per_sm),
            ]),
            Family::DecodeWgmma => d.extend([r, kv, pack]),
            Family::DecodeNarrow => d.extend([
                r,
                kv,
                format!("-DMLA_N={}", 16 * self.row_warps),
                format!("-DMLA_SLOTS={}", self.stages),
            ]),
            Family::DecodeSeesaw => d.extend([r, kv, pack]),
            Family::DecodeWgmmaFp8 => {
                d.extend([r, kv, format!("-DMLA_STAGES={}", self.stages)]);
            }
            Family::Combine | Family::Schedule => {}
        }
        if self.grid == Grid::Scheduled {
            d.push("-DMLA_SCHED=1".to_string());
        }
        if self.query == QueryMode::Fp8 {
            d.push("-DMLA_QFP8=1".to_string());
        }
        d
    }

    /// This variant on the device-computed schedule: at most [`SCHEDULED_CTAS_PER_SM`] CTAs
    /// an SM.
    pub(crate) fn scheduled(self) -> Variant {
        Variant {
            grid: Grid::Scheduled,
            ctas_per_sm: self.ctas_per_sm.min(SCHEDULED_CTAS_PER_SM),
            ..self
        }
    }

    /// This variant with packed query tokens.
    pub(crate) fn packed(self) -> Variant {
        Variant {
            rows: Rows::PackedTokens,
            ..self
        }
    }

    /// Whether a scheduled twin of this stage-1 variant exists: the kernels that take one
    /// query token a CTA (mma, the unpacked wgmma and seesaw kernels), whose jobs are the
    /// schedule's.
    pub(crate) fn schedulable(&self) -> bool {
        match self.family {
            Family::DecodeMma => true,
            Family::DecodeWgmma | Family::DecodeSeesaw => self.rows == Rows::OneToken,
            _ => false,
        }
    }

    /// Keys per tile (its `BN`): the split rule's unit of work.
    pub(crate) fn tile_keys(&self) -> usize {
        match self.family {
            Family::DecodeMma => MMA_TILE_KEYS,
            Family::Combine | Family::Schedule => 0,
            _ => HOPPER_TILE_KEYS,
        }
    }

    /// Heads of a query token a CTA takes (of `heads`): all of them where a CTA's rows are
    /// tokens x heads (packed variants, the narrow kernel), else a row group's worth.
    pub(crate) fn heads_per_cta(&self, heads: usize) -> usize {
        if self.rows == Rows::PackedTokens || self.family == Family::DecodeNarrow {
            heads
        } else {
            16 * self.row_warps
        }
    }

    /// Whether the cache is fp8 (e4m3 or e5m2).
    pub(crate) fn fp8(&self) -> bool {
        self.cache.is_fp8()
    }

    /// Whether the kernel takes the cache's tensor map beside the parameters (it copies the
    /// keys by TMA).
    pub(crate) fn takes_tensor_map(&self) -> bool {
        matches!(self.family, Family::DecodeNarrow | Family::DecodeSeesaw)
    }

    /// How the TMA kernels' copies land a key's chunk: 128 bytes in the 128-byte swizzle (64
    /// 16-bit elements, the wgmma operand; or 128 fp8 codes, the narrow kernel's fp8 operand),
    /// or, for the seesaw kernel's fp8 codes, 64 codes unswizzled, which the kernel rewrites
    /// as f16 in the swizzle.
    pub(crate) fn tma_box(&self) -> TmaBox {
        if self.family == Family::DecodeSeesaw && self.fp8() {
            TmaBox::Codes64
        } else {
            TmaBox::Swizzled128
        }
    }

    /// Threads per CTA.
    pub(crate) fn threads(&self) -> u32 {
        match self.family {
            Family::DecodeMma => 128 * self.row_warps as u32,
            Family::DecodeWgmma | Family::DecodeSeesaw | Family::DecodeWgmmaFp8 => 256,
            // fp8: no producer warpgroup (each consumer warpgroup issues its own tiles).
            Family::DecodeNarrow if self.fp8() => 256,
            Family::DecodeNarrow => 384,
            Family::Combine => 32 * COMBINE_WARPS as u32,
            Family::Schedule => 1024,
        }
    }
}

impl fmt::Display for Variant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.family.entry(), self.defines().join(" "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_codes_follow_the_model_dtype() {
        use CacheCode::*;
        assert_eq!(CacheCode::of(ModelDtype::Bf16, KvFormat::Bf16), Model);
        assert_eq!(CacheCode::of(ModelDtype::Bf16, KvFormat::F16), OtherHalf);
        assert_eq!(CacheCode::of(ModelDtype::F16, KvFormat::Bf16), OtherHalf);
        assert_eq!(CacheCode::of(ModelDtype::F16, KvFormat::F16), Model);
        assert_eq!(CacheCode::of(ModelDtype::F16, KvFormat::Fp8E5m2), E5m2);
        assert_eq!(CacheCode::of(ModelDtype::Bf16, KvFormat::Fp8E4m3), E4m3);
        // The numbers params.cuh gives them.
        assert_eq!(
            [Model, OtherHalf, E4m3, E5m2].map(CacheCode::define),
            [0, 1, 2, 3]
        );
        assert!(E4m3.is_fp8() && E5m2.is_fp8() && !Model.is_fp8() && !OtherHalf.is_fp8());
    }
}
