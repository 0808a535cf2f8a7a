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

// Lanes 0..15 wait at a full-warp __syncwarp, lanes 16..31 at __syncthreads: a deadlock.
extern "C" __global__ void kvrs_test_deadlock() {
    if (threadIdx.x < 16) __syncwarp();
    __syncthreads();
}

// mode 0: odd and even threads wait at different __syncthreads; mode 1: threads past the
// first warp return before the barrier the others wait at.
extern "C" __global__ void kvrs_test_divergent(int mode) {
    if (mode == 0) {
        if (threadIdx.x % 2) {
            __syncthreads();
        } else {
            __syncthreads();
        }
    } else {
        if (threadIdx.x >= 32) return;
        __syncthreads();
    }
}

// A barrier in a kernel that sim.cpp runs as a plain loop (K): the launch fails.
extern "C" __global__ void kvrs_test_plain_barrier() { __syncthreads(); }
