// The CUDA device-side names the kernels use, for the host (sim.cpp includes this before
// kernels/kvrs.cu): qualifiers, vector types, __shared__ memory, __syncthreads, warp
// shuffles and votes, and kvrs.cu's cooperative primitives (see the top of kvrs.cu), its
// tensor-core instructions too (tensor_core.h).
// Barriers and collectives need the fiber launch (KF in sim.cpp's table); called from a
// kernel launched as a plain loop (K), they fail the launch.
#pragma once
#include <math.h>
#include <string.h>

#include <type_traits>

#include "scheduler.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// One block runs at a time on a host thread, so thread-local statics are per block.
#define __shared__ static thread_local
// Only at function scope (a local pointer to the block's dynamic shared memory).
#define KVRS_DYNAMIC_SHARED(T, name) T* const name = reinterpret_cast<T*>(::kvrs_sim::t_dynamic_shared)
#define __syncthreads() ::kvrs_sim::sync_block(__FILE__, __LINE__)

constexpr int warpSize = 32;

// CUDA's vector types (vector_types.h) with the device's alignment.
#define KVRS_SIM_VEC2(T, N) \
    struct __align__(2 * sizeof(T)) N##2 { T x, y; }; \
    inline N##2 make_##N##2(T x, T y) { return {x, y}; }
#define KVRS_SIM_VEC4(T, N) \
    struct __align__(4 * sizeof(T)) N##4 { T x, y, z, w; }; \
    inline N##4 make_##N##4(T x, T y, T z, T w) { return {x, y, z, w}; }
KVRS_SIM_VEC2(float, float)
KVRS_SIM_VEC4(float, float)
KVRS_SIM_VEC2(int, int)
KVRS_SIM_VEC4(int, int)
KVRS_SIM_VEC2(unsigned, uint)
KVRS_SIM_VEC4(unsigned, uint)
#undef KVRS_SIM_VEC2
#undef KVRS_SIM_VEC4

template <typename T> inline T __ldg(const T* p) { return *p; }

namespace kvrs_sim {

// Fails a plain-loop launch that reached a collective.
inline bool in_fibers(const char* what) {
    if (t_runner != nullptr) return true;
    t_plain_collective = what;
    return false;
}

inline void sync_block(const char* file, int line) {
    if (in_fibers("__syncthreads")) t_runner->block_barrier(file, line);
}

// Kinds of warp collective (lanes meeting at different kinds diverge); a group
// reduction's kind also holds its operation and width.
enum Kind : int { SYNC, SHUFFLE, VOTE, GROUP_SUM = 64, GROUP_MAX = 128 };

// Every lane of `mask` gets the value its source lane published.
inline void take_sources(const Warp& w, Fiber* lanes, unsigned mask) {
    for (unsigned m = mask; m != 0; m &= m - 1) {
        Fiber& g = lanes[__builtin_ctz(m)];
        g.got = w.slot[g.src & 31];
    }
}

// The value lane `src` (of the calling lane's warp) published in the same shuffle.
template <typename T>
inline T shuffle(unsigned mask, T v, unsigned src) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffles move up to 8 bytes");
    if (!in_fibers("a warp shuffle")) return v;
    uint64_t u = 0;
    memcpy(&u, &v, sizeof v);
    const uint64_t r = t_runner->warp_collective(mask, SHUFFLE, u, src, take_sources);
    T out;
    memcpy(&out, &r, sizeof out);
    return out;
}

inline unsigned lane() { return t_runner ? t_runner->me().lane : 0; }

// The lanes of `mask` whose predicate is nonzero.
inline unsigned vote(unsigned mask, int pred) {
    if (!in_fibers("a warp vote")) return pred ? mask : 0;
    return (unsigned)t_runner->warp_collective(mask, VOTE, pred != 0, 0, [](const Warp& w, Fiber* lanes, unsigned m) {
        unsigned ballot = 0;
        for (unsigned b = m; b != 0; b &= b - 1) {
            if (w.slot[__builtin_ctz(b)]) ballot |= b & -b;
        }
        for (unsigned b = m; b != 0; b &= b - 1) lanes[__builtin_ctz(b)].got = ballot;
    });
}

// x reduced by op over aligned groups of W lanes as the xor butterfly computes it on the
// GPU (x = op(x, partner's x) for partner offsets W/2, ..., 1), in one warp barrier:
// the last lane to arrive evaluates the butterfly of all 32 lanes.
template <int W, int KIND, typename Op>
inline float group_reduce(float x, Op op) {
    static_assert(W >= 1 && W <= 32 && (W & (W - 1)) == 0, "W is a power of two <= 32");
    if (!in_fibers("a group reduction")) return x;
    uint32_t u;
    memcpy(&u, &x, 4);
    const uint32_t r = (uint32_t)t_runner->warp_collective(0xffffffffu, KIND + W, u, 0, [op](const Warp& w, Fiber* lanes, unsigned mask) {
        float a[32];
        for (int l = 0; l < 32; ++l) {
            const uint32_t b = (uint32_t)w.slot[l];
            memcpy(&a[l], &b, 4);
        }
        for (int m = W / 2; m > 0; m >>= 1) {
            float next[32];
            for (int l = 0; l < 32; ++l) next[l] = op(a[l], a[l ^ m]);
            memcpy(a, next, sizeof a);
        }
        for (unsigned b = mask; b != 0; b &= b - 1) {
            const int l = __builtin_ctz(b);
            uint32_t bits;
            memcpy(&bits, &a[l], 4);
            lanes[l].got = bits;
        }
    });
    float out;
    memcpy(&out, &r, 4);
    return out;
}

}  // namespace kvrs_sim

// Shuffles as PTX's shfl.sync defines them for CUDA's width (a power of two <= 32): the
// low 5 bits of the lane, lane mask or offset count; a lane reads within its own group
// of `width` lanes, and an out-of-group source gives it its own value (xor may also
// read lower groups).
template <typename T> inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
    const unsigned l = kvrs_sim::lane();
    return kvrs_sim::shuffle(mask, v, (l & ~(unsigned)(width - 1)) | ((unsigned)src & (unsigned)(width - 1)));
}
template <typename T> inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    const unsigned l = kvrs_sim::lane(), s = l ^ ((unsigned)lane_mask & 31);
    return kvrs_sim::shuffle(mask, v, s > (l | (unsigned)(width - 1)) ? l : s);
}
template <typename T> inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    const unsigned l = kvrs_sim::lane(), d = delta & 31;
    return kvrs_sim::shuffle(mask, v, (l & (unsigned)(width - 1)) + d >= (unsigned)width ? l : l + d);
}
template <typename T> inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    const unsigned l = kvrs_sim::lane(), d = delta & 31;
    return kvrs_sim::shuffle(mask, v, (l & (unsigned)(width - 1)) < d ? l : l - d);
}
inline void __syncwarp(unsigned mask = 0xffffffffu) {
    if (kvrs_sim::in_fibers("__syncwarp")) {
        kvrs_sim::t_runner->warp_collective(mask, kvrs_sim::SYNC, 0, 0, [](const kvrs_sim::Warp&, kvrs_sim::Fiber*, unsigned) {});
    }
}
inline unsigned __ballot_sync(unsigned mask, int pred) { return kvrs_sim::vote(mask, pred); }
inline int __any_sync(unsigned mask, int pred) { return kvrs_sim::vote(mask, pred) != 0; }
inline int __all_sync(unsigned mask, int pred) {
    return kvrs_sim::vote(mask, pred) == (kvrs_sim::t_runner ? kvrs_sim::t_runner->me().mask : mask);
}

// kvrs.cu's cooperative primitives (their GPU definitions are under #ifndef KVRS_SIM).
template <int W> inline float kvrs_group_sum(float x) {
    return kvrs_sim::group_reduce<W, kvrs_sim::GROUP_SUM>(x, [](float a, float b) { return a + b; });
}
template <int W> inline float kvrs_group_max(float x) {
    return kvrs_sim::group_reduce<W, kvrs_sim::GROUP_MAX>(x, [](float a, float b) { return fmaxf(a, b); });
}
// The copy completes at once, so commit and wait have nothing to do.
inline void kvrs_cp_async16(void* dst, const void* src) { memcpy(dst, src, 16); }
inline void kvrs_cp_async_commit() {}
template <int N> inline void kvrs_cp_async_wait() {}

#include "tensor_core.h"
