// Torch binding of the CUDA kernels: argument checks, then the launchers in q8_cuda_kernels.cu.
#include <torch/extension.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "q8_binding.h"
#include "q8_common.h"
#include "q8_cuda_api.h"

namespace ds_q8 {
namespace {

void check_cuda(const torch::Tensor& t, const char* name, const torch::Device& device) {
    TORCH_CHECK_VALUE(t.is_cuda() && t.device() == device, name, " must be on ", device, ", got ", t.device());
    TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous");
}

using binding::check_block_size;

void check_map(const torch::Tensor& code, const torch::Tensor* lookup, const torch::Device& device) {
    check_cuda(code, "code", device);
    binding::check_code(code);
    if (lookup) {
        check_cuda(*lookup, "lookup", device);
        TORCH_CHECK_VALUE(lookup->scalar_type() == torch::kInt32 && lookup->numel() == kDeviceLookupSize,
                          "lookup must come from this op's build_lookup (", kDeviceLookupSize, " int32), got ",
                          lookup->numel(), " of ", lookup->scalar_type());
    }
}

// The lookup tensor of a map (CPU in and out; see kDeviceLookupSize): the table, then the segment
// search's tables when the map has them and DS_Q8_FAST_SEARCH is not 0.
torch::Tensor build_lookup(const torch::Tensor& code) {
    const torch::Tensor table = binding::build_lookup(code);  // checks the map
    auto out = torch::zeros({kDeviceLookupSize}, torch::kInt32);
    out.narrow(0, 0, kLookupSize).copy_(table);
    const char* env = std::getenv("DS_Q8_FAST_SEARCH");
    FastMap fast;
    if (!(env && std::string(env) == "0") && q8_build_fastmap(code.data_ptr<float>(), &fast)) {
        std::memcpy(out.data_ptr<int32_t>() + kLookupSize, &fast, sizeof(FastMap));
        out.data_ptr<int32_t>()[kLookupSize + kFastWords] = 1;
    }
    return out;
}

void check_codes(const torch::Tensor& codes, const torch::Tensor& absmax, int64_t numel, int64_t block_size,
                 const torch::Device& device) {
    check_cuda(codes, "codes", device);
    check_cuda(absmax, "absmax", device);
    binding::check_codes(codes, absmax, numel, block_size, "codes");
}

void check_step(const torch::Tensor& param, const torch::Tensor& grad, const std::vector<torch::Tensor>& states,
                const std::vector<torch::Tensor>& absmax, const std::vector<torch::Tensor>& maps,
                const std::vector<torch::Tensor>& lookups, int64_t block_size) {
    const auto device = param.device();
    check_cuda(param, "param", device);
    check_cuda(grad, "grad", device);
    TORCH_CHECK_VALUE(grad.numel() == param.numel(), "grad has ", grad.numel(), " elements, param has ",
                      param.numel());
    const size_t k = states.size();
    TORCH_CHECK_VALUE(k >= 1 && k <= Q8_MAX_STATES && absmax.size() == k && maps.size() == k && lookups.size() == k,
                      "states, absmax, maps and lookups must be lists of the same length 1 or 2");
    for (size_t i = 0; i < k; ++i) {
        check_codes(states[i], absmax[i], param.numel(), block_size, device);
        check_map(maps[i], &lookups[i], device);
    }
}

// Stochastic rounding of tensor t's parameter write (arguments checked by binding::check_rounding).
void set_rounding(StepTensors& s, const std::vector<int64_t>& sr_keys, const std::vector<int64_t>& sr_index, size_t t,
                  size_t n) {
    s.stochastic = binding::check_rounding(sr_keys, sr_index, n);
    s.sr_key = s.stochastic ? (uint32_t)sr_keys[t] : 0u;
    s.sr_index = s.stochastic ? sr_index[t] : 0;
}

void step(const std::string& rule, torch::Tensor param, const torch::Tensor& grad, std::vector<torch::Tensor> states,
          std::vector<torch::Tensor> absmax, std::vector<torch::Tensor> maps, std::vector<torch::Tensor> lookups,
          int64_t block_size, const std::map<std::string, double>& hyper, const std::vector<int64_t>& sr_keys,
          const std::vector<int64_t>& sr_index) {
    check_block_size(block_size);
    check_step(param, grad, states, absmax, maps, lookups, block_size);
    StepTensors s{rule, param, grad, states, absmax, maps, lookups, block_size};
    set_rounding(s, sr_keys, sr_index, 0, 1);
    cuda_step(s, hyper);
}

// Many tensors that share the rule, maps, block size and hyperparameters: all are checked first,
// then launched back to back on the current stream from C++ (no per-tensor Python work).
void step_many(const std::string& rule, std::vector<torch::Tensor> params, std::vector<torch::Tensor> grads,
               std::vector<std::vector<torch::Tensor>> states, std::vector<std::vector<torch::Tensor>> absmax,
               std::vector<torch::Tensor> maps, std::vector<torch::Tensor> lookups, int64_t block_size,
               const std::map<std::string, double>& hyper, const std::vector<int64_t>& sr_keys,
               const std::vector<int64_t>& sr_index) {
    check_block_size(block_size);
    const size_t n = params.size();
    TORCH_CHECK_VALUE(grads.size() == n && states.size() == n && absmax.size() == n,
                      "params, grads, states and absmax must be lists of the same length, got ", n, ", ",
                      grads.size(), ", ", states.size(), " and ", absmax.size());
    for (size_t t = 0; t < n; ++t) {
        check_step(params[t], grads[t], states[t], absmax[t], maps, lookups, block_size);
        // one dtype pair, so that a pair without a kernel fails on the first tensor, before any launch
        binding::check_same_dtypes(params, grads, t, "step_many");
    }
    std::vector<StepTensors> calls;
    for (size_t t = 0; t < n; ++t) {
        StepTensors s{rule, params[t], grads[t], states[t], absmax[t], maps, lookups, block_size};
        set_rounding(s, sr_keys, sr_index, t, n);  // checked for every tensor before any launch
        calls.push_back(s);
    }
    for (const StepTensors& s : calls)
        if (s.param.numel() > 0) cuda_step(s, hyper);
}

std::vector<torch::Tensor> quantize(const torch::Tensor& x, const torch::Tensor& code, const torch::Tensor& lookup,
                                    int64_t block_size) {
    check_block_size(block_size);
    check_cuda(x, "x", x.device());
    check_map(code, &lookup, x.device());
    auto codes = torch::empty(x.sizes(), x.options().dtype(torch::kUInt8));
    auto absmax = torch::empty({(x.numel() + block_size - 1) / block_size}, x.options().dtype(torch::kFloat32));
    cuda_quantize(x, codes, absmax, lookup, block_size);
    return {codes, absmax};
}

torch::Tensor dequantize(const torch::Tensor& codes, const torch::Tensor& absmax, const torch::Tensor& code,
                         int64_t block_size, torch::ScalarType dtype) {
    check_block_size(block_size);
    check_codes(codes, absmax, codes.numel(), block_size, codes.device());
    check_map(code, nullptr, codes.device());
    auto out = torch::empty(codes.sizes(), codes.options().dtype(dtype));
    cuda_dequantize(codes, absmax, code, out, block_size);
    return out;
}

}  // namespace
}  // namespace ds_q8

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "ds_q8 CUDA kernels: fused 8-bit block-wise optimizer steps and (de)quantization";
    m.def("rules", &ds_q8::binding::rule_names, "update rules with a fused kernel (Python update_rule names)");
    m.def("build_lookup", &ds_q8::build_lookup,
          "nearest-code lookup table and segment-search tables of a 256-entry map (CPU tensors)");
    m.def("limits", &ds_q8::binding::limits, "block-size bounds and state count, shared with ds_q8.functional");
    m.def("step", &ds_q8::step, "fused 8-bit optimizer step, in place");
    m.def("step_many", &ds_q8::step_many, "fused 8-bit step of many tensors from one call, in place");
    m.def("quantize", &ds_q8::quantize, "block-wise quantize: (codes, absmax)");
    m.def("dequantize", &ds_q8::dequantize, "block-wise dequantize to dtype");
}
