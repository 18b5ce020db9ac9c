// Requantization by one table read: the two map entries around a scaled value, found from its sign,
// exponent and top 7 mantissa bits (the CUDA step kernels hold these tables in shared memory).
//
// Every rounding the reference does (ds_q8/functional.py quantize_scaled) picks one of two neighbouring
// entries: with F = #{i >= 1 : code[i] <= y} (the floor index, at most 254), stochastic rounding takes
// F + 1 when u * (code[F+1] - code[F]) < y - code[F] and F otherwise, and the nearest code is
// F + (mid[F] < y). That holds for every value of a finite block when each midpoint lies strictly
// between its two entries (the zero point's midpoint 0 of unsigned maps excepted): the reference's
// pair is (n, n + 1) above the nearest code n and (n - 1, n) below it, which is (F, F + 1) either way.
// At the ends the pair (0, 1) keeps everything below code[0] at 0, and (254, 255) sends everything at or
// above code[255] to 255 (y - code[254] is at least the gap, which u * gap with u < 1 never reaches).
// The zero point of unsigned maps (a positive value takes at least code 1) is the pair (0, 1) with a
// gap of 0: u * 0 < y holds for every positive y.
//
// F is counted like the nearest code in q8_common.h (the thresholds are the floats just below each
// entry, so that "threshold < y" is "entry <= y"): the order-preserving key of y, whose top 16 bits pick
// a row holding F at the row's start and the row's one threshold, if any, as the carry of
// (row + low 16 bits of the key) >> 16. Rows cover magnitudes from 2^-22 to 1 + 2^-7, once per sign;
// smaller magnitudes share their sign's first row, which must hold no threshold (a map with entries
// that small gets no table). A scaled value of a finite block never exceeds 1 + 2^-7 in magnitude
// (|x| <= absmax up to one rounding; a maximum saturated to the largest bf16 scales to at most
// 1.004), and -0.0 must be made +0.0 first (q8_floor_index's caller adds 0). Blocks that are not
// finite take the exact path (q8_quantize_scaled, q8_round_stochastic).
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "q8_common.h"

namespace ds_q8 {

constexpr uint32_t kFloorRowLow = 0x3480;   // top 16 bits of 2^-22: the first row of each sign
constexpr uint32_t kFloorRowHigh = 0x3F80;  // top 16 bits of 1.0: the last row, up to 1 + 2^-7
constexpr int kFloorRows = (int)(kFloorRowHigh - kFloorRowLow + 1);

// One map's tables, plain data (the CUDA kernels copy them word by word into shared memory).
struct FloorTable {
    // row[0][r]: negative values, row[1][r]: positive ones, r = max(|y| >> 16, kFloorRowLow) - kFloorRowLow
    uint32_t row[2][kFloorRows];
    // pair[F] = {code[F], (code[F+1] - code[F]) * 2^-24} (the gap of the zero point's pair is 0):
    // u * gap with u = (r >> 8) * 2^-24 is (r >> 8) * (gap * 2^-24), the same product, one multiply
    float pair[256][2];
    float mid[256];   // mid[F]: the reference's midpoints (the zero point's is 0), mid[255] unused
    float code[256];  // the map itself, for dequantization
    uint32_t pad[2];  // to whole 16-byte words
};

constexpr int kFloorWords = (int)(sizeof(FloorTable) / 4);
static_assert(sizeof(FloorTable) % 16 == 0, "a FloorTable must be whole 16-byte words");

namespace {

// The row of a value (its bits u) in a table's 2 * kFloorRows entries, negative rows first.
Q8_HD uint32_t q8_floor_row(uint32_t u) {
    const uint32_t hi = (u & 0x7FFFFFFFu) >> 16;
    const uint32_t r = (hi > kFloorRowLow ? hi : kFloorRowLow) - kFloorRowLow;
    return (u >> 31 ? 0u : (uint32_t)kFloorRows) + r;
}

// F from a row entry and the value's key.
Q8_HD uint32_t q8_floor_from_row(uint32_t entry, uint32_t key) { return (entry + (key & 0xFFFFu)) >> 16; }

// The scalar form of the kernels' rounding (the CUDA step and the tests' exhaustive check): the code of
// y (finite, |y| <= 1 + 2^-7, not -0.0) rounded to nearest, or stochastically with random bits r.
Q8_HD uint32_t q8_floor_round(const FloorTable& t, float y, bool stochastic, uint32_t r) {
    const uint32_t f = q8_floor_from_row((&t.row[0][0])[q8_floor_row(q8_bits(y))], q8_key(y));
    if (!stochastic) return f + (t.mid[f] < y ? 1u : 0u);
    const float u = (float)(r >> 8) * t.pair[f][1];
    return f + (u < y - t.pair[f][0] ? 1u : 0u);
}

}  // namespace

// Builds the tables of a sorted 256-entry map; false when it has none (a midpoint not strictly between
// its entries, entries within 2^-24 of zero, or two thresholds in one row): the exact path serves it.
Q8_HOST inline bool q8_build_floortable(const float* code, FloorTable* out) {
    float below[255];  // below[i] < y  <=>  code[i + 1] <= y
    for (int i = 0; i < 255; ++i) {
        const float mid = (code[i] + code[i + 1]) * 0.5f;
        const bool zero_point = i == 0 && code[0] == 0.0f;
        if (!(code[i] < code[i + 1]) || (!zero_point && !(code[i] < mid && mid < code[i + 1]))) return false;
        if (!(code[i + 1] > -2.0f && code[i + 1] < 2.0f)) return false;
        below[i] = nextafterf(code[i + 1], -INFINITY);
    }
    auto floor_of = [&](float y) {  // F, at most 254
        int f = 0;
        while (f < 254 && below[f] < y) ++f;
        return (uint32_t)f;
    };
    memset(out, 0, sizeof(FloorTable));
    for (int sign = 0; sign < 2; ++sign) {
        for (int r = 0; r < kFloorRows; ++r) {
            // the row's magnitudes [first, last]; the first row also holds every smaller magnitude
            // (down to the smallest nonzero one for negatives: -0.0 never gets here)
            const uint32_t hi = kFloorRowLow + (uint32_t)r;
            const uint32_t first = r == 0 ? (sign == 0 ? 1u : 0u) : hi << 16, last = (hi << 16) | 0xFFFFu;
            const float a = q8_float(first), b = q8_float(last);
            // in value order: the smallest value of the row, then the largest
            const float lo_v = sign == 0 ? -b : a, hi_v = sign == 0 ? -a : b;
            const uint32_t f_lo = floor_of(lo_v), f_hi = floor_of(hi_v);
            uint32_t cut = 0xFFFFu;  // the low 16 key bits of the row's threshold; none: 0xFFFF
            if (f_hi > f_lo + 1) return false;
            if (f_hi == f_lo + 1) {
                if (r == 0) return false;  // the clamped first row must be flat
                const uint32_t k = q8_key(below[f_lo]);
                if ((k >> 16) != (q8_key(lo_v) >> 16)) return false;
                cut = k & 0xFFFFu;
            }
            out->row[sign][r] = (f_lo << 16) + (0xFFFFu - cut);
        }
    }
    for (int f = 0; f < 255; ++f) {
        const bool zero_point = f == 0 && code[0] == 0.0f;
        out->pair[f][0] = code[f];
        const float gap = code[f + 1] - code[f];
        out->pair[f][1] = zero_point ? 0.0f : gap * 5.9604644775390625e-08f;
        if (!zero_point && out->pair[f][1] * 16777216.0f != gap) return false;  // not exact (subnormal)
        out->mid[f] = zero_point ? 0.0f : (code[f] + code[f + 1]) * 0.5f;
    }
    out->pair[255][0] = code[255];  // never read: F <= 254
    for (int i = 0; i < 256; ++i) out->code[i] = code[i];
    return true;
}

}  // namespace ds_q8
