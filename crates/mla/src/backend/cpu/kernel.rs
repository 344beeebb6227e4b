//! Which stage-1 kernel the CPU backend runs: the setting ([`CpuKernel`]), the CPU features
//! found at run time ([`CpuFeatures`]), and the path a configuration resolves to.
//!
//! Every path computes the same contract (docs/contract.md): the same rounding points, f32
//! partials and LSE, the same merge. They differ in how the two products are summed.

use std::fmt;

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
    /// AMX tiles with bf16 (reported; no kernel uses them yet).
    pub amx_bf16: bool,
}

impl CpuFeatures {
    /// The features of the CPU this runs on.
    pub fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            CpuFeatures {
                avx2_fma: is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"),
                avx512f: is_x86_feature_detected!("avx512f"),
                avx512bw: is_x86_feature_detected!("avx512bw"),
                avx512_bf16: is_x86_feature_detected!("avx512bf16"),
                amx_bf16: amx_bf16_in_cpuid(),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        CpuFeatures {
            avx2_fma: false,
            avx512f: false,
            avx512bw: false,
            avx512_bf16: false,
            amx_bf16: false,
        }
    }
}

/// CPUID leaf 7 reports AMX-BF16 in EDX bit 22 (std's detection of it is not stable yet).
/// Only the CPU's word: the kernel must still grant the tile state (`arch_prctl`) before a
/// program may use it.
#[cfg(target_arch = "x86_64")]
fn amx_bf16_in_cpuid() -> bool {
    use std::arch::x86_64::__cpuid_count;
    __cpuid_count(0, 0).eax >= 7 && __cpuid_count(7, 0).edx & (1 << 22) != 0
}

impl fmt::Display for CpuFeatures {
    /// The features found, space-separated (`none` if none).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names = [
            (self.avx2_fma, "avx2+fma"),
            (self.avx512f, "avx512f"),
            (self.avx512bw, "avx512bw"),
            (self.avx512_bf16, "avx512_bf16"),
            (self.amx_bf16, "amx_bf16"),
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
}

impl CpuPath {
    /// The kernel that runs, as [`CpuKernel::name`] prints it.
    pub fn kernel(self) -> CpuKernel {
        match self {
            CpuPath::Portable => CpuKernel::Portable,
            #[cfg(target_arch = "x86_64")]
            CpuPath::Avx512Bf16(_) => CpuKernel::Avx512Bf16,
        }
    }

    /// The path `asked` resolves to for `cfg` on this CPU.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming `cpu_kernel` when a forced path is missing from this
    /// CPU or cannot compute this configuration's numbers.
    pub fn resolve(asked: CpuKernel, cfg: &ValidConfig) -> Result<CpuPath> {
        // The bf16 products are exact only where every multiplied value is a bf16 number.
        let bf16_values = cfg.model_dtype == ModelDtype::Bf16 && !cfg.fp8_query;
        match asked {
            CpuKernel::Portable => Ok(CpuPath::Portable),
            CpuKernel::Auto => Ok(Self::avx512_bf16()
                .filter(|_| bf16_values)
                .unwrap_or(CpuPath::Portable)),
            CpuKernel::Avx512Bf16 => {
                let path = Self::avx512_bf16().ok_or_else(|| {
                    Error::config(
                        "cpu_kernel",
                        format!(
                            "avx512-bf16 needs AVX-512F, AVX-512BW and AVX-512 BF16; this CPU has: {}",
                            CpuFeatures::detect()
                        ),
                    )
                })?;
                if !bf16_values {
                    return Err(Error::config(
                        "cpu_kernel",
                        format!(
                            "avx512-bf16 multiplies bf16 values: it takes a bfloat16 model dtype \
                             outside the fp8-query mode, got {}{}",
                            cfg.model_dtype,
                            if cfg.fp8_query { " with fp8_query" } else { "" }
                        ),
                    ));
                }
                Ok(path)
            }
        }
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
        for k in [CpuKernel::Auto, CpuKernel::Avx512Bf16, CpuKernel::Portable] {
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
        let want = if has.avx512f && has.avx512bw && has.avx512_bf16 {
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
        let e = CpuPath::resolve(CpuKernel::Avx512Bf16, &valid(ModelDtype::F16)).unwrap_err();
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
        let portable = CpuPath::resolve(CpuKernel::Portable, &valid(ModelDtype::Bf16)).unwrap();
        assert_eq!(portable.kernel(), CpuKernel::Portable);
    }
}
