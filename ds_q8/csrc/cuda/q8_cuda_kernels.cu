// CUDA driver of the ds_q8 kernels: the (de)quantize kernels, and the step's dispatch to the
// translation units that compile the rules (q8_cuda_step.cuh says how the step works).
//
// Compiled with -fmad=false and without fast-math so that every operation rounds like torch's.
#include "q8_cuda_step.cuh"

namespace ds_q8 {
namespace {

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

// ------------------------------------------------------------------ nearest code
// The segment search of q8_fastmap.h (the function the CPU's scalar driver runs) with its tables in
// shared memory; values it cannot place exactly, and maps without the tables, go to the lookup table.
// The minifloat maps are coded from the values' bits instead (q8_minifloat.h), as the step codes them.
// `lookup` is a lookup tensor of kDeviceLookupSize words (see q8_cuda_api.h).
// Copies a map's FastMap into shared memory (every thread of the CUDA block takes part; the caller
// synchronizes) and returns whether the map has one (uniform across the grid).
__device__ __forceinline__ bool load_search(const uint32_t* lookup, FastMap& dst) {
    const uint32_t* src = lookup + kLookupSize;
    uint32_t* words = reinterpret_cast<uint32_t*>(&dst);
    for (int i = threadIdx.x; i < kFastWords; i += blockDim.x) words[i] = src[i];
    return __ldg(src + kFastWords) != 0u;
}

__device__ __forceinline__ uint32_t quantize_one(float x, float scale, bool fast, const FastMap& map,
                                                 const uint32_t* lookup) {
    const float y = x * scale;
    return fast ? q8_quantize_fast(y, map, lookup) : q8_quantize_scaled(y, lookup);
}

// ------------------------------------------------------------------ (de)quantize
template <class T>
__global__ void quantize_kernel(const T* __restrict__ x, uint8_t* __restrict__ codes, uint16_t* __restrict__ absmax,
                                const uint32_t* __restrict__ lookup, int64_t numel, int block_size, int Tq,
                                int x_align, int codes_align) {
    __shared__ float red[1024 / 32];
    __shared__ FastMap s_fast;
    const bool fast = load_search(lookup, s_fast);
    __syncthreads();
    const int64_t qblock = (int64_t)blockIdx.x * (blockDim.x / Tq) + threadIdx.x / Tq;
    const int64_t start = qblock * block_size + (int64_t)(threadIdx.x % Tq) * kElems;
    const int64_t nb = (numel + block_size - 1) / block_size;
    const bool live = qblock < nb && start < numel;
    const int cnt = live ? (int)(numel - start < kElems ? numel - start : kElems) : 0;
    float v[kElems];
#pragma unroll
    for (int i = 0; i < kElems; ++i) v[i] = 0.0f;
    if (live) load8(x + start, v, cnt, x_align);
    float local = 0.0f;
#pragma unroll
    for (int i = 0; i < kElems; ++i)
        if (i < cnt) local = q8_absmax_step(local, v[i]);
    const uint16_t stored = q8_absmax_store(qblock_absmax(local, Tq, red));
    if (!live) return;
    if (threadIdx.x % Tq == 0) absmax[qblock] = stored;
    uint32_t idx[kElems];
    const uint32_t kind = __ldg(lookup + kDeviceMapKind);  // a minifloat map: coded from the values' bits
    if (kind != kMapTable) {
        const float scale = q8_mf_scale(q8_absmax_load(stored));
#pragma unroll
        for (int i = 0; i < kElems; ++i)
            idx[i] = q8_mf_code(kind == kMapMinifloatSigned, v[i] * scale, Q8_ROUND_NEAREST, 0u, 0u);
    } else {
        const float scale = q8_block_scale(q8_absmax_load(stored));
#pragma unroll
        for (int i = 0; i < kElems; ++i) idx[i] = quantize_one(v[i], scale, fast, s_fast, lookup);
    }
    store_bits8(codes + start, idx, cnt, codes_align);
}

template <class T>
__global__ void dequantize_kernel(T* __restrict__ out, const uint8_t* __restrict__ codes,
                                  const uint16_t* __restrict__ absmax, const float* __restrict__ code, int64_t numel,
                                  int block_size, int out_align, int codes_align) {
    __shared__ float s_code[256];
    for (int i = threadIdx.x; i < 256; i += blockDim.x) s_code[i] = code[i];
    __syncthreads();
    const int64_t start = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * kElems;
    if (start >= numel) return;
    const int cnt = (int)(numel - start < kElems ? numel - start : kElems);
    uint32_t c[kElems];
    load_bits8(codes + start, c, cnt, codes_align);
    const float am = q8_absmax_load(absmax[start / block_size]);  // 8 elements never straddle a block (block_size % 8 == 0)
    float v[kElems];
#pragma unroll
    for (int i = 0; i < kElems; ++i) v[i] = s_code[c[i]] * am;
    store8(out + start, v, cnt, out_align);
}

}  // namespace

void cuda_step_many(const StepBatch& b, const std::map<std::string, double>& hyper) {
    if (b.tensors.empty()) return;
    static_assert(kStepParts == 8, "one call per part");
    if (step_in_part<0>(b, hyper) || step_in_part<1>(b, hyper) || step_in_part<2>(b, hyper) ||
        step_in_part<3>(b, hyper) || step_in_part<4>(b, hyper) || step_in_part<5>(b, hyper) ||
        step_in_part<6>(b, hyper) || step_in_part<7>(b, hyper))
        return;
    TORCH_CHECK_VALUE(false, "no CUDA kernel for update rule '", b.rule, "'");
}

void cuda_quantize(const void* x, Q8DType dtype, int64_t n, uint8_t* codes, uint16_t* absmax,
                   const uint32_t* lookup, int64_t block_size) {
    if (n == 0) return;
    const Geometry geo = geometry(n, block_size);
    const int x_align = alignment(x), codes_align = alignment(codes);
    auto stream = c10::cuda::getCurrentCUDAStream();
#define Q8_QUANTIZE(T)                                                                                       \
    Q8_LAUNCH(quantize_kernel<T>, (unsigned)geo.grid, geo.threads, 0, stream, static_cast<const T*>(x), codes, \
        absmax, lookup, n, (int)block_size, geo.threads_per_qblock, x_align, codes_align)
    switch (dtype) {  // (the binding refuses other dtypes)
        case Q8DType::kFloat32: Q8_QUANTIZE(float); break;
        case Q8DType::kFloat16: Q8_QUANTIZE(q8_half); break;
        case Q8DType::kBFloat16: Q8_QUANTIZE(q8_bf16); break;
        default: TORCH_CHECK_VALUE(false, "x must be float32, float16 or bfloat16");
    }
#undef Q8_QUANTIZE
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void cuda_dequantize(const uint8_t* codes, const uint16_t* absmax, const float* code, void* out, Q8DType dtype,
                     int64_t n, int64_t block_size) {
    if (n == 0) return;
    const int threads = kMinThreads;
    const int64_t grid = (n + (int64_t)threads * kElems - 1) / ((int64_t)threads * kElems);
    const int out_align = alignment(out), codes_align = alignment(codes);
    auto stream = c10::cuda::getCurrentCUDAStream();
#define Q8_DEQUANTIZE(T)                                                                                     \
    Q8_LAUNCH(dequantize_kernel<T>, (unsigned)grid, threads, 0, stream, static_cast<T*>(out), codes, absmax, code, \
        n, (int)block_size, out_align, codes_align)
    switch (dtype) {  // (the binding refuses other dtypes)
        case Q8DType::kFloat32: Q8_DEQUANTIZE(float); break;
        case Q8DType::kFloat16: Q8_DEQUANTIZE(q8_half); break;
        case Q8DType::kBFloat16: Q8_DEQUANTIZE(q8_bf16); break;
        default: TORCH_CHECK_VALUE(false, "dtype must be float32, float16 or bfloat16");
    }
#undef Q8_DEQUANTIZE
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace ds_q8
