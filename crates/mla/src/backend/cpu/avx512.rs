//! The AVX-512 BF16 kernels of stage 1 (`vdpbf16ps`: 16 f32 sums, each of two bf16 products
//! a step). Each public function is safe: it takes the [`Avx512Bf16`] token, which exists
//! only on a CPU that has the features, and checks that every index it touches lies inside
//! its slices before the unsafe inner loop runs.
//!
//! Layouts (`hp` heads rounded up to 16, `lp` = L rounded up to 16, `u32` = two bf16, the
//! lower one first, as `vdpbf16ps` pairs them):
//! - packed q `[D/2][hp]`: q of heads h for dimensions 2p, 2p+1;
//! - scores `[keys][hp]` f32: `Q K^T` transposed, so that the softmax runs over 16 heads a
//!   vector;
//! - packed P `[keys/2][hp]`: P of keys 2j, 2j+1 for head h;
//! - packed V `[keys/2][lp]`: keys 2j, 2j+1 at value column c;
//! - accumulator `[hp][lp]` f32.
#![allow(unsafe_code)]

use std::arch::x86_64::*;

/// Proof that this CPU has AVX-512F, AVX-512BW and AVX-512 BF16.
#[derive(Debug, Clone, Copy)]
pub struct Avx512Bf16 {
    _found: (),
}

impl Avx512Bf16 {
    /// The token, if the CPU has the features.
    pub fn detect() -> Option<Self> {
        (is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512bf16"))
        .then_some(Avx512Bf16 { _found: () })
    }

    /// The token for a test, which says that it is skipped on a CPU without the features.
    #[cfg(test)]
    pub fn detect_or_skip() -> Option<Self> {
        let t = Avx512Bf16::detect();
        if t.is_none() {
            eprintln!("skipped: this CPU lacks AVX-512 BF16");
        }
        t
    }
}

/// Heads (or value columns) a vector holds.
pub const LANES: usize = 16;

/// Keys of a score tile.
pub const TILE_KEYS: usize = 6;
/// Heads of a `P V` tile (one broadcast each).
const TILE_HEADS: usize = 4;
/// Value-column vectors of a `P V` tile.
const TILE_COLS: usize = 4;

/// `scores[j][h] = sum_p q[p][h] . row_j[p]` for the `rows` (each at least `2 * pairs` bf16
/// values; a pair is two bf16 as one u32) and all `hp` heads of `q` (`[pairs][hp]`).
///
/// # Panics
/// If a slice is shorter than the shapes say (internal invariants).
pub fn scores(
    _: Avx512Bf16,
    rows: &[&[u16]],
    q: &[u32],
    pairs: usize,
    hp: usize,
    scores: &mut [f32],
) {
    assert!(
        hp.is_multiple_of(LANES) && q.len() >= pairs * hp,
        "scores: q"
    );
    assert!(scores.len() >= rows.len() * hp, "scores: output");
    assert!(rows.iter().all(|r| r.len() >= 2 * pairs), "scores: rows");
    let vectors = hp / LANES;
    for (j0, chunk) in rows.chunks(TILE_KEYS).enumerate() {
        // The next tile's rows on their way while this one is multiplied: rows read where
        // they lie in the cache come from DRAM (NOTES.md).
        for row in rows.iter().skip((j0 + 1) * TILE_KEYS).take(TILE_KEYS) {
            prefetch_l2(bytemuck::cast_slice(&row[..2 * pairs]));
        }
        let mut tile = [chunk[0].as_ptr(); TILE_KEYS];
        for (t, r) in tile.iter_mut().zip(chunk) {
            *t = r.as_ptr();
        }
        let out = &mut scores[j0 * TILE_KEYS * hp..];
        let mut v = 0;
        while v < vectors {
            let take = (vectors - v).min(4);
            // SAFETY: the asserts above bound every read (rows of 2 * pairs values, q of
            // pairs * hp) and every write (chunk.len() rows of hp scores, heads
            // v * 16 .. (v + take) * 16 <= hp); the token proves the CPU features.
            unsafe {
                let (q, o) = (q.as_ptr().add(v * LANES), out.as_mut_ptr().add(v * LANES));
                match take {
                    4 => score_tile::<4>(&tile, chunk.len(), q, hp, pairs, o),
                    3 => score_tile::<3>(&tile, chunk.len(), q, hp, pairs, o),
                    2 => score_tile::<2>(&tile, chunk.len(), q, hp, pairs, o),
                    _ => score_tile::<1>(&tile, chunk.len(), q, hp, pairs, o),
                }
            }
            v += take;
        }
    }
}

/// One score tile: `TILE_KEYS` rows (the first `valid` stored) by `HV` vectors of heads.
///
/// # Safety
/// The CPU has AVX-512F and AVX-512 BF16; each row pointer reads `2 * pairs` u16, `q` reads
/// `pairs` rows of `q_stride` u32 (`HV * 16` of them each), `out` writes `valid` rows of
/// `q_stride` f32 (`HV * 16` of them each).
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn score_tile<const HV: usize>(
    rows: &[*const u16; TILE_KEYS],
    valid: usize,
    q: *const u32,
    q_stride: usize,
    pairs: usize,
    out: *mut f32,
) {
    let mut acc = [[_mm512_setzero_ps(); HV]; TILE_KEYS];
    for p in 0..pairs {
        let mut b = [_mm512_setzero_si512(); HV];
        for (h, bh) in b.iter_mut().enumerate() {
            *bh = unsafe { _mm512_loadu_si512(q.add(p * q_stride + h * LANES).cast()) };
        }
        for (k, acc_k) in acc.iter_mut().enumerate() {
            let pair = unsafe { rows[k].cast::<u32>().add(p).read_unaligned() };
            let a = bh16(_mm512_set1_epi32(pair as i32));
            for (acc_kh, &bh) in acc_k.iter_mut().zip(&b) {
                *acc_kh = _mm512_dpbf16_ps(*acc_kh, a, bh16(bh));
            }
        }
    }
    for (k, acc_k) in acc.iter().enumerate().take(valid) {
        for (h, &a) in acc_k.iter().enumerate() {
            unsafe { _mm512_storeu_ps(out.add(k * q_stride + h * LANES), a) };
        }
    }
}

/// The online-softmax step of one key chunk for all `hp` heads, 16 at a time:
/// `x = score_scale * scores[j][h]`, the new running max `m`, `e = exp(x - m)` summed
/// unrounded into `l` (after `l *= alpha`), `P` = e rounded to bf16 (to nearest even) packed
/// in key pairs into `p` (`[keys.div_ceil(2)][hp]`, the odd key's partner 0), and
/// `alpha = exp(m_old - m)` for the accumulator.
///
/// # Panics
/// If a slice is shorter than the shapes say (internal invariants).
#[allow(clippy::too_many_arguments)]
pub fn softmax(
    _: Avx512Bf16,
    scores: &[f32],
    keys: usize,
    hp: usize,
    score_scale: f32,
    m: &mut [f32],
    l: &mut [f32],
    alpha: &mut [f32],
    p: &mut [u32],
) {
    assert!(hp.is_multiple_of(LANES) && keys > 0, "softmax: shape");
    assert!(scores.len() >= keys * hp, "softmax: scores");
    assert!(
        m.len() >= hp && l.len() >= hp && alpha.len() >= hp,
        "softmax: m, l"
    );
    assert!(p.len() >= keys.div_ceil(2) * hp, "softmax: p");
    for v in (0..hp).step_by(LANES) {
        // SAFETY: the asserts above bound every index: scores [keys][hp], p
        // [keys / 2][hp], m, l and alpha of hp, heads v .. v + 16 <= hp.
        unsafe {
            softmax_vector(
                scores.as_ptr().add(v),
                keys,
                hp,
                score_scale,
                m.as_mut_ptr().add(v),
                l.as_mut_ptr().add(v),
                alpha.as_mut_ptr().add(v),
                p.as_mut_ptr().add(v),
            );
        }
    }
}

/// [`softmax`] for the 16 heads at `scores`, `m`, `l`, `alpha`, `p`.
///
/// # Safety
/// The CPU has AVX-512F; `scores` reads `keys` rows of `stride` f32 (16 each), `p` writes
/// `keys.div_ceil(2)` rows of `stride` u32 (16 each), `m`, `l`, `alpha` hold 16 values.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f")]
unsafe fn softmax_vector(
    scores: *const f32,
    keys: usize,
    stride: usize,
    score_scale: f32,
    m: *mut f32,
    l: *mut f32,
    alpha: *mut f32,
    p: *mut u32,
) {
    let scale = _mm512_set1_ps(score_scale);
    let x = |j: usize| unsafe { _mm512_mul_ps(scale, _mm512_loadu_ps(scores.add(j * stride))) };
    let m_old = unsafe { _mm512_loadu_ps(m) };
    let mut m_new = m_old;
    for j in 0..keys {
        m_new = _mm512_max_ps(m_new, x(j));
    }
    // exp(-inf) = 0 on the first chunk, when the accumulator is still zero.
    let a = exp(_mm512_sub_ps(m_old, m_new));
    let mut sum = _mm512_setzero_ps();
    for pair in 0..keys.div_ceil(2) {
        let e0 = exp(_mm512_sub_ps(x(2 * pair), m_new));
        sum = _mm512_add_ps(sum, e0);
        let mut packed = round_bf16(e0);
        if 2 * pair + 1 < keys {
            let e1 = exp(_mm512_sub_ps(x(2 * pair + 1), m_new));
            sum = _mm512_add_ps(sum, e1);
            packed = _mm512_or_si512(packed, _mm512_slli_epi32::<16>(round_bf16(e1)));
        }
        unsafe { _mm512_storeu_si512(p.add(pair * stride).cast(), packed) };
    }
    unsafe {
        let l_old = _mm512_loadu_ps(l);
        _mm512_storeu_ps(l, _mm512_fmadd_ps(l_old, a, sum));
        _mm512_storeu_ps(m, m_new);
        _mm512_storeu_ps(alpha, a);
    }
}

/// `acc[h][c] = alpha[h] * acc[h][c] + sum_j p[j][h] v[j][c]` over `pairs` key pairs, for all
/// `hp` heads and `lp` value columns (`p` packed `[pairs][hp]`, `v` packed `[pairs][lp]`).
///
/// # Panics
/// If a slice is shorter than the shapes say (internal invariants).
#[allow(clippy::too_many_arguments)]
pub fn accumulate(
    _: Avx512Bf16,
    p: &[u32],
    v: &[u32],
    pairs: usize,
    hp: usize,
    lp: usize,
    alpha: &[f32],
    acc: &mut [f32],
) {
    assert!(
        hp.is_multiple_of(LANES) && lp.is_multiple_of(LANES),
        "accumulate: shape"
    );
    assert!(
        p.len() >= pairs * hp && v.len() >= pairs * lp,
        "accumulate: p, v"
    );
    assert!(alpha.len() >= hp && acc.len() >= hp * lp, "accumulate: acc");
    let vectors = lp / LANES;
    for h in (0..hp).step_by(TILE_HEADS) {
        let mut c = 0;
        while c < vectors {
            let take = (vectors - c).min(TILE_COLS);
            // SAFETY: heads h .. h + 4 <= hp (hp is a multiple of 16), columns
            // c * 16 .. (c + take) * 16 <= lp, and pairs rows of p and v: all inside the
            // slices checked above; the token proves the CPU features.
            unsafe {
                let args = (
                    p.as_ptr().add(h),
                    hp,
                    v.as_ptr().add(c * LANES),
                    lp,
                    pairs,
                    alpha.as_ptr().add(h),
                    acc.as_mut_ptr().add(h * lp + c * LANES),
                );
                match take {
                    4 => accumulate_tile::<4>(args),
                    3 => accumulate_tile::<3>(args),
                    2 => accumulate_tile::<2>(args),
                    _ => accumulate_tile::<1>(args),
                }
            }
            c += take;
        }
    }
}

/// One `P V` tile: `TILE_HEADS` heads by `CV` vectors of value columns.
///
/// # Safety
/// The CPU has AVX-512F and AVX-512 BF16; `p` reads `pairs` rows of `p_stride` u32 (4 each),
/// `v` `pairs` rows of `v_stride` u32 (`CV * 16` each), `alpha` 4 f32, `acc` 4 rows of
/// `v_stride` f32 (`CV * 16` each).
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn accumulate_tile<const CV: usize>(
    (p, p_stride, v, v_stride, pairs, alpha, acc): (
        *const u32,
        usize,
        *const u32,
        usize,
        usize,
        *const f32,
        *mut f32,
    ),
) {
    let mut sums = [[_mm512_setzero_ps(); CV]; TILE_HEADS];
    for (h, s) in sums.iter_mut().enumerate() {
        let a = unsafe { _mm512_set1_ps(*alpha.add(h)) };
        for (c, sc) in s.iter_mut().enumerate() {
            *sc = _mm512_mul_ps(a, unsafe {
                _mm512_loadu_ps(acc.add(h * v_stride + c * LANES))
            });
        }
    }
    for j in 0..pairs {
        let mut b = [_mm512_setzero_si512(); CV];
        for (c, bc) in b.iter_mut().enumerate() {
            *bc = unsafe { _mm512_loadu_si512(v.add(j * v_stride + c * LANES).cast()) };
        }
        for (h, s) in sums.iter_mut().enumerate() {
            let a = bh16(_mm512_set1_epi32(unsafe { *p.add(j * p_stride + h) } as i32));
            for (sc, &bc) in s.iter_mut().zip(&b) {
                *sc = _mm512_dpbf16_ps(*sc, a, bh16(bc));
            }
        }
    }
    for (h, s) in sums.iter().enumerate() {
        for (c, &sc) in s.iter().enumerate() {
            unsafe { _mm512_storeu_ps(acc.add(h * v_stride + c * LANES), sc) };
        }
    }
}

/// Packs the first `l` values of key rows 2j and 2j + 1 into `v` (`[rows / 2][lp]`, the odd
/// row's partner and the columns from `l` to `lp` zero).
///
/// # Panics
/// If a slice is shorter than the shapes say (internal invariants).
pub fn pack_values(token: Avx512Bf16, rows: &[&[u16]], l: usize, lp: usize, v: &mut [u32]) {
    assert!(
        rows.iter().all(|r| r.len() >= l) && l <= lp,
        "pack_values: rows"
    );
    assert!(v.len() >= rows.len().div_ceil(2) * lp, "pack_values: v");
    let _ = token;
    for (pair, dst) in rows.chunks(2).zip(v.chunks_exact_mut(lp)) {
        // SAFETY: the token proves the CPU features; the body is safe code.
        unsafe { pack_pair(pair[0], pair.get(1).copied(), &mut dst[..l]) };
        dst[l..].fill(0);
    }
}

/// One packed pair, written so that the compiler vectorizes it with AVX-512.
#[target_feature(enable = "avx512f,avx512bw")]
fn pack_pair(lo: &[u16], hi: Option<&[u16]>, dst: &mut [u32]) {
    let n = dst.len();
    match hi {
        Some(hi) => {
            for ((d, &a), &b) in dst.iter_mut().zip(&lo[..n]).zip(&hi[..n]) {
                *d = u32::from(a) | (u32::from(b) << 16);
            }
        }
        None => {
            for (d, &a) in dst.iter_mut().zip(&lo[..n]) {
                *d = u32::from(a);
            }
        }
    }
}

/// P `[pairs][hp]` (the softmax's key pairs by head) as rows `[hp][ld]` (a head's key pairs:
/// the tiles' A operand of `P V`), the pairs from `pairs` to `ld` zero, 16 x 16 blocks at a
/// time transposed in registers.
///
/// # Panics
/// If `hp` or `ld` is not a multiple of 16, or a slice is shorter than the shapes say
/// (internal invariants).
pub fn transpose_pairs(
    _: Avx512Bf16,
    p: &[u32],
    pairs: usize,
    hp: usize,
    pt: &mut [u32],
    ld: usize,
) {
    assert!(
        hp.is_multiple_of(LANES) && ld.is_multiple_of(LANES) && pairs <= ld,
        "transpose_pairs: shape"
    );
    assert!(p.len() >= pairs * hp, "transpose_pairs: p");
    assert!(pt.len() >= hp * ld, "transpose_pairs: pt");
    for j0 in (0..ld).step_by(LANES) {
        let rows = pairs.saturating_sub(j0).min(LANES);
        for h0 in (0..hp).step_by(LANES) {
            // SAFETY: the asserts above: rows j0 .. j0 + rows < pairs of p hold heads h0 ..
            // h0 + 16 <= hp; rows h0 .. h0 + 16 of pt hold pairs j0 .. j0 + 16 <= ld. The
            // token proves the CPU features.
            unsafe {
                transpose_block(
                    p.as_ptr().add(j0 * hp + h0),
                    hp,
                    rows,
                    pt.as_mut_ptr().add(h0 * ld + j0),
                    ld,
                )
            };
        }
    }
}

/// One 16 x 16 block: `dst[c][r] = src[r][c]` for rows `r < rows` of `src` (the rest zero).
///
/// # Safety
/// AVX-512F; `src` reads `rows` (at most 16) rows of 16 values `src_ld` apart, `dst` writes 16
/// rows of 16 values `dst_ld` apart.
#[target_feature(enable = "avx512f")]
unsafe fn transpose_block(
    src: *const u32,
    src_ld: usize,
    rows: usize,
    dst: *mut u32,
    dst_ld: usize,
) {
    let mut r = [_mm512_setzero_si512(); 16];
    for (i, x) in r.iter_mut().enumerate().take(rows) {
        // SAFETY: row i < rows of the caller's src.
        *x = unsafe { _mm512_loadu_si512(src.add(i * src_ld).cast()) };
    }
    // Rows 2i, 2i + 1 interleaved by 32 bits, then rows 4g .. 4g + 4 by 64: u[4g + c] holds,
    // in 128-bit lane k, column 4k + c of rows 4g .. 4g + 4. (Loops, not closures: a closure
    // does not take this function's target features.)
    let mut t = [_mm512_setzero_si512(); 16];
    for i in (0..16).step_by(2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    let mut u = [_mm512_setzero_si512(); 16];
    for g in (0..16).step_by(4) {
        u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
        u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
        u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
        u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
    }
    // Lanes across the four row groups: column 4k + c gathers lane k of u[c], u[4 + c],
    // u[8 + c], u[12 + c].
    for c in 0..4 {
        let (g0, g1, g2, g3) = (u[c], u[4 + c], u[8 + c], u[12 + c]);
        // Lanes 0 and 2, and 1 and 3, of two groups each.
        let v02_01 = _mm512_shuffle_i32x4::<0x88>(g0, g1);
        let v13_01 = _mm512_shuffle_i32x4::<0xdd>(g0, g1);
        let v02_23 = _mm512_shuffle_i32x4::<0x88>(g2, g3);
        let v13_23 = _mm512_shuffle_i32x4::<0xdd>(g2, g3);
        let cols = [
            (c, _mm512_shuffle_i32x4::<0x88>(v02_01, v02_23)),
            (c + 8, _mm512_shuffle_i32x4::<0xdd>(v02_01, v02_23)),
            (c + 4, _mm512_shuffle_i32x4::<0x88>(v13_01, v13_23)),
            (c + 12, _mm512_shuffle_i32x4::<0xdd>(v13_01, v13_23)),
        ];
        for (col, x) in cols {
            // SAFETY: row col < 16 of the caller's dst.
            unsafe { _mm512_storeu_si512(dst.add(col * dst_ld).cast(), x) };
        }
    }
}

/// f16 values to bf16 bits, rounded to nearest even (NaN stays NaN), as
/// `bf16::from_f32(f16 as f32)`.
pub fn f16_to_bf16(_: Avx512Bf16, src: &[u16], dst: &mut [u16]) {
    assert!(src.len() >= dst.len(), "f16_to_bf16: src");
    let n = dst.len();
    let mut i = 0;
    while i < n {
        let k = (n - i).min(LANES);
        let mask = if k == LANES {
            u16::MAX
        } else {
            (1u16 << k) - 1
        };
        // SAFETY: the masked load and store touch elements i .. i + k <= n of src and dst;
        // the token proves the CPU features.
        unsafe { convert_f16(src.as_ptr().add(i), dst.as_mut_ptr().add(i), mask) };
        i += k;
    }
}

/// # Safety
/// The CPU has AVX-512F and AVX-512BW; `src` and `dst` hold the lanes `mask` selects.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn convert_f16(src: *const u16, dst: *mut u16, mask: u16) {
    let h = unsafe { _mm256_maskz_loadu_epi16(mask, src.cast()) };
    let bits = round_bf16_nan(_mm512_cvtph_ps(h));
    unsafe { _mm256_mask_storeu_epi16(dst.cast(), mask, _mm512_cvtepi32_epi16(bits)) };
}

/// Asks for `bytes` to be brought into L2, a 64-byte line at a time, ahead of their use.
pub fn prefetch_l2(bytes: &[u8]) {
    for line in bytes.chunks(64) {
        // SAFETY: a prefetch is a hint: it reads nothing into the program and never faults;
        // the address is inside a live slice. SSE is part of x86-64.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(line.as_ptr().cast()) };
    }
}

/// `vdpbf16ps` reads its operands as bf16 pairs.
#[inline(always)]
fn bh16(x: __m512i) -> __m512bh {
    // SAFETY: both are 512 bits of plain data.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(x) }
}

/// f32 to bf16 bits (in the low half of each lane), to nearest even as `bf16::from_f32` for
/// finite values (P is finite and not negative).
#[inline]
#[target_feature(enable = "avx512f")]
fn round_bf16(x: __m512) -> __m512i {
    let bits = _mm512_castps_si512(x);
    let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(1));
    let biased = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    _mm512_srli_epi32::<16>(biased)
}

/// [`round_bf16`], and NaN to a quiet NaN as `bf16::from_f32`.
#[inline]
#[target_feature(enable = "avx512f")]
fn round_bf16_nan(x: __m512) -> __m512i {
    let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
    let quiet = _mm512_or_si512(
        _mm512_srli_epi32::<16>(_mm512_castps_si512(x)),
        _mm512_set1_epi32(0x40),
    );
    _mm512_mask_blend_epi32(nan, round_bf16(x), quiet)
}

/// `exp(x)` to about one ulp (Cephes' `expf` polynomial on `x - n ln 2`, then times 2^n by
/// `vscalefps`, which also gives the subnormal results and 0 below them; -inf gives 0).
#[inline]
#[target_feature(enable = "avx512f")]
fn exp(x: __m512) -> __m512 {
    // The clamp keeps a NaN: vmaxps and vminps return their second operand when either is NaN.
    let x = _mm512_min_ps(
        _mm512_set1_ps(88.8),
        _mm512_max_ps(_mm512_set1_ps(-104.0), x),
    );
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
        _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
    );
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_359_4), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.121_944_4e-4), r);
    let mut y = _mm512_set1_ps(1.987_569_1e-4);
    for c in [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        1.666_666_5e-1,
        0.5,
    ] {
        y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(c));
    }
    let y = _mm512_fmadd_ps(
        y,
        _mm512_mul_ps(r, r),
        _mm512_add_ps(r, _mm512_set1_ps(1.0)),
    );
    _mm512_scalef_ps(y, n)
}

#[cfg(test)]
mod tests {
    use half::{bf16, f16};

    use super::*;

    #[test]
    fn exp_is_within_two_ulps_of_libm() {
        let Some(t) = Avx512Bf16::detect_or_skip() else {
            return;
        };
        let xs: Vec<f32> = (0..4000)
            .map(|i| -110.0 + i as f32 * 0.0497)
            .chain([f32::NEG_INFINITY, 0.0, -0.0])
            .collect();
        for &x in &xs {
            let got = exp_one(t, x);
            let want = x.exp();
            let ulp = (want.to_bits() as i64 - got.to_bits() as i64).abs();
            assert!(ulp <= 2, "exp({x}) = {got}, libm {want}");
        }
        // A NaN score stays NaN (the clamp must not turn it into exp(-104)).
        assert!(exp_one(t, f32::NAN).is_nan());
    }

    fn exp_one(_: Avx512Bf16, x: f32) -> f32 {
        let mut out = [0f32; 16];
        // SAFETY: the token proves AVX-512F; out holds 16 f32.
        unsafe {
            let y = exp(_mm512_set1_ps(x));
            _mm512_storeu_ps(out.as_mut_ptr(), y);
        }
        out[0]
    }

    #[test]
    fn transposed_p_is_each_head_s_pairs_padded_with_zero() {
        let Some(t) = Avx512Bf16::detect_or_skip() else {
            return;
        };
        for (pairs, hp, ld) in [
            (3, 16, 16),
            (0, 16, 16),
            (16, 16, 16),
            (17, 32, 64),
            (64, 128, 64),
        ] {
            let p: Vec<u32> = (1..=(pairs * hp) as u32)
                .map(|x| x.wrapping_mul(2_654_435_761))
                .collect();
            let mut pt = vec![u32::MAX; hp * ld];
            transpose_pairs(t, &p, pairs, hp, &mut pt, ld);
            for h in 0..hp {
                for j in 0..ld {
                    let want = if j < pairs { p[j * hp + h] } else { 0 };
                    assert_eq!(
                        pt[h * ld + j],
                        want,
                        "{pairs} x {hp}, ld {ld}: pt[{h}][{j}]"
                    );
                }
            }
        }
    }

    #[test]
    fn f16_conversion_rounds_as_half_does() {
        let Some(t) = Avx512Bf16::detect_or_skip() else {
            return;
        };
        // Every f16 bit pattern, in a length that leaves a partial vector.
        let src: Vec<u16> = (0..=u16::MAX).chain(0..7).collect();
        let mut dst = vec![0u16; src.len()];
        f16_to_bf16(t, &src, &mut dst);
        for (&s, &d) in src.iter().zip(&dst) {
            let want = bf16::from_f32(f16::from_bits(s).to_f32());
            let got = bf16::from_bits(d);
            assert!(
                got == want || (got.is_nan() && want.is_nan()),
                "f16 {s:#06x}: got {d:#06x}, want {:#06x}",
                want.to_bits()
            );
        }
    }

    #[test]
    fn products_match_an_f64_sum() {
        let Some(t) = Avx512Bf16::detect_or_skip() else {
            return;
        };
        // 3 rows of 20 bf16 values (10 pairs) against 32 heads; P V over 3 keys (2 pairs).
        let (pairs, hp, l, lp) = (10, 32, 20, 32);
        let val = |i: usize| bf16::from_f32(((i * 37 % 23) as f32 - 11.0) / 8.0);
        let rows: Vec<Vec<u16>> = (0..3)
            .map(|r| (0..2 * pairs).map(|d| val(r * 17 + d).to_bits()).collect())
            .collect();
        let row_refs: Vec<&[u16]> = rows.iter().map(|r| r.as_slice()).collect();
        let qv = |h: usize, d: usize| val(h * 5 + d * 3 + 1);
        let q: Vec<u32> = (0..pairs * hp)
            .map(|i| {
                let (p, h) = (i / hp, i % hp);
                u32::from(qv(h, 2 * p).to_bits()) | u32::from(qv(h, 2 * p + 1).to_bits()) << 16
            })
            .collect();
        let mut s = vec![0f32; 3 * hp];
        scores(t, &row_refs, &q, pairs, hp, &mut s);
        for j in 0..3 {
            for h in 0..hp {
                let want: f64 = (0..2 * pairs)
                    .map(|d| f64::from(qv(h, d).to_f32()) * f64::from(val(j * 17 + d).to_f32()))
                    .sum();
                assert!(
                    (f64::from(s[j * hp + h]) - want).abs() < 1e-5,
                    "s[{j}][{h}]"
                );
            }
        }

        let mut v = vec![7u32; 2 * lp];
        pack_values(t, &row_refs, l, lp, &mut v);
        let pv = |h: usize, j: usize| bf16::from_f32((h + 2 * j) as f32 / 64.0);
        let p: Vec<u32> = (0..2 * hp)
            .map(|i| {
                let (jp, h) = (i / hp, i % hp);
                let hi = if 2 * jp + 1 < 3 {
                    pv(h, 2 * jp + 1).to_bits()
                } else {
                    0
                };
                u32::from(pv(h, 2 * jp).to_bits()) | u32::from(hi) << 16
            })
            .collect();
        let alpha: Vec<f32> = (0..hp).map(|h| 0.5 + h as f32 / 64.0).collect();
        let acc0 = |h: usize, c: usize| (h * 3 + c) as f32 / 16.0;
        let mut acc: Vec<f32> = (0..hp * lp).map(|i| acc0(i / lp, i % lp)).collect();
        accumulate(t, &p, &v, 2, hp, lp, &alpha, &mut acc);
        for h in 0..hp {
            for c in 0..lp {
                let dot: f64 = if c < l {
                    (0..3)
                        .map(|j| f64::from(pv(h, j).to_f32()) * f64::from(val(j * 17 + c).to_f32()))
                        .sum()
                } else {
                    0.0
                };
                let want = f64::from(alpha[h]) * f64::from(acc0(h, c)) + dot;
                assert!(
                    (f64::from(acc[h * lp + c]) - want).abs() < 1e-5,
                    "acc[{h}][{c}]"
                );
            }
        }
    }
}
