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

/// One built kernel as Python sees it: (arch, kernel, defines, registers, spilled bytes, from
/// the cache).
type BuildRow = (String, String, String, Option<u32>, Option<u32>, bool);

/// Builds every GPU kernel ahead of time into the disk cache (`MLA_CACHE_DIR`, else
/// `~/.cache/mla`), as `mla precompile` does: on CUDA device 0 when `arch` is empty, else for
/// each named architecture (`sm_80`, `sm_90a`, ...) without a device. Returns one tuple a
/// kernel: (arch, kernel, defines, registers or None, spilled bytes or None, from the cache).
#[pyfunction]
#[pyo3(signature = (arch = Vec::new(), use_cache = true))]
fn precompile(py: Python<'_>, arch: Vec<String>, use_cache: bool) -> PyResult<Vec<BuildRow>> {
    let builds = py
        .detach(|| mla::precompile::for_targets(&arch, use_cache))
        .map_err(errors::to_py)?;
    Ok(builds
        .into_iter()
        .map(|b| {
            let regs = b.usage.map(|u| u.registers);
            let spilled = b.usage.map(|u| u.spill_stores + u.spill_loads);
            (b.arch, b.kernel, b.defines, regs, spilled, b.from_disk)
        })
        .collect())
}

/// The native part of `mla_rs` (imported by `mla_rs/__init__.py`).
#[pymodule]
fn _mla_rs(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<decoder::PyMlaDecode>()?;
    m.add_function(wrap_pyfunction!(precompile, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
