//! # mla: Multi-head Latent Attention decode over a paged latent KV cache
//!
//! MLA (DeepSeek-V2/V3/R1) keeps one latent row per token: `kv_lora_rank` (L = 512) values
//! that serve as both key and value, plus `qk_rope_head_dim` (R = 64) rotary values that only
//! the key uses. A decode step attends every query head to its request's latent rows, which
//! live in a paged cache addressed through a block table. This crate runs that step, exactly
//! as vLLM's Triton MLA backend specifies it, on NVIDIA GPUs (feature `cuda`) or on the CPU.
//!
//! ## Overview
//!
//! Data flows one way, and the modules follow it:
//!
//! | step | module | what it decides |
//! | --- | --- | --- |
//! | configuration | [`config`], [`dtype`] | heads, scale, dtypes, window; the seed's rejections for a device |
//! | plan | [`plan`] | argument checks, which keys each row sees, split count, workspace views |
//! | backend | [`backend`] | runs a plan: the CPU backend (this crate's reference) or CUDA (NVRTC-compiled kernels in `kernels/`) |
//!
//! [`MlaDecode`] ties them together; [`reference`](mod@reference) is the f64 oracle every backend is checked
//! against, and [`synth`] draws random problems for tests and benchmarks.
//!
//! ## Usage
//!
//! ```
//! use mla::{Device, MlaConfig, MlaDecode, synth::{Outputs, Problem, ProblemSpec}};
//!
//! // 16 heads, two requests of 300 and 1000 keys in 64-key pages.
//! let problem = Problem::generate(&ProblemSpec::new(16, vec![300, 1000]))?;
//! let mut dec = MlaDecode::new(&MlaConfig::new(16, 192f32.powf(-0.5)), Device::Cpu)?;
//! dec.reserve_workspace(2, 1000)?;
//! dec.lock_workspace();
//!
//! let mut out = Outputs::poisoned(&problem);
//! let plan = dec.forward(&problem.inputs()?, &mut out.views()?)?;
//! assert_eq!(plan.num_kv_splits, 1); // 1000 keys / 512 -> one split
//!
//! let reference = mla::reference::decode_f64(dec.config(), &problem.inputs()?, None)?;
//! let acc = reference.accuracy(&out.o.to_f32(), &out.lse);
//! assert!(acc.o_rel < 5e-3 && acc.lse_abs < 1e-3);
//! # Ok::<(), mla::Error>(())
//! ```
//!
//! The contract (shapes, which keys a row sees, split-KV, numerics, errors) is written out in
//! `docs/contract.md` at the repository root.
//!
//! ## Performance
//!
//! Build one [`MlaDecode`] per model configuration and reuse it for every layer and step:
//! reserve the workspace for the worst case once, lock it, warm it up
//! ([`MlaDecode::register_decode_warmup`]), then decode. A locked, warm decoder never
//! compiles or grows its workspace on the decode path; on the GPU it allocates nothing and
//! never waits for the device, so a decode can be captured in a CUDA graph and replayed with
//! new lengths and block tables (the CPU backend takes per-thread scratch for each parallel
//! job).
//!
//! ## Crate features
//!
//! - `cuda` (default): the CUDA backend, through cudarc with run-time loading of libcuda and
//!   libnvrtc, so it builds on machines without CUDA. Without it, [`Device::Cuda`] is
//!   [`Error::CudaNotCompiled`] and [`Device::Auto`] picks the CPU.
//! - `nccl` (implies `cuda`): decode context parallelism over several GPUs ([`dcp`]), through
//!   cudarc's NCCL 2.28 bindings, loaded at run time from an unversioned `libnccl.so`.
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod args;
pub mod backend;
pub mod config;
pub mod dcp;
mod decode;
pub mod dtype;
pub mod error;
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod kernels;
pub mod plan;
#[cfg(feature = "cuda")]
pub mod precompile;
pub mod reference;
pub mod synth;
pub mod tensor;

pub use args::{DecodeInputs, DecodeOutputs, Mask, Query};
pub use backend::Device;
/// Development: the CPU stage 1's time by phase since the last call (every thread's time
/// added), each total reset; `mla bench --backend cpu` prints it.
#[cfg(feature = "cpu-phase-times")]
pub use backend::cpu::phases::{Phase as CpuPhase, take as cpu_phase_times};
pub use backend::cpu::{CpuFeatures, CpuKernel};
pub use config::{AttentionType, DeviceInfo, MlaConfig, ScheduleCosts, Tuning, ValidConfig};
pub use decode::MlaDecode;
pub use dtype::{CacheDtype, DType, Element, KvFormat, ModelDtype};
pub use error::{Capability, Error, Result};
pub use kernels::{KernelChoice, KernelFamily};
pub use plan::DecodePlan;
pub use tensor::{Location, TensorMut, TensorRef};

/// The cudarc this crate is built on, so that callers use the very same types.
#[cfg(feature = "cuda")]
pub use cudarc;

/// The README's example compiles and runs as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
struct ReadmeDoctests;
