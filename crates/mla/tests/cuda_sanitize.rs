//! A small suite for compute-sanitizer (memcheck, racecheck): every kernel path on tiny
//! problems, including tails, padded heads, empty splits and bad block ids, once per kernel
//! setting (`sanitize::as_shipped`, `sanitize::forced_seesaw`, ..., `sanitize::device_schedule`).
//! It runs as a plain test too; scripts/gpu/run.sh runs each setting under the sanitizer in a
//! process of its own (`cuda_sanitize --exact sanitize::forced_seesaw`).
#![cfg(feature = "cuda")]

mod common;

use common::gpu::kernels::{Kernels, Tally};
use common::gpu::{self, DeviceOutputs};
use common::{Case, spec};
use mla::synth::Problem;
use mla::{Error, KvFormat, Mask, ModelDtype};

/// Every case of the suite under `kernels`.
fn sanitize(kernels: Kernels) {
    let Some(mut t) = Tally::start("cuda_sanitize", kernels) else {
        return;
    };
    every_kernel_path(&mut t);
    bad_block_ids(&mut t);
    t.finish();
}

kernel_tests!(sanitize);

fn every_kernel_path(t: &mut Tally) {
    let mut cases = Vec::new();
    for (model, kv) in common::formats() {
        // 20 heads: a padded row group (on Hopper, 2 tokens packed in 40 rows of the wgmma
        // tile); 3-key pages; a 2000-key row (4 splits on the tail).
        let s = spec(20, 3, &[2000, 7, 0, 513], 2, Mask::Causal).with_format(model, kv);
        cases.push(Case::new(s));
    }
    let mut windowed = Case::new(spec(100, 1, &[300, 1200], 3, Mask::NonCausal));
    windowed.window = Some(77);
    windowed.split_q = true;
    cases.push(windowed);
    // 16 heads x 4 causal tokens packed, each row with its own window edge.
    let mut packed = Case::new(spec(16, 16, &[900, 3, 70], 4, Mask::Causal));
    packed.window = Some(61);
    cases.push(packed);
    // The seesaw kernel's packed variant as shipped (splits of at least 1024 keys): 16 heads
    // x 3 tokens over 32-key pages, two splits whose edges differ token by token, a row
    // whose tokens see nothing of its second split, and a window.
    let mut packed_seesaw = Case::new(spec(16, 32, &[4500, 2, 2900], 3, Mask::Causal));
    packed_seesaw.fixed_splits = Some(2);
    packed_seesaw.window = Some(2500);
    cases.push(packed_seesaw);
    // 128 single-token heads over 32-key pages, windowed: the seesaw kernel (forced), and on
    // the device schedule its scheduled variant, whose persistent CTAs walk several pieces
    // each (the mbarriers set up again between them).
    let mut wide = Case::new(spec(128, 32, &[3000, 5, 0, 1500, 700], 1, Mask::Causal));
    wide.window = Some(2000);
    cases.push(wide);
    // The same over fp8 caches (the codes rewritten as f16 in shared memory, each chunk
    // between two barriers of its warpgroup), and packed over an e5m2 cache under an f16 model.
    let mut s = spec(128, 32, &[3000, 5, 0, 1500, 700], 1, Mask::Causal)
        .with_format(ModelDtype::Bf16, KvFormat::Fp8E4m3);
    s.k_scale = 0.25;
    let mut wide_fp8 = Case::new(s);
    wide_fp8.window = Some(2000);
    cases.push(wide_fp8);
    let mut s = spec(16, 32, &[4500, 2, 2900], 3, Mask::Causal)
        .with_format(ModelDtype::F16, KvFormat::Fp8E5m2);
    s.k_scale = 0.5;
    let mut packed_fp8 = Case::new(s);
    packed_fp8.fixed_splits = Some(2);
    cases.push(packed_fp8);
    let mut single = Case::new(spec(64, 64, &[100, 0], 1, Mask::Causal));
    single.batch_invariant = true;
    cases.push(single);
    // The narrow kernel on Hopper (few heads, bf16 cache): 8 heads x 2 tokens on 64-key pages
    // with several splits (tiles cut at both ends), and 3 heads x 3 tokens on 8-key pages with
    // a window.
    let mut narrow = Case::new(spec(8, 64, &[3000, 70, 0, 129], 2, Mask::Causal));
    narrow.fixed_splits = Some(5);
    cases.push(narrow);
    let mut narrow_packed = Case::new(spec(3, 8, &[700, 2, 95], 3, Mask::Causal));
    narrow_packed.window = Some(150);
    cases.push(narrow_packed);
    // The narrow kernel's fp8 path (fp8 wgmma on the raw codes, q and P split in two e4m3
    // terms): 8 heads x 2 tokens, and 16 single-token heads of an f16 model over an e5m2
    // cache on 16-key pages with several splits.
    let mut s = spec(8, 64, &[900, 5, 130], 2, Mask::Causal)
        .with_format(ModelDtype::Bf16, KvFormat::Fp8E4m3);
    s.k_scale = 0.25;
    cases.push(Case::new(s));
    let mut narrow_single = Case::new(
        spec(16, 16, &[1100, 3, 0, 200], 1, Mask::Causal)
            .with_format(ModelDtype::F16, KvFormat::Fp8E5m2),
    );
    narrow_single.fixed_splits = Some(3);
    cases.push(narrow_single);
    // The wgmma kernel's fp8 twin on Hopper (an fp8 cache under a 16-bit query, 17 heads or
    // more): 128 heads with a k_scale, and 48 heads (a padded tile) x 3 tokens of an f16
    // model over an e5m2 cache on 33-key pages, windowed.
    let mut s = spec(128, 16, &[700, 3, 0, 65], 1, Mask::Causal)
        .with_format(ModelDtype::Bf16, KvFormat::Fp8E4m3);
    s.k_scale = 0.5;
    cases.push(Case::new(s));
    let mut twin = Case::new(
        spec(48, 33, &[1500, 40], 3, Mask::Causal).with_format(ModelDtype::F16, KvFormat::Fp8E5m2),
    );
    twin.window = Some(300);
    cases.push(twin);
    // The fp8-query mode (q and P as e4m3 codes): 20 heads x 2 tokens (mma; packed wgmma on
    // Hopper), and 128 heads (wgmma) with an f16 model and an e5m2 cache.
    for (heads, q_len, model, kv) in [
        (20, 2, ModelDtype::Bf16, KvFormat::Fp8E4m3),
        (128, 1, ModelDtype::F16, KvFormat::Fp8E5m2),
    ] {
        let mut case = Case::new(
            spec(heads, 16, &[700, 3, 0, 65], q_len, Mask::Causal).with_format(model, kv),
        );
        case.fp8_query = true;
        cases.push(case);
    }
    for (i, case) in cases.iter().enumerate() {
        // Which case a sanitizer report comes from (its reports interleave with these lines).
        gpu::say(&format!("sanitize case {i}, {}", t.kernels()));
        t.check(case);
    }
}

fn bad_block_ids(t: &mut Tally) {
    // fp8 under f16 takes the mma kernel; on Hopper 128 bf16 heads the wgmma kernel, 64
    // fp8 heads its fp8 twin and 8 heads x 2 tokens the narrow kernel.
    for (heads, model, kv, q_len) in [
        (16, ModelDtype::F16, KvFormat::Fp8E5m2, 1),
        (64, ModelDtype::Bf16, KvFormat::Fp8E4m3, 1),
        (128, ModelDtype::Bf16, KvFormat::Bf16, 1),
        (8, ModelDtype::Bf16, KvFormat::Bf16, 2),
    ] {
        let mut s = spec(heads, 16, &[100, 40], q_len, Mask::Causal);
        s.kv_format = kv;
        s.model_dtype = model;
        let case = Case::new(s);
        let mut dec = t.open(&case);
        let st = gpu::stream(&dec);
        let p = Problem::generate(&case.spec).unwrap();
        let mut dp = p.to_device(&st).unwrap();
        let mut table = p.block_table.clone();
        table[0] = -5;
        table[3] = 1 << 30;
        st.memcpy_htod(&table, &mut dp.block_table).unwrap();
        let mut out = DeviceOutputs::poisoned(&st, &p).unwrap();
        let plan = dec
            .forward(&dp.inputs(&p, false).unwrap(), &mut out.views().unwrap())
            .unwrap();
        t.count(&plan);
        assert!(matches!(
            dec.check_device_errors(),
            Err(Error::DeviceCheck { bits: 4 })
        ));
    }
}
