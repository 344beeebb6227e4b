//! `mla_rs`: the mla decode for PyTorch and vLLM users.
//!
//! A thin layer: it reads torch tensors' pointers, shapes, strides and dtypes through Python
//! attributes, launches on torch's current stream in PyTorch's own CUDA context, and maps mla's
//! errors to Python exceptions. The vLLM drop-in (`decode_attention_fwd`) is written in Python
//! on top of `MlaDecode` (`python/mla_rs/vllm.py`).
#![deny(unsafe_code)]

mod decoder;
mod errors;
mod torch;

use pyo3::prelude::*;

/// The native part of `mla_rs` (imported by `mla_rs/__init__.py`).
#[pymodule]
fn _mla_rs(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<decoder::PyMlaDecode>()?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
