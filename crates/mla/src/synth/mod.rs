//! Random decode problems, seeded and reproducible: what `mla bench` times and what the tests
//! check (`device`, with the `cuda` feature: the same problems on a GPU). The data follows the contract's accuracy setting: q ~ N(0, 1), cache values
//! ~ N(0, 0.5^2) (fp8 caches store value / k_scale), pages handed out in a random order.

#[cfg(feature = "cuda")]
pub mod device;

use float8::{F8E4M3, F8E5M2};
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{RngExt, SeedableRng};
use rand_distr::{Distribution, StandardNormal};
use rayon::prelude::*;

use crate::args::{DecodeInputs, DecodeOutputs, Query};
use crate::dtype::{DType, KvFormat, ModelDtype};
use crate::error::{Error, Result};
use crate::plan::Mask;
use crate::tensor::{TensorMut, TensorRef};

/// What to generate.
#[derive(Debug, Clone, PartialEq)]
pub struct ProblemSpec {
    /// Query heads (times the DCP world size).
    pub heads: usize,
    /// L.
    pub kv_lora_rank: usize,
    /// R.
    pub rope_dim: usize,
    /// Keys per page.
    pub page_size: usize,
    /// Each request's KV length (its new tokens included).
    pub seq_lens: Vec<usize>,
    /// New tokens per request.
    pub query_len: usize,
    /// Mask among them.
    pub mask: Mask,
    /// q and o dtype.
    pub model_dtype: ModelDtype,
    /// Cache format.
    pub kv_format: KvFormat,
    /// Scale of an fp8 cache (values are stored divided by it).
    pub k_scale: f32,
    /// Scale of the fp8-query mode's q (used only by a decoder in that mode): 1/64 puts the
    /// drawn q ~ N(0, 1) well inside e4m3's range (|q| / q_scale up to about 350 of 448),
    /// and a wrong scale shows.
    pub q_scale: f32,
    /// Extra elements after each key (token stride = D + pad).
    pub token_pad: usize,
    /// Extra elements after each page (a cross-layer cache).
    pub page_pad: usize,
    /// Blocks in the cache beyond those the requests use.
    pub spare_blocks: usize,
    /// Seed of every random draw.
    pub seed: u64,
}

impl ProblemSpec {
    /// DeepSeek-V3 shapes, bf16, page 64, contiguous cache, one token per request.
    pub fn new(heads: usize, seq_lens: Vec<usize>) -> Self {
        ProblemSpec {
            heads,
            kv_lora_rank: 512,
            rope_dim: 64,
            page_size: 64,
            seq_lens,
            query_len: 1,
            mask: Mask::Causal,
            model_dtype: ModelDtype::Bf16,
            kv_format: KvFormat::Bf16,
            k_scale: 1.0,
            q_scale: 1.0 / 64.0,
            token_pad: 0,
            page_pad: 0,
            spare_blocks: 7,
            seed: 0,
        }
    }

    /// Lengths as the benchmark draws them: all `ctx`, or (varlen) uniform in `[ctx/8, ctx]`.
    pub fn lengths(batch: usize, ctx: usize, varlen: bool, seed: u64) -> Vec<usize> {
        let mut rng = StdRng::seed_from_u64(seed ^ 0x9e37_79b9);
        (0..batch)
            .map(|_| {
                if varlen {
                    rng.random_range((ctx / 8).max(1).min(ctx)..=ctx)
                } else {
                    ctx
                }
            })
            .collect()
    }
}

/// `n` draws of N(0, sigma^2) converted by `f`, generated in parallel chunks, each chunk from
/// its own seed: the same values whatever the thread count (gigabyte caches in about a second).
/// Written in place: one allocation of the result, no per-chunk vectors to gather.
fn normals<T: Send + Copy + Default>(
    n: usize,
    sigma: f32,
    seed: u64,
    stream: u64,
    f: impl Fn(f32) -> T + Sync,
) -> Result<Vec<T>> {
    const CHUNK: usize = 1 << 16;
    let mut out = alloc(n)?;
    out.par_chunks_mut(CHUNK)
        .enumerate()
        .for_each(|(c, chunk)| {
            let key = seed
                ^ stream.wrapping_mul(0x9e37_79b9_7f4a_7c15)
                ^ (c as u64).wrapping_mul(0xd1b5_4a32_d192_ed03);
            let mut rng = StdRng::seed_from_u64(key);
            for v in chunk {
                let x: f32 = StandardNormal.sample(&mut rng);
                *v = f(x * sigma);
            }
        });
    Ok(out)
}

/// q, `[rows, H, D]` drawn from N(0, 1) in the model dtype.
fn draw_q(spec: &ProblemSpec) -> Result<HalfBuf> {
    let n = [
        spec.query_len,
        spec.heads,
        spec.kv_lora_rank + spec.rope_dim,
    ]
    .into_iter()
    .try_fold(spec.seq_lens.len(), usize::checked_mul)
    .ok_or_else(|| Error::Overflow {
        what: "problem",
        detail: format!(
            "{} requests of {} query tokens",
            spec.seq_lens.len(),
            spec.query_len
        ),
    })?;
    Ok(match spec.model_dtype {
        ModelDtype::Bf16 => HalfBuf::Bf16(normals(n, 1.0, spec.seed, 1, bf16::from_f32)?),
        ModelDtype::F16 => HalfBuf::F16(normals(n, 1.0, spec.seed, 1, f16::from_f32)?),
    })
}

/// `n` default values, or [`Error::Alloc`] where the memory is not there (instead of an
/// abort: a problem's size comes from its caller).
fn alloc<T: Copy + Default>(n: usize) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| Error::Alloc {
        what: "problem",
        bytes: n.saturating_mul(std::mem::size_of::<T>()),
    })?;
    v.resize(n, T::default());
    Ok(v)
}

/// Host storage in the model dtype (q, o), or of a 16-bit cache.
#[derive(Debug, Clone, PartialEq)]
pub enum HalfBuf {
    /// bf16 elements.
    Bf16(Vec<bf16>),
    /// f16 elements.
    F16(Vec<f16>),
}

impl HalfBuf {
    /// `values` rounded to `dtype`.
    pub fn new(dtype: ModelDtype, values: impl Iterator<Item = f32>) -> HalfBuf {
        match dtype {
            ModelDtype::Bf16 => HalfBuf::Bf16(values.map(bf16::from_f32).collect()),
            ModelDtype::F16 => HalfBuf::F16(values.map(f16::from_f32).collect()),
        }
    }

    /// A view from element `offset` with explicit strides.
    ///
    /// # Errors
    /// [`crate::Error::Memory`] if the view does not fit.
    pub fn view<const N: usize>(
        &self,
        offset: usize,
        shape: [usize; N],
        strides: [usize; N],
    ) -> Result<TensorRef<'_, N>> {
        match self {
            HalfBuf::Bf16(v) => {
                TensorRef::from_host(v.get(offset..).unwrap_or_default(), shape, strides)
            }
            HalfBuf::F16(v) => {
                TensorRef::from_host(v.get(offset..).unwrap_or_default(), shape, strides)
            }
        }
    }

    /// A row-major writable view.
    ///
    /// # Errors
    /// [`crate::Error::Memory`] if the buffer is shorter than the shape.
    pub fn view_mut<const N: usize>(&mut self, shape: [usize; N]) -> Result<TensorMut<'_, N>> {
        match self {
            HalfBuf::Bf16(v) => TensorMut::contiguous(v, shape),
            HalfBuf::F16(v) => TensorMut::contiguous(v, shape),
        }
    }

    /// The values as f32.
    pub fn to_f32(&self) -> Vec<f32> {
        match self {
            HalfBuf::Bf16(v) => v.to_f32_vec(),
            HalfBuf::F16(v) => v.to_f32_vec(),
        }
    }
}

/// Host storage of a cache.
#[derive(Debug, Clone, PartialEq)]
pub enum CacheBuf {
    /// A bf16 or f16 cache.
    Half(HalfBuf),
    /// fp8 elements stored as bytes, read as the given dtype.
    Fp8(Vec<u8>, DType),
}

impl CacheBuf {
    /// A view with explicit strides.
    ///
    /// # Errors
    /// [`crate::Error::Memory`] if the view does not fit.
    pub fn view<const N: usize>(
        &self,
        shape: [usize; N],
        strides: [usize; N],
    ) -> Result<TensorRef<'_, N>> {
        match self {
            CacheBuf::Half(h) => h.view(0, shape, strides),
            CacheBuf::Fp8(v, dt) => TensorRef::from_host(v, shape, strides)?.view_as(*dt),
        }
    }
}

/// A generated problem: the inputs, ready to view.
#[derive(Debug, Clone)]
pub struct Problem {
    /// What it was generated from.
    pub spec: ProblemSpec,
    /// `[rows, H, D]` packed query.
    pub q: HalfBuf,
    /// The paged cache, `[num_blocks, page_size, D]` with the spec's padding.
    pub kv: CacheBuf,
    /// Blocks in the cache.
    pub num_blocks: usize,
    /// `[requests, max_blocks]`.
    pub block_table: Vec<i32>,
    /// Entries per block-table row.
    pub max_blocks: usize,
    /// `[requests]`.
    pub seq_lens: Vec<i32>,
}

impl Problem {
    /// Draws a problem.
    ///
    /// # Errors
    /// [`crate::Error::InvalidConfig`] for a zero page size or query length,
    /// [`crate::Error::Overflow`] for sizes beyond `usize`.
    pub fn generate(spec: &ProblemSpec) -> Result<Problem> {
        if spec.page_size == 0 || spec.query_len == 0 {
            return Err(Error::config(
                "problem",
                "page_size and query_len must be at least 1",
            ));
        }
        let mut rng = StdRng::seed_from_u64(spec.seed);
        let requests = spec.seq_lens.len();
        let max_len = spec.seq_lens.iter().copied().max().unwrap_or(0);
        if i32::try_from(max_len).is_err() {
            return Err(Error::config(
                "problem",
                format!("length {max_len} does not fit in i32"),
            ));
        }
        let max_blocks = max_len.div_ceil(spec.page_size).max(1);
        let (_, page_stride) = spec.strides();
        let overflow = || Error::Overflow {
            what: "problem",
            detail: format!("{requests} requests of up to {max_len} keys"),
        };
        let num_blocks = requests
            .checked_mul(max_blocks)
            .and_then(|b| b.checked_add(spec.spare_blocks.max(1)))
            .ok_or_else(overflow)?;
        // Block ids are i32.
        i32::try_from(num_blocks).map_err(|_| overflow())?;
        let kv_len = num_blocks.checked_mul(page_stride).ok_or_else(overflow)?;

        let q = draw_q(spec)?;
        let sigma = 0.5 / spec.k_scale;
        let kv = match spec.kv_format {
            KvFormat::Bf16 => CacheBuf::Half(HalfBuf::Bf16(normals(
                kv_len,
                sigma,
                spec.seed,
                2,
                bf16::from_f32,
            )?)),
            KvFormat::F16 => CacheBuf::Half(HalfBuf::F16(normals(
                kv_len,
                sigma,
                spec.seed,
                2,
                f16::from_f32,
            )?)),
            KvFormat::Fp8E4m3 => CacheBuf::Fp8(
                normals(kv_len, sigma, spec.seed, 2, |x| {
                    F8E4M3::from_f32(x).to_bits()
                })?,
                DType::F8E4M3,
            ),
            KvFormat::Fp8E5m2 => CacheBuf::Fp8(
                normals(kv_len, sigma, spec.seed, 2, |x| {
                    F8E5M2::from_f32(x).to_bits()
                })?,
                DType::F8E5M2,
            ),
        };

        let mut perm: Vec<i32> = alloc(num_blocks)?;
        perm.iter_mut().zip(0..).for_each(|(b, i)| *b = i);
        perm.shuffle(&mut rng);
        let mut block_table = perm;
        block_table.truncate(requests * max_blocks);
        Ok(Problem {
            spec: spec.clone(),
            q,
            kv,
            num_blocks,
            block_table,
            max_blocks,
            seq_lens: spec.seq_lens.iter().map(|&l| l as i32).collect(),
        })
    }

    /// The same problem with another query length and mask: what [`Problem::generate`] gives
    /// for the spec with those two changed, without drawing the cache again (neither changes
    /// the cache or the block table; only q, drawn for the new rows).
    ///
    /// # Errors
    /// As [`Problem::generate`].
    pub fn with_queries(&self, query_len: usize, mask: Mask) -> Result<Problem> {
        if query_len == 0 {
            return Err(Error::config("problem", "query_len must be at least 1"));
        }
        let spec = ProblemSpec {
            query_len,
            mask,
            ..self.spec.clone()
        };
        Ok(Problem {
            q: draw_q(&spec)?,
            spec,
            kv: self.kv.clone(),
            num_blocks: self.num_blocks,
            block_table: self.block_table.clone(),
            max_blocks: self.max_blocks,
            seq_lens: self.seq_lens.clone(),
        })
    }

    /// Query rows.
    pub fn rows(&self) -> usize {
        self.spec.seq_lens.len() * self.spec.query_len
    }

    /// D = L + R.
    pub fn head_dim(&self) -> usize {
        self.spec.kv_lora_rank + self.spec.rope_dim
    }

    /// The packed query view.
    ///
    /// # Errors
    /// Never for a generated problem; kept fallible like every view.
    pub fn query(&self) -> Result<Query<'_>> {
        let (rows, h, d) = (self.rows(), self.spec.heads, self.head_dim());
        Ok(Query::Packed(self.q.view(
            0,
            [rows, h, d],
            [h * d, d, 1],
        )?))
    }

    /// The same query as two strided views into the packed buffer.
    ///
    /// # Errors
    /// As [`Problem::query`].
    pub fn query_split(&self) -> Result<Query<'_>> {
        let (rows, h, d, l) = (
            self.rows(),
            self.spec.heads,
            self.head_dim(),
            self.spec.kv_lora_rank,
        );
        let strides = [h * d, d, 1];
        Ok(Query::Split {
            nope: self.q.view(0, [rows, h, l], strides)?,
            rope: self.q.view(l, [rows, h, self.spec.rope_dim], strides)?,
        })
    }

    /// The decode inputs (packed query).
    ///
    /// # Errors
    /// As [`Problem::query`].
    pub fn inputs(&self) -> Result<DecodeInputs<'_>> {
        let (token_stride, page_stride) = self.spec.strides();
        let requests = self.seq_lens.len();
        Ok(DecodeInputs {
            q: self.query()?,
            kv_cache: self.kv.view(
                [self.num_blocks, self.spec.page_size, self.head_dim()],
                [page_stride, token_stride, 1],
            )?,
            block_table: TensorRef::contiguous(&self.block_table, [requests, self.max_blocks])?,
            seq_lens: TensorRef::contiguous(&self.seq_lens, [requests])?,
            query_len: self.spec.query_len,
            mask: self.spec.mask,
            k_scale: self.spec.k_scale,
            k_scale_tensor: None,
            q_scale: self.spec.q_scale,
            q_scale_tensor: None,
            max_seq_len: None,
        })
    }
}

/// Planted values: one element of q or of a key set by hand (a NaN, an outlier), after the
/// draw.
impl Problem {
    /// Sets element `col` of q's row `row`, head `head` to `value` (rounded to the model
    /// dtype).
    ///
    /// # Errors
    /// [`crate::Error::Memory`] when the element is outside q.
    pub fn set_q(&mut self, row: usize, head: usize, col: usize, value: f32) -> Result<()> {
        let (h, d) = (self.spec.heads, self.head_dim());
        if row >= self.rows() || head >= h || col >= d {
            return Err(Error::memory(
                "set_q",
                format!(
                    "element ({row}, {head}, {col}) is outside q [{}, {h}, {d}]",
                    self.rows()
                ),
            ));
        }
        let at = (row * h + head) * d + col;
        match &mut self.q {
            HalfBuf::Bf16(v) => v[at] = bf16::from_f32(value),
            HalfBuf::F16(v) => v[at] = f16::from_f32(value),
        }
        Ok(())
    }

    /// Sets element `col` of key `pos` of request `request` (in the page the block table
    /// maps it to) so that it decodes to about `value`: stored as `value / k_scale`, rounded
    /// to the cache format, as the drawn values are.
    ///
    /// # Errors
    /// [`crate::Error::Memory`] when the key is past the block table or `col` past a row.
    pub fn set_key(&mut self, request: usize, pos: usize, col: usize, value: f32) -> Result<()> {
        let ps = self.spec.page_size;
        let entry =
            (request < self.seq_lens.len() && pos / ps < self.max_blocks && col < self.head_dim())
                .then(|| self.block_table[request * self.max_blocks + pos / ps]);
        let block = entry.and_then(|b| usize::try_from(b).ok()).ok_or_else(|| {
            Error::memory(
                "set_key",
                format!("key {pos} of request {request}, element {col}, is outside the cache"),
            )
        })?;
        let (token_stride, page_stride) = self.spec.strides();
        let at = block * page_stride + (pos % ps) * token_stride + col;
        let stored = value / self.spec.k_scale;
        match &mut self.kv {
            CacheBuf::Half(HalfBuf::Bf16(v)) => v[at] = bf16::from_f32(stored),
            CacheBuf::Half(HalfBuf::F16(v)) => v[at] = f16::from_f32(stored),
            CacheBuf::Fp8(v, DType::F8E5M2) => v[at] = F8E5M2::from_f32(stored).to_bits(),
            CacheBuf::Fp8(v, _) => v[at] = F8E4M3::from_f32(stored).to_bits(),
        }
        Ok(())
    }
}

impl ProblemSpec {
    /// The same problem with a model dtype and a cache format; an fp8 cache gets k_scale 0.5
    /// (so that a wrong scale shows), a 16-bit one 1. What the tests and `mla bench` draw.
    pub fn with_format(mut self, model: ModelDtype, kv: KvFormat) -> Self {
        self.model_dtype = model;
        self.kv_format = kv;
        self.k_scale = if kv.is_fp8() { 0.5 } else { 1.0 };
        self
    }

    /// (token stride, page stride) of the cache, in elements.
    pub fn strides(&self) -> (usize, usize) {
        let token = self.kv_lora_rank + self.rope_dim + self.token_pad;
        (token, self.page_size * token + self.page_pad)
    }
}

/// Dense host outputs of a problem, poisoned with NaN so that a row left unwritten shows.
#[derive(Debug, Clone)]
pub struct Outputs {
    /// `[rows, H, L]` in the model dtype.
    pub o: HalfBuf,
    /// `[rows, H]`.
    pub lse: Vec<f32>,
    shape: [usize; 3],
}

impl Outputs {
    /// NaN-filled outputs for a problem.
    pub fn poisoned(p: &Problem) -> Outputs {
        let shape = [p.rows(), p.spec.heads, p.spec.kv_lora_rank];
        Outputs::poisoned_shape(p.spec.model_dtype, shape)
    }

    /// NaN-filled outputs of `[rows, heads, L]` (o in `dtype`) and `[rows, heads]`.
    pub fn poisoned_shape(dtype: ModelDtype, shape: [usize; 3]) -> Outputs {
        let n = shape.iter().product::<usize>();
        Outputs {
            o: HalfBuf::new(dtype, (0..n).map(|_| f32::NAN)),
            lse: vec![f32::NAN; shape[0] * shape[1]],
            shape,
        }
    }

    /// Writable views.
    ///
    /// # Errors
    /// Never for outputs made by [`Outputs::poisoned`]; kept fallible like every view.
    pub fn views(&mut self) -> Result<DecodeOutputs<'_>> {
        let [rows, h, _] = self.shape;
        Ok(DecodeOutputs {
            o: self.o.view_mut(self.shape)?,
            lse: TensorMut::contiguous(&mut self.lse, [rows, h])?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_problem_too_large_for_memory_is_an_error_not_an_abort() {
        // 8 requests of 2^30 keys: a cache of about 10 TB.
        let e = Problem::generate(&ProblemSpec::new(8, vec![1 << 30; 8])).unwrap_err();
        assert!(
            matches!(
                e,
                Error::Alloc {
                    what: "problem",
                    ..
                }
            ),
            "{e}"
        );
        // More blocks than i32 block ids can name.
        let mut spec = ProblemSpec::new(1, vec![i32::MAX as usize; 2]);
        spec.page_size = 1;
        let e = Problem::generate(&spec).unwrap_err();
        assert!(matches!(e, Error::Overflow { .. }), "{e}");
    }

    #[test]
    fn with_queries_is_the_problem_generate_draws() {
        let mut spec = ProblemSpec::new(3, vec![70, 0, 129]);
        spec.page_size = 16;
        spec.kv_format = KvFormat::Fp8E4m3;
        spec.seed = 5;
        let one = Problem::generate(&spec).unwrap();
        for (query_len, mask) in [(3, Mask::NonCausal), (1, Mask::Causal), (4, Mask::Causal)] {
            let want = Problem::generate(&ProblemSpec {
                query_len,
                mask,
                ..spec.clone()
            })
            .unwrap();
            let got = one.with_queries(query_len, mask).unwrap();
            assert_eq!(got.spec, want.spec);
            assert_eq!(got.q, want.q);
            assert_eq!(got.kv, want.kv);
            assert_eq!(
                (
                    got.num_blocks,
                    &got.block_table,
                    got.max_blocks,
                    &got.seq_lens
                ),
                (
                    want.num_blocks,
                    &want.block_table,
                    want.max_blocks,
                    &want.seq_lens
                )
            );
        }
        assert!(one.with_queries(0, Mask::Causal).is_err());
    }
}
