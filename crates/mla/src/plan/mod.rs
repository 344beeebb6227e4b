//! The plan: everything about a decode call that can be decided on the host from the
//! configuration and the arguments' metadata, before any kernel runs.
//!
//! `DecodePlan::new` checks the arguments in a fixed order (dtypes, devices, shapes,
//! strides, batch structure, values) and records what the backends need: sizes, strides,
//! the split count and the workspace views. Backends execute a plan; they never re-derive it.
//!
//! `Planner` holds what is decided once per decoder: the split rule, the GPU kernels it may
//! launch (`kernel::KernelSet`) and whether it takes the device schedule.
//!
//! - [`extents`]: which keys each query row sees.
//! - [`kernel`]: which stage-1 kernel variant runs a decode (the one place that decides it).
//! - [`splits`]: the split count and each split's keys.
//! - [`workspace`]: the locked scratch buffer and its aligned views.
//! - [`schedule`]: the work schedule of a scheduled GPU decode (the GPU scheduler's
//!   reference).

pub mod extents;
pub mod kernel;
pub mod schedule;
pub mod splits;
pub mod workspace;

pub use extents::{KeyRange, Mask, key_range};
pub use splits::{SplitRule, num_kv_splits, split_range, warmup_split_counts};

use self::kernel::{Gpu, KernelSet, Pick};
use self::splits::Batch;
pub use workspace::{Region, WorkspaceManager};

use crate::args::host_scale;
use crate::args::{DecodeInputs, DecodeOutputs, Query};
use crate::config::{DeviceInfo, ValidConfig};
use crate::dtype::{DType, KvFormat, ModelDtype};
use crate::error::{Error, Result};
use crate::kernels::KernelFamily;
use crate::tensor::{Location, TensorRef};

/// Where the q parts are: element strides of the latent and rotary parts (for a packed q both
/// parts share the tensor and the rotary part starts at column L).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueryLayout {
    /// Whether q is one `[rows, H, D]` tensor.
    pub packed: bool,
    /// Row and head strides of the latent part.
    pub nope_strides: [usize; 2],
    /// Row and head strides of the rotary part.
    pub rope_strides: [usize; 2],
}

/// Geometry of the paged cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheLayout {
    /// Blocks (pages) in the cache.
    pub num_blocks: usize,
    /// Keys per page.
    pub page_size: usize,
    /// Elements from one page to the next.
    pub page_stride: usize,
    /// Elements from one key to the next within a page.
    pub token_stride: usize,
}

/// A checked decode call.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodePlan {
    /// Query rows (requests * query_len).
    pub rows: usize,
    /// Requests.
    pub requests: usize,
    /// Query tokens per request.
    pub query_len: usize,
    /// Mask among a request's query tokens.
    pub mask: Mask,
    /// Sliding window.
    pub window: Option<usize>,
    /// Heads in q and o.
    pub heads: usize,
    /// L.
    pub kv_lora_rank: usize,
    /// R.
    pub rope_dim: usize,
    /// Softmax scale.
    pub scale: f32,
    /// q and o dtype.
    pub model_dtype: ModelDtype,
    /// Cache storage format.
    pub kv_format: KvFormat,
    /// Scale of an fp8 cache (1 otherwise).
    pub k_scale: f32,
    /// The fp8-query mode: q quantized to e4m3 with `q_scale`, P rounded to e4m3.
    pub fp8_query: bool,
    /// Scale of the fp8-query mode's q (1 otherwise).
    pub q_scale: f32,
    /// Splits per row (the configuration's rule, 1 in batch-invariant mode).
    pub num_kv_splits: usize,
    /// The most keys a row's splits cover: the batch's longest length (or the bound that
    /// stands in for it), within the window. The split rule's input.
    pub max_span: usize,
    /// q geometry.
    pub q: QueryLayout,
    /// Cache geometry.
    pub kv: CacheLayout,
    /// Entries per block-table row.
    pub max_blocks: usize,
    /// Elements from one block-table row to the next.
    pub block_table_stride: usize,
    /// Row and head strides of o.
    pub o_strides: [usize; 2],
    /// Row stride of lse.
    pub lse_stride: usize,
    /// Workspace views: split partial outputs `[rows, splits, H, L]` f32 and their LSEs
    /// `[rows, splits, H]` f32.
    pub workspace: [Region; 2],
    /// Workspace views of a scheduled decode (when the configuration schedules): partial
    /// outputs and LSEs by piece slot, and the schedule's integers ([`scheduled_workspace`]).
    /// They overlap `workspace`: a decode takes one layout or the other.
    pub schedule_workspace: Option<ScheduledViews>,
    /// Bytes the workspace must hold for this call.
    pub workspace_bytes: usize,
    /// The stage-1 variant a GPU decoder launches (None on the CPU).
    pub(crate) stage1: Option<Pick>,
}

/// What is decided once per decoder, from its validated configuration and its device: how
/// rows are cut into splits, the GPU kernels it may launch, whether it takes the device
/// schedule. Every decode's plan is made from it (`DecodePlan::new`).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Planner {
    cfg: ValidConfig,
    rule: SplitRule,
    kernels: Option<KernelSet>,
}

impl Planner {
    /// The planner of a decoder on `device`.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when the device cannot run the configuration's kernels.
    pub(crate) fn new(cfg: ValidConfig, device: &DeviceInfo) -> Result<Planner> {
        let gpu = Gpu::of(device);
        // Batch-invariant mode: one split. Else a fixed count where asked; else the CPU
        // backend, the reference, follows vLLM's rule, and a GPU picks its count with a small
        // cost model of the kernels it runs.
        let rule = match (cfg.num_kv_splits, gpu) {
            _ if cfg.batch_invariant => SplitRule::Single,
            (Some(splits), _) => SplitRule::Fixed { splits },
            (None, None) => SplitRule::Vllm {
                sm_count: cfg.sm_count,
            },
            (None, Some(_)) => SplitRule::Fill {
                sm_count: cfg.sm_count,
                kv_lora_rank: cfg.kv_lora_rank,
            },
        };
        let fills = matches!(rule, SplitRule::Fill { .. });
        let kernels = match gpu {
            Some(gpu) => Some(KernelSet::for_decoder(&cfg, gpu, fills)?),
            None => None,
        };
        Ok(Planner { cfg, rule, kernels })
    }

    /// The validated configuration.
    pub(crate) fn config(&self) -> &ValidConfig {
        &self.cfg
    }

    /// The split rule.
    pub(crate) fn rule(&self) -> SplitRule {
        self.rule
    }

    /// The GPU kernels (None on the CPU).
    pub(crate) fn kernels(&self) -> Option<&KernelSet> {
        self.kernels.as_ref()
    }

    /// Whether decodes of two or more requests take the device-computed schedule.
    pub(crate) fn schedules(&self) -> bool {
        self.kernels.as_ref().is_some_and(|k| k.schedule)
    }

    /// Whether a decode of `requests` requests (or at most that many) takes the
    /// device-computed schedule: where the decoder does and there are two or more. One
    /// request has nothing to balance: the split grid already gives it an even share of the
    /// keys a CTA, without the schedule kernel and its pieces (10 to 20 us on the H200 at
    /// batch 1).
    pub(crate) fn schedules_requests(&self, requests: usize) -> bool {
        self.schedules() && requests > 1
    }

    /// Splits per row for `rows` query rows (`query_len` a request) whose longest length is
    /// `max_seq`, over a cache of pages of `page_size` keys.
    pub(crate) fn splits(
        &self,
        max_seq: usize,
        rows: usize,
        query_len: usize,
        page_size: usize,
    ) -> usize {
        self.rule.splits(
            self.kernels(),
            &self.batch(max_seq, rows, query_len, page_size),
        )
    }

    fn batch(&self, max_seq: usize, rows: usize, query_len: usize, page_size: usize) -> Batch {
        Batch {
            max_span: self.cfg.span(max_seq),
            rows,
            query_len,
            heads: self.cfg.q_heads,
            page_size,
        }
    }

    /// The most `rows x splits` a batch of at most `max_rows` rows over at most
    /// `max_model_len` keys can need.
    pub(crate) fn max_row_splits(&self, max_rows: usize, max_model_len: usize) -> usize {
        let c = &self.cfg;
        self.rule
            .max_row_splits(self.kernels(), max_rows, c.span(max_model_len), c.q_heads)
    }

    /// The split counts a decode can use up to `max_model_len` keys.
    pub(crate) fn warmup_counts(&self, max_model_len: usize) -> Vec<usize> {
        let c = &self.cfg;
        self.rule
            .warmup_counts(self.kernels(), c.span(max_model_len), c.q_heads)
    }

    /// The stage-1 variant of a decode (None on the CPU).
    fn pick(&self, b: &Batch, splits: usize, scheduled: bool) -> Option<Pick> {
        let call = kernel::Call {
            scheduled,
            ..b.call(splits)
        };
        self.kernels.as_ref().map(|k| k.pick(&call))
    }
}

impl DecodePlan {
    /// The stage-1 kernel family that runs this decode (None on the CPU backend).
    pub fn kernel(&self) -> Option<KernelFamily> {
        self.stage1.map(|p| p.family())
    }

    /// Query tokens of a request each stage-1 CTA takes (1 unless tokens pack; 1 on the CPU).
    pub fn tokens_per_cta(&self) -> usize {
        self.stage1.map_or(1, |p| p.tokens)
    }

    /// Whether the decode runs on the device-computed schedule.
    pub fn scheduled(&self) -> bool {
        self.stage1
            .is_some_and(|p| p.variant.grid == crate::kernels::variant::Grid::Scheduled)
    }

    /// Row width D = L + R.
    pub fn head_dim(&self) -> usize {
        self.kv_lora_rank + self.rope_dim
    }

    /// The most keys one split holds: the first split of [`max_span`](Self::max_span) keys
    /// cut as every row is ([`split_range`]). What decides between the Hopper kernels for
    /// many heads.
    pub fn split_keys(&self) -> usize {
        let span = KeyRange {
            start: 0,
            end: self.max_span,
        };
        split_range(span, 0, self.num_kv_splits.max(1)).len()
    }

    /// Keys row `row` sees, from its request's length.
    pub fn row_keys(&self, row: usize, seq_len: usize) -> KeyRange {
        key_range(
            seq_len,
            row % self.query_len,
            self.query_len,
            self.mask,
            self.window,
        )
    }

    /// Checks a decode call and plans it.
    ///
    /// `location` is where the backend runs; `max_model_len` (from the workspace reservation)
    /// stands in for the batch's longest length when seq_lens are on the device and the caller
    /// gave no `max_seq_len`.
    ///
    /// # Errors
    /// [`Error::Dtype`], [`Error::WrongDevice`], [`Error::Shape`], [`Error::Stride`],
    /// [`Error::NonUniformDecode`], [`Error::QueryLen`], [`Error::CausalMultiTokenWithDcp`],
    /// [`Error::KScale`], [`Error::QScale`], [`Error::NegativeSeqLen`] (host seq_lens), [`Error::Overflow`].
    pub(crate) fn new(
        planner: &Planner,
        inputs: &DecodeInputs<'_>,
        outputs: &DecodeOutputs<'_>,
        location: Location,
        max_model_len: Option<usize>,
    ) -> Result<DecodePlan> {
        let cfg = planner.config();
        let (h, l, r) = (cfg.q_heads, cfg.kv_lora_rank, cfg.rope_dim);
        let d = l + r;
        let model = cfg.model_dtype.storage();

        // 1. dtypes
        match &inputs.q {
            Query::Packed(q) => dtype("q", q.dtype(), model)?,
            Query::Split { nope, rope } => {
                dtype("q_nope", nope.dtype(), model)?;
                dtype("q_pe", rope.dtype(), model)?;
            }
        }
        check_kv_cache(cfg, &inputs.kv_cache, location)?;
        dtype("block_table", inputs.block_table.dtype(), DType::I32)?;
        dtype("seq_lens", inputs.seq_lens.dtype(), DType::I32)?;
        dtype("o", outputs.o.dtype(), model)?;
        dtype("lse", outputs.lse.dtype(), DType::F32)?;

        // 2. devices (q first, as the arguments come; nothing allocated on this path)
        let on_device = |arg: &'static str, got: Location| on_device(arg, got, location);
        match &inputs.q {
            Query::Packed(q) => on_device("q", q.location())?,
            Query::Split { nope, rope } => {
                on_device("q_nope", nope.location())?;
                on_device("q_pe", rope.location())?;
            }
        }
        on_device("block_table", inputs.block_table.location())?;
        on_device("seq_lens", inputs.seq_lens.location())?;
        on_device("o", outputs.o.location())?;
        on_device("lse", outputs.lse.location())?;

        // 3. shapes
        let rows = inputs.q.rows();
        let q = match &inputs.q {
            Query::Packed(q) => {
                shape("q", q.shape(), [Dim::Any("rows"), Dim::Is(h), Dim::Is(d)])?;
                last_contiguous("q", q.shape(), q.strides())?;
                let s = [q.strides()[0], q.strides()[1]];
                QueryLayout {
                    packed: true,
                    nope_strides: s,
                    rope_strides: s,
                }
            }
            Query::Split { nope, rope } => {
                shape(
                    "q_nope",
                    nope.shape(),
                    [Dim::Any("rows"), Dim::Is(h), Dim::Is(l)],
                )?;
                shape(
                    "q_pe",
                    rope.shape(),
                    [Dim::Is(rows), Dim::Is(h), Dim::Is(r)],
                )?;
                last_contiguous("q_nope", nope.shape(), nope.strides())?;
                last_contiguous("q_pe", rope.shape(), rope.strides())?;
                QueryLayout {
                    packed: false,
                    nope_strides: [nope.strides()[0], nope.strides()[1]],
                    rope_strides: [rope.strides()[0], rope.strides()[1]],
                }
            }
        };
        let kv = inputs.kv_cache;
        let [num_blocks, page_size, _] = kv.shape();
        let requests = inputs.seq_lens.shape()[0];
        shape(
            "block_table",
            inputs.block_table.shape(),
            [Dim::Is(requests), Dim::Any("max_blocks")],
        )?;
        shape(
            "o",
            outputs.o.shape(),
            [Dim::Is(rows), Dim::Is(h), Dim::Is(l)],
        )?;
        shape("lse", outputs.lse.shape(), [Dim::Is(rows), Dim::Is(h)])?;

        // 4. strides
        let [page_stride, token_stride, _] = kv.strides();
        let bt = inputs.block_table;
        let max_blocks = bt.shape()[1];
        last_contiguous("block_table", bt.shape(), bt.strides())?;
        if inputs.seq_lens.strides()[0] != 1 && requests > 1 {
            return Err(stride(
                "seq_lens",
                "seq_lens must be contiguous",
                &inputs.seq_lens.strides(),
                &inputs.seq_lens.shape(),
            ));
        }
        let o = &outputs.o;
        last_contiguous("o", o.shape(), o.strides())?;
        let [o_row, o_head, _] = o.strides();
        if (h > 1 && o_head < l) || (rows > 1 && o_row < (h - 1) * o_head + l) {
            return Err(stride(
                "o",
                "output rows or heads overlap",
                &o.strides(),
                &o.shape(),
            ));
        }
        let lse = &outputs.lse;
        last_contiguous("lse", lse.shape(), lse.strides())?;
        if rows > 1 && lse.strides()[0] < h {
            return Err(stride(
                "lse",
                "lse rows overlap",
                &lse.strides(),
                &lse.shape(),
            ));
        }

        // 5. batch structure
        if inputs.query_len == 0 {
            return Err(Error::config("query_len", "expected at least 1, got 0"));
        }
        if !rows.is_multiple_of(requests) {
            return Err(Error::NonUniformDecode { rows, requests });
        }
        if requests != 0 && rows / requests != inputs.query_len {
            return Err(Error::QueryLen {
                expected: rows / requests,
                got: inputs.query_len,
                rows,
                requests,
            });
        }
        if cfg.dcp_world_size > 1 && inputs.query_len > 1 && inputs.mask == Mask::Causal {
            return Err(Error::CausalMultiTokenWithDcp);
        }

        // 6. values known on the host
        // A scale in device memory is read by the kernels; one on the host is checked here.
        let k_scale = checked_scale(
            "k_scale",
            cfg.kv_format.is_fp8(),
            inputs.k_scale,
            inputs.k_scale_tensor.as_ref(),
            location,
            Error::KScale,
        )?;
        let q_scale = checked_scale(
            "q_scale",
            cfg.fp8_query,
            inputs.q_scale,
            inputs.q_scale_tensor.as_ref(),
            location,
            Error::QScale,
        )?;
        let host_max = match inputs.seq_lens.host_slice::<i32>() {
            Some(lens) => Some(max_seq_len(lens, max_blocks, page_size)?),
            None => None,
        };
        let max_seq =
            inputs
                .max_seq_len
                .or(host_max)
                .or(max_model_len)
                .ok_or(Error::NotReserved(
                    "a decode with seq_lens on the device and no max_seq_len",
                ))?;

        let batch = planner.batch(max_seq, rows, inputs.query_len, page_size);
        let num_kv_splits = planner.rule.splits(planner.kernels(), &batch);
        let scheduled = planner.schedules_requests(requests);
        let stage1 = planner.pick(&batch, num_kv_splits, scheduled);
        tracing::debug!(
            rule = ?planner.rule,
            rows,
            max_span = batch.max_span,
            splits = num_kv_splits,
            kernel = ?stage1.map(|p| p.family()),
            tokens_per_cta = stage1.map_or(1, |p| p.tokens),
            scheduled,
            "decode planned"
        );
        let (workspace, mut workspace_bytes) = decode_workspace(rows, h, num_kv_splits, l)?;
        let schedule_workspace = if scheduled {
            let (views, bytes) = scheduled_workspace(rows, h, l, cfg.sm_count)?;
            workspace_bytes = workspace_bytes.max(bytes);
            Some(views)
        } else {
            None
        };

        Ok(DecodePlan {
            rows,
            requests,
            query_len: inputs.query_len,
            mask: inputs.mask,
            window: cfg.sliding_window,
            heads: h,
            kv_lora_rank: l,
            rope_dim: r,
            scale: cfg.scale,
            model_dtype: cfg.model_dtype,
            kv_format: cfg.kv_format,
            k_scale,
            fp8_query: cfg.fp8_query,
            q_scale,
            num_kv_splits,
            max_span: cfg.span(max_seq),
            q,
            kv: CacheLayout {
                num_blocks,
                page_size,
                page_stride,
                token_stride,
            },
            max_blocks,
            block_table_stride: bt.strides()[0],
            o_strides: [o_row, o_head],
            lse_stride: lse.strides()[0],
            workspace,
            schedule_workspace,
            workspace_bytes,
            stage1,
        })
    }
}

/// The workspace views of a decode: partial outputs `[rows, splits, heads, L]` f32 and their
/// LSEs `[rows, splits, heads]` f32. Used by the plan and by the worst-case reservation, so
/// the two always agree.
pub fn decode_workspace(
    rows: usize,
    heads: usize,
    splits: usize,
    kv_lora_rank: usize,
) -> Result<([Region; 2], usize)> {
    let overflow = || Error::Overflow {
        what: "workspace",
        detail: format!("{rows} rows x {heads} heads x {splits} splits x {kv_lora_rank} values"),
    };
    let lse = rows
        .checked_mul(heads)
        .and_then(|x| x.checked_mul(splits))
        .and_then(|x| x.checked_mul(4))
        .ok_or_else(overflow)?;
    let o = lse.checked_mul(kv_lora_rank).ok_or_else(overflow)?;
    workspace::layout([o, lse])
}

/// The workspace views of a scheduled decode, and the SM count they were sized for (the
/// backend shares the schedule among that many SMs' CTAs, so the two always agree).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScheduledViews {
    /// Partial outputs `[slot rows, L]` f32.
    pub partial_o: Region,
    /// Their LSEs `[slot rows]` f32.
    pub partial_lse: Region,
    /// The schedule's i32s ([`schedule::ScheduledGrid::int_offsets`]).
    pub ints: Region,
    /// SMs the schedule is shared among.
    pub sm_count: usize,
}

/// The workspace views of a scheduled decode of `rows` query rows over `heads` heads on
/// `sm_count` SMs, for any stage-1 kernel that schedules, and the bytes they take. A CTA takes
/// 16 to 64 heads and an SM at most 64 heads' worth of CTAs, so a grid's slot rows
/// ([`schedule::ScheduledGrid::partial_rows`]) are at most rows x (heads + 63) plus 64 x
/// SMs (or one CTA a head block, heads + 63, where there are more head blocks than that),
/// and its integers at most those of one head block on two CTAs an SM.
pub fn scheduled_workspace(
    rows: usize,
    heads: usize,
    kv_lora_rank: usize,
    sm_count: usize,
) -> Result<(ScheduledViews, usize)> {
    let sizes = (|| {
        let slot_rows = rows
            .checked_mul(heads.checked_add(63)?)?
            .checked_add(sm_count.checked_mul(64)?.max(heads.checked_add(63)?))?;
        let lse = slot_rows.checked_mul(4)?;
        // The most integers: one head block, two CTAs an SM (no larger than the slot rows
        // just checked, so they cannot overflow).
        let ints = schedule::ScheduledGrid::new(rows, 16, 16, 2, sm_count).ints();
        Some([lse.checked_mul(kv_lora_rank)?, lse, ints.checked_mul(4)?])
    })()
    .ok_or_else(|| Error::Overflow {
        what: "workspace",
        detail: format!("a schedule of {rows} rows x {heads} heads on {sm_count} SMs"),
    })?;
    let ([partial_o, partial_lse, ints], bytes) = workspace::layout(sizes)?;
    let views = ScheduledViews {
        partial_o,
        partial_lse,
        ints,
        sm_count,
    };
    Ok((views, bytes))
}

/// A per-tensor scale (`name`, given as `value` or a one-element `tensor`): the tensor's
/// dtype, shape and device (`location`) checked; when the decode `uses` the scale, a value on
/// the host must be finite and positive (`err` otherwise), and one in device memory is read
/// and checked by the kernels, which get `value` meanwhile. 1 when unused.
fn checked_scale(
    name: &'static str,
    uses: bool,
    value: f32,
    tensor: Option<&TensorRef<'_, 1>>,
    location: Location,
    err: fn(f32) -> Error,
) -> Result<f32> {
    if let Some(t) = tensor {
        dtype(name, t.dtype(), DType::F32)?;
        shape(name, t.shape(), [Dim::Is(1)])?;
        on_device(name, t.location(), location)?;
    }
    match (uses, host_scale(value, tensor)) {
        (false, _) => Ok(1.0),
        (true, Some(k)) if k.is_finite() && k > 0.0 => Ok(k),
        (true, Some(k)) => Err(err(k)),
        (true, None) => Ok(value),
    }
}

/// The longest length in host seq_lens; an error for a negative one.
/// The longest of host lengths, each checked: not negative, not beyond the block table's
/// `max_blocks` pages of `page_size` keys.
fn max_seq_len(lens: &[i32], max_blocks: usize, page_size: usize) -> Result<usize> {
    let capacity = max_blocks.saturating_mul(page_size);
    let mut max = 0usize;
    for (request, &len) in lens.iter().enumerate() {
        let len = usize::try_from(len).map_err(|_| Error::NegativeSeqLen { request, len })?;
        if len > capacity {
            return Err(Error::SeqLenBeyondBlockTable {
                request,
                len,
                capacity,
                max_blocks,
                page_size,
            });
        }
        max = max.max(len);
    }
    Ok(max)
}

/// An argument's memory must be where the backend runs.
fn on_device(arg: &'static str, got: Location, want: Location) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(Error::WrongDevice {
            arg,
            expected: want.to_string(),
            got: got.to_string(),
        })
    }
}

/// The cache checks a decode and its warmup share: memory at `location` (the backend's),
/// the storage dtype of the configured format, the shape `[num_blocks >= 1, page_size >= 1,
/// D]`, contiguous rows, and token and page strides under which no two keys overlap.
///
/// # Errors
/// [`Error::WrongDevice`], [`Error::Dtype`], [`Error::Shape`], [`Error::Stride`] for the
/// argument `kv_cache`.
pub(crate) fn check_kv_cache(
    cfg: &ValidConfig,
    kv: &crate::tensor::TensorRef<'_, 3>,
    location: Location,
) -> Result<()> {
    on_device("kv_cache", kv.location(), location)?;
    if !cfg.kv_format.accepts(kv.dtype()) {
        return Err(Error::Dtype {
            arg: "kv_cache",
            expected: format!(
                "{} (kv_cache_dtype {})",
                cfg.kv_format.expected_storage(),
                cfg.cache_dtype
            ),
            got: kv.dtype().to_string(),
        });
    }
    let d = cfg.head_dim();
    shape(
        "kv_cache",
        kv.shape(),
        [Dim::Any("num_blocks"), Dim::Any("page_size"), Dim::Is(d)],
    )?;
    let [num_blocks, page_size, _] = kv.shape();
    if num_blocks == 0 || page_size == 0 {
        return Err(Error::Shape {
            arg: "kv_cache",
            expected: format!("[num_blocks >= 1, page_size >= 1, {d}]"),
            got: kv.shape().to_vec(),
        });
    }
    let [page_stride, token_stride, _] = kv.strides();
    last_contiguous("kv_cache", kv.shape(), kv.strides())?;
    if page_size > 1 && token_stride < d {
        return Err(stride(
            "kv_cache",
            "keys of a page overlap: token stride < row width",
            &kv.strides(),
            &kv.shape(),
        ));
    }
    if num_blocks > 1 && page_stride < (page_size - 1) * token_stride + d {
        return Err(stride(
            "kv_cache",
            "pages overlap: page stride < (page_size - 1) * token stride + row width",
            &kv.strides(),
            &kv.shape(),
        ));
    }
    Ok(())
}

/// `arg`'s dtype is `want`, or [`Error::Dtype`] naming it.
pub(crate) fn dtype(arg: &'static str, got: DType, want: DType) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(Error::Dtype {
            arg,
            expected: want.to_string(),
            got: got.to_string(),
        })
    }
}

/// One dimension of an expected shape: free (named in the message) or fixed.
#[derive(Clone, Copy)]
enum Dim {
    Any(&'static str),
    Is(usize),
}

fn shape<const N: usize>(arg: &'static str, got: [usize; N], want: [Dim; N]) -> Result<()> {
    let ok = got.iter().zip(&want).all(|(&g, w)| match w {
        Dim::Any(_) => true,
        Dim::Is(n) => g == *n,
    });
    if ok {
        return Ok(());
    }
    let dims: Vec<String> = want
        .iter()
        .map(|w| match w {
            Dim::Any(name) => name.to_string(),
            Dim::Is(n) => n.to_string(),
        })
        .collect();
    Err(Error::Shape {
        arg,
        expected: format!("[{}]", dims.join(", ")),
        got: got.to_vec(),
    })
}

fn last_contiguous<const N: usize>(
    arg: &'static str,
    shape: [usize; N],
    strides: [usize; N],
) -> Result<()> {
    if shape[N - 1] > 1 && strides[N - 1] != 1 {
        return Err(stride(
            arg,
            "the last dimension must be contiguous",
            &strides,
            &shape,
        ));
    }
    Ok(())
}

fn stride(arg: &'static str, reason: &str, strides: &[usize], shape: &[usize]) -> Error {
    Error::Stride {
        arg,
        reason: reason.into(),
        strides: strides.to_vec(),
        shape: shape.to_vec(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// The scheduled workspace holds what a scheduled decode writes, for every stage-1
        /// variant that schedules (rows of a job 16 to 64; the mma kernel with one row group
        /// runs two CTAs an SM): the grid's most pieces (jobs + CTAs, what the backend
        /// checks), the schedule's real slots, and its integers.
        #[test]
        fn the_scheduled_workspace_holds_every_schedule(
            lens in proptest::collection::vec(0usize..20_000, 1..40),
            heads in proptest::sample::select(vec![1usize, 16, 24, 64, 128, 256, 20_000]),
            job_rows in proptest::sample::select(vec![16usize, 32, 48, 64]),
            sms in 1usize..140,
        ) {
            use proptest::prelude::prop_assert;
            let per_sm = if job_rows == 16 { 2 } else { 1 };
            let g = schedule::ScheduledGrid::new(lens.len(), heads, job_rows, per_sm, sms);
            let head_blocks = heads.div_ceil(job_rows);
            let blocks: Vec<usize> = lens.iter().map(|&l| l.div_ceil(64)).collect();
            let (jobs, ctas) = (blocks.len(), (sms * per_sm / head_blocks).max(1));
            prop_assert!(jobs == g.jobs && ctas == g.ctas && head_blocks == g.head_blocks);
            let s = schedule::Schedule::build(&blocks, ctas, schedule::SEGMENT_COST, schedule::MIN_BLOCKS);
            let slots: usize = s.splits.iter().sum();
            let (v, total) = scheduled_workspace(lens.len(), heads, 512, sms).unwrap();
            let (o, lse, ints) = (v.partial_o, v.partial_lse, v.ints);
            prop_assert!(v.sm_count == sms);
            prop_assert!(slots <= jobs + ctas);
            prop_assert!((jobs + ctas) * head_blocks * job_rows == g.partial_rows());
            prop_assert!(g.partial_rows() * 4 <= lse.bytes);
            prop_assert!(g.partial_rows() * 512 * 4 <= o.bytes);
            prop_assert!((4 * jobs + 1 + 2 * (ctas + 1) + 1) == g.ints());
            prop_assert!(g.ints() * 4 <= ints.bytes);
            prop_assert!(ints.offset + ints.bytes <= total);
        }
    }

    #[test]
    fn a_cache_is_checked_for_place_dtype_and_shape_before_anything_reads_it() {
        use crate::config::{DeviceInfo, MlaConfig};
        let cfg = MlaConfig::new(4, 0.1)
            .validate(&DeviceInfo::Cpu { threads: 2 })
            .unwrap();
        let data = vec![half::bf16::ZERO; 2 * 16 * 576];
        let kv = crate::tensor::TensorRef::contiguous(&data, [2, 16, 576]).unwrap();
        check_kv_cache(&cfg, &kv, Location::Host).unwrap();
        let e = check_kv_cache(&cfg, &kv, Location::Cuda(0)).unwrap_err();
        assert!(
            matches!(
                e,
                Error::WrongDevice {
                    arg: "kv_cache",
                    ..
                }
            ),
            "{e}"
        );
        let narrow = kv.sub_view(0, [2, 16, 512], [16 * 576, 576, 1]).unwrap();
        let e = check_kv_cache(&cfg, &narrow, Location::Host).unwrap_err();
        assert!(
            matches!(
                e,
                Error::Shape {
                    arg: "kv_cache",
                    ..
                }
            ),
            "{e}"
        );
    }

    /// A Hopper-like device (132 SMs, 227 KB of shared memory a block).
    fn h200() -> DeviceInfo {
        DeviceInfo::Cuda {
            name: "Test GPU".into(),
            capability: crate::error::Capability { major: 9, minor: 0 },
            sm_count: 132,
            smem_per_block: 232_448,
        }
    }

    fn planner(cfg: &crate::config::MlaConfig, device: &DeviceInfo) -> Planner {
        Planner::new(cfg.validate(device).unwrap(), device).unwrap()
    }

    #[test]
    fn a_batch_of_one_request_keeps_the_split_grid_on_a_scheduling_decoder() {
        use crate::config::MlaConfig;
        use crate::synth::{Outputs, Problem, ProblemSpec};
        let mut cfg = MlaConfig::new(16, 0.1);
        cfg.device_schedule = true;
        let planner = planner(&cfg, &h200());
        assert!(planner.schedules());
        for (lens, query_len, scheduled, runs_scheduled) in [
            (vec![5000], 1, false, false),
            (vec![5000], 2, false, false),
            (vec![5000, 3], 1, true, true),
            // Packed tokens keep the split grid, though the workspace has the views.
            (vec![64, 64], 2, true, false),
        ] {
            let mut spec = ProblemSpec::new(16, lens.clone());
            spec.query_len = query_len;
            let problem = Problem::generate(&spec).unwrap();
            let inputs = problem.inputs().unwrap();
            let mut out = Outputs::poisoned(&problem);
            let outputs = out.views().unwrap();
            let plan = DecodePlan::new(&planner, &inputs, &outputs, Location::Host, None).unwrap();
            let what = format!("{lens:?} x {query_len} tokens");
            assert_eq!(plan.schedule_workspace.is_some(), scheduled, "{what}");
            assert_eq!(plan.scheduled(), runs_scheduled, "{what}");
        }
    }

    #[test]
    fn the_planner_picks_the_rule_and_only_the_fill_rule_schedules() {
        use crate::config::MlaConfig;
        let cpu = DeviceInfo::Cpu { threads: 2 };
        let schedule = |mut c: MlaConfig, device: &DeviceInfo| {
            c.num_heads = 128;
            assert!(!planner(&c, device).schedules(), "off unless asked");
            c.device_schedule = true;
            let p = planner(&c, device);
            assert!(
                !p.schedules_requests(1),
                "one request has nothing to balance"
            );
            assert_eq!(p.schedules_requests(2), p.schedules());
            p.schedules()
        };
        assert!(schedule(MlaConfig::new(16, 0.1), &h200()));
        let mut fixed = MlaConfig::new(16, 0.1);
        fixed.num_kv_splits = Some(4);
        assert!(
            !schedule(fixed, &h200()),
            "a fixed split count is the user's"
        );
        let mut invariant = MlaConfig::new(16, 0.1);
        invariant.batch_invariant = true;
        assert!(
            !schedule(invariant, &h200()),
            "batch-invariant mode keeps one split"
        );
        assert!(
            !schedule(MlaConfig::new(16, 0.1), &cpu),
            "the CPU keeps vLLM's rule"
        );
        // The rules: a fixed count everywhere, one split in batch-invariant mode, vLLM's on
        // the CPU, the fill rule on a GPU.
        for device in [cpu.clone(), h200()] {
            let mut c = MlaConfig::new(16, 0.1);
            c.num_kv_splits = Some(7);
            let p = planner(&c, &device);
            assert_eq!(p.rule(), SplitRule::Fixed { splits: 7 });
            assert_eq!(p.splits(100_000, 3, 1, 64), 7);
        }
        let mut c = MlaConfig::new(16, 0.1);
        c.num_kv_splits = Some(1);
        c.batch_invariant = true;
        assert_eq!(planner(&c, &cpu).rule(), SplitRule::Single);
        assert_eq!(
            planner(&MlaConfig::new(16, 0.1), &cpu).rule(),
            SplitRule::Vllm { sm_count: 2 }
        );
        assert_eq!(
            planner(&MlaConfig::new(16, 0.1), &h200()).rule(),
            SplitRule::Fill {
                sm_count: 132,
                kv_lora_rank: 512
            }
        );
        assert!(planner(&MlaConfig::new(16, 0.1), &cpu).kernels().is_none());
    }

    #[test]
    fn workspace_matches_the_seed_size_plus_alignment() {
        let (r, total) = decode_workspace(8, 16, 4, 512).unwrap();
        let seed = 8 * 16 * 4 * (512 + 1) * 4;
        assert_eq!(r[0].bytes + r[1].bytes, seed);
        assert!(total >= seed && total < seed + 256);
    }

    #[test]
    fn negative_lengths_are_named() {
        let e = max_seq_len(&[3, -2], 1, 16).unwrap_err();
        assert_eq!(e.to_string(), "seq_lens[1]: expected a length >= 0, got -2");
        assert_eq!(max_seq_len(&[3, 9, 0], 1, 16).unwrap(), 9);
        assert_eq!(max_seq_len(&[], 1, 16).unwrap(), 0);
        assert!(matches!(
            max_seq_len(&[3, 17], 1, 16),
            Err(Error::SeqLenBeyondBlockTable {
                request: 1,
                len: 17,
                capacity: 16,
                ..
            })
        ));
    }
}
