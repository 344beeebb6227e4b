//! Shared by the DCP tests (CPU simulated ranks and two GPUs): the decoder configuration of a
//! rank and the slice of the whole-sequence reference that a rank must match.

use mla::MlaConfig;
use mla::reference::Reference;
use mla::synth::ProblemSpec;

/// The configuration of `spec`'s dtypes with `heads` heads (H N for a rank's local decode,
/// H for the whole sequence's reference).
pub fn config(spec: &ProblemSpec, heads: usize) -> MlaConfig {
    let mut c = MlaConfig::new(heads, 192f32.powf(-0.5));
    c.model_dtype = spec.model_dtype;
    c.kv_cache_dtype = super::cache_dtype(spec.kv_format);
    c
}

/// The reference's rows for heads `rank * h .. (rank + 1) * h`: what rank `rank` keeps.
pub fn rank_reference(full: &Reference, rank: usize, h: usize) -> Reference {
    let (l, hn) = (full.kv_lora_rank, full.heads);
    let (mut o, mut lse) = (Vec::new(), Vec::new());
    for row in 0..full.rows {
        for head in rank * h..(rank + 1) * h {
            lse.push(full.lse[row * hn + head]);
            o.extend_from_slice(&full.o[(row * hn + head) * l..][..l]);
        }
    }
    Reference {
        rows: full.rows,
        heads: h,
        kv_lora_rank: l,
        o,
        lse,
    }
}
