// Host stand-in for CUDA's cuda_bf16.h, for the kernel simulator (sim.cpp): bfloat16 as
// its 16 bits, converted as the device does (round to nearest, ties to even; NaN stays NaN).
#pragma once
#include <stdint.h>
#include <string.h>

struct __nv_bfloat16 {
    uint16_t bits;
};
inline float __bfloat162float(__nv_bfloat16 x) {
    uint32_t u = (uint32_t)x.bits << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{(uint16_t)((u >> 16) | 0x40)};
    u += 0x7fffu + ((u >> 16) & 1u);
    return __nv_bfloat16{(uint16_t)(u >> 16)};
}
