//! Tensor views: where the data is, its storage dtype, shape and strides (in elements).
//!
//! mla does not own tensors; it reads and writes the caller's. A view is checked once when it
//! is built (a host view must fit in its slice) and again by the plan against what the decode
//! expects (dtype, shape, strides). Rank is a const parameter: q is `TensorRef<3>`, the block
//! table `TensorRef<2>`, seq_lens `TensorRef<1>`.

use std::fmt;

use crate::dtype::{DType, Element};
use crate::error::{Error, Result};

/// Where a tensor lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Location {
    /// Host memory.
    Host,
    /// Memory of CUDA device `ordinal`.
    Cuda(usize),
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::Host => f.write_str("the host"),
            Location::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// Data a read-only view points to.
#[derive(Debug, Clone, Copy)]
enum Data<'a> {
    Host(&'a [u8]),
}

/// A read-only view of a caller's tensor.
#[derive(Debug, Clone, Copy)]
pub struct TensorRef<'a, const N: usize> {
    data: Data<'a>,
    dtype: DType,
    shape: [usize; N],
    strides: [usize; N],
}

/// A writable view of a caller's tensor.
#[derive(Debug)]
pub struct TensorMut<'a, const N: usize> {
    data: &'a mut [u8],
    dtype: DType,
    shape: [usize; N],
    strides: [usize; N],
}

/// dtype, shape and strides accessors, the same for both view kinds.
macro_rules! layout_accessors {
    () => {
        /// Storage dtype.
        pub fn dtype(&self) -> DType {
            self.dtype
        }

        /// Shape.
        pub fn shape(&self) -> [usize; N] {
            self.shape
        }

        /// Strides in elements.
        pub fn strides(&self) -> [usize; N] {
            self.strides
        }
    };
}

/// Row-major strides of a shape.
pub fn contiguous_strides<const N: usize>(shape: [usize; N]) -> [usize; N] {
    let mut strides = [0; N];
    let mut s = 1usize;
    for i in (0..N).rev() {
        strides[i] = s;
        s = s.saturating_mul(shape[i]);
    }
    strides
}

/// Elements a view spans from its first element: 1 + sum((shape_i - 1) * stride_i), or 0 for
/// an empty shape. None when it overflows.
fn span<const N: usize>(shape: [usize; N], strides: [usize; N]) -> Option<usize> {
    if shape.contains(&0) {
        return Some(0);
    }
    shape
        .iter()
        .zip(&strides)
        .try_fold(1usize, |acc, (&n, &s)| {
            (n - 1).checked_mul(s).and_then(|x| acc.checked_add(x))
        })
}

fn check_fits<const N: usize>(
    len: usize,
    shape: [usize; N],
    strides: [usize; N],
) -> Result<(), String> {
    match span(shape, strides) {
        Some(need) if need <= len => Ok(()),
        Some(need) => Err(format!(
            "view of shape {shape:?} and strides {strides:?} spans {need} elements but the slice holds {len}"
        )),
        None => Err(format!(
            "view of shape {shape:?} and strides {strides:?} overflows"
        )),
    }
}

impl<'a, const N: usize> TensorRef<'a, N> {
    /// A view of a host slice with explicit strides (in elements).
    ///
    /// # Errors
    /// [`Error::Memory`] if the view reaches past the end of `data`.
    pub fn from_host<T: Element>(
        data: &'a [T],
        shape: [usize; N],
        strides: [usize; N],
    ) -> Result<Self> {
        check_fits(data.len(), shape, strides).map_err(|r| Error::memory("tensor", r))?;
        Ok(TensorRef {
            data: Data::Host(bytemuck::cast_slice(data)),
            dtype: T::DTYPE,
            shape,
            strides,
        })
    }

    /// A row-major view of a host slice.
    ///
    /// # Errors
    /// [`Error::Memory`] if the slice is shorter than the shape.
    pub fn contiguous<T: Element>(data: &'a [T], shape: [usize; N]) -> Result<Self> {
        Self::from_host(data, shape, contiguous_strides(shape))
    }

    /// The same bytes read as another dtype of the same size (an fp8 cache allocated as u8).
    ///
    /// # Errors
    /// [`Error::Dtype`] if the sizes differ.
    pub fn view_as(mut self, dtype: DType) -> Result<Self> {
        if dtype.size() != self.dtype.size() {
            return Err(Error::Dtype {
                arg: "view_as",
                expected: format!("a dtype of {} bytes", self.dtype.size()),
                got: dtype.to_string(),
            });
        }
        self.dtype = dtype;
        Ok(self)
    }

    layout_accessors!();

    /// Where the data is.
    pub fn location(&self) -> Location {
        match self.data {
            Data::Host(_) => Location::Host,
        }
    }

    /// The host bytes, from the first element; None for device memory.
    pub fn host_bytes(&self) -> Option<&'a [u8]> {
        match self.data {
            Data::Host(b) => Some(b),
        }
    }

    /// The host data as `T`; None for device memory or another dtype.
    pub fn host_slice<T: Element>(&self) -> Option<&'a [T]> {
        (T::DTYPE == self.dtype)
            .then(|| {
                self.host_bytes()
                    .and_then(|b| bytemuck::try_cast_slice(b).ok())
            })
            .flatten()
    }
}

impl<'a, const N: usize> TensorMut<'a, N> {
    /// A writable view of a host slice with explicit strides (in elements).
    ///
    /// # Errors
    /// [`Error::Memory`] if the view reaches past the end of `data`.
    pub fn from_host<T: Element>(
        data: &'a mut [T],
        shape: [usize; N],
        strides: [usize; N],
    ) -> Result<Self> {
        check_fits(data.len(), shape, strides).map_err(|r| Error::memory("tensor", r))?;
        Ok(TensorMut {
            data: bytemuck::cast_slice_mut(data),
            dtype: T::DTYPE,
            shape,
            strides,
        })
    }

    /// A row-major writable view of a host slice.
    ///
    /// # Errors
    /// [`Error::Memory`] if the slice is shorter than the shape.
    pub fn contiguous<T: Element>(data: &'a mut [T], shape: [usize; N]) -> Result<Self> {
        Self::from_host(data, shape, contiguous_strides(shape))
    }

    layout_accessors!();

    /// Where the data is.
    pub fn location(&self) -> Location {
        Location::Host
    }

    /// The host data as `T`; None for another dtype.
    pub fn host_slice_mut<T: Element>(&mut self) -> Option<&mut [T]> {
        if T::DTYPE != self.dtype {
            return None;
        }
        bytemuck::try_cast_slice_mut(&mut *self.data).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    #[test]
    fn contiguous_strides_are_row_major() {
        assert_eq!(contiguous_strides([2, 3, 4]), [12, 4, 1]);
        assert_eq!(contiguous_strides([5]), [1]);
    }

    #[test]
    fn a_view_must_fit_in_its_slice() {
        let v = vec![bf16::ZERO; 2 * 3 * 4];
        assert!(TensorRef::contiguous(&v, [2, 3, 4]).is_ok());
        // Padded rows: the last row may end early, the span is what counts.
        assert!(TensorRef::from_host(&v, [2, 3, 4], [13, 4, 1]).is_err());
        assert!(TensorRef::from_host(&v[..23], [2, 3, 4], [12, 4, 1]).is_err());
        assert!(TensorRef::from_host(&v[..0], [0, 3, 4], [12, 4, 1]).is_ok());
        let e = TensorRef::from_host(&v, [2, 3, 4], [usize::MAX, 4, 1]).unwrap_err();
        assert!(e.to_string().contains("overflows"), "{e}");
    }

    #[test]
    fn typed_access_checks_the_dtype() {
        let v = vec![1u8, 2, 3, 4];
        let t = TensorRef::contiguous(&v, [4]).unwrap();
        assert!(t.host_slice::<u8>().is_some());
        assert!(t.host_slice::<i32>().is_none());
        let t = t.view_as(DType::F8E4M3).unwrap();
        assert_eq!(t.dtype(), DType::F8E4M3);
        assert!(t.view_as(DType::BF16).is_err());
        assert_eq!(t.location(), Location::Host);
    }
}
