//! A fuzz test of the host validation: arbitrary shapes, strides, lengths, block ids, values
//! (NaN, inf, huge, negative), query lengths, masks, windows, scales and configuration
//! fields, every tensor a view inside a longer buffer poisoned around it. The CPU decode
//! (and the plan it makes) never panics; it fails with an error naming one of the call's
//! arguments or configuration fields and leaves the outputs untouched, or it succeeds with
//! exactly what the same call on compact copies of the views gives, writing nothing outside
//! its output views.

use half::bf16;
use mla::{DecodeInputs, DecodeOutputs, Device, Error, Mask, MlaConfig, MlaDecode, Query};
use mla::{TensorMut, TensorRef};
use proptest::prelude::*;

/// Names an error may give: the decode's arguments and the configuration's fields.
const NAMES: &[&str] = &[
    "q",
    "kv_cache",
    "block_table",
    "seq_lens",
    "o",
    "lse",
    "query_len",
    "k_scale",
    "q_scale",
    "max_seq_len",
    "num_heads",
    "scale",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "sliding_window",
    "split_units",
    "num_kv_splits",
    "dcp_world_size",
];

/// The argument or field an error names.
fn named(e: &Error) -> &'static str {
    match e {
        Error::InvalidConfig { field, .. } => field,
        Error::Dtype { arg, .. }
        | Error::Shape { arg, .. }
        | Error::Stride { arg, .. }
        | Error::Memory { arg, .. }
        | Error::WrongDevice { arg, .. } => arg,
        // vLLM's message: the rows are q's, the requests seq_lens'.
        Error::NonUniformDecode { .. } => "q",
        Error::QueryLen { .. } => "query_len",
        Error::NegativeSeqLen { .. } | Error::SeqLenBeyondBlockTable { .. } => "seq_lens",
        Error::BlockIdOutOfRange { .. } => "block_table",
        Error::KScale(_) => "k_scale",
        Error::QScale(_) => "q_scale",
        Error::Overflow { what, .. } | Error::Alloc { what, .. } => what,
        other => panic!("an error the fuzzed call cannot give: {other}"),
    }
}

/// A 1-D buffer holding a view: `offset` poisoned elements, the view's span (its gaps
/// poisoned too), `tail` poisoned elements.
struct Placed<T> {
    buf: Vec<T>,
    offset: usize,
}

/// The buffer of a view of `shape` and `strides` with `value(index)` at each element.
fn place<T: Copy, const N: usize>(
    shape: [usize; N],
    strides: [usize; N],
    offset: usize,
    tail: usize,
    poison: T,
    value: impl Fn(usize) -> T,
) -> Placed<T> {
    let span = if shape.contains(&0) {
        0
    } else {
        1 + shape
            .iter()
            .zip(&strides)
            .map(|(&n, &s)| (n - 1) * s)
            .sum::<usize>()
    };
    let mut buf = vec![poison; offset + span + tail];
    for (i, at) in elements(shape, strides).enumerate() {
        buf[offset + at] = value(i);
    }
    Placed { buf, offset }
}

/// Element offsets of a view, row-major.
fn elements<const N: usize>(shape: [usize; N], strides: [usize; N]) -> impl Iterator<Item = usize> {
    let count: usize = shape.iter().product();
    (0..count).map(move |mut i| {
        let mut at = 0;
        for d in (0..N).rev() {
            at += (i % shape[d]) * strides[d];
            i /= shape[d];
        }
        at
    })
}

/// One fuzzed call.
#[derive(Debug, Clone)]
struct Call {
    heads: usize,
    l: usize,
    r: usize,
    page: usize,
    num_blocks: usize,
    requests: usize,
    rows: usize,
    query_len: usize,
    max_blocks: usize,
    lens: Vec<i32>,
    table: Vec<i32>,
    /// (element, value) planted in q and in the cache.
    q_special: Vec<(usize, f32)>,
    kv_special: Vec<(usize, f32)>,
    /// Extra elements after each q head / row, cache key / page, table row, o head / row,
    /// lse row.
    pads: [usize; 7],
    /// Poisoned elements before each view.
    offsets: [usize; 6],
    causal: bool,
    window: Option<usize>,
    scale: f32,
    split_units: Option<usize>,
    num_kv_splits: Option<usize>,
    batch_invariant: bool,
    max_seq_len: Option<usize>,
}

fn special() -> impl Strategy<Value = f32> {
    prop::sample::select(vec![
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        1e30,
        -1e30,
        3e38,
        -2.5,
        0.0,
    ])
}

fn call() -> impl Strategy<Value = Call> {
    // Valid values mostly, so that most calls get as far as the decode; the rest each break
    // one thing.
    let shape = (1usize..4, 1usize..20, 0usize..9, 1usize..6, 1usize..6);
    let batch = (
        0usize..4,
        prop_oneof![20 => 1usize..3, 1 => Just(0)],
        prop_oneof![20 => Just(0i64), 1 => -1i64..=1],
        0usize..5,
    );
    let config = (
        prop_oneof![10 => Just(None), 10 => (1usize..6).prop_map(Some), 1 => Just(Some(0))],
        prop_oneof![
            15 => Just(0.1f32),
            5 => Just(3.0f32),
            1 => prop::sample::select(vec![1e30f32, f32::NAN, -1.0, 0.0, 1024.0, 1e-40]),
        ],
        prop_oneof![
            12 => Just(None),
            8 => Just(Some(3usize)),
            1 => prop::sample::select(vec![Some(0usize), Some(1 << 17)]),
        ],
        prop_oneof![
            12 => Just(None),
            8 => (1usize..5).prop_map(Some),
            1 => prop::sample::select(vec![Some(0usize), Some(5000)]),
        ],
        prop_oneof![10 => Just(false), 1 => Just(true)],
        prop::option::of(prop::sample::select(vec![0usize, 1, 40, usize::MAX])),
    );
    let lens_values = prop_oneof![
        // Within the block table once placed (below), or one that is not.
        30 => 0i32..1000,
        1 => prop::sample::select(vec![-2i32, -1, i32::MAX, i32::MIN]),
    ];
    let ids = prop_oneof![
        30 => 0i32..6,
        1 => prop::sample::select(vec![-2i32, -1, i32::MAX, i32::MIN]),
    ];
    (
        shape,
        batch,
        config,
        prop::collection::vec(lens_values, 4),
        prop::collection::vec(ids, 16),
        prop::collection::vec((0usize..4000, special()), 0..3),
        prop::collection::vec((0usize..4000, special()), 0..3),
        prop::array::uniform7(0usize..3),
        prop::array::uniform6(0usize..3),
        any::<bool>(),
    )
        .prop_map(
            |(
                (heads, l, r, page, num_blocks),
                (requests, query_len, delta, max_blocks),
                (window, scale, split_units, num_kv_splits, batch_invariant, max_seq_len),
                lens,
                table,
                q_special,
                kv_special,
                pads,
                offsets,
                causal,
            )| {
                let rows = ((requests * query_len) as i64 + delta).max(0) as usize;
                Call {
                    heads,
                    l,
                    r,
                    page,
                    num_blocks,
                    requests,
                    rows,
                    query_len,
                    max_blocks,
                    lens: lens[..requests]
                        .iter()
                        .map(|&n| match n {
                            0..1000 => n % (max_blocks * page + 1) as i32,
                            _ => n,
                        })
                        .collect(),
                    table: table[..requests * max_blocks].to_vec(),
                    q_special,
                    kv_special,
                    pads,
                    offsets,
                    causal,
                    window,
                    scale,
                    split_units,
                    num_kv_splits,
                    batch_invariant,
                    max_seq_len,
                }
            },
        )
}

impl Call {
    fn config(&self) -> MlaConfig {
        let mut c = MlaConfig::new(self.heads, self.scale);
        c.kv_lora_rank = self.l;
        c.qk_rope_head_dim = self.r;
        c.sliding_window = self.window;
        c.split_units = self.split_units;
        c.num_kv_splits = self.num_kv_splits;
        c.batch_invariant = self.batch_invariant;
        c
    }

    /// Shapes and strides (padded, or compact) of q, the cache, the table and the outputs.
    fn layouts(&self, compact: bool) -> Layouts {
        let (h, d, l) = (self.heads, self.l + self.r, self.l);
        let p = if compact { [0; 7] } else { self.pads };
        let q_head = d + p[0];
        let kv_token = d + p[2];
        let o_head = l + p[5];
        Layouts {
            q: ([self.rows, h, d], [h * q_head + p[1], q_head, 1]),
            kv: (
                [self.num_blocks, self.page, d],
                [self.page * kv_token + p[3], kv_token, 1],
            ),
            table: (
                [self.requests, self.max_blocks],
                [self.max_blocks + p[4], 1],
            ),
            o: ([self.rows, h, l], [h * o_head + p[6], o_head, 1]),
            lse: ([self.rows, h], [h + p[6], 1]),
        }
    }
}

struct Layouts {
    q: ([usize; 3], [usize; 3]),
    kv: ([usize; 3], [usize; 3]),
    table: ([usize; 2], [usize; 2]),
    o: ([usize; 3], [usize; 3]),
    lse: ([usize; 2], [usize; 2]),
}

/// Drawn values with the planted ones: q ~ 0.5 sin, keys ~ 0.5 cos of the index.
fn value(i: usize, planted: &[(usize, f32)], wave: fn(f32) -> f32) -> bf16 {
    let v = planted
        .iter()
        .rev()
        .find(|(at, _)| *at == i)
        .map_or(0.5 * wave(i as f32 * 0.37), |&(_, v)| v);
    bf16::from_f32(v)
}

/// What one decode gave: an error, or o and lse as the views' elements, and whether every
/// element outside the output views kept its poison.
struct Ran {
    result: Result<(Vec<u16>, Vec<u32>), Error>,
    untouched_outside: bool,
}

const POISON_OUT: f32 = -123.25;

fn run(c: &Call, compact: bool) -> Ran {
    let lay = c.layouts(compact);
    let off = if compact { [0; 6] } else { c.offsets };
    let tail = usize::from(!compact) * 3;
    let poison = bf16::NAN;
    let q = place(lay.q.0, lay.q.1, off[0], tail, poison, |i| {
        value(i, &c.q_special, f32::sin)
    });
    let kv = place(lay.kv.0, lay.kv.1, off[1], tail, poison, |i| {
        value(i, &c.kv_special, f32::cos)
    });
    let table = place(lay.table.0, lay.table.1, off[2], tail, i32::MIN, |i| {
        c.table[i]
    });
    let lens = place([c.requests], [1], off[3], tail, -7, |i| c.lens[i]);
    let o_poison = bf16::from_f32(POISON_OUT);
    let mut o = place(lay.o.0, lay.o.1, off[4], tail, o_poison, |_| o_poison);
    let mut lse = place(lay.lse.0, lay.lse.1, off[5], tail, POISON_OUT, |_| {
        POISON_OUT
    });
    let (o_before, lse_before) = (o.buf.clone(), lse.buf.clone());

    let result = (|| {
        let inputs = DecodeInputs {
            q: Query::Packed(TensorRef::from_host(&q.buf[q.offset..], lay.q.0, lay.q.1)?),
            kv_cache: TensorRef::from_host(&kv.buf[kv.offset..], lay.kv.0, lay.kv.1)?,
            block_table: TensorRef::from_host(
                &table.buf[table.offset..],
                lay.table.0,
                lay.table.1,
            )?,
            seq_lens: TensorRef::from_host(&lens.buf[lens.offset..], [c.requests], [1])?,
            query_len: c.query_len,
            mask: if c.causal {
                Mask::Causal
            } else {
                Mask::NonCausal
            },
            k_scale: 1.0,
            k_scale_tensor: None,
            q_scale: 1.0,
            q_scale_tensor: None,
            max_seq_len: c.max_seq_len,
        };
        let mut outputs = DecodeOutputs {
            o: TensorMut::from_host(&mut o.buf[o.offset..], lay.o.0, lay.o.1)?,
            lse: TensorMut::from_host(&mut lse.buf[lse.offset..], lay.lse.0, lay.lse.1)?,
        };
        MlaDecode::new(&c.config(), Device::Cpu)?.forward(&inputs, &mut outputs)?;
        Ok(())
    })();
    let o_view: Vec<usize> = elements(lay.o.0, lay.o.1).map(|i| i + o.offset).collect();
    let lse_view: Vec<usize> = elements(lay.lse.0, lay.lse.1)
        .map(|i| i + lse.offset)
        .collect();
    let untouched_outside = (0..o.buf.len())
        .filter(|i| !o_view.contains(i))
        .all(|i| o.buf[i].to_bits() == o_before[i].to_bits())
        && (0..lse.buf.len())
            .filter(|i| !lse_view.contains(i))
            .all(|i| lse.buf[i].to_bits() == lse_before[i].to_bits());
    let result = result.map(|()| {
        (
            o_view.iter().map(|&i| o.buf[i].to_bits()).collect(),
            lse_view.iter().map(|&i| lse.buf[i].to_bits()).collect(),
        )
    });
    if result.is_err() {
        // A refused call writes nothing at all.
        assert!(
            o.buf
                .iter()
                .zip(&o_before)
                .all(|(a, b)| a.to_bits() == b.to_bits())
                && lse
                    .buf
                    .iter()
                    .zip(&lse_before)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
            "outputs written by a refused call"
        );
    }
    Ran {
        result,
        untouched_outside,
    }
}

proptest! {
    // 512 cases of a few small tensors: about a second of `cargo test`.
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn host_validation_never_panics_and_reads_only_the_views(c in call()) {
        let padded = run(&c, false);
        prop_assert!(padded.untouched_outside, "written outside the output views");
        if let Err(e) = &padded.result {
            let name = named(e);
            prop_assert!(NAMES.contains(&name), "{e} names {name}");
            prop_assert!(e.to_string().contains(name) || name == "q", "{e} names {name}");
        }
        // The pads keep every layout valid: the views and their compact copies are the same
        // call, with the same error or bitwise the same outputs.
        let compact = run(&c, true);
        prop_assert!(compact.untouched_outside);
        let outcome = |r: &Ran| r.result.as_ref().map_err(|e| e.to_string()).cloned();
        prop_assert_eq!(outcome(&padded), outcome(&compact));
    }
}
