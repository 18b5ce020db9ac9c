// The PTX instructions the step kernels ask for by name: those that CUDA C++ reaches only through a longer
// sequence (an approximate reciprocal or square root without its denormal handling, a saturating byte pack, a
// NaN-propagating maximum). Each function is that instruction and nothing else, so the kernels' arithmetic
// around it is the IEEE arithmetic of the rest of the code.
//
// The CPU execution harness of the tests (tests/cuda_sim/cuda_sim.h) defines Q8_PTX_EMULATED and gives each
// function from the PTX ISA's description of its instruction (the approximations with the largest error
// that description allows), so that the harness checks what the kernels build on it, not one lucky rounding.
#pragma once

#include <stdint.h>

namespace ds_q8 {
namespace {

#ifndef Q8_PTX_EMULATED

// 1/x to within 1 ulp (MUFU.RCP); subnormal inputs and results are flushed to zero.
__device__ __forceinline__ float q8_rcp_approx(float x) {
    float y;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// 1/sqrt(x) (MUFU.RSQ, the approximation ptxas starts its IEEE square root from); subnormals flushed.
__device__ __forceinline__ float q8_rsqrt_approx(float x) {
    float y;
    asm("rsqrt.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Codes a and b saturated to [0, 255] in bytes 1 and 0 of the result, the low half of c above them.
__device__ __forceinline__ uint32_t q8_pack_sat(int a, int b, uint32_t c) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 720
    uint32_t d;
    asm("cvt.pack.sat.u8.s32.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
#else
    const uint32_t sa = (uint32_t)(a < 0 ? 0 : a > 255 ? 255 : a), sb = (uint32_t)(b < 0 ? 0 : b > 255 ? 255 : b);
    return (c << 16) | (sa << 8) | sb;
#endif
}

// max(acc, |x|), NaN when either is NaN (a block's maximum: a NaN anywhere must reach it).
__device__ __forceinline__ float q8_max_abs_nan(float acc, float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    float d;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(acc), "f"(fabsf(x)));
    return d;
#else
    const float a = fabsf(x);
    return acc != acc ? acc : (a != a || a > acc) ? a : acc;
#endif
}

#endif  // Q8_PTX_EMULATED

}  // namespace
}  // namespace ds_q8
