//! Decode context parallelism (DCP; docs/contract.md and docs/dcp.md): the KV cache of each
//! request is dealt out to N GPUs in interleaved chunks of I tokens, every GPU attends all
//! H N query heads over its own keys, and the ranks merge their (o, lse) by LSE over NCCL so
//! that each keeps its H heads.
//!
//! | module | what it holds | needs |
//! | --- | --- | --- |
//! | [`layout`] | which rank holds a token, where, and each rank's local length | nothing |
//! | [`merge`] | the LSE merge on the host in f32 (the kernels' math, for tests) | nothing |
//! | [`shard`] | a generated problem's share for one rank (tests, `mla bench --dcp`) | nothing |
//! | `kernels` | the DCP kernel family, built by NVRTC | `cuda` |
//! | `group`, `decode` | `DcpGroup` (NCCL communicator) and `DcpDecode` | `nccl` |

pub mod layout;
pub mod merge;
pub mod shard;

// The launch and the parameters are only used by the DCP decode (`nccl`); they build with
// `cuda` so that the parameter layout test runs in CI.
#[cfg(feature = "cuda")]
#[cfg_attr(not(feature = "nccl"), allow(dead_code))]
mod ffi;
#[cfg(feature = "cuda")]
pub(crate) mod kernels;
#[cfg(feature = "cuda")]
#[cfg_attr(not(feature = "nccl"), allow(dead_code))]
mod params;

#[cfg(feature = "nccl")]
mod decode;
#[cfg(feature = "nccl")]
mod group;
#[cfg(feature = "nccl")]
pub mod problem;

pub use layout::DcpLayout;

#[cfg(feature = "nccl")]
pub use decode::{DcpDecode, DcpMerge};
#[cfg(feature = "nccl")]
pub use group::{DcpGroup, DcpId, available};
