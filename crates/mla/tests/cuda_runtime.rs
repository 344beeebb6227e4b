//! The CUDA backend around the kernels: CUDA-graph capture and replay with changing lengths
//! and block tables, warmup (it builds what each decode runs: forward compiles nothing after
//! it), the device schedule's switch, the device-side error flag, scales read from the device
//! and the caller's stream, once per kernel setting (`runtime::as_shipped`,
//! `runtime::forced_seesaw`, ..., `runtime::device_schedule`); and the host checks the GPU
//! adds (alignment, device, shapes the kernels cannot index). Skips (saying why) without a
//! GPU, fails there with `MLA_REQUIRE_GPU=1`.
#![cfg(feature = "cuda")]

mod common;

use common::gpu::kernels::{Kernels, Tally};
use common::gpu::{self, DeviceCache, DeviceOutputs, DeviceProblem};
use common::{Case, LSE_TOL, O_TOL, spec};
use mla::reference;
use mla::synth::HalfBuf;
use mla::synth::device::DeviceHalf;
use mla::synth::{Outputs, Problem};
use mla::{
    CacheDtype, DType, DecodeInputs, Error, KernelFamily, KvFormat, Mask, ModelDtype, Query,
    TensorRef,
};
use rand::SeedableRng;
use rand::seq::SliceRandom;

/// Every case of the suite under `kernels`.
fn runtime(kernels: Kernels) {
    let Some(mut t) = Tally::start("cuda_runtime", kernels) else {
        return;
    };
    a_captured_decode_replays_with_new_lengths_and_tables(&mut t);
    after_warmup_forward_compiles_nothing(&mut t);
    warmup_builds_what_each_decode_runs(&mut t);
    the_fp8_query_mode_takes_the_fp8_twin_on_long_splits(&mut t);
    the_configuration_turns_the_device_schedule_on(&mut t);
    bad_values_raise_the_device_flag_and_are_never_read(&mut t);
    captured_decode_reads_a_new_scale(&mut t, ScaleArg::K);
    captured_decode_reads_a_new_scale(&mut t, ScaleArg::Q);
    decodes_run_on_a_stream_of_the_callers(&mut t);
    t.finish();
}

kernel_tests!(runtime);

fn a_captured_decode_replays_with_new_lengths_and_tables(t: &mut Tally) {
    for (heads, kv) in [(64, KvFormat::Bf16), (16, KvFormat::Fp8E4m3)] {
        // Shapes fixed at capture: 3 requests x 2 tokens, block tables of up to 4000 keys.
        let s =
            spec(heads, 16, &[4000, 4000, 4000], 2, Mask::Causal).with_format(ModelDtype::Bf16, kv);
        let case = Case::new(s);
        let mut dec = t.open(&case);
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
            t.count(&plan);
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

fn after_warmup_forward_compiles_nothing(t: &mut Tally) {
    for (heads, kv, dtype) in [
        (16, KvFormat::Bf16, CacheDtype::Bf16),
        (128, KvFormat::Fp8E4m3, CacheDtype::Fp8E4m3),
        (40, KvFormat::Fp8E5m2, CacheDtype::Fp8E5m2),
    ] {
        let s = spec(heads, 64, &[10], 1, Mask::Causal).with_format(ModelDtype::Bf16, kv);
        let case = Case::new(s);
        let mut dec = t.open(&case);
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
            t.check_on(
                &mut dec,
                &Case {
                    spec: s,
                    ..case.clone()
                },
            );
        }
        assert_eq!(
            dec.cuda_backend().unwrap().builds().len(),
            built,
            "forward built a kernel"
        );
    }
}

fn bad_values_raise_the_device_flag_and_are_never_read(t: &mut Tally) {
    // 16 and 128 heads: the kernels of few heads and of many.
    for heads in [16, 128] {
        let case = Case::new(spec(heads, 16, &[100, 40], 1, Mask::Causal));
        let mut dec = t.open(&case);
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
            let plan = dec
                .forward(&dp.inputs(&p, false).unwrap(), &mut out.views().unwrap())
                .unwrap();
            dec.check_device_errors().unwrap();
            t.count(&plan);
        }
    }
}

/// Warms a decoder up for `case` (the workspace for its rows and longest length, the cache
/// dtype `dtype`), runs it (outputs poisoned, against the reference and the CPU backend),
/// and checks that warmup built what the decode ran (forward builds nothing) and that the plan
/// says whether the decode took the device schedule. Returns the run.
fn warm_then_check(t: &mut Tally, case: &Case, dtype: CacheDtype) -> gpu::GpuRun {
    let mut dec = t.open(case);
    let st = gpu::stream(&dec);
    let p = Problem::generate(&case.spec).unwrap();
    let dp = p.to_device(&st).unwrap();
    let longest = case.spec.seq_lens.iter().copied().max().unwrap_or(0);
    dec.reserve_workspace(p.rows(), longest).unwrap();
    dec.register_decode_warmup(&dp.inputs(&p, false).unwrap().kv_cache, dtype)
        .unwrap();
    let cuda = dec.cuda_backend().unwrap();
    let (built, scheduled) = (cuda.builds(), cuda.scheduled_decodes());
    let run = t.check_on(&mut dec, case);
    let cuda = dec.cuda_backend().unwrap();
    let what = format!(
        "{} heads x {} requests x {} tokens, {:?}, {}: {} on {} splits",
        case.spec.heads,
        case.spec.seq_lens.len(),
        case.spec.query_len,
        case.spec.kv_format,
        t.kernels(),
        dec.kernel_name(&run.plan),
        run.plan.num_kv_splits
    );
    let names = |b: &[mla::precompile::KernelBuild]| -> Vec<String> {
        b.iter()
            .map(|k| format!("{} {}", k.kernel, k.defines))
            .collect()
    };
    assert_eq!(
        names(&cuda.builds()),
        names(&built),
        "{what}: forward built a kernel that warmup did not"
    );
    assert_eq!(
        cuda.scheduled_decodes() > scheduled,
        run.plan.scheduled(),
        "{what}: the plan and the launch disagree on the schedule"
    );
    assert!(
        !run.plan.scheduled() || dec.schedules(),
        "{what}: scheduled by a decoder that does not schedule"
    );
    println!("{what}");
    run
}

fn warmup_builds_what_each_decode_runs(t: &mut Tally) {
    // Each case with the family it is there for: the one the kernel pick gives it as shipped
    // on Hopper (plan::kernel's tests check the pick itself), None where the case is there
    // for every kernel setting alike. 40 requests of 1100 keys at 128 heads: one split each,
    // long enough for the seesaw kernel; 128 requests of 1024 keys at 16 heads: single tokens
    // whose grid the narrow kernel fills; 66 requests of 2100 keys: the packed seesaw kernel
    // at 16 heads x 2 tokens (two splits of 1050 keys) and at 128 heads the seesaw kernel over
    // an fp8 cache (one split each), on pages of 48 keys (which the seesaw kernel does not
    // tile) the fp8 twin; two short requests: the wgmma kernel and, packed, its packed variant.
    use KernelFamily::{Mma, Narrow, Seesaw, Wgmma, WgmmaFp8};
    let two = [1000, 37];
    let forty = [1100; 40];
    let long = [2100; 66];
    let filled = [1024; 128];
    for (heads, kv, dtype, q_len, lengths, there_for) in [
        (128, KvFormat::Bf16, CacheDtype::Auto, 1, &two[..], None),
        (
            128,
            KvFormat::Bf16,
            CacheDtype::Auto,
            1,
            &forty[..],
            Some(Seesaw),
        ),
        (64, KvFormat::Bf16, CacheDtype::Auto, 1, &two[..], None),
        (16, KvFormat::Bf16, CacheDtype::Auto, 1, &two[..], None),
        (
            16,
            KvFormat::Bf16,
            CacheDtype::Auto,
            1,
            &filled[..],
            Some(Narrow),
        ),
        (
            16,
            KvFormat::Bf16,
            CacheDtype::Auto,
            4,
            &two[..],
            Some(Wgmma),
        ),
        (
            16,
            KvFormat::Bf16,
            CacheDtype::Auto,
            2,
            &long[..],
            Some(Seesaw),
        ),
        (
            8,
            KvFormat::Bf16,
            CacheDtype::Auto,
            2,
            &two[..],
            Some(Narrow),
        ),
        (
            128,
            KvFormat::Fp8E4m3,
            CacheDtype::Fp8E4m3,
            1,
            &two[..],
            Some(Wgmma),
        ),
        (
            128,
            KvFormat::Fp8E4m3,
            CacheDtype::Fp8E4m3,
            1,
            &long[..],
            Some(Seesaw),
        ),
        (
            64,
            KvFormat::Fp8E4m3,
            CacheDtype::Fp8E4m3,
            2,
            &two[..],
            Some(Wgmma),
        ),
        (
            32,
            KvFormat::Fp8E4m3,
            CacheDtype::Fp8E4m3,
            2,
            &two[..],
            Some(Wgmma),
        ),
        (
            16,
            KvFormat::Fp8E4m3,
            CacheDtype::Fp8E4m3,
            1,
            &two[..],
            Some(Mma),
        ),
    ] {
        let mut s = spec(heads, 64, lengths, q_len, Mask::Causal);
        s.kv_format = kv;
        let case = Case::new(s);
        let run = warm_then_check(t, &case, dtype);
        if let Some(family) = there_for {
            let what = format!("{heads} heads x {} requests, {kv:?}", lengths.len());
            t.assert_there_for(&run, family, &what);
        }
    }
    let mut s = spec(128, 48, &long, 1, Mask::Causal);
    s.kv_format = KvFormat::Fp8E4m3;
    let run = warm_then_check(t, &Case::new(s), CacheDtype::Fp8E4m3);
    t.assert_there_for(
        &run,
        WgmmaFp8,
        "128 heads x 66 requests, fp8, pages of 48 keys",
    );
}

fn the_fp8_query_mode_takes_the_fp8_twin_on_long_splits(t: &mut Tally) {
    // 128 heads, an fp8 cache, the fp8-query mode: as shipped on Hopper the wgmma kernel takes
    // splits shorter than WGMMA_FP8Q_MIN_SPLIT_KEYS keys and the twin (fp8 wgmma for both
    // products) the longer ones (66 requests of 4200 keys: one split each, two CTAs a
    // request); both against the reference with the mode's tolerances.
    let short = [1000, 37];
    let long = [4200; 66];
    for (lengths, there_for) in [
        (&short[..], KernelFamily::Wgmma),
        (&long[..], KernelFamily::WgmmaFp8),
    ] {
        let mut s = spec(128, 64, lengths, 1, Mask::Causal);
        s.kv_format = KvFormat::Fp8E4m3;
        s.q_scale = 0.05;
        let mut case = Case::new(s);
        case.fp8_query = true;
        let run = warm_then_check(t, &case, CacheDtype::Fp8E4m3);
        let what = format!(
            "fp8 query, 128 heads x {} requests, {} keys a split",
            lengths.len(),
            run.plan.split_keys()
        );
        t.assert_there_for(&run, there_for, &what);
    }
}

fn the_configuration_turns_the_device_schedule_on(t: &mut Tally) {
    // MlaConfig::device_schedule, asked or not whatever the suite's setting: a decoder asked
    // schedules, its single-token decodes of several requests run on the device-computed
    // schedule (as shipped always: every family it picks for them has a scheduled variant),
    // right, on lengths far apart; a decoder not asked stays on the split grid. 40 requests
    // of 500 to 6350 keys at 128 heads: splits long enough for the seesaw kernel, whose
    // scheduled variant then walks the pieces (on Hopper, as shipped).
    let varied: Vec<usize> = (0..40).map(|i| 500 + 150 * i).collect();
    let few = [5000, 3, 700, 0, 64];
    for (heads, asked, lengths) in [
        (128, true, &few[..]),
        (128, true, &varied[..]),
        (16, true, &few[..]),
        (16, false, &few[..]),
    ] {
        let case = Case::new(spec(heads, 64, lengths, 1, Mask::Causal));
        let mut cfg = t.config(&case);
        cfg.device_schedule = asked;
        let mut dec = t.open_config(&cfg);
        let before = dec.cuda_backend().unwrap().scheduled_decodes();
        let run = t.check_on(&mut dec, &case);
        let what = format!("{heads} heads, asked {asked}, {}", t.kernels());
        assert_eq!(dec.schedules(), asked, "{what}");
        let launched = dec.cuda_backend().unwrap().scheduled_decodes() - before;
        assert_eq!(launched > 0, run.plan.scheduled(), "{what}");
        if t.kernels().choice == mla::KernelChoice::Auto {
            assert_eq!(run.plan.scheduled(), asked, "{what}");
        }
        if lengths == varied.as_slice() {
            t.assert_there_for(&run, KernelFamily::Seesaw, &what);
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
fn captured_decode_reads_a_new_scale(t: &mut Tally, arg: ScaleArg) {
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
    let mut dec = t.open(&case);
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
        t.count(&captured.unwrap());
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

fn decodes_run_on_a_stream_of_the_callers(t: &mut Tally) {
    let case = Case::new(spec(32, 16, &[2000, 5, 900], 2, Mask::Causal));
    let mut dec = t.open(&case);
    let side = dec.cuda_context().unwrap().new_stream().unwrap();
    dec.set_cuda_stream(side.clone()).unwrap();
    assert_eq!(gpu::stream(&dec).cu_stream(), side.cu_stream());
    t.check_on(&mut dec, &case);
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
