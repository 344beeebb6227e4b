//! The CPU backend's stage-1 paths by name: the setting that picks one
//! ([`crate::Tuning::cpu_kernel`]). Which path a CPU can run is the CPU backend's to find out
//! (`backend::cpu::kernel`).

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// Which stage-1 kernel the CPU backend runs ([`crate::Tuning::cpu_kernel`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum CpuKernel {
    /// The fastest path this CPU and configuration allow: amx-bf16, else avx512-bf16, else
    /// portable.
    #[default]
    Auto,
    /// AVX-512 BF16 (`vdpbf16ps`): both products on bf16 values with f32 sums. Needs a CPU
    /// with AVX-512F, AVX-512BW and AVX-512 BF16, a bfloat16 model dtype and the default
    /// (not fp8-query) mode: those are the configurations whose multiplied values are all
    /// bf16 numbers.
    Avx512Bf16,
    /// AMX-BF16 (`tdpbf16ps` on tiles): the AVX-512 BF16 path with its two products (`Q K^T`
    /// and `P V`) on AMX tiles, 16 x 16 f32 sums a tile; the softmax, the rounding points,
    /// the f32 partials and LSE and the merge are the AVX-512 BF16 path's. Needs everything
    /// that path needs, plus AMX-TILE and AMX-BF16 with the tile state granted by Linux
    /// (`arch_prctl`, asked once a process).
    AmxBf16,
    /// Portable Rust: the keys decoded to f32 and f32 GEMMs (`matrixmultiply`, which picks
    /// AVX2/FMA itself where the CPU has them). Runs everywhere and every configuration.
    Portable,
}

impl CpuKernel {
    /// Every setting, the fastest path first.
    pub const ALL: [CpuKernel; 4] = [
        CpuKernel::Auto,
        CpuKernel::AmxBf16,
        CpuKernel::Avx512Bf16,
        CpuKernel::Portable,
    ];

    /// The name the CLI takes and prints.
    pub fn name(self) -> &'static str {
        match self {
            CpuKernel::Auto => "auto",
            CpuKernel::Avx512Bf16 => "avx512-bf16",
            CpuKernel::AmxBf16 => "amx-bf16",
            CpuKernel::Portable => "portable",
        }
    }
}

impl fmt::Display for CpuKernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for CpuKernel {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        CpuKernel::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = CpuKernel::ALL.iter().map(|k| k.name()).collect();
                Error::config(
                    "cpu_kernel",
                    format!("expected one of {}, got {s:?}", names.join(", ")),
                )
            })
    }
}
