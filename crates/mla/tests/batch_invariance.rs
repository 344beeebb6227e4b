//! Batch-invariant mode: a row decoded alone and the same row inside a batch give bitwise the
//! same o and lse, whatever the other requests' lengths.

mod common;

use common::{Case, spec};
use mla::synth::{Outputs, Problem};
use mla::{DecodeInputs, Device, Mask, MlaDecode, Query, TensorRef};
use proptest::prelude::*;

/// Runs request `i` of a problem alone: same q rows, cache, block-table row and length.
fn run_alone(dec: &mut MlaDecode, p: &Problem, i: usize) -> (Vec<f32>, Vec<f32>) {
    let (h, d, q_len) = (p.spec.heads, p.head_dim(), p.spec.query_len);
    let full = p.inputs().unwrap();
    let inputs = DecodeInputs {
        q: Query::Packed(
            p.q.view(i * q_len * h * d, [q_len, h, d], [h * d, d, 1])
                .unwrap(),
        ),
        block_table: TensorRef::contiguous(
            &p.block_table[i * p.max_blocks..(i + 1) * p.max_blocks],
            [1, p.max_blocks],
        )
        .unwrap(),
        seq_lens: TensorRef::contiguous(&p.seq_lens[i..i + 1], [1]).unwrap(),
        ..full
    };
    let mut alone = Problem {
        spec: p.spec.clone(),
        ..p.clone()
    };
    alone.spec.seq_lens = vec![p.spec.seq_lens[i]];
    let mut out = Outputs::poisoned(&alone);
    dec.forward(&inputs, &mut out.views().unwrap()).unwrap();
    (out.o.to_f32(), out.lse)
}

/// (index, batch value, alone value, values that differ) of the first bitwise difference.
fn first_difference(a: &[f32], b: &[f32]) -> Option<(usize, f32, f32, usize)> {
    assert_eq!(a.len(), b.len());
    let differ = |(x, y): (&f32, &f32)| x.to_bits() != y.to_bits();
    let count = a.iter().zip(b).filter(|&p| differ(p)).count();
    let i = a.iter().zip(b).position(differ)?;
    Some((i, a[i], b[i], count))
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
    ) {
        let mut s = spec(heads, page, &lens, q_len, Mask::Causal);
        s.seed = seed;
        let mut case = Case::new(s);
        case.batch_invariant = true;
        case.window = window;
        check(&case)?;
    }
}
