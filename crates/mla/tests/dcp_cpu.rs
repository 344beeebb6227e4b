//! Decode context parallelism on the CPU with simulated ranks (runs in CI): each rank decodes
//! its shard of the cache for all H N heads with the CPU backend, the host merge
//! ([`mla::dcp::merge`], the GPU kernels' math) combines them, and every rank's H heads must
//! match the f64 reference over the whole sequence, within the contract's tolerances.

mod common;

use common::dcp::{config, rank_reference};
use common::{LSE_TOL, O_TOL};
use mla::dcp::merge::{Partial, merge_for_rank};
use mla::dcp::{DcpLayout, shard::shard_problem};
use mla::reference;
use mla::synth::{Outputs, Problem, ProblemSpec};
use mla::{Device, Error, KvFormat, Mask, MlaConfig, MlaDecode};

/// Runs `spec` (H N heads) over `world` simulated ranks and checks every rank's heads.
fn check(spec: &ProblemSpec, world: usize, interleave: usize) {
    let h = spec.heads / world;
    let global = Problem::generate(spec).unwrap();
    let whole = MlaDecode::new(&config(spec, spec.heads), Device::Cpu).unwrap();
    let full = reference::decode_f64(whole.config(), &global.inputs().unwrap(), None).unwrap();

    let mut cfg = config(spec, h);
    cfg.dcp_world_size = world;
    let mut parts_o = Vec::new();
    let mut parts_lse = Vec::new();
    for rank in 0..world {
        let layout = DcpLayout::new(rank, world, interleave).unwrap();
        let shard = shard_problem(&global, &layout).unwrap();
        let mut dec = MlaDecode::new(&cfg, Device::Cpu).unwrap();
        let mut out = Outputs::poisoned(&shard);
        dec.forward(&shard.inputs().unwrap(), &mut out.views().unwrap())
            .unwrap();
        parts_o.push(out.o.to_f32());
        parts_lse.push(out.lse);
    }
    let parts: Vec<Partial<'_>> = parts_o
        .iter()
        .zip(&parts_lse)
        .map(|(o, lse)| Partial { o, lse })
        .collect();
    for rank in 0..world {
        let (o, lse) = merge_for_rank(&parts, rank, global.rows(), h, spec.kv_lora_rank).unwrap();
        let rounded: Vec<f32> = o.iter().map(|&x| spec.model_dtype.round(x)).collect();
        let acc = rank_reference(&full, rank, h).accuracy(&rounded, &lse);
        assert!(
            acc.o_rel <= O_TOL && acc.lse_abs <= LSE_TOL,
            "world {world} I {interleave} rank {rank} {:?}: {acc:?}",
            spec.kv_format
        );
    }
}

/// Uneven lengths: empty, shorter than one chunk (later ranks hold nothing), a partial last
/// round, and several full rounds.
fn uneven() -> Vec<usize> {
    vec![0, 1, 5, 37, 300, 1000]
}

#[test]
fn two_ranks_bf16_match_the_whole_sequence() {
    for interleave in [1, 16, 64] {
        check(&ProblemSpec::new(8, uneven()), 2, interleave);
    }
}

#[test]
fn three_ranks_fp8_match_the_whole_sequence() {
    let mut spec = ProblemSpec::new(6, uneven());
    spec.kv_format = KvFormat::Fp8E4m3;
    spec.k_scale = 0.5;
    check(&spec, 3, 16);
}

#[test]
fn non_causal_draft_blocks_are_supported() {
    let mut spec = ProblemSpec::new(4, vec![3, 70, 129]);
    spec.query_len = 2;
    spec.mask = Mask::NonCausal;
    spec.page_size = 16;
    check(&spec, 2, 8);
}

#[test]
fn the_seeds_rejections_hold() {
    let mut cfg = MlaConfig::new(4, 0.1);
    cfg.dcp_world_size = 2;
    cfg.sliding_window = Some(128);
    let e = MlaDecode::new(&cfg, Device::Cpu).unwrap_err();
    assert!(matches!(e, Error::SlidingWindowWithDcp), "{e}");

    cfg.sliding_window = None;
    let mut spec = ProblemSpec::new(8, vec![40, 50]);
    spec.query_len = 2;
    spec.mask = Mask::Causal;
    let p = Problem::generate(&spec).unwrap();
    let mut dec = MlaDecode::new(&cfg, Device::Cpu).unwrap();
    let mut out = Outputs::poisoned(&p);
    let e = dec
        .forward(&p.inputs().unwrap(), &mut out.views().unwrap())
        .unwrap_err();
    assert!(matches!(e, Error::CausalMultiTokenWithDcp), "{e}");
}
