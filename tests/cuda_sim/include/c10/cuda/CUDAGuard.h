// Test-only stand-in for torch's c10/cuda/CUDAGuard.h in the CPU execution harness (tests/cuda_sim):
// the harness runs the CUDA op's launchers on CPU tensors, so there is no device to switch to.
#pragma once

#include <c10/core/Device.h>
#include <c10/util/Exception.h>

namespace c10 {
namespace cuda {

struct CUDAGuard {
    explicit CUDAGuard(c10::Device device) {
        TORCH_CHECK(device.is_cpu(), "cuda_sim: the harness runs on CPU tensors, got a tensor on ", device);
    }
};

}  // namespace cuda
}  // namespace c10
