// The kvrs kernels (kernels/kvrs.cu) compiled for the host, so the CUDA backend's launch
// code and the kernels' indexing are tested on machines without a GPU (cargo feature
// `cuda-sim`). Device memory is host memory; a launch runs every block and thread of
// its grid one after another, which is exact for kernels without shared memory or
// barriers (none of ours has either).
#define KVRS_SIM 1  // kvrs.cu leaves the cooperative primitives to the simulator
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <tuple>
#include <type_traits>
#include <utility>

struct dim3 {
    unsigned x, y, z;
};
static thread_local dim3 blockIdx, threadIdx, blockDim, gridDim;

#define __global__
#define __device__
#define __forceinline__ inline

#include "../kvrs.cu"

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
};

#define K(NAME) Entry{#NAME, [](void** p) { invoke(NAME, p); }}
#define K_INPUTS(PREFIX, TN) K(PREFIX##_f32_##TN), K(PREFIX##_f16_##TN), K(PREFIX##_bf16_##TN)
// A kernel taking launch words: its instances with the words in a parameter or behind a pointer.
#define KW(NAME) K(NAME##_w480), K(NAME##_w4000), K(NAME##_wp)
#define KW_INPUTS(PREFIX, TN) KW(PREFIX##_f32_##TN), KW(PREFIX##_f16_##TN), KW(PREFIX##_bf16_##TN)
#define K_STORAGE(TN)                                                                           \
    KW_INPUTS(kvrs_scatter, TN), K_INPUTS(kvrs_append_contiguous, TN), K_INPUTS(kvrs_copy3, TN), \
        K_INPUTS(kvrs_scale3, TN), KW(kvrs_gather_##TN), K(kvrs_rope_rotate_##TN),                \
        K(kvrs_paged_attention_##TN), K(kvrs_attention_merge_##TN)
#define K_FP8(TN)                                                                               \
    KW_INPUTS(kvrs_scatter, TN), K_INPUTS(kvrs_append_contiguous, TN), K_INPUTS(kvrs_copy3, TN), \
        K(kvrs_copy3_##TN##_f32), K(kvrs_copy3_##TN##_f16), K(kvrs_copy3_##TN##_bf16),          \
        K_INPUTS(kvrs_paged_attention, TN)
#define K_INT8(SN)                                                                             \
    KW(kvrs_scatter_##SN##_i8), K(kvrs_append_contiguous_##SN##_i8), K(kvrs_quantize3_##SN), \
        K(kvrs_dequantize3_##SN), K(kvrs_paged_attention_##SN##_i8)

const Entry KERNELS[] = {
    KW(kvrs_copy_blocks), KW(kvrs_load_blocks), KW(kvrs_save_blocks), K(kvrs_advance_counter), K_STORAGE(f32), K_STORAGE(f16), K_STORAGE(bf16),
    K_FP8(e4m3),         K_FP8(e5m2),             K_INT8(f32),    K_INT8(f16),    K_INT8(bf16),
    K(kvrs_copy3_b8_b8), KW(kvrs_gather_b8),       K(kvrs_zero3_b8), K(kvrs_zero3_b16), K(kvrs_zero3_b32),
};

}  // namespace

// Runs kernel `name` over grid x block; returns 0, or -1 when there is no such kernel.
extern "C" int kvrs_sim_launch(const char* name, const unsigned grid[3], const unsigned block[3], void** params) {
    for (const Entry& e : KERNELS) {
        if (strcmp(e.name, name) != 0) continue;
        gridDim = {grid[0], grid[1], grid[2]};
        blockDim = {block[0], block[1], block[2]};
        for (unsigned bz = 0; bz < grid[2]; ++bz)
            for (unsigned by = 0; by < grid[1]; ++by)
                for (unsigned bx = 0; bx < grid[0]; ++bx)
                    for (unsigned tz = 0; tz < block[2]; ++tz)
                        for (unsigned ty = 0; ty < block[1]; ++ty)
                            for (unsigned tx = 0; tx < block[0]; ++tx) {
                                blockIdx = {bx, by, bz};
                                threadIdx = {tx, ty, tz};
                                e.run(params);
                            }
        return 0;
    }
    return -1;
}
