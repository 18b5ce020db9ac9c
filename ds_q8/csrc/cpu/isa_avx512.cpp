// AVX-512 traits for the CPU driver (16 lanes, masked loads/stores for partial blocks).
// Every header that defines inline code is included before the target pragma, so that only
// this file's own functions are compiled for AVX-512.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,f16c")

#include "q8_common.h"

namespace ds_q8 {
namespace {

struct V512 {
    __m512 v;
    V512() = default;
    V512(__m512 x) : v(x) {}
    V512(float s) : v(_mm512_set1_ps(s)) {}
};
inline V512 operator+(V512 a, V512 b) { return _mm512_add_ps(a.v, b.v); }
inline V512 operator-(V512 a, V512 b) { return _mm512_sub_ps(a.v, b.v); }
inline V512 operator*(V512 a, V512 b) { return _mm512_mul_ps(a.v, b.v); }
inline V512 operator/(V512 a, V512 b) { return _mm512_div_ps(a.v, b.v); }
inline V512 q8_sqrt(V512 a) { return _mm512_sqrt_ps(a.v); }

struct Avx512 {
    static constexpr int W = 16;
    using V = V512;

    static __mmask16 mask(int cnt) { return cnt >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << cnt) - 1u); }

    static V load(const float* p, int cnt) { return _mm512_maskz_loadu_ps(mask(cnt), p); }
    static V load(const q8_half* p, int cnt) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask(cnt), p)); }
    static V load(const q8_bf16* p, int cnt) {
        __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask(cnt), p));
        return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    }

    static void store(float* p, V v, int cnt) { _mm512_mask_storeu_ps(p, mask(cnt), v.v); }
    static void store(q8_half* p, V v, int cnt) {
        _mm256_mask_storeu_epi16(p, mask(cnt), _mm512_cvtps_ph(v.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    static void store(q8_bf16* p, V v, int cnt) {
        // round to nearest even on the bit pattern, as q8_bf16_from_float
        __m512i u = _mm512_castps_si512(v.v);
        __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
        __mmask16 nan = _mm512_cmp_ps_mask(v.v, v.v, _CMP_UNORD_Q);
        r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
        _mm256_mask_storeu_epi16(p, mask(cnt), _mm512_cvtepi32_epi16(r));
    }

    static V load_tmp(const float* p) { return _mm512_load_ps(p); }
    static void store_tmp(float* p, V v) { _mm512_store_ps(p, v.v); }

    static V dequant(const uint8_t* c, int cnt, const float* code, float absmax) {
        __m512i idx = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask(cnt), c));
        return _mm512_mul_ps(_mm512_i32gather_ps(idx, code, 4), _mm512_set1_ps(absmax));
    }

    static V absmax_init() { return _mm512_setzero_ps(); }
    static V absmax_step(V acc, V x, int cnt) {
        // lanes that already hold NaN keep it; max(acc, NaN) returns the NaN operand
        __mmask16 live = mask(cnt) & (__mmask16)~_mm512_cmp_ps_mask(acc.v, acc.v, _CMP_UNORD_Q);
        return _mm512_mask_max_ps(acc.v, live, acc.v, _mm512_abs_ps(x.v));
    }
    static float absmax_reduce(V acc) {
        if (_mm512_cmp_ps_mask(acc.v, acc.v, _CMP_UNORD_Q)) return NAN;
        return _mm512_reduce_max_ps(acc.v);
    }

    static void quantize(uint8_t* out, V x, float scale, const uint32_t* lookup, int cnt) {
        const __m512i low16 = _mm512_set1_epi32(0xFFFF);
        __m512 y = _mm512_mul_ps(x.v, _mm512_set1_ps(scale));
        __m512i u = _mm512_castps_si512(y);
        __m512i flip = _mm512_or_si512(_mm512_srai_epi32(u, 31), _mm512_set1_epi32((int)0x80000000u));
        __m512i key = _mm512_xor_si512(u, flip);
        __m512i hi = _mm512_srli_epi32(key, 16);
        hi = _mm512_min_epi32(_mm512_max_epi32(hi, _mm512_set1_epi32(kLookupLow)), _mm512_set1_epi32(kLookupHigh));
        __m512i entry = _mm512_i32gather_epi32(_mm512_sub_epi32(hi, _mm512_set1_epi32(kLookupLow)), lookup, 4);
        __mmask16 above = _mm512_cmpgt_epi32_mask(_mm512_and_si512(key, low16), _mm512_and_si512(entry, low16));
        __m512i idx = _mm512_srli_epi32(entry, 16);
        idx = _mm512_mask_add_epi32(idx, above, idx, _mm512_set1_epi32(1));
        idx = _mm512_mask_mov_epi32(idx, _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), _mm512_set1_epi32(255));
        _mm512_mask_cvtepi32_storeu_epi8(out, mask(cnt), idx);
    }
};

}  // namespace
}  // namespace ds_q8

#include "q8_cpu_driver.h"

Q8_DEFINE_ISA(avx512, Avx512)

#pragma GCC pop_options
