//! Sharding a generated problem over DCP ranks, for tests and `mla bench --dcp`: rank r's
//! problem holds the tokens it owns (docs/contract.md, "Decode context parallelism") at their
//! local positions, in a cache and block table of its own, with its local lengths. The query
//! (all H N heads) is the same on every rank.

use crate::dcp::layout::DcpLayout;
use crate::error::{Error, Result};
use crate::synth::{CacheBuf, HalfBuf, Problem};

/// Rank `layout.rank()`'s share of `problem`: the same query, its own keys at their local
/// positions, its local `seq_lens`. Its pages are handed out in reverse order (block ids are
/// not positions) plus one spare block.
///
/// # Errors
/// [`Error::Memory`] if the problem's block table points outside its cache (a generated
/// problem never does), [`Error::Overflow`] for sizes beyond `usize`.
pub fn shard_problem(problem: &Problem, layout: &DcpLayout) -> Result<Problem> {
    let spec = &problem.spec;
    let page = spec.page_size;
    let (token_stride, page_stride) = spec.strides();
    let local_lens: Vec<usize> = spec
        .seq_lens
        .iter()
        .map(|&len| layout.local_len(len))
        .collect();
    let max_blocks = local_lens
        .iter()
        .map(|l| l.div_ceil(page))
        .max()
        .unwrap_or(0)
        .max(1);
    let requests = local_lens.len();
    let num_blocks = requests * max_blocks + 1;
    let cache_len = num_blocks.checked_mul(page_stride).ok_or(Error::Overflow {
        what: "dcp shard",
        detail: format!("{num_blocks} blocks of {page_stride} elements"),
    })?;
    let block_table: Vec<i32> = (0..requests * max_blocks)
        .map(|i| (num_blocks - 1 - i) as i32)
        .collect();

    // (source element offset, destination element offset) of every token the rank owns.
    let mut moves = Vec::new();
    for (req, &local_len) in local_lens.iter().enumerate() {
        for local in 0..local_len {
            let p = layout.global_position(local);
            let src_block = problem
                .block_table
                .get(req * problem.max_blocks + p / page)
                .and_then(|&b| usize::try_from(b).ok())
                .filter(|&b| b < problem.num_blocks)
                .ok_or_else(|| Error::memory("dcp shard", "a block id outside the cache"))?;
            let dst_block = block_table[req * max_blocks + local / page] as usize;
            moves.push((
                src_block * page_stride + (p % page) * token_stride,
                dst_block * page_stride + (local % page) * token_stride,
            ));
        }
    }
    let kv = match &problem.kv {
        CacheBuf::Half(HalfBuf::Bf16(v)) => {
            CacheBuf::Half(HalfBuf::Bf16(gather(v, cache_len, token_stride, &moves)))
        }
        CacheBuf::Half(HalfBuf::F16(v)) => {
            CacheBuf::Half(HalfBuf::F16(gather(v, cache_len, token_stride, &moves)))
        }
        CacheBuf::Fp8(v, dt) => CacheBuf::Fp8(gather(v, cache_len, token_stride, &moves), *dt),
    };
    let mut local_spec = spec.clone();
    local_spec.seq_lens = local_lens.clone();
    Ok(Problem {
        spec: local_spec,
        q: problem.q.clone(),
        kv,
        num_blocks,
        block_table,
        max_blocks,
        seq_lens: local_lens.iter().map(|&l| l as i32).collect(),
    })
}

/// A cache of `len` elements (zero outside the moved tokens) with each token of `moves`
/// copied from `src`.
fn gather<T: Copy + Default>(
    src: &[T],
    len: usize,
    token: usize,
    moves: &[(usize, usize)],
) -> Vec<T> {
    let mut dst = vec![T::default(); len];
    for &(from, to) in moves {
        dst[to..to + token].copy_from_slice(&src[from..from + token]);
    }
    dst
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::ProblemSpec;

    #[test]
    fn every_token_lands_on_its_owner_at_its_local_position() {
        let mut spec = ProblemSpec::new(2, vec![37, 0, 5]);
        spec.kv_lora_rank = 8;
        spec.rope_dim = 8;
        spec.page_size = 4;
        spec.token_pad = 2;
        let p = Problem::generate(&spec).unwrap();
        let HalfBuf::Bf16(global) = (match &p.kv {
            CacheBuf::Half(h) => h.clone(),
            CacheBuf::Fp8(..) => unreachable!("a bf16 problem"),
        }) else {
            unreachable!("a bf16 problem")
        };
        let (token, page_stride) = spec.strides();
        let at = |table: &[i32], max_blocks: usize, req: usize, pos: usize| {
            table[req * max_blocks + pos / 4] as usize * page_stride + (pos % 4) * token
        };
        for rank in 0..3 {
            let layout = DcpLayout::new(rank, 3, 2).unwrap();
            let s = shard_problem(&p, &layout).unwrap();
            let CacheBuf::Half(HalfBuf::Bf16(local)) = &s.kv else {
                unreachable!("a bf16 shard")
            };
            for (req, &len) in spec.seq_lens.iter().enumerate() {
                assert_eq!(s.seq_lens[req] as usize, layout.local_len(len));
                for pos in (0..len).filter(|&q| layout.owner(q) == rank) {
                    let g = at(&p.block_table, p.max_blocks, req, pos);
                    let l = at(
                        &s.block_table,
                        s.max_blocks,
                        req,
                        layout.local_position(pos),
                    );
                    assert_eq!(global[g..g + 16], local[l..l + 16], "rank {rank} pos {pos}");
                }
            }
        }
    }
}
