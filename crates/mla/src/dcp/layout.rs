//! Where a token of a request lives under decode context parallelism (docs/contract.md,
//! "Decode context parallelism"): the KV cache is dealt out to N ranks in interleaved chunks of
//! I tokens. Pure arithmetic, the same on the host as in `kernels/dcp/kernel.cu`'s
//! `dcp_local_seq_lens`.

use crate::error::{Error, Result};

/// One rank's view of the interleaving: rank r of N, chunks of I tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DcpLayout {
    rank: usize,
    world_size: usize,
    interleave: usize,
}

impl DcpLayout {
    /// Rank `rank` of `world_size`, chunks of `interleave` tokens.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a zero world size or interleave, a rank outside the
    /// world, or a chunk round (I x N) beyond i32 (the kernels' lengths).
    pub fn new(rank: usize, world_size: usize, interleave: usize) -> Result<Self> {
        if world_size == 0 || interleave == 0 {
            return Err(Error::config(
                "dcp",
                format!(
                    "world size and interleave must be at least 1, got {world_size} and {interleave}"
                ),
            ));
        }
        if rank >= world_size {
            return Err(Error::config(
                "dcp",
                format!("rank {rank} is outside a world of {world_size}"),
            ));
        }
        let round = world_size.checked_mul(interleave);
        if round.is_none_or(|r| i32::try_from(r).is_err()) {
            return Err(Error::config(
                "dcp",
                format!("interleave {interleave} x world size {world_size} overflows i32"),
            ));
        }
        Ok(DcpLayout {
            rank,
            world_size,
            interleave,
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// N.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// I.
    pub fn interleave(&self) -> usize {
        self.interleave
    }

    /// The rank that holds global token `p`: `(p / I) % N`.
    pub fn owner(&self, p: usize) -> usize {
        (p / self.interleave) % self.world_size
    }

    /// Where global token `p` sits on its owner: `(p / (I N)) I + p % I`.
    pub fn local_position(&self, p: usize) -> usize {
        (p / (self.interleave * self.world_size)) * self.interleave + p % self.interleave
    }

    /// The global token at this rank's local position `local` (the inverse of
    /// [`DcpLayout::local_position`] on the tokens this rank owns).
    pub fn global_position(&self, local: usize) -> usize {
        let (chunk, within) = (local / self.interleave, local % self.interleave);
        (chunk * self.world_size + self.rank) * self.interleave + within
    }

    /// How many of the first `global_len` tokens this rank holds: I per full round of I N
    /// tokens, plus its share of the last, partial round.
    pub fn local_len(&self, global_len: usize) -> usize {
        let round = self.interleave * self.world_size;
        let last = (global_len % round).saturating_sub(self.rank * self.interleave);
        (global_len / round) * self.interleave + last.min(self.interleave)
    }

    /// [`DcpLayout::local_len`] of an i32 length as the kernels read it: a negative length
    /// passes through unchanged (the decode reports it).
    pub fn local_len_i32(&self, global_len: i32) -> i32 {
        match usize::try_from(global_len) {
            // local <= global, so it fits back.
            Ok(len) => self.local_len(len) as i32,
            Err(_) => global_len,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The contract's definition, counted token by token.
    fn counted(l: &DcpLayout, global_len: usize) -> usize {
        (0..global_len).filter(|&p| l.owner(p) == l.rank()).count()
    }

    #[test]
    fn local_length_is_the_count_of_owned_tokens() {
        for world in 1..=4 {
            for interleave in [1, 2, 3, 16, 64] {
                for rank in 0..world {
                    let l = DcpLayout::new(rank, world, interleave).unwrap();
                    for len in 0..(3 * world * interleave + 5) {
                        assert_eq!(l.local_len(len), counted(&l, len), "{l:?} len {len}");
                    }
                }
            }
        }
    }

    #[test]
    fn local_positions_are_dense_and_invertible() {
        let (world, interleave, len) = (3, 4, 101);
        for rank in 0..world {
            let l = DcpLayout::new(rank, world, interleave).unwrap();
            let owned: Vec<usize> = (0..len).filter(|&p| l.owner(p) == rank).collect();
            for (i, &p) in owned.iter().enumerate() {
                assert_eq!(l.local_position(p), i, "rank {rank} token {p}");
                assert_eq!(l.global_position(i), p);
            }
        }
    }

    #[test]
    fn lengths_match_the_contract_example() {
        // I = 2, N = 2, 7 tokens: rank 0 holds 0 1 4 5, rank 1 holds 2 3 6.
        let r0 = DcpLayout::new(0, 2, 2).unwrap();
        let r1 = DcpLayout::new(1, 2, 2).unwrap();
        assert_eq!((r0.local_len(7), r1.local_len(7)), (4, 3));
        assert_eq!((r0.local_len(1), r1.local_len(1)), (1, 0));
        assert_eq!(r1.local_len_i32(-3), -3);
    }

    #[test]
    fn bad_layouts_are_errors() {
        assert!(DcpLayout::new(2, 2, 1).is_err());
        assert!(DcpLayout::new(0, 0, 1).is_err());
        assert!(DcpLayout::new(0, 2, 0).is_err());
        assert!(DcpLayout::new(0, 2, usize::MAX / 2).is_err());
    }
}
