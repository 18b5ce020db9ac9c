// The minifloat maps' codec (q8_minifloat.h) on AVX2: 8 codes decoded from their bits per vector, and 32
// values coded per pass, with the integer addition that rounds them (to nearest, with random bits, or guided
// by the old codes) and no table. Included by isa_avx2.cpp only, after its target pragma; internal
// linkage, like every project header there.
#pragma once

#include <string.h>

#include "q8_common.h"
#include "q8_minifloat.h"
#include "q8_mf_blocks.h"

namespace ds_q8 {
namespace {

struct Avx2Minifloat : MinifloatBlocks<Avx2Minifloat> {
    // 8 codes (cnt of them read, the rest code 0) as their map entries times `absmax` (q8_mf_value).
    template <bool kSigned>
    __attribute__((always_inline)) static inline __m256 mf_decode8(const uint8_t* p, int cnt, __m256 absmax) {
        __m128i bytes;
        if (cnt >= 8) {
            bytes = _mm_loadl_epi64((const __m128i*)p);
        } else {
            uint8_t b[8] = {};
            memcpy(b, p, (size_t)(cnt > 0 ? cnt : 0));
            bytes = _mm_loadl_epi64((const __m128i*)b);
        }
        const __m256i c = _mm256_cvtepu8_epi32(bytes);
        if (!kSigned && _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(16), c))) == 0) {
            // every code has a nonzero exponent field (nearly all second moments): its bits plus the base
            const __m256 one = _mm256_castsi256_ps(
                _mm256_add_epi32(_mm256_slli_epi32(c, 19), _mm256_set1_epi32((int)q8_mf_base(false))));
            return _mm256_mul_ps(_mm256_mul_ps(one, _mm256_set1_ps(kMfInvTop)), absmax);
        }
        __m256i mag = c, d = c;
        if (kSigned) {
            d = _mm256_sub_epi32(c, _mm256_set1_epi32(127));
            mag = _mm256_abs_epi32(d);
        }
        const __m256 one = _mm256_castsi256_ps(
            _mm256_add_epi32(_mm256_slli_epi32(mag, 19), _mm256_set1_epi32((int)q8_mf_base(kSigned))));
        const __m256 sub = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(16), mag));
        // exponent field 0: (one - 2^-B) * 2 / 1.9375, else one / 1.9375, each one rounding
        const __m256 units = _mm256_sub_ps(one, _mm256_and_ps(sub, _mm256_set1_ps(q8_mf_sub_limit(kSigned) * 0.5f)));
        const __m256 inv = _mm256_blendv_ps(_mm256_set1_ps(kMfInvTop), _mm256_set1_ps(kMfInvTop * 2.0f), sub);
        __m256 v = _mm256_mul_ps(units, inv);
        if (kSigned)  // the sign of c - 127
            v = _mm256_or_ps(v, _mm256_castsi256_ps(_mm256_and_si256(d, _mm256_set1_epi32((int)0x80000000u))));
        return _mm256_mul_ps(v, absmax);
    }

    // A chunk of 32 codes (cnt of them read) into 4 vectors.
    template <class V>
    __attribute__((always_inline)) static inline void mf_dequant_chunk(V* out, const uint8_t* codes, int cnt, bool is_signed, float absmax) {
        const __m256 a = _mm256_set1_ps(absmax);
        for (int q = 0; q < 4 && 8 * q < cnt; ++q)
            out[q] = is_signed ? mf_decode8<true>(codes + 8 * q, cnt - 8 * q, a)
                               : mf_decode8<false>(codes + 8 * q, cnt - 8 * q, a);
    }

    // The codes of 8 values z (times q8_mf_scale already), finite, as int32 lanes (q8_mf_code) and not yet
    // clamped to a byte (pack_codes saturates): random bits `bits` (kMode not nearest), old codes as lanes
    // (guided).
    template <bool kSigned, int kMode>
    __attribute__((always_inline)) static inline __m256i mf_encode8(__m256 z, __m256i bits, __m256i old) {
        const __m256i u = _mm256_castps_si256(z);
        const __m256 limit = _mm256_set1_ps(q8_mf_sub_limit(kSigned));
        // An unsigned map's values of 2^(1 - B) and up (nearly every second moment): their bits less the base
        // are the fixed-point code, and they take neither the zero point nor the negative's 0.
        if (!kSigned && _mm256_movemask_ps(_mm256_cmp_ps(z, limit, _CMP_GE_OQ)) == 0xFF) {
            const __m256i fixed = _mm256_sub_epi32(u, _mm256_set1_epi32((int)q8_mf_base(false)));
            __m256i add = _mm256_set1_epi32((int)kMfNearest);
            if (kMode != Q8_ROUND_NEAREST) {
                const __m256i r = _mm256_srli_epi32(bits, 32 - kMfFracBits);
                if (kMode == Q8_ROUND_BY_OLD_CODE) {
                    const __m256i dist = _mm256_sub_epi32(old, _mm256_srli_epi32(fixed, kMfFracBits));
                    add = _mm256_blendv_epi8(add, r, _mm256_cmpeq_epi32(_mm256_min_epu32(dist, _mm256_set1_epi32(1)), dist));
                } else {
                    add = r;
                }
            }
            return _mm256_srli_epi32(_mm256_add_epi32(fixed, add), kMfFracBits);
        }
        const __m256i ab = _mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF));
        const __m256i negative = _mm256_srai_epi32(u, 31);  // all ones for a negative value
        // q8_mf_fixed: the larger of the normal and the subnormal forms is the one of the value's range
        const __m256i sub = _mm256_sub_epi32(_mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(ab), limit)),
                                             _mm256_castps_si256(limit));
        const __m256i fixed = _mm256_max_epi32(_mm256_sub_epi32(ab, _mm256_set1_epi32((int)q8_mf_base(kSigned))), sub);
        __m256i add = _mm256_set1_epi32((int)kMfNearest);
        if (kMode != Q8_ROUND_NEAREST) {
            const __m256i r = _mm256_srli_epi32(bits, 32 - kMfFracBits);
            if (kMode == Q8_ROUND_BY_OLD_CODE) {
                const __m256i lo = _mm256_srli_epi32(fixed, kMfFracBits);
                __m256i offset = old;
                if (kSigned)  // the old code's distance from zero on the value's side: negated where negative
                    offset = _mm256_sub_epi32(_mm256_xor_si256(_mm256_sub_epi32(old, _mm256_set1_epi32(127)), negative),
                                              negative);
                const __m256i dist = _mm256_sub_epi32(offset, lo);
                const __m256i draw = _mm256_cmpeq_epi32(_mm256_min_epu32(dist, _mm256_set1_epi32(1)), dist);
                add = _mm256_blendv_epi8(add, r, draw);
            } else {
                add = r;
            }
        }
        const __m256i mag = _mm256_srli_epi32(_mm256_add_epi32(fixed, add), kMfFracBits);
        if (kSigned)  // 127 + mag, or 127 - mag for a negative value (below 0 only past the top: saturated)
            return _mm256_add_epi32(_mm256_set1_epi32(127), _mm256_sub_epi32(_mm256_xor_si256(mag, negative), negative));
        const __m256i c = _mm256_andnot_si256(negative, mag);  // a negative value: 0
        const __m256i positive = _mm256_cmpgt_epi32(u, _mm256_setzero_si256());
        return _mm256_max_epu32(c, _mm256_and_si256(positive, _mm256_set1_epi32(1)));  // the zero point
    }

    // Four vectors of codes < 256 to 32 bytes in memory order.
    static __m256i pack_codes(const __m256i* c) {
        const __m256i w01 = _mm256_packus_epi32(c[0], c[1]), w23 = _mm256_packus_epi32(c[2], c[3]);
        const __m256i b = _mm256_packus_epi16(w01, w23);  // per 128-bit lane: 0 1 2 3 of each vector's halves
        return _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    }

    // The codes of one block's `len` values x (a scratch buffer of whole vectors) scaled by s =
    // q8_mf_scale(its maximum), finite; the old codes are those in `out`; random bits (key + index) * mul,
    // x[0]'s index in its parameter `first`: a Weyl sequence, each vector's the one before plus 8 * mul.
    template <bool kSigned, int kMode>
    __attribute__((always_inline)) static inline void mf_encode_block(uint8_t* out, const float* x, int len, float s,
                                                                     uint32_t key, uint32_t mul, uint32_t first) {
        const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i step = _mm256_set1_epi32((int)(8u * mul));
        const __m256 vs = _mm256_set1_ps(s);
        __m256i bits = _mm256_mullo_epi32(_mm256_add_epi32(iota, _mm256_set1_epi32((int)(key + first))),
                                          _mm256_set1_epi32((int)mul));
        for (int i = 0; i < len; i += 32) {
            const int cnt = len - i < 32 ? len - i : 32;
            alignas(32) uint8_t old_bytes[32];
            const uint8_t* old = out + i;
            if (kMode == Q8_ROUND_BY_OLD_CODE && cnt < 32) {
                memcpy(old_bytes, out + i, (size_t)cnt);
                old = old_bytes;
            }
            __m256i c[4];
            for (int q = 0; q < 4; ++q) {
                const __m256 z = _mm256_mul_ps(_mm256_load_ps(x + i + 8 * q), vs);
                const __m256i o = kMode == Q8_ROUND_BY_OLD_CODE
                                      ? _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(old + 8 * q)))
                                      : _mm256_setzero_si256();
                c[q] = mf_encode8<kSigned, kMode>(z, bits, o);
                bits = _mm256_add_epi32(bits, step);
            }
            const __m256i bytes = pack_codes(c);
            if (cnt == 32) {
                _mm256_storeu_si256((__m256i*)(out + i), bytes);
            } else {
                alignas(32) uint8_t b[32];
                _mm256_store_si256((__m256i*)b, bytes);
                memcpy(out + i, b, (size_t)cnt);
            }
        }
    }
};

}  // namespace
}  // namespace ds_q8
