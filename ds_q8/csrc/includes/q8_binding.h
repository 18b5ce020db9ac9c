// What the CPU and CUDA torch bindings share: argument checks with the messages users see, the
// list of fused update rules, and the lookup-table builder. Host code; include after torch.
#pragma once

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "q8_common.h"
#include "q8_rules.h"

namespace ds_q8 {
namespace binding {

inline void check_block_size(int64_t block_size) {
    TORCH_CHECK_VALUE(block_size >= Q8_MIN_BLOCK && block_size <= Q8_MAX_BLOCK && (block_size & (block_size - 1)) == 0,
                      "block_size must be a power of two in [", Q8_MIN_BLOCK, ", ", Q8_MAX_BLOCK, "], got ", block_size);
}

inline void check_code(const torch::Tensor& code) {
    TORCH_CHECK_VALUE(code.scalar_type() == torch::kFloat32 && code.numel() == 256 && code.is_contiguous(),
                      "code must be 256 contiguous float32 values, got ", code.numel(), " of ", code.scalar_type());
}

inline void check_lookup(const torch::Tensor& lookup) {
    TORCH_CHECK_VALUE(lookup.scalar_type() == torch::kInt32 && lookup.numel() == kLookupSize && lookup.is_contiguous(),
                      "lookup must come from build_lookup (", kLookupSize, " int32), got ", lookup.numel(), " of ",
                      lookup.scalar_type());
}

inline void check_codes(const torch::Tensor& codes, const torch::Tensor& absmax, int64_t numel, int64_t block_size,
                        const char* name) {
    TORCH_CHECK_VALUE(codes.is_contiguous() && absmax.is_contiguous(), name, " and absmax must be contiguous");
    TORCH_CHECK_VALUE(codes.scalar_type() == torch::kUInt8 && codes.numel() == numel, name, " must be ", numel,
                      " uint8 codes, got ", codes.numel(), " of ", codes.scalar_type());
    const int64_t nb = (numel + block_size - 1) / block_size;
    TORCH_CHECK_VALUE(absmax.scalar_type() == torch::kBFloat16 && absmax.numel() == nb, "absmax must be ", nb,
                      " bfloat16 block maxima for ", numel, " elements with block_size=", block_size, ", got ",
                      absmax.numel(), " of ", absmax.scalar_type());
}

// The bits of stored block maxima (bf16, checked by check_codes or allocated as such).
inline uint16_t* absmax_bits(const torch::Tensor& absmax) {
    return reinterpret_cast<uint16_t*>(const_cast<at::BFloat16*>(absmax.data_ptr<at::BFloat16>()));
}

// A call over many tensors needs one param dtype and one grad dtype (the kernel is chosen once).
inline void check_same_dtypes(const std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& grads,
                              size_t t, const char* what) {
    TORCH_CHECK_VALUE(params[t].scalar_type() == params[0].scalar_type() &&
                          grads[t].scalar_type() == grads[0].scalar_type(),
                      what, " needs one param dtype and one grad dtype; tensor ", t, " has ", params[t].scalar_type(),
                      "/", grads[t].scalar_type(), ", tensor 0 has ", params[0].scalar_type(), "/",
                      grads[0].scalar_type());
}

// Per rule, which of its states are on a signed map (each functor's kSigned; ds_q8.optim.rules has them
// as Rule.state_signed, and a test ties the two).
inline std::map<std::string, std::vector<bool>> rule_signs() {
    std::map<std::string, std::vector<bool>> out;
#define Q8_RULE_SIGNS(NAME, RULE)                                                    \
    for (int k = 0; k < RULE::kStates; ++k) out[NAME].push_back(((RULE::kSigned >> k) & 1u) != 0u);
    Q8_RULES(Q8_RULE_SIGNS)
#undef Q8_RULE_SIGNS
    return out;
}

// A step's settings are exactly the names rule `rule`'s functor reads (its constructor, run with a getter
// that records each name): a name it does not read, a misspelt or misplaced setting that would otherwise
// be ignored, is an error that names it, and so is a name it reads that `hyper` lacks. An unknown rule is
// left to the caller's own message.
// The names rule `rule`'s functor reads, in the order it reads them (its constructor, run with a getter
// that records each name and answers from `hyper`); `known` says whether the rule exists.
inline std::vector<std::string> settings_read(const std::string& rule, const std::map<std::string, double>& hyper,
                                              bool* known) {
    std::vector<std::string> read;
    auto get = [&](const char* name) -> double {
        if (std::find(read.begin(), read.end(), name) == read.end()) read.emplace_back(name);
        const auto it = hyper.find(name);
        return it == hyper.end() ? 0.0 : it->second;
    };
    *known = false;
#define Q8_RULE_READS(NAME, RULE)         \
    if (!*known && rule == NAME) {        \
        *known = true;                    \
        (void)RULE(get);                  \
    }
    Q8_RULES(Q8_RULE_READS)
#undef Q8_RULE_READS
    return read;
}

// Per rule, the hyperparameters its kernels take (what ds_q8.ops hands them of a step's scalars).
inline std::map<std::string, std::vector<std::string>> rule_settings() {
    std::map<std::string, std::vector<std::string>> out;
    bool known = false;
#define Q8_RULE_SETTINGS(NAME, RULE) out[NAME] = settings_read(NAME, {}, &known);
    Q8_RULES(Q8_RULE_SETTINGS)
#undef Q8_RULE_SETTINGS
    return out;
}

// A step's hyperparameters are exactly the names its rule's functor reads: a name it does not read (a
// misspelt or misplaced setting that would otherwise be ignored) is an error that names it, and so is a
// name it reads that `hyper` lacks. An unknown rule is left to the caller's own message.
inline void check_settings(const std::string& rule, const std::map<std::string, double>& hyper) {
    bool known = false;
    const std::vector<std::string> read = settings_read(rule, hyper, &known);
    if (!known) return;
    for (const auto& name : read)
        TORCH_CHECK_VALUE(hyper.count(name) != 0, "update rule '", rule, "' needs hyperparameter '", name, "'");
    std::string names;
    for (const auto& name : read) names += (names.empty() ? "'" : ", '") + name + "'";
    for (const auto& kv : hyper)
        TORCH_CHECK_VALUE(std::find(read.begin(), read.end(), kv.first) != read.end(), "update rule '", rule,
                          "' has no hyperparameter '", kv.first, "'; it reads ", names);
}

inline std::vector<std::string> rule_names() {
    std::vector<std::string> names;
#define Q8_RULE_NAME(NAME, RULE) names.push_back(NAME);
    Q8_RULES(Q8_RULE_NAME)
#undef Q8_RULE_NAME
    return names;
}

// The nearest-code table of a map, built on the host (CPU tensor in and out).
inline torch::Tensor build_lookup(const torch::Tensor& code) {
    TORCH_CHECK_VALUE(code.device().is_cpu(), "code must be a CPU tensor here, got ", code.device());
    check_code(code);
    auto lookup = torch::empty({kLookupSize}, torch::kInt32);
    bool ok = q8_build_lookup(code.data_ptr<float>(), reinterpret_cast<uint32_t*>(lookup.data_ptr<int32_t>()));
    TORCH_CHECK_VALUE(ok, "code must be sorted with midpoints in (-2, 2) and at most one midpoint per 2^-7 "
                          "relative interval (the dynamic and linear maps are)");
    return lookup;
}

// The stochastic-rounding arguments of a step over n tensors: both empty (round to nearest), or a
// 32-bit hash key and the index of the first element in its original parameter for every tensor.
// Returns whether rounding is stochastic.
inline bool check_rounding(const std::vector<int64_t>& sr_keys, const std::vector<int64_t>& sr_index, size_t n) {
    if (sr_keys.empty() && sr_index.empty()) return false;
    TORCH_CHECK_VALUE(sr_keys.size() == n && sr_index.size() == n, "sr_keys and sr_index must be empty or have one ",
                      "entry per tensor (", n, "), got ", sr_keys.size(), " and ", sr_index.size());
    for (size_t t = 0; t < n; ++t) {
        TORCH_CHECK_VALUE(sr_keys[t] >= 0 && sr_keys[t] <= 0xFFFFFFFFLL, "sr_keys must be 32-bit unsigned, got ",
                          sr_keys[t]);
        TORCH_CHECK_VALUE(sr_index[t] >= 0, "sr_index must be >= 0, got ", sr_index[t]);
    }
    return true;
}

// How each of an 8-bit step's k states is requantized: empty (all to nearest) or one Q8_ROUND_* per state.
// Random bits need the keys (`has_keys`, from check_rounding); so do stochastic parameter writes,
// which are off without keys whatever the flag says.
inline void check_rounding_modes(bool has_keys, const std::vector<int64_t>& states, size_t k) {
    TORCH_CHECK_VALUE(states.empty() || states.size() == k, "rounding_modes must be empty or have one entry per "
                      "state (", k, "), got ", states.size());
    bool any = false;
    for (int64_t s : states) {
        TORCH_CHECK_VALUE(s == Q8_ROUND_NEAREST || s == Q8_ROUND_STOCHASTIC || s == Q8_ROUND_BY_OLD_CODE,
                          "rounding_modes entries must be ", Q8_ROUND_NEAREST, " (nearest), ", Q8_ROUND_STOCHASTIC,
                          " (stochastic) or ", Q8_ROUND_BY_OLD_CODE, " (guided by the old code), got ", s);
        any = any || s != Q8_ROUND_NEAREST;
    }
    TORCH_CHECK_VALUE(has_keys || !any, "rounding_modes needs sr_keys and sr_index (the random bits' keys)");
}

// The correction bytes of a step over params: none, or one int8 tensor per param, each with the
// param's elements, contiguous and on its device, for bf16 params written to nearest (the byte takes
// the place of stochastic rounding: q8_bf16_split).
inline bool check_corrections(const std::vector<torch::Tensor>& corrections, const std::vector<torch::Tensor>& params,
                              bool stochastic_params) {
    if (corrections.empty()) return false;
    TORCH_CHECK_VALUE(corrections.size() == params.size(), "corrections must be empty or have one tensor per param (",
                      params.size(), "), got ", corrections.size());
    TORCH_CHECK_VALUE(!stochastic_params, "correction bytes replace stochastic rounding: pass stochastic_params=False");
    for (size_t t = 0; t < params.size(); ++t) {
        const torch::Tensor& c = corrections[t];
        TORCH_CHECK_VALUE(params[t].scalar_type() == torch::kBFloat16, "correction bytes need bfloat16 params, got ",
                          params[t].scalar_type());
        TORCH_CHECK_VALUE(c.scalar_type() == torch::kInt8 && c.numel() == params[t].numel() && c.is_contiguous() &&
                          c.device() == params[t].device(), "corrections[", t, "] must be a contiguous int8 tensor of ",
                          params[t].numel(), " elements on ", params[t].device(), ", got ", c.numel(), " of ",
                          c.scalar_type(), " on ", c.device());
    }
    return true;
}

// The limits shared with Python (see q8_common.h).
inline std::map<std::string, int64_t> limits() {
    return {{"min_block_size", Q8_MIN_BLOCK}, {"max_block_size", Q8_MAX_BLOCK}, {"max_states", Q8_MAX_STATES}};
}

}  // namespace binding
}  // namespace ds_q8
