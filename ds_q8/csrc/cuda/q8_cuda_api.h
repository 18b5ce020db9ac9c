// The boundary between the torch binding (q8_cuda.cpp, host compiler) and the CUDA driver
// (q8_cuda_kernels.cu and q8_cuda_step_<n>.cu, nvcc). Tensors are checked by the binding before they get here,
// and cross it as pointers and sizes: no translation unit that nvcc compiles includes ATen, whose headers
// would cost each of them more time than its kernels.
#pragma once

#include <stdint.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "../cpu/q8_fastmap.h"
#include "q8_common.h"  // Q8_MAX_STATES
#include "q8_floortable.h"

namespace ds_q8 {

// The lookup tensor of the CUDA op (its build_lookup): the q8_build_lookup table; the map's
// segment-search tables (a FastMap, kFastWords words, copied into shared memory by the quantize
// kernel) and one word that is 1 when that FastMap is usable; from the next 16-byte boundary the map's
// FloorTable (copied into shared memory by the step kernels) and one word that is 1 when it is usable
// (0: the lookup table answers every value).
// The word after it is the map's kind (q8_map_kind: a table, or one of the minifloat maps that the kernels
// code from their bits).
constexpr int kDeviceFloorOffset = (kLookupSize + kFastWords + 1 + 3) / 4 * 4;
constexpr int kDeviceFloorFlag = kDeviceFloorOffset + kFloorWords;
constexpr int kDeviceMapKind = kDeviceFloorFlag + 1;
constexpr int kDeviceLookupSize = kDeviceFloorFlag + 4;

// The element types the kernels read and write (the binding names any other and refuses it).
enum class Q8DType : uint8_t { kFloat32, kFloat16, kBFloat16, kOther };

// One tensor of a step: its parameter, gradient, states and their block maxima, as device pointers.
struct StepTensor {
    void* param = nullptr;
    const void* grad = nullptr;
    int64_t numel = 0;
    int states = 0;                        // how many the caller passed (the rule's count is checked here)
    void* state[Q8_MAX_STATES] = {};       // uint8 codes, or float32 states (fp32_states)
    void* absmax[Q8_MAX_STATES] = {};      // block maxima: bf16 bits (4-bit state's second moment: float32)
    double* error_sums = nullptr;          // telemetry: Q8_TELEMETRY_SUMS doubles per state, or null
    int8_t* correction = nullptr;          // bf16 params: their correction bytes, or null
};

// The step of many tensors that share a rule, dtypes, maps, block size and hyperparameters.
struct StepBatch {
    std::string rule;
    Q8DType param_dtype = Q8DType::kOther, grad_dtype = Q8DType::kOther;
    std::string param_dtype_name, grad_dtype_name;  // for errors
    std::vector<StepTensor> tensors;
    const float* maps[Q8_MAX_STATES] = {};         // per state: 256-entry map (8-bit)
    const uint32_t* lookups[Q8_MAX_STATES] = {};   // per state: its lookup tensor (8-bit)
    uint8_t map_kind[Q8_MAX_STATES] = {};          // per state: its lookup tensor's kDeviceMapKind (Q8MapKind)
    int64_t block_size = 0;                        // 8-bit states only
    bool fp32_states = false;
    bool stochastic = false;                       // 16-bit params: write them with stochastic rounding
    uint8_t rounding_modes[Q8_MAX_STATES] = {};    // how each 8-bit state is requantized (Q8_ROUND_*)
    bool has_keys = false;                         // sr_keys/sr_index given (needed by either kind)
    std::vector<int64_t> sr_keys, sr_index;        // per tensor when has_keys: hash key, index of param[0]
    const int32_t* skip = nullptr;                 // device flag: non-zero means the kernels write nothing
    // 4-bit Adam state (ds_q8/format4.py): state = {m codes, v codes} packed two a byte from an even
    // element, absmax = {m's bf16 maxima, v's float32 maxima}; four_maps the 60 floats of M_MAP,
    // M_MIDPOINTS, V_MAP and V_MIDPOINTS, end to end
    bool four_bit = false;
    const float* four_maps = nullptr;
    // A device copy of `bytes` host bytes, usable by work queued next on the current stream and kept until
    // the step's call returns (the binding gives it the caching allocators' memory).
    std::function<const void*(const void* host, size_t bytes)> upload;
};

// Launches on the current stream (of the device the binding has made current): one kernel for every
// tensor of the batch.
void cuda_step_many(const StepBatch& batch, const std::map<std::string, double>& hyper);
// the map itself is not needed: the lookup tensor (built from it) gives each value's nearest entry
void cuda_quantize(const void* x, Q8DType dtype, int64_t numel, uint8_t* codes, uint16_t* absmax,
                   const uint32_t* lookup, int64_t block_size);
void cuda_dequantize(const uint8_t* codes, const uint16_t* absmax, const float* code, void* out, Q8DType dtype,
                     int64_t numel, int64_t block_size);

}  // namespace ds_q8
