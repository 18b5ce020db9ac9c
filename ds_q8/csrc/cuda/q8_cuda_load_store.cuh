// Loads and stores of a thread's 8 values, and the maximum over the threads of a quantization block:
// what every kernel of the CUDA op builds on (q8_cuda_step.cuh's step kernels, q8_cuda_kernels.cu's
// quantize and dequantize).
#pragma once

#include <type_traits>

#include "q8_common.h"

namespace ds_q8 {
namespace {

constexpr int kElems = 8;          // elements per thread

// ------------------------------------------------------------------ loads and stores of 8 values
// Every per-thread array below is indexed only by constants once the fixed-trip loops are unrolled
// (`#pragma unroll` over kElems, the tail guarded by `if (i < cnt)`), so it lives in registers: no
// stack frame, no local memory (gpu_check/ptxas_report.py checks it).
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

// A thread's 8 codes as two words, code i in byte i % 4 of word i / 4 (codes past cnt read as 0), and back.
__device__ __forceinline__ void load_codes8(const uint8_t* p, uint32_t (&w)[2], int cnt, int align) {
    if (cnt == kElems && align >= 8) {
        const uint2 c = *reinterpret_cast<const uint2*>(p);
        w[0] = c.x, w[1] = c.y;
        return;
    }
    w[0] = w[1] = 0u;  // a view 4, 2 or 1 bytes off its alignment, or a tensor's last, partial pass
#pragma unroll
    for (int i = 0; i < kElems; ++i)
        if (i < cnt) w[i >> 2] |= (uint32_t)p[i] << (8 * (i & 3));
}

__device__ __forceinline__ void store_codes8(uint8_t* p, const uint32_t (&w)[2], int cnt, int align) {
    if (cnt == kElems && align >= 8) {
        *reinterpret_cast<uint2*>(p) = make_uint2(w[0], w[1]);
        return;
    }
#pragma unroll
    for (int i = 0; i < kElems; ++i)
        if (i < cnt) p[i] = (uint8_t)(w[i >> 2] >> (8 * (i & 3)));
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

}  // namespace
}  // namespace ds_q8
