// The first half of the AVX-512 traits of the CPU driver (isa_avx512.cpp adds the requantization):
// the 16-lane vector, masked loads and stores, the map in byte planes with the dequantization of 64
// codes at a time, and block maxima. Included by isa_avx512.cpp only, after its system headers and
// its target pragma; internal linkage, like every project header there.
#pragma once

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

// What the driver reads and writes through the traits; Avx512 (isa_avx512.cpp) adds the search of
// the nearest codes and their stochastic rounding.
struct Avx512Vectors {
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

    // code[c] * absmax for 64 codes (cnt of them read, the rest taken as code 0) into 4 vectors in
    // memory order.
    static void dequant64(__m512* out, const uint8_t* codes, int cnt, const Table& t, float absmax) {
        const __mmask64 live = cnt >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << cnt) - 1);
        values64(out, _mm512_maskz_loadu_epi8(live, codes), t, _mm512_set1_ps(absmax));
    }

    // code[c] * scale for the 64 codes of a register, into 4 vectors in memory order.
    static void values64(__m512* out, __m512i codes, const Table& t, __m512 scale) {
        // After the byte->word->dword unpacks below, float q of 128-bit lane L holds input byte
        // 16L + 4q + i; this pre-permutation puts element 16q + 4L + i there, so that the four
        // result registers come out in memory order.
        alignas(64) static const uint8_t order[64] = {
            0, 1, 2, 3, 16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51,
            4, 5, 6, 7, 20, 21, 22, 23, 36, 37, 38, 39, 52, 53, 54, 55,
            8, 9, 10, 11, 24, 25, 26, 27, 40, 41, 42, 43, 56, 57, 58, 59,
            12, 13, 14, 15, 28, 29, 30, 31, 44, 45, 46, 47, 60, 61, 62, 63};
        const __m512i perm = _mm512_load_si512(order);
        __m512i c = _mm512_permutexvar_epi8(perm, codes);
        __mmask64 high = _mm512_movepi8_mask(c);
        __m512i b[4];
        for (int k = 0; k < 4; ++k)
            b[k] = _mm512_mask_blend_epi8(high, _mm512_permutex2var_epi8(t.plane[k][0], c, t.plane[k][1]),
                                          _mm512_permutex2var_epi8(t.plane[k][2], c, t.plane[k][3]));
        __m512i lo01 = _mm512_unpacklo_epi8(b[0], b[1]), hi01 = _mm512_unpackhi_epi8(b[0], b[1]);
        __m512i lo23 = _mm512_unpacklo_epi8(b[2], b[3]), hi23 = _mm512_unpackhi_epi8(b[2], b[3]);
        __m512i f[4] = {_mm512_unpacklo_epi16(lo01, lo23), _mm512_unpackhi_epi16(lo01, lo23),
                        _mm512_unpacklo_epi16(hi01, hi23), _mm512_unpackhi_epi16(hi01, hi23)};
        for (int q = 0; q < 4; ++q) out[q] = _mm512_mul_ps(_mm512_castsi512_ps(f[q]), scale);
    }

    // The step dequantizes 64 codes at a time straight into registers.
    static constexpr int kChunk = 64;
    static void dequant_chunk(V* out, const uint8_t* codes, int cnt, const Table& t, float absmax) {
        __m512 v[4];
        dequant64(v, codes, cnt, t, absmax);
        for (int q = 0; q < 4; ++q) out[q] = v[q];
    }

    // code[c] * absmax for `len` codes into out (rounded up to a multiple of 64 lanes).
    static void dequant_block(float* out, const uint8_t* codes, int len, const Table& t, float absmax) {
        for (int i = 0; i < len; i += 64) {
            __m512 v[4];
            dequant64(v, codes + i, len - i, t, absmax);
            for (int q = 0; q < 4; ++q) _mm512_store_ps(out + i + 16 * q, v[q]);
        }
    }

    // Running max of |x| on the bit patterns: for non-negative floats integer order is float order,
    // and every NaN pattern lies above infinity, so a NaN wins and is reported at the end.
    static V absmax_init() { return _mm512_setzero_ps(); }
    static V absmax_step(V acc, V x, int cnt) {
        const __m512i bits = _mm512_and_si512(_mm512_castps_si512(x.v), _mm512_set1_epi32(0x7FFFFFFF));
        const __m512i a = _mm512_castps_si512(acc.v);
        return _mm512_castsi512_ps(_mm512_mask_max_epu32(a, mask(cnt), a, bits));
    }
    static float absmax_reduce(V acc) {
        const uint32_t m = (uint32_t)_mm512_reduce_max_epu32(_mm512_castps_si512(acc.v));
        return m > 0x7F800000u ? NAN : q8_float(m);
    }

    // absmax_reduce of `count` accumulators into out[0..count): 16 at a time by a tree that halves the
    // lanes per accumulator and doubles the accumulators per vector at each level (4 levels, 3
    // instructions per pair), about 3 instructions per accumulator instead of 9 for one reduction each.
    // Small blocks end in many reductions: this is most of what 64-element blocks cost over 2048.
    static void absmax_reduce_many(const V* acc, int count, float* out) {
        for (int b = 0; b < count; b += 16) {
            __m512i v[16];
            for (int i = 0; i < 16; ++i)
                v[i] = b + i < count ? _mm512_castps_si512(acc[b + i].v) : _mm512_setzero_si512();
            __m512i w[8], x[4], y[2];
            for (int i = 0; i < 8; ++i)  // 256-bit halves: accumulator 2i in the low half, 2i+1 in the high
                w[i] = _mm512_max_epu32(_mm512_shuffle_i64x2(v[2 * i], v[2 * i + 1], 0x44),
                                        _mm512_shuffle_i64x2(v[2 * i], v[2 * i + 1], 0xEE));
            for (int i = 0; i < 4; ++i)  // one accumulator per 128-bit lane
                x[i] = _mm512_max_epu32(_mm512_shuffle_i64x2(w[2 * i], w[2 * i + 1], 0x88),
                                        _mm512_shuffle_i64x2(w[2 * i], w[2 * i + 1], 0xDD));
            for (int i = 0; i < 2; ++i)  // two accumulators per 128-bit lane
                y[i] = _mm512_max_epu32(shuffle32<_MM_SHUFFLE(1, 0, 1, 0)>(x[2 * i], x[2 * i + 1]),
                                        shuffle32<_MM_SHUFFLE(3, 2, 3, 2)>(x[2 * i], x[2 * i + 1]));
            __m512i z = _mm512_max_epu32(shuffle32<_MM_SHUFFLE(2, 0, 2, 0)>(y[0], y[1]),
                                         shuffle32<_MM_SHUFFLE(3, 1, 3, 1)>(y[0], y[1]));
            // lane j now holds accumulator {0,4,8,12,1,5,...}[j]: back to order
            z = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), z);
            alignas(64) uint32_t bits[16];
            _mm512_store_si512(bits, z);
            for (int i = 0; i < 16 && b + i < count; ++i) out[b + i] = bits[i] > 0x7F800000u ? NAN : q8_float(bits[i]);
        }
    }

    // _mm512_shuffle_ps on integer vectors: per 128-bit lane, two dwords of a then two of b.
    template <int kImm>
    static __m512i shuffle32(__m512i a, __m512i b) {
        return _mm512_castps_si512(_mm512_shuffle_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b), kImm));
    }
};

}  // namespace
}  // namespace ds_q8
