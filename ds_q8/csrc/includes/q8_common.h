// Math shared by the CPU and CUDA drivers of ds_q8: the nearest-code lookup, float <-> fp16/bf16
// rounding (to nearest and stochastic) and the stored block maxima. The per-element update rule of
// every optimizer is in q8_rules.h, the codec of 4-bit Adam state in q8_four.h.
//
// Everything here must give the same bits as the pure-PyTorch reference (ds_q8/functional.py and
// the rules' update functions in ds_q8/optim/rules.py). That is why each update is written one IEEE
// operation at a time and the drivers are compiled without floating-point contraction
// (-ffp-contract=off, nvcc -fmad=false) and without fast-math.
//
// Adding an optimizer: docs/adding-an-optimizer.md and the top of q8_rules.h.
#pragma once

#include <stdint.h>
#include <string.h>
#include <math.h>

#if defined(__CUDACC__)
#define Q8_HD __host__ __device__ __forceinline__
#define Q8_HOST __host__
#else
#define Q8_HD inline
#define Q8_HOST
#endif

namespace ds_q8 {

// Storage types of fp16 and bf16 values: layout-compatible with at::Half / at::BFloat16, but free
// of torch headers so the SIMD translation units stay small.
struct q8_half { uint16_t x; };
struct q8_bf16 { uint16_t x; };

// The lookup table has one uint32 per bucket (see q8_build_lookup).
constexpr int kLookupLow = 0x3FFF;    // bucket of every value <= -2 (and of negative NaNs)
constexpr int kLookupHigh = 0xC000;   // bucket of every value >= 2
constexpr int kLookupSize = kLookupHigh - kLookupLow + 1;

// The driver TUs are compiled for different instruction sets (AVX-512, AVX2, baseline). Internal
// linkage keeps the linker from merging, say, the AVX-512 copy of an inline helper into the
// baseline path, which would then crash on an older CPU.
namespace {

Q8_HD uint32_t q8_bits(float f) {
#if defined(__CUDA_ARCH__)
    return __float_as_uint(f);
#else
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
#endif
}

Q8_HD float q8_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
    return __uint_as_float(u);
#else
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

// ------------------------------------------------------------------ limits
// Shared with Python (ds_q8/functional.py MIN_BLOCK_SIZE, MAX_BLOCK_SIZE, MAX_STATES): both ops
// return them from limits(), and tests/test_kernels.py and tests/test_cuda_build.py tie the two.
constexpr int64_t Q8_MIN_BLOCK = 64;
constexpr int64_t Q8_MAX_BLOCK = 4096;
constexpr int Q8_MAX_STATES = 3;
// How a state is requantized (group_options.py ROUND_*): to nearest, stochastically, or guided by its old
// code (stochastically where the old code is one of the two entries around the value, else to nearest).
// 2 is not a mode (guidance by the update, once a study's rule, left the library).
constexpr int Q8_ROUND_NEAREST = 0;
constexpr int Q8_ROUND_STOCHASTIC = 1;
constexpr int Q8_ROUND_BY_OLD_CODE = 3;
// Telemetry sums per state (optim/telemetry.py): sum |requantized - x|, sum |x|, and how many nonzero
// values were requantized to zero.
constexpr int Q8_TELEMETRY_SUMS = 3;

// ------------------------------------------------------------------ fp16 / bf16
// Round to nearest even, like torch's conversions (NaN becomes a quiet NaN).
Q8_HD uint16_t q8_bf16_from_float(float f) {
    uint32_t u = q8_bits(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

Q8_HD float q8_float_from_bf16(uint16_t h) { return q8_float((uint32_t)h << 16); }

Q8_HD uint16_t q8_half_from_float(float f) {
    uint32_t u = q8_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return sign | 0x7E00;            // NaN
    if (a >= 0x47800000u) return sign | 0x7C00;           // >= 2^16: infinity
    if (a >= 0x38800000u) {                               // normal half (>= 2^-14)
        uint32_t r = (a + 0xFFFu + ((a >> 13) & 1u)) >> 13; // a carry into the exponent is right
        return (uint16_t)(sign | (r - (112u << 10)));     // rebias 127 -> 15
    }
    uint32_t e = a >> 23;
    if (e < 102) return sign;                             // below half the smallest subnormal
    uint32_t mant = (a & 0x7FFFFFu) | 0x800000u;          // value = mant * 2^(e - 150)
    uint32_t shift = 126u - e;                            // in units of 2^-24: 14..24
    uint32_t q = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1u);
    uint32_t halfway = 1u << (shift - 1u);
    if (rem > halfway || (rem == halfway && (q & 1u))) ++q;
    return (uint16_t)(sign | q);
}

Q8_HD float q8_float_from_half(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1Fu;
    uint32_t m = h & 0x3FFu;
    if (e == 0x1F) return q8_float(sign | 0x7F800000u | (m << 13));
    if (e != 0) return q8_float(sign | ((e + 112u) << 23) | (m << 13));
    // subnormal or zero: m * 2^-24 is exact in float32
    float v = (float)m * 5.9604644775390625e-08f;
    return sign ? -v : v;
}

Q8_HD float q8_to_float(float v) { return v; }
// ------------------------------------------------------------------ stochastic rounding
// A 16-bit parameter written with stochastic rounding takes the neighbour above it with a
// probability equal to how far the value lies toward that neighbour, so that it is right on average
// and updates smaller than half a unit in the last place still count. The random bits are a hash of
// (key, element index); the host folds the seed, the step and the parameter's identity into the key
// (ds_q8.optim.rounding.sr_key), so the CPU and CUDA kernels and the PyTorch reference draw the same
// bits for an element, wherever a partition put it. The keys are hashed with the murmur3 finalizer; an
// element's bits are (key ^ index) times an odd constant, read from the top: uniform and independent
// from step to step because the key is (ds_q8/optim/rounding.py says why that is enough).
Q8_HD uint32_t q8_mix32(uint32_t h) {  // the murmur3 finalizer
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    h ^= h >> 16;
    return h;
}

#define Q8_DRAW_MUL 0x9E3779B9u  // rounding.DRAW_MUL: 2^32 / the golden ratio, rounded to odd
Q8_HD uint32_t q8_sr_bits(uint32_t key, uint32_t index) { return (key ^ index) * Q8_DRAW_MUL; }

// bf16 keeps the top 16 bits of a float: adding the top 16 random bits below them carries into the
// kept part with probability (dropped bits) / 2^16. Inf and NaN round as to nearest.
Q8_HD uint16_t q8_bf16_from_float_sr(float f, uint32_t r) {
    uint32_t u = q8_bits(f);
    if ((u & 0x7F800000u) == 0x7F800000u) return q8_bf16_from_float(f);
    return (uint16_t)((u + (r >> 16)) >> 16);
}

// fp16: the neighbours below and above |f|, and 24 random bits compared with the exact fraction of
// the step between them. |f| >= 65504 (and Inf, NaN) round as to nearest.
Q8_HD uint16_t q8_half_from_float_sr(float f, uint32_t r) {
    const uint32_t u = q8_bits(f);
    const float a = q8_float(u & 0x7FFFFFFFu);
    if (!(a < 65504.0f)) return q8_half_from_float(f);
    uint16_t h = q8_half_from_float(a);
    if (q8_float_from_half(h) > a) --h;                                  // toward zero
    const float lo = q8_float_from_half(h);
    const float step = q8_float_from_half((uint16_t)(h + 1)) - lo;       // exact: a power of two
    const float frac = (a - lo) / step;                                  // exact, in [0, 1)
    const float draw = (float)(r >> 8) * 5.9604644775390625e-08f;        // 24 bits times 2^-24, exact
    if (draw < frac) ++h;
    return (uint16_t)(((u >> 16) & 0x8000u) | h);
}

// The key of the random bits that requantize state k of a tensor whose key is `key` (rounding.state_key).
Q8_HD uint32_t q8_state_key(uint32_t key, int k) { return q8_mix32(key ^ (0x9E3779B9u * (uint32_t)(k + 1))); }

// The random bits that requantize state k of an element (rounding.state_bits): (state key + index) times the
// state's multiplier, a Weyl sequence over consecutive elements (each the one before plus the multiplier).
Q8_HD uint32_t q8_state_mul(int k) { return k == 0 ? 0x9E3779B9u : k == 1 ? 0x6A09E667u : 0xBB67AE85u; }
Q8_HD uint32_t q8_state_bits(uint32_t state_key, int k, uint32_t index) { return (state_key + index) * q8_state_mul(k); }

// Stochastic requantization of a scaled value y whose nearest code is `nearest` (ds_q8/functional.py
// quantize_scaled): the entry below or above y, the upper one with probability equal to how far y lies
// toward it, so that the state is right on average; the zero point of unsigned maps; NaN to 255.
Q8_HD uint32_t q8_round_stochastic(float y, uint32_t nearest, const float* code, uint32_t r) {
    if (y != y) return 255u;
    const bool up = y >= code[nearest];
    const uint32_t nb = up ? (nearest < 255u ? nearest + 1u : 255u) : (nearest > 0u ? nearest - 1u : 0u);
    const uint32_t lo = up ? nearest : nb, hi = up ? nb : nearest;
    const float u = (float)(r >> 8) * 5.9604644775390625e-08f;  // 24 bits times 2^-24, exact
    uint32_t idx = u * (code[hi] - code[lo]) < y - code[lo] ? hi : lo;
    if (code[0] == 0.0f && idx == 0u && y > 0.0f) idx = 1u;
    return idx;
}

// Guided requantization's parts (functional.py): the entries lo and hi around y (finite) from its nearest
// code, and whether it goes up to hi with `draw` (stochastically, random bits r) or without it (to the
// nearer entry), then the unsigned map's zero point.
struct Q8Guide {
    uint32_t lo, hi;
    float gap, above;
};
Q8_HD Q8Guide q8_guide_pair(float y, uint32_t nearest, const float* code) {
    const bool up = y >= code[nearest];
    const uint32_t nb = up ? (nearest < 255u ? nearest + 1u : 255u) : (nearest > 0u ? nearest - 1u : 0u);
    const uint32_t lo = up ? nearest : nb, hi = up ? nb : nearest;
    return Q8Guide{lo, hi, code[hi] - code[lo], y - code[lo]};
}
Q8_HD uint32_t q8_guide_pick(const Q8Guide& g, bool draw, uint32_t r, float y, const float* code) {
    const bool go_up = draw ? (float)(r >> 8) * 5.9604644775390625e-08f * g.gap < g.above : g.gap * 0.5f < g.above;
    uint32_t idx = go_up ? g.hi : g.lo;
    if (code[0] == 0.0f && idx == 0u && y > 0.0f) idx = 1u;
    return idx;
}

// q8_round_stochastic guided by the old code (functional.py): stochastic where `old`, the state's code
// before the step, is one of the two entries around y, else the nearer of them.
Q8_HD uint32_t q8_round_guided_code(float y, uint32_t nearest, const float* code, uint32_t r, uint32_t old) {
    if (y != y) return 255u;
    const Q8Guide g = q8_guide_pair(y, nearest, code);
    return q8_guide_pick(g, old == g.lo || old == g.hi, r, y, code);
}

// ------------------------------------------------------------------ the correction byte
// A bf16 parameter with a correction byte (correction_byte=True) is a 24-bit float: its pattern is
// (b << 16) + (c << 8), with c in [-128, 127] counted toward larger magnitude (ds_q8.optim.rounding,
// split_bf16 / join_bf16, is the specification). Splitting rounds the fp32 pattern to a multiple of
// 2^8, then to a multiple of 2^16, each half away from zero in magnitude; Inf and NaN keep c = 0.
Q8_HD float q8_bf16_join(uint16_t b, int8_t c) {
    const uint32_t top = (uint32_t)b << 16;
    if ((top & 0x7F800000u) == 0x7F800000u) return q8_float(top);
    return q8_float(top + (uint32_t)((int32_t)c * 256));
}

Q8_HD void q8_bf16_split(float f, uint16_t* b, int8_t* c) {
    const uint32_t u = q8_bits(f);
    if ((u & 0x7F800000u) == 0x7F800000u) {
        *b = q8_bf16_from_float(f);
        *c = 0;
        return;
    }
    const uint32_t r = (u + 0x80u) & 0xFFFFFF00u;
    const uint32_t hi = (r + 0x8000u) >> 16;
    *b = (uint16_t)hi;
    *c = (hi & 0x7F80u) == 0x7F80u ? (int8_t)0 : (int8_t)((int32_t)(r - (hi << 16)) >> 8);
}

Q8_HD void q8_store_sr(float* p, float v, uint32_t) { *p = v; }
Q8_HD void q8_store_sr(q8_half* p, float v, uint32_t r) { p->x = q8_half_from_float_sr(v, r); }
Q8_HD void q8_store_sr(q8_bf16* p, float v, uint32_t r) { p->x = q8_bf16_from_float_sr(v, r); }

Q8_HD float q8_to_float(q8_half v) { return q8_float_from_half(v.x); }
Q8_HD float q8_to_float(q8_bf16 v) { return q8_float_from_bf16(v.x); }
Q8_HD void q8_store(float* p, float v) { *p = v; }
Q8_HD void q8_store(q8_half* p, float v) { p->x = q8_half_from_float(v); }
Q8_HD void q8_store(q8_bf16* p, float v) { p->x = q8_bf16_from_float(v); }

// ------------------------------------------------------------------ nearest code
// The reference stores index = #{i : mid[i] < y}, mid[i] = (code[i] + code[i+1]) * 0.5f, which is
// an 8-step binary search per value. Here it is one table read and one comparison instead:
//
// Map y to an unsigned key that orders like the float (negative: all bits flipped; positive: sign
// bit set). The top 16 bits of the key (sign, exponent, 7 mantissa bits) select a bucket, a
// contiguous range of floats. If one midpoint falls inside the bucket, y lies above it exactly
// when y's low 16 key bits exceed the midpoint's (`thr`; none: thr = 0xFFFF). The table holds
//   entry = index_of_smallest_value * 65536 + (0xFFFF - thr)
// so that (entry + low16(key)) >> 16 is the index: the sum carries into bit 16 exactly when
// low16(key) > thr. Buckets at or beyond +-2 are clamped into two end buckets (scaled values never exceed 1
// by more than one rounding, except infinities). For the dynamic and linear maps every bucket
// holds at most one midpoint; q8_build_lookup refuses maps where that fails.
//
// The zero-point rule (ds_q8/functional.py midpoints): in a map whose smallest entry is 0 (the unsigned
// maps of second moments, which are never negative) code 0 is kept for zeros. The boundary between
// entries 0 and 1 is 0 itself instead of their midpoint, so a positive value takes at least code 1:
// a second moment stored as 0 would wipe its history and let the element step several times too far.
// The boundary at +0.0 is one more threshold (0) in the bucket of +0.0 and the smallest denormals.

Q8_HD uint32_t q8_key(float y) {
    uint32_t u = q8_bits(y);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

Q8_HD uint32_t q8_bucket(uint32_t key) {
    int hi = (int)(key >> 16);
    hi = hi < kLookupLow ? kLookupLow : (hi > kLookupHigh ? kLookupHigh : hi);
    return (uint32_t)(hi - kLookupLow);
}

// A read of the lookup table: through the read-only data cache on CUDA (the table is never
// written while a kernel runs).
Q8_HD uint32_t q8_lookup_at(const uint32_t* lookup, uint32_t i) {
#if defined(__CUDA_ARCH__)
    return __ldg(lookup + i);
#else
    return lookup[i];
#endif
}

// The code index of an already scaled value y (the reference sends NaN to 255).
Q8_HD uint32_t q8_quantize_scaled(float y, const uint32_t* lookup) {
    uint32_t key = q8_key(y);
    uint32_t idx = (q8_lookup_at(lookup, q8_bucket(key)) + (key & 0xFFFFu)) >> 16;
    return y != y ? 255u : idx;
}

// The reference's per-block scale: 1/absmax, or 0 for an all-zero (or NaN) block.
Q8_HD float q8_block_scale(float absmax) { return absmax > 0.0f ? 1.0f / absmax : 0.0f; }

// ------------------------------------------------------------------ stored block maxima
// A block maximum is stored as bf16, rounded up (ds_q8/functional.py stored_absmax): the smallest
// bf16 at or above max |x|, so every scaled value stays within [-1, 1]. On the bit pattern of the
// non-negative maximum that is adding 0xFFFF and keeping the top 16 bits; NaN stays NaN, and a finite
// maximum above the largest bf16 saturates to it instead of becoming infinite. The step scales and
// dequantizes with the stored value (as float32, exact).
Q8_HD uint16_t q8_absmax_store(float m) {
    const uint32_t u = q8_bits(m) & 0x7FFFFFFFu;
    if (u > 0x7F800000u) return 0x7FC0;                    // NaN
    const uint32_t r = (u + 0xFFFFu) >> 16;
    return (uint16_t)(r == 0x7F80u && u < 0x7F800000u ? 0x7F7Fu : r);
}

Q8_HD float q8_absmax_load(uint16_t stored) { return q8_float_from_bf16(stored); }

// NaN-propagating running max of |x|, like torch.amax.
Q8_HD float q8_absmax_step(float acc, float x) {
    float a = fabsf(x);
    if (acc != acc) return acc;
    return (a != a || a > acc) ? a : acc;
}

Q8_HOST inline int q8_count_below(const float* mid, float v) {
    int c = 0;
    for (int i = 0; i < 255; ++i) c += mid[i] < v ? 1 : 0;
    return c;
}

// Fill `lookup` (kLookupSize entries) so that it counts the thresholds thr[0..255) below a value:
// (entry + low16(key)) >> 16 = #{i : thr[i] < y}. Returns false when the thresholds are unsorted,
// outside (-2, 2) or too dense for one comparison per bucket.
Q8_HOST inline bool q8_build_thresholds(const float* thr, uint32_t* lookup) {
    for (int i = 0; i < 255; ++i) {
        if (!(thr[i] > -2.0f && thr[i] < 2.0f)) return false;
        if (i > 0 && thr[i] < thr[i - 1]) return false;
    }
    lookup[0] = 0;                               // index 0, no threshold above
    lookup[kLookupSize - 1] = 255u << 16;
    for (int hi = kLookupLow + 1; hi < kLookupHigh; ++hi) {
        uint32_t key_lo = (uint32_t)hi << 16, key_hi = key_lo | 0xFFFFu;
        auto value = [](uint32_t key) {
            return q8_float((key & 0x80000000u) ? (key & 0x7FFFFFFFu) : ~key);
        };
        int lo = q8_count_below(thr, value(key_lo));
        int top = q8_count_below(thr, value(key_hi));
        uint32_t cut = 0xFFFFu;
        if (top - lo > 1) return false;
        if (top - lo == 1) {
            float m = thr[lo] == 0.0f ? 0.0f : thr[lo];   // -0.0 compares like +0.0
            uint32_t k = q8_key(m);
            if ((int)(k >> 16) != hi) return false;
            cut = k & 0xFFFFu;
        }
        lookup[hi - kLookupLow] = ((uint32_t)lo << 16) + (0xFFFFu - cut);
    }
    return true;
}

// Fill `lookup` (kLookupSize entries) for a sorted 256-entry map: the count of its midpoints below a
// value, its nearest code. Returns false when the map is too dense for one comparison per bucket or
// has midpoints outside (-2, 2).
Q8_HOST inline bool q8_build_lookup(const float* code, uint32_t* lookup) {
    float mid[255];
    for (int i = 0; i < 255; ++i) {
        mid[i] = (code[i] + code[i + 1]) * 0.5f;
        if (i == 0 && code[0] == 0.0f) mid[0] = 0.0f;  // the zero-point rule
    }
    return q8_build_thresholds(mid, lookup);
}

}  // namespace
}  // namespace ds_q8
