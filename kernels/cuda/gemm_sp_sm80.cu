/*
 * gemm_sp_sm80 — the grouped GEMM of 2:4 sparse weights on the Sparse Tensor Cores (sm_80 and
 * newer, Hopper included): mma.sp m16n8k32 with the weights as the sparse A operand (M = output
 * features, K = input) and the tile's token rows as the dense B operand, so each CTA computes
 * C^T = W · X^T for its (expert, m-tile of tokens, n-tile of BW features). The weights arrive
 * compressed (moed_cuda.h: the kept values [n, k/2] and the metadata in fragment order), 0.5625 of
 * the dense bytes: at a few tokens an expert the GEMMs stream weights, so a deep cp.async pipeline
 * over values and metadata runs them at copy speed, and the fewer bytes are the gain.
 *
 * As in gemm_sm80.cu: the token rows are gathered in the load (16-byte chunks from X[token(row)],
 * or H[row] with no gather), rows past the expert's segment are zero-filled and never stored, and
 * every output element is one thread's fixed sequence of MMAs over K in order, whatever the tile's
 * other rows, so a token's result never depends on the batch it came in.
 *
 * A stage is BK = 128 of K: a weight row's 64 kept values (one 128-byte shared row, swizzled as
 * the dense kernel's), its 16 bytes of metadata (a uint2 a lane per 16 rows, as mma.sp takes it),
 * and each token row's 128 values as two 128-byte swizzled halves. Per 32 of K a warp issues, per
 * 16 features and 8 tokens, one mma.sp, whose A fragment is one ldmatrix.x4 of kept values and
 * whose B fragment one ldmatrix.x4 of the token rows.
 *
 * The epilogue: mma.sp leaves a thread two tokens of one feature (the accumulator's columns are
 * tokens); one shuffle with the lane four apart swaps halves so that it holds two adjacent features
 * of one token, which is what the dense epilogues take (moed_cuda_epilogue2). Warp tiles are 64
 * features aligned to 64, so SwiGLU's gate block and its up block (MOED_CUDA_GLU_BLOCK = 32
 * further) are in the same thread's registers.
 */
#include "gemm_common.cuh"
#include "launch.cuh"

#include "moed_dtype.h"
#include "moed_err.h"

#include <cuda_runtime.h>

#include <type_traits>

namespace
{

namespace ptx = moed::ptx;

constexpr int BK = 128;   /* K of a stage: a weight row's kept values fill one 128-byte row */
constexpr int KSTEP = 32; /* K of one mma.sp */
constexpr int WROWS = 64; /* features a warp: a SwiGLU gate block and its up block */
constexpr int BW = 128;   /* features a CTA (its n-tile) */
constexpr int WM = BW / WROWS;
constexpr int MI = WROWS / 16;            /* mma.sp row blocks a warp */
constexpr int W_STAGE = BW * 128;         /* kept values: BW rows of 128 bytes */
constexpr int META_STAGE = BW / 16 * 256; /* metadata: 64 words per 16 rows */
constexpr int META_WORDS_16x128 = 64;     /* per 16 rows and 128 of K */
static_assert(BW % WROWS == 0 && WROWS == 2 * MOED_CUDA_GLU_BLOCK, "SwiGLU: 64-feature warp tiles");
static_assert(BK / 2 * 2 == 128 && BK % (4 * KSTEP) == 0,
              "a stage: 128 bytes of kept values a row, whole uint2s of metadata");
static_assert(MOED_CUDA_PAD % BK == 0 && MOED_CUDA_PAD % BW == 0, "padded shapes need no edges");

template <int BM> __host__ __device__ constexpr int stage_bytes()
{
    return W_STAGE + META_STAGE + BM * 2 * 128; /* + the token rows' two 128-byte halves */
}

/* BM token rows a CTA in WN warps along them (WM = 2 along the features), STAGES deep. */
template <typename T, int BM, int WN, int STAGES, int EPI>
__global__ void __launch_bounds__(WM *WN * 32) gemm_sp_kernel(const moed_cuda_gemm g, int num_n)
{
    constexpr int THREADS = WM * WN * 32;
    constexpr int WTN = BM / WN, NI = WTN / 8; /* tokens a warp; 8-token mma columns */
    constexpr int STAGE = stage_bytes<BM>(), X_OFF = W_STAGE + META_STAGE;
    constexpr int W_CHUNKS = W_STAGE / 16 / THREADS, X_CHUNKS = BM * 16 / THREADS;
    constexpr int META_CHUNKS = META_STAGE / 16;
    static_assert(WTN % 8 == 0 && W_STAGE / 16 % THREADS == 0 && BM * 16 % THREADS == 0,
                  "load split");

    /* Started early as gemm_sm80.cu is (moed_cuda.h, MOED_CUDA_OVERLAP_*): with WEIGHTS the first
     * stages' weights load before the wait. */
    const bool weights_first = g.overlap == MOED_CUDA_OVERLAP_WEIGHTS;
    if (!weights_first) {
        ptx::griddep_wait();
        ptx::griddep_launch_dependents();
    }
    moed_cuda_tile t;
    if (!moed_cuda_tile_of(g, num_n, blockIdx.x, t)) return;

    extern __shared__ __align__(1024) uint8_t smem[];
    const uint32_t sbase = ptx::smem_addr(smem);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp % WM, wn = warp / WM;

    /* Token chunks: 16 a row (K 128 = two 128-byte halves), fixed shared offsets. */
    const T *x_src[X_CHUNKS];
    uint32_t x_dst[X_CHUNKS];
    int x_bytes[X_CHUNKS];
#pragma unroll
    for (int i = 0; i < X_CHUNKS; i++) {
        const int c = tid + i * THREADS, row = c >> 4, kc = c & 15;
        const int r = t.row0 + row;
        const bool ok = r < t.row_end;
        int64_t src = ok ? (g.a_rows ? g.a_rows[r] : r) : 0;
        if (src >= g.a_rows_total) src = 0; /* defensive: never read outside A */
        x_src[i] = static_cast<const T *>(g.a) + src * g.lda + kc * 8;
        x_dst[i] = X_OFF + (kc >> 3) * BM * 128 + moed_cuda_swz128(row, kc & 7);
        x_bytes[i] = ok ? 16 : 0;
    }
    const int kb_count = g.k / BK;
    const T *w_base =
        static_cast<const T *>(g.b) + t.e * g.b_estride + (int64_t)t.nt * BW * (g.k / 2);
    const uint32_t *m_base = g.b_meta + (int64_t)t.e * g.n * (g.k / 32) +
                             (int64_t)t.nt * (BW / 16) * kb_count * META_WORDS_16x128;

    auto load_x = [&](int stage, int kt) {
        const uint32_t sx = sbase + stage * STAGE;
#pragma unroll
        for (int i = 0; i < X_CHUNKS; i++)
            ptx::cp_async16(sx + x_dst[i], x_src[i] + kt * BK, x_bytes[i]);
    };
    auto load_w = [&](int stage, int kt) {
        const uint32_t sw = sbase + stage * STAGE;
#pragma unroll
        for (int i = 0; i < W_CHUNKS; i++) {
            const int c = tid + i * THREADS, row = c >> 3, kc = c & 7;
            ptx::cp_async16(sw + moed_cuda_swz128(row, kc),
                            w_base + (int64_t)row * (g.k / 2) + kt * (BK / 2) + kc * 8, 16);
        }
#pragma unroll
        for (int c = tid; c < META_CHUNKS; c += THREADS) { /* 16 chunks per 16 rows */
            const int rb = c >> 4, kc = c & 15;
            ptx::cp_async16(sw + W_STAGE + c * 16,
                            m_base + ((int64_t)rb * kb_count + kt) * META_WORDS_16x128 + kc * 4,
                            16);
        }
    };

    float acc[MI][NI][4];
#pragma unroll
    for (int mi = 0; mi < MI; mi++)
#pragma unroll
        for (int ni = 0; ni < NI; ni++)
#pragma unroll
            for (int j = 0; j < 4; j++) acc[mi][ni][j] = 0.0f;

    /* As gemm_sm80.cu: the prologue's weight stages join the first cp.async group. */
    if (weights_first) {
#pragma unroll
        for (int s = 0; s < STAGES - 1; s++)
            if (s < kb_count) load_w(s, s);
        ptx::griddep_wait();
        ptx::griddep_launch_dependents();
    }
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < kb_count) {
            load_x(s, s);
            if (!weights_first) load_w(s, s);
        }
        ptx::cp_async_commit();
    }

    for (int kt = 0; kt < kb_count; kt++) {
        ptx::cp_async_wait<STAGES - 2>();
        __syncthreads(); /* stage kt landed for everyone; stage kt-1 is free to refill */
        const int nk = kt + STAGES - 1;
        if (nk < kb_count) {
            load_x(nk % STAGES, nk);
            load_w(nk % STAGES, nk);
        }
        ptx::cp_async_commit();

        const uint32_t sw = sbase + (kt % STAGES) * STAGE, sx = sw + X_OFF;
        uint2 meta[MI]; /* .x: K steps 0, 1 of the stage (selectors 0, 1); .y: steps 2, 3 */
#pragma unroll
        for (int mi = 0; mi < MI; mi++)
            meta[mi] = *reinterpret_cast<const uint2 *>(smem + (kt % STAGES) * STAGE + W_STAGE +
                                                        ((wm * MI + mi) * 32 + lane) * 8);
#pragma unroll
        for (int ks = 0; ks < BK / KSTEP; ks++) {
            uint32_t af[MI][4], bf[NI][4];
#pragma unroll
            for (int mi = 0; mi < MI; mi++) {
                const int row = wm * WROWS + mi * 16 + (lane & 15);
                ptx::ldmatrix_x4(af[mi], sw + moed_cuda_swz128(row, 2 * ks + (lane >> 4)));
            }
#pragma unroll
            for (int ni = 0; ni < NI; ni++) {
                const int row = wn * WTN + ni * 8 + (lane & 7);
                ptx::ldmatrix_x4(bf[ni], sx + (ks >> 1) * BM * 128 +
                                             moed_cuda_swz128(row, 4 * (ks & 1) + (lane >> 3)));
            }
#pragma unroll
            for (int mi = 0; mi < MI; mi++) {
                const uint32_t e = ks < 2 ? meta[mi].x : meta[mi].y;
#pragma unroll
                for (int ni = 0; ni < NI; ni++) {
                    if (ks & 1)
                        ptx::mma_sp_m16n8k32<T, 1>(acc[mi][ni], af[mi], bf[ni], e);
                    else
                        ptx::mma_sp_m16n8k32<T, 0>(acc[mi][ni], af[mi], bf[ni], e);
                }
            }
        }
    }
    ptx::cp_async_wait<0>();

    /* Accumulator (mi, ni, j): feature wm*64 + mi*16 + lane/4 (+8 for j >= 2), token
     * wn*WTN + ni*8 + 2*(lane%4) (+1 for odd j). Lanes lane and lane^4 hold features f and f+1
     * (f even): the even one gives its odd-token value for the other's even-token one, leaving
     * each with features f, f+1 of token 2*(lane%4) + (lane/4 odd). Every lane shuffles before any
     * returns. */
    const int odd = (lane >> 2) & 1;
#pragma unroll
    for (int mi = 0; mi < MI; mi++)
#pragma unroll
        for (int ni = 0; ni < NI; ni++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                float &c0 = acc[mi][ni][2 * h], &c1 = acc[mi][ni][2 * h + 1];
                const float other = __shfl_xor_sync(0xffffffffu, odd ? c0 : c1, 4);
                if (odd)
                    c0 = other;
                else
                    c1 = other;
            }
    constexpr int MOUT = MI / 2; /* SwiGLU: gate row blocks mi < 2, their up blocks mi + 2 */
#pragma unroll
    for (int ni = 0; ni < NI; ni++) {
        const int r = t.row0 + wn * WTN + ni * 8 + 2 * (lane & 3) + odd;
        if (r >= t.row_end) continue;
#pragma unroll
        for (int mi = 0; mi < MI; mi++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int n = t.nt * BW + wm * WROWS + mi * 16 + ((lane >> 2) & ~1) + 8 * h;
                const float v0 = acc[mi][ni][2 * h], v1 = acc[mi][ni][2 * h + 1];
                if constexpr (EPI == MOED_CUDA_EPI_SWIGLU) {
                    if (mi < MOUT)
                        moed_cuda_epilogue2<T, EPI>(g, r, n, v0, v1, acc[mi + MOUT][ni][2 * h],
                                                    acc[mi + MOUT][ni][2 * h + 1]);
                } else {
                    moed_cuda_epilogue2<T, EPI>(g, r, n, v0, v1, 0.0f, 0.0f);
                }
            }
    }
}

template <typename T, int BM, int WN, int STAGES, int EPI>
int launch_epi(const moed_cuda_gemm *g, moed_cuda_stream s)
{
    constexpr int smem = STAGES * stage_bytes<BM>();
    static_assert(smem <= 163 * 1024, "fits an sm_80 CTA's shared memory");
    auto kern = gemm_sp_kernel<T, BM, WN, STAGES, EPI>;
    if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) !=
        cudaSuccess)
        return MOED_EDEVICE;
    const int num_n = g->n / BW;
    const int64_t ctas = (int64_t)num_n * g->max_tiles;
    if (ctas <= 0) return 0;
    if (ctas > 0x7fffffff) return MOED_EINVAL;
    return moed_cuda_launch(kern, { dim3((unsigned)ctas), dim3(WM * WN * 32), smem, 1 },
                            (cudaStream_t)s, g->overlap != MOED_CUDA_OVERLAP_NONE, *g, num_n);
}

template <typename T, int BM, int WN, int STAGES>
int launch(const moed_cuda_gemm *g, moed_cuda_stream s)
{
    return moed_cuda_epi_dispatch(
        g->epi, [&]<int EPI>() { return launch_epi<T, BM, WN, STAGES, EPI>(g, s); });
}

/* The shapes the table picks (tile_config.c): bm tokens a CTA, always BW = 128 features.
 *   bm  16: 2 warps (64 x 16 each), 5 stages of 22.5 KB: weight streaming, two CTAs an SM on
 *           Hopper, so about 150 KB of weights in flight an SM; 3 stages (three CTAs an SM) when
 *           K <= 1024, where CTAs are short-lived
 *   bm  32: 4 warps (64 x 16), 4 stages of 26.5 KB
 *   bm  64: 4 warps (64 x 32), 4 stages of 34.5 KB
 *   bm 128: 8 warps (64 x 32), 3 stages of 50.5 KB (compute-bound; mma.sync's ceiling) */
template <typename T> int dispatch(const moed_cuda_gemm *g, moed_cuda_stream s)
{
    switch (g->bm) {
    case 128:
        return launch<T, 128, 4, 3>(g, s);
    case 64:
        return launch<T, 64, 2, 4>(g, s);
    case 32:
        return launch<T, 32, 2, 4>(g, s);
    case 16: /* short K: a third CTA an SM beats a deeper pipeline */
        return g->k <= 1024 ? launch<T, 16, 1, 3>(g, s) : launch<T, 16, 1, 5>(g, s);
    }
    return MOED_EINVAL;
}

} // namespace

extern "C" int moed_cuda_gemm_sp_sm80(const moed_cuda_gemm *g, moed_cuda_stream s)
{
    if (!g->b_meta || g->n % BW || g->k % BK || g->a_scale || g->b_scale) return MOED_EINVAL;
    if (g->cdtype == MOED_BF16) return dispatch<__nv_bfloat16>(g, s);
    if (g->cdtype == MOED_F16) return dispatch<__half>(g, s);
    return MOED_EINVAL;
}
