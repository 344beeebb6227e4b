//! On the GPU: a NaN in q or in a key that is read makes that (row, head)'s o and lse NaN, as
//! the f64 reference's are (never lse = -inf, which a later LSE merge would drop), whatever
//! the split count, for each cache format; one in a key that is not read changes nothing.
//! Skips, saying why, where there is no GPU or no `cuda` feature.

#[cfg(feature = "cuda")]
mod common;

#[cfg(feature = "cuda")]
mod on_gpu {
    use super::common::nan::{assert_nan_where_the_reference_is, nan_problem};
    use super::common::{LSE_TOL, O_TOL, cache_dtype, gpu};
    use mla::reference;
    use mla::synth::device::DeviceOutputs;
    use mla::{KvFormat, MlaConfig, ModelDtype};

    #[test]
    fn a_nan_read_gives_a_nan_lse_not_minus_infinity() {
        // 16 heads (the narrow kernels) and 128 (the wide ones); the rule's split count and
        // fixed ones, so that the combine merges NaN partials with finite and empty ones.
        for heads in [16, 128] {
            for (model, kv) in [
                (ModelDtype::Bf16, KvFormat::Bf16),
                (ModelDtype::F16, KvFormat::F16),
                (ModelDtype::Bf16, KvFormat::Fp8E4m3),
            ] {
                let p = nan_problem(heads, model, kv);
                for splits in [None, Some(1), Some(7)] {
                    let mut cfg = MlaConfig::new(heads, 192f32.powf(-0.5));
                    cfg.model_dtype = model;
                    cfg.kv_cache_dtype = cache_dtype(kv);
                    cfg.num_kv_splits = splits;
                    let Some(mut dec) = gpu::open(&cfg) else {
                        return;
                    };
                    let s = gpu::stream(&dec);
                    let dp = p.to_device(&s).unwrap();
                    let mut out = DeviceOutputs::poisoned(&s, &p).unwrap();
                    let plan = dec
                        .forward(&dp.inputs(&p, false).unwrap(), &mut out.views().unwrap())
                        .unwrap();
                    dec.check_device_errors().unwrap();
                    let (o, lse) = out.download(&s).unwrap();
                    let r =
                        reference::decode_f64(dec.config(), &p.inputs().unwrap(), None).unwrap();
                    assert_nan_where_the_reference_is(
                        &r,
                        &o,
                        &lse,
                        O_TOL,
                        LSE_TOL,
                        &format!(
                            "{heads} heads, {model:?} q, {kv:?} cache, {} splits ({})",
                            plan.num_kv_splits,
                            dec.kernel_name(&plan)
                        ),
                    );
                }
            }
        }
    }
}
