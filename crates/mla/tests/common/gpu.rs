//! What the GPU tests share: open the device (or say why a test skips), copy a problem to it,
//! run a case, and compare with the CPU backend and the f64 reference.
#![allow(dead_code)]

use mla::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use mla::cudarc::driver::{CudaGraph, CudaStream};
use mla::reference::{self, Accuracy, Reference};
use mla::synth::{Outputs, Problem};
use mla::{DecodePlan, Device, Error, MlaConfig, MlaDecode};
use std::sync::Arc;

#[allow(unused_imports)]
pub use mla::synth::device::{DeviceCache, DeviceOutputs, DeviceProblem};

use super::Case;

pub mod kernels;

/// What `launch` enqueues on `st`, captured into a graph (not run), and what it returned.
pub fn capture<T>(st: &Arc<CudaStream>, launch: impl FnOnce() -> T) -> (CudaGraph, T) {
    st.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .unwrap();
    let returned = launch();
    let graph = st
        .end_capture(CUgraphInstantiate_flags(0))
        .unwrap()
        .expect("a graph");
    (graph, returned)
}

/// Whether this run must have a GPU: `MLA_REQUIRE_GPU=1` (scripts/gpu/run.sh sets it on the GPU
/// machine), so that a GPU that cannot be opened fails the tests instead of skipping them.
pub fn gpu_required() -> bool {
    std::env::var_os("MLA_REQUIRE_GPU").is_some_and(|v| !v.is_empty() && v != "0")
}

/// Skips the running test, saying why, or fails it where a GPU is required ([`gpu_required`]).
pub fn skip(why: &str) {
    assert!(
        !gpu_required(),
        "MLA_REQUIRE_GPU is set and this test cannot run: {why}"
    );
    let exe = std::env::args().next().unwrap_or_default();
    let stem = std::path::Path::new(&exe)
        .file_stem()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    // Cargo names a test binary `<name>-<16 hex digits>`.
    let binary = match stem.rsplit_once('-') {
        Some((name, hash)) if hash.len() == 16 && hash.chars().all(|c| c.is_ascii_hexdigit()) => {
            name.to_string()
        }
        _ => stem.clone(),
    };
    let test = std::thread::current().name().unwrap_or("?").to_string();
    say(&format!("skipped {binary}: {test}: {why}"));
}

/// Writes a line to the process's stderr directly: the test harness captures `eprintln!` of a
/// test that passes and hides it, so a skip or a tally would otherwise never show.
pub fn say(line: &str) {
    use std::io::Write;
    let _ = std::io::stderr().write_all(format!("{line}\n").as_bytes());
}

/// The decoder on CUDA device 0, or None (the test skipped, saying why) where there is none.
pub fn open(cfg: &MlaConfig) -> Option<MlaDecode> {
    match MlaDecode::new(cfg, Device::Cuda(0)) {
        Ok(dec) => Some(dec),
        Err(e @ (Error::NoCudaDevice(_) | Error::CudaNotCompiled)) => {
            skip(&e.to_string());
            None
        }
        Err(e) => panic!("opening the GPU decoder failed: {e}"),
    }
}

/// The error opening a GPU decoder with `cfg` gives, or None (the test skipped) where there is
/// no GPU. Panics if the decoder opens.
pub fn open_err(cfg: &MlaConfig) -> Option<Error> {
    match MlaDecode::new(cfg, Device::Cuda(0)) {
        Ok(_) => panic!("a GPU decoder opened with {cfg:?}"),
        Err(e @ (Error::NoCudaDevice(_) | Error::CudaNotCompiled)) => {
            skip(&e.to_string());
            None
        }
        Err(e) => Some(e),
    }
}

/// The stream of a GPU decoder.
pub fn stream(dec: &MlaDecode) -> Arc<CudaStream> {
    dec.cuda_stream().expect("a GPU decoder").clone()
}

/// The problem's host inputs, with the query packed or as two strided parts.
pub fn host_inputs(p: &Problem, split_q: bool) -> mla::DecodeInputs<'_> {
    let mut inputs = p.inputs().unwrap();
    if split_q {
        inputs.q = p.query_split().unwrap();
    }
    inputs
}

/// The CPU backend's outputs for a problem, split as the GPU splits (same SM count).
pub fn cpu_outputs(
    case: &Case,
    p: &Problem,
    sm_count: usize,
    split_q: bool,
) -> (Vec<f32>, Vec<f32>) {
    let mut cfg = case.config();
    cfg.split_units = Some(sm_count);
    let mut dec = MlaDecode::new(&cfg, Device::Cpu).unwrap();
    let mut out = Outputs::poisoned(p);
    dec.forward(&host_inputs(p, split_q), &mut out.views().unwrap())
        .unwrap();
    (out.o.to_f32(), out.lse)
}

/// How far `o`/`lse` are from another backend's outputs.
pub fn distance(
    o: &[f32],
    lse: &[f32],
    base_o: &[f32],
    base_lse: &[f32],
    rows: usize,
    heads: usize,
    l: usize,
) -> Accuracy {
    let base = Reference {
        rows,
        heads,
        kv_lora_rank: l,
        o: base_o.iter().map(|&x| x as f64).collect(),
        lse: base_lse.iter().map(|&x| x as f64).collect(),
    };
    base.accuracy(o, lse)
}

/// What a GPU run of a case gave.
pub struct GpuRun {
    pub plan: DecodePlan,
    pub o: Vec<f32>,
    pub lse: Vec<f32>,
    pub vs_reference: Accuracy,
    /// The worst (row, head) against the reference (`super::worst_head`).
    pub worst_head: Accuracy,
    pub vs_cpu: Accuracy,
}

/// Runs a case on the GPU with poisoned outputs, checks the device flag, and compares with
/// the f64 reference and with the CPU backend. None where there is no GPU.
pub fn run_case(case: &Case) -> Option<GpuRun> {
    let mut dec = open(&case.config())?;
    Some(run_case_on(&mut dec, case))
}

/// As [`run_case`], on a given decoder.
pub fn run_case_on(dec: &mut MlaDecode, case: &Case) -> GpuRun {
    let s = stream(dec);
    let p = Problem::generate(&case.spec).unwrap();
    let dp = p.to_device(&s).unwrap();
    let mut out = DeviceOutputs::poisoned(&s, &p).unwrap();
    let inputs = dp.inputs(&p, case.split_q).unwrap();
    let plan = dec
        .forward(&inputs, &mut out.views().unwrap())
        .expect("forward");
    dec.check_device_errors().expect("no device-side error");
    let (o, lse) = out.download(&s).unwrap();

    let r = reference::decode_f64(dec.config(), &host_inputs(&p, case.split_q), None).unwrap();
    let vs_reference = r.accuracy(&o, &lse);
    let worst_head = super::worst_head(&r, &o, &lse);
    let (co, cl) = cpu_outputs(case, &p, dec.config().sm_count, case.split_q);
    let vs_cpu = distance(
        &o,
        &lse,
        &co,
        &cl,
        p.rows(),
        p.spec.heads,
        p.spec.kv_lora_rank,
    );
    GpuRun {
        plan,
        o,
        lse,
        vs_reference,
        worst_head,
        vs_cpu,
    }
}

/// Asserts the contract's tolerances against the reference and the CPU backend. In the
/// fp8-query mode P is rounded to e4m3 at each kernel's running maxima (a tile's, where the
/// CPU backend takes 256 keys at a time), so over rows of several tiles o differs from the
/// CPU backend's as much as from exact attention; its LSE, from the unrounded P, differs only
/// by the fp8 products' sums (`Case::cpu_lse_tolerance`).
pub fn assert_close(case: &Case, run: &GpuRun) {
    super::assert_heads_accurate(case, run.worst_head, "against the reference");
    let (o_tol, lse_tol) = case.tolerances();
    for (what, a, lse_tol) in [
        ("reference", run.vs_reference, lse_tol),
        ("cpu backend", run.vs_cpu, case.cpu_lse_tolerance()),
    ] {
        assert!(
            a.o_rel <= o_tol && a.lse_abs <= lse_tol,
            "against the {what}: o_rel {:.3e}, lse_abs {:.3e} (splits {}) for {case:#?}",
            a.o_rel,
            a.lse_abs,
            run.plan.num_kv_splits
        );
    }
}
