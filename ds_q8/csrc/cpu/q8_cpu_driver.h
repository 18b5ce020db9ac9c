// The CPU driver, written once for every instruction set: OpenMP over tiles of quantization blocks,
// and per block dequantize -> update -> absmax, then per tile requantize, with the state held in an
// L1-sized scratch buffer (never a full fp32 copy of the state).
//
// Include it after `#pragma GCC target(...)` and after defining the instruction-set traits `I`.
// It uses no standard-library templates: an inline template instantiated here would carry this
// file's instruction set and could be merged by the linker into the baseline path.
// Traits:
//   static constexpr int W;                    lanes per vector
//   using V;                                   float vector: + - * /, V(float), q8_sqrt(V), q8_sign(V)
//   template <class T> V load(const T*, int cnt)          lanes >= cnt read as 0
//   template <class T> void store(T*, V, int cnt)         only lanes < cnt are written
//   V load_tmp(const float*) / void store_tmp(float*, V)  full vectors, scratch buffer
//   Table prepare(const float* code)                      per-thread form of a map
//   void dequant_block(float* out, const uint8_t* codes, int len, const Table&, float absmax)
//                                              writes whole vectors (up to 64 lanes past len)
//   static constexpr int kChunk;               values per dequant_chunk, a multiple of W
//   void dequant_chunk(V* out, const uint8_t* codes, int cnt, const Table&, float absmax)
//                                              kChunk / W vectors; codes past cnt are not read
//   V absmax_init() / V absmax_step(V acc, V x, int cnt) / float absmax_reduce(V acc)
//   void absmax_reduce_many(const V* acc, int count, float* out)   absmax_reduce of each
//   void requantize_blocks(uint8_t* out, const float* x, int len, const float* absmax, int bs,
//                          const uint32_t* lookup, const FastMap* fast, const Stochastic<Table>* sr)
//                                              len values in blocks of bs (a multiple of 64, or len itself),
//                                              block j scaled by absmax[j] (stored maxima): nearest codes, or
//                                              with sr stochastically rounded (or guided) ones; fast may be null
#pragma once

#include <math.h>
#include <string.h>

#include "q8_common.h"
#include "q8_cpu_api.h"
#include "q8_cpu_blocks.h"  // Stochastic
#include "q8_minifloat.h"
#include "q8_rules.h"       // Q8_RULES

namespace ds_q8 {
namespace {

constexpr int kMaxBlock = (int)Q8_MAX_BLOCK;
// The step's unit of work: a tile of kTile values (whole blocks, since block sizes are powers of two),
// or one block where blocks are larger. Its scratch fits the per-thread buffers of kMaxBlock values.
constexpr int64_t kTile = 2048;
constexpr int kTileBlocks = (int)(kTile / Q8_MIN_BLOCK);
static_assert(kTile <= kMaxBlock && kTile % Q8_MIN_BLOCK == 0, "a tile is whole blocks and fits the scratch");

inline int64_t q8_min(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t tile_of(int64_t block_size) { return block_size > kTile ? block_size : kTile; }

// A minifloat map's codes of a chunk (kChunk values, cnt of them read) as map entries times absmax
// (q8_minifloat.h, decoded from their bits): the traits' own where they have it (mf_dequant_chunk), else one
// value at a time.
template <class I>
__attribute__((always_inline)) inline void mf_dequant_chunk(typename I::V* out, const uint8_t* codes, int cnt, bool is_signed, float absmax) {
    if constexpr (I::W == 1) {
        out[0] = q8_mf_value(codes[0], is_signed) * absmax;
    } else {
        I::mf_dequant_chunk(out, codes, cnt, is_signed, absmax);
    }
}

// A minifloat map's codes of `len` values (blocks of bs, block j's stored maximum absmax[j]), rounded as
// `mode` says with the random bits of state k (q8_state_bits: key, and x[0]'s index `first`), the old codes
// read from `out` before they are replaced: q8_mf_code on each, or the traits' mf_requantize where they have it.
template <class I>
inline void mf_requantize_blocks(uint8_t* out, const float* x, int len, const float* absmax, int bs, bool is_signed,
                                 int mode, uint32_t key, int k, uint32_t first) {
    if constexpr (I::W == 1) {
        for (int b0 = 0, j = 0; b0 < len; b0 += bs, ++j) {
            const float s = q8_mf_scale(absmax[j]);
            const int end = len - b0 < bs ? len : b0 + bs;
            for (int i = b0; i < end; ++i)
                out[i] = (uint8_t)q8_mf_code(is_signed, x[i] * s, mode, q8_state_bits(key, k, first + (uint32_t)i), out[i]);
        }
    } else {
        I::mf_requantize(out, x, len, absmax, bs, is_signed, mode, key, q8_state_mul(k), first);
    }
}

// A parameter write: rounded to nearest, or stochastically for 16-bit parameters when the tensor asks
// (the same bits as the CUDA kernel and the reference: q8_store_sr on each element).
template <class T> struct IsFloat32 { static constexpr bool value = false; };
template <> struct IsFloat32<float> { static constexpr bool value = true; };

template <class T> struct IsBFloat16 { static constexpr bool value = false; };
template <> struct IsBFloat16<q8_bf16> { static constexpr bool value = true; };

// A parameter read: its 16 bits, or with a correction byte the 24-bit value they make together.
template <class I, class P>
inline typename I::V load_param(const P* p, int cnt, const StepArgs& a, int64_t at) {
    if constexpr (IsBFloat16<P>::value) {
        if (a.correction) {
            alignas(64) float vals[I::W] = {};
            for (int i = 0; i < cnt; ++i) vals[i] = q8_bf16_join(p[i].x, a.correction[at + i]);
            return I::load_tmp(vals);
        }
    }
    return I::load(p, cnt);
}

template <class I, class P>
inline void store_param(P* p, typename I::V v, int cnt, const StepArgs& a, int64_t at) {
    if constexpr (IsFloat32<P>::value) {
        I::store(p, v, cnt);
    } else {
        if constexpr (IsBFloat16<P>::value) {
            if (a.correction) {  // the value split into bf16 and its correction byte, to nearest
                alignas(64) float vals[I::W];
                I::store_tmp(vals, v);
                for (int i = 0; i < cnt; ++i) q8_bf16_split(vals[i], &p[i].x, &a.correction[at + i]);
                return;
            }
        }
        if (!a.stochastic) {
            I::store(p, v, cnt);
            return;
        }
        alignas(64) float vals[I::W];
        I::store_tmp(vals, v);
        const uint32_t first = (uint32_t)(a.sr_index + at);
        for (int i = 0; i < cnt; ++i) q8_store_sr(p + i, vals[i], q8_sr_bits(a.sr_key, first + (uint32_t)i));
    }
}

// The work units (tiles of blocks, or spans of `unit` values) of many tensors as one range: prefix sums of
// the per-tensor unit counts, and the tensor that holds a unit. A static OpenMP schedule hands each
// thread an increasing range, so `tensor_of` only ever walks forward from the thread's last answer.
struct UnitRange {
    int64_t* first;  // first[t] = index of tensor t's first unit; first[count] = total
    int count;

    UnitRange(const StepArgs* args, int n, int64_t unit) : first(new int64_t[n + 1]), count(n) {
        first[0] = 0;
        for (int t = 0; t < n; ++t) {
            const int64_t u = unit > 0 ? unit : tile_of(args[t].block_size);
            first[t + 1] = first[t] + (args[t].numel + u - 1) / u;
        }
    }
    ~UnitRange() { delete[] first; }
    UnitRange(const UnitRange&) = delete;
    UnitRange& operator=(const UnitRange&) = delete;

    int64_t total() const { return first[count]; }
    int tensor_of(int64_t global, int t) const {
        while (global >= first[t + 1]) ++t;
        return t;
    }
};

// The step of `count` tensors that share a rule, hyperparameters, dtypes and maps (args[0] gives
// those): one parallel loop over the tiles of all of them (kTile values, or one block where blocks are
// larger), so that many small tensors cost one call and one OpenMP region instead of one each, and
// small blocks cost one requantization call per tile instead of one per block.
template <class I, class Rule, class P, class G>
void step_blocks(const StepArgs* args, int count, const Rule& rule) {
    constexpr int K = Rule::kStates;
    constexpr int W = I::W;
    constexpr int C = I::kChunk;
    using V = typename I::V;
    const UnitRange tiles(args, count, 0);
    const int64_t total = tiles.total();
#pragma omp parallel num_threads(args[0].num_threads)
    {
        const Rule local_rule = rule;  // its fields stay in registers: the parameter stores cannot alias a local
        alignas(64) float tmp[K][kMaxBlock];
        alignas(64) float deq[kMaxBlock];  // telemetry only: the requantized values of a tile
        typename I::Table table[K];
        for (int k = 0; k < K; ++k) table[k] = I::prepare(args[0].code[k]);
        int t = 0;
#pragma omp for schedule(static)
        for (int64_t global = 0; global < total; ++global) {
            t = tiles.tensor_of(global, t);
            const StepArgs& a = args[t];
            P* param = static_cast<P*>(a.param);
            const G* grad = static_cast<const G*>(a.grad);
            const int64_t n = a.numel, bs = a.block_size, tile = tile_of(bs);
            const int64_t start = (global - tiles.first[t]) * tile;
            const int len = (int)q8_min(tile, n - start);
            const int64_t first_block = start / bs;
            const int blocks = (int)((len + bs - 1) / bs);
            float amax[K][kTileBlocks];  // the tile's new stored maxima, as floats
            // The next tile's data (in this tensor or at the start of the next one) is prefetched,
            // one cache line of each stream per 16 values: without it the loads of a tile wait on
            // memory (about 15% of the step at 2^25 parameters). Into L2 (prefetcht1), not L1: the
            // scratch buffers and the current tile fill L1, and at 2^25 parameters on Zen 4 this
            // measured 2-8% faster than prefetching into L1.
            const P* next_param = param + start + tile;
            const G* next_grad = grad + start + tile;
            const uint8_t* next_codes[K];
            const uint16_t* next_absmax[K];  // with small blocks a tile's maxima fill a cache line per state
            for (int k = 0; k < K; ++k) next_codes[k] = a.codes[k] + start + tile;
            for (int k = 0; k < K; ++k) next_absmax[k] = a.absmax[k] + first_block + blocks;
            int64_t next_len = n - (start + tile);
            if (next_len <= 0 && t + 1 < count) {
                const StepArgs& an = args[t + 1];
                next_param = static_cast<const P*>(an.param);
                next_grad = static_cast<const G*>(an.grad);
                for (int k = 0; k < K; ++k) next_codes[k] = an.codes[k], next_absmax[k] = an.absmax[k];
                next_len = an.numel;
            }
            if (next_len > 0)
                for (int k = 0; k < K; ++k) __builtin_prefetch(next_absmax[k], 1, 2);
            // One loop over the tile's chunks, not one per block: the loop-invariant setup (the maps'
            // registers, the broadcast hyperparameters) is then paid once per tile, which with
            // 64-value blocks measured 20% of the step. A chunk never straddles two blocks (the block
            // size is a power of two >= 64, a multiple of every chunk).
            // The running max of the current block stays in registers (stores through the parameter
            // pointer could alias the array, which would then be reloaded for every vector); it is
            // stored when the chunks reach the next block.
            V acc[K][kTileBlocks];  // each block's running max |state|, reduced once for the whole tile
            V cur[K];
            float old_absmax[K];
            int cur_bi = 0;
            for (int k = 0; k < K; ++k) cur[k] = I::absmax_init(), old_absmax[k] = q8_absmax_load(a.absmax[k][first_block]);
            const int block_shift = __builtin_ctzll((unsigned long long)bs);
            uint8_t kind[K];
            for (int k = 0; k < K; ++k) kind[k] = a.map_kind[k];
            // One chunk: its states decoded, the rule, the parameter written, the states kept in the scratch
            // buffer and their running maxima; a full chunk (kFull) with every lane live, at compile time.
            auto run_chunk = [&]<bool kFull>(int i, int chunk) {
                V s[K][C / W];
                for (int k = 0; k < K; ++k) {
                    if (kind[k] != kMapTable)
                        mf_dequant_chunk<I>(s[k], a.codes[k] + start + i, chunk, kind[k] == kMapMinifloatSigned,
                                            old_absmax[k]);
                    else
                        I::dequant_chunk(s[k], a.codes[k] + start + i, chunk, table[k], old_absmax[k]);
                }
                for (int j = 0; j < C / W && (kFull || j * W < chunk); ++j) {
                    const int at = i + j * W;
                    const int cnt = kFull ? W : (int)q8_min(W, len - at);
                    V p = load_param<I>(param + start + at, cnt, a, start + at);
                    V g = I::load(grad + start + at, cnt);
                    V st[K];
                    for (int k = 0; k < K; ++k) st[k] = s[k][j];
                    local_rule(p, g, st);
                    store_param<I>(param + start + at, p, cnt, a, start + at);
                    for (int k = 0; k < K; ++k) {
                        I::store_tmp(tmp[k] + at, st[k]);
                        cur[k] = I::absmax_step(cur[k], st[k], cnt);
                    }
                }
            };
            for (int i = 0; i < len; i += C) {
                const int bi = i >> block_shift;
                if (bi != cur_bi) {
                    for (int k = 0; k < K; ++k) {
                        acc[k][cur_bi] = cur[k];
                        cur[k] = I::absmax_init();
                        old_absmax[k] = q8_absmax_load(a.absmax[k][first_block + bi]);
                    }
                    cur_bi = bi;
                }
                if ((i & 15) == 0 && i < next_len) {
                    for (int j = 0; j < C; j += 16) {
                        __builtin_prefetch(next_param + i + j, 1, 2);
                        __builtin_prefetch(next_grad + i + j, 0, 2);
                    }
                    if ((i & 63) == 0)
                        for (int k = 0; k < K; ++k) __builtin_prefetch(next_codes[k] + i, 1, 2);
                }
                const int chunk = (int)q8_min(C, len - i);
                if (chunk == C) run_chunk.template operator()<true>(i, chunk);
                else run_chunk.template operator()<false>(i, chunk);
            }
            for (int k = 0; k < K; ++k) acc[k][cur_bi] = cur[k];
            for (int k = 0; k < K; ++k) {
                I::absmax_reduce_many(acc[k], blocks, amax[k]);
                for (int bi = 0; bi < blocks; ++bi) {
                    const uint16_t stored = q8_absmax_store(amax[k][bi]);
                    a.absmax[k][first_block + bi] = stored;
                    amax[k][bi] = q8_absmax_load(stored);
                }
            }
            for (int k = 0; k < K; ++k) {
                uint8_t* codes = a.codes[k] + start;
                if (a.map_kind[k] != kMapTable) {
                    mf_requantize_blocks<I>(codes, tmp[k], len, amax[k], (int)bs, a.map_kind[k] == kMapMinifloatSigned,
                                            a.rounding_modes[k], q8_state_key(a.sr_key, k), k,
                                            (uint32_t)(a.sr_index + start));
                } else {
                    const Stochastic<typename I::Table> sr{&table[k], a.code[k], q8_state_key(a.sr_key, k),
                                                           q8_state_mul(k), (uint32_t)(a.sr_index + start), a.floor[k],
                                                           a.rounding_modes[k] == Q8_ROUND_BY_OLD_CODE};
                    I::requantize_blocks(codes, tmp[k], len, amax[k], (int)bs, a.lookup[k], a.fast[k],
                                         a.rounding_modes[k] ? &sr : nullptr);
                }
                if (a.error_sums) {  // quantization telemetry (optim/telemetry.py): off by default
                    for (int bi = 0; bi < blocks; ++bi) {
                        const int b0 = (int)(bi * bs);
                        I::dequant_block(deq + b0, codes + b0, (int)q8_min(bs, len - b0), table[k], amax[k][bi]);
                    }
                    double err = 0.0, mag = 0.0, zeroed = 0.0;
                    for (int i = 0; i < len; ++i) {
                        err += fabs((double)deq[i] - (double)tmp[k][i]);
                        mag += fabs((double)tmp[k][i]);
                        zeroed += deq[i] == 0.0f && tmp[k][i] != 0.0f ? 1.0 : 0.0;
                    }
                    double* sums = a.error_sums + Q8_TELEMETRY_SUMS * k;
#pragma omp atomic
                    sums[0] += err;
#pragma omp atomic
                    sums[1] += mag;
#pragma omp atomic
                    sums[2] += zeroed;
                }
            }
        }
    }
}

}  // namespace
}  // namespace ds_q8

// The step on float32 states and on 4-bit state, which use the tiles and parameter reads above.
#include "q8_cpu_step_formats.h"

namespace ds_q8 {
namespace {

template <class I, class Rule, class P, class G>
void step_any_state(const StepArgs* args, int count, const Rule& rule) {
    static_assert(Rule::kStates >= 1 && Rule::kStates <= Q8_MAX_STATES, "a rule keeps 1 to Q8_MAX_STATES states");
    if (args[0].four_bit) {
        if constexpr (Rule::kStates == 2) step_four_blocks<I, Rule, P, G>(args, count, rule);
    } else if (args[0].fp32_states) {
        step_fp32_blocks<I, Rule, P, G>(args, count, rule);
    } else {
        step_blocks<I, Rule, P, G>(args, count, rule);
    }
}

template <class I, class Rule>
bool step_dtypes(const StepArgs* args, int count, const Rule& rule) {
    const DType p = args[0].param_dtype, g = args[0].grad_dtype;
    if (p == DType::kFloat32 && g == DType::kFloat32) return step_any_state<I, Rule, float, float>(args, count, rule), true;
    if (p == DType::kFloat16 && g == DType::kFloat16) return step_any_state<I, Rule, q8_half, q8_half>(args, count, rule), true;
    if (p == DType::kBFloat16 && g == DType::kBFloat16) return step_any_state<I, Rule, q8_bf16, q8_bf16>(args, count, rule), true;
    if (p == DType::kFloat16 && g == DType::kFloat32) return step_any_state<I, Rule, q8_half, float>(args, count, rule), true;
    if (p == DType::kBFloat16 && g == DType::kFloat32) return step_any_state<I, Rule, q8_bf16, float>(args, count, rule), true;
    return false;
}

template <class I>
StepStatus step_any_rule(const StepArgs* args, int count) {
    const StepArgs& a = args[0];
    const char* missing = nullptr;
    auto get = [&a, &missing](const char* name) -> double {
        for (int i = 0; i < a.num_hyper; ++i)
            if (strcmp(a.hyper[i].name, name) == 0) return a.hyper[i].value;
        if (!missing) missing = name;  // report the first one
        return 0.0;
    };
#define Q8_TRY_RULE(NAME, RULE)                                                   \
    if (strcmp(a.rule, NAME) == 0) {                                              \
        RULE rule(get);                                                           \
        if (missing) return StepStatus{StepStatus::kMissingHyper, missing};       \
        if (a.num_states != RULE::kStates) return StepStatus{StepStatus::kWrongStates, nullptr}; \
        bool ok = step_dtypes<I>(args, count, rule);                              \
        return StepStatus{ok ? StepStatus::kOk : StepStatus::kUnsupported, nullptr}; \
    }
    Q8_RULES(Q8_TRY_RULE)
#undef Q8_TRY_RULE
    return StepStatus{StepStatus::kUnsupported, nullptr};
}

template <class I, class T>
void quantize_blocks(const QuantizeArgs& a) {
    constexpr int W = I::W;
    using V = typename I::V;
    const T* x = static_cast<const T*>(a.x);
    const int64_t n = a.numel, bs = a.block_size;
    const int64_t nb = (n + bs - 1) / bs;
#pragma omp parallel num_threads(a.num_threads)
    {
        alignas(64) float tmp[kMaxBlock];
#pragma omp for schedule(static)
        for (int64_t b = 0; b < nb; ++b) {
            const int64_t start = b * bs;
            const int len = (int)q8_min(bs, n - start);
            V acc = I::absmax_init();
            for (int i = 0; i < len; i += W) {
                const int cnt = (int)q8_min(W, len - i);
                V v = I::load(x + start + i, cnt);
                I::store_tmp(tmp + i, v);
                acc = I::absmax_step(acc, v, cnt);
            }
            const uint16_t stored = q8_absmax_store(I::absmax_reduce(acc));
            a.absmax[b] = stored;
            const float absmax = q8_absmax_load(stored);
            if (a.map_kind != kMapTable)
                mf_requantize_blocks<I>(a.codes + start, tmp, len, &absmax, len, a.map_kind == kMapMinifloatSigned,
                                        Q8_ROUND_NEAREST, 0u, 0, 0u);
            else
                I::requantize_blocks(a.codes + start, tmp, len, &absmax, len, a.lookup, a.fast, nullptr);
        }
    }
}

template <class I, class T>
void dequantize_blocks(const QuantizeArgs& a) {
    constexpr int W = I::W;
    T* out = static_cast<T*>(a.x);
    const int64_t n = a.numel, bs = a.block_size;
    const int64_t nb = (n + bs - 1) / bs;
#pragma omp parallel num_threads(a.num_threads)
    {
        alignas(64) float tmp[kMaxBlock];
        typename I::Table table = I::prepare(a.code);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < nb; ++b) {
            const int64_t start = b * bs;
            const int len = (int)q8_min(bs, n - start);
            I::dequant_block(tmp, a.codes + start, len, table, q8_absmax_load(a.absmax[b]));
            for (int i = 0; i < len; i += W) I::store(out + start + i, I::load_tmp(tmp + i), (int)q8_min(W, len - i));
        }
    }
}

// Whether none of n words has an all-ones exponent field: the largest of (x & exponent), which the loop
// computes a vector at a time in this file's instruction set, is the exponent itself only for Inf or NaN.
// The n words are read as four streams side by side: one stream a core reads at about half the bandwidth
// that several give (measured 4.8 ms for 2^25 fp32 values on two threads of an Intel Xeon with one).
template <class W>
bool words_finite(const W* x, int64_t n, W exponent) {
    const int64_t q = n / 4;
    const W* s[4] = {x, x + q, x + 2 * q, x + 3 * q};
    W top0 = 0, top1 = 0, top2 = 0, top3 = 0;
    for (int64_t i = 0; i < q; ++i) {
        const W e0 = (W)(s[0][i] & exponent), e1 = (W)(s[1][i] & exponent);
        const W e2 = (W)(s[2][i] & exponent), e3 = (W)(s[3][i] & exponent);
        top0 = e0 > top0 ? e0 : top0;
        top1 = e1 > top1 ? e1 : top1;
        top2 = e2 > top2 ? e2 : top2;
        top3 = e3 > top3 ? e3 : top3;
    }
    for (int64_t i = 4 * q; i < n; ++i) {
        const W e = (W)(x[i] & exponent);
        top0 = e > top0 ? e : top0;
    }
    const W a = top0 > top1 ? top0 : top1, b = top2 > top3 ? top2 : top3;
    return (a > b ? a : b) != exponent;
}

inline bool finite_values(const void* x, int64_t n, DType dtype) {
    switch (dtype) {
        case DType::kFloat32: return words_finite(static_cast<const uint32_t*>(x), n, 0x7F800000u);
        case DType::kFloat16: return words_finite(static_cast<const uint16_t*>(x), n, (uint16_t)0x7C00);
        default: return words_finite(static_cast<const uint16_t*>(x), n, (uint16_t)0x7F80);
    }
}

template <class I, template <class, class> class F>
void by_dtype(const QuantizeArgs& a) {
    switch (a.dtype) {
        case DType::kFloat32: F<I, float>::run(a); break;
        case DType::kFloat16: F<I, q8_half>::run(a); break;
        case DType::kBFloat16: F<I, q8_bf16>::run(a); break;
    }
}

template <class I, class T>
struct QuantizeOp { static void run(const QuantizeArgs& a) { quantize_blocks<I, T>(a); } };
template <class I, class T>
struct DequantizeOp { static void run(const QuantizeArgs& a) { dequantize_blocks<I, T>(a); } };

}  // namespace
}  // namespace ds_q8

// Defines the three entry points of q8_cpu_api.h for one instruction set.
#define Q8_DEFINE_ISA(isa, Traits)                                                                  \
    namespace ds_q8 {                                                                               \
    StepStatus step_##isa(const StepArgs* a, int count) { return step_any_rule<Traits>(a, count); }    \
    void quantize_##isa(const QuantizeArgs& a) { by_dtype<Traits, QuantizeOp>(a); }                 \
    void dequantize_##isa(const QuantizeArgs& a) { by_dtype<Traits, DequantizeOp>(a); }             \
    bool finite_##isa(const void* x, int64_t n, DType dtype) { return finite_values(x, n, dtype); }      \
    }
