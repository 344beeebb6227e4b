//! The CUDA backend against the CPU backend and the f64 reference, over every feature and
//! dtype, with outputs poisoned before each run. Skips (saying why) without a GPU.
#![cfg(feature = "cuda")]

mod common;

use common::gpu::{self, DeviceOutputs};
use common::{Case, spec};
use mla::synth::Problem;
use mla::{KvFormat, Mask, ModelDtype};
use proptest::prelude::*;

fn check(case: &Case) {
    if let Some(run) = gpu::run_case(case) {
        gpu::assert_close(case, &run);
    }
}

#[test]
fn every_cache_format_and_model_dtype() {
    for (model, kv) in common::formats() {
        let s = spec(16, 64, &[700, 1500, 33, 0], 1, Mask::Causal).with_format(model, kv);
        check(&Case::new(s));
    }
}

#[test]
fn head_counts_and_page_sizes() {
    // 16, 32, 64, 128 heads and odd counts (padded tiles); pages of 1, 16, 64 and odd sizes.
    for (heads, page) in [
        (16, 1),
        (32, 16),
        (64, 64),
        (128, 33),
        (7, 64),
        (20, 3),
        (100, 16),
        (1, 7),
    ] {
        check(&Case::new(spec(
            heads,
            page,
            &[1000, 257, 1, 4100],
            1,
            Mask::Causal,
        )));
    }
}

#[test]
fn multi_token_rows_causal_and_not() {
    for mask in [Mask::Causal, Mask::NonCausal] {
        for q_len in [2, 3, 4] {
            check(&Case::new(spec(
                16,
                16,
                &[2, 1, 0, 900, 77, 3000],
                q_len,
                mask,
            )));
        }
    }
}

#[test]
fn multi_token_rows_of_few_heads_on_long_splits() {
    // On Hopper the seesaw kernel's packed variant takes these (splits of at least 1024 keys,
    // tokens x heads in its 64 rows; 16 x 4 fills them): each token's split edges its own,
    // the edges inside a tile, the last row's tokens seeing one split or none.
    use KvFormat::{Bf16, F16};
    for (heads, q_len, model, kv, splits) in [
        (16, 2, ModelDtype::Bf16, Bf16, 2),
        (16, 4, ModelDtype::F16, F16, 3),
        (32, 2, ModelDtype::Bf16, Bf16, 1),
        (20, 3, ModelDtype::Bf16, Bf16, 2),
        (8, 4, ModelDtype::Bf16, Bf16, 2),
        (4, 16, ModelDtype::F16, F16, 1),
    ] {
        let s = spec(heads, 64, &[5003, 4097, 2900, 2], q_len, Mask::Causal).with_format(model, kv);
        let mut case = Case::new(s);
        case.fixed_splits = Some(splits);
        check(&case);
    }
}

#[test]
fn sliding_windows() {
    for (w, q_len) in [(1, 1), (64, 1), (100, 3), (5000, 2), (31, 4)] {
        let mut case = Case::new(spec(32, 64, &[1000, 10, 0, 2570], q_len, Mask::Causal));
        case.window = Some(w);
        check(&case);
    }
}

#[test]
fn few_heads_on_every_page_size_the_narrow_kernel_tiles() {
    // Hopper's narrow kernel (up to 16 rows, a cache in the model dtype or fp8; as shipped it
    // takes the multi-token rows of up to 8 heads, with MLA_KERNEL=narrow single tokens of up
    // to 16 too): pages of 8 to 256 keys, split starts inside a tile (lengths that do not
    // divide), windows, tokens packed (8 heads x 2, 4 x 4, 3 x 5, 1 x 12), fp8 with a scale,
    // padded strides and a split query. Elsewhere these run on the mma kernel and must match
    // all the same.
    use KvFormat::{Bf16, F16, Fp8E4m3, Fp8E5m2};
    for (heads, page, q_len, window, model, kv) in [
        (8, 8, 2, None, ModelDtype::Bf16, Bf16),
        (4, 16, 4, Some(1000), ModelDtype::F16, F16),
        (8, 32, 2, None, ModelDtype::Bf16, Bf16),
        (3, 128, 5, Some(65), ModelDtype::Bf16, Bf16),
        (8, 256, 2, None, ModelDtype::F16, F16),
        (1, 64, 12, None, ModelDtype::Bf16, Bf16),
        (16, 64, 1, Some(300), ModelDtype::Bf16, Bf16),
        (16, 16, 1, None, ModelDtype::F16, F16),
        (8, 64, 2, None, ModelDtype::Bf16, Fp8E4m3),
        (4, 16, 4, Some(700), ModelDtype::F16, Fp8E5m2),
        (16, 32, 1, None, ModelDtype::Bf16, Fp8E4m3),
    ] {
        let mut s = spec(heads, page, &[4097, 1, 0, 777, 20_000], q_len, Mask::Causal)
            .with_format(model, kv);
        // Rows padded to a multiple of 16 bytes (8 elements of 16 bits, 16 of fp8).
        s.token_pad = if kv.is_fp8() { 16 } else { 8 };
        s.page_pad = 64;
        if kv.is_fp8() {
            s.k_scale = 0.5;
        }
        let mut case = Case::new(s);
        case.window = window;
        case.split_q = heads == 8;
        check(&case);
        // The same with many splits: tiles cut at both ends of every split.
        case.fixed_splits = Some(37);
        check(&case);
    }
}

#[test]
fn split_query_and_padded_strides() {
    let mut s = spec(64, 16, &[300, 2301], 2, Mask::NonCausal);
    s.token_pad = 8; // 16-byte aligned rows, padded
    s.page_pad = 64;
    let mut case = Case::new(s);
    case.split_q = true;
    check(&case);
    let mut s = spec(16, 64, &[300, 2301], 1, Mask::Causal);
    s.kv_format = KvFormat::Fp8E4m3;
    s.k_scale = 0.25;
    s.token_pad = 16;
    s.page_pad = 32;
    check(&Case::new(s));
}

#[test]
fn many_splits_and_long_contexts() {
    // 64k keys: the largest split count the rule gives on an H200 at this length (128).
    for (heads, kv) in [
        (16, KvFormat::Bf16),
        (128, KvFormat::Bf16),
        (16, KvFormat::Fp8E4m3),
    ] {
        let s = spec(heads, 64, &[65_536, 5, 17_000], 1, Mask::Causal)
            .with_format(ModelDtype::Bf16, kv);
        check(&Case::new(s));
    }
}

#[test]
fn the_combine_on_each_of_its_launch_shapes() {
    // The combine takes 1, 2, 4 or 8 warps a head (backend/cuda/combine.rs: 16 splits a warp
    // at once, more in turns; fewer warps where the rows fill the GPU) and 8, 4, 2 or 1 heads
    // a CTA, the last CTA padded when the heads do not divide; empty splits (short rows) sit
    // among full ones.
    for heads in [5, 17, 128] {
        for splits in [2, 17, 33, 100, 300] {
            let s = spec(heads, 16, &[3000, 40, 0, 1500], 1, Mask::Causal);
            let mut case = Case::new(s);
            case.fixed_splits = Some(splits);
            check(&case);
        }
    }
}

#[test]
fn other_latent_widths() {
    // fp8 too: the mma kernel's products permute the columns in groups (of 64, then the 32
    // and 16 left: 288, 144 and 432 columns here; 8 or 4 n-tiles of the value columns a
    // warp), which the widths other than 512 + 64 cut differently.
    for (l, r) in [(256, 32), (128, 16), (512, 0), (384, 48)] {
        for kv in [KvFormat::Bf16, KvFormat::Fp8E4m3, KvFormat::Fp8E5m2] {
            let mut s =
                spec(24, 16, &[90, 1031], 1, Mask::Causal).with_format(ModelDtype::Bf16, kv);
            s.kv_lora_rank = l;
            s.rope_dim = r;
            if kv.is_fp8() {
                s.k_scale = 0.75;
            }
            check(&Case::new(s));
        }
    }
}

#[test]
fn batch_invariant_rows_are_bitwise_independent_of_the_batch() {
    let mut case = Case::new(spec(128, 64, &[700, 20_000, 3, 0], 2, Mask::Causal));
    case.batch_invariant = true;
    let Some(mut dec) = gpu::open(&case.config()) else {
        return;
    };
    let full = gpu::run_case_on(&mut dec, &case);
    gpu::assert_close(&case, &full);
    assert_eq!(full.plan.num_kv_splits, 1);

    let s = gpu::stream(&dec);
    let p = Problem::generate(&case.spec).unwrap();
    let dp = p.to_device(&s).unwrap();
    let (h, l, q_len) = (p.spec.heads, p.spec.kv_lora_rank, p.spec.query_len);
    let all = dp.inputs(&p, false).unwrap();
    for i in 0..p.seq_lens.len() {
        // Request i alone: its q rows, its block-table row, its length, the same cache.
        let inputs = common::request_alone(&all, i);
        let mut out = DeviceOutputs::with_shape(&s, ModelDtype::Bf16, [q_len, h, l]).unwrap();
        dec.forward(&inputs, &mut out.views().unwrap()).unwrap();
        dec.check_device_errors().unwrap();
        let (o1, lse1) = out.download(&s).unwrap();
        let r = i * q_len;
        let diff = common::first_difference(&full.o[r * h * l..(r + q_len) * h * l], &o1);
        assert!(diff.is_none(), "o of request {i} differs alone: {diff:?}");
        let diff = common::first_difference(&full.lse[r * h..(r + q_len) * h], &lse1);
        assert!(diff.is_none(), "lse of request {i} differs alone: {diff:?}");
    }
}

#[test]
fn query_rows_that_see_nothing_get_zero_and_minus_infinity() {
    for splits_forced in [false, true] {
        let mut case = Case::new(spec(16, 16, &[0, 5, 0, 3000], 2, Mask::Causal));
        if !splits_forced {
            case.batch_invariant = true; // single split: stage 1 writes o and lse directly
        }
        let Some(run) = gpu::run_case(&case) else {
            return;
        };
        gpu::assert_close(&case, &run);
        let (h, l) = (16, 512);
        for row in [0, 1, 4, 5] {
            assert!(
                run.lse[row * h..(row + 1) * h]
                    .iter()
                    .all(|&x| x == f32::NEG_INFINITY),
                "row {row}"
            );
            assert!(
                run.o[row * h * l..(row + 1) * h * l]
                    .iter()
                    .all(|&x| x == 0.0),
                "row {row}"
            );
        }
    }
}

#[test]
fn the_fp8_query_mode_on_each_kernel() {
    // 16 heads: the mma kernel (the narrow kernel has no fp8-query mode); 16 heads x 4 causal
    // tokens: the packed wgmma kernel on sm_90a; 128 heads: wgmma (mma below sm_90a). Each
    // with e4m3 and e5m2 caches, bf16 and f16 models, two q scales; MLA_SCHEDULE=1 and
    // MLA_KERNEL=mma (scripts/gpu/run.sh) take the scheduled and the mma variants through it.
    for (heads, q_len) in [(16, 1), (16, 4), (128, 1)] {
        for (model, kv) in [
            (ModelDtype::Bf16, KvFormat::Fp8E4m3),
            (ModelDtype::F16, KvFormat::Fp8E4m3),
            (ModelDtype::Bf16, KvFormat::Fp8E5m2),
        ] {
            for q_scale in [1.0 / 64.0, 0.3] {
                // Long rows: against the reference with the mode's tolerances (P rounds at
                // each kernel's tile maxima, the CPU backend's at its own: assert_close).
                let mut s = spec(heads, 64, &[3000, 700, 33, 0], q_len, Mask::Causal)
                    .with_format(model, kv);
                s.q_scale = q_scale;
                let mut case = Case::new(s.clone());
                case.fp8_query = true;
                check(&case);
                // Rows of one tile of every kernel (32 keys), one split: P rounds at the
                // row's maximum on both backends, whose o then agree as closely as without
                // the mode (a wrong scale, a P not rounded to e4m3 or not scaled first
                // shows), and their LSE within the fp8 wgmma sums' error.
                s.seq_lens = vec![32, 9, 1, 20 + q_len];
                let mut short = Case::new(s);
                short.fp8_query = true;
                short.fixed_splits = Some(1);
                if let Some(run) = gpu::run_case(&short) {
                    gpu::assert_close(&short, &run);
                    let a = run.vs_cpu;
                    // The record of what the hardware's fp8 sums do (cpu_lse_tolerance).
                    eprintln!(
                        "fp8 query, one tile, {heads} heads x {q_len}, {model:?} {kv:?}, q_scale {q_scale}: against the cpu backend {a:?}"
                    );
                    assert!(
                        a.o_rel <= common::O_TOL && a.lse_abs <= short.cpu_lse_tolerance(),
                        "{heads} heads x {q_len}, {model:?} {kv:?}, q_scale {q_scale}: {a:?}"
                    );
                }
            }
        }
    }
}

fn gpu_formats() -> impl Strategy<Value = (ModelDtype, KvFormat)> {
    proptest::sample::select(common::formats())
}

prop_compose! {
    fn any_gpu_case()(
        heads in proptest::sample::select(vec![1usize, 5, 16, 17, 32, 48, 64, 100, 128]),
        requests in 1usize..=5,
        q_len in 1usize..=4,
        page in proptest::sample::select(vec![1usize, 3, 16, 33, 64]),
        (model, kv) in gpu_formats(),
        causal in any::<bool>(),
        window in proptest::option::weighted(0.3, 1usize..3000),
        batch_invariant in proptest::bool::weighted(0.2),
        split_q in any::<bool>(),
        fixed_splits in proptest::option::weighted(0.2, 1usize..=80),
        fp8_query in proptest::bool::weighted(0.3),
        len_draws in proptest::collection::vec(0.0f64..1.0, 5),
        seed in any::<u64>(),
    ) -> Case {
        let max_len = (4_000_000 / (heads * requests * q_len)).clamp(1, 9000);
        let lens: Vec<usize> = len_draws[..requests].iter().map(|u| (u * max_len as f64) as usize).collect();
        let mut s = spec(heads, page, &lens, q_len, if causal { Mask::Causal } else { Mask::NonCausal }).with_format(model, kv);
        s.seed = seed;
        // A fixed count above 1 contradicts batch-invariant mode (a config error).
        let fixed_splits = fixed_splits.filter(|_| !batch_invariant);
        // The fp8-query mode needs an fp8 cache.
        let fp8_query = fp8_query && kv.is_fp8();
        Case { spec: s, window, batch_invariant, split_q, split_units: None, fixed_splits, fp8_query, cpu_kernel: mla::CpuKernel::Auto }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 40, ..ProptestConfig::default() })]

    #[test]
    fn random_cases_match_the_cpu_and_the_reference(case in any_gpu_case()) {
        if let Some(run) = gpu::run_case(&case) {
            gpu::assert_close(&case, &run);
        }
    }
}
