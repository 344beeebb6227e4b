//! Building every GPU kernel ahead of time, into the disk cache (what `mla precompile` runs),
//! so that the first decode of any process starts warm.
//!
//! [`for_device`] builds and loads every variant a device can use with DeepSeek's shapes;
//! [`for_arch`] needs no GPU, only libnvrtc, and reports each kernel's registers and spills
//! (what CI checks for every architecture that ships).

pub use crate::backend::cuda::compile::{KernelBuild, KernelUsage};

use crate::backend::cuda::CudaBackend;
use crate::backend::cuda::compile::{self, Target};
use crate::dcp::kernels as dcp;
use crate::dtype::ModelDtype;
use crate::error::{Error, Result};
use crate::kernels::select::{all_variants, smem_limit_of_arch};

/// Builds (or reads from the disk cache) and loads every kernel device `ordinal` can use: the
/// decode's variants for both model dtypes and every cache format, and the DCP family.
///
/// # Errors
/// [`Error::NoCudaDevice`], [`Error::Compile`], [`Error::Driver`].
pub fn for_device(ordinal: usize) -> Result<Vec<KernelBuild>> {
    let (mut backend, _) = CudaBackend::open(ordinal)?;
    let mut builds = backend.precompile_all()?;
    builds.extend(dcp_builds(backend.target(), true)?);
    Ok(builds)
}

/// Compiles every kernel for the architecture `arch` (`sm_80`, `sm_89`, `sm_90a`, `90`,
/// `8.9`) without a device. With `use_cache` false every kernel is compiled afresh, so that
/// each reports its registers and spills.
///
/// # Errors
/// [`Error::InvalidConfig`] (`arch`) for a name that is not an architecture,
/// [`Error::NoCudaDevice`] without libnvrtc, [`Error::Compile`].
pub fn for_arch(arch: &str, use_cache: bool) -> Result<Vec<KernelBuild>> {
    let (major, minor) = Target::parse_arch(arch).ok_or_else(|| {
        Error::config("arch", format!("expected a name like sm_90a, got {arch:?}"))
    })?;
    let target = Target::new(major, minor)?;
    let mut builds = Vec::new();
    for v in all_variants(smem_limit_of_arch(major, minor), target.wgmma()) {
        builds.push(KernelBuild::from(&compile::build(&v, &target, use_cache)?));
    }
    builds.extend(dcp_builds(&target, use_cache)?);
    Ok(builds)
}

/// What `mla precompile` builds: for CUDA device 0 ([`for_device`]) when `arches` is empty,
/// else for each named architecture without a device ([`for_arch`]), in order.
///
/// # Errors
/// Those of [`for_device`] and [`for_arch`].
pub fn for_targets<S: AsRef<str>>(arches: &[S], use_cache: bool) -> Result<Vec<KernelBuild>> {
    if arches.is_empty() {
        return for_device(0);
    }
    let mut builds = Vec::new();
    for arch in arches {
        builds.extend(for_arch(arch.as_ref(), use_cache)?);
    }
    Ok(builds)
}

/// The DCP family, one module per model dtype.
fn dcp_builds(target: &Target, use_cache: bool) -> Result<Vec<KernelBuild>> {
    [ModelDtype::Bf16, ModelDtype::F16]
        .into_iter()
        .map(|dtype| {
            let b = dcp::build(target, dtype, use_cache)?;
            let defines = format!("-DMODEL_BF16={}", u8::from(dtype == ModelDtype::Bf16));
            let name = format!("dcp ({} entries)", dcp::ENTRIES.len());
            Ok(KernelBuild::new(&target.arch, name, defines, &b.module))
        })
        .collect()
}
