// Test-only stand-in for torch's c10/cuda/CUDAStream.h in the CPU execution harness (tests/cuda_sim):
// every launch runs to completion before it returns, so one stream is all there is.
#pragma once

namespace c10 {
namespace cuda {

struct CUDAStream {};

inline CUDAStream getCurrentCUDAStream() { return {}; }

}  // namespace cuda
}  // namespace c10

// The harness reports a failed launch by throwing from the launch itself.
#define C10_CUDA_KERNEL_LAUNCH_CHECK() ((void)0)
// Its runtime calls (cuda_sim.h) answer cudaSuccess or throw.
#define C10_CUDA_CHECK(expr) TORCH_CHECK((expr) == 0, "cuda_sim: ", #expr, " failed")
