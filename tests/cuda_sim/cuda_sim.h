// Test-only CPU execution harness for the CUDA op's device code.
//
// tests/cuda_sim/kernels.cpp includes this header and then ds_q8/csrc/cuda/q8_cuda_kernels.cu,
// unmodified, and g++ compiles the pair as host C++. What CUDA gives a kernel, this header gives it:
//
// - the qualifiers (__global__, __device__, __forceinline__, __grid_constant__) as plain C++;
//   __shared__ variables become static variables in one linker section, q8sim_shared, whose bytes are
//   set to 0xFF (NaN as float) before every CTA, so a read before a write shows;
// - threadIdx/blockIdx/blockDim/gridDim. Every CUDA thread of a CTA is a fiber with its own stack
//   (ucontext), and one OS thread per launch runs them in turn, each until it waits at a barrier or
//   exits: __syncthreads is a barrier and __shfl_xor_sync an exchange between the 32 lanes of a warp
//   (__all_sync is five of them), without an OS thread switch at each;
// - the PTX instructions the kernels name (q8_cuda_ptx.cuh), from ptx_emulation.h;
// - uint2/uint4 with CUDA's alignment (8 and 16 bytes: UBSan's alignment check sees a vector access
//   through a pointer that does not have it), __ldg, __float_as_uint, atomicAdd.
//
// It reports, as the launch's error (a RuntimeError in Python), instead of hanging:
// - a thread that reaches a __syncthreads after a thread of its CTA exited, or exits while others
//   wait at one; threads of one CTA waiting at different __syncthreads;
// - a lane that shuffles after a lane its mask names exited; lanes of a warp at different shuffles;
// - a whole turn of the fibers in which none moves (a deadlock), and it stops the process when a
//   launch outlives 2 * Q8_SIM_WATCHDOG_S + 10 seconds (default 60: a thread that never yields).
//
// CTAs run one after another (there is one copy of shared memory), so races between CTAs are out
// of its reach. Races inside a CTA are ThreadSanitizer's to find (the -fsanitize=thread build): each
// fiber is a thread to it, ordered with the others only by the barriers and warp exchanges between
// them (each arrival releases, each departure acquires), so two accesses with no barrier between
// them are a race whichever order the fibers ran them in. AddressSanitizer is told of every stack switch.
// The math is the host's IEEE float with contraction off (-ffp-contract=off), as the op's
// -fmad=false asks of nvcc.
#pragma once

// c10's checks (all of torch the device code and its launchers use) before __CUDACC__ below: its headers must
// see a host compiler
#include <c10/util/Exception.h>

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

#include <pthread.h>

#include "fibers.h"
#include "ptx_emulation.h"

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
#define __maxnreg__(...)

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
    int size = 0, arrived = 0, exited = 0, line = 0, lane_mask = 0;
    unsigned mask = 0;
    uint64_t gen = 0;
    uint64_t slot[2][kWarp] = {};
    uint64_t sync[2] = {};  // ThreadSanitizer's sync objects, one per parity of gen
};

// One launch: its CTAs run one after another; a CTA's `threads` CUDA threads are fibers that one OS thread
// runs in turn, each until it waits at a barrier or exits.
struct Launch {
    std::string name;
    int64_t grid = 0;
    int threads = 0;
    double watchdog_s = 60.0;
    const std::function<void()>* body = nullptr;
    bool failed = false;
    std::string error;
    // __syncthreads of the current CTA
    int arrived = 0, exited = 0, line = 0;
    uint64_t gen = 0;
    uint64_t cta_sync[2] = {};
    std::vector<std::unique_ptr<Warp>> warps;
    // the harness's own barrier between CTAs
    int at_end = 0;
    uint64_t end_gen = 0;
    uint64_t end_sync[2] = {};
    // the fibers, the OS thread's own context (main) and the one running (-1: main)
    std::vector<Fiber> fibers;
    Fiber main;
    int running = -1;
    // arrivals, passings and exits: a whole turn of the fibers that leaves it unchanged is a deadlock
    uint64_t progress = 0;
    uint64_t start_sync = 0, exit_sync = 0;
    // between the launching thread and the one that runs the fibers
    std::mutex mu;
    std::condition_variable finished_cv;
    bool finished = false;
};

inline thread_local Launch* current = nullptr;
inline thread_local int thread_id = 0;

// Counters the tests read through ctypes (q8sim_stat below).
inline std::mutex stats_mu;
inline int64_t stat_launches = 0, stat_ctas = 0, stat_last_grid = 0, stat_last_threads = 0;
inline const void* stat_last_kernel = nullptr;  // the kernel function of the last launch (q8sim_last_kernel_is)

inline void note_kernel(const void* kernel) {
    std::lock_guard<std::mutex> g(stats_mu);
    stat_last_kernel = kernel;
}

// 0 launches, 1 CTAs, 2 the last grid, 3 the last CTA size, 4 the last kernel's address (q8sim_stat of
// kernels.cpp).
inline int64_t stat(int what) {
    std::lock_guard<std::mutex> g(stats_mu);
    switch (what) {
        case 0: return stat_launches;
        case 1: return stat_ctas;
        case 2: return stat_last_grid;
        case 3: return stat_last_threads;
        case 4: return reinterpret_cast<int64_t>(stat_last_kernel);
        default: return -1;
    }
}

inline std::string where() {
    std::ostringstream s;
    s << "thread " << thread_id << " of CTA " << blockIdx.x;
    return s.str();
}

// Records the launch's first error; every waiting thread unwinds when it next runs.
inline void record(Launch& L, const std::string& what) {
    if (!L.failed) L.error = what;
    L.failed = true;
}

[[noreturn]] inline void fail(Launch& L, const std::string& what) {
    record(L, what);
    throw Abort{};
}

// The CUDA thread's registers: what the kernel reads as threadIdx and blockIdx.
inline void enter(Launch& L, int t) {
    thread_id = t;
    threadIdx = uint3{(unsigned)t, 0, 0};
    blockIdx = uint3{(unsigned)L.fibers[t].block, 0, 0};
}

// The next fiber in turn after `t` that has not finished, or -1 when none has.
inline int next_live(Launch& L, int t) {
    for (int k = 1; k <= L.threads; ++k) {
        const int n = (t + k) % L.threads;
        if (!L.fibers[n].done) return n;
    }
    return -1;
}

// Lets every other unfinished fiber run once, each until it waits or exits.
inline void yield(Launch& L) {
    const int me = L.running, n = next_live(L, me);
    if (n == me) return;
    L.running = n;
    switch_to(L.fibers[me], L.fibers[n], false, false);
    enter(L, me);
}

// Waits until `done()`, or unwinds (Abort) when the launch fails or no thread of the CTA can go on.
template <class Done>
void wait(Launch& L, Done done, const char* at, int line) {
    uint64_t seen = L.progress;
    while (true) {
        yield(L);
        if (L.failed) throw Abort{};
        if (done()) {
            ++L.progress;
            return;
        }
        if (L.progress == seen) {
            std::ostringstream s;
            s << "deadlock: " << where() << " waits at " << at << " (line " << line
              << ") and no thread of its CTA can go on: a barrier that not every thread reaches";
            fail(L, s.str());
        }
        seen = L.progress;
    }
}

inline void syncthreads(int line) {
    Launch& L = *current;
    Quiet quiet;
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
    release(&L.cta_sync[gen & 1u]);
    ++L.progress;
    if (++L.arrived == L.threads) {
        L.arrived = 0;
        ++L.gen;
    } else {
        wait(L, [&] { return L.gen != gen; }, "__syncthreads", line);
    }
    acquire(&L.cta_sync[gen & 1u]);
}

template <class T>
T shfl_xor(int line, unsigned mask, T var, int lane_mask, int width = kWarp) {
    static_assert(sizeof(T) <= 8, "shuffles of up to 8 bytes");
    Launch& L = *current;
    Quiet quiet;
    Warp& w = *L.warps[thread_id / kWarp];
    const int lane = thread_id % kWarp;
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
    release(&w.sync[parity]);
    ++L.progress;
    if (++w.arrived == w.size) {
        w.arrived = 0;
        ++w.gen;
    } else {
        wait(L, [&] { return w.gen != gen; }, "__shfl_xor_sync", line);
    }
    acquire(&w.sync[parity]);
    const int src = lane ^ lane_mask;
    if (src >= w.size || src / width > lane / width) return var;  // CUDA: a later group gives the lane its own value
    T out;
    std::memcpy(&out, &w.slot[parity][src], sizeof(T));
    return out;
}

// __all_sync over the whole warp: the lanes' predicates ANDed through five exchanges of shfl_xor, so that
// it waits, checks and orders like one.
inline int all_sync(int line, unsigned mask, int predicate) {
    int all = predicate != 0;
    for (int lane_mask = kWarp / 2; lane_mask > 0; lane_mask /= 2) all &= shfl_xor(line, mask, all, lane_mask);
    return all;
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

// The exit of a thread from the kernel body.
inline void thread_exited(Launch& L) {
    Warp& w = *L.warps[thread_id / kWarp];
    ++L.exited;
    ++w.exited;
    ++L.progress;
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

// One CUDA thread's work: the kernel body once per CTA, and the harness's barrier at each CTA's end.
inline void run_ctas(Launch& L, int t) {
    for (int64_t b = 0; b < L.grid; ++b) {
        {
            Quiet quiet;
            L.fibers[t].block = b;
            enter(L, t);
        }
        try {
            (*L.body)();
        } catch (const Abort&) {
        } catch (const std::exception& e) {
            Quiet quiet;
            record(L, where() + ": " + e.what());
        }
        Quiet quiet;
        thread_exited(L);
        if (L.failed) return;
        const uint64_t gen = L.end_gen;
        release(&L.end_sync[gen & 1u]);
        ++L.progress;
        if (++L.at_end == L.threads) {  // the CTA is done: reset its barriers, poison its shared memory
            L.at_end = L.arrived = L.exited = 0;
            for (auto& w : L.warps) w->arrived = w->exited = 0;
            poison_shared();
            ++L.end_gen;
        } else {
            try {
                wait(L, [&] { return L.end_gen != gen; }, "the end of its CTA", 0);
            } catch (const Abort&) {
                return;
            }
        }
        acquire(&L.end_sync[gen & 1u]);
    }
}

// A fiber's entry (makecontext): the CUDA thread's work, then the OS thread to the next fiber, or back to
// main after the last.
inline void fiber_main() {
#if defined(__SANITIZE_ADDRESS__)
    __sanitizer_finish_switch_fiber(nullptr, nullptr, nullptr);
#endif
    Launch* launch;
    int t;
    {
        Quiet quiet;
        launch = current;
        t = launch->running;
    }
    Launch& L = *launch;
    acquire(&L.start_sync);  // the launch as its thread set it up (a fiber kept from an earlier launch knew none of it)
    run_ctas(L, t);
    Fiber *me, *to;
    {
        Quiet quiet;  // ended before the switch: ThreadSanitizer refuses a fiber that ends inside one
        L.fibers[t].done = true;
        const int n = next_live(L, t);
        L.running = n;
        me = &L.fibers[t], to = n < 0 ? &L.main : &L.fibers[n];
        release(&L.exit_sync);
    }
    switch_to(*me, *to, to == &L.main, true);
    std::abort();  // a finished fiber is never switched to
}

// Runs the launch's fibers on this OS thread, from the first to the last one's exit.
inline void run_fibers(Launch& L) {
    current = &L;
    blockDim = dim3((unsigned)L.threads);
    gridDim = dim3((unsigned)L.grid);
    pthread_attr_t attr;  // this thread's own stack, for AddressSanitizer's switch notes
    void* bottom = nullptr;
    pthread_getattr_np(pthread_self(), &attr);
    pthread_attr_getstack(&attr, &bottom, &L.main.size);
    pthread_attr_destroy(&attr);
    L.main.stack = static_cast<char*>(bottom);
#if defined(__SANITIZE_THREAD__)
    L.main.tsan = __tsan_get_current_fiber();
#endif
    L.fibers.resize(L.threads);
    for (Fiber& f : L.fibers) {
        const FiberStore store = take_store();
        f.stack = store.stack, f.tsan = store.tsan;
        f.size = kFiberStack;
#if defined(__SANITIZE_ADDRESS__)
        __asan_unpoison_memory_region(f.stack, f.size);  // what an earlier fiber's frames left poisoned
#endif
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = f.stack;
        f.ctx.uc_stack.ss_size = f.size;
        f.ctx.uc_link = nullptr;
        makecontext(&f.ctx, fiber_main, 0);
        // no stack in the saved context: AddressSanitizer's swapcontext then leaves the fiber's shadow alone
        f.ctx.uc_stack.ss_sp = nullptr;
        f.ctx.uc_stack.ss_size = 0;
    }
    L.running = 0;
    release(&L.start_sync);
    switch_to(L.main, L.fibers[0], true, false);
    acquire(&L.exit_sync);  // what every CUDA thread wrote, before the launch returns
    for (const Fiber& f : L.fibers) give_store(FiberStore{f.stack, f.tsan});
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
    auto owned = std::make_unique<Launch>();  // on the heap: ThreadSanitizer forgets its sync objects when freed
    Launch& L = *owned;
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
    L.body = &fn;
    std::thread runner([&L] {
        run_fibers(L);
        std::lock_guard<std::mutex> g(L.mu);
        L.finished = true;
        L.finished_cv.notify_all();
    });
    {
        std::unique_lock<std::mutex> lk(L.mu);
        const auto limit = std::chrono::duration<double>(2 * L.watchdog_s + 10.0);
        if (!L.finished_cv.wait_for(lk, limit, [&] { return L.finished; })) {
            // a thread that never waits (an endless loop) holds the OS thread: say so and stop the process
            std::fprintf(stderr, "cuda_sim: %s: still running %.0f s after the launch: a CUDA thread that never "
                         "reaches a barrier or its end\n", name, limit.count());
            std::fflush(stderr);
            std::_Exit(3);
        }
    }
    runner.join();
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
#define __all_sync(...) ::q8sim::all_sync(__LINE__, __VA_ARGS__)
#define Q8_LAUNCH(kernel, grid, threads, smem, stream, ...)                                                  \
    (::q8sim::note_kernel(reinterpret_cast<const void*>(kernel)),                                              \
     ::q8sim::launch(#kernel, (int64_t)(grid), (int64_t)(threads), (size_t)(smem), [&] { kernel(__VA_ARGS__); }))
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
