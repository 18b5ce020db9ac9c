// Test-only: the CUDA op's device code and launchers (q8_cuda_kernels.cu and the step's parts, found on
// the include path: the shipped files, or planted-bug copies of them) compiled as host C++ over the
// harness of cuda_sim.h, as one translation unit.
#include "cuda_sim.h"

#include "q8_cuda_kernels.cu"
#include "q8_cuda_step_0.cu"
#include "q8_cuda_step_1.cu"
#include "q8_cuda_step_2.cu"
#include "q8_cuda_step_3.cu"
#include "q8_cuda_step_4.cu"
#include "q8_cuda_step_5.cu"
#include "q8_cuda_step_6.cu"
#include "q8_cuda_step_7.cu"

#include "device_checks.h"

extern "C" __attribute__((visibility("default"))) int64_t q8sim_stat(int what) { return q8sim::stat(what); }

// Whether the last launch ran AdamW's 8-bit step kernel `which`: 0 the guided default's own (kCodecGuided) and
// 1 the one that reads each state's rounding at run time (kCodecRunTime), for fp32 parameters; 2 and 3 the same
// for bf16; 4 and 5 the kernel of table maps (kCodecTables), fp32 and bf16.
extern "C" __attribute__((visibility("default"))) int64_t q8sim_last_kernel_is(int which) {
    using ds_q8::AdamRule;
    using ds_q8::q8_bf16;
    const void* kernels[] = {
        reinterpret_cast<const void*>(&ds_q8::step_kernel<AdamRule<true>, float, float, ds_q8::kCodecGuided>),
        reinterpret_cast<const void*>(&ds_q8::step_kernel<AdamRule<true>, float, float, ds_q8::kCodecRunTime>),
        reinterpret_cast<const void*>(&ds_q8::step_kernel<AdamRule<true>, q8_bf16, q8_bf16, ds_q8::kCodecGuided>),
        reinterpret_cast<const void*>(&ds_q8::step_kernel<AdamRule<true>, q8_bf16, q8_bf16, ds_q8::kCodecRunTime>),
        reinterpret_cast<const void*>(&ds_q8::step_kernel<AdamRule<true>, float, float, ds_q8::kCodecTables>),
        reinterpret_cast<const void*>(&ds_q8::step_kernel<AdamRule<true>, q8_bf16, q8_bf16, ds_q8::kCodecTables>),
    };
    if (which < 0 || which >= 6) return -1;
    return q8sim::stat(4) == reinterpret_cast<int64_t>(kernels[which]) ? 1 : 0;
}
