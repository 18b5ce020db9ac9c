// The boundary between the torch binding (q8_cuda.cpp, host compiler) and the CUDA driver
// (q8_cuda_kernels.cu, nvcc). Tensors are checked by the binding before they get here.
#pragma once

#include <ATen/ATen.h>

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

// The step of many tensors that share a rule, dtypes, maps, block size and hyperparameters.
struct StepBatch {
    std::string rule;
    std::vector<at::Tensor> params, grads;
    std::vector<std::vector<at::Tensor>> states;  // per tensor: uint8 codes, or float32 states (fp32_states)
    std::vector<std::vector<at::Tensor>> absmax;  // per tensor, per state: block maxima (8-bit states only)
    std::vector<at::Tensor> maps, lookups;         // per state: 256-entry map and its lookup tensor (8-bit)
    uint8_t map_kind[Q8_MAX_STATES] = {};          // per state: its lookup tensor's kDeviceMapKind (Q8MapKind)
    int64_t block_size = 0;                        // 8-bit states only
    bool fp32_states = false;
    bool stochastic = false;                       // 16-bit params: write them with stochastic rounding
    uint8_t rounding_modes[Q8_MAX_STATES] = {}; // how each 8-bit state is requantized (Q8_ROUND_*)
    bool has_keys = false;                         // sr_keys/sr_index given (needed by either kind)
    std::vector<int64_t> sr_keys, sr_index;        // per tensor when has_keys: hash key, index of param[0]
    std::vector<at::Tensor> error_sums;            // empty, or per tensor: float64 [3 per state] (telemetry)
    std::vector<at::Tensor> corrections;           // empty, or per tensor: int8 correction bytes (bf16 params)
    const int32_t* skip = nullptr;                 // device flag: non-zero means the kernels write nothing
    // 4-bit Adam state (ds_q8/format4.py): states[t] = {m codes, v codes} packed two a byte from an even
    // element, absmax[t] = {m's bf16 maxima, v's float32 maxima}; four_maps the 60 floats of M_MAP,
    // M_MIDPOINTS, V_MAP and V_MIDPOINTS, end to end
    bool four_bit = false;
    at::Tensor four_maps;
};

// Launches on the current stream: one kernel for every tensor of the batch.
void cuda_step_many(const StepBatch& batch, const std::map<std::string, double>& hyper);
// the map itself is not needed: the lookup tensor (built from it) gives each value's nearest entry
void cuda_quantize(const at::Tensor& x, at::Tensor& codes, at::Tensor& absmax, const at::Tensor& lookup,
                   int64_t block_size);
void cuda_dequantize(const at::Tensor& codes, const at::Tensor& absmax, const at::Tensor& code, at::Tensor& out,
                     int64_t block_size);

}  // namespace ds_q8
