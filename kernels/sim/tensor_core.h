// The tensor-core warp instructions kvrs.cu uses (kernels/tensor_core.cuh), emulated as
// warp collectives for the simulator: every lane publishes a pointer to its operands, and
// the last lane to arrive computes the whole warp's result, reading and writing each
// lane's registers by the fragment layouts of the PTX ISA (section 9.7.14.5, "Matrix
// Fragments for mma.m16n8k16 with floating point type", and 9.7.14.5.15, "Warp-level
// matrix load instruction: ldmatrix"), with
//     groupID = %laneid >> 2, threadID_in_group = %laneid % 4:
// - mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32 d, a, b, c:
//   A (16 x 16, four .b32 registers a0..a7, two elements each, low half first):
//     row = groupID for ai with i < 2 or 4 <= i < 6, groupID + 8 otherwise;
//     col = threadID_in_group * 2 + (i & 1), + 8 for i >= 4.
//   B (16 x 8, two registers b0..b3): row = threadID_in_group * 2 + (i & 1), + 8 for
//     i >= 2; col = groupID.
//   C, D (16 x 8 f32, c0..c3): row = groupID for c0, c1, groupID + 8 for c2, c3;
//     col = threadID_in_group * 2 + (i & 1).
//   D = A B + C: the products of 16-bit values are exact in f32; the sum is taken in
//   double and rounded once (the GPU's f32 accumulation order is not specified, so the
//   two may differ in the last bits of f32).
// - ldmatrix.sync.aligned.m8n8.x4{.trans}.shared.b16 {r0, r1, r2, r3}, [p]: threads
//   8j .. 8j + 7 give the addresses of rows 0..7 of matrix j (16-byte aligned rows of
//   eight 16-bit elements); register rj of lane l holds row l / 4, columns
//   2 (l % 4) and 2 (l % 4) + 1 of matrix j (low half first); with .trans, of the
//   transposed matrix (rows 2 (l % 4) and 2 (l % 4) + 1 of column l / 4).
#pragma once
#include <stdint.h>
#include <string.h>

#include <string>

#include "cuda_bf16.h"
#include "cuda_fp16.h"
#include "scheduler.h"

namespace kvrs_sim {

// Kinds of the tensor-core collectives (beside cooperative.h's: lanes meeting at
// different kinds diverge).
enum TensorKind : int { MMA_F16 = 8, MMA_BF16 = 9, LDMATRIX = 10, LDMATRIX_TRANS = 11 };

// The value of a 16-bit float of element type T.
template <typename T> inline double half_value(uint16_t bits);
template <> inline double half_value<__half>(uint16_t bits) {
    __half h;
    memcpy(&h, &bits, 2);
    return __half2float(h);
}
template <> inline double half_value<__nv_bfloat16>(uint16_t bits) {
    return __bfloat162float(__nv_bfloat16{bits});
}

// Element i (low half first) of a lane's .b32 registers `regs`.
inline uint16_t element(const uint32_t* regs, int i) { return (uint16_t)(regs[i >> 1] >> (16 * (i & 1))); }

// Whether a tensor-core instruction may run here: in a fiber launch (else the launch
// fails, see in_fibers), in a block of whole warps (else it fails as a misuse: every
// lane of the warp takes part).
inline bool tensor_core_ready(const char* what) {
    if (!in_fibers(what)) return false;
    if (blockDim.x * blockDim.y * blockDim.z % 32 != 0) {
        t_runner->misuse(std::string(what) + " in a block of " + std::to_string(blockDim.x * blockDim.y * blockDim.z) +
                         " threads: it needs whole warps");
    }
    return true;
}

// One lane's operands of an mma.
struct MmaLane {
    const uint32_t* a;
    const uint32_t* b;
    float* d;  // in: C; out: D
};

template <typename T>
inline void mma_m16n8k16(const Warp& w, Fiber*, unsigned) {
    double a[16][16], b[16][8], c[16][8];
    for (int l = 0; l < 32; ++l) {
        const MmaLane* x = reinterpret_cast<const MmaLane*>(w.slot[l]);
        const int g = l >> 2, t = l & 3;
        for (int i = 0; i < 8; ++i) a[g + 8 * ((i >> 1) & 1)][t * 2 + (i & 1) + 8 * (i >> 2)] = half_value<T>(element(x->a, i));
        for (int i = 0; i < 4; ++i) b[t * 2 + (i & 1) + 8 * (i >> 1)][g] = half_value<T>(element(x->b, i));
        for (int i = 0; i < 4; ++i) c[g + 8 * (i >> 1)][t * 2 + (i & 1)] = x->d[i];
    }
    for (int l = 0; l < 32; ++l) {
        MmaLane* x = reinterpret_cast<MmaLane*>(w.slot[l]);
        const int g = l >> 2, t = l & 3;
        for (int i = 0; i < 4; ++i) {
            const int row = g + 8 * (i >> 1), col = t * 2 + (i & 1);
            double s = c[row][col];
            for (int k = 0; k < 16; ++k) s += a[row][k] * b[k][col];
            x->d[i] = (float)s;
        }
    }
}

// d += a b (one m16n8k16 tile per warp); every lane of the warp calls it.
template <typename T>
inline void mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    static_assert(sizeof(T) == 2, "f16 or bf16 operands");
    if (!tensor_core_ready("mma.sync")) return;
    MmaLane me{a, b, d};
    const int kind = std::is_same<T, __half>::value ? MMA_F16 : MMA_BF16;
    t_runner->warp_collective(0xffffffffu, kind, (uint64_t)(uintptr_t)&me, 0, mma_m16n8k16<T>);
}

// One lane's part of an ldmatrix.x4.
struct LdmatrixLane {
    const uint16_t* row;  // the row this lane addresses
    uint32_t* r;          // its four result registers
};

template <bool TRANS>
inline void ldmatrix_x4(const Warp& w, Fiber*, unsigned) {
    uint16_t m[4][8][8];
    for (int l = 0; l < 32; ++l) {
        const LdmatrixLane* x = reinterpret_cast<const LdmatrixLane*>(w.slot[l]);
        memcpy(m[l >> 3][l & 7], x->row, 16);
    }
    for (int l = 0; l < 32; ++l) {
        LdmatrixLane* x = reinterpret_cast<LdmatrixLane*>(w.slot[l]);
        const int r = l >> 2, c = 2 * (l & 3);
        for (int j = 0; j < 4; ++j) {
            const uint16_t lo = TRANS ? m[j][c][r] : m[j][r][c], hi = TRANS ? m[j][c + 1][r] : m[j][r][c + 1];
            x->r[j] = (uint32_t)lo | (uint32_t)hi << 16;
        }
    }
}

// r = the four 8 x 8 matrices whose rows the warp's lanes address (lane 8j + i: row i of
// matrix j), as ldmatrix...x4 gives them; transposed with TRANS.
template <bool TRANS>
inline void ldmatrix(uint32_t (&r)[4], const void* row) {
    if (!tensor_core_ready("ldmatrix")) return;
    if ((uintptr_t)row % 16 != 0) {
        t_runner->misuse("ldmatrix: lane " + std::to_string(t_runner->me().lane) +
                         " gives a row address that is not 16-byte aligned");
    }
    LdmatrixLane me{static_cast<const uint16_t*>(row), r};
    t_runner->warp_collective(0xffffffffu, TRANS ? LDMATRIX_TRANS : LDMATRIX, (uint64_t)(uintptr_t)&me, 0,
                              ldmatrix_x4<TRANS>);
}

}  // namespace kvrs_sim

// kvrs.cu's tensor-core primitives (their GPU definitions are in tensor_core.cuh, under
// #ifndef KVRS_SIM).
template <typename T> inline void kvrs_mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    kvrs_sim::mma<T>(d, a, b);
}
inline void kvrs_ldmatrix_x4(uint32_t (&r)[4], const void* row) { kvrs_sim::ldmatrix<false>(r, row); }
inline void kvrs_ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) { kvrs_sim::ldmatrix<true>(r, row); }
