//! The one unsafe call of the CPU backend: f32 GEMM through `matrixmultiply`, behind a safe
//! wrapper that checks every index it can touch lies inside its slice.
#![allow(unsafe_code)]

/// A matrix inside a slice: `rows x cols`, element (i, j) at `i * row_stride + j * col_stride`.
#[derive(Debug, Clone, Copy)]
pub struct Mat {
    pub rows: usize,
    pub cols: usize,
    pub row_stride: usize,
    pub col_stride: usize,
}

impl Mat {
    /// A row-major matrix whose rows are `row_stride` apart.
    pub fn rows(rows: usize, cols: usize, row_stride: usize) -> Mat {
        Mat {
            rows,
            cols,
            row_stride,
            col_stride: 1,
        }
    }

    /// The transpose of a row-major `cols x rows` matrix whose rows are `row_stride` apart.
    pub fn transposed(rows: usize, cols: usize, row_stride: usize) -> Mat {
        Mat {
            rows,
            cols,
            row_stride: 1,
            col_stride: row_stride,
        }
    }

    /// Whether every element lies inside a slice of `len` elements.
    fn fits(&self, len: usize) -> bool {
        self.rows == 0
            || self.cols == 0
            || (self.rows - 1) * self.row_stride + (self.cols - 1) * self.col_stride < len
    }
}

/// `c = alpha * a * b + beta * c`. With `beta == 0`, `c` need not be initialized.
///
/// # Panics
/// If the shapes disagree or a matrix reaches past its slice (internal invariants: callers
/// size their scratch from the same numbers).
#[allow(clippy::too_many_arguments)]
pub fn gemm(alpha: f32, a: &[f32], am: Mat, b: &[f32], bm: Mat, beta: f32, c: &mut [f32], cm: Mat) {
    assert!(
        am.cols == bm.rows && am.rows == cm.rows && bm.cols == cm.cols,
        "gemm shapes"
    );
    assert!(
        am.fits(a.len()) && bm.fits(b.len()) && cm.fits(c.len()),
        "gemm bounds"
    );
    if cm.rows == 0 || cm.cols == 0 {
        return;
    }
    // SAFETY: the asserts above keep every element matrixmultiply reads or writes inside `a`,
    // `b` and `c`; `c` is borrowed mutably, so it cannot alias `a` or `b`.
    unsafe {
        matrixmultiply::sgemm(
            am.rows,
            am.cols,
            bm.cols,
            alpha,
            a.as_ptr(),
            am.row_stride as isize,
            am.col_stride as isize,
            b.as_ptr(),
            bm.row_stride as isize,
            bm.col_stride as isize,
            beta,
            c.as_mut_ptr(),
            cm.row_stride as isize,
            cm.col_stride as isize,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_a_naive_product_with_strides() {
        // a: 3x4 row-major in a padded buffer (stride 5); b: 4x2 given as the transpose of 2x4.
        let a: Vec<f32> = (0..15).map(|x| x as f32 * 0.5).collect();
        let bt: Vec<f32> = (0..8).map(|x| (x as f32 - 3.0) * 0.25).collect();
        let mut c = vec![1.0f32; 6];
        gemm(
            2.0,
            &a,
            Mat::rows(3, 4, 5),
            &bt,
            Mat::transposed(4, 2, 4),
            1.0,
            &mut c,
            Mat::rows(3, 2, 2),
        );
        for i in 0..3 {
            for j in 0..2 {
                let dot: f32 = (0..4).map(|k| a[i * 5 + k] * bt[j * 4 + k]).sum();
                assert!((c[i * 2 + j] - (2.0 * dot + 1.0)).abs() < 1e-5);
            }
        }
    }

    #[test]
    #[should_panic(expected = "gemm bounds")]
    fn refuses_a_matrix_past_its_slice() {
        let a = vec![0f32; 11];
        let b = vec![0f32; 8];
        let mut c = vec![0f32; 6];
        gemm(
            1.0,
            &a,
            Mat::rows(3, 4, 4),
            &b,
            Mat::rows(4, 2, 2),
            0.0,
            &mut c,
            Mat::rows(3, 2, 2),
        );
    }
}
