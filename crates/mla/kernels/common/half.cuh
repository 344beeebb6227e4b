/**
 * @file half.cuh
 * @brief 16-byte vector types and the 16-bit float conversions every kernel family uses
 * (the decode kernels through ptx.cuh, the DCP kernels directly). Includes no parameter
 * header, so that a family's parameters stay its own. bf16/f16 values travel as raw 16-bit
 * patterns; BF16 (true: bf16, false: f16) picks the type.
 */
#pragma once

typedef unsigned short u16;
typedef unsigned int u32;

struct __align__(16) u32x4 {
    u32 x, y, z, w;
};
struct __align__(8) u32x2 {
    u32 x, y;
};
struct __align__(8) f32x2 {
    float x, y;
};
struct __align__(16) f32x4 {
    float x, y, z, w;
};

__device__ __forceinline__ float bits_to_float(u32 b) {
    float f;
    asm("mov.b32 %0, %1;" : "=f"(f) : "r"(b));
    return f;
}

/// The larger of a and b, NaN when either is (sm_80 and up). fmaxf returns the other operand
/// of a NaN, so a merge that takes its maximum with fmaxf would drop a NaN LSE and report the
/// row as having no key (lse -inf); a NaN in q or a key must reach o and lse.
__device__ __forceinline__ float fmax_nan(float a, float b) {
    float d;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
    return d;
}

/// A bf16 bit pattern as f32 (exact).
__device__ __forceinline__ float bf16_to_float(u32 h) {
    return __int_as_float((int)(h << 16));
}

/// An f16 bit pattern as f32 (exact, subnormals included).
__device__ __forceinline__ float f16_to_float(u32 h) {
    float f;
    u16 s = (u16)h;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(s));
    return f;
}

/// Two f32 rounded to nearest even into the model's 16-bit type: `lo` in the low half.
template <bool BF16>
__device__ __forceinline__ u32 pack2(float lo, float hi) {
    u32 r;
    if (BF16) {
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    } else {
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    }
    return r;
}

/// A 16-bit pattern of the model's type as f32.
template <bool BF16>
__device__ __forceinline__ float half_to_float(u32 h) {
    return BF16 ? bf16_to_float(h) : f16_to_float(h);
}
