//! Every argument, value and workspace error, through the public API: the call fails with a
//! message naming the argument and the outputs are left untouched.

mod common;

use half::bf16;
use mla::synth::{Outputs, Problem, ProblemSpec};
use mla::{
    CacheDtype, DecodeInputs, DecodeOutputs, Device, Error, KvFormat, Mask, MlaConfig, MlaDecode,
    ModelDtype, Query, TensorMut, TensorRef,
};

const H: usize = 4;

fn problem(lens: &[usize], q_len: usize) -> Problem {
    let mut s = ProblemSpec::new(H, lens.to_vec());
    s.page_size = 16;
    s.query_len = q_len;
    Problem::generate(&s).unwrap()
}

fn decoder() -> MlaDecode {
    MlaDecode::new(&MlaConfig::new(H, 0.1), Device::Cpu).unwrap()
}

/// An e4m3 problem (k_scale 0.5) of these lengths and a decoder for its cache.
fn fp8(lens: Vec<usize>) -> (Problem, MlaDecode) {
    let s = ProblemSpec::new(H, lens).with_format(ModelDtype::Bf16, KvFormat::Fp8E4m3);
    let mut cfg = MlaConfig::new(H, 0.1);
    cfg.kv_cache_dtype = CacheDtype::Fp8E4m3;
    (
        Problem::generate(&s).unwrap(),
        MlaDecode::new(&cfg, Device::Cpu).unwrap(),
    )
}

/// Runs forward with one input replaced, checks the error and that outputs stayed NaN.
fn expect_err<'a>(
    p: &'a Problem,
    edit: impl FnOnce(&mut DecodeInputs<'a>),
    check: impl FnOnce(&Error),
) {
    expect_err_on(&mut decoder(), p, edit, check);
}

/// [`expect_err`] on a given decoder.
fn expect_err_on<'a>(
    dec: &mut MlaDecode,
    p: &'a Problem,
    edit: impl FnOnce(&mut DecodeInputs<'a>),
    check: impl FnOnce(&Error),
) {
    let mut inputs = p.inputs().unwrap();
    edit(&mut inputs);
    let mut out = Outputs::poisoned(p);
    let e = dec.forward(&inputs, &mut out.views().unwrap()).unwrap_err();
    check(&e);
    assert!(
        out.lse.iter().all(|x| x.is_nan()),
        "lse written despite {e}"
    );
    assert!(
        out.o.to_f32().iter().all(|x| x.is_nan()),
        "o written despite {e}"
    );
}

/// Asserts that a decode that went through computed what the f64 reference does with the
/// same inputs, head by head (an argument it must ignore really was ignored).
fn assert_matches_reference(dec: &MlaDecode, inputs: &DecodeInputs<'_>, o: &[f32], lse: &[f32]) {
    let r = mla::reference::decode_f64(dec.config(), inputs, None).unwrap();
    let worst = common::worst_head(&r, o, lse);
    assert!(
        worst.o_rel <= common::O_TOL && worst.lse_abs <= common::LSE_TOL,
        "worst head {worst:?}"
    );
}

fn message(e: &Error) -> String {
    e.to_string()
}

/// The check of an error that matches a pattern.
macro_rules! is {
    ($p:pat) => {
        |e: &Error| assert!(matches!(e, $p), "{e}")
    };
}

/// The check of an error whose message is exactly `want`.
fn msg(want: impl AsRef<str>) -> impl FnOnce(&Error) {
    move |e| assert_eq!(message(e), want.as_ref())
}

#[test]
fn input_dtypes_are_checked() {
    let p = problem(&[20, 5], 1);
    let f32s = vec![0f32; 2 * H * 576];
    let bytes = vec![0u8; 50 * 16 * 576];
    expect_err(
        &p,
        |i| i.q = Query::Packed(TensorRef::contiguous(&f32s, [2, H, 576]).unwrap()),
        msg("q: expected dtype bf16, got f32"),
    );
    expect_err(
        &p,
        |i| i.kv_cache = TensorRef::contiguous(&bytes, [50, 16, 576]).unwrap(),
        msg("kv_cache: expected dtype bf16 (kv_cache_dtype auto), got u8"),
    );
    expect_err(
        &p,
        |i| i.block_table = TensorRef::contiguous(&f32s, [2, 2]).unwrap(),
        msg("block_table: expected dtype i32, got f32"),
    );
    expect_err(
        &p,
        |i| i.seq_lens = TensorRef::contiguous(&f32s, [2]).unwrap(),
        msg("seq_lens: expected dtype i32, got f32"),
    );
    let q = p.q.view(0, [2, H, 512], [H * 576, 576, 1]).unwrap();
    expect_err(
        &p,
        |i| {
            i.q = Query::Split {
                nope: q,
                rope: TensorRef::from_host(&f32s, [2, H, 64], [H * 576, 576, 1]).unwrap(),
            }
        },
        msg("q_pe: expected dtype bf16, got f32"),
    );
}

#[test]
fn output_dtypes_are_checked() {
    let p = problem(&[20], 1);
    let mut dec = decoder();
    let inputs = p.inputs().unwrap();
    let mut o = vec![0f32; H * 512];
    let mut lse = vec![0f32; H];
    let mut out = DecodeOutputs {
        o: TensorMut::contiguous(&mut o, [1, H, 512]).unwrap(),
        lse: TensorMut::contiguous(&mut lse, [1, H]).unwrap(),
    };
    assert_eq!(
        message(&dec.forward(&inputs, &mut out).unwrap_err()),
        "o: expected dtype bf16, got f32"
    );
    let mut o = vec![bf16::ZERO; H * 512];
    let mut lse = vec![bf16::ZERO; H];
    let mut out = DecodeOutputs {
        o: TensorMut::contiguous(&mut o, [1, H, 512]).unwrap(),
        lse: TensorMut::contiguous(&mut lse, [1, H]).unwrap(),
    };
    assert_eq!(
        message(&dec.forward(&inputs, &mut out).unwrap_err()),
        "lse: expected dtype f32, got bf16"
    );
}

#[test]
fn fp8_caches_accept_fp8_or_bytes_only() {
    let (p, mut dec) = fp8(vec![30]);
    let mut out = Outputs::poisoned(&p);
    // As generated (f8e4m3) and the same bytes as u8 both work.
    let inputs = p.inputs().unwrap();
    dec.forward(&inputs, &mut out.views().unwrap()).unwrap();
    let as_u8 = DecodeInputs {
        kv_cache: inputs.kv_cache.view_as(mla::DType::U8).unwrap(),
        ..inputs
    };
    dec.forward(&as_u8, &mut out.views().unwrap()).unwrap();
    let as_e5m2 = DecodeInputs {
        kv_cache: inputs.kv_cache.view_as(mla::DType::F8E5M2).unwrap(),
        ..inputs
    };
    let e = dec
        .forward(&as_e5m2, &mut out.views().unwrap())
        .unwrap_err();
    assert_eq!(
        message(&e),
        "kv_cache: expected dtype f8e4m3 or u8 (kv_cache_dtype fp8_e4m3), got f8e5m2"
    );
    // k_scale is checked for fp8 caches.
    for bad in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        let e = dec
            .forward(
                &DecodeInputs {
                    k_scale: bad,
                    ..inputs
                },
                &mut out.views().unwrap(),
            )
            .unwrap_err();
        assert!(matches!(e, Error::KScale(_)), "{e}");
    }
}

#[test]
fn k_scale_is_ignored_for_16_bit_caches() {
    let p = problem(&[30], 1);
    let mut out = Outputs::poisoned(&p);
    let inputs = DecodeInputs {
        k_scale: 0.0,
        ..p.inputs().unwrap()
    };
    let mut dec = decoder();
    dec.forward(&inputs, &mut out.views().unwrap()).unwrap();
    assert_matches_reference(&dec, &p.inputs().unwrap(), &out.o.to_f32(), &out.lse);
}

#[test]
fn shapes_are_checked() {
    let p = problem(&[20, 5], 1);
    let wrong_heads = p.q.view(0, [2, H - 1, 576], [H * 576, 576, 1]).unwrap();
    expect_err(
        &p,
        |i| i.q = Query::Packed(wrong_heads),
        msg("q: expected shape [rows, 4, 576], got [2, 3, 576]"),
    );
    let narrow = p.q.view(0, [2, H, 575], [H * 576, 576, 1]).unwrap();
    expect_err(
        &p,
        |i| i.q = Query::Packed(narrow),
        is!(Error::Shape { arg: "q", .. }),
    );
    let nope = p.q.view(0, [2, H, 512], [H * 576, 576, 1]).unwrap();
    let rope_rows = p.q.view(512, [1, H, 64], [H * 576, 576, 1]).unwrap();
    expect_err(
        &p,
        |i| {
            i.q = Query::Split {
                nope,
                rope: rope_rows,
            }
        },
        msg("q_pe: expected shape [2, 4, 64], got [1, 4, 64]"),
    );
    let short_table =
        TensorRef::contiguous(&p.block_table[..p.max_blocks], [1, p.max_blocks]).unwrap();
    expect_err(
        &p,
        |i| i.block_table = short_table,
        msg(format!(
            "block_table: expected shape [2, max_blocks], got [1, {}]",
            p.max_blocks
        )),
    );
    let kv =
        p.kv.view([p.num_blocks, 16, 512], [16 * 576, 576, 1])
            .unwrap();
    expect_err(
        &p,
        |i| i.kv_cache = kv,
        msg(format!(
            "kv_cache: expected shape [num_blocks, page_size, 576], got [{}, 16, 512]",
            p.num_blocks
        )),
    );
    let empty = p.kv.view([0, 16, 576], [16 * 576, 576, 1]).unwrap();
    expect_err(
        &p,
        |i| i.kv_cache = empty,
        |e| assert!(message(e).contains("num_blocks >= 1"), "{e}"),
    );
}

#[test]
fn output_shapes_are_checked() {
    let p = problem(&[20, 5], 1);
    let mut dec = decoder();
    let inputs = p.inputs().unwrap();
    let mut o = vec![bf16::ZERO; 3 * H * 512];
    let mut lse = vec![0f32; 3 * H];
    let mut out = DecodeOutputs {
        o: TensorMut::contiguous(&mut o, [3, H, 512]).unwrap(),
        lse: TensorMut::contiguous(&mut lse, [2, H]).unwrap(),
    };
    let e = dec.forward(&inputs, &mut out).unwrap_err();
    assert_eq!(
        message(&e),
        "o: expected shape [2, 4, 512], got [3, 4, 512]"
    );
    let mut out = DecodeOutputs {
        o: TensorMut::contiguous(&mut o[..2 * H * 512], [2, H, 512]).unwrap(),
        lse: TensorMut::contiguous(&mut lse, [3, H]).unwrap(),
    };
    let e = dec.forward(&inputs, &mut out).unwrap_err();
    assert_eq!(message(&e), "lse: expected shape [2, 4], got [3, 4]");
}

#[test]
fn strides_are_checked() {
    let p = problem(&[20, 5], 1);
    // The last dimension must be contiguous.
    let f = vec![bf16::ZERO; 2 * H * 576 * 2];
    let q2 = TensorRef::from_host(&f, [2, H, 576], [H * 1152, 1152, 2]).unwrap();
    expect_err(
        &p,
        |i| i.q = Query::Packed(q2),
        msg(
            "q: the last dimension must be contiguous (strides [4608, 1152, 2], shape [2, 4, 576])",
        ),
    );
    // Keys of a page overlapping, pages overlapping.
    let kv =
        p.kv.view([p.num_blocks, 16, 576], [16 * 576, 500, 1])
            .unwrap();
    expect_err(
        &p,
        |i| i.kv_cache = kv,
        |e| assert!(message(e).contains("token stride"), "{e}"),
    );
    let kv =
        p.kv.view([p.num_blocks, 16, 576], [15 * 576, 576, 1])
            .unwrap();
    expect_err(
        &p,
        |i| i.kv_cache = kv,
        |e| assert!(message(e).starts_with("kv_cache: pages overlap"), "{e}"),
    );
    // Non-contiguous seq_lens.
    let lens = [20i32, 0, 5, 0];
    let strided = TensorRef::from_host(&lens, [2], [2]).unwrap();
    expect_err(
        &p,
        |i| i.seq_lens = strided,
        is!(Error::Stride {
            arg: "seq_lens",
            ..
        }),
    );
}

#[test]
fn overlapping_outputs_are_refused() {
    let p = problem(&[20, 5], 1);
    let inputs = p.inputs().unwrap();
    let mut dec = decoder();
    let mut o = vec![bf16::ZERO; 2 * H * 512];
    let mut lse = vec![0f32; 2 * H];
    let mut out = DecodeOutputs {
        o: TensorMut::from_host(&mut o, [2, H, 512], [512, 256, 1]).unwrap(),
        lse: TensorMut::contiguous(&mut lse, [2, H]).unwrap(),
    };
    let e = dec.forward(&inputs, &mut out).unwrap_err();
    assert!(
        message(&e).starts_with("o: output rows or heads overlap"),
        "{e}"
    );
    let mut out = DecodeOutputs {
        o: TensorMut::contiguous(&mut o, [2, H, 512]).unwrap(),
        lse: TensorMut::from_host(&mut lse, [2, H], [2, 1]).unwrap(),
    };
    let e = dec.forward(&inputs, &mut out).unwrap_err();
    assert!(message(&e).starts_with("lse: lse rows overlap"), "{e}");
}

#[test]
fn padded_outputs_are_written_in_place() {
    // o rows padded to 3000 elements and heads to 600: only the views' elements change.
    let p = problem(&[40, 17], 1);
    let mut dec = decoder();
    let mut o = vec![bf16::from_f32(7.0); 2 * 3000];
    let mut lse = vec![7f32; 2 * 9];
    let mut out = DecodeOutputs {
        o: TensorMut::from_host(&mut o, [2, H, 512], [3000, 600, 1]).unwrap(),
        lse: TensorMut::from_host(&mut lse, [2, H], [9, 1]).unwrap(),
    };
    dec.forward(&p.inputs().unwrap(), &mut out).unwrap();
    let mut dense = Outputs::poisoned(&p);
    decoder()
        .forward(&p.inputs().unwrap(), &mut dense.views().unwrap())
        .unwrap();
    let dense_o = dense.o.to_f32();
    for row in 0..2 {
        for h in 0..H {
            for c in 0..512 {
                assert_eq!(
                    o[row * 3000 + h * 600 + c].to_f32(),
                    dense_o[(row * H + h) * 512 + c]
                );
            }
            assert_eq!(o[row * 3000 + h * 600 + 512].to_f32(), 7.0, "padding kept");
            assert_eq!(lse[row * 9 + h], dense.lse[row * H + h]);
        }
        assert_eq!(lse[row * 9 + H], 7.0);
    }
}

#[test]
fn non_uniform_batches_are_refused() {
    // 4 query rows (from a 2 x 2-token problem) over 3 requests.
    let rows4 = problem(&[20, 5], 2);
    let three = problem(&[20, 5, 9], 1);
    let inputs = DecodeInputs {
        q: rows4.query().unwrap(),
        ..three.inputs().unwrap()
    };
    let mut out = Outputs::poisoned(&rows4);
    let e = decoder()
        .forward(&inputs, &mut out.views().unwrap())
        .unwrap_err();
    assert_eq!(
        message(&e),
        "non-uniform decode block: 4 query rows over 3 requests"
    );
    assert!(out.lse.iter().all(|x| x.is_nan()));
}

#[test]
fn query_len_must_match_the_rows() {
    let p = problem(&[20, 5], 2);
    expect_err(
        &p,
        |i| i.query_len = 1,
        msg("query_len: expected 2 (4 query rows over 2 requests), got 1"),
    );
    expect_err(
        &p,
        |i| i.query_len = 0,
        is!(Error::InvalidConfig {
            field: "query_len",
            ..
        }),
    );
}

#[test]
fn causal_multi_token_with_dcp_is_refused() {
    let p = problem(&[20, 5], 2);
    let mut cfg = MlaConfig::new(H / 2, 0.1);
    cfg.dcp_world_size = 2;
    let mut dec = MlaDecode::new(&cfg, Device::Cpu).unwrap();
    let mut out = Outputs::poisoned(&p);
    let e = dec
        .forward(&p.inputs().unwrap(), &mut out.views().unwrap())
        .unwrap_err();
    assert_eq!(
        message(&e),
        "causal multi-token decode is not supported with DCP"
    );
    // A non-causal draft block is fine with DCP (every row sees the local sequence).
    let inputs = DecodeInputs {
        mask: Mask::NonCausal,
        ..p.inputs().unwrap()
    };
    dec.forward(&inputs, &mut out.views().unwrap()).unwrap();
}

#[test]
fn negative_and_too_long_lengths_are_refused() {
    let p = problem(&[20, 5], 1);
    let neg = [20i32, -1];
    expect_err(
        &p,
        |i| i.seq_lens = TensorRef::contiguous(&neg, [2]).unwrap(),
        msg("seq_lens[1]: expected a length >= 0, got -1"),
    );
    let capacity = p.max_blocks * 16;
    let long = [20i32, capacity as i32 + 1];
    expect_err(
        &p,
        |i| i.seq_lens = TensorRef::contiguous(&long, [2]).unwrap(),
        msg(format!(
            "seq_lens[1] = {} exceeds the block table's capacity of {capacity} keys ({} blocks of 16)",
            capacity + 1,
            p.max_blocks
        )),
    );
}

#[test]
fn block_ids_outside_the_cache_are_refused() {
    let p = problem(&[40, 5], 1);
    for bad in [-1, p.num_blocks as i32, i32::MAX] {
        let mut table = p.block_table.clone();
        table[1] = bad; // request 0, block 1 (keys 16..32)
        expect_err(
            &p,
            |i| i.block_table = TensorRef::contiguous(&table, [2, p.max_blocks]).unwrap(),
            msg(format!(
                "block_table[0][1] = {bad} is outside the kv cache's {} blocks",
                p.num_blocks
            )),
        );
    }
}

#[test]
fn unread_block_table_entries_may_hold_anything() {
    // Entries past a request's length, or before its window, are never read.
    let p = problem(&[16, 40], 1);
    let mut table = p.block_table.clone();
    table[1] = -7; // request 0 has 16 keys: one block
    table[p.max_blocks] = 99_999; // request 1's first block: outside a 20-key window
    let mut cfg = MlaConfig::new(H, 0.1);
    cfg.sliding_window = Some(20);
    let mut dec = MlaDecode::new(&cfg, Device::Cpu).unwrap();
    let inputs = DecodeInputs {
        block_table: TensorRef::contiguous(&table, [2, p.max_blocks]).unwrap(),
        ..p.inputs().unwrap()
    };
    let mut out = Outputs::poisoned(&p);
    dec.forward(&inputs, &mut out.views().unwrap()).unwrap();
    assert_matches_reference(&dec, &inputs, &out.o.to_f32(), &out.lse);
}

#[test]
fn views_must_fit_their_slices() {
    let v = vec![bf16::ZERO; 100];
    let e = TensorRef::contiguous(&v, [2, 4, 576]).unwrap_err();
    assert!(matches!(e, Error::Memory { .. }));
    assert!(
        message(&e).contains("spans 4608 elements but the slice holds 100"),
        "{e}"
    );
}

#[test]
fn a_locked_workspace_refuses_to_grow() {
    let p = problem(&[20, 5], 1);
    let mut dec = decoder();
    dec.reserve_workspace(1, 100).unwrap(); // one row, one split; the batch has two rows
    dec.lock_workspace();
    let before = dec.workspace_bytes();
    let mut out = Outputs::poisoned(&p);
    let e = dec
        .forward(&p.inputs().unwrap(), &mut out.views().unwrap())
        .unwrap_err();
    assert!(matches!(e, Error::WorkspaceLocked { .. }), "{e}");
    assert!(
        message(&e).starts_with("workspace is locked but this decode requires"),
        "{e}"
    );
    assert_eq!(dec.workspace_bytes(), before);
    assert!(out.lse.iter().all(|x| x.is_nan()));
    // Reserving more after the lock is refused too; within the reservation decodes run.
    assert!(dec.reserve_workspace(8, 1024).is_err());
    let p1 = problem(&[700], 1);
    let mut out = Outputs::poisoned(&p1);
    dec.forward(&p1.inputs().unwrap(), &mut out.views().unwrap())
        .unwrap();
}

#[test]
fn an_impossible_reservation_is_an_error_not_an_abort() {
    let mut dec = decoder();
    let e = dec.reserve_workspace(1 << 30, 1 << 20).unwrap_err();
    assert!(
        matches!(e, Error::Alloc { .. } | Error::Overflow { .. }),
        "{e}"
    );
    assert_eq!(
        dec.workspace_bytes(),
        0,
        "a refused reservation changes nothing"
    );
    let e = dec.reserve_workspace(usize::MAX, 1 << 20).unwrap_err();
    assert!(matches!(e, Error::Overflow { .. }), "{e}");
    dec.reserve_workspace(2, 100).unwrap();
}

#[test]
fn the_reservation_covers_every_decode_up_to_its_limits() {
    // Reserve for 4 rows and 8192 keys, lock, then decode the worst case and smaller ones.
    let mut dec = decoder();
    dec.reserve_workspace(4, 8192).unwrap();
    dec.lock_workspace();
    for (lens, q_len) in [
        (vec![8192, 8192, 8192, 8192], 1),
        (vec![8192, 3], 2),
        (vec![1], 4),
        (vec![], 1),
    ] {
        let p = problem(&lens, q_len);
        let mut out = Outputs::poisoned(&p);
        dec.forward(&p.inputs().unwrap(), &mut out.views().unwrap())
            .unwrap();
    }
}

#[test]
fn warmup_needs_a_reservation_and_the_configured_cache() {
    let p = problem(&[20], 1);
    let mut dec = decoder();
    let kv = p.inputs().unwrap().kv_cache;
    let e = dec
        .register_decode_warmup(&kv, CacheDtype::Auto)
        .unwrap_err();
    assert_eq!(
        message(&e),
        "register_decode_warmup needs max_model_len: call reserve_workspace first"
    );
    dec.reserve_workspace(8, 1 << 17).unwrap();
    let set = dec.register_decode_warmup(&kv, CacheDtype::Bf16).unwrap();
    let max = dec.num_kv_splits(1 << 17, 1, 1, kv.shape()[1]);
    assert_eq!(set.last(), Some(&max));
    assert_eq!(set[0], 1);
    let e = dec
        .register_decode_warmup(&kv, CacheDtype::Fp8E4m3)
        .unwrap_err();
    assert!(matches!(e, Error::CacheDtypeMismatch { .. }), "{e}");
    // The cache checks of a decode: pages that overlap (a token stride shorter than a row).
    let [blocks, page, d] = kv.shape();
    let overlapping = kv
        .sub_view(0, [blocks, page, d], [page * d, d - 1, 1])
        .unwrap();
    let e = dec
        .register_decode_warmup(&overlapping, CacheDtype::Bf16)
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::Stride {
                arg: "kv_cache",
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn a_cuda_decoder_decodes_on_a_gpu_or_is_a_clear_error() {
    let opened = match MlaDecode::new(&MlaConfig::new(H, 0.1), Device::Cuda(0)) {
        Err(e) => {
            assert!(
                matches!(e, Error::CudaNotCompiled | Error::NoCudaDevice(_)),
                "{e}"
            );
            false
        }
        Ok(mut dec) => {
            // A usable GPU: the decoder is the CUDA one, refuses host tensors, and decodes
            // device ones as the reference does.
            assert_eq!(dec.backend_name(), "cuda");
            let p = problem(&[20, 5], 1);
            expect_err_on(&mut dec, &p, |_| {}, is!(Error::WrongDevice { .. }));
            #[cfg(feature = "cuda")]
            {
                use common::gpu::{DeviceOutputs, stream};
                let s = stream(&dec);
                let dp = p.to_device(&s).unwrap();
                let mut out = DeviceOutputs::poisoned(&s, &p).unwrap();
                dec.forward(&dp.inputs(&p, false).unwrap(), &mut out.views().unwrap())
                    .unwrap();
                let (o, lse) = out.download(&s).unwrap();
                assert_matches_reference(&dec, &p.inputs().unwrap(), &o, &lse);
            }
            true
        }
    };
    // Auto takes the GPU where one opens, else falls back to the CPU.
    let dec = MlaDecode::new(&MlaConfig::new(H, 0.1), Device::Auto).unwrap();
    assert_eq!(dec.backend_name(), if opened { "cuda" } else { "cpu" });
}

#[test]
fn config_errors_surface_from_the_constructor() {
    let mut cfg = MlaConfig::new(H, 0.1);
    cfg.logits_soft_cap = Some(50.0);
    let e = MlaDecode::new(&cfg, Device::Cpu).unwrap_err();
    assert_eq!(
        message(&e),
        "mla does not support one of the following: alibi_slopes, logits_soft_cap"
    );
    let e = "fp8_ds_mla".parse::<CacheDtype>().map(|d| {
        let mut c = MlaConfig::new(H, 0.1);
        c.kv_cache_dtype = d;
        MlaDecode::new(&c, Device::Cpu)
    });
    assert!(matches!(
        e,
        Ok(Err(Error::CacheDtypeNotSupportedYet { .. }))
    ));
}

/// An e4m3 problem (k_scale 0.5, q_scale 1/64) and a decoder in the fp8-query mode.
fn fp8_query(lens: Vec<usize>) -> (Problem, MlaDecode) {
    let s = ProblemSpec::new(H, lens).with_format(ModelDtype::Bf16, KvFormat::Fp8E4m3);
    let mut cfg = MlaConfig::new(H, 0.1);
    cfg.kv_cache_dtype = CacheDtype::Fp8E4m3;
    cfg.fp8_query = true;
    (
        Problem::generate(&s).unwrap(),
        MlaDecode::new(&cfg, Device::Cpu).unwrap(),
    )
}

#[test]
fn the_fp8_query_mode_needs_an_fp8_cache() {
    for (cache, named) in [
        (CacheDtype::Auto, "auto (the model dtype, bfloat16)"),
        (CacheDtype::Bf16, "bfloat16"),
        (CacheDtype::F16, "float16"),
    ] {
        let mut cfg = MlaConfig::new(H, 0.1);
        cfg.kv_cache_dtype = cache;
        cfg.fp8_query = true;
        let e = MlaDecode::new(&cfg, Device::Cpu).unwrap_err();
        assert_eq!(
            message(&e),
            format!(
                "fp8_query: the fp8-query mode needs an fp8 kv cache (fp8, fp8_e4m3 or \
                 fp8_e5m2), got {named}"
            )
        );
    }
}

#[test]
fn q_scale_is_checked_in_the_fp8_query_mode_only() {
    let (p, mut dec) = fp8_query(vec![70, 33]);
    for bad in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        expect_err_on(&mut dec, &p, |i| i.q_scale = bad, is!(Error::QScale(_)));
    }
    let e = {
        let mut i = p.inputs().unwrap();
        i.q_scale = -2.0;
        let mut out = Outputs::poisoned(&p);
        dec.forward(&i, &mut out.views().unwrap()).unwrap_err()
    };
    assert_eq!(message(&e), "q_scale: expected a finite value > 0, got -2");
    // Outside the mode it is not read.
    let (p, mut plain) = fp8(vec![70, 33]);
    let mut out = Outputs::poisoned(&p);
    let inputs = DecodeInputs {
        q_scale: f32::NAN,
        ..p.inputs().unwrap()
    };
    plain.forward(&inputs, &mut out.views().unwrap()).unwrap();
    assert_matches_reference(&plain, &p.inputs().unwrap(), &out.o.to_f32(), &out.lse);
}

/// A per-tensor scale of the inputs.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Scale {
    /// An fp8 cache's k_scale.
    K,
    /// The fp8-query mode's q_scale.
    Q,
}

impl Scale {
    /// A problem of these lengths and a decoder that reads this scale.
    fn decoder(self, lens: Vec<usize>) -> (Problem, MlaDecode) {
        match self {
            Scale::K => fp8(lens),
            Scale::Q => fp8_query(lens),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Scale::K => "k_scale",
            Scale::Q => "q_scale",
        }
    }

    /// The problem's value of the scale.
    fn of(self, p: &Problem) -> f32 {
        match self {
            Scale::K => p.spec.k_scale,
            Scale::Q => p.spec.q_scale,
        }
    }

    fn set<'a>(self, i: &mut DecodeInputs<'a>, value: f32, tensor: Option<TensorRef<'a, 1>>) {
        match self {
            Scale::K => (i.k_scale, i.k_scale_tensor) = (value, tensor),
            Scale::Q => (i.q_scale, i.q_scale_tensor) = (value, tensor),
        }
    }

    fn is_its_error(self, e: &Error) -> bool {
        match self {
            Scale::K => matches!(e, Error::KScale(_)),
            Scale::Q => matches!(e, Error::QScale(_)),
        }
    }
}

/// A one-element tensor of the scale replaces its value (the same outputs as the value, other
/// outputs for another scale), and is checked like the value, and for dtype and shape.
fn a_scale_tensor_replaces_the_value_and_is_checked(scale: Scale) {
    let (bad, two, ints) = ([f32::NAN], [0.5f32, 0.5], [1i32]);
    let (p, mut dec) = scale.decoder(vec![70, 33]);
    let run = |dec: &mut MlaDecode, value: f32, tensor: Option<&[f32]>| {
        let mut inputs = p.inputs().unwrap();
        scale.set(
            &mut inputs,
            value,
            tensor.map(|t| TensorRef::contiguous(t, [1]).unwrap()),
        );
        let mut out = Outputs::poisoned(&p);
        dec.forward(&inputs, &mut out.views().unwrap()).unwrap();
        (out.o.to_f32(), out.lse)
    };
    let value = scale.of(&p);
    let by_value = run(&mut dec, value, None);
    let by_tensor = run(&mut dec, 7.0, Some(&[value])); // 7: ignored
    assert_eq!(by_value, by_tensor, "{scale:?}");
    assert_ne!(by_value.0, run(&mut dec, 4.0 * value, None).0, "{scale:?}");
    expect_err_on(
        &mut dec,
        &p,
        |i| scale.set(i, value, Some(TensorRef::contiguous(&bad, [1]).unwrap())),
        |e| assert!(scale.is_its_error(e), "{e}"),
    );
    let name = scale.name();
    expect_err_on(
        &mut dec,
        &p,
        |i| scale.set(i, value, Some(TensorRef::contiguous(&two, [2]).unwrap())),
        msg(format!("{name}: expected shape [1], got [2]")),
    );
    expect_err_on(
        &mut dec,
        &p,
        |i| scale.set(i, value, Some(TensorRef::contiguous(&ints, [1]).unwrap())),
        msg(format!("{name}: expected dtype f32, got i32")),
    );
}

#[test]
fn a_k_scale_tensor_replaces_the_value_and_is_checked() {
    a_scale_tensor_replaces_the_value_and_is_checked(Scale::K);
}

#[test]
fn a_q_scale_tensor_replaces_the_value_and_is_checked() {
    a_scale_tensor_replaces_the_value_and_is_checked(Scale::Q);
}

#[test]
fn split_units_are_bounded_where_the_split_rules_cannot_overflow() {
    for (units, ok) in [(1 << 16, true), ((1 << 16) + 1, false), (usize::MAX, false)] {
        let mut cfg = MlaConfig::new(H, 0.1);
        cfg.split_units = Some(units);
        match MlaDecode::new(&cfg, Device::Cpu) {
            Ok(mut dec) => {
                assert!(ok, "split_units {units} accepted");
                // The largest accepted count decodes (vLLM's rule: 2 x units, then the
                // lengths decide).
                let p = problem(&[2000, 5], 1);
                let mut out = Outputs::poisoned(&p);
                let inputs = p.inputs().unwrap();
                dec.forward(&inputs, &mut out.views().unwrap()).unwrap();
                let r = mla::reference::decode_f64(dec.config(), &inputs, None).unwrap();
                common::assert_accurate(
                    &common::Case::new(p.spec.clone()),
                    r.accuracy(&out.o.to_f32(), &out.lse),
                );
            }
            Err(e) => {
                assert!(!ok, "split_units {units} refused: {e}");
                assert_eq!(
                    message(&e),
                    format!("split_units: expected at most 65536, got {units}")
                );
            }
        }
    }
}

#[test]
fn scales_the_kernels_cannot_compute_with_are_refused() {
    for scale in [3e38, 1024.5, f32::INFINITY, 0.0, -0.1] {
        let e = MlaDecode::new(&MlaConfig::new(H, scale), Device::Cpu).unwrap_err();
        assert_eq!(
            message(&e),
            format!("scale: expected a finite value in (0, 1024], got {scale}")
        );
    }
    // The largest accepted scale computes what the f64 reference does.
    let p = problem(&[300, 17], 1);
    let mut dec = MlaDecode::new(&MlaConfig::new(H, 1024.0), Device::Cpu).unwrap();
    let inputs = p.inputs().unwrap();
    let mut out = Outputs::poisoned(&p);
    dec.forward(&inputs, &mut out.views().unwrap()).unwrap();
    let r = mla::reference::decode_f64(dec.config(), &inputs, None).unwrap();
    let a = r.accuracy(&out.o.to_f32(), &out.lse);
    // Scores of about 1e4: the LSE keeps f32's relative precision over a 576-term dot.
    let largest = r.lse.iter().fold(0f64, |m, x| m.max(x.abs()));
    assert!(
        a.o_rel <= common::O_TOL && a.lse_abs <= 1e-5 * largest,
        "{a:?} (largest lse {largest})"
    );
}
