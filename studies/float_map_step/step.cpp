// A speed probe, not a kernel of the op: the AdamW step with 8-bit states on float-coded maps, AVX2.
//
// The op's maps are tables (dynamic6): a code becomes a value by a table read and a value finds its
// code through lookup tables, four table reads a parameter. A float-coded map needs none. A code is a
// small float: the first moment's sign, 3 exponent bits and 4 mantissa bits (E3M4; codes with exponent 0
// are evenly spaced down to 0), the second moment's 4 exponent and 4 mantissa bits (E4M4; a positive
// value takes at least code 1, as the op's unsigned maps do), each scaled per block of 64 by the block's
// maximum over the map's top entry. A code becomes a value by
// shifting it into a float's bits; a value becomes its code by adding random bits below the kept
// mantissa (stochastic rounding, unbiased) and shifting back. This file times that step against the
// same data layout as the op's (fp32 parameters and gradients, uint8 codes, a bf16 maximum per block),
// so that the arithmetic a step needs on such maps can be set beside DeepSpeedCPUAdam's: it answers how
// fast the CPU step could be, not whether such maps train as well (the fidelity study's question).
//
// Built by studies/float_map_bench.py: g++ -O3 -mavx2 -mfma -mf16c -fopenmp -ffp-contract=off -shared.
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

namespace {

constexpr int kBlock = 64;      // values per block (the op's default)
constexpr int kTile = 2048;     // values per parallel work item (the op's CPU tile)
// the largest entry of a map with M mantissa bits: 2^0 (2 - 2^-M)
template <int M>
constexpr float top() { return 2.0f - 1.0f / (float)(1 << M); }

inline __m256i mix32(__m256i h) {  // the op's q8_mix32: the random bits of (key ^ index)
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
    h = _mm256_mullo_epi32(h, _mm256_set1_epi32((int)0x85EBCA6Bu));
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 13));
    h = _mm256_mullo_epi32(h, _mm256_set1_epi32((int)0xC2B2AE35u));
    return _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
}

inline __m256i load_codes(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }

inline void store_codes(uint8_t* p, __m256i c) {  // 8 int32 lanes < 256 to 8 bytes
    const __m128i lo = _mm256_castsi256_si128(c), hi = _mm256_extracti128_si256(c, 1);
    const __m128i w = _mm_packus_epi32(lo, hi);
    _mm_storel_epi64((__m128i*)p, _mm_packus_epi16(w, w));
}

// A code of E exponent bits and M mantissa bits, exponent bias B = 2^E - 1 so that the top binade is
// [1, 2): normal codes are the float 2^(e - B) (1 + f / 2^M), those with e = 0 the evenly spaced
// f / 2^M x 2^(1 - B) (0 included). `mag` holds the code without its sign.
template <int E, int M, bool kFlush = false>
inline __m256 decode_magnitude(__m256i mag) {
    constexpr int B = (1 << E) - 1;
    const __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(mag, 23 - M), _mm256_set1_epi32((127 - B) << 23)));
    if (kFlush) return normal;  // a variant: codes with e = 0 read as 2^-B (1 + f / 2^M), a map without 0
    const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(ldexpf(1.0f, 1 - B - M)));
    const __m256 is_sub = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(1 << M), mag));
    return _mm256_blendv_ps(normal, sub, is_sub);
}

// The code of |y| <= top<M>() rounded stochastically with random bits r: 23 - M of them added below the
// kept mantissa bits carry into it with probability equal to the dropped fraction; below 2^(1 - B) the
// same on the evenly spaced codes, through a float (24 random bits).
// kFlush (a variant, to see what the evenly spaced low codes cost): values below 2^-14 go to code 0 or
// the smallest normal code by the same carry, no second path.
template <int E, int M, bool kFlush>
inline __m256i encode_magnitude(__m256 a, __m256i r, int top_code) {
    constexpr int B = (1 << E) - 1;
    const __m256i bits = _mm256_castps_si256(a);
    const __m256i kept = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_srli_epi32(r, 9 + M)), 23 - M);
    const __m256i normal = _mm256_sub_epi32(kept, _mm256_set1_epi32((127 - B) << M));
    if (kFlush) return _mm256_min_epi32(_mm256_max_epi32(normal, _mm256_setzero_si256()), _mm256_set1_epi32(top_code));
    const __m256 u = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(r, 8)), _mm256_set1_ps(5.9604644775390625e-08f));
    const __m256 q = _mm256_add_ps(_mm256_mul_ps(a, _mm256_set1_ps(ldexpf(1.0f, B - 1 + M))), u);
    const __m256i sub = _mm256_cvttps_epi32(q);
    const __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32((127 + 1 - B) << 23), bits);  // a < 2^(1 - B)
    return _mm256_min_epi32(_mm256_blendv_epi8(normal, sub, is_sub), _mm256_set1_epi32(top_code));
}

inline uint16_t bf16_up(float x) {  // the stored maximum: bf16 rounded up (the op's q8_absmax_store)
    uint32_t u;
    memcpy(&u, &x, 4);
    const uint32_t hi = u >> 16;
    return (uint16_t)((u & 0xFFFFu) ? hi + 1 : hi);
}
inline float bf16_float(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

inline float hmax(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

struct Hyper {
    float lr, beta1, beta2, eps, weight_decay;
    int step;
};

// Variants, to see what each part costs: bit 0 kFlush (above); bit 1 one hash for both states (the
// second moment reuses the first's random bits); bit 2 rounding to nearest (half a unit added instead of
// random bits: no hash at all); bit 3 codes decoded without their second path (decode_magnitude).
// Bit 4 (kGuided) rounds as the op's default does (functional.py, state_rounding="guided"): a first
// moment takes its nearest code where that moves it from its value before the update the way the update
// did, else the stochastic code; a second moment the stochastic code where its old code is one of the two
// around it, else the nearest.
// One block of 64: dequantize both states, the AdamW update, the new maxima, requantize.
template <int kVariant>
inline void step_block(float* p, const float* g, uint8_t* m_codes, uint8_t* v_codes, uint16_t* m_max, uint16_t* v_max,
                       const Hyper& h, float step_size, float inv_sqrt_bc2, uint32_t first) {
    constexpr bool kGuided = kVariant & 16;
    alignas(32) float m_new[kBlock], v_new[kBlock], m_prev[kBlock];
    const __m256 m_old_scale = _mm256_set1_ps(bf16_float(*m_max) / top<4>());
    const __m256 v_old_scale = _mm256_set1_ps(bf16_float(*v_max) / top<4>());
    const __m256 b1 = _mm256_set1_ps(h.beta1), nb1 = _mm256_set1_ps(1.0f - h.beta1);
    const __m256 b2 = _mm256_set1_ps(h.beta2), nb2 = _mm256_set1_ps(1.0f - h.beta2);
    const __m256 decay = _mm256_set1_ps(1.0f - h.lr * h.weight_decay), eps = _mm256_set1_ps(h.eps);
    const __m256 vstep = _mm256_set1_ps(step_size), vbc2 = _mm256_set1_ps(inv_sqrt_bc2);
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 mmax = _mm256_setzero_ps(), vmax = _mm256_setzero_ps();
    for (int i = 0; i < kBlock; i += 8) {
        const __m256i mc = load_codes(m_codes + i), vc = load_codes(v_codes + i);
        const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(mc, _mm256_set1_epi32(0x80)), 24);
        constexpr bool kFlushDecode = kVariant & 8;
        __m256 m = decode_magnitude<3, 4, kFlushDecode>(_mm256_and_si256(mc, _mm256_set1_epi32(0x7F)));
        m = _mm256_mul_ps(_mm256_or_ps(m, _mm256_castsi256_ps(sign)), m_old_scale);
        if (kGuided) _mm256_store_ps(m_prev + i, m);
        __m256 v = _mm256_mul_ps(decode_magnitude<4, 4, kFlushDecode>(vc), v_old_scale);
        const __m256 gv = _mm256_loadu_ps(g + i);
        m = _mm256_add_ps(_mm256_mul_ps(b1, m), _mm256_mul_ps(nb1, gv));
        v = _mm256_add_ps(_mm256_mul_ps(b2, v), _mm256_mul_ps(nb2, _mm256_mul_ps(gv, gv)));
        const __m256 denom = _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(v), vbc2), eps);
        const __m256 pv = _mm256_mul_ps(_mm256_loadu_ps(p + i), decay);
        _mm256_storeu_ps(p + i, _mm256_sub_ps(pv, _mm256_mul_ps(vstep, _mm256_div_ps(m, denom))));
        _mm256_store_ps(m_new + i, m);
        _mm256_store_ps(v_new + i, v);
        mmax = _mm256_max_ps(mmax, _mm256_and_ps(m, abs_mask));
        vmax = _mm256_max_ps(vmax, v);
    }
    *m_max = bf16_up(hmax(mmax));
    *v_max = bf16_up(hmax(vmax));
    const float ma = bf16_float(*m_max), va = bf16_float(*v_max);
    const __m256 m_scale = _mm256_set1_ps(ma > 0.0f ? top<4>() / ma : 0.0f);
    const __m256 v_scale = _mm256_set1_ps(va > 0.0f ? top<4>() / va : 0.0f);
    const __m256 m_unit = _mm256_set1_ps(ma / top<4>());  // a code's value times this: the state's
    const __m256i key_m = _mm256_set1_epi32(0x1234567), key_v = _mm256_set1_epi32(0x7654321);
    __m256i index = _mm256_add_epi32(_mm256_set1_epi32((int)first), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    for (int i = 0; i < kBlock; i += 8, index = _mm256_add_epi32(index, _mm256_set1_epi32(8))) {
        constexpr bool kFlush = kVariant & 1, kShared = kVariant & 2, kNearest = kVariant & 4;
        const __m256i half = _mm256_set1_epi32((int)0x80000000u);  // half a unit, where the bits are r >> (9 + M)
        const __m256i rm = kNearest ? half : mix32(_mm256_xor_si256(index, key_m));
        const __m256i rv = kNearest || kShared ? rm : mix32(_mm256_xor_si256(index, key_v));
        const __m256 m = _mm256_mul_ps(_mm256_load_ps(m_new + i), m_scale);
        const __m256i sign = _mm256_srli_epi32(_mm256_and_si256(_mm256_castps_si256(m), _mm256_set1_epi32((int)0x80000000u)), 24);
        __m256i mc = encode_magnitude<3, 4, kFlush>(_mm256_and_ps(m, abs_mask), rm, 127);
        if (kGuided) {
            const __m256i near = encode_magnitude<3, 4, kFlush>(_mm256_and_ps(m, abs_mask), half, 127);
            const __m256 moved = _mm256_mul_ps(_mm256_or_ps(decode_magnitude<3, 4>(near), _mm256_castsi256_ps(_mm256_slli_epi32(sign, 24))),
                                               m_unit);
            const __m256 x = _mm256_load_ps(m_new + i), prev = _mm256_load_ps(m_prev + i);
            const __m256 keep = _mm256_cmp_ps(_mm256_mul_ps(_mm256_sub_ps(moved, prev), _mm256_sub_ps(x, prev)),
                                              _mm256_setzero_ps(), _CMP_GT_OQ);
            mc = _mm256_blendv_epi8(mc, near, _mm256_castps_si256(keep));
        }
        store_codes(m_codes + i, _mm256_or_si256(mc, sign));
        const __m256 v = _mm256_mul_ps(_mm256_load_ps(v_new + i), v_scale);
        __m256i vc = encode_magnitude<4, 4, kFlush>(v, rv, 255);
        if (kGuided) {
            const __m256i near = encode_magnitude<4, 4, kFlush>(v, half, 255);
            const __m256i lo = encode_magnitude<4, 4, kFlush>(v, _mm256_setzero_si256(), 255);
            const __m256i old = load_codes(v_codes + i);
            const __m256i draw = _mm256_or_si256(_mm256_cmpeq_epi32(old, lo),
                                                 _mm256_cmpeq_epi32(old, _mm256_add_epi32(lo, _mm256_set1_epi32(1))));
            vc = _mm256_blendv_epi8(near, vc, draw);
        }
        const __m256i positive = _mm256_and_si256(_mm256_cmpgt_epi32(_mm256_castps_si256(v), _mm256_setzero_si256()),
                                                  _mm256_set1_epi32(1));
        store_codes(v_codes + i, _mm256_max_epi32(vc, positive));
    }
}

}  // namespace

extern "C" {

// One AdamW step over n values (n a multiple of 64), on `threads` OpenMP threads, tiles of 2048.
void float_map_step(float* p, const float* g, uint8_t* m_codes, uint8_t* v_codes, uint16_t* m_max, uint16_t* v_max,
                    int64_t n, float lr, float beta1, float beta2, float eps, float weight_decay, int step, int threads,
                    int variant) {
    const Hyper h{lr, beta1, beta2, eps, weight_decay, step};
    const float bc1 = 1.0f - powf(beta1, (float)step), bc2 = 1.0f - powf(beta2, (float)step);
    const float step_size = lr / bc1, inv_sqrt_bc2 = 1.0f / sqrtf(bc2);
    const int64_t tiles = (n + kTile - 1) / kTile;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tiles; ++t) {
        const int64_t start = t * kTile, end = start + kTile < n ? start + kTile : n;
        for (int64_t b = start; b < end; b += kBlock) {
            auto run = [&](auto block) {
                block(p + b, g + b, m_codes + b, v_codes + b, m_max + b / kBlock, v_max + b / kBlock, h, step_size,
                      inv_sqrt_bc2, (uint32_t)b);
            };
            switch (variant) {
                case 0: run(step_block<0>); break;
                case 1: run(step_block<1>); break;
                case 3: run(step_block<3>); break;
                case 5: run(step_block<5>); break;
                case 13: run(step_block<13>); break;
                case 16: run(step_block<16>); break;
                default: break;
            }
        }
    }
}

// The value of code c of the first (signed = 1) or second moment's map, for checks.
float float_map_value(int c, int is_signed) {
    alignas(32) float out[8];
    const __m256i code = _mm256_set1_epi32(c);
    if (is_signed) {
        const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(code, _mm256_set1_epi32(0x80)), 24);
        const __m256 m = decode_magnitude<3, 4>(_mm256_and_si256(code, _mm256_set1_epi32(0x7F)));
        _mm256_store_ps(out, _mm256_or_ps(m, _mm256_castsi256_ps(sign)));
    } else {
        _mm256_store_ps(out, decode_magnitude<4, 4>(code));
    }
    return out[0] * (1.0f / top<4>());  // the maps' entries: a code's value times float32(1 / top)
}

}  // extern "C"
