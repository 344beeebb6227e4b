//! A NaN in q or in a key that is read makes that (row, head)'s o and lse NaN, as the f64
//! reference's are, whatever the split count; one in a key that is not read changes nothing.

mod common;

use common::nan::{assert_nan_where_the_reference_is, nan_problem};
use common::{LSE_TOL, O_TOL, cache_dtype};
use mla::reference;
use mla::synth::Outputs;
use mla::{Device, KvFormat, MlaConfig, MlaDecode, ModelDtype};

#[test]
fn a_nan_read_gives_a_nan_lse_not_minus_infinity() {
    let heads = 16;
    for (model, kv) in [
        (ModelDtype::Bf16, KvFormat::Bf16),
        (ModelDtype::F16, KvFormat::F16),
        (ModelDtype::Bf16, KvFormat::Fp8E4m3),
    ] {
        let p = nan_problem(heads, model, kv);
        for splits in [1, 2, 7] {
            let mut cfg = MlaConfig::new(heads, 192f32.powf(-0.5));
            cfg.model_dtype = model;
            cfg.kv_cache_dtype = cache_dtype(kv);
            cfg.num_kv_splits = Some(splits);
            let mut dec = MlaDecode::new(&cfg, Device::Cpu).unwrap();
            let inputs = p.inputs().unwrap();
            let mut out = Outputs::poisoned(&p);
            dec.forward(&inputs, &mut out.views().unwrap()).unwrap();
            let r = reference::decode_f64(dec.config(), &inputs, None).unwrap();
            assert_nan_where_the_reference_is(
                &r,
                &out.o.to_f32(),
                &out.lse,
                O_TOL,
                LSE_TOL,
                &format!("{model:?} q, {kv:?} cache, {splits} splits"),
            );
        }
    }
}
