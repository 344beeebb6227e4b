//! The CPU backend against the f64 reference: hand-written cases for each feature, then
//! property tests over random shapes, lengths, masks, windows and dtypes.

mod common;

use common::{Case, Drawn, assert_accurate, cpu_kernels, formats, run_case, spec};
use mla::reference::{self, Reference};
use mla::synth::{CacheBuf, Outputs, Problem, ProblemSpec};
use mla::{CpuKernel, Device, Error, KvFormat, Mask, MlaDecode, ModelDtype};
use proptest::prelude::*;

#[test]
fn every_cache_format_is_accurate() {
    for (model, kv) in formats() {
        let s = spec(16, 64, &[700, 1500, 33], 1, Mask::Causal).with_format(model, kv);
        let case = Case::new(s);
        let r = run_case(&case, Device::Cpu);
        assert_accurate(&case, r.accuracy);
    }
}

#[test]
fn multi_token_rows_causal_and_not() {
    for mask in [Mask::Causal, Mask::NonCausal] {
        for q_len in [2, 3, 4] {
            let case = Case::new(spec(8, 16, &[2, 1, 0, 900, 77], q_len, mask));
            let r = run_case(&case, Device::Cpu);
            assert_accurate(&case, r.accuracy);
        }
    }
}

#[test]
fn causal_rows_differ_from_non_causal_rows() {
    // The same problem under both masks: the last token of each request sees the same keys,
    // the earlier ones see fewer keys when causal.
    let causal = run_case(
        &Case::new(spec(4, 16, &[50, 90], 3, Mask::Causal)),
        Device::Cpu,
    );
    let full = run_case(
        &Case::new(spec(4, 16, &[50, 90], 3, Mask::NonCausal)),
        Device::Cpu,
    );
    let (lc, lf) = (&causal.outputs.lse, &full.outputs.lse);
    let heads = 4;
    for request in 0..2 {
        let last = (request * 3 + 2) * heads;
        assert_eq!(lc[last..last + heads], lf[last..last + heads]);
        let first = request * 3 * heads;
        assert_ne!(lc[first..first + heads], lf[first..first + heads]);
    }
}

#[test]
fn sliding_window_rows() {
    for (w, q_len) in [(1, 1), (64, 1), (100, 3), (5000, 2)] {
        let mut case = Case::new(spec(16, 16, &[1000, 10, 0, 257], q_len, Mask::Causal));
        case.window = Some(w);
        let r = run_case(&case, Device::Cpu);
        assert_accurate(&case, r.accuracy);
    }
}

#[test]
fn a_plan_knows_the_keys_of_its_longest_split() {
    // The longest length, cut by the window, over the split count (rounded up): the Hopper
    // backend picks its many-head kernel by it.
    for (window, splits, want) in [
        (None, 1, 1000),
        (None, 3, 334),
        (Some(100), 3, 34),
        (Some(5000), 7, 143),
    ] {
        let mut case = Case::new(spec(4, 16, &[1000, 10, 0], 1, Mask::Causal));
        case.window = window;
        case.fixed_splits = Some(splits);
        let r = run_case(&case, Device::Cpu);
        assert_eq!(
            (r.num_kv_splits, r.split_keys),
            (splits, want),
            "{window:?}"
        );
        assert_accurate(&case, r.accuracy);
    }
}

#[test]
fn many_splits_with_empty_ones() {
    // 40000 keys -> 128 splits; the 8-key and 1-key rows leave most of theirs empty.
    let mut case = Case::new(spec(4, 3, &[8, 40_000, 1], 1, Mask::Causal));
    case.split_units = Some(132);
    let r = run_case(&case, Device::Cpu);
    assert_eq!(r.num_kv_splits, 128);
    assert_accurate(&case, r.accuracy);
}

#[test]
fn every_fixed_split_count_gives_the_same_rows() {
    // The split count only cuts the work: 1 to 600 splits of 500 keys (most of them empty
    // past 500) all match the reference, and each plan uses the count asked for.
    for n in [1, 2, 7, 64, 600] {
        let mut case = Case::new(spec(4, 16, &[500, 3, 0], 2, Mask::Causal));
        case.fixed_splits = Some(n);
        let r = run_case(&case, Device::Cpu);
        assert_eq!(r.num_kv_splits, n);
        assert_accurate(&case, r.accuracy);
    }
}

/// Lengths at the edges on purpose: 0, 1, and either side of page boundaries (16, 64), the
/// GPU kernels' 64-key tiles, the CPU backend's softmax steps (`KEY_CHUNK`, 256) and the split
/// rule's 512 keys a split.
const EDGE_LENS: &[usize] = &[
    0, 1, 2, 15, 16, 17, 63, 64, 65, 127, 128, 129, 255, 256, 257, 511, 512, 513, 1023, 1024, 1025,
];

#[test]
fn lengths_at_page_tile_and_split_edges() {
    for page in [1, 16, 64] {
        // One cache for the three query shapes (it is most of the work: 21 requests of up to
        // 1025 keys), one reference for both split rules.
        let cache = Drawn::new(&spec(2, page, EDGE_LENS, 1, Mask::Causal), |_| {});
        for (q_len, mask) in [(1, Mask::Causal), (3, Mask::Causal), (2, Mask::NonCausal)] {
            let drawn = Drawn::of(cache.problem().with_queries(q_len, mask).unwrap());
            let case = Case::new(drawn.problem().spec.clone());
            for split_units in [None, Some(8)] {
                let case = Case {
                    split_units,
                    ..case.clone()
                };
                assert_accurate(&case, drawn.run(&case, Device::Cpu, |_| {}).accuracy);
            }
        }
    }
}

/// Keys with a few huge elements, at positions that make a row's running maximum jump late
/// (past the first softmax step, in a later split) and early: `(request, key)`.
const OUTLIERS: &[(usize, usize)] = &[(1, 290), (2, 3), (2, 600), (3, 1299), (3, 257), (3, 700)];

#[test]
fn large_scores_and_outlier_keys() {
    // Scales 20 and 50 times DeepSeek's 192^-0.5 and keys with elements of +-8 (the drawn
    // ones are ~0.5): scores of about 100 apart, so that a softmax that mishandles its running
    // maximum (a rescale skipped, a stale maximum) overflows or weighs the wrong keys.
    let base = 192f32.powf(-0.5);
    for (model, kv) in formats() {
        let case =
            Case::new(spec(4, 16, &[1, 300, 700, 1300], 1, Mask::Causal).with_format(model, kv));
        // One problem for both scales, one reference for each scale's three split counts.
        let drawn = Drawn::new(&case.spec, |p| {
            for (i, &(request, key)) in OUTLIERS.iter().enumerate() {
                let sign = if i % 2 == 0 { 8.0 } else { -8.0 };
                for col in [0, 5, 300, 520] {
                    p.set_key(request, key, col, sign).unwrap();
                }
            }
        });
        for factor in [20.0, 50.0] {
            for fixed_splits in [None, Some(1), Some(5)] {
                let case = Case {
                    fixed_splits,
                    ..case.clone()
                };
                let r = drawn.run(&case, Device::Cpu, |c| c.scale = base * factor);
                assert_accurate(&case, r.accuracy);
            }
        }
    }
}

#[test]
fn zero_length_rows_give_zero_and_minus_infinity() {
    let case = Case::new(spec(3, 16, &[0, 5, 0], 2, Mask::Causal));
    let r = run_case(&case, Device::Cpu);
    let (o, lse) = (r.outputs.o.to_f32(), &r.outputs.lse);
    let (h, l) = (3, 512);
    // Request 0: both rows empty. Request 1, token 0 sees 4 keys. Request 2: empty.
    for row in [0, 1, 4, 5] {
        assert!(
            lse[row * h..(row + 1) * h]
                .iter()
                .all(|&x| x == f32::NEG_INFINITY),
            "row {row}"
        );
        assert!(
            o[row * h * l..(row + 1) * h * l].iter().all(|&x| x == 0.0),
            "row {row}"
        );
    }
    assert!(lse[2 * h..4 * h].iter().all(|x| x.is_finite()));
    assert_accurate(&case, r.accuracy);
}

#[test]
fn split_query_equals_packed_query_bitwise() {
    let mut case = Case::new(spec(16, 64, &[600, 1300], 2, Mask::NonCausal));
    let packed = run_case(&case, Device::Cpu);
    case.split_q = true;
    let split = run_case(&case, Device::Cpu);
    assert_eq!(packed.outputs.o.to_f32(), split.outputs.o.to_f32());
    assert_eq!(packed.outputs.lse, split.outputs.lse);
}

#[test]
fn padded_cache_strides() {
    let mut s = spec(8, 16, &[300, 301], 1, Mask::Causal);
    s.token_pad = 8;
    s.page_pad = 100;
    s.kv_format = KvFormat::Fp8E4m3;
    s.k_scale = 0.25;
    let case = Case::new(s);
    assert_accurate(&case, run_case(&case, Device::Cpu).accuracy);
}

#[test]
fn other_latent_shapes() {
    // Every dimension is a parameter: DeepSeek-V2-Lite style heads, odd widths.
    for (l, r) in [(512, 64), (256, 32), (100, 28), (8, 0)] {
        let mut s = spec(5, 7, &[90, 31], 1, Mask::Causal);
        s.kv_lora_rank = l;
        s.rope_dim = r;
        let case = Case::new(s);
        assert_accurate(&case, run_case(&case, Device::Cpu).accuracy);
    }
}

#[test]
fn bf16_split_kv_error_is_in_the_expected_range() {
    // DeepSeek-V3 shapes as the benchmark draws them: vLLM's kernel and FlashMLA land near
    // 2e-3 here; we must not be worse than the tolerance and should not be far from them.
    let case = Case::new(ProblemSpec::new(128, vec![4096, 3000]));
    let r = run_case(&case, Device::Cpu);
    assert_accurate(&case, r.accuracy);
    assert!(
        r.accuracy.o_rel > 1e-4,
        "bf16 rounding of P must show: {:?}",
        r.accuracy
    );
}

fn formats_strategy() -> impl Strategy<Value = (ModelDtype, KvFormat)> {
    proptest::sample::select(formats())
}

prop_compose! {
    /// A random case whose reference costs at most about 1.5M (row, head, key) triples.
    fn any_case()(
        heads in 1usize..=128,
        requests in 1usize..=4,
        q_len in 1usize..=4,
        page in proptest::sample::select(vec![1usize, 3, 16, 64]),
        (model, kv) in formats_strategy(),
        k_scale in proptest::sample::select(vec![0.25f32, 0.5, 1.0]),
        causal in any::<bool>(),
        window in proptest::option::weighted(0.3, 1usize..2000),
        batch_invariant in proptest::bool::weighted(0.2),
        split_q in any::<bool>(),
        split_units in proptest::option::of(1usize..=132),
        fixed_splits in proptest::option::weighted(0.2, 1usize..=40),
        fp8_query in any::<bool>(),
        q_scale in proptest::sample::select(vec![1.0f32 / 64.0, 0.01, 1.0]),
        pads in (0usize..3, 0usize..70),
        len_draws in proptest::collection::vec(0.0f64..1.0, 4),
        // Half the lengths at an edge on purpose (EDGE_LENS, within the case's budget).
        edges in proptest::collection::vec(
            proptest::option::of(proptest::sample::select(EDGE_LENS.to_vec())),
            4,
        ),
        seed in any::<u64>(),
    ) -> Case {
        let max_len = (1_500_000 / (heads * requests * q_len)).clamp(1, 3000);
        let lens: Vec<usize> = len_draws[..requests]
            .iter()
            .zip(&edges)
            .map(|(u, edge)| edge.map_or((u * max_len as f64) as usize, |e| e.min(max_len)))
            .collect();
        let mut s = spec(heads, page, &lens, q_len, if causal { Mask::Causal } else { Mask::NonCausal });
        s.model_dtype = model;
        s.kv_format = kv;
        s.k_scale = k_scale;
        s.q_scale = q_scale;
        s.token_pad = pads.0 * 8;
        s.page_pad = pads.1;
        s.seed = seed;
        // A fixed count above 1 contradicts batch-invariant mode (a config error).
        let fixed_splits = fixed_splits.filter(|_| !batch_invariant);
        // The fp8-query mode needs an fp8 cache.
        let fp8_query = fp8_query && kv.is_fp8();
        Case { spec: s, window, batch_invariant, split_q, split_units, fixed_splits, fp8_query, cpu_kernel: CpuKernel::Auto }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// The CPU backend with its own pick of path, then each path this CPU has, forced: all
    /// against the one reference of the drawn case. The bf16-product paths (AVX-512 BF16,
    /// AMX-BF16) take the configurations whose multiplied values are bf16 numbers and refuse
    /// the others with an error naming `cpu_kernel`.
    #[test]
    fn cpu_backend_and_every_path_match_the_f64_reference(case in any_case()) {
        let drawn = Drawn::new(&case.spec, |_| {});
        for kernel in std::iter::once(CpuKernel::Auto).chain(cpu_kernels()) {
            let case = Case { cpu_kernel: kernel, ..case.clone() };
            let bf16_values = case.spec.model_dtype == ModelDtype::Bf16 && !case.fp8_query;
            let bf16_products = matches!(kernel, CpuKernel::Avx512Bf16 | CpuKernel::AmxBf16);
            if bf16_products && !bf16_values {
                let e = MlaDecode::new(&case.config(), Device::Cpu).unwrap_err();
                prop_assert!(
                    matches!(e, Error::InvalidConfig { field: "cpu_kernel", .. }),
                    "{e}"
                );
                continue;
            }
            let r = drawn.run(&case, Device::Cpu, |_| {});
            let (o_tol, lse_tol) = case.tolerances();
            prop_assert!(
                r.accuracy.o_rel <= o_tol && r.accuracy.lse_abs <= lse_tol,
                "{:?} on {kernel} for {:#?}", r.accuracy, case
            );
            if case.batch_invariant {
                prop_assert_eq!(r.num_kv_splits, 1);
            }
            if let Some(n) = case.fixed_splits {
                prop_assert_eq!(r.num_kv_splits, n);
            }
        }
    }
}

/// The fp8-query mode written out from docs/contract.md in f64, for single-token rows whose
/// keys fit one chunk of the CPU backend (P's running maximum is then the row's): q as
/// `e4m3(q / q_scale)`, the cache's raw codes, scores `scale q_scale k_scale q8 . k8`,
/// `P = exp(s - max)`, P times 256 rounded to e4m3 for `P V`, the row sum of the unrounded P,
/// `o = k_scale / 256 * sum(P8 v8) / sum(P)`. Returns (o `[rows, H, L]`, lse `[rows, H]`).
fn fp8_query_model(p: &Problem, scale: f64) -> (Vec<f64>, Vec<f64>) {
    use float8::{F8E4M3, F8E5M2};
    let s = &p.spec;
    assert_eq!(s.query_len, 1);
    let (h, l, d) = (s.heads, s.kv_lora_rank, p.head_dim());
    let q = p.q.to_f32();
    let CacheBuf::Fp8(codes, _) = &p.kv else {
        panic!("an fp8 cache")
    };
    let value = |b: u8| match s.kv_format {
        KvFormat::Fp8E4m3 => F8E4M3::from_bits(b).to_f64(),
        _ => F8E5M2::from_bits(b).to_f64(),
    };
    let e4m3 = |x: f64| F8E4M3::from_f64(x).to_f64();
    let (token_stride, page_stride) = s.strides();
    let key = |row: usize, pos: usize| {
        let block = p.block_table[row * p.max_blocks + pos / s.page_size] as usize;
        let at = block * page_stride + (pos % s.page_size) * token_stride;
        &codes[at..at + d]
    };
    let (mut o, mut lse) = (
        vec![0f64; p.rows() * h * l],
        vec![f64::NEG_INFINITY; p.rows() * h],
    );
    let (qs, ks) = (s.q_scale as f64, s.k_scale as f64);
    for row in 0..p.rows() {
        let len = p.seq_lens[row] as usize;
        assert!(len <= 256, "the model needs one chunk of keys");
        for head in 0..h {
            let q8: Vec<f64> = q[(row * h + head) * d..][..d]
                .iter()
                .map(|&x| e4m3((x / s.q_scale) as f64))
                .collect();
            let scores: Vec<f64> = (0..len)
                .map(|j| {
                    let dot: f64 = key(row, j)
                        .iter()
                        .zip(&q8)
                        .map(|(&b, &x)| value(b) * x)
                        .sum();
                    scale * qs * ks * dot
                })
                .collect();
            if len == 0 {
                continue;
            }
            let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let p_exact: Vec<f64> = scores.iter().map(|&x| (x - m).exp()).collect();
            let sum: f64 = p_exact.iter().sum();
            let out = &mut o[(row * h + head) * l..][..l];
            for (j, &pj) in p_exact.iter().enumerate() {
                let p8 = e4m3(pj * 256.0);
                for (c, &b) in key(row, j)[..l].iter().enumerate() {
                    out[c] += p8 * value(b);
                }
            }
            out.iter_mut().for_each(|x| *x *= ks / 256.0 / sum);
            lse[row * h + head] = m + sum.ln();
        }
    }
    (o, lse)
}

#[test]
fn the_fp8_query_mode_computes_what_the_contract_says() {
    // Against its own numerics written out in f64 (above), it differs by the output's
    // rounding to the model dtype only: a missed scale, P rounded to the model dtype instead
    // of e4m3, or P not scaled before it would each show far above these bounds.
    for (model, kv, o_tol) in [
        (ModelDtype::F16, KvFormat::Fp8E4m3, 4e-4),
        (ModelDtype::Bf16, KvFormat::Fp8E4m3, 2.5e-3),
        (ModelDtype::F16, KvFormat::Fp8E5m2, 4e-4),
    ] {
        // A larger softmax scale spreads P over many binades (most below e4m3's 2^-6).
        for (q_scale, softmax_scale) in [(1.0 / 64.0, 192f32.powf(-0.5)), (0.3, 0.3)] {
            let mut s = spec(16, 16, &[1, 2, 5, 16, 40, 255, 256, 0], 1, Mask::Causal)
                .with_format(model, kv);
            s.q_scale = q_scale;
            let mut case = Case::new(s);
            case.fp8_query = true;
            case.fixed_splits = Some(1);
            let p = Problem::generate(&case.spec).unwrap();
            let mut cfg = case.config();
            cfg.scale = softmax_scale;
            let mut dec = MlaDecode::new(&cfg, Device::Cpu).unwrap();
            let mut out = Outputs::poisoned(&p);
            let inputs = p.inputs().unwrap();
            dec.forward(&inputs, &mut out.views().unwrap()).unwrap();
            let exact = reference::decode_f64(dec.config(), &inputs, None).unwrap();
            let (o, lse) = fp8_query_model(&p, softmax_scale as f64);
            let model_ref = Reference {
                rows: p.rows(),
                heads: case.spec.heads,
                kv_lora_rank: case.spec.kv_lora_rank,
                o,
                lse,
            };
            let got = model_ref.accuracy(&out.o.to_f32(), &out.lse);
            assert!(
                got.o_rel <= o_tol && got.lse_abs <= 1e-5,
                "{model:?} {kv:?} q_scale {q_scale}: {got:?} against the written-out mode"
            );
            // And the mode is less exact than exact attention, as the rounding of q and P
            // makes it.
            let vs_exact = exact.accuracy(&out.o.to_f32(), &out.lse);
            assert!(vs_exact.o_rel > 5.0 * got.o_rel, "{vs_exact:?}");
        }
    }
}

#[test]
fn the_fp8_query_mode_error_on_deepseek_shapes() {
    // What docs/contract.md records: about 3e-2 (FlashMLA's fp8 path, which quantizes q too,
    // shows the same), against 1.9e-3 for a bf16 q over the same cache.
    for kv in [KvFormat::Fp8E4m3, KvFormat::Fp8E5m2] {
        let mut case =
            Case::new(ProblemSpec::new(128, vec![4096, 3000]).with_format(ModelDtype::Bf16, kv));
        case.fp8_query = true;
        let r = run_case(&case, Device::Cpu);
        eprintln!(
            "fp8-query mode, {kv:?} cache, 128 heads, 4096 and 3000 keys: {:?}",
            r.accuracy
        );
        assert_accurate(&case, r.accuracy);
        assert!((1e-2..4e-2).contains(&r.accuracy.o_rel), "{:?}", r.accuracy);
    }
}
