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
    /// A device address; the lifetime ties the view to whatever owns the memory.
    Device {
        ptr: u64,
        ordinal: usize,
        _owner: std::marker::PhantomData<&'a [u8]>,
    },
}

/// Data a writable view points to.
#[derive(Debug)]
enum DataMut<'a> {
    Host(&'a mut [u8]),
    Device {
        ptr: u64,
        ordinal: usize,
        _owner: std::marker::PhantomData<&'a mut [u8]>,
    },
}

impl Data<'_> {
    /// The device address and ordinal; None for host memory.
    fn device(&self) -> Option<(u64, usize)> {
        match *self {
            Data::Host(_) => None,
            Data::Device { ptr, ordinal, .. } => Some((ptr, ordinal)),
        }
    }
}

impl DataMut<'_> {
    /// The device address and ordinal; None for host memory.
    fn device(&self) -> Option<(u64, usize)> {
        match *self {
            DataMut::Host(_) => None,
            DataMut::Device { ptr, ordinal, .. } => Some((ptr, ordinal)),
        }
    }
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
    data: DataMut<'a>,
    dtype: DType,
    shape: [usize; N],
    strides: [usize; N],
}

/// dtype, shape, strides and location accessors, and the device-view constructor, the same
/// for both view kinds (`$data`: the kind's data enum).
macro_rules! layout_accessors {
    ($data:ident) => {
        /// A view of device memory of at least `len` elements at `ptr` on device `ordinal`.
        fn device_view(
            len: usize,
            ptr: u64,
            ordinal: usize,
            dtype: DType,
            shape: [usize; N],
            strides: [usize; N],
        ) -> Result<Self> {
            check_fits(len, shape, strides).map_err(|r| Error::memory("tensor", r))?;
            Ok(Self {
                data: $data::Device {
                    ptr,
                    ordinal,
                    _owner: std::marker::PhantomData,
                },
                dtype,
                shape,
                strides,
            })
        }

        /// Where the data is.
        pub fn location(&self) -> Location {
            self.data
                .device()
                .map_or(Location::Host, |(_, ordinal)| Location::Cuda(ordinal))
        }

        /// The device address of the first element; None for host memory.
        pub fn device_ptr(&self) -> Option<u64> {
            self.data.device().map(|(ptr, _)| ptr)
        }

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

/// The view's span if it fits in `len` elements.
fn check_fits<const N: usize>(
    len: usize,
    shape: [usize; N],
    strides: [usize; N],
) -> Result<usize, String> {
    match span(shape, strides) {
        Some(need) if need <= len => Ok(need),
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
        let span =
            check_fits(data.len(), shape, strides).map_err(|r| Error::memory("tensor", r))?;
        // Only the view's span is kept: nothing reads the caller's memory past the view.
        Ok(TensorRef {
            data: Data::Host(bytemuck::cast_slice(&data[..span])),
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

    /// Another view of the same memory: `shape` and `strides` from element `offset` of this
    /// view's memory (a view of q's rotary part inside a packed q, one request's rows, ...).
    ///
    /// # Errors
    /// [`Error::Memory`] if the new view reaches past this view's span.
    pub fn sub_view<const M: usize>(
        &self,
        offset: usize,
        shape: [usize; M],
        strides: [usize; M],
    ) -> Result<TensorRef<'a, M>> {
        let have = span(self.shape, self.strides).unwrap_or(0);
        let end = span(shape, strides).and_then(|n| n.checked_add(offset));
        let Some(end) = end.filter(|&n| n <= have) else {
            return Err(Error::memory(
                "sub_view",
                format!(
                    "{shape:?} with strides {strides:?} from element {offset} exceeds the view's {have} elements"
                ),
            ));
        };
        let size = self.dtype.size();
        let data = match self.data {
            // In bounds: a host view holds exactly its span, and `end` is within it.
            Data::Host(b) => Data::Host(&b[offset * size..end * size]),
            Data::Device {
                ptr,
                ordinal,
                _owner,
            } => Data::Device {
                ptr: ptr + (offset * size) as u64,
                ordinal,
                _owner,
            },
        };
        Ok(TensorRef {
            data,
            dtype: self.dtype,
            shape,
            strides,
        })
    }

    layout_accessors!(Data);

    /// A view of device memory.
    ///
    /// # Safety
    /// `ptr` must be the address, on CUDA device `ordinal`, of memory that holds every element
    /// of the view (`span * dtype.size()` bytes from `ptr`), and that memory must stay valid and
    /// unwritten by anyone else until the decode reading it has completed on the decoder's
    /// stream (order other streams against it yourself).
    ///
    /// # Errors
    /// [`Error::Memory`] if the view's span overflows.
    #[allow(unsafe_code)]
    pub unsafe fn from_device_ptr(
        ptr: u64,
        ordinal: usize,
        dtype: DType,
        shape: [usize; N],
        strides: [usize; N],
    ) -> Result<Self> {
        Self::device_view(usize::MAX, ptr, ordinal, dtype, shape, strides)
    }

    /// The host bytes of the view's span, from its first element to its last (with the gaps
    /// of a strided view), nothing past it; None for device memory.
    pub fn host_bytes(&self) -> Option<&'a [u8]> {
        match self.data {
            Data::Host(b) => Some(b),
            Data::Device { .. } => None,
        }
    }

    /// The host data of the view's span as `T` (as [`host_bytes`](Self::host_bytes)); None
    /// for device memory or another dtype.
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
        let span =
            check_fits(data.len(), shape, strides).map_err(|r| Error::memory("tensor", r))?;
        // Only the view's span is kept: nothing writes the caller's memory past the view.
        Ok(TensorMut {
            data: DataMut::Host(bytemuck::cast_slice_mut(&mut data[..span])),
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

    layout_accessors!(DataMut);

    /// A writable view of device memory.
    ///
    /// # Safety
    /// As [`TensorRef::from_device_ptr`], and no one else may read or write that memory
    /// until the decode writing it has completed on the decoder's stream.
    ///
    /// # Errors
    /// [`Error::Memory`] if the view's span overflows.
    #[allow(unsafe_code)]
    pub unsafe fn from_device_ptr(
        ptr: u64,
        ordinal: usize,
        dtype: DType,
        shape: [usize; N],
        strides: [usize; N],
    ) -> Result<Self> {
        Self::device_view(usize::MAX, ptr, ordinal, dtype, shape, strides)
    }

    /// The host data of the view's span as `T`, nothing past its last element; None for
    /// device memory or another dtype.
    pub fn host_slice_mut<T: Element>(&mut self) -> Option<&mut [T]> {
        match &mut self.data {
            DataMut::Host(b) if T::DTYPE == self.dtype => bytemuck::try_cast_slice_mut(b).ok(),
            _ => None,
        }
    }
}

#[cfg(feature = "cuda")]
mod cuda_views {
    use cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr};

    use super::*;

    impl<'a, const N: usize> TensorRef<'a, N> {
        /// A view of a cudarc device slice or view (`CudaSlice`, `CudaView`), borrowed for as
        /// long as the view lives.
        ///
        /// # Errors
        /// [`Error::Memory`] if the view reaches past the end of the slice.
        pub fn from_cuda<T, S>(slice: &'a S, shape: [usize; N], strides: [usize; N]) -> Result<Self>
        where
            T: Element + DeviceRepr,
            S: DevicePtr<T>,
        {
            let stream = slice.stream();
            let (ptr, _record) = slice.device_ptr(stream);
            let ordinal = stream.context().ordinal();
            Self::device_view(slice.len(), ptr, ordinal, T::DTYPE, shape, strides)
        }
    }

    impl<'a, const N: usize> TensorMut<'a, N> {
        /// A writable view of a cudarc device slice (`CudaSlice`, `CudaViewMut`).
        ///
        /// # Errors
        /// [`Error::Memory`] if the view reaches past the end of the slice.
        pub fn from_cuda<T, S>(
            slice: &'a mut S,
            shape: [usize; N],
            strides: [usize; N],
        ) -> Result<Self>
        where
            T: Element + DeviceRepr,
            S: DevicePtrMut<T>,
        {
            let len = slice.len();
            let stream = slice.stream().clone();
            let (ptr, _record) = slice.device_ptr_mut(&stream);
            let ordinal = stream.context().ordinal();
            Self::device_view(len, ptr, ordinal, T::DTYPE, shape, strides)
        }
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
    fn sub_views_stay_inside_their_parent() {
        let v: Vec<bf16> = (0..24).map(|i| bf16::from_f32(i as f32)).collect();
        let t = TensorRef::contiguous(&v, [2, 3, 4]).unwrap();
        let tail = t.sub_view(2, [2, 3, 2], [12, 4, 1]).unwrap();
        assert_eq!(tail.host_slice::<bf16>().unwrap()[0].to_f32(), 2.0);
        assert!(
            t.sub_view(3, [2, 3, 2], [12, 4, 1]).is_err(),
            "one past the end"
        );
        assert!(t.sub_view(0, [25], [1]).is_err());
        assert!(t.sub_view(0, [24], [1]).is_ok());
    }

    #[test]
    fn a_host_view_holds_its_span_and_nothing_past_it() {
        let v: Vec<i32> = (0..10).collect();
        let t = TensorRef::contiguous(&v, [3]).unwrap();
        assert_eq!(t.host_slice::<i32>().unwrap(), &[0, 1, 2]);
        let strided = TensorRef::from_host(&v, [2, 2], [4, 1]).unwrap();
        assert_eq!(strided.host_slice::<i32>().unwrap(), &[0, 1, 2, 3, 4, 5]);
        let sub = strided.sub_view(1, [2], [4]).unwrap();
        assert_eq!(sub.host_slice::<i32>().unwrap(), &[1, 2, 3, 4, 5]);
        assert!(
            strided
                .sub_view(6, [0], [1])
                .unwrap()
                .host_bytes()
                .unwrap()
                .is_empty()
        );
        let mut w = vec![0f32; 10];
        let mut t = TensorMut::from_host(&mut w, [2, 2], [3, 1]).unwrap();
        assert_eq!(t.host_slice_mut::<f32>().unwrap().len(), 5);
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
