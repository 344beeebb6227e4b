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
    let builds = mla::precompile::for_targets(&args.arch, !args.deny_spills)?;
    println!(
        "{:<8} {:<20} {:<54} {:>5} {:>6} {:>8} {:>9}",
        "arch", "kernel", "defines", "regs", "spills", "source", "ms"
    );
    let mut spilled = 0;
    for b in &builds {
        let (arch, name, defines) = (&b.arch, &b.kernel, &b.defines);
        let (usage, from_disk, millis) = (b.usage, b.from_disk, b.millis);
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
        builds.len(),
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
