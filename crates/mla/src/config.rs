//! The decoder's configuration and its validation against a device.
//!
//! [`MlaConfig`] holds what vLLM passes to its MLA backend's constructor (heads, scale, dtypes,
//! window, the features the seed rejects) plus the shape of the latent rows. [`MlaConfig::validate`]
//! checks it against a [`DeviceInfo`], which is a plain value, so every rejection is testable
//! without a GPU. The result, [`ValidConfig`], is what the plan and the backends read.

use crate::dtype::{CacheDtype, KvFormat, ModelDtype};
use crate::error::{Capability, Error, Result};
use crate::kernels::{CpuKernel, KernelChoice};

/// The largest fixed split count a configuration may ask for (`MlaConfig::num_kv_splits`):
/// the workspace grows with it, and the combine walks the splits in order.
pub const MAX_FIXED_SPLITS: usize = 4096;

/// vLLM's attention types; mla implements decoder self-attention only.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttentionType {
    /// Decoder self-attention (the only one MLA decode serves).
    #[default]
    Decoder,
    /// Encoder self-attention.
    Encoder,
    /// Encoder-only self-attention.
    EncoderOnly,
    /// Encoder/decoder cross-attention.
    EncoderDecoder,
}

impl AttentionType {
    fn name(self) -> &'static str {
        match self {
            AttentionType::Decoder => "decoder",
            AttentionType::Encoder => "encoder",
            AttentionType::EncoderOnly => "encoder_only",
            AttentionType::EncoderDecoder => "encoder_decoder",
        }
    }
}

/// Which device a configuration is checked against.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceInfo {
    /// The CPU backend: every dtype is available.
    Cpu {
        /// Worker threads; they stand in for SMs in the split rule.
        threads: usize,
    },
    /// A CUDA device.
    Cuda {
        /// Its name, as the driver reports it.
        name: String,
        /// Its compute capability.
        capability: Capability,
        /// Streaming multiprocessors: bounds the split count.
        sm_count: usize,
        /// Dynamic shared memory a block may take (bytes): which kernel variants fit.
        smem_per_block: usize,
    },
}

impl std::fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceInfo::Cpu { threads } => write!(f, "cpu ({threads} threads)"),
            DeviceInfo::Cuda {
                name,
                capability,
                sm_count,
                ..
            } => write!(
                f,
                "{name} (compute capability {capability}, {sm_count} SMs)"
            ),
        }
    }
}

/// The configuration of an MLA decoder. Build it with [`MlaConfig::new`] (DeepSeek-V3 shapes)
/// and change fields as needed; [`MlaConfig::validate`] checks it.
///
/// ```
/// use mla::{CacheDtype, MlaConfig};
/// let mut cfg = MlaConfig::new(128, 192f32.powf(-0.5));
/// cfg.kv_cache_dtype = "fp8".parse::<CacheDtype>()?;
/// # Ok::<(), mla::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct MlaConfig {
    /// Query heads on this rank (H). With DCP the query carries `num_heads * dcp_world_size`.
    pub num_heads: usize,
    /// Softmax scale applied to q.k (DeepSeek-V3: 192^-0.5), in (0, 1024].
    pub scale: f32,
    /// Width of the latent (value) part of a row, L (512).
    pub kv_lora_rank: usize,
    /// Width of the rotary part of a row, R (64).
    pub qk_rope_head_dim: usize,
    /// dtype of q and o.
    pub model_dtype: ModelDtype,
    /// dtype of the KV cache, by vLLM's name.
    pub kv_cache_dtype: CacheDtype,
    /// Each row attends to its last `sliding_window` keys; None for all.
    pub sliding_window: Option<usize>,
    /// One split per row, so that a row's output is bitwise independent of the batch
    /// (vLLM's `VLLM_BATCH_INVARIANT`).
    pub batch_invariant: bool,
    /// Decode context parallelism world size (1 when off).
    pub dcp_world_size: usize,
    /// Must be the decoder (vLLM's `attn_type`).
    pub attn_type: AttentionType,
    /// Rejected unless empty (vLLM's `alibi_slopes`).
    pub alibi_slopes: Option<Vec<f32>>,
    /// Rejected unless None or 0 (vLLM's `logits_soft_cap`).
    pub logits_soft_cap: Option<f32>,
    /// The SM count the split rule uses. None: the GPU's SMs, or the CPU's threads. Set it to
    /// a GPU's SM count to make the CPU backend split exactly as vLLM's Triton kernel does on
    /// that GPU.
    pub split_units: Option<usize>,
    /// A fixed split count for every decode instead of the device's rule (vLLM's Triton
    /// kernel takes one as an argument), at most 4096: for tuning and benchmarks, as the
    /// split count never changes which keys a row sees. None: the rule. Batch-invariant mode
    /// takes 1.
    pub num_kv_splits: Option<usize>,
    /// Single-token decodes of two or more requests on a GPU take the schedule the GPU
    /// computes from the lengths (docs/scheduler.md): every SM gets an even share of the
    /// batch's keys, so a batch of varied lengths (what serving runs) is about 1.2x faster
    /// than on the split grid (H200: 64 requests of up to 8192 keys, 16 and 128 heads); a
    /// batch of equal lengths pays up to 35% for the scheduler, the pieces and the merges (8
    /// requests x 4096 keys, 128 heads: 46.5 against 34.7 us). A batch of one request keeps
    /// the split grid, which already spreads it evenly. Ignored on the CPU, with a fixed
    /// split count and in batch-invariant mode.
    pub device_schedule: bool,
    /// The fp8-query mode (vLLM's quantized query input, FlashMLA's fp8 path): with an fp8
    /// cache, q is quantized to fp8 e4m3 with the per-tensor `q_scale` of each call
    /// ([`crate::DecodeInputs::q_scale`]), the scores are products of the codes, and P is
    /// rounded to e4m3 before `P V` (docs/contract.md, "The fp8-query mode"). Less exact than
    /// the default (a bf16 or f16 q against the decoded cache), by design: it is the numerics
    /// of fp8 tensor cores. Needs an fp8 cache.
    pub fp8_query: bool,
    /// Settings for benchmarks and tests (a forced kernel family, the schedule's costs, PDL);
    /// the defaults are what ships.
    pub tuning: Tuning,
}

/// Settings for benchmarks, tests and kernel work. The defaults are what ships; none of them
/// changes which keys a row sees, only which kernels run and how they are launched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tuning {
    /// The stage-1 kernel family (`mla bench --kernel`): the shipped choice, or one family
    /// forced wherever it can run (decodes it cannot take run the shipped choice; a plan says
    /// which family ran, [`crate::DecodePlan::kernel`]).
    pub kernel: KernelChoice,
    /// The device schedule's costs (docs/scheduler.md): a segment's fixed cost and a stretch's
    /// fewest blocks beyond it, each at most 64.
    pub schedule_costs: ScheduleCosts,
    /// Whether the kernels after a decode's first start as programmatic dependent launches on
    /// Hopper (the combine, and on the schedule the stage-1 kernel after the scheduler): they
    /// are then resident while the one before finishes.
    pub pdl: bool,
    /// The CPU backend's stage-1 kernel (`mla bench --cpu-kernel`): the fastest this CPU runs,
    /// or one path forced (an error naming `cpu_kernel` where this CPU or the dtypes cannot run
    /// it).
    pub cpu_kernel: CpuKernel,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            kernel: KernelChoice::Auto,
            schedule_costs: ScheduleCosts::default(),
            pdl: true,
            cpu_kernel: CpuKernel::Auto,
        }
    }
}

/// The device schedule's two costs (docs/scheduler.md), in key blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScheduleCosts {
    /// A segment's fixed cost.
    pub segment: usize,
    /// A stretch's fewest blocks beyond it.
    pub min_blocks: usize,
}

impl Default for ScheduleCosts {
    fn default() -> Self {
        ScheduleCosts::SHIPPED
    }
}

impl std::str::FromStr for ScheduleCosts {
    type Err = Error;

    /// `SEG,MIN`, each 0 to 64.
    fn from_str(s: &str) -> Result<Self> {
        let bad = || {
            Error::config(
                "schedule_costs",
                format!("expected SEG,MIN with each 0 to 64, got {s:?}"),
            )
        };
        let (seg, min) = s.split_once(',').ok_or_else(bad)?;
        let (segment, min_blocks) = (
            seg.trim().parse().map_err(|_| bad())?,
            min.trim().parse().map_err(|_| bad())?,
        );
        let costs = ScheduleCosts {
            segment,
            min_blocks,
        };
        costs.check().map_err(|_| bad())?;
        Ok(costs)
    }
}

impl ScheduleCosts {
    /// The costs as shipped: a segment costs 2 blocks beyond its own, and a stretch holds at
    /// least 3 blocks beyond one segment cost (a batch of one short request is not cut into
    /// pieces of one block).
    pub const SHIPPED: ScheduleCosts = ScheduleCosts {
        segment: 2,
        min_blocks: 3,
    };

    /// The most either cost may be (the range the schedule's tests cover).
    pub const MAX: usize = 64;

    fn check(&self) -> Result<()> {
        for (what, v) in [("segment", self.segment), ("min_blocks", self.min_blocks)] {
            if v > Self::MAX {
                return Err(Error::config(
                    "schedule_costs",
                    format!("{what}: expected at most {}, got {v}", Self::MAX),
                ));
            }
        }
        Ok(())
    }
}

impl MlaConfig {
    /// DeepSeek-V3 shapes (L = 512, R = 64), bf16 model, `auto` cache, no window.
    pub fn new(num_heads: usize, scale: f32) -> Self {
        MlaConfig {
            num_heads,
            scale,
            kv_lora_rank: 512,
            qk_rope_head_dim: 64,
            model_dtype: ModelDtype::Bf16,
            kv_cache_dtype: CacheDtype::Auto,
            sliding_window: None,
            batch_invariant: false,
            dcp_world_size: 1,
            attn_type: AttentionType::Decoder,
            alibi_slopes: None,
            logits_soft_cap: None,
            split_units: None,
            num_kv_splits: None,
            device_schedule: false,
            fp8_query: false,
            tuning: Tuning::default(),
        }
    }

    /// Checks the configuration against a device, in the seed's order (unsupported features,
    /// window with DCP, attention type, dtypes on the device), then our range checks.
    ///
    /// # Errors
    /// The seed's rejections ([`Error::UnsupportedFeature`], [`Error::SlidingWindowWithDcp`],
    /// [`Error::UnsupportedAttentionType`], [`Error::Fp8NeedsSm89`], [`Error::Bf16NeedsSm80`]),
    /// [`Error::CacheDtypeNotSupportedYet`] for `fp8_ds_mla`, and [`Error::InvalidConfig`].
    pub fn validate(&self, device: &DeviceInfo) -> Result<ValidConfig> {
        let alibi = self.alibi_slopes.as_ref().is_some_and(|a| !a.is_empty());
        let soft_cap = self.logits_soft_cap.is_some_and(|c| c != 0.0);
        if alibi || soft_cap {
            return Err(Error::UnsupportedFeature);
        }
        if self.dcp_world_size == 0 {
            return Err(Error::config(
                "dcp_world_size",
                "expected at least 1, got 0",
            ));
        }
        if self.sliding_window.is_some() && self.dcp_world_size > 1 {
            return Err(Error::SlidingWindowWithDcp);
        }
        if self.attn_type != AttentionType::Decoder {
            return Err(Error::UnsupportedAttentionType {
                attn_type: self.attn_type.name().into(),
            });
        }
        if let DeviceInfo::Cuda {
            name, capability, ..
        } = device
        {
            self.check_capability(name, *capability)?;
        }
        let kv_format = self.kv_cache_dtype.resolve(self.model_dtype)?;
        if self.fp8_query && !kv_format.is_fp8() {
            return Err(Error::config(
                "fp8_query",
                format!(
                    "the fp8-query mode needs an fp8 kv cache (fp8, fp8_e4m3 or fp8_e5m2), got {}{}",
                    self.kv_cache_dtype,
                    if self.kv_cache_dtype == CacheDtype::Auto {
                        format!(" (the model dtype, {})", self.model_dtype)
                    } else {
                        String::new()
                    }
                ),
            ));
        }
        self.check_ranges()?;
        let sm_count = self.split_units.unwrap_or(match device {
            DeviceInfo::Cpu { threads } => *threads,
            DeviceInfo::Cuda { sm_count, .. } => *sm_count,
        });
        Ok(ValidConfig {
            num_heads: self.num_heads,
            q_heads: self.num_heads * self.dcp_world_size,
            scale: self.scale,
            kv_lora_rank: self.kv_lora_rank,
            rope_dim: self.qk_rope_head_dim,
            model_dtype: self.model_dtype,
            cache_dtype: self.kv_cache_dtype,
            kv_format,
            sliding_window: self.sliding_window,
            batch_invariant: self.batch_invariant,
            dcp_world_size: self.dcp_world_size,
            sm_count,
            num_kv_splits: self.num_kv_splits,
            device_schedule: self.device_schedule,
            fp8_query: self.fp8_query,
            tuning: self.tuning,
        })
    }

    /// The seed's dtype-on-device checks (it makes them on CUDA only).
    fn check_capability(&self, device: &str, cap: Capability) -> Result<()> {
        if self.kv_cache_dtype.is_fp8() && cap.to_int() < 89 {
            return Err(Error::Fp8NeedsSm89 {
                device: device.into(),
                capability: cap,
                suggested: if cap.to_int() < 80 {
                    "float16"
                } else {
                    "bfloat16"
                },
            });
        }
        let cache_bf16 = self.kv_cache_dtype == CacheDtype::Bf16
            || (self.kv_cache_dtype == CacheDtype::Auto && self.model_dtype == ModelDtype::Bf16);
        if cache_bf16 && cap.to_int() < 80 {
            return Err(Error::Bf16NeedsSm80 {
                what: "KV cache",
                device: device.into(),
                capability: cap,
                suggestion: "--kv-cache-dtype float16",
            });
        }
        if self.model_dtype == ModelDtype::Bf16 && cap.to_int() < 80 {
            return Err(Error::Bf16NeedsSm80 {
                what: "query",
                device: device.into(),
                capability: cap,
                suggestion: "--dtype float16",
            });
        }
        Ok(())
    }

    fn check_ranges(&self) -> Result<()> {
        if self.num_heads == 0 {
            return Err(Error::config("num_heads", "expected at least 1, got 0"));
        }
        if self.kv_lora_rank == 0 {
            return Err(Error::config("kv_lora_rank", "expected at least 1, got 0"));
        }
        // The GPU kernels fold log2(e) into the scale and multiply the scores by it in f32.
        // Up to 1024 that product stays finite for every |q.k| < 2.3e35: f16 q and keys give
        // at most 576 x 65504^2 = 2.5e12, and bf16 values large enough to overflow overflow
        // q.k itself. Above it a finite problem could give inf scores and NaN rows.
        const MAX_SCALE: f32 = 1024.0;
        if !(self.scale.is_finite() && self.scale > 0.0 && self.scale <= MAX_SCALE) {
            return Err(Error::config(
                "scale",
                format!(
                    "expected a finite value in (0, {MAX_SCALE}], got {}",
                    self.scale
                ),
            ));
        }
        if self.sliding_window == Some(0) {
            return Err(Error::config(
                "sliding_window",
                "expected None or at least 1, got 0",
            ));
        }
        // Far above any MLA model; keeps every size product of the plan inside usize.
        const LIMIT: usize = 1 << 16;
        for (field, v) in [
            ("num_heads", self.num_heads),
            ("kv_lora_rank", self.kv_lora_rank),
            ("qk_rope_head_dim", self.qk_rope_head_dim),
            ("dcp_world_size", self.dcp_world_size),
            // The split rules multiply it (2 x SMs, CTAs an SM x SMs).
            ("split_units", self.split_units.unwrap_or(0)),
        ] {
            if v > LIMIT {
                return Err(Error::config(
                    field,
                    format!("expected at most {LIMIT}, got {v}"),
                ));
            }
        }
        if self.split_units == Some(0) {
            return Err(Error::config(
                "split_units",
                "expected None or at least 1, got 0",
            ));
        }
        match self.num_kv_splits {
            Some(n) if !(1..=MAX_FIXED_SPLITS).contains(&n) => {
                return Err(Error::config(
                    "num_kv_splits",
                    format!("expected None or 1 to {MAX_FIXED_SPLITS}, got {n}"),
                ));
            }
            Some(n) if n > 1 && self.batch_invariant => {
                return Err(Error::config(
                    "num_kv_splits",
                    format!("batch-invariant mode takes one split, got {n}"),
                ));
            }
            _ => {}
        }
        self.tuning.schedule_costs.check()?;
        if self.num_heads.checked_mul(self.dcp_world_size).is_none() {
            return Err(Error::config(
                "dcp_world_size",
                "num_heads * dcp_world_size overflows",
            ));
        }
        Ok(())
    }
}

/// A configuration that passed [`MlaConfig::validate`] for one device.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidConfig {
    /// Heads of this rank.
    pub num_heads: usize,
    /// Heads in q and o: `num_heads * dcp_world_size`.
    pub q_heads: usize,
    /// Softmax scale.
    pub scale: f32,
    /// L.
    pub kv_lora_rank: usize,
    /// R.
    pub rope_dim: usize,
    /// dtype of q and o.
    pub model_dtype: ModelDtype,
    /// The cache dtype as named.
    pub cache_dtype: CacheDtype,
    /// The cache's storage format.
    pub kv_format: KvFormat,
    /// Window, if any.
    pub sliding_window: Option<usize>,
    /// One split per row.
    pub batch_invariant: bool,
    /// DCP world size.
    pub dcp_world_size: usize,
    /// SMs (or CPU threads, or the `split_units` override) for the split rule.
    pub sm_count: usize,
    /// The fixed split count asked for ([`MlaConfig::num_kv_splits`]).
    pub num_kv_splits: Option<usize>,
    /// Whether the device-computed schedule was asked for ([`MlaConfig::device_schedule`]);
    /// whether a decoder takes it is its plan's decision.
    pub device_schedule: bool,
    /// The fp8-query mode ([`MlaConfig::fp8_query`]); the cache is fp8.
    pub fp8_query: bool,
    /// Settings for benchmarks and tests ([`MlaConfig::tuning`]).
    pub tuning: Tuning,
}

impl ValidConfig {
    /// Row width D = L + R.
    pub fn head_dim(&self) -> usize {
        self.kv_lora_rank + self.rope_dim
    }

    /// The longest span a row can attend to for a batch whose longest length is `max_seq`.
    pub fn span(&self, max_seq: usize) -> usize {
        self.sliding_window.map_or(max_seq, |w| max_seq.min(w))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(major: u32, minor: u32) -> DeviceInfo {
        DeviceInfo::Cuda {
            name: "Test GPU".into(),
            capability: Capability { major, minor },
            sm_count: 80,
            smem_per_block: 232_448,
        }
    }

    const CPU: DeviceInfo = DeviceInfo::Cpu { threads: 2 };

    fn cfg() -> MlaConfig {
        MlaConfig::new(16, 0.1)
    }

    #[test]
    fn alibi_and_soft_cap_are_rejected_with_the_seed_message() {
        let mut c = cfg();
        c.alibi_slopes = Some(vec![0.5]);
        let e = c.validate(&CPU).unwrap_err();
        assert_eq!(
            e.to_string(),
            "mla does not support one of the following: alibi_slopes, logits_soft_cap"
        );
        let mut c = cfg();
        c.logits_soft_cap = Some(30.0);
        assert!(matches!(c.validate(&CPU), Err(Error::UnsupportedFeature)));
        // Like the seed's `any(...)`: an empty list and a zero cap are falsy.
        let mut c = cfg();
        c.alibi_slopes = Some(vec![]);
        c.logits_soft_cap = Some(0.0);
        assert!(c.validate(&CPU).is_ok());
    }

    #[test]
    fn non_decoder_attention_is_rejected() {
        for t in [
            AttentionType::Encoder,
            AttentionType::EncoderOnly,
            AttentionType::EncoderDecoder,
        ] {
            let mut c = cfg();
            c.attn_type = t;
            let e = c.validate(&CPU).unwrap_err();
            assert!(matches!(e, Error::UnsupportedAttentionType { .. }));
            assert!(e.to_string().contains("are not implemented for mla"), "{e}");
        }
    }

    #[test]
    fn fp8_below_sm89_names_the_device_and_suggests_a_dtype() {
        let mut c = cfg();
        c.kv_cache_dtype = CacheDtype::Fp8E4m3;
        let e = c.validate(&gpu(8, 6)).unwrap_err();
        assert_eq!(
            e.to_string(),
            "FP8 KV cache is not supported by mla on Test GPU (compute capability 8.6); \
             native FP8 (fp8e4nv) requires SM89+. Re-run with --kv-cache-dtype bfloat16"
        );
        c.kv_cache_dtype = CacheDtype::Fp8E5m2;
        let e = c.validate(&gpu(7, 5)).unwrap_err();
        assert!(e.to_string().ends_with("--kv-cache-dtype float16"), "{e}");
        // fp8_ds_mla counts as fp8 for the capability check, as in the seed.
        c.kv_cache_dtype = CacheDtype::Fp8DsMla;
        assert!(matches!(
            c.validate(&gpu(8, 0)),
            Err(Error::Fp8NeedsSm89 { .. })
        ));
        c.kv_cache_dtype = CacheDtype::Fp8E4m3;
        assert!(c.validate(&gpu(8, 9)).is_ok());
        assert!(c.validate(&gpu(9, 0)).is_ok());
        assert!(c.validate(&CPU).is_ok());
    }

    #[test]
    fn bf16_below_sm80_suggests_float16() {
        let mut c = cfg();
        c.kv_cache_dtype = CacheDtype::Bf16;
        c.model_dtype = ModelDtype::F16;
        let e = c.validate(&gpu(7, 5)).unwrap_err();
        assert_eq!(
            e.to_string(),
            "bfloat16 KV cache is not supported by mla on Test GPU (compute capability 7.5); \
             bfloat16 requires SM80+. Re-run with --kv-cache-dtype float16"
        );
        // auto with a bf16 model is a bf16 cache.
        let c = cfg();
        assert!(matches!(
            c.validate(&gpu(7, 0)),
            Err(Error::Bf16NeedsSm80 {
                what: "KV cache",
                ..
            })
        ));
        // an f16 cache with a bf16 query still needs bf16 math.
        let mut c = cfg();
        c.kv_cache_dtype = CacheDtype::F16;
        assert!(matches!(
            c.validate(&gpu(7, 5)),
            Err(Error::Bf16NeedsSm80 { what: "query", .. })
        ));
        c.model_dtype = ModelDtype::F16;
        assert!(c.validate(&gpu(7, 5)).is_ok());
        assert!(cfg().validate(&gpu(8, 0)).is_ok());
    }

    #[test]
    fn sliding_window_with_dcp_is_rejected() {
        let mut c = cfg();
        c.sliding_window = Some(128);
        c.dcp_world_size = 2;
        let e = c.validate(&CPU).unwrap_err();
        assert_eq!(
            e.to_string(),
            "sliding-window mla does not support decode context parallelism"
        );
        c.dcp_world_size = 1;
        assert!(c.validate(&CPU).is_ok());
    }

    #[test]
    fn fp8_ds_mla_is_not_supported_yet() {
        let mut c = cfg();
        c.kv_cache_dtype = CacheDtype::Fp8DsMla;
        assert!(matches!(
            c.validate(&gpu(9, 0)),
            Err(Error::CacheDtypeNotSupportedYet { .. })
        ));
    }

    #[test]
    fn ranges_are_checked() {
        type Break = fn(&mut MlaConfig);
        let bad: [(&str, Break); 12] = [
            ("num_heads", |c| c.num_heads = 0),
            ("kv_lora_rank", |c| c.kv_lora_rank = 0),
            ("scale", |c| c.scale = f32::NAN),
            ("scale", |c| c.scale = -1.0),
            ("sliding_window", |c| c.sliding_window = Some(0)),
            ("dcp_world_size", |c| c.dcp_world_size = 0),
            ("split_units", |c| c.split_units = Some(0)),
            ("num_kv_splits", |c| c.num_kv_splits = Some(0)),
            ("num_kv_splits", |c| c.num_kv_splits = Some(4097)),
            ("num_kv_splits", |c| {
                c.num_kv_splits = Some(2);
                c.batch_invariant = true;
            }),
            ("num_heads", |c| c.num_heads = 1 << 17),
            ("kv_lora_rank", |c| c.kv_lora_rank = usize::MAX),
        ];
        for (field, f) in bad {
            let mut c = cfg();
            f(&mut c);
            match c.validate(&CPU) {
                Err(Error::InvalidConfig { field: got, .. }) => assert_eq!(got, field),
                other => panic!("{field}: expected InvalidConfig, got {other:?}"),
            }
        }
    }

    #[test]
    fn dcp_multiplies_the_query_heads() {
        let mut c = cfg();
        c.dcp_world_size = 4;
        let v = c.validate(&CPU).unwrap();
        assert_eq!(v.q_heads, 64);
        assert_eq!(v.head_dim(), 576);
    }

    #[test]
    fn schedule_costs_parse_within_bounds_only() {
        let costs = |seg, min| ScheduleCosts {
            segment: seg,
            min_blocks: min,
        };
        assert_eq!("1,2".parse::<ScheduleCosts>().unwrap(), costs(1, 2));
        assert_eq!(" 0 , 64 ".parse::<ScheduleCosts>().unwrap(), costs(0, 64));
        for bad in ["", "3", "65,1", "1,65", "-1,2", "a,b", "1,2,3"] {
            match bad.parse::<ScheduleCosts>() {
                Err(Error::InvalidConfig { field, .. }) => assert_eq!(field, "schedule_costs"),
                other => panic!("{bad:?}: {other:?}"),
            }
        }
        let mut c = cfg();
        c.tuning.schedule_costs = costs(65, 0);
        assert!(matches!(
            c.validate(&CPU),
            Err(Error::InvalidConfig {
                field: "schedule_costs",
                ..
            })
        ));
        assert_eq!(Tuning::default().schedule_costs, ScheduleCosts::SHIPPED);
        assert!(Tuning::default().pdl);
    }

    #[test]
    fn split_units_default_to_the_device_and_can_be_overridden() {
        assert_eq!(cfg().validate(&CPU).unwrap().sm_count, 2);
        assert_eq!(cfg().validate(&gpu(9, 0)).unwrap().sm_count, 80);
        let mut c = cfg();
        c.split_units = Some(132);
        assert_eq!(c.validate(&CPU).unwrap().sm_count, 132);
    }
}
