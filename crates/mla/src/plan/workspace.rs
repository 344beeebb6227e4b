//! The workspace manager: one scratch buffer shared by every decode call, reserved at the
//! worst case and then locked (vLLM's `WorkspaceManager`).
//!
//! This module is bookkeeping only: sizes, 256-byte aligned offsets and the lock. The backend
//! owns the memory (a host `Vec` or a device allocation) and resizes it when
//! [`WorkspaceManager::ensure`] reports growth, which can only happen before the lock. Once
//! locked, a decode that would need more is an error, never an allocation: that is what lets
//! forward run inside CUDA-graph capture.

use super::schedule;
use crate::error::{Error, Result};
use crate::kernels::variant::SCHEDULED_CTAS_PER_SM;

/// Alignment of every view into the workspace, in bytes.
pub const ALIGN: usize = 256;

/// A view into the workspace: `bytes` bytes from `offset` (a multiple of [`ALIGN`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    /// Byte offset from the start of the buffer.
    pub offset: usize,
    /// Length in bytes.
    pub bytes: usize,
}

/// Size and lock state of the workspace.
#[derive(Debug, Clone, Default)]
pub struct WorkspaceManager {
    size: usize,
    locked: bool,
}

fn align_up(x: usize) -> Option<usize> {
    x.checked_next_multiple_of(ALIGN)
}

/// Lays out `K` simultaneous views back to back, each at a 256-byte aligned offset. Returns
/// the views and the bytes they need in all.
pub fn layout<const K: usize>(bytes: [usize; K]) -> Result<([Region; K], usize)> {
    let mut regions = [Region {
        offset: 0,
        bytes: 0,
    }; K];
    let mut end = 0usize;
    for (r, &b) in regions.iter_mut().zip(&bytes) {
        let offset = align_up(end).ok_or_else(|| overflow(&bytes))?;
        end = offset.checked_add(b).ok_or_else(|| overflow(&bytes))?;
        *r = Region { offset, bytes: b };
    }
    Ok((regions, end))
}

fn overflow(bytes: &[usize]) -> Error {
    Error::Overflow {
        what: "workspace",
        detail: format!("views of {bytes:?} bytes"),
    }
}

impl WorkspaceManager {
    /// An empty, unlocked workspace.
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes the backend's buffer must hold.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Whether growth is forbidden.
    pub fn is_locked(&self) -> bool {
        self.locked
    }

    /// Forbids growth from now on.
    pub fn lock(&mut self) {
        self.locked = true;
    }

    /// Makes room for `required` bytes: when that is more than it holds, `grow(required)`
    /// must provide the memory (the backend resizes its buffer), and the size changes only
    /// if it did. Returns whether the size grew.
    ///
    /// # Errors
    /// [`Error::WorkspaceLocked`] if it would grow after [`WorkspaceManager::lock`]; `grow`'s.
    pub fn ensure(
        &mut self,
        required: usize,
        grow: impl FnOnce(usize) -> Result<()>,
    ) -> Result<bool> {
        if required <= self.size {
            return Ok(false);
        }
        if self.locked {
            return Err(Error::WorkspaceLocked {
                required,
                current: self.size,
            });
        }
        grow(required)?;
        self.size = required;
        Ok(true)
    }

    /// Lays out simultaneous views and makes room for them.
    ///
    /// # Errors
    /// As [`WorkspaceManager::ensure`], and [`Error::Overflow`] for sizes beyond `usize`.
    pub fn simultaneous<const K: usize>(&mut self, bytes: [usize; K]) -> Result<[Region; K]> {
        let (regions, total) = layout(bytes)?;
        self.ensure(total, |_| Ok(()))?;
        Ok(regions)
    }
}

/// The workspace views of a decode: partial outputs `[rows, splits, heads, L]` f32 and their
/// LSEs `[rows, splits, heads]` f32. Used by the plan and by the worst-case reservation, so
/// the two always agree.
pub fn decode_workspace(
    rows: usize,
    heads: usize,
    splits: usize,
    kv_lora_rank: usize,
) -> Result<([Region; 2], usize)> {
    let overflow = || Error::Overflow {
        what: "workspace",
        detail: format!("{rows} rows x {heads} heads x {splits} splits x {kv_lora_rank} values"),
    };
    let lse = rows
        .checked_mul(heads)
        .and_then(|x| x.checked_mul(splits))
        .and_then(|x| x.checked_mul(4))
        .ok_or_else(overflow)?;
    let o = lse.checked_mul(kv_lora_rank).ok_or_else(overflow)?;
    layout([o, lse])
}

/// The workspace views of a scheduled decode, and the SM count they were sized for (the
/// backend shares the schedule among that many SMs' CTAs, so the two always agree).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScheduledViews {
    /// Partial outputs `[slot rows, L]` f32.
    pub partial_o: Region,
    /// Their LSEs `[slot rows]` f32.
    pub partial_lse: Region,
    /// The schedule's i32s ([`schedule::ScheduledGrid::int_offsets`]).
    pub ints: Region,
    /// SMs the schedule is shared among.
    pub sm_count: usize,
}

/// The workspace views of a scheduled decode of `rows` query rows over `heads` heads on
/// `sm_count` SMs, for any stage-1 kernel that schedules, and the bytes they take. A CTA takes
/// 16 to 64 heads and an SM at most 64 heads' worth of CTAs, so a grid's slot rows
/// ([`schedule::ScheduledGrid::partial_rows`]) are at most rows x (heads + 63) plus 64 x
/// SMs (or one CTA a head block, heads + 63, where there are more head blocks than that),
/// and its integers at most those of one head block on two CTAs an SM.
pub fn scheduled_workspace(
    rows: usize,
    heads: usize,
    kv_lora_rank: usize,
    sm_count: usize,
) -> Result<(ScheduledViews, usize)> {
    let sizes = (|| {
        let slot_rows = rows
            .checked_mul(heads.checked_add(63)?)?
            .checked_add(sm_count.checked_mul(64)?.max(heads.checked_add(63)?))?;
        let lse = slot_rows.checked_mul(4)?;
        // The most integers: one head block, the most CTAs an SM of a scheduled variant (no
        // larger than the slot rows just checked, so they cannot overflow).
        let per_sm = SCHEDULED_CTAS_PER_SM;
        let ints = schedule::ScheduledGrid::new(rows, 16, 16, per_sm, sm_count).ints();
        Some([lse.checked_mul(kv_lora_rank)?, lse, ints.checked_mul(4)?])
    })()
    .ok_or_else(|| Error::Overflow {
        what: "workspace",
        detail: format!("a schedule of {rows} rows x {heads} heads on {sm_count} SMs"),
    })?;
    let ([partial_o, partial_lse, ints], bytes) = layout(sizes)?;
    let views = ScheduledViews {
        partial_o,
        partial_lse,
        ints,
        sm_count,
    };
    Ok((views, bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn views_are_aligned_and_disjoint() {
        let (r, total) = layout([1000, 4, 0, 256]).unwrap();
        assert_eq!(
            r[0],
            Region {
                offset: 0,
                bytes: 1000
            }
        );
        assert_eq!(
            r[1],
            Region {
                offset: 1024,
                bytes: 4
            }
        );
        assert_eq!(
            r[2],
            Region {
                offset: 1280,
                bytes: 0
            }
        );
        assert_eq!(
            r[3],
            Region {
                offset: 1280,
                bytes: 256
            }
        );
        assert_eq!(total, 1536);
        for v in r {
            assert_eq!(v.offset % ALIGN, 0);
        }
    }

    #[test]
    fn grows_until_locked_then_refuses() {
        let mut w = WorkspaceManager::new();
        assert!(w.ensure(100, |_| Ok(())).unwrap());
        assert!(!w.ensure(50, |_| panic!("no growth needed")).unwrap());
        assert_eq!(w.size(), 100);
        // Memory that cannot be had leaves the size alone.
        let refused = w.ensure(200, |n| {
            Err(Error::Overflow {
                what: "test",
                detail: n.to_string(),
            })
        });
        assert!(matches!(refused, Err(Error::Overflow { .. })));
        assert_eq!(w.size(), 100);
        w.simultaneous([300, 300]).unwrap();
        assert_eq!(w.size(), 812); // [0, 300) and [512, 812)
        w.lock();
        assert!(w.is_locked());
        // Within the locked size: fine.
        w.simultaneous([256, 300]).unwrap();
        let e = w.simultaneous([2 << 20, 1 << 20]).unwrap_err();
        match e {
            Error::WorkspaceLocked { required, current } => {
                assert_eq!(current, 812);
                assert_eq!(required, 3 << 20);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(w.size(), 812, "a refused request leaves the size alone");
    }

    #[test]
    fn overflow_is_an_error() {
        assert!(matches!(
            layout([usize::MAX, 1]),
            Err(Error::Overflow { .. })
        ));
    }
}
