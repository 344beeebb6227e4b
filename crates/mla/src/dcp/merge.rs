//! The LSE merge of the ranks' partial attention on the host, in f32: the arithmetic the GPU
//! kernels do (`kernels/dcp/kernel.cu`), written once more plainly so that the simulated-rank
//! tests (CPU, in CI) check the math and the GPU tests check the kernels against it.
//!
//! Rank r attended every one of the H N heads over its own keys and got `o_r` `[rows, H N, L]`
//! and `lse_r` `[rows, H N]`. The merged head is `lse = log sum_r e^(lse_r)`,
//! `o = sum_r e^(lse_r - lse) o_r`; rank k keeps heads `k H .. (k + 1) H`.

use crate::error::{Error, Result};

/// One rank's partial attention over all H N heads.
#[derive(Debug, Clone, Copy)]
pub struct Partial<'a> {
    /// `[rows, H N, L]`.
    pub o: &'a [f32],
    /// `[rows, H N]`; -inf where the rank held no key.
    pub lse: &'a [f32],
}

/// The merged lse of a head from every rank's: `m + ln(sum_r e^(lse_r - m))`, -inf when no
/// rank held a key, NaN when a rank's is NaN (a NaN in q or in a key it read: `f32::max`
/// would skip it, and the merge would pass for a head without keys).
pub fn merged_lse(lse: impl Iterator<Item = f32> + Clone) -> f32 {
    if lse.clone().any(f32::is_nan) {
        return f32::NAN;
    }
    let m = lse.clone().fold(f32::NEG_INFINITY, f32::max);
    if m == f32::NEG_INFINITY {
        return m;
    }
    m + lse.map(|x| (x - m).exp()).sum::<f32>().ln()
}

/// A part's weight `e^(lse_r - lse)`: exactly 0 for a part with no key, whose o is not read.
pub fn weight(lse_r: f32, lse: f32) -> f32 {
    if lse_r == f32::NEG_INFINITY {
        0.0
    } else {
        (lse_r - lse).exp()
    }
}

/// What rank `rank` keeps: its H heads merged from every rank's partial, `o` `[rows, H, L]`
/// and `lse` `[rows, H]` in f32.
///
/// # Errors
/// [`Error::Shape`] when a partial's sizes disagree with `rows`, `heads` x the number of
/// parts, and `kv_lora_rank`, or `rank` is not one of the parts.
pub fn merge_for_rank(
    parts: &[Partial<'_>],
    rank: usize,
    rows: usize,
    heads: usize,
    kv_lora_rank: usize,
) -> Result<(Vec<f32>, Vec<f32>)> {
    let (world, l) = (parts.len(), kv_lora_rank);
    let hn = heads * world;
    let bad = parts
        .iter()
        .any(|p| p.o.len() != rows * hn * l || p.lse.len() != rows * hn);
    if bad || rank >= world {
        return Err(Error::Shape {
            arg: "dcp partials",
            expected: format!("{world} parts of [{rows}, {hn}, {l}] and [{rows}, {hn}]"),
            got: vec![rank, world],
        });
    }
    let mut o = vec![0f32; rows * heads * l];
    let mut lse = vec![0f32; rows * heads];
    for row in 0..rows {
        for h in 0..heads {
            let g = row * hn + rank * heads + h;
            let merged = merged_lse(parts.iter().map(|p| p.lse[g]));
            lse[row * heads + h] = merged;
            let out = &mut o[(row * heads + h) * l..][..l];
            for p in parts {
                let w = weight(p.lse[g], merged);
                if w == 0.0 {
                    continue;
                }
                for (acc, &x) in out.iter_mut().zip(&p.o[g * l..][..l]) {
                    *acc += w * x;
                }
            }
        }
    }
    Ok((o, lse))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_parts_weigh_nothing_and_make_no_nan() {
        let inf = f32::NEG_INFINITY;
        // Two ranks, one head each (H = 1, N = 2), L = 2, one row.
        let o0 = [1.0, 2.0, f32::NAN, f32::NAN]; // head 1 of rank 0 is empty: garbage o
        let o1 = [3.0, 4.0, 5.0, 6.0];
        let parts = [
            Partial {
                o: &o0,
                lse: &[0.0, inf],
            },
            Partial {
                o: &o1,
                lse: &[0.0, 1.5],
            },
        ];
        let (o, lse) = merge_for_rank(&parts, 0, 1, 1, 2).unwrap();
        assert_eq!(lse, [2f32.ln()]);
        assert_eq!(o, [2.0, 3.0]); // the mean of equal weights
        let (o, lse) = merge_for_rank(&parts, 1, 1, 1, 2).unwrap();
        assert_eq!((o, lse), (vec![5.0, 6.0], vec![1.5]));
        // No key anywhere: o = 0, lse = -inf.
        let none = [Partial {
            o: &[f32::NAN, f32::NAN],
            lse: &[inf],
        }];
        let (o, lse) = merge_for_rank(&none, 0, 1, 1, 2).unwrap();
        assert_eq!((o, lse), (vec![0.0, 0.0], vec![inf]));
    }

    #[test]
    fn a_nan_part_makes_the_merged_head_nan() {
        let inf = f32::NEG_INFINITY;
        for other in [inf, 0.5] {
            // Two ranks, one head each, L = 1; rank 0's head 0 is NaN.
            let parts = [
                Partial {
                    o: &[f32::NAN, 1.0],
                    lse: &[f32::NAN, 0.0],
                },
                Partial {
                    o: &[1.0, 2.0],
                    lse: &[other, 0.0],
                },
            ];
            let (o, lse) = merge_for_rank(&parts, 0, 1, 1, 1).unwrap();
            assert!(
                lse.len() == 1 && lse[0].is_nan(),
                "lse {lse:?} beside {other}"
            );
            assert!(o.iter().all(|x| x.is_nan()), "o {o:?} beside {other}");
        }
    }

    #[test]
    fn merging_splits_of_a_softmax_gives_the_whole() {
        // Scores split 3 / 2 over two ranks; values are scalars (L = 1).
        let s = [0.3f32, -1.2, 2.0, 0.7, -0.1];
        let v = [1.0f32, -2.0, 0.5, 3.0, 1.5];
        let part = |idx: &[usize]| {
            let lse = merged_lse(idx.iter().map(|&i| s[i]));
            let o: f32 = idx.iter().map(|&i| (s[i] - lse).exp() * v[i]).sum();
            (vec![o], vec![lse])
        };
        let (a, b) = (part(&[0, 2, 4]), part(&[1, 3]));
        let parts = [
            Partial { o: &a.0, lse: &a.1 },
            Partial { o: &b.0, lse: &b.1 },
        ];
        let whole = part(&[0, 1, 2, 3, 4]);
        let lse = merged_lse(parts.iter().map(|p| p.lse[0]));
        let o: f32 = parts.iter().map(|p| weight(p.lse[0], lse) * p.o[0]).sum();
        assert!((lse - whole.1[0]).abs() < 1e-6);
        assert!((o - whole.0[0]).abs() < 1e-6);
    }

    #[test]
    fn wrong_sizes_are_errors() {
        let parts = [Partial {
            o: &[0.0; 3],
            lse: &[0.0],
        }];
        assert!(merge_for_rank(&parts, 0, 1, 1, 2).is_err());
        assert!(merge_for_rank(&parts[..0], 0, 1, 1, 3).is_err());
    }
}
