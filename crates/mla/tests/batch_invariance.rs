//! Batch-invariant mode: a row decoded alone and the same row inside a batch give bitwise the
//! same o and lse, whatever the other requests' lengths.

mod common;

use common::{Case, first_difference, request_alone, spec};
use mla::synth::{Outputs, Problem};
use mla::{Device, Mask, MlaDecode};
use proptest::prelude::*;

/// Runs request `i` of a problem alone: same q rows, cache, block-table row and length.
fn run_alone(dec: &mut MlaDecode, p: &Problem, i: usize) -> (Vec<f32>, Vec<f32>) {
    let inputs = request_alone(&p.inputs().unwrap(), i);
    let shape = [p.spec.query_len, p.spec.heads, p.spec.kv_lora_rank];
    let mut out = Outputs::poisoned_shape(p.spec.model_dtype, shape);
    dec.forward(&inputs, &mut out.views().unwrap()).unwrap();
    (out.o.to_f32(), out.lse)
}

fn check(case: &Case) -> Result<(), TestCaseError> {
    let p = Problem::generate(&case.spec).unwrap();
    let mut dec = MlaDecode::new(&case.config(), Device::Cpu).unwrap();
    let mut out = Outputs::poisoned(&p);
    dec.forward(&p.inputs().unwrap(), &mut out.views().unwrap())
        .unwrap();
    let (o, lse) = (out.o.to_f32(), out.lse);
    let (h, l, q_len) = (p.spec.heads, p.spec.kv_lora_rank, p.spec.query_len);
    for i in 0..p.seq_lens.len() {
        let (o1, lse1) = run_alone(&mut dec, &p, i);
        let rows = i * q_len..(i + 1) * q_len;
        let diff = first_difference(&o[rows.start * h * l..rows.end * h * l], &o1);
        prop_assert!(
            diff.is_none(),
            "o of request {}: first difference {:?}",
            i,
            diff
        );
        let diff = first_difference(&lse[rows.start * h..rows.end * h], &lse1);
        prop_assert!(
            diff.is_none(),
            "lse of request {}: first difference {:?}",
            i,
            diff
        );
    }
    Ok(())
}

#[test]
fn a_long_neighbour_does_not_change_a_short_row() {
    // Without batch invariance the 20000-key request would raise the split count for all.
    let mut case = Case::new(spec(40, 16, &[700, 20_000, 3], 2, Mask::Causal));
    case.batch_invariant = true;
    check(&case).unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    #[test]
    fn rows_are_bitwise_independent_of_the_batch(
        heads in 1usize..=70,
        lens in proptest::collection::vec(0usize..3000, 1..4),
        q_len in 1usize..=3,
        page in proptest::sample::select(vec![1usize, 16, 64]),
        window in proptest::option::weighted(0.3, 1usize..1500),
        seed in any::<u64>(),
        kernel in proptest::sample::select(common::cpu_kernels()),
    ) {
        let mut s = spec(heads, page, &lens, q_len, Mask::Causal);
        s.seed = seed;
        let mut case = Case::new(s);
        case.batch_invariant = true;
        case.window = window;
        case.cpu_kernel = kernel;
        check(&case)?;
    }
}
