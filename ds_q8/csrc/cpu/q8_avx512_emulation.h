// The AVX-512 intrinsics of isa_avx512.cpp on a CPU without AVX-512, for tests only: built with
// DS_Q8_EMULATE_AVX512=1 (ds_q8/op_builder/cpu.py), isa_avx512.cpp includes this header instead of
// <immintrin.h> and its target pragma, and the op then offers "avx512" on any x86-64 CPU with AVX2. SIMDe
// (https://github.com/simd-everywhere/simde, headers only: apt install libsimde-dev) implements most of
// them lane by lane; below, plain loops for those its 0.7.4 release lacks. Each follows the instruction's
// definition in Intel's reference (masked loads read only the lanes their mask names).
#pragma once

#define SIMDE_ENABLE_NATIVE_ALIASES
#include <math.h>
#include <simde/x86/avx512.h>
#include <simde/x86/f16c.h>
#include <stdint.h>
#include <string.h>

// the mask types, which SIMDe names simde__mmask* without aliases
#define __mmask16 simde__mmask16
#define __mmask64 simde__mmask64
#ifndef _MM_FROUND_NO_EXC
#define _MM_FROUND_NO_EXC SIMDE_MM_FROUND_NO_EXC
#endif

namespace q8_emulated {

template <class V, class L>
inline V from_lanes(const L* lanes) {
    V v;
    memcpy(&v, lanes, sizeof(v));
    return v;
}

template <class L, int N, class V>
inline void to_lanes(const V& v, L (&lanes)[N]) {
    static_assert(sizeof(L) * N == sizeof(V), "lane count");
    memcpy(lanes, &v, sizeof(v));
}

template <class L, int N, class Mask>
inline void masked_store(void* p, Mask m, const L (&lanes)[N]) {
    for (int i = 0; i < N; ++i)
        if ((m >> i) & 1) memcpy(static_cast<char*>(p) + i * sizeof(L), &lanes[i], sizeof(L));
}

template <class V, class L, int N, class Mask>
inline V masked_load(Mask m, const void* p) {
    L lanes[N];
    for (int i = 0; i < N; ++i) {
        lanes[i] = L(0);
        if ((m >> i) & 1) memcpy(&lanes[i], static_cast<const char*>(p) + i * sizeof(L), sizeof(L));
    }
    return from_lanes<V>(lanes);
}

inline simde__m512i srai_epi32(simde__m512i a, int imm) {
    int32_t l[16];
    to_lanes(a, l);
    for (int i = 0; i < 16; ++i) l[i] = imm > 31 ? (l[i] < 0 ? -1 : 0) : l[i] >> imm;
    return from_lanes<simde__m512i>(l);
}

inline simde__m512 cvtepi32_ps(simde__m512i a) {
    int32_t l[16];
    float f[16];
    to_lanes(a, l);
    for (int i = 0; i < 16; ++i) f[i] = (float)l[i];  // round to nearest even, as the instruction by default
    return from_lanes<simde__m512>(f);
}

inline simde__m512i cvttps_epi32(simde__m512 a) {
    float f[16];
    int32_t l[16];
    to_lanes(a, f);
    for (int i = 0; i < 16; ++i)  // NaN and values out of range give the integer indefinite, INT32_MIN
        l[i] = (f[i] >= -2147483648.0f && f[i] < 2147483648.0f) ? (int32_t)f[i] : INT32_MIN;
    return from_lanes<simde__m512i>(l);
}

inline simde__m256i cvtepi32_epi16(simde__m512i a) {
    int32_t l[16];
    int16_t h[16];
    to_lanes(a, l);
    for (int i = 0; i < 16; ++i) h[i] = (int16_t)(uint16_t)(uint32_t)l[i];
    return from_lanes<simde__m256i>(h);
}

// 16 unsigned lanes of type U, zero-extended to 32 bits
template <class U, class V>
inline simde__m512i widen_epu32(const V& a) {
    U narrow[16];
    int32_t l[16];
    to_lanes(a, narrow);
    for (int i = 0; i < 16; ++i) l[i] = narrow[i];
    return from_lanes<simde__m512i>(l);
}

inline simde__m512i cvtepu8_epi32(simde__m128i a) { return widen_epu32<uint8_t>(a); }
inline simde__m512i cvtepu16_epi32(simde__m256i a) { return widen_epu32<uint16_t>(a); }

// float16 <-> float32 through the F16C instructions every AVX2 CPU of the op has, 8 lanes at a time
inline simde__m512 cvtph_ps(simde__m256i a) {
    uint16_t h[16];
    float f[16];
    to_lanes(a, h);
    for (int half = 0; half < 2; ++half)
        simde_mm256_storeu_ps(f + 8 * half, simde_mm256_cvtph_ps(simde_mm_loadu_si128(h + 8 * half)));
    return from_lanes<simde__m512>(f);
}

inline simde__m512i i32gather_epi32(simde__m512i idx, const void* base, int scale) {
    int32_t l[16], out[16];
    to_lanes(idx, l);
    for (int i = 0; i < 16; ++i) memcpy(&out[i], static_cast<const char*>(base) + (int64_t)l[i] * scale, 4);
    return from_lanes<simde__m512i>(out);
}

inline void mask_cvtepi32_storeu_epi8(void* p, simde__mmask16 m, simde__m512i a) {
    int32_t l[16];
    int8_t b[16];
    to_lanes(a, l);
    for (int i = 0; i < 16; ++i) b[i] = (int8_t)(uint8_t)(uint32_t)l[i];
    masked_store(p, m, b);
}

inline uint32_t reduce_max_epu32(simde__m512i a) {
    uint32_t l[16], m = 0;
    to_lanes(a, l);
    for (int i = 0; i < 16; ++i) m = l[i] > m ? l[i] : m;
    return m;
}

// VREDUCEPS: x - round(x * 2^M) / 2^M, M = imm >> 4, the rounding imm & 3 (nearest even, down, up, toward
// zero); imm bit 2 (the MXCSR's mode) is not used by the op
inline simde__m512 reduce_ps(simde__m512 a, int imm) {
    float f[16];
    to_lanes(a, f);
    const float scale = ldexpf(1.0f, imm >> 4);
    for (int i = 0; i < 16; ++i) {
        const float s = f[i] * scale;
        float r;
        switch (imm & 3) {
            case 0: r = nearbyintf(s); break;
            case 1: r = floorf(s); break;
            case 2: r = ceilf(s); break;
            default: r = truncf(s); break;
        }
        f[i] = f[i] - r / scale;
    }
    return from_lanes<simde__m512>(f);
}

// VFMSUB with a merge mask: a * b - c rounded once where m is set, a elsewhere (fmaf rounds once, as the
// instruction does)
inline simde__m512 mask_fmsub_ps(simde__m512 a, simde__mmask16 m, simde__m512 b, simde__m512 c) {
    float fa[16], fb[16], fc[16];
    to_lanes(a, fa);
    to_lanes(b, fb);
    to_lanes(c, fc);
    for (int i = 0; i < 16; ++i)
        if ((m >> i) & 1) fa[i] = fmaf(fa[i], fb[i], -fc[i]);
    return from_lanes<simde__m512>(fa);
}

template <int kImm>
inline simde__m256i cvtps_ph(simde__m512 a) {
    float f[16];
    uint16_t h[16];
    to_lanes(a, f);
    for (int half = 0; half < 2; ++half)
        simde_mm_storeu_si128(h + 8 * half, simde_mm256_cvtps_ph(simde_mm256_loadu_ps(f + 8 * half), kImm));
    return from_lanes<simde__m256i>(h);
}

}  // namespace q8_emulated

#define _kor_mask16(a, b) ((simde__mmask16)((a) | (b)))
#define _mm512_srai_epi32(a, imm) q8_emulated::srai_epi32((a), (imm))
#define _mm512_cvtepi32_ps(a) q8_emulated::cvtepi32_ps(a)
#define _mm512_cvttps_epi32(a) q8_emulated::cvttps_epi32(a)
#define _mm512_cvtepi32_epi16(a) q8_emulated::cvtepi32_epi16(a)
#define _mm512_cvtepu8_epi32(a) q8_emulated::cvtepu8_epi32(a)
#define _mm512_cvtepu16_epi32(a) q8_emulated::cvtepu16_epi32(a)
#define _mm512_cvtph_ps(a) q8_emulated::cvtph_ps(a)
#define _mm512_cvtps_ph(a, imm) q8_emulated::cvtps_ph<(imm)>(a)
#define _mm512_i32gather_epi32(idx, base, scale) q8_emulated::i32gather_epi32((idx), (base), (scale))
#define _mm512_mask_cvtepi32_storeu_epi8(p, m, a) q8_emulated::mask_cvtepi32_storeu_epi8((p), (m), (a))
#define _mm512_reduce_max_epu32(a) q8_emulated::reduce_max_epu32(a)
#define _mm512_reduce_ps(a, imm) q8_emulated::reduce_ps((a), (imm))
#define _mm512_mask_fmsub_ps(a, m, b, c) q8_emulated::mask_fmsub_ps((a), (m), (b), (c))
#define _mm512_shuffle_i64x2(a, b, imm) simde_mm512_shuffle_i64x2((a), (b), (imm))
#define _mm512_maskz_loadu_ps(m, p) (q8_emulated::masked_load<simde__m512, float, 16>((m), (p)))
#define _mm512_maskz_loadu_epi8(m, p) (q8_emulated::masked_load<simde__m512i, int8_t, 64>((m), (p)))
#define _mm_maskz_loadu_epi8(m, p) (q8_emulated::masked_load<simde__m128i, int8_t, 16>((m), (p)))
#define _mm256_maskz_loadu_epi16(m, p) (q8_emulated::masked_load<simde__m256i, int16_t, 16>((m), (p)))
// a masked store of lanes of type L, N of them
#define Q8_EMULATED_STORE(L, N, p, m, a)                \
    do {                                                \
        L q8_lanes_[N];                                 \
        q8_emulated::to_lanes((a), q8_lanes_);          \
        q8_emulated::masked_store((p), (m), q8_lanes_); \
    } while (0)
#define _mm512_mask_storeu_ps(p, m, a) Q8_EMULATED_STORE(float, 16, p, m, a)
#define _mm512_mask_storeu_epi8(p, m, a) Q8_EMULATED_STORE(int8_t, 64, p, m, a)
#define _mm256_mask_storeu_epi16(p, m, a) Q8_EMULATED_STORE(int16_t, 16, p, m, a)
