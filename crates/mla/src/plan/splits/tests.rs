use super::*;
use crate::config::{DeviceInfo, MlaConfig};
use crate::dtype::CacheDtype;
use crate::error::Capability;
use crate::kernels::{KernelChoice, KernelFamily};
use crate::plan::kernel::Gpu;

/// The fill rule of a GPU of 132 SMs (L = 512).
const FILL: SplitRule = SplitRule::Fill {
    sm_count: 132,
    kv_lora_rank: 512,
};

/// The kernels of a `heads`-head decoder over a bf16 cache on a GPU of 132 SMs and an
/// H200's shared memory: Hopper's (`hopper`) or only the mma kernel.
fn kernels(heads: usize, hopper: bool, choice: KernelChoice) -> KernelSet {
    kernels_over(CacheDtype::Bf16, heads, hopper, choice)
}

/// The same over a cache of `cache`.
fn kernels_over(cache: CacheDtype, heads: usize, hopper: bool, choice: KernelChoice) -> KernelSet {
    let mut c = MlaConfig::new(heads, 0.1);
    c.kv_cache_dtype = cache;
    c.tuning.kernel = choice;
    let device = DeviceInfo::Cuda {
        name: "Test GPU".into(),
        capability: Capability { major: 9, minor: 0 },
        sm_count: 132,
        smem_per_block: 232_448,
    };
    let gpu = Gpu {
        hopper,
        smem_limit: 232_448,
        sm_count: 132,
    };
    KernelSet::for_decoder(&c.validate(&device).unwrap(), gpu, true).unwrap()
}

/// Hopper's kernels as shipped.
fn hopper(heads: usize) -> KernelSet {
    kernels(heads, true, KernelChoice::Auto)
}

/// Only the mma kernel (a GPU before Hopper).
fn mma_only(heads: usize) -> KernelSet {
    kernels(heads, false, KernelChoice::Auto)
}

/// Hopper's kernels without the narrow kernel's single tokens.
fn seesaw_only(heads: usize) -> KernelSet {
    let mut k = hopper(heads);
    k.narrow_singles = false;
    k
}

fn count(k: &KernelSet, len: usize, rows: usize, q: usize, heads: usize, page: usize) -> usize {
    let b = Batch {
        max_span: len,
        rows,
        query_len: q,
        heads,
        page_size: page,
    };
    FILL.splits(Some(k), &b)
}

/// A batch `(keys, rows)` and its split counts `(without, with)` a kernel.
type CountCase = ((usize, usize), (usize, usize));

/// `(count on without, count on with)` of single-token 16-head batches over 64-key pages.
fn assert_single_token_counts(without: &KernelSet, with: &KernelSet, cases: &[CountCase]) {
    for &((len, rows), want) in cases {
        let got = (
            count(without, len, rows, 1, 16, 64),
            count(with, len, rows, 1, 16, 64),
        );
        assert_eq!(got, want, "{rows} rows of {len} keys");
    }
}

/// `k` never gives more splits than `plain` to single-token 16-head batches.
fn assert_never_raises(k: &KernelSet, plain: &KernelSet) {
    for rows in [1, 2, 5, 16, 33, 64, 100, 128, 256] {
        for len in (0..20_000).step_by(61) {
            assert!(
                count(k, len, rows, 1, 16, 64) <= count(plain, len, rows, 1, 16, 64),
                "{rows} rows of {len} keys"
            );
        }
    }
}

#[test]
fn the_fill_rule_splits_small_batches_and_spares_large_ones() {
    // (len, rows, heads) -> splits on the mma kernel, as the cost model ranks them.
    for ((len, rows, heads), want) in [
        ((1024, 1, 16), 32),
        ((8192, 1, 16), 64),
        ((32768, 4, 16), 64),
        ((4096, 32, 16), 8),
        ((4096, 128, 16), 2),
        ((8192, 1, 128), 43),
        ((2048, 128, 128), 1),
        ((0, 1, 16), 1),
        ((1 << 20, 1, 16), 64),
    ] {
        let k = mma_only(heads);
        assert_eq!(
            count(&k, len, rows, 1, heads, 64),
            want,
            "len {len} rows {rows} heads {heads}"
        );
    }
    // On Hopper 128 heads run the wgmma kernel's 64-key tiles, which start at a split's first
    // key: 37 splits of 222 keys take as many tiles as 32 of 256 (H200: 27.2 us against
    // 25.3), 43 of 191 one fewer.
    assert_eq!(count(&hopper(128), 8192, 1, 1, 128, 64), 43);
    assert_eq!(count(&hopper(16), 8192, 1, 1, 16, 64), 64);
    assert_eq!(
        SplitRule::Vllm { sm_count: 132 }.splits(
            None,
            &Batch {
                max_span: 8192,
                rows: 1,
                query_len: 1,
                heads: 16,
                page_size: 64,
            }
        ),
        16
    );
}

#[test]
fn packed_tokens_make_fewer_ctas_and_more_splits_on_hopper() {
    // 256 rows of 4 tokens x 16 heads: packed requests get more splits than one CTA each
    // (64 of 132 SMs busy) would, and more than the mma kernel's CTA a token gets.
    let packed = count(&hopper(16), 8192, 256, 4, 16, 64);
    assert!(packed >= 2, "{packed}");
    assert!(packed > count(&mma_only(16), 8192, 256, 4, 16, 64));
    // One token a request never packs: the count is the mma kernel's, as without Hopper
    // (short of the lengths the seesaw and narrow kernels take).
    let plain = hopper(16).without_long_split_kernels();
    assert_eq!(
        count(&plain, 8192, 64, 1, 16, 64),
        count(&mma_only(16), 8192, 64, 1, 16, 64)
    );
}

#[test]
fn the_seesaw_kernel_takes_fewer_longer_splits_where_it_runs() {
    // 16 heads on Hopper: the seesaw kernel takes splits of 2048 keys or more, one CTA an SM;
    // the mma kernel shorter ones, two an SM. (len, rows) -> splits without and with it.
    // Measured (H200, 2026-12-03): 64 x 8192 keys 166.6 us on 2 seesaw splits, 173.3 on 4;
    // 128 x 2048 keys 87.4 us on 1, 95.2 on 2 mma splits.
    let plain = hopper(16).without_long_split_kernels();
    let seesaw = seesaw_only(16);
    assert_single_token_counts(
        &plain,
        &seesaw,
        &[
            ((8192, 64), (4, 2)),
            ((2048, 128), (2, 1)),
            ((2047, 128), (2, 2)),
            ((4096, 32), (8, 8)),
            ((8192, 1), (64, 64)),
            ((32768, 4), (64, 64)),
        ],
    );
    // Pages the TMA kernels cannot tile run the mma kernel: the count without them.
    assert_eq!(count(&seesaw, 2048, 128, 1, 16, 1), 2);
    // Above 16 heads the seesaw kernel replaces the wgmma kernel, one CTA an SM and 64-key
    // tiles both: the model, and so the count, is the wgmma kernel's.
    let with = hopper(128);
    let without = with.without_long_split_kernels();
    for (len, rows) in [(8192, 64), (4096, 32), (8192, 1), (2048, 128), (700, 3)] {
        assert_eq!(
            count(&with, len, rows, 1, 128, 64),
            count(&without, len, rows, 1, 128, 64)
        );
    }
    // It never raises a count, at any length: so a reservation at the longest length holds
    // the shorter ones.
    assert_never_raises(&seesaw, &plain);
}

#[test]
fn the_narrow_kernel_takes_the_single_tokens_whose_grid_it_fills() {
    // (keys, rows) -> splits without and with it, on the H200's measured cases (2026-12-05).
    // Taken: 8 x 4096 (22.1 -> 21.7 us), 32 x 4096 (53.9 -> 51.4), 4 x 32768 (54.0 -> 52.4),
    // 128 x 1024 (54.8 -> 47.7), 64 x 2048 (52.8 -> 51.1); left alone where the mma kernel was
    // faster: batch 1 and 3 x 4096 (too few CTAs), 6 x 8192 and 12 x 4096 (373 keys a split),
    // 48 x 2048 (96 CTAs), 24 x 4096 (820 keys); and where the seesaw kernel takes the splits.
    let seesaw = seesaw_only(16);
    let narrow = hopper(16);
    assert_single_token_counts(
        &seesaw,
        &narrow,
        &[
            ((4096, 8), (32, 16)),
            ((4096, 32), (8, 4)),
            ((32768, 4), (64, 32)),
            ((1024, 128), (2, 1)),
            ((2048, 64), (4, 2)),
            ((8192, 1), (64, 64)),
            ((4096, 3), (43, 43)),
            ((8192, 6), (43, 43)),
            ((4096, 12), (22, 22)),
            ((2048, 48), (5, 5)),
            ((4096, 24), (11, 11)),
            ((8192, 64), (2, 2)),
            ((2048, 128), (1, 1)),
        ],
    );
    // Multi-token rows and other head counts as before.
    for (len, rows, q, heads) in [(4096, 16, 2, 16), (4096, 8, 1, 8), (4096, 32, 1, 128)] {
        let (with, without) = (hopper(heads), seesaw_only(heads));
        assert_eq!(
            count(&with, len, rows, q, heads, 64),
            count(&without, len, rows, q, heads, 64)
        );
    }
    // It never raises a count; pages the TMA kernels cannot tile take the count without it.
    assert_never_raises(&narrow, &narrow.without_long_split_kernels());
    assert_eq!(count(&narrow, 4096, 8, 1, 16, 1), 32);
}

#[test]
fn reservations_cover_every_batch() {
    let cases = [
        (1, 1024, 16),
        (256, 163_840, 128),
        (7, 100, 3),
        (1000, 8192, 16),
    ];
    for (max_rows, max_len, heads) in cases {
        let sets = [
            Some(mma_only(heads)),
            Some(hopper(heads)),
            Some(seesaw_only(heads)),
            Some(kernels(
                heads,
                true,
                KernelChoice::Only(KernelFamily::Seesaw),
            )),
            Some(kernels(
                heads,
                true,
                KernelChoice::Only(KernelFamily::Narrow),
            )),
        ];
        let rules = sets
            .iter()
            .map(|k| (FILL, k.as_ref()))
            .chain([(SplitRule::Vllm { sm_count: 132 }, None)]);
        for (rule, k) in rules {
            let reserved = rule.max_row_splits(k, max_rows, max_len, heads);
            for rows in 1..=max_rows {
                for q in (1..=8).filter(|q| rows % q == 0) {
                    for len in [0, 1, max_len / 3, max_len] {
                        for page in [1, 16, 64] {
                            let b = Batch {
                                max_span: len,
                                rows,
                                query_len: q,
                                heads,
                                page_size: page,
                            };
                            assert!(
                                rows * rule.splits(k, &b) <= reserved,
                                "{rule:?} {rows} rows of {q} tokens, {len} keys, page {page}"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn split_count_follows_vllm() {
    // (max_kv_len, sm_count, expected)
    let cases = [
        (0, 132, 1),
        (1, 132, 1),
        (1023, 132, 1),
        (1024, 132, 2),
        (1536, 132, 4), // 3 -> next power of two
        (8192, 132, 16),
        (32768, 132, 64),
        (131072, 132, 256),
        (1 << 20, 132, 264), // capped at 2 * SMs, not a power of two
        (1 << 20, 66, 132),
        (4096, 2, 4),
        (1 << 20, usize::MAX, 2048), // no overflow at any SM count
    ];
    for (len, sms, want) in cases {
        assert_eq!(num_kv_splits(len, sms), want, "len {len} sms {sms}");
    }
}

#[test]
fn a_single_split_rule_is_one_split_everywhere() {
    let batch = |len, rows| Batch {
        max_span: len,
        rows,
        query_len: 1,
        heads: 128,
        page_size: 64,
    };
    for (len, rows) in [(0, 1), (100_000, 1), (1 << 20, 64)] {
        assert_eq!(SplitRule::Single.splits(None, &batch(len, rows)), 1);
    }
    assert_eq!(SplitRule::Single.max_row_splits(None, 64, 1 << 20, 128), 64);
    assert_eq!(SplitRule::Single.warmup_counts(None, 1 << 20, 128), [1]);
    let fixed = SplitRule::Fixed { splits: 5 };
    assert_eq!(fixed.splits(None, &batch(0, 1)), 5);
    assert_eq!(fixed.max_row_splits(None, 64, 1 << 20, 16), 320);
    assert_eq!(fixed.warmup_counts(None, 8192, 16), [5]);
    let k = mma_only(16);
    assert_eq!(
        FILL.warmup_counts(Some(&k), 8192, 16),
        (1..=count(&k, 8192, 1, 1, 16, 64)).collect::<Vec<_>>()
    );
    assert_eq!(
        SplitRule::Vllm { sm_count: 132 }.warmup_counts(None, 8192, 16),
        [1, 2, 4, 8, 16]
    );
}

#[test]
fn warmup_counts_cover_every_choice() {
    assert_eq!(warmup_split_counts(8192, 132, false), [1, 2, 4, 8, 16]);
    assert_eq!(
        warmup_split_counts(1 << 20, 132, false),
        [1, 2, 4, 8, 16, 32, 64, 128, 256, 264]
    );
    assert_eq!(warmup_split_counts(100, 132, false), [1]);
    assert_eq!(warmup_split_counts(1 << 20, 132, true), [1]);
    // Every count the rule can produce at or below the maximum length is in the set.
    let set = warmup_split_counts(300_000, 7, false);
    for len in (0..300_000).step_by(977) {
        assert!(set.contains(&num_kv_splits(len, 7)), "len {len}");
    }
}

#[test]
fn splits_tile_the_row_in_order() {
    for (start, end, splits) in [(0, 0, 4), (0, 1, 4), (3, 1000, 7), (5, 9, 16), (0, 512, 1)] {
        let row = KeyRange { start, end };
        let mut next = start;
        for s in 0..splits {
            let r = split_range(row, s, splits);
            if r.is_empty() {
                continue;
            }
            assert_eq!(r.start, next, "{row:?} split {s}");
            next = r.end;
        }
        assert_eq!(next, end, "{row:?} in {splits}");
    }
    // ceil(10 / 4) = 3: [0,3) [3,6) [6,9) [9,10)
    let r = KeyRange { start: 0, end: 10 };
    assert_eq!(split_range(r, 3, 4), KeyRange { start: 9, end: 10 });
    // ceil(3 / 4) = 1: the fourth split is empty
    let r = KeyRange { start: 0, end: 3 };
    assert!(split_range(r, 3, 4).is_empty());
}

/// The system allocator, counting the allocations of threads that opted in (the fill rule
/// and the kernel pick run on every decode: they must not touch the heap).
struct Counting;

thread_local! {
    static COUNTING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    static COUNT: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

// SAFETY: every call is forwarded to the system allocator unchanged; the thread-locals are
// const-initialized, so touching them never allocates.
#[allow(unsafe_code)]
unsafe impl std::alloc::GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        if COUNTING.with(std::cell::Cell::get) {
            COUNT.with(|c| c.set(c.get() + 1));
        }
        unsafe { std::alloc::System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, size: usize) -> *mut u8 {
        if COUNTING.with(std::cell::Cell::get) {
            COUNT.with(|c| c.set(c.get() + 1));
        }
        unsafe { std::alloc::System.realloc(ptr, layout, size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

#[test]
fn the_fill_rule_and_the_kernel_pick_allocate_nothing() {
    let sets = [(16, hopper(16)), (128, hopper(128))];
    COUNT.with(|c| c.set(0));
    COUNTING.with(|c| c.set(true));
    let splits = [(8192, 1, 0), (4096, 32, 1), (1 << 20, 1, 0)].map(|(len, rows, i)| {
        let (heads, k) = &sets[i];
        count(k, len, rows, 1, *heads, 64)
    });
    COUNTING.with(|c| c.set(false));
    let n = COUNT.with(std::cell::Cell::get);
    assert_eq!(n, 0, "the fill rule allocated {n} times");
    assert!(splits.iter().all(|&s| (1..=64).contains(&s)), "{splits:?}");
}

#[test]
fn a_third_cta_an_sm_counts_at_its_own_pace() {
    // The fp8 mma kernel runs three CTAs an SM on Hopper. Counted at two CTAs' pace each, the
    // rule cut short batches into 43, 22 and 12 splits; the counts below were the fastest of
    // each sweep (H100, 2026-12-06: 8 x 16 x 4096 on 32 splits 21.7 us against 23.8 on 43).
    let k = kernels_over(CacheDtype::Fp8E4m3, 16, true, KernelChoice::Auto);
    assert_eq!(k.decode.ctas_per_sm, 3);
    for ((rows, len), want) in [
        ((8, 4096), 32),
        ((16, 4096), 16),
        ((32, 4096), 8),
        ((64, 8192), 6),
        ((128, 16384), 3),
        ((1, 8192), 64),
    ] {
        assert_eq!(count(&k, len, rows, 1, 16, 64), want, "{rows} x 16 x {len}");
    }
}
