// The minifloat maps' codec (q8_minifloat.h) on AVX-512: 16 codes decoded from their bits per vector, and 64
// values coded per call, with the integer addition that rounds them (to nearest, with random bits, or guided
// by the old codes) and no table. Included by isa_avx512.cpp only, after its target pragma and
// q8_avx512_vectors.h; internal linkage, like every project header there.
#pragma once

#include "q8_common.h"
#include "q8_minifloat.h"
#include "q8_mf_blocks.h"

namespace ds_q8 {
namespace {

struct Avx512Minifloat : MinifloatBlocks<Avx512Minifloat> {
    // 16 codes (bytes) as their map entries times `absmax` (q8_mf_value).
    template <bool kSigned>
    __attribute__((always_inline)) static inline __m512 mf_decode16(__m128i bytes, __m512 absmax) {
        const __m512i c = _mm512_cvtepu8_epi32(bytes);
        __m512i mag = c, d = c;
        if (kSigned) {
            d = _mm512_sub_epi32(c, _mm512_set1_epi32(127));
            mag = _mm512_abs_epi32(d);
        }
        const __m512 one = _mm512_castsi512_ps(
            _mm512_add_epi32(_mm512_slli_epi32(mag, 19), _mm512_set1_epi32((int)q8_mf_base(kSigned))));
        const __mmask16 sub = _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(16), mag);
        // exponent field 0: (one - 2^-B) * 2, that is one * 2 - 2^(1 - B) (exact, so one fused operation gives
        // it), else one; then / 1.9375, one rounding
        const __m512 units = _mm512_mask_fmsub_ps(one, sub, _mm512_set1_ps(2.0f), _mm512_set1_ps(q8_mf_sub_limit(kSigned)));
        __m512 v = _mm512_mul_ps(units, _mm512_set1_ps(kMfInvTop));
        if (kSigned)  // v | (d & sign bit): the sign of c - 127
            v = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(_mm512_castps_si512(v), d,
                                                              _mm512_set1_epi32((int)0x80000000u), 0xF8));
        return _mm512_mul_ps(v, absmax);
    }

    // The decoding of a chunk of 64 codes (cnt of them read) into 4 vectors. Codes of an unsigned map with a
    // nonzero exponent field (16 and up: every value above 2^-14 of its block's maximum, nearly all second
    // moments) are their float bits plus the base, no more: a chunk of them only takes those bits.
    template <class V>
    __attribute__((always_inline)) static inline void mf_dequant_chunk(V* out, const uint8_t* codes, int cnt, bool is_signed, float absmax) {
        const __m512 a = _mm512_set1_ps(absmax);
        if (!is_signed && cnt >= 64 &&
            !_mm512_cmplt_epu8_mask(_mm512_loadu_si512(codes), _mm512_set1_epi8(16))) {
            const __m512 inv = _mm512_set1_ps(kMfInvTop);
            for (int q = 0; q < 4; ++q) {
                const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(codes + 16 * q)));
                const __m512 one = _mm512_castsi512_ps(
                    _mm512_add_epi32(_mm512_slli_epi32(c, 19), _mm512_set1_epi32((int)q8_mf_base(false))));
                out[q] = _mm512_mul_ps(_mm512_mul_ps(one, inv), a);
            }
            return;
        }
        for (int q = 0; q < 4; ++q) {
            const int left = cnt - 16 * q;
            const __mmask16 m = left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1u);
            const __m128i bytes = _mm_maskz_loadu_epi8(m, codes + 16 * q);
            out[q] = is_signed ? mf_decode16<true>(bytes, a) : mf_decode16<false>(bytes, a);
        }
    }

    // The codes of 16 values z (times q8_mf_scale already), finite, as int32 lanes (q8_mf_code) and not yet
    // clamped to a byte (pack_codes saturates): random bits `bits` (kMode not nearest), old codes as lanes
    // (guided).
    template <bool kSigned, int kMode>
    __attribute__((always_inline)) static inline __m512i mf_encode16(__m512 z, __m512i bits, const uint8_t* old_bytes) {
        const __m512i u = _mm512_castps_si512(z);
        const uint32_t base = q8_mf_base(kSigned), base_code = base >> kMfFracBits;
        const __m512 limit = _mm512_set1_ps(q8_mf_sub_limit(kSigned));
        // An unsigned map's values of 2^(1 - B) and up (nearly every second moment): their bits are the
        // fixed-point code plus the base, and they take neither the zero point nor the negative's 0.
        if (!kSigned && _mm512_cmp_ps_mask(z, limit, _CMP_GE_OQ) == (__mmask16)0xFFFF) {
            __m512i add = _mm512_set1_epi32((int)kMfNearest);
            if (kMode != Q8_ROUND_NEAREST) {
                const __m512i r = _mm512_srli_epi32(bits, 32 - kMfFracBits);
                if (kMode == Q8_ROUND_BY_OLD_CODE) {
                    const __m512i old = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)old_bytes));
                    const __m512i dist = _mm512_sub_epi32(_mm512_add_epi32(old, _mm512_set1_epi32((int)base_code)),
                                                          _mm512_srli_epi32(u, kMfFracBits));
                    add = _mm512_mask_blend_epi32(_mm512_cmple_epu32_mask(dist, _mm512_set1_epi32(1)), add, r);
                } else {
                    add = r;
                }
            }
            return _mm512_sub_epi32(_mm512_srli_epi32(_mm512_add_epi32(u, add), kMfFracBits),
                                    _mm512_set1_epi32((int)base_code));
        }
        const __m512i ab = _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF));
        // q8_mf_fixed plus the base bits (127 - B) << 23, which the code and the guided test fold into their
        // constants: from 2^(1 - B) up the magnitude's own bits, below it those of ab + 2^(1 - B) less
        // 2^(1 - B)'s and plus the base; the larger of the two is the form of the value's range
        const __m512i sub = _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(ab), limit)),
                                             _mm512_set1_epi32((int)(q8_bits(q8_mf_sub_limit(kSigned)) - base)));
        const __m512i fixed = _mm512_max_epi32(ab, sub);  // the fixed-point code plus `base`
        __mmask16 negative = 0;
        if (kSigned) negative = _mm512_movepi32_mask(u);
        __m512i add = _mm512_set1_epi32((int)kMfNearest);
        if (kMode != Q8_ROUND_NEAREST) {
            const __m512i r = _mm512_srli_epi32(bits, 32 - kMfFracBits);
            if (kMode == Q8_ROUND_BY_OLD_CODE) {
                const __m512i lo = _mm512_srli_epi32(fixed, kMfFracBits);  // the code below, plus base_code
                const __m512i old = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)old_bytes));
                // the old code's distance from zero on the value's side, plus base_code
                __m512i offset;
                if (kSigned)
                    offset = _mm512_mask_sub_epi32(_mm512_sub_epi32(old, _mm512_set1_epi32(127 - (int)base_code)), negative,
                                                   _mm512_set1_epi32(127 + (int)base_code), old);
                else
                    offset = _mm512_add_epi32(old, _mm512_set1_epi32((int)base_code));
                const __mmask16 draw = _mm512_cmple_epu32_mask(_mm512_sub_epi32(offset, lo), _mm512_set1_epi32(1));
                add = _mm512_mask_blend_epi32(draw, add, r);
            } else {
                add = r;
            }
        }
        const __m512i mag = _mm512_srli_epi32(_mm512_add_epi32(fixed, add), kMfFracBits);  // plus base_code
        if (kSigned)  // 127 + mag, or 127 - mag for a negative value (below 0 only past the top: saturated)
            return _mm512_mask_sub_epi32(_mm512_add_epi32(mag, _mm512_set1_epi32(127 - (int)base_code)), negative,
                                         _mm512_set1_epi32(127 + (int)base_code), mag);
        // a positive value takes at least code 1 (the zero point), a negative one 0 (a zero's code is 0 already)
        const __mmask16 positive = _mm512_cmpgt_epi32_mask(u, _mm512_setzero_si512());
        return _mm512_maskz_max_epu32(positive, _mm512_sub_epi32(mag, _mm512_set1_epi32((int)base_code)),
                                      _mm512_set1_epi32(1));
    }

    // The codes of one block's `len` values x (a scratch buffer of whole vectors) scaled by s =
    // q8_mf_scale(its maximum), finite; the old codes are those in `out`; random bits (key + index) * mul,
    // x[0]'s index in its parameter `first`: a Weyl sequence, each vector's the one before plus 16 * mul.
    template <bool kSigned, int kMode>
    __attribute__((always_inline)) static inline void mf_encode_block(uint8_t* out, const float* x, int len, float s,
                                                                     uint32_t key, uint32_t mul, uint32_t first) {
        const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512i step = _mm512_set1_epi32((int)(16u * mul));
        const __m512 vs = _mm512_set1_ps(s);
        __m512i bits = _mm512_mullo_epi32(_mm512_add_epi32(iota, _mm512_set1_epi32((int)(key + first))),
                                          _mm512_set1_epi32((int)mul));
        for (int i = 0; i < len; i += 64) {
            const int cnt = len - i;
            const __mmask64 live = cnt >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << cnt) - 1);
            alignas(16) uint8_t tail[64];  // the old codes of a last, partial chunk, read whole from here
            const uint8_t* old = out + i;
            if (kMode == Q8_ROUND_BY_OLD_CODE && cnt < 64) {
                _mm512_storeu_si512(tail, _mm512_maskz_loadu_epi8(live, out + i));
                old = tail;
            }
            __m512i c[4];
            for (int q = 0; q < 4; ++q) {
                const __m512 z = _mm512_mul_ps(_mm512_load_ps(x + i + 16 * q), vs);
                c[q] = mf_encode16<kSigned, kMode>(z, bits, old + 16 * q);
                bits = _mm512_add_epi32(bits, step);
            }
            _mm512_mask_storeu_epi8(out + i, live, pack_codes(c));
        }
    }

    // Four vectors of codes < 256 to 64 bytes in memory order (the packs work per 128-bit lane; the dword
    // permute undoes their interleaving).
    static __m512i pack_codes(const __m512i* idx) {
        const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        const __m512i w01 = _mm512_packus_epi32(idx[0], idx[1]), w23 = _mm512_packus_epi32(idx[2], idx[3]);
        return _mm512_permutexvar_epi32(order, _mm512_packus_epi16(w01, w23));
    }
};

}  // namespace
}  // namespace ds_q8
