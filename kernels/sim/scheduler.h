// The simulator's block scheduler (sim.cpp): runs one thread block as fibers (fiber.h)
// on the launching host thread, with the GPU's barrier semantics, and reports what a
// GPU would leave undefined (deadlocks, divergent barriers) as launch errors.
//
// A pass resumes every runnable fiber once, in the launch's order (KVRS_SIM_ORDER); a
// fiber runs until it waits at a barrier or returns.
// - __syncthreads(): the fiber waits at a block barrier. When no fiber can run and
//   every thread of the block waits at the same __syncthreads (same source line), all
//   are released (and a seeded order is reshuffled). Waits at different lines, or some
//   threads returned while others wait, is a divergent barrier (DIVERGENT).
// - Warp collectives: the lane publishes its value in its warp's slot and waits; the
//   last lane of the mask to arrive computes every lane's result (the source lane's
//   value for a shuffle, the ballot, a group reduction's butterfly), releases the others
//   and keeps running. Lanes that meet with different masks or at different kinds of
//   collective are a divergent collective (DIVERGENT).
// - No runnable fiber while some wait at a warp barrier: DEADLOCK.
#pragma once
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <string>
#include <vector>

#include "fiber.h"

struct dim3 {
    unsigned x, y, z;
};
// The built-in variables; the scheduler sets threadIdx on every resume.
static thread_local dim3 blockIdx, threadIdx, blockDim, gridDim;

namespace kvrs_sim {

// kvrs_sim_launch's results (src/storage/cuda/sim.rs reads them).
enum Status : int {
    OK = 0,
    NO_KERNEL = -1,
    DEADLOCK = -2,
    DIVERGENT = -3,
    MISUSE = -4,        // a collective in a kernel registered with K, a lane outside its mask
    BAD_LAUNCH = -5,    // a launch configuration a GPU refuses, a bad KVRS_SIM_ORDER
    OUT_OF_MEMORY = -6, // no memory for fiber stacks or dynamic shared memory
};

// The order in which a pass resumes the block's threads.
enum class Order : uint8_t { Forward, Reverse, Seeded };
struct OrderSetting {
    Order order;
    uint64_t seed;
};

// The message of this host thread's last failed launch.
static thread_local std::string t_error;
// The dynamic shared memory of the block running on this host thread.
static thread_local unsigned char* t_dynamic_shared;
// The collective a kernel launched as a plain loop (K) called, if any.
static thread_local const char* t_plain_collective;
// The order set by kvrs_sim_set_order for this host thread, if any.
static thread_local bool t_order_set;
static thread_local OrderSetting t_order;

// Parses KVRS_SIM_ORDER: unset or "forward", "reverse", "seed:N". false if malformed.
inline bool parse_order(const char* s, OrderSetting* out) {
    *out = {Order::Forward, 0};
    if (s == nullptr || *s == 0 || strcmp(s, "forward") == 0) return true;
    if (strcmp(s, "reverse") == 0) {
        out->order = Order::Reverse;
        return true;
    }
    if (strncmp(s, "seed:", 5) == 0 && s[5] != 0) {
        char* end;
        out->seed = strtoull(s + 5, &end, 10);
        out->order = Order::Seeded;
        return *end == 0;
    }
    return false;
}

inline uint64_t splitmix64(uint64_t* state) {
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

enum class State : uint8_t { Run, AtBlock, AtWarp, Done };

// One CUDA thread.
struct Fiber {
    Context ctx;
    dim3 tid;
    unsigned warp, lane;
    State state;
    unsigned mask;    // the lanes of its pending warp collective
    int kind;         // which collective that is
    unsigned src;     // the lane whose value a shuffle reads
    uint64_t got;     // the collective's result for this lane
    int line;         // the source line of its pending __syncthreads
    const char* file;
};

// The values a warp's lanes published for their pending collectives.
struct Warp {
    uint64_t slot[32];
    unsigned waiting;  // lanes at a warp collective
    unsigned lanes;    // lanes that exist
};

// Runs the blocks of one launch as fibers on this host thread.
class Runner {
  public:
    Runner(void (*kernel)(void**), void** params, unsigned threads, OrderSetting order)
        : kernel_(kernel), params_(params), fibers_(threads), warps_((threads + 31) / 32), order_(threads),
          order_setting_(order) {}
    ~Runner() { stack_pool().give(stacks_); }

    // Takes the fiber stacks; false when the system has no memory for them.
    bool init() {
        stacks_.reserve(fibers_.size());
        for (size_t i = 0; i < fibers_.size(); ++i) {
            char* s = stack_pool().take();
            if (s == nullptr) return false;
            stacks_.push_back(s);
        }
        return true;
    }

    // Runs block blockIdx to its end, or to the first error (its message in t_error).
    Status run_block() {
        const unsigned n = (unsigned)fibers_.size();
        for (unsigned i = 0; i < n; ++i) {
            Fiber& f = fibers_[i];
            f.tid = {i % blockDim.x, i / blockDim.x % blockDim.y, i / (blockDim.x * blockDim.y)};
            f.warp = i / 32;
            f.lane = i % 32;
            f.state = State::Run;
            context_init(&f.ctx, stacks_[i], &entry);
        }
        for (size_t w = 0; w < warps_.size(); ++w) {
            warps_[w].waiting = 0;
            const unsigned have = n - (unsigned)w * 32;
            warps_[w].lanes = have >= 32 ? ~0u : (1u << have) - 1;
        }
        live_ = n;
        phase_ = 0;
        arrange();
        for (;;) {
            bool ran = false;
            for (unsigned i : order_) {
                Fiber& f = fibers_[i];
                if (f.state != State::Run) continue;
                ran = true;
                me_ = &f;
                threadIdx = f.tid;
                context_switch(&main_, &f.ctx);
                if (status_ != OK) return status_;
            }
            if (ran) continue;
            if (live_ == 0) return OK;
            const Status s = release_block_barrier();
            if (s != OK) return s;
        }
    }

    // __syncthreads() at file:line.
    void block_barrier(const char* file, int line) {
        Fiber& f = *me_;
        f.state = State::AtBlock;
        f.file = file;
        f.line = line;
        context_switch(&f.ctx, &main_);
    }

    // A warp collective of kind `kind` over `mask`: publishes `value` (and the lane a
    // shuffle reads, `src`), waits until every existing lane of `mask` has arrived and
    // returns the lane's result. The last lane to arrive calls
    // complete(warp, warp's first fiber, mask) to set every lane's `got`.
    template <class Complete>
    uint64_t warp_collective(unsigned mask, int kind, uint64_t value, unsigned src, Complete&& complete) {
        Fiber& f = *me_;
        Warp& w = warps_[f.warp];
        const unsigned bit = 1u << f.lane;
        if ((mask & bit) == 0) {
            fail(MISUSE, "thread " + thread_name(f) + " calls a warp collective with mask " + hex(mask) +
                             ", which does not name its own lane " + std::to_string(f.lane));
        }
        w.slot[f.lane] = value;
        mask &= w.lanes;
        f.mask = mask;
        f.kind = kind;
        f.src = src;
        w.waiting |= bit;
        if ((w.waiting & mask) != mask) {
            f.state = State::AtWarp;
            context_switch(&f.ctx, &main_);
            return f.got;
        }
        Fiber* lanes = &fibers_[f.warp * 32];
        for (unsigned m = mask; m != 0; m &= m - 1) {
            const Fiber& g = lanes[__builtin_ctz(m)];
            if (g.mask != mask || g.kind != kind) {
                fail(DIVERGENT, "divergent warp collective in block " + block_name() + ": thread " + thread_name(f) +
                                    (g.kind != kind ? " and thread " + thread_name(g) + " call different collectives"
                                                    : " uses mask " + hex(mask) + ", thread " + thread_name(g) +
                                                          " mask " + hex(g.mask)));
            }
        }
        complete(w, lanes, mask);
        w.waiting &= ~mask;
        for (unsigned m = mask & ~bit; m != 0; m &= m - 1) lanes[__builtin_ctz(m)].state = State::Run;
        return f.got;
    }

    // The calling thread's fiber.
    const Fiber& me() const { return *me_; }

    // Fails the launch as a misuse of a collective (MISUSE), for the reason `why`.
    [[noreturn]] void misuse(std::string why) { fail(MISUSE, std::move(why)); }

  private:
    // Each fiber's first frame: runs the kernel, then leaves for good.
    static void entry();

    [[noreturn]] void fail(Status s, std::string why) {
        status_ = s;
        t_error = std::move(why);
        me_->state = State::Done;
        context_switch(&me_->ctx, &main_);
        __builtin_unreachable();
    }

    [[noreturn]] void finish() {
        me_->state = State::Done;
        --live_;
        context_switch(&me_->ctx, &main_);
        __builtin_unreachable();
    }

    // Every live fiber waits: releases them if they all wait at one __syncthreads.
    Status release_block_barrier() {
        const Fiber* first = nullptr;
        const Fiber* exited = nullptr;
        for (const Fiber& f : fibers_) {
            if (f.state == State::AtWarp) return deadlock();
            if (f.state == State::Done) {
                exited = exited ? exited : &f;
                continue;
            }
            if (first == nullptr) {
                first = &f;
            } else if (f.line != first->line || strcmp(f.file, first->file) != 0) {
                t_error = "divergent __syncthreads in block " + block_name() + ": thread " + thread_name(*first) +
                          " waits at " + site(*first) + ", thread " + thread_name(f) + " at " + site(f);
                return DIVERGENT;
            }
        }
        if (exited != nullptr) {
            t_error = "divergent __syncthreads in block " + block_name() + ": thread " + thread_name(*exited) +
                      " returned while " + std::to_string(live_) + " threads wait at " + site(*first);
            return DIVERGENT;
        }
        for (Fiber& f : fibers_) f.state = State::Run;
        ++phase_;
        if (order_setting_.order == Order::Seeded) arrange();
        return OK;
    }

    // Describes the first thread waiting at a warp collective and the first waiting at
    // __syncthreads.
    Status deadlock() {
        std::string why = "deadlock in block " + block_name() + ": no thread can run";
        const Fiber* at_warp = nullptr;
        const Fiber* at_block = nullptr;
        for (const Fiber& f : fibers_) {
            if (f.state == State::AtWarp && at_warp == nullptr) at_warp = &f;
            if (f.state == State::AtBlock && at_block == nullptr) at_block = &f;
        }
        if (at_warp != nullptr) {
            const Fiber& f = *at_warp;
            const unsigned missing = f.mask & ~warps_[f.warp].waiting;
            unsigned gone = 0;
            for (unsigned m = missing; m != 0; m &= m - 1) {
                if (fibers_[f.warp * 32 + (unsigned)__builtin_ctz(m)].state == State::Done) gone |= m & -m;
            }
            why += "; thread " + thread_name(f) + " waits at a warp collective (mask " + hex(f.mask) + ") for lanes " +
                   hex(missing) + (gone ? " (lanes " + hex(gone) + " returned)" : "");
        }
        if (at_block != nullptr) why += "; thread " + thread_name(*at_block) + " waits at __syncthreads at " + site(*at_block);
        t_error = std::move(why);
        return DEADLOCK;
    }

    // Sets the resume order for the next phase.
    void arrange() {
        const unsigned n = (unsigned)order_.size();
        for (unsigned i = 0; i < n; ++i) order_[i] = order_setting_.order == Order::Reverse ? n - 1 - i : i;
        if (order_setting_.order != Order::Seeded) return;
        uint64_t state = order_setting_.seed ^ (((uint64_t)blockIdx.z << 42) ^ ((uint64_t)blockIdx.y << 21) ^ blockIdx.x) ^
                         (phase_ * 0x2545f4914f6cdd1dull);
        for (unsigned i = n; i > 1; --i) {
            const unsigned j = (unsigned)(splitmix64(&state) % i);
            const unsigned t = order_[i - 1];
            order_[i - 1] = order_[j];
            order_[j] = t;
        }
    }

    static std::string hex(unsigned v) {
        char b[16];
        snprintf(b, sizeof b, "0x%08x", v);
        return b;
    }
    static std::string thread_name(const Fiber& f) {
        return "(" + std::to_string(f.tid.x) + "," + std::to_string(f.tid.y) + "," + std::to_string(f.tid.z) + ")";
    }
    static std::string block_name() {
        return "(" + std::to_string(blockIdx.x) + "," + std::to_string(blockIdx.y) + "," + std::to_string(blockIdx.z) +
               ")";
    }
    static std::string site(const Fiber& f) {
        const char* base = strrchr(f.file, '/');
        return std::string(base ? base + 1 : f.file) + ":" + std::to_string(f.line);
    }

    void (*kernel_)(void**);
    void** params_;
    std::vector<Fiber> fibers_;
    std::vector<Warp> warps_;
    std::vector<unsigned> order_;
    std::vector<char*> stacks_;
    OrderSetting order_setting_;
    Context main_;
    Fiber* me_ = nullptr;
    unsigned live_ = 0;
    uint64_t phase_ = 0;
    Status status_ = OK;
};

// The runner of the fiber launch on this host thread (null in plain loops).
static thread_local Runner* t_runner;

inline void Runner::entry() {
    Runner& r = *t_runner;
    r.kernel_(r.params_);
    r.finish();
}

}  // namespace kvrs_sim
