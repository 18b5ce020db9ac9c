// The CPU driver's step on the other state formats: float32 states, and 4-bit Adam state (q8_four.h).
// Part of q8_cpu_driver.h, which includes it after its tiles and parameter reads and writes: the same
// conventions hold (after the instruction set's `#pragma GCC target`, internal linkage, no
// standard-library templates).
#pragma once

#include "q8_four.h"

namespace ds_q8 {
namespace {

// The same rules on float32 states (optim_bits=32, or tensors below min_8bit_size): loaded, updated
// and stored as they are, in spans of kSpan values over all tensors of the call.
template <class I, class Rule, class P, class G>
void step_fp32_blocks(const StepArgs* args, int count, const Rule& rule) {
    constexpr int K = Rule::kStates;
    constexpr int W = I::W;
    constexpr int64_t kSpan = 4096;
    using V = typename I::V;
    const UnitRange spans(args, count, kSpan);
    const int64_t total = spans.total();
#pragma omp parallel num_threads(args[0].num_threads)
    {
        const Rule local_rule = rule;  // its fields stay in registers: the stores cannot alias a local
        int t = 0;
#pragma omp for schedule(static)
        for (int64_t global = 0; global < total; ++global) {
            t = spans.tensor_of(global, t);
            const StepArgs& a = args[t];
            P* param = static_cast<P*>(a.param);
            const G* grad = static_cast<const G*>(a.grad);
            float* states[K];
            for (int k = 0; k < K; ++k) states[k] = a.states32[k];
            const int64_t start = (global - spans.first[t]) * kSpan;
            const int len = (int)q8_min(kSpan, a.numel - start);
            // a vector of W values, every lane live at compile time where kFull
            auto one = [&]<bool kFull>(int i) {
                const int cnt = kFull ? W : (int)q8_min(W, len - i);
                V p = load_param<I>(param + start + i, cnt, a, start + i);
                V g = I::load(grad + start + i, cnt);
                V s[K];
                for (int k = 0; k < K; ++k) s[k] = I::load(states[k] + start + i, cnt);
                local_rule(p, g, s);
                store_param<I>(param + start + i, p, cnt, a, start + i);
                for (int k = 0; k < K; ++k) I::store(states[k] + start + i, s[k], cnt);
            };
            int i = 0;
            for (; i + W <= len; i += W) one.template operator()<true>(i);
            if (i < len) one.template operator()<false>(i);
        }
    }
}

// q8_four_decode / q8_four_encode (q8_four.h) as loops over a block that the compiler vectorizes for
// this file's instruction set (block maxima with the traits' NaN-propagating vector max): the same
// operations in the same order, so the same bits.
inline void four_unpack(const uint8_t* bytes, int len, uint8_t* c) {
    for (int i = 0; i < len / 2; ++i) {
        c[2 * i] = bytes[i] & 15;
        c[2 * i + 1] = bytes[i] >> 4;
    }
    if (len & 1) c[len - 1] = bytes[len / 2] & 15;
}

inline void four_pack(const uint8_t* c, int len, uint8_t* bytes) {
    for (int i = 0; i < len / 2; ++i) bytes[i] = (uint8_t)(c[2 * i] | (c[2 * i + 1] << 4));
    if (len & 1) bytes[len / 2] = c[len - 1];
}

// out[i] = #{j : mid[j] < x[i] * scale} (NaN: N), one boundary at a time over the block.
template <int N>
inline void four_count_below(const float* mid, const float* x, float scale, int len, uint8_t* out) {
    alignas(64) float y[kMaxBlock];
    for (int i = 0; i < len; ++i) y[i] = x[i] * scale;
    for (int i = 0; i < len; ++i) out[i] = 0;
    for (int j = 0; j < N; ++j) {
        const float b = mid[j];
        for (int i = 0; i < len; ++i) out[i] = (uint8_t)(out[i] + (b < y[i] ? 1 : 0));
    }
    for (int i = 0; i < len; ++i) out[i] = y[i] != y[i] ? (uint8_t)N : out[i];
}

template <class I>
inline float four_block_max(const float* x, int len) {
    typename I::V acc = I::absmax_init();
    for (int i = 0; i < len; i += I::W) acc = I::absmax_step(acc, I::load_tmp(x + i), (int)q8_min(I::W, len - i));
    return I::absmax_reduce(acc);
}

inline void four_decode_block(const uint8_t* m_bytes, const uint8_t* v_bytes, int64_t first, int len, float m_absmax,
                              float v_max, const Q8Four& f, float* m, float* v) {
    alignas(64) uint8_t cm[kMaxBlock], cv[kMaxBlock];
    alignas(64) float mt[16], vt[16];
    for (int j = 0; j < 16; ++j) vt[j] = f.v_map[j];
    for (int j = 0; j < 15; ++j) mt[j] = f.m_map[j];
    mt[15] = 0.0f;  // never written
    four_unpack(v_bytes + (first >> 1), len, cv);
    four_unpack(m_bytes + (first >> 1), len, cm);
    for (int i = 0; i < len; ++i) v[i] = vt[cv[i]] * v_max;
    for (int i = 0; i < len; ++i) m[i] = (mt[cm[i]] * m_absmax) * sqrtf(v[i]);
}

// m and v padded with zeros to whole vectors past len (the traits' max reads whole vectors).
template <class I>
inline void four_encode_block(float* m, const float* v, int len, int64_t first, const Q8Four& f, uint8_t* m_bytes,
                              uint8_t* v_bytes, float* v_max_out, uint16_t* m_absmax_out) {
    alignas(64) uint8_t c[kMaxBlock];
    alignas(64) float vt[16], vmid[16], mmid[16];
    for (int j = 0; j < 16; ++j) vt[j] = f.v_map[j];
    for (int j = 0; j < 15; ++j) vmid[j] = f.v_mid[j];
    for (int j = 0; j < 14; ++j) mmid[j] = f.m_mid[j];
    const float vmax = four_block_max<I>(v, len);
    four_count_below<15>(vmid, v, q8_block_scale(vmax), len, c);
    for (int i = 0; i < len; ++i) {
        const float root = sqrtf(vt[c[i]] * vmax);
        const float r = m[i] / root;  // computed everywhere (a vector division), kept where root > 0
        m[i] = root > 0.0f ? r : 0.0f;
    }
    four_pack(c, len, v_bytes + (first >> 1));
    const uint16_t stored = q8_absmax_store(four_block_max<I>(m, len));
    four_count_below<14>(mmid, m, q8_block_scale(q8_absmax_load(stored)), len, c);
    four_pack(c, len, m_bytes + (first >> 1));
    *v_max_out = vmax;
    *m_absmax_out = stored;
}

// The step of 4-bit Adam state (format4.py): per tile, each block decoded (v, then m = r * sqrt(v)), the
// rule in vectors over the tile, then each block requantized in two passes (v on its new maximum, then
// r = m / sqrt(v decoded) on its own). Every tensor starts a block at an even element of its parameter,
// so its codes start a byte.
template <class I, class Rule, class P, class G>
void step_four_blocks(const StepArgs* args, int count, const Rule& rule) {
    constexpr int W = I::W;
    using V = typename I::V;
    const Q8Four four{args[0].four_maps[0], args[0].four_maps[1], args[0].four_maps[2], args[0].four_maps[3]};
    const UnitRange tiles(args, count, 0);
    const int64_t total = tiles.total();
#pragma omp parallel num_threads(args[0].num_threads)
    {
        alignas(64) float tmp[2][kMaxBlock];
        int t = 0;
#pragma omp for schedule(static)
        for (int64_t global = 0; global < total; ++global) {
            t = tiles.tensor_of(global, t);
            const StepArgs& a = args[t];
            // tile `global - first[t]` of tensor t: tile_of(bs) values from a block boundary, the last shorter
            const int64_t bs = a.block_size, start = (global - tiles.first[t]) * tile_of(bs), first_block = start / bs;
            const int len = (int)q8_min(tile_of(bs), a.numel - start), blocks = (int)((len + bs - 1) / bs);
            P* param = static_cast<P*>(a.param);
            const G* grad = static_cast<const G*>(a.grad);
            for (int bi = 0; bi < blocks; ++bi) {
                const int b0 = (int)(bi * bs);
                four_decode_block(a.codes[0], a.codes[1], start + b0, (int)q8_min(bs, len - b0),
                               q8_absmax_load(a.absmax[0][first_block + bi]), a.v_max[first_block + bi], four,
                               tmp[0] + b0, tmp[1] + b0);
            }
            for (int i = len; i < len + W - 1 && i < kMaxBlock; ++i) tmp[0][i] = tmp[1][i] = 0.0f;
            for (int i = 0; i < len; i += W) {
                const int cnt = (int)q8_min(W, len - i);
                V p = load_param<I>(param + start + i, cnt, a, start + i);
                V g = I::load(grad + start + i, cnt);
                V st[2] = {I::load_tmp(tmp[0] + i), I::load_tmp(tmp[1] + i)};
                rule(p, g, st);
                store_param<I>(param + start + i, p, cnt, a, start + i);
                I::store_tmp(tmp[0] + i, st[0]);
                I::store_tmp(tmp[1] + i, st[1]);
            }
            for (int bi = 0; bi < blocks; ++bi) {
                const int b0 = (int)(bi * bs);
                four_encode_block<I>(tmp[0] + b0, tmp[1] + b0, (int)q8_min(bs, len - b0), start + b0, four, a.codes[0],
                               a.codes[1], a.v_max + first_block + bi, a.absmax[0] + first_block + bi);
            }
        }
    }
}

}  // namespace
}  // namespace ds_q8
