// The 8-bit step kernel of the ds_q8 CUDA op, included by each translation unit that compiles some of the
// rules (q8_cuda_step_<n>.cu) and by q8_cuda_kernels.cu. Its parts: the tensor lists and the rule's passes in
// q8_cuda_step_lists.cuh, the minifloat codec in q8_cuda_minifloat.cuh, the table maps' requantization in
// q8_cuda_tables.cuh; in q8_cuda_step_formats.cuh the kernels of 4-bit and float32 states, in
// q8_cuda_step_launch.cuh their launchers, in q8_cuda_load_store.cuh the loads and stores they share.
//
// Geometry: every thread owns 8 consecutive elements (vector loads: 2 x float4 or 1 x uint4 for
// the parameter and gradient, 8 bytes of codes per state), so a quantization block of block_size
// elements is handled by T = block_size / 8 threads and a CUDA block of max(T, 256) threads holds
// one or more whole quantization blocks. The step kernels are persistent: a grid of as many CTAs as
// the device holds at once walks the tiles (one CTA's elements) of every tensor of a call. The state
// never leaves registers: dequantize, update, reduce the new absmax across the T threads (warp
// shuffles, then shared memory when T > 32), requantize and store.
//
// Compiled with -fmad=false and without fast-math so that every operation rounds like torch's.
#pragma once

// c10's stream (with C10_CUDA_CHECK) and checks only: the tensors are pointers by now (q8_cuda_api.h)
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <cstring>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

#include "q8_common.h"
#include "q8_cuda_api.h"
#include "q8_cuda_load_store.cuh"
#include "q8_cuda_minifloat.cuh"
#include "q8_cuda_step_lists.cuh"
#include "q8_cuda_tables.cuh"
#include "q8_floortable.h"
#include "q8_minifloat.h"
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

// ------------------------------------------------------------------ fused 8-bit step
// How the 8-bit step kernel codes its states, its template argument kCodec; the launcher picks it from the
// maps' kinds (each lookup tensor's kDeviceMapKind) and the rounding.
enum StepCodec : int {
    kCodecGuided = 0,   // every state on the minifloat map of its rule's sign, guided by its old code: the default
    kCodecRunTime = 1,  // the same maps, each state to nearest or stochastically as the list says
    kCodecTables = 2,   // any maps: FloorTables in shared memory for table maps, any rounding (q8_cuda_tables.cuh)
};
constexpr int kStepThreads = 256;  // CUDA block size unless a quantization block needs more

// The 8 values of state k from its codes `c` and its block's stored maximum: from the codes' bits on a
// minifloat map, through the map in shared memory on a table map.
template <int kCodec>
__device__ __forceinline__ void decode_state(const uint32_t (&c)[2], float absmax, bool signed_rule, uint8_t kind,
                                             const FloorTable* t, float (&v)[kElems]) {
    if (kCodec != kCodecTables || kind != kMapTable) {
        if (kCodec != kCodecTables ? signed_rule : kind == kMapMinifloatSigned) mf_decode8<true>(c, absmax, v);
        else mf_decode8<false>(c, absmax, v);
        return;
    }
#pragma unroll
    for (int i = 0; i < kElems; ++i) v[i] = t->code[code_at(c, i)] * absmax;
}

// A thread's 8 values of one state (x) requantized through the map's tables on the block's maximum `absmax`
// (its bits `maxbits`): `positive`, the rule's kind of map for the state (a map of the other kind, like a
// block that is not finite or a map without a FloorTable, takes the exact path); packed into `out`.
__device__ __forceinline__ void requantize_by_table(const FloorTable& t, bool floor, bool positive, const uint32_t* lookup,
                                                   const float (&x)[kElems], uint32_t maxbits, float absmax, int mode,
                                                   uint32_t bits0, uint32_t mul, const uint32_t (&old)[2],
                                                   uint32_t (&out)[2]) {
    const float scale = q8_block_scale(absmax);
    uint32_t idx[kElems];
    const bool fast = floor && maxbits < 0x7F800000u && (t.positive_only != 0u) == positive;
    if (fast && mode == Q8_ROUND_BY_OLD_CODE) {
        if (positive) requantize_guided_code<true>(t, x, old, scale, bits0, mul, idx);
        else requantize_guided_code<false>(t, x, old, scale, bits0, mul, idx);
    } else if (fast && mode == Q8_ROUND_STOCHASTIC) {
        if (positive) requantize_stochastic<true>(t, x, scale, bits0, mul, idx);
        else requantize_stochastic<false>(t, x, scale, bits0, mul, idx);
    } else if (fast) {
        requantize_nearest(t, x, scale, idx);
    } else {
#pragma unroll
        for (int i = 0; i < kElems; ++i)
            idx[i] = round_exact(t.code, lookup, x[i], scale, mode, bits0 + (uint32_t)i * mul, code_at(old, i));
    }
#pragma unroll
    for (int j = 0; j < 2; ++j)
        out[j] = idx[4 * j] | (idx[4 * j + 1] << 8) | (idx[4 * j + 2] << 16) | (idx[4 * j + 3] << 24);
}

// Per tile, each thread's 8 values in one pass: load, decode, the rule, then per state the block's new
// maximum (reduced across the T threads of the block), its stored value, and each value's code, stored.
//
// The rule runs first on Q8Checked (q8_cuda_fastmath.cuh), its divisions and square roots on their fast
// paths; a warp where any lane had an operand off them runs it again on float from the parameter and
// gradient reloaded (nothing is stored before) and the states decoded again from their codes.
//
// Minifloat states are coded from their bits (q8_cuda_minifloat.cuh): in kCodecGuided and kCodecRunTime a
// block whose maximum is 0 or in [2^-100, 2^100] (all but blocks that are not finite or far out of range) by
// the integer arithmetic of mf_encode8, any other block value by value through q8_mf_code, as kCodecTables
// codes a minifloat map beside table maps (a rare form, kept short). Table maps are coded by their FloorTables
// (q8_cuda_tables.cuh).
//
// Registers: the fast path runs the rule on a thread's 8 values side by side, which takes more of them than
// one value at a time behind per-value branches did; each kernel is held to what lets a whole number of
// 256-thread CTAs share a multiprocessor: 64 for one state (4 CTAs), 80 for two (3), 128 for three (1).
template <class Rule, class P, class G, int kCodec>
__global__ void __maxnreg__(Rule::kStates > 2 ? 128 : Rule::kStates > 1 ? 80 : 64) step_kernel(const __grid_constant__ StepList list, const Rule rule) {
    constexpr int K = Rule::kStates;
    if (list_skipped(list)) return;
    __shared__ float red[1024 / 32];
    FloorTable* tab[K] = {};  // kCodecTables: the FloorTable of each table map, in shared memory
    bool floor[K] = {};        // and whether it is one (else that map's entries alone, for the exact path)
    if constexpr (kCodec == kCodecTables) {
        Q8_DYNAMIC_SHARED(FloorTable, tables);  // one per table map (list.table_slot)
#pragma unroll
        for (int k = 0; k < K; ++k)
            if (list.table_slot[k] >= 0) {
                tab[k] = tables + list.table_slot[k];
                floor[k] = load_table(list.lookup[k], list.code[k], *tab[k]);
            }
        __syncthreads();
    }

    const int T = list.threads_per_qblock, block_shift = list.block_shift;
    for_each_tile(list, [&](const StepSlot& a, int64_t tile_start) {
        P* param = static_cast<P*>(a.param);
        const G* grad = static_cast<const G*>(a.grad);
        const int64_t start = tile_start + (int64_t)threadIdx.x * kElems;
        const int64_t qblock = start >> block_shift;
        // a tensor's last tile may reach past its end: its lanes there (all 8 of a thread past it, cnt = 0) read
        // and write nothing, compute on zeros, and count for nothing in the maxima
        const bool live = start < a.numel;
        const int cnt = live ? (int)(a.numel - start < kElems ? a.numel - start : kElems) : 0;
        int8_t* corr = a.correction ? a.correction + start : nullptr;

        uint32_t codes[K][2];  // each state's old codes, packed (guided rounding reads them; a redone rule too)
        float am[K];           // and its block's stored maximum
#pragma unroll
        for (int k = 0; k < K; ++k) {
            load_codes8(static_cast<const uint8_t*>(a.state[k]) + start, codes[k], cnt, a.align_state);
            am[k] = live ? q8_absmax_load(a.absmax[k][qblock]) : 0.0f;
        }
        float p[kElems], g[kElems], s[K][kElems];
        auto inputs = [&]() {
            load_param8(param + start, p, cnt, a.align_param, corr);
            load8(grad + start, g, cnt, a.align_grad);
#pragma unroll
            for (int k = 0; k < K; ++k)
                decode_state<kCodec>(codes[k], am[k], ((Rule::kSigned >> k) & 1u) != 0u, list.map_kind[k], tab[k], s[k]);
        };
        inputs();
        if (!__all_sync(0xFFFFFFFFu, apply_rule_checked(rule, p, g, s))) {  // a division or root off its fast path
            inputs();
            apply_rule(rule, p, g, s);
        }
        store_param8(param + start, p, cnt, a.align_param, corr, list.stochastic, a.sr_key, a.sr_index + start);
        if (cnt < kElems) {  // a tensor's last pass: lanes past its end count for nothing in the maxima
#pragma unroll
            for (int i = 0; i < kElems; ++i)
#pragma unroll
                for (int k = 0; k < K; ++k)
                    if (i >= cnt) s[k][i] = 0.0f;
        }
        const uint32_t index = (uint32_t)(a.sr_index + start);
#pragma unroll
        for (int k = 0; k < K; ++k) {
            float local = 0.0f;
#pragma unroll
            for (int i = 0; i < kElems; ++i) local = q8_max_abs_nan(local, s[k][i]);
            // every thread takes part (shuffles, barriers); each rounds the same maximum the same way
            const float bmax = qblock_reduce(local, T, red, [](float x, float y) { return q8_max_abs_nan(x, y); });
            const uint32_t maxbits = __float_as_uint(bmax);
            const uint16_t stored = q8_absmax_store(bmax);
            if ((threadIdx.x & (T - 1)) == 0 && live) a.absmax[k][qblock] = stored;
            const float absmax = q8_absmax_load(stored);
            const int listed = list.rounding_modes[k];
            const int mode = kCodec == kCodecGuided ? Q8_ROUND_BY_OLD_CODE : listed;
            const uint32_t mul = q8_state_mul(k), bits0 = (a.state_key[k] + index) * mul;  // q8_state_bits
            const bool is_signed = ((Rule::kSigned >> k) & 1u) != 0u;
            const uint8_t kind = kCodec == kCodecTables ? list.map_kind[k] : is_signed ? kMapMinifloatSigned
                                                                                       : kMapMinifloatUnsigned;
            uint32_t out[2];
            if (kCodec != kCodecTables && mf_fast_block(maxbits)) {
                constexpr int kMode = kCodec == kCodecGuided ? Q8_ROUND_BY_OLD_CODE : -1;
                const float scale = q8_mf_scale_fast(absmax);
                const bool sr = mode == Q8_ROUND_STOCHASTIC;
                if (is_signed) mf_encode8<true, kMode>(s[k], scale, bits0, mul, codes[k], sr, out);
                else mf_encode8<false, kMode>(s[k], scale, bits0, mul, codes[k], sr, out);
            } else if (kind != kMapTable) {  // a block far out of range, or a minifloat map beside table maps
                mf_encode8_exact(kind == kMapMinifloatSigned, s[k], absmax, mode, bits0, mul, codes[k], out);
            } else {
                requantize_by_table(*tab[k], floor[k], !is_signed, list.lookup[k], s[k], maxbits, absmax, mode, bits0,
                                    mul, codes[k], out);
            }
            store_codes8(static_cast<uint8_t*>(a.state[k]) + start, out, cnt, a.align_state);
            if (a.error_sums != nullptr) {  // quantization telemetry: off by default, no host sync when on
                double err = 0.0, mag = 0.0, zeroed = 0.0;
#pragma unroll
                for (int i = 0; i < kElems; ++i)
                    if (i < cnt) {
                        const uint32_t c = code_at(out, i);
                        const float entry = kind != kMapTable ? q8_mf_value(c, kind == kMapMinifloatSigned) : tab[k]->code[c];
                        const float back = entry * absmax;
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
