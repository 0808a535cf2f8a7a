// Absorbed multi-head latent attention (DeepSeek's MLA) on the tensor cores, included at
// the end of kvrs.cu after attention_mma.cuh (whose helpers it uses): the latent pool
// holds per position a compressed latent c of 512 elements (the cache's keys) and a rotary
// part r of 64 (its values); each query head's [q_c, q_r] (576 elements) scores
// q_c . c + q_r . r, and its output is the softmax-weighted sum of the latents (512
// elements), which the caller projects with W_UV. All query heads share the latent, so
// (query token, head) pairs are packed into the rows of a block's tiles as in
// kvrs_paged_attention_mma, and one K tile of [c | r] rows serves Q K^T while its c part is
// the V operand of P V: the cache is read once per 64 packed rows.
//
// Block: 8 warps (256 threads), 64 packed rows in four groups of 16; tiles of BN = 32
// positions. Warp w takes row group w % 4 and half w / 4: for S = Q K^T the half's 16
// positions of the tile (all 576 dimensions: Q and K by ldmatrix from shared memory), for
// O += P V the half's 256 of the 512 output dimensions over all 32 positions. So the two
// warps of a row group exchange their rows' maxima (shared memory, one barrier) and P
// (rounded to T, through shared memory, one barrier); each keeps its half's share of the
// denominator, and the two are added at the end. Semantics, launch plan (items, splits,
// kvrs_attention_merge_*_d512 for the splits), masking and the K tile pipeline (two
// cp.async stages, page offsets ahead) are kvrs_paged_attention_mma's. Shared memory:
// Q 72 KB, two stages of 36 KB, P 5 KB: about 150 KB, within sm_80's 163 KB.

namespace kvrs_device {

struct MlaShape {
    static constexpr int DC = 512, DR = 64, DQ = DC + DR;  // latent, rotary part, query
    static constexpr int WARPS = 8;
    static constexpr int BM = 64;                   // packed rows per block
    static constexpr int BN = 32;                   // positions per K tile
    static constexpr int CHUNKS = DQ / 8;           // 16-byte pieces of a [c | r] row
    static constexpr int C_CHUNKS = DC / 8;
    static constexpr int ROW_BYTES = DQ * 2;
    static constexpr int KSTEPS = DQ / 16;          // k-steps of Q K^T
    static constexpr int HALF_N = BN / 2;           // positions of a warp's S
    static constexpr int HALF_D = DC / 2;           // output dimensions of a warp
    static constexpr int OT = HALF_D / 8;           // 8-element tiles of a warp's O
    static constexpr int P_PITCH = BN + 8;          // P's rows in shared memory, elements
    static constexpr int STAGE_BYTES = BN * ROW_BYTES;
    static constexpr int Q_BYTES = BM * ROW_BYTES;
    static constexpr int P_BYTES = BM * P_PITCH * 2;
    // Dynamic shared memory: two stages, Q, P.
    static constexpr int SHARED_BYTES = 2 * STAGE_BYTES + Q_BYTES + P_BYTES;
};

// The byte offset of 16-byte piece c of row i in a swizzled tile of [c | r] rows.
__device__ __forceinline__ int mla_swizzled(int i, int c) { return i * MlaShape::ROW_BYTES + ((c ^ (i & 7)) << 4); }

template <typename T>
__device__ void paged_attention_mla(const T* q, TokenStrides qs, T* out, const T* cache, const int32_t* tables,
                                    const int64_t* rows, const int64_t* items, int q_heads, int group, float scale,
                                    float softcap, const float* sinks, const float* alibi, float* part_o,
                                    float* part_ml, int bs, int heads, int hnd, int hpb) {
    using S = MlaShape;
    constexpr int BM = S::BM, BN = S::BN, CH = S::CHUNKS;
    const float neg_inf = -__builtin_huge_valf();
    KVRS_DYNAMIC_SHARED(unsigned char, smem);
    unsigned char* const q_tile = smem + 2 * S::STAGE_BYTES;
    unsigned char* const p_tile = q_tile + S::Q_BYTES;
    __shared__ int64_t offs[3][BN], roffs[3][BN];  // c and r row offsets of a tile's positions
    __shared__ int win_lo[BM], win_hi[BM];  // the packed rows' windows, from kb
    __shared__ float half_max[2][BM];  // each half's row maxima of the current tile
    __shared__ float half_l[2][BM];    // each half's denominators, at the end

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nthreads = blockDim.x;
    const int rg = warp & 3, half = warp >> 2;
    const int64_t* item = items + 4 * (int64_t)blockIdx.x;
    const int row0 = (int)(item[0] & 0xffffffff), nrows = (int)(item[0] >> 32);
    const int64_t kb = item[1], ke = item[2], pbase = item[3];
    const int head_chunks = gridDim.y / heads;
    const int kvh = blockIdx.y / head_chunks, j0 = (blockIdx.y % head_chunks) * hpb;
    const int32_t* table = tables + rows[5 * (int64_t)row0 + 1];
    const int64_t block_elems = (int64_t)bs * heads * S::DQ, r_base = (int64_t)bs * heads * S::DC;

    auto packed = [&](int r, int& t, int& h) {
        t = r / hpb;
        const int j = j0 + r % hpb;
        h = kvh * group + j;
        return t < nrows && j < group;
    };
    const int64_t ntiles = ke > kb ? (ke - kb + BN - 1) / BN : 0;
    auto block_of = [&](int64_t ti, int i) -> int64_t {
        const int64_t p = kb + ti * BN + i;
        return ti < ntiles && p < ke ? table[p / bs] : -1;
    };
    // Position p's row among the block's (and so its c and r rows).
    auto set_offsets = [&](int slot, int64_t ti, int i, int64_t block) {
        const int64_t p = kb + ti * BN + i;
        const int64_t r = hnd ? (int64_t)kvh * bs + p % bs : (p % bs) * heads + kvh;
        offs[slot][i] = block < 0 ? -1 : block * block_elems + r * S::DC;
        roffs[slot][i] = block < 0 ? -1 : block * block_elems + r_base + r * S::DR;
    };
    auto issue = [&](int64_t ti) {
        if (ti < ntiles) {
            unsigned char* dst = smem + (ti & 1) * S::STAGE_BYTES;
            const int64_t *o = offs[ti % 3], *ro = roffs[ti % 3];
            for (int c = tid; c < BN * CH; c += nthreads) {
                const int i = c / CH, piece = c % CH;
                unsigned char* d = dst + mla_swizzled(i, piece);
                if (o[i] >= 0) {
                    kvrs_cp_async16(d, piece < S::C_CHUNKS ? cache + o[i] + piece * 8
                                                           : cache + ro[i] + (piece - S::C_CHUNKS) * 8);
                } else {
                    *reinterpret_cast<kvrs_u4*>(d) = kvrs_u4{0, 0, 0, 0};
                }
            }
        }
        kvrs_cp_async_commit();
    };

    // Prologue: windows, Q, offsets of tiles 0..2, tiles 0 and 1 in flight.
    for (int r = tid; r < BM; r += nthreads) {
        int t, h;
        const bool real = packed(r, t, h);
        const int64_t* row = rows + 5 * (int64_t)(row0 + (real ? t : 0));
        win_lo[r] = (int)(lmax(row[3], kb) - kb);
        win_hi[r] = (int)(lmin(row[4], ke) - kb);
    }
    for (int c = tid; c < BM * CH; c += nthreads) {
        const int r = c / CH, piece = c % CH;
        int t, h;
        unsigned char* d = q_tile + mla_swizzled(r, piece);
        if (packed(r, t, h)) {
            kvrs_cp_async16(d, q + rows[5 * (int64_t)(row0 + t)] * qs.tok + h * qs.head + piece * 8);
        } else {
            *reinterpret_cast<kvrs_u4*>(d) = kvrs_u4{0, 0, 0, 0};
        }
    }
    kvrs_cp_async_commit();
    for (int ti = 0; ti < 3; ++ti)
        for (int i = tid; i < BN; i += nthreads) set_offsets(ti, ti, i, block_of(ti, i));
    __syncthreads();
    issue(0);
    issue(1);

    const int g = lane >> 2, tq = lane & 3;
    // Positions from kb (int: an item spans less than 2^31 positions).
    int pos[2], lo[2], hi[2];
    float slope[2];
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        const int r = rg * 16 + g + 8 * rr;
        int t, h;
        const bool mine = packed(r, t, h);
        pos[rr] = (int)(rows[5 * (int64_t)(row0 + (mine ? t : 0)) + 2] - kb);
        lo[rr] = win_lo[r], hi[rr] = win_hi[r];
        slope[rr] = mine && alibi ? alibi[h] : 0.0f;
    }

    float o[S::OT][4], m[2] = {neg_inf, neg_inf}, l[2] = {0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < S::OT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;

    for (int64_t ti = 0; ti < ntiles; ++ti) {
        kvrs_cp_async_wait<1>();
        __syncthreads();
        const int64_t next_block = tid < BN ? block_of(ti + 3, tid) : -1;
        const int p0 = (int)(ti * BN);  // the tile's first position, from kb
        const unsigned char* kt = smem + (ti & 1) * S::STAGE_BYTES;
        // S = Q K^T over this warp's 16 positions (two n-tiles), all 576 dimensions.
        float s[2][4] = {{0, 0, 0, 0}, {0, 0, 0, 0}};
#pragma unroll 4
        for (int k = 0; k < S::KSTEPS; ++k) {
            uint32_t a[4], b[4];
            kvrs_ldmatrix_x4(a, q_tile + mla_swizzled(rg * 16 + ((lane >> 3) & 1) * 8 + (lane & 7), 2 * k + (lane >> 4)));
            kvrs_ldmatrix_x4(b, kt + mla_swizzled(half * 16 + (lane >> 4) * 8 + (lane & 7), 2 * k + ((lane >> 3) & 1)));
            const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
            kvrs_mma_m16n8k16<T>(s[0], a, b0);
            kvrs_mma_m16n8k16<T>(s[1], a, b1);
        }
        // Scores in base 2, masked to each row's window; the rows' maxima of this half.
        float mx[2];
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            const int from = imin(imax(lo[rr] - p0, 0), BN), to = imin(imax(hi[rr] - p0, 0), BN);
            const float rel = (float)(p0 - pos[rr]);
            mx[rr] = neg_inf;
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int col = half * 16 + nt * 8 + 2 * tq + e;
                    float x = s[nt][2 * rr + e] * scale;
                    if (softcap > 0.0f) x = softcap * tanhf(x / softcap);
                    x = fmaf(slope[rr], rel + (float)col, x);
                    x = col >= from && col < to ? x * KVRS_LOG2E : neg_inf;
                    s[nt][2 * rr + e] = x;
                    mx[rr] = fmaxf(mx[rr], x);
                }
            }
        }
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            mx[rr] = kvrs_group_max<4>(mx[rr]);
            if (tq == 0) half_max[half][rg * 16 + g + 8 * rr] = mx[rr];
        }
        __syncthreads();
        // The online softmax with the whole tile's maxima; P (rounded to T) into shared
        // memory for both halves' P V.
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            const int r = rg * 16 + g + 8 * rr;
            const float tile_max = fmaxf(half_max[0][r], half_max[1][r]);
            const float mnew = fmaxf(m[rr], tile_max);
            const float mref = mnew == neg_inf ? 0.0f : mnew;
            const float f = exp2f(m[rr] - mref);
            m[rr] = mnew;
            l[rr] *= f;
#pragma unroll
            for (int i = 0; i < S::OT; ++i) o[i][2 * rr] *= f, o[i][2 * rr + 1] *= f;
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
                const float p0v = exp2f(s[nt][2 * rr] - mref), p1v = exp2f(s[nt][2 * rr + 1] - mref);
                l[rr] += p0v + p1v;
                *reinterpret_cast<uint32_t*>(p_tile + (r * S::P_PITCH + half * 16 + nt * 8 + 2 * tq) * 2) =
                    pack2<T>(p0v, p1v);
            }
        }
        __syncthreads();
        // O += P V over the tile's 32 positions, this warp's 256 output dimensions: V is
        // the c part of the K tile (pieces half * 32 ...), transposed by ldmatrix.
#pragma unroll
        for (int kp = 0; kp < BN / 16; ++kp) {
            uint32_t a[4];
            kvrs_ldmatrix_x4(a, p_tile + ((rg * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * S::P_PITCH + kp * 16 +
                                          (lane >> 4) * 8) * 2);
#pragma unroll
            for (int dp = 0; dp < S::OT / 2; ++dp) {
                uint32_t b[4];
                kvrs_ldmatrix_x4_trans(b, kt + mla_swizzled(kp * 16 + ((lane >> 3) & 1) * 8 + (lane & 7),
                                                            half * (S::C_CHUNKS / 2) + 2 * dp + (lane >> 4)));
                const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
                kvrs_mma_m16n8k16<T>(o[2 * dp], a, b0);
                kvrs_mma_m16n8k16<T>(o[2 * dp + 1], a, b1);
            }
        }
        if (tid < BN) set_offsets((int)((ti + 3) % 3), ti + 3, tid, next_block);
        __syncthreads();
        issue(ti + 2);
    }
    kvrs_cp_async_wait<0>();

    // Denominators: over the row's four lanes, then the two halves (through shared memory).
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        l[rr] = kvrs_group_sum<4>(l[rr]);
        if (tq == 0) half_l[half][rg * 16 + g + 8 * rr] = l[rr];
    }
    __syncthreads();
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        const int r = rg * 16 + g + 8 * rr;
        int t, h;
        if (!packed(r, t, h)) continue;
        const float lsum = half_l[0][r] + half_l[1][r];
        const int d0 = half * S::HALF_D + 2 * tq;
        if (pbase < 0) {
            const float f = finish_factor(m[rr], lsum, sinks, h);
            T* dst = out + (rows[5 * (int64_t)(row0 + t)] * q_heads + h) * S::DC + d0;
#pragma unroll
            for (int i = 0; i < S::OT; ++i)
                *reinterpret_cast<uint32_t*>(dst + 8 * i) = pack2<T>(o[i][2 * rr] * f, o[i][2 * rr + 1] * f);
        } else {
            const int64_t entry = (pbase + t) * q_heads + h;
            float* dst = part_o + entry * S::DC + d0;
#pragma unroll
            for (int i = 0; i < S::OT; ++i) *reinterpret_cast<float2*>(dst + 8 * i) = make_float2(o[i][2 * rr], o[i][2 * rr + 1]);
            if (half == 0 && tq == 0) part_ml[2 * entry] = m[rr], part_ml[2 * entry + 1] = lsum;
        }
    }
}

}  // namespace kvrs_device

// Latent attention for f16 or bf16 latent pools (named TN) with a 512-element latent and a
// 64-element rotary part: kvrs_paged_attention_mla_TN, 256 threads and
// MlaShape::SHARED_BYTES of dynamic shared memory per block.
#define KVRS_ATTENTION_MLA(TN, T)                                                                              \
    extern "C" __global__ void __launch_bounds__(256) kvrs_paged_attention_mla_##TN(                           \
        const T* q, int64_t q_tok, int64_t q_head, T* out, const T* cache, const int32_t* tables,              \
        const int64_t* rows, const int64_t* items, int q_heads, int group, float scale, float softcap,         \
        const float* sinks, const float* alibi, float* part_o, float* part_ml, int bs, int heads, int hnd,     \
        int hpb) {                                                                                             \
        paged_attention_mla<T>(q, {q_tok, q_head}, out, cache, tables, rows, items, q_heads, group, scale,     \
                               softcap, sinks, alibi, part_o, part_ml, bs, heads, hnd, hpb);                   \
    }
KVRS_ATTENTION_MLA(f16, __half)
KVRS_ATTENTION_MLA(bf16, __nv_bfloat16)
