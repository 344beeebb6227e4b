//! `mla`: benchmark and inspect the mla decode.
//!
//! - `mla bench`: time decodes on random DeepSeek-shaped problems, check them against the f64
//!   reference, print a table (or JSON for scripts such as the side-by-side anchors benchmark).
//! - `mla info`: the backends found, the device, and the split counts it would use.
//! - `mla precompile`: build the GPU kernels ahead of time (and check them for spills).
//!
//! `MLA_LOG=mla=debug` prints the library's debug events on stderr.

mod bench;
#[cfg(feature = "nccl")]
mod dcp_bench;
#[cfg(feature = "cuda")]
mod gpu_timing;
mod info;
mod precompile;
mod timing;

use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};

#[derive(Parser)]
#[command(
    name = "mla",
    version,
    about = "Multi-head Latent Attention decode: benchmark and inspect"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Time decodes and check them against the f64 reference.
    Bench(bench::BenchArgs),
    /// Show the backends, the device and its split counts.
    Info(info::InfoArgs),
    /// Build every GPU kernel variant ahead of time (into the disk cache).
    Precompile(precompile::PrecompileArgs),
}

/// Which backend to run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BackendArg {
    /// The CPU backend.
    Cpu,
    /// The first CUDA device.
    Cuda,
    /// The GPU when one is usable, else the CPU.
    Auto,
}

impl BackendArg {
    fn device(self) -> mla::Device {
        match self {
            BackendArg::Cpu => mla::Device::Cpu,
            BackendArg::Cuda => mla::Device::Cuda(0),
            BackendArg::Auto => mla::Device::Auto,
        }
    }
}

/// The environment variable holding the log filter (tracing's `EnvFilter` syntax).
const LOG_ENV: &str = "MLA_LOG";

/// Sends the library's events to stderr where `MLA_LOG` asks for them (`MLA_LOG=mla=debug`:
/// each decoder's kernels, each NVRTC build, each decode's kernel and split count); silent
/// otherwise.
fn init_logging() {
    if std::env::var_os(LOG_ENV).is_some() {
        let filter = tracing_subscriber::EnvFilter::from_env(LOG_ENV);
        tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .init();
    }
}

fn main() -> ExitCode {
    init_logging();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Bench(args) => bench::run(&args),
        Command::Info(args) => info::run(&args),
        Command::Precompile(args) => precompile::run(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}
