//! Backends: where a planned decode runs. Each backend owns its workspace memory and executes
//! plans; none of them decides anything the plan already decided.
//!
//! - [`cpu`]: the reference, parallel with rayon.
//! - `cuda` (feature `cuda`): NVRTC-compiled kernels on an NVIDIA GPU.
//!
//! Without the `cuda` feature the same names exist and asking for a GPU is an error
//! ([`crate::Error::CudaNotCompiled`]), so the public API does not change shape with features.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;

use std::fmt;

use crate::args::{DecodeInputs, DecodeOutputs};
use crate::config::{DeviceInfo, ValidConfig};
use crate::error::Result;
use crate::kernels::variant::Variant;
use crate::plan::DecodePlan;
use crate::tensor::Location;

/// Which device a decoder runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Device {
    /// The CPU backend.
    Cpu,
    /// CUDA device `ordinal`.
    Cuda(usize),
    /// CUDA device 0 when it is usable, else the CPU.
    #[default]
    Auto,
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
            Device::Auto => f.write_str("auto"),
        }
    }
}

/// A backend ready to run plans.
#[derive(Debug)]
pub(crate) enum Backend {
    Cpu(cpu::CpuBackend),
    #[cfg(feature = "cuda")]
    Cuda(Box<cuda::CudaBackend>),
}

impl Backend {
    /// Opens the backend for a device, with what the configuration is validated against.
    pub(crate) fn open(device: Device) -> Result<(Backend, DeviceInfo)> {
        let cpu = || {
            (
                Backend::Cpu(cpu::CpuBackend::new()),
                cpu::CpuBackend::device_info(),
            )
        };
        match device {
            Device::Cpu => Ok(cpu()),
            Device::Cuda(ordinal) => Self::open_cuda(ordinal),
            Device::Auto => Ok(Self::open_cuda(0).unwrap_or_else(|_| cpu())),
        }
    }

    #[cfg(feature = "cuda")]
    fn open_cuda(ordinal: usize) -> Result<(Backend, DeviceInfo)> {
        let (b, info) = cuda::CudaBackend::open(ordinal)?;
        Ok((Backend::Cuda(Box::new(b)), info))
    }

    #[cfg(not(feature = "cuda"))]
    fn open_cuda(_ordinal: usize) -> Result<(Backend, DeviceInfo)> {
        Err(crate::error::Error::CudaNotCompiled)
    }

    pub(crate) fn name(&self) -> &'static str {
        match self {
            Backend::Cpu(_) => "cpu",
            #[cfg(feature = "cuda")]
            Backend::Cuda(_) => "cuda",
        }
    }

    /// What computes stage 1: the CPU path (`cpu-amx-bf16`, `cpu-avx512-bf16`,
    /// `cpu-portable`), or the backend's name on a GPU (whose kernels are named per plan).
    pub(crate) fn kernel_name(&self) -> &'static str {
        match self {
            Backend::Cpu(b) => match b.kernel() {
                cpu::CpuKernel::AmxBf16 => "cpu-amx-bf16",
                cpu::CpuKernel::Avx512Bf16 => "cpu-avx512-bf16",
                cpu::CpuKernel::Portable | cpu::CpuKernel::Auto => "cpu-portable",
            },
            #[cfg(feature = "cuda")]
            Backend::Cuda(_) => self.name(),
        }
    }

    pub(crate) fn location(&self) -> Location {
        match self {
            Backend::Cpu(_) => Location::Host,
            #[cfg(feature = "cuda")]
            Backend::Cuda(b) => Location::Cuda(b.ordinal()),
        }
    }

    /// Backend-specific limits on the configuration (the CUDA kernels' widths and head count)
    /// and the launch settings it takes from it.
    pub(crate) fn configure(&mut self, cfg: &ValidConfig) -> Result<()> {
        match self {
            Backend::Cpu(b) => b.configure(cfg),
            #[cfg(feature = "cuda")]
            Backend::Cuda(b) => b.configure(cfg),
        }
    }

    /// Builds and loads `variants` (the kernels a GPU decoder can launch), so that no decode
    /// compiles. The CPU backend has nothing to prepare.
    pub(crate) fn warmup(&mut self, variants: &[Variant]) -> Result<()> {
        match self {
            Backend::Cpu(_) => {
                let _ = variants;
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Backend::Cuda(b) => b.warmup(variants),
        }
    }

    pub(crate) fn resize_workspace(&mut self, bytes: usize) -> Result<()> {
        match self {
            Backend::Cpu(b) => b.resize_workspace(bytes),
            #[cfg(feature = "cuda")]
            Backend::Cuda(b) => b.resize_workspace(bytes),
        }
    }

    pub(crate) fn forward(
        &mut self,
        plan: &DecodePlan,
        inputs: &DecodeInputs<'_>,
        outputs: &mut DecodeOutputs<'_>,
    ) -> Result<()> {
        match self {
            Backend::Cpu(b) => b.forward(plan, inputs, outputs),
            #[cfg(feature = "cuda")]
            Backend::Cuda(b) => b.forward(plan, inputs, outputs),
        }
    }

    /// Waits for the device and reports errors its kernels flagged (the CPU checks up front).
    pub(crate) fn check_errors(&mut self) -> Result<()> {
        match self {
            Backend::Cpu(_) => Ok(()),
            #[cfg(feature = "cuda")]
            Backend::Cuda(b) => b.check_errors(),
        }
    }

    #[cfg(feature = "cuda")]
    pub(crate) fn cuda(&self) -> Option<&cuda::CudaBackend> {
        match self {
            Backend::Cuda(b) => Some(b),
            Backend::Cpu(_) => None,
        }
    }

    #[cfg(feature = "cuda")]
    pub(crate) fn cuda_mut(&mut self) -> Option<&mut cuda::CudaBackend> {
        match self {
            Backend::Cuda(b) => Some(b),
            Backend::Cpu(_) => None,
        }
    }
}
