//! The kernels as data: their sources (embedded), the variants a decode can pick, and the key
//! that names a compiled variant in memory and on disk.
//!
//! A variant is a family plus the `-D` defines that specialize it; the plan's numbers and the
//! device's shared memory decide it ([`decode_variant`], [`combine_variant`]), and
//! [`all_variants`] enumerates what an architecture can need.

use std::fmt;

use crate::dtype::{KvFormat, ModelDtype};
use crate::plan::schedule::{MIN_BLOCKS, SEGMENT_COST};
use crate::plan::{DecodePlan, splits};

/// Every kernel source, by the name the `#include` lines use.
pub const HEADERS: [(&str, &str); 9] = [
    ("params.cuh", include_str!("../../../kernels/params.cuh")),
    (
        "common/half.cuh",
        include_str!("../../../kernels/common/half.cuh"),
    ),
    (
        "common/ptx.cuh",
        include_str!("../../../kernels/common/ptx.cuh"),
    ),
    (
        "common/fp8.cuh",
        include_str!("../../../kernels/common/fp8.cuh"),
    ),
    (
        "common/rows.cuh",
        include_str!("../../../kernels/common/rows.cuh"),
    ),
    (
        "common/wgmma.cuh",
        include_str!("../../../kernels/common/wgmma.cuh"),
    ),
    (
        "common/keys.cuh",
        include_str!("../../../kernels/common/keys.cuh"),
    ),
    (
        "common/tma.cuh",
        include_str!("../../../kernels/common/tma.cuh"),
    ),
    (
        "common/schedule.cuh",
        include_str!("../../../kernels/common/schedule.cuh"),
    ),
];

/// A kernel family: one source file, one entry point.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Family {
    /// Stage 1: split-KV attention on tensor cores (mma.sync), sm_80 and up.
    DecodeMma,
    /// Stage 1 on Hopper's warpgroup MMA (sm_90a): 64 heads a CTA, 64 keys a tile.
    DecodeWgmma,
    /// Stage 1 for few heads on Hopper (sm_90a): keys as wgmma's rows, up to 16 query rows a
    /// CTA, the keys streamed by TMA through a ring of 8 KB chunks.
    DecodeNarrow,
    /// Stage 1 on Hopper (sm_90a) for a cache in the model dtype: 64 heads of one query row
    /// a CTA, two 64-key tiles a step, the two warpgroups taking turns between softmax and
    /// products ("seesaw"), the keys by TMA chunk by chunk.
    DecodeSeesaw,
    /// Stage 1 on Hopper (sm_90a) for an fp8 cache under a 16-bit query: the wgmma kernel's
    /// grid, with both products turned around (S^T = K Q^T, O^T = V^T P^T) so that the codes
    /// reach wgmma from registers, converted there.
    DecodeWgmmaFp8,
    /// Stage 2: the merge of each row's splits.
    Combine,
    /// The work schedule of a scheduled decode (`MlaConfig::device_schedule`), from the
    /// device's lengths; `plan::schedule` is its reference.
    Schedule,
}

impl Family {
    /// The source file, relative to `kernels/`.
    pub fn file(self) -> &'static str {
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
    pub fn source(self) -> &'static str {
        match self {
            Family::DecodeMma => include_str!("../../../kernels/decode_mma/kernel.cu"),
            Family::DecodeWgmma => include_str!("../../../kernels/decode_wgmma/kernel.cu"),
            Family::DecodeNarrow => include_str!("../../../kernels/decode_narrow/kernel.cu"),
            Family::DecodeSeesaw => include_str!("../../../kernels/decode_seesaw/kernel.cu"),
            Family::DecodeWgmmaFp8 => {
                include_str!("../../../kernels/decode_wgmma_fp8/kernel.cu")
            }
            Family::Combine => include_str!("../../../kernels/combine/kernel.cu"),
            Family::Schedule => include_str!("../../../kernels/schedule/kernel.cu"),
        }
    }

    /// Whether this is a stage-1 kernel (it exports `mla_decode_smem_bytes`).
    pub fn is_decode(self) -> bool {
        !matches!(self, Family::Combine | Family::Schedule)
    }

    /// The `extern "C"` entry point.
    pub fn entry(self) -> &'static str {
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
}

/// Keys per tile of the mma kernel.
pub const BLOCK_N: usize = splits::TILE;

/// Rows (heads x packed tokens) per CTA and keys per tile of the wgmma kernel.
pub const WGMMA_TILE: usize = splits::WGMMA_ROWS;
/// As shipped, the seesaw kernel takes the decodes of more than [`WGMMA_TILE`] heads (each
/// tile of keys then serves two CTAs from L2, and the tensor cores set the pace) whose splits
/// hold at least this many keys (4 of its steps of two tiles): there it beats the wgmma
/// kernel by 8% to 17%, where on splits of 64 to 191 keys (batch 1) the wgmma kernel is 4% to
/// 6% faster, a CTA's one or two steps paying the seesaw's longer start (BENCHMARKS.md, the
/// tenth session). Fewer heads need longer splits: [`seesaw_min_split_keys`].
pub const SEESAW_MIN_SPLIT_KEYS: usize = 512;

/// The fewest heads the seesaw kernel takes as shipped (it pads them to 64 rows): from 16
/// heads on it beats the mma kernel on long splits; fewer heads were not measured.
pub const SEESAW_MIN_HEADS: usize = 16;

/// The keys a split must hold for the seesaw kernel to take a decode of `heads` heads as
/// shipped, None below [`SEESAW_MIN_HEADS`]: [`SEESAW_MIN_SPLIT_KEYS`] for more than
/// [`WGMMA_TILE`] heads; twice that for 17 to 64 heads, where the wgmma kernel runs otherwise
/// (64 heads: 6% to 13% faster on 1024 and 2048 keys a split); four times that at 16 heads,
/// where the mma kernel runs otherwise and the decode is memory-bound (3% to 14% faster on
/// 2048 to 8192 keys a split, 2% slower on 1024 and 10% to 14% on 512; BENCHMARKS.md, tenth
/// session). The packed variant takes the rows of packed tokens as heads: 32 and 64 rows (16
/// heads x 2 and 4 tokens, 8 x 4, 4 x 16) measured 1.03x to 1.04x the packed wgmma kernel at
/// 1024 keys a split, 1.09x to 1.10x at 2048, 0.98x to 0.99x at 512 (nineteenth session).
pub fn seesaw_min_split_keys(heads: usize) -> Option<usize> {
    match heads {
        h if h > WGMMA_TILE => Some(SEESAW_MIN_SPLIT_KEYS),
        h if h >= WGMMA_MIN_HEADS => Some(2 * SEESAW_MIN_SPLIT_KEYS),
        h if h >= SEESAW_MIN_HEADS => Some(4 * SEESAW_MIN_SPLIT_KEYS),
        _ => None,
    }
}

/// The fewest heads (rows of a CTA, tokens packed) for which the wgmma kernel is chosen
/// ([`splits::WGMMA_MIN_ROWS`], where the split rule's model of the grids needs it too).
pub const WGMMA_MIN_HEADS: usize = splits::WGMMA_MIN_ROWS;

/// Bytes of one chunk of a tile in the model dtype: 64 keys x 64 columns of 16 bits.
const NARROW_CHUNK: usize = 8192;

/// One compiled kernel: the family and its specialization.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Variant {
    /// The family.
    pub family: Family,
    /// L.
    pub kv_lora_rank: usize,
    /// R (unused by the combine).
    pub rope_dim: usize,
    /// bf16 (true) or f16 model.
    pub bf16: bool,
    /// Cache format code: 0 model dtype, 1 the other 16-bit type, 2 e4m3, 3 e5m2 (unused by
    /// the combine).
    pub kv: u8,
    /// Row groups of 16 heads per CTA (unused by the combine; the narrow kernel's rows are
    /// 16 x this).
    pub row_warps: usize,
    /// Tiles in the shared-memory ring (unused by the combine; the narrow kernel's ring
    /// counts 8 KB chunks).
    pub stages: usize,
    /// The wgmma kernel's variant for packed query tokens (`MLA_PACK`): each row masks to
    /// its own keys. The other variant keeps one token's simpler loop.
    pub packed: bool,
    /// The scheduled variant (`MLA_SCHED`, docs/scheduler.md) of a stage-1 kernel that takes
    /// one token a CTA (mma, unpacked wgmma) or of the combine: it reads the schedule the
    /// scheduler kernel computed on the device (stage 1: persistent CTAs, each walking its
    /// stretch; the combine: the slots of the rows that were cut).
    pub scheduled: bool,
    /// The fp8-query mode (`MLA_QFP8`) of a stage-1 kernel with an fp8 cache: q rewritten as
    /// its e4m3 codes, P rounded to e4m3 (docs/contract.md).
    pub fp8_query: bool,
}

impl Variant {
    /// The `-D` options that specialize the source.
    pub fn defines(&self) -> Vec<String> {
        let mut d = vec![
            format!("-DMLA_L={}", self.kv_lora_rank),
            format!("-DMLA_BF16={}", self.bf16 as u8),
        ];
        match self.family {
            Family::DecodeMma => d.extend([
                format!("-DMLA_R={}", self.rope_dim),
                format!("-DMLA_KV={}", self.kv),
                format!("-DMLA_MW={}", self.row_warps),
                format!("-DMLA_BN={BLOCK_N}"),
                format!("-DMLA_STAGES={}", self.stages),
            ]),
            Family::DecodeWgmma => d.extend([
                format!("-DMLA_R={}", self.rope_dim),
                format!("-DMLA_KV={}", self.kv),
                format!("-DMLA_PACK={}", self.packed as u8),
            ]),
            Family::DecodeNarrow => d.extend([
                format!("-DMLA_R={}", self.rope_dim),
                format!("-DMLA_KV={}", self.kv),
                format!("-DMLA_N={}", 16 * self.row_warps),
                format!("-DMLA_SLOTS={}", self.stages),
            ]),
            // A cache in the model dtype only (`seesaw_variant`).
            Family::DecodeSeesaw => d.extend([
                format!("-DMLA_R={}", self.rope_dim),
                format!("-DMLA_PACK={}", self.packed as u8),
            ]),
            Family::DecodeWgmmaFp8 => d.extend([
                format!("-DMLA_R={}", self.rope_dim),
                format!("-DMLA_KV={}", self.kv),
                format!("-DMLA_STAGES={}", self.stages),
            ]),
            Family::Combine | Family::Schedule => {}
        }
        if self.scheduled {
            d.push("-DMLA_SCHED=1".to_string());
        }
        if self.fp8_query {
            d.push("-DMLA_QFP8=1".to_string());
        }
        d
    }

    /// Whether a scheduled twin of this variant exists: the stage-1 kernels that take one
    /// query token a CTA (mma, the unpacked wgmma kernel), whose jobs are the schedule's.
    pub fn schedulable(&self) -> bool {
        match self.family {
            Family::DecodeMma => true,
            Family::DecodeWgmma | Family::DecodeSeesaw => !self.packed,
            _ => false,
        }
    }

    /// Keys per tile of this stage-1 variant (its `BN`): the split rule's unit of work.
    pub fn tile_keys(&self) -> usize {
        match self.family {
            Family::DecodeMma => BLOCK_N,
            Family::DecodeWgmma
            | Family::DecodeNarrow
            | Family::DecodeSeesaw
            | Family::DecodeWgmmaFp8 => splits::WGMMA_TILE_KEYS,
            Family::Combine | Family::Schedule => 0,
        }
    }

    /// CTAs of this stage-1 variant an SM holds (its launch bounds): two of the mma kernel
    /// with one row group, else one. A schedule shares its cost line among SMs x this.
    pub fn ctas_per_sm(&self) -> usize {
        if self.family == Family::DecodeMma && self.row_warps == 1 {
            2
        } else {
            1
        }
    }

    /// Heads of a query token a CTA takes (of `heads`): all of them in the packed wgmma and
    /// the narrow variants (their rows are tokens x heads), else a row group's worth.
    pub fn heads_per_cta(&self, heads: usize) -> usize {
        if self.packed || self.family == Family::DecodeNarrow {
            heads
        } else {
            16 * self.row_warps
        }
    }

    /// Whether the cache is fp8 (e4m3 or e5m2): the stage-1 kernels stage its raw bytes (the
    /// mma kernel's products convert them in registers, the others into a tile of the model
    /// dtype).
    pub fn fp8(&self) -> bool {
        self.kv >= 2
    }

    /// The narrow kernel's chunks of a tile (its `CHUNKS`): 128 bytes of each key row, 64
    /// 16-bit elements or 128 fp8 codes (the last fp8 chunk half past the 576-code row).
    fn narrow_chunks(&self) -> usize {
        let d = self.kv_lora_rank + self.rope_dim;
        if self.fp8() { d.div_ceil(128) } else { d / 64 }
    }

    /// Whether the kernel takes the cache's tensor map beside the parameters (it copies the
    /// keys by TMA).
    pub fn takes_tensor_map(&self) -> bool {
        matches!(self.family, Family::DecodeNarrow | Family::DecodeSeesaw)
    }

    /// Threads per CTA.
    pub fn threads(&self) -> u32 {
        match self.family {
            Family::DecodeMma => 128 * self.row_warps as u32,
            Family::DecodeWgmma | Family::DecodeSeesaw | Family::DecodeWgmmaFp8 => 256,
            // fp8: no producer warpgroup (each consumer warpgroup issues its own tiles).
            Family::DecodeNarrow if self.fp8() => 256,
            Family::DecodeNarrow => 384,
            Family::Combine => 32 * super::combine::WARPS as u32,
            Family::Schedule => 1024,
        }
    }

    /// Dynamic shared memory per CTA, as the kernel lays it out (the kernel exports the same
    /// number as `mla_decode_smem_bytes`, and loading checks that they agree).
    pub fn smem_bytes(&self) -> usize {
        match self.family {
            Family::Combine | Family::Schedule => return 0,
            Family::DecodeWgmma => {
                // 1024 bytes of alignment slack, q (64 x D), two stages (swizzled 16-bit
                // tiles, or raw fp8 rows plus the converted tile), P (64 x 64), two tiles
                // of key offsets, three rows of 64 floats.
                let t = WGMMA_TILE;
                let d = self.kv_lora_rank + self.rope_dim;
                let tile = t * d * 2;
                let (stage, converted) = if self.fp8() { (t * d, tile) } else { (tile, 0) };
                // The fp8-query mode keeps q as e4m3 codes (the 16-bit q lands in the
                // converted tile first).
                let q = if self.fp8_query { t * d } else { tile };
                return 1024 + q + 2 * stage + converted + t * t * 2 + 2 * t * 8 + 3 * t * 4;
            }
            Family::DecodeSeesaw => {
                // 1024 bytes of alignment slack, q and two stages (64 x D each; P0 takes
                // the first stage's rotary chunk), P1 (64 x 64), five rows of 64 floats (the
                // running max, two rescales, two row sums), and mbarriers: one a chunk of each
                // stage, one for each of the four hand-overs between the warpgroups and one for
                // the row sums' exchange at the end; packed, each row's keys and the keys every
                // row sees (two i32 each); scheduled, the piece's job, slot and splits.
                let t = WGMMA_TILE;
                let d = self.kv_lora_rank + self.rope_dim;
                let ranges = match (self.packed, self.scheduled) {
                    (true, _) => (t + 1) * 8,
                    (false, true) => 16,
                    (false, false) => 0,
                };
                return 1024
                    + 3 * t * d * 2
                    + t * t * 2
                    + 5 * t * 4
                    + (2 * (d / 64) + 5) * 8
                    + ranges;
            }
            Family::DecodeWgmmaFp8 => {
                // 1024 bytes of alignment slack, q (64 x D, 16-bit), P^T (64 x 64, 16-bit)
                // a buffer, the ring of raw tiles (64 keys of D codes, rows padded by 16
                // bytes), a tile of key offsets a stage, the four warps' column maxima and a
                // row of 64 floats (the rescale factors) a buffer, a row of the final maxima,
                // and the mbarriers. Buffers: one under a 16-bit query, two in the fp8-query
                // mode (its lag schedule: 6 + 2 stages mbarriers, else one).
                let t = WGMMA_TILE;
                let d = self.kv_lora_rank + self.rope_dim;
                let (bufs, bars) = if self.fp8_query {
                    (2, 6 + 2 * self.stages)
                } else {
                    (1, 1)
                };
                return 1024
                    + t * d * 2
                    + bufs * t * t * 2
                    + self.stages * t * (d + 16)
                    + self.stages * t * 8
                    + bufs * 4 * t * 4
                    + (bufs + 1) * t * 4
                    + 8 * bars;
            }
            Family::DecodeNarrow => {
                // 1024 bytes of alignment slack, the ring of chunks (8 KB: 128 bytes of each
                // of a tile's 64 keys; fp8's codes as the products take them), q (N x D
                // 16-bit, or its two e4m3 terms in the same bytes), for each of the two
                // consumer warpgroups P^T (N x 64, 16-bit or two e4m3 terms) and 4 x N column
                // maxima, fp8: N floats (each column's q scale); two mbarriers a slot.
                let n = 16 * self.row_warps;
                let d = self.kv_lora_rank + self.rope_dim;
                // fp8's q takes its two terms, 2N rows of whole chunks.
                let (q, units) = if self.fp8() {
                    (2 * n * 128 * self.narrow_chunks(), 4 * n)
                } else {
                    (n * d * 2, 0)
                };
                return 1024
                    + self.stages * NARROW_CHUNK
                    + q
                    + 2 * (n * 128 + 16 * n)
                    + units
                    + 16 * self.stages;
            }
            Family::DecodeMma => {}
        }
        let (rows, bn) = (16 * self.row_warps, BLOCK_N);
        let d = self.kv_lora_rank + self.rope_dim;
        let dp = d + 8;
        // fp8 stages raw codes (rows padded by 16 bytes), which the products convert in
        // registers.
        let stage_row = if self.fp8() { d + 16 } else { dp * 2 };
        let q = rows * dp * 2;
        let stages = self.stages * bn * stage_row;
        let p = rows * (bn + 8) * 2;
        let red = self.row_warps * 4 * 16 * 4;
        let offsets = self.stages * bn * 8;
        q + stages + p + red + offsets
    }
}

impl fmt::Display for Variant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.family.entry(), self.defines().join(" "))
    }
}

/// The cache format code of the kernels.
pub fn kv_code(model: ModelDtype, kv: KvFormat) -> u8 {
    match (model, kv) {
        (ModelDtype::Bf16, KvFormat::Bf16) | (ModelDtype::F16, KvFormat::F16) => 0,
        (_, KvFormat::Bf16 | KvFormat::F16) => 1,
        (_, KvFormat::Fp8E4m3) => 2,
        (_, KvFormat::Fp8E5m2) => 3,
    }
}

/// Which stage-1 kernel family a decoder may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelChoice {
    /// The fastest that runs: wgmma on sm_90a where it applies, else mma.sync.
    Auto,
    /// Always mma.sync (the sm_80 path), for comparisons.
    Mma,
    /// wgmma wherever it can run, whatever the head count (for comparisons).
    Wgmma,
    /// The narrow kernel wherever it can run (up to 16 rows a CTA, one token a request
    /// included), else as auto (for comparisons and tests).
    Narrow,
    /// The seesaw kernel wherever it can run (every head count, one query token a CTA, pages
    /// it tiles), else as auto (for comparisons and tests).
    Seesaw,
    /// The wgmma kernel's fp8 twin wherever it can run (every head count and query length,
    /// one query token a CTA), else the wgmma kernel (for comparisons and tests).
    WgmmaFp8,
}

impl KernelChoice {
    /// From `MLA_KERNEL` (`mma`, `wgmma`, `narrow`, `seesaw`, `wgmma_fp8`; anything else or
    /// unset: auto).
    pub fn from_env() -> KernelChoice {
        match std::env::var("MLA_KERNEL").as_deref() {
            Ok("mma") => KernelChoice::Mma,
            Ok("wgmma") => KernelChoice::Wgmma,
            Ok("narrow") => KernelChoice::Narrow,
            Ok("seesaw") => KernelChoice::Seesaw,
            Ok("wgmma_fp8") => KernelChoice::WgmmaFp8,
            _ => KernelChoice::Auto,
        }
    }
}

/// The environment's override of [`crate::MlaConfig::device_schedule`]: `MLA_SCHEDULE=1`
/// yes, `0` no, unset (or anything else) the configuration's choice.
pub fn schedule_from_env() -> Option<bool> {
    match std::env::var("MLA_SCHEDULE").as_deref() {
        Ok("1") => Some(true),
        Ok("0") => Some(false),
        _ => None,
    }
}

/// The schedule's costs (docs/scheduler.md): a segment's fixed cost and a stretch's fewest
/// blocks beyond it, [`SEGMENT_COST`] and [`MIN_BLOCKS`] unless `MLA_SCHEDULE_COSTS=SEG,MIN`
/// (kernel development: to sweep them on the GPU machine; SEG up to 64, MIN 0 to 64, anything
/// else is ignored).
pub fn schedule_costs_from_env() -> (usize, usize) {
    std::env::var("MLA_SCHEDULE_COSTS")
        .ok()
        .and_then(|v| parse_schedule_costs(&v))
        .unwrap_or((SEGMENT_COST, MIN_BLOCKS))
}

/// `SEG,MIN` as [`schedule_costs_from_env`] reads it.
fn parse_schedule_costs(v: &str) -> Option<(usize, usize)> {
    let (seg, min) = v.split_once(',')?;
    let (seg, min) = (seg.trim().parse().ok()?, min.trim().parse().ok()?);
    (seg <= 64 && min <= 64).then_some((seg, min))
}

/// What a decoder's kernels are specialized on: the widths and the dtypes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelShape {
    /// L.
    pub kv_lora_rank: usize,
    /// R.
    pub rope_dim: usize,
    /// The model dtype (q, o).
    pub model: ModelDtype,
    /// The cache format.
    pub kv: KvFormat,
    /// The fp8-query mode (the cache is fp8).
    pub fp8_query: bool,
}

impl KernelShape {
    /// DeepSeek's widths (L = 512, R = 64) with these dtypes.
    pub fn deepseek(model: ModelDtype, kv: KvFormat) -> KernelShape {
        KernelShape {
            kv_lora_rank: 512,
            rope_dim: 64,
            model,
            kv,
            fp8_query: false,
        }
    }

    /// A stage-1 variant of this shape.
    fn variant(&self, family: Family, row_warps: usize, stages: usize) -> Variant {
        Variant {
            family,
            kv_lora_rank: self.kv_lora_rank,
            rope_dim: self.rope_dim,
            bf16: self.model == ModelDtype::Bf16,
            kv: kv_code(self.model, self.kv),
            row_warps,
            stages,
            packed: false,
            scheduled: false,
            fp8_query: self.fp8_query,
        }
    }
}

/// The wgmma variant, where it can run: an sm_90a device, L = 512, whole 64-column chunks.
pub fn wgmma_variant(shape: KernelShape, smem_limit: usize) -> Option<Variant> {
    let v = shape.variant(Family::DecodeWgmma, WGMMA_TILE / 16, 2);
    let applies = shape.kv_lora_rank == 512
        && (shape.kv_lora_rank + shape.rope_dim).is_multiple_of(64)
        && v.smem_bytes() <= smem_limit;
    applies.then_some(v)
}

/// The narrow variant (few heads, [`splits::NARROW_ROWS`] rows a CTA), where it can run: an
/// sm_90a device, a cache in the model dtype or fp8 (not the other 16-bit type), L = 512,
/// whole 64-column chunks, and room for a ring of at least two tiles; the ring takes all the
/// shared memory the rest leaves (fp8: four whole tiles, two a consumer warpgroup, or none).
pub fn narrow_variant(shape: KernelShape, smem_limit: usize) -> Option<Variant> {
    let d = shape.kv_lora_rank + shape.rope_dim;
    let base = shape.variant(Family::DecodeNarrow, splits::NARROW_ROWS / 16, 0);
    let fixed = base.smem_bytes();
    // A slot's bytes and mbarriers, from the one layout formula (smem_bytes).
    let per_slot = Variant { stages: 1, ..base }.smem_bytes() - fixed;
    // fp8: exactly NARROW_FP8_TILES tiles (two a consumer warpgroup).
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
    let applies = base.kv != 1
        && shape.kv_lora_rank == 512
        && d.is_multiple_of(64)
        && slots >= 2 * chunks
        && v.smem_bytes() <= smem_limit;
    applies.then_some(v)
}

/// The narrow kernel's ring under fp8, in tiles (its `TILE_GROUPS`): the two consumer
/// warpgroups take alternate tiles and issue their own copies, two tiles each (an even
/// count: the kernel's static_assert says why).
const NARROW_FP8_TILES: usize = 4;

/// The seesaw variant, where it can run: an sm_90a device, a cache in the model dtype (no
/// conversion: the keys land by TMA as the products read them), L = 512 and R = 64 (eight
/// value chunks split between the warpgroups, and one rotary chunk, where P0 goes once the
/// scores have read it).
pub fn seesaw_variant(shape: KernelShape, smem_limit: usize) -> Option<Variant> {
    let v = shape.variant(Family::DecodeSeesaw, WGMMA_TILE / 16, 2);
    let applies = v.kv == 0
        && !shape.fp8_query
        && shape.kv_lora_rank == 512
        && shape.rope_dim == 64
        && v.smem_bytes() <= smem_limit;
    applies.then_some(v)
}

/// The keys a split must hold for the wgmma kernel's fp8 twin to take a decode under a
/// 16-bit query as shipped: from 1024 keys a split it is 1.06x to 1.28x faster than the wgmma
/// kernel's fp8 path at 128 heads (its column max handed over by an mbarrier, fourteenth
/// session), at 512 and below slower (0.72x to 0.95x in the twelfth: its start rewrites q
/// twice); BENCHMARKS.md, twelfth to fourteenth sessions.
pub const WGMMA_FP8_MIN_SPLIT_KEYS: usize = 1024;

/// The same in the fp8-query mode, where the wgmma kernel's scores are fp8 wgmma too. With
/// its start rewritten (q divided through `Divider`, the same pieces for every thread), the
/// twin (both products on fp8 wgmma) measured 1.12x faster than the wgmma kernel at 1024 keys
/// a split on two waves of CTAs (132 x 128 x 1024), 1.15x at 4096 and 8192 on one wave
/// (against the wgmma kernel's times before its own start got `Divider`, 5% to 7% faster
/// since). On one wave (fifteenth session): 0.84x at 512 keys, 0.90x at 1024,
/// 0.98x to 1.14x at 2048. With the lag schedule (seventeenth session) it is 1.18x faster at
/// 1024 keys on one wave (66 x 128 x 1024: 58.1 against 68.6 us), 1.06x to 1.07x at 1024 on
/// 2 and 4 splits, 0.95x at 512 (8 x 128 x 4096, 8 splits); hence 1024 (BENCHMARKS.md,
/// eighteenth session).
pub const WGMMA_FP8Q_MIN_SPLIT_KEYS: usize = 1024;

/// The most raw tiles the fp8 twin's ring holds (the third hides a DRAM latency the second
/// leaves; a fourth does not fit beside q).
pub const WGMMA_FP8_STAGES: usize = 3;

/// The wgmma kernel's fp8 twin (products on the codes in registers: f16 wgmma on codes
/// converted there, or in the fp8-query mode fp8 wgmma on the codes as loaded), where it can
/// run: an sm_90a device, an fp8 cache, L = 512, whole 64-column chunks, and a ring of at
/// least two tiles (the deepest up to [`WGMMA_FP8_STAGES`] that fits).
pub fn wgmma_fp8_variant(shape: KernelShape, smem_limit: usize) -> Option<Variant> {
    let applies = shape.kv.is_fp8()
        && shape.kv_lora_rank == 512
        && (shape.kv_lora_rank + shape.rope_dim).is_multiple_of(64);
    if !applies {
        return None;
    }
    (2..=WGMMA_FP8_STAGES)
        .rev()
        .map(|stages| shape.variant(Family::DecodeWgmmaFp8, WGMMA_TILE / 16, stages))
        .find(|v| v.smem_bytes() <= smem_limit)
}

/// The stage-1 variant for a decoder. On sm_90a (`wgmma`), the wgmma kernel where it applies
/// and `choice` and the head count call for it. Otherwise the mma kernel: the most row groups
/// (up to 4, fewer for few heads) that fit the device's shared memory, then the ring of tiles
/// (up to 4, 6 for fp8 whose tiles are half the bytes). None if not even the smallest fits.
pub fn decode_variant(
    heads: usize,
    shape: KernelShape,
    smem_limit: usize,
    wgmma: bool,
    choice: KernelChoice,
) -> Option<Variant> {
    let wants_wgmma = match choice {
        KernelChoice::Auto | KernelChoice::Narrow | KernelChoice::Seesaw => {
            heads >= WGMMA_MIN_HEADS
        }
        KernelChoice::Wgmma | KernelChoice::WgmmaFp8 => true,
        KernelChoice::Mma => false,
    };
    if wgmma
        && wants_wgmma
        && let Some(v) = wgmma_variant(shape, smem_limit)
    {
        return Some(v);
    }
    mma_variant(heads, shape, smem_limit)
}

fn mma_variant(heads: usize, shape: KernelShape, smem_limit: usize) -> Option<Variant> {
    let want = match heads {
        0..=16 => 1,
        17..=32 => 2,
        // An fp8 cache's products convert its codes in registers, which the 128 registers a
        // thread of four row groups cannot hold without spills.
        _ if shape.kv.is_fp8() => 2,
        _ => 4,
    };
    let max_stages = if shape.kv.is_fp8() { 6 } else { 4 };
    let variant = |row_warps, stages| shape.variant(Family::DecodeMma, row_warps, stages);
    // Two CTAs on an SM hide each other's latencies better than a deeper ring in one CTA
    // (measured on the H200: 252 us against 394 us at 128 x 4096 keys, 16 heads), so with one
    // row group (the only size whose registers allow two CTAs, see the kernel's launch
    // bounds) the deepest ring that keeps two per SM wins; else the deepest that fits once.
    // The SM has 1 KB more than a block may take, and each resident block reserves 1 KB.
    let fits_twice =
        |v: &Variant| v.row_warps == 1 && 2 * (v.smem_bytes() + 1024) <= smem_limit + 1024;
    let fits_once = |v: &Variant| v.smem_bytes() <= smem_limit;
    [4, 2, 1]
        .into_iter()
        .filter(|&mw| mw <= want)
        .find_map(|mw| {
            let ring = || {
                (2..=max_stages)
                    .rev()
                    .map(move |stages| variant(mw, stages))
            };
            ring().find(fits_twice).or_else(|| ring().find(fits_once))
        })
}

/// The stage-1 kernels of a decoder: its own (one query token a CTA), and on sm_90a, for up
/// to 32 heads, the wgmma kernel's packed variant, whose CTAs take several query tokens of a
/// request (16 heads x 4 tokens: one read of the keys serves them all), and for up to 16
/// heads with a cache in the model dtype or fp8, the narrow kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stage1 {
    /// The kernel of single-token decodes (and of multi-token ones that do not pack).
    pub decode: Variant,
    /// The kernel of multi-token decodes whose packed rows fill a wgmma tile enough.
    pub packed: Option<Variant>,
    /// The seesaw kernel's packed variant, where the decoder packs tokens (whatever its head
    /// count) and the seesaw kernel can run (a cache in the model dtype): it takes the packed
    /// decodes whose splits hold at least [`seesaw_min_split_keys`] of the packed rows (any
    /// with `MLA_KERNEL=seesaw`), on pages it tiles.
    pub packed_seesaw: Option<Variant>,
    /// The kernel of few-head multi-token decodes that do not pack into the wgmma tile, on
    /// pages it tiles ([`splits::tma_pages`]); at 16 heads over a cache in the model dtype,
    /// of the single-token decodes whose grid it fills (`narrow_singles`).
    pub narrow: Option<Variant>,
    /// Whether the narrow kernel takes the single-token decodes [`splits::narrow_single`]
    /// allows: as shipped at 16 heads over a cache in the model dtype, where it is built
    /// (the fill rule models it, `SplitRule::with_narrow_singles`).
    pub narrow_singles: bool,
    /// The kernel of the decodes that take one query token a CTA (instead of `decode`), on
    /// pages it tiles, from [`SEESAW_MIN_HEADS`] heads (every head count when forced);
    /// none on a decoder that schedules on the device (it has no scheduled variant).
    pub seesaw: Option<Variant>,
    /// The wgmma kernel's fp8 twin, where the decoder's own kernel is the wgmma kernel over
    /// an fp8 cache: it takes the decodes whose splits hold at least
    /// [`WGMMA_FP8_MIN_SPLIT_KEYS`] keys ([`WGMMA_FP8Q_MIN_SPLIT_KEYS`] in the fp8-query mode;
    /// every decode with `MLA_KERNEL=wgmma_fp8`); none with
    /// another kernel forced, or on a decoder that schedules on the device.
    pub fp8: Option<Variant>,
    /// The family asked for: `MLA_KERNEL=narrow` also gives the narrow kernel single-token
    /// decodes, `MLA_KERNEL=seesaw` gives the seesaw kernel splits of any length.
    pub choice: KernelChoice,
}

impl Stage1 {
    /// The stage-1 kernels for a decoder (see [`decode_variant`]); None if not even the
    /// smallest mma variant fits.
    pub fn choose(
        heads: usize,
        shape: KernelShape,
        smem_limit: usize,
        wgmma: bool,
        choice: KernelChoice,
    ) -> Option<Stage1> {
        let decode = decode_variant(heads, shape, smem_limit, wgmma, choice)?;
        // Forced, the fp8 twin takes every decode it can, packed ones too.
        let packs = wgmma
            && !matches!(choice, KernelChoice::Mma | KernelChoice::WgmmaFp8)
            && 2 * heads <= WGMMA_TILE;
        let packed = packs
            .then(|| wgmma_variant(shape, smem_limit))
            .flatten()
            .map(|v| Variant { packed: true, ..v });
        // Auto: where two tokens fit next to the heads; forced: wherever the heads fit.
        let narrow_heads = match choice {
            KernelChoice::Narrow => splits::NARROW_ROWS,
            KernelChoice::Auto | KernelChoice::Seesaw => splits::NARROW_ROWS / 2,
            KernelChoice::Mma | KernelChoice::Wgmma | KernelChoice::WgmmaFp8 => 0,
        };
        // The narrow kernel has no fp8-query mode (its fp8 products split a 16-bit q and P
        // into two e4m3 terms each): those decodes take the mma or packed wgmma kernel.
        // As shipped, 16 heads over a cache in the model dtype also build it, for the single
        // tokens whose grid it fills (`splits::narrow_single`, `launch_for`).
        let singles = choice == KernelChoice::Auto
            && heads == splits::NARROW_ROWS
            && kv_code(shape.model, shape.kv) == 0;
        let narrow = (wgmma && (heads <= narrow_heads || singles) && !shape.fp8_query)
            .then(|| narrow_variant(shape, smem_limit))
            .flatten();
        let narrow_singles = singles && narrow.is_some();
        let seesaw_heads = match choice {
            KernelChoice::Seesaw => true,
            KernelChoice::Auto => seesaw_min_split_keys(heads).is_some(),
            KernelChoice::Mma
            | KernelChoice::Wgmma
            | KernelChoice::Narrow
            | KernelChoice::WgmmaFp8 => false,
        };
        let seesaw = (wgmma && seesaw_heads)
            .then(|| seesaw_variant(shape, smem_limit))
            .flatten();
        // Packed rows are rows whatever their heads: the packed variant wherever tokens pack,
        // as shipped and forced (its threshold is the packed rows', `launch`).
        let packed_seesaw = (packed.is_some()
            && matches!(choice, KernelChoice::Auto | KernelChoice::Seesaw))
        .then(|| seesaw_variant(shape, smem_limit))
        .flatten()
        .map(|v| Variant { packed: true, ..v })
        .filter(|v| v.smem_bytes() <= smem_limit);
        // Where the decoder's own kernel is the wgmma kernel, unless that one is forced.
        let fp8_choice = matches!(choice, KernelChoice::Auto | KernelChoice::WgmmaFp8);
        let fp8 = (decode.family == Family::DecodeWgmma && fp8_choice)
            .then(|| wgmma_fp8_variant(shape, smem_limit))
            .flatten();
        Some(Stage1 {
            decode,
            packed,
            packed_seesaw,
            narrow,
            narrow_singles,
            seesaw,
            fp8,
            choice,
        })
    }

    /// The kernel a decode of `query_len` tokens a request over pages of `page_size` keys,
    /// whose longest split holds `split_keys` keys, launches, and the tokens each of its CTAs
    /// takes: where the tokens pack ([`splits::packing`]: the packed rows reach
    /// [`WGMMA_MIN_HEADS`], the rule that picks wgmma for single tokens), the packed seesaw
    /// kernel where the decoder has it, it tiles the pages and a split holds at least
    /// [`seesaw_min_split_keys`] of the packed rows, else the packed wgmma kernel; else the
    /// narrow kernel where two or more tokens fit it next to the heads and it tiles the pages
    /// ([`splits::narrow_tokens`]; with `MLA_KERNEL=narrow`, single tokens too), else the
    /// seesaw kernel where the decoder has it, it tiles the pages and a split holds at least
    /// [`seesaw_min_split_keys`] keys (any split with `MLA_KERNEL=seesaw`), else the fp8
    /// twin where the decoder has it and a split holds at least [`WGMMA_FP8_MIN_SPLIT_KEYS`]
    /// keys ([`WGMMA_FP8Q_MIN_SPLIT_KEYS`] in the fp8-query mode; any split with
    /// `MLA_KERNEL=wgmma_fp8`), else the decoder's own.
    pub fn launch(
        &self,
        heads: usize,
        query_len: usize,
        page_size: usize,
        split_keys: usize,
    ) -> (Variant, usize) {
        let tiles = splits::tma_pages(page_size);
        if let (Some(w), Some(tokens)) = (self.packed, splits::packing(heads, query_len)) {
            let seesaw = self.packed_seesaw.filter(|_| tiles).filter(|_| {
                self.seesaw_keys_for(heads * tokens)
                    .is_some_and(|keys| split_keys >= keys)
            });
            return (seesaw.unwrap_or(w), tokens);
        }
        let tokens = if self.choice == KernelChoice::Narrow {
            splits::narrow_fit(heads, query_len)
        } else {
            splits::narrow_tokens(heads, query_len)
        };
        let long_splits = self
            .seesaw_keys(heads)
            .is_some_and(|keys| split_keys >= keys);
        let fp8_min = match self.fp8 {
            Some(f) if f.fp8_query => WGMMA_FP8Q_MIN_SPLIT_KEYS,
            _ => WGMMA_FP8_MIN_SPLIT_KEYS,
        };
        let fp8_splits = self.choice == KernelChoice::WgmmaFp8 || split_keys >= fp8_min;
        match (self.narrow, tokens, self.seesaw, self.fp8) {
            (Some(n), Some(tokens), _, _) if tiles => (n, tokens),
            (_, _, Some(s), _) if tiles && long_splits => (s, 1),
            (_, _, _, Some(f)) if fp8_splits => (f, 1),
            _ => (self.decode, 1),
        }
    }

    /// The fewest keys a split must hold for the seesaw kernel to take a decode of `heads`
    /// heads (on pages it tiles): [`seesaw_min_split_keys`], any with `MLA_KERNEL=seesaw`;
    /// None where the decoder has no seesaw kernel. The split rule models it
    /// (`SplitRule::with_kernels`).
    pub fn seesaw_keys(&self, heads: usize) -> Option<usize> {
        self.seesaw?;
        self.seesaw_keys_for(heads)
    }

    /// The fewest keys a split must hold for the seesaw kernel (either variant) to take
    /// `rows` rows a CTA (heads, or packed heads x tokens): [`seesaw_min_split_keys`], any
    /// with `MLA_KERNEL=seesaw`.
    fn seesaw_keys_for(&self, rows: usize) -> Option<usize> {
        if self.choice == KernelChoice::Seesaw {
            Some(0)
        } else {
            seesaw_min_split_keys(rows)
        }
    }

    /// [`launch`](Self::launch) for a planned decode on a GPU of `sm_count` SMs, where
    /// the narrow kernel also takes, instead of the decode kernel, the single tokens whose
    /// grid it fills ([`splits::narrow_single`], on pages it tiles) when the decoder runs it
    /// for them (`narrow_singles`) and the decode is not scheduled
    /// (the narrow kernel has no scheduled variant).
    pub fn launch_for(&self, plan: &DecodePlan, sm_count: usize) -> (Variant, usize) {
        let split_keys = plan.split_keys();
        let launched = self.launch(plan.heads, plan.query_len, plan.kv.page_size, split_keys);
        let ctas = plan.rows * plan.num_kv_splits.max(1);
        let single = self.narrow_singles
            && launched.0 == self.decode
            && plan.schedule_workspace.is_none()
            && splits::tma_pages(plan.kv.page_size)
            && splits::narrow_single(plan.heads, plan.query_len, split_keys, ctas, sm_count);
        match self.narrow {
            Some(n) if single => (n, 1),
            _ => launched,
        }
    }

    /// Every stage-1 kernel the decoder can launch.
    pub fn variants(&self) -> impl Iterator<Item = Variant> {
        std::iter::once(self.decode)
            .chain(self.packed)
            .chain(self.packed_seesaw)
            .chain(self.narrow)
            .chain(self.seesaw)
            .chain(self.fp8)
    }
}

/// The stage-2 variant for a decoder.
pub fn combine_variant(kv_lora_rank: usize, model: ModelDtype) -> Variant {
    Variant {
        family: Family::Combine,
        kv_lora_rank,
        rope_dim: 0,
        bf16: model == ModelDtype::Bf16,
        kv: 0,
        row_warps: 0,
        stages: 0,
        packed: false,
        scheduled: false,
        fp8_query: false,
    }
}

/// The scheduler kernel (one for every decode; its defines are the base ones).
pub fn schedule_variant() -> Variant {
    Variant {
        family: Family::Schedule,
        ..combine_variant(512, ModelDtype::Bf16)
    }
}

/// Largest dynamic shared memory per block by architecture, for compiling without a device.
pub fn smem_limit_of_arch(major: u32, minor: u32) -> usize {
    match (major, minor) {
        (8, 0) => 166_912,
        (9, 0) | (10, _) => 232_448,
        (8, _) | (12, _) => 101_376,
        _ => 49_152,
    }
}

/// Every variant the DeepSeek shapes (L = 512, R = 64) can use on an architecture: both model
/// dtypes, every cache format (fp8 with and without the fp8-query mode), every row-group
/// count that fits, and on sm_90a (`wgmma`) the wgmma kernels (one token a CTA, and packed),
/// the narrow kernel and the seesaw kernel. What CI compiles.
pub fn all_variants(smem_limit: usize, wgmma: bool) -> Vec<Variant> {
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
            // An fp8 cache has the fp8-query mode too.
            let fp8_query = KernelShape {
                fp8_query: true,
                ..plain
            };
            std::iter::once(plain).chain(kv.is_fp8().then_some(fp8_query))
        });
        for shape in shapes {
            for heads in [16, 32, 128] {
                if let Some(v) = mma_variant(heads, shape, smem_limit)
                    && !out.contains(&v)
                {
                    out.extend([
                        v,
                        Variant {
                            scheduled: true,
                            ..v
                        },
                    ]);
                }
            }
            if wgmma && let Some(v) = wgmma_variant(shape, smem_limit) {
                let scheduled = Variant {
                    scheduled: true,
                    ..v
                };
                out.extend([v, scheduled, Variant { packed: true, ..v }]);
            }
            if wgmma
                && !shape.fp8_query
                && let Some(v) = narrow_variant(shape, smem_limit)
            {
                out.push(v);
            }
            if wgmma && let Some(v) = seesaw_variant(shape, smem_limit) {
                let scheduled = Variant {
                    scheduled: true,
                    ..v
                };
                out.extend([v, scheduled, Variant { packed: true, ..v }]);
            }
            if wgmma && let Some(v) = wgmma_fp8_variant(shape, smem_limit) {
                out.push(v);
            }
        }
        let combine = combine_variant(512, model);
        out.extend([
            combine,
            Variant {
                scheduled: true,
                ..combine
            },
        ]);
    }
    out.push(schedule_variant());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bf16(kv: KvFormat) -> KernelShape {
        KernelShape::deepseek(ModelDtype::Bf16, kv)
    }

    #[test]
    fn schedule_costs_parse_within_bounds_only() {
        assert_eq!(parse_schedule_costs("1,2"), Some((1, 2)));
        assert_eq!(parse_schedule_costs(" 0 , 64 "), Some((0, 64)));
        for bad in ["", "3", "65,1", "1,65", "-1,2", "a,b", "1,2,3"] {
            assert_eq!(parse_schedule_costs(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn shared_memory_matches_the_kernel_layout_by_hand() {
        // bf16 cache, 64 rows on an H200: q 64 x 584 x 2, four 32-key stages of 584 x 2,
        // P 64 x 40 x 2, the reduction 4 x 4 x 16 floats, four tiles of key offsets.
        let v = mma_variant(128, bf16(KvFormat::Bf16), 232_448).unwrap();
        assert_eq!((v.row_warps, v.stages), (4, 4));
        assert_eq!(
            v.smem_bytes(),
            74_752 + 4 * 37_376 + 5_120 + 1_024 + 4 * 256
        );
        // fp8: four raw stages of 592 bytes per key (576 and the padding).
        let v = mma_variant(16, bf16(KvFormat::Fp8E4m3), 232_448).unwrap();
        assert_eq!(v.stages, 4);
        assert_eq!(
            v.smem_bytes(),
            18_688 + 4 * 32 * 592 + 1_280 + 256 + 4 * 256
        );
        // The wgmma kernel's fp8 twin: 1 KB of alignment, q 64 x 576 x 2, P^T 64 x 64 x 2,
        // three raw stages of 64 keys x 592 bytes, three tiles of key offsets, 4 x 64 column
        // maxima, 2 x 64 floats and an mbarrier.
        let v = wgmma_fp8_variant(bf16(KvFormat::Fp8E4m3), 232_448).unwrap();
        assert_eq!(v.stages, 3);
        assert_eq!(
            v.smem_bytes(),
            1_024 + 73_728 + 8_192 + 3 * 64 * 592 + 3 * 512 + 1_024 + 512 + 8
        );
    }

    #[test]
    fn the_wgmma_kernels_fp8_twin_takes_long_splits_as_shipped_and_every_decode_when_forced() {
        use KernelChoice::{Auto, Mma, Narrow, Seesaw, Wgmma, WgmmaFp8};
        let limit = smem_limit_of_arch(9, 0);
        for model in [ModelDtype::Bf16, ModelDtype::F16] {
            for kv in [KvFormat::Fp8E4m3, KvFormat::Fp8E5m2] {
                let shape = KernelShape::deepseek(model, kv);
                let twin = wgmma_fp8_variant(shape, limit).unwrap();
                assert_eq!(twin.family, Family::DecodeWgmmaFp8);
                let choose = |heads, choice| Stage1::choose(heads, shape, limit, true, choice);
                // Forced: every head count, query length, page size and split, packed
                // tokens too; warmup builds it.
                for heads in [1, 16, 17, 32, 64, 128] {
                    let s = choose(heads, WgmmaFp8).unwrap();
                    assert_eq!(s.fp8, Some(twin));
                    assert!(s.variants().any(|v| v == twin));
                    for (q_len, page, split_keys) in [(1, 64, 4096), (1, 7, 64), (4, 16, 500)] {
                        assert_eq!(s.launch(heads, q_len, page, split_keys), (twin, 1));
                    }
                }
                // As shipped: from 17 heads (the wgmma kernel's), splits of at least
                // WGMMA_FP8_MIN_SPLIT_KEYS keys, on any page size; the packed kernel keeps
                // the tokens that pack (up to 32 heads).
                let min = WGMMA_FP8_MIN_SPLIT_KEYS;
                let s = choose(17, Auto).unwrap();
                assert_eq!(s.launch(17, 1, 64, min), (twin, 1));
                assert_eq!(s.launch(17, 1, 64, min - 1), (s.decode, 1));
                for heads in [33, 64, 128] {
                    let s = choose(heads, Auto).unwrap();
                    assert_eq!(s.fp8, Some(twin));
                    for (q_len, page) in [(1, 64), (1, 7), (2, 64), (3, 33)] {
                        assert_eq!(s.launch(heads, q_len, page, min), (twin, 1));
                        assert_eq!(s.launch(heads, q_len, page, 4 * min), (twin, 1));
                        assert_eq!(s.launch(heads, q_len, page, min - 1), (s.decode, 1));
                    }
                    assert_eq!(s.decode.family, Family::DecodeWgmma);
                }
                let s = choose(17, Auto).unwrap();
                assert_eq!(s.launch(17, 3, 64, 4 * min).0.family, Family::DecodeWgmma);
                assert!(s.launch(17, 3, 64, 4 * min).0.packed);
                // 16 heads take the mma kernel, which has no twin; a forced kernel keeps its
                // own.
                assert_eq!(choose(16, Auto).unwrap().fp8, None);
                for choice in [Mma, Wgmma, Narrow, Seesaw] {
                    for heads in [16, 64, 128] {
                        assert_eq!(choose(heads, choice).unwrap().fp8, None);
                    }
                }
                // Not before sm_90a; in the fp8-query mode, its fp8-wgmma variant.
                let sm89 = Stage1::choose(128, shape, smem_limit_of_arch(8, 9), false, WgmmaFp8);
                assert_eq!(sm89.unwrap().fp8, None);
                let fp8_query = KernelShape {
                    fp8_query: true,
                    ..shape
                };
                let twin_q = wgmma_fp8_variant(fp8_query, limit).unwrap();
                assert!(twin_q.fp8_query && twin_q.defines().contains(&"-DMLA_QFP8=1".into()));
                let s = Stage1::choose(128, fp8_query, limit, true, Auto).unwrap();
                assert_eq!(s.fp8, Some(twin_q));
                let min_q = WGMMA_FP8Q_MIN_SPLIT_KEYS;
                assert!(min_q >= min);
                assert_eq!(s.launch(128, 1, 64, min_q), (twin_q, 1));
                assert_eq!(s.launch(128, 1, 64, min_q - 1), (s.decode, 1));
                assert!(s.decode.fp8_query && s.decode.family == Family::DecodeWgmma);
            }
            let bf16_cache = KernelShape::deepseek(model, KvFormat::Bf16);
            assert_eq!(wgmma_fp8_variant(bf16_cache, limit), None);
        }
        // Other widths: whole 64-column groups under L = 512 only.
        let narrow_rope = KernelShape {
            rope_dim: 32,
            ..bf16(KvFormat::Fp8E4m3)
        };
        assert_eq!(wgmma_fp8_variant(narrow_rope, limit), None);
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
        assert_eq!(stages(16, KvFormat::Fp8E4m3, 232_448), Some(4)); // two CTAs
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
            for kv in 0..4 {
                assert!(
                    all.iter().any(|v| v.kv == kv),
                    "{major}.{minor}: no variant for cache code {kv}"
                );
            }
        }
    }

    #[test]
    fn the_fp8_query_mode_has_its_own_variants_and_no_narrow_kernel() {
        for (major, minor) in [(8, 0), (8, 9), (9, 0)] {
            let all = all_variants(smem_limit_of_arch(major, minor), (major, minor) == (9, 0));
            let qfp8: Vec<_> = all.iter().filter(|v| v.fp8_query).collect();
            assert!(!qfp8.is_empty(), "{major}.{minor}");
            for v in &qfp8 {
                assert!(v.fp8() && v.family != Family::DecodeNarrow, "{v}");
                assert!(v.defines().contains(&"-DMLA_QFP8=1".to_string()), "{v}");
                // Every one has its twin without the mode.
                assert!(all.contains(&Variant {
                    fp8_query: false,
                    ..**v
                }));
            }
        }
        let shape = KernelShape {
            fp8_query: true,
            ..bf16(KvFormat::Fp8E4m3)
        };
        for choice in [KernelChoice::Auto, KernelChoice::Narrow] {
            let s = Stage1::choose(4, shape, 232_448, true, choice).unwrap();
            assert_eq!(s.narrow, None);
            assert!(s.decode.fp8_query && s.packed.is_some_and(|p| p.fp8_query));
            // Few-head multi-token rows take the packed wgmma kernel or mma instead.
            let (v, _) = s.launch(4, 2, 64, 1);
            assert!(v.fp8_query && v.family != Family::DecodeNarrow);
        }
        let plain = Stage1::choose(
            4,
            bf16(KvFormat::Fp8E4m3),
            232_448,
            true,
            KernelChoice::Auto,
        );
        assert!(plain.unwrap().narrow.is_some());
    }

    #[test]
    fn each_stage1_family_names_its_tile_for_the_split_rule() {
        // The kernels' BN: decode_mma's MLA_BN, decode_wgmma's and decode_narrow's 64.
        let mma = mma_variant(16, bf16(KvFormat::Bf16), 232_448).unwrap();
        let wgmma = wgmma_variant(bf16(KvFormat::Bf16), 232_448).unwrap();
        let narrow = narrow_variant(bf16(KvFormat::Bf16), 232_448).unwrap();
        assert!(
            mma.defines()
                .contains(&format!("-DMLA_BN={}", mma.tile_keys()))
        );
        assert_eq!((wgmma.tile_keys(), narrow.tile_keys()), (64, 64));
    }

    #[test]
    fn every_schedulable_variant_has_a_scheduled_twin_that_precompile_builds() {
        for (major, minor) in [(8, 0), (8, 9), (9, 0)] {
            let all = all_variants(smem_limit_of_arch(major, minor), (major, minor) == (9, 0));
            for v in &all {
                let sched = v.defines().contains(&"-DMLA_SCHED=1".to_string());
                assert_eq!(sched, v.scheduled, "{v}");
                let twin = Variant {
                    scheduled: true,
                    ..*v
                };
                if !v.scheduled && (v.schedulable() || v.family == Family::Combine) {
                    assert!(
                        all.contains(&twin),
                        "{major}.{minor}: no scheduled twin of {v}"
                    );
                }
                if v.scheduled {
                    assert!(v.schedulable() || v.family == Family::Combine, "{v}");
                }
            }
            assert!(all.contains(&schedule_variant()));
        }
        // Packed rows and the narrow kernel's keep the split grid: their jobs are not the
        // schedule's single tokens.
        let w = wgmma_variant(bf16(KvFormat::Bf16), 232_448).unwrap();
        assert!(w.schedulable() && !Variant { packed: true, ..w }.schedulable());
        assert!(
            !narrow_variant(bf16(KvFormat::Bf16), 232_448)
                .unwrap()
                .schedulable()
        );
        // The fill line is shared among the CTAs an SM holds.
        let mma = |h| mma_variant(h, bf16(KvFormat::Bf16), 232_448).unwrap();
        assert_eq!(
            (
                mma(16).ctas_per_sm(),
                mma(128).ctas_per_sm(),
                w.ctas_per_sm()
            ),
            (2, 1, 1)
        );
    }

    #[test]
    fn hopper_takes_wgmma_from_17_heads_for_every_cache() {
        let pick = |h, kv, wgmma, choice| {
            decode_variant(h, bf16(kv), 232_448, wgmma, choice).map(|v| v.family)
        };
        use KernelChoice::{Auto, Mma, Wgmma};
        use KvFormat::{Bf16, F16, Fp8E4m3};
        let (w, m) = (Some(Family::DecodeWgmma), Some(Family::DecodeMma));
        // heads, cache, sm_90a, choice -> family: many heads and every cache format take
        // wgmma on Hopper; 16 heads, MLA_KERNEL=mma and earlier GPUs take mma.
        for (heads, kv, hopper, choice, want) in [
            (128, Bf16, true, Auto, w),
            (64, Bf16, true, Auto, w),
            (32, Bf16, true, Auto, w),
            (16, Bf16, true, Auto, m),
            (16, Bf16, true, Wgmma, w),
            (128, Bf16, true, Mma, m),
            (128, Fp8E4m3, true, Auto, w),
            (128, F16, true, Auto, w),
            (128, Bf16, false, Auto, m),
        ] {
            assert_eq!(
                pick(heads, kv, hopper, choice),
                want,
                "{heads} {kv:?} {hopper} {choice:?}"
            );
        }
        // Its layout: q, two key tiles and P of 64 rows, offsets and statistics, 1 KB slack.
        let v = wgmma_variant(
            KernelShape::deepseek(ModelDtype::F16, KvFormat::F16),
            232_448,
        )
        .unwrap();
        assert_eq!(v.smem_bytes(), 1024 + 3 * 73_728 + 8_192 + 1_024 + 768);
        // fp8: two raw stages of 576 bytes a key and the converted tile: the same total.
        let v = wgmma_variant(bf16(KvFormat::Fp8E4m3), 232_448).unwrap();
        assert_eq!(
            v.smem_bytes(),
            1024 + 73_728 + 2 * 36_864 + 73_728 + 8_192 + 1_024 + 768
        );
        assert_eq!((v.threads(), v.row_warps * 16), (256, 64));
        // The fp8-query mode: q as e4m3 codes (64 x 576 bytes), the rest as above.
        let q8 = Variant {
            fp8_query: true,
            ..v
        };
        assert_eq!(
            q8.smem_bytes(),
            1024 + 36_864 + 2 * 36_864 + 73_728 + 8_192 + 1_024 + 768
        );
        let f16 = KernelShape::deepseek(ModelDtype::F16, KvFormat::F16);
        let narrow = KernelShape {
            kv_lora_rank: 256,
            ..f16
        };
        assert!(wgmma_variant(narrow, 232_448).is_none());
        assert!(wgmma_variant(f16, 166_912).is_none());
    }

    #[test]
    fn few_heads_pack_query_tokens_into_the_wgmma_tile_on_hopper() {
        use KernelChoice::{Auto, Mma, Wgmma};
        let choose = |heads, wgmma, choice| {
            Stage1::choose(heads, bf16(KvFormat::Bf16), 232_448, wgmma, choice).unwrap()
        };
        // (family, packed variant, tokens a CTA) a decode over pages of 64 keys in splits
        // shorter than the seesaw kernel takes launches.
        let launch = |s: Stage1, heads, q| {
            let (v, t) = s.launch(heads, q, 64, SEESAW_MIN_SPLIT_KEYS - 1);
            (v.family, v.packed, t)
        };
        let (w, m, n) = (Family::DecodeWgmma, Family::DecodeMma, Family::DecodeNarrow);
        // heads, query_len -> what launches on sm_90a (auto).
        for (heads, q, want) in [
            (16, 1, (m, false, 1)), // one token: mma.sync, as fast or faster
            (8, 1, (m, false, 1)),
            (16, 2, (w, true, 2)),
            (16, 4, (w, true, 4)),
            (16, 8, (w, true, 4)), // 64 rows: two token blocks a request
            (8, 2, (n, false, 2)), // 16 rows: the narrow kernel's
            (8, 3, (w, true, 3)),
            (4, 4, (n, false, 4)),
            (1, 8, (n, false, 8)),
            (1, 12, (n, false, 12)), // 12 rows: the wgmma tile needs 17
            (1, 30, (w, true, 30)),
            (20, 1, (w, false, 1)),
            (20, 3, (w, true, 3)),
            (32, 2, (w, true, 2)),
            (33, 2, (w, false, 1)),
            (128, 4, (w, false, 1)),
        ] {
            assert_eq!(
                launch(choose(heads, true, Auto), heads, q),
                want,
                "{heads} heads, {q} tokens"
            );
        }
        // Pages the narrow kernel does not tile take the decoder's own kernel.
        for page in [1, 4, 24, 48, 100] {
            let (v, t) = choose(8, true, Auto).launch(8, 2, page, 1);
            assert_eq!((v.family, t), (m, 1), "page {page}");
        }
        for page in [8, 16, 32, 64, 128, 256] {
            let (v, _) = choose(8, true, Auto).launch(8, 2, page, 1);
            assert_eq!(v.family, n, "page {page}");
        }
        // Nor the other 16-bit type; fp8 caches convert on the way.
        let f16 = Stage1::choose(8, bf16(KvFormat::F16), 232_448, true, Auto).unwrap();
        assert_eq!(f16.launch(8, 2, 64, 1).0.family, m);
        let fp8 = Stage1::choose(8, bf16(KvFormat::Fp8E4m3), 232_448, true, Auto).unwrap();
        assert_eq!(fp8.launch(8, 2, 64, 1).0.family, n);
        // MLA_KERNEL=narrow: single tokens of up to 16 heads too; packing still comes first.
        use KernelChoice::Narrow;
        assert_eq!(launch(choose(16, true, Narrow), 16, 1), (n, false, 1));
        assert_eq!(launch(choose(5, true, Narrow), 5, 2), (n, false, 2));
        assert_eq!(launch(choose(16, true, Narrow), 16, 4), (w, true, 4));
        assert_eq!(launch(choose(17, true, Narrow), 17, 1), (w, false, 1));
        // MLA_KERNEL=mma never packs; MLA_KERNEL=wgmma runs the wgmma kernel everywhere and
        // packs as auto does; before Hopper there is no wgmma kernel.
        assert_eq!(launch(choose(16, true, Mma), 16, 4), (m, false, 1));
        assert_eq!(launch(choose(16, true, Mma), 16, 1), (m, false, 1));
        assert_eq!(launch(choose(16, true, Wgmma), 16, 1), (w, false, 1));
        assert_eq!(launch(choose(4, true, Wgmma), 4, 4), (w, false, 1));
        assert_eq!(launch(choose(4, true, Wgmma), 4, 100), (w, true, 16));
        assert_eq!(launch(choose(16, false, Auto), 16, 4), (m, false, 1));
        // Warmup builds what can launch: the packed variants (wgmma and seesaw) for up to 32
        // heads on Hopper, the narrow kernel for up to 8 (16 when forced, and as shipped at
        // 16 over a cache in the model dtype, for single tokens), the seesaw kernel from 16.
        let count = |heads, wgmma| choose(heads, wgmma, Auto).variants().count();
        assert_eq!(
            (
                count(8, true),
                count(16, true),
                count(32, true),
                count(33, true)
            ),
            (4, 5, 4, 2)
        );
        // The narrow kernel's single tokens: as shipped at 16 heads over a cache in the model
        // dtype (not fp8, not in the fp8-query mode), forced or not at all elsewhere.
        assert!(choose(16, true, Auto).narrow_singles);
        for kv in [KvFormat::Fp8E4m3, KvFormat::F16] {
            let s = Stage1::choose(16, bf16(kv), 232_448, true, Auto).unwrap();
            assert!(s.narrow.is_none() && !s.narrow_singles, "{kv:?}");
        }
        let mut fp8q = bf16(KvFormat::Bf16);
        fp8q.fp8_query = true;
        assert!(
            !Stage1::choose(16, fp8q, 232_448, true, Auto)
                .unwrap()
                .narrow_singles
        );
        for choice in [Narrow, Mma, Wgmma, KernelChoice::Seesaw] {
            assert!(!choose(16, true, choice).narrow_singles, "{choice:?}");
        }
        assert!(!choose(16, false, Auto).narrow_singles);
        assert!(choose(17, true, Auto).narrow.is_none());
        // Built at 8 heads for multi-token rows, it takes no single tokens there.
        let eight = choose(8, true, Auto);
        assert!(eight.narrow.is_some() && !eight.narrow_singles);
        assert_eq!(choose(16, true, Narrow).variants().count(), 3);
        assert_eq!(count(16, false), 1);
        assert!(
            choose(16, true, Auto)
                .packed
                .unwrap()
                .defines()
                .contains(&"-DMLA_PACK=1".to_string())
        );
    }

    #[test]
    fn the_seesaw_kernel_takes_many_heads_on_long_splits_and_anything_forced_on_pages_it_tiles() {
        use KernelChoice::{Auto, Mma, Narrow, Seesaw, Wgmma};
        let choose = |heads, kv, wgmma, choice| {
            Stage1::choose(heads, bf16(kv), 232_448, wgmma, choice).unwrap()
        };
        let (s, w, n) = (
            Family::DecodeSeesaw,
            Family::DecodeWgmma,
            Family::DecodeNarrow,
        );
        // MLA_KERNEL=seesaw: every head count's single tokens, and multi-token rows that
        // neither pack into the wgmma tile nor take the narrow kernel, one token a CTA, on
        // any split length.
        for (heads, q, want) in [
            (128, 1, (s, 1)),
            (128, 4, (s, 1)),
            (64, 1, (s, 1)),
            (17, 1, (s, 1)),
            (16, 1, (s, 1)),
            (1, 1, (s, 1)),
            (16, 4, (s, 4)), // packed: one read of the keys for 4 tokens
            (16, 2, (s, 2)),
            (8, 2, (n, 2)), // the narrow kernel's 16 rows
        ] {
            for split_keys in [1, 64, 511, 512, 100_000] {
                let (v, t) =
                    choose(heads, KvFormat::Bf16, true, Seesaw).launch(heads, q, 64, split_keys);
                assert_eq!(
                    (v.family, t),
                    want,
                    "{heads} heads x {q}, {split_keys} keys a split"
                );
            }
        }
        // As shipped: more than 64 heads (two CTAs share each tile of keys) on splits of at
        // least SEESAW_MIN_SPLIT_KEYS keys, 17 to 64 heads on twice as long ones, 16 heads on
        // four times as long; else the wgmma kernel (the mma kernel at 16 heads or fewer).
        let long = SEESAW_MIN_SPLIT_KEYS;
        let m = Family::DecodeMma;
        for (heads, q, split_keys, want) in [
            (128, 1, long, s),
            (128, 1, 32_768, s),
            (128, 2, long, s),
            (65, 1, long, s),
            (128, 1, long - 1, w),
            (128, 1, 191, w), // batch 1 at 8192 keys: 43 splits
            (128, 1, 1, w),
            (64, 1, 2 * long, s),
            (64, 1, 2 * long - 1, w),
            (17, 1, 2 * long, s),
            (32, 1, long, w),
            (16, 1, 4 * long, s),
            (16, 1, 4 * long - 1, m),
            (16, 1, long, m),
            (15, 1, 100_000, m),
            (8, 1, 100_000, m),
        ] {
            let (v, _) = choose(heads, KvFormat::Bf16, true, Auto).launch(heads, q, 64, split_keys);
            assert_eq!(
                v.family, want,
                "{heads} heads x {q}, {split_keys} keys a split"
            );
        }
        // Pages it does not tile take the decoder's own kernel.
        for (page, want) in [
            (8, s),
            (16, s),
            (32, s),
            (64, s),
            (192, s),
            (48, w),
            (12, w),
            (1, w),
        ] {
            for choice in [Seesaw, Auto] {
                let (v, _) = choose(128, KvFormat::Bf16, true, choice).launch(128, 1, page, long);
                assert_eq!(v.family, want, "page {page}, {choice:?}");
            }
        }
        // Not where another family is forced, only on Hopper, only for a cache in the model
        // dtype (the keys land as the products read them).
        for (kv, hopper, choice) in [
            (KvFormat::Bf16, true, Wgmma),
            (KvFormat::Bf16, true, Narrow),
            (KvFormat::F16, true, Auto),
            (KvFormat::Fp8E4m3, true, Auto),
            (KvFormat::Bf16, true, Mma),
            (KvFormat::Bf16, false, Seesaw),
            (KvFormat::F16, true, Seesaw),
            (KvFormat::Fp8E4m3, true, Seesaw),
        ] {
            let stage1 = choose(128, kv, hopper, choice);
            assert_eq!(stage1.seesaw, None, "{kv:?} {hopper} {choice:?}");
            assert_eq!(stage1.seesaw_keys(128), None, "{kv:?} {hopper} {choice:?}");
            assert_ne!(stage1.launch(128, 1, 64, long).0.family, s);
        }
        // What the split rule is told (SplitRule::with_kernels): the launch's own threshold.
        for heads in [128, 64, 17, 16] {
            let keys = choose(heads, KvFormat::Bf16, true, Auto).seesaw_keys(heads);
            assert_eq!(keys, seesaw_min_split_keys(heads), "{heads} heads");
            let keys = keys.unwrap();
            let stage1 = choose(heads, KvFormat::Bf16, true, Auto);
            assert_eq!(stage1.launch(heads, 1, 64, keys).0.family, s);
            assert_ne!(stage1.launch(heads, 1, 64, keys - 1).0.family, s);
            assert_eq!(
                choose(heads, KvFormat::Bf16, true, Seesaw).seesaw_keys(heads),
                Some(0)
            );
        }
        let v = choose(128, KvFormat::Bf16, true, Seesaw).seesaw.unwrap();
        assert!(
            choose(128, KvFormat::Bf16, true, Seesaw)
                .variants()
                .any(|x| x == v)
        );
        assert_eq!(
            (
                v.threads(),
                v.heads_per_cta(128),
                v.tile_keys(),
                v.ctas_per_sm()
            ),
            (256, 64, 64, 1)
        );
        // It has a scheduled variant (its packed one does not: packed jobs are not the
        // schedule's single tokens).
        assert!(v.takes_tensor_map() && v.schedulable());
        assert!(!Variant { packed: true, ..v }.schedulable());
        // 1 KB slack, q and two stages of 64 x 576, P1 (64 x 64), five rows of 64 floats,
        // 23 mbarriers: within the 227 KB a block may take on sm_90a; scheduled, 16 bytes
        // more (the piece's job, slot and split count, for the epilogue).
        assert_eq!(v.smem_bytes(), 1024 + 3 * 73_728 + 8_192 + 1_280 + 184);
        let scheduled = Variant {
            scheduled: true,
            ..v
        };
        assert_eq!(scheduled.smem_bytes(), v.smem_bytes() + 16);
        assert!(scheduled.defines().contains(&"-DMLA_SCHED=1".to_string()));
        assert!(v.smem_bytes() <= 232_448);
        assert!(seesaw_variant(bf16(KvFormat::Bf16), 200_000).is_none());
        let other_rope = KernelShape {
            rope_dim: 128,
            ..bf16(KvFormat::Bf16)
        };
        assert!(seesaw_variant(other_rope, 232_448).is_none());
        let f16 = KernelShape::deepseek(ModelDtype::F16, KvFormat::F16);
        assert!(seesaw_variant(f16, 232_448).is_some_and(|v| !v.bf16));
        // What CI compiles: both model dtypes' seesaw kernels on sm_90a, none before it.
        let count = |wgmma| {
            all_variants(232_448, wgmma)
                .iter()
                .filter(|v| v.family == s)
                .count()
        };
        assert_eq!((count(true), count(false)), (6, 0));
    }

    #[test]
    fn the_seesaw_kernel_packs_few_head_tokens_on_long_splits_as_shipped() {
        use KernelChoice::{Auto, Mma, Seesaw, Wgmma};
        let choose =
            |heads, kv, choice| Stage1::choose(heads, bf16(kv), 232_448, true, choice).unwrap();
        let (s, w) = (Family::DecodeSeesaw, Family::DecodeWgmma);
        // (heads, tokens, keys a split) -> family; the CTA packs the tokens either way.
        let long = seesaw_min_split_keys(32).unwrap();
        assert_eq!(long, 2 * SEESAW_MIN_SPLIT_KEYS);
        for (heads, q, split_keys, want, tokens) in [
            (16, 2, long, s, 2),
            (16, 4, long, s, 4),
            (16, 8, 100_000, s, 4),
            (32, 2, long, s, 2),
            (20, 3, long, s, 3),
            (16, 2, long - 1, w, 2),
            (16, 4, 64, w, 4),
            // Under 16 heads too (no unpacked seesaw kernel there as shipped).
            (8, 4, long, s, 4),
            (8, 8, long, s, 8),
            (1, 30, 100_000, s, 30),
            (8, 3, long - 1, w, 3),
        ] {
            let (v, t) = choose(heads, KvFormat::Bf16, Auto).launch(heads, q, 64, split_keys);
            assert_eq!(
                (v.family, v.packed, t),
                (want, true, tokens),
                "{heads} heads x {q}, {split_keys} keys a split"
            );
        }
        // Pages it does not tile, and caches it does not read, keep the packed wgmma kernel.
        for page in [1, 12, 48] {
            let (v, _) = choose(16, KvFormat::Bf16, Auto).launch(16, 4, page, 100_000);
            assert_eq!((v.family, v.packed), (w, true), "page {page}");
        }
        for kv in [KvFormat::F16, KvFormat::Fp8E4m3] {
            let stage1 = choose(16, kv, Auto);
            assert_eq!(stage1.packed_seesaw, None, "{kv:?}");
            assert_eq!(stage1.launch(16, 4, 64, 100_000).0.family, w, "{kv:?}");
        }
        // Forced: any split; another family forced: never.
        let (v, _) = choose(16, KvFormat::Bf16, Seesaw).launch(16, 2, 64, 1);
        assert_eq!((v.family, v.packed), (s, true));
        for choice in [Wgmma, Mma] {
            assert_eq!(choose(16, KvFormat::Bf16, choice).packed_seesaw, None);
        }
        // The variant: MLA_PACK, its rows' key ranges in shared memory (65 x two i32 more
        // than the unpacked kernel's, still within the 227 KB of a block), all heads of a
        // token a CTA, and what warmup and CI build.
        let stage1 = choose(16, KvFormat::Bf16, Auto);
        let v = stage1.packed_seesaw.unwrap();
        let unpacked = stage1.seesaw.unwrap();
        assert!(v.defines().contains(&"-DMLA_PACK=1".to_string()));
        assert!(unpacked.defines().contains(&"-DMLA_PACK=0".to_string()));
        assert_eq!(v.smem_bytes(), unpacked.smem_bytes() + 65 * 8);
        assert!(v.smem_bytes() <= 232_448);
        assert_eq!(
            (v.heads_per_cta(16), v.tile_keys(), v.ctas_per_sm()),
            (16, 64, 1)
        );
        assert!(v.takes_tensor_map() && !v.schedulable());
        assert!(stage1.variants().any(|x| x == v));
        assert!(all_variants(232_448, true).contains(&v));
    }

    #[test]
    fn the_narrow_kernel_fills_shared_memory_with_its_ring() {
        // 25 chunk slots of 8 KB on an H200 next to q (16 x 576 x 2), two P^T (16 x 64 x 2)
        // and two 4 x 16 maxima, 1 KB slack, two mbarriers a slot.
        let v = narrow_variant(bf16(KvFormat::Bf16), 232_448).unwrap();
        assert_eq!((v.stages, v.threads()), (25, 384));
        assert_eq!(
            v.smem_bytes(),
            1024 + 25 * 8192 + 18_432 + 2 * (2048 + 256) + 25 * 16
        );
        assert!(v.smem_bytes() <= 232_448);
        assert!(v.defines().contains(&"-DMLA_SLOTS=25".to_string()));
        // Its CTAs take every head of their tokens, and the cache's tensor map.
        assert_eq!(v.heads_per_cta(8), 8);
        assert!(v.takes_tensor_map());
        let mma = mma_variant(128, bf16(KvFormat::Bf16), 232_448).unwrap();
        assert_eq!(mma.heads_per_cta(128), 64);
        assert!(!mma.takes_tensor_map());
        let w = wgmma_variant(bf16(KvFormat::Bf16), 232_448).unwrap();
        assert_eq!(
            (
                w.heads_per_cta(128),
                Variant { packed: true, ..w }.heads_per_cta(16)
            ),
            (64, 16)
        );
        // Only caches in the model dtype, and only where two tiles (18 slots) fit.
        assert!(narrow_variant(bf16(KvFormat::F16), 232_448).is_none());
        // fp8: four tiles of 5 raw slots of 8 KB (128 codes of each key, the last slot's half
        // past the row; the products take the codes as they land), q's two e4m3 terms (32
        // rows of 5 chunks, where the 16-bit q lands first), and 16 floats of q scales; no
        // producer warpgroup.
        let v = narrow_variant(bf16(KvFormat::Fp8E4m3), 232_448).unwrap();
        assert_eq!((v.stages, v.threads()), (20, 256));
        assert_eq!(
            v.smem_bytes(),
            1024 + 20 * 8192 + 20_480 + 2 * (2048 + 256) + 64 + 20 * 16
        );
        assert!(v.defines().contains(&"-DMLA_KV=2".to_string()));
        // Four tiles or none: the fp8 ring does not shrink to what a device has.
        assert_eq!(
            narrow_variant(bf16(KvFormat::Fp8E4m3), 200_000).map(|v| v.stages),
            Some(20)
        );
        assert!(narrow_variant(bf16(KvFormat::Fp8E4m3), 180_000).is_none());
        assert_eq!(
            narrow_variant(bf16(KvFormat::Bf16), 180_000)
                .unwrap()
                .stages,
            18
        );
        assert!(narrow_variant(bf16(KvFormat::Bf16), 166_912).is_none());
    }

    #[test]
    fn cache_codes() {
        assert_eq!(kv_code(ModelDtype::Bf16, KvFormat::Bf16), 0);
        assert_eq!(kv_code(ModelDtype::Bf16, KvFormat::F16), 1);
        assert_eq!(kv_code(ModelDtype::F16, KvFormat::Bf16), 1);
        assert_eq!(kv_code(ModelDtype::F16, KvFormat::Fp8E5m2), 3);
    }
}
