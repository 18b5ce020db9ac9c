// Entry points that only the tests use, kept out of the shipped CPU module. tests/helpers/probe.py builds
// this file together with the AVX-512 driver (compiled with Q8_PROBES, which adds its exhaustive
// search check) into a separate extension.
#include <torch/extension.h>

#include "q8_binding.h"
#include "q8_cpu_api.h"
#include "q8_fastmap.h"

namespace ds_q8 {
namespace {

bool segment_tables(const torch::Tensor& code, FastMap* m) {
    TORCH_CHECK_VALUE(code.device().is_cpu(), "code must be a CPU tensor, got ", code.device());
    binding::check_code(code);
    return q8_build_fastmap(code.data_ptr<float>(), m);
}

// Whether the map has the structure the segment search needs (q8_build_fastmap accepts it).
bool fast_search(const torch::Tensor& code) {
    FastMap m;
    return segment_tables(code, &m);
}

// The AVX-512 segment search against the lookup table over every float in [-limit, limit];
// -1 when the map has no segment tables.
int64_t fast_search_mismatches(const torch::Tensor& code, const torch::Tensor& lookup, double limit) {
    binding::check_lookup(lookup);
    TORCH_CHECK_VALUE(limit >= 0.0 && limit < 2.0, "limit must be in [0, 2), got ", limit);
    FastMap m;
    if (!segment_tables(code, &m)) return -1;
    return fast_search_mismatches_avx512(reinterpret_cast<const uint32_t*>(lookup.data_ptr<int32_t>()), m,
                                         (float)limit, at::get_num_threads());
}

}  // namespace
}  // namespace ds_q8

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "test probes of the ds_q8 CPU drivers";
    m.def("fast_search", &ds_q8::fast_search, "True when the map gets segment tables (no lookup-table search)");
    m.def("fast_search_mismatches", &ds_q8::fast_search_mismatches,
          "AVX-512 segment search vs lookup table over every float in [-limit, limit]; -1 without tables");
}
