// The CPU binding's argument conversion: torch tensors and lists checked and turned into the driver's
// StepArgs (q8_cpu_api.h), with the tables derived from each map. Included by q8_cpu.cpp only.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "q8_binding.h"
#include "q8_common.h"
#include "q8_cpu_api.h"
#include "q8_fastmap.h"
#include "q8_floormap.h"
#include "q8_minifloat.h"

namespace ds_q8 {
namespace {

DType dtype_of(const torch::Tensor& t, const char* name) {
    switch (t.scalar_type()) {
        case torch::kFloat32: return DType::kFloat32;
        case torch::kFloat16: return DType::kFloat16;
        case torch::kBFloat16: return DType::kBFloat16;
        default: TORCH_CHECK_VALUE(false, name, " must be float32, float16 or bfloat16, got ", t.scalar_type());
    }
}

void check_cpu_contiguous(const torch::Tensor& t, const char* name) {
    TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be a CPU tensor, got ", t.device());
    TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous");
}

// The instruction sets this CPU runs, best first.
std::vector<std::string> supported_isas() {
    std::vector<std::string> out;
    __builtin_cpu_init();
#ifdef Q8_EMULATE_AVX512  // tests only: isa_avx512.cpp built on SIMDe (q8_avx512_emulation.h) runs anywhere
    out.push_back("avx512");
#else
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512vbmi"))
        out.push_back("avx512");
#endif
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) out.push_back("avx2");
    out.push_back("scalar");
    return out;
}

using binding::check_block_size;
using binding::check_same_dtypes;

void check_map(const torch::Tensor& code, const torch::Tensor& lookup) {
    check_cpu_contiguous(code, "code");
    check_cpu_contiguous(lookup, "lookup");
    binding::check_code(code);
    binding::check_lookup(lookup);
}

// Tables derived from a map (T: FastMap, q8_fastmap.h; FloorMap, q8_floormap.h), built once per distinct
// map and kept for the life of the process; null when the map has no such structure.
template <class T, bool (*Build)(const float*, T*)>
const T* tables_for(const torch::Tensor& code) {
    struct Entry {
        std::array<uint32_t, 256> bits;
        bool ok;
        T map;
    };
    static std::mutex mu;
    static std::deque<Entry> cache;  // a deque keeps addresses stable as it grows
    std::array<uint32_t, 256> key;
    std::memcpy(key.data(), code.data_ptr<float>(), sizeof(key));
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& e : cache)
        if (e.bits == key) return e.ok ? &e.map : nullptr;
    // Entries are never freed (a running step may hold one); past this many distinct maps, which
    // the optimizers never reach (they use at most four), the lookup table serves the rest.
    if (cache.size() >= 64) return nullptr;
    cache.emplace_back();
    Entry& e = cache.back();
    e.bits = key;
    e.ok = Build(code.data_ptr<float>(), &e.map);
    return e.ok ? &e.map : nullptr;
}

const FastMap* fast_map_for(const torch::Tensor& code) { return tables_for<FastMap, q8_build_fastmap>(code); }
const FloorMap* floor_map_for(const torch::Tensor& code) { return tables_for<FloorMap, q8_build_floormap>(code); }

void check_codes(const torch::Tensor& codes, const torch::Tensor& absmax, int64_t numel, int64_t block_size,
                 const char* name) {
    check_cpu_contiguous(codes, name);
    check_cpu_contiguous(absmax, "absmax");
    binding::check_codes(codes, absmax, numel, block_size, name);
}

// The maps of a step, checked once per call.
struct StepMaps {
    size_t k;
    const float* code[Q8_MAX_STATES];
    const uint32_t* lookup[Q8_MAX_STATES];
    const FastMap* fast[Q8_MAX_STATES];
    const FloorMap* floor[Q8_MAX_STATES];
    uint8_t kind[Q8_MAX_STATES];
};

StepMaps step_maps(const std::vector<torch::Tensor>& maps, const std::vector<torch::Tensor>& lookups) {
    const size_t k = maps.size();
    TORCH_CHECK_VALUE(k >= 1 && k <= Q8_MAX_STATES && lookups.size() == k, "maps and lookups must be lists of ",
                      "the same length, 1 to ", Q8_MAX_STATES, " (one per state), got ", k, " and ", lookups.size());
    StepMaps m{};
    m.k = k;
    for (size_t i = 0; i < k; ++i) {
        check_map(maps[i], lookups[i]);
        m.code[i] = maps[i].data_ptr<float>();
        m.lookup[i] = reinterpret_cast<const uint32_t*>(lookups[i].data_ptr<int32_t>());
        m.fast[i] = fast_map_for(maps[i]);
        m.floor[i] = floor_map_for(maps[i]);
        m.kind[i] = q8_map_kind(m.code[i]);
    }
    return m;
}

// The fields of one tensor's part of a step that do not depend on how its state is stored, checked.
StepArgs tensor_args(const std::string& rule, const torch::Tensor& param, const torch::Tensor& grad, size_t k,
                     int64_t block_size, const std::vector<HyperParam>& hp) {
    check_cpu_contiguous(param, "param");
    check_cpu_contiguous(grad, "grad");
    TORCH_CHECK_VALUE(grad.numel() == param.numel(), "grad has ", grad.numel(), " elements, param has ",
                      param.numel());
    StepArgs a{};
    a.rule = rule.c_str();
    a.param = param.data_ptr();
    a.grad = grad.data_ptr();
    a.param_dtype = dtype_of(param, "param");
    a.grad_dtype = dtype_of(grad, "grad");
    a.numel = param.numel();
    a.block_size = block_size;
    a.num_states = (int)k;
    a.hyper = hp.data();
    a.num_hyper = (int)hp.size();
    a.num_threads = at::get_num_threads();
    a.stochastic = false;
    return a;
}

// Stochastic rounding of tensor t: of its parameter write (`params`; with float32 states: whenever keys
// are given) and of the 8-bit states flagged in `states`. `has_keys` is binding::check_rounding's answer,
// asked once per call (asked per tensor, its check of every key made a call quadratic in the tensors),
// and the choices are checked by binding::check_rounding_modes.
void set_rounding(StepArgs& a, bool has_keys, const std::vector<int64_t>& sr_keys, const std::vector<int64_t>& sr_index,
                  size_t t, bool params = true, const std::vector<int64_t>& states = {}) {
    if (!has_keys) return;
    a.stochastic = params;
    for (size_t k = 0; k < states.size(); ++k) a.rounding_modes[k] = (uint8_t)states[k];
    a.sr_key = (uint32_t)sr_keys[t];
    a.sr_index = sr_index[t];
}

// One tensor's part of a step, checked. The maps, block size and hyperparameters are shared.
StepArgs step_args(const std::string& rule, const torch::Tensor& param, const torch::Tensor& grad,
                   const std::vector<torch::Tensor>& states, const std::vector<torch::Tensor>& absmax,
                   const StepMaps& maps, int64_t block_size, const std::vector<HyperParam>& hp) {
    const size_t k = maps.k;
    StepArgs a = tensor_args(rule, param, grad, k, block_size, hp);
    TORCH_CHECK_VALUE(states.size() == k && absmax.size() == k, "states and absmax must hold one tensor per ",
                      "state, as maps and lookups do (", k, "), got ", states.size(), " and ", absmax.size());
    for (size_t i = 0; i < k; ++i) {
        check_codes(states[i], absmax[i], a.numel, block_size, "state");
        a.codes[i] = states[i].data_ptr<uint8_t>();
        a.absmax[i] = binding::absmax_bits(absmax[i]);
        a.code[i] = maps.code[i];
        a.lookup[i] = maps.lookup[i];
        a.fast[i] = maps.fast[i];
        a.floor[i] = maps.floor[i];
        a.map_kind[i] = maps.kind[i];
    }
    return a;
}

std::vector<HyperParam> hyper_params(const std::string& rule, const std::map<std::string, double>& hyper) {
    binding::check_settings(rule, hyper);
    std::vector<HyperParam> hp;
    for (const auto& kv : hyper) hp.push_back(HyperParam{kv.first.c_str(), kv.second});
    return hp;
}
// The checked arguments of an 8-bit step of many tensors (step_many, PreparedStep), one per tensor, empty
// ones included. They share the rule, maps, block size and hyperparameters, and all params (and all grads)
// have one dtype. Everything is checked before anything is written.
std::vector<StepArgs> many_args(const std::string& rule, const std::vector<torch::Tensor>& params,
                                const std::vector<torch::Tensor>& grads,
                                const std::vector<std::vector<torch::Tensor>>& states,
                                const std::vector<std::vector<torch::Tensor>>& absmax, const StepMaps& step_map,
                                int64_t block_size, const std::vector<HyperParam>& hp,
                                const std::vector<int64_t>& sr_keys, const std::vector<int64_t>& sr_index,
                                bool stochastic_params, const std::vector<int64_t>& rounding_modes,
                                const std::vector<torch::Tensor>& error_sums,
                                const std::vector<torch::Tensor>& corrections) {
    check_block_size(block_size);
    const size_t n = params.size();
    const bool corrected = binding::check_corrections(corrections, params, stochastic_params);
    TORCH_CHECK_VALUE(error_sums.empty() || error_sums.size() == n, "error_sums must be empty or have one tensor per ",
                      "param (", n, "), got ", error_sums.size());
    TORCH_CHECK_VALUE(grads.size() == n && states.size() == n && absmax.size() == n,
                      "params, grads, states and absmax must be lists of the same length, got ", n, ", ",
                      grads.size(), ", ", states.size(), " and ", absmax.size());
    const bool has_keys = binding::check_rounding(sr_keys, sr_index, n);
    binding::check_rounding_modes(has_keys, rounding_modes, step_map.k);
    std::vector<StepArgs> args;
    args.reserve(n);
    for (size_t t = 0; t < n; ++t) {
        StepArgs a = step_args(rule, params[t], grads[t], states[t], absmax[t], step_map, block_size, hp);
        check_same_dtypes(params, grads, t, "step_many");
        set_rounding(a, has_keys, sr_keys, sr_index, t, stochastic_params, rounding_modes);
        if (corrected) a.correction = corrections[t].data_ptr<int8_t>();
        if (!error_sums.empty()) {
            const torch::Tensor& e = error_sums[t];
            check_cpu_contiguous(e, "error_sums");
            TORCH_CHECK_VALUE(e.scalar_type() == torch::kFloat64 && e.numel() == Q8_TELEMETRY_SUMS * (int64_t)step_map.k,
                              "error_sums must be float64 tensors of ", Q8_TELEMETRY_SUMS, " values per state, got ",
                              e.numel(), " of ", e.scalar_type());
            a.error_sums = e.data_ptr<double>();
        }
        args.push_back(a);
    }
    return args;
}

// The args of the tensors that have elements.
std::vector<StepArgs> nonempty(std::vector<StepArgs> args) {
    args.erase(std::remove_if(args.begin(), args.end(), [](const StepArgs& a) { return a.numel == 0; }), args.end());
    return args;
}

// The checked arguments of a step of tensors whose states are float32 (optim_bits=32, or tensors below
// min_8bit_size; step_fp32_many, PreparedStep), one per tensor, empty ones included: states[t] holds the
// 1 to Q8_MAX_STATES float32 states of tensor t, updated in place.
std::vector<StepArgs> fp32_many_args(const std::string& rule, const std::vector<torch::Tensor>& params,
                                     const std::vector<torch::Tensor>& grads,
                                     const std::vector<std::vector<torch::Tensor>>& states,
                                     const std::vector<HyperParam>& hp, const std::vector<int64_t>& sr_keys,
                                     const std::vector<int64_t>& sr_index,
                                     const std::vector<torch::Tensor>& corrections) {
    const size_t n = params.size();
    const bool corrected = binding::check_corrections(corrections, params, false);
    TORCH_CHECK_VALUE(!corrected || sr_keys.empty(), "correction bytes replace stochastic rounding: pass no sr_keys");
    TORCH_CHECK_VALUE(grads.size() == n && states.size() == n,
                      "params, grads and states must be lists of the same length, got ", n, ", ", grads.size(),
                      " and ", states.size());
    const bool has_keys = binding::check_rounding(sr_keys, sr_index, n);
    std::vector<StepArgs> args;
    args.reserve(n);
    for (size_t t = 0; t < n; ++t) {
        const torch::Tensor& param = params[t];
        const size_t k = states[t].size();
        TORCH_CHECK_VALUE(k >= 1 && k <= (size_t)Q8_MAX_STATES, "states must hold 1 to ", Q8_MAX_STATES,
                          " tensors per param, got ", k);
        TORCH_CHECK_VALUE(k == states[0].size(), "every tensor needs the same number of states; tensor 0 has ",
                          states[0].size(), ", tensor ", t, " has ", k);
        StepArgs a = tensor_args(rule, param, grads[t], k, 1, hp);
        check_same_dtypes(params, grads, t, "step_fp32_many");
        set_rounding(a, has_keys, sr_keys, sr_index, t);
        if (corrected) a.correction = corrections[t].data_ptr<int8_t>();
        a.fp32_states = true;
        for (size_t i = 0; i < k; ++i) {
            const torch::Tensor& st = states[t][i];
            check_cpu_contiguous(st, "state");
            TORCH_CHECK_VALUE(st.scalar_type() == torch::kFloat32 && st.numel() == param.numel(),
                              "a float32 state must have the param's ", param.numel(), " elements, got ",
                              st.numel(), " of ", st.scalar_type());
            a.states32[i] = st.data_ptr<float>();
        }
        args.push_back(a);
    }
    return args;
}

}  // namespace
}  // namespace ds_q8
