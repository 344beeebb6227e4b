//! Stage 1 on the CPU: each split of each row attends to its keys and writes a normalized
//! partial output and its LSE (natural log) to the workspace.
//!
//! Work item: (row, split, group of up to [`HEAD_GROUP`] heads), run in parallel by rayon.
//! Keys go in chunks of up to [`KEY_CHUNK`] with an online softmax, as a GPU tile loop does:
//! 1. gather the chunk's keys through the block table and decode them (fp8 times k_scale,
//!    rounded to the query dtype);
//! 2. `S = scale * Q K^T` (f32 GEMM);
//! 3. per head: new running max m, `P = exp(S - m)`, row sum l += P (unrounded), P rounded to
//!    the query dtype, accumulator rescaled by `exp(m_old - m)`;
//! 4. `acc += P V` with V the first L columns of the same keys (f32 GEMM).
//!
//! The output is `acc / l`, the LSE `m + ln(l)`. Nothing here depends on other rows, so in
//! batch-invariant mode (one split) a row's result is bitwise the same in any batch.
//!
//! The fp8-query mode (docs/contract.md) runs the same steps on codes: q as its e4m3 codes
//! and the keys' raw fp8 codes (`HostInputs`), `q_scale * k_scale` on the scores, P times
//! [`FP8_P_SCALE`] rounded to e4m3, and `k_scale / FP8_P_SCALE` on the output.

use std::cell::RefCell;
use std::thread::LocalKey;

use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
use super::amx::TileUnit;
#[cfg(target_arch = "x86_64")]
use super::avx512::Avx512Bf16;
use super::gemm::{Mat, gemm};
use super::inputs::HostInputs;
use super::kernel::CpuPath;
use super::lines::LineBuf;
#[cfg(target_arch = "x86_64")]
use super::split_avx512;
use crate::dtype::{FP8_P_SCALE, round_e4m3};
use crate::plan::{DecodePlan, KeyRange, split_range};

/// The scales and the rounding of P a plan's products take.
struct Numerics {
    /// On the scores `Q K^T`.
    score_scale: f32,
    /// On the output, before the division by the row sum.
    out_scale: f32,
    /// P as `P V` reads it.
    round_p: fn(&DecodePlan, f32) -> f32,
}

impl Numerics {
    fn of(plan: &DecodePlan) -> Self {
        if plan.fp8_query {
            Numerics {
                score_scale: plan.scale * plan.q_scale * plan.k_scale,
                out_scale: plan.k_scale / FP8_P_SCALE,
                round_p: |_, p| round_e4m3(p * FP8_P_SCALE),
            }
        } else {
            Numerics {
                score_scale: plan.scale,
                out_scale: 1.0,
                round_p: |plan, p| plan.model_dtype.round(p),
            }
        }
    }
}

/// Keys per softmax step of the portable path. 256 beat 64 and 128 by 5-10% on a 2-core AVX-512 EPYC (the key
/// chunk, the scores and the accumulator still fit its 1 MB L2).
pub const KEY_CHUNK: usize = 256;
/// Heads per work item: all of them up to 128, so each key is decoded once per split and the
/// GEMMs get their tallest shape (+45% at 128 heads against groups of 32). Fixed, so that a
/// row's arithmetic never depends on the batch; parallelism comes from rows and splits.
pub const HEAD_GROUP: usize = 128;

/// The online softmax's running state of a work item's heads, on both paths: the running max
/// `m`, the row sum `l` and the accumulator `acc` (`[heads][stride]`).
pub(super) struct SoftmaxState {
    pub m: Vec<f32>,
    pub l: Vec<f32>,
    pub acc: LineBuf<f32>,
    stride: usize,
}

impl SoftmaxState {
    pub fn new(heads: usize, stride: usize) -> Self {
        SoftmaxState {
            m: vec![0.0; heads],
            l: vec![0.0; heads],
            acc: LineBuf::zeroed(heads * stride),
            stride,
        }
    }

    /// The state before the first key of the first `heads` heads: m = -inf, l = 0, acc = 0.
    pub fn reset(&mut self, heads: usize) {
        self.m[..heads].fill(f32::NEG_INFINITY);
        self.l[..heads].fill(0.0);
        self.acc[..heads * self.stride].fill(0.0);
    }

    /// The partial output `acc * out_scale / l` (the first `width` values of each accumulator
    /// row) and its LSE `m + ln(l)`, for the heads of `lse`.
    pub fn write(&self, out_scale: f32, width: usize, o: &mut [f32], lse: &mut [f32]) {
        let stride = self.stride;
        for (i, lse_i) in lse.iter_mut().enumerate() {
            let acc_i = &self.acc[i * stride..i * stride + width];
            for (dst, a) in o[i * width..(i + 1) * width].iter_mut().zip(acc_i) {
                *dst = a * out_scale / self.l[i];
            }
            *lse_i = self.m[i] + self.l[i].ln();
        }
    }
}

/// Per-thread buffers of one work item.
struct Scratch {
    q: Vec<f32>, // [HEAD_GROUP, D]
    k: Vec<f32>, // [KEY_CHUNK, D]
    s: Vec<f32>, // [HEAD_GROUP, KEY_CHUNK]
    state: SoftmaxState,
}

impl Scratch {
    fn new(d: usize, l: usize) -> Self {
        Scratch {
            q: vec![0.0; HEAD_GROUP * d],
            k: vec![0.0; KEY_CHUNK * d],
            s: vec![0.0; HEAD_GROUP * KEY_CHUNK],
            state: SoftmaxState::new(HEAD_GROUP, l),
        }
    }
}

/// A thread's scratch of a stage-1 path, with the shape it was made for: `[D, L, heads of a
/// work item]`. It lives as long as the thread, so that a decode allocates none when its
/// shape is the last one's.
type Cached<S> = RefCell<Option<([usize; 3], S)>>;

thread_local! {
    static PORTABLE: Cached<Scratch> = const { RefCell::new(None) };
    /// Both bf16-product paths: the same buffers.
    #[cfg(target_arch = "x86_64")]
    static AVX512: Cached<split_avx512::Scratch> = const { RefCell::new(None) };
}

/// Runs stage 1 for every (row, split) of the plan on `path`. `part_o` is
/// `[rows, splits, H, L]`, `part_lse` `[rows, splits, H]`; empty splits are left as they are.
pub fn run(
    plan: &DecodePlan,
    src: &HostInputs<'_>,
    path: CpuPath,
    part_o: &mut [f32],
    part_lse: &mut [f32],
) {
    let (d, l) = (plan.head_dim(), plan.kv_lora_rank);
    match path {
        CpuPath::Portable => for_each_item(
            plan,
            src,
            part_o,
            part_lse,
            &PORTABLE,
            || Scratch::new(d, l),
            |sc, row, head0, keys, o, lse| attend(plan, src, row, head0, keys, sc, o, lse),
        ),
        #[cfg(target_arch = "x86_64")]
        CpuPath::Avx512Bf16(token) => run_bf16(plan, src, token, None, part_o, part_lse),
        #[cfg(target_arch = "x86_64")]
        CpuPath::AmxBf16(token) => {
            let tiles = Some(TileUnit::Amx(token));
            run_bf16(plan, src, token.vectors(), tiles, part_o, part_lse)
        }
        #[cfg(all(test, target_arch = "x86_64"))]
        CpuPath::EmulatedTiles(token) => {
            run_bf16(plan, src, token, Some(TileUnit::Scalar), part_o, part_lse)
        }
    }
}

/// Stage 1 on a bf16-product path: the products on AVX-512 BF16 vectors, or on `tiles`.
#[cfg(target_arch = "x86_64")]
fn run_bf16(
    plan: &DecodePlan,
    src: &HostInputs<'_>,
    token: Avx512Bf16,
    tiles: Option<TileUnit>,
    part_o: &mut [f32],
    part_lse: &mut [f32],
) {
    let stage1 = split_avx512::Stage1::new(token, tiles, plan, src);
    let heads = plan.heads.min(HEAD_GROUP);
    for_each_item(
        plan,
        src,
        part_o,
        part_lse,
        &AVX512,
        || split_avx512::Scratch::new(plan, heads),
        |sc, row, head0, keys, o, lse| stage1.attend(row, head0, keys, sc, o, lse),
    )
}

/// Runs `item` on every work item (row, split, head group) in parallel, with the scratch of
/// the thread that runs it (`make` builds it where the thread has none of this shape).
#[allow(clippy::too_many_arguments)]
fn for_each_item<S: 'static>(
    plan: &DecodePlan,
    src: &HostInputs<'_>,
    part_o: &mut [f32],
    part_lse: &mut [f32],
    scratch: &'static LocalKey<Cached<S>>,
    make: impl Fn() -> S + Sync + Send,
    item: impl Fn(&mut S, usize, usize, KeyRange, &mut [f32], &mut [f32]) + Sync + Send,
) {
    let (h, l) = (plan.heads, plan.kv_lora_rank);
    let splits = plan.num_kv_splits;
    let shape = [plan.head_dim(), l, h.min(HEAD_GROUP)];
    part_o
        .par_chunks_mut(h * l)
        .zip(part_lse.par_chunks_mut(h))
        .enumerate()
        .for_each(|(rs, (o, lse))| {
            let (row, s) = (rs / splits, rs % splits);
            let keys = split_range(src.row_keys(plan, row), s, splits);
            if keys.is_empty() {
                return;
            }
            scratch.with_borrow_mut(|cached| {
                if cached
                    .as_ref()
                    .is_some_and(|(made_for, _)| *made_for != shape)
                {
                    *cached = None;
                }
                let (_, sc) = cached.get_or_insert_with(|| (shape, make()));
                let groups = o.chunks_mut(HEAD_GROUP * l).zip(lse.chunks_mut(HEAD_GROUP));
                for (g, (o, lse)) in groups.enumerate() {
                    item(sc, row, g * HEAD_GROUP, keys, o, lse);
                }
            });
        });
}

/// One work item: heads `head0..head0 + lse.len()` of `row` over `keys`.
#[allow(clippy::too_many_arguments)]
fn attend(
    plan: &DecodePlan,
    src: &HostInputs<'_>,
    row: usize,
    head0: usize,
    keys: KeyRange,
    sc: &mut Scratch,
    o: &mut [f32],
    lse: &mut [f32],
) {
    let (l, d) = (plan.kv_lora_rank, plan.head_dim());
    let hg = lse.len();
    let request = row / plan.query_len;
    let num = Numerics::of(plan);

    for i in 0..hg {
        src.load_q(plan, row, head0 + i, &mut sc.q[i * d..(i + 1) * d]);
    }
    sc.state.reset(hg);

    for chunk in (keys.start..keys.end).step_by(KEY_CHUNK) {
        let n = KEY_CHUNK.min(keys.end - chunk);
        // 1. keys
        for j in 0..n {
            src.load_key(plan, request, chunk + j, &mut sc.k[j * d..(j + 1) * d]);
        }
        // 2. S = scale * Q K^T
        let s_mat = Mat::rows(hg, n, KEY_CHUNK);
        gemm(
            num.score_scale,
            &sc.q,
            Mat::rows(hg, d, d),
            &sc.k,
            Mat::transposed(d, n, d),
            0.0,
            &mut sc.s,
            s_mat,
        );
        // 3. online softmax
        let st = &mut sc.state;
        for i in 0..hg {
            let p = &mut sc.s[i * KEY_CHUNK..i * KEY_CHUNK + n];
            let m_new = p.iter().fold(st.m[i], |a, &b| a.max(b));
            // exp(-inf) = 0 on the first chunk, when the accumulator is still zero.
            let alpha = (st.m[i] - m_new).exp();
            let mut sum = 0.0f32;
            for x in p.iter_mut() {
                let e = (*x - m_new).exp();
                sum += e;
                *x = (num.round_p)(plan, e);
            }
            st.l[i] = st.l[i] * alpha + sum;
            st.m[i] = m_new;
            if alpha != 1.0 {
                st.acc[i * l..(i + 1) * l]
                    .iter_mut()
                    .for_each(|a| *a *= alpha);
            }
        }
        // 4. acc += P V
        gemm(
            1.0,
            &sc.s,
            s_mat,
            &sc.k,
            Mat::rows(n, l, d),
            1.0,
            &mut sc.state.acc,
            Mat::rows(hg, l, l),
        );
    }

    sc.state.write(num.out_scale, l, o, lse);
}
