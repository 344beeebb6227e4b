//! What is decided once per decoder (the split rule, the GPU kernels it may launch, whether it
//! takes the device schedule), and the per-decode decisions made from it: the split count and
//! the kernel pick.

use super::kernel::{self, Gpu, KernelSet, Pick};
use super::splits::{Batch, SplitRule};
use crate::config::{DeviceInfo, ValidConfig};
use crate::error::Result;

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

    /// The per-decode decisions for `rows` query rows of `requests` requests (`query_len` a
    /// request) whose longest length is `max_seq`, over pages of `page_size` keys: the split
    /// count, whether the decode takes the device schedule, and (on a GPU) the stage-1 variant,
    /// picked for that split count.
    pub(super) fn decide(
        &self,
        max_seq: usize,
        rows: usize,
        requests: usize,
        query_len: usize,
        page_size: usize,
    ) -> Decision {
        let batch = self.batch(max_seq, rows, query_len, page_size);
        let splits = self.rule.splits(self.kernels(), &batch);
        let scheduled = self.schedules_requests(requests);
        let call = kernel::Call {
            scheduled,
            ..batch.call(splits)
        };
        let stage1 = self.kernels.as_ref().map(|k| k.pick(&call));
        tracing::debug!(
            rule = ?self.rule,
            rows,
            max_span = batch.max_span,
            splits,
            kernel = ?stage1.map(|p| p.family()),
            tokens_per_cta = stage1.map_or(1, |p| p.tokens),
            scheduled,
            "decode planned"
        );
        Decision {
            max_span: batch.max_span,
            splits,
            scheduled,
            stage1,
        }
    }
}

/// What [`Planner::decide`] decided for one decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Decision {
    /// The most keys a row's splits cover (the longest length, within the window).
    pub max_span: usize,
    /// Splits per row.
    pub splits: usize,
    /// Whether the decode takes the device-computed schedule.
    pub scheduled: bool,
    /// The stage-1 variant (None on the CPU).
    pub stage1: Option<Pick>,
}
