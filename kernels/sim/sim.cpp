// The kvrs kernels (kernels/kvrs.cu) compiled for the host, so the CUDA backend's launch
// code and the kernels themselves are tested on machines without a GPU (cargo feature
// `cuda-sim`). Device memory is host memory. Kernels registered with K (no barriers, no
// shared memory across threads, no warp collectives) run every block and thread of the
// grid one after another in a plain loop. Kernels registered with KF run each block as
// one fiber per thread (fiber.h, scheduler.h): __syncthreads, __shared__ memory (per
// block), dynamic shared memory, warp shuffles and votes, and kvrs.cu's group
// reductions behave as on the GPU (cooperative.h), and a deadlock or divergent barrier
// fails the launch. KVRS_SIM_ORDER=reverse|seed:N (or kvrs_sim_set_order) changes the
// order in which threads resume after each barrier, to expose a missing barrier.
// kernels/sim/test_kernels.cu holds the simulator's own test kernels (not in kvrs.ptx).
#define KVRS_SIM 1  // kvrs.cu leaves the cooperative primitives to the simulator
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <tuple>
#include <type_traits>
#include <utility>

#include "cooperative.h"

#include "../kvrs.cu"
#include "test_kernels.cu"

namespace {

// Calls `f` with its arguments read from `params`, as cuLaunchKernel passes them: one
// pointer per argument, to a value of the argument's type (a reference parameter, the
// launch words, refers to that value in place).
template <typename... A, size_t... I>
void call(void (*f)(A...), void** params, std::index_sequence<I...>) {
    f(*static_cast<std::remove_reference_t<A>*>(params[I])...);
}
template <typename... A>
void invoke(void (*f)(A...), void** params) {
    call(f, params, std::index_sequence_for<A...>{});
}

struct Entry {
    const char* name;
    void (*run)(void**);
    bool fibers;  // runs each block as fibers (KF)
};

// K: a kernel without cooperation between threads (plain loop); KF: one with barriers,
// shared memory or warp collectives (fibers).
#define K(NAME) Entry{#NAME, [](void** p) { invoke(NAME, p); }, false}
#define KF(NAME) Entry{#NAME, [](void** p) { invoke(NAME, p); }, true}
// The attention kernels of one dtype pair, one per head size.
#define K_ATTENTION(PREFIX) KF(PREFIX##_d64), KF(PREFIX##_d128), KF(PREFIX##_d256), KF(PREFIX##_dn)
#define K_INPUTS(PREFIX, TN) K(PREFIX##_f32_##TN), K(PREFIX##_f16_##TN), K(PREFIX##_bf16_##TN)
// A kernel taking launch words: its instances with the words in a parameter or behind a pointer.
#define KW(NAME) K(NAME##_w480), K(NAME##_w4000), K(NAME##_wp)
#define KW_INPUTS(PREFIX, TN) KW(PREFIX##_f32_##TN), KW(PREFIX##_f16_##TN), KW(PREFIX##_bf16_##TN)
#define K_STORAGE(TN)                                                                           \
    KW_INPUTS(kvrs_scatter, TN), K_INPUTS(kvrs_append_contiguous, TN), K_INPUTS(kvrs_copy3, TN), \
        K_INPUTS(kvrs_scale3, TN), KW(kvrs_gather_##TN), K(kvrs_rope_rotate_##TN),                \
        K_ATTENTION(kvrs_paged_attention_##TN), KF(kvrs_attention_merge_##TN)
#define K_FP8(TN)                                                                               \
    KW_INPUTS(kvrs_scatter, TN), K_INPUTS(kvrs_append_contiguous, TN), K_INPUTS(kvrs_copy3, TN), \
        K(kvrs_copy3_##TN##_f32), K(kvrs_copy3_##TN##_f16), K(kvrs_copy3_##TN##_bf16),          \
        K_ATTENTION(kvrs_paged_attention_f32_##TN), K_ATTENTION(kvrs_paged_attention_f16_##TN),          \
        K_ATTENTION(kvrs_paged_attention_bf16_##TN)
// The tensor-core attention kernels of one dtype.
#define K_MMA(TN) KF(kvrs_paged_attention_mma_##TN##_d64), KF(kvrs_paged_attention_mma_##TN##_d128), KF(kvrs_paged_attention_mma_##TN##_d256)
#define K_INT8(SN)                                                                             \
    KW(kvrs_scatter_##SN##_i8), K(kvrs_append_contiguous_##SN##_i8), K(kvrs_quantize3_##SN), \
        K(kvrs_dequantize3_##SN), K_ATTENTION(kvrs_paged_attention_##SN##_i8)

const Entry KERNELS[] = {
    KW(kvrs_copy_blocks), KW(kvrs_load_blocks), KW(kvrs_save_blocks), K(kvrs_advance_counter), K_STORAGE(f32), K_STORAGE(f16), K_STORAGE(bf16),
    K_FP8(e4m3),         K_FP8(e5m2),             K_INT8(f32),    K_INT8(f16),    K_INT8(bf16),
    K(kvrs_copy3_b8_b8), KW(kvrs_gather_b8),      K(kvrs_zero3_b8), K(kvrs_zero3_b16), K(kvrs_zero3_b32),
    K_MMA(f16), K_MMA(bf16), KF(kvrs_paged_attention_mla_f16), KF(kvrs_paged_attention_mla_bf16),
    KF(kvrs_attention_merge_f16_d512), KF(kvrs_attention_merge_bf16_d512),
    // The simulator's own tests (test_kernels.cu).
    KF(kvrs_test_block_sum), KF(kvrs_test_shuffles), KF(kvrs_test_votes), KF(kvrs_test_group_reductions),
    KF(kvrs_test_dynamic_shared), KF(kvrs_test_neighbour_sum), KF(kvrs_test_deadlock), KF(kvrs_test_divergent),
    K(kvrs_test_plain_barrier), KF(kvrs_test_mma_f16), KF(kvrs_test_mma_bf16), KF(kvrs_test_ldmatrix),
    KF(kvrs_test_ldmatrix_mma_f16), KF(kvrs_test_ldmatrix_mma_bf16),
};

}  // namespace

// Dynamic shared memory a block may have (sm_90's opt-in maximum).
static const size_t MAX_SHARED_BYTES = 227 * 1024;

// Runs kernel `name` over grid x block with `shared_bytes` of dynamic shared memory per
// block; returns 0 or a kvrs_sim::Status, with the reason in kvrs_sim_last_error().
extern "C" int kvrs_sim_launch(const char* name, const unsigned grid[3], const unsigned block[3], unsigned shared_bytes,
                               void** params) {
    using namespace kvrs_sim;
    const Entry* e = nullptr;
    for (const Entry& k : KERNELS) {
        if (strcmp(k.name, name) == 0) e = &k;
    }
    if (e == nullptr) {
        t_error = std::string("no kernel named ") + name;
        return NO_KERNEL;
    }
    const uint64_t threads = (uint64_t)block[0] * block[1] * block[2];
    if (threads > 1024 || shared_bytes > MAX_SHARED_BYTES) {
        t_error = std::string(name) + ": a block of " + std::to_string(threads) + " threads and " +
                  std::to_string(shared_bytes) + " bytes of dynamic shared memory is more than a GPU runs (1024, " +
                  std::to_string(MAX_SHARED_BYTES) + ")";
        return BAD_LAUNCH;
    }
    OrderSetting order = t_order;
    if (!t_order_set && !parse_order(getenv("KVRS_SIM_ORDER"), &order)) {
        t_error = "KVRS_SIM_ORDER is not forward, reverse or seed:N";
        return BAD_LAUNCH;
    }
    const uint64_t blocks = (uint64_t)grid[0] * grid[1] * grid[2];
    if (blocks == 0 || threads == 0) return OK;
    // 16-byte aligned, filled with NaN bytes per block so reads before writes show.
    void* shared = nullptr;
    if (shared_bytes > 0 && posix_memalign(&shared, 16, shared_bytes) != 0) {
        t_error = "no host memory for dynamic shared memory";
        return OUT_OF_MEMORY;
    }
    t_dynamic_shared = static_cast<unsigned char*>(shared);
    t_plain_collective = nullptr;
    gridDim = {grid[0], grid[1], grid[2]};
    blockDim = {block[0], block[1], block[2]};
    Status status = OK;
    if (!e->fibers) {
        for (unsigned bz = 0; bz < grid[2]; ++bz)
            for (unsigned by = 0; by < grid[1]; ++by)
                for (unsigned bx = 0; bx < grid[0]; ++bx) {
                    if (shared != nullptr) memset(shared, 0xff, shared_bytes);
                    for (unsigned tz = 0; tz < block[2]; ++tz)
                        for (unsigned ty = 0; ty < block[1]; ++ty)
                            for (unsigned tx = 0; tx < block[0]; ++tx) {
                                blockIdx = {bx, by, bz};
                                threadIdx = {tx, ty, tz};
                                e->run(params);
                            }
                }
        if (t_plain_collective != nullptr) {
            t_error = std::string(name) + " calls " + t_plain_collective +
                      " but kernels/sim/sim.cpp runs it as a plain loop: register it with KF";
            status = MISUSE;
        }
    } else {
        Runner runner(e->run, params, (unsigned)threads, order);
        if (!runner.init()) {
            t_error = "no memory for fiber stacks";
            status = OUT_OF_MEMORY;
        }
        t_runner = &runner;
        for (unsigned bz = 0; bz < grid[2] && status == OK; ++bz)
            for (unsigned by = 0; by < grid[1] && status == OK; ++by)
                for (unsigned bx = 0; bx < grid[0] && status == OK; ++bx) {
                    if (shared != nullptr) memset(shared, 0xff, shared_bytes);
                    blockIdx = {bx, by, bz};
                    status = runner.run_block();
                    if (status != OK) t_error = std::string(name) + ": " + t_error;
                }
        t_runner = nullptr;
    }
    free(shared);
    t_dynamic_shared = nullptr;
    return status;
}

// The reason for this host thread's last failed kvrs_sim_launch.
extern "C" const char* kvrs_sim_last_error() { return kvrs_sim::t_error.c_str(); }

// Sets this host thread's resume order (0 forward, 1 reverse, 2 seeded by `seed`),
// overriding KVRS_SIM_ORDER; mode -1 returns to KVRS_SIM_ORDER.
extern "C" void kvrs_sim_set_order(int mode, uint64_t seed) {
    using namespace kvrs_sim;
    t_order_set = mode >= 0;
    t_order = {mode == 1 ? Order::Reverse : mode == 2 ? Order::Seeded : Order::Forward, seed};
}
