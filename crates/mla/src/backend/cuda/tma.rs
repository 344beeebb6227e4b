//! The cache as the TMA unit reads it (the narrow and seesaw kernels' copies): the tensor map's
//! description, and the last map encoded, which `forward` reuses while the cache stays put.

use super::ffi;
use super::params::TensorMap;
use crate::error::Result;
use crate::kernels::variant::{TmaBox, Variant};
use crate::plan::DecodePlan;

/// What a tensor map describes: `ffi::tensor_map_3d`'s arguments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MapShape {
    base: u64,
    element_bytes: usize,
    dims: [u64; 3],
    strides: [u64; 2],
    boxes: [u32; 3],
    landing: TmaBox,
}

impl MapShape {
    /// The cache of `plan` at address `kv`, as `kernel` copies it: D elements (16 bits, or fp8
    /// bytes) a key, `page_size` keys a page, `num_blocks` pages (the plan's strides, which
    /// `pointers` checked are multiples of 16 bytes), in boxes of the kernel's chunk
    /// ([`Variant::tma_box`]: 128 bytes swizzled, or 64 fp8 codes) x min(page_size, 64) keys
    /// x 1 page.
    pub(crate) fn kv_cache(plan: &DecodePlan, kernel: &Variant, kv: u64) -> MapShape {
        let u = |x: usize| x as u64;
        let element_bytes = plan.kv_format.size();
        let landing = kernel.tma_box();
        MapShape {
            base: kv,
            element_bytes,
            dims: [
                u(plan.kv_lora_rank + plan.rope_dim),
                u(plan.kv.page_size),
                u(plan.kv.num_blocks),
            ],
            strides: [
                u(plan.kv.token_stride * element_bytes),
                u(plan.kv.page_stride * element_bytes),
            ],
            boxes: [
                (landing.bytes() / element_bytes) as u32,
                plan.kv.page_size.min(64) as u32,
                1,
            ],
            landing,
        }
    }

    /// Its tensor map, from the driver.
    ///
    /// # Errors
    /// [`crate::Error::Driver`] if the driver refuses the description.
    pub(crate) fn encode(&self) -> Result<TensorMap> {
        ffi::tensor_map_3d(
            self.base,
            self.element_bytes,
            self.dims,
            self.strides,
            self.boxes,
            self.landing,
        )
    }
}

/// The last tensor map encoded and what it describes. `forward` runs on every decode (every
/// layer's, without a CUDA graph) and the cache rarely moves, while encoding is a driver call:
/// a decoder re-encodes only when the cache's address or shape changes.
#[derive(Debug, Default)]
pub(crate) struct MapCache {
    last: Option<(MapShape, TensorMap)>,
}

impl MapCache {
    /// The map of `shape`: the last one when it describes the same, else `encode`'s (kept).
    ///
    /// # Errors
    /// `encode`'s; the cache then keeps what it had.
    pub(crate) fn get(
        &mut self,
        shape: MapShape,
        encode: impl FnOnce(&MapShape) -> Result<TensorMap>,
    ) -> Result<TensorMap> {
        match self.last {
            Some((s, map)) if s == shape => Ok(map),
            _ => {
                let map = encode(&shape)?;
                self.last = Some((shape, map));
                Ok(map)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;

    fn shape(base: u64) -> MapShape {
        MapShape {
            base,
            element_bytes: 2,
            dims: [576, 64, 100],
            strides: [1152, 73_728],
            boxes: [64, 64, 1],
            landing: TmaBox::Swizzled128,
        }
    }

    #[test]
    fn a_map_is_encoded_once_per_cache() {
        let mut cache = MapCache::default();
        let mut calls = 0;
        let mut get = |cache: &mut MapCache, s: MapShape| {
            cache
                .get(s, |s| {
                    calls += 1;
                    Ok(TensorMap([s.base; 16]))
                })
                .unwrap()
                .0[0]
        };
        assert_eq!(get(&mut cache, shape(1 << 20)), 1 << 20);
        assert_eq!(get(&mut cache, shape(1 << 20)), 1 << 20);
        // Another cache (or the same one moved): encoded afresh, then reused.
        assert_eq!(get(&mut cache, shape(2 << 20)), 2 << 20);
        assert_eq!(get(&mut cache, shape(2 << 20)), 2 << 20);
        let moved_pages = MapShape {
            dims: [576, 64, 200],
            ..shape(2 << 20)
        };
        assert_eq!(get(&mut cache, moved_pages), 2 << 20);
        // The same cache copied in other boxes (another kernel's): encoded afresh.
        let unswizzled = MapShape {
            landing: TmaBox::Codes64,
            ..moved_pages
        };
        assert_eq!(get(&mut cache, unswizzled), 2 << 20);
        assert_eq!(get(&mut cache, unswizzled), 2 << 20);
        assert_eq!(calls, 4);
    }

    #[test]
    fn a_refused_map_is_not_kept() {
        let mut cache = MapCache::default();
        let ok = |s: &MapShape| Ok(TensorMap([s.base; 16]));
        cache.get(shape(64), ok).unwrap();
        let refused = cache.get(shape(128), |_| {
            Err(Error::Overflow {
                what: "test",
                detail: String::new(),
            })
        });
        assert!(refused.is_err());
        // The refused shape is encoded again next time; the kept one is still served.
        let mut encoded = false;
        cache
            .get(shape(128), |s| {
                encoded = true;
                ok(s)
            })
            .unwrap();
        assert!(encoded);
    }
}
