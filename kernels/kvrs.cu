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

// vLLM's reshape_and_cache. Grid (tokens, layers); threads stride over heads * head_dim.
template <typename S, typename T>
__device__ void scatter(const S* const* k, const S* const* v, T* const* cache, const int64_t* slots,
                        TokenStrides ks, TokenStrides vs, int bs, int heads, int head_dim, int hnd) {
    const int64_t t = blockIdx.x;
    const int layer = blockIdx.y;
    const int64_t slot = slots[t];
    if (slot < 0) return;  // -1: padding, skip
    const int64_t block = slot / bs, off = slot % bs;
    for (int i = threadIdx.x; i < heads * head_dim; i += blockDim.x) {
        const int h = i / head_dim, d = i % head_dim;
        cache[layer][paged_offset(block, 0, off, h, d, bs, heads, head_dim, hnd)] =
            convert<S, T>(k[layer][t * ks.tok + h * ks.head + d]);
        cache[layer][paged_offset(block, 1, off, h, d, bs, heads, head_dim, hnd)] =
            convert<S, T>(v[layer][t * vs.tok + h * vs.head + d]);
    }
}

// Element strides of one [heads, positions, head_dim] output (head_dim contiguous).
struct HeadStrides {
    int64_t head, pos;
};

// Positions start..start+n of a block table gathered into K/V [heads, >= n, head_dim]
// (output position 0 is position start). Grid (n, layers); threads stride over
// heads * head_dim.
template <typename T>
__device__ void gather(const T* const* cache, const int32_t* table, int64_t start, T* const* out_k,
                       T* const* out_v, HeadStrides ks, HeadStrides vs, int bs, int heads, int head_dim,
                       int hnd) {
    const int64_t t = blockIdx.x, p = start + t;
    const int layer = blockIdx.y;
    const int64_t block = table[p / bs], off = p % bs;
    for (int i = threadIdx.x; i < heads * head_dim; i += blockDim.x) {
        const int h = i / head_dim, d = i % head_dim;
        out_k[layer][h * ks.head + t * ks.pos + d] = cache[layer][paged_offset(block, 0, off, h, d, bs, heads, head_dim, hnd)];
        out_v[layer][h * vs.head + t * vs.pos + d] = cache[layer][paged_offset(block, 1, off, h, d, bs, heads, head_dim, hnd)];
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
// [tokens, q_heads, head_dim] with element strides (token, head); out is C-contiguous.
//
// Flash-decoding: grid (rows, splits), one thread per query head; split s of a row reads
// positions lo + s * chunk .. min(hi, lo + (s + 1) * chunk), so a long history is read
// by many threads at once. With `partial` (splits > 1) each split writes its running max,
// denominator and unnormalised output there, [rows, splits, q_heads, 2 + head_dim] f32,
// and kvrs_attention_merge combines them; without it (one split) the thread finishes the
// row itself. No shared memory, no barriers, so the simulated device runs it exactly.
template <typename T>
__device__ void paged_attention(const T* q, TokenStrides qs, T* out, const T* cache, const int32_t* tables,
                                const int64_t* rows, int q_heads, float scale, float softcap, const float* sinks,
                                const float* alibi, int64_t chunk, float* partial, int bs, int heads,
                                int head_dim, int hnd) {
    const int64_t* row = rows + 5 * (int64_t)blockIdx.x;
    const int64_t token = row[0], pos = row[2], hi = row[4];
    const int64_t begin = row[3] + (int64_t)blockIdx.y * chunk;
    const int64_t end = begin + chunk < hi ? begin + chunk : hi;
    const int32_t* table = tables + row[1];
    for (int h = threadIdx.x; h < q_heads; h += blockDim.x) {
        const int kvh = h / (q_heads / heads);
        const T* qv = q + token * qs.tok + h * qs.head;
        float qf[KVRS_MAX_HEAD_DIM], acc[KVRS_MAX_HEAD_DIM];
        for (int d = 0; d < head_dim; ++d) {
            qf[d] = to_f32(qv[d]) * scale;
            acc[d] = 0.0f;
        }
        const float neg_inf = -__builtin_huge_valf();
        float m = neg_inf, l = 0.0f;
        for (int64_t p = begin; p < end; ++p) {
            const int64_t block = table[p / bs], off = p % bs;
            const T* k = cache + paged_offset(block, 0, off, kvh, 0, bs, heads, head_dim, hnd);
            const T* v = cache + paged_offset(block, 1, off, kvh, 0, bs, heads, head_dim, hnd);
            float s = 0.0f;
            for (int d = 0; d < head_dim; ++d) s += qf[d] * to_f32(k[d]);
            if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
            if (alibi) s += alibi[h] * (float)(p - pos);
            const float mx = fmaxf(m, s);
            const float f = m == neg_inf ? 0.0f : expf(m - mx);
            const float w = expf(s - mx);
            l = l * f + w;
            for (int d = 0; d < head_dim; ++d) acc[d] = acc[d] * f + w * to_f32(v[d]);
            m = mx;
        }
        if (partial) {
            float* w = partial + (((int64_t)blockIdx.x * gridDim.y + blockIdx.y) * q_heads + h) * (2 + head_dim);
            w[0] = m;
            w[1] = l;
            for (int d = 0; d < head_dim; ++d) w[2 + d] = acc[d];
        } else {
            finish_head<T>(out + (token * q_heads + h) * head_dim, acc, m, l, sinks, h, head_dim);
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

// Whole blocks copied, every layer: pairs[i] = (src, dst). Grid (pairs, layers); threads
// stride over the block's 32-bit words (a block's bytes are always a multiple of 4).
extern "C" __global__ void kvrs_copy_blocks(uint32_t* const* layers, const int64_t* pairs, int64_t block_words) {
    const int64_t src = pairs[2 * blockIdx.x] * block_words, dst = pairs[2 * blockIdx.x + 1] * block_words;
    uint32_t* data = layers[blockIdx.y];
    for (int64_t i = threadIdx.x; i < block_words; i += blockDim.x) data[dst + i] = data[src + i];
}

// Adds n to the device-resident position counter (the end of a captured decode step).
extern "C" __global__ void kvrs_advance_counter(int64_t* position, int64_t n) {
    if (blockIdx.x == 0 && threadIdx.x == 0) *position += n;
}

#define KVRS_SCATTER(NAME, S, T)                                                                              \
    extern "C" __global__ void kvrs_scatter_##NAME(const S* const* k, const S* const* v, T* const* cache,     \
                                                   const int64_t* slots, int64_t k_tok, int64_t k_head,        \
                                                   int64_t v_tok, int64_t v_head, int bs, int heads,           \
                                                   int head_dim, int hnd) {                                     \
        scatter<S, T>(k, v, cache, slots, {k_tok, k_head}, {v_tok, v_head}, bs, heads, head_dim, hnd);       \
    }
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
#define KVRS_FOR_INPUTS(MACRO, T, TN) \
    MACRO(f32_##TN, float, T)         \
    MACRO(f16_##TN, __half, T)        \
    MACRO(bf16_##TN, __nv_bfloat16, T)
#define KVRS_PER_STORAGE(T, TN)                                                                               \
    KVRS_FOR_INPUTS(KVRS_SCATTER, T, TN)                                                                      \
    KVRS_FOR_INPUTS(KVRS_APPEND, T, TN)                                                                       \
    KVRS_FOR_INPUTS(KVRS_COPY3, T, TN)                                                                        \
    extern "C" __global__ void kvrs_paged_attention_##TN(                                                    \
        const T* q, int64_t q_tok, int64_t q_head, T* out, const T* cache, const int32_t* tables,              \
        const int64_t* rows, int q_heads, float scale, float softcap, const float* sinks, const float* alibi,  \
        int64_t chunk, float* partial, int bs, int heads, int head_dim, int hnd) {                             \
        paged_attention<T>(q, {q_tok, q_head}, out, cache, tables, rows, q_heads, scale, softcap, sinks,       \
                           alibi, chunk, partial, bs, heads, head_dim, hnd);                                   \
    }                                                                                                          \
    extern "C" __global__ void kvrs_attention_merge_##TN(const float* partial, int splits, const int64_t* rows, \
                                                         T* out, int q_heads, const float* sinks, int head_dim) { \
        attention_merge<T>(partial, splits, rows, out, q_heads, sinks, head_dim);                              \
    }                                                                                                          \
    extern "C" __global__ void kvrs_gather_##TN(const T* const* cache, const int32_t* table, int64_t start,   \
                                                T* const* out_k, T* const* out_v, int64_t k_head,             \
                                                int64_t k_pos, int64_t v_head, int64_t v_pos, int bs,         \
                                                int heads, int head_dim, int hnd) {                           \
        gather<T>(cache, table, start, out_k, out_v, {k_head, k_pos}, {v_head, v_pos}, bs, heads, head_dim,   \
                  hnd);                                                                                        \
    }                                                                                                          \
    extern "C" __global__ void kvrs_rope_rotate_##TN(T* const* cache, const int32_t* table, int64_t start,    \
                                                     const float* cos_t, const float* sin_t, int rotary_dim,  \
                                                     int style, int bs, int heads, int head_dim, int hnd) {   \
        rope_rotate<T>(cache, table, start, cos_t, sin_t, rotary_dim, style, bs, heads, head_dim, hnd);       \
    }

KVRS_PER_STORAGE(float, f32)
KVRS_PER_STORAGE(__half, f16)
KVRS_PER_STORAGE(__nv_bfloat16, bf16)

// Zeroing by element width: 2 bytes (float16, bfloat16) or 4 (float32).
extern "C" __global__ void kvrs_zero3_b16(uint16_t* dst, int64_t d0, int64_t d1, int64_t d2, int64_t n0, int64_t n1,
                                          int64_t n2) {
    zero3<uint16_t>(dst, d0, d1, d2, n0, n1, n2);
}
extern "C" __global__ void kvrs_zero3_b32(uint32_t* dst, int64_t d0, int64_t d1, int64_t d2, int64_t n0, int64_t n1,
                                          int64_t n2) {
    zero3<uint32_t>(dst, d0, d1, d2, n0, n1, n2);
}
