// Torch binding of the CUDA kernels: argument checks, then the launchers in q8_cuda_kernels.cu.
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <cstring>
#include <iterator>
#include <memory>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "q8_binding.h"
#include "q8_common.h"
#include "q8_cuda_api.h"
#include "q8_minifloat.h"

// Whether a tensor is where this op's kernels run. The tests' CPU execution harness (tests/cuda_sim)
// builds this file for CPU tensors by defining it as t.is_cpu().
#ifndef Q8_TENSOR_ON_DEVICE
#define Q8_TENSOR_ON_DEVICE(t) (t).is_cuda()
#endif

namespace ds_q8 {
namespace {

void check_cuda(const torch::Tensor& t, const char* name, const torch::Device& device) {
    TORCH_CHECK_VALUE(Q8_TENSOR_ON_DEVICE(t) && t.device() == device, name, " must be on ", device, ", got ", t.device());
    TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous");
}

using binding::absmax_bits;
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
// search's and the step's tables when the map has them.
torch::Tensor build_lookup(const torch::Tensor& code) {
    const torch::Tensor table = binding::build_lookup(code);  // checks the map
    auto out = torch::zeros({kDeviceLookupSize}, torch::kInt32);
    out.narrow(0, 0, kLookupSize).copy_(table);
    FastMap fast;
    if (q8_build_fastmap(code.data_ptr<float>(), &fast)) {
        std::memcpy(out.data_ptr<int32_t>() + kLookupSize, &fast, sizeof(FastMap));
        out.data_ptr<int32_t>()[kLookupSize + kFastWords] = 1;
    }
    auto floor = std::make_unique<FloorTable>();
    if (q8_build_floortable(code.data_ptr<float>(), floor.get())) {
        std::memcpy(out.data_ptr<int32_t>() + kDeviceFloorOffset, floor.get(), sizeof(FloorTable));
        out.data_ptr<int32_t>()[kDeviceFloorFlag] = 1;
    }
    out.data_ptr<int32_t>()[kDeviceMapKind] = q8_map_kind(code.data_ptr<float>());
    return out;
}

// The kind of map a lookup tensor was built for (its kDeviceMapKind word), which picks the step's kernel and
// its shared memory on the host. A word on the device costs a synchronisation to read, so it is read once
// per lookup tensor and kept while the tensor's storage lives with the same data (the optimizers build a
// map's table once and pass it every step); the kernels read the same word themselves where they decide per
// value (q8_cuda_kernels.cu's quantize).
uint8_t lookup_kind(const torch::Tensor& lookup) {
    struct Seen {
        c10::weak_intrusive_ptr<c10::StorageImpl> storage;
        const void* data;
        int64_t version;
        uint8_t kind;
    };
    static std::mutex mu;
    static std::map<const c10::StorageImpl*, Seen> seen;
    const c10::StorageImpl* key = lookup.storage().unsafeGetStorageImpl();
    const int64_t version = (int64_t)lookup._version();
    {
        std::lock_guard<std::mutex> lock(mu);
        const auto it = seen.find(key);
        if (it != seen.end() && !it->second.storage.expired() && it->second.data == lookup.data_ptr() &&
            it->second.version == version)
            return it->second.kind;
    }
    const int32_t word = lookup.narrow(0, kDeviceMapKind, 1).item<int32_t>();
    TORCH_CHECK_VALUE(word >= kMapTable && word <= kMapMinifloatUnsigned, "lookup must come from this op's "
                      "build_lookup: its map kind word is ", word);
    std::lock_guard<std::mutex> lock(mu);
    for (auto it = seen.begin(); it != seen.end();) it = it->second.storage.expired() ? seen.erase(it) : std::next(it);
    seen.insert_or_assign(key, Seen{lookup.storage().getWeakStorageImpl(), lookup.data_ptr(), version, (uint8_t)word});
    return (uint8_t)word;
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
    TORCH_CHECK_VALUE(k >= 1 && k <= Q8_MAX_STATES, "states must hold 1 to ", Q8_MAX_STATES, " tensors per param, ",
                      "got ", k);
    TORCH_CHECK_VALUE(absmax.size() == k && maps.size() == k && lookups.size() == k, "absmax, maps and lookups must ",
                      "hold one tensor per state (", k, "), got ", absmax.size(), ", ", maps.size(), " and ",
                      lookups.size());
    for (size_t i = 0; i < k; ++i) {
        check_codes(states[i], absmax[i], param.numel(), block_size, device);
        check_map(maps[i], &lookups[i], device);
    }
}

// The optional skip flag: one int32 on the tensors' device (a non-finite check's result, so
// that the decision never leaves the GPU). Returns its device pointer, or null.
const int32_t* skip_flag(const c10::optional<torch::Tensor>& skip, const torch::Device& device) {
    if (!skip.has_value()) return nullptr;
    check_cuda(*skip, "skip", device);
    TORCH_CHECK_VALUE(skip->scalar_type() == torch::kInt32 && skip->numel() == 1,
                      "skip must be one int32 value (non-zero: write nothing), got ", skip->numel(), " of ",
                      skip->scalar_type());
    return skip->data_ptr<int32_t>();
}

Q8DType dtype_of(torch::ScalarType t) {
    return t == torch::kFloat32 ? Q8DType::kFloat32 : t == torch::kFloat16 ? Q8DType::kFloat16
                                : t == torch::kBFloat16 ? Q8DType::kBFloat16 : Q8DType::kOther;
}

// A batch's lists, with the checks every list step shares: list lengths, dtypes (one kernel per
// call), the rounding lists. One StepTensor per parameter: the caller fills in the states, launch the rest.
StepBatch list_batch(const std::string& rule, const std::vector<torch::Tensor>& params,
                     const std::vector<torch::Tensor>& grads, size_t states, const std::vector<int64_t>& sr_keys,
                     const std::vector<int64_t>& sr_index, const char* what) {
    StepBatch b;
    b.rule = rule;
    b.sr_keys = sr_keys;
    b.sr_index = sr_index;
    const size_t n = params.size();
    TORCH_CHECK_VALUE(grads.size() == n && states == n, what, ": params, grads and states must be lists of the "
                      "same length, got ", n, ", ", grads.size(), " and ", states);
    for (size_t t = 0; t < n; ++t) binding::check_same_dtypes(params, grads, t, what);
    b.has_keys = binding::check_rounding(b.sr_keys, b.sr_index, n);
    b.stochastic = b.has_keys;
    b.tensors.resize(n);
    return b;
}

// Runs the batch (its tensors checked, at least one) on their device, current for the call. The launchers'
// tables go through the caching allocators (pinned host memory, then device memory on the current stream),
// kept until the kernels that read them are queued.
void launch(StepBatch& b, const std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& grads,
            const std::map<std::string, double>& hyper) {
    for (size_t t = 0; t < params.size(); ++t) {
        b.tensors[t].param = params[t].data_ptr();
        b.tensors[t].grad = grads[t].data_ptr();
        b.tensors[t].numel = params[t].numel();
    }
    b.param_dtype = dtype_of(params[0].scalar_type());
    b.grad_dtype = dtype_of(grads[0].scalar_type());
    b.param_dtype_name = c10::toString(params[0].scalar_type());
    b.grad_dtype_name = c10::toString(grads[0].scalar_type());
    const torch::Device device = params[0].device();
    const c10::cuda::CUDAGuard guard(device);
    std::vector<torch::Tensor> kept;
    b.upload = [&kept, &device](const void* data, size_t bytes) -> const void* {
        auto host = torch::empty({(int64_t)bytes}, torch::TensorOptions().dtype(torch::kUInt8)
                                                       .pinned_memory(!device.is_cpu()));
        std::memcpy(host.data_ptr<uint8_t>(), data, bytes);
        kept.push_back(device.is_cpu() ? host : host.to(device, torch::kUInt8, /*non_blocking=*/true));
        return kept.back().data_ptr();
    };
    cuda_step_many(b, hyper);
}

// The rounding choices of an 8-bit step (binding::check_rounding_modes) into the batch.
void set_choices(StepBatch& b, bool stochastic_params, const std::vector<int64_t>& rounding_modes, size_t k) {
    // before the flags are copied into the batch's Q8_MAX_STATES of them (check_step checks k >= 1 per tensor)
    TORCH_CHECK_VALUE(k <= (size_t)Q8_MAX_STATES, "maps must hold 1 to ", Q8_MAX_STATES, " tensors (one per state), ",
                      "got ", k);
    binding::check_rounding_modes(b.has_keys, rounding_modes, k);
    b.stochastic = b.has_keys && stochastic_params;
    for (size_t i = 0; i < rounding_modes.size(); ++i) b.rounding_modes[i] = (uint8_t)rounding_modes[i];
}

void step_many(const std::string& rule, std::vector<torch::Tensor> params, std::vector<torch::Tensor> grads,
               std::vector<std::vector<torch::Tensor>> states, std::vector<std::vector<torch::Tensor>> absmax,
               std::vector<torch::Tensor> maps, std::vector<torch::Tensor> lookups, int64_t block_size,
               const std::map<std::string, double>& hyper, const std::vector<int64_t>& sr_keys,
               const std::vector<int64_t>& sr_index, const c10::optional<torch::Tensor>& skip,
               bool stochastic_params, const std::vector<int64_t>& rounding_modes,
               const std::vector<torch::Tensor>& error_sums, const std::vector<torch::Tensor>& corrections) {
    check_block_size(block_size);
    if (binding::check_corrections(corrections, params, stochastic_params)) {
        for (const auto& c : corrections) check_cuda(c, "corrections", c.device());
    }
    StepBatch b = list_batch(rule, params, grads, states.size(), sr_keys, sr_index, "step_many");
    set_choices(b, stochastic_params, rounding_modes, maps.size());
    TORCH_CHECK_VALUE(error_sums.empty() || error_sums.size() == params.size(), "error_sums must be empty or have "
                      "one tensor per param (", params.size(), "), got ", error_sums.size());
    for (const auto& e : error_sums) {
        if (!params.empty()) check_cuda(e, "error_sums", params[0].device());
        TORCH_CHECK_VALUE(e.scalar_type() == torch::kFloat64 && e.numel() == Q8_TELEMETRY_SUMS * (int64_t)maps.size(),
                          "error_sums must be float64 tensors of ", Q8_TELEMETRY_SUMS, " values per state, got ",
                          e.numel(), " of ", e.scalar_type());
    }
    TORCH_CHECK_VALUE(absmax.size() == params.size(), "step_many: absmax must have one list per tensor (",
                      params.size(), "), got ", absmax.size());
    for (size_t t = 0; t < params.size(); ++t)
        check_step(params[t], grads[t], states[t], absmax[t], maps, lookups, block_size);
    if (params.empty()) return;
    b.skip = skip_flag(skip, params[0].device());
    for (size_t t = 0; t < params.size(); ++t) {
        StepTensor& in = b.tensors[t];
        in.states = (int)states[t].size();
        for (size_t k = 0; k < states[t].size(); ++k) {
            in.state[k] = states[t][k].data_ptr();
            in.absmax[k] = absmax_bits(absmax[t][k]);
        }
        if (!error_sums.empty()) in.error_sums = error_sums[t].data_ptr<double>();
        if (!corrections.empty()) in.correction = corrections[t].data_ptr<int8_t>();
    }
    for (size_t k = 0; k < maps.size(); ++k) {
        b.maps[k] = maps[k].data_ptr<float>();
        b.lookups[k] = reinterpret_cast<const uint32_t*>(lookups[k].data_ptr<int32_t>());
        b.map_kind[k] = lookup_kind(lookups[k]);
    }
    b.block_size = block_size;
    binding::check_settings(rule, hyper);
    launch(b, params, grads, hyper);
}

void step(const std::string& rule, torch::Tensor param, const torch::Tensor& grad, std::vector<torch::Tensor> states,
          std::vector<torch::Tensor> absmax, std::vector<torch::Tensor> maps, std::vector<torch::Tensor> lookups,
          int64_t block_size, const std::map<std::string, double>& hyper, const std::vector<int64_t>& sr_keys,
          const std::vector<int64_t>& sr_index, const c10::optional<torch::Tensor>& skip, bool stochastic_params,
          const std::vector<int64_t>& rounding_modes) {
    step_many(rule, {param}, {grad}, {states}, {absmax}, maps, lookups, block_size, hyper, sr_keys, sr_index, skip,
              stochastic_params, rounding_modes, {}, {});
}

// The same rules on float32 states (optim_bits=32, or tensors below min_8bit_size): states[t] are
// the rule's float32 states of tensor t, each with the param's number of elements.
void step_fp32_many(const std::string& rule, std::vector<torch::Tensor> params, std::vector<torch::Tensor> grads,
                    std::vector<std::vector<torch::Tensor>> states, const std::map<std::string, double>& hyper,
                    const std::vector<int64_t>& sr_keys, const std::vector<int64_t>& sr_index,
                    const c10::optional<torch::Tensor>& skip, const std::vector<torch::Tensor>& corrections) {
    const bool corrected = binding::check_corrections(corrections, params, false);
    TORCH_CHECK_VALUE(!corrected || sr_keys.empty(), "correction bytes replace stochastic rounding: pass no sr_keys");
    StepBatch b = list_batch(rule, params, grads, states.size(), sr_keys, sr_index, "step_fp32_many");
    if (params.empty()) return;
    const auto device = params[0].device();
    for (size_t t = 0; t < params.size(); ++t) {
        check_cuda(params[t], "param", device);
        check_cuda(grads[t], "grad", device);
        const int64_t n = params[t].numel();
        TORCH_CHECK_VALUE(grads[t].numel() == n, "grad has ", grads[t].numel(), " elements, param has ", n);
        TORCH_CHECK_VALUE(states[t].size() >= 1 && states[t].size() <= (size_t)Q8_MAX_STATES,
                          "states must hold 1 to ", Q8_MAX_STATES, " tensors per param, got ", states[t].size());
        for (const auto& st : states[t]) {
            check_cuda(st, "state", device);
            TORCH_CHECK_VALUE(st.scalar_type() == torch::kFloat32 && st.numel() == n, "state must be ", n,
                              " float32 values, got ", st.numel(), " of ", st.scalar_type());
        }
    }
    b.skip = skip_flag(skip, device);
    for (size_t t = 0; t < params.size(); ++t) {
        b.tensors[t].states = (int)states[t].size();
        for (size_t k = 0; k < states[t].size(); ++k) b.tensors[t].state[k] = states[t][k].data_ptr();
        if (!corrections.empty()) b.tensors[t].correction = corrections[t].data_ptr<int8_t>();
    }
    b.fp32_states = true;
    binding::check_settings(rule, hyper);
    launch(b, params, grads, hyper);
}

// The step of 4-bit Adam state (optim_bits=4, ds_q8/format4.py) of many tensors, each starting a block at an
// even element of its parameter: m_codes/v_codes packed two a byte, m_absmax bf16 and v_max float32 block
// maxima; maps: format4's M_MAP, M_MIDPOINTS, V_MAP and V_MIDPOINTS (on the device).
void step4_many(const std::string& rule, std::vector<torch::Tensor> params, std::vector<torch::Tensor> grads,
                std::vector<torch::Tensor> m_codes, std::vector<torch::Tensor> v_codes,
                std::vector<torch::Tensor> m_absmax, std::vector<torch::Tensor> v_max, std::vector<torch::Tensor> maps,
                int64_t block_size, const std::map<std::string, double>& hyper, const std::vector<int64_t>& sr_keys,
                const std::vector<int64_t>& sr_index, const c10::optional<torch::Tensor>& skip,
                bool stochastic_params, const std::vector<torch::Tensor>& corrections) {
    check_block_size(block_size);
    TORCH_CHECK_VALUE(rule == "adam" || rule == "adamw", "4-bit state is Adam's: rule must be 'adam' or 'adamw', got '",
                      rule, "'");
    if (binding::check_corrections(corrections, params, stochastic_params)) {
        for (const auto& c : corrections) check_cuda(c, "corrections", c.device());
    }
    const size_t n = params.size();
    TORCH_CHECK_VALUE(m_codes.size() == n && v_codes.size() == n && m_absmax.size() == n && v_max.size() == n,
                      "step4_many: m_codes, v_codes, m_absmax and v_max must have one tensor per param (", n, ")");
    StepBatch b = list_batch(rule, params, grads, n, sr_keys, sr_index, "step4_many");
    b.stochastic = b.has_keys && stochastic_params;
    if (params.empty()) return;
    const auto device = params[0].device();
    const int64_t sizes[4] = {15, 14, 16, 15};
    TORCH_CHECK_VALUE(maps.size() == 4, "maps must be format4's M_MAP, M_MIDPOINTS, V_MAP and V_MIDPOINTS, got ",
                      maps.size(), " tensors");
    for (int i = 0; i < 4; ++i) {
        check_cuda(maps[i], "maps", device);
        TORCH_CHECK_VALUE(maps[i].scalar_type() == torch::kFloat32 && maps[i].numel() == sizes[i], "maps[", i,
                          "] must be ", sizes[i], " float32 values, got ", maps[i].numel(), " of ", maps[i].scalar_type());
    }
    for (size_t t = 0; t < n; ++t) {
        check_cuda(params[t], "param", device);
        check_cuda(grads[t], "grad", device);
        const int64_t numel = params[t].numel(), bytes = (numel + 1) / 2, nb = (numel + block_size - 1) / block_size;
        TORCH_CHECK_VALUE(grads[t].numel() == numel, "grad has ", grads[t].numel(), " elements, param has ", numel);
        for (const torch::Tensor* c : {&m_codes[t], &v_codes[t]}) {
            check_cuda(*c, "codes", device);
            TORCH_CHECK_VALUE(c->scalar_type() == torch::kUInt8 && c->numel() == bytes, "4-bit codes of ", numel,
                              " elements must be ", bytes, " uint8 bytes, got ", c->numel(), " of ", c->scalar_type());
        }
        check_cuda(m_absmax[t], "m_absmax", device);
        check_cuda(v_max[t], "v_max", device);
        TORCH_CHECK_VALUE(m_absmax[t].scalar_type() == torch::kBFloat16 && m_absmax[t].numel() == nb,
                          "m_absmax must be ", nb, " bfloat16 block maxima, got ", m_absmax[t].numel(), " of ",
                          m_absmax[t].scalar_type());
        TORCH_CHECK_VALUE(v_max[t].scalar_type() == torch::kFloat32 && v_max[t].numel() == nb, "v_max must be ", nb,
                          " float32 block maxima, got ", v_max[t].numel(), " of ", v_max[t].scalar_type());
        StepTensor& in = b.tensors[t];
        in.states = 2;
        in.state[0] = m_codes[t].data_ptr();
        in.state[1] = v_codes[t].data_ptr();
        in.absmax[0] = absmax_bits(m_absmax[t]);
        in.absmax[1] = v_max[t].data_ptr<float>();
        if (!corrections.empty()) in.correction = corrections[t].data_ptr<int8_t>();
    }
    b.skip = skip_flag(skip, device);
    b.block_size = block_size;
    b.four_bit = true;
    const torch::Tensor four_maps = torch::cat(maps).contiguous();  // lives until the launch is queued
    b.four_maps = four_maps.data_ptr<float>();
    binding::check_settings(rule, hyper);
    launch(b, params, grads, hyper);
}

std::vector<torch::Tensor> quantize(const torch::Tensor& x, const torch::Tensor& code, const torch::Tensor& lookup,
                                    int64_t block_size) {
    check_block_size(block_size);
    check_cuda(x, "x", x.device());
    check_map(code, &lookup, x.device());
    TORCH_CHECK_VALUE(dtype_of(x.scalar_type()) != Q8DType::kOther, "x must be float32, float16 or bfloat16, got ",
                      x.scalar_type());
    auto codes = torch::empty(x.sizes(), x.options().dtype(torch::kUInt8));
    auto absmax = torch::empty({(x.numel() + block_size - 1) / block_size}, x.options().dtype(torch::kBFloat16));
    const c10::cuda::CUDAGuard guard(x.device());
    cuda_quantize(x.data_ptr(), dtype_of(x.scalar_type()), x.numel(), codes.data_ptr<uint8_t>(), absmax_bits(absmax),
                  reinterpret_cast<const uint32_t*>(lookup.data_ptr<int32_t>()), block_size);
    return {codes, absmax};
}

torch::Tensor dequantize(const torch::Tensor& codes, const torch::Tensor& absmax, const torch::Tensor& code,
                         int64_t block_size, torch::ScalarType dtype) {
    check_block_size(block_size);
    check_codes(codes, absmax, codes.numel(), block_size, codes.device());
    check_map(code, nullptr, codes.device());
    TORCH_CHECK_VALUE(dtype_of(dtype) != Q8DType::kOther, "dtype must be float32, float16 or bfloat16, got ", dtype);
    auto out = torch::empty(codes.sizes(), codes.options().dtype(dtype));
    const c10::cuda::CUDAGuard guard(codes.device());
    cuda_dequantize(codes.data_ptr<uint8_t>(), absmax_bits(absmax), code.data_ptr<float>(), out.data_ptr(),
                    dtype_of(dtype), codes.numel(), block_size);
    return out;
}

}  // namespace
}  // namespace ds_q8

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "ds_q8 CUDA kernels: fused 8-bit block-wise optimizer steps and (de)quantization";
    m.def("rules", &ds_q8::binding::rule_names, "update rules with a fused kernel (the kernel names of ds_q8.optim.rules)");
    m.def("state_signs", &ds_q8::binding::rule_signs, "per rule, whether each state is on a signed map");
    m.def("rule_settings", &ds_q8::binding::rule_settings, "per rule, the hyperparameters its kernels take");
    m.def("build_lookup", &ds_q8::build_lookup,
          "nearest-code lookup table and segment-search tables of a 256-entry map (CPU tensors)");
    m.def("limits", &ds_q8::binding::limits, "block-size bounds and state count, shared with ds_q8.functional");
    using pybind11::arg;
    const auto skip = arg("skip") = pybind11::none();
    // with keys: stochastic parameter writes unless stochastic_params=False, and the flagged states
    const auto params_sr = arg("stochastic_params") = true;
    const auto states_sr = arg("rounding_modes") = std::vector<int64_t>{};
    m.def("step", &ds_q8::step, "fused 8-bit optimizer step, in place", arg("rule"), arg("param"), arg("grad"),
          arg("states"), arg("absmax"), arg("maps"), arg("lookups"), arg("block_size"), arg("hyper"), arg("sr_keys"),
          arg("sr_index"), skip, params_sr, states_sr);
    m.def("step_many", &ds_q8::step_many,
          "fused 8-bit step of many tensors, in place: one launch for all of them; nothing is written when "
          "skip (one int32 on the device) is non-zero; corrections: each bf16 param's correction bytes, or none",
          arg("rule"), arg("params"), arg("grads"), arg("states"), arg("absmax"), arg("maps"), arg("lookups"),
          arg("block_size"), arg("hyper"), arg("sr_keys"), arg("sr_index"), skip, params_sr, states_sr,
          arg("error_sums") = std::vector<torch::Tensor>{}, arg("corrections") = std::vector<torch::Tensor>{});
    m.def("step_fp32_many", &ds_q8::step_fp32_many,
          "the same fused step for tensors with float32 states (optim_bits=32 or small tensors), in place",
          arg("rule"), arg("params"), arg("grads"), arg("states"), arg("hyper"), arg("sr_keys"), arg("sr_index"),
          skip, arg("corrections") = std::vector<torch::Tensor>{});
    m.def("step4_many", &ds_q8::step4_many,
          "fused step of 4-bit Adam state (ds_q8/format4.py) of many tensors, in place: one launch for all of them",
          arg("rule"), arg("params"), arg("grads"), arg("m_codes"), arg("v_codes"), arg("m_absmax"), arg("v_max"),
          arg("maps"), arg("block_size"), arg("hyper"), arg("sr_keys"), arg("sr_index"), skip, params_sr,
          arg("corrections") = std::vector<torch::Tensor>{});
    m.def("quantize", &ds_q8::quantize, "block-wise quantize: (codes, absmax)");
    m.def("dequantize", &ds_q8::dequantize, "block-wise dequantize to dtype");
}
