//! The f64 oracle: straight softmax attention over the keys each row sees, with no splits,
//! no chunks and no rounding of its own. Plain on purpose (its loops only compiled for the
//! widest vectors the CPU has, with the same bits); every backend is checked against it.
//!
//! It reads the same arguments as [`crate::MlaDecode::forward`] and takes the key and value
//! numbers through the same [`crate::KvFormat::decoder`] (decoded, times k_scale, rounded to
//! the query dtype), so the only differences it measures are the backend's arithmetic. Which
//! keys a row sees is written out again here from the contract, on purpose, rather than taken
//! from the plan: the oracle must not share the code it checks.

use rayon::prelude::*;

use crate::args::{DecodeInputs, Query};
use crate::config::ValidConfig;
use crate::error::{Error, Result};
use crate::plan::Mask;
use crate::tensor::TensorRef;

/// Reference outputs in f64: `o` is `[rows, H, L]`, `lse` is `[rows, H]` (natural log;
/// -inf for a row with no key).
#[derive(Debug, Clone, PartialEq)]
pub struct Reference {
    /// Rows computed.
    pub rows: usize,
    /// Heads.
    pub heads: usize,
    /// L.
    pub kv_lora_rank: usize,
    /// `[rows, H, L]`.
    pub o: Vec<f64>,
    /// `[rows, H]`.
    pub lse: Vec<f64>,
}

fn oob(what: &str) -> Error {
    Error::memory("reference", format!("{what} is outside its tensor"))
}

/// Element `idx` of a host tensor as f64 (16-bit q only).
fn half_at(t: &TensorRef<'_, 3>, idx: usize) -> Result<f64> {
    let v = match t.dtype() {
        crate::DType::BF16 => t
            .host_slice::<half::bf16>()
            .and_then(|s| s.get(idx))
            .map(|x| x.to_f64()),
        crate::DType::F16 => t
            .host_slice::<half::f16>()
            .and_then(|s| s.get(idx))
            .map(|x| x.to_f64()),
        _ => None,
    };
    v.ok_or_else(|| oob("a q element"))
}

/// q of one row and head as f64, `[D]`.
fn query(q: &Query<'_>, row: usize, head: usize, l: usize, r: usize) -> Result<Vec<f64>> {
    let at = |t: &TensorRef<'_, 3>, col: usize| {
        let s = t.strides();
        half_at(t, row * s[0] + head * s[1] + col)
    };
    (0..l + r)
        .map(|c| match q {
            Query::Packed(t) => at(t, c),
            Query::Split { nope, rope } => {
                if c < l {
                    at(nope, c)
                } else {
                    at(rope, c - l)
                }
            }
        })
        .collect()
}

/// Computes the first `max_rows` rows (all when None) in f64.
///
/// # Errors
/// [`Error::Memory`] for device tensors or indices outside a tensor (a bad block id, a
/// length beyond the block table): the reference never reads out of bounds.
pub fn decode_f64(
    cfg: &ValidConfig,
    inputs: &DecodeInputs<'_>,
    max_rows: Option<usize>,
) -> Result<Reference> {
    let (h, l, r) = (cfg.q_heads, cfg.kv_lora_rank, cfg.rope_dim);
    let d = l + r;
    let ql = inputs.query_len.max(1);
    let rows = max_rows.map_or(inputs.q.rows(), |m| m.min(inputs.q.rows()));
    let host = |arg| Error::memory(arg, "the reference reads host tensors only");
    let lens = inputs
        .seq_lens
        .host_slice::<i32>()
        .ok_or_else(|| host("seq_lens"))?;
    let table = inputs
        .block_table
        .host_slice::<i32>()
        .ok_or_else(|| host("block_table"))?;
    let kv = inputs
        .kv_cache
        .host_bytes()
        .ok_or_else(|| host("kv_cache"))?;
    let k_scale = if cfg.kv_format.is_fp8() {
        inputs.host_k_scale().ok_or_else(|| host("k_scale"))?
    } else {
        1.0
    };
    let decoder = cfg.kv_format.decoder(cfg.model_dtype, k_scale);
    let elem = cfg.kv_format.size();
    let [_, page_size, _] = inputs.kv_cache.shape();
    let [page_stride, token_stride, _] = inputs.kv_cache.strides();
    let bt_stride = inputs.block_table.strides()[0];
    let lens_stride = inputs.seq_lens.strides()[0];
    let num_blocks = inputs.kv_cache.shape()[0];

    let per_row: Vec<Result<(Vec<f64>, Vec<f64>)>> = (0..rows)
        .into_par_iter()
        .map(|row| {
            let (req, t) = (row / ql, row % ql);
            let len = usize::try_from(
                *lens
                    .get(req * lens_stride)
                    .ok_or_else(|| oob("a seq_len"))?,
            )
            .map_err(|_| oob("a negative seq_len"))?;
            // The contract, written out: causal rows end at their own token.
            let end = match inputs.mask {
                Mask::Causal => len.saturating_sub(ql - 1 - t),
                Mask::NonCausal => len,
            };
            let start = cfg.sliding_window.map_or(0, |w| end.saturating_sub(w));
            let n = end - start;
            let mut keys = vec![0f32; n * d];
            for (j, key) in keys.chunks_exact_mut(d).enumerate() {
                let p = start + j;
                let block = *table
                    .get(req * bt_stride + p / page_size)
                    .ok_or_else(|| oob("a block table entry"))?;
                let block = usize::try_from(block)
                    .ok()
                    .filter(|&b| b < num_blocks)
                    .ok_or_else(|| oob("a block id"))?;
                let off = (block * page_stride + (p % page_size) * token_stride) * elem;
                let src = kv.get(off..off + d * elem).ok_or_else(|| oob("a key"))?;
                decoder.decode(src, key);
            }
            // Heads in parallel too: a long row alone keeps every core busy.
            let heads: Vec<Result<(Vec<f64>, f64)>> = (0..h)
                .into_par_iter()
                .map(|head| {
                    let mut out = vec![0f64; l];
                    if n == 0 {
                        return Ok((out, f64::NEG_INFINITY));
                    }
                    let q = query(&inputs.q, row, head, l, r)?;
                    let lse = attend(&q, &keys, cfg.scale as f64, &mut out);
                    Ok((out, lse))
                })
                .collect();
            let mut o = Vec::with_capacity(h * l);
            let mut lse = Vec::with_capacity(h);
            for res in heads {
                let (out, head_lse) = res?;
                o.extend(out);
                lse.push(head_lse);
            }
            Ok((o, lse))
        })
        .collect();

    let mut out = Reference {
        rows,
        heads: h,
        kv_lora_rank: l,
        o: Vec::with_capacity(rows * h * l),
        lse: Vec::with_capacity(rows * h),
    };
    for res in per_row {
        let (o, lse) = res?;
        out.o.extend(o);
        out.lse.extend(lse);
    }
    Ok(out)
}

/// One head of one row, `q` `[D]` against `keys` `[n, D]`: softmax of the scaled scores,
/// their weighted sum of the values (each key's first L elements) added to `out` `[L]`;
/// returns the LSE. Compiled for the widest vectors the CPU has: the same operations in the
/// same order everywhere (Rust fuses no multiply-add on its own), so the same bits. The two
/// calls of the wider copies are its only unsafe code: each after its CPU check.
#[allow(unsafe_code)]
fn attend(q: &[f64], keys: &[f32], scale: f64, out: &mut [f64]) -> f64 {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F (checked above).
            return unsafe { attend_avx512(q, keys, scale, out) };
        }
        if is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked above).
            return unsafe { attend_avx2(q, keys, scale, out) };
        }
    }
    attend_any(q, keys, scale, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn attend_avx512(q: &[f64], keys: &[f32], scale: f64, out: &mut [f64]) -> f64 {
    attend_any(q, keys, scale, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn attend_avx2(q: &[f64], keys: &[f32], scale: f64, out: &mut [f64]) -> f64 {
    attend_any(q, keys, scale, out)
}

/// [`attend`] for whatever instructions its caller was compiled for (inlined into each).
#[inline(always)]
fn attend_any(q: &[f64], keys: &[f32], scale: f64, out: &mut [f64]) -> f64 {
    let d = q.len();
    // A loop, not a collect: the collect's code would not be inlined into the wider copies.
    let mut scores = Vec::with_capacity(keys.len() / d);
    for k in keys.chunks_exact(d) {
        scores.push(scale * dot(q, k));
    }
    let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let w: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
    let sum: f64 = w.iter().sum();
    for (k, wj) in keys.chunks_exact(d).zip(&w) {
        let p = wj / sum;
        for (acc, &v) in out.iter_mut().zip(k) {
            *acc += p * v as f64;
        }
    }
    m + sum.ln()
}

/// Independent partial sums of the f64 dot product: as many as four of the widest vectors
/// hold, so that the additions of one step do not wait on each other.
const DOT_LANES: usize = 32;

/// f64 dot product with [`DOT_LANES`] independent partial sums (so it vectorizes).
#[inline(always)]
fn dot(q: &[f64], k: &[f32]) -> f64 {
    let mut acc = [0f64; DOT_LANES];
    let (qc, kc) = (q.chunks_exact(DOT_LANES), k.chunks_exact(DOT_LANES));
    let (qr, kr) = (qc.remainder(), kc.remainder());
    for (a, b) in qc.zip(kc) {
        for i in 0..DOT_LANES {
            acc[i] += a[i] * b[i] as f64;
        }
    }
    let tail: f64 = qr.iter().zip(kr).map(|(a, &b)| a * b as f64).sum();
    acc.iter().sum::<f64>() + tail
}

/// How far a backend's outputs are from the reference.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Accuracy {
    /// `||o - ref|| / ||ref||` over the rows compared (the absolute norm when ref is zero);
    /// infinite if o holds a NaN or an infinity where the reference does not (a NaN where
    /// the reference is NaN is exact: a NaN in q or in a key read).
    pub o_rel: f64,
    /// Largest `|lse - ref|`; infinite if one side is -inf and the other is not, or one side
    /// is NaN and the other is not.
    pub lse_abs: f64,
}

impl Accuracy {
    /// `o` against `want` and `lse` against `want_lse`, element by element (the shorter of
    /// each pair decides how many).
    fn of(o: &[f32], want: &[f64], lse: &[f32], want_lse: &[f64]) -> Accuracy {
        let (mut diff, mut norm, mut bad) = (0f64, 0f64, false);
        for (&x, &want) in o.iter().zip(want) {
            let x = x as f64;
            if x.is_nan() && want.is_nan() {
                continue;
            }
            bad |= !x.is_finite() || !want.is_finite();
            diff += (x - want) * (x - want);
            norm += want * want;
        }
        let o_rel = if bad {
            f64::INFINITY
        } else if norm > 0.0 {
            (diff / norm).sqrt()
        } else {
            diff.sqrt()
        };
        let lse_abs = lse.iter().zip(want_lse).fold(0f64, |worst, (&x, &want)| {
            let x = x as f64;
            let e = if x == want || (x.is_nan() && want.is_nan()) {
                0.0 // both -inf, both NaN, or equal
            } else if x.is_finite() && want.is_finite() {
                (x - want).abs()
            } else {
                f64::INFINITY
            };
            worst.max(e)
        });
        Accuracy { o_rel, lse_abs }
    }
}

impl Reference {
    /// Compares dense outputs, `o` as `[rows, H, L]` and `lse` as `[rows, H]` (at least the
    /// reference's rows; extra rows are ignored).
    pub fn accuracy(&self, o: &[f32], lse: &[f32]) -> Accuracy {
        Accuracy::of(o, &self.o, lse, &self.lse)
    }

    /// [`accuracy`](Self::accuracy) of each (row, head) on its own, `[rows, H]` row-major: a
    /// wrong head or row shows even where the whole tensor's norm hides it. A head missing
    /// from short outputs is infinitely wrong.
    pub fn head_accuracy(&self, o: &[f32], lse: &[f32]) -> Vec<Accuracy> {
        let l = self.kv_lora_rank;
        (0..self.rows * self.heads)
            .map(|i| match (o.get(i * l..(i + 1) * l), lse.get(i..i + 1)) {
                (Some(o), Some(lse)) => {
                    Accuracy::of(o, &self.o[i * l..(i + 1) * l], lse, &self.lse[i..i + 1])
                }
                _ => Accuracy {
                    o_rel: f64::INFINITY,
                    lse_abs: f64::INFINITY,
                },
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accuracy_flags_nan_and_lone_infinities() {
        let r = Reference {
            rows: 1,
            heads: 2,
            kv_lora_rank: 2,
            o: vec![1.0, 0.0, 0.0, 0.0],
            lse: vec![0.5, f64::NEG_INFINITY],
        };
        let a = r.accuracy(&[1.0, 0.0, 0.0, 0.0], &[0.5, f32::NEG_INFINITY]);
        assert_eq!(
            a,
            Accuracy {
                o_rel: 0.0,
                lse_abs: 0.0
            }
        );
        let a = r.accuracy(&[1.1, 0.0, 0.0, 0.0], &[0.25, f32::NEG_INFINITY]);
        assert!((a.o_rel - 0.1).abs() < 1e-6 && (a.lse_abs - 0.25).abs() < 1e-9);
        assert_eq!(
            r.accuracy(&[f32::NAN, 0.0, 0.0, 0.0], &[0.5, f32::NEG_INFINITY])
                .o_rel,
            f64::INFINITY
        );
        assert_eq!(
            r.accuracy(&[1.0, 0.0, 0.0, 0.0], &[0.5, 0.0]).lse_abs,
            f64::INFINITY
        );
        assert!(
            r.accuracy(&[1.0, 0.0, 0.0, 0.0], &[f32::NAN, f32::NEG_INFINITY])
                .lse_abs
                .is_infinite()
        );
    }

    #[test]
    fn a_nan_where_the_reference_is_nan_is_exact_and_heads_are_measured_alone() {
        let r = Reference {
            rows: 1,
            heads: 2,
            kv_lora_rank: 2,
            o: vec![f64::NAN, f64::NAN, 1.0, 1.0],
            lse: vec![f64::NAN, 0.5],
        };
        let exact = Accuracy {
            o_rel: 0.0,
            lse_abs: 0.0,
        };
        let nan = f32::NAN;
        assert_eq!(r.accuracy(&[nan, nan, 1.0, 1.0], &[nan, 0.5]), exact);
        assert_eq!(
            r.accuracy(&[0.0, 0.0, 1.0, 1.0], &[nan, 0.5]).o_rel,
            f64::INFINITY
        );
        assert_eq!(
            r.accuracy(&[nan, nan, 1.0, 1.0], &[0.0, 0.5]).lse_abs,
            f64::INFINITY
        );
        let heads = r.head_accuracy(&[nan, nan, 1.5, 1.0], &[nan, 0.75]);
        assert_eq!(heads[0], exact);
        assert!((heads[1].o_rel - 0.5 / 2f64.sqrt()).abs() < 1e-12);
        assert!((heads[1].lse_abs - 0.25).abs() < 1e-12);
        assert_eq!(r.head_accuracy(&[nan, nan], &[nan])[1].o_rel, f64::INFINITY);
    }

    #[test]
    fn dot_matches_a_plain_sum() {
        // Two steps of partial sums and a tail.
        let n = 2 * DOT_LANES + 13;
        let q: Vec<f64> = (0..n).map(|i| i as f64 * 0.5).collect();
        let k: Vec<f32> = (0..n).map(|i| 1.0 - i as f32 * 0.125).collect();
        let want: f64 = q.iter().zip(&k).map(|(a, &b)| a * b as f64).sum();
        assert!((dot(&q, &k) - want).abs() < 1e-9 * want.abs());
    }

    #[test]
    fn attend_gives_the_same_bits_on_every_instruction_set() {
        // DeepSeek's widths, values whose products and sums round.
        let (d, l, n) = (576, 512, 37);
        let q: Vec<f64> = (0..d)
            .map(|i| ((i * 37 % 101) as f64 - 50.0) / 7.0)
            .collect();
        let keys: Vec<f32> = (0..n * d)
            .map(|i| ((i * 53 % 97) as f32 - 48.0) / 11.0)
            .collect();
        let (mut here, mut plain) = (vec![0f64; l], vec![0f64; l]);
        let lse = attend(&q, &keys, 0.07, &mut here);
        let plain_lse = attend_any(&q, &keys, 0.07, &mut plain);
        assert_eq!(lse.to_bits(), plain_lse.to_bits());
        assert!(
            here.iter()
                .zip(&plain)
                .all(|(a, b)| a.to_bits() == b.to_bits())
        );
    }
}
