//! Where the CPU stage 1's time goes, phase by phase: a development instrument (cargo feature
//! `cpu-phase-times`, `mla bench --backend cpu` prints it). The machines with AMX that mla is
//! measured on have no profiler, so the work item times its own phases: each worker thread's
//! [`Clock`] adds the time since its last lap to the phase that just ended, into process-wide
//! totals that [`take`] reads and clears. Without the feature the clock is empty and its laps
//! compile to nothing.

/// A phase of the bf16-product work item (`split_avx512::Stage1::attend`), in its order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// The chunk's key rows as bf16: in place, copied, or decoded into the chunk's buffer (an
    /// fp8 cache on the vector path: a score tile's rows at a time, between its scores).
    Keys,
    /// `S^T = K Q^T`.
    Scores,
    /// The chunk's values packed in key pairs (an fp8 cache on the vector path: a score tile's
    /// at a time).
    Values,
    /// The online softmax (P, the running max and sums).
    Softmax,
    /// The tile path's P^T and the output's rescale.
    Transpose,
    /// `acc += P V` (on the vector path with the rescale).
    Pv,
}

#[cfg(feature = "cpu-phase-times")]
impl Phase {
    /// Every phase, in the work item's order.
    pub const ALL: [Phase; 6] = [
        Phase::Keys,
        Phase::Scores,
        Phase::Values,
        Phase::Softmax,
        Phase::Transpose,
        Phase::Pv,
    ];

    /// Its name in `mla bench`'s output.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Keys => "keys",
            Phase::Scores => "scores",
            Phase::Softmax => "softmax",
            Phase::Values => "values",
            Phase::Transpose => "transpose+rescale",
            Phase::Pv => "pv",
        }
    }
}

#[cfg(feature = "cpu-phase-times")]
mod imp {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::{Duration, Instant};

    use super::Phase;

    /// Nanoseconds per phase, summed over every thread since the last `take`.
    static NANOS: [AtomicU64; Phase::ALL.len()] = [const { AtomicU64::new(0) }; Phase::ALL.len()];

    /// A worker thread's stopwatch: each lap goes to the phase it names, summed in the clock
    /// and added to the totals when it is dropped (a lap a score tile on the fp8 path: an
    /// atomic add each, shared by the threads, had cost more than the laps measured).
    pub struct Clock {
        last: Instant,
        nanos: [u64; Phase::ALL.len()],
    }

    impl Clock {
        pub fn start() -> Self {
            Clock {
                last: Instant::now(),
                nanos: [0; Phase::ALL.len()],
            }
        }

        pub fn lap(&mut self, phase: Phase) {
            let now = Instant::now();
            let ns = u64::try_from((now - self.last).as_nanos()).unwrap_or(u64::MAX);
            let sum = &mut self.nanos[phase as usize];
            *sum = sum.saturating_add(ns);
            self.last = now;
        }
    }

    impl Drop for Clock {
        fn drop(&mut self) {
            for (total, &ns) in NANOS.iter().zip(&self.nanos) {
                total.fetch_add(ns, Ordering::Relaxed);
            }
        }
    }

    /// The totals since the last call (every thread's time added), each reset to zero.
    pub fn take() -> Vec<(Phase, Duration)> {
        Phase::ALL
            .iter()
            .map(|&p| {
                (
                    p,
                    Duration::from_nanos(NANOS[p as usize].swap(0, Ordering::Relaxed)),
                )
            })
            .collect()
    }
}

#[cfg(not(feature = "cpu-phase-times"))]
mod imp {
    use super::Phase;

    /// Without the feature: nothing kept, nothing timed.
    pub struct Clock;

    impl Clock {
        #[inline(always)]
        pub fn start() -> Self {
            Clock
        }

        #[inline(always)]
        pub fn lap(&mut self, _: Phase) {}
    }
}

pub use imp::Clock;
#[cfg(feature = "cpu-phase-times")]
pub use imp::take;
