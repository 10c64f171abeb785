// Host (g++, C++20) emulation of the CUDA C++ that tinyvit's kernels (tinyvit/kernels/cuda/*.cu,
// each module's SOURCE) use, for tests/cuda_emulator/emulator.py. What is emulated:
//   - one std::thread per CUDA thread; the blocks of a grid run one after another, the threads of a
//     block all at once (threadIdx, blockIdx, blockDim, gridDim as in CUDA);
//   - __syncthreads as a barrier of the block (EmuBarrier; a thread that returns drops out of it, as
//     on sm_70+), checked by call site: every thread that waits in one phase must wait at the same
//     line of the source (threads at two different __syncthreads is undefined on a GPU; a helper
//     function that calls it counts as one line);
//   - __shfl_sync / __shfl_xor_sync (full mask only) through a per-warp exchange at a barrier,
//     checked the same way: all 32 lanes at the same line, and none of them exited (a full-mask
//     shuffle after a lane returned, or with lanes a partial last warp lacks, is undefined on a GPU);
//     a check that fails is reported (emu_launch returns it, emulator.py raises), the launch goes on;
//   - dynamic shared memory (extern __shared__) as a malloc of exactly the launch's bytes, filled with
//     0xFF bytes (NaN) so that reading what no thread wrote shows up in the results; static __shared__
//     arrays become function statics (one copy, fine while blocks run one at a time), registered on
//     first use and refilled with 0xFF before every block (emulator.py rewrites their declarations);
//   - the explicitly rounded intrinsics (__fmul_rn, __dadd_rn, ...) as plain IEEE operations, rsqrt as
//     1 / sqrt, device math (expf, erfc, tanh, ...) as the host libm.
//   - -ftz=true: float32 kernels (an entry point named *_f32, or taking float and no double) run with
//     the CPU's flush-to-zero and denormals-are-zero flags, as CuPy compiles every kernel;
//   - fused multiply-adds: emulator.py builds with contraction on, as NVRTC compiles (the _rn
//     intrinsics below stay unfused, as on the GPU).
// What is NOT emulated: warp scheduling and lockstep execution (a race that a real GPU hides or shows
// may behave differently here), the CUDA memory model and caches, atomics, partial shuffle masks, and
// the last-ulp behaviour of the device math functions; g++ fuses multiply-adds where it sees them,
// not necessarily exactly where ptxas does, so float32 results agree with a GPU to rounding, not bit
// for bit.
#pragma once
#include <atomic>
#include <climits>
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <math.h>
#include <mutex>
#include <source_location>
#include <string>
#include <thread>
#include <utility>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

struct emu_uint3 { unsigned x, y, z; };
struct dim3 {
    unsigned x, y, z;
    dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};

inline thread_local emu_uint3 threadIdx;
inline thread_local emu_uint3 blockIdx;
inline emu_uint3 blockDim, gridDim;

// The first problem a check found in the current launch (emu_launch returns it to emulator.py).
inline std::mutex emu_error_mutex;
inline std::string emu_error;
inline void emu_report(const std::string& what) {
    std::lock_guard<std::mutex> lock(emu_error_mutex);
    if (emu_error.empty()) emu_error = what;
}

inline std::string emu_where(const std::source_location& s) {
    return std::string(s.file_name()) + ":" + std::to_string(s.line());
}

// Where each thread of a group (a block's threads, or a warp's lanes) waits, and which have exited:
// what the completion of each barrier phase checks (EmuBarrier runs it once all have arrived).
struct EmuSites {
    const char* what;                    // "__syncthreads" or "shuffle"
    bool exits_forbidden;                // shuffles: every lane of the mask must take part
    std::vector<std::source_location> site;
    std::vector<char> waiting, exited;
    EmuSites(const char* w, bool forbid, unsigned n)
        : what(w), exits_forbidden(forbid), site(n), waiting(n), exited(n) {}
    void check() noexcept {
        int first = -1, gone = -1;
        for (int i = 0; i < (int)site.size(); ++i) {
            if (exited[i]) { if (gone < 0) gone = i; continue; }
            if (!waiting[i]) continue;
            if (first < 0) { first = i; continue; }
            if (site[i].line() != site[first].line() || std::strcmp(site[i].file_name(), site[first].file_name()))
                emu_report("threads " + std::to_string(first) + " and " + std::to_string(i) + " of block (" +
                           std::to_string(blockIdx.x) + ", " + std::to_string(blockIdx.y) + ") wait at " +
                           "different " + what + " calls, " + emu_where(site[first]) + " and " + emu_where(site[i]));
        }
        if (exits_forbidden && first >= 0 && gone >= 0)
            emu_report("a full-mask shuffle at " + emu_where(site[first]) + " after lane " + std::to_string(gone) +
                       " of its warp exited (undefined on a GPU)");
    }
};
// A barrier of `count` threads that runs sites->check() when a phase completes; a thread that has
// exited drops out (arrive_and_drop). Its own atomics and a futex on its own phase word, not
// std::barrier: libstdc++'s std::barrier waits through a waiter table shared by every barrier of the
// process, whose atomic counters give ThreadSanitizer orderings between unrelated threads (two warps
// at their own shuffles), hiding real races between them. Here only this barrier's atomics order
// threads: each arrival releases, the last one acquires them all and releases the next phase.
class EmuBarrier {
public:
    EmuBarrier(unsigned count, EmuSites* sites) : state_((unsigned long long)count << 32), sites_(sites) {}
    void arrive_and_wait() {
        const unsigned phase = phase_.load(std::memory_order_acquire);
        const unsigned long long s = state_.fetch_add(1, std::memory_order_acq_rel) + 1;
        if ((unsigned)s == (unsigned)(s >> 32)) return complete(phase);
        for (int i = 0; i < 4 && phase_.load(std::memory_order_acquire) == phase; ++i)
            sched_yield();                // let the others arrive before sleeping (cheaper than a futex)
        while (phase_.load(std::memory_order_acquire) == phase)
            syscall(SYS_futex, &phase_, FUTEX_WAIT_PRIVATE, phase, nullptr, nullptr, 0);
    }
    void arrive_and_drop() {              // expected - 1 from now on; completes the phase if it was the last
        const unsigned phase = phase_.load(std::memory_order_acquire);
        const unsigned long long s = state_.fetch_sub(1ull << 32, std::memory_order_acq_rel) - (1ull << 32);
        if ((unsigned)s > 0 && (unsigned)s == (unsigned)(s >> 32)) complete(phase);
    }

private:
    void complete(unsigned phase) {       // every live thread has arrived: none arrives or drops meanwhile
        sites_->check();
        state_.fetch_and(~0xffffffffull, std::memory_order_relaxed);          // arrived = 0
        phase_.store(phase + 1, std::memory_order_release);
        syscall(SYS_futex, &phase_, FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
    }
    std::atomic<unsigned long long> state_;     // expected << 32 | arrived
    std::atomic<unsigned> phase_{0};
    EmuSites* sites_;
};

struct EmuWarp {
    EmuSites sites{"shuffle", true, 32};
    EmuBarrier bar{32, &sites};
    unsigned long long slot[2][32];      // double-buffered: exchange k writes slot[k % 2]
    unsigned phase[32] = {};             // each lane's count of exchanges so far
};
inline thread_local unsigned char* emu_shared_memory;
inline thread_local EmuBarrier* emu_block_barrier;
inline thread_local EmuSites* emu_block_sites;
inline thread_local EmuWarp* emu_warp;
inline thread_local unsigned emu_linear_thread;

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __shared__ static

[[noreturn]] inline void emu_fail(const char* what) {
    std::fprintf(stderr, "cuda emulator: %s\n", what);
    std::abort();
}

// Static __shared__ arrays seen so far: (address, bytes), NaN-filled at registration and per block.
inline std::mutex emu_static_shared_mutex;
inline std::vector<std::pair<void*, size_t>> emu_static_shared;
inline bool emu_register_shared(void* p, size_t bytes) {
    std::lock_guard<std::mutex> lock(emu_static_shared_mutex);
    std::memset(p, 0xFF, bytes);
    emu_static_shared.emplace_back(p, bytes);
    return true;
}

inline void __syncthreads(std::source_location site = std::source_location::current()) {
    const unsigned t = emu_linear_thread;
    emu_block_sites->site[t] = site;
    emu_block_sites->waiting[t] = 1;
    emu_block_barrier->arrive_and_wait();
    emu_block_sites->waiting[t] = 0;
}

// One barrier phase per shuffle: lanes write their value into this exchange's buffer, wait for all
// 32, read the source lane's. The next exchange writes the other buffer, and no lane can start the
// one after (this buffer again) before every lane has arrived at the next, i.e. finished reading.
template <typename T> T emu_exchange(T v, int source, const std::source_location& site) {
    static_assert(sizeof(T) <= 8, "shuffle of more than 8 bytes");
    EmuWarp* w = emu_warp;
    const unsigned lane = emu_linear_thread % 32;
    unsigned long long* slot = w->slot[w->phase[lane]++ & 1];
    unsigned long long bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    slot[lane] = bits;
    w->sites.site[lane] = site;
    w->sites.waiting[lane] = 1;
    w->bar.arrive_and_wait();           // every lane has written its value (the completion checks sites)
    w->sites.waiting[lane] = 0;
    bits = slot[source & 31];
    T r;
    std::memcpy(&r, &bits, sizeof(T));
    return r;
}
template <typename T> T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32,
                                        std::source_location site = std::source_location::current()) {
    if (mask != 0xffffffffu || width != 32) emu_report("a partial shuffle mask or width at " + emu_where(site));
    return emu_exchange(v, (int)(emu_linear_thread % 32) ^ lane_mask, site);
}
template <typename T> T __shfl_sync(unsigned mask, T v, int source, int width = 32,
                                    std::source_location site = std::source_location::current()) {
    if (mask != 0xffffffffu || width != 32) emu_report("a partial shuffle mask or width at " + emu_where(site));
    return emu_exchange(v, source, site);
}

inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline double __longlong_as_double(long long i) { double d; std::memcpy(&d, &i, 8); return d; }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
template <typename T> inline T min(T a, T b) { return b < a ? b : a; }
template <typename T> inline T max(T a, T b) { return a < b ? b : a; }
// The explicitly rounded intrinsics: one IEEE operation each, whose result the compiler may not fuse
// with a neighbouring one (the build contracts a * b + c into an FMA, as the GPU compiler does; the
// GPU never fuses an _rn intrinsic). The empty asm statement hides a value from the optimizer: the
// operands and the rounded result.
template <typename T> inline T emu_rounded(T v) {
    __asm__("" : "+m"(v));
    return v;
}
inline float __fadd_rn(float a, float b) { return emu_rounded(emu_rounded(a) + emu_rounded(b)); }
inline float __fsub_rn(float a, float b) { return emu_rounded(emu_rounded(a) - emu_rounded(b)); }
inline float __fmul_rn(float a, float b) { return emu_rounded(emu_rounded(a) * emu_rounded(b)); }
inline float __fdiv_rn(float a, float b) { return emu_rounded(emu_rounded(a) / emu_rounded(b)); }
inline float __fsqrt_rn(float a) { return emu_rounded(sqrtf(a)); }
inline double __dadd_rn(double a, double b) { return emu_rounded(emu_rounded(a) + emu_rounded(b)); }
inline double __dsub_rn(double a, double b) { return emu_rounded(emu_rounded(a) - emu_rounded(b)); }
inline double __dmul_rn(double a, double b) { return emu_rounded(emu_rounded(a) * emu_rounded(b)); }
inline double __ddiv_rn(double a, double b) { return emu_rounded(emu_rounded(a) / emu_rounded(b)); }
inline double __dsqrt_rn(double a) { return emu_rounded(sqrt(a)); }

// -ftz=true, as CuPy compiles every kernel: float32 denormals flushed to zero, as inputs and as
// results. The CPU's flag is per thread and covers float and double alike, so the launcher sets it
// for float32 kernels only (a GPU never flushes doubles; the float32 kernels do no double arithmetic).
inline void emu_flush_denormals() {
#if defined(__x86_64__) || defined(__i386__)
    _mm_setcsr(_mm_getcsr() | 0x8040);     // FTZ (bit 15) and DAZ (bit 6) of MXCSR
#elif defined(__aarch64__)
    unsigned long long fpcr;
    __asm__ volatile("mrs %0, fpcr" : "=r"(fpcr));
    __asm__ volatile("msr fpcr, %0" : : "r"(fpcr | (1ull << 24)));     // FZ
#else
    emu_fail("flushing denormals is not emulated on this CPU");
#endif
}

// Run kernel on grid x block: blocks one after another, a block's threads at once; ftz: flush float
// denormals (a float32 kernel). Returns the first problem a check found, or nullptr.
template <typename... P, typename... A>
const char* emu_launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t shared, bool ftz, A... args) {
    emu_error.clear();
    const unsigned threads = block.x * block.y * block.z;
    if (threads == 0 || threads > 1024) emu_fail("block of 0 or more than 1024 threads");
    const unsigned warps = (threads + 31) / 32;
    blockDim = {block.x, block.y, block.z};
    gridDim = {grid.x, grid.y, grid.z};
    for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
    for (unsigned bx = 0; bx < grid.x; ++bx) {
        unsigned char* memory = static_cast<unsigned char*>(std::malloc(shared ? shared : 1));
        std::memset(memory, 0xFF, shared ? shared : 1);
        for (auto& [p, bytes] : emu_static_shared) std::memset(p, 0xFF, bytes);
        EmuSites block_sites("__syncthreads", false, threads);
        EmuBarrier bar(threads, &block_sites);
        std::vector<EmuWarp> warp(warps);
        // a partial last warp: its missing lanes count as exited (a full-mask shuffle there fails)
        for (unsigned t = threads; t < warps * 32; ++t) {
            warp[t / 32].sites.exited[t % 32] = 1;
            warp[t / 32].bar.arrive_and_drop();
        }
        std::vector<std::thread> pool;
        pool.reserve(threads);
        for (unsigned t = 0; t < threads; ++t) {
            pool.emplace_back([&, t] {
                threadIdx = {t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
                blockIdx = {bx, by, bz};
                emu_linear_thread = t;
                emu_shared_memory = memory;
                emu_block_barrier = &bar;
                emu_block_sites = &block_sites;
                emu_warp = &warp[t / 32];
                if (ftz) emu_flush_denormals();
                kernel(args...);
                block_sites.exited[t] = 1;
                bar.arrive_and_drop();      // an exited thread no longer holds up __syncthreads
                warp[t / 32].sites.exited[t % 32] = 1;
                warp[t / 32].bar.arrive_and_drop();
            });
        }
        for (auto& th : pool) th.join();
        std::free(memory);
    }
    return emu_error.empty() ? nullptr : emu_error.c_str();
}
