//! The CUDA backend: a device, a stream, the loaded kernels, the workspace and the
//! device-side error flag. It executes plans; the kernels live in `kernels/`.
//!
//! - `compile`: NVRTC options, ptxas' resource report, the build of a variant.
//! - `cache`: the on-disk cubin cache.
//! - `params`: the `#[repr(C)]` kernel argument.
//! - `combine`, `schedule`, `tma`: the combine's launch shape, the scheduled decode, the
//!   cache's tensor maps.
//! - `ffi`: every unsafe call.
//!
//! Which kernel runs a decode is the plan's decision (`plan::kernel`); this backend compiles,
//! loads and launches it. The decode path (`forward`) only looks kernels up, fills the
//! parameters and launches: no allocation (once the workspace is reserved), no compilation
//! (once warmed up), no host synchronization, so it can be captured in a CUDA graph.

pub(crate) mod cache;
mod combine;
pub(crate) mod compile;
pub(crate) mod ffi;
mod params;
mod schedule;
mod tma;

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr};
use cudarc::nvrtc::Ptx;

use self::combine::CombineShape;
use self::compile::{Built, Target};
use self::params::{DecodeParams, Pointers, TmaParams};
use crate::args::{DecodeInputs, DecodeOutputs, Query};
use crate::config::{DeviceInfo, ScheduleCosts, ValidConfig};
use crate::error::{Capability, Error, Result};
use crate::kernels::family::Family;
use crate::kernels::select::{all_variants, combine_variant};
use crate::kernels::variant::{Grid, Variant};
use crate::plan::DecodePlan;

pub use self::compile::KernelBuild;

/// How a configuration's decodes are launched (its [`crate::config::Tuning`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Launch {
    /// Whether the kernels after a decode's first are programmatic dependent launches (Hopper,
    /// unless the configuration turns it off): the combine, and on the schedule the stage-1
    /// kernel after the scheduler.
    pdl: bool,
    /// The device schedule's costs.
    schedule_costs: ScheduleCosts,
}

/// The CUDA backend of one device.
#[derive(Debug)]
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    /// Our own stream: the workspace and the error flag are allocated on it.
    own: Arc<CudaStream>,
    /// Where decodes are launched: `own`, or the caller's (torch's current stream).
    stream: Arc<CudaStream>,
    ordinal: usize,
    target: Target,
    smem_limit: usize,
    /// SMs of the device (the combine's launch shape).
    sm_count: usize,
    kernels: HashMap<Variant, CudaFunction>,
    /// How decodes are launched (set by `configure`).
    launch: Launch,
    /// Variants built (compiled or read from disk) and loaded by this backend.
    builds: Vec<Built>,
    workspace: Option<CudaSlice<u8>>,
    error_flag: CudaSlice<u32>,
    /// The narrow kernel's tensor map of the cache, encoded once per cache.
    kv_maps: tma::MapCache,
    /// Decodes launched on the device-computed schedule (what the tests check it ran).
    scheduled_decodes: u64,
}

impl CudaBackend {
    /// Opens device `ordinal`: its primary context, a stream of our own, the error flag.
    ///
    /// # Errors
    /// [`Error::NoCudaDevice`] when there is no driver, no NVRTC or no such device.
    pub fn open(ordinal: usize) -> Result<(CudaBackend, DeviceInfo)> {
        ffi::libraries_present().map_err(Error::NoCudaDevice)?;
        let count = CudaContext::device_count().map_err(|e| Error::NoCudaDevice(e.to_string()))?;
        if ordinal >= count.max(0) as usize {
            return Err(Error::NoCudaDevice(format!(
                "device {ordinal} asked for, {count} present"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| Error::NoCudaDevice(e.to_string()))?;
        ffi::disable_event_tracking(&ctx);
        let stream = ctx.new_stream().map_err(Error::driver("create a stream"))?;
        let name = ctx.name().map_err(Error::driver("device name"))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(Error::driver("compute capability"))?;
        let attr = |a| ctx.attribute(a).map_err(Error::driver("device attribute"));
        let sm_count = attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as usize;
        let smem_limit =
            attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?
                as usize;
        let error_flag = stream
            .alloc_zeros::<u32>(1)
            .map_err(Error::driver("allocate the error flag"))?;
        stream.synchronize().map_err(Error::driver("synchronize"))?;
        let capability = Capability {
            major: major as u32,
            minor: minor as u32,
        };
        let target = Target::new(capability.major, capability.minor)?;
        let info = DeviceInfo::Cuda {
            name,
            capability,
            sm_count,
            smem_per_block: smem_limit,
        };
        let backend = CudaBackend {
            ctx,
            own: stream.clone(),
            stream,
            ordinal,
            target,
            smem_limit,
            sm_count,
            kernels: HashMap::new(),
            launch: Launch {
                pdl: false,
                schedule_costs: ScheduleCosts::SHIPPED,
            },
            builds: Vec::new(),
            workspace: None,
            error_flag,
            kv_maps: tma::MapCache::default(),
            scheduled_decodes: 0,
        };
        Ok((backend, info))
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The stream every decode is launched on. Allocate and copy the decode's tensors on it
    /// (or order your streams against it).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The device's primary context (the one PyTorch and the CUDA runtime use).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Launches decodes on `stream` from now on (a caller's stream, e.g. torch's current
    /// one). Nothing waits: the switch may happen inside graph capture, where waiting is not
    /// allowed. Decodes on two streams share the workspace, so order them as you order any
    /// two ops on those streams (one stream, or torch.cuda.graph, which synchronizes before
    /// capturing, needs nothing more).
    ///
    /// # Errors
    /// [`Error::NoCudaDevice`] for a stream of another context.
    pub fn set_stream(&mut self, stream: Arc<CudaStream>) -> Result<()> {
        if stream.context().cu_ctx() != self.ctx.cu_ctx() {
            return Err(Error::NoCudaDevice(format!(
                "the stream belongs to another context than device {}'s",
                self.ordinal
            )));
        }
        self.stream = stream;
        Ok(())
    }

    /// The architecture kernels are compiled for (`sm_80`, `sm_89`, `sm_90a`, ...).
    pub fn arch(&self) -> &str {
        &self.target.arch
    }

    /// The compile target.
    pub(crate) fn target(&self) -> &Target {
        &self.target
    }

    /// Whether the device runs Hopper's kernels (sm_90a: wgmma, TMA).
    pub fn hopper(&self) -> bool {
        self.target.wgmma()
    }

    /// The device's SMs.
    pub fn sm_count(&self) -> usize {
        self.sm_count
    }

    /// Every kernel this backend built and loaded so far.
    pub fn builds(&self) -> Vec<KernelBuild> {
        self.builds.iter().map(KernelBuild::from).collect()
    }

    /// Checks the shapes the kernels support (L a multiple of 128 up to 512, R a multiple of
    /// 16, the head count the grids take) and takes the configuration's launch settings.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the field.
    pub(crate) fn configure(&mut self, cfg: &ValidConfig) -> Result<()> {
        let l = cfg.kv_lora_rank;
        if !l.is_multiple_of(128) || l > 512 {
            return Err(Error::config(
                "kv_lora_rank",
                format!("the CUDA backend needs a multiple of 128 up to 512, got {l}"),
            ));
        }
        if !cfg.rope_dim.is_multiple_of(16) {
            return Err(Error::config(
                "qk_rope_head_dim",
                format!(
                    "the CUDA backend needs a multiple of 16, got {}",
                    cfg.rope_dim
                ),
            ));
        }
        // The kernels index heads with i32; the combine's grid has a head block in y.
        if i32::try_from(cfg.q_heads).is_err() || cfg.q_heads > CombineShape::MAX_HEADS {
            return Err(Error::config(
                "num_heads",
                format!(
                    "the CUDA backend takes at most {} query heads, got {}",
                    CombineShape::MAX_HEADS,
                    cfg.q_heads
                ),
            ));
        }
        self.launch = Launch {
            pdl: self.target.wgmma() && cfg.tuning.pdl,
            schedule_costs: cfg.tuning.schedule_costs,
        };
        Ok(())
    }

    /// How many decodes this backend launched on the device-computed schedule.
    pub fn scheduled_decodes(&self) -> u64 {
        self.scheduled_decodes
    }

    /// Builds and loads `variants`, so that no decode compiles.
    ///
    /// # Errors
    /// [`Error::Compile`], [`Error::Driver`].
    pub(crate) fn warmup(&mut self, variants: &[Variant]) -> Result<()> {
        for &v in variants {
            self.kernel(v)?;
        }
        Ok(())
    }

    /// Builds and loads every variant this device can use with DeepSeek shapes (both model
    /// dtypes, every cache format, every head-count class), as `mla precompile` does.
    ///
    /// # Errors
    /// [`Error::Compile`], [`Error::Driver`].
    pub(crate) fn precompile_all(&mut self) -> Result<Vec<KernelBuild>> {
        for v in all_variants(self.smem_limit, self.target.wgmma()) {
            self.kernel(v)?;
        }
        Ok(self.builds())
    }

    /// A loaded kernel, building it on first use.
    fn kernel(&mut self, v: Variant) -> Result<&CudaFunction> {
        if !self.kernels.contains_key(&v) {
            let loaded = self.load(v)?;
            self.kernels.insert(v, loaded);
        }
        Ok(&self.kernels[&v])
    }

    fn load(&mut self, v: Variant) -> Result<CudaFunction> {
        // The backend keeps the build's report, not its bytes: the module takes them.
        let mut built = compile::build(&v, &self.target, true)?;
        tracing::debug!(
            kernel = %v,
            from_disk = built.module.from_disk,
            ms = built.module.millis,
            "kernel built"
        );
        let m = &mut built.module;
        let (cubin, from_disk) = (std::mem::take(&mut m.cubin), m.from_disk);
        let module = load_module(&self.ctx, cubin, from_disk, "load a module", || {
            built = compile::build(&v, &self.target, false)?;
            Ok(std::mem::take(&mut built.module.cubin))
        })?;
        let func = module
            .load_function(v.family.entry())
            .map_err(Error::driver("load a kernel"))?;
        let smem = v.smem_bytes();
        if v.family.is_decode() {
            // On our own stream: never the caller's, which may be capturing a graph.
            let global = module
                .get_global("mla_decode_smem_bytes", &self.own)
                .map_err(Error::driver("read the kernel's shared memory size"))?;
            let bytes = self
                .own
                .clone_dtoh(&global)
                .map_err(Error::driver("read the kernel's shared memory size"))?;
            let kernel_smem = bytes
                .get(..4)
                .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]));
            if kernel_smem != Some(smem as i32) {
                return Err(Error::Compile {
                    kernel: v.to_string(),
                    log: format!(
                        "the kernel lays out {kernel_smem:?} bytes of shared memory, the host {smem}"
                    ),
                });
            }
            func.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )
            .map_err(Error::driver("set the kernel's shared memory"))?;
        } else if v.family == Family::Combine {
            // Its staging rows take up to 68 KB (combine.rs), past the 48 KB default.
            func.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                CombineShape::MAX_SMEM as i32,
            )
            .map_err(Error::driver("set the combine's shared memory"))?;
        }
        self.builds.push(built);
        Ok(func)
    }

    /// Resizes the workspace to `bytes` (only before the workspace is locked).
    ///
    /// # Errors
    /// [`Error::Driver`] when the device memory is not available.
    pub(crate) fn resize_workspace(&mut self, bytes: usize) -> Result<()> {
        // Decodes still running may use the old one; the new one must exist before the next
        // launch, whichever stream it is on.
        self.stream
            .synchronize()
            .map_err(Error::driver("synchronize"))?;
        self.workspace = None; // free first: the new one is larger
        let fresh = self
            .own
            .alloc_zeros::<u8>(bytes.max(1))
            .map_err(Error::driver("allocate the workspace"))?;
        self.own
            .synchronize()
            .map_err(Error::driver("synchronize"))?;
        self.workspace = Some(fresh);
        Ok(())
    }

    /// Waits for the stream, then reports (and clears) the error flag the kernels raise for
    /// bad values: negative lengths, lengths beyond the block table, block ids outside the
    /// cache.
    ///
    /// # Errors
    /// [`Error::DeviceCheck`], [`Error::Driver`].
    pub(crate) fn check_errors(&mut self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(Error::driver("synchronize"))?;
        let flag = self
            .stream
            .clone_dtoh(&self.error_flag)
            .map_err(Error::driver("read the error flag"))?;
        let bits = flag.first().copied().unwrap_or(0);
        if bits != 0 {
            self.stream
                .memset_zeros(&mut self.error_flag)
                .map_err(Error::driver("clear the error flag"))?;
            return Err(Error::DeviceCheck { bits });
        }
        Ok(())
    }

    /// Launches a planned decode on the stream. Returns before the work is done.
    ///
    /// # Errors
    /// [`Error::Stride`] for tensors the kernels cannot read with 16-byte loads,
    /// [`Error::Compile`] or [`Error::Driver`] for a kernel not warmed up that fails to build,
    /// [`Error::Driver`] for a refused launch.
    pub(crate) fn forward(
        &mut self,
        plan: &DecodePlan,
        inputs: &DecodeInputs<'_>,
        outputs: &mut DecodeOutputs<'_>,
    ) -> Result<()> {
        let ptr = pointers(
            plan,
            inputs,
            outputs,
            self.error_flag_ptr(),
            self.workspace_ptr(),
        )?;
        if plan.rows == 0 {
            return Ok(());
        }
        let pick = plan
            .stage1
            .ok_or_else(|| Error::config("num_heads", "the plan was made for another backend"))?;
        // The kernels index with i32 and the grid's y dimension holds at most 65535 (heads
        // were bounded by `configure`).
        let fits_i32 = [
            plan.rows,
            plan.kv.num_blocks,
            plan.kv.page_size,
            plan.max_blocks,
        ]
        .iter()
        .all(|&x| i32::try_from(x).is_ok());
        if !fits_i32 {
            return Err(too_big(plan));
        }
        let (decode, tokens) = (pick.variant, pick.tokens);
        let combine = combine_variant(plan.kv_lora_rank, plan.model_dtype);
        let params = DecodeParams::new(plan, &ptr, tokens);
        // The cache's tensor map, for the kernels that copy the keys by TMA (either grid).
        let kv_map = if decode.takes_tensor_map() {
            Some(self.kv_maps.get(
                tma::MapShape::kv_cache(plan, &decode, ptr.kv),
                tma::MapShape::encode,
            )?)
        } else {
            None
        };
        if decode.grid == Grid::Scheduled {
            let views = plan.schedule_workspace.ok_or_else(|| Error::Overflow {
                what: "workspace",
                detail: "a scheduled decode planned without its views".into(),
            })?;
            return self.forward_scheduled(plan, params, decode, combine, &views, kv_map);
        }
        // A CTA takes `tokens` query tokens of one request and, of each, a block of heads.
        let ctas = plan.requests
            * plan.query_len.div_ceil(tokens)
            * plan.heads.div_ceil(decode.heads_per_cta(plan.heads));
        let grid_x = u32::try_from(ctas).map_err(|_| too_big(plan))?;
        let splits = u32::try_from(plan.num_kv_splits)
            .ok()
            .filter(|&s| s <= 65_535)
            .ok_or_else(|| too_big(plan))?;
        let f = self.kernel(decode)?.clone();
        let (grid, block, smem) = ((grid_x, splits), (decode.threads(), 1), decode.smem_bytes());
        match kv_map {
            Some(kv_map) => {
                let with_map = TmaParams { d: params, kv_map };
                ffi::launch(&self.stream, &f, grid, block, smem as u32, &with_map)?;
            }
            None => ffi::launch(&self.stream, &f, grid, block, smem as u32, &params)?,
        }
        if plan.num_kv_splits > 1 {
            let f = self.kernel(combine)?.clone();
            let shape = CombineShape::new(
                plan.rows,
                plan.heads,
                plan.kv_lora_rank,
                plan.num_kv_splits,
                self.sm_count,
            );
            ffi::launch_with(
                &self.stream,
                &f,
                shape.grid,
                shape.block,
                shape.smem,
                &params,
                self.launch.pdl,
            )?;
        }
        Ok(())
    }

    fn error_flag_ptr(&self) -> u64 {
        address(&self.error_flag, &self.stream)
    }

    fn workspace_ptr(&self) -> u64 {
        self.workspace
            .as_ref()
            .map_or(0, |w| address(w, &self.stream))
    }
}

/// Loads a cubin into `ctx`. A cubin from the disk cache that the driver refuses (a damaged
/// entry) is compiled afresh by `rebuild`, which overwrites the entry, and loaded instead.
///
/// # Errors
/// [`Error::Driver`] (`what`), or `rebuild`'s.
pub(crate) fn load_module(
    ctx: &Arc<CudaContext>,
    cubin: Vec<u8>,
    from_disk: bool,
    what: &'static str,
    rebuild: impl FnOnce() -> Result<Vec<u8>>,
) -> Result<Arc<CudaModule>> {
    match ctx.load_module(Ptx::from_binary(cubin)) {
        Ok(m) => Ok(m),
        Err(_) if from_disk => ctx
            .load_module(Ptx::from_binary(rebuild()?))
            .map_err(Error::driver(what)),
        Err(e) => Err(Error::driver(what)(e)),
    }
}

/// The device address of a slice we own (event tracking is off: ordering is by our stream).
pub(crate) fn address<T>(slice: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    slice.device_ptr(stream).0
}

fn too_big(plan: &DecodePlan) -> Error {
    Error::Overflow {
        what: "launch grid",
        detail: format!(
            "{} rows x {} heads x {} splits",
            plan.rows, plan.heads, plan.num_kv_splits
        ),
    }
}

/// A misaligned-tensor error.
fn misaligned(arg: &'static str, what: &str) -> Error {
    Error::Stride {
        arg,
        reason: format!(
            "the CUDA backend reads and writes it in 16-byte (o: 4-byte) units, so {what}"
        ),
        strides: Vec::new(),
        shape: Vec::new(),
    }
}

/// The device addresses of a decode, after checking the alignment the kernels rely on.
fn pointers(
    plan: &DecodePlan,
    inputs: &DecodeInputs<'_>,
    outputs: &DecodeOutputs<'_>,
    error_flag: u64,
    workspace: u64,
) -> Result<Pointers> {
    let dev = |arg: &'static str, p: Option<u64>| {
        p.ok_or_else(|| Error::memory(arg, "expected a device tensor"))
    };
    let (q_nope, q_rope) = match &inputs.q {
        Query::Packed(q) => {
            let p = dev("q", q.device_ptr())?;
            (p, p)
        }
        Query::Split { nope, rope } => (
            dev("q_nope", nope.device_ptr())?,
            dev("q_pe", rope.device_ptr())?,
        ),
    };
    let kv = dev("kv_cache", inputs.kv_cache.device_ptr())?;
    let elem = plan.kv_format.size();
    // q: rows of L and R values start on 16-byte boundaries.
    let [nr, nh] = plan.q.nope_strides;
    let [rr, rh] = plan.q.rope_strides;
    if q_nope % 16 != 0 || q_rope % 16 != 0 || [nr, nh, rr, rh].iter().any(|s| s % 8 != 0) {
        return Err(misaligned(
            "q",
            "its address and row and head strides must be multiples of 16 bytes",
        ));
    }
    if kv % 16 != 0
        || !(plan.kv.token_stride * elem).is_multiple_of(16)
        || !(plan.kv.page_stride * elem).is_multiple_of(16)
    {
        return Err(misaligned(
            "kv_cache",
            "its address, token stride and page stride must be multiples of 16 bytes",
        ));
    }
    let o = dev("o", outputs.o.device_ptr())?;
    if o % 4 != 0 || plan.o_strides.iter().any(|s| s % 2 != 0) {
        return Err(misaligned(
            "o",
            "its address must be 4-byte aligned and its strides even",
        ));
    }
    let lse = dev("lse", outputs.lse.device_ptr())?;
    let k_scale = match &inputs.k_scale_tensor {
        Some(t) => dev("k_scale", t.device_ptr())?,
        None => 0,
    };
    let q_scale = match &inputs.q_scale_tensor {
        Some(t) if plan.fp8_query => dev("q_scale", t.device_ptr())?,
        _ => 0,
    };
    Ok(Pointers {
        q_nope,
        q_rope,
        kv,
        block_table: dev("block_table", inputs.block_table.device_ptr())?,
        seq_lens: dev("seq_lens", inputs.seq_lens.device_ptr())?,
        o,
        lse,
        workspace,
        error_flag,
        k_scale,
        q_scale,
    })
}
