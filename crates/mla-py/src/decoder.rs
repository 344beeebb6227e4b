//! `mla_rs.MlaDecode`: the Rust decoder on torch tensors: CUDA tensors on torch's current
//! stream and PyTorch's CUDA context (the device's primary context), CPU tensors on the CPU
//! backend.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use mla::cudarc::driver::sys::CUstream;
use mla::{
    CacheDtype, DType, DecodeInputs, DecodeOutputs, Device, DeviceInfo, Location, Mask, MlaConfig,
    MlaDecode, ModelDtype, Query, TensorRef,
};

use crate::errors::{to_py, torch_device};
use crate::torch::{self, TorchTensor};

fn value_error(msg: impl Into<String>) -> PyErr {
    PyValueError::new_err(msg.into())
}

/// A count argument taken as a Python int of any sign, so that a negative one is a ValueError
/// naming the argument (not pyo3's nameless OverflowError).
fn count(name: &str, value: i64) -> PyResult<usize> {
    usize::try_from(value)
        .map_err(|_| value_error(format!("{name}: expected a value >= 0, got {value}")))
}

/// A dtype given as a string or a torch dtype: "bfloat16", "torch.float16", torch.bfloat16.
fn model_dtype(dtype: &Bound<'_, PyAny>) -> PyResult<ModelDtype> {
    let name = dtype.str()?.to_string();
    name.trim_start_matches("torch.").parse().map_err(to_py)
}

/// Where a decoder runs, as the constructor's `device` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Placement {
    /// None: where the first tensors are (torch's current CUDA device before any tensor).
    FirstTensors,
    /// "cpu": the CPU backend.
    Cpu,
    /// "cuda": torch's current CUDA device (or the first tensors' CUDA device).
    CurrentCuda,
    /// "cuda:N".
    Cuda(usize),
}

impl Placement {
    /// A device argument: None, "cpu", "cuda", "cuda:N" or a torch.device.
    fn of(device: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        let Some(d) = device else {
            return Ok(Placement::FirstTensors);
        };
        let name = d.str()?.to_string();
        Ok(match name.as_str() {
            "cpu" => Placement::Cpu,
            "cuda" => Placement::CurrentCuda,
            other => match other.strip_prefix("cuda:").and_then(|i| i.parse().ok()) {
                Some(i) => Placement::Cuda(i),
                None => {
                    return Err(value_error(format!(
                        "device: expected \"cpu\", \"cuda\" or \"cuda:N\", got {name:?}"
                    )));
                }
            },
        })
    }
}

/// MLA decode over a paged latent KV cache, on the tensors' CUDA device or the CPU backend.
#[pyclass(name = "MlaDecode", module = "mla_rs")]
pub struct PyMlaDecode {
    config: MlaConfig,
    placement: Placement,
    inner: Option<MlaDecode>,
}

impl PyMlaDecode {
    /// torch's current CUDA device; 0 where torch or a driver is missing, so that opening it
    /// reports mla's own "no usable CUDA device" rather than torch's message.
    fn torch_cuda_device(py: Python<'_>) -> PyResult<usize> {
        let Ok(t) = torch::torch(py) else {
            return Ok(0);
        };
        let cuda = t.getattr("cuda")?;
        if !cuda.call_method0("is_available")?.extract::<bool>()? {
            return Ok(0);
        }
        cuda.call_method0("current_device")?.extract()
    }

    /// The cache as the configured cache dtype reads it: vLLM hands any fp8 cache viewed as
    /// e4m3 (or stored as uint8) whatever its dtype string, so a 1-byte cache of an fp8
    /// configuration is read as bytes in the configured format (e5m2 included).
    fn cache_view(&self, kv: &TorchTensor) -> PyResult<TensorRef<'static, 3>> {
        let view = kv.view::<3>("kv_cache")?;
        if self.config.kv_cache_dtype.is_fp8() && kv.dtype.size() == 1 {
            return view.view_as(DType::U8).map_err(to_py);
        }
        Ok(view)
    }

    /// The decoder at `at` (the location of the call's first tensor, the argument `arg`),
    /// created on first use: at the device given to the constructor, else at `at`, else on
    /// torch's current CUDA device. A tensor elsewhere than the decoder is an error naming `arg`.
    fn decoder(
        &mut self,
        py: Python<'_>,
        at: Option<(Location, &'static str)>,
    ) -> PyResult<&mut MlaDecode> {
        let (at, arg) = (at.map(|(l, _)| l), at.map_or("tensors", |(_, a)| a));
        let dec = match self.inner.take() {
            Some(dec) => dec,
            None => {
                let device = match (self.placement, at) {
                    (Placement::Cpu, _) | (Placement::FirstTensors, Some(Location::Host)) => {
                        Device::Cpu
                    }
                    (Placement::Cuda(i), _) => Device::Cuda(i),
                    (_, Some(Location::Cuda(i))) => Device::Cuda(i),
                    _ => Device::Cuda(Self::torch_cuda_device(py)?),
                };
                MlaDecode::new(&self.config, device).map_err(to_py)?
            }
        };
        let dec = self.inner.insert(dec);
        if let Some(at) = at
            && at != dec.location()
        {
            return Err(value_error(format!(
                "{arg}: expected a tensor on {} (where this decoder runs), got one on {}",
                torch_device(dec.location()),
                torch_device(at)
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
    /// cache) quantizes q to e4m3 with the `q_scale` of each forward (MlaConfig::fp8_query);
    /// `device` ("cpu", "cuda", "cuda:N"; None: the first tensors' device) says where it runs.
    #[new]
    #[pyo3(signature = (
        num_heads, scale, kv_cache_dtype = "auto", kv_lora_rank = 512, qk_rope_head_dim = 64,
        sliding_window = None, batch_invariant = false, dtype = None, dcp_world_size = 1,
        device_schedule = false, fp8_query = false, device = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        num_heads: i64,
        scale: f32,
        kv_cache_dtype: &str,
        kv_lora_rank: i64,
        qk_rope_head_dim: i64,
        sliding_window: Option<i64>,
        batch_invariant: bool,
        dtype: Option<&Bound<'_, PyAny>>,
        dcp_world_size: i64,
        device_schedule: bool,
        fp8_query: bool,
        device: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let mut config = MlaConfig::new(count("num_heads", num_heads)?, scale);
        config.kv_cache_dtype = kv_cache_dtype.parse::<CacheDtype>().map_err(to_py)?;
        config.kv_lora_rank = count("kv_lora_rank", kv_lora_rank)?;
        config.qk_rope_head_dim = count("qk_rope_head_dim", qk_rope_head_dim)?;
        config.sliding_window = sliding_window
            .map(|w| count("sliding_window", w))
            .transpose()?;
        config.batch_invariant = batch_invariant;
        config.dcp_world_size = count("dcp_world_size", dcp_world_size)?;
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
            placement: Placement::of(device)?,
            inner: None,
        })
    }

    /// Reserves the scratch for the worst case: `max_rows` query rows (sequences x tokens)
    /// over `max_model_len` keys. Then `lock_workspace()`.
    fn reserve_workspace(
        &mut self,
        py: Python<'_>,
        max_rows: i64,
        max_model_len: i64,
    ) -> PyResult<()> {
        let (rows, len) = (
            count("max_rows", max_rows)?,
            count("max_model_len", max_model_len)?,
        );
        self.decoder(py, None)?
            .reserve_workspace(rows, len)
            .map_err(to_py)
    }

    /// The longest `max_model_len` reserved for so far (None before any reservation).
    #[getter]
    fn reserved_model_len(&self) -> Option<usize> {
        self.inner.as_ref().and_then(|d| d.reserved_model_len())
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
        let kv = TorchTensor::of(kv_cache, "kv_cache")?;
        let dtype = kv_cache_dtype.parse::<CacheDtype>().map_err(to_py)?;
        let view = self.cache_view(&kv)?;
        let dec = self.decoder(py, Some((kv.location, "kv_cache")))?;
        py.detach(|| dec.register_decode_warmup(&view, dtype))
            .map_err(to_py)
    }

    /// Decodes. Returns `(o, lse)`: `o` `[rows, H, kv_lora_rank]` in q's dtype, `lse`
    /// `[rows, H]` float32 (natural log). CUDA tensors run on their device, CPU tensors on the
    /// CPU backend. With `out` and `lse_out` given it allocates nothing and can be captured in
    /// `torch.cuda.graph` (after `reserve_workspace`, or with `max_seq_len`). `k_scale` (an fp8
    /// cache) and `q_scale` (the fp8-query mode) are floats or one-element float32 tensors.
    /// `max_seq_len` (the batch's longest length, or an upper bound such as vLLM's
    /// `max_seq_len`) picks the split count; without it and without a reservation, the first
    /// CUDA call reads the longest length from `seq_lens` (one host synchronization).
    #[pyo3(signature = (
        q, kv_cache, block_table, seq_lens, *, k_scale = None, q_scale = None, query_len = 1,
        causal = true, out = None, lse_out = None, max_seq_len = None
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
        query_len: i64,
        causal: bool,
        out: Option<Bound<'py, PyAny>>,
        lse_out: Option<Bound<'py, PyAny>>,
        max_seq_len: Option<i64>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let query_len = count("query_len", query_len)?;
        let max_seq_len = max_seq_len.map(|m| count("max_seq_len", m)).transpose()?;
        // Every tensor of the call, described once: the views below borrow their memory, and
        // host outputs must not overlap anything else.
        let mut inputs_seen: Vec<TorchTensor> = Vec::with_capacity(7);
        // q: one tensor, or (q_nope, q_pe); `first` gives the device, rows and dtype.
        let (query, first, q0, first_arg) = match q.cast::<PyTuple>() {
            Ok(parts) if parts.len() == 2 => {
                let (nope_t, rope_t) = (parts.get_item(0)?, parts.get_item(1)?);
                let nope = TorchTensor::of(&nope_t, "q_nope")?;
                let rope = TorchTensor::of(&rope_t, "q_pe")?;
                let query = Query::Split {
                    nope: nope.view("q_nope")?,
                    rope: rope.view("q_pe")?,
                };
                inputs_seen.push(rope);
                (query, nope_t, nope, "q_nope")
            }
            Ok(_) => return Err(value_error("q: expected a tensor or a (q_nope, q_pe) pair")),
            Err(_) => {
                let t = TorchTensor::of(q, "q")?;
                (Query::Packed(t.view("q")?), q.clone(), t, "q")
            }
        };
        let at = q0.location;
        let rows = q0.shape.first().copied().unwrap_or(0);
        let (heads, l) = (
            self.config.num_heads * self.config.dcp_world_size,
            self.config.kv_lora_rank,
        );
        inputs_seen.push(q0);

        let kv = TorchTensor::of(kv_cache, "kv_cache")?;
        let table = TorchTensor::of(block_table, "block_table")?;
        let lens = TorchTensor::of(seq_lens, "seq_lens")?;
        let mut inputs = DecodeInputs::new(
            query,
            self.cache_view(&kv)?,
            table.view("block_table")?,
            lens.view("seq_lens")?,
        );
        inputs_seen.extend([kv, table, lens]);
        inputs.query_len = query_len;
        inputs.mask = if causal {
            Mask::Causal
        } else {
            Mask::NonCausal
        };
        inputs.max_seq_len = max_seq_len;
        scale_arg(
            k_scale,
            "k_scale",
            &mut inputs.k_scale,
            &mut inputs.k_scale_tensor,
            &mut inputs_seen,
        )?;
        scale_arg(
            q_scale,
            "q_scale",
            &mut inputs.q_scale,
            &mut inputs.q_scale_tensor,
            &mut inputs_seen,
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
        let (o_t, lse_t) = (
            TorchTensor::of(&out, "out")?,
            TorchTensor::of(&lse_out, "lse_out")?,
        );
        check_no_overlap(&o_t, "out", &inputs_seen)?;
        check_no_overlap(&lse_t, "lse_out", &inputs_seen)?;
        check_no_overlap(&lse_t, "lse_out", std::slice::from_ref(&o_t))?;
        let mut outputs = DecodeOutputs {
            o: o_t.view_mut("out")?,
            lse: lse_t.view_mut("lse_out")?,
        };

        let dec = self.decoder(py, Some((at, first_arg)))?;
        if dec.reserved_model_len().is_none() {
            match (max_seq_len, at) {
                // The caller's bound sizes the scratch: no read of the lengths.
                (Some(longest), _) => dec.reserve_workspace(rows, longest).map_err(to_py)?,
                // Without a reservation the first CUDA call reads the longest length (one host
                // sync) and reserves for it; reserve_workspace first to capture forward in a
                // graph. Host lengths are read by the plan itself.
                (None, Location::Cuda(_)) => {
                    let longest = if rows == 0 {
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
                (None, Location::Host) => {}
            }
        }

        if let Location::Cuda(device) = at {
            let stream = torch::current_stream(py, device)?;
            let current = dec.cuda_stream().map(|s| s.cu_stream() as u64);
            if current != Some(stream) {
                let ctx = dec
                    .cuda_context()
                    .ok_or_else(|| value_error("not a GPU decoder"))?
                    .clone();
                // SAFETY: the handle is torch's live current stream on this device (its
                // primary context, which is also ours); torch keeps it alive while it is
                // current, and we replace it at the next call where another stream is current.
                #[allow(unsafe_code)]
                let wrapped = unsafe { ctx.wrap_borrowed_stream(stream as CUstream) };
                dec.set_cuda_stream(wrapped).map_err(to_py)?;
            }
            dec.forward(&inputs, &mut outputs).map_err(to_py)?;
        } else {
            // The CPU backend computes in place, without the interpreter lock held.
            py.detach(|| dec.forward(&inputs, &mut outputs))
                .map_err(to_py)?;
        }
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

    /// Width of the latent (values) part, `o`'s last dimension.
    #[getter]
    fn kv_lora_rank(&self) -> usize {
        self.config.kv_lora_rank
    }

    /// Query heads a call reads and writes (`num_heads x dcp_world_size`).
    #[getter]
    fn q_heads(&self) -> usize {
        self.config.num_heads * self.config.dcp_world_size
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
    seen: &mut Vec<TorchTensor>,
) -> PyResult<()> {
    match arg {
        None => {}
        Some(k) if k.hasattr("data_ptr")? => {
            let t = TorchTensor::of(k, name)?;
            *tensor = Some(t.view(name)?);
            seen.push(t);
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

/// A host output must not share bytes with any other tensor of the call: the CPU backend holds
/// it as the only (mutable) reference to that memory while it runs.
fn check_no_overlap(out: &TorchTensor, name: &str, others: &[TorchTensor]) -> PyResult<()> {
    let mine = out.host_range();
    for other in others {
        let theirs = other.host_range();
        if mine.start < theirs.end && theirs.start < mine.end {
            return Err(value_error(format!(
                "{name}: overlaps an input or the other output; pass a tensor of its own"
            )));
        }
    }
    Ok(())
}
