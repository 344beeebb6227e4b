//! `mla bench`: times decodes on random problems and checks them against the f64 reference.
//!
//! One case from the arguments, or (with no case argument) a small DeepSeek-V3-shaped grid
//! with a progress display. Time is the median over `--iters` runs of forward after one
//! warmup run; GB/s counts the cache bytes each request's rows read plus q and o, TFLOP/s the
//! two products (2 * H * keys * (D + L) per row). The error columns compare the first rows
//! (up to 4 requests) with the reference.

use std::io::IsTerminal;
use std::time::Instant;

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use mla::reference;
use mla::synth::{Outputs, Problem, ProblemSpec};
use mla::{CacheDtype, Mask, MlaConfig, MlaDecode, ModelDtype};
use serde::Serialize;

use crate::BackendArg;
use crate::timing::{Timed, median};

/// Requests whose rows are checked against the reference.
const CHECK_REQUESTS: usize = 4;

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Backend to time.
    #[arg(long, value_enum, default_value_t = BackendArg::Auto)]
    backend: BackendArg,
    /// Requests in the batch.
    #[arg(long, value_parser = positive)]
    batch: Option<usize>,
    /// Query heads.
    #[arg(long)]
    heads: Option<usize>,
    /// Keys per request (the longest with --varlen).
    #[arg(long)]
    ctx: Option<usize>,
    /// Keys per cache page.
    #[arg(long, value_parser = positive)]
    page: Option<usize>,
    /// Cache dtype: vLLM's names (auto, bfloat16, float16, fp8, fp8_e4m3, fp8_e5m2) or bf16, f16.
    #[arg(long)]
    kv_dtype: Option<String>,
    /// New query tokens per request.
    #[arg(long, value_parser = positive)]
    query_len: Option<usize>,
    /// Whether the query tokens of a request see each other causally.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    causal: bool,
    /// Sliding window (keys).
    #[arg(long)]
    window: Option<usize>,
    /// Draw lengths uniformly in [ctx/8, ctx] instead of all ctx.
    #[arg(long)]
    varlen: bool,
    /// A fixed split count instead of the device's rule (to time the split counts a rule
    /// could pick; every case of the run takes it).
    #[arg(long, value_parser = positive)]
    splits: Option<usize>,
    /// Single-token decodes on the schedule the GPU computes (MlaConfig::device_schedule,
    /// docs/scheduler.md) instead of the split grid.
    #[arg(long)]
    schedule: bool,
    /// The fp8-query mode (MlaConfig::fp8_query): q quantized to e4m3 (q_scale 1/64, which
    /// suits the drawn q ~ N(0, 1)), P rounded to e4m3; needs an fp8 cache. Over the default
    /// grid, its fp8 cases take it.
    #[arg(long)]
    fp8_query: bool,
    /// The stage-1 kernel family: auto (the shipped choice), or one of mma, wgmma, narrow,
    /// seesaw, wgmma-fp8 forced wherever it can run (for comparisons; the output's `kernel`
    /// column says which family ran).
    #[arg(long, default_value = "auto")]
    kernel: mla::KernelChoice,
    /// The device schedule's costs SEG,MIN (a segment's fixed cost, a stretch's fewest blocks;
    /// each 0 to 64), for tuning them; default the shipped ones.
    #[arg(long)]
    schedule_costs: Option<mla::ScheduleCosts>,
    /// Launch the kernels after a decode's first without programmatic dependent launch (PDL),
    /// to measure what it saves.
    #[arg(long)]
    no_pdl: bool,
    /// Timed runs per case: CPU decodes, or GPU graph replays (default 5; anchors use 10).
    #[arg(long, value_parser = positive)]
    iters: Option<usize>,
    /// Print one JSON object per case; the last stdout line is the last case's.
    #[arg(long)]
    json: bool,
    /// Seed of the random inputs.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// The CPU backend's stage-1 kernel (MlaConfig::cpu_kernel): auto, amx-bf16,
    /// avx512-bf16 or portable; forcing one this CPU or case cannot run is an error.
    #[arg(long, default_value = "auto")]
    cpu_kernel: mla::CpuKernel,
    /// Decode context parallelism: time one GPU against this many (GPUs 0..N, NCCL), the
    /// heads being the total over the ranks (needs the `nccl` feature).
    #[arg(long, value_parser = positive)]
    dcp: Option<usize>,
    /// DCP interleave: tokens per chunk dealt to a rank.
    #[arg(long, value_parser = positive, default_value_t = 1)]
    dcp_interleave: usize,
}

/// A whole number >= 1.
fn positive(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!("expected a whole number >= 1, got {s:?}")),
    }
}

/// One benchmark case.
#[derive(Debug, Clone, Serialize)]
struct Case {
    batch: usize,
    heads: usize,
    ctx: usize,
    page: usize,
    kv_dtype: String,
    query_len: usize,
    causal: bool,
    window: Option<usize>,
    varlen: bool,
    /// `--splits`: the split count asked for (None: the device's rule).
    fixed_splits: Option<usize>,
    /// `--schedule`: the device-computed schedule asked for.
    device_schedule: bool,
    /// `--fp8-query`: the fp8-query mode.
    fp8_query: bool,
    /// `--kernel`: the stage-1 family asked for (`auto`, or the one forced).
    kernel_choice: String,
    /// `--kernel`, `--schedule-costs`, `--no-pdl`.
    #[serde(skip)]
    tuning: mla::Tuning,
}

/// What a case measured.
#[derive(Debug, Clone, Serialize)]
struct Measured {
    #[serde(flatten)]
    case: Case,
    backend: &'static str,
    /// The stage-1 kernel that ran: the CPU path (`cpu-amx-bf16`, `cpu-avx512-bf16`,
    /// `cpu-portable`) or the GPU family (`mma`, `wgmma`, `narrow`, `seesaw`, `wgmma-fp8`).
    kernel: &'static str,
    device: String,
    num_kv_splits: usize,
    iters: usize,
    us: f64,
    #[serde(rename = "TBps")]
    tbps: f64,
    #[serde(rename = "TFLOPs")]
    tflops: f64,
    err_o: f64,
    err_lse: f64,
}

impl BenchArgs {
    fn has_case(&self) -> bool {
        self.batch.is_some()
            || self.heads.is_some()
            || self.ctx.is_some()
            || self.page.is_some()
            || self.kv_dtype.is_some()
            || self.query_len.is_some()
            || self.window.is_some()
            || self.varlen
    }

    /// The settings of every case of the run.
    fn tuning(&self) -> mla::Tuning {
        mla::Tuning {
            kernel: self.kernel,
            schedule_costs: self.schedule_costs.unwrap_or_default(),
            pdl: !self.no_pdl,
            cpu_kernel: self.cpu_kernel,
        }
    }

    fn case(&self) -> Case {
        Case {
            batch: self.batch.unwrap_or(8),
            heads: self.heads.unwrap_or(128),
            ctx: self.ctx.unwrap_or(4096),
            page: self.page.unwrap_or(64),
            kv_dtype: self.kv_dtype.clone().unwrap_or_else(|| "bf16".into()),
            query_len: self.query_len.unwrap_or(1),
            causal: self.causal,
            window: self.window,
            varlen: self.varlen,
            fixed_splits: self.splits,
            device_schedule: self.schedule,
            fp8_query: self.fp8_query,
            kernel_choice: self.kernel.to_string(),
            tuning: self.tuning(),
        }
    }
}

/// The default grid: DeepSeek-V3 shapes (576-wide rows, page 64), sized for a CPU, with the
/// run's settings (`--splits`, `--schedule`, `--kernel`, ...) for every case and
/// `--fp8-query` for the fp8 ones.
fn grid(args: &BenchArgs) -> Vec<Case> {
    let base = args.case();
    let mut cases = Vec::new();
    for heads in [16, 128] {
        for kv in ["bf16", "fp8"] {
            for (batch, ctx) in [(1, 4096), (8, 4096), (32, 2048)] {
                cases.push(Case {
                    batch,
                    heads,
                    ctx,
                    page: 64,
                    kv_dtype: kv.into(),
                    query_len: 1,
                    causal: true,
                    window: None,
                    varlen: false,
                    fp8_query: base.fp8_query && kv == "fp8",
                    ..base.clone()
                });
            }
        }
    }
    cases
}

/// The CLI's cache dtype names: vLLM's, plus the short bf16/f16.
fn cache_dtype(name: &str) -> mla::Result<CacheDtype> {
    match name {
        "bf16" => Ok(CacheDtype::Bf16),
        "f16" => Ok(CacheDtype::F16),
        other => other.parse(),
    }
}

pub fn run(args: &BenchArgs) -> mla::Result<()> {
    if let Some(world) = args.dcp {
        return run_dcp(args, world);
    }
    let cases = if args.has_case() {
        vec![args.case()]
    } else {
        grid(args)
    };
    let iters = args.iters.unwrap_or(5);
    let mut progress = Progress::new(cases.len(), args.json);
    let mut rows = Vec::new();
    for case in &cases {
        progress.start(case);
        let m = measure(case, args.backend, iters, args.seed)?;
        if args.json {
            println!("{}", serde_json::to_string(&m).unwrap_or_default());
        }
        rows.push(m);
        progress.done();
    }
    progress.finish();
    if !args.json {
        print_table(&rows);
    }
    Ok(())
}

/// A case's decoder configuration (DeepSeek's scale) and its cache dtype.
fn config(case: &Case) -> mla::Result<(MlaConfig, CacheDtype)> {
    let cache = cache_dtype(&case.kv_dtype)?;
    let mut cfg = MlaConfig::new(case.heads, 192f32.powf(-0.5));
    cfg.kv_cache_dtype = cache;
    cfg.sliding_window = case.window;
    cfg.num_kv_splits = case.fixed_splits;
    cfg.device_schedule = case.device_schedule;
    cfg.fp8_query = case.fp8_query;
    cfg.tuning = case.tuning;
    Ok((cfg, cache))
}

fn measure(case: &Case, backend: BackendArg, iters: usize, seed: u64) -> mla::Result<Measured> {
    let (cfg, cache) = config(case)?;
    let mut dec = MlaDecode::new(&cfg, backend.device())?;
    let problem = generate(case, cache, seed)?;

    dec.reserve_workspace(problem.rows(), case.ctx)?;
    dec.lock_workspace();
    let timed = match dec.location() {
        mla::Location::Host => time_cpu(&mut dec, &problem, iters)?,
        #[cfg(feature = "cuda")]
        mla::Location::Cuda(_) => crate::gpu_timing::time(&mut dec, &problem, iters)?,
        #[cfg(not(feature = "cuda"))]
        mla::Location::Cuda(_) => return Err(mla::Error::CudaNotCompiled),
    };

    let check_rows = CHECK_REQUESTS.min(case.batch) * case.query_len;
    let r = reference::decode_f64(dec.config(), &problem.inputs()?, Some(check_rows))?;
    let acc = r.accuracy(&timed.o, &timed.lse);
    let (bytes, flops) = traffic(&problem, &timed.plan);
    Ok(Measured {
        case: case.clone(),
        backend: dec.backend_name(),
        kernel: dec.kernel_name(&timed.plan),
        device: dec.device().to_string(),
        num_kv_splits: timed.plan.num_kv_splits,
        iters,
        us: timed.secs * 1e6,
        tbps: bytes / timed.secs / 1e12,
        tflops: flops / timed.secs / 1e12,
        err_o: acc.o_rel,
        err_lse: acc.lse_abs,
    })
}

/// Bytes of the host buffers a case allocates: q, the cache, the block table (and the
/// shuffled block ids it is cut from), o and lse with their f32 copies. None when it overflows.
fn host_bytes(case: &Case, cache: CacheDtype) -> Option<usize> {
    let spec = ProblemSpec::new(case.heads, Vec::new());
    let (l, d) = (spec.kv_lora_rank, spec.kv_lora_rank + spec.rope_dim);
    let kv_elem = cache.resolve(ModelDtype::Bf16).ok()?.size();
    let rows = case.batch.checked_mul(case.query_len)?;
    let heads = rows.checked_mul(case.heads)?;
    let blocks = case
        .ctx
        .div_ceil(case.page)
        .max(1)
        .checked_mul(case.batch)?
        .checked_add(spec.spare_blocks)?;
    let kv = blocks
        .checked_mul(case.page)?
        .checked_mul(d)?
        .checked_mul(kv_elem)?;
    let q = heads.checked_mul(d)?.checked_mul(2)?;
    let o = heads.checked_mul(l)?.checked_mul(2 + 4)?;
    let lse = heads.checked_mul(4 + 4)?;
    [kv, q, o, lse, blocks.checked_mul(8)?]
        .into_iter()
        .try_fold(0usize, usize::checked_add)
}

/// The machine's memory in bytes (Linux's MemTotal); None where it is not known.
fn total_memory() -> Option<usize> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// A case whose buffers cannot fit in this machine's memory is an error naming the flags
/// that size it, before anything is allocated (an allocation that fails aborts the process).
fn check_host_memory(case: &Case, cache: CacheDtype) -> mla::Result<()> {
    let need = host_bytes(case, cache);
    let memory = total_memory();
    if need.is_some_and(|n| memory.is_none_or(|m| n <= m)) {
        return Ok(());
    }
    let need = need.map_or("more bytes than usize holds".to_owned(), |n| {
        format!("{:.1} GiB", n as f64 / (1u64 << 30) as f64)
    });
    let here = memory.map_or(String::new(), |m| {
        format!(
            ", more than this machine's {:.1} GiB",
            m as f64 / (1u64 << 30) as f64
        )
    });
    Err(mla::Error::InvalidConfig {
        field: "--batch, --ctx",
        reason: format!(
            "--batch {} x --ctx {} (--heads {}, --query-len {}, --page {}) needs {need} of host memory{here}",
            case.batch, case.ctx, case.heads, case.query_len, case.page
        ),
    })
}

/// The random problem of a case.
fn generate(case: &Case, cache: CacheDtype, seed: u64) -> mla::Result<Problem> {
    check_host_memory(case, cache)?;
    let lens = ProblemSpec::lengths(case.batch, case.ctx, case.varlen, seed);
    let mut spec = ProblemSpec::new(case.heads, lens);
    spec.page_size = case.page;
    spec.query_len = case.query_len;
    spec.mask = if case.causal {
        Mask::Causal
    } else {
        Mask::NonCausal
    };
    let mut spec = spec.with_format(ModelDtype::Bf16, cache.resolve(ModelDtype::Bf16)?);
    spec.seed = seed;
    Problem::generate(&spec)
}

/// `--dcp N`: one GPU against N for the case of the arguments.
#[cfg(feature = "nccl")]
fn run_dcp(args: &BenchArgs, world: usize) -> mla::Result<()> {
    use crate::dcp_bench;
    use mla::dcp::DcpMerge;

    let case = args.case();
    let iters = args.iters.unwrap_or(20);
    let (cfg, cache) = config(&case)?;
    if let Err(why) = mla::dcp::available(world) {
        return Err(mla::Error::Nccl {
            op: "bench --dcp",
            detail: why,
        });
    }
    let problem = generate(&case, cache, args.seed)?;
    let (one_us, one_o) = dcp_bench::single_gpu(&problem, &cfg, iters)?;
    println!(
        "dcp bench: {} requests x {} keys{}, {} heads in all, kv {}, I = {}, {} GPUs, {} iterations",
        case.batch,
        case.ctx,
        if case.varlen { " (varlen)" } else { "" },
        case.heads,
        case.kv_dtype,
        args.dcp_interleave,
        world,
        iters
    );
    println!(
        "| merge | 1 GPU (us) | {world} GPUs (us) | local attention (us) | exchange + merge (us) | speedup | o vs 1 GPU |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: |");
    for merge in [DcpMerge::AllGatherReduceScatter, DcpMerge::AllToAll] {
        let m = dcp_bench::measure(
            &problem,
            &cfg,
            world,
            args.dcp_interleave,
            merge,
            iters,
            &one_o,
        )?;
        let name = match m.merge {
            DcpMerge::AllGatherReduceScatter => "all-gather + reduce-scatter",
            DcpMerge::AllToAll => "all-to-all",
        };
        println!(
            "| {name} | {one_us:.1} | {:.1} | {:.1} | {:.1} | {:.2}x | {:.1e} |",
            m.total_us,
            m.attend_us,
            m.total_us - m.attend_us,
            one_us / m.total_us,
            m.diff
        );
    }
    Ok(())
}

#[cfg(not(feature = "nccl"))]
fn run_dcp(_args: &BenchArgs, _world: usize) -> mla::Result<()> {
    Err(mla::Error::Nccl {
        op: "bench --dcp",
        detail: "mla was built without the nccl feature".into(),
    })
}

/// Median wall time of `iters` CPU decodes after one checked run.
fn time_cpu(dec: &mut MlaDecode, problem: &Problem, iters: usize) -> mla::Result<Timed> {
    let inputs = problem.inputs()?;
    let mut out = Outputs::poisoned(problem);
    let plan = dec.forward(&inputs, &mut out.views()?)?;
    let (o, lse) = (out.o.to_f32(), out.lse.clone());
    #[cfg(feature = "cpu-phase-times")]
    let _ = mla::cpu_phase_times(); // the checked run's phases are not the timed runs'
    let mut times = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t = Instant::now();
        dec.forward(&inputs, &mut out.views()?)?;
        times.push(t.elapsed().as_secs_f64());
    }
    #[cfg(feature = "cpu-phase-times")]
    print_phases(iters);
    Ok(Timed {
        plan,
        o,
        lse,
        secs: median(times),
    })
}

/// The CPU stage 1's time by phase over the timed runs, per decode (every thread's time
/// added, so the total is about the threads times the stage's wall time), to stderr.
#[cfg(feature = "cpu-phase-times")]
fn print_phases(iters: usize) {
    let phases = mla::cpu_phase_times();
    let total: f64 = phases.iter().map(|(_, d)| d.as_secs_f64()).sum();
    let parts: Vec<String> = phases
        .iter()
        .map(|(p, d)| {
            let s = d.as_secs_f64();
            let share = if total > 0.0 { 100.0 * s / total } else { 0.0 };
            format!(
                "{} {:.2} ms ({share:.0}%)",
                p.name(),
                1e3 * s / iters as f64
            )
        })
        .collect();
    eprintln!(
        "stage-1 phases, all threads, per decode: {}",
        parts.join(", ")
    );
}

/// Bytes a decode must move (each request's keys once, q in, o out) and the FLOPs of its two
/// products.
fn traffic(p: &Problem, plan: &mla::DecodePlan) -> (f64, f64) {
    let (h, d, l) = (
        plan.heads as f64,
        plan.head_dim() as f64,
        plan.kv_lora_rank as f64,
    );
    let elem = plan.kv_format.size() as f64;
    let (mut keys_read, mut keys_attended) = (0f64, 0f64);
    for (i, &len) in p.seq_lens.iter().enumerate() {
        let rows = (0..plan.query_len).map(|t| plan.row_keys(i * plan.query_len + t, len as usize));
        let (mut start, mut end) = (usize::MAX, 0);
        for k in rows {
            keys_attended += k.len() as f64;
            if !k.is_empty() {
                start = start.min(k.start);
                end = end.max(k.end);
            }
        }
        keys_read += end.saturating_sub(start) as f64;
    }
    let rows = plan.rows as f64;
    let bytes = keys_read * d * elem + rows * h * (d + l) * 2.0;
    let flops = 2.0 * h * keys_attended * (d + l);
    (bytes, flops)
}

fn print_table(rows: &[Measured]) {
    if let Some(first) = rows.first() {
        println!(
            "backend {} ({}) on {}, median of {} runs",
            first.backend, first.kernel, first.device, first.iters
        );
    }
    println!(
        "{:>5} {:>5} {:>7} {:>5} {:>8} {:>3} {:>7} {:>7} {:>11} {:>8} {:>8} {:>9} {:>9}  kernel",
        "batch",
        "heads",
        "ctx",
        "page",
        "kv",
        "Q",
        "window",
        "splits",
        "time",
        "GB/s",
        "TFLOP/s",
        "err_o",
        "err_lse"
    );
    for m in rows {
        let c = &m.case;
        let ctx = if c.varlen {
            format!("<={}", c.ctx)
        } else {
            c.ctx.to_string()
        };
        let q = if c.query_len > 1 && !c.causal {
            format!("{}n", c.query_len)
        } else {
            c.query_len.to_string()
        };
        println!(
            "{:>5} {:>5} {:>7} {:>5} {:>8} {:>3} {:>7} {:>7} {:>11} {:>8.1} {:>8.3} {:>9.2e} {:>9.2e}  {}",
            c.batch,
            c.heads,
            ctx,
            c.page,
            kv_name(c),
            q,
            c.window.map_or("-".into(), |w| w.to_string()),
            m.num_kv_splits,
            format_time(m.us),
            m.tbps * 1e3,
            m.tflops,
            m.err_o,
            m.err_lse,
            m.kernel
        );
    }
}

/// The cache dtype as the table shows it: `+q8` marks the fp8-query mode.
fn kv_name(c: &Case) -> String {
    if c.fp8_query {
        format!("{}+q8", c.kv_dtype)
    } else {
        c.kv_dtype.clone()
    }
}

fn format_time(us: f64) -> String {
    if us >= 1e4 {
        format!("{:.2} ms", us / 1e3)
    } else {
        format!("{us:.1} us")
    }
}

/// A progress bar on a terminal, a line per case otherwise (so CI logs show progress too).
struct Progress {
    bar: Option<ProgressBar>,
    total: usize,
    quiet: bool,
    index: usize,
}

impl Progress {
    fn new(total: usize, quiet: bool) -> Self {
        let bar = (total > 1 && std::io::stderr().is_terminal()).then(|| {
            let bar = ProgressBar::new(total as u64);
            if let Ok(style) = ProgressStyle::with_template("{bar:30} {pos}/{len} {elapsed} {msg}")
            {
                bar.set_style(style);
            }
            bar
        });
        Progress {
            bar,
            total,
            quiet,
            index: 0,
        }
    }

    fn start(&mut self, c: &Case) {
        self.index += 1;
        let i = self.index;
        let what = format!(
            "B={} H={} ctx={} kv={}",
            c.batch,
            c.heads,
            c.ctx,
            kv_name(c)
        );
        match &self.bar {
            Some(bar) => bar.set_message(what),
            None if self.total > 1 && !self.quiet => eprintln!("[{i}/{}] {what}", self.total),
            None => {}
        }
    }

    fn done(&self) {
        if let Some(bar) = &self.bar {
            bar.inc(1);
        }
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}
