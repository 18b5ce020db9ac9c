// The minifloat maps coded from a float's bits (ds_q8/functional.py, "The minifloat codec", is the
// specification; minifloat_codes and minifloat_values there): no table, no search. Shared by the CPU drivers
// (the scalar one calls these functions; the AVX2 and AVX-512 ones compute the same per vector in
// q8_cpu_minifloat.h) and the CUDA step.
//
// The two maps of quantization="minifloat" are small floats: sign + E3M4 for signed states, E4M4 for
// unsigned ones. Taken with their top binade at [1, 2) (exponent bias B = 7 or 15), code c is the float u(c)
// whose bits are (c << 19) + ((127 - B) << 23) when c >= 16, and c * 2^(-3 - B) below (the subnormals); the
// largest is 1.9375. A block's values are multiplied by 1.9375 / A (A its stored maximum), and then a
// value's float bits are its code: from 2^(1 - B) up the exponent and the top four mantissa bits, below it
// the value times 2^(3 + B). In both ranges the value as an integer with 19 more bits is a fixed-point
// code, and rounding it is integer arithmetic: adding 2^18 - 1 rounds to the nearer code (a value on a
// midpoint down), adding 19 random bits rounds stochastically (up with probability equal to the dropped
// fraction), and guided requantization adds the random bits only where the old code is the code below the
// value or the one above it, 2^18 - 1 elsewhere. A code's map entry is u(c) times float32(1 / 1.9375) in
// float32 (one rounding); its value, that times A.
#pragma once

#include <stdint.h>

#include "q8_common.h"

namespace ds_q8 {

// What a state's map is, for the drivers: coded through tables, or one of the two minifloat maps.
enum Q8MapKind : uint8_t { kMapTable = 0, kMapMinifloatSigned = 1, kMapMinifloatUnsigned = 2 };

constexpr uint32_t kMfFracBits = 19;                         // functional.FRACTION_BITS
constexpr uint32_t kMfFracMask = (1u << kMfFracBits) - 1u;
constexpr uint32_t kMfNearest = (1u << (kMfFracBits - 1)) - 1u;  // what rounding to nearest adds
constexpr float kMfTop = 1.9375f;                           // the largest value, 2 - 2^-4
constexpr float kMfInvTop = 0.516129016876220703125f;         // float32(1 / 1.9375)

namespace {

// The exponent bias B of a map: its top binade is [1, 2).
Q8_HD constexpr uint32_t q8_mf_bias(bool is_signed) { return is_signed ? 7u : 15u; }
// The bits that turn a code into its value: u(c) = float((c << 19) + q8_mf_base(...)) for c >= 16
Q8_HD constexpr uint32_t q8_mf_base(bool is_signed) { return (127u - q8_mf_bias(is_signed)) << 23; }
// 2^(1 - B), where the subnormals end
Q8_HD float q8_mf_sub_limit(bool is_signed) { return is_signed ? 0.015625f : 6.103515625e-05f; }

// What a block's values are multiplied by before they are coded (functional.block_scale): 1.9375 / A, or 0.
Q8_HD float q8_mf_scale(float absmax) { return absmax > 0.0f ? kMfTop / absmax : 0.0f; }

// The fixed-point code of a magnitude (its bits ab): code << 19 | the fraction toward the next code. Below
// 2^(1 - B) (the subnormals) the mantissa of ab + 2^(1 - B): the addition rounds to the fixed point (to
// nearest even), and the result's bits less those of 2^(1 - B) are it. (The SIMD drivers take the larger of
// the two forms, which is the same: each is the larger in its own range.)
template <bool kSigned>
Q8_HD uint32_t q8_mf_fixed(uint32_t ab) {
    const float a = q8_float(ab), limit = q8_mf_sub_limit(kSigned);
    return a < limit ? q8_bits(a + limit) - q8_bits(limit) : ab - q8_mf_base(kSigned);
}

// The code of z (a block value times q8_mf_scale): `mode` is Q8_ROUND_NEAREST, Q8_ROUND_STOCHASTIC (random
// bits r) or Q8_ROUND_BY_OLD_CODE (r, and the state's old code `old`).
template <bool kSigned>
Q8_HD uint32_t q8_mf_code(float z, int mode, uint32_t r, uint32_t old) {
    const uint32_t u = q8_bits(z), ab = u & 0x7FFFFFFFu;
    const bool negative = (u >> 31) != 0u;
    const uint32_t fixed = q8_mf_fixed<kSigned>(ab), lo = fixed >> kMfFracBits;
    bool draw = mode == Q8_ROUND_STOCHASTIC;
    if (mode == Q8_ROUND_BY_OLD_CODE) {  // drawn where the old code is lo or lo + 1, of z's sign
        const uint32_t offset = kSigned ? (negative ? 127u - old : old - 127u) : old;
        draw = offset - lo <= 1u;
    }
    const uint32_t mag = (fixed + (draw ? r >> (32 - kMfFracBits) : kMfNearest)) >> kMfFracBits;
    uint32_t c;
    if (kSigned) {  // a positive value within a rounding of the top may round up to entry 255 (above 1.0)
        c = negative ? (mag > 127u ? 0u : 127u - mag) : (mag > 128u ? 255u : 127u + mag);
    } else {
        c = negative ? 0u : (mag > 255u ? 255u : mag);
        if (!negative && ab != 0u && c == 0u) c = 1u;  // the zero point: a positive value takes at least 1
    }
    return ab > 0x7F800000u ? 255u : c;
}

Q8_HD uint32_t q8_mf_code(bool is_signed, float z, int mode, uint32_t r, uint32_t old) {
    return is_signed ? q8_mf_code<true>(z, mode, r, old) : q8_mf_code<false>(z, mode, r, old);
}

// The map entry of code c (functional.minifloat_values): u(c) * float32(1/T), one rounding.
Q8_HD float q8_mf_value(uint32_t c, bool is_signed) {
    const uint32_t mag = is_signed ? (c >= 127u ? c - 127u : 127u - c) : c;
    const float one = q8_float((mag << 19) + q8_mf_base(is_signed));
    const bool sub = mag < 16u;  // exponent field 0: the value is (one - 2^-B) * 2
    const float v = (sub ? one - q8_mf_sub_limit(is_signed) * 0.5f : one) * (sub ? kMfInvTop * 2.0f : kMfInvTop);
    return is_signed && c < 127u ? -v : v;
}

}  // namespace

// Which minifloat map `code` is (its 256 entries bit for bit), or kMapTable.
Q8_HOST inline Q8MapKind q8_map_kind(const float* code) {
    for (int s = 0; s < 2; ++s) {
        const bool is_signed = s == 0;
        bool same = true;
        for (uint32_t c = 0; c < 256u && same; ++c) same = q8_bits(q8_mf_value(c, is_signed)) == q8_bits(code[c]);
        if (same) return is_signed ? kMapMinifloatSigned : kMapMinifloatUnsigned;
    }
    return kMapTable;
}

}  // namespace ds_q8
