// The tensor lists every step kernel walks (the slots of a launch's tensors and their tiles), and the rule
// applied to a thread's 8 values: what q8_cuda_step.cuh's 8-bit kernel and q8_cuda_step_formats.cuh's 4-bit
// and float32 kernels share. q8_cuda_step_launch.cuh fills the lists on the host.
#pragma once

#include <stdint.h>

#include "q8_common.h"
#include "q8_cuda_fastmath.cuh"
#include "q8_cuda_load_store.cuh"

namespace ds_q8 {
namespace {

// ------------------------------------------------------------------ tensor lists
// A step launch covers every tensor of a call, as torch's multi_tensor_apply covers dozens: a table of
// per-tensor slots in device memory (uploaded by the launch, stream-ordered, from pinned memory). Each
// tensor is cut into tiles of one CTA's elements (blockDim.x * kElems, whole quantization blocks),
// numbered across the list (tensor t owns tiles first_tile[t] .. first_tile[t + 1] - 1), and the CTAs are
// persistent: each walks the tiles blockIdx.x, blockIdx.x + gridDim.x, ...
struct alignas(16) StepSlot {
    void* param;
    const void* grad;
    void* state[Q8_MAX_STATES];        // uint8 codes, or float32 states for the fp32-state kernel
    uint16_t* absmax[Q8_MAX_STATES];   // stored block maxima (bf16 bits, q8_absmax_store)
    int8_t* correction;                // null, or the bf16 param's correction bytes (q8_bf16_join / q8_bf16_split)
    double* error_sums;                // null, or per state k, at 3k: sum |requantized - x|, sum |x|, nonzero x requantized to 0
    int64_t numel;
    int64_t sr_index;                  // index of param[0] in its original parameter (stochastic rounding)
    uint32_t sr_key;                   // the parameter writes' key (q8_sr_bits)
    uint32_t state_key[Q8_MAX_STATES]; // each state's, q8_state_key(sr_key, k), hashed on the host once a launch
    int32_t tensor, first_tile, end_tile;  // its place in the list, its first tile and the next tensor's
    uint8_t align_param, align_grad, align_state;  // byte alignments, capped at 16 (load_words)
};
static_assert(sizeof(StepSlot) % 16 == 0, "a slot is read as whole 16-byte words");

struct StepList {
    const float* code[Q8_MAX_STATES];       // 8-bit states: the maps (4-bit: format4's 60 floats in code[0])
    const uint32_t* lookup[Q8_MAX_STATES];  // and their lookup tensors (kDeviceLookupSize words)
    const int32_t* skip;                    // null, or a device flag: non-zero means write nothing
    int32_t block_shift, threads_per_qblock;  // log2 of the block size, T = block size / kElems
    int32_t count, tiles;                   // tensors and tiles of the launch
    bool stochastic;                        // 16-bit parameter writes rounded stochastically
    uint8_t rounding_modes[Q8_MAX_STATES];  // how each 8-bit state is requantized (Q8_ROUND_*)
    uint8_t map_kind[Q8_MAX_STATES];        // each state's map (Q8MapKind: the lookup tensor's kDeviceMapKind)
    int8_t table_slot[Q8_MAX_STATES];       // where its FloorTable is in shared memory, -1 for none
    const StepSlot* slot;                   // device memory: the tensors' slots,
    const int32_t* first_tile;              // and their first tiles (count + 1 entries)
};

// Whether the step is to be skipped (a non-finite gradient found on the device): then no thread
// writes anything. The same answer for every thread of the grid.
__device__ __forceinline__ bool list_skipped(const StepList& list) {
    return list.skip != nullptr && *list.skip != 0;
}

// Calls body(slot, first element of the tile) for each tile of this CTA, in order. The tensor of a tile only
// moves forward: at its first tile of a tensor the CTA copies the tensor's slot into shared memory, and at
// every tile each thread copies the slot from there into registers, so that its fields are read once a tile
// (not again after each store, which the compiler cannot tell apart from them) and held only for the tile.
template <class Body>
__device__ __forceinline__ void for_each_tile(const StepList& list, Body body) {
    constexpr int kSlotWords = (int)(sizeof(StepSlot) / sizeof(uint4));
    __shared__ uint4 slot[kSlotWords];  // the slot of the CTA's current tensor
    const int64_t tile_elems = (int64_t)blockDim.x * kElems;
    int end = 0;  // the current tensor's end, the next tensor's first tile (0: none read yet)
    for (int tile = (int)blockIdx.x; tile < list.tiles; tile += (int)gridDim.x) {
        if (tile >= end) {  // the CTA's first tile of a tensor: its slot, once
            int t = end == 0 ? 0 : reinterpret_cast<const StepSlot*>(slot)->tensor + 1;
            while (list.first_tile[t + 1] <= tile) ++t;
            __syncthreads();  // every thread has its copy of the slot before
            if ((int)threadIdx.x < kSlotWords)
                slot[threadIdx.x] = __ldg(reinterpret_cast<const uint4*>(list.slot + t) + threadIdx.x);
            __syncthreads();
            end = reinterpret_cast<const StepSlot*>(slot)->end_tile;
        }
        const StepSlot& a = *reinterpret_cast<const StepSlot*>(slot);
        body(a, (int64_t)(tile - a.first_tile) * tile_elems);
    }
}

// The rule on each of the 8 values (its states s[k][i]); lanes past the tensor's end compute on zeros
// and are never stored.
template <class Rule, int K>
__device__ __forceinline__ void apply_rule(const Rule& rule, float (&p)[kElems], const float (&g)[kElems],
                                           float (&s)[K][kElems]) {
#pragma unroll
    for (int i = 0; i < kElems; ++i) {
        float sv[K];
#pragma unroll
        for (int k = 0; k < K; ++k) sv[k] = s[k][i];
        rule(p[i], g[i], sv);
#pragma unroll
        for (int k = 0; k < K; ++k) s[k][i] = sv[k];
    }
}

// The same through Q8Checked (q8_cuda_fastmath.cuh): returns whether every division and square root was
// exact; where not, the values are to be dropped and the rule run again with apply_rule.
template <class Rule, int K>
__device__ __forceinline__ bool apply_rule_checked(const Rule& rule, float (&p)[kElems], const float (&g)[kElems],
                                                   float (&s)[K][kElems]) {
    bool ok = true;
#pragma unroll
    for (int i = 0; i < kElems; ++i) {
        Q8Checked pv(p[i]), sv[K];
#pragma unroll
        for (int k = 0; k < K; ++k) sv[k] = Q8Checked(s[k][i]);
        rule(pv, Q8Checked(g[i]), sv);
        p[i] = pv.v;
        ok = ok && pv.ok;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            s[k][i] = sv[k].v;
            ok = ok && sv[k].ok;
        }
    }
    return ok;
}

}  // namespace
}  // namespace ds_q8
