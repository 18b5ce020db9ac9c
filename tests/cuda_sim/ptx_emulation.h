// Test-only: the PTX instructions the CUDA op's kernels name (ds_q8/csrc/cuda/q8_cuda_ptx.cuh), given from the
// PTX ISA's description of each for the CPU execution harness (cuda_sim.h, which defines Q8_PTX_EMULATED).
//
// The approximations are the ones the description allows at their worst: rcp.approx and rsqrt.approx return
// the float below or the float above the exact value (error under 1 ulp, within the ISA's 1 ulp and 2^-22.9),
// which of the two picked by a hash of the input's bits, so the harness checks that the kernels' division and
// square root are exact for any approximation of that accuracy, not for the correctly rounded one alone.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#define Q8_PTX_EMULATED 1

namespace ds_q8 {
namespace ptx_emulation {

inline uint32_t bits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
}
inline float from_bits(uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// .ftz: a subnormal input or result is a zero of its sign.
inline float flush(float x) { return (bits(x) & 0x7F800000u) == 0u ? std::copysign(0.0f, x) : x; }

// A float next to the exact value e (computed in double, whose rounding lies far below a float's): e itself
// when it is a float, else the one below or the one above, as the hash of `seed` says.
inline float faithful(double e, uint32_t seed) {
    const float near = (float)e;
    if ((double)near == e || !std::isfinite(near)) return near;
    const float other = (double)near < e ? std::nextafter(near, INFINITY) : std::nextafter(near, -INFINITY);
    uint32_t h = seed * 0x9E3779B9u;
    h ^= h >> 15;
    return (h & 1u) ? other : near;
}

}  // namespace ptx_emulation

// rcp.approx.ftz.f32
inline float q8_rcp_approx(float x) {
    using namespace ptx_emulation;
    x = flush(x);
    if (x == 0.0f) return std::copysign(INFINITY, x);
    if (std::isinf(x)) return std::copysign(0.0f, x);
    if (std::isnan(x)) return x;
    return flush(faithful(1.0 / (double)x, bits(x)));
}

// rsqrt.approx.ftz.f32
inline float q8_rsqrt_approx(float x) {
    using namespace ptx_emulation;
    x = flush(x);
    if (x == 0.0f) return std::copysign(INFINITY, x);
    if (x < 0.0f || std::isnan(x)) return NAN;
    if (std::isinf(x)) return 0.0f;
    return faithful(1.0 / std::sqrt((double)x), bits(x) ^ 0x5bd1e995u);
}

// cvt.pack.sat.u8.s32.b32 d, a, b, c: a and b saturated to [0, 255] in bytes 1 and 0, c's low half above them.
inline uint32_t q8_pack_sat(int a, int b, uint32_t c) {
    const uint32_t sa = (uint32_t)(a < 0 ? 0 : a > 255 ? 255 : a), sb = (uint32_t)(b < 0 ? 0 : b > 255 ? 255 : b);
    return (c << 16) | (sa << 8) | sb;
}

// max.NaN.f32 of acc and |x|: the canonical NaN when either is NaN.
inline float q8_max_abs_nan(float acc, float x) {
    const float a = std::fabs(x);
    if (std::isnan(acc) || std::isnan(a)) return ptx_emulation::from_bits(0x7FFFFFFFu);
    return a > acc ? a : acc;
}

}  // namespace ds_q8
