use super::*;
use crate::config::MlaConfig;
use crate::dtype::{CacheDtype, KvFormat, ModelDtype};
use crate::error::Capability;
use crate::kernels::variant::{Grid, Rows};

use KernelFamily::{Mma, Narrow, Seesaw, Wgmma, WgmmaFp8};

/// A GPU of 132 SMs and an H200's shared memory, Hopper or not.
fn gpu(hopper: bool) -> Gpu {
    Gpu {
        hopper,
        smem_limit: 232_448,
        sm_count: 132,
    }
}

fn cache(kv: KvFormat) -> CacheDtype {
    match kv {
        KvFormat::Bf16 => CacheDtype::Bf16,
        KvFormat::F16 => CacheDtype::F16,
        KvFormat::Fp8E4m3 => CacheDtype::Fp8E4m3,
        KvFormat::Fp8E5m2 => CacheDtype::Fp8E5m2,
    }
}

/// The kernels of a decoder of `heads` heads over a `kv` cache, the model in bf16.
fn set_with(
    heads: usize,
    kv: KvFormat,
    hopper: bool,
    choice: KernelChoice,
    f: impl Fn(&mut MlaConfig),
) -> KernelSet {
    let mut c = MlaConfig::new(heads, 0.1);
    c.kv_cache_dtype = cache(kv);
    c.tuning.kernel = choice;
    f(&mut c);
    let device = DeviceInfo::Cuda {
        name: "Test GPU".into(),
        capability: Capability { major: 9, minor: 0 },
        sm_count: 132,
        smem_per_block: 232_448,
    };
    let cfg = c.validate(&device).unwrap();
    let fills = !cfg.batch_invariant && cfg.num_kv_splits.is_none();
    KernelSet::for_decoder(&cfg, gpu(hopper), fills).unwrap()
}

fn set(heads: usize, kv: KvFormat, hopper: bool, choice: KernelChoice) -> KernelSet {
    set_with(heads, kv, hopper, choice, |_| {})
}

fn auto(heads: usize) -> KernelSet {
    set(heads, KvFormat::Bf16, true, KernelChoice::Auto)
}

fn only(heads: usize, family: KernelFamily) -> KernelSet {
    set(heads, KvFormat::Bf16, true, KernelChoice::Only(family))
}

/// The pick of a split-grid decode over pages of `page` keys whose splits hold `split_keys`
/// keys, with no CTA count (so the narrow kernel's single tokens never fill a wave).
fn launch(s: &KernelSet, heads: usize, q: usize, page: usize, split_keys: usize) -> Pick {
    s.pick(&Call {
        heads,
        query_len: q,
        page_size: page,
        split_keys,
        ctas: 0,
        scheduled: false,
    })
}

/// (family, packed, tokens a CTA).
fn what(p: Pick) -> (KernelFamily, bool, usize) {
    (p.family(), p.variant.rows == Rows::PackedTokens, p.tokens)
}

#[test]
fn hopper_takes_wgmma_from_17_heads_for_every_cache() {
    // heads, cache, sm_90a, choice -> the decoder's own kernel: many heads and every cache
    // format take wgmma on Hopper; 16 heads, mma forced and earlier GPUs take mma.
    use KvFormat::{Bf16, F16, Fp8E4m3};
    for (heads, kv, hopper, choice, want) in [
        (128, Bf16, true, KernelChoice::Auto, Wgmma),
        (64, Bf16, true, KernelChoice::Auto, Wgmma),
        (32, Bf16, true, KernelChoice::Auto, Wgmma),
        (17, Bf16, true, KernelChoice::Auto, Wgmma),
        (16, Bf16, true, KernelChoice::Auto, Mma),
        (16, Bf16, true, KernelChoice::Only(Wgmma), Wgmma),
        (128, Bf16, true, KernelChoice::Only(Mma), Mma),
        (128, Fp8E4m3, true, KernelChoice::Auto, Wgmma),
        (128, F16, true, KernelChoice::Auto, Wgmma),
        (128, Bf16, false, KernelChoice::Auto, Mma),
        (128, Bf16, false, KernelChoice::Only(Seesaw), Mma),
    ] {
        let s = set(heads, kv, hopper, choice);
        assert_eq!(
            s.decode.family.stage1(),
            Some(want),
            "{heads} {kv:?} {hopper} {choice:?}"
        );
    }
}

#[test]
fn few_heads_pack_query_tokens_into_the_wgmma_tile_on_hopper() {
    let short = SEESAW_MIN_SPLIT_KEYS - 1;
    // heads, query_len -> what launches on sm_90a (auto) in splits shorter than the seesaw
    // kernel takes.
    for (heads, q, want) in [
        (16, 1, (Mma, false, 1)), // one token: mma.sync, as fast or faster
        (8, 1, (Mma, false, 1)),
        (16, 2, (Wgmma, true, 2)),
        (16, 4, (Wgmma, true, 4)),
        (16, 8, (Wgmma, true, 4)),  // 64 rows: two token blocks a request
        (8, 2, (Narrow, false, 2)), // 16 rows: the narrow kernel's
        (8, 3, (Wgmma, true, 3)),
        (4, 4, (Narrow, false, 4)),
        (1, 8, (Narrow, false, 8)),
        (1, 12, (Narrow, false, 12)), // 12 rows: the wgmma tile needs 17
        (1, 30, (Wgmma, true, 30)),
        (20, 1, (Wgmma, false, 1)),
        (20, 3, (Wgmma, true, 3)),
        (32, 2, (Wgmma, true, 2)),
        (33, 2, (Wgmma, false, 1)),
        (128, 4, (Wgmma, false, 1)),
    ] {
        let p = launch(&auto(heads), heads, q, 64, short);
        assert_eq!(what(p), want, "{heads} heads, {q} tokens");
    }
    // Pages the narrow kernel does not tile take the decoder's own kernel.
    for page in [1, 4, 24, 48, 100] {
        let p = launch(&auto(8), 8, 2, page, 1);
        assert_eq!((p.family(), p.tokens), (Mma, 1), "page {page}");
    }
    for page in [8, 16, 32, 64, 128, 256] {
        assert_eq!(
            launch(&auto(8), 8, 2, page, 1).family(),
            Narrow,
            "page {page}"
        );
    }
    // Nor the other 16-bit type; fp8 caches take it.
    let f16 = set(8, KvFormat::F16, true, KernelChoice::Auto);
    assert_eq!(launch(&f16, 8, 2, 64, 1).family(), Mma);
    let fp8 = set(8, KvFormat::Fp8E4m3, true, KernelChoice::Auto);
    assert_eq!(launch(&fp8, 8, 2, 64, 1).family(), Narrow);
    // Narrow forced: single tokens of up to 16 heads too; packing still comes first. mma
    // forced never packs; wgmma forced runs the wgmma kernel everywhere and packs as auto
    // does; before Hopper there is no wgmma kernel.
    // (forced family, heads, query_len) -> (family, packed, tokens a CTA).
    for (family, heads, q, want) in [
        (Narrow, 16, 1, (Narrow, false, 1)),
        (Narrow, 5, 2, (Narrow, false, 2)),
        (Narrow, 16, 4, (Wgmma, true, 4)),
        (Narrow, 17, 1, (Wgmma, false, 1)),
        (Mma, 16, 4, (Mma, false, 1)),
        (Mma, 16, 1, (Mma, false, 1)),
        (Wgmma, 16, 1, (Wgmma, false, 1)),
        (Wgmma, 4, 4, (Wgmma, false, 1)),
        (Wgmma, 4, 100, (Wgmma, true, 16)),
    ] {
        let p = launch(&only(heads, family), heads, q, 64, short);
        assert_eq!(what(p), want, "{family:?} forced, {heads} x {q}");
    }
    let sm80 = set(16, KvFormat::Bf16, false, KernelChoice::Auto);
    assert_eq!(what(launch(&sm80, 16, 4, 64, short)), (Mma, false, 1));
    // Warmup builds what can launch: the packed variants (wgmma and seesaw) for up to 32
    // heads on Hopper, the narrow kernel for up to 8 (16 forced, and as shipped at 16 over a
    // cache in the model dtype for single tokens), the seesaw kernel from 16; and the combine.
    let count = |s: KernelSet| s.variants().len();
    assert_eq!(
        (
            count(auto(8)),
            count(auto(16)),
            count(auto(32)),
            count(auto(33))
        ),
        (5, 6, 5, 3)
    );
    assert_eq!(count(only(16, Narrow)), 4);
    assert_eq!(count(sm80), 2);
    assert!(
        auto(16)
            .packed
            .unwrap()
            .defines()
            .contains(&"-DMLA_PACK=1".to_string())
    );
}

#[test]
fn the_narrow_kernel_takes_the_16_head_single_tokens_whose_grid_it_fills() {
    // As shipped at 16 heads over a cache in the model dtype (not fp8, not the other 16-bit
    // type, not in the fp8-query mode), nowhere else, forced or not.
    assert!(auto(16).narrow_singles);
    for kv in [KvFormat::Fp8E4m3, KvFormat::F16] {
        let s = set(16, kv, true, KernelChoice::Auto);
        assert!(s.narrow.is_none() && !s.narrow_singles, "{kv:?}");
    }
    let q8 = set_with(16, KvFormat::Fp8E4m3, true, KernelChoice::Auto, |c| {
        c.fp8_query = true
    });
    assert!(!q8.narrow_singles && q8.narrow.is_none());
    for family in KernelFamily::ALL {
        assert!(!only(16, family).narrow_singles, "{family}");
    }
    assert!(!set(16, KvFormat::Bf16, false, KernelChoice::Auto).narrow_singles);
    assert!(auto(17).narrow.is_none());
    // Built at 8 heads for multi-token rows, it takes no single tokens there.
    let eight = auto(8);
    assert!(eight.narrow.is_some() && !eight.narrow_singles);
    // 16 heads, one token, splits of 256 keys or more in whole 64-key tiles, CTAs filling
    // each wave to 90% of 132 SMs (at least 119 of them).
    assert!(narrow_single(16, 1, 256, 128, 132));
    assert!(narrow_single(16, 1, 1024, 119, 132));
    assert!(!narrow_single(16, 1, 1024, 118, 132));
    assert!(
        narrow_single(16, 1, 512, 384, 132),
        "three waves, 384 of 396 slots"
    );
    assert!(
        !narrow_single(16, 1, 512, 300, 132),
        "three waves, 300 of 396 slots"
    );
    assert!(!narrow_single(16, 1, 192, 128, 132), "too short");
    assert!(!narrow_single(16, 1, 373, 132, 132), "not whole tiles");
    assert!(!narrow_single(16, 2, 256, 128, 132), "two tokens");
    assert!(!narrow_single(8, 1, 256, 128, 132), "8 heads");
    assert!(!narrow_single(16, 1, 1024, 0, 132));
    // The pick: with the CTAs, on pages it tiles, not on a scheduled decode.
    let s = auto(16);
    let call = |ctas, page, scheduled| Call {
        heads: 16,
        query_len: 1,
        page_size: page,
        split_keys: 1024,
        ctas,
        scheduled,
    };
    assert_eq!(s.pick(&call(128, 64, false)).family(), Narrow);
    assert_eq!(s.pick(&call(100, 64, false)).family(), Mma);
    assert_eq!(s.pick(&call(128, 1, false)).family(), Mma);
    let scheduled = s.pick(&call(128, 64, true));
    assert_eq!(
        (scheduled.family(), scheduled.variant.grid),
        (Mma, Grid::Scheduled)
    );
}

#[test]
fn the_seesaw_kernel_takes_many_heads_on_long_splits_and_anything_forced_on_pages_it_tiles() {
    // Forced: every head count's single tokens, and multi-token rows that neither pack into
    // the wgmma tile nor take the narrow kernel, one token a CTA, on any split length.
    for (heads, q, want) in [
        (128, 1, (Seesaw, 1)),
        (128, 4, (Seesaw, 1)),
        (64, 1, (Seesaw, 1)),
        (17, 1, (Seesaw, 1)),
        (16, 1, (Seesaw, 1)),
        (1, 1, (Seesaw, 1)),
        (16, 4, (Seesaw, 4)), // packed: one read of the keys for 4 tokens
        (16, 2, (Seesaw, 2)),
        (8, 2, (Narrow, 2)), // the narrow kernel's 16 rows
    ] {
        for split_keys in [1, 64, 511, 512, 100_000] {
            let p = launch(&only(heads, Seesaw), heads, q, 64, split_keys);
            assert_eq!(
                (p.family(), p.tokens),
                want,
                "{heads} x {q}, {split_keys} keys"
            );
        }
    }
    // As shipped: more than 64 heads on splits of at least 512 keys, 17 to 64 heads on twice
    // as long ones, 16 heads on four times as long; else the wgmma kernel (mma at 16 heads or
    // fewer).
    let long = SEESAW_MIN_SPLIT_KEYS;
    for (heads, q, split_keys, want) in [
        (128, 1, long, Seesaw),
        (128, 1, 32_768, Seesaw),
        (128, 2, long, Seesaw),
        (65, 1, long, Seesaw),
        (128, 1, long - 1, Wgmma),
        (128, 1, 191, Wgmma), // batch 1 at 8192 keys: 43 splits
        (128, 1, 1, Wgmma),
        (64, 1, 2 * long, Seesaw),
        (64, 1, 2 * long - 1, Wgmma),
        (17, 1, 2 * long, Seesaw),
        (32, 1, long, Wgmma),
        (16, 1, 4 * long, Seesaw),
        (16, 1, 4 * long - 1, Mma),
        (16, 1, long, Mma),
        (15, 1, 100_000, Mma),
        (8, 1, 100_000, Mma),
    ] {
        let p = launch(&auto(heads), heads, q, 64, split_keys);
        assert_eq!(p.family(), want, "{heads} x {q}, {split_keys} keys");
    }
    // Pages it does not tile take the decoder's own kernel.
    for (page, want) in [
        (8, Seesaw),
        (16, Seesaw),
        (32, Seesaw),
        (64, Seesaw),
        (192, Seesaw),
        (48, Wgmma),
        (12, Wgmma),
        (1, Wgmma),
    ] {
        for s in [only(128, Seesaw), auto(128)] {
            assert_eq!(launch(&s, 128, 1, page, long).family(), want, "page {page}");
        }
    }
    // Not where another family is forced, only on Hopper, only for a cache in the model dtype
    // (the keys land as the products read them) or fp8 (the codes are rewritten as f16 in
    // place), not in the fp8-query mode.
    for (kv, hopper, choice) in [
        (KvFormat::Bf16, true, KernelChoice::Only(Wgmma)),
        (KvFormat::Bf16, true, KernelChoice::Only(Narrow)),
        (KvFormat::F16, true, KernelChoice::Auto),
        (KvFormat::Bf16, true, KernelChoice::Only(Mma)),
        (KvFormat::Fp8E4m3, true, KernelChoice::Only(WgmmaFp8)),
        (KvFormat::Bf16, false, KernelChoice::Only(Seesaw)),
        (KvFormat::F16, true, KernelChoice::Only(Seesaw)),
    ] {
        let s = set(128, kv, hopper, choice);
        assert_eq!(s.seesaw, None, "{kv:?} {hopper} {choice:?}");
        assert_ne!(launch(&s, 128, 1, 64, long).family(), Seesaw);
    }
    let fp8_query = set_with(128, KvFormat::Fp8E4m3, true, KernelChoice::Auto, |c| {
        c.fp8_query = true
    });
    assert_eq!(fp8_query.seesaw, None);
    for kv in [KvFormat::Fp8E4m3, KvFormat::Fp8E5m2] {
        for choice in [KernelChoice::Auto, KernelChoice::Only(Seesaw)] {
            let s = set(128, kv, true, choice);
            assert!(s.seesaw.is_some_and(|v| v.fp8()), "{kv:?} {choice:?}");
            assert_eq!(launch(&s, 128, 1, 64, long).family(), Seesaw);
        }
    }
    // Its threshold at each head count, exactly, over either cache (fp8 from 17 heads).
    for kv in [KvFormat::Bf16, KvFormat::Fp8E4m3] {
        for heads in [128, 64, 17, 16] {
            let s = set(heads, kv, true, KernelChoice::Auto);
            let keys = seesaw_min_split_keys(heads).unwrap();
            let want = kv == KvFormat::Bf16 || heads >= FP8_SEESAW_MIN_HEADS;
            let at = launch(&s, heads, 1, 64, keys).family();
            assert_eq!(at == Seesaw, want, "{heads} {kv:?}");
            assert_ne!(launch(&s, heads, 1, 64, keys - 1).family(), Seesaw);
        }
    }
    assert_eq!(
        launch(
            &set(16, KvFormat::Fp8E4m3, true, KernelChoice::Auto),
            16,
            1,
            64,
            1 << 20
        )
        .family(),
        Mma
    );
    assert!(
        only(128, Seesaw)
            .variants()
            .contains(&only(128, Seesaw).seesaw.unwrap())
    );
}

#[test]
fn the_seesaw_kernel_packs_few_head_tokens_on_long_splits_as_shipped() {
    let long = seesaw_min_split_keys(32).unwrap();
    assert_eq!(long, 2 * SEESAW_MIN_SPLIT_KEYS);
    // (heads, tokens, keys a split) -> family; the CTA packs the tokens either way.
    for (heads, q, split_keys, want, tokens) in [
        (16, 2, long, Seesaw, 2),
        (16, 4, long, Seesaw, 4),
        (16, 8, 100_000, Seesaw, 4),
        (32, 2, long, Seesaw, 2),
        (20, 3, long, Seesaw, 3),
        (16, 2, long - 1, Wgmma, 2),
        (16, 4, 64, Wgmma, 4),
        // Under 16 heads too.
        (8, 4, long, Seesaw, 4),
        (8, 8, long, Seesaw, 8),
        (1, 30, 100_000, Seesaw, 30),
        (8, 3, long - 1, Wgmma, 3),
    ] {
        let p = launch(&auto(heads), heads, q, 64, split_keys);
        assert_eq!(
            what(p),
            (want, true, tokens),
            "{heads} x {q}, {split_keys} keys"
        );
    }
    // Pages it does not tile, and caches it does not read, keep the packed wgmma kernel.
    for page in [1, 12, 48] {
        assert_eq!(
            what(launch(&auto(16), 16, 4, page, 100_000)),
            (Wgmma, true, 4)
        );
    }
    for kv in [KvFormat::F16, KvFormat::Fp8E4m3] {
        let s = set(16, kv, true, KernelChoice::Auto);
        assert_eq!(s.packed_seesaw, None, "{kv:?}");
        assert_eq!(launch(&s, 16, 4, 64, 100_000).family(), Wgmma, "{kv:?}");
    }
    // fp8 packs into it where it is forced.
    let s = set(16, KvFormat::Fp8E4m3, true, KernelChoice::Only(Seesaw));
    assert!(s.packed_seesaw.is_some_and(|v| v.fp8()));
    assert_eq!(what(launch(&s, 16, 4, 64, 1)), (Seesaw, true, 4));
    // Forced: any split; another family forced: never.
    assert_eq!(
        what(launch(&only(16, Seesaw), 16, 2, 64, 1)),
        (Seesaw, true, 2)
    );
    for family in [Wgmma, Mma] {
        assert_eq!(only(16, family).packed_seesaw, None);
    }
    let s = auto(16);
    let v = s.packed_seesaw.unwrap();
    assert!(s.variants().contains(&v));
    assert!(crate::kernels::select::all_variants(232_448, true).contains(&v));
}

#[test]
fn the_fp8_twin_takes_long_splits_as_shipped_and_every_decode_when_forced() {
    let min = WGMMA_FP8_MIN_SPLIT_KEYS;
    for model in [ModelDtype::Bf16, ModelDtype::F16] {
        for kv in [KvFormat::Fp8E4m3, KvFormat::Fp8E5m2] {
            let with = |heads, choice| set_with(heads, kv, true, choice, |c| c.model_dtype = model);
            // Forced: every head count, query length, page size and split; warmup builds it.
            for heads in [1, 16, 17, 32, 64, 128] {
                let s = with(heads, KernelChoice::Only(WgmmaFp8));
                let twin = s.fp8.unwrap();
                assert_eq!(twin.family, Family::DecodeWgmmaFp8);
                assert!(s.variants().contains(&twin));
                for (q, page, split_keys) in [(1, 64, 4096), (1, 7, 64), (4, 16, 500)] {
                    assert_eq!(launch(&s, heads, q, page, split_keys), Pick::one(twin));
                }
            }
            // As shipped: from 17 heads, splits of at least 1024 keys, on the pages the seesaw
            // kernel does not tile (it takes the others: its fp8 path multiplies in f16 as the
            // twin does, in its two-tile order); the packed wgmma kernel keeps the tokens that
            // pack (up to 32 heads).
            let s = with(17, KernelChoice::Auto);
            assert_eq!(launch(&s, 17, 1, 7, min).family(), WgmmaFp8);
            assert_eq!(launch(&s, 17, 1, 7, min - 1).family(), Wgmma);
            assert_eq!(launch(&s, 17, 1, 64, min).family(), Seesaw);
            for page in [7, 64] {
                assert_eq!(what(launch(&s, 17, 3, page, 4 * min)), (Wgmma, true, 3));
            }
            for heads in [33, 64, 128] {
                let s = with(heads, KernelChoice::Auto);
                for (q, page) in [(1, 7), (1, 48), (3, 33)] {
                    assert_eq!(launch(&s, heads, q, page, min).family(), WgmmaFp8);
                    assert_eq!(launch(&s, heads, q, page, min - 1).family(), Wgmma);
                }
                for q in [1, 2] {
                    assert_eq!(launch(&s, heads, q, 64, min).family(), Seesaw);
                }
            }
            // 16 heads take the mma kernel, which has no twin; another family forced keeps its
            // own.
            assert_eq!(with(16, KernelChoice::Auto).fp8, None);
            for family in [Mma, Wgmma, Narrow, Seesaw] {
                for heads in [16, 64, 128] {
                    assert_eq!(with(heads, KernelChoice::Only(family)).fp8, None);
                }
            }
        }
    }
    // Not before sm_90a; in the fp8-query mode, its fp8-wgmma variant from 1024 keys.
    assert_eq!(
        set(128, KvFormat::Fp8E4m3, false, KernelChoice::Only(WgmmaFp8)).fp8,
        None
    );
    let q8 = set_with(128, KvFormat::Fp8E4m3, true, KernelChoice::Auto, |c| {
        c.fp8_query = true
    });
    let twin = q8.fp8.unwrap();
    assert_eq!(twin.query, QueryMode::Fp8);
    assert!(WGMMA_FP8Q_MIN_SPLIT_KEYS >= min);
    assert_eq!(
        launch(&q8, 128, 1, 64, WGMMA_FP8Q_MIN_SPLIT_KEYS),
        Pick::one(twin)
    );
    let short = launch(&q8, 128, 1, 64, WGMMA_FP8Q_MIN_SPLIT_KEYS - 1);
    assert_eq!(
        (short.family(), short.variant.query),
        (Wgmma, QueryMode::Fp8)
    );
    // A decoder that schedules does without the twin (it has no scheduled variant).
    let scheduling = set_with(128, KvFormat::Fp8E4m3, true, KernelChoice::Auto, |c| {
        c.device_schedule = true
    });
    assert!(scheduling.schedule && scheduling.fp8.is_none());
}

#[test]
fn the_fp8_query_mode_takes_no_narrow_kernel() {
    for choice in [KernelChoice::Auto, KernelChoice::Only(Narrow)] {
        let s = set_with(4, KvFormat::Fp8E4m3, true, choice, |c| c.fp8_query = true);
        assert_eq!(s.narrow, None);
        assert!(
            s.decode.query == QueryMode::Fp8 && s.packed.is_some_and(|p| p.query == QueryMode::Fp8)
        );
        // Few-head multi-token rows take the packed wgmma kernel or mma instead.
        let p = launch(&s, 4, 2, 64, 1);
        assert!(p.variant.query == QueryMode::Fp8 && p.family() != Narrow);
    }
    assert!(
        set(4, KvFormat::Fp8E4m3, true, KernelChoice::Auto)
            .narrow
            .is_some()
    );
}

#[test]
fn a_scheduling_decoder_runs_the_scheduled_twins_of_single_token_kernels() {
    let s = set_with(128, KvFormat::Bf16, true, KernelChoice::Auto, |c| {
        c.device_schedule = true
    });
    assert!(s.schedule);
    let call = |q, split_keys, scheduled| Call {
        heads: 128,
        query_len: q,
        page_size: 64,
        split_keys,
        ctas: 64,
        scheduled,
    };
    for (split_keys, family) in [(100, Wgmma), (4096, Seesaw)] {
        let p = s.pick(&call(1, split_keys, true));
        assert_eq!((p.family(), p.variant.grid), (family, Grid::Scheduled));
        assert!(
            s.variants().contains(&p.variant),
            "warmup builds {}",
            p.variant
        );
        let p = s.pick(&call(1, split_keys, false));
        assert_eq!((p.family(), p.variant.grid), (family, Grid::Split));
    }
    // Packed tokens keep the split grid.
    let s16 = set_with(16, KvFormat::Bf16, true, KernelChoice::Auto, |c| {
        c.device_schedule = true
    });
    let p = s16.pick(&Call {
        heads: 16,
        ..call(4, 100, true)
    });
    assert_eq!((p.tokens, p.variant.grid), (4, Grid::Split));
    // Not asked, or not the fill rule's count: no schedule.
    assert!(!auto(128).schedule);
    let fixed = set_with(128, KvFormat::Bf16, true, KernelChoice::Auto, |c| {
        c.device_schedule = true;
        c.num_kv_splits = Some(4);
    });
    assert!(!fixed.schedule);
}

#[test]
fn batch_invariant_picks_depend_on_the_decoder_and_the_call_shape_alone() {
    // Whatever the split's keys and the CTAs (what the neighbours of a row change), the pick
    // of a batch-invariant decoder is the same: the one for long splits, never the narrow
    // kernel's single tokens.
    for (heads, kv) in [
        (16, KvFormat::Bf16),
        (64, KvFormat::Bf16),
        (128, KvFormat::Bf16),
        (16, KvFormat::Fp8E4m3),
        (64, KvFormat::Fp8E4m3),
        (128, KvFormat::Fp8E4m3),
    ] {
        let s = set_with(heads, kv, true, KernelChoice::Auto, |c| {
            c.batch_invariant = true
        });
        for q in [1, 2, 4] {
            let picks: Vec<Pick> = [(1, 1), (64, 0), (1000, 128), (100_000, 400), (511, 7)]
                .into_iter()
                .map(|(split_keys, ctas)| {
                    s.pick(&Call {
                        heads,
                        query_len: q,
                        page_size: 64,
                        split_keys,
                        ctas,
                        scheduled: false,
                    })
                })
                .collect();
            assert!(
                picks.windows(2).all(|w| w[0] == w[1]),
                "{heads} heads {kv:?} x {q}: {:?}",
                picks.iter().map(|p| p.family()).collect::<Vec<_>>()
            );
        }
        // The pick is the long-split one.
        let p = s.pick(&Call {
            heads,
            query_len: 1,
            page_size: 64,
            split_keys: 1,
            ctas: 1,
            scheduled: false,
        });
        let want = match (heads, kv) {
            (16, KvFormat::Fp8E4m3) => Mma,
            _ => Seesaw,
        };
        assert_eq!(p.family(), want, "{heads} {kv:?}");
    }
}

#[test]
fn tokens_pack_where_two_fit_the_tile_next_to_the_heads() {
    // (heads, query_len) -> tokens a narrow CTA takes: two or more next to the heads, and
    // only where the wgmma kernel does not pack them (17 rows or more).
    for (heads, q, want) in [
        (8, 2, Some(2)),
        (8, 3, None), // 24 rows: the wgmma tile's
        (4, 4, Some(4)),
        (1, 12, Some(12)),
        (1, 40, None),
        (16, 2, None),
        (16, 1, None), // one token: the mma kernel
        (5, 1, None),
    ] {
        assert_eq!(narrow_tokens(heads, q), want, "{heads} heads, {q} tokens");
    }
    assert_eq!(narrow_fit(16, 1), Some(1));
    assert_eq!(narrow_fit(5, 2), Some(2));
    assert_eq!(narrow_fit(16, 4), None); // the wgmma tile packs them
    assert_eq!(narrow_fit(17, 1), None);
    assert_eq!(packing(16, 4), Some(4));
    assert_eq!(packing(16, 1), None);
    assert_eq!(packing(8, 2), None); // 16 rows
    assert_eq!(packing(20, 7), Some(3));
    for page in [8, 16, 32, 64, 128, 1024] {
        assert!(tma_pages(page), "{page}");
    }
    for page in [1, 4, 12, 24, 48, 96] {
        assert!(!tma_pages(page), "{page}");
    }
}

#[test]
fn a_pick_counts_the_ctas_the_backend_launches() {
    // 64 requests x 4 tokens x 16 heads: 64 CTAs a split packed (one a request), 256 of 16
    // rows on the mma kernel; 128 heads: two CTAs a token.
    let packed = launch(&auto(16), 16, 4, 64, 100);
    assert_eq!(packed.ctas_per_split(256, 4, 16), 64);
    let mma = launch(&only(16, Mma), 16, 4, 64, 100);
    assert_eq!(mma.ctas_per_split(256, 4, 16), 256);
    let wide = launch(&auto(128), 128, 4, 64, 100);
    assert_eq!(wide.ctas_per_split(8, 4, 128), 16);
    // 20 heads x 7 tokens: 3 tokens a CTA, 3 CTAs a request.
    let p = launch(&auto(20), 20, 7, 64, 100);
    assert_eq!((p.tokens, p.ctas_per_split(14, 7, 20)), (3, 6));
}
