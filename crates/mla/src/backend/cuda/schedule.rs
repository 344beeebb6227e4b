//! The GPU work scheduler (docs/scheduler.md): the scheduled decode (the scheduler kernel,
//! then the persistent stage-1 CTAs, each walking its stretch of the schedule, then the
//! combine of the rows that were cut, all on the stream: no host synchronization), and the
//! scheduler kernel run on its own for the tests that hold it to its reference
//! (`plan::schedule::Schedule::build`).

use super::combine::CombineShape;
use super::params::{DecodeParams, ScheduleParams, TensorMap, TmaScheduleParams};
use super::{CudaBackend, address, ffi};
use crate::error::{Error, Result};
use crate::kernels::select::schedule_variant;
use crate::kernels::variant::Variant;
use crate::plan::schedule::{Cursor, Jobs, Schedule, ScheduledGrid};
use crate::plan::{DecodePlan, Mask, ScheduledViews};

/// A count as the kernels' i32.
fn int(v: usize, what: &'static str) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::Overflow {
        what,
        detail: v.to_string(),
    })
}

impl CudaBackend {
    /// Launches a decode on the device-computed schedule: the scheduler kernel (from the
    /// device's lengths; its jobs are the rows), `decode` (the plan's scheduled stage-1
    /// variant: persistent, a CTA per stretch of the cost line and head block, walking its
    /// pieces) and the scheduled twin of `combine`, which merges the rows cut in pieces.
    /// `views`: the plan's scheduled workspace (partials, LSEs, the schedule's integers, and
    /// the SM count they were sized for). `kv_map`: the cache's tensor map, for a `decode`
    /// that copies the keys by TMA (the seesaw kernel). With PDL, the decode and the combine
    /// are programmatic dependent launches, each waiting for the kernel before it.
    pub(super) fn forward_scheduled(
        &mut self,
        plan: &DecodePlan,
        params: DecodeParams,
        decode: Variant,
        combine: Variant,
        views: &ScheduledViews,
        kv_map: Option<TensorMap>,
    ) -> Result<()> {
        let pdl = self.launch.pdl;
        let g = ScheduledGrid::new(
            plan.rows,
            plan.heads,
            decode.heads_per_cta(plan.heads),
            decode.ctas_per_sm,
            views.sm_count,
        );
        let (jobs, ctas) = (g.jobs, g.ctas);
        if g.ints() * 4 > views.ints.bytes || g.partial_rows() * 4 > views.partial_lse.bytes {
            return Err(Error::Overflow {
                what: "workspace",
                detail: format!("a schedule of {jobs} jobs on {ctas} CTAs"),
            });
        }
        let costs = self.launch.schedule_costs;
        let (segment_cost, min_blocks) = (costs.segment, costs.min_blocks);
        let cta_count = int(ctas, "CTAs")?;
        let ws = self.workspace_ptr();
        let [line, begin, first_cta, splits, first_slot, share] = g
            .int_offsets()
            .map(|i| ws + (views.ints.offset + 4 * i) as u64);
        let sp = ScheduleParams {
            d: DecodeParams {
                part_o: ws + views.partial_o.offset as u64,
                part_lse: ws + views.partial_lse.offset as u64,
                ..params
            },
            head_blocks: 1, // the schedule's jobs are rows; the grid's y is the head block
            ctas: cta_count,
            segment_cost: int(segment_cost, "segment cost")?,
            min_blocks: int(min_blocks, "fewest blocks")?,
            jobs: int(jobs, "jobs")?,
            job_rows: int(g.job_rows, "rows a job")?,
            line,
            begin,
            first_cta,
            splits,
            first_slot,
            share,
        };
        let blocks = u32::try_from(g.head_blocks)
            .ok()
            .filter(|&y| y <= 65_535)
            .ok_or_else(|| Error::Overflow {
                what: "grid",
                detail: format!("{} head blocks", g.head_blocks),
            })?;
        let grid = (cta_count as u32, blocks, 1);
        let st = self.stream.clone();
        let v = schedule_variant();
        let f = self.kernel(v)?.clone();
        ffi::launch(&st, &f, (1, 1), (v.threads(), 1), 0, &sp)?;
        let v = decode;
        let f = self.kernel(v)?.clone();
        let (block, smem) = ((v.threads(), 1), v.smem_bytes() as u32);
        match kv_map {
            Some(kv_map) => {
                let with_map = TmaScheduleParams { s: sp, kv_map };
                ffi::launch_with(&st, &f, grid, block, smem, &with_map, pdl)?;
            }
            None => ffi::launch_with(&st, &f, grid, block, smem, &sp, pdl)?,
        }
        let f = self.kernel(combine.scheduled())?.clone();
        let shape = CombineShape::new(
            plan.rows,
            plan.heads,
            plan.kv_lora_rank,
            g.mean_splits(),
            self.sm_count,
        );
        ffi::launch_with(&st, &f, shape.grid, shape.block, shape.smem, &sp, pdl)?;
        self.scheduled_decodes += 1;
        Ok(())
    }

    /// The schedule the device computes for `jobs` (their lengths uploaded first) over `ctas`
    /// CTAs, read back. Waits for the stream.
    ///
    /// # Errors
    /// [`Error::Overflow`] for a batch whose counts do not fit the kernel's 32-bit integers,
    /// [`Error::Compile`] or [`Error::Driver`].
    pub fn schedule(
        &mut self,
        jobs: &Jobs<'_>,
        ctas: usize,
        segment_cost: usize,
        min_blocks: usize,
    ) -> Result<Schedule> {
        let (q, pack) = jobs.tokens();
        let count = jobs.count();
        let st = self.stream.clone();
        let driver = Error::driver;
        let seq_lens = st
            .clone_htod(jobs.seq_lens)
            .map_err(driver("upload the lengths"))?;
        let zeros = |n: usize| st.alloc_zeros::<i32>(n.max(1)).map_err(driver("allocate"));
        let (line, begin) = (zeros(count + 1)?, zeros(2 * (ctas + 1))?);
        let (first_cta, splits, first_slot, share) =
            (zeros(count)?, zeros(count)?, zeros(count)?, zeros(1)?);
        let params = ScheduleParams {
            d: DecodeParams {
                seq_lens: address(&seq_lens, &st),
                query_len: int(q, "query length")?,
                causal: (jobs.mask == Mask::Causal) as i32,
                window: int(jobs.window.unwrap_or(0), "window")?,
                tokens_per_cta: int(pack, "tokens a CTA")?,
                error_flag: address(&self.error_flag, &st),
                ..DecodeParams::default()
            },
            head_blocks: int(jobs.head_blocks, "head blocks")?,
            ctas: int(ctas, "CTAs")?,
            segment_cost: int(segment_cost, "segment cost")?,
            min_blocks: int(min_blocks, "fewest blocks")?,
            jobs: int(count, "jobs")?,
            job_rows: 0,
            line: address(&line, &st),
            begin: address(&begin, &st),
            first_cta: address(&first_cta, &st),
            splits: address(&splits, &st),
            first_slot: address(&first_slot, &st),
            share: address(&share, &st),
        };
        let v = schedule_variant();
        let f = self.kernel(v)?.clone();
        ffi::launch(&st, &f, (1, 1), (v.threads(), 1), 0, &params)?;
        let read = |s| st.clone_dtoh(s).map_err(driver("read the schedule"));
        // A negative value (a kernel bug) reads as usize::MAX, which no test accepts.
        let sizes = |v: Vec<i32>| -> Vec<usize> {
            v.into_iter()
                .map(|x| usize::try_from(x).unwrap_or(usize::MAX))
                .collect()
        };
        let pairs = sizes(read(&begin)?);
        let cut = |v: Vec<usize>| v.into_iter().take(count).collect::<Vec<_>>();
        Ok(Schedule {
            begin: pairs
                .chunks(2)
                .map(|c| Cursor {
                    job: c[0],
                    block: c[1],
                })
                .collect(),
            first_cta: cut(sizes(read(&first_cta)?)),
            splits: cut(sizes(read(&splits)?)),
            first_slot: cut(sizes(read(&first_slot)?)),
            share: sizes(read(&share)?)[0],
        })
    }
}
