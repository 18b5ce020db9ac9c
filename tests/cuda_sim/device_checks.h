// Test-only: the step kernels' arithmetic checked value by value against its specification, on the CPU
// harness (kernels.cpp includes this after the device code; tests/test_cuda_sim.py calls it through ctypes).
//
// - The minifloat codec of q8_cuda_minifloat.cuh against q8_minifloat.h: mf_encode (saturated as the byte
//   pack saturates) against q8_mf_code, for every rounding, on values dense where codes change (each code, each
//   midpoint, the subnormal limit, the top, zero and the smallest subnormals, a step through every binade),
//   with the random bits and old codes that decide each case; mf_decode8 against q8_mf_value * absmax.
// - q8_mf_scale_fast against q8_mf_scale for every bf16 maximum mf_fast_block admits.
// - q8_div_checked and q8_sqrt_checked (q8_cuda_fastmath.cuh) against IEEE '/' and sqrtf wherever they report
//   their result exact, on random and hard operands, with the harness's approximations (ptx_emulation.h).
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

namespace q8sim_checks {

using namespace ds_q8;

inline uint64_t splitmix(uint64_t& s) {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

inline float as_float(uint32_t u) { return q8_float(u); }

// Values z (in a map's units) where the codec's decisions change, both signs.
template <bool kSigned>
std::vector<float> codec_values() {
    std::vector<float> z;
    const uint32_t base = q8_mf_base(kSigned);
    auto around = [&](float v, int ulps) {
        const uint32_t u = q8_bits(v);
        for (int d = -ulps; d <= ulps; ++d)
            if ((int64_t)u + d >= 0) z.push_back(as_float(u + (uint32_t)d));
    };
    for (uint32_t c = 0; c <= 130u; ++c) {  // each code and each midpoint, from their fixed points
        for (uint32_t fixed : {c << kMfFracBits, (c << kMfFracBits) + (1u << (kMfFracBits - 1))}) {
            // a fixed point's value: its bits plus the base above the subnormals, else fixed * 2^-(22 + B)
            const float v = fixed >= (16u << kMfFracBits) ? as_float(fixed + base)
                                                          : (float)fixed * q8_mf_sub_limit(kSigned) / 8388608.0f;
            around(v, 3);
        }
    }
    around(q8_mf_sub_limit(kSigned), 64);
    around(kMfTop, 16);
    for (uint32_t u = 0; u < 64; ++u) z.push_back(as_float(u));  // zero and the smallest float subnormals
    for (uint32_t u = 0; u <= q8_bits(2.05f); u += 4099u) z.push_back(as_float(u));
    const size_t n = z.size();
    for (size_t i = 0; i < n; ++i) z.push_back(-z[i]);
    return z;
}

// Mismatches of mf_encode against q8_mf_code for one map; *checked counts the comparisons.
template <bool kSigned>
int64_t encode_mismatches(int64_t* checked) {
    uint64_t seed = kSigned ? 1u : 2u;
    int64_t bad = 0;
    auto same = [&](int fast, uint32_t spec) {
        ++*checked;
        const uint32_t sat = (uint32_t)(fast < 0 ? 0 : fast > 255 ? 255 : fast);
        if (sat != spec) ++bad;
    };
    for (const float z : codec_values<kSigned>()) {
        same(mf_encode<kSigned, -1>(z, 0u, 0u, false), q8_mf_code<kSigned>(z, Q8_ROUND_NEAREST, 0u, 0u));
        const uint32_t fixed = q8_mf_fixed<kSigned>(q8_bits(z) & 0x7FFFFFFFu), frac = fixed & kMfFracMask;
        const uint32_t lo = fixed >> kMfFracBits;
        // random bits at the carry's edge (the fraction plus the draw just reaching the next code, or not), the
        // extremes, and random ones
        const uint32_t edge = ((1u << kMfFracBits) - frac) & kMfFracMask;
        const uint32_t draws[] = {0u, 0xFFFFFFFFu, edge << (32 - kMfFracBits), (edge - 1u) << (32 - kMfFracBits),
                                  (uint32_t)splitmix(seed), (uint32_t)splitmix(seed)};
        for (const uint32_t r : draws) {
            same(mf_encode<kSigned, -1>(z, r, 0u, true), q8_mf_code<kSigned>(z, Q8_ROUND_STOCHASTIC, r, 0u));
            // old codes at and around the two the value lies between, on either side of zero, and random ones
            const bool negative = q8_bits(z) >> 31;
            for (int d = -2; d <= 3; ++d)
                for (int side = 0; side < 2; ++side) {
                    const int64_t mag = (int64_t)lo + d;
                    int64_t old = kSigned ? (side ^ negative ? 127 - mag : 127 + mag) : (side ? 255 - mag : mag);
                    old = old < 0 ? 0 : old > 255 ? 255 : old;
                    same(mf_encode<kSigned, Q8_ROUND_BY_OLD_CODE>(z, r, (uint32_t)old, false),
                         q8_mf_code<kSigned>(z, Q8_ROUND_BY_OLD_CODE, r, (uint32_t)old));
                }
            const uint32_t old = (uint32_t)splitmix(seed) & 255u;
            same(mf_encode<kSigned, Q8_ROUND_BY_OLD_CODE>(z, r, old, false),
                 q8_mf_code<kSigned>(z, Q8_ROUND_BY_OLD_CODE, r, old));
        }
    }
    return bad;
}

// Mismatches of mf_decode8 against q8_mf_value(c) * absmax, every code, both maps, a range of maxima.
inline int64_t decode_mismatches(int64_t* checked) {
    int64_t bad = 0;
    const float maxima[] = {1.0f, 3.0f, 0.0f, 1e-30f, 1e30f, 3.3895313892515355e+38f, 9.183549615799121e-41f, 0.0390625f};
    for (const float absmax : maxima)
        for (uint32_t c0 = 0; c0 < 256u; c0 += 8u) {
            const uint32_t w[2] = {c0 | (c0 + 1) << 8 | (c0 + 2) << 16 | (c0 + 3) << 24,
                                   (c0 + 4) | (c0 + 5) << 8 | (c0 + 6) << 16 | (c0 + 7) << 24};
            float v[2][kElems];
            mf_decode8<true>(w, absmax, v[0]);
            mf_decode8<false>(w, absmax, v[1]);
            for (int s = 0; s < 2; ++s)
                for (int i = 0; i < kElems; ++i) {
                    ++*checked;
                    if (q8_bits(v[s][i]) != q8_bits(q8_mf_value(c0 + (uint32_t)i, s == 0) * absmax)) ++bad;
                }
        }
    return bad;
}

// Mismatches of q8_mf_scale_fast against q8_mf_scale over every bf16 maximum of a block mf_fast_block takes.
inline int64_t scale_mismatches(int64_t* checked) {
    int64_t bad = 0;
    for (uint32_t h = 0; h < 0x8000u; ++h) {
        const float a = q8_absmax_load((uint16_t)h);
        if (!mf_fast_block(q8_bits(a))) continue;
        ++*checked;
        if (q8_bits(q8_mf_scale_fast(a)) != q8_bits(q8_mf_scale(a))) ++bad;
    }
    return bad;
}

// An operand for the division and square root checks: mostly normal floats of either sign over 2^±80, with
// zeros, subnormals, infinities, NaN, and significands of all ones or a single one.
inline float operand(uint64_t& seed) {
    const uint64_t r = splitmix(seed);
    const uint32_t kind = (uint32_t)(r % 100u), sign = (uint32_t)(r >> 63) << 31;
    const uint32_t mant = (uint32_t)(r >> 8) & 0x7FFFFFu, exp = 127u - 80u + (uint32_t)((r >> 32) % 161u);
    if (kind < 5) return as_float(sign);
    if (kind < 8) return as_float(sign | (mant >> (r >> 40 & 15u)));  // a subnormal
    if (kind < 9) return as_float(sign | 0x7F800000u);
    if (kind < 10) return as_float(0x7FC00000u | mant);
    if (kind < 20) return as_float(sign | exp << 23 | 0x7FFFFFu);
    if (kind < 25) return as_float(sign | exp << 23);
    return as_float(sign | exp << 23 | mant);
}

// Mismatches of q8_div_checked (which 0) or q8_sqrt_checked (1) against IEEE where they say exact; *fast
// counts those cases.
inline int64_t fastmath_mismatches(int which, int64_t count, uint64_t seed, int64_t* fast) {
    int64_t bad = 0;
    for (int64_t i = 0; i < count; ++i) {
        float a = operand(seed), b = operand(seed);
        if (which == 1) b = std::fabs(b);  // square roots of positive values, mostly
        if (which == 0 && (splitmix(seed) & 3u) == 0u) {  // a quotient near 1 in the last bits
            const uint32_t d = (uint32_t)(splitmix(seed) % 5u);
            a = as_float(q8_bits(b) + d - 2u);
        }
        bool ok = true;
        const float got = which == 0 ? q8_div_checked(a, b, ok) : q8_sqrt_checked(b, ok);
        const float want = which == 0 ? a / b : std::sqrt(b);
        if (!ok) continue;
        ++*fast;
        if (q8_bits(got) != q8_bits(want)) ++bad;
    }
    return bad;
}

}  // namespace q8sim_checks

// The checks above by number (0 encode signed, 1 encode unsigned, 2 decode, 3 scale, 4 division, 5 square
// root, with `count` operands from `seed`): the mismatches, and in *checked the cases compared.
extern "C" __attribute__((visibility("default"))) int64_t q8sim_device_check(int which, int64_t count, int64_t seed,
                                                                              int64_t* checked) {
    using namespace q8sim_checks;
    *checked = 0;
    switch (which) {
        case 0: return encode_mismatches<true>(checked);
        case 1: return encode_mismatches<false>(checked);
        case 2: return decode_mismatches(checked);
        case 3: return scale_mismatches(checked);
        case 4: return fastmath_mismatches(0, count, (uint64_t)seed, checked);
        case 5: return fastmath_mismatches(1, count, (uint64_t)seed, checked);
        default: return -1;
    }
}
