//! A generated problem on one DCP rank, for tests and `mla bench --dcp`: the rank's shard
//! ([`super::shard::shard_problem`]) uploaded on its decoder's stream, with the global
//! lengths the DCP decode takes.

use cudarc::driver::CudaSlice;

use super::decode::DcpDecode;
use super::shard::shard_problem;
use crate::args::DecodeInputs;
use crate::dtype::CacheDtype;
use crate::error::{Error, Result};
use crate::synth::Problem;
use crate::synth::device::DeviceProblem;
use crate::tensor::TensorRef;

/// One rank's share of a problem, on its device.
#[derive(Debug)]
pub struct RankProblem {
    /// The shard on the host (its `seq_lens` are the local ones).
    pub shard: Problem,
    /// The shard on the device.
    pub device: DeviceProblem,
    global_lens: CudaSlice<i32>,
    max_global: usize,
}

impl RankProblem {
    /// Shards `global` (a problem of H N heads) for `dec`'s rank and uploads it.
    ///
    /// # Errors
    /// As [`shard_problem`]; [`Error::Driver`].
    pub fn upload(dec: &DcpDecode, global: &Problem) -> Result<Self> {
        let s = dec.stream()?;
        let shard = shard_problem(global, dec.group().layout())?;
        let device = shard.to_device(&s)?;
        let global_lens = s
            .clone_htod(&global.seq_lens)
            .map_err(Error::driver("copy to the device"))?;
        let max_global = global
            .seq_lens
            .iter()
            .map(|&l| l.max(0) as usize)
            .max()
            .unwrap_or(0);
        Ok(RankProblem {
            shard,
            device,
            global_lens,
            max_global,
        })
    }

    /// `dec` made ready for `global` and its shard uploaded: the workspace reserved for the
    /// problem's rows, requests and longest length, and every kernel built for its cache
    /// (`cache`, as the decoder's configuration names it). What a test or a benchmark does
    /// before its decodes.
    ///
    /// # Errors
    /// As [`DcpDecode::reserve`], [`RankProblem::upload`] and
    /// [`DcpDecode::register_decode_warmup`].
    pub fn prepare(dec: &mut DcpDecode, global: &Problem, cache: CacheDtype) -> Result<Self> {
        let max_len = global.spec.seq_lens.iter().copied().max().unwrap_or(0);
        dec.reserve(global.rows(), global.spec.seq_lens.len(), max_len)?;
        let rp = RankProblem::upload(dec, global)?;
        dec.register_decode_warmup(&rp.inputs()?.kv_cache, cache)?;
        Ok(rp)
    }

    /// The DCP decode's inputs: the query, the local cache and block table, the global
    /// lengths and their maximum.
    ///
    /// # Errors
    /// Never for an uploaded problem; kept fallible like every view.
    pub fn inputs(&self) -> Result<DecodeInputs<'_>> {
        let local = self.device.inputs(&self.shard, false)?;
        Ok(DecodeInputs {
            seq_lens: TensorRef::from_cuda(&self.global_lens, [self.global_lens.len()], [1])?,
            max_seq_len: Some(self.max_global),
            ..local
        })
    }
}
