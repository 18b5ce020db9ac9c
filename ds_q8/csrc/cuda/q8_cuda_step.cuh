// The step kernels of the ds_q8 CUDA op and their launchers, included by each translation unit that
// compiles some of the rules (q8_cuda_step_<n>.cu) and by q8_cuda_kernels.cu.
// Here the 8-bit step kernel; in q8_cuda_step_formats.cuh those of 4-bit and float32 states, in
// q8_cuda_step_launch.cuh their launchers, in q8_cuda_load_store.cuh the loads and stores they share.
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
#include "q8_cuda_load_store.cuh"
#include "q8_floortable.h"
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
constexpr int kStepParts = 8;
template <int Part>
bool step_in_part(const StepBatch& b, const std::map<std::string, double>& hyper);
template <> bool step_in_part<0>(const StepBatch& b, const std::map<std::string, double>& hyper);
template <> bool step_in_part<1>(const StepBatch& b, const std::map<std::string, double>& hyper);
template <> bool step_in_part<2>(const StepBatch& b, const std::map<std::string, double>& hyper);
template <> bool step_in_part<3>(const StepBatch& b, const std::map<std::string, double>& hyper);
template <> bool step_in_part<4>(const StepBatch& b, const std::map<std::string, double>& hyper);
template <> bool step_in_part<5>(const StepBatch& b, const std::map<std::string, double>& hyper);
template <> bool step_in_part<6>(const StepBatch& b, const std::map<std::string, double>& hyper);
template <> bool step_in_part<7>(const StepBatch& b, const std::map<std::string, double>& hyper);

namespace {

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
    uint8_t stochastic_states[Q8_MAX_STATES];  // how each 8-bit state is requantized (Q8_ROUND_*)
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

// A thread's old code i of a state, from the 8 packed in two words (pack_codes).
__device__ __forceinline__ uint32_t old_code(const uint32_t (&old)[2], int i) { return (old[i >> 2] >> (8 * (i & 3))) & 255u; }

// Whether a thread's old code i is F or F + 1, tested in place in its packed word: subtracting F from
// the code's byte leaves (old - F) mod 256 there (the bytes below it unchanged), and that is 0 or 1
// exactly when old - F is (F <= 254), which is the byte's bits 1 to 7 clear. An integer multiply-add and
// a logical test instead of extracting the byte, subtracting and comparing.
__device__ __forceinline__ bool old_code_near(const uint32_t (&old)[2], int i, uint32_t f) {
    const int shift = 8 * (i & 3);
    return ((old[i >> 2] - (f << shift)) & (0xFEu << shift)) == 0u;
}

// The 8 codes of a thread's values of state k guided by their old codes (q8_round_guided_code):
// stochastic rounding between F and F + 1 where the old code is F or F + 1, the nearer entry elsewhere. The two tests differ only in the factor of the pair's gap, the draw
// (r >> 8) or 2^23, so the factor is selected and one product compared (the same bits: a product of two
// floats does not depend on their order). No zero-point correction: the zero point's gap of 0 sends every
// positive value of a positive map's pair (0, 1) up to 1 either way.
template <bool kPositive>
__device__ __forceinline__ void requantize_guided_code(const FloorTable& t, const float (&x)[kElems],
                                                       const uint32_t (&old)[2], float scale, uint32_t key,
                                                       uint32_t index, uint32_t (&idx)[kElems]) {
#pragma unroll
    for (int i = 0; i < kElems; ++i) {
        const float y = table_scaled(x[i], scale);
        const uint32_t f = floor_index<kPositive>(t, y);
        const float2 pr = reinterpret_cast<const float2*>(t.pair)[f];
        // the factor's bits merged under a mask rather than selected: a select lets the compiler move the
        // draw into a branch of its own, which costs a warp more than the draw
        const uint32_t draw = __float_as_uint((float)(q8_sr_bits(key, index + i) >> 8));
        const uint32_t near = __float_as_uint(8388608.0f);
        const uint32_t mask = 0u - (old_code_near(old, i, f) ? 1u : 0u);
        const float factor = __uint_as_float((draw & mask) | (near & ~mask));
        idx[i] = f + (factor * pr.y < y - pr.x ? 1u : 0u);
    }
}

// The exact path: any value (NaN, infinity, beyond the table's range), through the lookup table.
__device__ __forceinline__ uint32_t round_exact(const FloorTable& t, const uint32_t* lookup, float x, float scale,
                                                int mode, uint32_t r, uint32_t old) {
    const float y = x * scale;
    const uint32_t n = q8_quantize_scaled(y, lookup);
    if (mode == Q8_ROUND_GUIDED_CODE) return q8_round_guided_code(y, n, t.code, r, old);
    return mode == Q8_ROUND_STOCHASTIC ? q8_round_stochastic(y, n, t.code, r) : n;
}

// ------------------------------------------------------------------ fused 8-bit step
// Per tile, each thread's 8 values: dequantize (one shared read each), the rule, then per state the
// new block maximum (integer max of |x|'s bits across the T threads of the block), the stored maximum,
// and each value's code from one row read and one pair read (round_stochastic_by_table). A block whose
// maximum is not finite takes the exact path, as does a map without a table.
constexpr int kStepThreads = 256;  // CUDA block size unless a quantization block needs more

// kGuided: the default's rounding (state_rounding="guided": every state guided by its old code) fixed at
// compile time, so that the kernel holds that rounding's code alone. The other kernel reads each state's
// rounding from the list, nearest or stochastic only (the launcher refuses guided rounding in any other
// form): it keeps no old codes.

template <class Rule, class P, class G, bool kGuided>
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
        uint32_t old[K][2];  // what guided requantization reads (kGuided): each state's old codes, packed
#pragma unroll
        for (int i = 0; i < kElems; ++i) {
            p[i] = g[i] = 0.0f;
#pragma unroll
            for (int k = 0; k < K; ++k) s[k][i] = 0.0f;
        }
#pragma unroll
        for (int k = 0; k < K; ++k) old[k][0] = old[k][1] = 0u;
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
                if (kGuided) {
                    old[k][0] = c[0] | (c[1] << 8) | (c[2] << 16) | (c[3] << 24);
                    old[k][1] = c[4] | (c[5] << 8) | (c[6] << 16) | (c[7] << 24);
                }
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
            const int listed = list.stochastic_states[k];
            const int mode = kGuided ? Q8_ROUND_GUIDED_CODE : listed;
            const bool sr = mode == Q8_ROUND_STOCHASTIC;
            const uint32_t key = q8_state_key(a.sr_key, k);
            const uint32_t index = (uint32_t)(a.sr_index + start);
            uint32_t idx[kElems];
            // the state's kind of map is the rule's (kSigned); a map of the other kind takes the exact path
            const bool positive = ((Rule::kSigned >> k) & 1u) == 0u;
            const bool fast = table[k] && maxbits < 0x7F800000u && (tab[k].positive_only != 0u) == positive;
            if (kGuided && fast) {
                if (positive) requantize_guided_code<true>(tab[k], s[k], old[k], scale, key, index, idx);
                else requantize_guided_code<false>(tab[k], s[k], old[k], scale, key, index, idx);
            } else if (fast && sr) {
                if (positive) requantize_stochastic<true>(tab[k], s[k], scale, key, index, idx);
                else requantize_stochastic<false>(tab[k], s[k], scale, key, index, idx);
            } else if (fast) {
#pragma unroll
                for (int i = 0; i < kElems; ++i) idx[i] = round_nearest_by_table(tab[k], table_scaled(s[k][i], scale));
            } else {
#pragma unroll
                for (int i = 0; i < kElems; ++i)
                    idx[i] = round_exact(tab[k], list.lookup[k], s[k][i], scale, mode,
                                         mode != Q8_ROUND_NEAREST ? q8_sr_bits(key, index + i) : 0u,
                                         old_code(old[k], i));
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

}  // namespace
}  // namespace ds_q8

// The step kernels of 4-bit and float32 states, then the launchers of every step kernel.
#include "q8_cuda_step_formats.cuh"
#include "q8_cuda_step_launch.cuh"
