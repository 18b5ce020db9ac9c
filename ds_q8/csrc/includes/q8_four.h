// The codec of 4-bit Adam state (ds_q8/format4.py), one value at a time: packed nibbles, a block
// decoded and a block requantized. The CPU driver's 4-bit step vectorizes the same operations.
#pragma once

#include "q8_common.h"

namespace ds_q8 {

// Internal linkage, as in q8_common.h: the driver TUs are compiled for different instruction sets.
namespace {

// ------------------------------------------------------------------ 4-bit Adam state (ds_q8/format4.py)
// Two codes a byte by the element's index in its parameter (the even one in the low nibble, a nibble
// past the end 0); the second moment on a zero-free map scaled by its block's float32 maximum, the first
// stored as r = m / sqrt(v) against the decoded second moment, scaled by a bf16 maximum rounded up. The
// maps and their decision boundaries are format4.py's, passed in.
struct Q8Four {
    const float* m_map;  // 15 values, k / 7
    const float* m_mid;  // their 14 decision boundaries
    const float* v_map;  // 16 values, the largest 1
    const float* v_mid;  // their 15 decision boundaries
};

// torch.searchsorted(mid, y): #{i : mid[i] < y}, NaN past every boundary.
Q8_HD uint32_t q8_count_below_n(const float* mid, int n, float y) {
    if (y != y) return (uint32_t)n;
    uint32_t c = 0;
    for (int i = 0; i < n; ++i) c += mid[i] < y ? 1u : 0u;
    return c;
}

Q8_HD uint32_t q8_nibble(const uint8_t* bytes, int64_t i) { return (bytes[i >> 1] >> ((i & 1) * 4)) & 15u; }

// Element i (from an even one) of packed codes: the even one writes its byte whole (a nibble past the
// end stays 0), the odd one adds the high nibble.
Q8_HD void q8_set_nibble(uint8_t* bytes, int64_t i, uint32_t code) {
    if (i & 1) bytes[i >> 1] = (uint8_t)(bytes[i >> 1] | (code << 4));
    else bytes[i >> 1] = (uint8_t)code;
}

// One block of len values from element `first` (even) of the packed codes: v, then m = r * sqrt(v).
Q8_HD void q8_four_decode(const uint8_t* m_bytes, const uint8_t* v_bytes, int64_t first, int len, float m_absmax,
                          float v_max, const Q8Four& f, float* m, float* v) {
    for (int i = 0; i < len; ++i) {
        const float vv = f.v_map[q8_nibble(v_bytes, first + i)] * v_max;
        v[i] = vv;
        m[i] = (f.m_map[q8_nibble(m_bytes, first + i)] * m_absmax) * sqrtf(vv);
    }
}

// One block requantized: v on its new maximum, then r = m / sqrt(v decoded) (m is overwritten with r)
// on r's stored maximum; the codes from element `first` (even), the maxima through the pointers.
Q8_HD void q8_four_encode(float* m, const float* v, int len, int64_t first, const Q8Four& f, uint8_t* m_bytes,
                          uint8_t* v_bytes, float* v_max_out, uint16_t* m_absmax_out) {
    float vmax = 0.0f;
    for (int i = 0; i < len; ++i) vmax = q8_absmax_step(vmax, v[i]);
    const float vs = q8_block_scale(vmax);
    float rmax = 0.0f;
    for (int i = 0; i < len; ++i) {
        const uint32_t c = q8_count_below_n(f.v_mid, 15, v[i] * vs);
        q8_set_nibble(v_bytes, first + i, c);
        const float root = sqrtf(f.v_map[c] * vmax);
        const float r = root > 0.0f ? m[i] / root : 0.0f;
        m[i] = r;
        rmax = q8_absmax_step(rmax, r);
    }
    const uint16_t stored = q8_absmax_store(rmax);
    const float ms = q8_block_scale(q8_absmax_load(stored));
    for (int i = 0; i < len; ++i) q8_set_nibble(m_bytes, first + i, q8_count_below_n(f.m_mid, 14, m[i] * ms));
    *v_max_out = vmax;
    *m_absmax_out = stored;
}

}  // namespace
}  // namespace ds_q8
