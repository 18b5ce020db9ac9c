// Torch binding of the CPU kernels: argument checks (q8_cpu_args.h), choice of instruction set, and the
// calls into the driver of that instruction set (isa_*.cpp).
#include <torch/extension.h>

#include <cstdlib>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "q8_binding.h"
#include "q8_common.h"
#include "q8_cpu_api.h"
#include "q8_cpu_args.h"
#include "q8_cpu_finite.h"

namespace ds_q8 {
namespace {

void check_isa(const std::string& isa) {
    for (const auto& s : supported_isas())
        if (s == isa) return;
    TORCH_CHECK_VALUE(false, "isa must be one this CPU supports (", c10::Join(", ", supported_isas()), "), got '",
                      isa, "'");
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
          const std::vector<int64_t>& rounding_modes) {
    check_isa(isa);
    check_block_size(block_size);
    const auto hp = hyper_params(rule, hyper);
    std::vector<StepArgs> args{step_args(rule, param, grad, states, absmax, step_maps(maps, lookups), block_size, hp)};
    const bool has_keys = binding::check_rounding(sr_keys, sr_index, 1);
    binding::check_rounding_modes(has_keys, rounding_modes, states.size());
    set_rounding(args[0], has_keys, sr_keys, sr_index, 0, stochastic_params, rounding_modes);
    if (args[0].numel == 0) args.clear();
    run_step(isa, rule, args, param, grad);
}

// The step of many tensors in one call (one parallel loop over all their blocks).
void step_many(const std::string& isa, const std::string& rule, std::vector<torch::Tensor> params,
               std::vector<torch::Tensor> grads, std::vector<std::vector<torch::Tensor>> states,
               std::vector<std::vector<torch::Tensor>> absmax, std::vector<torch::Tensor> maps,
               std::vector<torch::Tensor> lookups, int64_t block_size, const std::map<std::string, double>& hyper,
               const std::vector<int64_t>& sr_keys, const std::vector<int64_t>& sr_index, bool stochastic_params,
               const std::vector<int64_t>& rounding_modes, const std::vector<torch::Tensor>& error_sums,
               const std::vector<torch::Tensor>& corrections) {
    check_isa(isa);
    const auto hp = hyper_params(rule, hyper);
    const auto args = nonempty(many_args(rule, params, grads, states, absmax, step_maps(maps, lookups), block_size, hp,
                                         sr_keys, sr_index, stochastic_params, rounding_modes, error_sums,
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
                 std::vector<int64_t> param_index, bool stochastic_params, std::vector<int64_t> rounding_modes,
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
            TORCH_CHECK_VALUE(rounding_modes.empty(), "a step of float32 states has no rounding_modes");
            args_ = fp32_many_args(rule_, params_, params_, states_, {}, zeros, zeros, corrections_);
        } else {
            args_ = many_args(rule_, params_, params_, states_, absmax_, step_maps(maps_, lookups_), block_size, {},
                              zeros, zeros, stochastic_params, rounding_modes, {}, corrections_);
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
    a.map_kind = q8_map_kind(a.code);
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
    const auto states_sr = arg("rounding_modes") = std::vector<int64_t>{};
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
                            std::vector<int64_t>, std::vector<torch::Tensor>>(),
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
