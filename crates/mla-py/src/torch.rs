//! torch tensors as mla views, read through Python attributes only (no libtorch link): data
//! pointer, shape, strides, dtype, device. torch itself is imported only when a call needs it,
//! so the module imports on machines without torch or a GPU.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use mla::{DType, TensorMut, TensorRef};

/// What mla needs to know of a CUDA tensor.
#[derive(Debug, Clone)]
pub struct CudaTensor {
    pub ptr: u64,
    pub device: usize,
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

impl CudaTensor {
    /// Describes a CUDA tensor; a ValueError for anything else.
    pub fn of(t: &Bound<'_, PyAny>, arg: &str) -> PyResult<Self> {
        let not_tensor = || PyValueError::new_err(format!("{arg}: expected a torch tensor"));
        let device = t.getattr("device").map_err(|_| not_tensor())?;
        let kind: String = device.getattr("type")?.extract()?;
        if kind != "cuda" {
            return Err(PyValueError::new_err(format!(
                "{arg}: expected a CUDA tensor, got one on {kind}"
            )));
        }
        let index: Option<usize> = device.getattr("index")?.extract()?;
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
        Ok(CudaTensor {
            ptr: t.call_method0("data_ptr")?.extract()?,
            device: index.unwrap_or(0),
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

    /// A read-only view. The caller keeps the tensor alive for the call; the decode is ordered
    /// on torch's current stream, like any torch op.
    pub fn view<const N: usize>(&self, arg: &str) -> PyResult<TensorRef<'static, N>> {
        let (shape, strides) = self.dims::<N>(arg)?;
        // SAFETY: torch guarantees the storage holds the tensor's view; the Python object is
        // alive for the whole call and the kernels are launched on torch's current stream of
        // the tensor's device, after every earlier torch op on that stream.
        #[allow(unsafe_code)]
        let view = unsafe {
            TensorRef::from_device_ptr(self.ptr, self.device, self.dtype, shape, strides)
        };
        view.map_err(crate::errors::to_py)
    }

    /// A writable view (see [`CudaTensor::view`]).
    pub fn view_mut<const N: usize>(&self, arg: &str) -> PyResult<TensorMut<'static, N>> {
        let (shape, strides) = self.dims::<N>(arg)?;
        // SAFETY: as in `view`; torch does not touch the output while the op that writes it is
        // queued behind it on the same stream.
        #[allow(unsafe_code)]
        let view = unsafe {
            TensorMut::from_device_ptr(self.ptr, self.device, self.dtype, shape, strides)
        };
        view.map_err(crate::errors::to_py)
    }
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
