// The minifloat encoders of an instruction set against q8_mf_code (q8_minifloat.h), over every float z in
// [-limit, limit]: tests only (tests/csrc/q8_probe.cpp, compiled with Q8_PROBES). Included by isa_avx512.cpp
// and isa_avx2.cpp after their traits, with Q8_MF_PROBE_NAME and Q8_MF_PROBE_TRAITS defined.
#pragma once

namespace ds_q8 {
namespace {

// Every float of [-limit, limit] as a block's values scaled by 1 (a stored maximum of 1.9375), 64 at a
// time (every stride-th run of 64 where stride > 1): each value's old code and random bits vary with its bit
// pattern. Returns the count of codes that differ from q8_mf_code's.
template <class Traits, bool kSigned, int kMode>
int64_t mf_mismatches_as(float limit, int64_t stride, int num_threads) {
    const uint32_t top = q8_bits(limit);
    const int64_t chunks = ((int64_t)top + 64) / 64;
    const uint32_t key = 0x9E3779B9u, mul = q8_state_mul(kSigned ? 0 : 1);
    int64_t bad = 0;
#pragma omp parallel for num_threads(num_threads) schedule(static) reduction(+ : bad)
    for (int64_t c = 0; c < 2 * chunks; c += stride) {
        alignas(64) float x[64];
        alignas(64) uint8_t got[64], old[64];
        const uint32_t sign = c < chunks ? 0u : 0x80000000u;
        const int64_t first = (c % chunks) * 64;
        for (int i = 0; i < 64; ++i) {
            const int64_t b = first + i;
            const uint32_t u = sign | (uint32_t)(b > (int64_t)top ? top : b);
            x[i] = q8_float(u);
            old[i] = got[i] = (uint8_t)((u * 0x2545F491u) >> 24);  // an old code that is sometimes next to it
            if ((u & 3u) == 0u) old[i] = got[i] = (uint8_t)q8_mf_code<kSigned>(x[i], Q8_ROUND_NEAREST, 0u, 0u);
        }
        Traits::template mf_code_block<kSigned, kMode>(got, x, 64, kMfTop, key, mul, (uint32_t)first);
        for (int i = 0; i < 64; ++i)
            bad += got[i] != q8_mf_code<kSigned>(x[i], kMode, (key + (uint32_t)first + (uint32_t)i) * mul, old[i]);
    }
    return bad;
}

}  // namespace

int64_t Q8_MF_PROBE_NAME(bool is_signed, int mode, float limit, int64_t stride, int num_threads) {
#define Q8_MF_PROBE_CASE(SIGNED, MODE)                                                                      \
    if (is_signed == SIGNED && mode == MODE)                                                                 \
        return mf_mismatches_as<Q8_MF_PROBE_TRAITS, SIGNED, MODE>(limit, stride, num_threads);
    Q8_MF_PROBE_CASE(true, Q8_ROUND_NEAREST)
    Q8_MF_PROBE_CASE(false, Q8_ROUND_NEAREST)
    Q8_MF_PROBE_CASE(true, Q8_ROUND_STOCHASTIC)
    Q8_MF_PROBE_CASE(false, Q8_ROUND_STOCHASTIC)
    Q8_MF_PROBE_CASE(true, Q8_ROUND_BY_OLD_CODE)
    Q8_MF_PROBE_CASE(false, Q8_ROUND_BY_OLD_CODE)
#undef Q8_MF_PROBE_CASE
    return -1;
}

}  // namespace ds_q8
