// The step kernels of the ds_q8 CUDA op and their launchers, included by each translation unit that
// compiles some of the rules (q8_cuda_step_<n>.cu) and by q8_cuda_kernels.cu.
//
// Geometry: every thread owns 8 consecutive elements (vector loads: 2 x float4 or 1 x uint4 for
// the parameter and gradient, 8 bytes of codes per state), so a quantization block of block_size
// elements is handled by T = block_size / 8 threads and a CUDA block of max(T, 256) threads holds
// one or more whole quantization blocks. The step kernels are persistent: a grid of as many CTAs as
// the device holds at once walks the tiles (one CTA's elements) of every tensor of a call, so each CTA
// loads its tables into shared memory once. The state never leaves registers: dequantize, update,
// reduce the new absmax across the T threads (warp shuffles, then shared memory when T > 32),
// requantize (one row read and one pair read of q8_floortable.h per value) and store. The lookup
// table of q8_common.h answers, through the read-only cache, for blocks that are not finite.
//
// Compiled with -fmad=false and without fast-math so that every operation rounds like torch's.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstring>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

#include "q8_common.h"
#include "q8_cuda_api.h"
#include "q8_floortable.h"
#include "q8_four.h"
#include "q8_rules.h"

// Every launch goes through Q8_LAUNCH, and the step kernel's tables through Q8_DYNAMIC_SHARED: CUDA's
// here, the CPU execution harness of the tests (tests/cuda_sim/cuda_sim.h) where it defines its own.
#ifndef Q8_LAUNCH
#define Q8_LAUNCH(kernel, grid, threads, smem, stream, ...) \
    kernel<<<(grid), (threads), (smem), (stream)>>>(__VA_ARGS__)
#define Q8_DYNAMIC_SHARED(T, name)                               \
    extern __shared__ __align__(16) unsigned char q8_dynamic_shared[]; \
    T* name = reinterpret_cast<T*>(q8_dynamic_shared)
#endif

namespace ds_q8 {

// The rules' launchers are spread over kStepParts translation units, q8_cuda_step_<n>.cu, so that a
// build compiles them side by side: the rule at place i of Q8_RULES lives in part i % kStepParts. Each
// returns whether the batch's rule is one of its part's (and launched it).
constexpr int kStepParts = 4;
template <int Part>
bool step_in_part(const StepBatch& b, const std::map<std::string, double>& hyper);
template <> bool step_in_part<0>(const StepBatch& b, const std::map<std::string, double>& hyper);
template <> bool step_in_part<1>(const StepBatch& b, const std::map<std::string, double>& hyper);
template <> bool step_in_part<2>(const StepBatch& b, const std::map<std::string, double>& hyper);
template <> bool step_in_part<3>(const StepBatch& b, const std::map<std::string, double>& hyper);

namespace {

constexpr int kElems = 8;          // elements per thread

// ------------------------------------------------------------------ loads and stores of 8 values
// Every per-thread array below is indexed only by constants once the fixed-trip loops are unrolled
// (`#pragma unroll` over kElems, the tail guarded by `if (i < cnt)`), so it lives in registers: no
// stack frame, no local memory (launch/ptxas_report.py checks it).
//
// `align` is the byte alignment of the tensor's base pointer, capped at 16. A thread's 8 values
// start at a multiple of 8 elements, so they are aligned like the base: 16 bytes allow uint4
// accesses, 8 bytes uint2, 4 bytes uint32, anything less one element at a time.
template <int kWords>
__device__ __forceinline__ void load_words(const void* p, uint32_t (&w)[kWords], int align) {
    if (kWords % 4 == 0 && align >= 16) {
#pragma unroll
        for (int j = 0; j < kWords / 4; ++j) {
            const uint4 r = reinterpret_cast<const uint4*>(p)[j];
            w[4 * j] = r.x, w[4 * j + 1] = r.y, w[4 * j + 2] = r.z, w[4 * j + 3] = r.w;
        }
    } else if (kWords % 2 == 0 && align >= 8) {
#pragma unroll
        for (int j = 0; j < kWords / 2; ++j) {
            const uint2 r = reinterpret_cast<const uint2*>(p)[j];
            w[2 * j] = r.x, w[2 * j + 1] = r.y;
        }
    } else {
#pragma unroll
        for (int j = 0; j < kWords; ++j) w[j] = reinterpret_cast<const uint32_t*>(p)[j];
    }
}

template <int kWords>
__device__ __forceinline__ void store_words(void* p, const uint32_t (&w)[kWords], int align) {
    if (kWords % 4 == 0 && align >= 16) {
#pragma unroll
        for (int j = 0; j < kWords / 4; ++j)
            reinterpret_cast<uint4*>(p)[j] = make_uint4(w[4 * j], w[4 * j + 1], w[4 * j + 2], w[4 * j + 3]);
    } else if (kWords % 2 == 0 && align >= 8) {
#pragma unroll
        for (int j = 0; j < kWords / 2; ++j) reinterpret_cast<uint2*>(p)[j] = make_uint2(w[2 * j], w[2 * j + 1]);
    } else {
#pragma unroll
        for (int j = 0; j < kWords; ++j) reinterpret_cast<uint32_t*>(p)[j] = w[j];
    }
}

// The raw bits of one element, and the 32-bit words that hold 8 of them.
__device__ __forceinline__ uint32_t elem_bits(float v) { return __float_as_uint(v); }
__device__ __forceinline__ uint32_t elem_bits(q8_half v) { return v.x; }
__device__ __forceinline__ uint32_t elem_bits(q8_bf16 v) { return v.x; }
__device__ __forceinline__ uint32_t elem_bits(uint8_t v) { return v; }
template <class T> __device__ __forceinline__ T elem_from_bits(uint32_t b);
template <> __device__ __forceinline__ float elem_from_bits<float>(uint32_t b) { return __uint_as_float(b); }
template <> __device__ __forceinline__ q8_half elem_from_bits<q8_half>(uint32_t b) { return q8_half{(uint16_t)b}; }
template <> __device__ __forceinline__ q8_bf16 elem_from_bits<q8_bf16>(uint32_t b) { return q8_bf16{(uint16_t)b}; }
template <> __device__ __forceinline__ uint8_t elem_from_bits<uint8_t>(uint32_t b) { return (uint8_t)b; }

// The bits of 8 consecutive elements of type T (float, q8_half, q8_bf16 or uint8_t codes); element
// i >= cnt is neither read (its bits are 0) nor written.
template <class T>
__device__ __forceinline__ void load_bits8(const T* p, uint32_t (&b)[kElems], int cnt, int align) {
    constexpr int kPer = 4 / sizeof(T), kWords = kElems / kPer, kShift = 32 / kPer;
    if (cnt == kElems && align >= 4) {
        uint32_t w[kWords];
        load_words<kWords>(p, w, align);
#pragma unroll
        for (int i = 0; i < kElems; ++i) {
            if constexpr (kPer == 1) b[i] = w[i];
            else b[i] = (w[i / kPer] >> (kShift * (i % kPer))) & ((1u << kShift) - 1u);
        }
        return;
    }
#pragma unroll
    for (int i = 0; i < kElems; ++i) b[i] = i < cnt ? elem_bits(p[i]) : 0u;
}

template <class T>
__device__ __forceinline__ void store_bits8(T* p, const uint32_t (&b)[kElems], int cnt, int align) {
    constexpr int kPer = 4 / sizeof(T), kWords = kElems / kPer, kShift = 32 / kPer;
    if (cnt == kElems && align >= 4) {
        uint32_t w[kWords];
#pragma unroll
        for (int j = 0; j < kWords; ++j) {
            w[j] = 0u;
#pragma unroll
            for (int q = 0; q < kPer; ++q) w[j] |= b[j * kPer + q] << (kShift % 32 * q);
        }
        store_words<kWords>(p, w, align);
        return;
    }
#pragma unroll
    for (int i = 0; i < kElems; ++i)
        if (i < cnt) p[i] = elem_from_bits<T>(b[i]);
}

// 8 values as float32; lanes >= cnt read as 0.
template <class T>
__device__ __forceinline__ void load8(const T* p, float (&v)[kElems], int cnt, int align) {
    uint32_t b[kElems];
    load_bits8(p, b, cnt, align);
#pragma unroll
    for (int i = 0; i < kElems; ++i) v[i] = q8_to_float(elem_from_bits<T>(b[i]));  // load_bits8's 0 bits: 0.0
}

// 8 values rounded to T: to nearest, or stochastically with the bits of q8_sr_bits(key, index + i).
template <class T>
__device__ __forceinline__ void store8(T* p, const float (&v)[kElems], int cnt, int align, bool stochastic = false,
                                       uint32_t key = 0u, int64_t index = 0) {
    uint32_t b[kElems];
#pragma unroll
    for (int i = 0; i < kElems; ++i) {
        T h;
        if (stochastic) q8_store_sr(&h, v[i], q8_sr_bits(key, (uint32_t)(index + i)));
        else q8_store(&h, v[i]);
        b[i] = elem_bits(h);
    }
    store_bits8(p, b, cnt, align);
}

// A parameter's 8 values: as load8, or for bf16 with correction bytes `corr` (null: none) the 24-bit
// values they make together (q8_bf16_join).
template <class P>
__device__ __forceinline__ void load_param8(const P* p, float (&v)[kElems], int cnt, int align, const int8_t* corr) {
    if constexpr (std::is_same<P, q8_bf16>::value) {
        if (corr != nullptr) {
            uint32_t b[kElems];
            load_bits8(p, b, cnt, align);
#pragma unroll
            for (int i = 0; i < kElems; ++i) v[i] = i < cnt ? q8_bf16_join((uint16_t)b[i], corr[i]) : 0.0f;
            return;
        }
    }
    load8(p, v, cnt, align);
}

// A parameter's write: as store8, or for bf16 with correction bytes split to nearest (q8_bf16_split).
template <class P>
__device__ __forceinline__ void store_param8(P* p, const float (&v)[kElems], int cnt, int align, int8_t* corr,
                                             bool stochastic, uint32_t key, int64_t index) {
    if constexpr (std::is_same<P, q8_bf16>::value) {
        if (corr != nullptr) {
            uint32_t b[kElems];
#pragma unroll
            for (int i = 0; i < kElems; ++i) {
                uint16_t h;
                int8_t c;
                q8_bf16_split(v[i], &h, &c);
                b[i] = h;
                if (i < cnt) corr[i] = c;
            }
            store_bits8(p, b, cnt, align);
            return;
        }
    }
    store8(p, v, cnt, align, stochastic, key, index);
}

// ------------------------------------------------------------------ block maxima
// The maximum over the T threads of one quantization block (warp shuffles, then shared memory when T >
// 32); every thread gets it. `red` holds one value per warp of the CUDA block; `pick(a, b)` is the max.
template <class V, class Pick>
__device__ __forceinline__ V qblock_reduce(V local, int T, V* red, Pick pick) {
    const int width = T < 32 ? T : 32;
    for (int off = width / 2; off > 0; off /= 2) local = pick(local, __shfl_xor_sync(0xFFFFFFFFu, local, off));
    if (T <= 32) return local;
    const int warp = threadIdx.x / 32, warps = T / 32, first = (threadIdx.x / T) * warps;
    if ((threadIdx.x & 31) == 0) red[warp] = local;
    __syncthreads();
    V m = red[first];
    for (int w = 1; w < warps; ++w) m = pick(m, red[first + w]);
    __syncthreads();  // `red` is reused by the next reduction
    return m;
}

// NaN-propagating max of |x| over a quantization block (q8_absmax_step).
__device__ __forceinline__ float qblock_absmax(float local, int T, float* red) {
    return qblock_reduce(local, T, red, [](float a, float b) { return q8_absmax_step(a, b); });
}

// max |x| over a quantization block as the bits of |x|: for non-negative floats the integer order is
// the float order, and every NaN orders above infinity, so the maximum is NaN when the block holds
// one, as with q8_absmax_step; q8_absmax_store turns every NaN into the same stored value.
__device__ __forceinline__ uint32_t qblock_maxbits(uint32_t local, int T, uint32_t* red) {
    return qblock_reduce(local, T, red, [](uint32_t a, uint32_t b) { return a > b ? a : b; });
}

// ------------------------------------------------------------------ tensor lists
// A step launch covers every tensor of a call, as torch's multi_tensor_apply covers dozens: a table of
// per-tensor slots in device memory (uploaded by the launch, stream-ordered, from pinned memory). Each
// tensor is cut into tiles of one CTA's elements (blockDim.x * kElems, whole quantization blocks),
// numbered across the list (tensor t owns tiles first_tile[t] .. first_tile[t + 1] - 1), and the CTAs are
// persistent: each loads its tables once and then walks the tiles blockIdx.x, blockIdx.x + gridDim.x, ...
struct StepSlot {
    void* param;
    const void* grad;
    void* state[Q8_MAX_STATES];  // uint8 codes, or float32 states for the fp32-state kernel
    uint16_t* absmax[Q8_MAX_STATES];  // stored block maxima (bf16 bits, q8_absmax_store)
    int64_t numel;
    int64_t sr_index;      // index of param[0] in its original parameter (stochastic rounding)
    uint32_t sr_key;
    int8_t* correction;    // null, or the bf16 param's correction bytes (q8_bf16_join / q8_bf16_split)
    uint8_t align_param, align_grad, align_state;  // byte alignments, capped at 16 (load_words)
    double* error_sums;    // null, or per state k, at 3k: sum |requantized - x|, sum |x|, nonzero x requantized to 0
};

struct StepList {
    const float* code[Q8_MAX_STATES];       // 8-bit states: the maps (4-bit: format4's 60 floats in code[0])
    const uint32_t* lookup[Q8_MAX_STATES];  // and their lookup tensors (kDeviceLookupSize words)
    const int32_t* skip;                    // null, or a device flag: non-zero means write nothing
    int32_t block_shift, threads_per_qblock;  // log2 of the block size, T = block size / kElems
    int32_t count, tiles;                   // tensors and tiles of the launch
    bool stochastic;                        // 16-bit parameter writes rounded stochastically
    bool stochastic_states[Q8_MAX_STATES];  // 8-bit states requantized stochastically
    const StepSlot* slot;                   // device memory: the tensors' slots,
    const int32_t* first_tile;              // and their first tiles (count + 1 entries)
};

// Whether the step is to be skipped (a non-finite gradient found on the device): then no thread
// writes anything. The same answer for every thread of the grid.
__device__ __forceinline__ bool list_skipped(const StepList& list) {
    return list.skip != nullptr && *list.skip != 0;
}

// Calls body(slot, first element of the tile) for each tile of this CTA, in order. The tensor of a
// tile only moves forward, so finding it costs a few uniform comparisons per tile.
template <class Body>
__device__ __forceinline__ void for_each_tile(const StepList& list, Body body) {
    const int64_t tile_elems = (int64_t)blockDim.x * kElems;
    int t = 0;
    for (int tile = (int)blockIdx.x; tile < list.tiles; tile += (int)gridDim.x) {
        while (list.first_tile[t + 1] <= tile) ++t;
        body(list.slot[t], (int64_t)(tile - list.first_tile[t]) * tile_elems);
    }
}

// The rule on each of the 8 values (its states s[k][i]); lanes past the tensor's end compute on zeros
// and are never stored.
template <class Rule, int K>
__device__ __forceinline__ void apply_rule(const Rule& rule, float (&p)[kElems], const float (&g)[kElems],
                                           float (&s)[K][kElems]) {
#pragma unroll
    for (int i = 0; i < kElems; ++i) {
        float sv[K];
#pragma unroll
        for (int k = 0; k < K; ++k) sv[k] = s[k][i];
        rule(p[i], g[i], sv);
#pragma unroll
        for (int k = 0; k < K; ++k) s[k][i] = sv[k];
    }
}

// ------------------------------------------------------------------ requantization
// The CTA's copy of a state's tables: the map's FloorTable when it has one (q8_floortable.h), else the
// map alone in its code[] (the exact path then codes every value). Returns whether it has one (the same
// answer for every thread of the grid).
__device__ __forceinline__ bool load_table(const StepList& list, int k, FloorTable& dst) {
    const bool table = __ldg(list.lookup[k] + kDeviceFloorFlag) != 0u;
    if (table) {
        const uint4* src = reinterpret_cast<const uint4*>(list.lookup[k] + kDeviceFloorOffset);
        uint4* words = reinterpret_cast<uint4*>(&dst);
        for (int i = threadIdx.x; i < kFloorWords / 4; i += blockDim.x) words[i] = __ldg(src + i);
    } else {
        for (int i = threadIdx.x; i < 256; i += blockDim.x) dst.code[i] = __ldg(list.code[k] + i);
    }
    return table;
}

// A value of a block that the table serves, scaled as the reference scales it (x * scale), as +0.0 for
// -0.0 (an fma adding 0 rounds once, like the product alone).
__device__ __forceinline__ float table_scaled(float x, float scale) { return __fmaf_rn(x, scale, 0.0f); }

// F of a scaled value: q8_floor_index for a map of either kind, known here at compile time.
template <bool kPositive>
__device__ __forceinline__ uint32_t floor_index(const FloorTable& t, float y) {
    return kPositive ? q8_floor_index_positive(t, __float_as_uint(y)) : q8_floor_index_signed(t, __float_as_uint(y));
}

// Its code rounded stochastically with random bits r (q8_floor_round): one row read, one pair read.
template <bool kPositive>
__device__ __forceinline__ uint32_t round_stochastic_by_table(const FloorTable& t, float y, uint32_t r) {
    const uint32_t f = floor_index<kPositive>(t, y);
    const float2 pr = reinterpret_cast<const float2*>(t.pair)[f];
    return f + ((float)(r >> 8) * pr.y < y - pr.x ? 1u : 0u);
}

// Its nearest code (q8_floor_round): one row read, one midpoint read.
__device__ __forceinline__ uint32_t round_nearest_by_table(const FloorTable& t, float y) {
    const uint32_t f = q8_floor_index(t, __float_as_uint(y));
    return f + (t.mid[f] < y ? 1u : 0u);
}

// The 8 codes of a thread's values of one state, rounded stochastically by the table.
template <bool kPositive>
__device__ __forceinline__ void requantize_stochastic(const FloorTable& t, const float (&x)[kElems], float scale,
                                                      uint32_t key, uint32_t index, uint32_t (&idx)[kElems]) {
#pragma unroll
    for (int i = 0; i < kElems; ++i)
        idx[i] = round_stochastic_by_table<kPositive>(t, table_scaled(x[i], scale), q8_sr_bits(key, index + i));
}

// The exact path: any value (NaN, infinity, beyond the table's range), through the lookup table.
__device__ __forceinline__ uint32_t round_exact(const FloorTable& t, const uint32_t* lookup, float x, float scale,
                                                bool stochastic, uint32_t r) {
    const float y = x * scale;
    const uint32_t n = q8_quantize_scaled(y, lookup);
    return stochastic ? q8_round_stochastic(y, n, t.code, r) : n;
}

// ------------------------------------------------------------------ fused 8-bit step
// Per tile, each thread's 8 values: dequantize (one shared read each), the rule, then per state the
// new block maximum (integer max of |x|'s bits across the T threads of the block), the stored maximum,
// and each value's code from one row read and one pair read (round_stochastic_by_table). A block whose
// maximum is not finite takes the exact path, as does a map without a table.
constexpr int kStepThreads = 256;  // CUDA block size unless a quantization block needs more

template <class Rule, class P, class G>
__global__ void __launch_bounds__(512, Rule::kStates > 2 ? 1 : 2) step_kernel(const __grid_constant__ StepList list, const Rule rule) {
    constexpr int K = Rule::kStates;
    if (list_skipped(list)) return;
    Q8_DYNAMIC_SHARED(FloorTable, tab);  // K tables
    __shared__ uint32_t red[1024 / 32];
    bool table[K];
#pragma unroll
    for (int k = 0; k < K; ++k) table[k] = load_table(list, k, tab[k]);
    __syncthreads();

    const int T = list.threads_per_qblock, block_shift = list.block_shift;
    for_each_tile(list, [&](const StepSlot& a, int64_t tile_start) {
        P* param = static_cast<P*>(a.param);
        const G* grad = static_cast<const G*>(a.grad);
        const int64_t numel = a.numel;
        const int64_t start = tile_start + (int64_t)threadIdx.x * kElems;
        const int64_t qblock = start >> block_shift;
        const bool live = start < numel;  // a tensor's last tile may reach past its end
        const int cnt = live ? (int)(numel - start < kElems ? numel - start : kElems) : 0;
        int8_t* corr = a.correction ? a.correction + start : nullptr;

        float p[kElems], g[kElems], s[K][kElems];
#pragma unroll
        for (int i = 0; i < kElems; ++i) {
            p[i] = g[i] = 0.0f;
#pragma unroll
            for (int k = 0; k < K; ++k) s[k][i] = 0.0f;
        }
        if (live) {
            load_param8(param + start, p, cnt, a.align_param, corr);
            load8(grad + start, g, cnt, a.align_grad);
#pragma unroll
            for (int k = 0; k < K; ++k) {
                uint32_t c[kElems];
                load_bits8(static_cast<const uint8_t*>(a.state[k]) + start, c, cnt, a.align_state);
                const float am = q8_absmax_load(a.absmax[k][qblock]);
#pragma unroll
                for (int i = 0; i < kElems; ++i) s[k][i] = tab[k].code[c[i]] * am;
            }
            apply_rule(rule, p, g, s);
            store_param8(param + start, p, cnt, a.align_param, corr, list.stochastic, a.sr_key, a.sr_index + start);
        }
        if (cnt < kElems) {  // a tensor's last pass: lanes past its end count for nothing in the maxima
#pragma unroll
            for (int i = 0; i < kElems; ++i)
#pragma unroll
                for (int k = 0; k < K; ++k)
                    if (i >= cnt) s[k][i] = 0.0f;
        }
#pragma unroll
        for (int k = 0; k < K; ++k) {
            uint32_t local = 0u;
#pragma unroll
            for (int i = 0; i < kElems; ++i) {
                const uint32_t b = __float_as_uint(s[k][i]) & 0x7FFFFFFFu;
                local = b > local ? b : local;
            }
            // every thread takes part (shuffles, barriers); each rounds the same maximum the same way
            const uint32_t maxbits = qblock_maxbits(local, T, red);
            const uint16_t stored = q8_absmax_store(__uint_as_float(maxbits));
            if (!live) continue;
            if ((threadIdx.x & (T - 1)) == 0) a.absmax[k][qblock] = stored;
            const float absmax = q8_absmax_load(stored);
            const float scale = q8_block_scale(absmax);
            const bool sr = list.stochastic_states[k];
            const uint32_t key = q8_state_key(a.sr_key, k);
            const uint32_t index = (uint32_t)(a.sr_index + start);
            uint32_t idx[kElems];
            // the state's kind of map is the rule's (kSigned); a map of the other kind takes the exact path
            const bool positive = ((Rule::kSigned >> k) & 1u) == 0u;
            const bool fast = table[k] && maxbits < 0x7F800000u && (tab[k].positive_only != 0u) == positive;
            if (fast && sr) {
                if (positive) requantize_stochastic<true>(tab[k], s[k], scale, key, index, idx);
                else requantize_stochastic<false>(tab[k], s[k], scale, key, index, idx);
            } else if (fast) {
#pragma unroll
                for (int i = 0; i < kElems; ++i) idx[i] = round_nearest_by_table(tab[k], table_scaled(s[k][i], scale));
            } else {
#pragma unroll
                for (int i = 0; i < kElems; ++i)
                    idx[i] = round_exact(tab[k], list.lookup[k], s[k][i], scale, sr,
                                         sr ? q8_sr_bits(key, index + i) : 0u);
            }
            store_bits8(static_cast<uint8_t*>(a.state[k]) + start, idx, cnt, a.align_state);
            if (a.error_sums != nullptr) {  // quantization telemetry: off by default, no host sync when on
                double err = 0.0, mag = 0.0, zeroed = 0.0;
#pragma unroll
                for (int i = 0; i < kElems; ++i)
                    if (i < cnt) {
                        const float back = tab[k].code[idx[i]] * absmax;
                        err += fabs((double)back - (double)s[k][i]);
                        mag += fabs((double)s[k][i]);
                        zeroed += back == 0.0f && s[k][i] != 0.0f ? 1.0 : 0.0;
                    }
                double* sums = a.error_sums + Q8_TELEMETRY_SUMS * k;
                atomicAdd(sums, err);
                atomicAdd(sums + 1, mag);
                atomicAdd(sums + 2, zeroed);
            }
        }
    });
}

// ------------------------------------------------------------------ fused step of 4-bit Adam state
// ds_q8/format4.py, as the CPU driver's step_four_blocks: each thread's 8 codes are 4 bytes (its first
// element is even), decoded v first, then m = r * sqrt(v); the rule; v requantized on its block's new
// maximum, then r = m / sqrt(v decoded) on r's own, each maximum reduced across the T threads.
constexpr int kFourMaps = 15 + 14 + 16 + 15;

__device__ __forceinline__ void load_nibbles8(const uint8_t* p, uint32_t (&c)[kElems], int cnt, int align) {
    if (cnt == kElems && align >= 4) {
        const uint32_t w = *reinterpret_cast<const uint32_t*>(p);
#pragma unroll
        for (int i = 0; i < kElems; ++i) c[i] = (w >> (4 * i)) & 15u;
        return;
    }
#pragma unroll
    for (int i = 0; i < kElems; ++i) c[i] = i < cnt ? (uint32_t)(p[i / 2] >> (4 * (i % 2))) & 15u : 0u;
}

// A nibble past cnt is written 0 (the byte of an odd count's last element).
__device__ __forceinline__ void store_nibbles8(uint8_t* p, const uint32_t (&c)[kElems], int cnt, int align) {
    if (cnt == kElems && align >= 4) {
        uint32_t w = 0u;
#pragma unroll
        for (int i = 0; i < kElems; ++i) w |= c[i] << (4 * i);
        *reinterpret_cast<uint32_t*>(p) = w;
        return;
    }
#pragma unroll
    for (int j = 0; j < kElems / 2; ++j)
        if (2 * j < cnt) p[j] = (uint8_t)(c[2 * j] | (2 * j + 1 < cnt ? c[2 * j + 1] << 4 : 0u));
}

// q8_count_below_n(mid, n, y) for n <= 15 sorted boundaries padded to 16 with +infinity: a branch-free
// binary search, 4 reads instead of n comparisons; NaN counts past every boundary.
__device__ __forceinline__ uint32_t count_below16(const float* mid16, int n, float y) {
    uint32_t c = 0;
#pragma unroll
    for (int step = 8; step > 0; step /= 2) c += mid16[c + step - 1] < y ? (uint32_t)step : 0u;
    return y != y ? (uint32_t)n : c;
}

template <class Rule, class P, class G>
__global__ void __launch_bounds__(512, 1) step4_kernel(const __grid_constant__ StepList list, const Rule rule) {
    if (list_skipped(list)) return;
    __shared__ float s_maps[kFourMaps];
    __shared__ float s_mid[2][16];  // m's 14 and v's 15 boundaries, each padded with +infinity
    __shared__ float red[1024 / 32];
    for (int i = threadIdx.x; i < kFourMaps; i += blockDim.x) s_maps[i] = list.code[0][i];
    for (int i = threadIdx.x; i < 32; i += blockDim.x) {
        const int j = i % 16, n = i < 16 ? 14 : 15, at = i < 16 ? 15 : 45;
        s_mid[i / 16][j] = j < n ? list.code[0][at + j] : INFINITY;
    }
    __syncthreads();
    const Q8Four f{s_maps, s_maps + 15, s_maps + 29, s_maps + 45};
    const int T = list.threads_per_qblock, block_shift = list.block_shift;

    for_each_tile(list, [&](const StepSlot& a, int64_t tile_start) {
        P* param = static_cast<P*>(a.param);
        const G* grad = static_cast<const G*>(a.grad);
        uint8_t* m_bytes = static_cast<uint8_t*>(a.state[0]);
        uint8_t* v_bytes = static_cast<uint8_t*>(a.state[1]);
        float* v_max = reinterpret_cast<float*>(a.absmax[1]);  // float32 maxima (launch_lists)
        const int64_t numel = a.numel;
        const int64_t start = tile_start + (int64_t)threadIdx.x * kElems;
        const int64_t qblock = start >> block_shift;
        const bool live = start < numel;
        const int cnt = live ? (int)(numel - start < kElems ? numel - start : kElems) : 0;
        int8_t* corr = a.correction ? a.correction + start : nullptr;

        float p[kElems], g[kElems], s[2][kElems];
#pragma unroll
        for (int i = 0; i < kElems; ++i) p[i] = g[i] = s[0][i] = s[1][i] = 0.0f;
        if (live) {
            load_param8(param + start, p, cnt, a.align_param, corr);
            load8(grad + start, g, cnt, a.align_grad);
            uint32_t cm[kElems], cv[kElems];
            load_nibbles8(m_bytes + start / 2, cm, cnt, a.align_state);
            load_nibbles8(v_bytes + start / 2, cv, cnt, a.align_state);
            const float m_absmax = q8_absmax_load(a.absmax[0][qblock]), vm = v_max[qblock];
#pragma unroll
            for (int i = 0; i < kElems; ++i) {
                s[1][i] = f.v_map[cv[i]] * vm;
                s[0][i] = (f.m_map[cm[i]] * m_absmax) * sqrtf(s[1][i]);
            }
            apply_rule(rule, p, g, s);
            store_param8(param + start, p, cnt, a.align_param, corr, list.stochastic, a.sr_key, a.sr_index + start);
        }
        float local = 0.0f;
#pragma unroll
        for (int i = 0; i < kElems; ++i)
            if (i < cnt) local = q8_absmax_step(local, s[1][i]);
        const float vmax = qblock_absmax(local, T, red);  // every thread takes part
        const float vs = q8_block_scale(vmax);
        uint32_t cv[kElems], cm[kElems];
        float r[kElems];
        local = 0.0f;
#pragma unroll
        for (int i = 0; i < kElems; ++i) {
            cv[i] = count_below16(s_mid[1], 15, s[1][i] * vs);
            const float root = sqrtf(f.v_map[cv[i]] * vmax);
            const float q = s[0][i] / root;
            r[i] = root > 0.0f ? q : 0.0f;
            if (i < cnt) local = q8_absmax_step(local, r[i]);
        }
        const uint16_t stored = q8_absmax_store(qblock_absmax(local, T, red));
        if (!live) return;  // after the last reduction
        if ((threadIdx.x & (T - 1)) == 0) {
            a.absmax[0][qblock] = stored;
            v_max[qblock] = vmax;
        }
        const float ms = q8_block_scale(q8_absmax_load(stored));
#pragma unroll
        for (int i = 0; i < kElems; ++i) cm[i] = count_below16(s_mid[0], 14, r[i] * ms);
        store_nibbles8(m_bytes + start / 2, cm, cnt, a.align_state);
        store_nibbles8(v_bytes + start / 2, cv, cnt, a.align_state);
    });
}

// ------------------------------------------------------------------ fused step on float32 states
// The same rules on float32 states (optim_bits=32, or tensors below min_8bit_size): 8 values per
// thread, no maps and no block maxima.
template <class Rule, class P, class G>
__global__ void __launch_bounds__(kStepThreads) step_fp32_kernel(const __grid_constant__ StepList list,
                                                                 const Rule rule) {
    constexpr int K = Rule::kStates;
    if (list_skipped(list)) return;
    for_each_tile(list, [&](const StepSlot& a, int64_t tile_start) {
        const int64_t start = tile_start + (int64_t)threadIdx.x * kElems;
        if (start >= a.numel) return;
        const int cnt = (int)(a.numel - start < kElems ? a.numel - start : kElems);
        P* param = static_cast<P*>(a.param);
        float p[kElems], g[kElems], s[K][kElems];
        int8_t* corr = a.correction ? a.correction + start : nullptr;
        load_param8(param + start, p, cnt, a.align_param, corr);
        load8(static_cast<const G*>(a.grad) + start, g, cnt, a.align_grad);
#pragma unroll
        for (int k = 0; k < K; ++k) load8(static_cast<const float*>(a.state[k]) + start, s[k], cnt, a.align_state);
        apply_rule(rule, p, g, s);
        store_param8(param + start, p, cnt, a.align_param, corr, list.stochastic, a.sr_key, a.sr_index + start);
#pragma unroll
        for (int k = 0; k < K; ++k) store8(static_cast<float*>(a.state[k]) + start, s[k], cnt, a.align_state);
    });
}

// ------------------------------------------------------------------ host side
// The bits of a tensor of stored block maxima (bf16; the bindings check the dtype).
uint16_t* absmax_bits(const at::Tensor& t) {
    return reinterpret_cast<uint16_t*>(const_cast<at::BFloat16*>(t.data_ptr<at::BFloat16>()));
}

// The byte alignment of a pointer, capped at 16 (what load_words can use).
int alignment(const void* p) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    return a % 16 == 0 ? 16 : a % 8 == 0 ? 8 : a % 4 == 0 ? 4 : a % 2 == 0 ? 2 : 1;
}

int min_alignment(int a, int b) { return a < b ? a : b; }

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The persistent grid of a step kernel: as many CTAs as the device holds at once (its multiprocessors
// times the kernel's occupancy at `threads` and `smem`), fewer when there are fewer tiles. Kernels whose
// shared memory exceeds the default 48 KiB are allowed it first.
template <class Kernel>
int64_t resident_ctas(Kernel kernel, int threads, size_t smem) {
    int device = 0, sms = 0, per_sm = 0;
    C10_CUDA_CHECK(cudaGetDevice(&device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    if (smem > 48 * 1024)
        C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
    TORCH_CHECK(per_sm > 0, "a step kernel of ", threads, " threads and ", smem, " bytes of shared memory does not "
                "fit a multiprocessor of this device");
    return (int64_t)sms * per_sm;
}

// The slots and first tiles of a launch in device memory: one buffer, copied from pinned host memory on
// the stream (the caching allocators keep both until the copy and the kernel are done).
at::Tensor device_table(const std::vector<StepSlot>& slots, const std::vector<int32_t>& first, at::Device device) {
    const size_t slot_bytes = slots.size() * sizeof(StepSlot), bytes = slot_bytes + first.size() * sizeof(int32_t);
    auto host = at::empty({(int64_t)bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(!device.is_cpu()));
    std::memcpy(host.data_ptr<uint8_t>(), slots.data(), slot_bytes);
    std::memcpy(host.data_ptr<uint8_t>() + slot_bytes, first.data(), first.size() * sizeof(int32_t));
    return device.is_cpu() ? host : host.to(device, at::kByte, /*non_blocking=*/true);
}

// Launches one kernel for every tensor of the batch (tensors without elements are left out), over tiles
// of threads * kElems elements, on min(tiles, resident CTAs) persistent CTAs.
template <class Kernel, class Rule>
void launch_lists(const StepBatch& b, StepList list, Kernel kernel, const Rule& rule, int threads, size_t smem) {
    constexpr int K = Rule::kStates;
    static_assert(sizeof(StepSlot) % 8 == 0, "the first tiles follow the slots, 8-byte aligned");
    const int64_t tile = (int64_t)threads * kElems;
    std::vector<StepSlot> slots;
    std::vector<int32_t> first;
    int64_t tiles = 0;
    for (size_t t = 0; t < b.params.size(); ++t) {
        const int64_t numel = b.params[t].numel();
        if (numel == 0) continue;
        StepSlot s{};
        s.param = b.params[t].data_ptr();
        s.grad = b.grads[t].data_ptr();
        s.numel = numel;
        s.align_param = (uint8_t)alignment(s.param);
        s.align_grad = (uint8_t)alignment(s.grad);
        s.align_state = 16;
        for (int k = 0; k < K; ++k) {
            s.state[k] = b.states[t][k].data_ptr();
            s.align_state = (uint8_t)min_alignment(s.align_state, alignment(s.state[k]));
            if (!b.absmax.empty())  // 4-bit state: the second moment's maxima are float32, carried as such
                s.absmax[k] = b.absmax[t][k].scalar_type() == at::kFloat
                                  ? reinterpret_cast<uint16_t*>(b.absmax[t][k].data_ptr<float>())
                                  : absmax_bits(b.absmax[t][k]);
        }
        if (b.has_keys) {
            s.sr_key = (uint32_t)b.sr_keys[t];
            s.sr_index = b.sr_index[t];
        }
        if (!b.error_sums.empty()) s.error_sums = b.error_sums[t].data_ptr<double>();
        if (!b.corrections.empty()) s.correction = b.corrections[t].data_ptr<int8_t>();
        slots.push_back(s);
        first.push_back((int32_t)tiles);
        tiles += ceil_div(numel, tile);
        TORCH_CHECK_VALUE(tiles < INT32_MAX, "the step's tensors need more than ", INT32_MAX, " tiles of ", tile,
                          " elements: more than one launch holds");
    }
    if (slots.empty()) return;
    first.push_back((int32_t)tiles);
    const at::Tensor table = device_table(slots, first, b.params[0].device());
    list.slot = reinterpret_cast<const StepSlot*>(table.data_ptr<uint8_t>());
    list.first_tile = reinterpret_cast<const int32_t*>(table.data_ptr<uint8_t>() + slots.size() * sizeof(StepSlot));
    list.count = (int32_t)slots.size();
    list.tiles = (int32_t)tiles;
    const int64_t grid = resident_ctas(kernel, threads, smem);
    Q8_LAUNCH(kernel, (unsigned)(tiles < grid ? tiles : grid), threads, smem, c10::cuda::getCurrentCUDAStream(),
              list, rule);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <class Rule, class P, class G>
void launch_step(const StepBatch& b, const Rule& rule) {
    constexpr int K = Rule::kStates;
    static_assert(K >= 1 && K <= Q8_MAX_STATES, "a rule keeps 1 to Q8_MAX_STATES states");
    static_assert(sizeof(StepList) + sizeof(Rule) <= 4000, "the StepList and the rule must fit the parameter block");
    StepList list{};
    list.skip = b.skip;
    list.stochastic = b.stochastic;
    for (int k = 0; k < Q8_MAX_STATES; ++k) list.stochastic_states[k] = b.stochastic_states[k];
    if (b.fp32_states) {
        launch_lists(b, list, step_fp32_kernel<Rule, P, G>, rule, kStepThreads, 0);
        return;
    }
    const int T = (int)(b.block_size / kElems), threads = T > kStepThreads ? T : kStepThreads;
    list.block_shift = 0;
    while ((int64_t)1 << list.block_shift < b.block_size) ++list.block_shift;  // a power of two (checked)
    list.threads_per_qblock = T;
    if (b.four_bit) {  // Adam's rules only (the binding checks): no other rule's kernel is compiled
        if constexpr (std::is_same<Rule, AdamRule<true>>::value || std::is_same<Rule, AdamRule<false>>::value) {
            list.code[0] = b.four_maps.data_ptr<float>();
            launch_lists(b, list, step4_kernel<Rule, P, G>, rule, threads, 0);
        }
        return;
    }
    for (int k = 0; k < K; ++k) {
        list.code[k] = b.maps[k].data_ptr<float>();
        list.lookup[k] = reinterpret_cast<const uint32_t*>(b.lookups[k].data_ptr<int32_t>());
    }
    launch_lists(b, list, step_kernel<Rule, P, G>, rule, threads, K * sizeof(FloorTable));
}


template <class Rule>
bool launch_dtypes(const StepBatch& b, const Rule& rule) {
    const auto p = b.params[0].scalar_type(), g = b.grads[0].scalar_type();
    const auto f32 = at::kFloat, f16 = at::kHalf, bf16 = at::kBFloat16;
    if (p == f32 && g == f32) return launch_step<Rule, float, float>(b, rule), true;
    if (p == f16 && g == f16) return launch_step<Rule, q8_half, q8_half>(b, rule), true;
    if (p == bf16 && g == bf16) return launch_step<Rule, q8_bf16, q8_bf16>(b, rule), true;
    if (p == f16 && g == f32) return launch_step<Rule, q8_half, float>(b, rule), true;
    if (p == bf16 && g == f32) return launch_step<Rule, q8_bf16, float>(b, rule), true;
    return false;
}


// The place of a rule in Q8_RULES.
constexpr int rule_index(const char* name) {
    constexpr const char* kNames[] = {
#define Q8_RULE_NAME(NAME, RULE) NAME,
        Q8_RULES(Q8_RULE_NAME)
#undef Q8_RULE_NAME
    };
    for (int i = 0; i < (int)(sizeof(kNames) / sizeof(kNames[0])); ++i) {
        const char *a = kNames[i], *b = name;
        while (*a != 0 && *a == *b) ++a, ++b;
        if (*a == *b) return i;
    }
    return -1;
}

// step_in_part<Part>: the rules of one part, each instantiated only in its own translation unit.
template <int Part>
bool step_rules_of_part(const StepBatch& b, const std::map<std::string, double>& hyper) {
    auto get = [&](const char* name) -> double {
        auto it = hyper.find(name);
        TORCH_CHECK_VALUE(it != hyper.end(), "update rule '", b.rule, "' needs hyperparameter '", name, "'");
        return it->second;
    };
#define Q8_PART_RULE(NAME, RULE)                                                                               \
    if constexpr (rule_index(NAME) % kStepParts == Part) {                                                     \
        if (b.rule == NAME) {                                                                                  \
            for (const auto& st : b.states)                                                                    \
                TORCH_CHECK_VALUE(st.size() == (size_t)RULE::kStates, "update rule '", b.rule, "' keeps ",      \
                                  RULE::kStates, " states, got ", st.size());                                 \
            TORCH_CHECK_VALUE(launch_dtypes(b, RULE(get)), "no CUDA kernel for param ",                        \
                              b.params[0].scalar_type(), " with grad ", b.grads[0].scalar_type(),              \
                              " (grad must have the param's dtype or float32)");                               \
            return true;                                                                                       \
        }                                                                                                      \
    }
    Q8_RULES(Q8_PART_RULE)
#undef Q8_PART_RULE
    return false;
}

}  // namespace
}  // namespace ds_q8
