//! Which keys a query row sees.
//!
//! Row r is request `r / Q`, token `t = r % Q` of the request's Q new tokens; the request's
//! `seq_len` counts those tokens. Causal: `end = max(0, seq_len - (Q - 1 - t))`; a
//! non-causal draft block: `end = seq_len`. A sliding window W: `start = max(0, end - W)`.
//! The row attends to key positions `[start, end)`.

pub use crate::args::Mask;

/// A half-open range of key positions `[start, end)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KeyRange {
    /// First key.
    pub start: usize,
    /// One past the last key.
    pub end: usize,
}

impl KeyRange {
    /// Keys in the range.
    pub fn len(&self) -> usize {
        self.end - self.start
    }

    /// Whether the range holds no key.
    pub fn is_empty(&self) -> bool {
        self.end == self.start
    }
}

/// The keys token `token` (of `query_len`) of a request of length `seq_len` sees.
pub fn key_range(
    seq_len: usize,
    token: usize,
    query_len: usize,
    mask: Mask,
    window: Option<usize>,
) -> KeyRange {
    debug_assert!(token < query_len);
    let end = match mask {
        Mask::Causal => seq_len.saturating_sub(query_len - 1 - token),
        Mask::NonCausal => seq_len,
    };
    let start = window.map_or(0, |w| end.saturating_sub(w));
    KeyRange { start, end }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn causal_rows_end_at_their_own_token() {
        // seq_len 10 includes Q = 3 new tokens at positions 7, 8, 9.
        let ends: Vec<_> = (0..3)
            .map(|t| key_range(10, t, 3, Mask::Causal, None).end)
            .collect();
        assert_eq!(ends, [8, 9, 10]);
        // Clamped at zero for padding rows.
        assert_eq!(key_range(1, 0, 4, Mask::Causal, None), KeyRange::default());
    }

    #[test]
    fn non_causal_rows_see_the_whole_sequence() {
        for t in 0..4 {
            assert_eq!(
                key_range(10, t, 4, Mask::NonCausal, None),
                KeyRange { start: 0, end: 10 }
            );
        }
    }

    #[test]
    fn window_keeps_the_last_keys() {
        assert_eq!(
            key_range(10, 0, 1, Mask::Causal, Some(4)),
            KeyRange { start: 6, end: 10 }
        );
        assert_eq!(
            key_range(10, 1, 3, Mask::Causal, Some(4)),
            KeyRange { start: 5, end: 9 }
        );
        assert_eq!(
            key_range(3, 0, 1, Mask::Causal, Some(8)),
            KeyRange { start: 0, end: 3 }
        );
        assert!(key_range(0, 0, 1, Mask::Causal, Some(8)).is_empty());
    }

    #[test]
    fn single_token_rows_ignore_the_mask() {
        for len in [0, 1, 77] {
            assert_eq!(
                key_range(len, 0, 1, Mask::Causal, None),
                key_range(len, 0, 1, Mask::NonCausal, None)
            );
        }
    }
}
