// The CPU op's check of gradients for NaN and Inf (all_finite, all_finite_or_unknown). Included by
// q8_cpu.cpp only, after q8_cpu_args.h (dtype_of, check_cpu_contiguous).
#pragma once

#include <torch/extension.h>

#include <vector>

#include "q8_cpu_args.h"

namespace ds_q8 {
namespace {

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
