//! Batch-invariant mode on the GPU: the stage-1 family, and so a row's bits, depend on the
//! decoder and the row alone. A request decoded alone and beside neighbours that would flip
//! each kernel choice outside the mode (long neighbours, whose splits the seesaw kernel or the
//! fp8 twin would take; a wave's worth of neighbours, whose grid the narrow kernel would fill)
//! gives bitwise the same o and lse on the same family, at 16, 64 and 128 heads, bf16 and fp8
//! caches, single and multi-token rows, once per kernel setting
//! (`batch_invariance::as_shipped`, `batch_invariance::forced_seesaw`, ...; the mode never
//! schedules). Skips (saying why) without a GPU, fails there with `MLA_REQUIRE_GPU=1`.
#![cfg(feature = "cuda")]

mod common;

use common::gpu::kernels::{Kernels, Tally};
use common::gpu::{self, DeviceOutputs};
use common::{Case, first_difference, request_alone, spec};
use mla::reference;
use mla::synth::Problem;
use mla::{DecodeInputs, DecodePlan, KernelFamily, KvFormat, Mask, MlaDecode, ModelDtype};

/// Every case of the suite under `kernels`.
fn batch_invariance(kernels: Kernels) {
    let Some(mut t) = Tally::start("cuda_batch_invariance", kernels) else {
        return;
    };
    for heads in [16, 64, 128] {
        for kv in [KvFormat::Bf16, KvFormat::Fp8E4m3] {
            for q_len in [1, 2] {
                rows_do_not_see_their_neighbours(&mut t, heads, kv, q_len);
            }
        }
    }
    t.finish();
}

kernel_tests!(batch_invariance, split_grid);

/// Keys of the request under test: short enough that outside the mode its splits would take
/// neither the seesaw kernel nor the fp8 twin, and the narrow kernel would not fill the GPU.
const SUBJECT_KEYS: usize = 700;

/// What one decode ran on and gave.
struct Decoded {
    plan: DecodePlan,
    o: Vec<f32>,
    lse: Vec<f32>,
}

impl Decoded {
    /// The family and the tokens a CTA: what decides the kernel's arithmetic.
    fn kernel(&self) -> (Option<KernelFamily>, usize) {
        (self.plan.kernel(), self.plan.tokens_per_cta())
    }
}

/// Decodes `inputs` (`rows` query rows of `case`'s shape) on `dec`, outputs poisoned first.
fn decode(dec: &mut MlaDecode, case: &Case, inputs: &DecodeInputs<'_>, rows: usize) -> Decoded {
    let s = gpu::stream(dec);
    let shape = [rows, case.spec.heads, case.spec.kv_lora_rank];
    let mut out = DeviceOutputs::with_shape(&s, case.spec.model_dtype, shape).unwrap();
    let plan = dec.forward(inputs, &mut out.views().unwrap()).unwrap();
    dec.check_device_errors().unwrap();
    let (o, lse) = out.download(&s).unwrap();
    Decoded { plan, o, lse }
}

/// Request `i` of `full` (a decode of the whole batch) bitwise equal to `alone`, on the same
/// family and packing.
fn assert_same(full: &Decoded, alone: &Decoded, i: usize, rows: usize, what: &str) {
    assert_eq!(
        full.kernel(),
        alone.kernel(),
        "{what}: the batch and request {i} alone ran different kernels"
    );
    let (o_row, lse_row) = (alone.o.len() / rows, alone.lse.len() / rows);
    let r = i * rows;
    let diff = first_difference(&full.o[r * o_row..(r + rows) * o_row], &alone.o);
    assert!(
        diff.is_none(),
        "{what}: o of request {i} differs alone: {diff:?}"
    );
    let diff = first_difference(&full.lse[r * lse_row..(r + rows) * lse_row], &alone.lse);
    assert!(
        diff.is_none(),
        "{what}: lse of request {i} differs alone: {diff:?}"
    );
}

/// The request under test (first of the batch) and the batch's last request, each alone and
/// beside each set of neighbours, on one decoder: bitwise the same rows, on one family for
/// every batch; the request alone within the contract's tolerances of the reference.
fn rows_do_not_see_their_neighbours(t: &mut Tally, heads: usize, kv: KvFormat, q_len: usize) {
    let shape = |lens: &[usize]| {
        let mut case =
            Case::new(spec(heads, 64, lens, q_len, Mask::Causal).with_format(ModelDtype::Bf16, kv));
        case.batch_invariant = true;
        case
    };
    let mut dec = t.open(&shape(&[SUBJECT_KEYS]));
    let sm_count = dec.cuda_backend().unwrap().sm_count();
    // Outside the mode: splits of 16k keys and more take the seesaw kernel (bf16) or the fp8
    // twin (fp8, 17 heads or more); a CTA for each SM of 1024-key single tokens at 16 heads
    // takes the narrow kernel (bf16).
    let neighbours: [(&str, Vec<usize>); 3] = [
        ("no neighbour", vec![]),
        ("long neighbours", vec![16_384, 33_000]),
        ("a wave of neighbours", vec![1024; sm_count.max(2) - 1]),
    ];
    let mut families = Vec::new();
    for (which, others) in neighbours {
        let lens: Vec<usize> = std::iter::once(SUBJECT_KEYS).chain(others).collect();
        let case = shape(&lens);
        let what = format!(
            "{heads} heads x {q_len} tokens, {kv:?}, {}, {which}",
            t.kernels()
        );
        let s = gpu::stream(&dec);
        let p = Problem::generate(&case.spec).unwrap();
        let dp = p.to_device(&s).unwrap();
        let inputs = dp.inputs(&p, false).unwrap();
        let full = decode(&mut dec, &case, &inputs, p.rows());
        families.push(full.kernel());
        for i in [0, lens.len() - 1] {
            let alone = decode(&mut dec, &case, &request_alone(&inputs, i), q_len);
            assert_same(&full, &alone, i, q_len, &what);
            if i == 0 {
                // Its rows come first: the reference of the batch's first rows is its own.
                let host = p.inputs().unwrap();
                let r = reference::decode_f64(dec.config(), &host, Some(q_len)).unwrap();
                let a = r.accuracy(&alone.o, &alone.lse);
                common::assert_accurate(&case, a);
            }
        }
        // One count a batch: the family its decode ran on.
        t.count(&full.plan);
    }
    assert!(
        families.windows(2).all(|w| w[0] == w[1]),
        "{heads} heads x {q_len} tokens, {kv:?}, {}: the family changed with the neighbours: \
         {families:?}",
        t.kernels()
    );
}
