//! The CUDA backend against the CPU backend and the f64 reference, over every feature and
//! dtype, with outputs poisoned before each run: the whole suite once per kernel setting
//! (`contract::as_shipped`, `contract::forced_seesaw`, ..., `contract::device_schedule`), each
//! saying which family ran its cases. Skips (saying why) without a GPU, fails there with
//! `MLA_REQUIRE_GPU=1`.
#![cfg(feature = "cuda")]

mod common;

use common::gpu::kernels::{Kernels, Tally};
use common::{Case, spec};
use mla::{KvFormat, Mask, ModelDtype};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

/// Every case of the suite under `kernels`.
fn contract(kernels: Kernels) {
    let Some(mut t) = Tally::start("cuda_contract", kernels) else {
        return;
    };
    every_cache_format_and_model_dtype(&mut t);
    head_counts_and_page_sizes(&mut t);
    multi_token_rows_causal_and_not(&mut t);
    multi_token_rows_of_few_heads_on_long_splits(&mut t);
    many_heads_over_fp8_caches_on_long_splits(&mut t);
    sliding_windows(&mut t);
    few_heads_on_every_page_size_the_narrow_kernel_tiles(&mut t);
    split_query_and_padded_strides(&mut t);
    many_splits_and_long_contexts(&mut t);
    the_combine_on_each_of_its_launch_shapes(&mut t);
    other_latent_widths(&mut t);
    query_rows_that_see_nothing_get_zero_and_minus_infinity(&mut t);
    the_fp8_query_mode_on_each_kernel(&mut t);
    random_cases_match_the_cpu_and_the_reference(&mut t);
    t.finish();
}

kernel_tests!(contract);

fn every_cache_format_and_model_dtype(t: &mut Tally) {
    for (model, kv) in common::formats() {
        let s = spec(16, 64, &[700, 1500, 33, 0], 1, Mask::Causal).with_format(model, kv);
        t.check(&Case::new(s));
    }
}

fn head_counts_and_page_sizes(t: &mut Tally) {
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
        t.check(&Case::new(spec(
            heads,
            page,
            &[1000, 257, 1, 4100],
            1,
            Mask::Causal,
        )));
    }
}

fn multi_token_rows_causal_and_not(t: &mut Tally) {
    for mask in [Mask::Causal, Mask::NonCausal] {
        for q_len in [2, 3, 4] {
            t.check(&Case::new(spec(
                16,
                16,
                &[2, 1, 0, 900, 77, 3000],
                q_len,
                mask,
            )));
        }
    }
}

fn multi_token_rows_of_few_heads_on_long_splits(t: &mut Tally) {
    // On Hopper the seesaw kernel's packed variant takes these (splits of at least 1024 keys,
    // tokens x heads in its 64 rows; 16 x 4 fills them): each token's split edges its own,
    // the edges inside a tile, the last row's tokens seeing one split or none.
    // fp8 caches run it where it is forced (the packed wgmma kernel takes them as shipped),
    // their codes rewritten as f16 in its shared memory, tile by tile.
    use KvFormat::{Bf16, F16, Fp8E4m3, Fp8E5m2};
    for (heads, q_len, model, kv, splits) in [
        (16, 2, ModelDtype::Bf16, Bf16, 2),
        (16, 4, ModelDtype::F16, F16, 3),
        (32, 2, ModelDtype::Bf16, Bf16, 1),
        (20, 3, ModelDtype::Bf16, Bf16, 2),
        (8, 4, ModelDtype::Bf16, Bf16, 2),
        (4, 16, ModelDtype::F16, F16, 1),
        (16, 4, ModelDtype::Bf16, Fp8E4m3, 3),
        (20, 3, ModelDtype::F16, Fp8E5m2, 2),
    ] {
        let mut s =
            spec(heads, 64, &[5003, 4097, 2900, 2], q_len, Mask::Causal).with_format(model, kv);
        if kv.is_fp8() {
            s.k_scale = 0.25;
        }
        let mut case = Case::new(s);
        case.fixed_splits = Some(splits);
        t.check(&case);
    }
}

fn many_heads_over_fp8_caches_on_long_splits(t: &mut Tally) {
    // On Hopper the seesaw kernel takes these as shipped (512 keys a split and more above 64
    // heads, 1024 from 17): its fp8 codes rewritten as f16 chunk by chunk, k_scale on the
    // scores and the output; pages of 32, 16 and 8 keys (2, 4 and 8 boxes a tile), split
    // edges inside tiles, an empty row and a row of two keys.
    for (heads, page, model, kv, splits) in [
        (128, 32, ModelDtype::Bf16, KvFormat::Fp8E4m3, 2),
        (64, 32, ModelDtype::F16, KvFormat::Fp8E4m3, 1),
        (128, 32, ModelDtype::Bf16, KvFormat::Fp8E5m2, 3),
        (128, 16, ModelDtype::Bf16, KvFormat::Fp8E4m3, 2),
        (32, 8, ModelDtype::Bf16, KvFormat::Fp8E5m2, 2),
    ] {
        let mut s = spec(heads, page, &[5003, 2, 0, 2900], 1, Mask::Causal).with_format(model, kv);
        s.k_scale = 0.25;
        let mut case = Case::new(s);
        case.fixed_splits = Some(splits);
        t.check(&case);
    }
}

fn sliding_windows(t: &mut Tally) {
    for (w, q_len) in [(1, 1), (64, 1), (100, 3), (5000, 2), (31, 4)] {
        let mut case = Case::new(spec(32, 64, &[1000, 10, 0, 2570], q_len, Mask::Causal));
        case.window = Some(w);
        t.check(&case);
    }
}

fn few_heads_on_every_page_size_the_narrow_kernel_tiles(t: &mut Tally) {
    // Hopper's narrow kernel (up to 16 rows, a cache in the model dtype or fp8; as shipped it
    // takes the multi-token rows of up to 8 heads and the 16-head single tokens whose grid it
    // fills, forced (`contract::forced_narrow`) every single token of up to 16 heads too):
    // pages of 8 to 256 keys, split starts inside a tile (lengths that do not divide), windows,
    // tokens packed (8 heads x 2, 4 x 4, 3 x 5, 1 x 12), fp8 with a scale, padded strides and
    // a split query. Elsewhere these run on the mma kernel and must match all the same.
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
        t.check(&case);
        // The same with many splits: tiles cut at both ends of every split.
        case.fixed_splits = Some(37);
        t.check(&case);
    }
}

fn split_query_and_padded_strides(t: &mut Tally) {
    let mut s = spec(64, 16, &[300, 2301], 2, Mask::NonCausal);
    s.token_pad = 8; // 16-byte aligned rows, padded
    s.page_pad = 64;
    let mut case = Case::new(s);
    case.split_q = true;
    t.check(&case);
    let mut s = spec(16, 64, &[300, 2301], 1, Mask::Causal);
    s.kv_format = KvFormat::Fp8E4m3;
    s.k_scale = 0.25;
    s.token_pad = 16;
    s.page_pad = 32;
    t.check(&Case::new(s));
}

fn many_splits_and_long_contexts(t: &mut Tally) {
    // 64k keys: the largest split count the rule gives on an H200 at this length (128).
    for (heads, kv) in [
        (16, KvFormat::Bf16),
        (128, KvFormat::Bf16),
        (16, KvFormat::Fp8E4m3),
    ] {
        let s = spec(heads, 64, &[65_536, 5, 17_000], 1, Mask::Causal)
            .with_format(ModelDtype::Bf16, kv);
        t.check(&Case::new(s));
    }
}

fn the_combine_on_each_of_its_launch_shapes(t: &mut Tally) {
    // The combine takes 1, 2, 4 or 8 warps a head (backend/cuda/combine.rs: 16 splits a warp
    // at once, more in turns; fewer warps where the rows fill the GPU) and 8, 4, 2 or 1 heads
    // a CTA, the last CTA padded when the heads do not divide; empty splits (short rows) sit
    // among full ones.
    for heads in [5, 17, 128] {
        for splits in [2, 17, 33, 100, 300] {
            let s = spec(heads, 16, &[3000, 40, 0, 1500], 1, Mask::Causal);
            let mut case = Case::new(s);
            case.fixed_splits = Some(splits);
            t.check(&case);
        }
    }
}

fn other_latent_widths(t: &mut Tally) {
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
            t.check(&Case::new(s));
        }
    }
}

fn query_rows_that_see_nothing_get_zero_and_minus_infinity(t: &mut Tally) {
    for splits_forced in [false, true] {
        let mut case = Case::new(spec(16, 16, &[0, 5, 0, 3000], 2, Mask::Causal));
        if !splits_forced {
            case.batch_invariant = true; // single split: stage 1 writes o and lse directly
        }
        let run = t.check(&case);
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

fn the_fp8_query_mode_on_each_kernel(t: &mut Tally) {
    // 16 heads: the mma kernel (the narrow kernel has no fp8-query mode); 16 heads x 4 causal
    // tokens: the packed wgmma kernel on sm_90a; 128 heads: wgmma (mma below sm_90a). Each
    // with e4m3 and e5m2 caches, bf16 and f16 models, two q scales; `contract::device_schedule` and
    // `contract::forced_mma` take the scheduled and the mma variants through it.
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
                t.check(&case);
                // Rows of one tile of every kernel (32 keys), one split: P rounds at the
                // row's maximum on both backends, whose o then agree as closely as without
                // the mode (a wrong scale, a P not rounded to e4m3 or not scaled first
                // shows), and their LSE within the fp8 wgmma sums' error.
                s.seq_lens = vec![32, 9, 1, 20 + q_len];
                let mut short = Case::new(s);
                short.fp8_query = true;
                short.fixed_splits = Some(1);
                let a = t.check(&short).vs_cpu;
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

/// 40 random cases (proptest shrinks a failing one to a small one before it panics).
fn random_cases_match_the_cpu_and_the_reference(t: &mut Tally) {
    let config = Config {
        cases: 40,
        failure_persistence: None,
        ..Config::default()
    };
    let tally = std::cell::RefCell::new(t);
    TestRunner::new(config)
        .run(&any_gpu_case(), |case| {
            tally.borrow_mut().check(&case);
            Ok(())
        })
        .unwrap();
}
