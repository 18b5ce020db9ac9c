// Torch binding of the CPU kernels: argument checks, choice of instruction set, and the calls
// into the driver of that instruction set (isa_*.cpp).
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <cstdlib>
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

namespace ds_q8 {
namespace {

std::vector<std::string> supported_isas() {
    std::vector<std::string> out;
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512vbmi"))
        out.push_back("avx512");
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) out.push_back("avx2");
    out.push_back("scalar");
    return out;
}

void check_isa(const std::string& isa) {
    for (const auto& s : supported_isas())
        if (s == isa) return;
    TORCH_CHECK_VALUE(false, "isa must be one this CPU supports (", c10::Join(", ", supported_isas()), "), got '",
                      isa, "'");
}

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
// and the choices are checked by binding::check_stochastic_choices.
void set_rounding(StepArgs& a, bool has_keys, const std::vector<int64_t>& sr_keys, const std::vector<int64_t>& sr_index,
                  size_t t, bool params = true, const std::vector<bool>& states = {}) {
    if (!has_keys) return;
    a.stochastic = params;
    for (size_t k = 0; k < states.size(); ++k) a.stochastic_states[k] = states[k];
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
    }
    return a;
}

std::vector<HyperParam> hyper_params(const std::string& rule, const std::map<std::string, double>& hyper) {
    binding::check_settings(rule, hyper);
    std::vector<HyperParam> hp;
    for (const auto& kv : hyper) hp.push_back(HyperParam{kv.first.c_str(), kv.second});
    return hp;
}

void run_step(const std::string& isa, const std::string& rule, const std::vector<StepArgs>& args,
              const torch::Tensor& param, const torch::Tensor& grad) {
    if (args.empty()) return;
    const int count = (int)args.size();
    StepStatus st = isa == "avx512" ? step_avx512(args.data(), count)
                    : isa == "avx2" ? step_avx2(args.data(), count)
                                    : step_scalar(args.data(), count);
    TORCH_CHECK_VALUE(st.code != StepStatus::kMissingHyper, "update rule '", rule, "' needs hyperparameter '",
                      st.missing, "'");
    TORCH_CHECK_VALUE(st.code != StepStatus::kWrongStates, "update rule '", rule, "' keeps a different number of ",
                      "states than the ", args[0].num_states, " given");
    TORCH_CHECK_VALUE(st.code == StepStatus::kOk, "no CPU kernel for update rule '", rule, "' with param ",
                      param.scalar_type(), " and grad ", grad.scalar_type(),
                      " (grad must have the param's dtype or float32)");
}

void step(const std::string& isa, const std::string& rule, torch::Tensor param, const torch::Tensor& grad,
          std::vector<torch::Tensor> states, std::vector<torch::Tensor> absmax, std::vector<torch::Tensor> maps,
          std::vector<torch::Tensor> lookups, int64_t block_size, const std::map<std::string, double>& hyper,
          const std::vector<int64_t>& sr_keys, const std::vector<int64_t>& sr_index, bool stochastic_params,
          const std::vector<bool>& stochastic_states) {
    check_isa(isa);
    check_block_size(block_size);
    const auto hp = hyper_params(rule, hyper);
    std::vector<StepArgs> args{step_args(rule, param, grad, states, absmax, step_maps(maps, lookups), block_size, hp)};
    const bool has_keys = binding::check_rounding(sr_keys, sr_index, 1);
    binding::check_stochastic_choices(has_keys, stochastic_states, states.size());
    set_rounding(args[0], has_keys, sr_keys, sr_index, 0, stochastic_params, stochastic_states);
    if (args[0].numel == 0) args.clear();
    run_step(isa, rule, args, param, grad);
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
                                bool stochastic_params, const std::vector<bool>& stochastic_states,
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
    binding::check_stochastic_choices(has_keys, stochastic_states, step_map.k);
    std::vector<StepArgs> args;
    args.reserve(n);
    for (size_t t = 0; t < n; ++t) {
        StepArgs a = step_args(rule, params[t], grads[t], states[t], absmax[t], step_map, block_size, hp);
        check_same_dtypes(params, grads, t, "step_many");
        set_rounding(a, has_keys, sr_keys, sr_index, t, stochastic_params, stochastic_states);
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

// The step of many tensors in one call (one parallel loop over all their blocks).
void step_many(const std::string& isa, const std::string& rule, std::vector<torch::Tensor> params,
               std::vector<torch::Tensor> grads, std::vector<std::vector<torch::Tensor>> states,
               std::vector<std::vector<torch::Tensor>> absmax, std::vector<torch::Tensor> maps,
               std::vector<torch::Tensor> lookups, int64_t block_size, const std::map<std::string, double>& hyper,
               const std::vector<int64_t>& sr_keys, const std::vector<int64_t>& sr_index, bool stochastic_params,
               const std::vector<bool>& stochastic_states, const std::vector<torch::Tensor>& error_sums,
               const std::vector<torch::Tensor>& corrections) {
    check_isa(isa);
    const auto hp = hyper_params(rule, hyper);
    const auto args = nonempty(many_args(rule, params, grads, states, absmax, step_maps(maps, lookups), block_size, hp,
                                         sr_keys, sr_index, stochastic_params, stochastic_states, error_sums,
                                         corrections));
    if (params.empty()) return;
    run_step(isa, rule, args, params[0], grads[0]);
}

// The step of 4-bit Adam state (optim_bits=4, ds_q8/format4.py) over many tensors, each starting a block at
// an even element of its parameter: m_codes/v_codes packed two a byte (ceil(numel / 2) bytes), m_absmax
// bf16 and v_max float32 (one per block); maps: format4's M_MAP, M_MIDPOINTS, V_MAP, V_MIDPOINTS.
void step4_many(const std::string& isa, const std::string& rule, std::vector<torch::Tensor> params,
                std::vector<torch::Tensor> grads, std::vector<torch::Tensor> m_codes, std::vector<torch::Tensor> v_codes,
                std::vector<torch::Tensor> m_absmax, std::vector<torch::Tensor> v_max, std::vector<torch::Tensor> maps,
                int64_t block_size, const std::map<std::string, double>& hyper, const std::vector<int64_t>& sr_keys,
                const std::vector<int64_t>& sr_index, bool stochastic_params,
                const std::vector<torch::Tensor>& corrections) {
    check_isa(isa);
    check_block_size(block_size);
    TORCH_CHECK_VALUE(rule == "adam" || rule == "adamw", "4-bit state is Adam's: rule must be 'adam' or 'adamw', got '",
                      rule, "'");
    const size_t n = params.size();
    TORCH_CHECK_VALUE(grads.size() == n && m_codes.size() == n && v_codes.size() == n && m_absmax.size() == n &&
                          v_max.size() == n,
                      "params, grads, m_codes, v_codes, m_absmax and v_max must be lists of the same length, got ", n);
    const int64_t sizes[4] = {15, 14, 16, 15};
    TORCH_CHECK_VALUE(maps.size() == 4, "maps must be format4's M_MAP, M_MIDPOINTS, V_MAP and V_MIDPOINTS, got ",
                      maps.size(), " tensors");
    for (int i = 0; i < 4; ++i) {
        check_cpu_contiguous(maps[i], "maps");
        TORCH_CHECK_VALUE(maps[i].scalar_type() == torch::kFloat32 && maps[i].numel() == sizes[i], "maps[", i,
                          "] must be ", sizes[i], " float32 values, got ", maps[i].numel(), " of ", maps[i].scalar_type());
    }
    const bool corrected = binding::check_corrections(corrections, params, stochastic_params);
    const bool has_keys = binding::check_rounding(sr_keys, sr_index, n);
    const auto hp = hyper_params(rule, hyper);
    std::vector<StepArgs> args;
    args.reserve(n);
    for (size_t t = 0; t < n; ++t) {
        StepArgs a = tensor_args(rule, params[t], grads[t], 2, block_size, hp);
        check_same_dtypes(params, grads, t, "step4_many");
        const int64_t bytes = (a.numel + 1) / 2, nb = (a.numel + block_size - 1) / block_size;
        for (const torch::Tensor* c : {&m_codes[t], &v_codes[t]}) {
            check_cpu_contiguous(*c, "codes");
            TORCH_CHECK_VALUE(c->scalar_type() == torch::kUInt8 && c->numel() == bytes, "4-bit codes of ", a.numel,
                              " elements must be ", bytes, " uint8 bytes, got ", c->numel(), " of ", c->scalar_type());
        }
        check_cpu_contiguous(m_absmax[t], "m_absmax");
        check_cpu_contiguous(v_max[t], "v_max");
        TORCH_CHECK_VALUE(m_absmax[t].scalar_type() == torch::kBFloat16 && m_absmax[t].numel() == nb,
                          "m_absmax must be ", nb, " bfloat16 block maxima, got ", m_absmax[t].numel(), " of ",
                          m_absmax[t].scalar_type());
        TORCH_CHECK_VALUE(v_max[t].scalar_type() == torch::kFloat32 && v_max[t].numel() == nb, "v_max must be ", nb,
                          " float32 block maxima, got ", v_max[t].numel(), " of ", v_max[t].scalar_type());
        a.four_bit = true;
        a.codes[0] = m_codes[t].data_ptr<uint8_t>();
        a.codes[1] = v_codes[t].data_ptr<uint8_t>();
        a.absmax[0] = binding::absmax_bits(m_absmax[t]);
        a.v_max = v_max[t].data_ptr<float>();
        for (int i = 0; i < 4; ++i) a.four_maps[i] = maps[i].data_ptr<float>();
        set_rounding(a, has_keys, sr_keys, sr_index, t, stochastic_params);
        if (corrected) a.correction = corrections[t].data_ptr<int8_t>();
        if (a.numel > 0) args.push_back(a);
    }
    if (n == 0) return;
    run_step(isa, rule, args, params[0], grads[0]);
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

void step_fp32_many(const std::string& isa, const std::string& rule, std::vector<torch::Tensor> params,
                    std::vector<torch::Tensor> grads, std::vector<std::vector<torch::Tensor>> states,
                    const std::map<std::string, double>& hyper, const std::vector<int64_t>& sr_keys,
                    const std::vector<int64_t>& sr_index, const std::vector<torch::Tensor>& corrections) {
    check_isa(isa);
    const auto hp = hyper_params(rule, hyper);
    const auto args = nonempty(fp32_many_args(rule, params, grads, states, hp, sr_keys, sr_index, corrections));
    if (params.empty()) return;
    run_step(isa, rule, args, params[0], grads[0]);
}

// A step_many or step_fp32_many call whose tensors stay the same from step to step (the calls of a step
// plan, ds_q8/optim/plan.py): its params, states, maps and flags are converted and checked once, here,
// and each run takes only the gradients, the step scalars and the step's part of the rounding keys
// (rounding.step_key; each tensor's key is q8_mix32(q8_mix32(step_part ^ group_index) ^ param_index), as
// rounding.sr_key makes it). The params are read again at every run, so a param whose data was replaced
// in place of the same size is stepped where it now is.
class PreparedStep {
  public:
    PreparedStep(std::string rule, std::vector<torch::Tensor> params, std::vector<std::vector<torch::Tensor>> states,
                 std::vector<std::vector<torch::Tensor>> absmax, std::vector<torch::Tensor> maps,
                 std::vector<torch::Tensor> lookups, int64_t block_size, std::vector<int64_t> group_index,
                 std::vector<int64_t> param_index, bool stochastic_params, std::vector<bool> stochastic_states,
                 std::vector<torch::Tensor> corrections)
        : rule_(std::move(rule)), params_(std::move(params)), states_(std::move(states)), absmax_(std::move(absmax)),
          maps_(std::move(maps)), lookups_(std::move(lookups)), corrections_(std::move(corrections)) {
        const size_t n = params_.size();
        const bool keyed = !group_index.empty() || !param_index.empty();
        TORCH_CHECK_VALUE(!keyed || (group_index.size() == n && param_index.size() == n), "group_index and ",
                          "param_index must be empty or have one entry per param (", n, "), got ", group_index.size(),
                          " and ", param_index.size());
        for (size_t t = 0; keyed && t < n; ++t)
            TORCH_CHECK_VALUE(group_index[t] >= 0 && group_index[t] <= 0xFFFFFFFFLL && param_index[t] >= 0 &&
                                  param_index[t] <= 0xFFFFFFFFLL,
                              "group_index and param_index must be 32-bit unsigned, got ", group_index[t], " and ",
                              param_index[t]);
        const std::vector<int64_t> zeros(keyed ? n : 0, 0);
        // checked as a call with each param as its own gradient; the gradients are checked at every run
        if (absmax_.empty() && maps_.empty()) {
            TORCH_CHECK_VALUE(stochastic_states.empty(), "a step of float32 states has no stochastic_states");
            args_ = fp32_many_args(rule_, params_, params_, states_, {}, zeros, zeros, corrections_);
        } else {
            args_ = many_args(rule_, params_, params_, states_, absmax_, step_maps(maps_, lookups_), block_size, {},
                              zeros, zeros, stochastic_params, stochastic_states, {}, corrections_);
        }
        if (keyed) {
            group_index_.assign(group_index.begin(), group_index.end());
            param_index_.assign(param_index.begin(), param_index.end());
        }
    }

    void run(const std::string& isa, const std::vector<torch::Tensor>& grads,
             const std::map<std::string, double>& hyper, int64_t step_part) {
        check_isa(isa);
        const size_t n = params_.size();
        TORCH_CHECK_VALUE(grads.size() == n, "grads must have one tensor per param (", n, "), got ", grads.size());
        TORCH_CHECK_VALUE(step_part >= 0 && step_part <= 0xFFFFFFFFLL, "step_part must be 32-bit unsigned, got ",
                          step_part);
        const auto hp = hyper_params(rule_, hyper);
        const int threads = at::get_num_threads();
        std::vector<StepArgs> args;
        args.reserve(n);
        for (size_t t = 0; t < n; ++t) {
            const torch::Tensor& p = params_[t];
            const torch::Tensor& g = grads[t];
            StepArgs a = args_[t];
            check_cpu_contiguous(p, "param");
            check_cpu_contiguous(g, "grad");
            TORCH_CHECK_VALUE(p.numel() == a.numel && g.numel() == a.numel && dtype_of(p, "param") == a.param_dtype,
                              "param ", t, " changed since the step was prepared (", a.numel, " elements), or its ",
                              "grad does not match it: param ", p.numel(), " of ", p.scalar_type(), ", grad ",
                              g.numel(), " of ", g.scalar_type());
            TORCH_CHECK_VALUE(g.scalar_type() == grads[0].scalar_type(), "a prepared step needs one grad dtype; ",
                              "grad ", t, " is ", g.scalar_type(), ", grad 0 is ", grads[0].scalar_type());
            a.param = p.data_ptr();
            a.grad = g.data_ptr();
            a.grad_dtype = dtype_of(g, "grad");
            a.hyper = hp.data();
            a.num_hyper = (int)hp.size();
            a.num_threads = threads;
            if (!group_index_.empty())
                a.sr_key = q8_mix32(q8_mix32((uint32_t)step_part ^ group_index_[t]) ^ param_index_[t]);
            if (a.numel > 0) args.push_back(a);
        }
        if (n == 0) return;
        run_step(isa, rule_, args, params_[0], grads[0]);
    }

  private:
    std::string rule_;  // each StepArgs' rule points into it
    std::vector<torch::Tensor> params_;
    std::vector<std::vector<torch::Tensor>> states_, absmax_;  // held: args_ points into them
    std::vector<torch::Tensor> maps_, lookups_, corrections_;
    std::vector<uint32_t> group_index_, param_index_;  // empty: no rounding keys
    std::vector<StepArgs> args_;
};

// A prepared step's run, as a module function like the others (ds_q8.ops.call counts the calls).
void run_prepared(const std::string& isa, PreparedStep& prepared, const std::vector<torch::Tensor>& grads,
                  const std::map<std::string, double>& hyper, int64_t step_part) {
    prepared.run(isa, grads, hyper, step_part);
}

std::vector<torch::Tensor> quantize(const std::string& isa, const torch::Tensor& x, const torch::Tensor& code,
                                    const torch::Tensor& lookup, int64_t block_size) {
    check_isa(isa);
    check_block_size(block_size);
    check_cpu_contiguous(x, "x");
    check_map(code, lookup);
    auto codes = torch::empty(x.sizes(), x.options().dtype(torch::kUInt8));
    auto absmax = torch::empty({(x.numel() + block_size - 1) / block_size}, x.options().dtype(torch::kBFloat16));
    QuantizeArgs a{};
    a.x = const_cast<void*>(x.data_ptr());
    a.dtype = dtype_of(x, "x");
    a.numel = x.numel();
    a.block_size = block_size;
    a.codes = codes.data_ptr<uint8_t>();
    a.absmax = binding::absmax_bits(absmax);
    a.code = code.data_ptr<float>();
    a.lookup = reinterpret_cast<const uint32_t*>(lookup.data_ptr<int32_t>());
    a.fast = fast_map_for(code);
    a.num_threads = at::get_num_threads();
    if (isa == "avx512") quantize_avx512(a);
    else if (isa == "avx2") quantize_avx2(a);
    else quantize_scalar(a);
    return {codes, absmax};
}

// Dequantizes into `out` (any float dtype, contiguous, one value per code).
void dequantize_into(const std::string& isa, const torch::Tensor& codes, const torch::Tensor& absmax,
                     const torch::Tensor& code, int64_t block_size, const torch::Tensor& out) {
    check_isa(isa);
    check_block_size(block_size);
    check_codes(codes, absmax, codes.numel(), block_size, "codes");
    check_cpu_contiguous(code, "code");
    binding::check_code(code);
    check_cpu_contiguous(out, "out");
    TORCH_CHECK_VALUE(out.numel() == codes.numel(), "out must have one element per code (", codes.numel(), "), got ",
                      out.numel());
    QuantizeArgs a{};
    a.x = out.data_ptr();
    a.dtype = dtype_of(out, "out");
    a.numel = codes.numel();
    a.block_size = block_size;
    a.codes = const_cast<uint8_t*>(codes.data_ptr<uint8_t>());
    a.absmax = binding::absmax_bits(absmax);
    a.code = code.data_ptr<float>();
    a.num_threads = at::get_num_threads();
    if (isa == "avx512") dequantize_avx512(a);
    else if (isa == "avx2") dequantize_avx2(a);
    else dequantize_scalar(a);
}

torch::Tensor dequantize(const std::string& isa, const torch::Tensor& codes, const torch::Tensor& absmax,
                         const torch::Tensor& code, int64_t block_size, torch::ScalarType dtype) {
    auto out = torch::empty(codes.sizes(), codes.options().dtype(dtype));
    dequantize_into(isa, codes, absmax, code, block_size, out);
    return out;
}

// True when no element of `x` has an all-ones exponent (Inf or NaN): one read of the words, no
// temporary. torch's isfinite(g).all() writes and rereads a bool tensor a quarter of the size of an
// fp32 gradient and costs a sizeable part of a memory-bound 8-bit step.
template <class W>
bool words_finite(const W* x, int64_t n, W exponent) {
    int bad = 0;
    for (int64_t i = 0; i < n; ++i) bad |= (W)(x[i] & exponent) == exponent;  // vectorizes
    return bad == 0;
}

// 1 when no tensor holds NaN or Inf, 0 when one does; -1 (nothing read) when `lenient` and a tensor
// is not a contiguous float32/float16/bfloat16 CPU tensor, which otherwise is an error.
int finite_check(const std::vector<torch::Tensor>& tensors, bool lenient) {
    // Every tensor cut into chunks of 2^16 values; one parallel loop over all chunks of all tensors,
    // so that many small tensors cost one parallel region.
    constexpr int64_t kChunk = 1 << 16;
    struct Piece {
        const void* x;
        int64_t n;
        DType dtype;
    };
    std::vector<Piece> pieces;
    for (const auto& t : tensors) {
        if (lenient) {
            const auto s = t.scalar_type();
            if (!t.device().is_cpu() || !t.is_contiguous() ||
                (s != torch::kFloat32 && s != torch::kFloat16 && s != torch::kBFloat16))
                return -1;
        }
        check_cpu_contiguous(t, "tensor");
        const DType d = dtype_of(t, "tensor");
        const int64_t n = t.numel();
        const int width = d == DType::kFloat32 ? 4 : 2;
        for (int64_t s = 0; s < n; s += kChunk)
            pieces.push_back(Piece{static_cast<const char*>(t.data_ptr()) + s * width, std::min(kChunk, n - s), d});
    }
    const int64_t count = (int64_t)pieces.size();
    int bad = 0;
#pragma omp parallel for num_threads(at::get_num_threads()) schedule(static) reduction(| : bad)
    for (int64_t c = 0; c < count; ++c) {
        const Piece& q = pieces[c];
        bool ok;
        switch (q.dtype) {
            case DType::kFloat32: ok = words_finite(static_cast<const uint32_t*>(q.x), q.n, 0x7F800000u); break;
            case DType::kFloat16: ok = words_finite(static_cast<const uint16_t*>(q.x), q.n, (uint16_t)0x7C00); break;
            default: ok = words_finite(static_cast<const uint16_t*>(q.x), q.n, (uint16_t)0x7F80); break;
        }
        bad |= ok ? 0 : 1;
    }
    return bad == 0 ? 1 : 0;
}

bool all_finite(const std::vector<torch::Tensor>& tensors) { return finite_check(tensors, false) == 1; }

// The optimizers' check: -1 where it does not apply (the caller then asks torch), so that the
// tensors are looked at once, here, and not also in Python.
int all_finite_or_unknown(const std::vector<torch::Tensor>& tensors) { return finite_check(tensors, true); }

}  // namespace
}  // namespace ds_q8

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "ds_q8 CPU kernels: fused 8-bit block-wise optimizer steps and (de)quantization";
    m.def("supported_isas", &ds_q8::supported_isas, "instruction sets this CPU can run, best first");
    m.def("rules", &ds_q8::binding::rule_names, "update rules with a fused kernel (the kernel names of ds_q8.optim.rules)");
    m.def("state_signs", &ds_q8::binding::rule_signs, "per rule, whether each state is on a signed map");
    m.def("rule_settings", &ds_q8::binding::rule_settings, "per rule, the hyperparameters its kernels take");
    m.def("build_lookup", &ds_q8::binding::build_lookup, "nearest-code lookup table of a 256-entry map");
    m.def("limits", &ds_q8::binding::limits, "block-size bounds and state count, shared with ds_q8.functional");
    using pybind11::arg;
    // with keys: stochastic parameter writes unless stochastic_params=False, and the flagged states
    const auto params_sr = arg("stochastic_params") = true;
    const auto states_sr = arg("stochastic_states") = std::vector<bool>{};
    m.def("step", &ds_q8::step, "fused 8-bit optimizer step, in place", arg("isa"), arg("rule"), arg("param"),
          arg("grad"), arg("states"), arg("absmax"), arg("maps"), arg("lookups"), arg("block_size"), arg("hyper"),
          arg("sr_keys"), arg("sr_index"), params_sr, states_sr);
    m.def("step_many", &ds_q8::step_many, "fused 8-bit step of many tensors in one parallel loop, in place; "
          "error_sums (one float64 tensor of 3 per state for each param, or none) accumulate the requantization "
          "error and magnitude",
          arg("isa"), arg("rule"), arg("params"), arg("grads"), arg("states"), arg("absmax"), arg("maps"),
          arg("lookups"), arg("block_size"), arg("hyper"), arg("sr_keys"), arg("sr_index"), params_sr, states_sr,
          arg("error_sums") = std::vector<torch::Tensor>{}, arg("corrections") = std::vector<torch::Tensor>{});
    m.def("step_fp32_many", &ds_q8::step_fp32_many,
          "the same fused step for tensors with float32 states (optim_bits=32), in place; corrections: "
          "each bf16 param's correction bytes, or none",
          arg("isa"), arg("rule"), arg("params"), arg("grads"), arg("states"), arg("hyper"), arg("sr_keys"),
          arg("sr_index"), arg("corrections") = std::vector<torch::Tensor>{});
    pybind11::class_<ds_q8::PreparedStep>(m, "PreparedStep",
                                          "a step_many (absmax and maps given) or step_fp32_many call whose tensors "
                                          "stay the same, checked once; run it with run_prepared")
        .def(pybind11::init<std::string, std::vector<torch::Tensor>, std::vector<std::vector<torch::Tensor>>,
                            std::vector<std::vector<torch::Tensor>>, std::vector<torch::Tensor>,
                            std::vector<torch::Tensor>, int64_t, std::vector<int64_t>, std::vector<int64_t>, bool,
                            std::vector<bool>, std::vector<torch::Tensor>>(),
             arg("rule"), arg("params"), arg("states"), arg("absmax"), arg("maps"), arg("lookups"), arg("block_size"),
             arg("group_index"), arg("param_index"), params_sr, states_sr,
             arg("corrections") = std::vector<torch::Tensor>{});
    m.def("run_prepared", &ds_q8::run_prepared, "one step of a PreparedStep: each param's grad, the step scalars and "
          "the step's part of the rounding keys", arg("isa"), arg("prepared"), arg("grads"), arg("hyper"),
          arg("step_part"));
    m.def("step4_many", &ds_q8::step4_many,
          "fused step of 4-bit Adam state (ds_q8/format4.py) of many tensors in one parallel loop, in place",
          arg("isa"), arg("rule"), arg("params"), arg("grads"), arg("m_codes"), arg("v_codes"), arg("m_absmax"),
          arg("v_max"), arg("maps"), arg("block_size"), arg("hyper"), arg("sr_keys"), arg("sr_index"),
          arg("stochastic_params") = true, arg("corrections") = std::vector<torch::Tensor>{});
    m.def("all_finite", &ds_q8::all_finite, "True when no tensor (float32/float16/bfloat16) holds NaN or Inf");
    m.def("all_finite_or_unknown", &ds_q8::all_finite_or_unknown,
          "1 when no tensor holds NaN or Inf, 0 when one does, -1 when one is not a contiguous float CPU tensor");
    m.def("quantize", &ds_q8::quantize, "block-wise quantize: (codes, absmax)");
    m.def("dequantize", &ds_q8::dequantize, "block-wise dequantize to dtype");
    m.def("dequantize_into", &ds_q8::dequantize_into, "block-wise dequantize into a given tensor");
}
