//! Shared by the contract tests: a case description that every backend runs, and the check
//! against the f64 reference with the contract's tolerances.
#![allow(dead_code)]

pub mod dcp;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod nan;

use std::cell::RefCell;
use std::rc::Rc;

use mla::reference::{self, Accuracy, Reference};
use mla::synth::{Outputs, Problem, ProblemSpec};
use mla::{
    CpuKernel, DecodeInputs, Device, KvFormat, Mask, MlaConfig, MlaDecode, ModelDtype, Query,
    ValidConfig,
};

/// `||o - ref|| / ||ref||` with a bf16 or f16 query.
pub const O_TOL: f64 = 5e-3;
/// Largest LSE error.
pub const LSE_TOL: f64 = 1e-3;
/// `||o - ref|| / ||ref||` in the fp8-query mode (q and P rounded to e4m3; docs/contract.md).
pub const FP8_QUERY_O_TOL: f64 = 5e-2;
/// Largest LSE error in the fp8-query mode.
pub const FP8_QUERY_LSE_TOL: f64 = 0.15;
/// Each (row, head)'s `||o - ref|| / ||ref||` may be this many times the whole tensor's
/// tolerance (its LSE error is bounded by the same tolerance as the largest one): one head's
/// L values average fewer roundings than the tensor's, but a head or a row that is wrong
/// shows, which the whole tensor's norm hides among many.
pub const HEAD_O_FACTOR: f64 = 2.0;
/// Largest LSE difference between a GPU kernel and the CPU backend in the fp8-query mode.
/// Hopper's fp8 wgmma adds its products at less than f32's precision (DeepSeek-V3's report
/// measured about 14 bits on the H800), so its scores differ from the CPU backend's f32 sums
/// by more than the f16 products' (measured on the H200: up to 1.13e-3 against 1e-3 for the
/// mma kernel's f16 products; scripts/gpu/run.sh tests prints every case's).
pub const FP8_QUERY_CPU_LSE_TOL: f64 = 3e-3;

/// One decode case: a problem and the decoder settings it runs under.
#[derive(Debug, Clone)]
pub struct Case {
    pub spec: ProblemSpec,
    pub window: Option<usize>,
    pub batch_invariant: bool,
    pub split_q: bool,
    /// Overrides the SM count of the split rule (to reach many splits on a small CPU).
    pub split_units: Option<usize>,
    /// A fixed split count instead of the rule (`MlaConfig::num_kv_splits`).
    pub fixed_splits: Option<usize>,
    /// The fp8-query mode (`MlaConfig::fp8_query`; the spec's cache must be fp8).
    pub fp8_query: bool,
    /// The CPU backend's stage-1 path (`MlaConfig::cpu_kernel`).
    pub cpu_kernel: CpuKernel,
}

impl Case {
    pub fn new(spec: ProblemSpec) -> Self {
        Case {
            spec,
            window: None,
            batch_invariant: false,
            split_q: false,
            split_units: None,
            fixed_splits: None,
            fp8_query: false,
            cpu_kernel: CpuKernel::Auto,
        }
    }

    /// The contract's tolerances against the f64 reference: (o, lse).
    pub fn tolerances(&self) -> (f64, f64) {
        if self.fp8_query {
            (FP8_QUERY_O_TOL, FP8_QUERY_LSE_TOL)
        } else {
            (O_TOL, LSE_TOL)
        }
    }

    /// The tolerances of each (row, head) on its own against the f64 reference: (o, lse).
    pub fn head_tolerances(&self) -> (f64, f64) {
        let (o, lse) = self.tolerances();
        (o * HEAD_O_FACTOR, lse)
    }

    /// The largest LSE difference a GPU kernel may show against the CPU backend.
    pub fn cpu_lse_tolerance(&self) -> f64 {
        if self.fp8_query {
            FP8_QUERY_CPU_LSE_TOL
        } else {
            LSE_TOL
        }
    }

    pub fn config(&self) -> MlaConfig {
        let mut c = MlaConfig::new(self.spec.heads, 192f32.powf(-0.5));
        c.kv_lora_rank = self.spec.kv_lora_rank;
        c.qk_rope_head_dim = self.spec.rope_dim;
        c.model_dtype = self.spec.model_dtype;
        c.kv_cache_dtype = cache_dtype(self.spec.kv_format);
        c.sliding_window = self.window;
        c.batch_invariant = self.batch_invariant;
        c.split_units = self.split_units;
        c.num_kv_splits = self.fixed_splits;
        c.fp8_query = self.fp8_query;
        c.tuning.cpu_kernel = self.cpu_kernel;
        c
    }
}

/// Request `i` of a batch's inputs on its own: its `query_len` q rows, its block-table row
/// and its length, the same cache; views into the same memory (host or device), no copies.
/// Needs a packed q.
pub fn request_alone<'a>(full: &DecodeInputs<'a>, i: usize) -> DecodeInputs<'a> {
    let q_len = full.query_len;
    let mb = full.block_table.shape()[1];
    let Query::Packed(q) = &full.q else {
        panic!("request_alone needs a packed q");
    };
    let [_, h, d] = q.shape();
    DecodeInputs {
        q: Query::Packed(
            q.sub_view(i * q_len * q.strides()[0], [q_len, h, d], q.strides())
                .unwrap(),
        ),
        block_table: full.block_table.sub_view(i * mb, [1, mb], [mb, 1]).unwrap(),
        seq_lens: full.seq_lens.sub_view(i, [1], [1]).unwrap(),
        ..*full
    }
}

/// (index, first value, second value, values that differ) of the first bitwise difference
/// of two equally long slices; None when they are bitwise equal.
pub fn first_difference(a: &[f32], b: &[f32]) -> Option<(usize, f32, f32, usize)> {
    assert_eq!(a.len(), b.len());
    let differ = |(x, y): (&f32, &f32)| x.to_bits() != y.to_bits();
    let count = a.iter().zip(b).filter(|&p| differ(p)).count();
    let i = a.iter().zip(b).position(differ)?;
    Some((i, a[i], b[i], count))
}

/// vLLM's name for a cache format.
pub fn cache_dtype(kv: KvFormat) -> mla::CacheDtype {
    match kv {
        KvFormat::Bf16 => mla::CacheDtype::Bf16,
        KvFormat::F16 => mla::CacheDtype::F16,
        KvFormat::Fp8E4m3 => mla::CacheDtype::Fp8E4m3,
        KvFormat::Fp8E5m2 => mla::CacheDtype::Fp8E5m2,
    }
}

/// The worst (row, head) of `o` and `lse` against the reference: the largest o error and
/// the largest LSE error of any head on its own ([`Reference::head_accuracy`]).
pub fn worst_head(r: &Reference, o: &[f32], lse: &[f32]) -> Accuracy {
    r.head_accuracy(o, lse).iter().fold(
        Accuracy {
            o_rel: 0.0,
            lse_abs: 0.0,
        },
        |w, a| Accuracy {
            o_rel: w.o_rel.max(a.o_rel),
            lse_abs: w.lse_abs.max(a.lse_abs),
        },
    )
}

/// Asserts the per-(row, head) tolerances of a case on its worst head.
pub fn assert_heads_accurate(case: &Case, worst: Accuracy, what: &str) {
    assert_within(
        case,
        worst,
        case.head_tolerances(),
        &format!("{what}: worst head "),
    );
}

/// Asserts `a` within (o, lse) tolerances; `what` starts the message.
fn assert_within(case: &Case, a: Accuracy, (o_tol, lse_tol): (f64, f64), what: &str) {
    assert!(
        a.o_rel <= o_tol && a.lse_abs <= lse_tol,
        "{what}o_rel {:.3e} (tol {o_tol:e}), lse_abs {:.3e} (tol {lse_tol:e}) for {case:#?}",
        a.o_rel,
        a.lse_abs
    );
}

/// What a run gave and how far it is from the reference.
pub struct Checked {
    /// The whole tensor's accuracy.
    pub accuracy: Accuracy,
    /// The worst (row, head)'s ([`worst_head`]); [`run_case`] asserts its tolerances.
    pub worst_head: Accuracy,
    pub num_kv_splits: usize,
    /// The plan's keys of its longest split (`DecodePlan::split_keys`).
    pub split_keys: usize,
    pub outputs: Outputs,
}

/// Runs a case on a device with poisoned outputs and compares it with the f64 reference;
/// asserts every (row, head)'s tolerances ([`Case::head_tolerances`]).
pub fn run_case(case: &Case, device: Device) -> Checked {
    run_case_with(case, device, |_| {}, |_| {})
}

/// [`run_case`] with the configuration changed by `configure` (a larger scale) and values
/// planted in the drawn problem by `plant` (outlier keys).
pub fn run_case_with(
    case: &Case,
    device: Device,
    configure: impl FnOnce(&mut MlaConfig),
    plant: impl FnOnce(&mut Problem),
) -> Checked {
    Drawn::new(&case.spec, plant).run(case, device, configure)
}

/// What the f64 reference reads of a configuration besides the problem: heads, scale,
/// widths, dtypes, window.
type ReferenceSettings = (
    usize,
    f32,
    usize,
    usize,
    ModelDtype,
    KvFormat,
    Option<usize>,
);

fn reference_settings(c: &ValidConfig) -> ReferenceSettings {
    (
        c.q_heads,
        c.scale,
        c.kv_lora_rank,
        c.rope_dim,
        c.model_dtype,
        c.kv_format,
        c.sliding_window,
    )
}

/// A problem drawn once, and its f64 reference computed once for each setting it reads
/// ([`ReferenceSettings`]): the decoder settings that change neither (the CPU path, the split
/// count, the split rule's units) each cost [`run`](Self::run) a decode, not a draw of the
/// problem and a reference again, which cost many times a decode.
pub struct Drawn {
    problem: Problem,
    references: RefCell<Vec<(ReferenceSettings, Rc<Reference>)>>,
}

impl Drawn {
    /// Draws `spec`'s problem, with values planted in it by `plant` (outlier keys).
    pub fn new(spec: &ProblemSpec, plant: impl FnOnce(&mut Problem)) -> Drawn {
        let mut problem = Problem::generate(spec).unwrap();
        plant(&mut problem);
        Drawn::of(problem)
    }

    /// A problem drawn already.
    pub fn of(problem: Problem) -> Drawn {
        Drawn {
            problem,
            references: RefCell::new(Vec::new()),
        }
    }

    /// The problem.
    pub fn problem(&self) -> &Problem {
        &self.problem
    }

    /// [`run_case_with`] on this problem (the case's spec must be the one drawn).
    pub fn run(
        &self,
        case: &Case,
        device: Device,
        configure: impl FnOnce(&mut MlaConfig),
    ) -> Checked {
        assert_eq!(case.spec, self.problem.spec, "a case of another problem");
        let problem = &self.problem;
        let mut cfg = case.config();
        configure(&mut cfg);
        let mut dec = MlaDecode::new(&cfg, device).expect("valid config");
        let mut out = Outputs::poisoned(problem);
        let mut inputs = problem.inputs().expect("inputs");
        if case.split_q {
            inputs.q = problem.query_split().expect("split q");
        }
        let plan = dec
            .forward(&inputs, &mut out.views().unwrap())
            .expect("forward");
        let reference = self.reference(dec.config(), &inputs);
        let o = out.o.to_f32();
        let accuracy = reference.accuracy(&o, &out.lse);
        let worst_head = worst_head(&reference, &o, &out.lse);
        assert_heads_accurate(case, worst_head, "against the reference");
        Checked {
            accuracy,
            worst_head,
            num_kv_splits: plan.num_kv_splits,
            split_keys: plan.split_keys(),
            outputs: out,
        }
    }

    /// The reference under `cfg`'s settings: the one computed before for the same settings,
    /// or computed now.
    fn reference(&self, cfg: &ValidConfig, inputs: &DecodeInputs<'_>) -> Rc<Reference> {
        let settings = reference_settings(cfg);
        let mut references = self.references.borrow_mut();
        if let Some((_, r)) = references.iter().find(|(s, _)| *s == settings) {
            return Rc::clone(r);
        }
        let r = Rc::new(reference::decode_f64(cfg, inputs, None).expect("reference"));
        references.push((settings, Rc::clone(&r)));
        r
    }
}

/// Asserts the contract's tolerances.
pub fn assert_accurate(case: &Case, a: Accuracy) {
    assert_within(case, a, case.tolerances(), "");
}

/// The CPU paths this CPU can force, saying which it cannot. With `MLA_REQUIRE_AMX=1` (set on
/// a machine with AMX-BF16, to run the amx-bf16 path for sure) a missing amx-bf16 path fails
/// the test instead of being skipped.
pub fn cpu_kernels() -> Vec<CpuKernel> {
    let has = mla::CpuFeatures::detect();
    let mut kernels = vec![CpuKernel::Portable];
    if has.avx512_bf16 {
        kernels.push(CpuKernel::Avx512Bf16);
    } else {
        eprintln!("skipped the avx512-bf16 path: this CPU lacks AVX-512 BF16");
    }
    if has.amx_granted {
        kernels.push(CpuKernel::AmxBf16);
    } else {
        assert!(
            std::env::var("MLA_REQUIRE_AMX").as_deref() != Ok("1"),
            "MLA_REQUIRE_AMX=1 but the amx-bf16 path cannot run here; this CPU has: {has}"
        );
        eprintln!("skipped the amx-bf16 path: this CPU or OS lacks AMX-BF16 (it has: {has})");
    }
    kernels
}

/// A compact spec for hand-written cases.
pub fn spec(heads: usize, page: usize, lens: &[usize], q_len: usize, mask: Mask) -> ProblemSpec {
    let mut s = ProblemSpec::new(heads, lens.to_vec());
    s.page_size = page;
    s.query_len = q_len;
    s.mask = mask;
    s
}

/// Every cache format with the model dtypes worth testing against it.
pub fn formats() -> Vec<(ModelDtype, KvFormat)> {
    vec![
        (ModelDtype::Bf16, KvFormat::Bf16),
        (ModelDtype::F16, KvFormat::F16),
        (ModelDtype::Bf16, KvFormat::F16),
        (ModelDtype::F16, KvFormat::Bf16),
        (ModelDtype::Bf16, KvFormat::Fp8E4m3),
        (ModelDtype::Bf16, KvFormat::Fp8E5m2),
        (ModelDtype::F16, KvFormat::Fp8E4m3),
    ]
}
