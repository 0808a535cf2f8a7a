// Host stand-in for CUDA's cuda_fp16.h, for the kernel simulator (sim.cpp): float16 as
// GCC's _Float16, whose conversions round to nearest, ties to even, as the device does.
#pragma once
#include <stdint.h>
#include <string.h>

struct __half {
    _Float16 v;
};
inline float __half2float(__half x) { return (float)x.v; }
inline __half __float2half_rn(float x) { return __half{(_Float16)x}; }
