//! Stage 2 on the CPU: merges the splits of each row in ascending order (vLLM's online
//! merge), rounds the output to the query dtype and writes o and lse.
//!
//! For each (row, head): `m = max(m, lse_s)`, rescale the running sum and accumulator by
//! `exp(m_old - m)`, add `exp(lse_s - m) * o_s`. Splits with no key are skipped (they were
//! never written); a row with no key at all gets o = 0 and lse = -inf. A NaN (from a NaN in q
//! or in a key read) stays NaN in o and in lse, so that a later LSE merge cannot mistake the
//! row for one without keys.

use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;

use super::inputs::HostInputs;
use crate::plan::{DecodePlan, split_range};

/// Disjoint rows of an output: row r starts at `r * stride` (the plan checked they do not
/// overlap; a single row may have any stride).
fn rows_mut<T: Send>(
    data: &mut [T],
    rows: usize,
    stride: usize,
) -> impl IndexedParallelIterator<Item = &mut [T]> {
    let stride = if rows <= 1 { data.len().max(1) } else { stride };
    data.par_chunks_mut(stride).take(rows)
}

/// Runs stage 2. `o` and `lse` are the caller's outputs from their first element.
pub fn run<T>(
    plan: &DecodePlan,
    src: &HostInputs<'_>,
    part_o: &[f32],
    part_lse: &[f32],
    o: &mut [T],
    lse: &mut [f32],
) where
    T: Send,
    [T]: HalfFloatSliceExt,
{
    let (h, l, splits) = (plan.heads, plan.kv_lora_rank, plan.num_kv_splits);
    let [o_row, o_head] = plan.o_strides;
    rows_mut(o, plan.rows, o_row)
        .zip(rows_mut(lse, plan.rows, plan.lse_stride))
        .enumerate()
        .for_each_init(
            || vec![0f32; l],
            |acc, (row, (o_out, lse_out))| {
                let keys = src.row_keys(plan, row);
                for head in 0..h {
                    acc.fill(0.0);
                    let (mut m, mut sum) = (f32::NEG_INFINITY, 0f32);
                    let mut any_key = false;
                    for s in 0..splits {
                        if split_range(keys, s, splits).is_empty() {
                            continue;
                        }
                        any_key = true;
                        let at = (row * splits + s) * h + head;
                        let lse_s = part_lse[at];
                        let part = &part_o[at * l..(at + 1) * l];
                        let m_new = m.max(lse_s);
                        let old = (m - m_new).exp();
                        let w = (lse_s - m_new).exp();
                        for (a, &p) in acc.iter_mut().zip(part) {
                            *a = *a * old + w * p;
                        }
                        sum = sum * old + w;
                        m = m_new;
                    }
                    // Whether the row has keys, not the sum, tells "no key": a NaN sum
                    // must give lse = NaN, not -inf.
                    if any_key {
                        acc.iter_mut().for_each(|a| *a /= sum);
                        lse_out[head] = m + sum.ln();
                    } else {
                        lse_out[head] = f32::NEG_INFINITY;
                    }
                    o_out[head * o_head..head * o_head + l].convert_from_f32_slice(acc);
                }
            },
        );
}
