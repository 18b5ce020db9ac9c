// The block coders of the minifloat maps that every vector instruction set shares: a block whose maximum is
// finite is coded by the instruction set's own mf_encode_block, one whose maximum is Inf or NaN value by value
// (q8_mf_code, the scalar spec); then runs of blocks, and the choice of sign and rounding at run time.
// Isa is the struct that derives from it (Avx2Minifloat, Avx512Minifloat), so each instruction set's
// encoder is inlined into its own copy. Included by those headers only, after their target pragmas.
#pragma once

#include "q8_common.h"
#include "q8_minifloat.h"

namespace ds_q8 {
namespace {

template <class Isa>
struct MinifloatBlocks {
    template <bool kSigned, int kMode>
    __attribute__((always_inline)) static inline void mf_code_block(uint8_t* out, const float* x, int len,
                                                                   float absmax, uint32_t key, uint32_t mul,
                                                                   uint32_t first) {
        const float s = q8_mf_scale(absmax);
        if (absmax < INFINITY) return Isa::template mf_encode_block<kSigned, kMode>(out, x, len, s, key, mul, first);
        for (int i = 0; i < len; ++i)
            out[i] = (uint8_t)q8_mf_code<kSigned>(x[i] * s, kMode, (key + first + (uint32_t)i) * mul, out[i]);
    }

    // Codes for `len` values x in blocks of bs, block j with stored maximum absmax[j] (mf_code_block each).
    template <bool kSigned, int kMode>
    static void mf_requantize_as(uint8_t* out, const float* x, int len, const float* absmax, int bs, uint32_t key,
                                 uint32_t mul, uint32_t first) {
        for (int b0 = 0, j = 0; b0 < len; b0 += bs, ++j)
            mf_code_block<kSigned, kMode>(out + b0, x + b0, (len - b0 < bs ? len - b0 : bs), absmax[j], key, mul,
                                          first + (uint32_t)b0);
    }

    static void mf_requantize(uint8_t* out, const float* x, int len, const float* absmax, int bs, bool is_signed,
                              int mode, uint32_t key, uint32_t mul, uint32_t first) {
#define Q8_MF_CASE(SIGNED, MODE) \
    if (is_signed == SIGNED && mode == MODE) return mf_requantize_as<SIGNED, MODE>(out, x, len, absmax, bs, key, mul, first);
        Q8_MF_CASE(true, Q8_ROUND_BY_OLD_CODE)
        Q8_MF_CASE(false, Q8_ROUND_BY_OLD_CODE)
        Q8_MF_CASE(true, Q8_ROUND_STOCHASTIC)
        Q8_MF_CASE(false, Q8_ROUND_STOCHASTIC)
        Q8_MF_CASE(true, Q8_ROUND_NEAREST)
        Q8_MF_CASE(false, Q8_ROUND_NEAREST)
#undef Q8_MF_CASE
    }
};

}  // namespace
}  // namespace ds_q8
