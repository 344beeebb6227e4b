//! Backends: where a planned decode runs. Each backend owns its workspace memory and executes
//! plans; none of them decides anything the plan already decided.
//!
//! Without the `cuda` feature the same names exist and asking for a GPU is an error
//! ([`crate::Error::CudaNotCompiled`]), so the public API does not change shape with features.

pub mod cpu;

use std::fmt;

use crate::config::DeviceInfo;
use crate::error::{Error, Result};

/// Which device a decoder runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Device {
    /// The CPU backend.
    Cpu,
    /// CUDA device `ordinal`.
    Cuda(usize),
    /// The first GPU when one is usable, else the CPU.
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
}

impl Backend {
    /// Opens the backend for a device, with what the configuration is validated against.
    pub(crate) fn open(device: Device) -> Result<(Backend, DeviceInfo)> {
        match device {
            Device::Cpu | Device::Auto => Ok((
                Backend::Cpu(cpu::CpuBackend::new()),
                cpu::CpuBackend::device_info(),
            )),
            Device::Cuda(_) => Err(Error::CudaNotCompiled),
        }
    }

    pub(crate) fn name(&self) -> &'static str {
        match self {
            Backend::Cpu(_) => "cpu",
        }
    }

    pub(crate) fn location(&self) -> crate::tensor::Location {
        match self {
            Backend::Cpu(_) => crate::tensor::Location::Host,
        }
    }

    pub(crate) fn resize_workspace(&mut self, bytes: usize) -> Result<()> {
        match self {
            Backend::Cpu(b) => b.resize_workspace(bytes),
        }
    }

    pub(crate) fn forward(
        &mut self,
        plan: &crate::plan::DecodePlan,
        inputs: &crate::args::DecodeInputs<'_>,
        outputs: &mut crate::args::DecodeOutputs<'_>,
    ) -> Result<()> {
        match self {
            Backend::Cpu(b) => b.forward(plan, inputs, outputs),
        }
    }
}
