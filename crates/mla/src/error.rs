//! The one error type of the crate.
//!
//! Messages are lowercase without a final period and name the argument, what was expected and
//! what was given. Where vLLM's Triton MLA backend (the reference behaviour) has a message of
//! its own, ours keeps its words with `mla` in place of the class name, so that a vLLM user
//! recognises it.

use std::fmt;

/// Result of every fallible call of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A compute capability `major.minor` (8.0 for A100, 8.9 for L40S, 9.0 for H100/H200).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Capability {
    /// Major version.
    pub major: u32,
    /// Minor version.
    pub minor: u32,
}

impl Capability {
    /// `major * 10 + minor`, as vLLM's `to_int` (89 for sm_89).
    pub fn to_int(self) -> u32 {
        self.major * 10 + self.minor
    }
}

impl fmt::Display for Capability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// Everything that can go wrong, grouped by kind: configuration, inputs, workspace, backend.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    // ---- configuration (the seed's rejections and ours) ----
    /// ALiBi slopes or a logits soft cap were given.
    #[error("mla does not support one of the following: alibi_slopes, logits_soft_cap")]
    UnsupportedFeature,

    /// An attention type other than decoder self-attention.
    #[error(
        "encoder self-attention and encoder/decoder cross-attention are not implemented for mla (got attention type {attn_type})"
    )]
    UnsupportedAttentionType {
        /// The attention type asked for.
        attn_type: String,
    },

    /// A KV cache dtype name that vLLM does not define.
    #[error(
        "kv_cache_dtype: unknown name {name:?}; expected one of auto, bfloat16, float16, fp8, fp8_e4m3, fp8_e5m2, fp8_ds_mla"
    )]
    UnknownCacheDtype {
        /// The name given.
        name: String,
    },

    /// A KV cache dtype that vLLM defines but mla does not implement yet.
    #[error("kv_cache_dtype {name} is not supported by mla yet")]
    CacheDtypeNotSupportedYet {
        /// The name given.
        name: String,
    },

    /// A model (query) dtype name other than bf16/f16.
    #[error("model dtype: unknown name {name:?}; expected bfloat16 or float16")]
    UnknownModelDtype {
        /// The name given.
        name: String,
    },

    /// An fp8 cache on a GPU below SM89.
    #[error(
        "FP8 KV cache is not supported by mla on {device} (compute capability {capability}); native FP8 (fp8e4nv) requires SM89+. Re-run with --kv-cache-dtype {suggested}"
    )]
    Fp8NeedsSm89 {
        /// Device name.
        device: String,
        /// Its compute capability.
        capability: Capability,
        /// `bfloat16` on SM80+, else `float16`.
        suggested: &'static str,
    },

    /// bf16 (cache or query) on a GPU below SM80.
    #[error(
        "bfloat16 {what} is not supported by mla on {device} (compute capability {capability}); bfloat16 requires SM80+. Re-run with {suggestion}"
    )]
    Bf16NeedsSm80 {
        /// "KV cache" or "query".
        what: &'static str,
        /// Device name.
        device: String,
        /// Its compute capability.
        capability: Capability,
        /// What to run with instead.
        suggestion: &'static str,
    },

    /// A sliding window together with decode context parallelism.
    #[error("sliding-window mla does not support decode context parallelism")]
    SlidingWindowWithDcp,

    /// Causal multi-token rows together with decode context parallelism.
    #[error("causal multi-token decode is not supported with DCP")]
    CausalMultiTokenWithDcp,

    /// A configuration value out of its range.
    #[error("{field}: {reason}")]
    InvalidConfig {
        /// The field.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },

    // ---- inputs ----
    /// A tensor of the wrong element type.
    #[error("{arg}: expected dtype {expected}, got {got}")]
    Dtype {
        /// The argument.
        arg: &'static str,
        /// The dtype(s) accepted.
        expected: String,
        /// The dtype given.
        got: String,
    },

    /// A tensor of the wrong shape.
    #[error("{arg}: expected shape {expected}, got {got:?}")]
    Shape {
        /// The argument.
        arg: &'static str,
        /// The shape accepted, with names for free dimensions.
        expected: String,
        /// The shape given.
        got: Vec<usize>,
    },

    /// A tensor with strides the decode cannot use (a non-contiguous last dimension, overlap).
    #[error("{arg}: {reason} (strides {strides:?}, shape {shape:?})")]
    Stride {
        /// The argument.
        arg: &'static str,
        /// What is wrong.
        reason: String,
        /// Its strides, in elements.
        strides: Vec<usize>,
        /// Its shape.
        shape: Vec<usize>,
    },

    /// A host view that reaches past the end of its slice, or a slice of the wrong alignment.
    #[error("{arg}: {reason}")]
    Memory {
        /// The argument.
        arg: &'static str,
        /// What is wrong.
        reason: String,
    },

    /// A tensor on the wrong device for the backend.
    #[error("{arg}: expected a tensor on {expected}, got one on {got}")]
    WrongDevice {
        /// The argument.
        arg: &'static str,
        /// The device the backend runs on.
        expected: crate::tensor::Location,
        /// Where the tensor lives.
        got: crate::tensor::Location,
    },

    /// Query rows that are not a whole number of tokens per request (vLLM's message).
    #[error("non-uniform decode block: {rows} query rows over {requests} requests")]
    NonUniformDecode {
        /// Query rows.
        rows: usize,
        /// Requests (`seq_lens` entries).
        requests: usize,
    },

    /// `query_len` disagrees with rows / requests.
    #[error(
        "query_len: expected {expected} ({rows} query rows over {requests} requests), got {got}"
    )]
    QueryLen {
        /// rows / requests.
        expected: usize,
        /// The value given.
        got: usize,
        /// Query rows.
        rows: usize,
        /// Requests.
        requests: usize,
    },

    /// A negative sequence length.
    #[error("seq_lens[{request}]: expected a length >= 0, got {len}")]
    NegativeSeqLen {
        /// The request.
        request: usize,
        /// Its length.
        len: i32,
    },

    /// A sequence longer than its block table row can address.
    #[error(
        "seq_lens[{request}] = {len} exceeds the block table's capacity of {capacity} keys ({max_blocks} blocks of {page_size})"
    )]
    SeqLenBeyondBlockTable {
        /// The request.
        request: usize,
        /// Its length.
        len: usize,
        /// max_blocks * page_size.
        capacity: usize,
        /// Blocks a row of the table holds.
        max_blocks: usize,
        /// Keys a block holds.
        page_size: usize,
    },

    /// A block id outside the cache; the key it would address is never read.
    #[error(
        "block_table[{request}][{block_index}] = {block_id} is outside the kv cache's {num_blocks} blocks"
    )]
    BlockIdOutOfRange {
        /// The request.
        request: usize,
        /// The entry of its block table row.
        block_index: usize,
        /// The id found there.
        block_id: i32,
        /// Blocks in the cache.
        num_blocks: usize,
    },

    /// A k_scale that is not a finite positive number.
    #[error("k_scale: expected a finite value > 0, got {0}")]
    KScale(f32),

    /// A q_scale (the fp8-query mode's) that is not a finite positive number.
    #[error("q_scale: expected a finite value > 0, got {0}")]
    QScale(f32),

    /// The cache dtype given to warmup differs from the configured one.
    #[error("kv_cache_dtype: the decoder was configured for {configured}, got {got}")]
    CacheDtypeMismatch {
        /// The configured cache dtype.
        configured: String,
        /// The one given.
        got: String,
    },

    // ---- workspace ----
    /// A decode needs more scratch than the locked workspace holds (vLLM's wording).
    #[error(
        "workspace is locked but this decode requires {:.2} MB, current size is {:.2} MB; reserve the worst case with reserve_workspace before lock_workspace",
        *required as f64 / 1048576.0,
        *current as f64 / 1048576.0
    )]
    WorkspaceLocked {
        /// Bytes the decode needs.
        required: usize,
        /// Bytes the workspace holds.
        current: usize,
    },

    /// An operation that needs `reserve_workspace` first.
    #[error("{0} needs max_model_len: call reserve_workspace first")]
    NotReserved(&'static str),

    /// A size that does not fit in memory arithmetic.
    #[error("{what}: size overflows ({detail})")]
    Overflow {
        /// What was being sized.
        what: &'static str,
        /// The numbers involved.
        detail: String,
    },

    /// An allocation the system refused.
    #[error("{what}: could not allocate {bytes} bytes")]
    Alloc {
        /// What was being allocated.
        what: &'static str,
        /// Its size.
        bytes: usize,
    },

    // ---- backends ----
    /// The CUDA backend was asked for in a build without the `cuda` feature.
    #[error(
        "mla was built without the `cuda` feature: rebuild with `--features cuda` to use a GPU"
    )]
    CudaNotCompiled,

    /// No usable CUDA device (no driver, no device, or the ordinal is out of range).
    #[error("no usable CUDA device: {0}")]
    NoCudaDevice(String),

    /// A CUDA driver call failed.
    #[cfg(feature = "cuda")]
    #[error("CUDA driver call failed ({op}): {source}")]
    Driver {
        /// What was being done.
        op: &'static str,
        /// The driver's error.
        #[source]
        source: cudarc::driver::DriverError,
    },

    /// An NCCL call failed (decode context parallelism), or NCCL cannot be used.
    #[error("NCCL call failed ({op}): {detail}")]
    Nccl {
        /// What was being done.
        op: &'static str,
        /// NCCL's error, or why NCCL is unusable.
        detail: String,
    },

    /// NVRTC could not compile a kernel; the log says why.
    #[error("could not compile {kernel}:\n{log}")]
    Compile {
        /// The kernel and its options.
        kernel: String,
        /// NVRTC's log.
        log: String,
    },

    /// The kernels found bad values in device-side inputs (reported by the next checked call,
    /// since a decode on the GPU never waits for the device).
    #[error("device-side check failed: {}", device_check_message(*bits))]
    DeviceCheck {
        /// `kernels/params.cuh`'s MLA_ERR_* bits.
        bits: u32,
    },
}

/// The bits of [`Error::DeviceCheck`] in words: `kernels/params.cuh`'s MLA_ERR_* (a test
/// reads that file to keep the two in step).
const DEVICE_CHECKS: [(&str, u32, &str); 4] = [
    ("MLA_ERR_NEGATIVE_LEN", 1, "a negative seq_len (read as 0)"),
    (
        "MLA_ERR_BEYOND_TABLE",
        2,
        "a seq_len beyond the block table's capacity (the keys past it were skipped)",
    ),
    (
        "MLA_ERR_BAD_BLOCK",
        4,
        "a block id outside the kv cache (its page was skipped, never read)",
    ),
    (
        "MLA_ERR_BAD_SCALE",
        8,
        "a k_scale or q_scale tensor not finite and positive (the outputs are unspecified)",
    ),
];

fn device_check_message(bits: u32) -> String {
    let parts: Vec<&str> = DEVICE_CHECKS
        .iter()
        .filter(|(_, bit, _)| bits & bit != 0)
        .map(|(_, _, words)| *words)
        .collect();
    if parts.is_empty() {
        return format!("unknown flags {bits:#x}");
    }
    parts.join("; ")
}

impl Error {
    /// The mapping of a failed driver call made while doing `op` to [`Error::Driver`], for
    /// `map_err` (the mla CLI and tests use it around their own cudarc calls too).
    #[cfg(feature = "cuda")]
    pub fn driver(op: &'static str) -> impl Fn(cudarc::driver::DriverError) -> Error {
        move |source| Error::Driver { op, source }
    }

    /// Shorthand for [`Error::InvalidConfig`].
    pub(crate) fn config(field: &'static str, reason: impl Into<String>) -> Self {
        Error::InvalidConfig {
            field,
            reason: reason.into(),
        }
    }

    /// Shorthand for [`Error::Memory`].
    pub(crate) fn memory(arg: &'static str, reason: impl Into<String>) -> Self {
        Error::Memory {
            arg,
            reason: reason.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_are_send_sync_and_static() {
        fn check<T: Send + Sync + 'static + std::error::Error>() {}
        check::<Error>();
    }

    #[test]
    fn locked_workspace_message_reports_megabytes() {
        let e = Error::WorkspaceLocked {
            required: 3 * 1048576,
            current: 1048576 / 2,
        };
        let s = e.to_string();
        assert!(s.starts_with("workspace is locked"), "{s}");
        assert!(
            s.contains("requires 3.00 MB, current size is 0.50 MB"),
            "{s}"
        );
    }

    #[test]
    fn device_check_bits_are_the_kernels() {
        let header = include_str!("../kernels/params.cuh");
        for (name, bit, _) in DEVICE_CHECKS {
            let line = header
                .lines()
                .find(|l| l.starts_with(&format!("#define {name} ")))
                .unwrap_or_else(|| panic!("{name} not in params.cuh"));
            let value = line.split_whitespace().nth(2).unwrap_or_default();
            assert_eq!(value, format!("{bit}u"), "{line}");
        }
    }

    #[test]
    fn device_check_names_each_flag() {
        let s = Error::DeviceCheck { bits: 5 }.to_string();
        assert!(
            s.contains("negative seq_len") && s.contains("block id outside"),
            "{s}"
        );
        assert!(!s.contains("capacity"), "{s}");
    }

    #[test]
    fn capability_formats_like_vllm() {
        let c = Capability { major: 8, minor: 6 };
        assert_eq!(c.to_string(), "8.6");
        assert_eq!(c.to_int(), 86);
    }
}
