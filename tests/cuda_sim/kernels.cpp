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

extern "C" __attribute__((visibility("default"))) int64_t q8sim_stat(int what) { return q8sim::stat(what); }
