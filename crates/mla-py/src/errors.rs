//! mla errors as Python exceptions, with the library's messages: what the caller passed wrong
//! (and, as in vLLM, a cache dtype the GPU cannot take) is a ValueError, what mla does not do
//! is a NotImplementedError, what the device or the compiler refused is a RuntimeError.

use pyo3::PyErr;
use pyo3::exceptions::{PyNotImplementedError, PyRuntimeError, PyValueError};

use mla::Error;

/// The exception for an mla error.
pub fn to_py(e: Error) -> PyErr {
    let msg = e.to_string();
    match e {
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
