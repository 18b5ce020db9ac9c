// The CPU op's check of gradients for NaN and Inf (all_finite, all_finite_or_unknown). Included by
// q8_cpu.cpp only, after q8_cpu_args.h (dtype_of, check_cpu_contiguous).
#pragma once

#include <torch/extension.h>

#include <vector>

#include "q8_cpu_args.h"

namespace ds_q8 {
namespace {

// The best instruction set this CPU has reads the gradients (the check is a read of memory).
using FiniteFn = bool (*)(const void*, int64_t, DType);
FiniteFn best_finite() {
    const std::string best = supported_isas().front();
    return best == "avx512" ? finite_avx512 : best == "avx2" ? finite_avx2 : finite_scalar;
}

// 1 when no tensor holds NaN or Inf, 0 when one does; -1 (nothing read) when `lenient` and a tensor
// is not a contiguous float32/float16/bfloat16 CPU tensor, which otherwise is an error.
int finite_check(const std::vector<torch::Tensor>& tensors, bool lenient) {
    // Every tensor cut into chunks of 2^18 values; one parallel loop over all chunks of all tensors,
    // so that many small tensors cost one parallel region.
    constexpr int64_t kChunk = 1 << 18;
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
    static const FiniteFn finite = best_finite();
    int bad = 0;
#pragma omp parallel for num_threads(at::get_num_threads()) schedule(static) reduction(| : bad)
    for (int64_t c = 0; c < count; ++c) bad |= finite(pieces[c].x, pieces[c].n, pieces[c].dtype) ? 0 : 1;
    return bad == 0 ? 1 : 0;
}

bool all_finite(const std::vector<torch::Tensor>& tensors) { return finite_check(tensors, false) == 1; }

// The optimizers' check: -1 where it does not apply (the caller then asks torch), so that the
// tensors are looked at once, here, and not also in Python.
int all_finite_or_unknown(const std::vector<torch::Tensor>& tensors) { return finite_check(tensors, true); }

}  // namespace
}  // namespace ds_q8
