// Gather-free nearest-code search: the AVX-512 driver (SIMD twin in isa_avx512.cpp), and
// q8_quantize_fast below, one scalar function shared by the baseline CPU driver (isa_scalar.cpp)
// and the CUDA kernels (which hold the FastMap tables in shared memory).
//
// The lookup table of q8_common.h needs one table read per value, and a 16-lane gather costs about
// as much as the rest of a fused Adam step on AMD Zen 4. The dynamic and linear maps have more
// structure than a table needs: sorted by magnitude, their entries form a few runs ("segments") of
// equally spaced values (one per decade for the dynamic maps). Inside a segment the nearest entry
// is round((a - first) / spacing), which is a multiply-add; which segment holds a value follows from
// its binary exponent and one comparison, because no binade holds more than one segment boundary.
//
// Per value a >= 0 (with scale already applied), every step has a SIMD twin in isa_avx512.cpp:
//   b    = max(exponent_field(a), 96) & 31                  binade 2^-31 .. 2^0; lower ones share 0
//   seg  = bin_seg[b] + (a > bin_thr[b])                    the boundary in this binade, if any
//   t2   = min(fma(a, seg_inv[seg], seg_c[seg]), seg_hi[seg])
//   k    = floor(t2)                                        magnitude index
//   ambiguous when t2 - floor(t2) < kFastAmbiguous
// seg_c holds base - first * inv + 0.5 + kFastAmbiguous / 2, so t2 crosses an integer a little
// past each midpoint, and values close to a midpoint come out ambiguous. Ambiguous values are sent
// to the exact lookup table. q8_build_fastmap proves the rest exact for the given map (see
// q8_fastmap_verify) or refuses the map, so the codes stay bit-identical to the reference.
//
// Signs. Symmetric signed maps (code[127] == 0, code[127 - k] == -code[127 + k]) are searched by
// magnitude: index 127 + k for y >= 0, and for y < 0 the search runs on the next float above |y|,
// which turns the reference's "ties go to the lower entry" into the same strict comparison as on
// the positive side; 127 - k saturates at 0 where the positive side has an entry (1.0) that the
// negative side lacks. Unsigned maps (code[0] == 0, no negative entries) send every y < 0 to 0, and
// keep code 0 for zeros (the zero-point rule of q8_build_lookup): the search places a value among the
// map's own midpoints, and a positive value that lands on 0 moves up to 1.
#pragma once

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "q8_common.h"

namespace ds_q8 {

constexpr float kFastAmbiguous = 1.0f / 4096.0f;  // width of the ambiguous band around a midpoint
constexpr int kFastBinadeLow = 96;               // exponent field of 2^-31
constexpr int kFastMaxSegments = 16;
// The largest magnitude the proof covers: one rounding above 1 (the largest scaled value of a
// finite block) and one more for the next-float-above step of negative values.
constexpr uint32_t kFastLargestBits = 0x3F800002u;

struct FastMap {
    alignas(64) float bin_thr[32];
    alignas(64) int32_t bin_seg[32];
    alignas(64) float seg_inv[kFastMaxSegments];
    alignas(64) float seg_c[kFastMaxSegments];
    alignas(64) float seg_hi[kFastMaxSegments];
    bool is_signed;
};

// A FastMap is plain data: the CUDA kernels copy it word by word into shared memory.
constexpr int kFastWords = (int)(sizeof(FastMap) / 4);
static_assert(sizeof(FastMap) % 4 == 0, "FastMap must be a whole number of 32-bit words");
// The host builds it and the device reads its words: every compiler must lay it out alike.
static_assert(sizeof(FastMap) == 512 && offsetof(FastMap, seg_inv) == 256 && offsetof(FastMap, is_signed) == 448,
              "FastMap layout differs between compilers");

// Internal linkage, as in q8_common.h: this header is compiled both for the baseline (the builder,
// in q8_cpu.cpp) and for AVX-512, and the linker must not swap one copy for the other.
namespace {

Q8_HD float q8_next_up(float a) { return q8_float(q8_bits(a) + 1u); }  // a >= 0, finite

// The scalar twin of the SIMD search: t2 of a (0 <= a < 2). floor(t2) is the magnitude index,
// ambiguous when t2 - floor(t2) < kFastAmbiguous.
Q8_HD float q8_fastmap_t2(const FastMap& m, float a) {
    uint32_t e = q8_bits(a) >> 23;
    if (e < (uint32_t)kFastBinadeLow) e = kFastBinadeLow;
    const int b = (int)(e & 31u);
    const int seg = m.bin_seg[b] + (a > m.bin_thr[b] ? 1 : 0);
    const float t2 = fmaf(a, m.seg_inv[seg], m.seg_c[seg]);
    return t2 < m.seg_hi[seg] ? t2 : m.seg_hi[seg];
}

// The code index of an already scaled value y: q8_quantize_scaled's answer, by the segment search.
// The lookup table answers for y close to a midpoint (ambiguous), beyond the proved range
// (|y| above one rounding past 1: only blocks holding Inf or NaN scale that far) and NaN.
Q8_HD uint32_t q8_quantize_fast(float y, const FastMap& m, const uint32_t* lookup) {
    const uint32_t u = q8_bits(y);
    const bool negative = (u >> 31) != 0u;
    uint32_t a = u & 0x7FFFFFFFu;
    if (m.is_signed && negative) a += 1u;  // the next float above |y| (see "Signs" above)
    if (a > kFastLargestBits) return q8_quantize_scaled(y, lookup);  // also NaN (and -NaN + 1 = -0.0 bits)
    const float t2 = q8_fastmap_t2(m, q8_float(a));
    const float k = floorf(t2);  // t2 >= 0 on the proved range
    if (t2 - k < kFastAmbiguous) return q8_quantize_scaled(y, lookup);
    const uint32_t mag = (uint32_t)k;
    if (!m.is_signed) return negative ? 0u : (mag == 0u && a != 0u ? 1u : mag);  // zero-point rule
    if (negative) return mag >= 127u ? 0u : 127u - mag;
    return mag >= 128u ? 255u : 127u + mag;
}

// Builds the segment tables of a sorted 256-entry map and proves them exact; false when the map
// has no such structure (the lookup table is used instead).
Q8_HOST inline bool q8_build_fastmap(const float* code, FastMap* out) {
    FastMap m;
    memset(&m, 0, sizeof(m));
    float mags[256];
    int top;
    if (code[127] == 0.0f && code[255] > 0.0f) {
        m.is_signed = true;
        top = 128;
        for (int k = 0; k <= top; ++k) mags[k] = code[127 + k];
        for (int k = 1; k < 128; ++k)
            if (q8_bits(code[127 - k]) != q8_bits(-code[127 + k])) return false;
    } else if (code[0] == 0.0f) {
        m.is_signed = false;
        top = 255;
        for (int k = 0; k <= top; ++k) mags[k] = code[k];
    } else {
        return false;
    }
    mags[0] = 0.0f;  // -0.0 compares and scales like +0.0
    for (int k = 0; k < top; ++k)
        if (!(mags[k] < mags[k + 1]) || !(mags[k + 1] < 2.0f)) return false;
        float mid[255];
    for (int k = 0; k < top; ++k) mid[k] = (mags[k] + mags[k + 1]) * 0.5f;

    // Fewest runs of equally spaced entries (any partition is correct if it verifies; fewer runs
    // mean fewer boundaries per binade).
    auto linear = [&](int i, int j) {
        if (j - i < 2) return true;
        const double g0 = (double)mags[i + 1] - mags[i];
        for (int k = i + 1; k < j; ++k) {
            const double g = (double)mags[k + 1] - mags[k];
            if (fabs(g - g0) > 1e-3 * g0) return false;
        }
        return true;
    };
    int best[257], from[257];
    best[0] = 0;
    for (int j = 1; j <= top + 1; ++j) {
        best[j] = 1 << 20;
        for (int i = j - 1; i >= 0; --i) {
            if (!linear(i, j - 1)) break;  // a longer run containing a kink is never linear
            if (best[i] + 1 < best[j]) best[j] = best[i] + 1, from[j] = i;
        }
    }
    const int nseg = best[top + 1];
    if (nseg > kFastMaxSegments) return false;
    int first[kFastMaxSegments + 1];
    for (int j = top + 1, s = nseg; s > 0; --s) first[s - 1] = from[j], j = from[j];
    first[nseg] = top + 1;

    for (int s = 0; s < nseg; ++s) {
        const int base = first[s], last = first[s + 1] - 1;
        if (last == base) {
            m.seg_inv[s] = 0.0f;
            m.seg_c[s] = (float)base + 0.5f;
        } else {
            const double spacing = ((double)mags[last] - mags[base]) / (last - base);
            const float inv = (float)(1.0 / spacing);
            m.seg_inv[s] = inv;
            m.seg_c[s] = (float)(base + 0.5 + kFastAmbiguous / 2.0 - (double)mags[base] * inv);
        }
        m.seg_hi[s] = (float)last + 0.5f;
    }
    for (int s = nseg; s < kFastMaxSegments; ++s) m.seg_inv[s] = 0.0f, m.seg_c[s] = 0.0f, m.seg_hi[s] = 0.0f;

    // Segment s >= 1 starts above the midpoint below its first entry.
    for (int b = 0; b < 32; ++b) {
        const float lo = b == 0 ? 0.0f : ldexpf(1.0f, kFastBinadeLow + b - 127);
        const float hi = ldexpf(1.0f, kFastBinadeLow + b - 126);
        int below = 0, inside = 0;
        float thr = INFINITY;
        for (int s = 1; s < nseg; ++s) {
            const float t = mid[first[s] - 1];
            if (t < lo) ++below;
            else if (t < hi) ++inside, thr = t;
        }
        if (inside > 1) return false;
        m.bin_thr[b] = thr;
        m.bin_seg[b] = below;
    }

    // Proof. t2 is non-decreasing in a inside a segment (fma with inv >= 0, then min), and every
    // segment boundary is a midpoint, so each interval (mid[k-1], mid[k]] of values whose true
    // index is k lies in one segment. On it an unambiguous floor(t2) is exactly k when
    //   t2(q8_next_up(mid[k-1])) >= k          (nothing in the interval floors below k), and
    //   t2(mid[k]) < k + 1 + kFastAmbiguous (whatever floors to k + 1 or more is ambiguous).
    // The first interval starts at 0 and the last ends one rounding above 1 (the largest scaled
    // value of a finite block).
    for (int s = 0; s < nseg; ++s)
        if (!(m.seg_inv[s] >= 0.0f)) return false;
    const float largest = q8_float(kFastLargestBits);  // q8_next_up(q8_next_up(1.0f))
    for (int k = 0; k <= top; ++k) {
        const float lo = k == 0 ? 0.0f : q8_next_up(mid[k - 1]);
        const float hi = k == top ? largest : mid[k];
        if (!(q8_fastmap_t2(m, lo) >= (float)k)) return false;
        if (!(q8_fastmap_t2(m, hi) < (float)k + 1.0f + kFastAmbiguous)) return false;
    }
    *out = m;
    return true;
}

}  // namespace
}  // namespace ds_q8
