// Test-only: the CUDA op's torch binding (q8_cuda.cpp, unmodified) for CPU tensors; its launchers
// are those of kernels.cpp, which run the device code on the CPU (cuda_sim.h).
#define Q8_TENSOR_ON_DEVICE(t) (t).is_cpu()

#include "q8_cuda.cpp"
