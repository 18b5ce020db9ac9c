// The host side of the CUDA step: the persistent grid, the tensor lists in device memory, and the
// launchers of each rule's step kernels by parameter and gradient dtype and by part (kStepParts).
// Part of q8_cuda_step.cuh, which includes it at its end, after every step kernel.
#pragma once

#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace ds_q8 {
namespace {

// ------------------------------------------------------------------ host side
// The byte alignment of a pointer, capped at 16 (what load_words can use).
int alignment(const void* p) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    return a % 16 == 0 ? 16 : a % 8 == 0 ? 8 : a % 4 == 0 ? 4 : a % 2 == 0 ? 2 : 1;
}

int min_alignment(int a, int b) { return a < b ? a : b; }

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The persistent grid of a step kernel: as many CTAs as the device holds at once (its multiprocessors
// times the kernel's occupancy at `threads` and `smem`), fewer when there are fewer tiles. Kernels whose
// shared memory exceeds the default 48 KiB are allowed it first. Worked out once per kernel, device, CTA size
// and shared memory, and kept: the runtime's answers do not change while the process lives.
template <class Kernel>
int64_t resident_ctas(Kernel kernel, int threads, size_t smem) {
    using Key = std::tuple<const void*, int, int, size_t>;
    static std::mutex mu;
    static std::map<Key, int64_t> known;
    int device = 0;
    C10_CUDA_CHECK(cudaGetDevice(&device));
    const Key key{reinterpret_cast<const void*>(kernel), device, threads, smem};
    std::lock_guard<std::mutex> lock(mu);
    const auto hit = known.find(key);
    if (hit != known.end()) return hit->second;
    int sms = 0, per_sm = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    if (smem > 48 * 1024)
        C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
    TORCH_CHECK(per_sm > 0, "a step kernel of ", threads, " threads and ", smem, " bytes of shared memory does not "
                "fit a multiprocessor of this device");
    return known[key] = (int64_t)sms * per_sm;
}

// The slots and first tiles of a launch in device memory: one buffer, uploaded by the binding's `upload`
// (copied from pinned host memory on the stream; the caching allocators keep both until the copy and the
// kernel are done).
const uint8_t* device_table(const StepBatch& b, const std::vector<StepSlot>& slots, const std::vector<int32_t>& first) {
    const size_t slot_bytes = slots.size() * sizeof(StepSlot), bytes = slot_bytes + first.size() * sizeof(int32_t);
    std::vector<uint8_t> host(bytes);
    std::memcpy(host.data(), slots.data(), slot_bytes);
    std::memcpy(host.data() + slot_bytes, first.data(), first.size() * sizeof(int32_t));
    TORCH_CHECK(b.upload, "the step's batch has no upload");
    return static_cast<const uint8_t*>(b.upload(host.data(), bytes));
}

// Launches one kernel for every tensor of the batch (tensors without elements are left out), over tiles
// of threads * kElems elements, on min(tiles, resident CTAs) persistent CTAs.
template <class Kernel, class Rule>
void launch_lists(const StepBatch& b, StepList list, Kernel kernel, const Rule& rule, int threads, size_t smem) {
    constexpr int K = Rule::kStates;
    static_assert(sizeof(StepSlot) % 8 == 0, "the first tiles follow the slots, 8-byte aligned");
    const int64_t tile = (int64_t)threads * kElems;
    std::vector<StepSlot> slots;
    std::vector<int32_t> first;
    int64_t tiles = 0;
    for (const StepTensor& in : b.tensors) {
        const int64_t numel = in.numel;
        if (numel == 0) continue;
        StepSlot s{};
        s.param = in.param;
        s.grad = in.grad;
        s.numel = numel;
        s.align_param = (uint8_t)alignment(s.param);
        s.align_grad = (uint8_t)alignment(s.grad);
        s.align_state = 16;
        for (int k = 0; k < K; ++k) {
            s.state[k] = in.state[k];
            s.align_state = (uint8_t)min_alignment(s.align_state, alignment(s.state[k]));
            // 4-bit state: the second moment's maxima are float32, carried as such
            s.absmax[k] = static_cast<uint16_t*>(in.absmax[k]);
        }
        if (b.has_keys) {
            const size_t t = (size_t)(&in - b.tensors.data());
            s.sr_key = (uint32_t)b.sr_keys[t];
            s.sr_index = b.sr_index[t];
            for (int k = 0; k < K; ++k) s.state_key[k] = q8_state_key(s.sr_key, k);
        }
        s.error_sums = in.error_sums;
        s.correction = in.correction;
        s.tensor = (int32_t)slots.size();
        s.first_tile = (int32_t)tiles;
        first.push_back((int32_t)tiles);
        tiles += ceil_div(numel, tile);
        s.end_tile = (int32_t)tiles;
        slots.push_back(s);
        TORCH_CHECK_VALUE(tiles < INT32_MAX, "the step's tensors need more than ", INT32_MAX, " tiles of ", tile,
                          " elements: more than one launch holds");
    }
    if (slots.empty()) return;
    first.push_back((int32_t)tiles);
    const uint8_t* table = device_table(b, slots, first);
    list.slot = reinterpret_cast<const StepSlot*>(table);
    list.first_tile = reinterpret_cast<const int32_t*>(table + slots.size() * sizeof(StepSlot));
    list.count = (int32_t)slots.size();
    list.tiles = (int32_t)tiles;
    const int64_t grid = resident_ctas(kernel, threads, smem);
    Q8_LAUNCH(kernel, (unsigned)(tiles < grid ? tiles : grid), threads, smem, c10::cuda::getCurrentCUDAStream(),
              list, rule);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <class Rule, class P, class G>
void launch_step(const StepBatch& b, const Rule& rule) {
    constexpr int K = Rule::kStates;
    static_assert(K >= 1 && K <= Q8_MAX_STATES, "a rule keeps 1 to Q8_MAX_STATES states");
    static_assert(sizeof(StepList) + sizeof(Rule) <= 4000, "the StepList and the rule must fit the parameter block");
    StepList list{};
    list.skip = b.skip;
    list.stochastic = b.stochastic;
    for (int k = 0; k < Q8_MAX_STATES; ++k) list.rounding_modes[k] = b.rounding_modes[k];
    if (b.fp32_states) {
        launch_lists(b, list, step_fp32_kernel<Rule, P, G>, rule, kStepThreads, 0);
        return;
    }
    const int T = (int)(b.block_size / kElems), threads = T > kStepThreads ? T : kStepThreads;
    list.block_shift = 0;
    while ((int64_t)1 << list.block_shift < b.block_size) ++list.block_shift;  // a power of two (checked)
    list.threads_per_qblock = T;
    if (b.four_bit) {  // Adam's rules only (the binding checks): no other rule's kernel is compiled
        if constexpr (std::is_same<Rule, AdamRule<true>>::value || std::is_same<Rule, AdamRule<false>>::value) {
            list.code[0] = b.four_maps;
            launch_lists(b, list, step4_kernel<Rule, P, G>, rule, threads, 0);
        }
        return;
    }
    // the maps: each state's kind, and a FloorTable in shared memory for each table map
    bool minifloat = true;  // every state on the minifloat map of its rule's sign: no shared tables
    int tables = 0;
    for (int k = 0; k < K; ++k) {
        list.code[k] = b.maps[k];
        list.lookup[k] = b.lookups[k];
        list.map_kind[k] = b.map_kind[k];
        list.table_slot[k] = (int8_t)(b.map_kind[k] == kMapTable ? tables++ : -1);
        const bool is_signed = ((Rule::kSigned >> k) & 1u) != 0u;
        minifloat = minifloat && b.map_kind[k] == (is_signed ? kMapMinifloatSigned : kMapMinifloatUnsigned);
    }
    bool guided = true, any_guided = false;  // the default's rounding: its own kernel (kCodecGuided)
    for (int k = 0; k < K; ++k) {
        guided = guided && list.rounding_modes[k] == Q8_ROUND_BY_OLD_CODE;
        any_guided = any_guided || list.rounding_modes[k] == Q8_ROUND_BY_OLD_CODE;
    }
    TORCH_CHECK_VALUE(guided || !any_guided, "rounding_modes: the CUDA step takes guided rounding only as "
                      "state_rounding=\"guided\" gives it (", Q8_ROUND_BY_OLD_CODE, ", by the old code, for every "
                      "state); mix nearest (", Q8_ROUND_NEAREST, ") and stochastic (", Q8_ROUND_STOCHASTIC, ") freely");
    if (!minifloat)
        launch_lists(b, list, step_kernel<Rule, P, G, kCodecTables>, rule, threads, tables * sizeof(FloorTable));
    else if (guided) launch_lists(b, list, step_kernel<Rule, P, G, kCodecGuided>, rule, threads, 0);
    else launch_lists(b, list, step_kernel<Rule, P, G, kCodecRunTime>, rule, threads, 0);
}


template <class Rule>
bool launch_dtypes(const StepBatch& b, const Rule& rule) {
    const Q8DType p = b.param_dtype, g = b.grad_dtype;
    constexpr Q8DType f32 = Q8DType::kFloat32, f16 = Q8DType::kFloat16, bf16 = Q8DType::kBFloat16;
    if (p == f32 && g == f32) return launch_step<Rule, float, float>(b, rule), true;
    if (p == f16 && g == f16) return launch_step<Rule, q8_half, q8_half>(b, rule), true;
    if (p == bf16 && g == bf16) return launch_step<Rule, q8_bf16, q8_bf16>(b, rule), true;
    if (p == f16 && g == f32) return launch_step<Rule, q8_half, float>(b, rule), true;
    if (p == bf16 && g == f32) return launch_step<Rule, q8_bf16, float>(b, rule), true;
    return false;
}


// The place of a rule in Q8_RULES.
constexpr int rule_index(const char* name) {
    constexpr const char* kNames[] = {
#define Q8_RULE_NAME(NAME, RULE) NAME,
        Q8_RULES(Q8_RULE_NAME)
#undef Q8_RULE_NAME
    };
    for (int i = 0; i < (int)(sizeof(kNames) / sizeof(kNames[0])); ++i) {
        const char *a = kNames[i], *b = name;
        while (*a != 0 && *a == *b) ++a, ++b;
        if (*a == *b) return i;
    }
    return -1;
}

// step_in_part<Part>: the rules of one part, each instantiated only in its own translation unit.
template <int Part>
bool step_rules_of_part(const StepBatch& b, const std::map<std::string, double>& hyper) {
    auto get = [&](const char* name) -> double {
        auto it = hyper.find(name);
        TORCH_CHECK_VALUE(it != hyper.end(), "update rule '", b.rule, "' needs hyperparameter '", name, "'");
        return it->second;
    };
#define Q8_PART_RULE(NAME, RULE)                                                                               \
    if constexpr (rule_index(NAME) % kStepParts == Part) {                                                     \
        if (b.rule == NAME) {                                                                                  \
            for (const StepTensor& in : b.tensors)                                                             \
                TORCH_CHECK_VALUE(in.states == RULE::kStates, "update rule '", b.rule, "' keeps ",              \
                                  RULE::kStates, " states, got ", in.states);                                 \
            TORCH_CHECK_VALUE(launch_dtypes(b, RULE(get)), "no CUDA kernel for param ", b.param_dtype_name,    \
                              " with grad ", b.grad_dtype_name, " (grad must have the param's dtype or float32)"); \
            return true;                                                                                       \
        }                                                                                                      \
    }
    Q8_RULES(Q8_PART_RULE)
#undef Q8_PART_RULE
    return false;
}

}  // namespace
}  // namespace ds_q8
