//! `mla bench --dcp N`: one GPU against N for a decode with decode context parallelism.
//!
//! The same random problem (H N heads over the whole context) is decoded on GPU 0 alone
//! (CUDA-graph replays, as `mla bench` times every decode) and over GPUs 0..N, one thread per
//! rank, each keeping H heads. A DCP iteration starts on all ranks together (a host barrier);
//! on each rank CUDA events split it into the local attention (local lengths + decode of the
//! H N heads over the rank's keys) and the rest (NCCL exchange + merge kernels, including
//! any wait for the slower rank). The table reports, over ranks, the largest median of each,
//! and how far the DCP output is from the single GPU's (`||o_dcp - o_1|| / ||o_1||`).

use std::sync::{Arc, Barrier};

use mla::cudarc::driver::sys::CUevent_flags;
use mla::dcp::problem::RankProblem;
use mla::dcp::{DcpDecode, DcpGroup, DcpMerge};
use mla::synth::Problem;
use mla::synth::device::DeviceOutputs;
use mla::{Error, MlaConfig, MlaDecode};

use crate::timing::median;

/// What one rank measured: median attention and total microseconds, its checked output.
struct RankTimes {
    attend_us: f64,
    total_us: f64,
    o: Vec<f32>,
}

/// A DCP measurement of one merge.
pub struct DcpMeasured {
    pub merge: DcpMerge,
    pub attend_us: f64,
    pub total_us: f64,
    /// `||o_dcp - o_1|| / ||o_1||` over all heads.
    pub diff: f64,
}

fn rank_run(
    group: DcpGroup,
    cfg: &MlaConfig,
    problem: &Problem,
    merge: DcpMerge,
    iters: usize,
    barrier: &Barrier,
) -> mla::Result<RankTimes> {
    let mut dec = DcpDecode::new(cfg, group)?;
    dec.set_merge(merge);
    let rp = RankProblem::prepare(&mut dec, problem, cfg.kv_cache_dtype)?;
    let inputs = rp.inputs()?;
    let s = dec.stream()?;
    let shape = [problem.rows(), cfg.num_heads, cfg.kv_lora_rank];
    let mut out = DeviceOutputs::with_shape(&s, cfg.model_dtype, shape)?;
    dec.forward(&inputs, &mut out.views()?)?;
    dec.decoder_mut().check_device_errors()?;
    let (o, _) = out.download(&s)?;

    let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let ev = |s: &Arc<mla::cudarc::driver::CudaStream>| {
        s.record_event(flags)
            .map_err(Error::driver("record an event"))
    };
    let (mut attend, mut total) = (Vec::new(), Vec::new());
    for _ in 0..iters {
        s.synchronize().map_err(Error::driver("synchronize"))?;
        barrier.wait();
        let e0 = ev(&s)?;
        dec.attend(&inputs)?;
        let e1 = ev(&s)?;
        dec.merge(&mut out.views()?)?;
        let e2 = ev(&s)?;
        let ms = |a: &mla::cudarc::driver::CudaEvent, b| {
            a.elapsed_ms(b)
                .map(f64::from)
                .map_err(Error::driver("read the events"))
        };
        attend.push(ms(&e0, &e1)? * 1e3);
        total.push(ms(&e0, &e2)? * 1e3);
    }
    dec.decoder_mut().check_device_errors()?;
    Ok(RankTimes {
        attend_us: median(attend),
        total_us: median(total),
        o,
    })
}

/// Times `problem` (H N heads) over devices 0..world with `merge`; `reference_o` is the
/// single GPU's o `[rows, H N, L]`.
pub fn measure(
    problem: &Problem,
    cfg_all: &MlaConfig,
    world: usize,
    interleave: usize,
    merge: DcpMerge,
    iters: usize,
    reference_o: &[f32],
) -> mla::Result<DcpMeasured> {
    let hn = cfg_all.num_heads;
    if !hn.is_multiple_of(world) {
        return Err(Error::InvalidConfig {
            field: "heads",
            reason: format!("{hn} heads do not split over {world} ranks"),
        });
    }
    let mut cfg = cfg_all.clone();
    cfg.num_heads = hn / world;
    cfg.dcp_world_size = world;
    let ordinals: Vec<usize> = (0..world).collect();
    let groups = DcpGroup::in_process(&ordinals, interleave)?;
    let barrier = Barrier::new(world);
    let results: Vec<mla::Result<RankTimes>> = std::thread::scope(|sc| {
        let handles: Vec<_> = groups
            .into_iter()
            .map(|g| {
                let (cfg, barrier) = (&cfg, &barrier);
                sc.spawn(move || rank_run(g, cfg, problem, merge, iters, barrier))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::NoCudaDevice("a rank's thread panicked".into())))
            })
            .collect()
    });
    let ranks = results.into_iter().collect::<mla::Result<Vec<_>>>()?;
    // Rank r holds heads r H .. (r + 1) H of every row.
    let (rows, h, l) = (problem.rows(), hn / world, cfg.kv_lora_rank);
    let (mut diff, mut norm) = (0f64, 0f64);
    for (rank, t) in ranks.iter().enumerate() {
        for row in 0..rows {
            for head in 0..h {
                let mine = &t.o[(row * h + head) * l..][..l];
                let want = &reference_o[(row * hn + rank * h + head) * l..][..l];
                for (&a, &b) in mine.iter().zip(want) {
                    diff += f64::from(a - b).powi(2);
                    norm += f64::from(b).powi(2);
                }
            }
        }
    }
    Ok(DcpMeasured {
        merge,
        attend_us: ranks.iter().map(|t| t.attend_us).fold(0.0, f64::max),
        total_us: ranks.iter().map(|t| t.total_us).fold(0.0, f64::max),
        diff: if norm > 0.0 {
            (diff / norm).sqrt()
        } else {
            diff.sqrt()
        },
    })
}

/// The single-GPU decode of the whole problem: (median us, o).
pub fn single_gpu(
    problem: &Problem,
    cfg: &MlaConfig,
    iters: usize,
) -> mla::Result<(f64, Vec<f32>)> {
    let mut dec = MlaDecode::new(cfg, mla::Device::Cuda(0))?;
    let max_len = problem.spec.seq_lens.iter().copied().max().unwrap_or(0);
    dec.reserve_workspace(problem.rows(), max_len)?;
    dec.lock_workspace();
    let t = crate::gpu_timing::time(&mut dec, problem, iters)?;
    Ok((t.secs * 1e6, t.o))
}
