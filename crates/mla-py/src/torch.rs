//! torch tensors as mla views, read through Python attributes only (no libtorch link): data
//! pointer, shape, strides, dtype, device. CUDA tensors become device views, CPU tensors host
//! views (the CPU backend). torch itself is imported only when a call needs it, so the module
//! imports on machines without torch or a GPU.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use half::{bf16, f16};
use mla::{DType, Element, Location, TensorMut, TensorRef};

/// What mla needs to know of a torch tensor.
#[derive(Debug, Clone)]
pub struct TorchTensor {
    pub ptr: u64,
    pub location: Location,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub strides: Vec<usize>,
}

fn dtype_of(name: &str, arg: &str) -> PyResult<DType> {
    Ok(match name {
        "torch.bfloat16" => DType::BF16,
        "torch.float16" => DType::F16,
        "torch.float32" => DType::F32,
        "torch.int32" => DType::I32,
        "torch.uint8" => DType::U8,
        "torch.float8_e4m3fn" => DType::F8E4M3,
        "torch.float8_e5m2" => DType::F8E5M2,
        other => {
            return Err(PyValueError::new_err(format!(
                "{arg}: dtype {other} is not one mla reads (bfloat16, float16, float32, int32, uint8, float8_e4m3fn, float8_e5m2)"
            )));
        }
    })
}

/// `$make::<T, N>(args)` with `T` the host element type of `$dtype`: the dtype's own, or bytes
/// (`u8`) for the 1-byte dtypes (u8 and both fp8).
macro_rules! by_element {
    ($dtype:expr, $make:ident::<$n:ident>($($arg:expr),*)) => {
        match $dtype {
            DType::BF16 => $make::<bf16, $n>($($arg),*),
            DType::F16 => $make::<f16, $n>($($arg),*),
            DType::F32 => $make::<f32, $n>($($arg),*),
            DType::I32 => $make::<i32, $n>($($arg),*),
            _ => $make::<u8, $n>($($arg),*),
        }
    };
}

impl TorchTensor {
    /// Describes a CUDA or CPU tensor; a ValueError for anything else.
    pub fn of(t: &Bound<'_, PyAny>, arg: &str) -> PyResult<Self> {
        let not_tensor = || PyValueError::new_err(format!("{arg}: expected a torch tensor"));
        let device = t.getattr("device").map_err(|_| not_tensor())?;
        let kind: String = device.getattr("type")?.extract()?;
        let index: Option<usize> = device.getattr("index")?.extract()?;
        let location = match kind.as_str() {
            "cuda" => Location::Cuda(index.unwrap_or(0)),
            "cpu" => Location::Host,
            _ => {
                return Err(PyValueError::new_err(format!(
                    "{arg}: expected a CUDA or CPU tensor, got one on {kind}"
                )));
            }
        };
        let dtype = dtype_of(&t.getattr("dtype")?.str()?.to_cow()?, arg)?;
        let shape: Vec<usize> = t.getattr("shape")?.extract()?;
        let strides: Vec<isize> = t.call_method0("stride")?.extract()?;
        let strides = strides
            .into_iter()
            .map(|s| {
                usize::try_from(s).map_err(|_| {
                    PyValueError::new_err(format!("{arg}: negative strides are not supported"))
                })
            })
            .collect::<PyResult<_>>()?;
        Ok(TorchTensor {
            ptr: t.call_method0("data_ptr")?.extract()?,
            location,
            dtype,
            shape,
            strides,
        })
    }

    fn dims<const N: usize>(&self, arg: &str) -> PyResult<([usize; N], [usize; N])> {
        let wrong = || {
            PyValueError::new_err(format!(
                "{arg}: expected a {N}-dimensional tensor, got shape {:?}",
                self.shape
            ))
        };
        let shape: [usize; N] = self.shape.as_slice().try_into().map_err(|_| wrong())?;
        let strides: [usize; N] = self.strides.as_slice().try_into().map_err(|_| wrong())?;
        Ok((shape, strides))
    }

    /// Elements from the first one to the last one the view reaches (0 when empty).
    fn span(&self) -> usize {
        if self.shape.contains(&0) {
            return 0;
        }
        self.shape
            .iter()
            .zip(&self.strides)
            .fold(1usize, |acc, (&n, &s)| {
                acc.saturating_add((n - 1).saturating_mul(s))
            })
    }

    /// The host bytes `[start, end)` the tensor spans (empty for a device tensor).
    pub fn host_range(&self) -> std::ops::Range<u64> {
        match self.location {
            Location::Host => {
                let bytes = (self.span() * self.dtype.size()) as u64;
                self.ptr..self.ptr.saturating_add(bytes)
            }
            Location::Cuda(_) => 0..0,
        }
    }

    /// A read-only view. The caller keeps the tensor alive for the call; a device decode is
    /// ordered on torch's current stream, like any torch op.
    pub fn view<const N: usize>(&self, arg: &str) -> PyResult<TensorRef<'static, N>> {
        let (shape, strides) = self.dims::<N>(arg)?;
        let view = match self.location {
            // SAFETY: torch guarantees the storage holds the tensor's view; the Python object
            // is alive for the whole call and the kernels are launched on torch's current
            // stream of the tensor's device, after every earlier torch op on that stream.
            #[allow(unsafe_code)]
            Location::Cuda(device) => unsafe {
                TensorRef::from_device_ptr(self.ptr, device, self.dtype, shape, strides)
            },
            // Bytes for the 1-byte dtypes, read as the tensor's dtype (a no-op for the others).
            Location::Host => by_element!(self.dtype, host_ref::<N>(self, shape, strides))
                .and_then(|v| v.view_as(self.dtype)),
        };
        view.map_err(crate::errors::to_py)
    }

    /// A writable view (see [`TorchTensor::view`]).
    pub fn view_mut<const N: usize>(&self, arg: &str) -> PyResult<TensorMut<'static, N>> {
        let (shape, strides) = self.dims::<N>(arg)?;
        let view = match self.location {
            // SAFETY: as in `view`; torch does not touch the output while the op that writes it
            // is queued behind it on the same stream.
            #[allow(unsafe_code)]
            Location::Cuda(device) => unsafe {
                TensorMut::from_device_ptr(self.ptr, device, self.dtype, shape, strides)
            },
            // Outputs are never 1-byte: the plan rejects the dtype with its message.
            Location::Host => by_element!(self.dtype, host_mut::<N>(self, shape, strides)),
        };
        view.map_err(crate::errors::to_py)
    }
}

/// A host view of the tensor's elements as `T` (its dtype, or bytes for the 1-byte dtypes).
fn host_ref<T: Element, const N: usize>(
    t: &TorchTensor,
    shape: [usize; N],
    strides: [usize; N],
) -> mla::Result<TensorRef<'static, N>> {
    // SAFETY: a CPU torch tensor's storage holds `span` elements from its data pointer, which
    // is aligned for its dtype (`T` has the same size and alignment); the Python object keeps
    // it alive for the whole (synchronous) call, and the decode does not write through it.
    #[allow(unsafe_code)]
    let data: &'static [T] = match t.span() {
        0 => &[],
        len => unsafe { std::slice::from_raw_parts(t.ptr as *const T, len) },
    };
    TensorRef::from_host(data, shape, strides)
}

/// A writable host view, as [`host_ref`].
fn host_mut<T: Element, const N: usize>(
    t: &TorchTensor,
    shape: [usize; N],
    strides: [usize; N],
) -> mla::Result<TensorMut<'static, N>> {
    // SAFETY: as in `host_ref`; forward checks that no other view of the call overlaps an
    // output's bytes, so this is the only reference to them while it lives.
    #[allow(unsafe_code)]
    let data: &'static mut [T] = match t.span() {
        0 => &mut [],
        len => unsafe { std::slice::from_raw_parts_mut(t.ptr as *mut T, len) },
    };
    TensorMut::from_host(data, shape, strides)
}

/// torch, imported on first use.
pub fn torch(py: Python<'_>) -> PyResult<Bound<'_, PyModule>> {
    py.import("torch")
}

/// `torch.empty(shape, dtype=dtype, device=device)`.
pub fn empty<'py>(
    py: Python<'py>,
    shape: &[usize],
    dtype: &Bound<'py, PyAny>,
    device: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    let torch = torch(py)?;
    let kwargs = pyo3::types::PyDict::new(py);
    kwargs.set_item("dtype", dtype)?;
    kwargs.set_item("device", device)?;
    torch.call_method("empty", (PyTuple::new(py, shape)?,), Some(&kwargs))
}

/// The raw handle of torch's current stream on `device` (0 for the legacy default stream).
pub fn current_stream(py: Python<'_>, device: usize) -> PyResult<u64> {
    let stream = torch(py)?
        .getattr("cuda")?
        .call_method1("current_stream", (device,))?;
    stream.getattr("cuda_stream")?.extract()
}
