//! `mla_rs.MlaDecode`: the Rust decoder on torch tensors, torch's current stream and
//! PyTorch's CUDA context (the device's primary context).

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use mla::cudarc::driver::sys::CUstream;
use mla::{
    CacheDtype, DecodeInputs, DecodeOutputs, Device, DeviceInfo, Mask, MlaConfig, MlaDecode,
    ModelDtype, Query, TensorRef,
};

use crate::errors::to_py;
use crate::torch::{self, CudaTensor};

fn value_error(msg: impl Into<String>) -> PyErr {
    PyValueError::new_err(msg.into())
}

/// A dtype given as a string or a torch dtype: "bfloat16", "torch.float16", torch.bfloat16.
fn model_dtype(dtype: &Bound<'_, PyAny>) -> PyResult<ModelDtype> {
    let name = dtype.str()?.to_string();
    name.trim_start_matches("torch.").parse().map_err(to_py)
}

/// MLA decode over a paged latent KV cache, on the tensors' CUDA device.
#[pyclass(name = "MlaDecode", module = "mla_rs")]
pub struct PyMlaDecode {
    config: MlaConfig,
    inner: Option<MlaDecode>,
}

impl PyMlaDecode {
    /// The decoder on `device` (created on first use; torch's current device when None).
    fn decoder(&mut self, py: Python<'_>, device: Option<usize>) -> PyResult<&mut MlaDecode> {
        let dec = match self.inner.take() {
            Some(dec) => dec,
            None => {
                let device = match device {
                    Some(d) => d,
                    None => match torch::torch(py) {
                        Ok(t) => t
                            .getattr("cuda")?
                            .call_method0("current_device")?
                            .extract()?,
                        Err(_) => 0,
                    },
                };
                MlaDecode::new(&self.config, Device::Cuda(device)).map_err(to_py)?
            }
        };
        let dec = self.inner.insert(dec);
        if let (Some(d), mla::Location::Cuda(have)) = (device, dec.location())
            && d != have
        {
            return Err(value_error(format!(
                "the tensors are on cuda:{d}, but this decoder was set up on cuda:{have}"
            )));
        }
        Ok(dec)
    }
}

#[pymethods]
impl PyMlaDecode {
    /// A decoder for `num_heads` query heads (times `dcp_world_size`) with softmax `scale`.
    /// `kv_cache_dtype` takes vLLM's names; `dtype` is the model (query) dtype;
    /// `device_schedule` puts single-token decodes on the schedule the GPU computes from the
    /// lengths (faster when they vary, see MlaConfig::device_schedule); `fp8_query` (an fp8
    /// cache) quantizes q to e4m3 with the `q_scale` of each forward (MlaConfig::fp8_query).
    #[new]
    #[pyo3(signature = (
        num_heads, scale, kv_cache_dtype = "auto", kv_lora_rank = 512, qk_rope_head_dim = 64,
        sliding_window = None, batch_invariant = false, dtype = None, dcp_world_size = 1,
        device_schedule = false, fp8_query = false
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        num_heads: usize,
        scale: f32,
        kv_cache_dtype: &str,
        kv_lora_rank: usize,
        qk_rope_head_dim: usize,
        sliding_window: Option<usize>,
        batch_invariant: bool,
        dtype: Option<&Bound<'_, PyAny>>,
        dcp_world_size: usize,
        device_schedule: bool,
        fp8_query: bool,
    ) -> PyResult<Self> {
        let mut config = MlaConfig::new(num_heads, scale);
        config.kv_cache_dtype = kv_cache_dtype.parse::<CacheDtype>().map_err(to_py)?;
        config.kv_lora_rank = kv_lora_rank;
        config.qk_rope_head_dim = qk_rope_head_dim;
        config.sliding_window = sliding_window;
        config.batch_invariant = batch_invariant;
        config.dcp_world_size = dcp_world_size;
        config.device_schedule = device_schedule;
        config.fp8_query = fp8_query;
        if let Some(d) = dtype {
            config.model_dtype = model_dtype(d)?;
        }
        // Everything that does not depend on the device is checked now.
        config
            .validate(&DeviceInfo::Cpu { threads: 1 })
            .map_err(to_py)?;
        Ok(PyMlaDecode {
            config,
            inner: None,
        })
    }

    /// Reserves the scratch for the worst case: `max_rows` query rows (sequences x tokens)
    /// over `max_model_len` keys. Then `lock_workspace()`.
    fn reserve_workspace(
        &mut self,
        py: Python<'_>,
        max_rows: usize,
        max_model_len: usize,
    ) -> PyResult<()> {
        self.decoder(py, None)?
            .reserve_workspace(max_rows, max_model_len)
            .map_err(to_py)
    }

    /// From now on a call that would need more scratch is an error, never an allocation.
    fn lock_workspace(&mut self, py: Python<'_>) -> PyResult<()> {
        self.decoder(py, None)?.lock_workspace();
        Ok(())
    }

    /// Compiles (or reads from the disk cache) and loads every kernel a forward with this
    /// cache can pick. Returns the split counts covered.
    fn register_decode_warmup(
        &mut self,
        py: Python<'_>,
        kv_cache: &Bound<'_, PyAny>,
        kv_cache_dtype: &str,
    ) -> PyResult<Vec<usize>> {
        let kv = CudaTensor::of(kv_cache, "kv_cache")?;
        let dtype = kv_cache_dtype.parse::<CacheDtype>().map_err(to_py)?;
        let view = kv.view::<3>("kv_cache")?;
        let dec = self.decoder(py, Some(kv.device))?;
        py.detach(|| dec.register_decode_warmup(&view, dtype))
            .map_err(to_py)
    }

    /// Decodes. Returns `(o, lse)`: `o` `[rows, H, kv_lora_rank]` in q's dtype, `lse`
    /// `[rows, H]` float32 (natural log). With `out` and `lse_out` given it allocates nothing
    /// and can be captured in `torch.cuda.graph` (after `reserve_workspace`). `k_scale` (an fp8
    /// cache) and `q_scale` (the fp8-query mode) are floats or one-element float32 tensors.
    #[pyo3(signature = (
        q, kv_cache, block_table, seq_lens, *, k_scale = None, q_scale = None, query_len = 1,
        causal = true, out = None, lse_out = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn forward<'py>(
        &mut self,
        py: Python<'py>,
        q: &Bound<'py, PyAny>,
        kv_cache: &Bound<'py, PyAny>,
        block_table: &Bound<'py, PyAny>,
        seq_lens: &Bound<'py, PyAny>,
        k_scale: Option<&Bound<'py, PyAny>>,
        q_scale: Option<&Bound<'py, PyAny>>,
        query_len: usize,
        causal: bool,
        out: Option<Bound<'py, PyAny>>,
        lse_out: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        // q: one tensor, or (q_nope, q_pe); `first` gives the device, rows and dtype.
        let (query, first, q0) = match q.cast::<PyTuple>() {
            Ok(parts) if parts.len() == 2 => {
                let (nope_t, rope_t) = (parts.get_item(0)?, parts.get_item(1)?);
                let nope = CudaTensor::of(&nope_t, "q_nope")?;
                let query = Query::Split {
                    nope: nope.view("q_nope")?,
                    rope: CudaTensor::of(&rope_t, "q_pe")?.view("q_pe")?,
                };
                (query, nope_t, nope)
            }
            Ok(_) => return Err(value_error("q: expected a tensor or a (q_nope, q_pe) pair")),
            Err(_) => {
                let t = CudaTensor::of(q, "q")?;
                (Query::Packed(t.view("q")?), q.clone(), t)
            }
        };
        let device = q0.device;
        let (rows, heads, l) = (
            q0.shape.first().copied().unwrap_or(0),
            self.config.num_heads * self.config.dcp_world_size,
            self.config.kv_lora_rank,
        );

        let mut inputs = DecodeInputs::new(
            query,
            CudaTensor::of(kv_cache, "kv_cache")?.view("kv_cache")?,
            CudaTensor::of(block_table, "block_table")?.view("block_table")?,
            CudaTensor::of(seq_lens, "seq_lens")?.view("seq_lens")?,
        );
        inputs.query_len = query_len;
        inputs.mask = if causal {
            Mask::Causal
        } else {
            Mask::NonCausal
        };
        scale_arg(
            k_scale,
            "k_scale",
            &mut inputs.k_scale,
            &mut inputs.k_scale_tensor,
        )?;
        scale_arg(
            q_scale,
            "q_scale",
            &mut inputs.q_scale,
            &mut inputs.q_scale_tensor,
        )?;

        // Outputs: the caller's (nothing looked up: the graph-capture path), or new torch
        // tensors on q's device (o in q's dtype).
        let out = match out {
            Some(o) => o,
            None => {
                let (dtype, on) = (first.getattr("dtype")?, first.getattr("device")?);
                torch::empty(py, &[rows, heads, l], &dtype, &on)?
            }
        };
        let lse_out = match lse_out {
            Some(o) => o,
            None => {
                let f32 = torch::torch(py)?.getattr("float32")?;
                torch::empty(py, &[rows, heads], &f32, &first.getattr("device")?)?
            }
        };
        let mut outputs = DecodeOutputs {
            o: CudaTensor::of(&out, "out")?.view_mut("out")?,
            lse: CudaTensor::of(&lse_out, "lse_out")?.view_mut("lse_out")?,
        };

        // Without a reservation the first call reads the longest length (one host sync) and
        // reserves for it; reserve_workspace first to capture forward in a graph.
        let dec = self.decoder(py, Some(device))?;
        if dec.reserved_model_len().is_none() {
            let longest: usize = if rows == 0 {
                0
            } else {
                seq_lens
                    .call_method0("max")?
                    .call_method0("item")?
                    .extract::<i64>()?
                    .max(0) as usize
            };
            dec.reserve_workspace(rows, longest).map_err(to_py)?;
            inputs.max_seq_len = Some(longest);
        }

        let stream = torch::current_stream(py, device)?;
        let current = dec.cuda_stream().map(|s| s.cu_stream() as u64);
        if current != Some(stream) {
            let ctx = dec
                .cuda_context()
                .ok_or_else(|| value_error("not a GPU decoder"))?
                .clone();
            // SAFETY: the handle is torch's live current stream on this device (its primary
            // context, which is also ours); torch keeps it alive while it is current, and we
            // replace it at the next call where another stream is current.
            #[allow(unsafe_code)]
            let wrapped = unsafe { ctx.wrap_borrowed_stream(stream as CUstream) };
            dec.set_cuda_stream(wrapped).map_err(to_py)?;
        }
        dec.forward(&inputs, &mut outputs).map_err(to_py)?;
        PyTuple::new(py, [out, lse_out])
    }

    /// Waits for the stream and reports what the kernels flagged (bad block ids, lengths
    /// beyond the block table, negative lengths) since the last check, as a RuntimeError.
    fn check_device_errors(&mut self) -> PyResult<()> {
        match self.inner.as_mut() {
            Some(dec) => dec.check_device_errors().map_err(to_py),
            None => Ok(()),
        }
    }

    /// Bytes of scratch the decoder holds.
    #[getter]
    fn workspace_bytes(&self) -> usize {
        self.inner.as_ref().map_or(0, |d| d.workspace_bytes())
    }

    fn __repr__(&self) -> String {
        let c = &self.config;
        format!(
            "MlaDecode(num_heads={}, kv_cache_dtype={:?}, fp8_query={}, kv_lora_rank={}, qk_rope_head_dim={}, dtype={:?}, device={})",
            c.num_heads,
            c.kv_cache_dtype.name(),
            if c.fp8_query { "True" } else { "False" },
            c.kv_lora_rank,
            c.qk_rope_head_dim,
            c.model_dtype.name(),
            self.inner
                .as_ref()
                .map_or("not yet chosen".to_string(), |d| d.location().to_string()),
        )
    }
}

/// A per-tensor scale argument (`k_scale`, `q_scale`) into its value or its tensor. A tensor
/// stays on the device (read by the kernels, so a captured graph sees a new value); anything
/// else must be a number. Tensors first: a one-element tensor would also convert to a float,
/// through a host synchronization.
fn scale_arg(
    arg: Option<&Bound<'_, PyAny>>,
    name: &'static str,
    value: &mut f32,
    tensor: &mut Option<TensorRef<'static, 1>>,
) -> PyResult<()> {
    match arg {
        None => {}
        Some(k) if k.hasattr("data_ptr")? => {
            *tensor = Some(CudaTensor::of(k, name)?.view(name)?);
        }
        Some(k) => {
            *value = k.extract::<f32>().map_err(|_| {
                value_error(format!(
                    "{name}: expected a float or a one-element float32 tensor"
                ))
            })?;
        }
    }
    Ok(())
}
