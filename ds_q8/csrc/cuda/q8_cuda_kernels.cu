// CUDA driver of the ds_q8 kernels.
//
// Geometry: every thread owns 8 consecutive elements (vector loads: 2 x float4 or 1 x uint4 for
// the parameter and gradient, 8 bytes of codes per state), so a quantization block of block_size
// elements is handled by T = block_size / 8 threads and a CUDA block of max(T, 256) threads holds
// one or more whole quantization blocks. The state never leaves registers: dequantize, update,
// reduce the new absmax across the T threads (warp shuffles, then shared memory when T > 32),
// requantize and store. Maps live in shared memory; the nearest-code lookup table (128 KiB,
// read-only, concentrated on few entries) is read through the read-only cache.
//
// Compiled with -fmad=false and without fast-math so that every operation rounds like torch's.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <map>
#include <string>
#include <vector>

#include "q8_common.h"
#include "q8_cuda_api.h"

namespace ds_q8 {
namespace {

constexpr int kElems = 8;          // elements per thread
constexpr int kMinThreads = 256;   // CUDA block size unless a quantization block needs more

struct Geometry {
    int threads_per_qblock;  // T
    int threads;             // CUDA block size
    int qblocks_per_cta;
    int64_t grid;
};

Geometry geometry(int64_t numel, int64_t block_size) {
    Geometry g;
    g.threads_per_qblock = (int)(block_size / kElems);
    g.threads = g.threads_per_qblock > kMinThreads ? g.threads_per_qblock : kMinThreads;
    g.qblocks_per_cta = g.threads / g.threads_per_qblock;
    const int64_t nb = (numel + block_size - 1) / block_size;
    g.grid = (nb + g.qblocks_per_cta - 1) / g.qblocks_per_cta;
    return g;
}

// ------------------------------------------------------------------ loads and stores of 8 values
__device__ __forceinline__ void load8(const float* p, float* v, int cnt, bool vec) {
    if (vec && cnt == kElems) {
        float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
        return;
    }
    for (int i = 0; i < kElems; ++i) v[i] = i < cnt ? p[i] : 0.0f;
}

template <class T>  // q8_half or q8_bf16: 8 x 16 bits in one uint4
__device__ __forceinline__ void load8(const T* p, float* v, int cnt, bool vec) {
    if (vec && cnt == kElems) {
        uint4 r = *reinterpret_cast<const uint4*>(p);
        const uint32_t w[4] = {r.x, r.y, r.z, r.w};
        for (int i = 0; i < 4; ++i) {
            v[2 * i] = q8_to_float(T{(uint16_t)(w[i] & 0xFFFFu)});
            v[2 * i + 1] = q8_to_float(T{(uint16_t)(w[i] >> 16)});
        }
        return;
    }
    for (int i = 0; i < kElems; ++i) v[i] = i < cnt ? q8_to_float(p[i]) : 0.0f;
}

__device__ __forceinline__ void store8(float* p, const float* v, int cnt, bool vec) {
    if (vec && cnt == kElems) {
        reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
        reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
        return;
    }
    for (int i = 0; i < cnt; ++i) p[i] = v[i];
}

template <class T>
__device__ __forceinline__ void store8(T* p, const float* v, int cnt, bool vec) {
    if (vec && cnt == kElems) {
        T h[kElems];
        for (int i = 0; i < kElems; ++i) q8_store(&h[i], v[i]);
        uint32_t w[4];
        for (int i = 0; i < 4; ++i) w[i] = (uint32_t)h[2 * i].x | ((uint32_t)h[2 * i + 1].x << 16);
        *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
        return;
    }
    for (int i = 0; i < cnt; ++i) q8_store(&p[i], v[i]);
}

__device__ __forceinline__ void load_codes(const uint8_t* c, uint8_t* out, int cnt, bool vec) {
    if (vec && cnt == kElems) {
        uint2 r = *reinterpret_cast<const uint2*>(c);
        for (int i = 0; i < 4; ++i) {
            out[i] = (uint8_t)(r.x >> (8 * i));
            out[4 + i] = (uint8_t)(r.y >> (8 * i));
        }
        return;
    }
    for (int i = 0; i < kElems; ++i) out[i] = i < cnt ? c[i] : 0;
}

__device__ __forceinline__ void store_codes(uint8_t* c, const uint32_t* idx, int cnt, bool vec) {
    if (vec && cnt == kElems) {
        uint2 r;
        r.x = idx[0] | (idx[1] << 8) | (idx[2] << 16) | (idx[3] << 24);
        r.y = idx[4] | (idx[5] << 8) | (idx[6] << 16) | (idx[7] << 24);
        *reinterpret_cast<uint2*>(c) = r;
        return;
    }
    for (int i = 0; i < cnt; ++i) c[i] = (uint8_t)idx[i];
}

// ------------------------------------------------------------------ block absmax
// NaN-propagating max of |x| over the T threads of one quantization block; every thread gets it.
// `red` holds one float per warp of the CUDA block.
__device__ __forceinline__ float qblock_absmax(float local, int T, float* red) {
    const int width = T < 32 ? T : 32;
    for (int off = width / 2; off > 0; off /= 2) local = q8_absmax_step(local, __shfl_xor_sync(0xFFFFFFFFu, local, off));
    if (T <= 32) return local;
    const int warp = threadIdx.x / 32, warps = T / 32, first = (threadIdx.x / T) * warps;
    if ((threadIdx.x & 31) == 0) red[warp] = local;
    __syncthreads();
    float m = red[first];
    for (int w = 1; w < warps; ++w) m = q8_absmax_step(m, red[first + w]);
    __syncthreads();  // `red` is reused by the next reduction
    return m;
}

__device__ __forceinline__ uint32_t quantize_one(float x, float scale, const uint32_t* lookup) {
    return q8_quantize_scaled(x * scale, lookup);
}

// ------------------------------------------------------------------ fused step
template <int K>
struct StepPointers {
    uint8_t* codes[2];
    float* absmax[2];
    const float* code[2];
    const uint32_t* lookup[2];
};

template <class Rule, class P, class G>
__global__ void step_kernel(P* __restrict__ param, const G* __restrict__ grad, StepPointers<Rule::kStates> st,
                            int64_t numel, int block_size, int T, bool vec, bool stochastic, uint32_t sr_key,
                            int64_t sr_index, Rule rule) {
    constexpr int K = Rule::kStates;
    __shared__ float s_code[K][256];
    __shared__ float red[1024 / 32];
    for (int i = threadIdx.x; i < 256 * K; i += blockDim.x) s_code[i / 256][i % 256] = st.code[i / 256][i % 256];
    __syncthreads();

    const int64_t qblock = (int64_t)blockIdx.x * (blockDim.x / T) + threadIdx.x / T;
    const int64_t start = qblock * block_size + (int64_t)(threadIdx.x % T) * kElems;
    const int64_t nb = (numel + block_size - 1) / block_size;
    const bool live = qblock < nb && start < numel;
    const int cnt = live ? (int)(numel - start < kElems ? numel - start : kElems) : 0;

    float p[kElems], g[kElems], s[K][kElems];
    float local[K];
    if (live) {
        load8(param + start, p, cnt, vec);
        load8(grad + start, g, cnt, vec);
        for (int k = 0; k < K; ++k) {
            uint8_t c[kElems];
            load_codes(st.codes[k] + start, c, cnt, vec);
            const float am = st.absmax[k][qblock];
            for (int i = 0; i < kElems; ++i) s[k][i] = s_code[k][c[i]] * am;
        }
        for (int i = 0; i < kElems; ++i) {
            float sv[K];
            for (int k = 0; k < K; ++k) sv[k] = s[k][i];
            rule(p[i], g[i], sv);
            for (int k = 0; k < K; ++k) s[k][i] = sv[k];
        }
        if (stochastic) {
            for (int i = 0; i < cnt; ++i)
                q8_store_sr(&param[start + i], p[i], q8_sr_bits(sr_key, (uint32_t)(sr_index + start + i)));
        } else {
            store8(param + start, p, cnt, vec);
        }
    }
    for (int k = 0; k < K; ++k) {
        local[k] = 0.0f;
        for (int i = 0; i < cnt; ++i) local[k] = q8_absmax_step(local[k], s[k][i]);
    }
    for (int k = 0; k < K; ++k) {
        const float absmax = qblock_absmax(local[k], T, red);
        if (!live) continue;
        if (threadIdx.x % T == 0) st.absmax[k][qblock] = absmax;
        const float scale = q8_block_scale(absmax);
        uint32_t idx[kElems];
        for (int i = 0; i < kElems; ++i) idx[i] = quantize_one(s[k][i], scale, st.lookup[k]);
        store_codes(st.codes[k] + start, idx, cnt, vec);
    }
}

// ------------------------------------------------------------------ (de)quantize
template <class T>
__global__ void quantize_kernel(const T* __restrict__ x, uint8_t* __restrict__ codes, float* __restrict__ absmax,
                                const uint32_t* __restrict__ lookup, int64_t numel, int block_size, int Tq, bool vec) {
    __shared__ float red[1024 / 32];
    const int64_t qblock = (int64_t)blockIdx.x * (blockDim.x / Tq) + threadIdx.x / Tq;
    const int64_t start = qblock * block_size + (int64_t)(threadIdx.x % Tq) * kElems;
    const int64_t nb = (numel + block_size - 1) / block_size;
    const bool live = qblock < nb && start < numel;
    const int cnt = live ? (int)(numel - start < kElems ? numel - start : kElems) : 0;
    float v[kElems];
    if (live) load8(x + start, v, cnt, vec);
    float local = 0.0f;
    for (int i = 0; i < cnt; ++i) local = q8_absmax_step(local, v[i]);
    const float am = qblock_absmax(local, Tq, red);
    if (!live) return;
    if (threadIdx.x % Tq == 0) absmax[qblock] = am;
    const float scale = q8_block_scale(am);
    uint32_t idx[kElems];
    for (int i = 0; i < kElems; ++i) idx[i] = quantize_one(v[i], scale, lookup);
    store_codes(codes + start, idx, cnt, vec);
}

template <class T>
__global__ void dequantize_kernel(T* __restrict__ out, const uint8_t* __restrict__ codes,
                                  const float* __restrict__ absmax, const float* __restrict__ code, int64_t numel,
                                  int block_size, bool vec) {
    __shared__ float s_code[256];
    for (int i = threadIdx.x; i < 256; i += blockDim.x) s_code[i] = code[i];
    __syncthreads();
    const int64_t start = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * kElems;
    if (start >= numel) return;
    const int cnt = (int)(numel - start < kElems ? numel - start : kElems);
    uint8_t c[kElems];
    load_codes(codes + start, c, cnt, vec);
    const float am = absmax[start / block_size];  // 8 elements never straddle a block (block_size % 8 == 0)
    float v[kElems];
    for (int i = 0; i < kElems; ++i) v[i] = s_code[c[i]] * am;
    store8(out + start, v, cnt, vec);
}

// ------------------------------------------------------------------ host side
bool aligned(const void* p, int bytes) { return (reinterpret_cast<uintptr_t>(p) % bytes) == 0; }

template <class Rule, class P, class G>
void launch_step(const StepTensors& t, const Rule& rule) {
    constexpr int K = Rule::kStates;
    const int64_t n = t.param.numel();
    const Geometry geo = geometry(n, t.block_size);
    StepPointers<K> st{};
    bool vec = aligned(t.param.data_ptr(), 16) && aligned(t.grad.data_ptr(), 16);
    for (int k = 0; k < K; ++k) {
        st.codes[k] = t.states[k].data_ptr<uint8_t>();
        st.absmax[k] = t.absmax[k].data_ptr<float>();
        st.code[k] = t.maps[k].data_ptr<float>();
        st.lookup[k] = reinterpret_cast<const uint32_t*>(t.lookups[k].data_ptr<int32_t>());
        vec = vec && aligned(st.codes[k], 8);
    }
    auto stream = c10::cuda::getCurrentCUDAStream();
    step_kernel<Rule, P, G><<<(unsigned)geo.grid, geo.threads, 0, stream>>>(
        reinterpret_cast<P*>(t.param.data_ptr()), reinterpret_cast<const G*>(t.grad.data_ptr()), st, n,
        (int)t.block_size, geo.threads_per_qblock, vec, t.stochastic, t.sr_key, t.sr_index, rule);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <class Rule>
bool launch_dtypes(const StepTensors& t, const Rule& rule) {
    const auto p = t.param.scalar_type(), g = t.grad.scalar_type();
    const auto f32 = at::kFloat, f16 = at::kHalf, bf16 = at::kBFloat16;
    if (p == f32 && g == f32) return launch_step<Rule, float, float>(t, rule), true;
    if (p == f16 && g == f16) return launch_step<Rule, q8_half, q8_half>(t, rule), true;
    if (p == bf16 && g == bf16) return launch_step<Rule, q8_bf16, q8_bf16>(t, rule), true;
    if (p == f16 && g == f32) return launch_step<Rule, q8_half, float>(t, rule), true;
    if (p == bf16 && g == f32) return launch_step<Rule, q8_bf16, float>(t, rule), true;
    return false;
}

}  // namespace

void cuda_step(const StepTensors& t, const std::map<std::string, double>& hyper) {
    if (t.param.numel() == 0) return;
    const c10::cuda::CUDAGuard guard(t.param.device());
    auto get = [&](const char* name) -> double {
        auto it = hyper.find(name);
        TORCH_CHECK_VALUE(it != hyper.end(), "update rule '", t.rule, "' needs hyperparameter '", name, "'");
        return it->second;
    };
#define Q8_TRY_RULE(NAME, RULE)                                                                              \
    if (t.rule == NAME) {                                                                                    \
        TORCH_CHECK_VALUE(t.states.size() == (size_t)RULE::kStates, "update rule '", t.rule, "' keeps ",     \
                          RULE::kStates, " states, got ", t.states.size());                                  \
        TORCH_CHECK_VALUE(launch_dtypes(t, RULE(get)), "no CUDA kernel for param ", t.param.scalar_type(),   \
                          " with grad ", t.grad.scalar_type(), " (grad must have the param's dtype or float32)"); \
        return;                                                                                              \
    }
    Q8_RULES(Q8_TRY_RULE)
#undef Q8_TRY_RULE
    TORCH_CHECK_VALUE(false, "no CUDA kernel for update rule '", t.rule, "'");
}

void cuda_quantize(const at::Tensor& x, at::Tensor& codes, at::Tensor& absmax, const at::Tensor& lookup,
                   int64_t block_size) {
    const int64_t n = x.numel();
    if (n == 0) return;
    const c10::cuda::CUDAGuard guard(x.device());
    const Geometry geo = geometry(n, block_size);
    const bool vec = aligned(x.data_ptr(), 16) && aligned(codes.data_ptr(), 8);
    auto stream = c10::cuda::getCurrentCUDAStream();
    const auto* lk = reinterpret_cast<const uint32_t*>(lookup.data_ptr<int32_t>());
#define Q8_QUANTIZE(T)                                                                                       \
    quantize_kernel<T><<<(unsigned)geo.grid, geo.threads, 0, stream>>>(                                      \
        reinterpret_cast<const T*>(x.data_ptr()), codes.data_ptr<uint8_t>(), absmax.data_ptr<float>(), lk, n, \
        (int)block_size, geo.threads_per_qblock, vec)
    switch (x.scalar_type()) {
        case at::kFloat: Q8_QUANTIZE(float); break;
        case at::kHalf: Q8_QUANTIZE(q8_half); break;
        case at::kBFloat16: Q8_QUANTIZE(q8_bf16); break;
        default: TORCH_CHECK_VALUE(false, "x must be float32, float16 or bfloat16, got ", x.scalar_type());
    }
#undef Q8_QUANTIZE
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void cuda_dequantize(const at::Tensor& codes, const at::Tensor& absmax, const at::Tensor& code, at::Tensor& out,
                     int64_t block_size) {
    const int64_t n = codes.numel();
    if (n == 0) return;
    const c10::cuda::CUDAGuard guard(codes.device());
    const int threads = kMinThreads;
    const int64_t grid = (n + (int64_t)threads * kElems - 1) / ((int64_t)threads * kElems);
    const bool vec = aligned(out.data_ptr(), 16) && aligned(codes.data_ptr(), 8);
    auto stream = c10::cuda::getCurrentCUDAStream();
#define Q8_DEQUANTIZE(T)                                                                                     \
    dequantize_kernel<T><<<(unsigned)grid, threads, 0, stream>>>(                                            \
        reinterpret_cast<T*>(out.data_ptr()), codes.data_ptr<uint8_t>(), absmax.data_ptr<float>(),          \
        code.data_ptr<float>(), n, (int)block_size, vec)
    switch (out.scalar_type()) {
        case at::kFloat: Q8_DEQUANTIZE(float); break;
        case at::kHalf: Q8_DEQUANTIZE(q8_half); break;
        case at::kBFloat16: Q8_DEQUANTIZE(q8_bf16); break;
        default: TORCH_CHECK_VALUE(false, "dtype must be float32, float16 or bfloat16, got ", out.scalar_type());
    }
#undef Q8_DEQUANTIZE
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace ds_q8
