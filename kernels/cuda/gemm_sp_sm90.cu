/*
 * gemm_sp_sm90 — the Hopper grouped GEMM of 2:4 sparse weights (sm_90a): wgmma.mma_async.sp with
 * the weights as the sparse A operand (M = output features, K = input) and the tile's token rows as
 * the dense B operand, C^T = W · X^T, on the skeleton of producer_sm90.cuh (persistent,
 * warp-specialised, its ring, walk and barriers). For large batches, where gemm_sp_sm80.cu's mma.sp
 * runs far below wgmma's rate on Hopper.
 *
 * A tile is BF = 256 features (weight rows) x BT = 128 token rows (bm 128), a stage BK = 128 of K:
 * the weights' 64 kept values a row (one 128-byte swizzled row, by TMA), their metadata (16 bytes a
 * row, in moed_cuda.h's layout: the one device format gemm_sp_sm80.cu reads too; by TMA, as a
 * matrix of a row of 256 bytes a K-stage for each 16-row block) and each token row's 128 values as
 * two 128-byte swizzled halves, gathered by the producer warpgroup with cp.async into the layout
 * the dense Hopper kernel gathers (zero-filled past the expert's rows), each thread's copies
 * arriving on the stage's barrier once landed, so that every stage is in flight as with TMA (the
 * dense kernels' producer signals a stage behind: docs/kernels-notes.md, "2:4 sparse experts on
 * wgmma.sp", says why they differ), or, when they are in order (the down GEMM's H rows, or rows the
 * table had pre-permuted), by TMA as two boxes of BT rows: rows past the expert's are then the next
 * expert's (or TMA's zeros), and, being other token columns of the product, never stored. In
 * clusters of two (tile_config.c) the two CTAs' m-tiles share the weight tile by multicast, as in
 * gemm_sm90.cu. The last n-tile may be half a tile (n a multiple of 128, not 256: the down GEMM of
 * d 2880): its rows past n are computed from whatever follows them (or TMA's zeros) and never
 * stored.
 *
 * The SwiGLU pairing without leaving registers: wgmma's 64 rows are 8 groups of 8, and a warp's
 * accumulators hold groups 2w and 2w+1. Each wgmma.sp here reads every fourth 8-row group of the
 * stage (descriptor stride SLICE_SBO), starting at group o (o = 0..3, two for each consumer): its
 * group 2w is the stage's group o + 8w (gate rows of the 64-row block w) and group 2w+1 the stage's
 * group o + 8w + 4, 32 rows on: the matching up rows (MOED_CUDA_GLU_BLOCK = 32). So a thread holds
 * a gate feature and its up feature for the same tokens, as gemm_sp_sm80.cu's threads do. The
 * metadata word of such a thread takes its gate row's half-word and its up row's from the two
 * 16-row blocks 32 rows apart (one byte permute).
 *
 * The epilogue is gemm_sp_sm80.cu's: the accumulators of one wgmma row block are laid out as
 * mma.sp's (a thread: two tokens of one feature), one shuffle with lane ^ 4 gives a thread two
 * adjacent features of one token, and moed_cuda_epilogue2 writes them. Each output element is one
 * thread's fixed sequence of K-steps of 32 in order, whatever the tile's other rows, so a token's
 * result never depends on its batch; and it is the same sequence and epilogue as gemm_sp_sm80.cu's,
 * so the two kernels give a token the same bits (measured: docs/kernels-notes.md, "2:4 sparse
 * experts on wgmma.sp"), and the table may switch between them by batch size.
 */
#include "producer_sm90.cuh"

#include "moed_dtype.h"
#include "moed_err.h"

namespace
{

namespace ptx = moed::ptx;

/* ---- the tile, the warpgroups and their budgets --------------------------------------------- */

constexpr int BF = 256;       /* features (weight rows) a tile */
constexpr int BT = 128;       /* token rows a tile: bm, and wgmma's N */
constexpr int BK = 128;       /* K of a stage: a weight row's 64 kept values, one 128-byte row */
constexpr int KSTEP = 32;     /* K of one wgmma.sp */
constexpr int STAGES = 3;     /* 68 KiB a stage */
constexpr int CONSUMERS = 2;  /* consumer warpgroups, after the one producer */
constexpr int WGMMA_M = 64;   /* the instruction's rows */
constexpr int GROUP_ROWS = 8; /* rows of a 128-byte swizzle atom */
constexpr int SLICES = BF / WGMMA_M; /* wgmma.sp a K-step, each every SLICES-th 8-row group */
constexpr int PER_CONSUMER = SLICES / CONSUMERS;
constexpr uint32_t SLICE_SBO = SLICES * ptx::sw128_atom_bytes; /* a slice's group stride */
constexpr int META_BLOCK_BYTES = 256; /* metadata of 16 rows and 128 of K: a uint2 a lane */
constexpr int WORDS = 2;              /* metadata words a lane a stage: two K-steps each */
constexpr int ELEM = MOED_CUDA_CSIZE;
static_assert(PER_CONSUMER * CONSUMERS == SLICES && SLICE_SBO % ptx::sw128_atom_bytes == 0,
              "each consumer its slices, each slice every SLICES-th swizzle atom");
static_assert(SLICES * GROUP_ROWS == MOED_CUDA_GLU_BLOCK,
              "a slice's second row group of a warp is its first's up block");
static_assert(BF % (2 * MOED_CUDA_GLU_BLOCK) == 0 && SLICES % CONSUMERS == 0, "whole slices");
static_assert(BK / 2 * ELEM == (int)ptx::sw128_row_bytes, "a stage's kept values: one row");
static_assert(BK % KSTEP == 0 && BK / KSTEP == 2 * WORDS, "four K-steps a stage: two words");
static_assert(MOED_CUDA_PAD % BK == 0, "padded shapes need no K edges");

/* A consumer holds PER_CONSUMER * BT/2 fp32 accumulators (128) plus the epilogue's temporaries. */
constexpr int CONSUMER_REGS = 224;
static_assert(moed::ptx::valid_maxnreg<CONSUMER_REGS> &&
                  moed_cuda_sm90_regs_fit(CONSUMERS, CONSUMER_REGS),
              "the register budgets exceed the register file");

/* The ring of producer_sm90.cuh with its "A" rows the token rows' two 128-byte halves (2 * BT rows
 * of 128 bytes) and its "B" rows the weights' kept values (BF rows), no epilogue staging; then the
 * metadata of each stage (BF/16 blocks of META_BLOCK_BYTES). */
template <typename T, int MC>
struct sp_ring : moed_cuda_sm90_ring<T, 2 * BT, BF, STAGES, CONSUMERS, false, MC> {
    using base_ring = moed_cuda_sm90_ring<T, 2 * BT, BF, STAGES, CONSUMERS, false, MC>;
    static constexpr int META_STAGE = BF / 16 * META_BLOCK_BYTES;
    /* TMA writes shared memory from 128-byte aligned addresses */
    static constexpr int META_AT = (base_ring::END + 127) / 128 * 128;
    static constexpr int BYTES = base_ring::ALIGN + META_AT + STAGES * META_STAGE;
    static_assert(META_STAGE % 128 == 0, "each stage's metadata on a TMA alignment");
    static_assert(BYTES <= MOED_CUDA_SM90_SMEM,
                  "over the 227 KiB of shared memory a Hopper block may have");

    uint32_t meta;
    __device__ __forceinline__ explicit sp_ring(const uint8_t *smem)
        : base_ring(smem), meta(this->base + META_AT)
    {
    }
    __device__ __forceinline__ uint32_t meta_at(int s) const
    {
        return meta + s * META_STAGE;
    }
    /* The token rows' half h (K 64h .. 64h+63 of the stage) of stage s. */
    __device__ __forceinline__ uint32_t x_at(int s, int h) const
    {
        return this->a_at(s) + h * BT * (int)ptx::sw128_row_bytes;
    }
};
constexpr int THREADS = sp_ring<__nv_bfloat16, 1>::THREADS;

/* ---- the producer ---------------------------------------------------------------------------- */

/* Warpgroup 0: one thread brings each stage's kept values by TMA (in a cluster whose m-tiles are
 * of one expert, BF/MC rows of them, multicast to every CTA of it, as producer_sm90.cuh does) and
 * its metadata by TMA (rows past n: the next expert's, or TMA's zeros; their features are never
 * stored); without GATHER it brings the token rows by TMA too and the others return; with GATHER
 * every thread gathers its chunks of the token rows (chunk kc of both halves of rows tid/8 + 16i)
 * with cp.async, whose completion arrives on the stage's barrier (cp_async_mbar_arrive): no thread
 * waits for its copies, so every stage of the ring is in flight, as with TMA; the consumers fence
 * the proxies after their wait. */
template <class R, bool GATHER>
__device__ __forceinline__ void
produce(const R &rg, const moed_cuda_gemm &g, const CUtensorMap *tm_w, const CUtensorMap *tm_x,
        const CUtensorMap *tm_m, moed_cuda_sm90_walk<R::MC> &w, int ktiles, int tid)
{
    using E = typename R::elem;
    constexpr int MC = R::MC;
    constexpr int CHUNK = MOED_CUDA_SM90_CHUNK;
    constexpr int ROWS_PER_PASS = MOED_CUDA_SM90_ROWS_PER_PASS, PASSES = BT / ROWS_PER_PASS;
    constexpr int META_WORDS = META_BLOCK_BYTES / 4;
    static_assert(BT % ROWS_PER_PASS == 0, "whole gather passes");

    ptx::setmaxnreg_dec<MOED_CUDA_SM90_PRODUCER_REGS>();
    if (!GATHER && tid != 0) return; /* TMA alone: one thread issues everything */
    const int kc = tid & (MOED_CUDA_SM90_ROW_CHUNKS - 1);
    const int row_in_pass = tid >> MOED_CUDA_SM90_CHUNK_SHIFT;
    int it = 0;
    while (w.have) {
        int src[GATHER ? PASSES : 1];
        if constexpr (GATHER) {
#pragma unroll
            for (int i = 0; i < PASSES; i++)
                src[i] =
                    moed_cuda_sm90_a_source(g, w.cur, w.cur.row0 + row_in_pass + ROWS_PER_PASS * i);
        }
        const int w_row = w.cur.e * g.n + w.cur.nt * BF;
        for (int kt = 0; kt < ktiles; kt++, it++) {
            const int s = it % STAGES;
            rg.wait_empty(it);
            if (tid == 0) {
                ptx::mbar_arrive_expect_tx(rg.full_at(s),
                                           R::B_STAGE + R::META_STAGE + (GATHER ? 0 : R::A_STAGE));
                ptx::tma_load_2d(rg.meta_at(s), tm_m, rg.full_at(s), kt * META_WORDS, w_row / 16);
                if (MC == 1 || !w.cur.shared_b) /* the whole tile, for this CTA alone */
                    for (int j = 0; j < MC; j++)
                        ptx::tma_load_2d(rg.b_at(s) + j * R::B_SLICE, tm_w, rg.full_at(s),
                                         kt * (BK / 2), w_row + j * (BF / MC));
                else
                    ptx::tma_load_2d_multicast(rg.b_at(s) + rg.rank * R::B_SLICE, tm_w,
                                               rg.full_at(s), kt * (BK / 2),
                                               w_row + rg.rank * (BF / MC), (1u << MC) - 1);
                if constexpr (!GATHER)
#pragma unroll
                    for (int h = 0; h < 2; h++)
                        ptx::tma_load_2d(rg.x_at(s, h), tm_x, rg.full_at(s), kt * BK + h * (BK / 2),
                                         w.cur.row0);
            }
            const E *a = static_cast<const E *>(g.a) + kt * BK + kc * (CHUNK / ELEM);
#pragma unroll
            for (int i = 0; i < (GATHER ? PASSES : 0); i++) {
                const int row = row_in_pass + ROWS_PER_PASS * i;
                const E *src_row = a + (int64_t)(src[i] < 0 ? 0 : src[i]) * g.lda;
#pragma unroll
                for (int h = 0; h < 2; h++)
                    ptx::cp_async16(rg.x_at(s, h) + moed_cuda_swz128(row, kc),
                                    src_row + h * (BK / 2), src[i] < 0 ? 0 : CHUNK);
            }
            if constexpr (GATHER) ptx::cp_async_mbar_arrive(rg.full_at(s));
            if (kt == 0) w.fetch_next();
        }
        w.advance();
    }
    if constexpr (GATHER) { /* no thread leaves copies in flight */
        ptx::cp_async_commit();
        ptx::cp_async_wait<0>();
    }
    /* The CTA must outlive the other CTAs' arrivals on its barriers: wait until the last use of
     * every stage has been released by the whole cluster. */
    if (MC > 1 && tid == 0)
        for (int j = 0; j < STAGES; j++, it++) rg.wait_empty(it);
}

/* ---- the epilogue's transpose ---------------------------------------------------------------- */

/* Among the four lanes q = lane / 8 = 0..3 of the same lane % 8, slot k of lane q (a 32-bit word
 * of item k, piece q) becomes piece k of item q: after two exchanges, with the lanes 8 apart (q's
 * bit 0) and 16 apart (bit 1), each swapping the slots whose bit differs from the lane's, lane q
 * holds item q's four pieces in order. Selects, not indexing by q, keep v in registers. */
__device__ __forceinline__ void transpose4(uint32_t (&v)[4], int q)
{
#pragma unroll
    for (int bit = 0; bit < 2; bit++) {
        const int m = 1 << bit;
        const bool up = q & m;
#pragma unroll
        for (int j = 0; j < 2; j++) {
            /* the slot pair (lo, lo | m) of this exchange: the lane sends the one whose bit
             * differs from its own and takes the partner's other in its place */
            const int lo = bit == 0 ? 2 * j : j;
            const uint32_t got = __shfl_xor_sync(0xffffffffu, up ? v[lo] : v[lo | m], 8 * m);
            if (up)
                v[lo] = got;
            else
                v[lo | m] = got;
        }
    }
}

/* ---- the kernel ------------------------------------------------------------------------------ */

template <typename T, int EPI, int MC, bool GATHER>
__global__ void __launch_bounds__(THREADS, 1)
    gemm_sp_sm90_kernel(const __grid_constant__ CUtensorMap tm_w,
                        const __grid_constant__ CUtensorMap tm_x,
                        const __grid_constant__ CUtensorMap tm_m, const moed_cuda_gemm g, int num_n,
                        int total)
{
#ifdef MOED_CUDA_SM90A
    using R = sp_ring<T, MC>;
    static_assert(sizeof(T) == ELEM, "two-byte elements");
    constexpr int NACC = WGMMA_M * BT / MOED_CUDA_SM90_WG; /* fp32 accumulators a wgmma a thread */

    extern __shared__ uint8_t smem_raw[];
    R rg(smem_raw);
    const int tid = threadIdx.x, wg = tid >> MOED_CUDA_SM90_WG_SHIFT;
    const int ktiles = g.k / BK;
    rg.template init<GATHER>(tid);

    moed_cuda_sm90_walk<MC> w(g, num_n, total, rg.rank);
    if (wg == 0) {
        produce<R, GATHER>(rg, g, &tm_w, &tm_x, &tm_m, w, ktiles, tid);
        return;
    }

    ptx::setmaxnreg_inc<CONSUMER_REGS>();
    const int cw = wg - 1; /* this consumer's slices: o = PER_CONSUMER*cw .. */
    const int lane = tid & (MOED_CUDA_SM90_WARP - 1);
    const int wq = (tid >> MOED_CUDA_SM90_WARP_SHIFT) & (MOED_CUDA_SM90_WG_WARPS - 1);
    /* The 16-row metadata blocks of this warp's gate rows (8(o + 8wq) + lane/4 for both its
     * slices) and of their up rows, two blocks on. */
    const int meta_gate = (cw * PER_CONSUMER + SLICES * 2 * wq) / 2;
    const int meta_up = meta_gate + MOED_CUDA_GLU_BLOCK / 16;
    uint8_t *const meta_p = smem_raw + (rg.meta - ptx::smem_addr(smem_raw));
    int it = 0; /* k-steps across tiles, as the producer counts them */
    while (w.have) {
        float acc[PER_CONSUMER][NACC];
#pragma unroll
        for (int oo = 0; oo < PER_CONSUMER; oo++)
#pragma unroll
            for (int i = 0; i < NACC; i++) acc[oo][i] = 0.0f;
        /* One k-step: its metadata words into e (every word before the first wgmma.sp, since an
         * asynchronous wgmma.sp reads its metadata register in flight), then its wgmma.sp group. */
        auto kstep = [&](int kt, uint32_t(&e)[WORDS][PER_CONSUMER]) {
            const int s = it % STAGES;
            rg.template wait_full<GATHER ? MOED_CUDA_GATHER_ARRIVE : MOED_CUDA_GATHER_LAG_TILE>(it);
            const uint2 *ms = reinterpret_cast<const uint2 *>(meta_p + s * R::META_STAGE);
            const uint2 mg = ms[meta_gate * MOED_CUDA_SM90_WARP + lane];
            const uint2 mu = ms[meta_up * MOED_CUDA_SM90_WARP + lane];
            /* Word j holds K-steps 2j and 2j+1 (selectors 0 and 1, so one word serves both); of
             * its halves the low one is rows 0-7 of the block, the high one rows 8-15. Slice o's
             * gate rows are the low half for even o, the high for odd. */
#pragma unroll
            for (int oo = 0; oo < PER_CONSUMER; oo++) {
                const uint32_t sel = ((cw * PER_CONSUMER + oo) & 1) ? 0x7632 : 0x5410;
                e[0][oo] = __byte_perm(mg.x, mu.x, sel);
                e[1][oo] = __byte_perm(mg.y, mu.y, sel);
            }
#pragma unroll
            for (int oo = 0; oo < PER_CONSUMER; oo++) ptx::wgmma_fence_operands(acc[oo]);
            ptx::wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < BK / KSTEP; ks++) {
                const uint64_t db =
                    ptx::wgmma_desc_sw128(rg.x_at(s, ks >> 1) + (ks & 1) * KSTEP * ELEM);
#pragma unroll
                for (int oo = 0; oo < PER_CONSUMER; oo++) {
                    const uint64_t da = ptx::wgmma_desc_sw128_sbo(
                        rg.b_at(s) + (cw * PER_CONSUMER + oo) * ptx::sw128_atom_bytes +
                            ks * (KSTEP / 2) * ELEM,
                        SLICE_SBO);
                    if (ks & 1)
                        ptx::wgmma_sp_m64k32<T, BT, 1>(acc[oo], da, db, e[ks >> 1][oo]);
                    else
                        ptx::wgmma_sp_m64k32<T, BT, 0>(acc[oo], da, db, e[ks >> 1][oo]);
                }
            }
            ptx::wgmma_commit();
            if (kt == 0) w.fetch_next();
            ptx::wgmma_wait<1>();
#pragma unroll
            for (int oo = 0; oo < PER_CONSUMER; oo++) ptx::wgmma_fence_operands(acc[oo]);
            if (kt > 0) rg.release((it - 1) % STAGES, lane);
            it++;
        };
        /* Two sets of metadata words, alternating: a k-step's group may still run while the next
         * one's words are written. */
        uint32_t e0[WORDS][PER_CONSUMER], e1[WORDS][PER_CONSUMER];
        int kt = 0;
        for (; kt + 1 < ktiles; kt += 2) {
            kstep(kt, e0);
            kstep(kt + 1, e1);
        }
        if (kt < ktiles) kstep(kt, e0);
        ptx::wgmma_wait<0>();
#pragma unroll
        for (int oo = 0; oo < PER_CONSUMER; oo++) ptx::wgmma_fence_operands(acc[oo]);
        if (ktiles > 0) rg.release((it - 1) % STAGES, lane); /* the producer may refill it now */

        /* Accumulator (oo, 4*c8 + 2h + j): feature 8(o + 8wq + 4h) + lane/4 of the tile (h = 1:
         * the up row of h = 0's gate row), token 8*c8 + 2*(lane%4) + j. The shuffle of
         * gemm_sp_sm80.cu: lanes lane and lane^4 swap so that each holds features f, f+1 (f even)
         * of token 8*c8 + 2*(lane%4) + (lane/4 odd). Every lane shuffles before any returns. */
        const int odd = (lane >> 2) & 1;
#pragma unroll
        for (int oo = 0; oo < PER_CONSUMER; oo++)
#pragma unroll
            for (int p = 0; p < NACC / 2; p++) {
                float &c0 = acc[oo][2 * p], &c1 = acc[oo][2 * p + 1];
                const float other = __shfl_xor_sync(0xffffffffu, odd ? c0 : c1, 4);
                if (odd)
                    c0 = other;
                else
                    c1 = other;
            }
        /* Then the epilogue's values, packed as stored, are moved so that a lane holds 16 bytes
         * of one token: the four lanes 8 apart (q = lane / 8) hold features 2q, 2q+1 of the same
         * token for each (c8, oo); in groups of c8 pairs, they transpose (transpose4) so that lane
         * q holds all eight features of (c8 = 2g8 + q/2, oo = q%2), and lanes q and q^1 the two
         * halves of 16 consecutive features (slices o and o + 1 are adjacent 8-row groups): each
         * store instruction writes whole 32-byte sectors, where pairs of features wrote halves
         * (docs/kernels-notes.md, "2:4 sparse experts on wgmma.sp"). */
        static_assert(PER_CONSUMER == 2, "a lane pair's 32 bytes are its consumer's two slices");
        const int q = lane >> 3;
        const moed_cuda_tile &t = w.cur;
        T *const c = static_cast<T *>(g.c);
#pragma unroll
        for (int g8 = 0; g8 < BT / 16; g8++)
#pragma unroll
            for (int h = 0; h < (EPI == MOED_CUDA_EPI_SWIGLU ? 1 : 2); h++) {
                uint32_t v[4]; /* slot k: (c8 = 2g8 + k/2, oo = k%2) */
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    const float *a = acc[k & 1] + 4 * (2 * g8 + (k >> 1));
                    v[k] = moed_cuda_epilogue_pack2<T, EPI>(a[2 * h], a[2 * h + 1], a[2], a[3]);
                }
                transpose4(v, q);
                const int r = t.row0 + 8 * (2 * g8 + (q >> 1)) + 2 * (lane & 3) + odd;
                const int n = t.nt * BF + GROUP_ROWS * (cw * PER_CONSUMER + (q & 1) +
                                                        2 * SLICES * wq + SLICES * h);
                if (r < t.row_end && n < g.n) /* rows of the tile, none past n (a half tile) */
                    *reinterpret_cast<uint4 *>(c + (int64_t)r * g.ldc +
                                               moed_cuda_epilogue_col<EPI>(n)) =
                        make_uint4(v[0], v[1], v[2], v[3]);
            }
        w.advance();
    }
#endif
}

/* The token rows come by TMA when they are in order (no a_rows), else gathered (GATHER). */
template <typename T, int EPI, int MC, bool GATHER>
int launch(const moed_cuda_gemm *g, moed_cuda_stream s)
{
    using R = sp_ring<T, MC>;
    constexpr auto kern = gemm_sp_sm90_kernel<T, EPI, MC, GATHER>;
    const int tm = g->cdtype == MOED_BF16 ? MOED_CUDA_TM_BF16 : MOED_CUDA_TM_F16;
    CUtensorMap tm_w, tm_x, tm_m;
    int rc = moed_cuda_tensor_map(&tm_w, tm, g->b, (int64_t)g->b_experts * g->n, g->k / 2, g->k / 2,
                                  BK / 2, BF / MC, 1);
    /* the metadata as [16-row blocks][K-stages x 64 words], each read as a box of a stage's 64
     * words of the tile's BF/16 blocks (the words are copied as they are) */
    const int64_t meta_cols = (int64_t)(g->k / BK) * (META_BLOCK_BYTES / 4);
    if (!rc)
        rc = moed_cuda_tensor_map(&tm_m, MOED_CUDA_TM_F32, g->b_meta,
                                  (int64_t)g->b_experts * g->n / 16, meta_cols, meta_cols,
                                  META_BLOCK_BYTES / 4, BF / 16, 0);
    if (rc) return rc;
    if (GATHER)
        tm_x = tm_w; /* not read */
    else if ((rc = moed_cuda_tensor_map(&tm_x, tm, g->a, g->a_rows_total, g->k, g->lda, BK / 2, BT,
                                        1)))
        return rc;
    if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, R::BYTES) !=
        cudaSuccess)
        return MOED_EDEVICE;
    const int num_n = (g->n + BF - 1) / BF;
    const int64_t units = (int64_t)num_n * ((g->max_tiles + MC - 1) / MC);
    if (units <= 0) return 0;
    if (units > 0x7fffffff) return MOED_EINVAL;
    moed_cuda_shape sh = { dim3(), dim3(R::THREADS), (size_t)R::BYTES, MC };
    const int resident = moed_cuda_resident_clusters<kern>(sh);
    sh.grid = dim3((unsigned)((units < resident ? units : resident) * MC));
    return moed_cuda_launch(kern, sh, (cudaStream_t)s, false, tm_w, tm_x, tm_m, *g, num_n,
                            (int)units);
}

template <typename T> int dispatch(const moed_cuda_gemm *g, int cluster, moed_cuda_stream s)
{
    const bool gather = g->a_rows != nullptr;
    return moed_cuda_epi_dispatch(g->epi, [&]<int EPI>() -> int {
        if constexpr (EPI == MOED_CUDA_EPI_STORE) { /* the down GEMM: H rows in order */
            if (gather) return MOED_EINVAL;
            return cluster == 2 ? launch<T, EPI, 2, false>(g, s) : launch<T, EPI, 1, false>(g, s);
        } else {
            if (gather)
                return cluster == 2 ? launch<T, EPI, 2, true>(g, s) : launch<T, EPI, 1, true>(g, s);
            return cluster == 2 ? launch<T, EPI, 2, false>(g, s) : launch<T, EPI, 1, false>(g, s);
        }
    });
}

} // namespace

extern "C" int moed_cuda_gemm_sp_sm90(const moed_cuda_gemm *g, int cluster, moed_cuda_stream s)
{
    /* n a multiple of 128: a half last tile, except for SwiGLU (n_up a multiple of 256) */
    if (!g->b_meta || g->bm != BT || (uintptr_t)g->a % 16 || g->n % (BF / 2) ||
        (g->epi == MOED_CUDA_EPI_SWIGLU && g->n % BF) || g->k % BK || g->lda % 8 || g->a_scale ||
        g->b_scale || g->b_estride != (int64_t)g->n * (g->k / 2) ||
        (cluster != 1 && cluster != 2) || (uintptr_t)g->c % 16 ||
        g->ldc % 8) /* the epilogue's 16-byte stores */
        return MOED_EINVAL;
    if (g->cdtype == MOED_BF16) return dispatch<__nv_bfloat16>(g, cluster, s);
    if (g->cdtype == MOED_F16) return dispatch<__half>(g, cluster, s);
    return MOED_EINVAL;
}
