// Entry points that only the tests use, kept out of the shipped CPU module. tests/helpers/probe.py builds
// this file together with the AVX-512 driver (compiled with Q8_PROBES, which adds its exhaustive
// search check) into a separate extension.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <atomic>
#include <memory>
#include <string>

#include "q8_binding.h"
#include "q8_cpu_api.h"
#include "q8_fastmap.h"
#include "q8_floormap.h"
#include "q8_floortable.h"
#include "q8_minifloat.h"

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

// The AVX-512 segment search against the lookup table over every float in [-limit, limit] (every
// stride-th run of 64 floats where stride > 1); -1 when the map has no segment tables.
int64_t fast_search_mismatches(const torch::Tensor& code, const torch::Tensor& lookup, double limit, int64_t stride) {
    binding::check_lookup(lookup);
    TORCH_CHECK_VALUE(limit >= 0.0 && limit < 2.0, "limit must be in [0, 2), got ", limit);
    TORCH_CHECK_VALUE(stride >= 1, "stride must be at least 1, got ", stride);
    FastMap m;
    if (!segment_tables(code, &m)) return -1;
    return fast_search_mismatches_avx512(reinterpret_cast<const uint32_t*>(lookup.data_ptr<int32_t>()), m,
                                         (float)limit, stride, at::get_num_threads());
}

std::unique_ptr<FloorTable> floor_table_of(const torch::Tensor& code) {
    TORCH_CHECK_VALUE(code.device().is_cpu(), "code must be a CPU tensor, got ", code.device());
    binding::check_code(code);
    auto t = std::make_unique<FloorTable>();
    if (!q8_build_floortable(code.data_ptr<float>(), t.get())) t.reset();
    return t;
}

// Whether the map gets the AVX2 driver's floor rows (q8_build_floormap accepts it).
bool floor_map(const torch::Tensor& code) {
    TORCH_CHECK_VALUE(code.device().is_cpu(), "code must be a CPU tensor, got ", code.device());
    binding::check_code(code);
    auto m = std::make_unique<FloorMap>();  // 512 KiB: not on the stack
    return q8_build_floormap(code.data_ptr<float>(), m.get());
}

// Whether the map gets the CUDA step's floor tables (q8_build_floortable accepts it).
bool floor_table(const torch::Tensor& code) { return floor_table_of(code) != nullptr; }

// The codes the CUDA step's table path gives scaled values y (finite, |y| <= 1 + 2^-7; -0.0 as +0.0,
// as the kernel's fma makes it) with random bits `bits` (int64, 32 bits each), or to nearest.
torch::Tensor floor_round(const torch::Tensor& code, const torch::Tensor& y, const torch::Tensor& bits,
                          bool stochastic) {
    auto t = floor_table_of(code);
    TORCH_CHECK_VALUE(t != nullptr, "the map has no floor tables");
    TORCH_CHECK_VALUE(y.scalar_type() == torch::kFloat32 && y.is_contiguous() && bits.scalar_type() == torch::kInt64 &&
                          bits.numel() == y.numel() && bits.is_contiguous(),
                      "y must be contiguous float32 and bits as many contiguous int64");
    auto out = torch::empty({y.numel()}, torch::kUInt8);
    const float* yp = y.data_ptr<float>();
    const int64_t* bp = bits.data_ptr<int64_t>();
    uint8_t* op = out.data_ptr<uint8_t>();
    for (int64_t i = 0; i < y.numel(); ++i) {
        const float v = yp[i] + 0.0f;
        TORCH_CHECK_VALUE(v == v && fabsf(v) < 1.0078125f, "y[", i, "] = ", yp[i], " is outside the table's range");
        op[i] = (uint8_t)q8_floor_round(*t, v, stochastic, (uint32_t)bp[i]);
    }
    return out;
}

// Every float y in [-limit, limit] but -0.0, in value order, against the reference's rule (ds_q8/
// functional.py quantize_scaled) computed by counting: the nearest code, and for stochastic rounding
// the reference's pair of entries, which must be the table's (F, F + 1) with the same gap, or where the
// reference's pair is one entry (the ends) the table's choice at the extreme random draws. -1 when the
// map has no tables; else the number of floats where they differ.
int64_t floor_table_mismatches(const torch::Tensor& code, double limit) {
    TORCH_CHECK_VALUE(limit >= 0.0 && limit < 1.0078125, "limit must be in [0, 1 + 2^-7), got ", limit);
    auto tp = floor_table_of(code);
    if (!tp) return -1;
    const FloorTable& t = *tp;
    const float* c = code.data_ptr<float>();
    float mid[255];
    for (int i = 0; i < 255; ++i) mid[i] = i == 0 && c[0] == 0.0f ? 0.0f : (c[i] + c[i + 1]) * 0.5f;
    const uint32_t top = q8_bits((float)limit);
    // keys in value order: negative floats from -limit up to the smallest negative, then +0 to limit
    const int64_t negatives = (int64_t)top, total = 2 * (int64_t)top + 1;
    auto value_at = [&](int64_t k) { return k < negatives ? -q8_float(top - (uint32_t)k) : q8_float((uint32_t)(k - negatives)); };
    std::atomic<int64_t> bad{0};
    at::parallel_for(0, total, 1 << 22, [&](int64_t begin, int64_t end) {
        int n = 0;  // #{mid < y}, kept as y grows
        float y0 = value_at(begin);
        while (n < 255 && mid[n] < y0) ++n;
        int64_t local = 0;
        for (int64_t k = begin; k < end; ++k) {
            const float y = value_at(k);
            while (n < 255 && mid[n] < y) ++n;
            const uint32_t f = q8_floor_index(t, q8_bits(y));
            const uint32_t nearest = f + (t.mid[f] < y ? 1u : 0u);
            bool ok = nearest == (uint32_t)n;
            const bool up = y >= c[n];
            const int nb = up ? (n < 255 ? n + 1 : 255) : (n > 0 ? n - 1 : 0);
            const int lo = up ? n : nb, hi = up ? nb : n;
            const bool zero_point = c[0] == 0.0f && lo == 0 && hi == 1;
            if (lo != hi && !zero_point) {
                ok = ok && (uint32_t)lo == f && t.pair[f][0] == c[lo] &&
                     t.pair[f][1] * 16777216.0f == c[hi] - c[lo];
            } else {
                for (uint32_t r : {0u, 0xFFFFFFFFu}) {
                    const float u = (float)(r >> 8) * 5.9604644775390625e-08f;
                    uint32_t want = u * (c[hi] - c[lo]) < y - c[lo] ? (uint32_t)hi : (uint32_t)lo;
                    if (c[0] == 0.0f && want == 0u && y > 0.0f) want = 1u;
                    ok = ok && q8_floor_round(t, y, true, r) == want;
                }
            }
            local += ok ? 0 : 1;
        }
        bad += local;
    });
    return bad.load();
}

// q8_mf_code (the scalar codec, which the kernels share) on each value of z with its random bits and old code.
torch::Tensor minifloat_codes_scalar(const torch::Tensor& z, bool is_signed, int64_t mode, const torch::Tensor& bits,
                                     const torch::Tensor& old) {
    TORCH_CHECK_VALUE(z.scalar_type() == torch::kFloat32 && bits.scalar_type() == torch::kInt64 &&
                          old.scalar_type() == torch::kInt64 && bits.numel() == z.numel() && old.numel() == z.numel(),
                      "z must be float32, bits and old int64 of z's size");
    auto zc = z.contiguous(), bc = bits.contiguous(), oc = old.contiguous();
    auto out = torch::empty({z.numel()}, torch::kInt64);
    const float* zp = zc.data_ptr<float>();
    const int64_t* bp = bc.data_ptr<int64_t>();
    const int64_t* op = oc.data_ptr<int64_t>();
    int64_t* o = out.data_ptr<int64_t>();
    at::parallel_for(0, z.numel(), 1 << 16, [&](int64_t lo, int64_t hi) {
        for (int64_t i = lo; i < hi; ++i)
            o[i] = q8_mf_code(is_signed, zp[i], (int)mode, (uint32_t)bp[i], (uint32_t)op[i]);
    });
    return out;
}

// The minifloat encoders of `isa` against q8_mf_code over every float in [-limit, limit] (the map's units;
// every stride-th run of 64 floats where stride > 1).
int64_t minifloat_mismatches(const std::string& isa, bool is_signed, int64_t mode, double limit, int64_t stride) {
    TORCH_CHECK_VALUE(isa == "avx512" || isa == "avx2", "isa must be 'avx512' or 'avx2', got '", isa, "'");
    TORCH_CHECK_VALUE(limit >= 0.0 && limit < 4.0, "limit must be in [0, 4), got ", limit);
    TORCH_CHECK_VALUE(stride >= 1, "stride must be at least 1, got ", stride);
    const int threads = at::get_num_threads();
    return isa == "avx512" ? mf_mismatches_avx512(is_signed, (int)mode, (float)limit, stride, threads)
                           : mf_mismatches_avx2(is_signed, (int)mode, (float)limit, stride, threads);
}

}  // namespace
}  // namespace ds_q8

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "test probes of the ds_q8 CPU drivers";
    m.def("fast_search", &ds_q8::fast_search, "True when the map gets segment tables (no lookup-table search)");
    m.def("fast_search_mismatches", &ds_q8::fast_search_mismatches,
          "AVX-512 segment search vs lookup table over every float in [-limit, limit] (every stride-th run of 64); "
          "-1 without tables",
          pybind11::arg("code"), pybind11::arg("lookup"), pybind11::arg("limit"), pybind11::arg("stride") = 1);
    m.def("floor_map", &ds_q8::floor_map, "True when the map gets the AVX2 driver's floor rows");
    m.def("floor_table", &ds_q8::floor_table, "True when the map gets the CUDA step's floor tables");
    m.def("floor_round", &ds_q8::floor_round, "codes of scaled values by the CUDA step's floor tables");
    m.def("minifloat_codes_scalar", &ds_q8::minifloat_codes_scalar, "q8_mf_code on each value (the scalar codec)");
    m.def("minifloat_mismatches", &ds_q8::minifloat_mismatches,
          "an instruction set's minifloat encoder vs q8_mf_code over every float in [-limit, limit] (every "
          "stride-th run of 64)",
          pybind11::arg("isa"), pybind11::arg("is_signed"), pybind11::arg("mode"), pybind11::arg("limit"),
          pybind11::arg("stride") = 1);
    m.def("floor_table_mismatches", &ds_q8::floor_table_mismatches,
          "the floor tables vs the reference's rule over every float in [-limit, limit]; -1 without tables");
}
