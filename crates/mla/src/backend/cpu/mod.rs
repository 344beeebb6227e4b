//! The CPU backend: the decode contract in plain Rust, parallel with rayon. It is the
//! reference the GPU kernels are checked against and the default on a machine without a GPU.
//!
//! - `inputs`: typed host views and the value checks (lengths, block ids).
//! - `split`: stage 1, one normalized partial output and LSE per split.
//! - `combine`: stage 2, the ascending merge into o and lse.
//! - `gemm`: the safe wrapper of the f32 GEMM both products use.

mod combine;
mod gemm;
mod inputs;
mod split;

use half::{bf16, f16};

use crate::args::{DecodeInputs, DecodeOutputs};
use crate::config::DeviceInfo;
use crate::dtype::ModelDtype;
use crate::error::{Error, Result};
use crate::plan::DecodePlan;

pub use split::{HEAD_GROUP, KEY_CHUNK};

/// The CPU backend; it owns the workspace memory.
#[derive(Debug, Default)]
pub struct CpuBackend {
    /// The workspace, as f32 (every view is f32 and 256-byte aligned, a multiple of 4).
    workspace: Vec<f32>,
}

impl CpuBackend {
    /// A backend with an empty workspace.
    pub fn new() -> Self {
        Self::default()
    }

    /// What the configuration is validated against: rayon's threads stand in for SMs.
    pub fn device_info() -> DeviceInfo {
        DeviceInfo::Cpu {
            threads: rayon::current_num_threads(),
        }
    }

    /// Resizes the workspace to `bytes` (called only when the manager grew it).
    ///
    /// # Errors
    /// [`Error::Alloc`] if the memory is not available (instead of aborting).
    pub fn resize_workspace(&mut self, bytes: usize) -> Result<()> {
        let len = bytes.div_ceil(4);
        self.workspace
            .try_reserve_exact(len.saturating_sub(self.workspace.len()))
            .map_err(|_| Error::Alloc {
                what: "workspace",
                bytes,
            })?;
        self.workspace.resize(len, 0.0);
        Ok(())
    }

    /// Runs a planned decode. Every value is checked before anything is written.
    ///
    /// # Errors
    /// [`Error::NegativeSeqLen`], [`Error::SeqLenBeyondBlockTable`],
    /// [`Error::BlockIdOutOfRange`]; [`Error::Memory`] for outputs that are not aligned host
    /// slices.
    pub fn forward(
        &mut self,
        plan: &DecodePlan,
        inputs: &DecodeInputs<'_>,
        outputs: &mut DecodeOutputs<'_>,
    ) -> Result<()> {
        let src = inputs::HostInputs::new(plan, inputs)?;
        let [ro, rl] = plan.workspace;
        let ws = &mut self.workspace[..plan.workspace_bytes.div_ceil(4)];
        let (head, tail) = ws.split_at_mut(rl.offset / 4);
        let part_o = &mut head[ro.offset / 4..(ro.offset + ro.bytes) / 4];
        let part_lse = &mut tail[..rl.bytes / 4];

        split::run(plan, &src, part_o, part_lse);

        let lse = outputs
            .lse
            .host_slice_mut::<f32>()
            .ok_or_else(|| Error::memory("lse", "expected an aligned host f32 tensor"))?;
        let bad_o = || Error::memory("o", "expected an aligned host tensor of the model dtype");
        match plan.model_dtype {
            ModelDtype::Bf16 => {
                let o = outputs.o.host_slice_mut::<bf16>().ok_or_else(bad_o)?;
                combine::run(plan, &src, part_o, part_lse, o, lse);
            }
            ModelDtype::F16 => {
                let o = outputs.o.host_slice_mut::<f16>().ok_or_else(bad_o)?;
                combine::run(plan, &src, part_o, part_lse, o, lse);
            }
        }
        Ok(())
    }
}
