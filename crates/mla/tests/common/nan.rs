//! A batch with NaNs planted in q and in keys, read and not read, and the check of a
//! backend's outputs against the f64 reference: o and lse NaN exactly where the reference's
//! are (a NaN lse, never -inf, so that a later LSE merge cannot drop the row), accurate
//! elsewhere.
#![allow(dead_code)]

use mla::reference::Reference;
use mla::synth::{Problem, ProblemSpec};
use mla::{KvFormat, ModelDtype};

/// Request 0: a NaN in q's row 0, head [`NAN_HEAD`]; request 1: a NaN in a key it reads
/// (every head of its row); request 2: no key; request 3: a NaN in a key of its last page
/// past its length (never read).
pub const LENS: [usize; 4] = [700, 40, 0, 90];
/// The head whose q holds a NaN.
pub const NAN_HEAD: usize = 3;

/// The planted problem: `heads` heads (at least 4), pages of 16 keys.
pub fn nan_problem(heads: usize, model: ModelDtype, kv: KvFormat) -> Problem {
    let mut s = ProblemSpec::new(heads, LENS.to_vec()).with_format(model, kv);
    s.page_size = 16;
    let mut p = Problem::generate(&s).unwrap();
    p.set_q(0, NAN_HEAD, 7, f32::NAN).unwrap();
    p.set_key(1, 13, 520, f32::NAN).unwrap(); // a rotary element: the scores only
    p.set_key(3, 95, 0, f32::NAN).unwrap();
    p
}

/// Whether (row, head) of the planted problem must be NaN.
pub fn planted_nan(row: usize, head: usize) -> bool {
    (row == 0 && head == NAN_HEAD) || row == 1
}

/// Asserts that the reference is NaN exactly where [`planted_nan`] says (so that the problem
/// plants what it means to), and that `o` and `lse` are within `o_tol` and `lse_tol` of it
/// head by head, a NaN counting as exact only against a NaN.
pub fn assert_nan_where_the_reference_is(
    reference: &Reference,
    o: &[f32],
    lse: &[f32],
    o_tol: f64,
    lse_tol: f64,
    what: &str,
) {
    let h = reference.heads;
    for (i, a) in reference.head_accuracy(o, lse).iter().enumerate() {
        let (row, head) = (i / h, i % h);
        assert_eq!(
            reference.lse[i].is_nan(),
            planted_nan(row, head),
            "the reference at row {row}, head {head}"
        );
        assert!(
            a.o_rel <= o_tol && a.lse_abs <= lse_tol,
            "{what}: row {row}, head {head}: lse {} against {}, o_rel {:.3e}, lse_abs {:.3e}",
            lse[i],
            reference.lse[i],
            a.o_rel,
            a.lse_abs
        );
    }
}
