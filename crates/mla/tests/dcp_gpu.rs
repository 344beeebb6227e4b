//! Decode context parallelism on two GPUs of one machine (NCCL): every rank's H heads of the
//! DCP decode must match the f64 reference over the whole sequence, within the contract's
//! tolerances, for bf16 and fp8 caches, an f16 model, uneven lengths (requests that leave a
//! rank with no key), both merges and both ways of making a group. Skips, saying why, where
//! there is no NCCL, fewer than two GPUs, or no `nccl` feature; fails there with
//! `MLA_REQUIRE_GPU=1`.

#[cfg(feature = "cuda")]
mod common;

#[cfg(feature = "nccl")]
mod on_gpus {
    use super::common::dcp::{config, rank_reference};
    use super::common::gpu::skip;
    use super::common::{LSE_TOL, O_TOL};
    use mla::dcp::problem::RankProblem;
    use mla::dcp::{DcpDecode, DcpGroup, DcpId, DcpMerge, available};
    use mla::reference;
    use mla::synth::device::DeviceOutputs;
    use mla::synth::{Problem, ProblemSpec};
    use mla::{Device, KvFormat, MlaConfig, MlaDecode, ModelDtype};

    const WORLD: usize = 2;

    /// Whether two GPUs and NCCL are here; skips the test, saying why, where not.
    fn ready() -> bool {
        match available(WORLD) {
            Ok(v) => {
                eprintln!("dcp_gpu: NCCL version code {v}");
                true
            }
            Err(why) => {
                skip(&why);
                false
            }
        }
    }

    /// One rank: decode its shard (outputs poisoned first) and return (o, lse) as f32.
    fn run_rank(
        group: DcpGroup,
        cfg: &MlaConfig,
        global: &Problem,
        merge: DcpMerge,
    ) -> mla::Result<(Vec<f32>, Vec<f32>)> {
        let mut dec = DcpDecode::new(cfg, group)?;
        dec.set_merge(merge);
        let rp = RankProblem::prepare(&mut dec, global, cfg.kv_cache_dtype)?;
        let inputs = rp.inputs()?;
        let s = dec.stream()?;
        let shape = [global.rows(), cfg.num_heads, cfg.kv_lora_rank];
        let mut out = DeviceOutputs::with_shape(&s, cfg.model_dtype, shape)?;
        // Twice, poisoned each time: the second run must not lean on the first's outputs.
        for _ in 0..2 {
            out.poison(&s)?;
            dec.forward(&inputs, &mut out.views()?)?;
        }
        dec.decoder_mut().check_device_errors()?;
        out.download(&s)
    }

    /// Runs `spec` (H N heads) on the two GPUs and checks every rank against the reference.
    fn check(spec: &ProblemSpec, interleave: usize, merge: DcpMerge, from_id: bool) {
        let global = Problem::generate(spec).unwrap();
        let whole = MlaDecode::new(&config(spec, spec.heads), Device::Cpu).unwrap();
        let full = reference::decode_f64(whole.config(), &global.inputs().unwrap(), None).unwrap();
        let h = spec.heads / WORLD;
        let mut cfg = config(spec, h);
        cfg.dcp_world_size = WORLD;
        let results: Vec<mla::Result<(Vec<f32>, Vec<f32>)>> = if from_id {
            // As separate processes would: rank 0 makes the id, every rank joins with it.
            let id = DcpId::new().unwrap();
            std::thread::scope(|sc| {
                let handles: Vec<_> = (0..WORLD)
                    .map(|rank| {
                        let (cfg, global) = (&cfg, &global);
                        let bytes = id.to_bytes();
                        sc.spawn(move || {
                            let id = DcpId::from_bytes(bytes);
                            let group =
                                DcpGroup::from_unique_id(&id, rank, WORLD, interleave, rank)?;
                            run_rank(group, cfg, global, merge)
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            })
        } else {
            let groups = DcpGroup::in_process(&[0, 1], interleave).unwrap();
            std::thread::scope(|sc| {
                let handles: Vec<_> = groups
                    .into_iter()
                    .map(|g| {
                        let (cfg, global) = (&cfg, &global);
                        sc.spawn(move || run_rank(g, cfg, global, merge))
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            })
        };
        for (rank, r) in results.into_iter().enumerate() {
            let (o, lse) = r.unwrap();
            let acc = rank_reference(&full, rank, h).accuracy(&o, &lse);
            eprintln!(
                "dcp_gpu: {:?} cache, {:?} model, {} heads, I {interleave}, {merge:?}, rank {rank}: o_rel {:.2e}, lse_abs {:.2e}",
                spec.kv_format, spec.model_dtype, spec.heads, acc.o_rel, acc.lse_abs
            );
            assert!(
                acc.o_rel <= O_TOL && acc.lse_abs <= LSE_TOL,
                "rank {rank}: {acc:?}"
            );
        }
    }

    /// Uneven lengths: empty, shorter than a chunk (rank 1 holds nothing), partial rounds.
    fn uneven() -> Vec<usize> {
        vec![0, 1, 5, 37, 300, 1000, 4099, 20000]
    }

    #[test]
    fn bf16_cache_both_merges() {
        if !ready() {
            return;
        }
        for merge in [DcpMerge::AllGatherReduceScatter, DcpMerge::AllToAll] {
            check(&ProblemSpec::new(32, uneven()), 16, merge, false);
        }
    }

    #[test]
    fn fp8_cache_128_heads_from_a_unique_id() {
        if !ready() {
            return;
        }
        let mut spec = ProblemSpec::new(128, uneven());
        spec.kv_format = KvFormat::Fp8E4m3;
        spec.k_scale = 0.5;
        for merge in [DcpMerge::AllGatherReduceScatter, DcpMerge::AllToAll] {
            check(&spec, 64, merge, true);
        }
    }

    #[test]
    fn f16_model_interleave_one() {
        if !ready() {
            return;
        }
        let mut spec = ProblemSpec::new(16, vec![3, 1, 777, 2048]);
        spec.model_dtype = ModelDtype::F16;
        spec.kv_format = KvFormat::F16;
        for merge in [DcpMerge::AllGatherReduceScatter, DcpMerge::AllToAll] {
            check(&spec, 1, merge, false);
        }
    }
}

#[cfg(all(feature = "cuda", not(feature = "nccl")))]
#[test]
fn dcp_gpu_needs_the_nccl_feature() {
    common::gpu::skip("built without the nccl feature");
}
