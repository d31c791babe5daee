/*
 * router — the server router's logits on the GPU: logits [T, E] float32 = x [T, d] · W [E, d]^T,
 * with x in the request's dtype and W in the checkpoint's (f32, f16 or bf16 each), both read as
 * stored and widened to float32 exactly: neither is rounded to the compute type first, so experts
 * whose logits nearly tie are ordered as the model orders them.
 *
 * Each logit is one chain of fused multiply-adds over k = 0 .. d-1 starting from 0: the operations,
 * in the order, of the CPU backend's AVX2 kernel, so the two backends' logits are bit-identical and
 * the shared gating picks the same experts on both. Tensor Cores cannot keep that order, hence a
 * plain SIMT GEMM: a CTA of THREADS threads computes a BM x BN block of logits, staging BK columns
 * of k at a time in shared memory (widened on the way in, transposed so that a thread reads its TM
 * rows and TN experts as float4s), every thread TM x TN logits in registers; the next BK columns
 * are loaded into registers while the current ones are multiplied. Threads whose logits are all
 * past T or E skip the multiply (with a thread's rows fastest, whole warps fall past a small E).
 * Two shapes: 128 x 64 blocks of 8 x 8 per thread when there are blocks for every SM, 16 x 64 of
 * 2 x 4 otherwise, so that small batches still spread over the GPU.
 */
#include "dtype.cuh"
#include "moed_cuda.h"

#include <cuda_runtime.h>

namespace
{

constexpr int THREADS = 128, BK = 16, PAD = 4; /* PAD keeps float4 rows and breaks bank strides */

template <int BM_, int BN_, int TM_, int TN_> struct shape {
    static constexpr int BM = BM_, BN = BN_, TM = TM_, TN = TN_;
    static constexpr int ROW_THREADS = BM / TM; /* a thread's rows vary fastest within a warp */
    static constexpr int X_PER_THREAD = BM * BK / THREADS, W_PER_THREAD = BN * BK / THREADS;
    static_assert(ROW_THREADS * (BN / TN) == THREADS, "one TM x TN tile per thread");
    static_assert(TM % 4 == 0 || TM == 2, "float4 (or float2) reads of a thread's rows");
    static_assert(TN % 4 == 0, "float4 reads of a thread's experts");
    static_assert(BM * BK % THREADS == 0 && BN * BK % THREADS == 0, "the loads' split");
};
using tall = shape<128, 64, 8, 8>;
using flat = shape<16, 64, 2, 4>;

/* TM (or TN) consecutive floats of a shared row, as wide loads. */
template <int N> __device__ __forceinline__ void read_row(float (&v)[N], const float *p)
{
    if constexpr (N == 2) {
        const float2 q = *reinterpret_cast<const float2 *>(p);
        v[0] = q.x;
        v[1] = q.y;
    } else {
#pragma unroll
        for (int i = 0; i < N; i += 4) {
            const float4 q = *reinterpret_cast<const float4 *>(p + i);
            v[i] = q.x;
            v[i + 1] = q.y;
            v[i + 2] = q.z;
            v[i + 3] = q.w;
        }
    }
}

/* acc[i][j] = fma(x[k][i], w[k][j], acc[i][j]) for k = 0 .. kn-1, in that order. */
template <typename S, int KN>
__device__ __forceinline__ void multiply(float (&acc)[S::TM][S::TN], const float *xs,
                                         const float *ws, int kn)
{
#pragma unroll(KN ? KN : 1)
    for (int k = 0; k < (KN ? KN : kn); k++) {
        float a[S::TM], b[S::TN];
        read_row(a, xs + k * (S::BM + PAD));
        read_row(b, ws + k * (S::BN + PAD));
#pragma unroll
        for (int i = 0; i < S::TM; i++)
#pragma unroll
            for (int j = 0; j < S::TN; j++) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
}

/* Element e of a BK-wide slice [rows, BK] of a row-major [n, ld] matrix starting at (r0, k0), or
 * zero past its rows or columns. */
template <typename T>
__device__ __forceinline__ T load_elem(const T *m, int64_t n, int ld, int64_t r0, int k0, int e)
{
    const int64_t r = r0 + (unsigned)e / BK;
    const int k = k0 + (int)((unsigned)e % BK);
    return r < n && k < ld ? m[r * ld + k] : moed_cuda_from_f32<T>(0.0f);
}

template <typename S, typename TX, typename TW>
__global__ void __launch_bounds__(THREADS)
    router_kernel(const TX *x, int64_t T, int d, const TW *w, int E, float *logits)
{
    __shared__ __align__(16) float xs[BK * (S::BM + PAD)]; /* [k][row] */
    __shared__ __align__(16) float ws[BK * (S::BN + PAD)]; /* [k][expert] */
    const int tid = threadIdx.x;
    const int ty = tid % S::ROW_THREADS, tx = tid / S::ROW_THREADS;
    const int64_t m0 = (int64_t)blockIdx.y * S::BM;
    const int n0 = blockIdx.x * S::BN;
    const bool live = m0 + ty * S::TM < T && n0 + tx * S::TN < E;

    TX xr[S::X_PER_THREAD];
    TW wr[S::W_PER_THREAD];
    auto fetch = [&](int k0) {
#pragma unroll
        for (int i = 0; i < S::X_PER_THREAD; i++)
            xr[i] = load_elem(x, T, d, m0, k0, tid + i * THREADS);
#pragma unroll
        for (int i = 0; i < S::W_PER_THREAD; i++)
            wr[i] = load_elem(w, E, d, n0, k0, tid + i * THREADS);
    };

    float acc[S::TM][S::TN];
#pragma unroll
    for (int i = 0; i < S::TM; i++)
#pragma unroll
        for (int j = 0; j < S::TN; j++) acc[i][j] = 0.0f;

    fetch(0);
    for (int k0 = 0; k0 < d; k0 += BK) {
#pragma unroll
        for (int i = 0; i < S::X_PER_THREAD; i++) {
            const int e = tid + i * THREADS;
            xs[(e % BK) * (S::BM + PAD) + e / BK] = moed_cuda_to_f32(xr[i]);
        }
#pragma unroll
        for (int i = 0; i < S::W_PER_THREAD; i++) {
            const int e = tid + i * THREADS;
            ws[(e % BK) * (S::BN + PAD) + e / BK] = moed_cuda_to_f32(wr[i]);
        }
        __syncthreads();
        if (k0 + BK < d) fetch(k0 + BK); /* in flight while this slice is multiplied */
        const int kn = d - k0 < BK ? d - k0 : BK;
        if (live) { /* the padding columns past d are never multiplied: the chain stays d long */
            const float *xt = xs + ty * S::TM, *wt = ws + tx * S::TN;
            if (kn == BK)
                multiply<S, BK>(acc, xt, wt, BK);
            else
                multiply<S, 0>(acc, xt, wt, kn);
        }
        __syncthreads();
    }

#pragma unroll
    for (int i = 0; i < S::TM; i++) {
        const int64_t r = m0 + ty * S::TM + i;
        if (r >= T) break;
#pragma unroll
        for (int j = 0; j < S::TN; j++) {
            const int e = n0 + tx * S::TN + j;
            if (e < E) logits[r * E + e] = acc[i][j];
        }
    }
}

template <typename S, typename TX, typename TW>
int launch(const void *x, int64_t T, int d, const void *w, int E, float *logits, cudaStream_t s)
{
    const dim3 grid((unsigned)((E + S::BN - 1) / S::BN), (unsigned)((T + S::BM - 1) / S::BM));
    if (grid.y > 65535) return MOED_EINVAL;
    router_kernel<S, TX, TW>
        <<<grid, THREADS, 0, s>>>((const TX *)x, T, d, (const TW *)w, E, logits);
    return cudaGetLastError() == cudaSuccess ? 0 : MOED_EDEVICE;
}

} // namespace

extern "C" int moed_cuda_router_logits(const void *x, int xdtype, int64_t T, int d, const void *w,
                                       int wdtype, int E, float *logits, moed_cuda_stream s)
{
    if (T <= 0 || E <= 0) return 0;
    if (d <= 0) return MOED_EINVAL;
    int dev = 0, sms = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    const int64_t tall_blocks = (T + tall::BM - 1) / tall::BM * ((E + tall::BN - 1) / tall::BN);
    const bool use_tall = tall_blocks >= sms;
    cudaStream_t st = (cudaStream_t)s;
    return moed_cuda_float_dispatch(xdtype, [&]<typename TX>() {
        return moed_cuda_float_dispatch(wdtype, [&]<typename TW>() {
            return use_tall ? launch<tall, TX, TW>(x, T, d, w, E, logits, st)
                            : launch<flat, TX, TW>(x, T, d, w, E, logits, st);
        });
    });
}
