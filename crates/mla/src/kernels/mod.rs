//! The kernels as data, apart from any device: the GPU families and their sources
//! ([`family`]), the variants and the compile options that specialize them ([`variant`]),
//! each variant's shared-memory layout ([`smem`]), what each family supports on a device
//! ([`select`]), and the CPU backend's paths by name ([`cpu`]).
//!
//! The plan picks a variant for each decode (`plan::kernel`); the CUDA backend compiles,
//! loads and launches what the plan picked. The CUDA C++ sources live in `kernels/` at the
//! crate's root, one folder per family with a `NOTES.md`.

pub(crate) mod cpu;
pub(crate) mod family;
pub(crate) mod select;
pub(crate) mod smem;
pub(crate) mod variant;

pub use cpu::CpuKernel;
pub use family::{KernelChoice, KernelFamily};
