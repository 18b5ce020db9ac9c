// Test-only: the fibers of the CUDA execution harness (cuda_sim.h). Each CUDA thread is a fiber (ucontext)
// with its own stack; the sanitizers are told of every stack switch, and ThreadSanitizer of the order that
// the barriers give (release/acquire) and of nothing else.
#pragma once

#include <sys/mman.h>
#include <ucontext.h>

#include <cstdint>
#include <mutex>
#include <vector>

#include <c10/util/Exception.h>

// The sanitizers' interfaces for code that switches stacks (their runtimes export them).
#if defined(__SANITIZE_THREAD__)
extern "C" {
void* __tsan_get_current_fiber();
void* __tsan_create_fiber(unsigned flags);
void __tsan_switch_to_fiber(void* fiber, unsigned flags);
void __tsan_acquire(void* addr);
void __tsan_release(void* addr);
void __tsan_ignore_thread_begin();
void __tsan_ignore_thread_end();
}
#endif
#if defined(__SANITIZE_ADDRESS__)
extern "C" {
void __sanitizer_start_switch_fiber(void** fake_stack_save, const void* bottom, size_t size);
void __sanitizer_finish_switch_fiber(void* fake_stack_save, const void** bottom_old, size_t* size_old);
void __asan_unpoison_memory_region(void const volatile* addr, size_t size);
}
#endif

namespace q8sim {

// What ThreadSanitizer is told. A barrier's arrivals release into a sync object of the barrier and its
// departures acquire it, so the kernel's memory accesses are ordered by the barriers and warp exchanges
// between them and by nothing else (switching fibers orders nothing). The harness's own bookkeeping is
// invisible to it (Quiet).
inline void release(uint64_t* sync) {
#if defined(__SANITIZE_THREAD__)
    __tsan_release(sync);
#else
    (void)sync;
#endif
}
inline void acquire(uint64_t* sync) {
#if defined(__SANITIZE_THREAD__)
    __tsan_acquire(sync);
#else
    (void)sync;
#endif
}
struct Quiet {
#if defined(__SANITIZE_THREAD__)
    Quiet() { __tsan_ignore_thread_begin(); }
    ~Quiet() { __tsan_ignore_thread_end(); }
    Quiet(const Quiet&) = delete;
#endif
};

// A CUDA thread: its own stack and context, run by the launch's OS thread in turn with the others.
struct Fiber {
    ucontext_t ctx{};
    char* stack = nullptr;
    size_t size = 0;
    void* tsan = nullptr;
    int64_t block = 0;
    bool done = false;
};

constexpr size_t kFiberStack = 256 * 1024;

// A fiber's stack (kFiberStack bytes above a guard page) and ThreadSanitizer's state for it, kept from one
// launch to the next: making them is most of a launch's cost under ThreadSanitizer.
struct FiberStore {
    char* stack = nullptr;
    void* tsan = nullptr;
};
inline std::mutex stores_mu;
inline std::vector<FiberStore> free_stores;

inline FiberStore take_store() {
    {
        std::lock_guard<std::mutex> g(stores_mu);
        if (!free_stores.empty()) {
            FiberStore s = free_stores.back();
            free_stores.pop_back();
            return s;
        }
    }
    const size_t page = 4096;
    void* p = mmap(nullptr, kFiberStack + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    TORCH_CHECK(p != MAP_FAILED, "cuda_sim: no memory for a CUDA thread's stack");
    mprotect(p, page, PROT_NONE);  // an overflow faults
    FiberStore s;
    s.stack = static_cast<char*>(p) + page;
#if defined(__SANITIZE_THREAD__)
    s.tsan = __tsan_create_fiber(0);
#endif
    return s;
}

inline void give_store(const FiberStore& s) {
    std::lock_guard<std::mutex> g(stores_mu);
    free_stores.push_back(s);
}

// Hands the OS thread from `from` to `to`; returns when a switch comes back to `from`. `with_main`: one of
// them is the OS thread's own context (ThreadSanitizer orders the switch); `from_done`: `from` never runs again.
inline void switch_to(Fiber& from, Fiber& to, bool with_main, bool from_done) {
    void *tsan, *stack;
    size_t size;
    {
        Quiet quiet;  // ended before the switch: a fiber's ignores are its own
        tsan = to.tsan, stack = to.stack, size = to.size;
    }
#if defined(__SANITIZE_THREAD__)
    const unsigned no_sync = 1;  // __tsan_switch_to_fiber_no_sync
    __tsan_switch_to_fiber(tsan, with_main ? 0 : no_sync);
#else
    (void)with_main, (void)tsan;
#endif
#if defined(__SANITIZE_ADDRESS__)
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(from_done ? nullptr : &fake, stack, size);
#else
    (void)from_done, (void)stack, (void)size;
#endif
    swapcontext(&from.ctx, &to.ctx);
#if defined(__SANITIZE_ADDRESS__)
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
}

}  // namespace q8sim
