// Test-only: the CUDA op's device code and launchers (q8_cuda_kernels.cu, found on the include path:
// the shipped file, or a planted-bug copy of it) compiled as host C++ over the harness of cuda_sim.h.
#include "cuda_sim.h"

#include "q8_cuda_kernels.cu"

extern "C" __attribute__((visibility("default"))) int64_t q8sim_stat(int what) { return q8sim::stat(what); }
