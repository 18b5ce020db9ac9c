// The minifloat maps' codec (q8_minifloat.h, the specification) on a thread's 8 values: codes decoded from
// their bits, and values coded by integer arithmetic on theirs, with no table. Used by the step kernels
// (q8_cuda_step.cuh) and the quantize kernel (q8_cuda_kernels.cu).
//
// Decoding: u(c), code c's value with the top binade at [1, 2), is the float whose bits are c << 19 times
// 2^(127 - B) (bits below 2^23 are a float subnormal, c * 2^-130, which is how the format's subnormals are
// spaced); a map entry is u(c) * float32(1/1.9375), so bits(c << 19) times the exact constant 2^(127 - B) /
// 1.9375 rounds once to the entry. Two products a value: the entry, then the entry times the block's maximum.
//
// Coding: a value z (times 1.9375 / A) times 2^-(127 - B) has as float bits the fixed-point code of
// q8_mf_fixed: from 2^(1 - B) up the exponent moves down by 127 - B, below it the product is a float subnormal
// rounded, to nearest even, to the same grid the addition of 2^(1 - B) rounds to. A signed map's codes lie on
// one line, 127 + the magnitude code for positive values and 127 - it for negative ones; with the magnitude's
// fixed point f and s = 0 or -1 for the sign, the position 127 + (f ^ s) - s plus what rounds it, turned with
// the sign ((r ^ s) >> 13 for random bits r: 2^19 - 1 - (r >> 13) for a negative value), is the code after a
// shift, and guided rounding draws where the old code is within one of that position (the same test for both
// signs, f ^ s putting a negative value's boundaries on the right side). Codes past the ends (a value within
// a rounding of the top, or negative and past it) saturate in the byte pack.
#pragma once

#include <stdint.h>

#include "q8_common.h"
#include "q8_cuda_fastmath.cuh"  // q8_div_fast
#include "q8_cuda_load_store.cuh"  // kElems
#include "q8_cuda_ptx.cuh"
#include "q8_minifloat.h"

namespace ds_q8 {
namespace {

// 2^-(127 - B): a value times it has the fixed-point code as its bits.
template <bool kSigned>
__device__ __forceinline__ float mf_down() { return kSigned ? 0x1p-120f : 0x1p-112f; }
// 2^(127 - B) times float32(1 / 1.9375), exact: bits(c << 19) times it is code c's map entry, rounded once.
template <bool kSigned>
__device__ __forceinline__ float mf_up() { return kMfInvTop * (kSigned ? 0x1p120f : 0x1p112f); }

// Code i of the 8 a thread packs in two words.
__device__ __forceinline__ uint32_t code_at(const uint32_t (&w)[2], int i) { return (w[i >> 2] >> (8 * (i & 3))) & 255u; }

// The 8 values of a thread's codes `w` times the block's maximum `absmax` (q8_mf_value(c) * absmax).
template <bool kSigned>
__device__ __forceinline__ void mf_decode8(const uint32_t (&w)[2], float absmax, float (&v)[kElems]) {
#pragma unroll
    for (int i = 0; i < kElems; ++i) {
        const uint32_t c = code_at(w, i);
        uint32_t bits = c << 19;
        if (kSigned) {  // |c - 127| << 19, with c - 127's sign
            const int32_t d = (int32_t)bits - (127 << 19);
            bits = (uint32_t)(d < 0 ? -d : d) | ((uint32_t)d & 0x80000000u);
        }
        v[i] = (__uint_as_float(bits) * mf_up<kSigned>()) * absmax;
    }
}

// The code of z (a finite block's value times q8_mf_scale, |z| at most a rounding above 1.9375 * 1.004) as an
// int, before the pack saturates it; `r` its random bits, `old` its old code. kMode: Q8_ROUND_BY_OLD_CODE,
// or -1 for nearest or stochastic as `stochastic` says.
template <bool kSigned, int kMode>
__device__ __forceinline__ int mf_encode(float z, uint32_t r, uint32_t old, bool stochastic) {
    const uint32_t u = __float_as_uint(z);
    bool draw = kMode != Q8_ROUND_BY_OLD_CODE && stochastic;
    if (kSigned) {
        const uint32_t s = (uint32_t)((int32_t)u >> 31);
        const uint32_t g = __float_as_uint(fabsf(z) * mf_down<true>()) ^ s;  // the magnitude's fixed point, turned
        if (kMode == Q8_ROUND_BY_OLD_CODE) draw = g - (old << 19) + (128u << 19) < (2u << 19);
        const uint32_t pick = draw ? r : 0x7FFFE000u;  // (pick ^ s) >> 13: 2^18 - 1 up, 2^18 + 1 down (s)
        return (int32_t)((127u << 19) - s + g + ((pick ^ s) >> 13)) >> 19;
    }
    // unsigned: a negative value's bits are a negative int, and its code one too (saturated to 0)
    const int32_t f = (int32_t)__float_as_uint(z * mf_down<false>());
    if (kMode == Q8_ROUND_BY_OLD_CODE) draw = (uint32_t)f - (old << 19) + (1u << 19) < (2u << 19);
    const uint32_t pick = draw ? r : 0x7FFFE000u;
    const int32_t c = (f + (int32_t)(pick >> 13)) >> 19;
    const int32_t zero_point = (int32_t)u < 1 ? (int32_t)u : 1;  // 1 for a positive value, else at most 0
    return c > zero_point ? c : zero_point;
}

// The codes of a thread's 8 values x of a finite block scaled by `scale`, packed (code_at's order): random
// bits (key + index + i) * mul from `bits0` = (key + index) * mul, old codes `old`.
template <bool kSigned, int kMode>
__device__ __forceinline__ void mf_encode8(const float (&x)[kElems], float scale, uint32_t bits0, uint32_t mul,
                                           const uint32_t (&old)[2], bool stochastic, uint32_t (&out)[2]) {
    int c[kElems];
#pragma unroll
    for (int i = 0; i < kElems; ++i)
        c[i] = mf_encode<kSigned, kMode>(x[i] * scale, bits0 + (uint32_t)i * mul, code_at(old, i), stochastic);
#pragma unroll
    for (int j = 0; j < 2; ++j)
        out[j] = q8_pack_sat(c[4 * j + 1], c[4 * j], q8_pack_sat(c[4 * j + 3], c[4 * j + 2], 0u));
}

// Any block (not finite, a maximum outside the fast path's range): q8_mf_code on each value, as specified.
__device__ __forceinline__ void mf_encode8_exact(bool is_signed, const float (&x)[kElems], float absmax, int mode,
                                                 uint32_t bits0, uint32_t mul, const uint32_t (&old)[2],
                                                 uint32_t (&out)[2]) {
    const float scale = q8_mf_scale(absmax);
    out[0] = out[1] = 0u;
#pragma unroll
    for (int i = 0; i < kElems; ++i)
        out[i >> 2] |= q8_mf_code(is_signed, x[i] * scale, mode, bits0 + (uint32_t)i * mul, code_at(old, i))
                       << (8 * (i & 3));
}

// Whether a block's maximum (its bits) lets mf_encode8 code it: 0, or in [2^-100, 2^100], where the scale
// 1.9375 / A is a normal float computed exactly by q8_mf_scale_fast.
__device__ __forceinline__ bool mf_fast_block(uint32_t maxbits) {
    return maxbits == 0u || maxbits - 0x0D800000u <= 0x71800000u - 0x0D800000u;
}

// q8_mf_scale(A) for a stored maximum A of a block that mf_fast_block admits (A a bf16 at most 2^-8 above the
// maximum): the division's fast path, exact for 1.9375 over a normal A this far from the ends of the range.
__device__ __forceinline__ float q8_mf_scale_fast(float absmax) {
    return absmax > 0.0f ? q8_div_fast(kMfTop, absmax) : 0.0f;
}

}  // namespace
}  // namespace ds_q8
