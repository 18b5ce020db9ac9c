// The CUDA step kernels of the other state formats: 4-bit Adam state (q8_four.h) and float32 states.
// Part of q8_cuda_step.cuh, which includes it at its end: they walk the same tensor lists and apply the
// rules as its 8-bit step kernel does.
#pragma once

#include "q8_four.h"

namespace ds_q8 {
namespace {

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
__global__ void __maxnreg__(80) step4_kernel(const __grid_constant__ StepList list, const Rule rule) {
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

        // lanes past the tensor's end (cnt = 0) read and write nothing and compute on zeros
        const float m_absmax = live ? q8_absmax_load(a.absmax[0][qblock]) : 0.0f, vm = live ? v_max[qblock] : 0.0f;
        uint32_t cm[kElems], cv[kElems];
        float p[kElems], g[kElems], s[2][kElems];
        // the parameter, gradient and states (read again by a rerun, rather than kept in registers through
        // the rule); square roots on their fast path where `ok` is given (it says whether they were exact:
        // q8_cuda_fastmath.cuh), else sqrtf
        auto inputs = [&](bool* ok) {
            load_param8(param + start, p, cnt, a.align_param, corr);
            load8(grad + start, g, cnt, a.align_grad);
            load_nibbles8(m_bytes + start / 2, cm, cnt, a.align_state);
            load_nibbles8(v_bytes + start / 2, cv, cnt, a.align_state);
#pragma unroll
            for (int i = 0; i < kElems; ++i) {
                s[1][i] = f.v_map[cv[i]] * vm;
                s[0][i] = (f.m_map[cm[i]] * m_absmax) * (ok ? q8_sqrt_checked(s[1][i], *ok) : sqrtf(s[1][i]));
            }
        };
        bool ok = true;
        inputs(&ok);
        ok = apply_rule_checked(rule, p, g, s) && ok;
        if (!__all_sync(0xFFFFFFFFu, ok)) {  // a division or root off its fast path: the warp's exact rerun
            inputs(nullptr);
            apply_rule(rule, p, g, s);
        }
        store_param8(param + start, p, cnt, a.align_param, corr, list.stochastic, a.sr_key, a.sr_index + start);
        float local = 0.0f;
#pragma unroll
        for (int i = 0; i < kElems; ++i)
            if (i < cnt) local = q8_absmax_step(local, s[1][i]);
        const float vmax = qblock_absmax(local, T, red);  // every thread takes part
        const float vs = q8_block_scale(vmax);
        float r[kElems];
        // r = m / sqrt(v requantized), 0 where that root is 0 (then the quotient does not count)
        auto ratios = [&](bool* ok) {
#pragma unroll
            for (int i = 0; i < kElems; ++i) {
                cv[i] = count_below16(s_mid[1], 15, s[1][i] * vs);
                const float v = f.v_map[cv[i]] * vmax;
                bool exact = true;
                const float root = ok ? q8_sqrt_checked(v, exact) : sqrtf(v);
                const float q = ok ? q8_div_checked(s[0][i], root, exact) : s[0][i] / root;
                r[i] = root > 0.0f ? q : 0.0f;
                if (ok) *ok = *ok && (exact || !(root > 0.0f));
            }
        };
        ok = true;
        ratios(&ok);
        if (!__all_sync(0xFFFFFFFFu, ok)) {  // the same, for the ratios
            ratios(nullptr);
        }
        local = 0.0f;
#pragma unroll
        for (int i = 0; i < kElems; ++i)
            if (i < cnt) local = q8_absmax_step(local, r[i]);
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

}  // namespace
}  // namespace ds_q8
