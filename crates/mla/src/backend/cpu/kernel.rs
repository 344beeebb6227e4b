//! Which stage-1 kernel the CPU backend runs: the setting ([`CpuKernel`]), the CPU features
//! found at run time ([`CpuFeatures`]), and the path a configuration resolves to.
//!
//! Every path computes the same contract (docs/contract.md): the same rounding points, f32
//! partials and LSE, the same merge. They differ in how the two products are summed.

use std::fmt;

#[cfg(target_arch = "x86_64")]
use super::amx::{AmxBf16, AmxCpuid};
#[cfg(target_arch = "x86_64")]
use super::avx512::Avx512Bf16;
use crate::config::ValidConfig;
use crate::dtype::ModelDtype;
use crate::error::{Error, Result};
pub use crate::kernels::CpuKernel;

/// The CPU features the kernels care about, as found at run time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuFeatures {
    /// AVX2 with FMA (what `matrixmultiply` uses on x86).
    pub avx2_fma: bool,
    /// AVX-512 Foundation.
    pub avx512f: bool,
    /// AVX-512 byte and word instructions.
    pub avx512bw: bool,
    /// AVX-512 BF16 (`vdpbf16ps`).
    pub avx512_bf16: bool,
    /// AMX tiles (AMX-TILE), as CPUID reports them.
    pub amx_tile: bool,
    /// AMX with bf16 (AMX-BF16), as CPUID reports it.
    pub amx_bf16: bool,
    /// Everything the amx-bf16 path needs: AMX-TILE and AMX-BF16, the tile state enabled by
    /// the OS and granted to this process (`arch_prctl` on Linux, asked here), AVX-512 BF16.
    pub amx_granted: bool,
}

impl CpuFeatures {
    /// The features of the CPU this runs on.
    pub fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            let amx = AmxCpuid::read();
            CpuFeatures {
                avx2_fma: is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"),
                avx512f: is_x86_feature_detected!("avx512f"),
                avx512bw: is_x86_feature_detected!("avx512bw"),
                avx512_bf16: is_x86_feature_detected!("avx512bf16"),
                amx_tile: amx.tile,
                amx_bf16: amx.bf16,
                amx_granted: AmxBf16::detect().is_some(),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        CpuFeatures {
            avx2_fma: false,
            avx512f: false,
            avx512bw: false,
            avx512_bf16: false,
            amx_tile: false,
            amx_bf16: false,
            amx_granted: false,
        }
    }
}

impl fmt::Display for CpuFeatures {
    /// The features found, space-separated (`none` if none).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names = [
            (self.avx2_fma, "avx2+fma"),
            (self.avx512f, "avx512f"),
            (self.avx512bw, "avx512bw"),
            (self.avx512_bf16, "avx512_bf16"),
            (self.amx_tile, "amx_tile"),
            (self.amx_bf16, "amx_bf16"),
            (self.amx_granted, "amx_granted"),
        ];
        let found: Vec<&str> = names.iter().filter(|n| n.0).map(|n| n.1).collect();
        if found.is_empty() {
            f.write_str("none")
        } else {
            f.write_str(&found.join(" "))
        }
    }
}

/// The path a configuration runs, resolved once when the decoder is built.
#[derive(Debug, Clone, Copy)]
pub(crate) enum CpuPath {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx512Bf16(Avx512Bf16),
    #[cfg(target_arch = "x86_64")]
    AmxBf16(AmxBf16),
    /// The amx-bf16 path with a scalar model of the tile products: its packing and tile walk,
    /// checked on CPUs without AMX.
    #[cfg(all(test, target_arch = "x86_64"))]
    EmulatedTiles(Avx512Bf16),
}

impl CpuPath {
    /// The kernel that runs, as [`CpuKernel::name`] prints it.
    pub fn kernel(self) -> CpuKernel {
        match self {
            CpuPath::Portable => CpuKernel::Portable,
            #[cfg(target_arch = "x86_64")]
            CpuPath::Avx512Bf16(_) => CpuKernel::Avx512Bf16,
            #[cfg(target_arch = "x86_64")]
            CpuPath::AmxBf16(_) => CpuKernel::AmxBf16,
            #[cfg(all(test, target_arch = "x86_64"))]
            CpuPath::EmulatedTiles(_) => CpuKernel::AmxBf16,
        }
    }

    /// The path `asked` resolves to for `cfg` on this CPU.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming `cpu_kernel` when a forced path is missing from this
    /// CPU or cannot compute this configuration's numbers.
    pub fn resolve(asked: CpuKernel, cfg: &ValidConfig) -> Result<CpuPath> {
        let bf16_values = bf16_values(cfg);
        match asked {
            CpuKernel::Portable => Ok(CpuPath::Portable),
            CpuKernel::Auto => Ok(Self::amx_bf16()
                .or_else(Self::avx512_bf16)
                .filter(|_| bf16_values)
                .unwrap_or(CpuPath::Portable)),
            CpuKernel::Avx512Bf16 => Self::forced(
                asked,
                Self::avx512_bf16(),
                "AVX-512F, AVX-512BW and AVX-512 BF16",
                cfg,
            ),
            CpuKernel::AmxBf16 => Self::forced(
                asked,
                Self::amx_bf16(),
                "AMX-TILE and AMX-BF16 granted by Linux, with AVX-512F, AVX-512BW and AVX-512 BF16",
                cfg,
            ),
        }
    }

    /// A forced bf16 path: `found` if this CPU has it (`needs` names what it lacks otherwise)
    /// and the configuration's multiplied values are bf16 numbers.
    fn forced(
        asked: CpuKernel,
        found: Option<CpuPath>,
        needs: &str,
        cfg: &ValidConfig,
    ) -> Result<CpuPath> {
        let path = found.ok_or_else(|| {
            Error::config(
                "cpu_kernel",
                format!(
                    "{asked} needs {needs}; this CPU has: {}",
                    CpuFeatures::detect()
                ),
            )
        })?;
        if !bf16_values(cfg) {
            return Err(Error::config(
                "cpu_kernel",
                format!(
                    "{asked} multiplies bf16 values: it takes a bfloat16 model dtype \
                     outside the fp8-query mode, got {}{}",
                    cfg.model_dtype,
                    if cfg.fp8_query { " with fp8_query" } else { "" }
                ),
            ));
        }
        Ok(path)
    }

    fn amx_bf16() -> Option<CpuPath> {
        #[cfg(target_arch = "x86_64")]
        {
            AmxBf16::detect().map(CpuPath::AmxBf16)
        }
        #[cfg(not(target_arch = "x86_64"))]
        None
    }

    fn avx512_bf16() -> Option<CpuPath> {
        #[cfg(target_arch = "x86_64")]
        {
            Avx512Bf16::detect().map(CpuPath::Avx512Bf16)
        }
        #[cfg(not(target_arch = "x86_64"))]
        None
    }
}

/// The bf16 products are exact only where every multiplied value is a bf16 number.
fn bf16_values(cfg: &ValidConfig) -> bool {
    cfg.model_dtype == ModelDtype::Bf16 && !cfg.fp8_query
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{DeviceInfo, MlaConfig};

    fn valid(model: ModelDtype) -> ValidConfig {
        let mut cfg = MlaConfig::new(16, 0.1);
        cfg.model_dtype = model;
        cfg.validate(&DeviceInfo::Cpu { threads: 1 }).unwrap()
    }

    #[test]
    fn names_parse_back() {
        for k in CpuKernel::ALL {
            assert_eq!(k.name().parse::<CpuKernel>().unwrap(), k);
        }
        let e = "amx".parse::<CpuKernel>().unwrap_err();
        assert!(
            matches!(
                e,
                Error::InvalidConfig {
                    field: "cpu_kernel",
                    ..
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn auto_takes_bf16_products_only_for_bf16_values() {
        let has = CpuFeatures::detect();
        let bf16 = CpuPath::resolve(CpuKernel::Auto, &valid(ModelDtype::Bf16)).unwrap();
        let want = if has.amx_granted {
            CpuKernel::AmxBf16
        } else if has.avx512f && has.avx512bw && has.avx512_bf16 {
            CpuKernel::Avx512Bf16
        } else {
            CpuKernel::Portable
        };
        assert_eq!(bf16.kernel(), want);
        let f16 = CpuPath::resolve(CpuKernel::Auto, &valid(ModelDtype::F16)).unwrap();
        assert_eq!(f16.kernel(), CpuKernel::Portable);
    }

    #[test]
    fn a_forced_path_that_cannot_run_names_cpu_kernel() {
        // f16 values are not bf16 numbers: refused on every CPU (for lack of the features
        // or of exact products).
        for forced in [CpuKernel::Avx512Bf16, CpuKernel::AmxBf16] {
            let e = CpuPath::resolve(forced, &valid(ModelDtype::F16)).unwrap_err();
            assert!(
                matches!(
                    e,
                    Error::InvalidConfig {
                        field: "cpu_kernel",
                        ..
                    }
                ),
                "{e}"
            );
        }
        // Forced where the CPU lacks it, the error lists the features found.
        if !CpuFeatures::detect().amx_granted {
            let e = CpuPath::resolve(CpuKernel::AmxBf16, &valid(ModelDtype::Bf16)).unwrap_err();
            let found = CpuFeatures::detect().to_string();
            assert!(
                matches!(e, Error::InvalidConfig { field: "cpu_kernel", ref reason } if reason.contains(&found)),
                "{e}"
            );
        }
        let portable = CpuPath::resolve(CpuKernel::Portable, &valid(ModelDtype::Bf16)).unwrap();
        assert_eq!(portable.kernel(), CpuKernel::Portable);
    }
}
