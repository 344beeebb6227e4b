//! A host view over a longer buffer reads its own elements only: what lies past the view
//! (other requests' lengths, stale values) changes neither the checks, nor the split count,
//! nor a bit of the result.

mod common;

use mla::synth::{Outputs, Problem, ProblemSpec};
use mla::{DecodeInputs, Device, Error, MlaConfig, MlaDecode, TensorRef};

const H: usize = 4;

/// Two requests: a short one, and a long one whose length would take 16 splits.
fn problem() -> Problem {
    let mut s = ProblemSpec::new(H, vec![40, 8192]);
    s.page_size = 16;
    Problem::generate(&s).unwrap()
}

/// A decoder whose split count follows the length (one split per 512 keys, up to 16).
fn decoder() -> MlaDecode {
    let mut cfg = MlaConfig::new(H, 0.1);
    cfg.split_units = Some(8);
    MlaDecode::new(&cfg, Device::Cpu).unwrap()
}

/// (o as f32 bits, lse bits, split count) of one decode of the first request's row.
fn run(
    dec: &mut MlaDecode,
    p: &Problem,
    inputs: &DecodeInputs<'_>,
) -> Result<(Vec<u32>, Vec<u32>, usize), Error> {
    let mut out = Outputs::poisoned_shape(p.spec.model_dtype, [1, H, p.spec.kv_lora_rank]);
    let plan = dec.forward(inputs, &mut out.views().unwrap())?;
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect();
    Ok((bits(&out.o.to_f32()), bits(&out.lse), plan.num_kv_splits))
}

#[test]
fn values_past_a_seq_lens_view_are_never_read() {
    let p = problem();
    let full = p.inputs().unwrap();
    // The first request alone, its length a view of one element: of the problem's lengths
    // (the long one next), or of buffers going on with values that would be refused.
    let alone = common::request_alone(&full, 0);
    let compact = [40];
    let want = run(
        &mut decoder(),
        &p,
        &DecodeInputs {
            seq_lens: TensorRef::contiguous(&compact, [1]).unwrap(),
            ..alone
        },
    )
    .unwrap();
    assert_eq!(want.2, 1);
    assert_eq!(
        run(&mut decoder(), &p, &alone).unwrap(),
        want,
        "next length 8192"
    );
    for tail in [-1, i32::MAX] {
        let buffer = [40, tail];
        let seq_lens = TensorRef::contiguous(&buffer, [2])
            .unwrap()
            .sub_view(0, [1], [1])
            .unwrap();
        let got = run(&mut decoder(), &p, &DecodeInputs { seq_lens, ..alone }).unwrap();
        assert_eq!(got, want, "next length {tail}");
    }
}

#[test]
fn a_locked_workspace_is_measured_by_the_view_not_its_buffer() {
    // Reserved for one row of 600 keys: the first request fits, the buffer's next length
    // (8192 keys, 16 splits) is not this decode's.
    let p = problem();
    let mut dec = decoder();
    dec.reserve_workspace(1, 600).unwrap();
    dec.lock_workspace();
    let full = p.inputs().unwrap();
    run(&mut dec, &p, &common::request_alone(&full, 0)).unwrap();
}
