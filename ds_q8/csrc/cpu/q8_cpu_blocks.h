// Block-level traits functions written with a traits class's own per-vector ones: what an
// instruction set without special block code (AVX2, scalar) uses. Mix in with CRTP:
//   struct Avx2 : PerVectorBlocks<Avx2> { ... per-vector functions ... };
// Also the arguments of stochastic requantization, which every instruction set takes.
// Include after the target pragma, like the traits themselves.
#pragma once

#include <stdint.h>
#include <string.h>

#include "q8_common.h"

namespace ds_q8 {

struct FastMap;   // q8_fastmap.h: the segment search of the AVX-512 and scalar drivers
struct FloorMap;  // q8_floormap.h: the AVX2 driver's two entries around a value

namespace {

// Stochastic requantization of a call's values (q8_round_stochastic): the map as the instruction set
// prepared it, the map itself, the state's key and multiplier, the index of the call's first value in its parameter,
// the map's floor tables (null when the map has none), and for requantization guided by the old code
// (q8_round_guided_code) `by_code`: the codes a call writes hold the old ones when it starts.
template <class Table>
struct Stochastic {
    const Table* table;
    const float* code;
    uint32_t key;
    uint32_t mul;  // the state's multiplier: an element's bits are (key + index) * mul (q8_state_bits)
    uint32_t first;
    const FloorMap* floor;
    bool by_code;
};

template <class Self>
struct PerVectorBlocks {
    using Table = const float*;
    static Table prepare(const float* code) { return code; }

    // kChunk (a multiple of W) is declared by Self: it is incomplete here.
    template <class V>
    static void dequant_chunk(V* out, const uint8_t* codes, int cnt, Table code, float absmax) {
        constexpr int W = Self::W;
        for (int q = 0; q < Self::kChunk / W && q * W < cnt; ++q)
            out[q] = Self::dequant(codes + q * W, cnt - q * W < W ? cnt - q * W : W, code, absmax);
    }

    static void dequant_block(float* out, const uint8_t* codes, int len, Table code, float absmax) {
        constexpr int W = Self::W;
        for (int i = 0; i < len; i += W)
            Self::store_tmp(out + i, Self::dequant(codes + i, len - i < W ? len - i : W, code, absmax));
    }

    // absmax_reduce of `count` accumulators, one at a time.
    template <class V>
    static void absmax_reduce_many(const V* acc, int count, float* out) {
        for (int i = 0; i < count; ++i) out[i] = Self::absmax_reduce(acc[i]);
    }

    // Blocks of bs values (the last may be shorter), block j scaled by 1 / absmax[j], block by block:
    // the nearest codes, then (with sr) the stochastically rounded ones from them.
    static void requantize_blocks(uint8_t* out, const float* x, int len, const float* absmax, int bs,
                                  const uint32_t* lookup, const FastMap* fast, const Stochastic<Table>* sr) {
        uint8_t old[Q8_MAX_BLOCK];  // the old codes of a block guided by them, before the nearest ones replace them
        for (int b0 = 0, j = 0; b0 < len; b0 += bs, ++j) {
            const int blen = len - b0 < bs ? len - b0 : bs;
            const bool by_code = sr && sr->by_code;
            if (by_code) memcpy(old, out + b0, (size_t)blen);
            Self::quantize_block(out + b0, x + b0, blen, absmax[j], lookup, fast);
            if (sr)
                Self::round_block_stochastic(out + b0, x + b0, blen, absmax[j], *sr->table, sr->code, sr->key, sr->mul,
                                             sr->first + (uint32_t)b0, by_code ? old : nullptr);
        }
    }

    // One value at a time (the scalar driver; the AVX2 one has its own); guided by the old codes where
    // old is given.
    static void round_block_stochastic(uint8_t* codes, const float* x, int len, float absmax, Table code,
                                       const float*, uint32_t key, uint32_t mul, uint32_t first, const uint8_t* old) {
        const float scale = q8_block_scale(absmax);
        for (int i = 0; i < len; ++i) {
            const uint32_t r = (key + first + (uint32_t)i) * mul;
            const float y = x[i] * scale;
            codes[i] = (uint8_t)(old ? q8_round_guided_code(y, codes[i], code, r, old[i])
                                     : q8_round_stochastic(y, codes[i], code, r));
        }
    }

    static void quantize_block(uint8_t* out, const float* x, int len, float absmax, const uint32_t* lookup,
                               const FastMap*) {
        constexpr int W = Self::W;
        const float scale = q8_block_scale(absmax);
        for (int i = 0; i < len; i += W) Self::quantize(out + i, Self::load_tmp(x + i), scale, lookup, len - i < W ? len - i : W);
    }
};

}  // namespace
}  // namespace ds_q8
