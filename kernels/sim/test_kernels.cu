// Kernels that test the simulator itself (tests/cuda_sim_fibers.rs), in plain CUDA:
// sim.cpp includes this file after kvrs.cu; it is not part of kvrs.ptx. Each block's
// threads are numbered t = x + blockDim.x * (y + blockDim.y * z), as warps number lanes.

__device__ __forceinline__ unsigned kvrs_test_tid() {
    return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}
__device__ __forceinline__ unsigned kvrs_test_gid() {
    return blockIdx.x * blockDim.x * blockDim.y * blockDim.z + kvrs_test_tid();
}

// Per block (blockDim.x a power of two <= 1024, 1-D): thread t sums element (t + 1) of
// every tile of blockDim.x of in[block * n, block * n + n) (zero past n; a barrier
// before and after each tile), then the block sums the threads' totals by a tree in
// shared memory; out[block] = the sum.
extern "C" __global__ void kvrs_test_block_sum(const float* in, float* out, int n) {
    __shared__ float tile[1024];
    __shared__ float partial[1024];
    const unsigned t = threadIdx.x, b = blockDim.x;
    float acc = 0.0f;
    for (unsigned base = 0; base < (unsigned)n; base += b) {
        tile[t] = base + t < (unsigned)n ? in[blockIdx.x * n + base + t] : 0.0f;
        __syncthreads();
        acc += tile[(t + 1) % b];
        __syncthreads();
    }
    partial[t] = acc;
    __syncthreads();
    for (unsigned s = b / 2; s > 0; s >>= 1) {
        if (t < s) partial[t] += partial[t + s];
        __syncthreads();
    }
    if (t == 0) out[blockIdx.x] = partial[0];
}

// out[4i .. 4i+4) = __shfl_sync(v, src), __shfl_xor_sync(v, lane_mask),
// __shfl_down_sync(v, delta), __shfl_up_sync(v, delta), all with `width`, v = in[i].
extern "C" __global__ void kvrs_test_shuffles(const int* in, int* out, int src, int lane_mask, unsigned delta,
                                              int width) {
    const unsigned i = kvrs_test_gid();
    const int v = in[i];
    out[4 * i] = __shfl_sync(0xffffffffu, v, src, width);
    out[4 * i + 1] = __shfl_xor_sync(0xffffffffu, v, lane_mask, width);
    out[4 * i + 2] = __shfl_down_sync(0xffffffffu, v, delta, width);
    out[4 * i + 3] = __shfl_up_sync(0xffffffffu, v, delta, width);
}

// out[4i .. 4i+4) = __ballot_sync, __any_sync, __all_sync of in[i] != 0 over the warp,
// then the ballot over the lower half-warp alone (0 in the upper half).
extern "C" __global__ void kvrs_test_votes(const int* in, unsigned* out) {
    const unsigned i = kvrs_test_gid();
    const int p = in[i] != 0;
    out[4 * i] = __ballot_sync(0xffffffffu, p);
    out[4 * i + 1] = __any_sync(0xffffffffu, p);
    out[4 * i + 2] = __all_sync(0xffffffffu, p);
    __syncwarp();
    out[4 * i + 3] = kvrs_test_tid() % 32 < 16 ? __ballot_sync(0x0000ffffu, p) : 0u;
}

// Per lane: out[10i .. 10i+10) = kvrs_group_sum<W>(x), kvrs_group_max<W>(x) for
// W = 2, 4, 8, 16, 32, x = in[i]; then the same sums again by explicit xor shuffles
// (out2, for the bit-for-bit comparison with the GPU's butterfly).
template <int W> __device__ __forceinline__ float kvrs_test_butterfly_sum(float x) {
    for (int m = W / 2; m > 0; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
    return x;
}
extern "C" __global__ void kvrs_test_group_reductions(const float* in, float* out, float* out2) {
    const unsigned i = kvrs_test_gid();
    const float x = in[i];
    out[10 * i] = kvrs_group_sum<2>(x);
    out[10 * i + 1] = kvrs_group_max<2>(x);
    out[10 * i + 2] = kvrs_group_sum<4>(x);
    out[10 * i + 3] = kvrs_group_max<4>(x);
    out[10 * i + 4] = kvrs_group_sum<8>(x);
    out[10 * i + 5] = kvrs_group_max<8>(x);
    out[10 * i + 6] = kvrs_group_sum<16>(x);
    out[10 * i + 7] = kvrs_group_max<16>(x);
    out[10 * i + 8] = kvrs_group_sum<32>(x);
    out[10 * i + 9] = kvrs_group_max<32>(x);
    out2[5 * i] = kvrs_test_butterfly_sum<2>(x);
    out2[5 * i + 1] = kvrs_test_butterfly_sum<4>(x);
    out2[5 * i + 2] = kvrs_test_butterfly_sum<8>(x);
    out2[5 * i + 3] = kvrs_test_butterfly_sum<16>(x);
    out2[5 * i + 4] = kvrs_test_butterfly_sum<32>(x);
}

// Per block of n threads (1-D; the launch gives 16 * n bytes of dynamic shared memory):
// thread t copies the 16 bytes in[block * n + t] into shared memory by cp.async, and
// after the barrier writes shared[n - 1 - t] to out[block * n + t] (the block reversed).
extern "C" __global__ void kvrs_test_dynamic_shared(const uint4* in, uint4* out) {
    KVRS_DYNAMIC_SHARED(uint4, staged);
    const unsigned t = threadIdx.x, n = blockDim.x, base = blockIdx.x * n;
    kvrs_cp_async16(&staged[t], &in[base + t]);
    kvrs_cp_async_commit();
    kvrs_cp_async_wait<0>();
    __syncthreads();
    out[base + t] = staged[n - 1 - t];
}

// Thread t of a block of n: out = in[t] + in[t + 1] + in[t + 2] (indices mod n), by two
// exchanges in shared memory. With `barrier` 0 the barrier between reading the first
// exchange and writing the second is missing: a race whose result depends on the order
// in which threads run.
extern "C" __global__ void kvrs_test_neighbour_sum(const float* in, float* out, int barrier) {
    __shared__ float s[1024];
    const unsigned t = threadIdx.x, n = blockDim.x;
    s[t] = in[t];
    __syncthreads();
    const float next = s[(t + 1) % n];
    if (barrier) __syncthreads();
    s[t] = s[t] + next;
    __syncthreads();
    out[t] = s[t] + s[(t + 1) % n] - next;
}

// A deadlock. mode 0: lanes 0..15 wait at a full-warp __syncwarp, lanes 16..31 at
// __syncthreads; mode 1: lanes 16..31 return and the others wait for them at __syncwarp.
extern "C" __global__ void kvrs_test_deadlock(int mode) {
    if (mode == 0) {
        if (threadIdx.x < 16) __syncwarp();
        __syncthreads();
    } else {
        if (threadIdx.x % 32 >= 16) return;
        __syncwarp();
    }
}

// mode 0: odd and even threads wait at different __syncthreads; mode 1: threads past the
// first warp return before the barrier the others wait at; mode 2: even lanes shuffle
// while odd lanes vote; mode 3: lanes 0..2 meet at __syncwarp with different masks
// (0x3 and 0x7); mode 4: a lane calls __syncwarp with a mask that leaves it out.
extern "C" __global__ void kvrs_test_divergent(int mode) {
    const unsigned lane = threadIdx.x % 32;
    if (mode == 0) {
        if (threadIdx.x % 2) {
            __syncthreads();
        } else {
            __syncthreads();
        }
    } else if (mode == 1) {
        if (threadIdx.x >= 32) return;
        __syncthreads();
    } else if (mode == 2) {
        if (lane % 2) {
            __ballot_sync(0xffffffffu, 1);
        } else {
            __shfl_sync(0xffffffffu, 1, 0);
        }
    } else if (mode == 3) {
        if (lane < 3) __syncwarp(lane == 0 ? 0x3u : 0x7u);
    } else if (lane == 1) {
        __syncwarp(0x1u);
    }
}

// A barrier in a kernel that sim.cpp runs as a plain loop (K): the launch fails.
extern "C" __global__ void kvrs_test_plain_barrier() { __syncthreads(); }

// ---- Tensor-core instructions (tensor_core.h) --------------------------------------------
// The fragments below are written from the PTX ISA's formulas for mma.m16n8k16 (f16/bf16
// operands, f32 accumulators), independently of the emulation: with g = lane / 4 and
// q = lane % 4, A's element i is at (g + 8 ((i / 2) % 2), 2q + i % 2 + 8 (i / 4)), B's at
// (2q + i % 2 + 8 (i / 2), g), C's and D's at (g + 8 (i / 2), 2q + i % 2).

// One warp per block: d = a b + c for one tile, a 16 x 16 and b 16 x 8 row-major 16-bit
// floats of type T, c and d 16 x 8 row-major floats; the fragments built from the
// formulas above.
template <typename T>
__device__ void kvrs_test_mma(const uint16_t* a, const uint16_t* b, const float* c, float* d) {
    const unsigned lane = threadIdx.x, g = lane / 4, q = lane % 4;
    uint32_t fa[4] = {0, 0, 0, 0}, fb[2] = {0, 0};
    float acc[4];
    for (int i = 0; i < 8; ++i)
        fa[i / 2] |= (uint32_t)a[(g + 8 * ((i / 2) % 2)) * 16 + 2 * q + i % 2 + 8 * (i / 4)] << (16 * (i % 2));
    for (int i = 0; i < 4; ++i) fb[i / 2] |= (uint32_t)b[(2 * q + i % 2 + 8 * (i / 2)) * 8 + g] << (16 * (i % 2));
    for (int i = 0; i < 4; ++i) acc[i] = c[(g + 8 * (i / 2)) * 8 + 2 * q + i % 2];
    kvrs_mma_m16n8k16<T>(acc, fa, fb);
    for (int i = 0; i < 4; ++i) d[(g + 8 * (i / 2)) * 8 + 2 * q + i % 2] = acc[i];
}
extern "C" __global__ void kvrs_test_mma_f16(const uint16_t* a, const uint16_t* b, const float* c, float* d) {
    kvrs_test_mma<__half>(a, b, c, d);
}
extern "C" __global__ void kvrs_test_mma_bf16(const uint16_t* a, const uint16_t* b, const float* c, float* d) {
    kvrs_test_mma<__nv_bfloat16>(a, b, c, d);
}

// One warp per block: the four 8 x 8 matrices m[j][row][col] (16-bit elements) copied
// into shared memory with rows `pitch` elements apart (pitch a multiple of 8, rows in
// matrix order), loaded by ldmatrix.x4 (trans: .trans) with lane 8j + i addressing row i
// of matrix j; out[4 lane + j] = the lane's register j.
extern "C" __global__ void kvrs_test_ldmatrix(const uint16_t* m, uint32_t* out, int pitch, int trans) {
    __shared__ __align__(16) uint16_t rows[32 * 64];
    const unsigned lane = threadIdx.x;
    for (int e = 0; e < 8; ++e) rows[lane * pitch + e] = m[lane * 8 + e];
    __syncwarp();
    uint32_t r[4];
    if (trans) {
        kvrs_ldmatrix_x4_trans(r, &rows[lane * pitch]);
    } else {
        kvrs_ldmatrix_x4(r, &rows[lane * pitch]);
    }
    for (int j = 0; j < 4; ++j) out[4 * lane + j] = r[j];
}

// One warp per block, the two ways the attention kernel feeds the tensor cores: A
// (16 x 16, row-major) by ldmatrix.x4 from rows of shared memory; B (16 x 8) by
// ldmatrix.x4 from the rows of B^T (as K's rows give Q K^T: lanes 0-15 address b's 8
// columns' two halves), or, with trans, by ldmatrix.x4.trans from B's own rows (as V's
// rows give P V: lanes 0-15 address its 16 rows; the other two matrices, a second
// n-tile, are not used). d = a b (16 x 8 row-major floats) from the C layout.
template <typename T>
__device__ void kvrs_test_ldmatrix_mma(const uint16_t* a, const uint16_t* b, float* d, int trans) {
    __shared__ __align__(16) uint16_t sa[16 * 16], sb[16 * 16];
    const unsigned lane = threadIdx.x, g = lane / 4, q = lane % 4;
    for (int e = lane; e < 256; e += 32) sa[e] = a[e];
    for (int e = lane; e < 128; e += 32) {
        const int k = e / 8, n = e % 8;
        if (trans) {
            sb[k * 8 + n] = b[e];  // B's rows: 16 rows of 8
        } else {
            sb[n * 16 + k] = b[e];  // B^T's rows: 8 rows of 16
        }
    }
    for (int e = 128 + lane; e < 256; e += 32) sb[e] = 0;
    __syncwarp();
    uint32_t fa[4], r[4];
    kvrs_ldmatrix_x4(fa, &sa[((lane >> 3) & 1) * 8 * 16 + (lane & 7) * 16 + (lane >> 4) * 8]);
    if (trans) {
        kvrs_ldmatrix_x4_trans(r, &sb[(lane & 15) * 8]);
    } else {
        kvrs_ldmatrix_x4(r, &sb[(lane & 7) * 16 + ((lane >> 3) & 1) * 8]);
    }
    const uint32_t fb[2] = {r[0], r[1]};
    float acc[4] = {0, 0, 0, 0};
    kvrs_mma_m16n8k16<T>(acc, fa, fb);
    for (int i = 0; i < 4; ++i) d[(g + 8 * (i / 2)) * 8 + 2 * q + i % 2] = acc[i];
}
extern "C" __global__ void kvrs_test_ldmatrix_mma_f16(const uint16_t* a, const uint16_t* b, float* d, int trans) {
    kvrs_test_ldmatrix_mma<__half>(a, b, d, trans);
}
extern "C" __global__ void kvrs_test_ldmatrix_mma_bf16(const uint16_t* a, const uint16_t* b, float* d, int trans) {
    kvrs_test_ldmatrix_mma<__nv_bfloat16>(a, b, d, trans);
}
