// Baseline traits for the CPU driver: one float at a time, for CPUs without AVX2.
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "q8_common.h"
#include "q8_cpu_blocks.h"
#include "q8_fastmap.h"

namespace ds_q8 {
namespace {

struct Scalar : PerVectorBlocks<Scalar> {
    static constexpr int W = 1;
    static constexpr int kChunk = W;
    using V = float;

    template <class T>
    static V load(const T* p, int) { return q8_to_float(*p); }
    template <class T>
    static void store(T* p, V v, int) { q8_store(p, v); }
    static V load_tmp(const float* p) { return *p; }
    static void store_tmp(float* p, V v) { *p = v; }
    static V dequant(const uint8_t* c, int, const float* code, float absmax) { return code[*c] * absmax; }
    static V absmax_init() { return 0.0f; }
    static V absmax_step(V acc, V x, int) { return q8_absmax_step(acc, x); }
    static float absmax_reduce(V acc) { return acc; }
    static void quantize(uint8_t* out, V x, float scale, const uint32_t* lookup, int) {
        *out = (uint8_t)q8_quantize_scaled(x * scale, lookup);
    }
    // The segment search where the map has one (the function the CUDA kernels call), else the table.
    static void quantize_block(uint8_t* out, const float* x, int len, float absmax, const uint32_t* lookup,
                               const FastMap* fast) {
        const float scale = q8_block_scale(absmax);
        if (!fast) {
            for (int i = 0; i < len; ++i) quantize(out + i, x[i], scale, lookup, 1);
            return;
        }
        for (int i = 0; i < len; ++i) out[i] = (uint8_t)q8_quantize_fast(x[i] * scale, *fast, lookup);
    }
};

}  // namespace
}  // namespace ds_q8

#include "q8_cpu_driver.h"

Q8_DEFINE_ISA(scalar, Scalar)
