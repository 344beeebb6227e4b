/**
 * @file fp8.cuh
 * @brief Cache elements to the values the products use, bit-exact with the CPU backend:
 * decode, times k_scale (fp8 only), rounded to the model dtype (docs/contract.md, "Numerics").
 *
 * fp8 becomes f16 (exact for every code): in hardware on sm_89 and up, else with integer
 * moves (e5m2 is the top byte of an f16; e4m3 shifted into an f16's exponent and mantissa is
 * 2^-8 times its value, subnormals included; 0x7f/0xff are NaN).
 *
 * Products in f16 (the mma and wgmma kernels' fp8 path): decoding, scaling and rounding every
 * element (convert8) cost the fp8 decode more than its halved bytes saved. Since every fp8
 * code is an f16, the kernels instead multiply the raw codes as f16 (one conversion
 * instruction a pair, fp8x8_to_f16), apply k_scale once to the scores and once to the
 * output in f32 (it is one scale for K and V), and run q and P as f16: a bf16 q is rewritten
 * as f16 times a power of two that puts its largest magnitude in [2^14, 2^15)
 * (q_to_f16, exact for every element within 2^24 of the largest), which the score scale
 * takes back. This is at least as exact as rounding k_scale x code to the model dtype.
 *
 * The fp8-query mode (MLA_QFP8, docs/contract.md) runs the same f16 products on e4m3 codes:
 * q is rewritten once as the f16 values of e4m3(q / q_scale) (q_to_e4m3), P as those of
 * e4m3(P x FP8_P_SCALE) (pack_p), and q_scale goes on the scores, 1 / FP8_P_SCALE on the
 * output. A product of two fp8 values is exact in f16 and f32, so these are the numbers fp8
 * tensor cores would give, up to the order of the f32 sums.
 */
#pragma once
#include "common/ptx.cuh"

__device__ __forceinline__ float e4m3_to_float(u32 b) {
    const u32 mag = b & 0x7fu;
    const float v = f16_to_float(((b & 0x80u) << 8) | (mag << 7)) * 256.0f;
    return mag == 0x7fu ? bits_to_float(0x7fffffffu) : v;
}

__device__ __forceinline__ float e5m2_to_float(u32 b) {
    return f16_to_float(b << 8);
}

/// Two fp8 values (bytes 0 and 1 of `pair`) as f32, exactly. sm_89 and up convert in
/// hardware; older parts take the integer path above (the seed rejects fp8 there anyway, but
/// the kernels still compile for them).
template <int KV_FORMAT>
__device__ __forceinline__ void fp8x2_to_float(u32 pair, float& lo, float& hi) {
#if __CUDA_ARCH__ >= 890
    u32 h2;
    const u16 b = (u16)pair;
    if (KV_FORMAT == 2) {
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(b));
    } else {
        asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(h2) : "h"(b));
    }
    lo = f16_to_float(h2 & 0xffffu);
    hi = f16_to_float(h2 >> 16);
#else
    lo = KV_FORMAT == 2 ? e4m3_to_float(pair & 0xffu) : e5m2_to_float(pair & 0xffu);
    hi = KV_FORMAT == 2 ? e4m3_to_float((pair >> 8) & 0xffu) : e5m2_to_float((pair >> 8) & 0xffu);
#endif
}

/// KV_FORMAT: 1 = the other 16-bit type than the model's, 2 = fp8 e4m3, 3 = fp8 e5m2.
/// Converts 8 raw elements (16 bytes of a 16-bit cache, or the low 8 bytes for fp8) into 8
/// model-dtype elements.
template <int KV_FORMAT, bool BF16>
__device__ __forceinline__ u32x4 convert8(u32x4 raw, float k_scale) {
    float f[8];
    if (KV_FORMAT == 1) {
        const u32 w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            // The stored type is the other one: f16 under a bf16 model, bf16 under f16.
            f[2 * i] = half_to_float<!BF16>(w[i] & 0xffffu);
            f[2 * i + 1] = half_to_float<!BF16>(w[i] >> 16);
        }
    } else {
        const u32 w[2] = {raw.x, raw.y};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float lo, hi;
            fp8x2_to_float<KV_FORMAT>(w[i / 2] >> (16 * (i % 2)), lo, hi);
            f[2 * i] = lo * k_scale;
            f[2 * i + 1] = hi * k_scale;
        }
    }
    return {pack2<BF16>(f[0], f[1]), pack2<BF16>(f[2], f[3]), pack2<BF16>(f[4], f[5]),
            pack2<BF16>(f[6], f[7])};
}

/// Four fp8 codes (the bytes of `w`, the first lowest) as four f16, exactly and unscaled:
/// codes 0 and 1 in .x, 2 and 3 in .y, each first in the low half. e5m2 is the top byte of
/// an f16 (subnormals, infinities and NaN included), so a byte permute a pair places it, on
/// the integer pipe; e4m3 takes one conversion instruction a pair on sm_89 and up (the high
/// pair read in place, as the instruction's upper-half operand), which Hopper issues at a
/// fraction of the integer rate.
template <int KV_FORMAT>
__device__ __forceinline__ u32x2 fp8x4_to_f16(u32 w) {
    if (KV_FORMAT == 3) return {__byte_perm(w, 0u, 0x1404u), __byte_perm(w, 0u, 0x3424u)};
#if __CUDA_ARCH__ >= 890
    u32x2 h;
    asm("{.reg .b16 lo, hi;\n\tmov.b32 {lo, hi}, %2;\n\t"
        "cvt.rn.f16x2.e4m3x2 %0, lo;\n\tcvt.rn.f16x2.e4m3x2 %1, hi;}"
        : "=r"(h.x), "=r"(h.y)
        : "r"(w));
    return h;
#else
    float f[4];
    fp8x2_to_float<KV_FORMAT>(w, f[0], f[1]);
    fp8x2_to_float<KV_FORMAT>(w >> 16, f[2], f[3]);
    return {pack2<false>(f[0], f[1]), pack2<false>(f[2], f[3])};
#endif
}

/// 8 fp8 codes (the 8 bytes of `raw`, first in the low half) as 8 f16, exactly and unscaled.
template <int KV_FORMAT>
__device__ __forceinline__ u32x4 fp8x8_to_f16(u32x2 raw) {
    const u32x2 lo = fp8x4_to_f16<KV_FORMAT>(raw.x), hi = fp8x4_to_f16<KV_FORMAT>(raw.y);
    return {lo.x, lo.y, hi.x, hi.y};
}

/// A power of two as f32, for exponents in [-126, 127].
__device__ __forceinline__ float pow2(int e) {
    return __uint_as_float((u32)(e + 127) << 23);
}

/// Rewrites a tile of 16-bit pairs in shared memory in place: each pair (as f32, by `read`)
/// becomes `f(lo, hi)`. `chunks` 16-byte chunks, chunk c at byte `at(c)` of `q`. Every one of
/// the THREADS threads calls it; it ends with a barrier.
template <int THREADS, typename At, typename F, typename Read>
__device__ __forceinline__ void rewrite_pairs(unsigned char* q, int chunks, At at, F f, Read read) {
    for (int c = threadIdx.x; c < chunks; c += THREADS) {
        u32x4* at_c = (u32x4*)(q + at(c));
        const u32x4 v = *at_c;
        const u32 w[4] = {v.x, v.y, v.z, v.w};
        u32 h[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) h[i] = f(read(w[i] & 0xffffu), read(w[i] >> 16));
        *at_c = {h[0], h[1], h[2], h[3]};
    }
    __syncthreads();
}

/// Rewrites a bf16 q tile in shared memory as f16 times 2^e, e putting its largest magnitude
/// in [2^14, 2^15), and returns 2^-e (for the score scale). `chunks` 16-byte chunks of 8
/// elements, chunk c at byte `at(c)` of `q`; `scratch` one u32 of shared memory the caller
/// does not use meanwhile. Every one of the THREADS threads calls it after q landed and a
/// barrier; it ends with a barrier. A q of zeros keeps e = 0; an infinite or NaN element
/// stays one.
template <int THREADS, typename At>
__device__ __forceinline__ float q_to_f16(unsigned char* q, int chunks, At at, u32* scratch) {
    if (threadIdx.x == 0) *scratch = 0u;
    float mx = 0.0f;
    for (int c = threadIdx.x; c < chunks; c += THREADS) {
        const u32x4 v = *(const u32x4*)(q + at(c));
        const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            mx = fmaxf(mx, fmaxf(fabsf(bf16_to_float(w[i] & 0xffffu)), fabsf(bf16_to_float(w[i] >> 16))));
        }
    }
#pragma unroll
    for (int d = 16; d > 0; d /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, d));
    __syncthreads();  // scratch is 0 for everyone
    if (threadIdx.x % 32 == 0) atomicMax(scratch, __float_as_uint(mx));  // >= 0: ordered as integers
    __syncthreads();
    const u32 bits = *scratch;
    // The largest magnitude's binary exponent (subnormals count as -127, inf and NaN as 128).
    const int top = (int)((bits >> 23) & 0xffu) - 127;
    const int e = bits == 0u ? 0 : min(126, max(-126, 14 - top));
    const float up = pow2(e);
    rewrite_pairs<THREADS>(q, chunks, at, [up](float lo, float hi) { return pack2<false>(lo * up, hi * up); },
                           [](u32 h) { return bf16_to_float(h); });
    return pow2(-e);
}

/// The fp8-query mode's factor on P before its rounding to e4m3 (and 1 / it on the output):
/// mla::dtype::FP8_P_SCALE.
constexpr float FP8_P_SCALE = 256.0f;

/// x / d for many x and one d, rounded as the division rounds (the host's q / q_scale, bit
/// for bit) at three FMA-pipe instructions a quotient instead of the division's eight and its
/// slow-path check: the reciprocal rounded to nearest once, then Markstein's correction of
/// the product, exact wherever the quotient is a normal f32 (dtype.rs's property test; 10^8
/// random pairs checked once against the division). Where x / (1 / d) overflows the product
/// (an infinity: the e4m3 conversion saturates it as it would the quotient) or is NaN, it is
/// returned as is.
struct Divider {
    float d, inv;
    __device__ explicit Divider(float divisor) : d(divisor), inv(__frcp_rn(divisor)) {}
    __device__ __forceinline__ float of(float x) const {
        const float q = __fmul_rn(x, inv);
        return isfinite(q) ? fmaf(fmaf(-q, d, x), inv, q) : q;
    }
};

#if __CUDA_ARCH__ >= 890
/// Two f32 rounded to e4m3 as e4m3x2_as_f16x2 rounds them, as the two codes (`lo` in the low
/// byte): what fp8 wgmma multiplies. sm_89 and up only.
__device__ __forceinline__ u32 e4m3x2_bits(float lo, float hi) {
    u16 b;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(b) : "f"(hi), "f"(lo));
    return b;
}

/// Two f32 each split into two e4m3 terms, x = hi + lo + r: hi = e4m3(x), lo = e4m3(x - hi)
/// (x - hi is exact in f32). A bf16 of magnitude in [2^-2, 448] is exactly hi + lo (x - hi is
/// at most 8 of x's last places, which e4m3 holds), so fp8 wgmma on both terms multiplies the
/// value itself; an f16 keeps about 8 of its 11 significant bits (|r| <= 2^-8 |x|, twice
/// bf16's rounding). The narrow kernel's fp8 products (decode_narrow/NOTES.md). Returns the
/// codes: hi's pair in the low 16 bits (x0's code lowest), lo's pair in the high 16. sm_89
/// and up only.
__device__ __forceinline__ u32 e4m3x2_split(float x0, float x1) {
    const u32 hi = e4m3x2_bits(x0, x1);
    float h0, h1;
    fp8x2_to_float<2>(hi, h0, h1);
    const u32 lo = e4m3x2_bits(x0 - h0, x1 - h1);
    return hi | lo << 16;
}

/// The fp8-query mode's q codes: the eight 16-bit elements (model dtype) of a 16-byte piece
/// `v` divided by q_scale (`by`) and rounded to e4m3, in order, the first in the low byte.
/// sm_89 and up only.
template <bool BF16>
__device__ __forceinline__ u32x2 q_codes8(u32x4 v, const Divider& by) {
    const auto four = [&by](u32 w0, u32 w1) {
        const u32 lo = e4m3x2_bits(by.of(half_to_float<BF16>(w0 & 0xffffu)), by.of(half_to_float<BF16>(w0 >> 16)));
        const u32 hi = e4m3x2_bits(by.of(half_to_float<BF16>(w1 & 0xffffu)), by.of(half_to_float<BF16>(w1 >> 16)));
        return lo | hi << 16;
    };
    return {four(v.x, v.y), four(v.z, v.w)};
}
#endif

/// Two f32 rounded to e4m3 (to nearest, ties to even, saturating at +-448; NaN stays NaN) and
/// returned as the two f16 of those values, `lo` in the low half (exact: every e4m3 value is
/// an f16). mla::dtype::round_e4m3 is its host twin.
__device__ __forceinline__ u32 e4m3x2_as_f16x2(float lo, float hi) {
#if __CUDA_ARCH__ >= 890
    const u16 b = (u16)e4m3x2_bits(lo, hi);
    u32 h;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(b));
    return h;
#else
    // fp8 needs sm_89 (the configuration refuses it below: Error::Fp8NeedsSm89); the same
    // rounding in software keeps the kernels compiling for older parts.
    float v[2] = {lo, hi};
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const float a = fabsf(v[i]);
        float r;
        if (a != a) {
            r = a;
        } else if (a < 0.015625f) {  // below 2^-6: e4m3's subnormals, steps of 2^-9
            r = rintf(a * 512.0f) * (1.0f / 512.0f);
        } else {
            // Three mantissa bits: steps of 2^(exponent - 3), exact powers of two.
            const int e = (int)((__float_as_uint(fminf(a, 1024.0f)) >> 23) & 0xffu) - 127;
            const float step = pow2(e - 3);
            r = fminf(rintf(a / step) * step, 448.0f);
        }
        v[i] = copysignf(r, v[i]);
    }
    return pack2<false>(v[0], v[1]);
#endif
}

/// The fp8-query mode: rewrites a q tile of the model dtype in shared memory as the f16
/// values of its e4m3 codes, e4m3(q / q_scale), for the f16 products (the caller puts q_scale
/// on the score scale). `chunks` 16-byte chunks of 8 elements, chunk c at byte `at(c)` of
/// `q`, as q_to_f16. Every one of the THREADS threads calls it after q landed and a barrier;
/// it ends with a barrier.
template <int THREADS, bool BF16, typename At>
__device__ __forceinline__ void q_to_e4m3(unsigned char* q, int chunks, At at, float q_scale) {
    const Divider by(q_scale);  // the host's q / q_scale, bit for bit
    rewrite_pairs<THREADS>(q, chunks, at,
                           [by](float lo, float hi) { return e4m3x2_as_f16x2(by.of(lo), by.of(hi)); },
                           [](u32 h) { return half_to_float<BF16>(h); });
}

/// Two probabilities as `P V` multiplies them: rounded to the model's 16-bit type (BF16), or
/// in the fp8-query mode (QFP8) times FP8_P_SCALE rounded to e4m3, as f16.
template <bool QFP8, bool BF16>
__device__ __forceinline__ u32 pack_p(float lo, float hi) {
    if (QFP8) return e4m3x2_as_f16x2(lo * FP8_P_SCALE, hi * FP8_P_SCALE);
    return pack2<BF16>(lo, hi);
}
