//! Scratch buffers that start on a 64-byte cache line.
//!
//! The bf16-product paths walk their buffers in rows whose strides are whole lines (a tile row
//! of 64 bytes, a 512-bit load at a multiple of 16 values). A `Vec` of 4-byte values starts
//! wherever the allocator puts it, 16 bytes into a line for the large ones, and then every
//! such row straddles two lines: twice the lines for each tile load and store.

use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};

use bytemuck::{Pod, Zeroable};

/// Bytes of a cache line.
const LINE_BYTES: usize = 64;

/// A cache line: the unit a [`LineBuf`] is allocated in.
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C, align(64))]
struct Line([u8; LINE_BYTES]);

/// `len` values of `T` from the start of a cache line, zero when made.
pub struct LineBuf<T> {
    lines: Vec<Line>,
    len: usize,
    values: PhantomData<T>,
}

impl<T: Pod> LineBuf<T> {
    /// `len` zero values.
    pub fn zeroed(len: usize) -> Self {
        const { assert!(LINE_BYTES.is_multiple_of(size_of::<T>()) && size_of::<T>() > 0) };
        let lines = (len * size_of::<T>()).div_ceil(LINE_BYTES);
        LineBuf {
            lines: vec![Line::zeroed(); lines],
            len,
            values: PhantomData,
        }
    }
}

impl<T: Pod> Deref for LineBuf<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        &bytemuck::cast_slice(&self.lines)[..self.len]
    }
}

impl<T: Pod> DerefMut for LineBuf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut bytemuck::cast_slice_mut(&mut self.lines)[..self.len]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buffer_starts_on_a_line_holds_its_values_and_is_zero() {
        for len in [0, 1, 15, 16, 17, 1000, 36_864] {
            let mut b = LineBuf::<f32>::zeroed(len);
            assert_eq!(b.len(), len);
            assert!(b.iter().all(|&x| x == 0.0));
            assert_eq!(b.as_ptr() as usize % LINE_BYTES, 0, "len {len}");
            b.iter_mut().enumerate().for_each(|(i, x)| *x = i as f32);
            assert!(b.iter().enumerate().all(|(i, &x)| x == i as f32));
            let words = LineBuf::<u32>::zeroed(len);
            assert_eq!(words.as_ptr() as usize % LINE_BYTES, 0);
        }
    }
}
