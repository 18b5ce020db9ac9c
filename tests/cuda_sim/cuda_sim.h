// Test-only CPU execution harness for the CUDA op's device code.
//
// tests/cuda_sim/kernels.cpp includes this header and then ds_q8/csrc/cuda/q8_cuda_kernels.cu,
// unmodified, and g++ compiles the pair as host C++. What CUDA gives a kernel, this header gives it:
//
// - the qualifiers (__global__, __device__, __forceinline__, __grid_constant__) as plain C++;
//   __shared__ variables become static variables in one linker section, q8sim_shared, whose bytes are
//   set to 0xFF (NaN as float) before every CTA, so a read before a write shows;
// - threadIdx/blockIdx/blockDim/gridDim, thread-local to the OS thread that plays the CUDA thread:
//   every CUDA thread of a CTA is one real thread, so __syncthreads is a real barrier and
//   __shfl_xor_sync a real exchange between the 32 lanes of a warp;
// - uint2/uint4 with CUDA's alignment (8 and 16 bytes: UBSan's alignment check sees a vector access
//   through a pointer that does not have it), __ldg, __float_as_uint, atomicAdd.
//
// It reports, as the launch's error (a RuntimeError in Python), instead of hanging:
// - a thread that reaches a __syncthreads after a thread of its CTA exited, or exits while others
//   wait at one; threads of one CTA waiting at different __syncthreads;
// - a lane that shuffles after a lane its mask names exited; lanes of a warp at different shuffles;
// - any wait longer than the watchdog (Q8_SIM_WATCHDOG_S seconds, default 60).
//
// CTAs run one after another (there is one copy of shared memory), so races between CTAs are out
// of its reach; races inside a CTA are ThreadSanitizer's to find (the -fsanitize=thread build).
// The math is the host's IEEE float with contraction off (-ffp-contract=off), as the op's
// -fmad=false asks of nvcc.
#pragma once

#include <ATen/ATen.h>  // before __CUDACC__ below: torch's headers must see a host compiler

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

// q8_common.h then takes its device branches (__CUDA_ARCH__): the code nvcc compiles for the GPU.
#define __CUDACC__ 1
#define __CUDA_ARCH__ 900
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __grid_constant__
#define __shared__ __attribute__((section("q8sim_shared"))) static

#define __launch_bounds__(...)

struct alignas(16) uint4 { unsigned int x, y, z, w; };
struct alignas(8) float2 { float x, y; };
struct alignas(8) uint2 { unsigned int x, y; };
struct uint3 { unsigned int x, y, z; };
struct dim3 {
    unsigned int x, y, z;
    dim3(unsigned int a = 1, unsigned int b = 1, unsigned int c = 1) : x(a), y(b), z(c) {}
};
inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) { return uint4{x, y, z, w}; }
inline uint2 make_uint2(unsigned int x, unsigned int y) { return uint2{x, y}; }

inline thread_local uint3 threadIdx{0, 0, 0};
inline thread_local uint3 blockIdx{0, 0, 0};
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;

inline unsigned int __float_as_uint(float f) {
    unsigned int u;
    std::memcpy(&u, &f, 4);
    return u;
}
inline float __uint_as_float(unsigned int u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
template <class T>
inline T __ldg(const T* p) { return *p; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }

inline double atomicAdd(double* address, double value) {
    auto* word = reinterpret_cast<uint64_t*>(address);
    uint64_t seen = __atomic_load_n(word, __ATOMIC_RELAXED), next;
    do {
        double now;
        std::memcpy(&now, &seen, 8);
        now += value;
        std::memcpy(&next, &now, 8);
    } while (!__atomic_compare_exchange_n(word, &seen, next, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
    double old;
    std::memcpy(&old, &seen, 8);
    return old;
}

extern char __start_q8sim_shared[] __attribute__((weak, visibility("hidden")));
extern char __stop_q8sim_shared[] __attribute__((weak, visibility("hidden")));

namespace q8sim {

// Unwinds a simulated thread once its launch has failed.
struct Abort {};

constexpr int kWarp = 32;

struct Warp {
    std::condition_variable cv;
    int size = 0, arrived = 0, exited = 0, line = 0, lane_mask = 0;
    unsigned mask = 0;
    uint64_t gen = 0;
    uint64_t slot[2][kWarp] = {};
};

// One launch: its CTAs run one after another, each on `threads` OS threads.
struct Launch {
    std::string name;
    int64_t grid = 0;
    int threads = 0;
    double watchdog_s = 60.0;
    std::mutex mu;
    bool failed = false;
    std::string error;
    // __syncthreads of the current CTA
    std::condition_variable cta_cv;
    int arrived = 0, exited = 0, line = 0;
    uint64_t gen = 0;
    std::vector<std::unique_ptr<Warp>> warps;
    // the harness's own barrier between CTAs, and the count of finished threads
    std::condition_variable end_cv, finished_cv;
    int at_end = 0, finished = 0;
    uint64_t end_gen = 0;
};

inline thread_local Launch* current = nullptr;
inline thread_local int thread_id = 0;

// Counters the tests read through ctypes (q8sim_stat below).
inline std::mutex stats_mu;
inline int64_t stat_launches = 0, stat_ctas = 0, stat_last_grid = 0, stat_last_threads = 0;

// 0 launches, 1 CTAs, 2 the last grid, 3 the last CTA size (q8sim_stat of kernels.cpp).
inline int64_t stat(int what) {
    std::lock_guard<std::mutex> g(stats_mu);
    switch (what) {
        case 0: return stat_launches;
        case 1: return stat_ctas;
        case 2: return stat_last_grid;
        case 3: return stat_last_threads;
        default: return -1;
    }
}

inline std::string where() {
    std::ostringstream s;
    s << "thread " << thread_id << " of CTA " << blockIdx.x;
    return s.str();
}

// Records the launch's first error and wakes every waiter; the caller holds L.mu.
inline void record(Launch& L, const std::string& what) {
    if (!L.failed) L.error = what;
    L.failed = true;
    L.cta_cv.notify_all();
    L.end_cv.notify_all();
    for (auto& w : L.warps) w->cv.notify_all();
}

[[noreturn]] inline void fail(Launch& L, const std::string& what) {
    record(L, what);
    throw Abort{};
}

// Waits on `cv` until `done()`, the launch fails (Abort) or the watchdog expires (a failure).
template <class Done>
void wait(Launch& L, std::unique_lock<std::mutex>& lk, std::condition_variable& cv, Done done, const char* at,
          int line) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(L.watchdog_s);
    while (true) {
        if (L.failed) throw Abort{};
        if (done()) return;
        if (cv.wait_until(lk, deadline) == std::cv_status::timeout && !done() && !L.failed) {
            std::ostringstream s;
            s << "watchdog: " << where() << " waited " << L.watchdog_s << " s at " << at << " (line " << line
              << "): a barrier that not every thread reaches";
            fail(L, s.str());
        }
    }
}

inline void syncthreads(int line) {
    Launch& L = *current;
    std::unique_lock<std::mutex> lk(L.mu);
    if (L.failed) throw Abort{};
    if (L.exited > 0) {
        std::ostringstream s;
        s << where() << " reached __syncthreads (line " << line << ") after " << L.exited
          << " thread(s) of its CTA exited: a barrier that not every thread reaches";
        fail(L, s.str());
    }
    if (L.arrived == 0) L.line = line;
    else if (L.line != line) {
        std::ostringstream s;
        s << where() << " waits at __syncthreads line " << line << " while others of its CTA wait at line " << L.line;
        fail(L, s.str());
    }
    const uint64_t gen = L.gen;
    if (++L.arrived == L.threads) {
        L.arrived = 0;
        ++L.gen;
        L.cta_cv.notify_all();
        return;
    }
    wait(L, lk, L.cta_cv, [&] { return L.gen != gen; }, "__syncthreads", line);
}

template <class T>
T shfl_xor(int line, unsigned mask, T var, int lane_mask, int width = kWarp) {
    static_assert(sizeof(T) <= 8, "shuffles of up to 8 bytes");
    Launch& L = *current;
    Warp& w = *L.warps[thread_id / kWarp];
    const int lane = thread_id % kWarp;
    std::unique_lock<std::mutex> lk(L.mu);
    if (L.failed) throw Abort{};
    const unsigned whole = w.size == kWarp ? 0xFFFFFFFFu : (1u << w.size) - 1u;
    if (mask != whole) {
        std::ostringstream s;
        s << where() << ": __shfl_xor_sync (line " << line << ") with mask " << std::hex << mask
          << ", not its whole warp (" << whole << "): partial masks are not modelled";
        fail(L, s.str());
    }
    if (w.exited > 0) {
        std::ostringstream s;
        s << where() << " (lane " << lane << ") calls __shfl_xor_sync (line " << line << ") after " << w.exited
          << " lane(s) of its warp named by the mask exited";
        fail(L, s.str());
    }
    if (w.arrived == 0) {
        w.line = line, w.mask = mask, w.lane_mask = lane_mask;
    } else if (w.line != line || w.lane_mask != lane_mask) {
        std::ostringstream s;
        s << where() << " (lane " << lane << ") shuffles at line " << line << " xor " << lane_mask
          << " while its warp shuffles at line " << w.line << " xor " << w.lane_mask;
        fail(L, s.str());
    }
    const uint64_t gen = w.gen;
    const int parity = (int)(gen & 1u);
    uint64_t bits = 0;
    std::memcpy(&bits, &var, sizeof(T));
    w.slot[parity][lane] = bits;
    if (++w.arrived == w.size) {
        w.arrived = 0;
        ++w.gen;
        w.cv.notify_all();
    } else {
        wait(L, lk, w.cv, [&] { return w.gen != gen; }, "__shfl_xor_sync", line);
    }
    const int src = lane ^ lane_mask;
    if (src >= w.size || src / width > lane / width) return var;  // CUDA: a later group gives the lane its own value
    T out;
    std::memcpy(&out, &w.slot[parity][src], sizeof(T));
    return out;
}

// The launch's dynamic shared memory (Q8_DYNAMIC_SHARED): one buffer, as CTAs run one after another.
inline std::vector<uint4> dynamic_buffer;

inline void* dynamic_shared() { return dynamic_buffer.data(); }

// 0xFF in every byte of every __shared__ variable and of the dynamic shared memory: a float read
// before a write is NaN.
__attribute__((no_sanitize("address"))) inline void poison_shared() {
    if (!dynamic_buffer.empty()) std::memset(dynamic_buffer.data(), 0xFF, dynamic_buffer.size() * sizeof(uint4));
    if (__start_q8sim_shared == nullptr) return;
    for (volatile char* p = __start_q8sim_shared; p < __stop_q8sim_shared; ++p) *p = (char)0xFF;
}

// The exit of a thread from the kernel body; the caller holds L.mu.
inline void thread_exited(Launch& L) {
    Warp& w = *L.warps[thread_id / kWarp];
    ++L.exited;
    ++w.exited;
    if (L.arrived > 0 && !L.failed) {
        std::ostringstream s;
        s << where() << " exited while " << L.arrived << " thread(s) of its CTA wait at __syncthreads line "
          << L.line << ": a barrier that not every thread reaches";
        record(L, s.str());
    }
    if (w.arrived > 0 && !L.failed) {
        std::ostringstream s;
        s << where() << " (lane " << thread_id % kWarp << ") exited while " << w.arrived
          << " lane(s) of its warp wait at __shfl_xor_sync line " << w.line;
        record(L, s.str());
    }
}

inline void worker(Launch& L, int t, const std::function<void()>& body) {
    current = &L;
    thread_id = t;
    threadIdx = uint3{(unsigned)t, 0, 0};
    blockDim = dim3((unsigned)L.threads);
    gridDim = dim3((unsigned)L.grid);
    for (int64_t b = 0; b < L.grid; ++b) {
        blockIdx = uint3{(unsigned)b, 0, 0};
        try {
            body();
        } catch (const Abort&) {
        } catch (const std::exception& e) {
            std::lock_guard<std::mutex> g(L.mu);
            record(L, where() + ": " + e.what());
        }
        std::unique_lock<std::mutex> lk(L.mu);
        thread_exited(L);
        if (L.failed) break;
        const uint64_t gen = L.end_gen;
        if (++L.at_end == L.threads) {  // the CTA is done: reset its barriers, poison its shared memory
            L.at_end = L.arrived = L.exited = 0;
            for (auto& w : L.warps) w->arrived = w->exited = 0;
            poison_shared();
            ++L.end_gen;
            L.end_cv.notify_all();
        } else {
            try {
                wait(L, lk, L.end_cv, [&] { return L.end_gen != gen; }, "the end of its CTA", 0);
            } catch (const Abort&) {
                break;
            }
        }
    }
    std::lock_guard<std::mutex> g(L.mu);
    ++L.finished;
    L.finished_cv.notify_all();
}

// The planted bug a test's copy of the .cu activates (Q8_SIM_BUG(n) there; see test_cuda_sim.py).
inline int planted_bug() {
    static const int n = std::getenv("Q8_SIM_BUG") != nullptr ? std::atoi(std::getenv("Q8_SIM_BUG")) : 0;
    return n;
}

inline double watchdog_seconds() {
    const char* s = std::getenv("Q8_SIM_WATCHDOG_S");
    return s != nullptr && std::atof(s) > 0 ? std::atof(s) : 60.0;
}

// What the harness reports as the device: few multiprocessors holding few CTAs each, so that the
// persistent kernels' CTAs each walk several tiles.
constexpr int kSimMultiprocessors = 2;
constexpr int kSimCtasPerMultiprocessor = 2;
constexpr size_t kSimSharedPerCta = 227 * 1024;  // a Hopper multiprocessor's most for one CTA

// A kernel launch: `grid` CTAs of `threads` threads with `smem` bytes of dynamic shared memory, each
// running `body` (the kernel call).
template <class Body>
void launch(const char* name, int64_t grid, int64_t threads, size_t smem, Body&& body) {
    TORCH_CHECK(grid >= 1 && grid <= INT32_MAX && threads >= 1 && threads <= 1024, "cuda_sim: launch of ", name,
                " with grid ", grid, " and ", threads, " threads per CTA, outside CUDA's limits");
    TORCH_CHECK(smem <= kSimSharedPerCta, "cuda_sim: launch of ", name, " with ", smem, " bytes of dynamic shared "
                "memory, more than a CTA can have");
    dynamic_buffer.assign((smem + sizeof(uint4) - 1) / sizeof(uint4), uint4{});
    Launch L;
    L.name = name;
    L.grid = grid;
    L.threads = (int)threads;
    L.watchdog_s = watchdog_seconds();
    for (int w = 0; w * kWarp < L.threads; ++w) {
        L.warps.push_back(std::make_unique<Warp>());
        L.warps.back()->size = std::min(kWarp, L.threads - w * kWarp);
    }
    poison_shared();
    const std::function<void()> fn = body;
    std::vector<std::thread> pool;
    pool.reserve(L.threads);
    for (int t = 0; t < L.threads; ++t) pool.emplace_back(worker, std::ref(L), t, std::cref(fn));
    {
        std::unique_lock<std::mutex> lk(L.mu);
        const auto limit = std::chrono::duration<double>(2 * L.watchdog_s + 10.0);
        if (!L.finished_cv.wait_for(lk, limit, [&] { return L.finished == L.threads; })) {
            // a thread that never waits (an endless loop) cannot be unwound: say so and stop the process
            std::fprintf(stderr, "cuda_sim: %s: %d of %d threads still running %.0f s after the launch (%s)\n", name,
                         L.threads - L.finished, L.threads, limit.count(), L.failed ? L.error.c_str() : "no error");
            std::fflush(stderr);
            std::_Exit(3);
        }
    }
    for (auto& t : pool) t.join();
    {
        std::lock_guard<std::mutex> g(stats_mu);
        ++stat_launches;
        stat_ctas += grid;
        stat_last_grid = grid;
        stat_last_threads = threads;
    }
    TORCH_CHECK(!L.failed, "cuda_sim: ", name, " <<<", grid, ", ", threads, ">>>: ", L.error);
}

}  // namespace q8sim

#define Q8_SIM_BUG(n) (::q8sim::planted_bug() == (n))
#define __syncthreads() ::q8sim::syncthreads(__LINE__)
#define __shfl_xor_sync(...) ::q8sim::shfl_xor(__LINE__, __VA_ARGS__)
#define Q8_LAUNCH(kernel, grid, threads, smem, stream, ...) \
    ::q8sim::launch(#kernel, (int64_t)(grid), (int64_t)(threads), (size_t)(smem), [&] { kernel(__VA_ARGS__); })
#define Q8_DYNAMIC_SHARED(T, name) T* name = reinterpret_cast<T*>(::q8sim::dynamic_shared())

// The CUDA runtime calls of the launchers, answered for the harness's device.
using cudaError_t = int;
constexpr cudaError_t cudaSuccess = 0;
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16 };
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
inline cudaError_t cudaGetDevice(int* device) { return *device = 0, cudaSuccess; }
inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int) {
    TORCH_CHECK(attr == cudaDevAttrMultiProcessorCount, "cuda_sim: device attribute ", (int)attr, " is not modelled");
    return *value = ::q8sim::kSimMultiprocessors, cudaSuccess;
}
template <class Kernel>
cudaError_t cudaFuncSetAttribute(Kernel, cudaFuncAttribute, int value) {
    TORCH_CHECK((size_t)value <= ::q8sim::kSimSharedPerCta, "cuda_sim: ", value, " bytes of shared memory asked for");
    return cudaSuccess;
}
template <class Kernel>
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* n, Kernel, int, size_t) {
    return *n = ::q8sim::kSimCtasPerMultiprocessor, cudaSuccess;
}
