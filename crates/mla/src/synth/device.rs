//! Problems and outputs on a CUDA device, for tests and `mla bench`: uploads on the decoder's
//! stream, device views shaped like the host ones, NaN-poisoned outputs, downloads. Also the
//! model-dtype device buffer (`DeviceHalf`) that decode context parallelism allocates.

use std::sync::Arc;

use half::slice::HalfFloatSliceExt;

use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr};
use half::{bf16, f16};

use super::{CacheBuf, HalfBuf, Problem};
use crate::args::{DecodeInputs, DecodeOutputs, Query};
use crate::dtype::{DType, ModelDtype};
use crate::error::{Error, Result};
use crate::tensor::{TensorMut, TensorRef, contiguous_strides};

fn upload<T: DeviceRepr>(s: &Arc<CudaStream>, v: &[T]) -> Result<CudaSlice<T>> {
    s.clone_htod(v).map_err(Error::driver("copy to the device"))
}

/// 16-bit values on the device.
#[derive(Debug)]
pub enum DeviceHalf {
    /// bf16.
    Bf16(CudaSlice<bf16>),
    /// f16.
    F16(CudaSlice<f16>),
}

impl DeviceHalf {
    /// A copy of host values.
    ///
    /// # Errors
    /// [`Error::Driver`].
    pub fn upload(s: &Arc<CudaStream>, h: &HalfBuf) -> Result<DeviceHalf> {
        Ok(match h {
            HalfBuf::Bf16(v) => DeviceHalf::Bf16(upload(s, v)?),
            HalfBuf::F16(v) => DeviceHalf::F16(upload(s, v)?),
        })
    }

    /// `n` zeros (at least one element, so that the address is valid), ordered on `s`.
    ///
    /// # Errors
    /// [`Error::Driver`] (`what`: the allocation's purpose).
    pub fn zeros(
        s: &Arc<CudaStream>,
        dtype: ModelDtype,
        n: usize,
        what: &'static str,
    ) -> Result<DeviceHalf> {
        let d = Error::driver(what);
        Ok(match dtype {
            ModelDtype::Bf16 => DeviceHalf::Bf16(s.alloc_zeros(n.max(1)).map_err(d)?),
            ModelDtype::F16 => DeviceHalf::F16(s.alloc_zeros(n.max(1)).map_err(d)?),
        })
    }

    /// A row-major writable view of its first `shape` elements.
    ///
    /// # Errors
    /// [`Error::Memory`] if the buffer is shorter than the shape.
    pub fn view_mut<const N: usize>(&mut self, shape: [usize; N]) -> Result<TensorMut<'_, N>> {
        let strides = contiguous_strides(shape);
        match self {
            DeviceHalf::Bf16(v) => TensorMut::from_cuda(v, shape, strides),
            DeviceHalf::F16(v) => TensorMut::from_cuda(v, shape, strides),
        }
    }

    /// All of it as one flat view, to take sub-views of.
    ///
    /// # Errors
    /// Never for a live slice; kept fallible like every view.
    pub fn flat(&self) -> Result<TensorRef<'_, 1>> {
        match self {
            DeviceHalf::Bf16(v) => TensorRef::from_cuda(v, [v.len()], [1]),
            DeviceHalf::F16(v) => TensorRef::from_cuda(v, [v.len()], [1]),
        }
    }

    /// The values as f32 (waits for the stream).
    ///
    /// # Errors
    /// [`Error::Driver`].
    pub fn download(&self, s: &Arc<CudaStream>) -> Result<Vec<f32>> {
        let d = Error::driver("copy to the host");
        Ok(match self {
            DeviceHalf::Bf16(v) => s.clone_dtoh(v).map_err(d)?.to_f32_vec(),
            DeviceHalf::F16(v) => s.clone_dtoh(v).map_err(d)?.to_f32_vec(),
        })
    }
}

/// A cache on the device.
#[derive(Debug)]
pub enum DeviceCache {
    /// bf16 or f16.
    Half(DeviceHalf),
    /// fp8 bytes, read as the dtype.
    Fp8(CudaSlice<u8>, DType),
}

/// A problem's inputs on the device.
#[derive(Debug)]
pub struct DeviceProblem {
    /// `[rows, H, D]` packed query.
    pub q: DeviceHalf,
    /// The paged cache.
    pub kv: DeviceCache,
    /// `[requests, max_blocks]`.
    pub block_table: CudaSlice<i32>,
    /// `[requests]`.
    pub seq_lens: CudaSlice<i32>,
}

impl Problem {
    /// A copy of the problem's inputs on the device, ordered on `s`.
    ///
    /// # Errors
    /// [`Error::Driver`].
    pub fn to_device(&self, s: &Arc<CudaStream>) -> Result<DeviceProblem> {
        Ok(DeviceProblem {
            q: DeviceHalf::upload(s, &self.q)?,
            kv: match &self.kv {
                CacheBuf::Half(h) => DeviceCache::Half(DeviceHalf::upload(s, h)?),
                CacheBuf::Fp8(b, dt) => DeviceCache::Fp8(upload(s, b)?, *dt),
            },
            block_table: upload(s, &self.block_table)?,
            seq_lens: upload(s, &self.seq_lens)?,
        })
    }
}

impl DeviceProblem {
    /// Device views shaped like `p.inputs()` (of the problem this was uploaded from); with
    /// `split_q` the query as two strided parts.
    ///
    /// # Errors
    /// [`Error::Memory`] if `p` is not the problem this was made from.
    pub fn inputs<'a>(&'a self, p: &Problem, split_q: bool) -> Result<DecodeInputs<'a>> {
        let host = p.inputs()?;
        let (rows, h, d, l) = (p.rows(), p.spec.heads, p.head_dim(), p.spec.kv_lora_rank);
        let qs = [h * d, d, 1];
        let flat_q = self.q.flat()?;
        let q = if split_q {
            Query::Split {
                nope: flat_q.sub_view(0, [rows, h, l], qs)?,
                rope: flat_q.sub_view(l, [rows, h, p.spec.rope_dim], qs)?,
            }
        } else {
            Query::Packed(flat_q.sub_view(0, [rows, h, d], qs)?)
        };
        let (shape, strides) = (host.kv_cache.shape(), host.kv_cache.strides());
        let kv_cache = match &self.kv {
            DeviceCache::Half(x) => x.flat()?.sub_view(0, shape, strides)?,
            DeviceCache::Fp8(b, dt) => TensorRef::from_cuda(b, shape, strides)?.view_as(*dt)?,
        };
        Ok(DecodeInputs {
            q,
            kv_cache,
            block_table: TensorRef::from_cuda(
                &self.block_table,
                host.block_table.shape(),
                host.block_table.strides(),
            )?,
            seq_lens: TensorRef::from_cuda(&self.seq_lens, host.seq_lens.shape(), [1])?,
            query_len: host.query_len,
            mask: host.mask,
            k_scale: host.k_scale,
            k_scale_tensor: None,
            q_scale: host.q_scale,
            q_scale_tensor: None,
            // The host knows the lengths, as vLLM's metadata does: the split count follows them.
            max_seq_len: p.seq_lens.iter().map(|&l| l.max(0) as usize).max(),
        })
    }
}

/// Dense outputs on the device, poisoned with NaN.
#[derive(Debug)]
pub struct DeviceOutputs {
    /// `[rows, H, L]` in the model dtype.
    pub o: DeviceHalf,
    /// `[rows, H]`.
    pub lse: CudaSlice<f32>,
    shape: [usize; 3],
}

impl DeviceOutputs {
    /// NaN-filled outputs for a problem.
    ///
    /// # Errors
    /// [`Error::Driver`].
    pub fn poisoned(s: &Arc<CudaStream>, p: &Problem) -> Result<DeviceOutputs> {
        Self::with_shape(
            s,
            p.spec.model_dtype,
            [p.rows(), p.spec.heads, p.spec.kv_lora_rank],
        )
    }

    /// NaN-filled `[rows, H, L]` outputs of a model dtype.
    ///
    /// # Errors
    /// [`Error::Driver`].
    pub fn with_shape(
        s: &Arc<CudaStream>,
        dtype: ModelDtype,
        shape: [usize; 3],
    ) -> Result<DeviceOutputs> {
        let n: usize = shape.iter().product();
        Ok(DeviceOutputs {
            o: DeviceHalf::upload(s, &HalfBuf::new(dtype, (0..n).map(|_| f32::NAN)))?,
            lse: upload(s, &vec![f32::NAN; shape[0] * shape[1]])?,
            shape,
        })
    }

    /// Writes NaN over both outputs again, in place (a captured graph keeps their addresses).
    ///
    /// # Errors
    /// [`Error::Driver`].
    pub fn poison(&mut self, s: &Arc<CudaStream>) -> Result<()> {
        let n = self.shape.iter().product::<usize>();
        let d = Error::driver("copy to the device");
        match &mut self.o {
            DeviceHalf::Bf16(v) => s.memcpy_htod(&vec![bf16::NAN; n], v).map_err(&d)?,
            DeviceHalf::F16(v) => s.memcpy_htod(&vec![f16::NAN; n], v).map_err(&d)?,
        }
        s.memcpy_htod(
            &vec![f32::NAN; self.shape[0] * self.shape[1]],
            &mut self.lse,
        )
        .map_err(d)
    }

    /// Writable views.
    ///
    /// # Errors
    /// Never for outputs made here; kept fallible like every view.
    pub fn views(&mut self) -> Result<DecodeOutputs<'_>> {
        let [rows, h, _] = self.shape;
        Ok(DecodeOutputs {
            o: self.o.view_mut(self.shape)?,
            lse: TensorMut::from_cuda(&mut self.lse, [rows, h], [h, 1])?,
        })
    }

    /// o and lse as f32 (waits for the stream).
    ///
    /// # Errors
    /// [`Error::Driver`].
    pub fn download(&self, s: &Arc<CudaStream>) -> Result<(Vec<f32>, Vec<f32>)> {
        let lse = s
            .clone_dtoh(&self.lse)
            .map_err(Error::driver("copy to the host"))?;
        Ok((self.o.download(s)?, lse))
    }
}
