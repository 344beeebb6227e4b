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
//! - `checks`: the argument checks, each naming the argument.
//! - `planner`: what is decided once per decoder.
//! - [`extents`]: which keys each query row sees.
//! - [`kernel`]: which stage-1 kernel variant runs a decode (the one place that decides it).
//! - [`splits`]: the split count and each split's keys.
//! - [`workspace`]: the locked scratch buffer and its aligned views.
//! - [`schedule`]: the work schedule of a scheduled GPU decode (the GPU scheduler's
//!   reference).

mod checks;
pub mod extents;
pub mod kernel;
mod planner;
pub mod schedule;
pub mod splits;
pub mod workspace;

pub use extents::{KeyRange, Mask, key_range};
pub use splits::{SplitRule, num_kv_splits, split_range, warmup_split_counts};

pub use workspace::{
    Region, ScheduledViews, WorkspaceManager, decode_workspace, scheduled_workspace,
};

use self::checks::{Dim, checked_scale, last_contiguous, max_seq_len, on_device, shape, stride};
pub(crate) use self::checks::{check_kv_cache, dtype};
use self::kernel::Pick;
pub(crate) use self::planner::Planner;

use crate::args::{DecodeInputs, DecodeOutputs, Query};
use crate::dtype::{DType, KvFormat, ModelDtype};
use crate::error::{Error, Result};
use crate::kernels::KernelFamily;
use crate::tensor::Location;

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
        splits::split_keys(self.max_span, self.num_kv_splits)
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

        let decision = planner.decide(max_seq, rows, requests, inputs.query_len, page_size);
        let num_kv_splits = decision.splits;
        let (workspace, mut workspace_bytes) = decode_workspace(rows, h, num_kv_splits, l)?;
        let schedule_workspace = if decision.scheduled {
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
            max_span: decision.max_span,
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
            stage1: decision.stage1,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::DeviceInfo;

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
