// The boundary between the torch binding (q8_cuda.cpp, host compiler) and the CUDA driver
// (q8_cuda_kernels.cu, nvcc). Tensors are checked by the binding before they get here.
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <string>
#include <vector>

#include "../cpu/q8_fastmap.h"

namespace ds_q8 {

// The lookup tensor of the CUDA op (its build_lookup): the q8_build_lookup table, then the map's
// segment-search tables (a FastMap, kFastWords words, copied into shared memory by the kernels),
// then one word that is 1 when that FastMap is usable (0: the table answers every value).
constexpr int kDeviceLookupSize = kLookupSize + kFastWords + 1;

struct StepTensors {
    std::string rule;
    at::Tensor param, grad;
    std::vector<at::Tensor> states, absmax, maps, lookups;  // codes and block maxima per state; 256-entry maps
    int64_t block_size;
    bool stochastic;    // 16-bit params: write them with stochastic rounding (q8_store_sr)
    uint32_t sr_key;    // the hash key of this tensor's random bits
    int64_t sr_index;   // index of param[0] in its original parameter
};

void cuda_step(const StepTensors& t, const std::map<std::string, double>& hyper);
// the map itself is not needed: the lookup tensor (built from it) gives each value's nearest entry
void cuda_quantize(const at::Tensor& x, at::Tensor& codes, at::Tensor& absmax, const at::Tensor& lookup,
                   int64_t block_size);
void cuda_dequantize(const at::Tensor& codes, const at::Tensor& absmax, const at::Tensor& code, at::Tensor& out,
                     int64_t block_size);

}  // namespace ds_q8
