//! Building a kernel variant: NVRTC options, the disk cache, and the resource report ptxas
//! writes into the log (registers, stack, spills). Needs libnvrtc, not a GPU, so CI runs it
//! on a CPU-only machine for every architecture we ship.

use std::time::Instant;

use super::{cache, ffi};
use crate::error::Result;
use crate::kernels::family::HEADERS;
use crate::kernels::variant::Variant;

/// What a cubin is compiled for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// `sm_80`, `sm_89`, `sm_90a`, ...
    pub arch: String,
    /// NVRTC's version (part of the cache key).
    pub nvrtc: (i32, i32),
}

impl Target {
    /// The target of a compute capability, with the NVRTC found on this machine. Hopper gets
    /// its arch-specific `sm_90a` (wgmma, setmaxnreg).
    ///
    /// # Errors
    /// [`crate::Error::NoCudaDevice`] when libnvrtc cannot be loaded.
    pub fn new(major: u32, minor: u32) -> Result<Target> {
        ffi::nvrtc_present().map_err(crate::Error::NoCudaDevice)?;
        let suffix = if (major, minor) == (9, 0) { "a" } else { "" };
        Ok(Target {
            arch: format!("sm_{major}{minor}{suffix}"),
            nvrtc: ffi::nvrtc_version()?,
        })
    }

    /// Whether Hopper's arch-specific instructions (wgmma) are available: sm_90a.
    pub fn wgmma(&self) -> bool {
        self.arch == "sm_90a"
    }

    /// Parses `sm_80`, `sm_89`, `sm_90a`, `90`, `8.9` into (major, minor).
    pub fn parse_arch(s: &str) -> Option<(u32, u32)> {
        let digits: String = s.chars().filter(|c| c.is_ascii_digit()).collect();
        let (major, minor) = match digits.len() {
            2 => (&digits[..1], &digits[1..]),
            3 => (&digits[..2], &digits[2..]),
            _ => return None,
        };
        Some((major.parse().ok()?, minor.parse().ok()?))
    }
}

/// Registers, stack and spills of a compiled kernel, from ptxas' report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KernelUsage {
    /// Registers per thread.
    pub registers: u32,
    /// Stack frame bytes.
    pub stack: u32,
    /// Spill store bytes.
    pub spill_stores: u32,
    /// Spill load bytes.
    pub spill_loads: u32,
    /// Whether ptxas serialized the warpgroup MMAs (its C7520 "Potential Performance Loss":
    /// each wgmma then waits for the one before, which costs a Hopper kernel its overlap) or
    /// injected waits between them (C7517, C7519: a register of an accumulator in flight was
    /// touched; `fence_operands` in common/wgmma.cuh pins such registers).
    pub serialized_wgmma: bool,
}

impl KernelUsage {
    /// Whether any register spilled to local memory.
    pub fn spills(&self) -> bool {
        self.spill_stores > 0 || self.spill_loads > 0
    }

    /// Whether the build lost speed ptxas warned of: spills or serialized wgmma.
    pub fn degraded(&self) -> bool {
        self.spills() || self.serialized_wgmma
    }
}

/// Parses "Used N registers", "N bytes stack frame, N bytes spill stores, N bytes spill
/// loads" and the wgmma serialization warning (C7520) from an NVRTC log. A module of several
/// entries reports each: the result is the most registers and stack of any entry and the
/// spills of all of them.
pub(crate) fn usage(log: &str) -> Option<KernelUsage> {
    let number_before = |line: &str, word: &str| -> Option<u32> {
        let at = line.find(word)?;
        line[..at].split_whitespace().last()?.parse().ok()
    };
    let mut u = KernelUsage::default();
    let mut seen = false;
    for line in log.lines() {
        if let Some(r) = number_before(line, "registers") {
            u.registers = u.registers.max(r);
            seen = true;
        }
        if let Some(s) = number_before(line, "bytes stack frame") {
            u.stack = u.stack.max(s);
            u.spill_stores += number_before(line, "bytes spill stores").unwrap_or(0);
            u.spill_loads += number_before(line, "bytes spill loads").unwrap_or(0);
        }
        u.serialized_wgmma |= line.contains("wgmma.mma_async instructions are serialized")
            || line.contains("is injected in around line");
    }
    seen.then_some(u)
}

/// A built variant.
#[derive(Debug, Clone)]
pub(crate) struct Built {
    /// The variant.
    pub variant: Variant,
    /// Its module (the cubin is emptied once loaded: the module takes the bytes).
    pub module: Module,
}

/// What building one kernel module gave: its name, options and ptxas' report.
#[derive(Debug, Clone, PartialEq)]
pub struct KernelBuild {
    /// The architecture (`sm_90a`, ...).
    pub arch: String,
    /// The entry point (or family, for a module of several).
    pub kernel: String,
    /// The `-D` options that specialize it.
    pub defines: String,
    /// ptxas' report (None when the cubin came from the disk cache).
    pub usage: Option<KernelUsage>,
    /// Whether the disk cache had it.
    pub from_disk: bool,
    /// Time spent (compile or read), in milliseconds.
    pub millis: f64,
}

impl KernelBuild {
    pub(crate) fn new(arch: &str, kernel: String, defines: String, module: &Module) -> Self {
        KernelBuild {
            arch: arch.to_string(),
            kernel,
            defines,
            usage: module.usage,
            from_disk: module.from_disk,
            millis: module.millis,
        }
    }
}

impl From<&Built> for KernelBuild {
    fn from(b: &Built) -> Self {
        KernelBuild::new(
            &b.module.arch,
            b.variant.family.entry().to_string(),
            b.variant.defines().join(" "),
            &b.module,
        )
    }
}

/// A compiled (or cached) module, before anyone names what it is.
#[derive(Debug, Clone)]
pub(crate) struct Module {
    /// The architecture it was built for.
    pub arch: String,
    /// The cubin.
    pub cubin: Vec<u8>,
    /// ptxas' report (None when the cubin came from the disk cache).
    pub usage: Option<KernelUsage>,
    /// Whether the disk cache had it.
    pub from_disk: bool,
    /// Time spent (compile or read), in milliseconds.
    pub millis: f64,
}

/// The options every module is compiled with: the target, C++17, ptxas' resource report.
pub(crate) fn base_options(target: &Target) -> Vec<String> {
    vec![
        format!("--gpu-architecture={}", target.arch),
        "--std=c++17".into(),
        "--ptxas-options=-v".into(),
    ]
}

/// The cubin of `source` (named `file`, including `headers`) compiled with `opts`: from the
/// disk cache when `use_cache` and present (keyed by `label`, the arch, every source text,
/// the options and NVRTC's version), else compiled and stored.
///
/// # Errors
/// [`crate::Error::Compile`] with NVRTC's log.
pub(crate) fn build_module(
    label: &str,
    file: &str,
    source: &str,
    headers: &[(&str, &str)],
    opts: &[String],
    target: &Target,
    use_cache: bool,
) -> Result<Module> {
    let start = Instant::now();
    let mut sources: Vec<&str> = headers.iter().map(|(_, src)| *src).collect();
    sources.push(source);
    let name = cache::file_name(label, &target.arch, &sources, opts, target.nvrtc);
    let dir = cache::dir();
    let millis = |start: Instant| start.elapsed().as_secs_f64() * 1e3;
    if use_cache && let Some(cubin) = dir.as_deref().and_then(|d| cache::load(d, &name)) {
        return Ok(Module {
            arch: target.arch.clone(),
            cubin,
            usage: None,
            from_disk: true,
            millis: millis(start),
        });
    }
    let compiled = ffi::compile_cubin(file, source, headers, opts)?;
    if let Some(d) = dir.as_deref() {
        cache::store(d, &name, &compiled.cubin);
    }
    Ok(Module {
        arch: target.arch.clone(),
        cubin: compiled.cubin,
        usage: usage(&compiled.log),
        from_disk: false,
        millis: millis(start),
    })
}

/// The NVRTC options of a variant: the base options and its defines, and with the cargo
/// feature `kernel-dev` the defines of `MLA_EXTRA_DEFINES` (kernel development: trying a
/// define on the GPU machine without a rebuild; a shipped build never reads it).
pub(crate) fn options(variant: &Variant, target: &Target) -> Vec<String> {
    let mut o = base_options(target);
    o.extend(variant.defines());
    #[cfg(feature = "kernel-dev")]
    o.extend(extra_defines(
        &std::env::var("MLA_EXTRA_DEFINES").unwrap_or_default(),
    ));
    o
}

/// The `-DNAME` or `-DNAME=VALUE` words of `text`; anything else is ignored. The defines are
/// part of the cache key.
#[cfg_attr(not(any(test, feature = "kernel-dev")), allow(dead_code))]
fn extra_defines(text: &str) -> Vec<String> {
    text.split_whitespace()
        .filter(|w| {
            w.strip_prefix("-D").is_some_and(|name| {
                !name.is_empty()
                    && name
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '=')
            })
        })
        .map(String::from)
        .collect()
}

/// The cubin of a variant: from the disk cache when `use_cache` and present, else compiled
/// (and stored).
///
/// # Errors
/// [`crate::Error::Compile`] with NVRTC's log.
pub(crate) fn build(variant: &Variant, target: &Target, use_cache: bool) -> Result<Built> {
    let family = variant.family;
    let opts = options(variant, target);
    let module = build_module(
        family.entry(),
        family.file(),
        family.source(),
        &HEADERS,
        &opts,
        target,
        use_cache,
    )?;
    Ok(Built {
        variant: *variant,
        module,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_of_a_module_of_several_entries_keeps_every_spill() {
        let log = "ptxas info    : Compiling entry function 'a' for 'sm_90a'\n\
                   ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
                   ptxas info    : Used 40 registers\n\
                   ptxas info    : Compiling entry function 'b' for 'sm_90a'\n\
                   ptxas         .     16 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads\n\
                   ptxas info    : Used 255 registers\n\
                   ptxas info    : Compiling entry function 'c' for 'sm_90a'\n\
                   ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
                   ptxas info    : Used 32 registers\n";
        let u = usage(log).unwrap();
        assert_eq!(
            u,
            KernelUsage {
                registers: 255,
                stack: 16,
                spill_stores: 8,
                spill_loads: 12,
                serialized_wgmma: false,
            }
        );
        assert!(u.spills(), "the middle entry's spills must not be lost");
        assert_eq!(usage("nothing here"), None);
    }

    #[test]
    fn extra_defines_keep_only_defines() {
        assert_eq!(
            extra_defines("-DNO_S  -DX=1 --use_fast_math -D -Dbad;rm"),
            vec!["-DNO_S", "-DX=1"]
        );
    }

    #[test]
    fn parses_ptxas_reports() {
        let log = "ptxas info    : Compiling entry function 'k' for 'sm_90a'\n\
                   ptxas         .     16 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads\n\
                   ptxas info    : Used 128 registers, used 1 barriers";
        let u = usage(log).unwrap();
        assert_eq!(
            u,
            KernelUsage {
                registers: 128,
                stack: 16,
                spill_stores: 8,
                spill_loads: 12,
                serialized_wgmma: false,
            }
        );
        assert!(u.spills());
        assert!(usage("no report").is_none());
        // NVRTC 13.0's words when a wgmma waits for the one before (decode_narrow/NOTES.md).
        let log = "ptxas info    : (C7520) Potential Performance Loss: wgmma.mma_async instructions \
                   are serialized due to program dependence on compiler-inserted WG.AR in divergent \
                   path in the function 'k'\n\
                   ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
                   ptxas info    : Used 168 registers, used 16 barriers";
        let u = usage(log).unwrap();
        assert!(u.serialized_wgmma && !u.spills() && u.degraded());
        let log = "ptxas info    : (C7519) warpgroup.arrive is injected in around line 2265 by \
                   compiler to allow use of registers in GMMA in function 'k'\n\
                   ptxas info    : Used 168 registers, used 16 barriers";
        assert!(usage(log).unwrap().degraded());
    }

    #[test]
    fn arch_names() {
        assert_eq!(Target::parse_arch("sm_90a"), Some((9, 0)));
        assert_eq!(Target::parse_arch("sm_89"), Some((8, 9)));
        assert_eq!(Target::parse_arch("8.0"), Some((8, 0)));
        assert_eq!(Target::parse_arch("sm_100"), Some((10, 0)));
        assert_eq!(Target::parse_arch("x"), None);
    }
}
