// Tensor-core warp instructions (sm_80+), included by kvrs.cu. Every lane of the warp
// calls each of them together (they are .sync.aligned). The simulator (kernels/sim,
// KVRS_SIM) emulates them as warp collectives with the PTX ISA's fragment layouts
// (kernels/sim/tensor_core.h states them):
// - kvrs_mma_m16n8k16<T>(d, a, b): d += a b for one 16 x 8 x 16 tile, T = __half or
//   __nv_bfloat16 operands (a: 16 x 16 row-major, four .b32 registers; b: 16 x 8
//   column-major, two), f32 accumulators d (mma.sync.aligned.m16n8k16.row.col.f32).
// - kvrs_ldmatrix_x4(r, row), kvrs_ldmatrix_x4_trans(r, row): four 8 x 8 matrices of
//   16-bit elements from shared memory, lane 8j + i giving the address of row i of
//   matrix j (16-byte aligned); .trans transposes each.
#pragma once

#ifndef KVRS_SIM
template <typename T> struct KvrsMmaType;
template <> struct KvrsMmaType<__half> {
    __device__ static __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
};
template <> struct KvrsMmaType<__nv_bfloat16> {
    __device__ static __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
};
template <typename T>
__device__ __forceinline__ void kvrs_mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    KvrsMmaType<T>::mma(d, a, b);
}
__device__ __forceinline__ void kvrs_ldmatrix_x4(uint32_t (&r)[4], const void* row) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}
__device__ __forceinline__ void kvrs_ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}
#endif
