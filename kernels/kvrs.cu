// kvrs CUDA kernels, compiled to PTX (compute_80) by `make ptx` and checked by `make test`
// (`kernels/build.sh check`): the committed kvrs.ptx must match this file and assemble
// with ptxas for sm_80 and sm_90. The CUDA storage backend loads the PTX at run time.
//
// Layouts (elements):
// - paged, per layer: [num_blocks, 2, block_size, heads, head_dim] ("NHD", hnd = 0) or
//   [num_blocks, 2, heads, block_size, head_dim] ("HND", hnd = 1); index 1 = 0 is K, 1 is V.
// - contiguous cache, per layer: K and V each [heads, max_seq_len, head_dim].
// - token inputs: [n_tokens, heads, head_dim] with element strides (token, head), last
//   dimension contiguous.
// The paged kernels with a `layers` grid dimension take arrays of per-layer pointers, so
// one launch covers all layers of a step; the contiguous append takes a layer stride.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

// Cooperative primitives. On the GPU they are what they say; the simulator
// (kernels/sim, which defines KVRS_SIM) provides the same names with the same results:
// - kvrs_group_sum<W>(x), kvrs_group_max<W>(x): x reduced over each aligned group of W
//   lanes (W a power of two <= 32; every lane of the warp calls it, full mask) by the xor
//   butterfly W/2, ..., 1, so every lane of a group gets the group's result, bit for bit
//   the same on the simulator.
// - kvrs_cp_async16(dst, src): 16 bytes from global src to shared dst, asynchronously
//   (cp.async.cg; both 16-byte aligned); kvrs_cp_async_commit() closes a group;
//   kvrs_cp_async_wait<N>() waits until at most N groups are pending (the calling
//   thread's own copies: a __syncthreads() must follow before other threads read them).
// - KVRS_DYNAMIC_SHARED(T, name): the launch's dynamic shared memory as T name[],
//   16-byte aligned.
#ifndef KVRS_SIM
template <int W> __device__ __forceinline__ float kvrs_group_sum(float x) {
#pragma unroll
    for (int m = W / 2; m > 0; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
    return x;
}
template <int W> __device__ __forceinline__ float kvrs_group_max(float x) {
#pragma unroll
    for (int m = W / 2; m > 0; m >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, m));
    return x;
}
__device__ __forceinline__ void kvrs_cp_async16(void* dst, const void* src) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void kvrs_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void kvrs_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
#define KVRS_DYNAMIC_SHARED(T, name) extern __shared__ __align__(16) T name[]
#endif
// Tensor-core instructions: kvrs_mma_m16n8k16, kvrs_ldmatrix_x4 (tensor_core.cuh).
#include "tensor_core.cuh"

// A named namespace, not an anonymous one: nvcc names the shared arrays of anonymous-namespace
// templates after a hash of the source's path, and the committed PTX must not depend on it.
namespace kvrs_device {

template <typename T> __device__ __forceinline__ float to_f32(T x);
template <> __device__ __forceinline__ float to_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_f32<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

// Conversions round to nearest, ties to even, as the host path does.
template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// The bits of a float and back (a union: the same code compiles for the simulator).
__device__ __forceinline__ float bits_f32(uint32_t u) {
    union { uint32_t u; float f; } x;
    x.u = u;
    return x.f;
}
__device__ __forceinline__ uint32_t f32_bits(float f) {
    union { float f; uint32_t u; } x;
    x.f = f;
    return x.u;
}

// fp8 storage types: the OCP formats (ml_dtypes' float8_e4m3fn and float8_e5m2).
struct kvrs_e4m3 {
    uint8_t bits;
};
struct kvrs_e5m2 {
    uint8_t bits;
};

// Encodes x in an fp8 format of M mantissa bits and exponent bias BIAS whose largest
// finite value is `max` (code MAXC) and NaN code NANC, exactly as the host codec
// (src/quant.rs): round to nearest even, saturate at +-max, NaN stays NaN.
template <int M, int BIAS, uint32_t MAXC, uint32_t NANC>
__device__ __forceinline__ uint8_t fp8_encode(float x, float max) {
    const uint32_t bits = f32_bits(x);
    const uint32_t sign = (bits >> 24) & 0x80u;
    const uint32_t abits = bits & 0x7fffffffu;
    const float a = bits_f32(abits);
    if (a != a) return (uint8_t)(sign | NANC);
    if (a >= max) return (uint8_t)(sign | MAXC);
    uint32_t code;
    if (a < bits_f32((uint32_t)(128 - BIAS) << 23)) {
        // Subnormal: a multiple of 2^(1 - BIAS - M); scaling by a power of two is exact.
        code = (uint32_t)rintf(a * bits_f32((uint32_t)(126 + BIAS + M) << 23));
    } else {
        // Normal: round the f32 mantissa to M bits (a carry moves into the exponent).
        const int drop = 23 - M;
        code = ((abits + (1u << (drop - 1)) - 1u + ((abits >> drop) & 1u)) >> drop) - ((uint32_t)(127 - BIAS) << M);
    }
    return (uint8_t)(sign | (code < MAXC ? code : MAXC));
}

// The value of fp8 code c (IEEE: E5M2's infinities and NaNs; otherwise E4M3's single NaN
// per sign, 0x7f).
template <int M, int BIAS, bool IEEE>
__device__ __forceinline__ float fp8_decode(uint8_t c) {
    const uint32_t e = (uint32_t)(c & 0x7f) >> M, m = c & ((1u << M) - 1u);
    const bool special = IEEE ? e == (0x7fu >> M) : (c & 0x7f) == 0x7f;
    if (special && !(IEEE && m == 0)) return bits_f32(0x7fc00000u);
    float v;
    if (special) {
        v = bits_f32(0x7f800000u);
    } else if (e == 0) {
        v = (float)m * bits_f32((uint32_t)(128 - BIAS - M) << 23);
    } else {
        v = bits_f32(((e + 127u - BIAS) << 23) | (m << (23 - M)));
    }
    return (c & 0x80) ? -v : v;
}

template <> __device__ __forceinline__ float to_f32<kvrs_e4m3>(kvrs_e4m3 x) { return fp8_decode<3, 7, false>(x.bits); }
template <> __device__ __forceinline__ float to_f32<kvrs_e5m2>(kvrs_e5m2 x) { return fp8_decode<2, 15, true>(x.bits); }
template <> __device__ __forceinline__ float to_f32<int8_t>(int8_t x) { return (float)x; }
template <> __device__ __forceinline__ kvrs_e4m3 from_f32<kvrs_e4m3>(float x) {
    return kvrs_e4m3{fp8_encode<3, 7, 0x7eu, 0x7fu>(x, 448.0f)};
}
template <> __device__ __forceinline__ kvrs_e5m2 from_f32<kvrs_e5m2>(float x) {
    return kvrs_e5m2{fp8_encode<2, 15, 0x7bu, 0x7eu>(x, 57344.0f)};
}

// Quantizes the head vector src[0], src[src_stride], ... (n elements) into dst[0..n) as
// the host does (quantize_row_i8 in src/quant.rs): scale = max|x| / 127 (NaNs ignored,
// infinities counted as FLT_MAX; one ulp less when 127 * scale would overflow), codes
// rint(x / scale) clamped to +-127 (NaN: 0). Returns the scale (0 for a zero vector).
template <typename S>
__device__ float quantize_vector(int8_t* dst, int64_t dst_stride, const S* src, int64_t src_stride, int n) {
    float amax = 0.0f;
    for (int e = 0; e < n; ++e) {
        const float a = fabsf(to_f32(src[e * src_stride]));
        if (a > amax) amax = a;
    }
    if (amax == 0.0f) {
        for (int e = 0; e < n; ++e) dst[e * dst_stride] = 0;
        return 0.0f;
    }
    float scale = fminf(amax, 3.40282347e38f) / 127.0f;
    if (scale * 127.0f > 3.40282347e38f) scale = bits_f32(f32_bits(scale) - 1u);
    for (int e = 0; e < n; ++e) {
        const float x = to_f32(src[e * src_stride]);
        const float q = rintf(fminf(fmaxf(x / scale, -127.0f), 127.0f));
        dst[e * dst_stride] = x != x ? (int8_t)0 : (int8_t)q;
    }
    return scale;
}

// Element offset of (block, kv, offset in block, head, dim) in one layer's paged tensor.
__device__ __forceinline__ int64_t paged_offset(int64_t block, int kv, int64_t off, int64_t head, int64_t dim,
                                                int64_t bs, int64_t heads, int64_t head_dim, int hnd) {
    const int64_t base = (block * 2 + kv) * bs * heads * head_dim;
    return hnd ? base + (head * bs + off) * head_dim + dim : base + (off * heads + head) * head_dim + dim;
}

// Whether two types are one (std::is_same, without the header NVRTC may lack).
template <typename A, typename B> struct same { static constexpr bool value = false; };
template <typename A> struct same<A, A> { static constexpr bool value = true; };

// Input element conversion; a same-type copy moves the bits unchanged (NaN payloads too).
template <typename S, typename T> __device__ __forceinline__ T convert(S x) {
    if constexpr (same<S, T>::value) {
        return x;
    } else {
        return from_f32<T>(to_f32(x));
    }
}

// Element strides of one [tokens, heads, head_dim] input (head_dim contiguous).
struct TokenStrides {
    int64_t tok, head;
};

// ---- Copies at copy speed (scatter, gather, block copies and swaps) --------------------
//
// The small arrays of a launch (slots, block tables, block pairs, per-layer base
// addresses) are 64-bit "words", passed either as a kernel parameter (the `_w480` and
// `_w4000` instances: a __grid_constant__ struct, so no upload precedes the launch and
// the launch can be captured in a CUDA graph; 4000 words need CUDA 12.1's 32 KB of
// parameters) or, when larger, through a device pointer (the `_wp` instances). The host
// picks the smallest instance that holds them.
//
// The kernels read their pointers once into __restrict__ locals, move up to 16 bytes per
// access (the host picks the vector width `vec`, in elements, from the alignment of
// every address and stride, and passes it; the kernel switches to the instance
// compiled for it), stride over tokens with the loop unrolled so several loads are in
// flight, and do no 64-bit division: the host splits each slot into its block and
// offset.

#ifdef KVRS_SIM
struct alignas(16) kvrs_v16 {
    uint32_t x, y, z, w;
};
struct alignas(8) kvrs_v8 {
    uint32_t x, y;
};
#define KVRS_UNROLL(N)
#else
typedef uint4 kvrs_v16;
typedef uint2 kvrs_v8;
#define KVRS_PRAGMA(X) _Pragma(#X)
#define KVRS_UNROLL(N) KVRS_PRAGMA(unroll N)
#endif

// A slot split by the host: block << 32 | offset; all ones skips the token (slot -1).
#define KVRS_SKIP_SLOT (~(uint64_t)0)

// The unsigned integer type of B bytes (the vector a copy moves per access).
template <int B> struct raw_of;
template <> struct raw_of<16> { typedef kvrs_v16 type; };
template <> struct raw_of<8> { typedef kvrs_v8 type; };
template <> struct raw_of<4> { typedef uint32_t type; };
template <> struct raw_of<2> { typedef uint16_t type; };
template <> struct raw_of<1> { typedef uint8_t type; };

// E elements of S as one raw vector (the address aligned to E elements).
template <typename S, int E> struct Lane {
    typedef typename raw_of<E * sizeof(S)>::type type;
};
template <typename S, int E> __device__ __forceinline__ typename Lane<S, E>::type load_vec(const S* __restrict__ src) {
    return *reinterpret_cast<const typename Lane<S, E>::type*>(src);
}

// Stores the E elements of S in `in` at dst as T (a same-type store moves the bits).
template <typename S, typename T, int E>
__device__ __forceinline__ void store_vec(T* __restrict__ dst, typename Lane<S, E>::type in) {
    if constexpr (same<S, T>::value) {
        *reinterpret_cast<typename Lane<S, E>::type*>(dst) = in;
    } else {
        union {
            typename Lane<S, E>::type raw;
            S x[E];
        } from;
        union {
            typename Lane<T, E>::type raw;
            T x[E];
        } to;
        from.raw = in;
        for (int e = 0; e < E; ++e) to.x[e] = convert<S, T>(from.x[e]);
        *reinterpret_cast<typename Lane<T, E>::type*>(dst) = to.raw;
    }
}

// Tokens a thread has in flight: each round loads KVRS_BATCH tokens' vectors before it
// stores any, so the loads overlap.
#define KVRS_BATCH 4

// A compile-time vector width.
template <int E> struct Vec {
    static constexpr int value = E;
};

// Calls f(Vec<E>{}) for E = vec, among the widths whose accesses of S and T are at most
// 16 bytes (the host never asks for more); E = 1 otherwise.
template <typename S, typename T, typename F> __device__ __forceinline__ void with_vec(int vec, F f) {
    constexpr int wide = sizeof(S) > sizeof(T) ? sizeof(S) : sizeof(T);
    if constexpr (16 / wide >= 16) {
        if (vec == 16) return f(Vec<16>{});
    }
    if constexpr (16 / wide >= 8) {
        if (vec == 8) return f(Vec<8>{});
    }
    if constexpr (16 / wide >= 4) {
        if (vec == 4) return f(Vec<4>{});
    }
    if (vec == 2) return f(Vec<2>{});
    f(Vec<1>{});
}

// Geometry of one paged cache tensor: a block is [2][bs][heads][head_dim] (NHD) or
// [2][heads][bs][head_dim] (HND).
struct Paged {
    int bs, heads, head_dim, hnd;
    // Elements of K (or V) of one block, and of the whole block.
    __device__ __forceinline__ int64_t plane() const { return (int64_t)bs * heads * head_dim; }
    // Elements between positions (offsets) of one head.
    __device__ __forceinline__ int64_t off_step() const { return hnd ? head_dim : (int64_t)heads * head_dim; }
    // Offset of (head h, dim d) at position 0 of K.
    __device__ __forceinline__ int64_t head_at(int h, int d) const {
        return hnd ? (int64_t)h * bs * head_dim + d : (int64_t)h * head_dim + d;
    }
};

// vLLM's reshape_and_cache over every layer of one step: grid (token blocks, layers),
// threads (x: vectors of a token's row, y: tokens). Layer l's cache tensor starts at
// words[l * rec], its slots (split) at words + words[l * rec + 1]; its K and V inputs
// at k + l * k_layer, v + l * v_layer.
template <typename S, typename T>
__device__ void scatter_rows(const uint64_t* __restrict__ words, int rec, const S* __restrict__ k,
                             const S* __restrict__ v, int64_t k_layer, int64_t v_layer, TokenStrides ks,
                             TokenStrides vs, int n, Paged g, int vec) {
    const int layer = blockIdx.y;
    T* __restrict__ cache = reinterpret_cast<T*>(words[layer * rec]);
    const uint64_t* __restrict__ slots = words + words[layer * rec + 1];
    const S* __restrict__ kl = k + layer * k_layer;
    const S* __restrict__ vl = v + layer * v_layer;
    const int64_t plane = g.plane(), step = g.off_step();
    with_vec<S, T>(vec, [&](auto e) {
        constexpr int E = decltype(e)::value;
        const int dv = g.head_dim / E, row = g.heads * dv;
        for (int r = threadIdx.x; r < row; r += blockDim.x) {
            const int h = r / dv, d = (r - h * dv) * E;
            const S* __restrict__ kr = kl + h * ks.head + d;
            const S* __restrict__ vr = vl + h * vs.head + d;
            T* __restrict__ cr = cache + g.head_at(h, d);
            const int stride = gridDim.x * blockDim.y;
            for (int t0 = blockIdx.x * blockDim.y + threadIdx.y; t0 < n; t0 += KVRS_BATCH * stride) {
                typename Lane<S, E>::type kx[KVRS_BATCH] = {}, vx[KVRS_BATCH] = {};
                T* dst[KVRS_BATCH];
                KVRS_UNROLL(KVRS_BATCH)
                for (int u = 0; u < KVRS_BATCH; ++u) {
                    const int t = t0 + u * stride;
                    const uint64_t s = t < n ? slots[t] : KVRS_SKIP_SLOT;
                    dst[u] = nullptr;
                    if (s != KVRS_SKIP_SLOT) {
                        dst[u] = cr + (int64_t)(uint32_t)(s >> 32) * 2 * plane + (int64_t)(uint32_t)s * step;
                        kx[u] = load_vec<S, E>(kr + t * ks.tok);
                        vx[u] = load_vec<S, E>(vr + t * vs.tok);
                    }
                }
                KVRS_UNROLL(KVRS_BATCH)
                for (int u = 0; u < KVRS_BATCH; ++u) {
                    if (dst[u] == nullptr) continue;
                    store_vec<S, T, E>(dst[u], kx[u]);
                    store_vec<S, T, E>(dst[u] + plane, vx[u]);
                }
            }
        }
    });
}

// scatter_rows into int8 storage: each thread quantizes whole head vectors (threads x:
// heads); layer l's float32 scales start at words[l * rec + 2].
template <typename S>
__device__ void scatter_rows_q8(const uint64_t* __restrict__ words, int rec, const S* __restrict__ k,
                                const S* __restrict__ v, int64_t k_layer, int64_t v_layer, TokenStrides ks,
                                TokenStrides vs, int n, Paged g, int /* vec: one vector per thread */) {
    const int layer = blockIdx.y;
    int8_t* __restrict__ cache = reinterpret_cast<int8_t*>(words[layer * rec]);
    const uint64_t* __restrict__ slots = words + words[layer * rec + 1];
    float* __restrict__ scales = reinterpret_cast<float*>(words[layer * rec + 2]);
    const S* __restrict__ kl = k + layer * k_layer;
    const S* __restrict__ vl = v + layer * v_layer;
    // Offsets in head vectors (every offset below is a multiple of head_dim).
    const int64_t plane = g.plane() / g.head_dim, step = g.off_step() / g.head_dim;
    for (int h = threadIdx.x; h < g.heads; h += blockDim.x) {
        const int64_t at = g.head_at(h, 0) / g.head_dim;
        for (int t = blockIdx.x * blockDim.y + threadIdx.y; t < n; t += gridDim.x * blockDim.y) {
            const uint64_t s = slots[t];
            if (s == KVRS_SKIP_SLOT) continue;
            const int64_t kvec = at + (int64_t)(uint32_t)(s >> 32) * 2 * plane + (int64_t)(uint32_t)s * step;
            const int64_t vvec = kvec + plane;
            scales[kvec] = quantize_vector(cache + kvec * g.head_dim, 1, kl + t * ks.tok + h * ks.head, 1, g.head_dim);
            scales[vvec] = quantize_vector(cache + vvec * g.head_dim, 1, vl + t * vs.tok + h * vs.head, 1, g.head_dim);
        }
    }
}

// Element strides of one [heads, positions, head_dim] output (head_dim contiguous).
struct HeadStrides {
    int64_t head, pos;
};

// Positions first..first+n of a block table (int32 entries, two per word, from the
// block holding position first on) gathered into K/V [heads, >= n, head_dim]: raw
// copies. Grid (position blocks), threads (x: vectors of a position's row, y: positions).
template <typename T>
__device__ void gather_rows(const uint64_t* __restrict__ words, const T* __restrict__ cache, int first, int n,
                            T* __restrict__ out_k, T* __restrict__ out_v, HeadStrides ks, HeadStrides vs, Paged g,
                            int vec) {
    const uint32_t* __restrict__ table = reinterpret_cast<const uint32_t*>(words);
    const int64_t plane = g.plane(), step = g.off_step();
    const unsigned bs = g.bs;
    with_vec<T, T>(vec, [&](auto e) {
        constexpr int E = decltype(e)::value;
        const int dv = g.head_dim / E, row = g.heads * dv;
        for (int r = threadIdx.x; r < row; r += blockDim.x) {
            const int h = r / dv, d = (r - h * dv) * E;
            const T* __restrict__ cr = cache + g.head_at(h, d);
            T* __restrict__ ko = out_k + h * ks.head + d;
            T* __restrict__ vo = out_v + h * vs.head + d;
            const int stride = gridDim.x * blockDim.y;
            for (int t0 = blockIdx.x * blockDim.y + threadIdx.y; t0 < n; t0 += KVRS_BATCH * stride) {
                typename Lane<T, E>::type kx[KVRS_BATCH] = {}, vx[KVRS_BATCH] = {};
                KVRS_UNROLL(KVRS_BATCH)
                for (int u = 0; u < KVRS_BATCH; ++u) {
                    const int t = t0 + u * stride;
                    if (t < n) {
                        const unsigned p = first + t, b = p / bs;
                        const T* src = cr + (int64_t)table[b] * 2 * plane + (int64_t)(p - b * bs) * step;
                        kx[u] = load_vec<T, E>(src);
                        vx[u] = load_vec<T, E>(src + plane);
                    }
                }
                KVRS_UNROLL(KVRS_BATCH)
                for (int u = 0; u < KVRS_BATCH; ++u) {
                    const int t = t0 + u * stride;
                    if (t < n) {
                        store_vec<T, T, E>(ko + t * ks.pos, kx[u]);
                        store_vec<T, T, E>(vo + t * vs.pos, vx[u]);
                    }
                }
            }
        }
    });
}

// Bytes [z * chunk, (z + 1) * chunk) of one block (z = blockIdx.z) in B-byte vectors:
// threads stride over them, KVRS_BATCH loads in flight.
template <int B>
__device__ __forceinline__ void move_chunk(const char* __restrict__ from, char* __restrict__ to, int64_t block_bytes,
                                           int64_t chunk) {
    typedef typename raw_of<B>::type R;
    const R* __restrict__ src = reinterpret_cast<const R*>(from);
    R* __restrict__ dst = reinterpret_cast<R*>(to);
    const int64_t n = block_bytes / B, lo = blockIdx.z * (chunk / B), end = lo + chunk / B;
    const int64_t hi = end < n ? end : n;
    for (int64_t i0 = lo + threadIdx.x; i0 < hi; i0 += KVRS_BATCH * blockDim.x) {
        R x[KVRS_BATCH] = {};
        KVRS_UNROLL(KVRS_BATCH)
        for (int u = 0; u < KVRS_BATCH; ++u) {
            const int64_t i = i0 + u * blockDim.x;
            if (i < hi) x[u] = src[i];
        }
        KVRS_UNROLL(KVRS_BATCH)
        for (int u = 0; u < KVRS_BATCH; ++u) {
            const int64_t i = i0 + u * blockDim.x;
            if (i < hi) dst[i] = x[u];
        }
    }
}

// move_chunk with B = vec bytes (16, 8 or 4; every address and size a multiple of it).
__device__ __forceinline__ void move_chunk_vec(const char* from, char* to, int64_t block_bytes, int64_t chunk,
                                               int vec) {
    if (vec == 16) return move_chunk<16>(from, to, block_bytes, chunk);
    if (vec == 8) return move_chunk<8>(from, to, block_bytes, chunk);
    move_chunk<4>(from, to, block_bytes, chunk);
}

// Whole blocks copied in every tensor: grid (pairs, tensors, chunks of `chunk` bytes).
// words[0..tensors) are the tensors' bases, words[tensors + i] pair i (source block in
// the low half, destination in the high). No block is both a source and a destination
// of one launch.
__device__ void copy_blocks(const uint64_t* __restrict__ words, int64_t block_bytes, int64_t chunk, int vec) {
    const uint64_t pair = words[gridDim.y + blockIdx.x];
    char* base = reinterpret_cast<char*>(words[blockIdx.y]);
    move_chunk_vec(base + (int64_t)(uint32_t)pair * block_bytes, base + (int64_t)(uint32_t)(pair >> 32) * block_bytes,
                   block_bytes, chunk, vec);
}

// Whole blocks between the cache tensors and a packed host-transfer buffer (the block
// swaps of the offload tiers), grid (items, tensors, chunks): item i's block of tensor t
// is bytes [(i * tensors + t) * block_bytes, + block_bytes) of `packed` and block
// words[tensors + i] of the tensor at words[t]. load: packed -> tensors; else the reverse.
__device__ void swap_blocks(const uint64_t* __restrict__ words, char* packed, int64_t block_bytes, int64_t chunk,
                            int vec, bool load) {
    char* tensor = reinterpret_cast<char*>(words[blockIdx.y]) + (int64_t)words[gridDim.y + blockIdx.x] * block_bytes;
    char* buffer = packed + ((int64_t)blockIdx.x * gridDim.y + blockIdx.y) * block_bytes;
    if (load) {
        move_chunk_vec(buffer, tensor, block_bytes, chunk, vec);
    } else {
        move_chunk_vec(tensor, buffer, block_bytes, chunk, vec);
    }
}

// dst[i][j][k] = src[i][j][k] over a rank-3 shape with element strides (the source's may
// be negative): every region read or write of the storage interface. A 1-D grid-stride
// loop over the elements.
template <typename S, typename T>
__device__ void copy3(T* dst, int64_t d0, int64_t d1, int64_t d2, const S* src, int64_t s0, int64_t s1,
                      int64_t s2, int64_t n0, int64_t n1, int64_t n2) {
    const int64_t total = n0 * n1 * n2;
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (int64_t)gridDim.x * blockDim.x) {
        const int64_t k = e % n2, j = (e / n2) % n1, i = e / (n1 * n2);
        dst[i * d0 + j * d1 + k * d2] = convert<S, T>(src[i * s0 + j * s1 + k * s2]);
    }
}

// Zeroes a rank-3 strided region of elements of W bytes (the type only sets the width).
template <typename W>
__device__ void zero3(W* dst, int64_t d0, int64_t d1, int64_t d2, int64_t n0, int64_t n1, int64_t n2) {
    const int64_t total = n0 * n1 * n2;
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (int64_t)gridDim.x * blockDim.x) {
        const int64_t k = e % n2, j = (e / n2) % n1, i = e / (n1 * n2);
        dst[i * d0 + j * d1 + k * d2] = W(0);
    }
}

// Keys at positions start..start+n of a block table rotated in place by a position change
// whose angles are given as cos/sin per rotated pair. Grid (n, layers); threads stride
// over heads * rotary_dim / 2. style 0: NeoX (i with i + rotary_dim/2); 1: GPT-J (2i, 2i+1).
template <typename T>
__device__ void rope_rotate(T* const* cache, const int32_t* table, int64_t start, const float* cos_t,
                            const float* sin_t, int rotary_dim, int style, int bs, int heads, int head_dim, int hnd) {
    const int64_t p = start + blockIdx.x;
    const int layer = blockIdx.y;
    const int64_t block = table[p / bs], off = p % bs;
    const int half = rotary_dim / 2;
    for (int i = threadIdx.x; i < heads * half; i += blockDim.x) {
        const int h = i / half, j = i % half;
        const int a = style == 0 ? j : 2 * j, b = style == 0 ? j + half : 2 * j + 1;
        T* x = cache[layer] + paged_offset(block, 0, off, h, 0, bs, heads, head_dim, hnd);
        const float xa = to_f32(x[a]), xb = to_f32(x[b]);
        x[a] = from_f32<T>(xa * cos_t[j] - xb * sin_t[j]);
        x[b] = from_f32<T>(xa * sin_t[j] + xb * cos_t[j]);
    }
}

// The contiguous cache's append, reading the write position from a device-resident
// counter, so a decode loop can be captured in a CUDA graph: the arguments are plain
// values (no staged arrays) and the host checks nothing per token. Inputs are
// [layers, tokens, heads, head_dim] with element strides (head_dim contiguous); `cache` is
// the first layer's K, each layer [K|V][heads][max_seq_len][head_dim]. Positions past
// max_seq_len are dropped (the host reports it when it reads the counter back).
// Grid (tokens, layers); threads stride over heads * head_dim.
template <typename S, typename T>
__device__ void append_contiguous(const S* k, const S* v, TokenStrides ks, TokenStrides vs, int64_t k_layer,
                                  int64_t v_layer, T* cache, const int64_t* position, int64_t max_seq_len,
                                  int heads, int head_dim) {
    const int64_t t = blockIdx.x;
    const int64_t layer = blockIdx.y;
    const int64_t p = *position + t;
    if (p >= max_seq_len) return;
    const int64_t plane = (int64_t)heads * max_seq_len * head_dim;
    T* ck = cache + layer * 2 * plane;
    T* cv = ck + plane;
    for (int i = threadIdx.x; i < heads * head_dim; i += blockDim.x) {
        const int h = i / head_dim, d = i % head_dim;
        const int64_t dst = (h * max_seq_len + p) * head_dim + d;
        ck[dst] = convert<S, T>(k[layer * k_layer + t * ks.tok + h * ks.head + d]);
        cv[dst] = convert<S, T>(v[layer * v_layer + t * vs.tok + h * vs.head + d]);
    }
}

// int8 storage keeps one float32 scale per head vector: the vector at element offset o
// of the codes has its scale at o / head_dim of the scales (the same regions, divided).

// append_contiguous into int8 storage (`scales` holds the scales of `cache`'s vectors).
// Grid (tokens, layers); threads stride over heads.
template <typename S>
__device__ void append_contiguous_q8(const S* k, const S* v, TokenStrides ks, TokenStrides vs, int64_t k_layer,
                                     int64_t v_layer, int8_t* cache, float* scales, const int64_t* position,
                                     int64_t max_seq_len, int heads, int head_dim) {
    const int64_t t = blockIdx.x;
    const int64_t layer = blockIdx.y;
    const int64_t p = *position + t;
    if (p >= max_seq_len) return;
    const int64_t plane = (int64_t)heads * max_seq_len * head_dim;
    for (int h = threadIdx.x; h < heads; h += blockDim.x) {
        const int64_t ko = layer * 2 * plane + (h * max_seq_len + p) * head_dim, vo = ko + plane;
        scales[ko / head_dim] =
            quantize_vector(cache + ko, 1, k + layer * k_layer + t * ks.tok + h * ks.head, 1, head_dim);
        scales[vo / head_dim] =
            quantize_vector(cache + vo, 1, v + layer * v_layer + t * vs.tok + h * vs.head, 1, head_dim);
    }
}

// A rank-3 region of int8 codes written from floats: dst[i][j][k] (element strides d*;
// n2 a multiple of head_dim) quantized one head vector at a time, each vector's scale
// stored at scales[i * c0 + j * c1 + k / head_dim]. A 1-D grid-stride loop over vectors.
template <typename S>
__device__ void quantize3(int8_t* dst, int64_t d0, int64_t d1, int64_t d2, float* scales, int64_t c0, int64_t c1,
                          const S* src, int64_t s0, int64_t s1, int64_t s2, int64_t n0, int64_t n1, int64_t n2,
                          int head_dim) {
    const int64_t per_row = n2 / head_dim, total = n0 * n1 * per_row;
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (int64_t)gridDim.x * blockDim.x) {
        const int64_t k = (e % per_row) * head_dim, j = (e / per_row) % n1, i = e / (per_row * n1);
        scales[i * c0 + j * c1 + k / head_dim] =
            quantize_vector(dst + i * d0 + j * d1 + k * d2, d2, src + i * s0 + j * s1 + k * s2, s2, head_dim);
    }
}

// The reverse of quantize3: dst[i][j][k] = code * its vector's scale, in T. A 1-D
// grid-stride loop over the elements.
template <typename T>
__device__ void dequantize3(T* dst, int64_t d0, int64_t d1, int64_t d2, const int8_t* codes, int64_t q0, int64_t q1,
                            int64_t q2, const float* scales, int64_t c0, int64_t c1, int64_t n0, int64_t n1,
                            int64_t n2, int head_dim) {
    const int64_t total = n0 * n1 * n2;
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (int64_t)gridDim.x * blockDim.x) {
        const int64_t k = e % n2, j = (e / n2) % n1, i = e / (n1 * n2);
        const float x = (float)codes[i * q0 + j * q1 + k * q2] * scales[i * c0 + j * c1 + k / head_dim];
        dst[i * d0 + j * d1 + k * d2] = from_f32<T>(x);
    }
}

// dst[i][j][k] = src[i][j][k] divided (divide != 0) or multiplied by the scale of its
// index along `axis` (scales[0] for all when n_scales is 1), through f32: an fp8 cache's
// per-head scales applied to tensors on the device (src may be dst).
template <typename S, typename T>
__device__ void scale3(T* dst, int64_t d0, int64_t d1, int64_t d2, const S* src, int64_t s0, int64_t s1, int64_t s2,
                       int64_t n0, int64_t n1, int64_t n2, const float* scales, int64_t n_scales, int axis,
                       int divide) {
    const int64_t total = n0 * n1 * n2;
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (int64_t)gridDim.x * blockDim.x) {
        const int64_t idx[3] = {e / (n1 * n2), (e / n2) % n1, e % n2};
        const float s = n_scales == 1 ? scales[0] : scales[idx[axis]];
        const float x = to_f32(src[idx[0] * s0 + idx[1] * s1 + idx[2] * s2]);
        dst[idx[0] * d0 + idx[1] * d1 + idx[2] * d2] = from_f32<T>(divide ? x / s : x * s);
    }
}

// ---------------------------------------------------------------------------------------
// Paged attention (decode and extend), FlashInfer-style, and the merge of its splits.
//
// The host (src/storage/cuda/attention.rs) plans the launch: query rows (rows[5r..5r+5] =
// token, offset of its sequence's block table in `tables`, position, first and one past
// the last visible position) are grouped into tiles of consecutive rows of one sequence
// (one row for decode, several for extend/chunked prefill), and a tile's positions
// (the union of its rows' windows) into chunks (split-K). A work item is one chunk of one
// tile: items[4i..4i+4] = (first row | rows << 32, first position, end position, first
// partial row or -1). Grid (items, kv_heads * head_chunks), blockDim 32 * warps.
//
// A block reads its item's K/V rows of one KV head once, through shared memory: 16-byte
// cp.async copies in two stages (tile t + 2 is in flight while tile t is computed), the
// row offsets of each tile computed from the block table ahead of time into shared memory
// (int8: the rows' scales too). Each warp serves one "row slot" (a query token and HPT of
// the GQA group's query heads, q and the f32 accumulator in registers) and a share of the
// tile's positions (`wpr` warps per row slot); within a warp, LPR lanes hold one 16-byte
// piece each of a K/V row (HEAD_DIM a template parameter; 0 = any head_dim up to 256,
// elementwise), so a warp reads PPW = 32 / LPR positions at once, and every K/V element
// loaded serves the HPT heads of the slot. Scores are f32, reduced with kvrs_group_sum,
// and go through an online softmax in base 2; at the end the warps of a slot merge
// through shared memory. An item without a partial row writes the output (sinks added);
// otherwise it writes its (max, denominator, unnormalised output) and kvrs_attention_merge
// combines the splits.
//
// Semantics are the CPU core's (kvrs::attention): q scaled by `scale`, soft-capping
// (softcap > 0), ALiBi slopes and sinks per query head (null: none). 8-bit storage is
// decoded in registers and its scale applied once per score and once per output (fp8:
// per KV head, k_scales[kvh]; int8: per row, k_scales[element offset / head_dim], V's
// likewise), never per element; float storage has no scale at all.
//
// Values may have their own head size (v_head_dim; an MLA latent's K and V): then only
// the generic kernel (HD 0) runs (the host picks it), a block holds bs * heads * head_dim
// keys followed by bs * heads * v_head_dim values, V rows have offsets of their own
// (voffs), and outputs have v_head_dim elements. The fixed-HD kernels take
// v_head_dim == head_dim. int8's scales of such caches cover chunks of a row, not rows,
// and the host refuses them.

// log2(e): scores are kept in base 2 (exp2 of log2(e)-scaled scores).
constexpr float KVRS_LOG2E = 1.4426950408889634f;
// Bytes of K and V one pipeline stage holds (two stages).
constexpr int KVRS_STAGE_BYTES = 16384;
// Positions a lane scores before it rescales its accumulator.
constexpr int KVRS_STEP = 2;
// Most splits of one row (kvrs_attention_merge keeps 4 per lane).
constexpr int KVRS_MAX_SPLITS = 128;

// 16 bytes, the unit a lane loads.
struct alignas(16) kvrs_u4 {
    uint32_t x, y, z, w;
};

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int imax(int a, int b) { return a > b ? a : b; }
__device__ __forceinline__ int64_t lmax(int64_t a, int64_t b) { return a > b ? a : b; }
__device__ __forceinline__ int64_t lmin(int64_t a, int64_t b) { return a < b ? a : b; }

// The value of float16 bits b (low 16 bits).
__device__ __forceinline__ float half_bits_f32(uint32_t b) {
#ifdef KVRS_SIM
    const uint16_t s = (uint16_t)b;
    __half h;
    memcpy(&h, &s, 2);
    return __half2float(h);
#else
    return __half2float(__ushort_as_half((unsigned short)b));
#endif
}

// 16 bytes of stored elements C decoded to 16 / sizeof(C) floats, each UNIT times smaller than its
// value where UNIT != 1 (the kernel multiplies scores and outputs by UNIT instead).
template <typename C> struct Vec16;
template <> struct Vec16<float> {
    static constexpr float UNIT = 1.0f;
    static __device__ __forceinline__ void decode(const kvrs_u4& v, float* o) {
        o[0] = bits_f32(v.x), o[1] = bits_f32(v.y), o[2] = bits_f32(v.z), o[3] = bits_f32(v.w);
    }
};
template <> struct Vec16<__half> {
    static constexpr float UNIT = 1.0f;
    static __device__ __forceinline__ void decode(const kvrs_u4& v, float* o) {
        const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) o[2 * i] = half_bits_f32(w[i] & 0xffffu), o[2 * i + 1] = half_bits_f32(w[i] >> 16);
    }
};
template <> struct Vec16<__nv_bfloat16> {
    static constexpr float UNIT = 1.0f;
    static __device__ __forceinline__ void decode(const kvrs_u4& v, float* o) {
        const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) o[2 * i] = bits_f32(w[i] << 16), o[2 * i + 1] = bits_f32(w[i] & 0xffff0000u);
    }
};
// E5M2 is the top byte of a float16.
template <> struct Vec16<kvrs_e5m2> {
    static constexpr float UNIT = 1.0f;
    static __device__ __forceinline__ void decode(const kvrs_u4& v, float* o) {
        const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 16; ++i) o[i] = half_bits_f32(((w[i / 4] >> (8 * (i % 4))) & 0xffu) << 8);
    }
};
// E4M3 moved into float16's bit positions is its value / 256 (normals and subnormals
// alike); its NaN codes (0x7f, 0xff) are put back per word, when a word holds one.
template <> struct Vec16<kvrs_e4m3> {
    static constexpr float UNIT = 256.0f;
    static __device__ __forceinline__ void decode(const kvrs_u4& v, float* o) {
        const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const uint32_t b = (w[i / 4] >> (8 * (i % 4))) & 0xffu;
            o[i] = half_bits_f32(((b & 0x80u) << 8) | ((b & 0x7fu) << 7));
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const uint32_t y = (w[i] & 0x7f7f7f7fu) ^ 0x7f7f7f7fu;  // a zero byte: a NaN code
            if ((y - 0x01010101u) & ~y & 0x80808080u) {
#pragma unroll
                for (int k = 0; k < 4; ++k)
                    if (((y >> (8 * k)) & 0xffu) == 0) o[4 * i + k] = bits_f32(0x7fc00000u);
            }
        }
    }
};
// int8 codes through the 2^23 magic number: float bits 0x4b0000xx are 2^23 + xx.
template <> struct Vec16<int8_t> {
    static constexpr float UNIT = 1.0f;
    static __device__ __forceinline__ void decode(const kvrs_u4& v, float* o) {
        const uint32_t w[4] = {v.x ^ 0x80808080u, v.y ^ 0x80808080u, v.z ^ 0x80808080u, v.w ^ 0x80808080u};
#pragma unroll
        for (int i = 0; i < 16; ++i) o[i] = bits_f32(0x4b000000u | ((w[i / 4] >> (8 * (i % 4))) & 0xffu)) - 8388736.0f;
    }
};

// The work split of the attention kernel for storage C and HEAD_DIM HD (0: any head_dim
// up to 256, read elementwise).
template <typename C, int HD> struct AttnShape {
    static constexpr bool GENERIC = HD == 0;
    static constexpr int MAXD = GENERIC ? 256 : HD;                  // elements of a row, at most
    static constexpr int VEC = 16 / (int)sizeof(C);                  // elements per 16 bytes
    static constexpr int CPR = MAXD / VEC;                           // 16-byte pieces per row
    static constexpr int LPR = GENERIC ? 32 : (CPR < 32 ? CPR : 32);  // lanes per row
    static constexpr int NV = GENERIC ? 1 : CPR / LPR;               // 16-byte pieces per lane
    static constexpr int E = MAXD / LPR;                             // elements per lane
    static constexpr int PPW = 32 / LPR;                             // positions a warp reads at once
    static constexpr int HPT = E >= 8 ? 32 / E : 4;                  // query heads per thread
    static constexpr int ROW_BYTES = MAXD * (int)sizeof(C);          // a row's stride in shared memory
    static constexpr int TILE = KVRS_STAGE_BYTES / (2 * ROW_BYTES);  // positions per stage
    static constexpr int STEPS = TILE / (PPW * KVRS_STEP);           // a tile's steps (split over wpr warps)
    static_assert(STEPS >= 1 && TILE <= 128, "tile");
    // The end-of-item merge of up to 7 warps' states fits in the stage buffers.
    static_assert(7 * HPT * (2 + MAXD) * 4 <= 2 * KVRS_STAGE_BYTES, "merge scratch");
};

// Merges another online-softmax state (mo, lo, its accumulator through `other`) into
// (m, l, acc), all in base 2.
__device__ __forceinline__ void merge_state(float& m, float& l, float mo, float lo, float& fa, float& fb) {
    const float mx = fmaxf(m, mo);
    const float mref = mx == -__builtin_huge_valf() ? 0.0f : mx;
    fa = exp2f(m - mref);
    fb = exp2f(mo - mref);
    l = l * fa + lo * fb;
    m = mx;
}

// Adds head h's sink (in base 2: sink2, or no sink) to a final state and returns what
// multiplies the unnormalised output.
__device__ __forceinline__ float finish_factor(float m, float l, const float* sinks, int h) {
    float f = 1.0f;
    if (sinks) {
        const float s2 = sinks[h] * KVRS_LOG2E;
        const float mx = fmaxf(m, s2);
        f = m == -__builtin_huge_valf() ? 0.0f : exp2f(m - mx);
        l = l * f + exp2f(s2 - mx);
    }
    return l > 0.0f ? f / l : 0.0f;
}

template <typename Q, typename C, int HD>
__device__ void paged_attention(const Q* q, TokenStrides qs, Q* out, const C* cache, const int32_t* tables,
                                const int64_t* rows, const int64_t* items, int q_heads, int group, float scale,
                                float softcap, const float* sinks, const float* alibi, float* part_o,
                                float* part_ml, int bs, int heads, int head_dim, int v_head_dim, int hnd,
                                const float* k_scales, const float* v_scales, int tile_rows, int hsb, int wpr) {
    using S = AttnShape<C, HD>;
    using V = Vec16<C>;
    constexpr bool INT8 = same<C, int8_t>::value;
    constexpr bool FP8 = same<C, kvrs_e4m3>::value || same<C, kvrs_e5m2>::value;
    constexpr int HPT = S::HPT, E = S::E, LPR = S::LPR, TILE = S::TILE, RB = S::ROW_BYTES;
    constexpr float UNIT = S::GENERIC ? 1.0f : V::UNIT;
    const float neg_inf = -__builtin_huge_valf();

    __shared__ __align__(16) unsigned char stage[2][KVRS_STAGE_BYTES];
    __shared__ int64_t offs[3][TILE];                 // K row offsets of a tile's positions (-1: none)
    __shared__ int64_t voffs[3][S::GENERIC ? TILE : 1];  // generic: their V row offsets
    __shared__ float row_scales[3][2][INT8 ? TILE : 1];  // int8: the rows' K and V scales

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nthreads = blockDim.x;
    const int64_t* item = items + 4 * (int64_t)blockIdx.x;
    const int row0 = (int)(item[0] & 0xffffffff), nrows = (int)(item[0] >> 32);
    const int64_t kb = item[1], ke = item[2], pbase = item[3];
    const int head_chunks = gridDim.y / heads;
    const int kvh = blockIdx.y / head_chunks;
    const int32_t* table = tables + rows[5 * (int64_t)row0 + 1];
    const int64_t v_off = (int64_t)bs * heads * head_dim;  // from a block's K rows to its V rows
    const int64_t block_elems = (int64_t)bs * heads * (head_dim + v_head_dim);

    // This warp's row slot: query token t of the item, heads j0 .. j0 + nh of the group.
    const int slot = warp / wpr, part = warp % wpr;
    const int t = slot / hsb;
    const int j0 = ((blockIdx.y % head_chunks) * hsb + slot % hsb) * HPT;
    const int nh = imin(HPT, group - j0);
    const bool active = slot < tile_rows * hsb && t < nrows && nh > 0;
    const int gi = lane / LPR, tx = lane % LPR;
    // Element e of this lane's part of a row.
    auto dim = [&](int e) { return S::GENERIC ? tx * E + e : (tx + (e / S::VEC) * LPR) * S::VEC + e % S::VEC; };

    int64_t token = 0, pos = 0, wlo = 0, whi = 0;
    float qf[HPT][E], acc[HPT][E], m[HPT], l[HPT], slope[HPT];
#pragma unroll
    for (int j = 0; j < HPT; ++j) {
        m[j] = neg_inf, l[j] = 0.0f, slope[j] = 0.0f;
#pragma unroll
        for (int e = 0; e < E; ++e) qf[j][e] = 0.0f, acc[j][e] = 0.0f;
    }
    if (active) {
        const int64_t* row = rows + 5 * (int64_t)(row0 + t);
        token = row[0], pos = row[2], wlo = lmax(row[3], kb), whi = lmin(row[4], ke);
#pragma unroll
        for (int j = 0; j < HPT; ++j) {
            if (j >= nh) continue;
            const int h = kvh * group + j0 + j;
            const Q* qv = q + token * qs.tok + h * qs.head;
            if (alibi) slope[j] = alibi[h];
#pragma unroll
            for (int e = 0; e < E; ++e)
                if (!S::GENERIC || dim(e) < head_dim) qf[j][e] = to_f32(qv[dim(e)]) * scale;
        }
    }
    // K's factor per KV head (fp8: its scale; UNIT for the decoding), V's likewise.
    const float k_fold = FP8 ? k_scales[kvh] * UNIT : UNIT, v_fold = FP8 ? v_scales[kvh] * UNIT : UNIT;

    const int64_t ntiles = ke > kb ? (ke - kb + TILE - 1) / TILE : 0;
    // The block of position p's row, and from it the K row's offset.
    auto block_of = [&](int64_t ti, int i) -> int64_t {
        const int64_t p = kb + ti * TILE + i;
        return ti < ntiles && p < ke ? table[p / bs] : -1;
    };
    auto offset_of = [&](int64_t ti, int i, int64_t block) -> int64_t {
        const int64_t p = kb + ti * TILE + i;
        if (S::GENERIC) {
            const int64_t r = hnd ? (int64_t)kvh * bs + p % bs : (p % bs) * heads + kvh;
            return block < 0 ? -1 : block * block_elems + r * head_dim;
        }
        return block < 0 ? -1 : paged_offset(block, 0, p % bs, kvh, 0, bs, heads, head_dim, hnd);
    };
    // Generic: the V row of the position whose K row is at o (-1: none).
    auto voffset_of = [&](int64_t ti, int i, int64_t block) -> int64_t {
        const int64_t p = kb + ti * TILE + i;
        const int64_t r = hnd ? (int64_t)kvh * bs + p % bs : (p % bs) * heads + kvh;
        return block < 0 ? -1 : block * block_elems + v_off + r * v_head_dim;
    };
    // Where tile ti's row i keeps its V (stage slot ti % 3).
    auto v_at = [&](int64_t ti, int i) -> int64_t {
        if constexpr (S::GENERIC) return voffs[ti % 3][i];
        else return offs[ti % 3][i] + v_off;
    };
    auto load_scales = [&](int64_t ti) {  // int8: tile ti's row scales, into registers
        float ks = 0.0f, vs = 0.0f;
        if (INT8 && tid < TILE) {
            const int64_t o = offs[ti % 3][tid];
            if (o >= 0) ks = k_scales[o / head_dim], vs = v_scales[v_at(ti, tid) / head_dim];
        }
        return kvrs_u4{f32_bits(ks), f32_bits(vs), 0, 0};
    };
    auto store_scales = [&](int64_t ti, const kvrs_u4& s) {
        if (INT8 && tid < TILE) row_scales[ti % 3][0][tid] = bits_f32(s.x), row_scales[ti % 3][1][tid] = bits_f32(s.y);
    };
    // Tile ti's K and V rows into stage ti % 2.
    auto issue = [&](int64_t ti) {
        if (ti < ntiles) {
            unsigned char* dst = stage[ti & 1];
            const int64_t* o = offs[ti % 3];
            const int row_bytes = head_dim * (int)sizeof(C), v_row_bytes = v_head_dim * (int)sizeof(C);
            if (!S::GENERIC || (row_bytes % 16 == 0 && v_row_bytes % 16 == 0)) {
                const int cpr = S::GENERIC ? (row_bytes > v_row_bytes ? row_bytes : v_row_bytes) / 16 : S::CPR;
                for (int c = tid; c < 2 * TILE * cpr; c += nthreads) {
                    const int kv = c / (TILE * cpr), r = c % (TILE * cpr), i = r / cpr, piece = r % cpr;
                    if (o[i] >= 0 && (!S::GENERIC || piece * 16 < (kv ? v_row_bytes : row_bytes)))
                        kvrs_cp_async16(dst + kv * TILE * RB + i * RB + piece * 16,
                                        cache + (kv ? v_at(ti, i) : o[i]) + piece * S::VEC);
                }
            } else {
                C* d = reinterpret_cast<C*>(dst);
                const int maxd = head_dim > v_head_dim ? head_dim : v_head_dim;
                for (int c = tid; c < 2 * TILE * maxd; c += nthreads) {
                    const int kv = c / (TILE * maxd), r = c % (TILE * maxd), i = r / maxd, e = r % maxd;
                    if (o[i] >= 0 && e < (kv ? v_head_dim : head_dim))
                        d[(kv * TILE * RB + i * RB) / (int)sizeof(C) + e] = cache[(kv ? v_at(ti, i) : o[i]) + e];
                }
            }
        }
        kvrs_cp_async_commit();
    };
    // This lane's part of a row of n elements in shared memory, as floats (times 1 / UNIT).
    auto load_row = [&](const unsigned char* row, float (&x)[E], int n) {
        if (S::GENERIC) {
            const C* r = reinterpret_cast<const C*>(row);
#pragma unroll
            for (int e = 0; e < E; ++e) x[e] = dim(e) < n ? to_f32(r[dim(e)]) : 0.0f;
        } else {
#pragma unroll
            for (int i = 0; i < S::NV; ++i)
                V::decode(*reinterpret_cast<const kvrs_u4*>(row + (tx + i * LPR) * 16), x + i * S::VEC);
        }
    };

    // Prologue: offsets of tiles 0..2, scales of tiles 0 and 1, tiles 0 and 1 in flight.
    for (int ti = 0; ti < 3; ++ti)
        for (int i = tid; i < TILE; i += nthreads) {
            const int64_t block = block_of(ti, i);
            offs[ti][i] = offset_of(ti, i, block);
            if constexpr (S::GENERIC) voffs[ti][i] = voffset_of(ti, i, block);
        }
    __syncthreads();
    for (int ti = 0; ti < 2; ++ti) store_scales(ti, load_scales(ti));
    issue(0);
    issue(1);

    for (int64_t ti = 0; ti < ntiles; ++ti) {
        kvrs_cp_async_wait<1>();
        __syncthreads();
        // Ahead: the blocks of tile ti + 3 and the scales of tile ti + 2, loads in flight
        // while this tile is computed (the host launches at least TILE threads).
        const int64_t next_block = tid < TILE ? block_of(ti + 3, tid) : -1;
        const kvrs_u4 next_scales = load_scales(ti + 2);
        const int64_t p0 = kb + ti * TILE;
        if (active && p0 < whi && p0 + TILE > wlo) {
            const unsigned char* ks = stage[ti & 1];
            const unsigned char* vs = ks + TILE * RB;
            for (int st = part; st < S::STEPS; st += wpr) {
                float s[HPT][KVRS_STEP];
                int at[KVRS_STEP];
                bool valid[KVRS_STEP];
#pragma unroll
                for (int u = 0; u < KVRS_STEP; ++u) {
                    at[u] = (st * KVRS_STEP + u) * S::PPW + gi;
                    const int64_t p = p0 + at[u];
                    valid[u] = p >= wlo && p < whi;
                    float kf[E];
                    load_row(ks + at[u] * RB, kf, head_dim);
#pragma unroll
                    for (int j = 0; j < HPT; ++j) {
                        float d = 0.0f;
#pragma unroll
                        for (int e = 0; e < E; ++e) d = fmaf(qf[j][e], kf[e], d);
                        s[j][u] = d;
                    }
                }
#pragma unroll
                for (int j = 0; j < HPT; ++j) {
                    if (j >= nh) continue;  // uniform across the warp
#pragma unroll
                    for (int u = 0; u < KVRS_STEP; ++u) s[j][u] = kvrs_group_sum<LPR>(s[j][u]);
                }
#pragma unroll
                for (int u = 0; u < KVRS_STEP; ++u) {
                    const float kf = INT8 ? row_scales[ti % 3][0][at[u]] : k_fold;
                    const float rel = (float)(p0 + at[u] - pos);
#pragma unroll
                    for (int j = 0; j < HPT; ++j) {
                        float x = s[j][u] * kf;
                        if (softcap > 0.0f) x = softcap * tanhf(x / softcap);
                        x = fmaf(slope[j], rel, x);
                        s[j][u] = valid[u] ? x * KVRS_LOG2E : neg_inf;
                    }
                }
#pragma unroll
                for (int j = 0; j < HPT; ++j) {
                    float mx = m[j];
#pragma unroll
                    for (int u = 0; u < KVRS_STEP; ++u) mx = fmaxf(mx, s[j][u]);
                    const float mref = mx == neg_inf ? 0.0f : mx;
                    const float f = exp2f(m[j] - mref);
                    l[j] *= f;
#pragma unroll
                    for (int e = 0; e < E; ++e) acc[j][e] *= f;
                    m[j] = mx;
#pragma unroll
                    for (int u = 0; u < KVRS_STEP; ++u) {
                        s[j][u] = exp2f(s[j][u] - mref);
                        l[j] += s[j][u];
                    }
                }
#pragma unroll
                for (int u = 0; u < KVRS_STEP; ++u) {
                    if (!valid[u]) continue;  // an invisible row is never read (it may hold anything)
                    float vf[E];
                    load_row(vs + at[u] * RB, vf, v_head_dim);
                    const float vsc = INT8 ? row_scales[ti % 3][1][at[u]] : 1.0f;
#pragma unroll
                    for (int j = 0; j < HPT; ++j) {
                        const float w = s[j][u] * vsc;
#pragma unroll
                        for (int e = 0; e < E; ++e) acc[j][e] = fmaf(w, vf[e], acc[j][e]);
                    }
                }
            }
        }
        if (tid < TILE) {
            offs[(ti + 3) % 3][tid] = offset_of(ti + 3, tid, next_block);
            if constexpr (S::GENERIC) voffs[(ti + 3) % 3][tid] = voffset_of(ti + 3, tid, next_block);
        }
        store_scales(ti + 2, next_scales);
        __syncthreads();
        issue(ti + 2);
    }
    kvrs_cp_async_wait<0>();

    // The position groups of a warp merged (xor over lanes LPR apart).
    if (active) {
#pragma unroll
        for (int off = LPR; off < 32; off <<= 1) {
#pragma unroll
            for (int j = 0; j < HPT; ++j) {
                if (j >= nh) continue;
                float fa, fb;
                const float mo = __shfl_xor_sync(0xffffffffu, m[j], off);
                const float lo = __shfl_xor_sync(0xffffffffu, l[j], off);
                merge_state(m[j], l[j], mo, lo, fa, fb);
#pragma unroll
                for (int e = 0; e < E; ++e) acc[j][e] = acc[j][e] * fa + __shfl_xor_sync(0xffffffffu, acc[j][e], off) * fb;
            }
        }
    }
    // The warps of a row slot merged through shared memory (the stages, now free).
    if (wpr > 1) {
        float* scratch = reinterpret_cast<float*>(&stage[0][0]);
        constexpr int PER = HPT * (2 + S::MAXD);
        __syncthreads();
        if (active && part > 0 && gi == 0) {
            float* w = scratch + (slot * (wpr - 1) + part - 1) * PER;
#pragma unroll
            for (int j = 0; j < HPT; ++j) {
                if (tx == 0) w[j * (2 + S::MAXD)] = m[j], w[j * (2 + S::MAXD) + 1] = l[j];
#pragma unroll
                for (int e = 0; e < E; ++e) w[j * (2 + S::MAXD) + 2 + dim(e)] = acc[j][e];
            }
        }
        __syncthreads();
        if (active && part == 0) {
            for (int o = 1; o < wpr; ++o) {
                const float* w = scratch + (slot * (wpr - 1) + o - 1) * PER;
#pragma unroll
                for (int j = 0; j < HPT; ++j) {
                    float fa, fb;
                    merge_state(m[j], l[j], w[j * (2 + S::MAXD)], w[j * (2 + S::MAXD) + 1], fa, fb);
#pragma unroll
                    for (int e = 0; e < E; ++e) acc[j][e] = acc[j][e] * fa + w[j * (2 + S::MAXD) + 2 + dim(e)] * fb;
                }
            }
        }
    }
    if (!active || part != 0 || gi != 0) return;
#pragma unroll
    for (int j = 0; j < HPT; ++j) {
        if (j >= nh) continue;
        const int h = kvh * group + j0 + j;
        if (pbase < 0) {
            const float f = finish_factor(m[j], l[j], sinks, h) * v_fold;
            Q* o = out + (token * q_heads + h) * v_head_dim;
#pragma unroll
            for (int e = 0; e < E; ++e)
                if (!S::GENERIC || dim(e) < v_head_dim) o[dim(e)] = from_f32<Q>(acc[j][e] * f);
        } else {
            const int64_t entry = (pbase + t) * q_heads + h;
            float* o = part_o + entry * v_head_dim;
#pragma unroll
            for (int e = 0; e < E; ++e)
                if (!S::GENERIC || dim(e) < v_head_dim) o[dim(e)] = acc[j][e] * v_fold;
            if (tx == 0) part_ml[2 * entry] = m[j], part_ml[2 * entry + 1] = l[j];
        }
    }
}

// The splits of kvrs_paged_attention combined: merges[4i..4i+4] = (row, first partial
// row, splits, stride between its partial rows); one warp per (merged row, query head):
// grid (merged rows, ceil(q_heads / warps)). Each split's (max, denominator) is read once
// (lane s % 32 keeps split s's), its output in 16-byte pieces: NP per lane, so rows of up
// to 128 NP elements (NP 2 for the attention kernels' 256, 4 for MLA's 512-element latent).
template <typename T, int NP>
__device__ void attention_merge(const float* part_o, const float* part_ml, const int32_t* merges,
                                const int64_t* rows, T* out, int q_heads, const float* sinks, int head_dim) {
    constexpr int KEEP = KVRS_MAX_SPLITS / 32;
    const float neg_inf = -__builtin_huge_valf();
    const int lane = threadIdx.x & 31;
    const int h = blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (h >= q_heads) return;  // a whole warp; no block barrier follows
    const int32_t* mg = merges + 4 * (int64_t)blockIdx.x;
    const int64_t token = rows[5 * (int64_t)mg[0]];
    const int first = mg[1], count = mg[2], stride = mg[3];
    auto entry = [&](int s) { return ((int64_t)first + (int64_t)s * stride) * q_heads + h; };
    float ms[KEEP], mloc = neg_inf, lloc = 0.0f;
#pragma unroll
    for (int k = 0; k < KEEP; ++k) {
        const int s = lane + 32 * k;
        ms[k] = neg_inf;
        if (s < count) {
            ms[k] = part_ml[2 * entry(s)];
            float fa, fb;
            merge_state(mloc, lloc, ms[k], part_ml[2 * entry(s) + 1], fa, fb);
        }
    }
    const float mx = kvrs_group_max<32>(mloc);
    const float mref = mx == neg_inf ? 0.0f : mx;
    const float l = kvrs_group_sum<32>(lloc * exp2f(mloc - mref));
    const bool vec = head_dim % 4 == 0;
    float acc[4 * NP];  // vec: pieces lane + 32i; else elements lane + 32i
#pragma unroll
    for (int c = 0; c < 4 * NP; ++c) acc[c] = 0.0f;
#pragma unroll
    for (int k = 0; k < KEEP; ++k) {
        const float f = exp2f(ms[k] - mref);
        if (vec) {
            // UB splits at a time (8 for two pieces per lane): their loads are issued
            // together, then summed in split order (the partial rows sit in L2; one at a
            // time is latency-bound).
            constexpr int UB = 16 / NP;
            for (int i0 = 0; i0 < 32 && 32 * k + i0 < count; i0 += UB) {
                kvrs_u4 x[UB][NP];
                float fs[UB];
#pragma unroll
                for (int u = 0; u < UB; ++u) {
                    const int s = 32 * k + i0 + u;
                    fs[u] = __shfl_sync(0xffffffffu, f, i0 + u);
                    const float* o = part_o + entry(s < count ? s : 0) * head_dim;
#pragma unroll
                    for (int c = 0; c < NP; ++c)
                        x[u][c] = s < count && 4 * (lane + 32 * c) < head_dim
                                      ? *reinterpret_cast<const kvrs_u4*>(o + 4 * (lane + 32 * c))
                                      : kvrs_u4{0, 0, 0, 0};
                }
#pragma unroll
                for (int u = 0; u < UB; ++u) {
                    if (32 * k + i0 + u >= count) break;
#pragma unroll
                    for (int c = 0; c < NP; ++c) {
                        acc[4 * c] += fs[u] * bits_f32(x[u][c].x), acc[4 * c + 1] += fs[u] * bits_f32(x[u][c].y);
                        acc[4 * c + 2] += fs[u] * bits_f32(x[u][c].z), acc[4 * c + 3] += fs[u] * bits_f32(x[u][c].w);
                    }
                }
            }
        } else {
            for (int i = 0; i < 32 && 32 * k + i < count; ++i) {
                const float fs = __shfl_sync(0xffffffffu, f, i);
                const float* o = part_o + entry(32 * k + i) * head_dim;
#pragma unroll
                for (int c = 0; c < 4 * NP; ++c)
                    if (lane + 32 * c < head_dim) acc[c] += fs * o[lane + 32 * c];
            }
        }
    }
    const float f = finish_factor(mx, l, sinks, h);
    T* o = out + (token * q_heads + h) * head_dim;
#pragma unroll
    for (int c = 0; c < 4 * NP; ++c) {
        const int d = vec ? 4 * (lane + 32 * (c / 4)) + c % 4 : lane + 32 * c;
        if (d < head_dim) o[d] = from_f32<T>(acc[c] * f);
    }
}

}  // namespace kvrs_device

using namespace kvrs_device;

// Kernels taking launch words (see "Copies at copy speed"): NAME_w480 and NAME_w4000
// hold them in a parameter of 480 or 4000 words (the latter needs CUDA 12.1's large
// parameters, and is left out when compiled by an older NVRTC), NAME_wp reads them
// through a pointer. PARAMS are the other parameters; BODY runs with `words` their address.
template <int N> struct KvrsWords {
    uint64_t w[N];
};
#if !defined(__CUDACC_VER_MAJOR__) || __CUDACC_VER_MAJOR__ > 12 || \
    (__CUDACC_VER_MAJOR__ == 12 && __CUDACC_VER_MINOR__ >= 1)
#define KVRS_LARGE_PARAMS 1
#endif
#define KVRS_EXPAND(...) __VA_ARGS__
#ifdef KVRS_SIM
// The simulator hands a kernel its parameters in place (no copy per simulated thread).
#define KVRS_WORDS_T(N) const KvrsWords<N>&
#else
#define KVRS_WORDS_T(N) const __grid_constant__ KvrsWords<N>
#endif
#define KVRS_WORDS_PARAM(NAME, N, PARAMS, BODY)                                                  \
    extern "C" __global__ void NAME##_w##N(KVRS_WORDS_T(N) in_words, KVRS_EXPAND PARAMS) {      \
        const uint64_t* words = in_words.w;                                                                 \
        KVRS_EXPAND BODY;                                                                                   \
    }
#ifdef KVRS_LARGE_PARAMS
#define KVRS_WORDS_LARGE(NAME, PARAMS, BODY) KVRS_WORDS_PARAM(NAME, 4000, PARAMS, BODY)
#else
#define KVRS_WORDS_LARGE(NAME, PARAMS, BODY)
#endif
#define KVRS_WORDS(NAME, PARAMS, BODY)                                                           \
    KVRS_WORDS_PARAM(NAME, 480, PARAMS, BODY)                                                    \
    KVRS_WORDS_LARGE(NAME, PARAMS, BODY)                                                         \
    extern "C" __global__ void NAME##_wp(const uint64_t* __restrict__ words, KVRS_EXPAND PARAMS) { \
        KVRS_EXPAND BODY;                                                                        \
    }

KVRS_WORDS(kvrs_copy_blocks, (int64_t block_bytes, int64_t chunk, int vec),
           (copy_blocks(words, block_bytes, chunk, vec)))
KVRS_WORDS(kvrs_load_blocks, (char* packed, int64_t block_bytes, int64_t chunk, int vec),
           (swap_blocks(words, packed, block_bytes, chunk, vec, true)))
KVRS_WORDS(kvrs_save_blocks, (char* packed, int64_t block_bytes, int64_t chunk, int vec),
           (swap_blocks(words, packed, block_bytes, chunk, vec, false)))

// Adds n to the device-resident position counter (the end of a captured decode step).
extern "C" __global__ void kvrs_advance_counter(int64_t* position, int64_t n) {
    if (blockIdx.x == 0 && threadIdx.x == 0) *position += n;
}

// The scatter's parameters after the words: inputs [layers, tokens, heads, head_dim]
// with element strides, tokens, the pool's geometry and the vector width.
#define KVRS_SCATTER_PARAMS(S)                                                                                \
    (const S* k, const S* v, int64_t k_layer, int64_t v_layer, int64_t k_tok, int64_t k_head, int64_t v_tok,   \
     int64_t v_head, int n, int bs, int heads, int head_dim, int hnd, int vec)
#define KVRS_SCATTER(NAME, S, T)                                                                              \
    KVRS_WORDS(kvrs_scatter_##NAME, KVRS_SCATTER_PARAMS(S),                                                      \
               (scatter_rows<S, T>(words, 2, k, v, k_layer, v_layer, {k_tok, k_head}, {v_tok, v_head}, n,      \
                                   {bs, heads, head_dim, hnd}, vec)))
#define KVRS_GATHER(TN, T)                                                                                    \
    KVRS_WORDS(kvrs_gather_##TN,                                                                              \
               (const T* cache, int first, int n, T* out_k, T* out_v, int64_t k_head, int64_t k_pos,          \
                int64_t v_head, int64_t v_pos, int bs, int heads, int head_dim, int hnd, int vec),            \
               (gather_rows<T>(words, cache, first, n, out_k, out_v, {k_head, k_pos}, {v_head, v_pos},         \
                               {bs, heads, head_dim, hnd}, vec)))
#define KVRS_APPEND(NAME, S, T)                                                                               \
    extern "C" __global__ void kvrs_append_contiguous_##NAME(                                                 \
        const S* k, const S* v, int64_t k_tok, int64_t k_head, int64_t v_tok, int64_t v_head, int64_t k_layer, \
        int64_t v_layer, T* cache, const int64_t* position, int64_t max_seq_len, int heads, int head_dim) {    \
        append_contiguous<S, T>(k, v, {k_tok, k_head}, {v_tok, v_head}, k_layer, v_layer, cache, position,     \
                                max_seq_len, heads, head_dim);                                                 \
    }
#define KVRS_COPY3(NAME, S, T)                                                                                \
    extern "C" __global__ void kvrs_copy3_##NAME(T* dst, int64_t d0, int64_t d1, int64_t d2, const S* src,    \
                                                 int64_t s0, int64_t s1, int64_t s2, int64_t n0, int64_t n1,  \
                                                 int64_t n2) {                                                \
        copy3<S, T>(dst, d0, d1, d2, src, s0, s1, s2, n0, n1, n2);                                            \
    }
#define KVRS_SCALE3(NAME, S, T)                                                                               \
    extern "C" __global__ void kvrs_scale3_##NAME(T* dst, int64_t d0, int64_t d1, int64_t d2, const S* src,   \
                                                  int64_t s0, int64_t s1, int64_t s2, int64_t n0, int64_t n1, \
                                                  int64_t n2, const float* scales, int64_t n_scales, int axis, \
                                                  int divide) {                                               \
        scale3<S, T>(dst, d0, d1, d2, src, s0, s1, s2, n0, n1, n2, scales, n_scales, axis, divide);           \
    }
// Attention for queries Q over storage C, one kernel per head size: d64, d128, d256 and
// dn (any head_dim up to 256). At most 256 threads per block (the host launches 128-256).
// The fixed head sizes are held to 128 registers (two 256-thread or four 128-thread
// blocks per SM: decode is bound by the K/V bytes in flight, so occupancy pays); the
// generic one keeps more registers, which it needs to avoid a stack frame.
#define KVRS_ATTENTION_HD(NAME, Q, C, HD, SUFFIX, MINB)                                                           \
    extern "C" __global__ void __launch_bounds__(256, MINB) kvrs_paged_attention_##NAME##_##SUFFIX(           \
        const Q* q, int64_t q_tok, int64_t q_head, Q* out, const C* cache, const int32_t* tables,              \
        const int64_t* rows, const int64_t* items, int q_heads, int group, float scale, float softcap,         \
        const float* sinks, const float* alibi, float* part_o, float* part_ml, int bs, int heads, int head_dim, \
        int v_head_dim, int hnd, const float* k_scales, const float* v_scales, int tile_rows, int hsb, int wpr) { \
        paged_attention<Q, C, HD>(q, {q_tok, q_head}, out, cache, tables, rows, items, q_heads, group, scale,  \
                                  softcap, sinks, alibi, part_o, part_ml, bs, heads, head_dim, v_head_dim, hnd, \
                                  k_scales, v_scales, tile_rows, hsb, wpr);                                    \
    }
#define KVRS_ATTENTION(NAME, Q, C)                \
    KVRS_ATTENTION_HD(NAME, Q, C, 64, d64, 2)     \
    KVRS_ATTENTION_HD(NAME, Q, C, 128, d128, 2)   \
    KVRS_ATTENTION_HD(NAME, Q, C, 256, d256, 2)   \
    KVRS_ATTENTION_HD(NAME, Q, C, 0, dn, 1)
#define KVRS_FOR_INPUTS(MACRO, T, TN) \
    MACRO(f32_##TN, float, T)         \
    MACRO(f16_##TN, __half, T)        \
    MACRO(bf16_##TN, __nv_bfloat16, T)
// Float storage (T, named TN): writes from every float input, reads and attention in T.
#define KVRS_PER_STORAGE(T, TN)                                                                               \
    KVRS_FOR_INPUTS(KVRS_SCATTER, T, TN)                                                                      \
    KVRS_FOR_INPUTS(KVRS_APPEND, T, TN)                                                                       \
    KVRS_FOR_INPUTS(KVRS_COPY3, T, TN)                                                                        \
    KVRS_FOR_INPUTS(KVRS_SCALE3, T, TN)                                                                       \
    KVRS_ATTENTION(TN, T, T)                                                                                   \
    extern "C" __global__ void kvrs_attention_merge_##TN(const float* part_o, const float* part_ml,           \
                                                         const int32_t* merges, const int64_t* rows, T* out,      \
                                                         int q_heads, const float* sinks, int head_dim) {         \
        attention_merge<T, 2>(part_o, part_ml, merges, rows, out, q_heads, sinks, head_dim);                   \
    }                                                                                                          \
    KVRS_GATHER(TN, T)                                                                                         \
    extern "C" __global__ void kvrs_rope_rotate_##TN(T* const* cache, const int32_t* table, int64_t start,    \
                                                     const float* cos_t, const float* sin_t, int rotary_dim,  \
                                                     int style, int bs, int heads, int head_dim, int hnd) {   \
        rope_rotate<T>(cache, table, start, cos_t, sin_t, rotary_dim, style, bs, heads, head_dim, hnd);       \
    }
// fp8 storage (T, named TN): encoding writes from every float input, decoding copies to
// every float type, attention for every float query type.
#define KVRS_PER_FP8(T, TN)                                 \
    KVRS_FOR_INPUTS(KVRS_SCATTER, T, TN)                    \
    KVRS_FOR_INPUTS(KVRS_APPEND, T, TN)                     \
    KVRS_FOR_INPUTS(KVRS_COPY3, T, TN)                      \
    KVRS_COPY3(TN##_f32, T, float)                          \
    KVRS_COPY3(TN##_f16, T, __half)                         \
    KVRS_COPY3(TN##_bf16, T, __nv_bfloat16)                 \
    KVRS_ATTENTION(f32_##TN, float, T)                      \
    KVRS_ATTENTION(f16_##TN, __half, T)                     \
    KVRS_ATTENTION(bf16_##TN, __nv_bfloat16, T)

KVRS_PER_STORAGE(float, f32)
KVRS_PER_STORAGE(__half, f16)
KVRS_PER_STORAGE(__nv_bfloat16, bf16)
KVRS_PER_FP8(kvrs_e4m3, e4m3)
KVRS_PER_FP8(kvrs_e5m2, e5m2)

// int8 storage, per float input S (named SN): quantizing scatter, append and region
// write; dequantizing region read into S; attention with S queries.
#define KVRS_PER_INT8_INPUT(S, SN)                                                                            \
    KVRS_WORDS(kvrs_scatter_##SN##_i8, KVRS_SCATTER_PARAMS(S),                                                   \
               (scatter_rows_q8<S>(words, 3, k, v, k_layer, v_layer, {k_tok, k_head}, {v_tok, v_head}, n,      \
                                   {bs, heads, head_dim, hnd}, vec)))                                          \
    extern "C" __global__ void kvrs_append_contiguous_##SN##_i8(                                              \
        const S* k, const S* v, int64_t k_tok, int64_t k_head, int64_t v_tok, int64_t v_head, int64_t k_layer, \
        int64_t v_layer, int8_t* cache, float* scales, const int64_t* position, int64_t max_seq_len, int heads, \
        int head_dim) {                                                                                        \
        append_contiguous_q8<S>(k, v, {k_tok, k_head}, {v_tok, v_head}, k_layer, v_layer, cache, scales,       \
                                position, max_seq_len, heads, head_dim);                                       \
    }                                                                                                          \
    extern "C" __global__ void kvrs_quantize3_##SN(int8_t* dst, int64_t d0, int64_t d1, int64_t d2,           \
                                                   float* scales, int64_t c0, int64_t c1, const S* src,        \
                                                   int64_t s0, int64_t s1, int64_t s2, int64_t n0, int64_t n1, \
                                                   int64_t n2, int head_dim) {                                 \
        quantize3<S>(dst, d0, d1, d2, scales, c0, c1, src, s0, s1, s2, n0, n1, n2, head_dim);                  \
    }                                                                                                          \
    extern "C" __global__ void kvrs_dequantize3_##SN(S* dst, int64_t d0, int64_t d1, int64_t d2,              \
                                                     const int8_t* codes, int64_t q0, int64_t q1, int64_t q2,  \
                                                     const float* scales, int64_t c0, int64_t c1, int64_t n0,  \
                                                     int64_t n1, int64_t n2, int head_dim) {                   \
        dequantize3<S>(dst, d0, d1, d2, codes, q0, q1, q2, scales, c0, c1, n0, n1, n2, head_dim);              \
    }                                                                                                          \
    KVRS_ATTENTION(SN##_i8, S, int8_t)

KVRS_PER_INT8_INPUT(float, f32)
KVRS_PER_INT8_INPUT(__half, f16)
KVRS_PER_INT8_INPUT(__nv_bfloat16, bf16)

// 1-byte storage of any kind: raw copies and gathers of the codes.
KVRS_COPY3(b8_b8, uint8_t, uint8_t)
KVRS_GATHER(b8, uint8_t)

// Zeroing by element width: 1 byte (8-bit codes), 2 (float16, bfloat16) or 4 (float32).
extern "C" __global__ void kvrs_zero3_b8(uint8_t* dst, int64_t d0, int64_t d1, int64_t d2, int64_t n0, int64_t n1,
                                         int64_t n2) {
    zero3<uint8_t>(dst, d0, d1, d2, n0, n1, n2);
}
extern "C" __global__ void kvrs_zero3_b16(uint16_t* dst, int64_t d0, int64_t d1, int64_t d2, int64_t n0, int64_t n1,
                                          int64_t n2) {
    zero3<uint16_t>(dst, d0, d1, d2, n0, n1, n2);
}
extern "C" __global__ void kvrs_zero3_b32(uint32_t* dst, int64_t d0, int64_t d1, int64_t d2, int64_t n0, int64_t n1,
                                          int64_t n2) {
    zero3<uint32_t>(dst, d0, d1, d2, n0, n1, n2);
}

// Tensor-core attention for extend and prefill (kvrs_paged_attention_mma_*).
#include "attention_mma.cuh"
// Latent (MLA) attention on the tensor cores (kvrs_paged_attention_mla_*), and the merge of
// its splits' 512-element rows.
#include "attention_mla.cuh"
#define KVRS_MERGE_D512(TN, T)                                                                                  \
    extern "C" __global__ void kvrs_attention_merge_##TN##_d512(const float* part_o, const float* part_ml,     \
                                                                const int32_t* merges, const int64_t* rows,    \
                                                                T* out, int q_heads, const float* sinks,       \
                                                                int head_dim) {                                \
        attention_merge<T, 4>(part_o, part_ml, merges, rows, out, q_heads, sinks, head_dim);                   \
    }
KVRS_MERGE_D512(f16, __half)
KVRS_MERGE_D512(bf16, __nv_bfloat16)
