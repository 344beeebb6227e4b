//! The DCP kernel family (`kernels/dcp/`): built by NVRTC for the device, cached on disk like
//! the decode kernels (same cache, keyed by source, options, arch and NVRTC version), one
//! module per model dtype holding every entry.

use cudarc::driver::{CudaContext, CudaFunction};
use std::sync::Arc;

use crate::backend::cuda::compile::{self, Module, Target};
use crate::backend::cuda::load_module;
use crate::dtype::ModelDtype;
use crate::error::{Error, Result};

/// The source and its headers.
const SOURCE: &str = include_str!("../../kernels/dcp/kernel.cu");
const HEADERS: [(&str, &str); 2] = [
    (
        "dcp/params.cuh",
        include_str!("../../kernels/dcp/params.cuh"),
    ),
    (
        "common/half.cuh",
        include_str!("../../kernels/common/half.cuh"),
    ),
];

/// The kernels of the family, in the order the loaded family holds them.
pub(crate) const ENTRIES: [&str; 5] = [
    "dcp_local_seq_lens",
    "dcp_scale_partials",
    "dcp_finish_sum",
    "dcp_pack",
    "dcp_merge_gathered",
];

/// A built module of the family (its ptxas report sums every entry's spills and takes the
/// most registers).
#[derive(Debug, Clone)]
pub(crate) struct DcpBuilt {
    /// The module.
    pub module: Module,
}

/// The module for `dtype` on `target`: from the disk cache when `use_cache` and present,
/// else compiled (and stored). Needs libnvrtc, not a GPU.
///
/// # Errors
/// [`Error::Compile`] with NVRTC's log.
pub(crate) fn build(target: &Target, dtype: ModelDtype, use_cache: bool) -> Result<DcpBuilt> {
    let mut opts = compile::base_options(target);
    opts.push(format!(
        "-DMODEL_BF16={}",
        u8::from(dtype == ModelDtype::Bf16)
    ));
    let module = compile::build_module(
        "dcp",
        "dcp/kernel.cu",
        SOURCE,
        &HEADERS,
        &opts,
        target,
        use_cache,
    )?;
    Ok(DcpBuilt { module })
}

/// The family's kernels, loaded on one device for one model dtype.
#[cfg_attr(not(feature = "nccl"), allow(dead_code))]
#[derive(Debug)]
pub(crate) struct DcpKernels {
    pub local_seq_lens: CudaFunction,
    pub scale_partials: CudaFunction,
    pub finish_sum: CudaFunction,
    pub pack: CudaFunction,
    pub merge_gathered: CudaFunction,
}

#[cfg_attr(not(feature = "nccl"), allow(dead_code))]
impl DcpKernels {
    /// Builds (or reads from the disk cache) and loads the module into `ctx`.
    ///
    /// # Errors
    /// [`Error::Compile`], [`Error::Driver`].
    pub(crate) fn load(ctx: &Arc<CudaContext>, target: &Target, dtype: ModelDtype) -> Result<Self> {
        let built = build(target, dtype, true)?;
        let module = load_module(
            ctx,
            built.module.cubin,
            built.module.from_disk,
            "load the dcp module",
            || Ok(build(target, dtype, false)?.module.cubin),
        )?;
        let f = |name| {
            module
                .load_function(name)
                .map_err(Error::driver("load a dcp kernel"))
        };
        Ok(DcpKernels {
            local_seq_lens: f(ENTRIES[0])?,
            scale_partials: f(ENTRIES[1])?,
            finish_sum: f(ENTRIES[2])?,
            pack: f(ENTRIES[3])?,
            merge_gathered: f(ENTRIES[4])?,
        })
    }
}
