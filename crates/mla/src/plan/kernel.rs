//! The kernel pick: which stage-1 variant runs a decode, decided in one place.
//!
//! `KernelSet::for_decoder` decides, once per decoder, which variants it may launch (from
//! the validated configuration and the device: its architecture and shared memory, and the
//! configuration's [`KernelChoice`]). `KernelSet::pick` decides, for each decode, which of
//! them runs it (from the call's metadata: heads, tokens a request, page size, keys a split,
//! CTAs). The plan carries the pick; the split rule's cost model calls the same function for
//! each split count it weighs; the CUDA backend launches what the plan carries.
//!
//! Batch-invariant mode picks by the decoder and the call's shape alone (never by lengths or
//! CTA counts), so a row's kernel, and so its bits, never depend on its neighbours.

use crate::config::{DeviceInfo, ValidConfig};
use crate::error::{Error, Result};
use crate::kernels::family::Family;
use crate::kernels::select::{
    KernelShape, combine_variant, mma_variant, narrow_variant, seesaw_variant, wgmma_fp8_variant,
    wgmma_variant,
};
use crate::kernels::variant::{
    CacheCode, HOPPER_TILE_KEYS, NARROW_ROWS, QueryMode, Variant, WGMMA_ROWS,
};
use crate::kernels::{KernelChoice, KernelFamily};

/// The fewest rows (heads, or heads x packed tokens) a CTA gives the wgmma kernel for it to be
/// chosen: at 16 rows its tile is three-quarters padding and two mma.sync CTAs an SM are faster
/// (H200: 175 against 233 us at 128 x 16 x 4096); at 32 the wgmma kernel is 1.3x to 1.4x
/// faster (64 x 4096 keys, bf16 and fp8 caches).
pub const WGMMA_MIN_ROWS: usize = 17;

/// Keys a split must hold for the seesaw kernel to take more than 64 heads (each tile of keys
/// then serves two CTAs from L2 and the tensor cores set the pace): 8% to 17% faster than the
/// wgmma kernel there, 4% to 6% slower on splits of 64 to 191 keys (H200, 2026-12-02).
pub const SEESAW_MIN_SPLIT_KEYS: usize = 512;

/// The keys a split must hold for the seesaw kernel to take a CTA of `rows` rows (heads, or
/// packed heads x tokens), None under 16: 512 above 64 rows; 1024 from 17 to 64, where the
/// wgmma kernel runs otherwise (64 heads: 6% to 13% faster on 1024 and 2048 keys a split); 2048
/// at 16, where the mma kernel runs otherwise and the decode is memory-bound (3% to 14% faster
/// on 2048 to 8192 keys, 2% slower on 1024; H200, 2026-12-02). Packed rows count as heads
/// (1.03x to 1.10x the packed wgmma kernel from 1024 keys a split, H200, 2026-12-03).
pub fn seesaw_min_split_keys(rows: usize) -> Option<usize> {
    match rows {
        r if r > WGMMA_ROWS => Some(SEESAW_MIN_SPLIT_KEYS),
        r if r >= WGMMA_MIN_ROWS => Some(2 * SEESAW_MIN_SPLIT_KEYS),
        r if r >= 16 => Some(4 * SEESAW_MIN_SPLIT_KEYS),
        _ => None,
    }
}

/// The fewest heads for the seesaw kernel to take single tokens over an fp8 cache as shipped.
/// From 17 its codes rewritten as f16 in shared memory and its two-tile order beat the fp8
/// twin by 1.15x to 1.31x at 128 heads on every case of the side-by-side grid (8 x 128 x 4096:
/// 53.3 to 40.5 us, 64 x 128 x 8192: 418.4 to 343.7); at 16 heads, where the mma kernel runs
/// otherwise, it is 1.10x to 1.17x slower (64 x 16 x 8192: 182.1 against 157.7; H100,
/// 2026-12-06).
pub const FP8_SEESAW_MIN_HEADS: usize = WGMMA_MIN_ROWS;

/// Keys a split must hold for the fp8 twin to take a decode under a 16-bit query: from 1024 it
/// is 1.06x to 1.28x faster than the wgmma kernel's fp8 path at 128 heads, at 512 and below
/// slower (0.72x to 0.95x: its start rewrites q twice; H200, 2026-12-02).
pub const WGMMA_FP8_MIN_SPLIT_KEYS: usize = 1024;

/// The same in the fp8-query mode: 1.18x faster at 1024 keys on one wave (66 x 128 x 1024:
/// 58.1 against 68.6 us), 0.95x at 512 (H200, 2026-12-03).
pub const WGMMA_FP8Q_MIN_SPLIT_KEYS: usize = 1024;

/// The fewest keys a split must hold for the narrow kernel to take a single-token decode
/// ([`narrow_single`]): at 16 heads it beats the mma kernel's two CTAs an SM on twice the
/// splits from 256 keys a split (8 x 16 x 4096: 21.7 us on 16 splits of 256 keys against 22.1
/// on 32; 128 x 16 x 1024: 47.7 on one split against 54.8 on 2; H200, 2026-12-05).
pub const NARROW_SINGLE_MIN_SPLIT_KEYS: usize = 256;

/// Whether a request's query tokens pack into the wgmma (or seesaw) kernel's CTAs, and how
/// many each takes: as many as fit its 64 rows next to the heads (16 heads x 4 tokens, so one
/// read of the keys serves them all), when that is at least 2 and the rows reach
/// [`WGMMA_MIN_ROWS`].
pub fn packing(heads: usize, query_len: usize) -> Option<usize> {
    let tokens = query_len.min(WGMMA_ROWS / heads.max(1));
    (tokens > 1 && heads * tokens >= WGMMA_MIN_ROWS).then_some(tokens)
}

/// The tokens a narrow CTA can take of a request, one or more, where the heads fit its 16 rows
/// and the wgmma kernel does not pack them.
pub fn narrow_fit(heads: usize, query_len: usize) -> Option<usize> {
    let fits = (1..=NARROW_ROWS).contains(&heads) && packing(heads, query_len).is_none();
    fits.then(|| query_len.clamp(1, NARROW_ROWS / heads))
}

/// Whether the narrow kernel takes a request's query tokens as shipped: two or more fit its
/// rows next to the heads (8 heads x 2: one read of the keys for both, 1.7x the mma kernel's
/// CTA a token on the H200) and the wgmma kernel does not pack them.
pub fn narrow_tokens(heads: usize, query_len: usize) -> Option<usize> {
    narrow_fit(heads, query_len).filter(|&tokens| tokens > 1)
}

/// Whether the narrow kernel takes a single-token decode of `heads` heads whose splits hold
/// `split_keys` keys, launched as `ctas` CTAs (one an SM) on `sm_count` SMs: its 16 rows are
/// all heads, a split holds at least [`NARROW_SINGLE_MIN_SPLIT_KEYS`] keys in whole 64-key
/// tiles (its tiles start at multiples of 64: a split of 373 keys reads seven), and the CTAs
/// fill each wave to at least 90% (with one CTA an SM an idle SM is keys unread: 48 x 16 x
/// 2048 on 96 CTAs, 50.3 against the mma kernel's 44.7 us; H200, 2026-12-05).
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
        && split_keys.is_multiple_of(HOPPER_TILE_KEYS)
        && 10 * ctas >= 9 * sm_count * waves
}

/// Whether the TMA kernels' copies (narrow, seesaw) tile pages of `page_size` keys: their
/// 64-key tiles start at multiples of 64, so a page must hold whole tiles or a tile whole pages
/// of at least 8 keys (a page is then a whole number of 1 KB swizzle atoms).
pub fn tma_pages(page_size: usize) -> bool {
    page_size.is_multiple_of(64) || (page_size.is_multiple_of(8) && 64 % page_size.max(1) == 0)
}

/// What a GPU offers the kernel pick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Gpu {
    /// Hopper's arch-specific instructions (sm_90a: wgmma, TMA, setmaxnreg).
    pub hopper: bool,
    /// Dynamic shared memory a block may take.
    pub smem_limit: usize,
    /// Streaming multiprocessors.
    pub sm_count: usize,
}

impl Gpu {
    /// The GPU of a CUDA device (None for the CPU).
    pub(crate) fn of(device: &DeviceInfo) -> Option<Gpu> {
        match device {
            DeviceInfo::Cpu { .. } => None,
            DeviceInfo::Cuda {
                capability,
                sm_count,
                smem_per_block,
                ..
            } => Some(Gpu {
                hopper: (capability.major, capability.minor) == (9, 0),
                smem_limit: *smem_per_block,
                sm_count: *sm_count,
            }),
        }
    }
}

/// A decode as the pick sees it: the call's shape and, per split count weighed, the keys of
/// its longest split and its CTAs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Call {
    /// Query heads.
    pub heads: usize,
    /// Query tokens a request.
    pub query_len: usize,
    /// Keys a page of the cache.
    pub page_size: usize,
    /// Keys of the longest split.
    pub split_keys: usize,
    /// Query rows x splits (the CTA count of a kernel of one token and all heads a CTA).
    pub ctas: usize,
    /// Whether the decode takes the device-computed schedule.
    pub scheduled: bool,
}

/// The stage-1 variant a decode launches, and the query tokens each of its CTAs takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Pick {
    /// The variant.
    pub variant: Variant,
    /// Query tokens of one request a CTA takes.
    pub tokens: usize,
}

impl Pick {
    fn one(variant: Variant) -> Pick {
        Pick { variant, tokens: 1 }
    }

    /// The public family.
    pub(crate) fn family(&self) -> KernelFamily {
        self.variant.family.stage1().unwrap_or(KernelFamily::Mma)
    }

    /// The CTAs a split of `rows` query rows (`query_len` a request) of `heads` heads takes,
    /// as the backend launches it: a CTA a block of `tokens` tokens and a block of heads.
    pub(crate) fn ctas_per_split(&self, rows: usize, query_len: usize, heads: usize) -> usize {
        let q = query_len.max(1);
        rows.div_ceil(q)
            * q.div_ceil(self.tokens)
            * heads.div_ceil(self.variant.heads_per_cta(heads).max(1))
    }
}

/// The stage-1 variants a GPU decoder may launch, decided once from its configuration and the
/// device, and the rule that picks one for each decode (`KernelSet::pick`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct KernelSet {
    /// The kernel of single-token decodes (and of multi-token ones that take nothing else).
    pub decode: Variant,
    /// The wgmma kernel's packed variant, for multi-token decodes whose packed rows fill its
    /// tile enough ([`packing`]; up to 32 heads).
    pub packed: Option<Variant>,
    /// The seesaw kernel's packed variant, for the packed decodes whose splits are long enough
    /// ([`seesaw_min_split_keys`] of the packed rows), on pages it tiles.
    pub packed_seesaw: Option<Variant>,
    /// The narrow kernel: few-head multi-token decodes that do not pack ([`narrow_tokens`]),
    /// and where `narrow_singles`, 16-head single tokens whose grid it fills.
    pub narrow: Option<Variant>,
    /// Whether the narrow kernel takes the single tokens [`narrow_single`] allows.
    pub narrow_singles: bool,
    /// The seesaw kernel: decodes of one token a CTA whose splits are long enough.
    pub seesaw: Option<Variant>,
    /// The fp8 twin: fp8 decodes of 17 heads or more whose splits are long enough.
    pub fp8: Option<Variant>,
    /// Whether decodes of two or more requests take the device-computed schedule.
    pub schedule: bool,
    /// What the configuration forces.
    choice: KernelChoice,
    /// Batch-invariant mode: picks by the decoder and the call's shape alone.
    batch_invariant: bool,
    /// SMs of the GPU.
    sm_count: usize,
}

impl KernelSet {
    /// The kernels of a GPU decoder: the fastest variants that run for its heads, dtypes and
    /// widths on this GPU (or the family its configuration forces, where that runs).
    ///
    /// `fills` says whether the split count is the fill rule's to choose (not fixed, not
    /// batch-invariant): only then does a decoder take the device-computed schedule.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] (`qk_rope_head_dim`) when not even the smallest mma variant
    /// fits the device's shared memory.
    pub(crate) fn for_decoder(cfg: &ValidConfig, gpu: Gpu, fills: bool) -> Result<KernelSet> {
        let query = if cfg.fp8_query {
            QueryMode::Fp8
        } else {
            QueryMode::Model
        };
        let shape = KernelShape {
            kv_lora_rank: cfg.kv_lora_rank,
            rope_dim: cfg.rope_dim,
            model: cfg.model_dtype,
            kv: cfg.kv_format,
            query,
        };
        let (heads, limit, choice) = (cfg.q_heads, gpu.smem_limit, cfg.tuning.kernel);
        let forced = |k| choice.forces(k);
        let auto = choice == KernelChoice::Auto;
        let hopper = |build: fn(KernelShape, usize) -> Option<Variant>| {
            gpu.hopper.then(|| build(shape, limit)).flatten()
        };
        // The decoder's own kernel: wgmma on Hopper from 17 heads (every head count when the
        // wgmma kernel or its fp8 twin is forced), else mma.
        let wants_wgmma = match choice {
            KernelChoice::Only(KernelFamily::Mma) => false,
            KernelChoice::Only(KernelFamily::Wgmma | KernelFamily::WgmmaFp8) => true,
            _ => heads >= WGMMA_MIN_ROWS,
        };
        let decode = wants_wgmma
            .then(|| hopper(wgmma_variant))
            .flatten()
            .or_else(|| mma_variant(heads, shape, limit))
            .ok_or_else(|| {
                Error::config(
                    "qk_rope_head_dim",
                    format!(
                        "L + R = {} needs more shared memory than the device's {limit} bytes \
                         per block",
                        cfg.kv_lora_rank + cfg.rope_dim
                    ),
                )
            })?;
        // Tokens pack where two fit next to the heads, unless mma or the twin is forced.
        let packs = !forced(KernelFamily::Mma)
            && !forced(KernelFamily::WgmmaFp8)
            && 2 * heads <= WGMMA_ROWS;
        let packed = packs
            .then(|| hopper(wgmma_variant))
            .flatten()
            .map(Variant::packed);
        // fp8 packed rows stay on the packed wgmma kernel as shipped (not measured against it).
        let packed_seesaw = (packed.is_some()
            && ((auto && !shape.kv.is_fp8()) || forced(KernelFamily::Seesaw)))
        .then(|| hopper(seesaw_variant))
        .flatten()
        .map(Variant::packed)
        .filter(|v| v.smem_bytes() <= limit);
        // The narrow kernel: multi-token rows of up to 8 heads (16 forced); as shipped also
        // 16-head single tokens over a cache in the model dtype.
        let narrow_heads = match choice {
            KernelChoice::Auto | KernelChoice::Only(KernelFamily::Seesaw) => NARROW_ROWS / 2,
            KernelChoice::Only(KernelFamily::Narrow) => NARROW_ROWS,
            KernelChoice::Only(_) => 0,
        };
        let singles = auto && heads == NARROW_ROWS && shape.cache() == CacheCode::Model;
        let narrow = (heads <= narrow_heads || singles)
            .then(|| hopper(narrow_variant))
            .flatten();
        // The seesaw kernel from 16 heads as shipped (from 17 over an fp8 cache), every head
        // count forced.
        let seesaw_heads = forced(KernelFamily::Seesaw)
            || (auto
                && seesaw_min_split_keys(heads).is_some()
                && (!shape.kv.is_fp8() || heads >= FP8_SEESAW_MIN_HEADS));
        let seesaw = seesaw_heads.then(|| hopper(seesaw_variant)).flatten();
        // The fp8 twin where the decoder's own kernel is the wgmma kernel.
        let twin_choice = auto || forced(KernelFamily::WgmmaFp8);
        let fp8 = (decode.family == Family::DecodeWgmma && twin_choice)
            .then(|| hopper(wgmma_fp8_variant))
            .flatten();
        // The schedule where asked, the split count is the fill rule's, and the decoder's own
        // kernel has a scheduled variant; the twin has none, so a scheduling decoder does
        // without it.
        let schedule = cfg.device_schedule && fills && decode.schedulable();
        Ok(KernelSet {
            decode,
            packed,
            packed_seesaw,
            narrow_singles: singles && narrow.is_some(),
            narrow,
            seesaw,
            fp8: if schedule { None } else { fp8 },
            schedule,
            choice,
            batch_invariant: cfg.batch_invariant,
            sm_count: gpu.sm_count,
        })
    }

    /// The variant that runs a decode, and the tokens each of its CTAs takes. In order: where
    /// the tokens pack, the packed seesaw kernel on pages it tiles and long enough splits,
    /// else the packed wgmma kernel; the narrow kernel where two or more tokens fit it (single
    /// tokens too when forced) on pages it tiles; the seesaw kernel on pages it tiles and long
    /// enough splits (any when forced); the fp8 twin on long enough splits (any when forced);
    /// else the decoder's own kernel, which the narrow kernel replaces for the single tokens
    /// whose grid it fills. On a scheduled decode, a variant of one token a CTA that has a
    /// scheduled twin runs that twin.
    pub(crate) fn pick(&self, call: &Call) -> Pick {
        let Call {
            heads, query_len, ..
        } = *call;
        let tiles = tma_pages(call.page_size);
        // Batch-invariant mode sees every split as long: the pick is the decoder's.
        let split_keys = if self.batch_invariant {
            usize::MAX
        } else {
            call.split_keys
        };
        let long_for = |rows: usize| {
            self.choice.forces(KernelFamily::Seesaw)
                || seesaw_min_split_keys(rows).is_some_and(|keys| split_keys >= keys)
        };
        if let (Some(w), Some(tokens)) = (self.packed, packing(heads, query_len)) {
            let seesaw = self
                .packed_seesaw
                .filter(|_| tiles && long_for(heads * tokens));
            return Pick {
                variant: seesaw.unwrap_or(w),
                tokens,
            };
        }
        let narrow_tokens = if self.choice.forces(KernelFamily::Narrow) {
            narrow_fit(heads, query_len)
        } else {
            narrow_tokens(heads, query_len)
        };
        let fp8_min = match self.fp8.map(|f| f.query) {
            Some(QueryMode::Fp8) => WGMMA_FP8Q_MIN_SPLIT_KEYS,
            _ => WGMMA_FP8_MIN_SPLIT_KEYS,
        };
        let fp8_long = self.choice.forces(KernelFamily::WgmmaFp8) || split_keys >= fp8_min;
        let pick = match (self.narrow, narrow_tokens, self.seesaw, self.fp8) {
            (Some(n), Some(tokens), _, _) if tiles => Pick { variant: n, tokens },
            (_, _, Some(s), _) if tiles && long_for(heads) => Pick::one(s),
            (_, _, _, Some(f)) if fp8_long => Pick::one(f),
            _ => {
                let singles = self.narrow_singles
                    && !call.scheduled
                    && !self.batch_invariant
                    && tiles
                    && narrow_single(heads, query_len, split_keys, call.ctas, self.sm_count);
                match self.narrow {
                    Some(n) if singles => Pick::one(n),
                    _ => Pick::one(self.decode),
                }
            }
        };
        if call.scheduled && pick.tokens == 1 && pick.variant.schedulable() {
            Pick::one(pick.variant.scheduled())
        } else {
            pick
        }
    }

    /// The set without the kernels of one CTA an SM that only take single tokens on long
    /// enough splits (the seesaw kernel, the narrow kernel's single tokens): what the fill
    /// rule weighs them against, so that they only ever lower its count.
    pub(crate) fn without_long_split_kernels(&self) -> KernelSet {
        KernelSet {
            seesaw: None,
            narrow_singles: false,
            ..*self
        }
    }

    /// Every variant the decoder can launch, scheduled twins and the combine included: what
    /// warmup builds.
    pub(crate) fn variants(&self) -> Vec<Variant> {
        // The combine is the decoder's widths' and dtype's, as the backend launches it.
        let combine = combine_variant(self.decode.kv_lora_rank, self.decode.model);
        let mut v: Vec<Variant> = std::iter::once(self.decode)
            .chain(self.packed)
            .chain(self.packed_seesaw)
            .chain(self.narrow)
            .chain(self.seesaw)
            .chain(self.fp8)
            .chain([combine])
            .collect();
        if self.schedule {
            v.extend(
                [Some(self.decode), self.seesaw]
                    .into_iter()
                    .flatten()
                    .map(Variant::scheduled),
            );
            v.extend([
                combine.scheduled(),
                crate::kernels::select::schedule_variant(),
            ]);
        }
        v
    }
}

#[cfg(test)]
mod tests;
