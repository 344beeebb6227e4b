//! The CUDA backend around the kernels: CUDA-graph capture and replay with changing lengths
//! and block tables, warmup (forward compiles nothing after it), the device-side error flag,
//! and the host checks the GPU adds (alignment, device). Skips (saying why) without a GPU.
#![cfg(feature = "cuda")]

mod common;

use common::gpu::{self, DeviceCache, DeviceOutputs, DeviceProblem};
use common::{Case, LSE_TOL, O_TOL, spec};
use mla::backend::cuda::registry::{self, Family};
use mla::reference;
use mla::synth::HalfBuf;
use mla::synth::device::DeviceHalf;
use mla::synth::{Outputs, Problem};
use mla::{CacheDtype, DType, DecodeInputs, Error, KvFormat, Mask, ModelDtype, Query, TensorRef};
use rand::SeedableRng;
use rand::seq::SliceRandom;

#[test]
fn a_captured_decode_replays_with_new_lengths_and_tables() {
    for (heads, kv) in [(64, KvFormat::Bf16), (16, KvFormat::Fp8E4m3)] {
        // Shapes fixed at capture: 3 requests x 2 tokens, block tables of up to 4000 keys.
        let s =
            spec(heads, 16, &[4000, 4000, 4000], 2, Mask::Causal).with_format(ModelDtype::Bf16, kv);
        let case = Case::new(s);
        let Some(mut dec) = gpu::open(&case.config()) else {
            return;
        };
        let st = gpu::stream(&dec);
        let mut p = Problem::generate(&case.spec).unwrap();
        let mut dp = p.to_device(&st).unwrap();
        let mut out = DeviceOutputs::poisoned(&st, &p).unwrap();
        dec.reserve_workspace(p.rows(), 8192).unwrap();
        dec.lock_workspace();
        let dtype = if kv.is_fp8() {
            CacheDtype::Fp8E4m3
        } else {
            CacheDtype::Auto
        };
        let splits = dec
            .register_decode_warmup(&dp.inputs(&p, false).unwrap().kv_cache, dtype)
            .unwrap();
        let workspace = dec.workspace_bytes();

        let graph = {
            let inputs = dp.inputs(&p, false).unwrap();
            let (graph, captured) =
                gpu::capture(&st, || dec.forward(&inputs, &mut out.views().unwrap()));
            let plan = captured.expect("forward is capturable");
            assert!(
                splits.contains(&plan.num_kv_splits),
                "{splits:?} {}",
                plan.num_kv_splits
            );
            graph
        };

        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for lens in [[1000, 300, 4000], [1, 0, 2500], [4000, 4000, 17], [0, 0, 0]] {
            // New lengths and a new page assignment, written into the captured buffers.
            p.seq_lens = lens.to_vec();
            let mut blocks: Vec<i32> = (0..p.num_blocks as i32).collect();
            blocks.shuffle(&mut rng);
            p.block_table = blocks[..p.block_table.len()].to_vec();
            st.memcpy_htod(&p.seq_lens, &mut dp.seq_lens).unwrap();
            st.memcpy_htod(&p.block_table, &mut dp.block_table).unwrap();
            out.poison(&st).unwrap();
            graph.launch().unwrap();
            dec.check_device_errors().unwrap();
            let (o, lse) = out.download(&st).unwrap();

            let r = reference::decode_f64(dec.config(), &p.inputs().unwrap(), None).unwrap();
            let a = r.accuracy(&o, &lse);
            assert!(
                a.o_rel <= O_TOL && a.lse_abs <= LSE_TOL,
                "{lens:?}: {a:?} against the reference"
            );
            let (co, cl) = gpu::cpu_outputs(&case, &p, dec.config().sm_count, false);
            let a = gpu::distance(&o, &lse, &co, &cl, p.rows(), heads, 512);
            assert!(
                a.o_rel <= O_TOL && a.lse_abs <= LSE_TOL,
                "{lens:?}: {a:?} against the CPU backend"
            );
        }
        assert_eq!(
            dec.workspace_bytes(),
            workspace,
            "replays never grow the workspace"
        );
    }
}

#[test]
fn after_warmup_forward_compiles_nothing() {
    for (heads, kv, dtype) in [
        (16, KvFormat::Bf16, CacheDtype::Bf16),
        (128, KvFormat::Fp8E4m3, CacheDtype::Fp8E4m3),
        (40, KvFormat::Fp8E5m2, CacheDtype::Fp8E5m2),
    ] {
        let s = spec(heads, 64, &[10], 1, Mask::Causal).with_format(ModelDtype::Bf16, kv);
        let case = Case::new(s);
        let Some(mut dec) = gpu::open(&case.config()) else {
            return;
        };
        let st = gpu::stream(&dec);
        dec.reserve_workspace(8, 1 << 16).unwrap();
        dec.lock_workspace();
        let p = Problem::generate(&case.spec).unwrap();
        let dp = p.to_device(&st).unwrap();
        dec.register_decode_warmup(&dp.inputs(&p, false).unwrap().kv_cache, dtype)
            .unwrap();
        let built = dec.cuda_backend().unwrap().builds().len();
        assert!(built >= 2, "warmup builds stage 1 and the combine");
        // One split, many splits, multi-token rows: nothing new to build.
        for (lens, q_len) in [
            (vec![10], 1),
            (vec![40_000, 3], 1),
            (vec![5000, 0, 20_000], 2),
        ] {
            let mut s = case.spec.clone();
            s.seq_lens = lens;
            s.query_len = q_len;
            let run = gpu::run_case_on(
                &mut dec,
                &Case {
                    spec: s,
                    ..case.clone()
                },
            );
            assert!(run.vs_reference.o_rel <= O_TOL);
        }
        assert_eq!(
            dec.cuda_backend().unwrap().builds().len(),
            built,
            "forward built a kernel"
        );
    }
}

#[test]
fn bad_values_raise_the_device_flag_and_are_never_read() {
    // 16 heads take the narrow kernel on Hopper (mma.sync elsewhere); 128 take the wgmma
    // kernel on Hopper.
    for heads in [16, 128] {
        let case = Case::new(spec(heads, 16, &[100, 40], 1, Mask::Causal));
        let Some(mut dec) = gpu::open(&case.config()) else {
            return;
        };
        let st = gpu::stream(&dec);
        let p = Problem::generate(&case.spec).unwrap();
        let capacity = (p.max_blocks * 16) as i32;
        let with_block = |b: i32| {
            let mut t = p.block_table.clone();
            t[1] = b; // request 0, keys 16..32
            t
        };
        // (block table, lengths, the flag bit expected)
        let cases: Vec<(Vec<i32>, Vec<i32>, u32)> = vec![
            (with_block(-1), p.seq_lens.clone(), 4),
            (with_block(p.num_blocks as i32), p.seq_lens.clone(), 4),
            (with_block(i32::MAX), p.seq_lens.clone(), 4),
            (p.block_table.clone(), vec![capacity + 50, 40], 2),
            (p.block_table.clone(), vec![-3, 40], 1),
        ];
        for (table, lens, bit) in cases {
            let mut dp = p.to_device(&st).unwrap();
            st.memcpy_htod(&table, &mut dp.block_table).unwrap();
            st.memcpy_htod(&lens, &mut dp.seq_lens).unwrap();
            let mut out = DeviceOutputs::poisoned(&st, &p).unwrap();
            dec.forward(&dp.inputs(&p, false).unwrap(), &mut out.views().unwrap())
                .expect("forward itself does not wait");
            match dec.check_device_errors() {
                Err(Error::DeviceCheck { bits }) => assert_eq!(bits & bit, bit, "bits {bits:#x}"),
                other => panic!("expected the device flag for {bit}, got {other:?}"),
            }
            // The flag is cleared: a clean decode checks clean.
            let dp = p.to_device(&st).unwrap();
            dec.forward(&dp.inputs(&p, false).unwrap(), &mut out.views().unwrap())
                .unwrap();
            dec.check_device_errors().unwrap();
        }
    }
}

#[test]
fn hopper_decodes_many_heads_and_packed_tokens_with_wgmma() {
    use registry::KernelChoice::{Auto, Mma, Narrow, Seesaw, Wgmma, WgmmaFp8};
    // What warmup builds and what each decode launches on this device. On sm_90a, 64 and 128
    // heads take the wgmma kernel whatever the cache; 16 heads take mma.sync for one token a
    // request and the wgmma kernel, tokens packed, for two or more (warmup builds both); 8
    // heads x 2 tokens with a bf16 cache take the narrow kernel (and mma.sync is built for
    // pages it does not tile); 16 heads or more with a bf16 cache also build the seesaw kernel,
    // which takes the decode where a split holds at least seesaw_min_split_keys(heads) keys
    // (40 requests of 1100 keys at 128 heads: one split each; 2 requests take many short
    // splits), and its packed variant the packed tokens' decodes where a split holds at
    // least seesaw_min_split_keys(heads x tokens).
    // From 17 heads, an fp8 cache under a bf16 query also builds the wgmma kernel's fp8 twin,
    // which takes the decodes whose splits hold WGMMA_FP8_MIN_SPLIT_KEYS keys or more (66
    // requests of 2100 keys at 128 heads: one split each); with MLA_KERNEL=wgmma_fp8, every
    // decode.
    // MLA_KERNEL=mma|wgmma|narrow|seesaw|wgmma_fp8 forces a family (the seesaw kernel: every
    // decode with a cache in the model dtype that the narrow kernel does not take, packed
    // tokens too, on any split count, unless the decoder schedules; the fp8 twin: every fp8
    // decode, packed tokens too).
    // At 16 heads over a bf16 cache warmup also builds the narrow kernel, which takes the
    // single tokens whose grid it fills (`splits::narrow_single`: 128 requests of 1024 keys,
    // one split each), unless the decoder schedules.
    let two = [1000, 37];
    let forty = [1100; 40];
    let long = [2100; 66];
    let filled = [1024; 128];
    for (heads, kv, dtype, q_len, lengths) in [
        (128, KvFormat::Bf16, CacheDtype::Auto, 1, &two[..]),
        (128, KvFormat::Bf16, CacheDtype::Auto, 1, &forty[..]),
        (64, KvFormat::Bf16, CacheDtype::Auto, 1, &two[..]),
        (16, KvFormat::Bf16, CacheDtype::Auto, 1, &two[..]),
        (16, KvFormat::Bf16, CacheDtype::Auto, 1, &filled[..]),
        (16, KvFormat::Bf16, CacheDtype::Auto, 4, &two[..]),
        (16, KvFormat::Bf16, CacheDtype::Auto, 2, &long[..]),
        (8, KvFormat::Bf16, CacheDtype::Auto, 2, &two[..]),
        (128, KvFormat::Fp8E4m3, CacheDtype::Fp8E4m3, 1, &two[..]),
        (128, KvFormat::Fp8E4m3, CacheDtype::Fp8E4m3, 1, &long[..]),
        (64, KvFormat::Fp8E4m3, CacheDtype::Fp8E4m3, 2, &two[..]),
        (32, KvFormat::Fp8E4m3, CacheDtype::Fp8E4m3, 2, &two[..]),
        (16, KvFormat::Fp8E4m3, CacheDtype::Fp8E4m3, 1, &two[..]),
    ] {
        let mut s = spec(heads, 64, lengths, q_len, Mask::Causal);
        s.kv_format = kv;
        let case = Case::new(s);
        let Some(mut dec) = gpu::open(&case.config()) else {
            return;
        };
        let st = gpu::stream(&dec);
        let p = Problem::generate(&case.spec).unwrap();
        let dp = p.to_device(&st).unwrap();
        let longest = lengths.iter().copied().max().unwrap_or(0);
        dec.reserve_workspace(lengths.len() * q_len, longest)
            .unwrap();
        dec.register_decode_warmup(&dp.inputs(&p, false).unwrap().kv_cache, dtype)
            .unwrap();
        let cuda = dec.cuda_backend().unwrap();
        let families: Vec<Family> = cuda.builds().iter().map(|b| b.variant.family).collect();
        println!(
            "{heads} heads, {kv:?}, {q_len} tokens: {families:?} on {}",
            cuda.target().arch
        );
        let hopper = cuda.target().wgmma();
        let choice = registry::KernelChoice::from_env();
        let many = heads >= registry::WGMMA_MIN_HEADS;
        let packs = mla::plan::splits::packing(heads, q_len).is_some();
        let (wgmma_built, mma_built, launches_wgmma) = match choice {
            Mma => (false, true, false),
            Wgmma | WgmmaFp8 => (hopper, !hopper, hopper),
            // As shipped and with the narrow kernel forced (it runs where the wgmma one does
            // not).
            _ => (hopper, !(hopper && many), hopper && (many || packs)),
        };
        // The narrow kernel: built for up to 8 heads (16 when forced, or as shipped over a
        // bf16 cache), launched for the multi-token rows it packs (single tokens too when
        // forced, and as shipped those whose grid it fills).
        let narrow_heads = match choice {
            Narrow => 16,
            Auto if kv == KvFormat::Bf16 => 16,
            _ => 8,
        };
        let narrow_built = hopper
            && !matches!(choice, Mma | Wgmma | WgmmaFp8)
            && heads <= narrow_heads
            && kv != KvFormat::F16;
        let scheduling = registry::schedule_from_env().unwrap_or(false);
        let fp8_built = hopper
            && kv.is_fp8()
            && !scheduling
            && (choice == WgmmaFp8 || (choice == Auto && many));
        assert_eq!(families.contains(&Family::DecodeWgmmaFp8), fp8_built);
        // Its packed variant wherever tokens can pack (up to 32 heads).
        let can_pack = 2 * heads <= registry::WGMMA_TILE;
        let seesaw_built = hopper
            && (choice == Seesaw
                || (choice == Auto
                    && (registry::seesaw_min_split_keys(heads).is_some() || can_pack)))
            && kv == KvFormat::Bf16;
        assert_eq!(families.contains(&Family::DecodeSeesaw), seesaw_built);
        assert_eq!(
            families.contains(&Family::DecodeWgmma),
            wgmma_built,
            "{heads} heads, {kv:?}: {families:?}"
        );
        assert_eq!(families.contains(&Family::DecodeMma), mma_built);
        // The decode runs right (poisoned outputs against the reference), on the kernel
        // expected, and compiles nothing after warmup.
        let run = gpu::run_case_on(&mut dec, &case);
        gpu::assert_close(&case, &run);
        assert_eq!(families.contains(&Family::DecodeNarrow), narrow_built);
        let splits = run.plan.num_kv_splits;
        // Packed tokens take its packed variant, on the packed rows' threshold.
        let rows = heads * mla::plan::splits::packing(heads, q_len).unwrap_or(1);
        let long_splits = choice == Seesaw
            || registry::seesaw_min_split_keys(rows)
                .is_some_and(|keys| run.plan.split_keys() >= keys);
        // The narrow kernel's single tokens as shipped: below the seesaw kernel's splits, on
        // the split grid (a decoder that schedules runs the mma kernel's scheduled variant).
        let fills = mla::plan::splits::narrow_single(
            heads,
            q_len,
            run.plan.split_keys(),
            run.plan.rows * splits,
            dec.cuda_backend().unwrap().sm_count(),
        );
        let narrow_single = choice == Auto
            && narrow_built
            && !(seesaw_built && long_splits)
            && !(scheduling && lengths.len() > 1)
            && fills;
        let narrow_launched =
            narrow_built && !launches_wgmma && (q_len > 1 || choice == Narrow || narrow_single);
        // The case that is there for it does take it.
        assert!(
            narrow_single
                || !(choice == Auto && narrow_built && !scheduling && lengths == filled.as_slice())
        );
        let seesaw_launched = seesaw_built && !narrow_launched && long_splits;
        // The cases that are there for it do take it (packed: 66 requests of 2100 keys x 2
        // tokens at 16 heads, two splits of 1050 keys).
        assert!(seesaw_launched || !(seesaw_built && lengths == forty.as_slice()));
        assert!(seesaw_launched || !(seesaw_built && packs && lengths == long.as_slice()));
        let fp8_launched = fp8_built
            && (choice == WgmmaFp8
                || (!packs && run.plan.split_keys() >= registry::WGMMA_FP8_MIN_SPLIT_KEYS));
        // The case that is there for it does take it.
        assert!(fp8_launched || !(fp8_built && lengths == long.as_slice()));
        let launched = if narrow_launched {
            Family::DecodeNarrow
        } else if seesaw_launched {
            Family::DecodeSeesaw
        } else if fp8_launched {
            Family::DecodeWgmmaFp8
        } else if launches_wgmma {
            Family::DecodeWgmma
        } else {
            Family::DecodeMma
        };
        assert_eq!(
            dec.kernel_name(&run.plan),
            launched.entry(),
            "{heads} heads x {} requests, {kv:?}, {splits} splits",
            lengths.len()
        );
        let built = dec.cuda_backend().unwrap().builds().len();
        assert_eq!(built, families.len(), "forward built a kernel after warmup");
        // MLA_SCHEDULE=1: the kernels that take one token a CTA (mma, unpacked wgmma and
        // seesaw) run on the device-computed schedule; packed tokens and the narrow kernel
        // never do.
        let one_token = launched == Family::DecodeMma
            || (matches!(launched, Family::DecodeWgmma | Family::DecodeSeesaw) && !packs);
        let scheduled = scheduling && one_token;
        assert_eq!(
            dec.cuda_backend().unwrap().scheduled_decodes() > 0,
            scheduled,
            "{heads} heads, {kv:?}, {q_len} tokens on {launched:?}"
        );
    }
}

#[test]
fn the_fp8_query_mode_takes_the_fp8_twin_on_long_splits() {
    use registry::KernelChoice::{Auto, WgmmaFp8};
    // 128 heads, an fp8 cache, the fp8-query mode: on sm_90a the wgmma kernel takes splits
    // shorter than WGMMA_FP8Q_MIN_SPLIT_KEYS keys and the twin (fp8 wgmma for both products)
    // the longer ones (66 requests of 4200 keys: one split each, two CTAs a request), every
    // split with MLA_KERNEL=wgmma_fp8; both against the reference with the mode's tolerances.
    let short = [1000, 37];
    let long = [4200; 66];
    for lengths in [&short[..], &long[..]] {
        let mut s = spec(128, 64, lengths, 1, Mask::Causal);
        s.kv_format = KvFormat::Fp8E4m3;
        s.q_scale = 0.05;
        let mut case = Case::new(s);
        case.fp8_query = true;
        let Some(mut dec) = gpu::open(&case.config()) else {
            return;
        };
        let run = gpu::run_case_on(&mut dec, &case);
        gpu::assert_close(&case, &run);
        let cuda = dec.cuda_backend().unwrap();
        let choice = registry::KernelChoice::from_env();
        let has_twin = cuda.target().wgmma() && !registry::schedule_from_env().unwrap_or(false);
        let split_keys = run.plan.split_keys();
        let twin_runs = has_twin
            && (choice == WgmmaFp8
                || (choice == Auto && split_keys >= registry::WGMMA_FP8Q_MIN_SPLIT_KEYS));
        let name = dec.kernel_name(&run.plan);
        println!(
            "fp8 query, 128 heads x {} requests, {split_keys} keys a split: {name}",
            lengths.len()
        );
        assert_eq!(name == Family::DecodeWgmmaFp8.entry(), twin_runs, "{name}");
        // The case that is there for it does take it.
        let shipped = has_twin && choice == Auto;
        assert!(
            twin_runs || !(shipped && lengths == long.as_slice()),
            "{split_keys} keys a split"
        );
    }
}

#[test]
fn the_configuration_turns_the_device_schedule_on() {
    // MlaConfig::device_schedule: single-token decodes run on the device-computed schedule
    // (unless the environment says MLA_SCHEDULE=0), right, on lengths far apart; a
    // configuration without it stays on the split grid (unless MLA_SCHEDULE=1).
    // 40 requests of 500 to 6350 keys at 128 heads: splits long enough for the seesaw kernel,
    // whose scheduled variant then walks the pieces (on Hopper, as shipped).
    let env = registry::schedule_from_env();
    let varied: Vec<usize> = (0..40).map(|i| 500 + 150 * i).collect();
    let few = [5000, 3, 700, 0, 64];
    for (heads, asked, lengths) in [
        (128, true, &few[..]),
        (128, true, &varied[..]),
        (16, true, &few[..]),
        (16, false, &few[..]),
    ] {
        let case = Case::new(spec(heads, 64, lengths, 1, Mask::Causal));
        let mut cfg = case.config();
        cfg.device_schedule = asked;
        let Some(mut dec) = gpu::open(&cfg) else {
            return;
        };
        let run = gpu::run_case_on(&mut dec, &case);
        gpu::assert_close(&case, &run);
        // The narrow kernel (MLA_KERNEL=narrow at 16 heads) has no scheduled variant; the
        // seesaw kernel (128 heads here, on long splits) has.
        let narrow = dec.kernel_name(&run.plan) == Family::DecodeNarrow.entry();
        let expected = env.unwrap_or(asked) && !narrow;
        assert_eq!(
            dec.cuda_backend().unwrap().scheduled_decodes() > 0,
            expected,
            "{heads} heads, asked {asked}, MLA_SCHEDULE {env:?}"
        );
        let cuda = dec.cuda_backend().unwrap();
        let shipped = cuda.target().wgmma()
            && registry::KernelChoice::from_env() == registry::KernelChoice::Auto;
        if shipped && lengths == varied.as_slice() {
            assert_eq!(dec.kernel_name(&run.plan), Family::DecodeSeesaw.entry());
        }
    }
}

#[test]
fn misaligned_and_host_tensors_are_refused() {
    let case = Case::new(spec(16, 16, &[100, 40], 1, Mask::Causal));
    let Some(mut dec) = gpu::open(&case.config()) else {
        return;
    };
    let st = gpu::stream(&dec);
    let p = Problem::generate(&case.spec).unwrap();
    let dp = p.to_device(&st).unwrap();
    let mut out = DeviceOutputs::poisoned(&st, &p).unwrap();
    let good = dp.inputs(&p, false).unwrap();

    // A token stride of 580 bf16 values: rows not 16-byte aligned.
    let kv = dp_kv_with_strides(&dp, &p, [16 * 580, 580, 1]);
    let e = dec
        .forward(
            &DecodeInputs {
                kv_cache: kv,
                ..good
            },
            &mut out.views().unwrap(),
        )
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
    assert!(e.to_string().contains("16 bytes"), "{e}");
    // q starting one element into a buffer.
    let shifted = DeviceHalf::upload(
        &st,
        &HalfBuf::new(ModelDtype::Bf16, (0..2 * 16 * 576 + 8).map(|_| 0.5)),
    )
    .unwrap();
    let flat = shifted.flat().unwrap();
    let q = flat.sub_view(1, [2, 16, 576], [16 * 576, 576, 1]).unwrap();
    let e = dec
        .forward(
            &DecodeInputs {
                q: Query::Packed(q),
                ..good
            },
            &mut out.views().unwrap(),
        )
        .unwrap_err();
    assert!(matches!(e, Error::Stride { arg: "q", .. }), "{e}");
    // Host tensors on a GPU decoder.
    let e = dec
        .forward(&p.inputs().unwrap(), &mut out.views().unwrap())
        .unwrap_err();
    assert!(matches!(e, Error::WrongDevice { .. }), "{e}");
    let mut host_out = Outputs::poisoned(&p);
    let e = dec
        .forward(&good, &mut host_out.views().unwrap())
        .unwrap_err();
    assert!(e.to_string().contains("expected a tensor on cuda:0"), "{e}");
}

/// The problem's cache viewed with other strides (the buffer is large enough for them).
fn dp_kv_with_strides<'a>(
    dp: &'a DeviceProblem,
    p: &Problem,
    strides: [usize; 3],
) -> TensorRef<'a, 3> {
    let shape = [p.num_blocks / 2, 16, 576];
    match &dp.kv {
        DeviceCache::Half(h) => h.flat().unwrap().sub_view(0, shape, strides).unwrap(),
        DeviceCache::Fp8(b, _) => TensorRef::from_cuda(b, shape, strides)
            .unwrap()
            .view_as(DType::F8E4M3)
            .unwrap(),
    }
}

/// A per-tensor scale a decode can read from the device.
#[derive(Debug, Clone, Copy, PartialEq)]
enum ScaleArg {
    /// An fp8 cache's k_scale.
    K,
    /// The fp8-query mode's q_scale.
    Q,
}

/// A decode captured with the scale `arg` as a device tensor, replayed with new values in
/// it: each replay matches the CPU backend given the value, and a value not finite and
/// positive raises the device flag.
fn captured_decode_reads_a_new_scale(arg: ScaleArg) {
    // The fp8-query mode's rows fit one tile of every kernel, where the GPU rounds P at the
    // CPU backend's maxima (see cuda_contract's fp8-query tests): a close comparison.
    let (lens, values): (&[usize], [f32; 3]) = match arg {
        ScaleArg::K => (&[3000, 700], [0.5, 0.125, 2.0]),
        ScaleArg::Q => (&[32, 9], [1.0 / 64.0, 0.01, 0.3]),
    };
    let mut s = spec(16, 64, lens, 1, Mask::Causal);
    s.kv_format = KvFormat::Fp8E4m3;
    s.k_scale = 0.5;
    s.q_scale = values[0];
    let mut case = Case::new(s);
    case.fp8_query = arg == ScaleArg::Q;
    let Some(mut dec) = gpu::open(&case.config()) else {
        return;
    };
    let st = gpu::stream(&dec);
    let mut p = Problem::generate(&case.spec).unwrap();
    let dp = p.to_device(&st).unwrap();
    let mut scale = st.clone_htod(&values[..1]).unwrap();
    let mut out = DeviceOutputs::poisoned(&st, &p).unwrap();
    dec.reserve_workspace(p.rows(), 4096).unwrap();
    dec.lock_workspace();
    dec.register_decode_warmup(&dp.inputs(&p, false).unwrap().kv_cache, CacheDtype::Fp8E4m3)
        .unwrap();
    let graph = {
        let tensor = Some(TensorRef::from_cuda(&scale, [1], [1]).unwrap());
        // The values beside the tensor are ignored: the tensor wins.
        let inputs = match arg {
            ScaleArg::K => DecodeInputs {
                k_scale: 99.0,
                k_scale_tensor: tensor,
                ..dp.inputs(&p, false).unwrap()
            },
            ScaleArg::Q => DecodeInputs {
                q_scale: 99.0,
                q_scale_tensor: tensor,
                ..dp.inputs(&p, false).unwrap()
            },
        };
        let (graph, captured) =
            gpu::capture(&st, || dec.forward(&inputs, &mut out.views().unwrap()));
        captured.unwrap();
        graph
    };
    for k in values {
        st.memcpy_htod(&[k], &mut scale).unwrap();
        out.poison(&st).unwrap();
        graph.launch().unwrap();
        dec.check_device_errors().unwrap();
        let (o, lse) = out.download(&st).unwrap();
        match arg {
            ScaleArg::K => p.spec.k_scale = k,
            ScaleArg::Q => p.spec.q_scale = k,
        }
        let now = Case {
            spec: p.spec.clone(),
            ..case.clone()
        };
        let (co, cl) = gpu::cpu_outputs(&now, &p, dec.config().sm_count, false);
        let a = gpu::distance(&o, &lse, &co, &cl, p.rows(), 16, 512);
        assert!(
            a.o_rel <= O_TOL && a.lse_abs <= LSE_TOL,
            "{arg:?} scale {k}: {a:?}"
        );
    }
    // A scale the host cannot check is checked on the device.
    for bad in [0.0f32, -1.0, f32::NAN, f32::INFINITY] {
        st.memcpy_htod(&[bad], &mut scale).unwrap();
        graph.launch().unwrap();
        match dec.check_device_errors() {
            Err(Error::DeviceCheck { bits }) => assert_eq!(bits, 8, "{arg:?} scale {bad}"),
            other => panic!("{arg:?} scale {bad}: expected the device flag, got {other:?}"),
        }
    }
}

#[test]
fn a_captured_decode_reads_a_new_k_scale_from_the_device() {
    captured_decode_reads_a_new_scale(ScaleArg::K);
}

#[test]
fn a_captured_decode_reads_a_new_q_scale_from_the_device() {
    captured_decode_reads_a_new_scale(ScaleArg::Q);
}

#[test]
fn decodes_run_on_a_stream_of_the_callers() {
    let case = Case::new(spec(32, 16, &[2000, 5, 900], 2, Mask::Causal));
    let Some(mut dec) = gpu::open(&case.config()) else {
        return;
    };
    let side = dec.cuda_context().unwrap().new_stream().unwrap();
    dec.set_cuda_stream(side.clone()).unwrap();
    assert_eq!(gpu::stream(&dec).cu_stream(), side.cu_stream());
    let run = gpu::run_case_on(&mut dec, &case);
    gpu::assert_close(&case, &run);
}

#[test]
fn configurations_the_kernels_cannot_index_are_refused_when_opened() {
    // 65536 heads x 8 DCP ranks: more query heads than the kernels' grid holds. Refused by
    // MlaDecode::new on a GPU (the CPU backend takes it), before any decode.
    let mut cfg = mla::MlaConfig::new(1 << 16, 0.1);
    cfg.dcp_world_size = 8;
    assert!(mla::MlaDecode::new(&cfg, mla::Device::Cpu).is_ok());
    let Some(e) = gpu::open_err(&cfg) else {
        return;
    };
    assert!(
        matches!(
            e,
            Error::InvalidConfig {
                field: "num_heads",
                ..
            }
        ),
        "{e}"
    );
    // An L the kernels do not tile.
    for l in [100, 192] {
        let mut cfg = mla::MlaConfig::new(16, 0.1);
        cfg.kv_lora_rank = l;
        let e = gpu::open_err(&cfg).expect("a GPU was found above");
        assert!(
            matches!(
                e,
                Error::InvalidConfig {
                    field: "kv_lora_rank",
                    ..
                }
            ),
            "L = {l}: {e}"
        );
    }
}
