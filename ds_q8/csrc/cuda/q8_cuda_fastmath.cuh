// IEEE division and square root for the rules, decided once per warp: Q8Checked, the value type the step
// kernels run a rule on first, computes each quotient and root with the instructions of ptxas's own fast path
// and carries whether every operand lay where that path is exact; a warp whose lanes all say so keeps the
// results, any other runs the rule again on float (q8_cuda_step.cuh). The exact '/' and sqrtf compile to the
// same fast path behind a test and a branch per operation, and the branch to the slow path's call, which
// clobbers registers, costs more than the operation.
//
// Square root: ptxas's sequence (MUFU.RSQ, then s = x * y, h = y / 2, s + (x - s * s) * h), taken only where
// ptxas takes it, x in [2^-101, the largest float] (its own test, bits - 0x0D000000 <= 0x727FFFFF), or x = +0,
// which the approximation of a clamped x sends through the same steps to +0.
// Division: ptxas's sequence (MUFU.RCP, one Newton step, a product and one correction by the remainder, all
// fused multiply-adds), with the remainder's sign turned so that a zero numerator keeps its sign, taken where
// ptxas's FCHK passes it by a wide margin: b in [2^-60, 2^60), |a| = 0 or in [2^-60, 2^60), which keep
// every intermediate and the quotient normal and the remainder exact (CUDA_NOTES.md, "Division").
#pragma once

#include <stdint.h>

#include "q8_cuda_ptx.cuh"
#include "q8_rules.h"  // q8_sign of a float

namespace ds_q8 {
namespace {

// sqrt(x), and whether it is exact (ok stays true) or the warp must take sqrtf.
__device__ __forceinline__ float q8_sqrt_checked(float x, bool& ok) {
    const uint32_t u = __float_as_uint(x);
    ok = ok && (u - 0x0D000000u <= 0x727FFFFFu || u == 0u);
    const float y = q8_rsqrt_approx(fmaxf(x, 0x1p-101f));  // 2^-101: +0 then gives +0
    const float s = x * y, h = y * 0.5f;
    return __fmaf_rn(__fmaf_rn(-s, s, x), h, s);
}

// a / b by ptxas's fast path (the remainder's sign turned): exact where q8_div_checked admits a and b.
__device__ __forceinline__ float q8_div_fast(float a, float b) {
    const float y0 = q8_rcp_approx(b);
    const float y = __fmaf_rn(y0, __fmaf_rn(-b, y0, 1.0f), y0);
    const float q = a * y;  // a product, not a fused multiply-add with +0: -0 / b stays -0
    return __fmaf_rn(-y, __fmaf_rn(b, q, -a), q);
}

// a / b, and whether it is exact (ok stays true) or the warp must take '/'.
__device__ __forceinline__ float q8_div_checked(float a, float b, bool& ok) {
    // |a|'s bits times 2 (the sign shifted out): 0, or from 2^-60's up to 2^60's; every tiny |a| wraps past the
    // first bound. b from 2^-60 to 2^60 as one unsigned test (a negative b's sign bit fails it)
    const uint32_t a2 = __float_as_uint(a) << 1, ub = __float_as_uint(b);
    ok = ok && a2 - 2u * 0x21800000u <= 0u - 2u * 0x21800000u && a2 < 2u * 0x5D800000u &&
         ub - 0x21800000u < 0x5D800000u - 0x21800000u;
    return q8_div_fast(a, b);
}

// The value type of a rule's fast pass: a float and whether every division and square root that made it was
// exact. The rules need + - * /, V(float), q8_sqrt and q8_sign of it (q8_rules.h).
struct Q8Checked {
    float v;
    bool ok;
    __device__ __forceinline__ Q8Checked() : v(0.0f), ok(true) {}
    __device__ __forceinline__ Q8Checked(float x) : v(x), ok(true) {}  // NOLINT: a rule's V(constant)
    __device__ __forceinline__ Q8Checked(float x, bool exact) : v(x), ok(exact) {}
};

__device__ __forceinline__ Q8Checked operator+(Q8Checked a, Q8Checked b) { return {a.v + b.v, a.ok && b.ok}; }
__device__ __forceinline__ Q8Checked operator-(Q8Checked a, Q8Checked b) { return {a.v - b.v, a.ok && b.ok}; }
__device__ __forceinline__ Q8Checked operator*(Q8Checked a, Q8Checked b) { return {a.v * b.v, a.ok && b.ok}; }
__device__ __forceinline__ Q8Checked operator/(Q8Checked a, Q8Checked b) {
    bool ok = a.ok && b.ok;
    const float q = q8_div_checked(a.v, b.v, ok);
    return {q, ok};
}
__device__ __forceinline__ Q8Checked q8_sqrt(Q8Checked x) {
    bool ok = x.ok;
    const float r = q8_sqrt_checked(x.v, ok);
    return {r, ok};
}
__device__ __forceinline__ Q8Checked q8_sign(Q8Checked x) { return {q8_sign(x.v), x.ok}; }

}  // namespace
}  // namespace ds_q8
