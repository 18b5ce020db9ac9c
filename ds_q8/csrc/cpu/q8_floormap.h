// Stochastic requantization from the two map entries around a value, found without its nearest code
// (the AVX2 driver). q8_round_stochastic takes the nearest code n, reads code[n], steps to the
// neighbour on y's side and reads that entry too: three dependent table reads per value. Both entries
// follow from one number instead, the floor index F = #{i >= 1 : code[i] <= y}: when every midpoint
// lies strictly between its two entries (the zero point's midpoint 0 of unsigned maps excepted), n is
// F or F + 1, and either way the reference rounds between entries F and F + 1. At the ends the pair
// (0, 1) or (254, 255) gives the reference's result too: below code[0], y - code[0] < 0 keeps 0; at or
// above code[255], y - code[254] is at least the gap, which u * gap (u < 1) never reaches, so 255.
// F comes from a lookup table like the nearest code's, built on the thresholds "just below each entry"
// (the next float down, so that "threshold < y" is "entry <= y"), and both entries from one 64-bit
// read of a table of neighbouring pairs. q8_build_floormap refuses maps where the premise fails; the
// two-step search serves them.
#pragma once

#include <math.h>
#include <stdint.h>

#include "q8_common.h"

namespace ds_q8 {

struct FloorMap {
    uint32_t lookup[kLookupSize];  // q8_build_thresholds of the entries' next floats down: F
    float pair[255][2];            // (code[f], code[f + 1])
};

// static: a file compiled for another instruction set gets its own copy
static inline bool q8_build_floormap(const float* code, FloorMap* out) {
    float below[255];
    for (int i = 0; i < 255; ++i) {
        const float mid = (code[i] + code[i + 1]) * 0.5f;
        const bool zero_point = i == 0 && code[0] == 0.0f;
        if (!(code[i] < code[i + 1]) || (!zero_point && !(code[i] < mid && mid < code[i + 1]))) return false;
        below[i] = nextafterf(code[i + 1], -INFINITY);
    }
    if (!q8_build_thresholds(below, out->lookup)) return false;
    for (int f = 0; f < 255; ++f) {
        out->pair[f][0] = code[f];
        out->pair[f][1] = code[f + 1];
    }
    return true;
}

}  // namespace ds_q8
