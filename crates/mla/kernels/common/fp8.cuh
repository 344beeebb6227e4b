/**
 * @file fp8.cuh
 * @brief Cache elements to the values the products use, bit-exact with the CPU backend:
 * decode, times k_scale (fp8 only), rounded to the model dtype (docs/contract.md, "Numerics").
 *
 * fp8 becomes f16 (exact for every code): in hardware on sm_89 and up, else with integer
 * moves (e5m2 is the top byte of an f16; e4m3 shifted into an f16's exponent and mantissa is
 * 2^-8 times its value, subnormals included; 0x7f/0xff are NaN).
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
