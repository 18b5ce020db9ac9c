// Stochastic requantization from the two map entries around a value, found without its nearest code
// (the AVX2 driver). q8_round_stochastic takes the nearest code n, reads code[n], steps to the
// neighbour on y's side and reads that entry too: three dependent table reads per value. Both entries
// follow from one number instead, the floor index F = #{i >= 1 : code[i] <= y}: when every midpoint
// lies strictly between its two entries (the zero point's midpoint 0 of unsigned maps excepted), n is
// F or F + 1, and either way the reference rounds between entries F and F + 1. At the ends the pair
// (0, 1) or (254, 255) gives the reference's result too: below code[0], y - code[0] < 0 keeps 0; at or
// above code[255], y - code[254] is at least the gap, which u * gap (u < 1) never reaches, so 255.
// F comes from a lookup table like the nearest code's, built on the thresholds "just below each entry"
// (the next float down, so that "threshold < y" is "entry <= y"), whose rows also carry the entries
// that F can point to there. q8_build_floormap refuses maps where the premise fails; the
// two-step search serves them.
#pragma once

#include <math.h>
#include <stdint.h>

#include "q8_common.h"

namespace ds_q8 {

// One row per bucket of the lookup table (the value's sign, exponent and top 7 mantissa bits): the
// bucket's count entry, F = (entry + low 16 bits of the key) >> 16 at most 254, and the three map
// entries that F's pair can take there, code[lo], code[lo + 1], code[lo + 2] (lo = entry >> 16): a
// bucket holds at most one threshold, so F is lo or lo + 1 and the pair (c[0], c[1]) or (c[1], c[2]).
// One 16-byte read gives a value everything its rounding needs; the table is 512 KiB a map, built once
// per distinct map, of which a step touches the rows of the exponents its values have.
struct FloorRow {
    uint32_t entry;
    float c[3];
};

struct FloorMap {
    FloorRow row[kLookupSize];
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
    // The zero point folded in: in a map whose smallest entry is 0, every positive value has F >= 1, so a
    // value below code[1] rounds between entries 1 and 2, and y - code[1] < 0 keeps it at 1 whatever the
    // rule, as the zero point would (callers skip that step); 0 itself keeps F = 0.
    if (code[0] == 0.0f) below[0] = 0.0f;
    uint32_t* lookup = new uint32_t[kLookupSize];
    const bool ok = q8_build_thresholds(below, lookup);
    for (int i = 0; ok && i < kLookupSize; ++i) {
        uint32_t entry = lookup[i];
        // F is at most 254 (the pair (254, 255) serves every value at or above code[254]): a bucket
        // whose count reaches 254 gives 254 and never carries
        if ((entry >> 16) >= 254) entry = 254u << 16;
        const int lo = (int)(entry >> 16);
        out->row[i].entry = entry;
        for (int k = 0; k < 3; ++k) out->row[i].c[k] = code[lo + k < 255 ? lo + k : 255];
    }
    delete[] lookup;
    return ok;
}

}  // namespace ds_q8
