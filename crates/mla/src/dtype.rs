//! Element types: the model (query) dtype, the KV cache dtype by vLLM's names, the storage
//! dtype of a tensor, and the one rule that turns a cache element into the value the decode
//! multiplies (decode, times k_scale for fp8, rounded to the query dtype).
//!
//! Both the CPU backend and the f64 reference take cache values through [`KvFormat::decoder`],
//! so they see the very same key and value numbers.

use std::fmt;
use std::str::FromStr;

use float8::{F8E4M3, F8E5M2};
use half::{bf16, f16};

use crate::error::{Error, Result};

/// The model dtype: the dtype of q and o.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ModelDtype {
    /// bfloat16.
    Bf16,
    /// float16.
    F16,
}

impl ModelDtype {
    /// vLLM's (and torch's) name.
    pub fn name(self) -> &'static str {
        match self {
            ModelDtype::Bf16 => "bfloat16",
            ModelDtype::F16 => "float16",
        }
    }

    /// The storage dtype of a tensor of this model dtype.
    pub fn storage(self) -> DType {
        match self {
            ModelDtype::Bf16 => DType::BF16,
            ModelDtype::F16 => DType::F16,
        }
    }

    /// `x` rounded (to nearest even) to this dtype and back: the rounding points of the
    /// contract (cache values before Q.K^T, P before P.V, the output).
    #[inline]
    pub fn round(self, x: f32) -> f32 {
        match self {
            ModelDtype::Bf16 => bf16::from_f32(x).to_f32(),
            ModelDtype::F16 => f16::from_f32(x).to_f32(),
        }
    }
}

impl FromStr for ModelDtype {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "bfloat16" | "bf16" => Ok(ModelDtype::Bf16),
            "float16" | "f16" | "half" => Ok(ModelDtype::F16),
            _ => Err(Error::UnknownModelDtype { name: s.into() }),
        }
    }
}

impl fmt::Display for ModelDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The KV cache dtype, by vLLM's `--kv-cache-dtype` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CacheDtype {
    /// `auto`: the model dtype.
    Auto,
    /// `bfloat16`.
    Bf16,
    /// `float16`.
    F16,
    /// `fp8` or `fp8_e4m3`: e4m3 with one per-tensor scale.
    Fp8E4m3,
    /// `fp8_e5m2`: e5m2 with one per-tensor scale.
    Fp8E5m2,
    /// `fp8_ds_mla`: DeepSeek's 656-byte token (512 e4m3 + 4 f32 scales + 64 bf16 rope).
    /// Parsed so that it is reported clearly; not supported yet.
    Fp8DsMla,
}

impl CacheDtype {
    /// vLLM's name (`fp8` is reported as `fp8_e4m3`, which it means).
    pub fn name(self) -> &'static str {
        match self {
            CacheDtype::Auto => "auto",
            CacheDtype::Bf16 => "bfloat16",
            CacheDtype::F16 => "float16",
            CacheDtype::Fp8E4m3 => "fp8_e4m3",
            CacheDtype::Fp8E5m2 => "fp8_e5m2",
            CacheDtype::Fp8DsMla => "fp8_ds_mla",
        }
    }

    /// Whether vLLM counts it as fp8 (`kv_cache_dtype.startswith("fp8")`).
    pub fn is_fp8(self) -> bool {
        matches!(
            self,
            CacheDtype::Fp8E4m3 | CacheDtype::Fp8E5m2 | CacheDtype::Fp8DsMla
        )
    }

    /// The storage format of the cache for a model dtype; an error for formats not supported.
    pub fn resolve(self, model: ModelDtype) -> Result<KvFormat> {
        Ok(match self {
            CacheDtype::Auto => match model {
                ModelDtype::Bf16 => KvFormat::Bf16,
                ModelDtype::F16 => KvFormat::F16,
            },
            CacheDtype::Bf16 => KvFormat::Bf16,
            CacheDtype::F16 => KvFormat::F16,
            CacheDtype::Fp8E4m3 => KvFormat::Fp8E4m3,
            CacheDtype::Fp8E5m2 => KvFormat::Fp8E5m2,
            CacheDtype::Fp8DsMla => {
                return Err(Error::CacheDtypeNotSupportedYet {
                    name: self.name().into(),
                });
            }
        })
    }
}

impl FromStr for CacheDtype {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(CacheDtype::Auto),
            "bfloat16" => Ok(CacheDtype::Bf16),
            "float16" => Ok(CacheDtype::F16),
            "fp8" | "fp8_e4m3" => Ok(CacheDtype::Fp8E4m3),
            "fp8_e5m2" => Ok(CacheDtype::Fp8E5m2),
            "fp8_ds_mla" => Ok(CacheDtype::Fp8DsMla),
            _ => Err(Error::UnknownCacheDtype { name: s.into() }),
        }
    }
}

impl fmt::Display for CacheDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How cache elements are stored, once `auto` is resolved against the model dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvFormat {
    /// bfloat16 elements.
    Bf16,
    /// float16 elements.
    F16,
    /// fp8 e4m3 elements, times k_scale.
    Fp8E4m3,
    /// fp8 e5m2 elements, times k_scale.
    Fp8E5m2,
}

impl KvFormat {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            KvFormat::Bf16 | KvFormat::F16 => 2,
            KvFormat::Fp8E4m3 | KvFormat::Fp8E5m2 => 1,
        }
    }

    /// Whether elements are fp8 (and k_scale applies).
    pub fn is_fp8(self) -> bool {
        matches!(self, KvFormat::Fp8E4m3 | KvFormat::Fp8E5m2)
    }

    /// The tensor dtypes a cache of this format may be stored as. A byte tensor is read as the
    /// fp8 format, as vLLM views its uint8 cache.
    pub fn accepts(self, d: DType) -> bool {
        match self {
            KvFormat::Bf16 => d == DType::BF16,
            KvFormat::F16 => d == DType::F16,
            KvFormat::Fp8E4m3 => matches!(d, DType::F8E4M3 | DType::U8),
            KvFormat::Fp8E5m2 => matches!(d, DType::F8E5M2 | DType::U8),
        }
    }

    /// The name of the dtypes [`KvFormat::accepts`], for error messages.
    pub fn expected_storage(self) -> &'static str {
        match self {
            KvFormat::Bf16 => "bf16",
            KvFormat::F16 => "f16",
            KvFormat::Fp8E4m3 => "f8e4m3 or u8",
            KvFormat::Fp8E5m2 => "f8e5m2 or u8",
        }
    }

    /// The cache value -> multiplied value rule for a query dtype and k_scale.
    pub fn decoder(self, q: ModelDtype, k_scale: f32) -> KvDecoder {
        let mut fp8 = [0f32; 256];
        if self.is_fp8() {
            for (bits, v) in fp8.iter_mut().enumerate() {
                let raw = match self {
                    KvFormat::Fp8E4m3 => F8E4M3::from_bits(bits as u8).to_f32(),
                    _ => F8E5M2::from_bits(bits as u8).to_f32(),
                };
                *v = q.round(raw * k_scale);
            }
        }
        KvDecoder {
            format: self,
            q,
            fp8,
        }
    }
}

/// The fp8-query mode's rounding of q and P (docs/contract.md): to the nearest fp8 e4m3
/// value, ties to even, saturating at +-448 (infinities too; NaN stays NaN), as the GPU's
/// `cvt.rn.satfinite.e4m3x2.f32`.
pub fn round_e4m3(x: f32) -> f32 {
    F8E4M3::from_f32(x).to_f32()
}

/// In the fp8-query mode P (at most 1) is multiplied by this power of two before its rounding
/// to e4m3, and the output divided by it: probabilities down to 2^-17 of the row's running
/// maximum keep a value, where e4m3's own range would flush those below 2^-10 to zero.
pub const FP8_P_SCALE: f32 = 256.0;

/// Turns stored cache elements into the f32 values the products use: decode, times k_scale
/// (fp8 only), rounded to the query dtype. fp8 goes through a 256-entry table.
#[derive(Clone)]
pub struct KvDecoder {
    format: KvFormat,
    q: ModelDtype,
    fp8: [f32; 256],
}

impl KvDecoder {
    /// The format this decoder reads.
    pub fn format(&self) -> KvFormat {
        self.format
    }

    /// Decodes `src` (raw little-endian elements of this format) into `dst`; `dst.len()`
    /// elements are read.
    ///
    /// # Panics
    /// If `src` holds fewer than `dst.len()` elements (an internal invariant: callers slice
    /// validated rows).
    #[inline]
    pub fn decode(&self, src: &[u8], dst: &mut [f32]) {
        let n = dst.len();
        match self.format {
            KvFormat::Fp8E4m3 | KvFormat::Fp8E5m2 => {
                for (d, &b) in dst.iter_mut().zip(&src[..n]) {
                    *d = self.fp8[b as usize];
                }
            }
            KvFormat::Bf16 => {
                decode_half::<bf16>(&src[..2 * n], dst);
                self.round_if_other(ModelDtype::Bf16, dst);
            }
            KvFormat::F16 => {
                decode_half::<f16>(&src[..2 * n], dst);
                self.round_if_other(ModelDtype::F16, dst);
            }
        }
    }

    /// A 16-bit cache read by a query of the other 16-bit dtype is rounded to the query's.
    fn round_if_other(&self, stored: ModelDtype, dst: &mut [f32]) {
        if self.q != stored {
            dst.iter_mut().for_each(|x| *x = self.q.round(*x));
        }
    }
}

/// 16-bit floats to f32 with half's vectorized conversion. Host tensors are built from typed
/// slices, so the bytes are aligned; the byte-wise path only guards that invariant.
fn decode_half<T>(src: &[u8], dst: &mut [f32])
where
    T: bytemuck::Pod,
    [T]: half::slice::HalfFloatSliceExt,
{
    use half::slice::HalfFloatSliceExt;
    match bytemuck::try_cast_slice::<u8, T>(src) {
        Ok(typed) => typed.convert_to_f32_slice(dst),
        Err(_) => {
            for (d, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
                let bits = u16::from_le_bytes([c[0], c[1]]);
                let typed: &[T] = bytemuck::cast_slice(std::slice::from_ref(&bits));
                typed.convert_to_f32_slice(std::slice::from_mut(d));
            }
        }
    }
}

/// The dtype of a tensor as stored in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// bfloat16.
    BF16,
    /// float16.
    F16,
    /// float32.
    F32,
    /// int32.
    I32,
    /// Raw bytes (an fp8 cache as vLLM allocates it).
    U8,
    /// fp8 e4m3 (`torch.float8_e4m3fn`).
    F8E4M3,
    /// fp8 e5m2 (`torch.float8_e5m2`).
    F8E5M2,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::U8 | DType::F8E4M3 | DType::F8E5M2 => 1,
        }
    }

    /// Short name, as in error messages.
    pub fn name(self) -> &'static str {
        match self {
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::F32 => "f32",
            DType::I32 => "i32",
            DType::U8 => "u8",
            DType::F8E4M3 => "f8e4m3",
            DType::F8E5M2 => "f8e5m2",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A host element type with its [`DType`]: what a host tensor can be built from.
pub trait Element: bytemuck::Pod + Send + Sync {
    /// Its dtype.
    const DTYPE: DType;
}

macro_rules! element {
    ($($t:ty => $d:ident),* $(,)?) => {
        $(impl Element for $t { const DTYPE: DType = DType::$d; })*
    };
}
element!(bf16 => BF16, f16 => F16, f32 => F32, i32 => I32, u8 => U8, F8E4M3 => F8E4M3, F8E5M2 => F8E5M2);

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// The kernels' fp8-query q codes divide by q_scale as `Divider` in
        /// kernels/common/fp8.cuh does: the reciprocal rounded once, then one Markstein
        /// correction of the product. That is the division, bit for bit, wherever the
        /// quotient is a normal f32 (the host's rounding of q / q_scale).
        #[test]
        fn the_kernels_division_by_q_scale_is_the_division(
            x in -1.0e30f32..1.0e30,
            d in 1.0e-6f32..1.0e6,
        ) {
            let want = x / d;
            proptest::prop_assume!(want == 0.0 || want.abs() >= f32::MIN_POSITIVE);
            let inv = 1.0 / d;
            let q = x * inv;
            let got = if q.is_finite() { (-q).mul_add(d, x).mul_add(inv, q) } else { q };
            proptest::prop_assert_eq!(got.to_bits(), want.to_bits(), "{} / {}", x, d);
        }
    }

    /// The narrow kernel's fp8 products take a 16-bit value as two e4m3 terms, hi = e4m3(x)
    /// and lo = e4m3(x - hi) (kernels/common/fp8.cuh, `e4m3x2_split`, whose rounding is
    /// `round_e4m3`'s): every bf16 of magnitude 2^-2 to 448 is exactly their sum (the kernel
    /// scales each head's q into that range), every such f16 within 2^-8 of itself.
    #[test]
    fn a_16_bit_value_is_two_e4m3_terms() {
        let split = |x: f32| {
            let hi = round_e4m3(x);
            hi + round_e4m3(x - hi)
        };
        let in_range = |x: f32| (0.25..=448.0).contains(&x.abs());
        for bits in 0..=u16::MAX {
            let b = half::bf16::from_bits(bits).to_f32();
            if in_range(b) {
                assert_eq!(split(b), b, "bf16 {b}");
            }
            let f = half::f16::from_bits(bits).to_f32();
            if in_range(f) {
                let err = (split(f) - f).abs();
                assert!(err <= f.abs() * 2f32.powi(-8), "f16 {f}: {err}");
            }
        }
    }

    #[test]
    fn vllm_cache_dtype_names_parse() {
        let cases = [
            ("auto", CacheDtype::Auto),
            ("bfloat16", CacheDtype::Bf16),
            ("float16", CacheDtype::F16),
            ("fp8", CacheDtype::Fp8E4m3),
            ("fp8_e4m3", CacheDtype::Fp8E4m3),
            ("fp8_e5m2", CacheDtype::Fp8E5m2),
            ("fp8_ds_mla", CacheDtype::Fp8DsMla),
        ];
        for (name, want) in cases {
            assert_eq!(name.parse::<CacheDtype>().unwrap(), want, "{name}");
        }
        let e = "fp4".parse::<CacheDtype>().unwrap_err();
        assert!(matches!(e, Error::UnknownCacheDtype { .. }));
        assert!(e.to_string().contains("\"fp4\""), "{e}");
    }

    #[test]
    fn fp8_ds_mla_is_reported_not_supported() {
        let e = CacheDtype::Fp8DsMla.resolve(ModelDtype::Bf16).unwrap_err();
        assert_eq!(
            e.to_string(),
            "kv_cache_dtype fp8_ds_mla is not supported by mla yet"
        );
    }

    #[test]
    fn auto_follows_the_model_dtype() {
        assert_eq!(
            CacheDtype::Auto.resolve(ModelDtype::Bf16).unwrap(),
            KvFormat::Bf16
        );
        assert_eq!(
            CacheDtype::Auto.resolve(ModelDtype::F16).unwrap(),
            KvFormat::F16
        );
    }

    #[test]
    fn fp8_decoder_scales_then_rounds_to_the_query_dtype() {
        let dec = KvFormat::Fp8E4m3.decoder(ModelDtype::Bf16, 0.3);
        for bits in 0..=255u8 {
            let raw = F8E4M3::from_bits(bits).to_f32();
            let want = bf16::from_f32(raw * 0.3).to_f32();
            let mut out = [0f32];
            dec.decode(&[bits], &mut out);
            assert!(out[0].to_bits() == want.to_bits() || (out[0].is_nan() && want.is_nan()));
        }
        let dec = KvFormat::Fp8E5m2.decoder(ModelDtype::F16, 2.0);
        let mut out = [0f32];
        dec.decode(&[F8E5M2::from_f32(1.5).to_bits()], &mut out);
        assert_eq!(out[0], 3.0);
    }

    #[test]
    fn sixteen_bit_decoder_rounds_to_a_different_query_dtype() {
        // 1 + 2^-9 is exact in f16 and not in bf16.
        let x = f16::from_f32(1.0 + 1.0 / 512.0);
        let dec = KvFormat::F16.decoder(ModelDtype::Bf16, 1.0);
        let mut out = [0f32];
        dec.decode(&x.to_le_bytes(), &mut out);
        assert_eq!(out[0], 1.0);
        let dec = KvFormat::F16.decoder(ModelDtype::F16, 7.0); // k_scale ignored off fp8
        dec.decode(&x.to_le_bytes(), &mut out);
        assert_eq!(out[0], 1.0 + 1.0 / 512.0);
    }

    #[test]
    fn storage_acceptance() {
        assert!(KvFormat::Fp8E4m3.accepts(DType::U8));
        assert!(KvFormat::Fp8E4m3.accepts(DType::F8E4M3));
        assert!(!KvFormat::Fp8E4m3.accepts(DType::F8E5M2));
        assert!(!KvFormat::Bf16.accepts(DType::F16));
    }
}
