//! `mla info`: what this build and this machine offer.

use clap::Args;
use mla::{Device, MlaConfig, MlaDecode};

use crate::BackendArg;

#[derive(Args)]
pub struct InfoArgs {
    /// Backend to describe.
    #[arg(long, value_enum, default_value_t = BackendArg::Auto)]
    backend: BackendArg,
}

/// Lengths whose split counts are shown.
const LENGTHS: [usize; 7] = [512, 1024, 4096, 8192, 32768, 131072, 1 << 20];

pub fn run(args: &InfoArgs) -> Result<(), mla::Error> {
    let probe = |device| MlaDecode::new(&MlaConfig::new(16, 0.1), device);
    println!("mla {}", env!("CARGO_PKG_VERSION"));
    println!("backends:");
    for (name, device) in [("cpu", Device::Cpu), ("cuda", Device::Cuda(0))] {
        match probe(device) {
            Ok(dec) => println!("  {name:<5} available: {}", dec.device()),
            Err(e) => println!("  {name:<5} unavailable: {e}"),
        }
    }
    println!("cpu features: {}", mla::CpuFeatures::detect());
    let dec = probe(args.backend.device())?;
    let units = dec.config().sm_count;
    println!(
        "selected ({:?}): {} backend on {}",
        args.backend,
        dec.backend_name(),
        dec.device()
    );

    println!(
        "num_kv_splits ({:?}, {units} SMs or threads; pages of 64 keys):",
        dec.split_rule()
    );
    let row = |f: &dyn Fn(usize) -> usize| {
        LENGTHS
            .iter()
            .map(|&l| format!("{:>9}", f(l)))
            .collect::<String>()
    };
    println!("  max_kv_len {}", row(&|l| l));
    for rows in [1, 8, 64] {
        println!(
            "  {rows:>3} rows   {}",
            row(&|l| dec.num_kv_splits(l, rows, 1, 64))
        );
    }
    Ok(())
}
