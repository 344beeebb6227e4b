//! The kernel families: one CUDA source file and one entry point each, and the public names of
//! the stage-1 families (what a plan runs, what a benchmark may force).

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// Every header the kernel sources include, by the name their `#include` lines use. NVRTC
/// compiles the kernels with nothing but these (no CUDA header).
pub(crate) const HEADERS: [(&str, &str); 9] = [
    ("params.cuh", include_str!("../../kernels/params.cuh")),
    (
        "common/half.cuh",
        include_str!("../../kernels/common/half.cuh"),
    ),
    (
        "common/ptx.cuh",
        include_str!("../../kernels/common/ptx.cuh"),
    ),
    (
        "common/fp8.cuh",
        include_str!("../../kernels/common/fp8.cuh"),
    ),
    (
        "common/rows.cuh",
        include_str!("../../kernels/common/rows.cuh"),
    ),
    (
        "common/wgmma.cuh",
        include_str!("../../kernels/common/wgmma.cuh"),
    ),
    (
        "common/keys.cuh",
        include_str!("../../kernels/common/keys.cuh"),
    ),
    (
        "common/tma.cuh",
        include_str!("../../kernels/common/tma.cuh"),
    ),
    (
        "common/schedule.cuh",
        include_str!("../../kernels/common/schedule.cuh"),
    ),
];

/// A kernel family: one source file, one entry point.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Family {
    /// Stage 1 on tensor cores through mma.sync, sm_80 and up.
    DecodeMma,
    /// Stage 1 on Hopper's warpgroup MMA (sm_90a): 64 rows (heads, or heads x packed tokens) a
    /// CTA, 64 keys a tile.
    DecodeWgmma,
    /// Stage 1 for few heads on Hopper: keys as wgmma's rows, up to 16 query rows a CTA, the
    /// keys streamed by TMA through a ring of 8 KB chunks.
    DecodeNarrow,
    /// Stage 1 on Hopper for a cache in the model dtype: 64 rows a CTA, two 64-key tiles a
    /// step, the two warpgroups taking turns between softmax and products.
    DecodeSeesaw,
    /// Stage 1 on Hopper for an fp8 cache: the wgmma kernel's grid with both products turned
    /// around (S^T = K Q^T, O^T = V^T P^T) so that the codes reach wgmma from registers.
    DecodeWgmmaFp8,
    /// Stage 2: the merge of each row's splits.
    Combine,
    /// The work schedule of a scheduled decode, computed on the device from the lengths
    /// (`plan::schedule` is its reference).
    Schedule,
}

impl Family {
    /// The source file, relative to `kernels/`.
    pub(crate) fn file(self) -> &'static str {
        match self {
            Family::DecodeMma => "decode_mma/kernel.cu",
            Family::DecodeWgmma => "decode_wgmma/kernel.cu",
            Family::DecodeNarrow => "decode_narrow/kernel.cu",
            Family::DecodeSeesaw => "decode_seesaw/kernel.cu",
            Family::DecodeWgmmaFp8 => "decode_wgmma_fp8/kernel.cu",
            Family::Combine => "combine/kernel.cu",
            Family::Schedule => "schedule/kernel.cu",
        }
    }

    /// The source text.
    pub(crate) fn source(self) -> &'static str {
        match self {
            Family::DecodeMma => include_str!("../../kernels/decode_mma/kernel.cu"),
            Family::DecodeWgmma => include_str!("../../kernels/decode_wgmma/kernel.cu"),
            Family::DecodeNarrow => include_str!("../../kernels/decode_narrow/kernel.cu"),
            Family::DecodeSeesaw => include_str!("../../kernels/decode_seesaw/kernel.cu"),
            Family::DecodeWgmmaFp8 => include_str!("../../kernels/decode_wgmma_fp8/kernel.cu"),
            Family::Combine => include_str!("../../kernels/combine/kernel.cu"),
            Family::Schedule => include_str!("../../kernels/schedule/kernel.cu"),
        }
    }

    /// The `extern "C"` entry point.
    pub(crate) fn entry(self) -> &'static str {
        match self {
            Family::DecodeMma => "mla_decode_split",
            Family::DecodeWgmma => "mla_decode_wgmma",
            Family::DecodeNarrow => "mla_decode_narrow",
            Family::DecodeSeesaw => "mla_decode_seesaw",
            Family::DecodeWgmmaFp8 => "mla_decode_wgmma_fp8",
            Family::Combine => "mla_decode_combine",
            Family::Schedule => "mla_schedule",
        }
    }

    /// The public name of a stage-1 family (None for the combine and the scheduler).
    pub(crate) fn stage1(self) -> Option<KernelFamily> {
        match self {
            Family::DecodeMma => Some(KernelFamily::Mma),
            Family::DecodeWgmma => Some(KernelFamily::Wgmma),
            Family::DecodeNarrow => Some(KernelFamily::Narrow),
            Family::DecodeSeesaw => Some(KernelFamily::Seesaw),
            Family::DecodeWgmmaFp8 => Some(KernelFamily::WgmmaFp8),
            Family::Combine | Family::Schedule => None,
        }
    }

    /// Whether this is a stage-1 kernel (it exports `mla_decode_smem_bytes`).
    pub(crate) fn is_decode(self) -> bool {
        self.stage1().is_some()
    }
}

/// A stage-1 kernel family: what computes each split's partial attention (docs/glossary.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KernelFamily {
    /// `mma`: mma.sync tensor-core kernel, sm_80 and up; 16 to 64 heads a CTA, 32-key tiles.
    Mma,
    /// `wgmma`: Hopper's warpgroup-MMA kernel (sm_90a); 64 rows a CTA, 64-key tiles; its packed
    /// variant takes several query tokens of a request in one CTA.
    Wgmma,
    /// `narrow`: Hopper's few-head kernel (up to 16 query rows a CTA, keys streamed by TMA).
    Narrow,
    /// `seesaw`: Hopper's two-warpgroup pipeline for a cache in the model dtype, on long splits.
    Seesaw,
    /// `wgmma-fp8`: the wgmma kernel's twin for fp8 caches, the codes converted in registers.
    WgmmaFp8,
}

impl KernelFamily {
    /// Every stage-1 family.
    pub const ALL: [KernelFamily; 5] = [
        KernelFamily::Mma,
        KernelFamily::Wgmma,
        KernelFamily::Narrow,
        KernelFamily::Seesaw,
        KernelFamily::WgmmaFp8,
    ];

    /// The name `mla bench --kernel` and the docs use.
    pub fn name(self) -> &'static str {
        match self {
            KernelFamily::Mma => "mma",
            KernelFamily::Wgmma => "wgmma",
            KernelFamily::Narrow => "narrow",
            KernelFamily::Seesaw => "seesaw",
            KernelFamily::WgmmaFp8 => "wgmma-fp8",
        }
    }

    /// Whether the family needs Hopper (sm_90a).
    pub fn needs_hopper(self) -> bool {
        self != KernelFamily::Mma
    }
}

impl fmt::Display for KernelFamily {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for KernelFamily {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        KernelFamily::ALL
            .into_iter()
            .find(|k| k.name() == s || k.name().replace('-', "_") == s)
            .ok_or_else(|| {
                let names: Vec<_> = KernelFamily::ALL.iter().map(|k| k.name()).collect();
                Error::config(
                    "kernel",
                    format!("expected one of {}, got {s:?}", names.join(", ")),
                )
            })
    }
}

/// Which stage-1 family a decoder may use: the shipped choice, or one family forced where it
/// can run (for benchmarks and tests; decodes it cannot take run the shipped choice).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum KernelChoice {
    /// The shipped choice: the fastest family that runs, as measured (docs/kernels.md).
    #[default]
    Auto,
    /// This family wherever it can run.
    Only(KernelFamily),
}

impl KernelChoice {
    /// Whether `family` is forced.
    pub fn forces(self, family: KernelFamily) -> bool {
        self == KernelChoice::Only(family)
    }
}

impl fmt::Display for KernelChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KernelChoice::Auto => f.write_str("auto"),
            KernelChoice::Only(k) => k.fmt(f),
        }
    }
}

impl FromStr for KernelChoice {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(KernelChoice::Auto),
            other => other.parse().map(KernelChoice::Only),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_bad_names_name_the_setting() {
        for k in KernelFamily::ALL {
            assert_eq!(k.name().parse::<KernelFamily>().unwrap(), k);
            assert_eq!(
                KernelChoice::Only(k)
                    .to_string()
                    .parse::<KernelChoice>()
                    .unwrap(),
                KernelChoice::Only(k)
            );
        }
        assert_eq!(
            "wgmma_fp8".parse::<KernelFamily>().unwrap(),
            KernelFamily::WgmmaFp8
        );
        assert_eq!("auto".parse::<KernelChoice>().unwrap(), KernelChoice::Auto);
        match "tiled".parse::<KernelChoice>() {
            Err(Error::InvalidConfig { field, reason }) => {
                assert_eq!(field, "kernel");
                assert!(reason.contains("seesaw"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn every_stage1_family_has_a_public_name() {
        for f in [
            Family::DecodeMma,
            Family::DecodeWgmma,
            Family::DecodeNarrow,
            Family::DecodeSeesaw,
            Family::DecodeWgmmaFp8,
        ] {
            assert!(f.is_decode() && f.stage1().is_some(), "{f:?}");
        }
        assert!(!Family::Combine.is_decode() && !Family::Schedule.is_decode());
    }
}
