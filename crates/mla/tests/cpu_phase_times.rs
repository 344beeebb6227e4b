//! The development instrument `cpu-phase-times`: a CPU decode on a bf16-product path times
//! each phase of its work item, and reading the totals clears them. One test in its own
//! binary, so no other decode adds to the process-wide totals meanwhile.
#![cfg(feature = "cpu-phase-times")]

mod common;

use std::time::Duration;

use common::{Case, cpu_kernels, run_case, spec};
use mla::{CpuKernel, CpuPhase, Device, KvFormat, Mask, ModelDtype, cpu_phase_times};

#[test]
fn a_decode_times_each_phase_it_runs_and_reading_clears_the_totals() {
    let paths: Vec<CpuKernel> = cpu_kernels()
        .into_iter()
        .filter(|k| *k != CpuKernel::Portable)
        .collect();
    if paths.is_empty() {
        eprintln!("skipped: no bf16-product CPU path here (the phases are that path's)");
        return;
    }
    // A bf16 cache, read in place, and an fp8 one, decoded (on the vector path a score tile
    // at a time, its laps inside the chunk's).
    let kv_paths = [KvFormat::Bf16, KvFormat::Fp8E4m3]
        .into_iter()
        .flat_map(|kv| paths.iter().map(move |&path| (kv, path)));
    for (kv, path) in kv_paths {
        let _ = cpu_phase_times();
        let s = spec(32, 64, &[300, 1000], 1, Mask::Causal).with_format(ModelDtype::Bf16, kv);
        let mut case = Case::new(s);
        case.cpu_kernel = path;
        run_case(&case, Device::Cpu);
        let times = cpu_phase_times();
        for (phase, t) in &times {
            // The tile path alone transposes P and rescales apart from its product.
            let runs = *phase != CpuPhase::Transpose || path == CpuKernel::AmxBf16;
            assert_eq!(
                *t > Duration::ZERO,
                runs,
                "{path:?}, {kv:?}: {} took {t:?}",
                phase.name()
            );
        }
        assert!(
            cpu_phase_times().iter().all(|(_, t)| t.is_zero()),
            "{path:?}, {kv:?}: the totals are cleared once read"
        );
    }
}
