// Tensor-core paged attention for many query rows per sequence (extend, chunked prefill,
// speculative verification), included at the end of kvrs.cu: FlashAttention-2's
// algorithm on mma.sync.m16n8k16 (tensor_core.cuh), f16 or bf16 pages and queries, f32
// accumulation, for head sizes 64, 128 and 256 (keys and values of one size).
//
// The launch is planned on the host like kvrs_paged_attention's (src/storage/cuda/
// attention_plan.rs; the same rows, items and merges, so kvrs_attention_merge combines
// its splits), with one difference: a block's query rows are "packed rows", (query token
// t, query head j) pairs of one KV head, t = r / hpb and j = j0 + r % hpb, so the heads of
// a GQA group share every K/V tile. Grid (items, kv_heads * head_chunks), 128 threads:
// four warps of 16 packed rows each (BM = 64 per block).
//
// Per block: Q's 64 rows are copied into shared memory by cp.async, then K/V tiles of BN
// positions stream through two shared-memory stages (cp.async, 16 bytes per copy, rows
// found through the block table ahead of time as in kvrs_paged_attention; positions with
// no row are zeros). Rows are stored with their 16-byte pieces swizzled (piece c of row i
// at c ^ (i % 8)), so that ldmatrix reads eight rows without bank conflicts. Per warp and
// tile: S = Q K^T (ldmatrix of Q, or Q's fragments kept in registers for HD <= 128, and of
// K), the scores scaled, soft-capped, ALiBi-biased and masked to each row's window
// (tiles inside every row's window skip the mask; tiles outside all of a warp's rows'
// windows are skipped altogether: the causal tiles), the online softmax in registers (in
// base 2; a row's max over its four lanes by kvrs_group_max<4>, its denominator summed per
// lane and reduced once at the end), then O += P V with P converted to T in registers (the
// accumulator layout of S is the A layout of P) and V through ldmatrix.trans.
//
// Semantics are kvrs_paged_attention's (the CPU core's): q . k times `scale`, then the
// soft-cap, the ALiBi bias, the window; sinks when the row is finished. Differences in
// rounding: q and k are multiplied as stored (the scale is applied to the f32 dot product),
// and P is rounded to T before P V, as FlashAttention does. A value a row cannot see is
// multiplied by a zero weight (masked scores give exactly 0), so a position outside
// every row's window must hold a finite value: the loaded positions are those of the
// item, the union of its rows' windows, which the sequence holds.

namespace kvrs_device {

template <int HD> struct MmaShape {
    static constexpr int WARPS = 4;
    static constexpr int BM = 16 * WARPS;           // packed rows per block
    static constexpr int BN = HD <= 128 ? 64 : 32;  // positions per K/V tile
    static constexpr int CHUNKS = HD / 8;           // 16-byte pieces per row
    static constexpr int ROW_BYTES = HD * 2;
    static constexpr int KSTEPS = HD / 16;          // k-steps of Q K^T
    static constexpr int NT = BN / 8;               // 8-position tiles of S
    static constexpr int OT = HD / 8;               // 8-element tiles of O
    static constexpr bool Q_REGS = HD <= 128;       // Q's fragments stay in registers
    static constexpr int KV_BYTES = BN * ROW_BYTES;  // one K (or V) tile
    static constexpr int STAGE_BYTES = 2 * KV_BYTES;
    // Dynamic shared memory: two stages, then Q.
    static constexpr int SHARED_BYTES = 2 * STAGE_BYTES + BM * ROW_BYTES;
    static_assert(CHUNKS >= 8 && BN <= 128 && BN % 16 == 0, "shape");
};

// The byte offset of 16-byte piece c of row i in a swizzled tile of HD-element rows.
template <int HD> __device__ __forceinline__ int swizzled(int i, int c) {
    return i * (HD * 2) + ((c ^ (i & 7)) << 4);
}

// The 16 bits of a 16-bit float.
__device__ __forceinline__ uint32_t bits16(__half x) {
#ifdef KVRS_SIM
    uint16_t u;
    memcpy(&u, &x, 2);
    return u;
#else
    return __half_as_ushort(x);
#endif
}
__device__ __forceinline__ uint32_t bits16(__nv_bfloat16 x) {
#ifdef KVRS_SIM
    return x.bits;
#else
    return __bfloat16_as_ushort(x);
#endif
}

// lo and hi rounded to T, packed in one register (lo in the low half).
template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi) {
    return bits16(from_f32<T>(lo)) | bits16(from_f32<T>(hi)) << 16;
}

template <typename T, int HD>
__device__ void paged_attention_mma(const T* q, TokenStrides qs, T* out, const T* cache, const int32_t* tables,
                                    const int64_t* rows, const int64_t* items, int q_heads, int group, float scale,
                                    float softcap, const float* sinks, const float* alibi, float* part_o,
                                    float* part_ml, int bs, int heads, int hnd, int hpb) {
    using S = MmaShape<HD>;
    constexpr int BM = S::BM, BN = S::BN, CH = S::CHUNKS;
    const float neg_inf = -__builtin_huge_valf();
    KVRS_DYNAMIC_SHARED(unsigned char, smem);
    unsigned char* const q_tile = smem + 2 * S::STAGE_BYTES;
    __shared__ int64_t offs[3][BN];           // K row offsets of a tile's positions (-1: none)
    __shared__ int win_lo[BM], win_hi[BM];      // the packed rows' windows, from kb
    __shared__ bool real[BM];                 // whether a packed row is a query's (not padding)

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nthreads = blockDim.x;
    const int64_t* item = items + 4 * (int64_t)blockIdx.x;
    const int row0 = (int)(item[0] & 0xffffffff), nrows = (int)(item[0] >> 32);
    const int64_t kb = item[1], ke = item[2], pbase = item[3];
    const int head_chunks = gridDim.y / heads;
    const int kvh = blockIdx.y / head_chunks, j0 = (blockIdx.y % head_chunks) * hpb;
    const int32_t* table = tables + rows[5 * (int64_t)row0 + 1];
    const int64_t v_off = (int64_t)bs * heads * HD;  // from a block's K rows to its V rows

    // Packed row r: its query token's row t of the item and query head h; false for padding.
    auto packed = [&](int r, int& t, int& h) {
        t = r / hpb;
        const int j = j0 + r % hpb;
        h = kvh * group + j;
        return t < nrows && j < group;
    };
    // The block of position p of tile ti, and from it the K row's offset.
    const int64_t ntiles = ke > kb ? (ke - kb + BN - 1) / BN : 0;
    auto block_of = [&](int64_t ti, int i) -> int64_t {
        const int64_t p = kb + ti * BN + i;
        return ti < ntiles && p < ke ? table[p / bs] : -1;
    };
    auto offset_of = [&](int64_t ti, int i, int64_t block) -> int64_t {
        const int64_t p = kb + ti * BN + i;
        return block < 0 ? -1 : paged_offset(block, 0, p % bs, kvh, 0, bs, heads, HD, hnd);
    };
    // Tile ti's K and V rows into stage ti % 2 (zeros for positions without a row).
    auto issue = [&](int64_t ti) {
        if (ti < ntiles) {
            unsigned char* dst = smem + (ti & 1) * S::STAGE_BYTES;
            const int64_t* o = offs[ti % 3];
            for (int c = tid; c < 2 * BN * CH; c += nthreads) {
                const int kv = c / (BN * CH), r = c % (BN * CH), i = r / CH, piece = r % CH;
                unsigned char* d = dst + kv * S::KV_BYTES + swizzled<HD>(i, piece);
                if (o[i] >= 0) {
                    kvrs_cp_async16(d, cache + o[i] + kv * v_off + piece * 8);
                } else {
                    *reinterpret_cast<kvrs_u4*>(d) = kvrs_u4{0, 0, 0, 0};
                }
            }
        }
        kvrs_cp_async_commit();
    };

    // Prologue: the rows' windows, Q (zeros for padding rows), the offsets of tiles 0..2,
    // then tiles 0 and 1 in flight.
    for (int r = tid; r < BM; r += nthreads) {
        int t, h;
        real[r] = packed(r, t, h);
        const int64_t* row = rows + 5 * (int64_t)(row0 + (real[r] ? t : 0));
        win_lo[r] = (int)(lmax(row[3], kb) - kb);
        win_hi[r] = (int)(lmin(row[4], ke) - kb);
    }
    for (int c = tid; c < BM * CH; c += nthreads) {
        const int r = c / CH, piece = c % CH;
        int t, h;
        unsigned char* d = q_tile + swizzled<HD>(r, piece);
        if (packed(r, t, h)) {
            const int64_t token = rows[5 * (int64_t)(row0 + t)];
            kvrs_cp_async16(d, q + token * qs.tok + h * qs.head + piece * 8);
        } else {
            *reinterpret_cast<kvrs_u4*>(d) = kvrs_u4{0, 0, 0, 0};
        }
    }
    kvrs_cp_async_commit();
    for (int ti = 0; ti < 3; ++ti)
        for (int i = tid; i < BN; i += nthreads) offs[ti][i] = offset_of(ti, i, block_of(ti, i));
    __syncthreads();
    issue(0);
    issue(1);
    kvrs_cp_async_wait<2>();  // Q (tiles 0 and 1 may still be in flight)
    __syncthreads();

    // This lane's two rows (g and g + 8 of its warp's 16) and the warp's windows: the
    // union of its real rows' (a tile outside it is skipped) and their intersection (a
    // tile inside it needs no mask).
    const int g = lane >> 2, tq = lane & 3;
    // Positions from kb (int: an item spans less than 2^31 positions).
    int pos[2], lo[2], hi[2];
    float slope[2];
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        const int r = warp * 16 + g + 8 * rr;
        int t, h;
        const bool mine = packed(r, t, h);
        pos[rr] = (int)(rows[5 * (int64_t)(row0 + (mine ? t : 0)) + 2] - kb);
        lo[rr] = win_lo[r], hi[rr] = win_hi[r];
        slope[rr] = mine && alibi ? alibi[h] : 0.0f;
    }
    const int most = 0x7fffffff;
    int any_lo = most, any_hi = -most, all_lo = -most, all_hi = most;
    for (int i = 0; i < 16; ++i) {
        const int r = warp * 16 + i;
        if (!real[r]) continue;
        any_lo = any_lo < win_lo[r] ? any_lo : win_lo[r];
        any_hi = any_hi > win_hi[r] ? any_hi : win_hi[r];
        all_lo = all_lo > win_lo[r] ? all_lo : win_lo[r];
        all_hi = all_hi < win_hi[r] ? all_hi : win_hi[r];
    }

    // Q's fragments (A operands of the k-steps): rows 0-7 and 8-15 of the warp, pieces 2k
    // and 2k + 1.
    auto q_fragment = [&](int k, uint32_t (&a)[4]) {
        kvrs_ldmatrix_x4(a, q_tile + swizzled<HD>(warp * 16 + ((lane >> 3) & 1) * 8 + (lane & 7), 2 * k + (lane >> 4)));
    };
    uint32_t qa[S::Q_REGS ? S::KSTEPS : 1][4];
    if constexpr (S::Q_REGS) {
#pragma unroll
        for (int k = 0; k < S::KSTEPS; ++k) q_fragment(k, qa[k]);
    }

    float o[S::OT][4], m[2] = {neg_inf, neg_inf}, l[2] = {0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < S::OT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;

    for (int64_t ti = 0; ti < ntiles; ++ti) {
        kvrs_cp_async_wait<1>();
        __syncthreads();
        // Ahead: the blocks of tile ti + 3, loaded while this tile is computed.
        const int64_t next_block = tid < BN ? block_of(ti + 3, tid) : -1;
        const int p0 = (int)(ti * BN);  // the tile's first position, from kb
        if (p0 < any_hi && p0 + BN > any_lo) {  // uniform across the warp
            const unsigned char* kt = smem + (ti & 1) * S::STAGE_BYTES;
            const unsigned char* vt = kt + S::KV_BYTES;
            // S = Q K^T: K rows are the B operand's columns (n-tiles 2np and 2np + 1,
            // pieces 2k and 2k + 1 of their rows).
            float s[S::NT][4];
#pragma unroll
            for (int i = 0; i < S::NT; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
#pragma unroll
            for (int k = 0; k < S::KSTEPS; ++k) {
                uint32_t a[4];
                if constexpr (S::Q_REGS) {
#pragma unroll
                    for (int i = 0; i < 4; ++i) a[i] = qa[k][i];
                } else {
                    q_fragment(k, a);
                }
#pragma unroll
                for (int np = 0; np < S::NT / 2; ++np) {
                    uint32_t b[4];
                    kvrs_ldmatrix_x4(b, kt + swizzled<HD>(np * 16 + (lane >> 4) * 8 + (lane & 7), 2 * k + ((lane >> 3) & 1)));
                    const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
                    kvrs_mma_m16n8k16<T>(s[2 * np], a, b0);
                    kvrs_mma_m16n8k16<T>(s[2 * np + 1], a, b1);
                }
            }
            // Scores in base 2, masked outside each row's window (element e of n-tile nt is
            // row g + 8 (e / 2), position p0 + 8 nt + 2 tq + e % 2).
            const bool inside = p0 >= all_lo && p0 + BN <= all_hi;
            int from[2], to[2];  // the rows' windows as columns of the tile
            float rel[2];        // p0 - the rows' positions
#pragma unroll
            for (int rr = 0; rr < 2; ++rr) {
                from[rr] = imin(imax(lo[rr] - p0, 0), BN);
                to[rr] = imin(imax(hi[rr] - p0, 0), BN);
                rel[rr] = (float)(p0 - pos[rr]);
            }
#pragma unroll
            for (int nt = 0; nt < S::NT; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int rr = e >> 1, col = nt * 8 + 2 * tq + (e & 1);
                    float x = s[nt][e] * scale;
                    if (softcap > 0.0f) x = softcap * tanhf(x / softcap);
                    x = fmaf(slope[rr], rel[rr] + (float)col, x);
                    s[nt][e] = inside || (col >= from[rr] && col < to[rr]) ? x * KVRS_LOG2E : neg_inf;
                }
            }
            // The online softmax, per row.
#pragma unroll
            for (int rr = 0; rr < 2; ++rr) {
                float mx = m[rr];
#pragma unroll
                for (int nt = 0; nt < S::NT; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * rr], s[nt][2 * rr + 1]));
                mx = kvrs_group_max<4>(mx);
                const float mref = mx == neg_inf ? 0.0f : mx;
                const float f = exp2f(m[rr] - mref);
                m[rr] = mx;
                l[rr] *= f;
#pragma unroll
                for (int i = 0; i < S::OT; ++i) o[i][2 * rr] *= f, o[i][2 * rr + 1] *= f;
#pragma unroll
                for (int nt = 0; nt < S::NT; ++nt) {
                    s[nt][2 * rr] = exp2f(s[nt][2 * rr] - mref);
                    s[nt][2 * rr + 1] = exp2f(s[nt][2 * rr + 1] - mref);
                    l[rr] += s[nt][2 * rr] + s[nt][2 * rr + 1];
                }
            }
            // O += P V: P's k-step kp is S's n-tiles 2kp and 2kp + 1; V's rows are the B
            // operand's k (positions 16 kp .. + 15), transposed by ldmatrix.
#pragma unroll
            for (int kp = 0; kp < S::NT / 2; ++kp) {
                const uint32_t a[4] = {pack2<T>(s[2 * kp][0], s[2 * kp][1]), pack2<T>(s[2 * kp][2], s[2 * kp][3]),
                                       pack2<T>(s[2 * kp + 1][0], s[2 * kp + 1][1]),
                                       pack2<T>(s[2 * kp + 1][2], s[2 * kp + 1][3])};
#pragma unroll
                for (int dp = 0; dp < S::OT / 2; ++dp) {
                    uint32_t b[4];
                    kvrs_ldmatrix_x4_trans(b, vt + swizzled<HD>(kp * 16 + ((lane >> 3) & 1) * 8 + (lane & 7), 2 * dp + (lane >> 4)));
                    const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
                    kvrs_mma_m16n8k16<T>(o[2 * dp], a, b0);
                    kvrs_mma_m16n8k16<T>(o[2 * dp + 1], a, b1);
                }
            }
        }
        if (tid < BN) offs[(ti + 3) % 3][tid] = offset_of(ti + 3, tid, next_block);
        __syncthreads();
        issue(ti + 2);
    }
    kvrs_cp_async_wait<0>();

    // The rows' denominators summed over their four lanes; then the output (sinks added)
    // or, for a split, the partial state kvrs_attention_merge combines.
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) l[rr] = kvrs_group_sum<4>(l[rr]);
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        int t, h;
        if (!packed(warp * 16 + g + 8 * rr, t, h)) continue;
        if (pbase < 0) {
            const float f = finish_factor(m[rr], l[rr], sinks, h);
            T* dst = out + (rows[5 * (int64_t)(row0 + t)] * q_heads + h) * HD + 2 * tq;
#pragma unroll
            for (int i = 0; i < S::OT; ++i)
                *reinterpret_cast<uint32_t*>(dst + 8 * i) = pack2<T>(o[i][2 * rr] * f, o[i][2 * rr + 1] * f);
        } else {
            const int64_t entry = (pbase + t) * q_heads + h;
            float* dst = part_o + entry * HD + 2 * tq;
#pragma unroll
            for (int i = 0; i < S::OT; ++i) *reinterpret_cast<float2*>(dst + 8 * i) = make_float2(o[i][2 * rr], o[i][2 * rr + 1]);
            if (tq == 0) part_ml[2 * entry] = m[rr], part_ml[2 * entry + 1] = l[rr];
        }
    }
}

}  // namespace kvrs_device

// Tensor-core attention for f16 or bf16 pages and queries (named TN), head sizes 64, 128
// and 256: kvrs_paged_attention_mma_TN_dHD, 128 threads and MmaShape<HD>::SHARED_BYTES of
// dynamic shared memory per block.
#define KVRS_ATTENTION_MMA_HD(TN, T, HD)                                                                       \
    extern "C" __global__ void __launch_bounds__(128) kvrs_paged_attention_mma_##TN##_d##HD(                   \
        const T* q, int64_t q_tok, int64_t q_head, T* out, const T* cache, const int32_t* tables,              \
        const int64_t* rows, const int64_t* items, int q_heads, int group, float scale, float softcap,         \
        const float* sinks, const float* alibi, float* part_o, float* part_ml, int bs, int heads, int hnd,     \
        int hpb) {                                                                                             \
        paged_attention_mma<T, HD>(q, {q_tok, q_head}, out, cache, tables, rows, items, q_heads, group, scale, \
                                   softcap, sinks, alibi, part_o, part_ml, bs, heads, hnd, hpb);               \
    }
#define KVRS_ATTENTION_MMA(TN, T)      \
    KVRS_ATTENTION_MMA_HD(TN, T, 64)  \
    KVRS_ATTENTION_MMA_HD(TN, T, 128) \
    KVRS_ATTENTION_MMA_HD(TN, T, 256)
KVRS_ATTENTION_MMA(f16, __half)
KVRS_ATTENTION_MMA(bf16, __nv_bfloat16)
