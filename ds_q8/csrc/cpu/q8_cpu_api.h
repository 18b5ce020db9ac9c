// The boundary between the torch binding (q8_cpu.cpp) and the per-instruction-set drivers
// (isa_*.cpp). Plain structs only, so the driver files need no torch headers and each can be
// compiled for its own instruction set.
#pragma once

#include <stdint.h>

#include "q8_common.h"  // Q8_MAX_STATES

namespace ds_q8 {

struct FastMap;   // q8_fastmap.h
struct FloorMap;  // q8_floormap.h

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

struct HyperParam {
    const char* name;
    double value;
};

struct StepArgs {
    const char* rule;          // Q8_RULES name
    void* param;               // updated in place
    const void* grad;
    DType param_dtype, grad_dtype;
    int64_t numel;
    int64_t block_size;
    uint8_t* codes[Q8_MAX_STATES];         // per state (flat, numel each)
    uint16_t* absmax[Q8_MAX_STATES];       // one stored maximum per block (bf16 bits, q8_absmax_store)
    const float* code[Q8_MAX_STATES];      // the 256-entry map of each state
    const uint32_t* lookup[Q8_MAX_STATES]; // q8_build_lookup table of each map
    const FastMap* fast[Q8_MAX_STATES];    // its segment tables, or null (q8_build_fastmap)
    const FloorMap* floor[Q8_MAX_STATES];  // its floor tables, or null (q8_build_floormap)
    uint8_t map_kind[Q8_MAX_STATES];       // Q8MapKind: coded through the tables above, or a minifloat map
    int num_states;            // 1 to Q8_MAX_STATES: must be the rule's
    bool fp32_states;          // states are float32 (below): no codes, maps or absmax
    float* states32[Q8_MAX_STATES];
    const HyperParam* hyper;
    int num_hyper;
    int num_threads;
    bool stochastic;           // 16-bit params: write them with stochastic rounding (q8_store_sr)
    uint8_t rounding_modes[Q8_MAX_STATES]; // how each 8-bit state is requantized (Q8_ROUND_*)
    uint32_t sr_key;           // the hash key of this tensor's random bits (both kinds)
    int64_t sr_index;          // index of param[0] in its original parameter
    int8_t* correction;        // null, or bf16 params' correction bytes (one per element: q8_bf16_join/split)
    double* error_sums;        // null, or per state k, at 3k: sum |requantized - x|, sum |x|, and the count
                               // of nonzero x requantized to 0 (Q8_TELEMETRY_SUMS)
    bool four_bit;             // 4-bit Adam state (format4.py): codes[0..1] packed two a byte from an even
                               // element, absmax[0] the first moment's bf16 maxima, v_max the second's
    float* v_max;
    const float* four_maps[4]; // the 4-bit maps and boundaries: m_map, m_mid, v_map, v_mid (Q8Four)
};

struct QuantizeArgs {
    void* x;                   // quantize: input; dequantize: output
    DType dtype;
    int64_t numel;
    int64_t block_size;
    uint8_t* codes;
    uint16_t* absmax;          // one stored maximum per block (bf16 bits)
    const float* code;
    const uint32_t* lookup;
    const FastMap* fast;
    uint8_t map_kind;          // Q8MapKind (q8_minifloat.h): a minifloat map is coded from bits, not `lookup`
    int num_threads;
};

struct StepStatus {
    enum Code { kOk, kUnsupported, kMissingHyper, kWrongStates } code;
    const char* missing;       // the hyperparameter name, for kMissingHyper
};

// Each instruction set provides these. No exceptions cross this boundary. finite_<isa>: whether no
// element of n values of `dtype` at x is NaN or Inf (the non-finite check of the gradients).
#define Q8_DECLARE_ISA(isa)                                   \
    StepStatus step_##isa(const StepArgs* args, int count);                   \
    void quantize_##isa(const QuantizeArgs& args);            \
    void dequantize_##isa(const QuantizeArgs& args);          \
    bool finite_##isa(const void* x, int64_t n, DType dtype);

Q8_DECLARE_ISA(avx512)
Q8_DECLARE_ISA(avx2)
Q8_DECLARE_ISA(scalar)

// Test probe of the AVX-512 segment search, compiled with Q8_PROBES only (tests/csrc/q8_probe.cpp):
// mismatches against the lookup table over every float in [-limit, limit] (scaled values, so limit
// is a little above 1). The floats go 64 at a time in order; `stride` > 1 takes every stride-th run
// of 64 only (the emulated AVX-512 build, whose instructions run in software).
int64_t fast_search_mismatches_avx512(const uint32_t* lookup, const FastMap& m, float limit, int64_t stride,
                                      int num_threads);
// Test probes of the minifloat encoders (Q8_PROBES only, q8_mf_probe.h): codes that differ from q8_mf_code over
// every float in [-limit, limit] (values in the map's units), with rounding `mode` (Q8_ROUND_*); `stride` as
// above.
int64_t mf_mismatches_avx512(bool is_signed, int mode, float limit, int64_t stride, int num_threads);
int64_t mf_mismatches_avx2(bool is_signed, int mode, float limit, int64_t stride, int num_threads);

}  // namespace ds_q8
