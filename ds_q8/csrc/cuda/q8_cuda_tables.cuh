// Requantization through a map's tables, for the maps the minifloat codec does not code (dynamic, dynamic6,
// linear, or any other 256-entry map): the step kernel of q8_cuda_step.cuh keeps each such state's FloorTable
// (q8_floortable.h) in shared memory and codes a value by one row read and one pair read; blocks that are not
// finite, and maps without a FloorTable, take the exact path through the lookup table of q8_common.h.
// A state's random bits are q8_state_bits: `bits0` = (key + index) * mul for a thread's first value, then
// one addition of mul per value.
#pragma once

#include <stdint.h>

#include "q8_common.h"
#include "q8_cuda_api.h"  // where a lookup tensor holds its FloorTable
#include "q8_cuda_load_store.cuh"  // kElems
#include "q8_floortable.h"

namespace ds_q8 {
namespace {

// The CTA's copy of a state's tables: the map's FloorTable when it has one, else the map alone in its code[]
// (the exact path then codes every value). Returns whether it has one (the same answer for every thread).
__device__ __forceinline__ bool load_table(const uint32_t* lookup, const float* code, FloorTable& dst) {
    const bool table = __ldg(lookup + kDeviceFloorFlag) != 0u;
    if (table) {
        const uint4* src = reinterpret_cast<const uint4*>(lookup + kDeviceFloorOffset);
        uint4* words = reinterpret_cast<uint4*>(&dst);
        for (int i = threadIdx.x; i < kFloorWords / 4; i += blockDim.x) words[i] = __ldg(src + i);
    } else {
        for (int i = threadIdx.x; i < 256; i += blockDim.x) dst.code[i] = __ldg(code + i);
    }
    return table;
}

// A value of a block that the table serves, scaled as the reference scales it (x * scale), as +0.0 for
// -0.0 (an fma adding 0 rounds once, like the product alone).
__device__ __forceinline__ float table_scaled(float x, float scale) { return __fmaf_rn(x, scale, 0.0f); }

// F of a scaled value: q8_floor_index for a map of either kind, known here at compile time.
template <bool kPositive>
__device__ __forceinline__ uint32_t floor_index(const FloorTable& t, float y) {
    return kPositive ? q8_floor_index_positive(t, __float_as_uint(y)) : q8_floor_index_signed(t, __float_as_uint(y));
}

// The 8 codes of a thread's values of one state, rounded stochastically by the table (q8_floor_round): one
// row read, one pair read each.
template <bool kPositive>
__device__ __forceinline__ void requantize_stochastic(const FloorTable& t, const float (&x)[kElems], float scale,
                                                      uint32_t bits0, uint32_t mul, uint32_t (&idx)[kElems]) {
#pragma unroll
    for (int i = 0; i < kElems; ++i) {
        const float y = table_scaled(x[i], scale);
        const uint32_t f = floor_index<kPositive>(t, y);
        const float2 pr = reinterpret_cast<const float2*>(t.pair)[f];
        idx[i] = f + ((float)((bits0 + (uint32_t)i * mul) >> 8) * pr.y < y - pr.x ? 1u : 0u);
    }
}

// Their nearest codes (q8_floor_round): one row read, one midpoint read.
__device__ __forceinline__ void requantize_nearest(const FloorTable& t, const float (&x)[kElems], float scale,
                                                   uint32_t (&idx)[kElems]) {
#pragma unroll
    for (int i = 0; i < kElems; ++i) {
        const float y = table_scaled(x[i], scale);
        const uint32_t f = q8_floor_index(t, __float_as_uint(y));
        idx[i] = f + (t.mid[f] < y ? 1u : 0u);
    }
}

// Whether a thread's old code i is F or F + 1, tested in place in its packed word: subtracting F from
// the code's byte leaves (old - F) mod 256 there (the bytes below it unchanged), and that is 0 or 1
// exactly when old - F is (F <= 254), which is the byte's bits 1 to 7 clear. An integer multiply-add and
// a logical test instead of extracting the byte, subtracting and comparing.
__device__ __forceinline__ bool old_code_near(const uint32_t (&old)[2], int i, uint32_t f) {
    const int shift = 8 * (i & 3);
    return ((old[i >> 2] - (f << shift)) & (0xFEu << shift)) == 0u;
}

// The 8 codes guided by their old codes (q8_round_guided_code): stochastic rounding between F and F + 1
// where the old code is F or F + 1, the nearer entry elsewhere. The two tests differ only in the factor of the
// pair's gap, the draw (r >> 8) or 2^23, so the factor is selected and one product compared (the same bits: a
// product of two floats does not depend on their order). No zero-point correction: the zero point's gap of 0
// sends every positive value of a positive map's pair (0, 1) up to 1 either way.
template <bool kPositive>
__device__ __forceinline__ void requantize_guided_code(const FloorTable& t, const float (&x)[kElems],
                                                       const uint32_t (&old)[2], float scale, uint32_t bits0,
                                                       uint32_t mul, uint32_t (&idx)[kElems]) {
#pragma unroll
    for (int i = 0; i < kElems; ++i) {
        const float y = table_scaled(x[i], scale);
        const uint32_t f = floor_index<kPositive>(t, y);
        const float2 pr = reinterpret_cast<const float2*>(t.pair)[f];
        // the factor's bits merged under a mask rather than selected: a select lets the compiler move the
        // draw into a branch of its own, which costs a warp more than the draw
        const uint32_t draw = __float_as_uint((float)((bits0 + (uint32_t)i * mul) >> 8));
        const uint32_t near = __float_as_uint(8388608.0f);
        const uint32_t mask = 0u - (old_code_near(old, i, f) ? 1u : 0u);
        const float factor = __uint_as_float((draw & mask) | (near & ~mask));
        idx[i] = f + (factor * pr.y < y - pr.x ? 1u : 0u);
    }
}

// The exact path: any value (NaN, infinity, beyond the table's range), through the lookup table.
__device__ __forceinline__ uint32_t round_exact(const float* code, const uint32_t* lookup, float x, float scale,
                                                int mode, uint32_t r, uint32_t old) {
    const float y = x * scale;
    const uint32_t n = q8_quantize_scaled(y, lookup);
    if (mode == Q8_ROUND_BY_OLD_CODE) return q8_round_guided_code(y, n, code, r, old);
    return mode == Q8_ROUND_STOCHASTIC ? q8_round_stochastic(y, n, code, r) : n;
}

}  // namespace
}  // namespace ds_q8
