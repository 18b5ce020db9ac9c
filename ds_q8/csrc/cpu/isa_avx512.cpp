// AVX-512 traits for the CPU driver (16 lanes, masked loads/stores for partial blocks): the loads,
// stores, dequantization and block maxima in q8_avx512_vectors.h, the requantization here.
// Needs AVX512-VBMI too: codes are dequantized 64 at a time with byte permutes instead of gathers,
// which are slow on some CPUs (about 1.2 cycles per element on AMD Zen 4).
// System headers come before the target pragma; the project's headers come after it and give their
// helpers internal linkage, so this file's AVX-512 copies never replace another file's.
#ifdef Q8_EMULATE_AVX512
#include "q8_avx512_emulation.h"  // tests only: SIMDe's AVX-512 on any AVX2 CPU
#else
#include <immintrin.h>
#endif
#include <math.h>
#include <stdint.h>
#include <string.h>

#ifndef Q8_EMULATE_AVX512
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,f16c")
#endif

#include "q8_avx512_minifloat.h"
#include "q8_avx512_vectors.h"
#include "q8_common.h"
#include "q8_cpu_blocks.h"  // Stochastic (this file writes its block functions itself)
#include "q8_fastmap.h"

namespace ds_q8 {
namespace {

struct Avx512 : Avx512Vectors, Avx512Minifloat {
    // 16 scaled values by the lookup table: one gather (q8_quantize_scaled without its NaN case).
    static __m512i lookup16(__m512 y, const uint32_t* lookup) {
        const __m512i u = _mm512_castps_si512(y);
        const __m512i key = _mm512_xor_si512(u, _mm512_or_si512(_mm512_srai_epi32(u, 31), _mm512_set1_epi32((int)0x80000000u)));
        __m512i hi = _mm512_srli_epi32(key, 16);
        hi = _mm512_min_epi32(_mm512_max_epi32(hi, _mm512_set1_epi32(kLookupLow)), _mm512_set1_epi32(kLookupHigh));
        const __m512i entry = _mm512_i32gather_epi32(hi, (const int*)lookup - kLookupLow, 4);
        return _mm512_srli_epi32(_mm512_add_epi32(entry, _mm512_and_si512(key, _mm512_set1_epi32(0xFFFF))), 16);
    }

    static __m512i lookup64(const float* x, __m512 vscale, const uint32_t* lookup) {
        __m512i idx[4];
        for (int q = 0; q < 4; ++q) idx[q] = lookup16(_mm512_mul_ps(_mm512_load_ps(x + 16 * q), vscale), lookup);
        return pack_bytes(idx);
    }

    // Four vectors of indices < 256 to 64 bytes in memory order (packs work per 128-bit lane; the
    // final dword permute undoes their interleaving).
    static __m512i pack_bytes(const __m512i* idx) {
        const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        __m512i w01 = _mm512_packus_epi32(idx[0], idx[1]), w23 = _mm512_packus_epi32(idx[2], idx[3]);
        return _mm512_permutexvar_epi32(order, _mm512_packus_epi16(w01, w23));
    }

    // The segment tables of q8_fastmap.h in registers.
    struct FastRegs {
        __m512 thr_lo, thr_hi, inv, c, hi;
        __m512i seg_lo, seg_hi;
    };
    static FastRegs load_fast(const FastMap& m) {
        return FastRegs{_mm512_load_ps(m.bin_thr), _mm512_load_ps(m.bin_thr + 16), _mm512_load_ps(m.seg_inv),
                        _mm512_load_ps(m.seg_c), _mm512_load_ps(m.seg_hi), _mm512_load_si512(m.bin_seg),
                        _mm512_load_si512(m.bin_seg + 16)};
    }

    // 64 scaled values by the segment search. Each step mirrors q8_fastmap_t2; a vector with an
    // ambiguous value goes through the lookup table instead (rare: a value within
    // kFastAmbiguous / 2 of a midpoint, in units of the code spacing).
    template <bool kSigned>
    static __m512i fast64(const float* x, __m512 vscale, const FastRegs& r, const uint32_t* lookup) {
        const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF), one = _mm512_set1_epi32(1);
        const __m512i low_binade = _mm512_set1_epi32(kFastBinadeLow);
        const __m512 band = _mm512_set1_ps(kFastAmbiguous);
        __m512i k[4];
        __mmask16 neg[4], amb[4], pos[4];
        for (int q = 0; q < 4; ++q) {
            const __m512 yf = _mm512_mul_ps(_mm512_load_ps(x + 16 * q), vscale);
            const __m512i y = _mm512_castps_si512(yf);
            neg[q] = _mm512_movepi32_mask(y);
            if (!kSigned) pos[q] = _mm512_cmpgt_epi32_mask(y, _mm512_setzero_si512());  // y > +0.0
            __m512i ab = _mm512_and_si512(y, abs_mask);
            if (kSigned) ab = _mm512_mask_add_epi32(ab, neg[q], ab, one);  // next float above |y|
            const __m512 a = _mm512_castsi512_ps(ab);
            const __m512i e = _mm512_max_epu32(_mm512_srli_epi32(ab, 23), low_binade);
            const __m512 thr = _mm512_permutex2var_ps(r.thr_lo, e, r.thr_hi);
            __m512i seg = _mm512_permutex2var_epi32(r.seg_lo, e, r.seg_hi);
            seg = _mm512_mask_add_epi32(seg, _mm512_cmp_ps_mask(a, thr, _CMP_GT_OQ), seg, one);
            __m512 t2 = _mm512_fmadd_ps(a, _mm512_permutexvar_ps(seg, r.inv), _mm512_permutexvar_ps(seg, r.c));
            t2 = _mm512_min_ps(t2, _mm512_permutexvar_ps(seg, r.hi));
            // reduce with imm 0x09: t2 - floor(t2), no precision exception
            amb[q] = _mm512_cmp_ps_mask(_mm512_reduce_ps(t2, 0x09), band, _CMP_LT_OQ);
            k[q] = _mm512_cvttps_epi32(t2);
        }
        const __m512i mag = pack_bytes(k);
        const __mmask64 negative = (__mmask64)neg[0] | ((__mmask64)neg[1] << 16) | ((__mmask64)neg[2] << 32) |
                                   ((__mmask64)neg[3] << 48);
        __m512i idx;
        if (kSigned) {
            const __m512i zero_code = _mm512_set1_epi8(127);
            idx = _mm512_mask_blend_epi8(negative, _mm512_adds_epu8(zero_code, mag), _mm512_subs_epu8(zero_code, mag));
        } else {
            // code 0 is for zeros only: a positive value takes at least code 1 (q8_quantize_fast)
            const __mmask64 positive = (__mmask64)pos[0] | ((__mmask64)pos[1] << 16) | ((__mmask64)pos[2] << 32) |
                                       ((__mmask64)pos[3] << 48);
            idx = _mm512_maskz_mov_epi8(~negative, mag);
            idx = _mm512_mask_max_epu8(idx, positive, idx, _mm512_set1_epi8(1));
        }
        if (_kor_mask16(_kor_mask16(amb[0], amb[1]), _kor_mask16(amb[2], amb[3]))) {
            __m512i exact[4];
            __mmask64 redo = 0;
            for (int q = 0; q < 4; ++q) {
                exact[q] = _mm512_setzero_si512();
                if (amb[q]) {
                    exact[q] = lookup16(_mm512_mul_ps(_mm512_load_ps(x + 16 * q), vscale), lookup);
                    redo |= (__mmask64)0xFFFF << (16 * q);
                }
            }
            idx = _mm512_mask_blend_epi8(redo, idx, pack_bytes(exact));
        }
        return idx;
    }

    // Blocks of bs values (a multiple of 64, or len itself), block j scaled by 1 / absmax[j]: the
    // nearest codes, turned into stochastically rounded ones in the same registers when `sr` is given.
    // With a finite absmax every scaled value is finite and within [-1, 1] (one rounding above 1 at
    // most), so the segment search or the table needs no clamp or NaN case; a block with a non-finite
    // absmax, or shorter than a multiple of 64 (the end of a tensor), goes 16 values at a time through
    // quantize() and is rounded stochastically from memory.
    static void requantize_blocks(uint8_t* out, const float* x, int len, const float* absmax, int bs,
                                  const uint32_t* lookup, const FastMap* fast, const Stochastic<Table>* sr) {
        if (fast && fast->is_signed) return requantize<1>(out, x, len, absmax, bs, lookup, fast, sr);
        if (fast) return requantize<0>(out, x, len, absmax, bs, lookup, fast, sr);
        requantize<-1>(out, x, len, absmax, bs, lookup, nullptr, sr);
    }

    // The blocks of one call: a tile of the step (its blocks) or one block of quantize().
    static constexpr int kMaxScales = (int)(4096 / Q8_MIN_BLOCK);

    // q8_block_scale of each block maximum, 16 at a time (one division instruction per 16 blocks).
    static void block_scales(const float* absmax, int count, float* out) {
        for (int j = 0; j < count; j += 16) {
            const __mmask16 m = mask(count - j);
            const __m512 a = _mm512_maskz_loadu_ps(m, absmax + j);
            const __mmask16 pos = _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_GT_OQ);
            _mm512_mask_storeu_ps(out + j, m, _mm512_maskz_div_ps(pos, _mm512_set1_ps(1.0f), a));
        }
    }

    // kSearch: 1 / 0 the segment search of a signed / unsigned map, -1 the lookup table. Two passes,
    // the nearest codes and then their stochastic rounding: one fused pass needs more than the 32
    // vector registers (the segment tables and the map's byte planes) and measured slower.
    // Guided by the old codes (sr->by_code), those the nearest codes overwrite are kept first.
    template <int kSearch>
    static void requantize(uint8_t* out, const float* x, int len, const float* absmax, int bs,
                           const uint32_t* lookup, const FastMap* fast, const Stochastic<Table>* sr) {
        const int nb = (len + bs - 1) / bs;
        alignas(64) float scales[kMaxScales];
        alignas(64) uint8_t old[Q8_MAX_BLOCK];  // a step's call covers one tile or one block, at most this
        const bool by_code = sr && sr->by_code;
        if (by_code) memcpy(old, out, (size_t)len);
        block_scales(absmax, nb, scales);
        nearest<kSearch>(out, x, len, absmax, scales, bs, lookup, fast);
        if (sr) round_stochastic(out, x, len, scales, bs, *sr, by_code ? old : nullptr);
    }

    template <int kSearch>
    static void nearest(uint8_t* out, const float* x, int len, const float* absmax, const float* scales, int bs,
                        const uint32_t* lookup, const FastMap* fast) {
        FastRegs r;
        if (kSearch >= 0) r = load_fast(*fast);
        for (int b0 = 0, j = 0; b0 < len; b0 += bs, ++j) {
            const int blen = len - b0 < bs ? len - b0 : bs;
            if (!(fabsf(absmax[j]) < INFINITY) || blen % 64) {
                for (int i = b0; i < b0 + blen; i += 16)
                    quantize(out + i, load_tmp(x + i), scales[j], lookup, b0 + blen - i < 16 ? b0 + blen - i : 16);
                continue;
            }
            const __m512 vscale = _mm512_set1_ps(scales[j]);
            for (int i = b0; i < b0 + blen; i += 64) {
                __m512i idx;
                if (kSearch == 1) idx = fast64<true>(x + i, vscale, r, lookup);
                else if (kSearch == 0) idx = fast64<false>(x + i, vscale, r, lookup);
                else idx = lookup64(x + i, vscale, lookup);
                _mm512_storeu_si512(out + i, idx);
            }
        }
    }

    // The nearest codes of x in `codes` turned into stochastically rounded ones, 64 at a time: guided by
    // the old codes (`old`) where they are given.
    static void round_stochastic(uint8_t* codes, const float* x, int len, const float* scales,
                                 int bs, const Stochastic<Table>& sr, const uint8_t* old) {
        const SrRegs g = sr_regs(sr);
        __m512 vscale = _mm512_setzero_ps();
        for (int i = 0, j = -1, next = 0; i < len; i += 64) {
            if (i >= next) {  // the next block starts here
                ++j, next += bs;
                vscale = _mm512_set1_ps(scales[j]);
            }
            const int cnt = len - i;
            const __mmask64 live = cnt >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << cnt) - 1);
            const __m512i n = _mm512_maskz_loadu_epi8(live, codes + i);
            const __m512i idx = old ? stochastic64<true>(n, x + i, vscale, sr, g, (uint32_t)i, _mm512_maskz_loadu_epi8(live, old + i))
                                    : stochastic64<false>(n, x + i, vscale, sr, g, (uint32_t)i, _mm512_setzero_si512());
            _mm512_mask_storeu_epi8(codes + i, live, idx);
        }
    }

    static __mmask64 join(const __mmask16* m) {
        return (__mmask64)m[0] | ((__mmask64)m[1] << 16) | ((__mmask64)m[2] << 32) | ((__mmask64)m[3] << 48);
    }

    // What stochastic64 keeps in registers across a call.
    struct SrRegs {
        __m512 unit;
        __m512i iota, vkey, vmul;
        bool unsigned_map;
    };
    static SrRegs sr_regs(const Stochastic<Table>& sr) {
        return SrRegs{_mm512_set1_ps(5.9604644775390625e-08f),
                      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                      _mm512_set1_epi32((int)sr.key), _mm512_set1_epi32((int)sr.mul), sr.code[0] == 0.0f};
    }

    static __m512i draw_bits(__m512i index, const SrRegs& g) {  // q8_state_bits on 16 lanes
        return _mm512_mullo_epi32(_mm512_add_epi32(index, g.vkey), g.vmul);
    }

    // q8_round_stochastic on 64 values x[0..64) (scaled by vscale) whose nearest codes are n, the
    // first of them element `at` of the call (its random bits: sr.first + at + lane); the map entries
    // around each come from the byte planes of the dequantization table (no gathers). Guided by the old
    // codes `old` (kByCode, q8_round_guided_code), the nearer of the two entries replaces the stochastic one
    // where the old code is neither entry.
    template <bool kByCode>
    static __m512i stochastic64(__m512i n, const float* x, __m512 vscale, const Stochastic<Table>& sr,
                                const SrRegs& g, uint32_t at, __m512i old) {
        const __m512 one_f = _mm512_set1_ps(1.0f);
        const __m512i ones8 = _mm512_set1_epi8(1);
        const Table& t = *sr.table;
        __m512 y[4], c[4];
        __mmask16 up[4];
        values64(c, n, t, one_f);
        for (int q = 0; q < 4; ++q) {
            y[q] = _mm512_mul_ps(_mm512_load_ps(x + 16 * q), vscale);
            up[q] = _mm512_cmp_ps_mask(y[q], c[q], _CMP_GE_OQ);
        }
        const __mmask64 up64 = join(up);
        const __m512i nb = _mm512_mask_blend_epi8(up64, _mm512_subs_epu8(n, ones8), _mm512_adds_epu8(n, ones8));
        __m512 cn[4];
        values64(cn, nb, t, one_f);
        const __m512i lo = _mm512_mask_blend_epi8(up64, nb, n), hi = _mm512_mask_blend_epi8(up64, n, nb);
        // by the code: the lanes that draw, whose old code is one of the two entries
        const __mmask64 draws = kByCode ? _mm512_cmpeq_epi8_mask(old, lo) | _mm512_cmpeq_epi8_mask(old, hi) : (__mmask64)0;
        __mmask16 pick[4], pos[4], nan[4];
        for (int q = 0; q < 4; ++q) {
            const __m512 c_lo = _mm512_mask_blend_ps(up[q], cn[q], c[q]);
            const __m512 c_hi = _mm512_mask_blend_ps(up[q], c[q], cn[q]);
            const __m512 gap = _mm512_sub_ps(c_hi, c_lo), above = _mm512_sub_ps(y[q], c_lo);
            const __m512i index = _mm512_add_epi32(_mm512_set1_epi32((int)(sr.first + at + (uint32_t)(16 * q))), g.iota);
            const __m512i r = draw_bits(index, g);
            __m512 u = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(r, 8)), g.unit);
            // by the code: the nearer entry's test is the draw's with 0.5 for u, so the lanes that keep
            // the nearer entry take 0.5 and one product serves both (0.5 * gap is gap * 0.5, exactly)
            if (kByCode) u = _mm512_mask_blend_ps((__mmask16)(draws >> (16 * q)), _mm512_set1_ps(0.5f), u);
            pick[q] = _mm512_cmp_ps_mask(_mm512_mul_ps(u, gap), above, _CMP_LT_OQ);
            pos[q] = _mm512_cmp_ps_mask(y[q], _mm512_setzero_ps(), _CMP_GT_OQ);
            nan[q] = _mm512_cmp_ps_mask(y[q], y[q], _CMP_UNORD_Q);
        }
        __m512i idx = _mm512_mask_blend_epi8(join(pick), lo, hi);
        if (g.unsigned_map) idx = _mm512_mask_max_epu8(idx, join(pos), idx, ones8);  // the zero point
        return _mm512_mask_mov_epi8(idx, join(nan), _mm512_set1_epi8((char)255));
    }

    static void quantize(uint8_t* out, V x, float scale, const uint32_t* lookup, int cnt) {
        const __m512 y = _mm512_mul_ps(x.v, _mm512_set1_ps(scale));
        __m512i idx = lookup16(y, lookup);
        idx = _mm512_mask_mov_epi32(idx, _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), _mm512_set1_epi32(255));
        _mm512_mask_cvtepi32_storeu_epi8(out, mask(cnt), idx);
    }
};

}  // namespace
}  // namespace ds_q8

#include "q8_cpu_driver.h"

Q8_DEFINE_ISA(avx512, Avx512)

#ifdef Q8_PROBES  // tests/csrc/q8_probe.cpp only
#define Q8_MF_PROBE_NAME mf_mismatches_avx512
#define Q8_MF_PROBE_TRAITS Avx512
#include "q8_mf_probe.h"
#undef Q8_MF_PROBE_NAME
#undef Q8_MF_PROBE_TRAITS
namespace ds_q8 {
// Every float in [-limit, limit] (every stride-th run of 64) through the segment search, against the lookup table.
int64_t fast_search_mismatches_avx512(const uint32_t* lookup, const FastMap& m, float limit, int64_t stride,
                                      int num_threads) {
    const uint32_t top = q8_bits(limit);
    const int64_t chunks = ((int64_t)top + 64) / 64;
    const Avx512::FastRegs r = Avx512::load_fast(m);
    const __m512 one = _mm512_set1_ps(1.0f);
    int64_t bad = 0;
#pragma omp parallel for num_threads(num_threads) schedule(static) reduction(+ : bad)
    for (int64_t c = 0; c < 2 * chunks; c += stride) {
        alignas(64) float y[64];
        alignas(64) uint8_t got[64];
        const uint32_t sign = c < chunks ? 0u : 0x80000000u;
        const int64_t first = (c % chunks) * 64;
        for (int i = 0; i < 64; ++i) {
            const int64_t b = first + i;
            y[i] = q8_float(sign | (uint32_t)(b > (int64_t)top ? top : b));
        }
        _mm512_store_si512(got, m.is_signed ? Avx512::fast64<true>(y, one, r, lookup)
                                            : Avx512::fast64<false>(y, one, r, lookup));
        for (int i = 0; i < 64; ++i) bad += got[i] != q8_quantize_scaled(y[i], lookup);
    }
    return bad;
}
}  // namespace ds_q8
#endif

#ifndef Q8_EMULATE_AVX512
#pragma GCC pop_options
#endif
