//! The scheduler kernel run on its own, for the tests that hold it to its reference
//! (`plan::schedule::Schedule::build`). No decode launches it yet (docs/scheduler.md).

use super::params::{DecodeParams, ScheduleParams};
use super::{CudaBackend, address, ffi, registry};
use crate::error::{Error, Result};
use crate::plan::Mask;
use crate::plan::schedule::{Cursor, Jobs, Schedule};

impl CudaBackend {
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
        let q = jobs.query_len.max(1);
        let pack = jobs.tokens_per_cta.clamp(1, q);
        let count = jobs.seq_lens.len() * q.div_ceil(pack) * jobs.head_blocks;
        let int = |v: usize, what: &'static str| {
            i32::try_from(v).map_err(|_| Error::Overflow {
                what,
                detail: v.to_string(),
            })
        };
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
            pad: 0,
            line: address(&line, &st),
            begin: address(&begin, &st),
            first_cta: address(&first_cta, &st),
            splits: address(&splits, &st),
            first_slot: address(&first_slot, &st),
            share: address(&share, &st),
        };
        let v = registry::schedule_variant();
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
