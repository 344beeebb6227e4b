//! The CPU backend: the decode contract in plain Rust, parallel with rayon. It is the
//! reference the GPU kernels are checked against and the default on a machine without a GPU.
//!
//! - `inputs`: typed host views and the value checks (lengths, block ids).
//! - `split`: stage 1, one normalized partial output and LSE per split.
//! - `combine`: stage 2, the ascending merge into o and lse.
//! - `kernel`: which stage-1 path runs ([`CpuKernel`], the CPU's [`CpuFeatures`]).
//! - `split_avx512`, `avx512` (x86-64): stage 1 with AVX-512 BF16 products, or with AMX-BF16
//!   tile products (`amx`); `fp8_lookup`: an fp8 cache's bytes as their bf16 values.
//! - `lines`: scratch buffers that start on a cache line.
//! - `gemm`: the safe wrapper of the f32 GEMM the portable path's products use.
//! - `phases`: the work item's time by phase (development feature `cpu-phase-times`).
//!
//! NOTES.md beside this file: where the time goes, what was tried.

#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod combine;
#[cfg(target_arch = "x86_64")]
mod fp8_lookup;
mod gemm;
mod inputs;
mod kernel;
mod lines;
pub(crate) mod phases;
mod split;
#[cfg(target_arch = "x86_64")]
mod split_avx512;

use half::{bf16, f16};

use crate::args::{DecodeInputs, DecodeOutputs};
use crate::config::{DeviceInfo, ValidConfig};
use crate::dtype::ModelDtype;
use crate::error::{Error, Result};
use crate::plan::DecodePlan;

use kernel::CpuPath;
pub use kernel::{CpuFeatures, CpuKernel};
pub use split::{HEAD_GROUP, KEY_CHUNK};

/// The CPU backend; it owns the workspace memory.
#[derive(Debug)]
pub struct CpuBackend {
    /// The workspace, as f32 (every view is f32 and 256-byte aligned, a multiple of 4).
    workspace: Vec<f32>,
    /// The stage-1 path, resolved by [`CpuBackend::configure`].
    path: CpuPath,
}

impl Default for CpuBackend {
    fn default() -> Self {
        CpuBackend {
            workspace: Vec::new(),
            path: CpuPath::Portable,
        }
    }
}

impl CpuBackend {
    /// A backend with an empty workspace, on the portable path until configured.
    pub fn new() -> Self {
        Self::default()
    }

    /// Picks the stage-1 path for a configuration ([`crate::Tuning::cpu_kernel`]).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming `cpu_kernel` for a forced path this CPU lacks or that
    /// cannot compute the configuration's numbers.
    pub fn configure(&mut self, cfg: &ValidConfig) -> Result<()> {
        self.path = CpuPath::resolve(cfg.tuning.cpu_kernel, cfg)?;
        Ok(())
    }

    /// The stage-1 kernel that runs (never [`CpuKernel::Auto`]).
    pub fn kernel(&self) -> CpuKernel {
        self.path.kernel()
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

        split::run(plan, &src, self.path, part_o, part_lse);

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

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use crate::config::MlaConfig;
    use crate::dtype::{CacheDtype, KvFormat};
    use crate::synth::{Outputs, Problem, ProblemSpec};
    use crate::{Device, MlaDecode};

    /// The whole amx-bf16 work item (key tiles read in place, or keys copied or decoded into
    /// whole tiles; q, P^T and V padded to whole tiles, the rescale before the tile product)
    /// with the scalar model of `tdpbf16ps` in place of the AMX unit, against the AVX-512 BF16
    /// path: the same products summed in another order. 20 heads (a padded second head tile) and lengths that end in
    /// partial chunks and partial tiles, for a cache read in place and decoded ones.
    #[test]
    fn the_tile_walk_matches_the_avx512_path() {
        let Some(token) = avx512::Avx512Bf16::detect_or_skip() else {
            return;
        };
        // Pages of 16 on one split: a bf16 cache's whole tiles read in place. Pages of 64 on
        // three splits of 100 keys: tiles that lie in one page read in place, those across
        // two pages copied.
        for (kv, cache, page, splits) in [
            (KvFormat::Bf16, CacheDtype::Bf16, 16, None),
            (KvFormat::F16, CacheDtype::F16, 16, None),
            (KvFormat::Fp8E4m3, CacheDtype::Fp8E4m3, 16, None),
            (KvFormat::Bf16, CacheDtype::Bf16, 64, Some(3)),
        ] {
            let mut spec = ProblemSpec::new(20, vec![300, 77, 1]);
            spec.kv_format = kv;
            spec.page_size = page;
            let problem = Problem::generate(&spec).unwrap();
            let inputs = problem.inputs().unwrap();
            let mut cfg = MlaConfig::new(20, 192f32.powf(-0.5));
            cfg.kv_cache_dtype = cache;
            cfg.tuning.cpu_kernel = CpuKernel::Avx512Bf16;
            cfg.num_kv_splits = splits;
            let mut dec = MlaDecode::new(&cfg, Device::Cpu).unwrap();
            let mut want = Outputs::poisoned(&problem);
            let plan = dec.forward(&inputs, &mut want.views().unwrap()).unwrap();

            let mut tiles = CpuBackend {
                workspace: Vec::new(),
                path: CpuPath::EmulatedTiles(token),
            };
            tiles.resize_workspace(plan.workspace_bytes).unwrap();
            let mut got = Outputs::poisoned(&problem);
            tiles
                .forward(&plan, &inputs, &mut got.views().unwrap())
                .unwrap();

            let (g, w) = (got.o.to_f32(), want.o.to_f32());
            let err: f64 = g
                .iter()
                .zip(&w)
                .map(|(a, b)| f64::from(a - b).powi(2))
                .sum();
            let norm: f64 = w.iter().map(|b| f64::from(*b).powi(2)).sum();
            assert!(
                err.sqrt() <= 1e-3 * norm.sqrt(),
                "{kv:?}: o off by {err} / {norm}"
            );
            for (i, (a, b)) in got.lse.iter().zip(&want.lse).enumerate() {
                assert!((a - b).abs() <= 1e-4, "{kv:?}: lse[{i}] {a} against {b}");
            }
        }
    }
}
