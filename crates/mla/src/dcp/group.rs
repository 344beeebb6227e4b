//! [`DcpGroup`]: one rank of a decode-context-parallel group: its place in the interleaving
//! ([`DcpLayout`]: rank, world size N, interleave I), its device, and an NCCL communicator
//! over the N ranks. Built from a [`DcpId`] that rank 0 makes and hands to the others (one
//! process per GPU, as a serving engine runs), or for several devices of one process at once.

use std::sync::Arc;

use cudarc::driver::CudaContext;

use super::ffi::{self, NcclComm};
use super::layout::DcpLayout;
use crate::error::{Error, Result};

/// An NCCL unique id: 128 opaque bytes that rank 0 makes and every rank joins with.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct DcpId([u8; 128]);

impl std::fmt::Debug for DcpId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DcpId(..)")
    }
}

impl DcpId {
    /// A fresh id (on rank 0; send [`DcpId::to_bytes`] to the other ranks).
    ///
    /// # Errors
    /// [`Error::Nccl`] when NCCL is missing or fails.
    pub fn new() -> Result<Self> {
        nccl_present()?;
        Ok(DcpId(ffi::unique_id()?))
    }

    /// The bytes to send to the other ranks.
    pub fn to_bytes(&self) -> [u8; 128] {
        self.0
    }

    /// The id another rank made, from its bytes.
    pub fn from_bytes(bytes: [u8; 128]) -> Self {
        DcpId(bytes)
    }
}

fn nccl_present() -> Result<()> {
    ffi::nccl_present().map_err(|detail| Error::Nccl {
        op: "load libnccl.so",
        detail,
    })
}

/// Whether DCP can run here over `devices` GPUs: the CUDA driver, NVRTC and NCCL load and
/// that many devices exist. Returns NCCL's version code (22809 for 2.28.9); the error says
/// what is missing, for tests and benchmarks to print when they skip.
pub fn available(devices: usize) -> std::result::Result<i32, String> {
    crate::backend::cuda::ffi::libraries_present()?;
    ffi::nccl_present()?;
    let count = CudaContext::device_count().map_err(|e| e.to_string())?;
    if (count.max(0) as usize) < devices {
        return Err(format!("{devices} CUDA devices needed, {count} present"));
    }
    ffi::nccl_version().map_err(|e| e.to_string())
}

/// One rank of a DCP group.
#[derive(Debug)]
pub struct DcpGroup {
    layout: DcpLayout,
    ordinal: usize,
    /// Held so that the device's primary context outlives the communicator.
    _ctx: Arc<CudaContext>,
    pub(crate) comm: NcclComm,
}

impl DcpGroup {
    /// Joins the group of `id` as `rank` of `world_size` on CUDA device `ordinal`, tokens
    /// interleaved in chunks of `interleave`. Blocks until all `world_size` ranks have joined
    /// (each from its own process or thread).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a bad layout, [`Error::NoCudaDevice`], [`Error::Nccl`].
    pub fn from_unique_id(
        id: &DcpId,
        rank: usize,
        world_size: usize,
        interleave: usize,
        ordinal: usize,
    ) -> Result<Self> {
        let layout = DcpLayout::new(rank, world_size, interleave)?;
        crate::backend::cuda::ffi::libraries_present().map_err(Error::NoCudaDevice)?;
        nccl_present()?;
        // NCCL joins on the current device: make it this one (its primary context).
        let ctx = CudaContext::new(ordinal).map_err(|e| Error::NoCudaDevice(e.to_string()))?;
        ctx.bind_to_thread()
            .map_err(Error::driver("bind the context"))?;
        let comm = NcclComm::init_rank(id.0, world_size, rank)?;
        Ok(DcpGroup {
            layout,
            ordinal,
            _ctx: ctx,
            comm,
        })
    }

    /// A group over the devices of this process: rank i on `ordinals[i]`, made from one
    /// thread. Hand each rank to its own thread to decode (NCCL calls of several ranks from
    /// one thread would wait on each other).
    ///
    /// # Errors
    /// As [`DcpGroup::from_unique_id`]; [`Error::InvalidConfig`] for an empty or repeated
    /// list of devices.
    pub fn in_process(ordinals: &[usize], interleave: usize) -> Result<Vec<Self>> {
        let world = ordinals.len();
        let mut seen = ordinals.to_vec();
        seen.sort_unstable();
        seen.dedup();
        if seen.len() != world || world == 0 {
            return Err(Error::config(
                "dcp",
                format!("distinct devices needed, got {ordinals:?}"),
            ));
        }
        DcpLayout::new(0, world, interleave)?;
        crate::backend::cuda::ffi::libraries_present().map_err(Error::NoCudaDevice)?;
        nccl_present()?;
        // Retain every primary context before NCCL uses the devices.
        let ctxs: Vec<Arc<CudaContext>> = ordinals
            .iter()
            .map(|&o| CudaContext::new(o).map_err(|e| Error::NoCudaDevice(e.to_string())))
            .collect::<Result<_>>()?;
        let comms = NcclComm::init_all(ordinals)?;
        comms
            .into_iter()
            .zip(ctxs)
            .zip(ordinals)
            .enumerate()
            .map(|(rank, ((comm, ctx), &ordinal))| {
                Ok(DcpGroup {
                    layout: DcpLayout::new(rank, world, interleave)?,
                    ordinal,
                    _ctx: ctx,
                    comm,
                })
            })
            .collect()
    }

    /// This rank's place in the interleaving.
    pub fn layout(&self) -> &DcpLayout {
        &self.layout
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.layout.rank()
    }

    /// N.
    pub fn world_size(&self) -> usize {
        self.layout.world_size()
    }

    /// I.
    pub fn interleave(&self) -> usize {
        self.layout.interleave()
    }

    /// The CUDA device of this rank.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }
}
