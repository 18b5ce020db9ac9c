// AVX-512 traits for the CPU driver (16 lanes, masked loads/stores for partial blocks).
// Needs AVX512-VBMI too: codes are dequantized 64 at a time with byte permutes instead of gathers,
// which are slow on some CPUs (about 1.2 cycles per element on AMD Zen 4).
// Every header that defines inline code is included before the target pragma, so that only
// this file's own functions are compiled for AVX-512.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,f16c")

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
inline V512 q8_sign(V512 a) {  // torch.sign: +0 for +-0 and NaN (ordered compares are false)
    const __m512 zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.0f);
    __m512 pos = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(zero, a.v, _CMP_LT_OQ), one);
    __m512 neg = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a.v, zero, _CMP_LT_OQ), one);
    return _mm512_sub_ps(pos, neg);
}

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

    // The map split into 4 byte planes (byte b of every entry), 4 registers of 64 bytes each:
    // a 256-entry byte lookup is then two 128-entry vpermt2b and a blend on bit 7.
    struct Table {
        __m512i plane[4][4];
    };
    static Table prepare(const float* code) {
        Table t;
        alignas(64) uint8_t bytes[4][256];
        for (int i = 0; i < 256; ++i) {
            uint32_t u = q8_bits(code[i]);
            for (int b = 0; b < 4; ++b) bytes[b][i] = (uint8_t)(u >> (8 * b));
        }
        for (int b = 0; b < 4; ++b)
            for (int r = 0; r < 4; ++r) t.plane[b][r] = _mm512_load_si512(bytes[b] + 64 * r);
        return t;
    }

    // code[c] * absmax for `len` codes into out (rounded up to a multiple of 64 lanes).
    static void dequant_block(float* out, const uint8_t* codes, int len, const Table& t, float absmax) {
        // After the byte->word->dword unpacks below, float q of 128-bit lane L holds input byte
        // 16L + 4q + i; this pre-permutation puts element 16q + 4L + i there, so that the four
        // result registers come out in memory order.
        alignas(64) static const uint8_t order[64] = {
            0, 1, 2, 3, 16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51,
            4, 5, 6, 7, 20, 21, 22, 23, 36, 37, 38, 39, 52, 53, 54, 55,
            8, 9, 10, 11, 24, 25, 26, 27, 40, 41, 42, 43, 56, 57, 58, 59,
            12, 13, 14, 15, 28, 29, 30, 31, 44, 45, 46, 47, 60, 61, 62, 63};
        const __m512i perm = _mm512_load_si512(order);
        const __m512 scale = _mm512_set1_ps(absmax);
        for (int i = 0; i < len; i += 64) {
            const int cnt = len - i;
            const __mmask64 live = cnt >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << cnt) - 1);
            __m512i c = _mm512_permutexvar_epi8(perm, _mm512_maskz_loadu_epi8(live, codes + i));
            __mmask64 high = _mm512_movepi8_mask(c);
            __m512i b[4];
            for (int k = 0; k < 4; ++k)
                b[k] = _mm512_mask_blend_epi8(high, _mm512_permutex2var_epi8(t.plane[k][0], c, t.plane[k][1]),
                                              _mm512_permutex2var_epi8(t.plane[k][2], c, t.plane[k][3]));
            __m512i lo01 = _mm512_unpacklo_epi8(b[0], b[1]), hi01 = _mm512_unpackhi_epi8(b[0], b[1]);
            __m512i lo23 = _mm512_unpacklo_epi8(b[2], b[3]), hi23 = _mm512_unpackhi_epi8(b[2], b[3]);
            __m512i f[4] = {_mm512_unpacklo_epi16(lo01, lo23), _mm512_unpackhi_epi16(lo01, lo23),
                            _mm512_unpacklo_epi16(hi01, hi23), _mm512_unpackhi_epi16(hi01, hi23)};
            for (int q = 0; q < 4; ++q) _mm512_store_ps(out + i + 16 * q, _mm512_mul_ps(_mm512_castsi512_ps(f[q]), scale));
        }
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

    // A whole block. With a finite absmax every scaled value is finite and within [-1, 1] (one
    // rounding above 1 at most), so the clamp and NaN handling of quantize() are not needed.
    static void quantize_block(uint8_t* out, const float* x, int len, float absmax, const uint32_t* lookup) {
        const float scale = q8_block_scale(absmax);
        if (!(fabsf(absmax) < INFINITY) || len % 64) {
            for (int i = 0; i < len; i += 16) quantize(out + i, load_tmp(x + i), scale, lookup, len - i < 16 ? len - i : 16);
            return;
        }
        const __m512i low16 = _mm512_set1_epi32(0xFFFF), sign = _mm512_set1_epi32((int)0x80000000u);
        const __m512 vscale = _mm512_set1_ps(scale);
        const int* base = (const int*)lookup - kLookupLow;
        const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        for (int i = 0; i < len; i += 64) {
            __m512i idx[4];
            for (int q = 0; q < 4; ++q) {
                __m512i u = _mm512_castps_si512(_mm512_mul_ps(_mm512_load_ps(x + i + 16 * q), vscale));
                __m512i key = _mm512_xor_si512(u, _mm512_or_si512(_mm512_srai_epi32(u, 31), sign));
                __m512i entry = _mm512_i32gather_epi32(_mm512_srli_epi32(key, 16), base, 4);
                idx[q] = _mm512_srli_epi32(_mm512_add_epi32(entry, _mm512_and_si512(key, low16)), 16);
            }
            // packs work per 128-bit lane; the final dword permute restores memory order
            __m512i w01 = _mm512_packus_epi32(idx[0], idx[1]), w23 = _mm512_packus_epi32(idx[2], idx[3]);
            __m512i bytes = _mm512_permutexvar_epi32(order, _mm512_packus_epi16(w01, w23));
            _mm512_storeu_si512(out + i, bytes);
        }
    }

    static void quantize(uint8_t* out, V x, float scale, const uint32_t* lookup, int cnt) {
        const __m512i low16 = _mm512_set1_epi32(0xFFFF);
        __m512 y = _mm512_mul_ps(x.v, _mm512_set1_ps(scale));
        __m512i u = _mm512_castps_si512(y);
        __m512i flip = _mm512_or_si512(_mm512_srai_epi32(u, 31), _mm512_set1_epi32((int)0x80000000u));
        __m512i key = _mm512_xor_si512(u, flip);
        __m512i hi = _mm512_srli_epi32(key, 16);
        hi = _mm512_min_epi32(_mm512_max_epi32(hi, _mm512_set1_epi32(kLookupLow)), _mm512_set1_epi32(kLookupHigh));
        __m512i entry = _mm512_i32gather_epi32(hi, (const int*)lookup - kLookupLow, 4);
        __m512i idx = _mm512_srli_epi32(_mm512_add_epi32(entry, _mm512_and_si512(key, low16)), 16);
        idx = _mm512_mask_mov_epi32(idx, _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), _mm512_set1_epi32(255));
        _mm512_mask_cvtepi32_storeu_epi8(out, mask(cnt), idx);
    }
};

}  // namespace
}  // namespace ds_q8

#include "q8_cpu_driver.h"

Q8_DEFINE_ISA(avx512, Avx512)

#pragma GCC pop_options
