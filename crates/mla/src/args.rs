//! The arguments of a decode call: what the caller hands to [`crate::MlaDecode::forward`].
//!
//! Shapes use the contract's names: `rows = requests * query_len`, `H` query heads (times the
//! DCP world size), `L` = kv_lora_rank, `R` = rope dim, `D = L + R`.

use crate::tensor::{TensorMut, TensorRef};

/// How the Q tokens of a request see each other (it matters only when Q > 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mask {
    /// Token t sees the prefix and block tokens 0..=t (speculative-decoding verify).
    #[default]
    Causal,
    /// Every token of the block sees the whole sequence (a draft block).
    NonCausal,
}

/// The query, whole or in its two parts (reading two pointers saves the caller a concat).
#[derive(Debug, Clone, Copy)]
pub enum Query<'a> {
    /// `[rows, H, D]`: latent part then rotary part.
    Packed(TensorRef<'a, 3>),
    /// `[rows, H, L]` and `[rows, H, R]`.
    Split {
        /// The latent ("nope") part.
        nope: TensorRef<'a, 3>,
        /// The rotary part.
        rope: TensorRef<'a, 3>,
    },
}

impl<'a> Query<'a> {
    /// Query rows.
    pub fn rows(&self) -> usize {
        match self {
            Query::Packed(q) => q.shape()[0],
            Query::Split { nope, .. } => nope.shape()[0],
        }
    }
}

/// What a decode reads.
#[derive(Debug, Clone, Copy)]
pub struct DecodeInputs<'a> {
    /// The query, in the model dtype.
    pub q: Query<'a>,
    /// `[num_blocks, page_size, D]` in the cache dtype; page and token strides are free
    /// (a cross-layer cache), the last dimension is contiguous.
    pub kv_cache: TensorRef<'a, 3>,
    /// `[requests, max_blocks]` i32: the pages of each request, in order.
    pub block_table: TensorRef<'a, 2>,
    /// `[requests]` i32: each request's KV length, its new query tokens included.
    pub seq_lens: TensorRef<'a, 1>,
    /// New tokens per request (Q); rows must be `requests * query_len`.
    pub query_len: usize,
    /// How the Q tokens of a request see each other.
    pub mask: Mask,
    /// Per-tensor scale of an fp8 cache (K and V alike); ignored for 16-bit caches.
    pub k_scale: f32,
    /// The same scale as a one-element f32 tensor, read where the decode runs (on the GPU, at
    /// run time, so a captured graph sees a new scale). When given it replaces `k_scale`.
    pub k_scale_tensor: Option<TensorRef<'a, 1>>,
    /// Per-tensor scale of the fp8-query mode ([`crate::MlaConfig::fp8_query`]): q is
    /// quantized as `e4m3(q / q_scale)`, vLLM's `_q_scale`; ignored otherwise. 1 suits a q of
    /// magnitudes up to a few hundred; `max |q| / 448` uses e4m3's whole range.
    pub q_scale: f32,
    /// The same scale as a one-element f32 tensor, read where the decode runs, as
    /// `k_scale_tensor`. When given it replaces `q_scale`.
    pub q_scale_tensor: Option<TensorRef<'a, 1>>,
    /// The batch's longest `seq_len`, used only to pick the split count (vLLM's
    /// `max_seq_len`). None: read from `seq_lens` when they are on the host.
    pub max_seq_len: Option<usize>,
}

impl<'a> DecodeInputs<'a> {
    /// Inputs of a single-token decode (Q = 1) with k_scale and q_scale 1.
    pub fn new(
        q: Query<'a>,
        kv_cache: TensorRef<'a, 3>,
        block_table: TensorRef<'a, 2>,
        seq_lens: TensorRef<'a, 1>,
    ) -> Self {
        DecodeInputs {
            q,
            kv_cache,
            block_table,
            seq_lens,
            query_len: 1,
            mask: Mask::Causal,
            k_scale: 1.0,
            k_scale_tensor: None,
            q_scale: 1.0,
            q_scale_tensor: None,
            max_seq_len: None,
        }
    }

    /// The fp8 scale when it is known on the host: `k_scale`, or the host tensor's value.
    /// None for a scale tensor in device memory (or an unreadable one).
    pub fn host_k_scale(&self) -> Option<f32> {
        host_scale(self.k_scale, self.k_scale_tensor.as_ref())
    }

    /// The fp8-query mode's scale when it is known on the host, as [`Self::host_k_scale`].
    pub fn host_q_scale(&self) -> Option<f32> {
        host_scale(self.q_scale, self.q_scale_tensor.as_ref())
    }
}

/// A per-tensor scale given as a value or a one-element tensor: its value if on the host.
pub(crate) fn host_scale(value: f32, tensor: Option<&TensorRef<'_, 1>>) -> Option<f32> {
    match tensor {
        None => Some(value),
        Some(t) => t.host_slice::<f32>().and_then(|v| v.first().copied()),
    }
}

/// What a decode writes.
#[derive(Debug)]
pub struct DecodeOutputs<'a> {
    /// `[rows, H, L]` in the model dtype.
    pub o: TensorMut<'a, 3>,
    /// `[rows, H]` f32: natural-log sum of exp(scale * q.k) over the row's keys; -inf for a
    /// row with no key.
    pub lse: TensorMut<'a, 2>,
}
