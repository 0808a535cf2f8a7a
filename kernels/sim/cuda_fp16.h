// Host stand-in for CUDA's cuda_fp16.h, for the kernel simulator (sim.cpp): float16 as
// _Float16 (AArch64: __fp16, as GCC 12's C++ lacks _Float16 there), whose conversions
// round to nearest, ties to even, as the device does.
#pragma once
#include <stdint.h>
#include <string.h>

#ifdef __aarch64__
typedef __fp16 kvrs_sim_f16;
#else
typedef _Float16 kvrs_sim_f16;
#endif
struct __half {
    kvrs_sim_f16 v;
};
inline float __half2float(__half x) { return (float)x.v; }
inline __half __float2half_rn(float x) { return __half{(kvrs_sim_f16)x}; }
