//! The kernel settings a GPU suite runs under (the stage-1 family as shipped or one forced, on
//! the split grid or the device schedule), one `#[test]` per setting ([`kernel_tests!`]), and
//! the tally of the family that ran each case: a forced family that cannot take a case runs
//! another, so a run says how many cases its family really took, and fails where the GPU has
//! the family and it took none.

use std::collections::BTreeMap;
use std::fmt;

use mla::{DecodePlan, Device, KernelChoice, KernelFamily, MlaConfig, MlaDecode};

use super::{GpuRun, assert_close, open, run_case_on, say};
use crate::common::Case;

/// What a suite runs its decodes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kernels {
    /// The stage-1 family: as shipped, or one forced wherever it can run.
    pub choice: KernelChoice,
    /// Whether decoders take the device-computed schedule (`MlaConfig::device_schedule`).
    pub device_schedule: bool,
}

impl Kernels {
    /// The kernels as shipped, on the split grid.
    pub const SHIPPED: Kernels = Kernels {
        choice: KernelChoice::Auto,
        device_schedule: false,
    };

    /// `family` forced wherever it can run, on the split grid.
    pub const fn forced(family: KernelFamily) -> Kernels {
        Kernels {
            choice: KernelChoice::Only(family),
            device_schedule: false,
        }
    }

    /// The same kernels on the device-computed schedule.
    pub const fn scheduled(self) -> Kernels {
        Kernels {
            device_schedule: true,
            ..self
        }
    }

    /// `case`'s decoder configuration under these kernels.
    pub fn config(self, case: &Case) -> MlaConfig {
        let mut cfg = case.config();
        cfg.tuning.kernel = self.choice;
        cfg.device_schedule = self.device_schedule;
        cfg
    }
}

impl fmt::Display for Kernels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.choice {
            KernelChoice::Auto => f.write_str("as shipped")?,
            KernelChoice::Only(family) => write!(f, "forced {family}")?,
        }
        if self.device_schedule {
            f.write_str(", device schedule")?;
        }
        Ok(())
    }
}

/// One `#[test]` per kernel setting, in a module named after the suite: `kernel_tests!(contract)`
/// makes `contract::as_shipped`, `contract::forced_mma` (`_wgmma`, `_narrow`, `_seesaw`,
/// `_wgmma_fp8`), `contract::device_schedule` and `contract::device_schedule_forced_mma`
/// (`_wgmma`, `_seesaw`: the families with a scheduled variant), each calling
/// `contract(Kernels)`; `kernel_tests!(contract, split_grid)` only the first six, for a suite
/// whose decoders never schedule. A test-name filter picks one setting (with `--exact`:
/// `forced_wgmma` is a prefix of `forced_wgmma_fp8`).
#[macro_export]
macro_rules! kernel_tests {
    ($suite:ident) => {
        $crate::kernel_tests!(@split_grid $suite,
            device_schedule = Kernels::SHIPPED.scheduled(),
            device_schedule_forced_mma = Kernels::forced(Mma).scheduled(),
            device_schedule_forced_wgmma = Kernels::forced(Wgmma).scheduled(),
            device_schedule_forced_seesaw = Kernels::forced(Seesaw).scheduled()
        );
    };
    ($suite:ident, split_grid) => {
        $crate::kernel_tests!(@split_grid $suite);
    };
    (@split_grid $suite:ident $(, $name:ident = $kernels:expr)*) => {
        $crate::kernel_tests!(@module $suite,
            as_shipped = Kernels::SHIPPED,
            forced_mma = Kernels::forced(Mma),
            forced_wgmma = Kernels::forced(Wgmma),
            forced_narrow = Kernels::forced(Narrow),
            forced_seesaw = Kernels::forced(Seesaw),
            forced_wgmma_fp8 = Kernels::forced(WgmmaFp8)
            $(, $name = $kernels)*
        );
    };
    (@module $suite:ident, $($name:ident = $kernels:expr),+) => {
        mod $suite {
            #[allow(unused_imports)]
            use mla::KernelFamily::{Mma, Narrow, Seesaw, Wgmma, WgmmaFp8};
            use $crate::common::gpu::kernels::Kernels;
            $(
                #[test]
                fn $name() {
                    super::$suite($kernels);
                }
            )+
        }
    };
}

/// The cases of one suite under one kernel setting, by the family that ran each.
pub struct Tally {
    suite: &'static str,
    kernels: Kernels,
    /// Cases by the name of the family that ran them.
    ran: BTreeMap<&'static str, usize>,
    /// Cases that ran on the device-computed schedule.
    scheduled: usize,
    /// Whether the GPU runs Hopper's kernels.
    hopper: bool,
}

impl Tally {
    /// The tally of `suite` under `kernels`, or None (the test skipped, saying why) where no
    /// GPU opens.
    pub fn start(suite: &'static str, kernels: Kernels) -> Option<Tally> {
        let probe = open(&MlaConfig::new(16, 0.1))?;
        let hopper = probe.cuda_backend().is_some_and(|c| c.hopper());
        Some(Tally {
            suite,
            kernels,
            ran: BTreeMap::new(),
            scheduled: 0,
            hopper,
        })
    }

    pub fn kernels(&self) -> Kernels {
        self.kernels
    }

    /// Whether the GPU runs Hopper's kernels (sm_90a).
    pub fn hopper(&self) -> bool {
        self.hopper
    }

    /// `case`'s configuration under the suite's kernels.
    pub fn config(&self, case: &Case) -> MlaConfig {
        self.kernels.config(case)
    }

    /// A GPU decoder of `cfg` (the GPU opened in [`Tally::start`]).
    pub fn open_config(&self, cfg: &MlaConfig) -> MlaDecode {
        MlaDecode::new(cfg, Device::Cuda(0))
            .unwrap_or_else(|e| panic!("opening the GPU decoder failed: {e} ({cfg:?})"))
    }

    /// A GPU decoder of `case` under the suite's kernels.
    pub fn open(&self, case: &Case) -> MlaDecode {
        self.open_config(&self.config(case))
    }

    /// Runs `case` on a decoder of its own (outputs poisoned), checks it against the reference
    /// and the CPU backend, and counts the family that ran it.
    pub fn check(&mut self, case: &Case) -> GpuRun {
        let mut dec = self.open(case);
        self.check_on(&mut dec, case)
    }

    /// As [`Tally::check`], on a given decoder.
    pub fn check_on(&mut self, dec: &mut MlaDecode, case: &Case) -> GpuRun {
        let run = run_case_on(dec, case);
        assert_close(case, &run);
        self.count(&run.plan);
        run
    }

    /// Counts the family a decode ran on.
    pub fn count(&mut self, plan: &DecodePlan) {
        let family = plan.kernel().expect("a GPU decode runs a stage-1 family");
        *self.ran.entry(family.name()).or_default() += 1;
        self.scheduled += usize::from(plan.scheduled());
    }

    /// Asserts that a case there for `family` runs on it, where the kernels are as shipped on
    /// the split grid and the GPU is a Hopper: what the case is in the suite for.
    pub fn assert_there_for(&self, run: &GpuRun, family: KernelFamily, what: &str) {
        if self.kernels == Kernels::SHIPPED && self.hopper {
            assert_eq!(
                run.plan.kernel(),
                Some(family),
                "{what}: the case for {family} ran another family"
            );
        }
    }

    /// Says what ran (`cuda_contract, forced seesaw: 14 of 20 cases ran seesaw, 6 ran another
    /// family (mma 6)`), and fails where a forced family the GPU has ran no case, or a suite on
    /// the device schedule never took it.
    pub fn finish(self) {
        let total: usize = self.ran.values().sum();
        let others = |skip: Option<&str>| {
            let v: Vec<String> = self
                .ran
                .iter()
                .filter(|(k, _)| Some(**k) != skip)
                .map(|(k, n)| format!("{k} {n}"))
                .collect();
            v.join(", ")
        };
        let mut line = format!("{}, {}: ", self.suite, self.kernels);
        let forced = match self.kernels.choice {
            KernelChoice::Auto => {
                line += &format!("{total} cases ran {}", others(None));
                None
            }
            KernelChoice::Only(family) => {
                let n = self.ran.get(family.name()).copied().unwrap_or(0);
                line += &format!(
                    "{n} of {total} cases ran {family}, {} ran another family ({})",
                    total - n,
                    others(Some(family.name()))
                );
                Some((family, n))
            }
        };
        if self.kernels.device_schedule {
            line += &format!("; {} on the device schedule", self.scheduled);
        }
        say(&line);
        if let Some((family, n)) = forced {
            let has_it = self.hopper || !family.needs_hopper();
            assert!(n > 0 || !has_it, "{line}: the forced family ran no case");
        }
        assert!(
            self.scheduled > 0 || !self.kernels.device_schedule,
            "{line}: no case ran on the device schedule"
        );
    }
}
