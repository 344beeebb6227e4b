//! mla errors as Python exceptions, with the library's messages: what the caller passed wrong
//! (and, as in vLLM, a cache dtype the GPU cannot take) is a ValueError, what mla does not do
//! is a NotImplementedError, what the device or the compiler refused is a RuntimeError.

use pyo3::PyErr;
use pyo3::exceptions::{PyNotImplementedError, PyRuntimeError, PyValueError};

use mla::{Error, Location};

/// The exception for an mla error.
pub fn to_py(e: Error) -> PyErr {
    let msg = e.to_string();
    match e {
        // Devices as torch names them, which a Python caller compares with `tensor.device`.
        Error::WrongDevice { arg, expected, got } => PyValueError::new_err(format!(
            "{arg}: expected a tensor on {}, got one on {}",
            torch_device(expected),
            torch_device(got)
        )),
        Error::UnsupportedFeature
        | Error::UnsupportedAttentionType { .. }
        | Error::CacheDtypeNotSupportedYet { .. }
        | Error::SlidingWindowWithDcp
        | Error::CausalMultiTokenWithDcp => PyNotImplementedError::new_err(msg),
        Error::NoCudaDevice(_)
        | Error::CudaNotCompiled
        | Error::Driver { .. }
        | Error::Nccl { .. }
        | Error::Compile { .. }
        | Error::DeviceCheck { .. }
        | Error::Alloc { .. }
        | Error::WorkspaceLocked { .. } => PyRuntimeError::new_err(msg),
        _ => PyValueError::new_err(msg),
    }
}

/// A location as torch names the device (`cpu`, `cuda:0`).
pub fn torch_device(at: Location) -> String {
    match at {
        Location::Host => "cpu".to_string(),
        Location::Cuda(i) => format!("cuda:{i}"),
    }
}
