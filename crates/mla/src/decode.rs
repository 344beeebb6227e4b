//! [`MlaDecode`]: the object a serving engine keeps, one per model configuration (every
//! layer of a model can share it). It ties the pieces together in the one direction data
//! flows: configuration -> plan -> backend.

use crate::args::{DecodeInputs, DecodeOutputs};
use crate::backend::{Backend, Device};
use crate::config::{DeviceInfo, MlaConfig, ValidConfig};
use crate::dtype::CacheDtype;
use crate::error::{Error, Result};
use crate::plan::{self, DecodePlan, Planner, SplitRule, WorkspaceManager};
use crate::tensor::{Location, TensorRef};

/// An MLA decoder: a validated configuration, a backend and its workspace.
///
/// ```
/// use half::bf16;
/// use mla::{DecodeInputs, DecodeOutputs, Device, MlaConfig, MlaDecode, Query, TensorMut, TensorRef};
///
/// let (heads, page, blocks) = (16, 64, 4);
/// let mut dec = MlaDecode::new(&MlaConfig::new(heads, 192f32.powf(-0.5)), Device::Cpu)?;
/// dec.reserve_workspace(8, 4096)?; // worst case: 8 rows, 4096 keys
/// dec.lock_workspace();
///
/// let q = vec![bf16::from_f32(0.1); 2 * heads * 576];
/// let kv = vec![bf16::from_f32(0.2); blocks * page * 576];
/// let block_table = vec![0i32, 1, 2, 3];
/// let seq_lens = vec![100i32, 30];
/// let inputs = DecodeInputs::new(
///     Query::Packed(TensorRef::contiguous(&q, [2, heads, 576])?),
///     TensorRef::contiguous(&kv, [blocks, page, 576])?,
///     TensorRef::contiguous(&block_table, [2, 2])?,
///     TensorRef::contiguous(&seq_lens, [2])?,
/// );
/// let mut o = vec![bf16::ZERO; 2 * heads * 512];
/// let mut lse = vec![0f32; 2 * heads];
/// let mut outputs = DecodeOutputs {
///     o: TensorMut::contiguous(&mut o, [2, heads, 512])?,
///     lse: TensorMut::contiguous(&mut lse, [2, heads])?,
/// };
/// dec.forward(&inputs, &mut outputs)?;
/// // Every key is the same, so the output is that key's value part.
/// assert!((o[0].to_f32() - 0.2).abs() < 1e-3);
/// # Ok::<(), mla::Error>(())
/// ```
#[derive(Debug)]
pub struct MlaDecode {
    planner: Planner,
    device: DeviceInfo,
    backend: Backend,
    workspace: WorkspaceManager,
    max_model_len: Option<usize>,
}

impl MlaDecode {
    /// Validates `config` for `device` and opens its backend.
    ///
    /// # Errors
    /// The configuration errors of [`MlaConfig::validate`]; [`Error::CudaNotCompiled`] or
    /// [`Error::NoCudaDevice`] for a GPU that cannot be used.
    pub fn new(config: &MlaConfig, device: Device) -> Result<Self> {
        let (mut backend, info) = Backend::open(device)?;
        let config = config.validate(&info)?;
        backend.configure(&config)?;
        let planner = Planner::new(config, &info)?;
        if let Some(k) = planner.kernels() {
            tracing::debug!(
                decode = %k.decode,
                packed = ?k.packed.map(|v| v.to_string()),
                narrow = ?k.narrow.map(|v| v.to_string()),
                seesaw = ?k.seesaw.map(|v| v.to_string()),
                fp8_twin = ?k.fp8.map(|v| v.to_string()),
                schedule = k.schedule,
                "decoder kernels chosen"
            );
        }
        Ok(MlaDecode {
            planner,
            device: info,
            backend,
            workspace: WorkspaceManager::new(),
            max_model_len: None,
        })
    }

    /// The validated configuration.
    pub fn config(&self) -> &ValidConfig {
        self.planner.config()
    }

    /// How the decoder cuts rows into splits (vLLM's rule on the CPU, the fill rule on a GPU,
    /// one split in batch-invariant mode, or the configuration's fixed count).
    pub fn split_rule(&self) -> SplitRule {
        self.planner.rule()
    }

    /// Whether decodes of two or more requests take the device-computed schedule
    /// ([`MlaConfig::device_schedule`] on a GPU decoder whose split count is the fill rule's).
    pub fn schedules(&self) -> bool {
        self.planner.schedules()
    }

    /// The device the decoder runs on.
    pub fn device(&self) -> &DeviceInfo {
        &self.device
    }

    /// The backend's name (`cpu`, `cuda`).
    pub fn backend_name(&self) -> &'static str {
        self.backend.name()
    }

    /// What computes stage 1 of a planned decode: the CPU path (`cpu-avx512-bf16`,
    /// `cpu-portable`) or the GPU kernel family ([`crate::KernelFamily::name`]: `mma`,
    /// `wgmma`, `narrow`, `seesaw`, `wgmma-fp8`), so that a measurement can say which kernel
    /// it timed.
    pub fn kernel_name(&self, plan: &DecodePlan) -> &'static str {
        plan.kernel()
            .map_or(self.backend.kernel_name(), |k| k.name())
    }

    /// Where the decode's tensors must live.
    pub fn location(&self) -> Location {
        self.backend.location()
    }

    /// The CUDA stream decodes are launched on (None on the CPU). Put the decode's tensors in
    /// memory ordered on it (allocate and copy on it, or make your streams wait for it).
    #[cfg(feature = "cuda")]
    pub fn cuda_stream(&self) -> Option<&std::sync::Arc<cudarc::driver::CudaStream>> {
        self.backend.cuda().map(|b| b.stream())
    }

    /// Launches decodes on `stream` from now on (for example torch's current stream, wrapped
    /// with cudarc's `CudaContext::wrap_borrowed_stream` on [`MlaDecode::cuda_context`]).
    ///
    /// # Errors
    /// [`Error::NoCudaDevice`] on a CPU decoder or for a stream of another device,
    /// [`Error::Driver`].
    #[cfg(feature = "cuda")]
    pub fn set_cuda_stream(
        &mut self,
        stream: std::sync::Arc<cudarc::driver::CudaStream>,
    ) -> Result<()> {
        match self.backend.cuda_mut() {
            Some(b) => b.set_stream(stream),
            None => Err(Error::NoCudaDevice("this decoder runs on the CPU".into())),
        }
    }

    /// The CUDA context of a GPU decoder (the device's primary context).
    #[cfg(feature = "cuda")]
    pub fn cuda_context(&self) -> Option<&std::sync::Arc<cudarc::driver::CudaContext>> {
        self.backend.cuda().map(|b| b.context())
    }

    /// The CUDA backend itself (None on the CPU): its target, the kernels it built.
    #[cfg(feature = "cuda")]
    pub fn cuda_backend(&self) -> Option<&crate::backend::cuda::CudaBackend> {
        self.backend.cuda()
    }

    /// The CUDA backend, mutable (to load kernels ahead, as `mla precompile` does).
    #[cfg(feature = "cuda")]
    pub fn cuda_backend_mut(&mut self) -> Option<&mut crate::backend::cuda::CudaBackend> {
        self.backend.cuda_mut()
    }

    /// Waits for the device, then reports what its kernels flagged since the last check:
    /// negative lengths, lengths beyond the block table, block ids outside the cache. A GPU
    /// decode never waits for the device itself, so such errors surface here (on the CPU they
    /// are returned by `forward` before anything runs).
    ///
    /// # Errors
    /// [`Error::DeviceCheck`] naming what was found.
    pub fn check_device_errors(&mut self) -> Result<()> {
        self.backend.check_errors()
    }

    /// The split count a batch of `rows` query rows (`query_len` a request) whose longest
    /// length is `max_kv_len` gets over a cache of pages of `page_size` keys (vLLM's rule on
    /// the CPU, the fill rule on a GPU; clamped to the window; 1 in batch-invariant mode).
    pub fn num_kv_splits(
        &self,
        max_kv_len: usize,
        rows: usize,
        query_len: usize,
        page_size: usize,
    ) -> usize {
        self.planner.splits(max_kv_len, rows, query_len, page_size)
    }

    /// Reserves the workspace for the worst case: `max_rows` query rows (max sequences times
    /// the largest query_len) over `max_model_len` keys (clamped to the window).
    ///
    /// # Errors
    /// [`Error::WorkspaceLocked`] if that needs more than a locked workspace holds;
    /// [`Error::Overflow`].
    pub fn reserve_workspace(&mut self, max_rows: usize, max_model_len: usize) -> Result<()> {
        let c = self.planner.config();
        let row_splits = self.planner.max_row_splits(max_rows, max_model_len);
        // The views are sized by rows x splits, so one "row" of that many splits is the worst.
        let (_, mut bytes) = plan::decode_workspace(row_splits, c.q_heads, 1, c.kv_lora_rank)?;
        // `max_rows` bounds the requests: one row is one request, which never schedules.
        if self.planner.schedules_requests(max_rows) {
            let (_, scheduled) =
                plan::scheduled_workspace(max_rows, c.q_heads, c.kv_lora_rank, c.sm_count)?;
            bytes = bytes.max(scheduled);
        }
        self.grow_workspace(bytes)?;
        self.max_model_len = Some(
            self.max_model_len
                .map_or(max_model_len, |m| m.max(max_model_len)),
        );
        Ok(())
    }

    /// The longest `max_model_len` reserved for so far (None before
    /// [`MlaDecode::reserve_workspace`]).
    pub fn reserved_model_len(&self) -> Option<usize> {
        self.max_model_len
    }

    /// Forbids the workspace to grow: from now on a decode that needs more is an error.
    pub fn lock_workspace(&mut self) {
        self.workspace.lock();
    }

    /// Bytes the workspace holds.
    pub fn workspace_bytes(&self) -> usize {
        self.workspace.size()
    }

    /// The split counts a decode can use up to the reserved `max_model_len`.
    ///
    /// # Errors
    /// [`Error::NotReserved`] before [`MlaDecode::reserve_workspace`].
    pub fn warmup_split_counts(&self) -> Result<Vec<usize>> {
        let max = self
            .max_model_len
            .ok_or(Error::NotReserved("register_decode_warmup"))?;
        Ok(self.planner.warmup_counts(max))
    }

    /// Prepares every variant forward can pick for this cache (its dtype, page size and
    /// strides) and returns the split counts covered: on the GPU it compiles (or reads from
    /// the disk cache) and loads every kernel forward can launch, so that forward never
    /// compiles; the CPU backend only checks the cache and reports the set.
    ///
    /// # Errors
    /// [`Error::CacheDtypeMismatch`], and [`Error::WrongDevice`], [`Error::Dtype`],
    /// [`Error::Shape`] or [`Error::Stride`] for a cache this decoder cannot read (the checks
    /// of a decode),
    /// [`Error::NotReserved`].
    pub fn register_decode_warmup(
        &mut self,
        kv_cache: &TensorRef<'_, 3>,
        kv_cache_dtype: CacheDtype,
    ) -> Result<Vec<usize>> {
        let cfg = self.planner.config();
        let configured = cfg.cache_dtype;
        let same = kv_cache_dtype.resolve(cfg.model_dtype)? == cfg.kv_format;
        if !same {
            return Err(Error::CacheDtypeMismatch {
                configured: configured.to_string(),
                got: kv_cache_dtype.to_string(),
            });
        }
        plan::check_kv_cache(cfg, kv_cache, self.backend.location())?;
        let counts = self.warmup_split_counts()?;
        if let Some(k) = self.planner.kernels() {
            self.backend.warmup(&k.variants())?;
        }
        Ok(counts)
    }

    /// Checks and plans a decode call without running it.
    ///
    /// # Errors
    /// See `DecodePlan::new`.
    pub fn plan(
        &self,
        inputs: &DecodeInputs<'_>,
        outputs: &DecodeOutputs<'_>,
    ) -> Result<DecodePlan> {
        DecodePlan::new(
            &self.planner,
            inputs,
            outputs,
            self.backend.location(),
            self.max_model_len,
        )
    }

    /// Decodes: writes o and lse for every query row. Returns the plan it ran.
    ///
    /// # Errors
    /// Argument errors (see `DecodePlan::new`), value errors (negative lengths, lengths
    /// beyond the block table, block ids outside the cache) and [`Error::WorkspaceLocked`].
    /// On error the outputs are left untouched.
    pub fn forward(
        &mut self,
        inputs: &DecodeInputs<'_>,
        outputs: &mut DecodeOutputs<'_>,
    ) -> Result<DecodePlan> {
        let plan = self.plan(inputs, outputs)?;
        self.grow_workspace(plan.workspace_bytes)?;
        self.backend.forward(&plan, inputs, outputs)?;
        Ok(plan)
    }

    fn grow_workspace(&mut self, bytes: usize) -> Result<()> {
        if bytes > self.workspace.size() {
            tracing::debug!(from = self.workspace.size(), to = bytes, "workspace grows");
        }
        let backend = &mut self.backend;
        self.workspace
            .ensure(bytes, |size| backend.resize_workspace(size))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reservation_is_the_longest_asked_for() {
        let mut dec = MlaDecode::new(&MlaConfig::new(16, 0.1), Device::Cpu).unwrap();
        assert_eq!(dec.reserved_model_len(), None);
        dec.reserve_workspace(4, 8192).unwrap();
        dec.reserve_workspace(8, 1024).unwrap();
        assert_eq!(dec.reserved_model_len(), Some(8192));
        let bytes = dec.workspace_bytes();
        let (_, one_row) = plan::decode_workspace(1, 16, 1, 512).unwrap();
        assert!(bytes >= 8 * one_row, "8 rows reserved, {bytes} bytes");
    }

    #[test]
    fn a_decoder_can_move_between_threads() {
        fn send<T: Send>() {}
        send::<MlaDecode>();
    }
}
