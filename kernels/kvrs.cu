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

namespace {

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

// Largest head_dim the attention kernel takes (its accumulator lives in registers).
constexpr int KVRS_MAX_HEAD_DIM = 256;

// Adds head h's sink (sinks: null for none) to the denominator l of a softmax whose
// running max is m; returns the factor the unnormalised output is rescaled by.
__device__ __forceinline__ float add_sink(float m, float& l, const float* sinks, int h) {
    if (!sinks) return 1.0f;
    const float mx = fmaxf(m, sinks[h]);
    const float f = m == -__builtin_huge_valf() ? 0.0f : expf(m - mx);
    l = l * f + expf(sinks[h] - mx);
    return f;
}

// Finishes one query row's head from its running max m, denominator l and unnormalised
// output acc: adds the head's sink, divides and writes o[0..head_dim) in T.
template <typename T>
__device__ void finish_head(T* o, const float* acc, float m, float l, const float* sinks, int h, int head_dim) {
    const float f = add_sink(m, l, sinks, h);
    const float inv = l > 0.0f ? f / l : 0.0f;
    for (int d = 0; d < head_dim; ++d) o[d] = from_f32<T>(acc[d] * inv);
}

// Paged attention, the CPU core's semantics: query row r (rows[5r..5r+5] = token, offset of
// its sequence's block table in `tables`, position, first and one-past-last visible
// position) attends, for each query head, over positions lo..hi of its own sequence,
// read through the block table; f32 scores and an online softmax; scale, soft-capping
// (softcap > 0), sinks and ALiBi slopes (null: none) as in kvrs::attention. q is
// [tokens, q_heads, head_dim] with element strides (token, head); out is C-contiguous, of
// q's type Q. The cache's elements C may be 8-bit codes, converted in registers and
// multiplied by their scale: scale_mode 0 none, 1 one per KV head (k_scales[kvh], fp8),
// 2 one per head vector (k_scales[element offset / head_dim], int8; v_scales likewise).
//
// Flash-decoding: grid (rows, splits), one thread per query head; split s of a row reads
// positions lo + s * chunk .. min(hi, lo + (s + 1) * chunk), so a long history is read
// by many threads at once. With `partial` (splits > 1) each split writes its running max,
// denominator and unnormalised output there, [rows, splits, q_heads, 2 + head_dim] f32,
// and kvrs_attention_merge combines them; without it (one split) the thread finishes the
// row itself. No shared memory, no barriers, so the simulated device runs it exactly.
template <typename Q, typename C>
__device__ void paged_attention(const Q* q, TokenStrides qs, Q* out, const C* cache, const int32_t* tables,
                                const int64_t* rows, int q_heads, float scale, float softcap, const float* sinks,
                                const float* alibi, int64_t chunk, float* partial, int bs, int heads,
                                int head_dim, int hnd, const float* k_scales, const float* v_scales,
                                int scale_mode) {
    const int64_t* row = rows + 5 * (int64_t)blockIdx.x;
    const int64_t token = row[0], pos = row[2], hi = row[4];
    const int64_t begin = row[3] + (int64_t)blockIdx.y * chunk;
    const int64_t end = begin + chunk < hi ? begin + chunk : hi;
    const int32_t* table = tables + row[1];
    for (int h = threadIdx.x; h < q_heads; h += blockDim.x) {
        const int kvh = h / (q_heads / heads);
        const Q* qv = q + token * qs.tok + h * qs.head;
        float qf[KVRS_MAX_HEAD_DIM], acc[KVRS_MAX_HEAD_DIM];
        for (int d = 0; d < head_dim; ++d) {
            qf[d] = to_f32(qv[d]) * scale;
            acc[d] = 0.0f;
        }
        const float neg_inf = -__builtin_huge_valf();
        float m = neg_inf, l = 0.0f;
        for (int64_t p = begin; p < end; ++p) {
            const int64_t block = table[p / bs], off = p % bs;
            const int64_t ko = paged_offset(block, 0, off, kvh, 0, bs, heads, head_dim, hnd);
            const int64_t vo = paged_offset(block, 1, off, kvh, 0, bs, heads, head_dim, hnd);
            const C* k = cache + ko;
            const C* v = cache + vo;
            // What multiplies the codes: 1, the KV head's scale (fp8), the vector's (int8).
            const float ks = scale_mode == 1 ? k_scales[kvh] : scale_mode == 2 ? k_scales[ko / head_dim] : 1.0f;
            const float vs = scale_mode == 1 ? v_scales[kvh] : scale_mode == 2 ? v_scales[vo / head_dim] : 1.0f;
            float s = 0.0f;
            for (int d = 0; d < head_dim; ++d) s += qf[d] * (to_f32(k[d]) * ks);
            if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
            if (alibi) s += alibi[h] * (float)(p - pos);
            const float mx = fmaxf(m, s);
            const float f = m == neg_inf ? 0.0f : expf(m - mx);
            const float w = expf(s - mx);
            l = l * f + w;
            for (int d = 0; d < head_dim; ++d) acc[d] = acc[d] * f + w * (to_f32(v[d]) * vs);
            m = mx;
        }
        if (partial) {
            float* w = partial + (((int64_t)blockIdx.x * gridDim.y + blockIdx.y) * q_heads + h) * (2 + head_dim);
            w[0] = m;
            w[1] = l;
            for (int d = 0; d < head_dim; ++d) w[2 + d] = acc[d];
        } else {
            finish_head<Q>(out + (token * q_heads + h) * head_dim, acc, m, l, sinks, h, head_dim);
        }
    }
}

// The splits of kvrs_paged_attention combined by their log-sum-exp: grid (rows), threads
// stride over q_heads * head_dim, each one output element (the split maxima and
// denominators are re-read per element: a handful of words, cached).
template <typename T>
__device__ void attention_merge(const float* partial, int splits, const int64_t* rows, T* out, int q_heads,
                                const float* sinks, int head_dim) {
    const int64_t token = rows[5 * (int64_t)blockIdx.x];
    const float neg_inf = -__builtin_huge_valf();
    for (int i = threadIdx.x; i < q_heads * head_dim; i += blockDim.x) {
        const int h = i / head_dim, d = i % head_dim;
        const float* w = partial + ((int64_t)blockIdx.x * splits * q_heads + h) * (2 + head_dim);
        const int64_t stride = (int64_t)q_heads * (2 + head_dim);
        float m = neg_inf;
        for (int s = 0; s < splits; ++s) m = fmaxf(m, w[s * stride]);
        float l = 0.0f, o = 0.0f;
        if (m != neg_inf) {
            for (int s = 0; s < splits; ++s) {
                const float ms = w[s * stride];
                if (ms == neg_inf) continue;
                const float f = expf(ms - m);
                l += w[s * stride + 1] * f;
                o += w[s * stride + 2 + d] * f;
            }
        }
        const float f = add_sink(m, l, sinks, h);
        out[(token * q_heads + h) * head_dim + d] = from_f32<T>(l > 0.0f ? o * f / l : 0.0f);
    }
}

}  // namespace

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
#define KVRS_ATTENTION(NAME, Q, C)                                                                            \
    extern "C" __global__ void kvrs_paged_attention_##NAME(                                                  \
        const Q* q, int64_t q_tok, int64_t q_head, Q* out, const C* cache, const int32_t* tables,              \
        const int64_t* rows, int q_heads, float scale, float softcap, const float* sinks, const float* alibi,  \
        int64_t chunk, float* partial, int bs, int heads, int head_dim, int hnd, const float* k_scales,        \
        const float* v_scales, int scale_mode) {                                                               \
        paged_attention<Q, C>(q, {q_tok, q_head}, out, cache, tables, rows, q_heads, scale, softcap, sinks,    \
                              alibi, chunk, partial, bs, heads, head_dim, hnd, k_scales, v_scales, scale_mode); \
    }
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
    extern "C" __global__ void kvrs_attention_merge_##TN(const float* partial, int splits, const int64_t* rows, \
                                                         T* out, int q_heads, const float* sinks, int head_dim) { \
        attention_merge<T>(partial, splits, rows, out, q_heads, sinks, head_dim);                              \
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
