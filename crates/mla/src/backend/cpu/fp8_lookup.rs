//! fp8 cache bytes to the bf16 values the AVX-512 BF16 products take, through a table of the
//! decoder's values (decode, times k_scale, rounded to bf16: the same numbers as every other
//! path). Each public function is safe: it takes the [`Avx512Bf16`] token, which exists only
//! on a CPU that has the features, and bounds every access before the unsafe inner loop runs.
#![allow(unsafe_code)]

use std::arch::x86_64::*;

use half::bf16;

use super::avx512::Avx512Bf16;
use crate::dtype::KvDecoder;

/// Proof that this CPU has AVX-512 VBMI (byte permutes), beside AVX-512 BF16.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Avx512Vbmi {
    _found: (),
}

impl Avx512Vbmi {
    /// The token, if the CPU has the feature.
    fn detect() -> Option<Self> {
        is_x86_feature_detected!("avx512vbmi").then_some(Avx512Vbmi { _found: () })
    }
}

/// How [`fp8_to_bf16`] reads its table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lookup {
    /// 64 bytes a step: the low and the high bytes of the values by byte permutes of 128
    /// entries, the top bit choosing the table's half, then interleaved: 13 vector
    /// instructions per 64 codes where the 16-bit permutes take about 20 (NOTES.md).
    Bytes(Avx512Vbmi),
    /// 32 bytes a step, a sign-symmetric table: two 64-entry 16-bit permutes of the low seven
    /// bits and the sign flipped by bit 7.
    HalfWords,
    /// 32 bytes a step, any table: four 64-entry 16-bit permutes chosen by the top two bits.
    Words,
}

/// The bf16 bits of each fp8 byte's value, as a 16-bit table and as its low and high bytes,
/// and the fastest way this CPU reads them.
pub struct Fp8Table {
    bits: [u16; 256],
    low: [u8; 256],
    high: [u8; 256],
    lookup: Lookup,
}

impl Fp8Table {
    /// The table of `decoder`'s values, rounded to bf16.
    pub fn of(decoder: &KvDecoder) -> Self {
        Fp8Table::new(std::array::from_fn(|b| {
            let mut x = [0f32];
            decoder.decode(&[b as u8], &mut x);
            bf16::from_f32(x[0]).to_bits()
        }))
    }

    pub fn new(bits: [u16; 256]) -> Self {
        let lookup = match Avx512Vbmi::detect() {
            Some(vbmi) => Lookup::Bytes(vbmi),
            None if symmetric(&bits) => Lookup::HalfWords,
            None => Lookup::Words,
        };
        Fp8Table {
            bits,
            low: bits.map(|x| x.to_le_bytes()[0]),
            high: bits.map(|x| x.to_le_bytes()[1]),
            lookup,
        }
    }
}

/// Whether byte `b | 0x80` is byte `b`'s bits with the sign flipped, as it is for the
/// sign-magnitude fp8 formats (`-x` rounds to bf16 as `x` does), or both are NaN (whose sign
/// nothing reads). Then half the table serves the 16-bit permutes.
fn symmetric(bits: &[u16; 256]) -> bool {
    let nan = |x: u16| bf16::from_bits(x).is_nan();
    (0..128).all(|b| {
        let (pos, neg) = (bits[b], bits[b | 0x80]);
        neg == pos ^ 0x8000 || (nan(pos) && nan(neg))
    })
}

/// fp8 bytes through the table: `dst[i]` is the table's entry of `src[i]`, for the `dst.len()`
/// first bytes.
///
/// # Panics
/// If `src` is shorter than `dst` (internal invariant).
pub fn fp8_to_bf16(_: Avx512Bf16, table: &Fp8Table, src: &[u8], dst: &mut [u16]) {
    assert!(src.len() >= dst.len(), "fp8_to_bf16: src");
    let (s, d, n) = (src.as_ptr(), dst.as_mut_ptr(), dst.len());
    // SAFETY: the loops touch elements 0..n of src and dst, which hold them; the tokens prove
    // the CPU features (Bytes holds the VBMI one).
    unsafe {
        match table.lookup {
            Lookup::Bytes(_) => lookup_bytes_row(&table.low, &table.high, s, d, n),
            Lookup::HalfWords => lookup_words_row::<true>(&table.bits, s, d, n),
            Lookup::Words => lookup_words_row::<false>(&table.bits, s, d, n),
        }
    }
}

/// [`Lookup::Bytes`] over a row, 64 bytes a step.
///
/// # Safety
/// The CPU has AVX-512F, AVX-512BW and AVX-512 VBMI; `src` and `dst` hold `n` elements.
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
unsafe fn lookup_bytes_row(
    low: &[u8; 256],
    high: &[u8; 256],
    src: *const u8,
    dst: *mut u16,
    n: usize,
) {
    // SAFETY: 64 bytes from 64 i, i < 4: inside the 256.
    let quarter =
        |t: &[u8; 256], i: usize| unsafe { _mm512_loadu_si512(t.as_ptr().add(64 * i).cast()) };
    let (l0, l1, l2, l3) = (
        quarter(low, 0),
        quarter(low, 1),
        quarter(low, 2),
        quarter(low, 3),
    );
    let (h0, h1, h2, h3) = (
        quarter(high, 0),
        quarter(high, 1),
        quarter(high, 2),
        quarter(high, 3),
    );
    // The unpacks below interleave within 128-bit lanes: the codes' 8-byte groups go first
    // 0, 4, 1, 5, 2, 6, 3, 7, so that the low unpack holds codes 0..32 and the high 32..64.
    let order = _mm512_set_epi64(7, 3, 6, 2, 5, 1, 4, 0);
    let mut i = 0;
    while i < n {
        let k = (n - i).min(64);
        let mask = if k == 64 { u64::MAX } else { (1u64 << k) - 1 };
        // SAFETY: the masked load touches elements i .. i + k <= n of src.
        let codes = unsafe { _mm512_maskz_loadu_epi8(mask, src.add(i).cast()) };
        let codes = _mm512_permutexvar_epi64(order, codes);
        // Entries 0..128 and 128..256 by the low seven bits, chosen by bit 7.
        let upper = _mm512_movepi8_mask(codes);
        let lo = _mm512_mask_blend_epi8(
            upper,
            _mm512_permutex2var_epi8(l0, codes, l1),
            _mm512_permutex2var_epi8(l2, codes, l3),
        );
        let hi = _mm512_mask_blend_epi8(
            upper,
            _mm512_permutex2var_epi8(h0, codes, h1),
            _mm512_permutex2var_epi8(h2, codes, h3),
        );
        // SAFETY: the masked stores touch elements i .. i + k <= n of dst; the second half
        // only when there is one.
        unsafe {
            let d = dst.add(i);
            _mm512_mask_storeu_epi16(d.cast(), mask as u32, _mm512_unpacklo_epi8(lo, hi));
            if k > 32 {
                let second = _mm512_unpackhi_epi8(lo, hi);
                _mm512_mask_storeu_epi16(d.add(32).cast(), (mask >> 32) as u32, second);
            }
        }
        i += k;
    }
}

/// [`Lookup::HalfWords`] (SYMMETRIC) or [`Lookup::Words`] over a row, 32 bytes a step, in one
/// call: the lookups inline and the table's loads leave the loop.
///
/// # Safety
/// The CPU has AVX-512F and AVX-512BW; `src` and `dst` hold `n` elements; SYMMETRIC only
/// for a [`symmetric`] table.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn lookup_words_row<const SYMMETRIC: bool>(
    table: &[u16; 256],
    src: *const u8,
    dst: *mut u16,
    n: usize,
) {
    let mut i = 0;
    while i < n {
        let k = (n - i).min(32);
        let mask = if k == 32 { u32::MAX } else { (1u32 << k) - 1 };
        // SAFETY: the masked load and store touch elements i .. i + k <= n of src and dst.
        unsafe {
            let idx = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(mask, src.add(i).cast()));
            let out = if SYMMETRIC {
                // magnitude ^ (bit 7 moved to bit 15): A ^ (B & C) is 0x78.
                _mm512_ternarylogic_epi32::<0x78>(
                    table_half(table, 0, idx),
                    _mm512_slli_epi16::<8>(idx),
                    _mm512_set1_epi16(i16::MIN),
                )
            } else {
                let bit7 = _mm512_test_epi16_mask(idx, _mm512_set1_epi16(0x80));
                let (lower, upper) = (table_half(table, 0, idx), table_half(table, 1, idx));
                _mm512_mask_blend_epi16(bit7, lower, upper)
            };
            _mm512_mask_storeu_epi16(dst.add(i).cast(), mask, out);
        }
        i += k;
    }
}

/// Entries `128 h + (idx & 127)` of the table: two 64-entry permutes by the low six bits,
/// chosen by bit 6.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
fn table_half(table: &[u16; 256], h: usize, idx: __m512i) -> __m512i {
    // SAFETY: 32 entries from 128 h + 32 i, i < 4, h < 2: inside the 256.
    let t = |i: usize| unsafe { _mm512_loadu_si512(table.as_ptr().add(128 * h + 32 * i).cast()) };
    let low = _mm512_permutex2var_epi16(t(0), idx, t(1));
    let high = _mm512_permutex2var_epi16(t(2), idx, t(3));
    _mm512_mask_blend_epi16(
        _mm512_test_epi16_mask(idx, _mm512_set1_epi16(0x40)),
        low,
        high,
    )
}

#[cfg(test)]
mod tests {
    use crate::dtype::{KvFormat, ModelDtype};

    use super::*;

    /// Every lookup this CPU has that can read `table`.
    fn lookups(table: &Fp8Table) -> Vec<Lookup> {
        let mut all = vec![Lookup::Words];
        if symmetric(&table.bits) {
            all.push(Lookup::HalfWords);
        }
        all.extend(Avx512Vbmi::detect().map(Lookup::Bytes));
        if Avx512Vbmi::detect().is_none() {
            eprintln!("not run: the byte lookup (this CPU lacks AVX-512 VBMI)");
        }
        all
    }

    /// Every byte, in an order that is not the table's, and lengths that end inside a step of
    /// each lookup.
    fn sources() -> Vec<Vec<u8>> {
        let all: Vec<u8> = (0..=255u8).rev().chain(3..40).collect();
        [all.len(), 256, 100, 64, 63, 33, 32, 31, 1, 0]
            .iter()
            .map(|&n| all[all.len() - n..].to_vec())
            .collect()
    }

    #[test]
    fn every_lookup_reads_the_table() {
        let Some(t) = Avx512Bf16::detect_or_skip() else {
            return;
        };
        let any: [u16; 256] = std::array::from_fn(|i| (i as u16).wrapping_mul(40503) ^ 0x1234);
        // Sign-symmetric, with sign bits set in the lower half too (a negative scale).
        let sym: [u16; 256] =
            std::array::from_fn(|i| any[i % 128] ^ if i >= 128 { 0x8000 } else { 0 });
        assert!(!symmetric(&any) && symmetric(&sym), "symmetry found");
        for bits in [any, sym] {
            let table = Fp8Table::new(bits);
            for lookup in lookups(&table) {
                let table = Fp8Table { lookup, ..table };
                for src in sources() {
                    let mut dst = vec![0xdead; src.len() + 5];
                    let n = src.len();
                    fp8_to_bf16(t, &table, &src, &mut dst[..n]);
                    for (&s, &d) in src.iter().zip(&dst) {
                        assert_eq!(d, bits[s as usize], "byte {s}, {lookup:?}, length {n}");
                    }
                    assert!(
                        dst[n..].iter().all(|&d| d == 0xdead),
                        "{lookup:?} wrote past {n}"
                    );
                }
            }
        }
    }

    /// Each fp8 format's 256 codes, NaN included, through every lookup against the decoder's
    /// scalar decode rounded to bf16.
    #[test]
    fn every_lookup_decodes_every_fp8_code_as_the_decoder() {
        let Some(t) = Avx512Bf16::detect_or_skip() else {
            return;
        };
        for kv in [KvFormat::Fp8E4m3, KvFormat::Fp8E5m2] {
            for scale in [1.0, 0.37, 3.5] {
                let decoder = kv.decoder(ModelDtype::Bf16, scale);
                let table = Fp8Table::of(&decoder);
                assert!(symmetric(&table.bits), "{kv:?}, k_scale {scale}");
                let codes: Vec<u8> = (0..=255).collect();
                let mut want = vec![0f32; 256];
                decoder.decode(&codes, &mut want);
                assert!(want.iter().any(|x| x.is_nan()), "{kv:?} has NaN codes");
                for lookup in lookups(&table) {
                    let table = Fp8Table { lookup, ..table };
                    let mut got = vec![0u16; 256];
                    fp8_to_bf16(t, &table, &codes, &mut got);
                    for ((&c, &g), &w) in codes.iter().zip(&got).zip(&want) {
                        let (g, w) = (bf16::from_bits(g), bf16::from_f32(w));
                        assert!(
                            g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                            "{kv:?} k_scale {scale} code {c:#04x} {lookup:?}: {g} against {w}"
                        );
                    }
                }
            }
        }
    }
}
