//! `mla precompile`: build every kernel variant ahead of time, into the disk cache.
//!
//! On a GPU machine it compiles (or finds in the cache) and loads every variant the device
//! can use, so the first decode of any process starts warm. With `--arch` it needs no GPU,
//! only libnvrtc: it compiles for the named architectures and reports registers and spills;
//! `--deny-spills` fails on any spill (what CI runs).

use clap::Args;

#[derive(Args, Debug)]
pub struct PrecompileArgs {
    /// Architectures to compile for without a device, e.g. sm_80,sm_89,sm_90a.
    #[arg(long, value_delimiter = ',')]
    arch: Vec<String>,
    /// Fail when a kernel spills registers to local memory (compiles afresh to see the report).
    #[arg(long)]
    deny_spills: bool,
}

#[cfg(feature = "cuda")]
pub fn run(args: &PrecompileArgs) -> mla::Result<()> {
    use mla::backend::cuda::compile::{self, Built, Target};
    use mla::backend::cuda::registry;

    let mut builds: Vec<(String, Built)> = Vec::new();
    // The DCP family (decode context parallelism) is built for every target too, so that a
    // DcpDecode starts warm.
    let mut dcp: Vec<(String, mla::dcp::kernels::DcpBuilt)> = Vec::new();
    let mut targets: Vec<Target> = Vec::new();
    if args.arch.is_empty() {
        let mut dec = mla::MlaDecode::new(&mla::MlaConfig::new(16, 0.1), mla::Device::Cuda(0))?;
        let Some(cuda) = dec.cuda_backend_mut() else {
            return Err(mla::Error::NoCudaDevice("no CUDA backend".into()));
        };
        let arch = cuda.target().arch.clone();
        for b in cuda.precompile_all()? {
            builds.push((arch.clone(), b.clone()));
        }
        targets.push(cuda.target().clone());
    } else {
        for name in &args.arch {
            let (major, minor) =
                Target::parse_arch(name).ok_or_else(|| mla::Error::InvalidConfig {
                    field: "arch",
                    reason: format!("expected a name like sm_90a, got {name:?}"),
                })?;
            let target = Target::new(major, minor)?;
            let smem_limit = registry::smem_limit_of_arch(major, minor);
            for v in registry::all_variants(smem_limit, target.wgmma()) {
                let b = compile::build(&v, &target, !args.deny_spills)?;
                builds.push((target.arch.clone(), b));
            }
            targets.push(target);
        }
    }
    for target in &targets {
        for dtype in [mla::ModelDtype::Bf16, mla::ModelDtype::F16] {
            let b = mla::dcp::kernels::build(target, dtype, !args.deny_spills)?;
            dcp.push((target.arch.clone(), b));
        }
    }

    println!(
        "{:<8} {:<20} {:<54} {:>5} {:>6} {:>8} {:>9}",
        "arch", "kernel", "defines", "regs", "spills", "source", "ms"
    );
    let rows = builds
        .iter()
        .map(|(arch, b)| {
            let name = b.variant.family.entry().to_string();
            (arch, name, b.variant.defines().join(" "), &b.module)
        })
        .chain(dcp.iter().map(|(arch, b)| {
            let bf16 = u8::from(b.model_dtype == mla::ModelDtype::Bf16);
            let defines = format!("MODEL_BF16={bf16}");
            (arch, "dcp (5 entries)".to_string(), defines, &b.module)
        }));
    let mut spilled = 0;
    for (arch, name, defines, module) in rows {
        let (usage, from_disk, millis) = (module.usage, module.from_disk, module.millis);
        let (regs, spills) = match usage {
            Some(u) => (
                u.registers.to_string(),
                format!(
                    "{}{}",
                    u.spill_stores + u.spill_loads,
                    if u.serialized_wgmma {
                        " (wgmma serialized)"
                    } else {
                        ""
                    }
                ),
            ),
            None => ("-".into(), "-".into()),
        };
        spilled += usage.is_some_and(|u| u.degraded()) as usize;
        let source = if from_disk { "cache" } else { "nvrtc" };
        println!(
            "{arch:<8} {name:<20} {defines:<54} {regs:>5} {spills:>6} {source:>8} {millis:>9.1}"
        );
    }
    println!(
        "{} kernels built, {} with spills or serialized wgmma",
        builds.len() + dcp.len(),
        spilled
    );
    if args.deny_spills && spilled > 0 {
        return Err(mla::Error::Compile {
            kernel: format!("{spilled} variants"),
            log: "register spills or serialized wgmma (see the table above)".into(),
        });
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
pub fn run(_args: &PrecompileArgs) -> mla::Result<()> {
    Err(mla::Error::CudaNotCompiled)
}
