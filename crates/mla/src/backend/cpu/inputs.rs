//! The CPU backend's view of a decode's inputs: typed host slices, and the value checks a GPU
//! does on the device (lengths within the block table, block ids within the cache), made here
//! before anything is computed, so a bad batch leaves the outputs untouched.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::args::{DecodeInputs, Query};
use crate::dtype::{KvDecoder, round_e4m3};
use crate::error::{Error, Result};
use crate::plan::{DecodePlan, KeyRange};
use crate::tensor::TensorRef;

/// A host slice of 16-bit floats in the model dtype.
#[derive(Clone, Copy)]
pub enum Halfs<'a> {
    Bf16(&'a [bf16]),
    F16(&'a [f16]),
}

impl<'a> Halfs<'a> {
    fn of(t: &TensorRef<'a, 3>, arg: &'static str) -> Result<Self> {
        let typed = match t.dtype() {
            crate::DType::BF16 => t.host_slice::<bf16>().map(Halfs::Bf16),
            crate::DType::F16 => t.host_slice::<f16>().map(Halfs::F16),
            _ => None,
        };
        typed.ok_or_else(|| Error::memory(arg, "expected an aligned host bf16/f16 tensor"))
    }

    /// Elements `[offset, offset + dst.len())` as f32.
    pub fn read(&self, offset: usize, dst: &mut [f32]) {
        let end = offset + dst.len();
        match self {
            Halfs::Bf16(s) => s[offset..end].convert_to_f32_slice(dst),
            Halfs::F16(s) => s[offset..end].convert_to_f32_slice(dst),
        }
    }
}

/// Typed, value-checked host inputs of one decode.
pub struct HostInputs<'a> {
    nope: Halfs<'a>,
    rope: Halfs<'a>,
    /// Offset of the rotary part inside a q row (L for a packed q, 0 for a split one).
    rope_offset: usize,
    kv: &'a [u8],
    kv_elem: usize,
    pub block_table: &'a [i32],
    pub seq_lens: &'a [i32],
    pub decoder: KvDecoder,
    /// The fp8-query mode's q_scale: q is read as its e4m3 codes `round_e4m3(q / q_scale)`.
    q_scale: Option<f32>,
}

impl<'a> HostInputs<'a> {
    /// Typed views of the inputs, after checking every length and every block id the decode
    /// will read.
    ///
    /// # Errors
    /// [`Error::BlockIdOutOfRange`].
    pub fn new(plan: &DecodePlan, inputs: &DecodeInputs<'a>) -> Result<Self> {
        let (nope, rope, rope_offset) = match &inputs.q {
            Query::Packed(q) => {
                let h = Halfs::of(q, "q")?;
                (h, h, plan.kv_lora_rank)
            }
            Query::Split { nope, rope } => {
                (Halfs::of(nope, "q_nope")?, Halfs::of(rope, "q_pe")?, 0)
            }
        };
        let host = |arg| Error::memory(arg, "expected a host tensor");
        let this = HostInputs {
            nope,
            rope,
            rope_offset,
            kv: inputs
                .kv_cache
                .host_bytes()
                .ok_or_else(|| host("kv_cache"))?,
            kv_elem: plan.kv_format.size(),
            block_table: inputs
                .block_table
                .host_slice()
                .ok_or_else(|| host("block_table"))?,
            seq_lens: inputs
                .seq_lens
                .host_slice()
                .ok_or_else(|| host("seq_lens"))?,
            // The fp8-query mode multiplies the raw codes; k_scale goes on the scores and
            // the output (split.rs), as on the GPU.
            decoder: plan.kv_format.decoder(
                plan.model_dtype,
                if plan.fp8_query { 1.0 } else { plan.k_scale },
            ),
            q_scale: plan.fp8_query.then_some(plan.q_scale),
        };
        this.check_values(plan)?;
        Ok(this)
    }

    /// Request `i`'s length (checked non-negative in [`HostInputs::new`]).
    pub fn seq_len(&self, request: usize) -> usize {
        self.seq_lens[request] as usize
    }

    /// The keys row `row` sees.
    pub fn row_keys(&self, plan: &DecodePlan, row: usize) -> KeyRange {
        plan.row_keys(row, self.seq_len(row / plan.query_len))
    }

    /// The block ids the rows read. The lengths were checked by the plan (host lengths: not
    /// negative, within the block table).
    fn check_values(&self, plan: &DecodePlan) -> Result<()> {
        let ps = plan.kv.page_size;
        for request in 0..plan.requests {
            // The pages this request's rows read: from the earliest start to the latest end.
            let rows = request * plan.query_len..(request + 1) * plan.query_len;
            let (start, end) = rows
                .map(|r| self.row_keys(plan, r))
                .filter(|k| !k.is_empty())
                .fold((usize::MAX, 0), |(s, e), k| (s.min(k.start), e.max(k.end)));
            if start >= end {
                continue;
            }
            for block_index in start / ps..end.div_ceil(ps) {
                let block_id = self.block_table[request * plan.block_table_stride + block_index];
                if usize::try_from(block_id).map_or(true, |b| b >= plan.kv.num_blocks) {
                    return Err(Error::BlockIdOutOfRange {
                        request,
                        block_index,
                        block_id,
                        num_blocks: plan.kv.num_blocks,
                    });
                }
            }
        }
        Ok(())
    }

    /// q of `row`, head `head` as the f32 values the products use (`dst` holds D = L + R
    /// values): as given, or in the fp8-query mode its e4m3 codes.
    pub fn load_q(&self, plan: &DecodePlan, row: usize, head: usize, dst: &mut [f32]) {
        let l = plan.kv_lora_rank;
        let [nr, nh] = plan.q.nope_strides;
        let [rr, rh] = plan.q.rope_strides;
        let (dst_nope, dst_rope) = dst.split_at_mut(l);
        self.nope.read(row * nr + head * nh, dst_nope);
        self.rope
            .read(row * rr + head * rh + self.rope_offset, dst_rope);
        if let Some(q_scale) = self.q_scale {
            dst.iter_mut().for_each(|x| *x = round_e4m3(*x / q_scale));
        }
    }

    /// The cache bytes of the first `values` values of key `pos` of `request`. The page was
    /// checked in range by [`HostInputs::new`].
    pub fn key_bytes(
        &self,
        plan: &DecodePlan,
        request: usize,
        pos: usize,
        values: usize,
    ) -> &'a [u8] {
        let ps = plan.kv.page_size;
        let block = self.block_table[request * plan.block_table_stride + pos / ps] as usize;
        let elem = block * plan.kv.page_stride + (pos % ps) * plan.kv.token_stride;
        let off = elem * self.kv_elem;
        &self.kv[off..off + values * self.kv_elem]
    }

    /// Key `pos` of `request` as the values the products use (`dst` holds D values).
    pub fn load_key(&self, plan: &DecodePlan, request: usize, pos: usize, dst: &mut [f32]) {
        self.decoder
            .decode(self.key_bytes(plan, request, pos, dst.len()), dst);
    }
}
