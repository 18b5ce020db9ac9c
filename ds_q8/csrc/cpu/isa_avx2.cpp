// AVX2 traits for the CPU driver (8 lanes; partial vectors go through a small zeroed buffer).
// Every header that defines inline code is included before the target pragma, so that only
// this file's own functions are compiled for AVX2.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#pragma GCC push_options
#pragma GCC target("avx2,f16c")

#include "q8_common.h"
#include "q8_cpu_blocks.h"
#include "q8_floormap.h"
#include "q8_avx2_minifloat.h"

namespace ds_q8 {
namespace {

struct V256 {
    __m256 v;
    V256() = default;
    V256(__m256 x) : v(x) {}
    V256(float s) : v(_mm256_set1_ps(s)) {}
};
inline V256 operator+(V256 a, V256 b) { return _mm256_add_ps(a.v, b.v); }
inline V256 operator-(V256 a, V256 b) { return _mm256_sub_ps(a.v, b.v); }
inline V256 operator*(V256 a, V256 b) { return _mm256_mul_ps(a.v, b.v); }
inline V256 operator/(V256 a, V256 b) { return _mm256_div_ps(a.v, b.v); }
inline V256 q8_sqrt(V256 a) { return _mm256_sqrt_ps(a.v); }
inline V256 q8_sign(V256 a) {  // torch.sign: +0 for +-0 and NaN (ordered compares are false)
    const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f);
    __m256 pos = _mm256_and_ps(_mm256_cmp_ps(zero, a.v, _CMP_LT_OQ), one);
    __m256 neg = _mm256_and_ps(_mm256_cmp_ps(a.v, zero, _CMP_LT_OQ), one);
    return _mm256_sub_ps(pos, neg);
}

struct Avx2 : PerVectorBlocks<Avx2>, Avx2Minifloat {
    static constexpr int W = 8;
    static constexpr int kChunk = 4 * W;  // the step's unit: its per-chunk bookkeeping paid once per 32 values
    using V = V256;

    // Full vectors read/write memory directly; a partial one is staged through `buf`.
    template <class T>
    static const T* staged_in(const T* p, int cnt, T* buf) {
        if (cnt == W) return p;
        memset(buf, 0, sizeof(T) * W);
        memcpy(buf, p, sizeof(T) * cnt);
        return buf;
    }

    static V from_words(__m128i w) {  // 8 bf16 values -> float
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(w), 16));
    }

    static V load(const float* p, int cnt) { float b[8]; return _mm256_loadu_ps(staged_in(p, cnt, b)); }
    static V load(const q8_half* p, int cnt) {
        q8_half b[8];
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)staged_in(p, cnt, b)));
    }
    static V load(const q8_bf16* p, int cnt) {
        q8_bf16 b[8];
        return from_words(_mm_loadu_si128((const __m128i*)staged_in(p, cnt, b)));
    }

    template <class T>
    static void finish(T* p, const T* staged, int cnt) { memcpy(p, staged, sizeof(T) * cnt); }

    static void store(float* p, V v, int cnt) {
        if (cnt == W) { _mm256_storeu_ps(p, v.v); return; }
        float b[8];
        _mm256_storeu_ps(b, v.v);
        finish(p, b, cnt);
    }
    static void store_words(uint16_t* p, __m128i w, int cnt) {
        if (cnt == W) { _mm_storeu_si128((__m128i*)p, w); return; }
        uint16_t b[8];
        _mm_storeu_si128((__m128i*)b, w);
        finish(p, b, cnt);
    }
    static void store(q8_half* p, V v, int cnt) {
        store_words((uint16_t*)p, _mm256_cvtps_ph(v.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), cnt);
    }
    static void store(q8_bf16* p, V v, int cnt) {
        __m256i u = _mm256_castps_si256(v.v);
        __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
        __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v.v, v.v, _CMP_UNORD_Q));
        r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
        __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
        store_words((uint16_t*)p, _mm256_castsi256_si128(packed), cnt);
    }

    static V load_tmp(const float* p) { return _mm256_load_ps(p); }
    static void store_tmp(float* p, V v) { _mm256_store_ps(p, v.v); }

    static __m256 lanes_below(int cnt) {
        __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(cnt), iota));
    }

    // Table reads. On AMD's Zen cores (AVX2 without AVX-512) a gather instruction is microcoded and
    // slower than the scalar loads it stands for (8 floats from a 256-entry map: 0.46 against 0.27 ns
    // a value on Zen 3), so the tables are read one value at a time and the vectors assembled.
    static __m256 read8(const float* table, uint64_t w) {  // table[byte k of w], k = 0..7
        const __m128 a = _mm_setr_ps(table[w & 255], table[(w >> 8) & 255], table[(w >> 16) & 255], table[(w >> 24) & 255]);
        const __m128 b = _mm_setr_ps(table[(w >> 32) & 255], table[(w >> 40) & 255], table[(w >> 48) & 255], table[w >> 56]);
        return _mm256_set_m128(b, a);
    }
    static __m256i read8(const uint32_t* table, __m256i idx) {  // table[idx[k]], k = 0..7
        const __m128i l = _mm256_castsi256_si128(idx), h = _mm256_extracti128_si256(idx, 1);
        const uint64_t l0 = (uint64_t)_mm_cvtsi128_si64(l), l1 = (uint64_t)_mm_extract_epi64(l, 1);
        const uint64_t h0 = (uint64_t)_mm_cvtsi128_si64(h), h1 = (uint64_t)_mm_extract_epi64(h, 1);
        return _mm256_setr_epi32((int)table[(uint32_t)l0], (int)table[l0 >> 32], (int)table[(uint32_t)l1], (int)table[l1 >> 32],
                                 (int)table[(uint32_t)h0], (int)table[h0 >> 32], (int)table[(uint32_t)h1], (int)table[h1 >> 32]);
    }
    static V dequant(const uint8_t* c, int cnt, const float* code, float absmax) {
        uint8_t b[8];
        uint64_t w;
        memcpy(&w, staged_in(c, cnt, b), 8);
        return _mm256_mul_ps(read8(code, w), _mm256_set1_ps(absmax));
    }

    static V absmax_init() { return _mm256_setzero_ps(); }
    // The running max of |x| as integers: the bits of non-negative floats order as their values, with
    // every NaN above infinity, so a NaN stays (absmax_reduce then gives NaN). Lanes >= cnt count as 0.
    static V absmax_step(V acc, V x, int cnt) {
        __m256i a = _mm256_and_si256(_mm256_castps_si256(x.v), _mm256_set1_epi32(0x7FFFFFFF));
        if (cnt < W) a = _mm256_and_si256(a, _mm256_castps_si256(lanes_below(cnt)));
        return _mm256_castsi256_ps(_mm256_max_epi32(_mm256_castps_si256(acc.v), a));
    }
    static float absmax_reduce(V acc) {
        float b[8];
        _mm256_storeu_ps(b, acc.v);
        float m = 0.0f;
        for (int i = 0; i < 8; ++i) m = q8_absmax_step(m, b[i]);
        return m;
    }

    // absmax_reduce of `count` accumulators, 8 at a time by a tree (each holds the bits of |x|, NaN above
    // every number): three levels of pairwise maxima that halve the lanes per accumulator and double the
    // accumulators per vector, then one permute back to order.
    static void absmax_reduce_many(const V* acc, int count, float* out) {
        for (int b = 0; b < count; b += 8) {
            __m256i v[8];
            for (int i = 0; i < 8; ++i) v[i] = b + i < count ? _mm256_castps_si256(acc[b + i].v) : _mm256_setzero_si256();
            __m256i w[4], x[2];
            for (int i = 0; i < 4; ++i)  // 128-bit halves: accumulator 2i in the low lane, 2i+1 in the high
                w[i] = _mm256_max_epi32(_mm256_permute2x128_si256(v[2 * i], v[2 * i + 1], 0x20),
                                        _mm256_permute2x128_si256(v[2 * i], v[2 * i + 1], 0x31));
            for (int i = 0; i < 2; ++i)  // two values of each of four accumulators
                x[i] = _mm256_max_epi32(_mm256_unpacklo_epi64(w[2 * i], w[2 * i + 1]),
                                        _mm256_unpackhi_epi64(w[2 * i], w[2 * i + 1]));
            const __m256 lo = _mm256_shuffle_ps(_mm256_castsi256_ps(x[0]), _mm256_castsi256_ps(x[1]), _MM_SHUFFLE(2, 0, 2, 0));
            const __m256 hi = _mm256_shuffle_ps(_mm256_castsi256_ps(x[0]), _mm256_castsi256_ps(x[1]), _MM_SHUFFLE(3, 1, 3, 1));
            __m256i z = _mm256_max_epi32(_mm256_castps_si256(lo), _mm256_castps_si256(hi));
            // lane j holds accumulator {0, 2, 4, 6, 1, 3, 5, 7}[j]: back to order
            z = _mm256_permutevar8x32_epi32(z, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            alignas(32) uint32_t bits[8];
            _mm256_store_si256((__m256i*)bits, z);
            for (int i = 0; i < 8 && b + i < count; ++i) out[b + i] = bits[i] > 0x7F800000u ? NAN : q8_float(bits[i]);
        }
    }

    // The low byte of each of 8 int32 lanes to out[0..cnt).
    static void store_bytes(uint8_t* out, __m256i idx, int cnt) {
        // byte 0 of each int32 -> the low 4 bytes of each 128-bit lane -> bytes 0..7
        const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                              0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
        __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(idx, pick), _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0));
        uint8_t b[8];
        _mm_storel_epi64((__m128i*)(cnt == W ? out : b), _mm256_castsi256_si128(bytes));
        if (cnt != W) finish(out, b, cnt);
    }

    static __m256i draw_bits(__m256i index, __m256i key, __m256i mul) {  // q8_state_bits on 8 lanes
        return _mm256_mullo_epi32(_mm256_add_epi32(index, key), mul);
    }

    // q8_round_stochastic's choice for 8 values between entries c_lo <= y and c_hi: the upper one where
    // u * (c_hi - c_lo) < y - c_lo, u from the top 24 bits of the hash r; then the unsigned map's zero
    // point (a positive value never takes code 0; zero_point false where the floor tables fold it in)
    // and NaN to the top code.
    static __m256i pick_entry(__m256 y, __m256 c_lo, __m256 c_hi, __m256i lo, __m256i hi, __m256i r, bool zero_point) {
        const __m256 u = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(r, 8)), _mm256_set1_ps(5.9604644775390625e-08f));
        const __m256 pick = _mm256_cmp_ps(_mm256_mul_ps(u, _mm256_sub_ps(c_hi, c_lo)), _mm256_sub_ps(y, c_lo), _CMP_LT_OQ);
        return picked<false, false>(y, lo, hi, pick, zero_point);
    }

    // The index a choice gives: hi where go_up, else lo (kNext: hi is lo + 1 from the floor tables, so lo
    // minus the all-ones mask); then the unsigned map's zero point where it applies and NaN to the top
    // code (kFinite: the block's maximum is finite, so no value is NaN).
    template <bool kFinite, bool kNext>
    static __m256i picked(__m256 y, __m256i lo, __m256i hi, __m256 go_up, bool zero_point) {
        __m256i idx = kNext ? _mm256_sub_epi32(lo, _mm256_castps_si256(go_up))
                            : _mm256_blendv_epi8(lo, hi, _mm256_castps_si256(go_up));
        if (zero_point)
            idx = _mm256_max_epi32(idx, _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(y, _mm256_setzero_ps(), _CMP_GT_OQ)),
                                                         _mm256_set1_epi32(1)));
        return kFinite ? idx : nan_to_top(idx, y);
    }

    // q8_round_stochastic on 8 values at a time (guided by the old codes where old is given): the two map
    // entries around each by gathers.
    static void round_block_stochastic(uint8_t* codes, const float* x, int len, float absmax, Table,
                                       const float* code, uint32_t key, uint32_t mul, uint32_t first, const uint8_t* old) {
        const __m256 vscale = _mm256_set1_ps(q8_block_scale(absmax));
        const __m256i one = _mm256_set1_epi32(1), top = _mm256_set1_epi32(255), zero = _mm256_setzero_si256();
        const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const bool unsigned_map = code[0] == 0.0f;
        for (int i = 0; i < len; i += W) {
            const int cnt = len - i < W ? len - i : W;
            uint8_t b[8];
            const __m256i n = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)staged_in(codes + i, cnt, b)));
            const __m256 y = _mm256_mul_ps(_mm256_load_ps(x + i), vscale);
            const __m256 c = _mm256_i32gather_ps(code, n, 4);
            const __m256i up = _mm256_castps_si256(_mm256_cmp_ps(y, c, _CMP_GE_OQ));
            const __m256i nb = _mm256_blendv_epi8(_mm256_max_epi32(_mm256_sub_epi32(n, one), zero),
                                                  _mm256_min_epi32(_mm256_add_epi32(n, one), top), up);
            const __m256 cn = _mm256_i32gather_ps(code, nb, 4);
            const __m256i lo = _mm256_blendv_epi8(nb, n, up), hi = _mm256_blendv_epi8(n, nb, up);
            const __m256 c_lo = _mm256_blendv_ps(cn, c, _mm256_castsi256_ps(up));
            const __m256 c_hi = _mm256_blendv_ps(c, cn, _mm256_castsi256_ps(up));
            const __m256i index = _mm256_add_epi32(_mm256_set1_epi32((int)(first + (uint32_t)i)), iota);
            const __m256i r = draw_bits(index, _mm256_set1_epi32((int)key), _mm256_set1_epi32((int)mul));
            const __m256i idx = old ? pick_by_code(y, c_lo, c_hi, lo, hi, load_codes(old + i, cnt), r, unsigned_map)
                                    : pick_entry(y, c_lo, c_hi, lo, hi, r, unsigned_map);
            store_bytes(codes + i, idx, cnt);
        }
    }

    // The lookup tables' key of 8 floats (their bits with the sign folded, so that unsigned order is
    // float order) and its bucket (the top 16 bits clamped to the tables' range, counted from 0).
    static __m256i lookup_key(__m256 y) {
        const __m256i u = _mm256_castps_si256(y);
        return _mm256_xor_si256(u, _mm256_or_si256(_mm256_srai_epi32(u, 31), _mm256_set1_epi32((int)0x80000000u)));
    }
    static __m256i lookup_bucket(__m256i key) {
        const __m256i hi = _mm256_srli_epi32(key, 16);
        return _mm256_sub_epi32(_mm256_min_epi32(_mm256_max_epi32(hi, _mm256_set1_epi32(kLookupLow)), _mm256_set1_epi32(kLookupHigh)),
                                _mm256_set1_epi32(kLookupLow));
    }
    // (entry + low16(key)) >> 16: a bucket's count entry plus the key's low half carries into the count
    // of thresholds at or below the value.
    static __m256i bucket_count(__m256i entry, __m256i key) {
        return _mm256_srli_epi32(_mm256_add_epi32(entry, _mm256_and_si256(key, _mm256_set1_epi32(0xFFFF))), 16);
    }

    // The nearest codes of 8 scaled values by a q8_build_lookup table.
    static __m256i lookup_count(__m256 y, const uint32_t* lookup) {
        const __m256i key = lookup_key(y);
        return bucket_count(read8(lookup, lookup_bucket(key)), key);
    }

    static __m256i nan_to_top(__m256i idx, __m256 y) {
        return _mm256_blendv_epi8(idx, _mm256_set1_epi32(255), _mm256_castps_si256(_mm256_cmp_ps(y, y, _CMP_UNORD_Q)));
    }

    static void quantize(uint8_t* out, V x, float scale, const uint32_t* lookup, int cnt) {
        const __m256 y = _mm256_mul_ps(x.v, _mm256_set1_ps(scale));
        store_bytes(out, nan_to_top(lookup_count(y, lookup), y), cnt);
    }

    // Requantization guided by the old codes (q8_round_guided_code) of 8 values between entries lo
    // (c_lo) and hi (c_hi): the stochastic choice where the old code is lo or hi, else the nearer entry;
    // the unsigned map's zero point and NaN to the top code, as pick_entry.
    // The threshold of each lane is u where it draws and 1/2 (the nearer entry) where it does not.
    template <bool kFinite = false, bool kNext = false>
    static __m256i pick_by_code(__m256 y, __m256 c_lo, __m256 c_hi, __m256i lo, __m256i hi, __m256i old, __m256i r,
                                bool zero_point) {
        const __m256 gap = _mm256_sub_ps(c_hi, c_lo), above = _mm256_sub_ps(y, c_lo);
        const __m256 u = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(r, 8)), _mm256_set1_ps(5.9604644775390625e-08f));
        const __m256 draw = _mm256_castsi256_ps(_mm256_or_si256(_mm256_cmpeq_epi32(old, lo), _mm256_cmpeq_epi32(old, hi)));
        const __m256 go_up = _mm256_cmp_ps(_mm256_mul_ps(_mm256_blendv_ps(_mm256_set1_ps(0.5f), u, draw), gap), above,
                                           _CMP_LT_OQ);
        return picked<kFinite, kNext>(y, lo, hi, go_up, zero_point);
    }

    // 8 codes as int32 lanes (lanes >= cnt read as 0).
    static __m256i load_codes(const uint8_t* c, int cnt) {
        uint8_t b[8];
        return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)staged_in(c, cnt, b)));
    }

    // The floor index F (at most 254) of 8 scaled values and entries F and F + 1, by the floor tables
    // (q8_floormap.h): one row each, read whole and transposed.
    static void floor_pair(__m256 y, const FloorMap& fm, __m256i& lo, __m256& c_lo, __m256& c_hi) {
        const __m256i key = lookup_key(y), hi = lookup_bucket(key);
        const __m128i hl = _mm256_castsi256_si128(hi), hh = _mm256_extracti128_si256(hi, 1);
        const uint64_t l0 = (uint64_t)_mm_cvtsi128_si64(hl), l1 = (uint64_t)_mm_extract_epi64(hl, 1);
        const uint64_t h0 = (uint64_t)_mm_cvtsi128_si64(hh), h1 = (uint64_t)_mm_extract_epi64(hh, 1);
        const float* rows = (const float*)&fm.row[0];
        auto row = [rows](uint64_t i) { return _mm_loadu_ps(rows + 4 * i); };
        // rows of values k and k + 4 side by side, then a 4x4 transpose within each half
        const __m256 v0 = _mm256_insertf128_ps(_mm256_castps128_ps256(row((uint32_t)l0)), row((uint32_t)h0), 1);
        const __m256 v1 = _mm256_insertf128_ps(_mm256_castps128_ps256(row(l0 >> 32)), row(h0 >> 32), 1);
        const __m256 v2 = _mm256_insertf128_ps(_mm256_castps128_ps256(row((uint32_t)l1)), row((uint32_t)h1), 1);
        const __m256 v3 = _mm256_insertf128_ps(_mm256_castps128_ps256(row(l1 >> 32)), row(h1 >> 32), 1);
        const __m256 t0 = _mm256_unpacklo_ps(v0, v1), t1 = _mm256_unpackhi_ps(v0, v1);
        const __m256 t2 = _mm256_unpacklo_ps(v2, v3), t3 = _mm256_unpackhi_ps(v2, v3);
        const __m256i entry = _mm256_castps_si256(_mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0)));
        const __m256 c0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
        const __m256 c1 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
        const __m256 c2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
        lo = bucket_count(entry, key);
        const __m256 carry = _mm256_castsi256_ps(_mm256_cmpgt_epi32(lo, _mm256_srli_epi32(entry, 16)));
        c_lo = _mm256_blendv_ps(c0, c1, carry);
        c_hi = _mm256_blendv_ps(c1, c2, carry);
    }

    // Blocks of bs values, block j scaled by 1 / absmax[j]. Stochastic (or guided) requantization with
    // floor tables takes one pass and no nearest codes, and no zero point step (the tables fold it in);
    // otherwise the shared two passes (the nearest codes, then round_block_stochastic).
    static void requantize_blocks(uint8_t* out, const float* x, int len, const float* absmax, int bs,
                                  const uint32_t* lookup, const FastMap* fast, const Stochastic<Table>* sr) {
        if (!sr || !sr->floor) {
            PerVectorBlocks<Avx2>::requantize_blocks(out, x, len, absmax, bs, lookup, fast, sr);
            return;
        }
        const FloorMap& fm = *sr->floor;
        const __m256i key = _mm256_set1_epi32((int)sr->key), one = _mm256_set1_epi32(1), eight = _mm256_set1_epi32(8);
        const __m256i mul = _mm256_set1_epi32((int)sr->mul);
        const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        for (int b0 = 0, j = 0; b0 < len; b0 += bs, ++j) {
            const int blen = len - b0 < bs ? len - b0 : bs;
            const __m256 vscale = _mm256_set1_ps(q8_block_scale(absmax[j]));
            const bool finite = absmax[j] < INFINITY;  // NaN is not
            __m256i index = _mm256_add_epi32(_mm256_set1_epi32((int)(sr->first + (uint32_t)b0)), iota);
            for (int i = 0; i < blen; i += W, index = _mm256_add_epi32(index, eight)) {
                const __m256 y = _mm256_mul_ps(_mm256_load_ps(x + b0 + i), vscale);
                __m256i lo;
                __m256 c_lo, c_hi;
                floor_pair(y, fm, lo, c_lo, c_hi);
                const __m256i hi = _mm256_add_epi32(lo, one);
                const int cnt = blen - i < W ? blen - i : W;
                __m256i idx;
                if (sr->by_code) {  // the old codes, read before this vector's are written
                    const __m256i old = load_codes(out + b0 + i, cnt), r = draw_bits(index, key, mul);
                    idx = finite ? pick_by_code<true, true>(y, c_lo, c_hi, lo, hi, old, r, false)
                                 : pick_by_code<false, true>(y, c_lo, c_hi, lo, hi, old, r, false);
                } else {
                    idx = pick_entry(y, c_lo, c_hi, lo, hi, draw_bits(index, key, mul), false);
                }
                store_bytes(out + b0 + i, idx, cnt);
            }
        }
    }
};

}  // namespace
}  // namespace ds_q8

#include "q8_cpu_driver.h"

Q8_DEFINE_ISA(avx2, Avx2)

#ifdef Q8_PROBES  // tests/csrc/q8_probe.cpp only
#define Q8_MF_PROBE_NAME mf_mismatches_avx2
#define Q8_MF_PROBE_TRAITS Avx2
#include "q8_mf_probe.h"
#undef Q8_MF_PROBE_NAME
#undef Q8_MF_PROBE_TRAITS
#endif

#pragma GCC pop_options
