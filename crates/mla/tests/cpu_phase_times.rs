//! The development instrument `cpu-phase-times`: a CPU decode on a bf16-product path times
//! each phase of its work item, and reading the totals clears them. One test in its own
//! binary, so no other decode adds to the process-wide totals meanwhile.
#![cfg(feature = "cpu-phase-times")]

mod common;

use std::time::Duration;

use common::{Case, cpu_kernels, run_case, spec};
use mla::{CpuKernel, CpuPhase, Device, Mask, cpu_phase_times};

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
    for path in paths {
        let _ = cpu_phase_times();
        let mut case = Case::new(spec(32, 64, &[300, 1000], 1, Mask::Causal));
        case.cpu_kernel = path;
        run_case(&case, Device::Cpu);
        let times = cpu_phase_times();
        for (phase, t) in &times {
            // The tile path alone transposes P and rescales apart from its product.
            let runs = *phase != CpuPhase::Transpose || path == CpuKernel::AmxBf16;
            assert_eq!(
                *t > Duration::ZERO,
                runs,
                "{path:?}: {} took {t:?}",
                phase.name()
            );
        }
        assert!(
            cpu_phase_times().iter().all(|(_, t)| t.is_zero()),
            "{path:?}: the totals are cleared once read"
        );
    }
}
