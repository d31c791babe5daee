/*
 * gemm_sm90 — the Hopper grouped GEMM (sm_90a): wgmma with both operands in shared memory, weight
 * tiles brought by the tensor memory accelerator (TMA), warp-specialised.
 *
 * Persistent: one CTA per SM walks the 128 x BN tiles (BN = 128 or 256), each of one expert, with
 * three warpgroups:
 *   warpgroup 0, the producer, fills STAGES shared-memory stages: one thread issues the TMA copy of
 *   the weight tile, and (for the up projection) all 128 threads gather the token rows of A with
 *   16-byte cp.async straight from X[token(row)] — Hopper's TMA cannot gather rows, and a permuted
 *   copy of X would cost a full extra pass over the activations. cp.async writes through the
 * generic proxy and wgmma reads through the async proxy, so each producer thread waits for its
 * copies of a stage (LAG stages behind the newest), fences the proxies, and only then arrives on
 * the stage's barrier. Without gather (the down projection reads H in order) A also comes by TMA.
 *   warpgroups 1 and 2, the consumers, each run m64nBNk16 wgmma over 64 of the tile's rows, keep
 * one wgmma group in flight, release a stage once the group that read it has finished, and apply
 * the epilogue from registers. Shared rows are 128 bytes (BK = 64), 128-byte swizzled: the layout
 * TMA writes with CU_TENSOR_MAP_SWIZZLE_128B, the cp.async path writes with moe_swz128, and the
 * wgmma descriptors name. Each output element is one fixed-order sum over K, independent of the
 * tile's other rows.
 */
#include "gemm_common.cuh"
#include "wgmma_ops.cuh"

#include "moed_dtype.h"
#include "moed_err.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <type_traits>

namespace
{

constexpr int BM = 128, BK = 64, STAGES = 4;
constexpr int A_STAGE = BM * BK * 2;

/* The device code exists only in the sm_90a pass; the other passes see an empty kernel. */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MOE_SM90_ENABLED 1
constexpr int LAG = 2; /* stages a producer thread keeps in flight before signalling the oldest */

__device__ __forceinline__ void mbar_init(uint32_t bar, int count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, int bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void mbar_wait(uint32_t bar, int parity)
{
    asm volatile("{\n.reg .pred P1;\nLAB_WAIT:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
                 "@P1 bra DONE;\nbra LAB_WAIT;\nDONE:\n}\n" ::"r"(bar),
                 "r"(parity)
                 : "memory");
}

__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap *map, uint32_t bar,
                                            int x, int y)
{
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes "
                 "[%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
                 "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(bar)
                 : "memory");
}

__device__ __forceinline__ void fence_proxy_async()
{
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

/* K-major operand, 128-byte swizzle: rows of 128 bytes, 8-row groups 1024 bytes apart. Stepping
 * K by 16 elements inside the swizzle atom adds 32 bytes to the start address. */
__device__ __forceinline__ uint64_t wgmma_desc(uint32_t addr)
{
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) |
           ((uint64_t)1 << 62);
}

template <typename T, int BN>
__device__ __forceinline__ void wgmma(float *d, uint64_t da, uint64_t db)
{
    if constexpr (BN == 256) {
        if constexpr (std::is_same<T, __nv_bfloat16>::value)
            moe_wgmma_m64n256k16_bf16(d, da, db);
        else
            moe_wgmma_m64n256k16_f16(d, da, db);
    } else {
        if constexpr (std::is_same<T, __nv_bfloat16>::value)
            moe_wgmma_m64n128k16_bf16(d, da, db);
        else
            moe_wgmma_m64n128k16_f16(d, da, db);
    }
}

template <int N> __device__ __forceinline__ void fence_acc(float (&acc)[N])
{
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(acc[i])::"memory");
}

#endif

template <typename T, int BN, bool GATHER, int EPI>
__global__ void __launch_bounds__(384, 1) gemm_sm90_kernel(const __grid_constant__ CUtensorMap tm_b,
                                                           const __grid_constant__ CUtensorMap tm_a,
                                                           const moe_gemm g, int num_n, int total)
{
#ifdef MOE_SM90_ENABLED
    constexpr int B_STAGE = BN * BK * 2;
    constexpr int NACC = BN / 2;

    extern __shared__ uint8_t smem_raw[];
    uint32_t base = moe_smem_addr(smem_raw);
    base = (base + 1023) & ~1023u; /* swizzled stages start on 1024-byte boundaries */
    const uint32_t sA = base, sB = base + STAGES * A_STAGE;
    const uint32_t full = sB + STAGES * B_STAGE, empty = full + 8 * STAGES;
    const int tid = threadIdx.x, wg = tid >> 7, lane = tid & 31;
    const int ktiles = g.k / BK;

    if (tid == 0) {
        for (int s = 0; s < STAGES; s++) {
            mbar_init(full + 8 * s, GATHER ? 128 + 1 : 1);
            mbar_init(empty + 8 * s, 8); /* one arrival per consumer warp */
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        fence_proxy_async();
    }
    __syncthreads();

    /* Persistent: every CTA walks tiles id = blockIdx.x, + gridDim.x, ...; producer and consumers
     * walk the same sequence, each resolving its next tile (dependent loads of the tile tables)
     * during the current tile's first k-step so the latency hides behind it; `it` counts k-steps
     * across tiles so stage and phase carry over, and the producer fills the next tile's first
     * stages while the consumers run this tile's epilogue. */
    int it = 0, id = blockIdx.x;
    moe_tile cur, nxt;
    bool have = moe_next_tile(g, num_n, total, id, cur);
    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 56;\n");
        if (!GATHER && tid != 0) return; /* TMA alone: one thread issues everything */
        const int kc = tid & 7;
        while (have) {
            int src[GATHER ? 8 : 1];
            if constexpr (GATHER) {
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    const int r = cur.row0 + (tid >> 3) + 16 * i;
                    int s = -1;
                    if (r < cur.row_end) s = g.a_rows ? g.a_rows[r] : r;
                    src[i] = (s >= 0 && s < g.a_rows_total) ? s : -1;
                }
            }
            const int b_row = cur.e * g.n + cur.nt * BN;
            bool have_next = false;
            for (int kt = 0; kt < ktiles; kt++, it++) {
                const int s = it % STAGES;
                mbar_wait(empty + 8 * s, ((it / STAGES) & 1) ^ 1);
                if (tid == 0) {
                    mbar_arrive_expect_tx(full + 8 * s, B_STAGE + (GATHER ? 0 : A_STAGE));
                    tma_load_2d(sB + s * B_STAGE, &tm_b, full + 8 * s, kt * BK, b_row);
                    if constexpr (!GATHER)
                        tma_load_2d(sA + s * A_STAGE, &tm_a, full + 8 * s, kt * BK, cur.row0);
                }
                if constexpr (GATHER) {
                    const T *a = static_cast<const T *>(g.a) + kt * BK + kc * 8;
#pragma unroll
                    for (int i = 0; i < 8; i++) {
                        const int row = (tid >> 3) + 16 * i;
                        moe_cp_async16(sA + s * A_STAGE + moe_swz128(row, kc),
                                       a + (int64_t)(src[i] < 0 ? 0 : src[i]) * g.lda,
                                       src[i] < 0 ? 0 : 16);
                    }
                    moe_cp_async_commit();
                    if (kt >= LAG) {
                        moe_cp_async_wait<LAG>();
                        fence_proxy_async();
                        mbar_arrive(full + 8 * ((it - LAG) % STAGES));
                    }
                }
                if (kt == 0) {
                    id += gridDim.x;
                    have_next = moe_next_tile(g, num_n, total, id, nxt);
                }
            }
            if constexpr (GATHER) { /* signal the tile's last stages before moving on */
                moe_cp_async_wait<0>();
                fence_proxy_async();
                for (int j = it - (ktiles < LAG ? ktiles : LAG); j < it; j++)
                    mbar_arrive(full + 8 * (j % STAGES));
            }
            cur = nxt;
            have = have_next;
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 224;\n");
    const int cw = wg - 1; /* this consumer's 64 rows of each tile */
    while (have) {
        float acc[NACC];
#pragma unroll
        for (int i = 0; i < NACC; i++) acc[i] = 0.0f;
        bool have_next = false;
        for (int kt = 0; kt < ktiles; kt++, it++) {
            const int s = it % STAGES;
            mbar_wait(full + 8 * s, (it / STAGES) & 1);
            fence_acc(acc);
            asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
            for (int kk = 0; kk < BK / 16; kk++)
                wgmma<T, BN>(acc, wgmma_desc(sA + s * A_STAGE + cw * 64 * 128 + kk * 32),
                             wgmma_desc(sB + s * B_STAGE + kk * 32));
            asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
            if (kt == 0) {
                id += gridDim.x;
                have_next = moe_next_tile(g, num_n, total, id, nxt);
            }
            asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
            fence_acc(acc);
            if (kt > 0 && lane == 0) mbar_arrive(empty + 8 * ((it - 1) % STAGES));
        }
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        fence_acc(acc);
        if (lane == 0)
            mbar_arrive(empty + 8 * ((it - 1) % STAGES)); /* the producer may refill it now */

        /* Accumulator 4*c8 + 2*h + j: row 16*(warp%4) + lane/4 + 8h of this consumer's 64, column
         * 8*c8 + 2*(lane%4) + j. Gate blocks of 32 columns are followed by their up blocks. */
        const int rbase = cur.row0 + cw * 64 + ((tid >> 5) & 3) * 16 + (lane >> 2);
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int r = rbase + 8 * h;
            if (r >= cur.row_end) continue;
#pragma unroll
            for (int c8 = 0; c8 < BN / 8; c8++) {
                const int n = cur.nt * BN + c8 * 8 + 2 * (lane & 3);
                const float v0 = acc[4 * c8 + 2 * h], v1 = acc[4 * c8 + 2 * h + 1];
                if constexpr (EPI == MOE_EPI_SWIGLU) {
                    if ((c8 & 7) < 4)
                        moe_epilogue2<T, EPI>(g, r, n, v0, v1, acc[4 * (c8 + 4) + 2 * h],
                                              acc[4 * (c8 + 4) + 2 * h + 1]);
                } else {
                    moe_epilogue2<T, EPI>(g, r, n, v0, v1, 0.0f, 0.0f);
                }
            }
        }
        cur = nxt;
        have = have_next;
    }
#endif
}

typedef CUresult (*encode_tiled_fn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *,
                                    const cuuint64_t *, const cuuint64_t *, const cuuint32_t *,
                                    const cuuint32_t *, CUtensorMapInterleave, CUtensorMapSwizzle,
                                    CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

/* The driver's tensor-map encoder, found at run time so moed needs no libcuda at link time (it must
 * start on machines without a GPU driver, where the CPU backend serves). */
encode_tiled_fn encoder()
{
    static encode_tiled_fn fn;
    if (!fn) {
        void *p = nullptr;
        cudaDriverEntryPointQueryResult q;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                             &q) == cudaSuccess &&
            q == cudaDriverEntryPointSuccess)
            fn = reinterpret_cast<encode_tiled_fn>(p);
    }
    return fn;
}

/* A row-major [rows, cols] matrix of 2-byte elements, read in boxes of box_rows x 64 columns. */
int tensor_map(CUtensorMap *m, int cdtype, const void *p, int64_t rows, int64_t cols, int64_t ld,
               int box_rows)
{
    encode_tiled_fn fn = encoder();
    if (!fn) return MOED_EDEVICE;
    const cuuint64_t dims[2] = { (cuuint64_t)cols, (cuuint64_t)rows };
    const cuuint64_t strides[1] = { (cuuint64_t)ld * 2 };
    const cuuint32_t box[2] = { (cuuint32_t)BK, (cuuint32_t)box_rows };
    const cuuint32_t estr[2] = { 1, 1 };
    CUresult r = fn(
        m, cdtype == MOED_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        2, const_cast<void *>(p), dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
        CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return r == CUDA_SUCCESS ? 0 : MOED_EDEVICE;
}

template <typename T, int BN, bool GATHER, int EPI> int launch(const moe_gemm *g, moe_stream s)
{
    CUtensorMap tm_b, tm_a;
    int rc = tensor_map(&tm_b, g->cdtype, g->b, (int64_t)g->b_experts * g->n, g->k, g->k, BN);
    if (rc) return rc;
    if (GATHER)
        tm_a = tm_b; /* unused */
    else if ((rc = tensor_map(&tm_a, g->cdtype, g->a, g->a_rows_total, g->k, g->lda, BM)))
        return rc;

    constexpr int smem = 1024 + STAGES * (A_STAGE + BN * BK * 2) + 16 * STAGES;
    auto kern = gemm_sm90_kernel<T, BN, GATHER, EPI>;
    if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) !=
        cudaSuccess)
        return MOED_EDEVICE;
    const int num_n = g->n / BN;
    const int64_t tiles = (int64_t)num_n * g->max_tiles;
    if (tiles <= 0) return 0;
    if (tiles > 0x7fffffff) return MOED_EINVAL;
    int dev = 0, sms = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    const int grid = (int)(tiles < sms ? tiles : sms); /* one resident CTA per SM walks the tiles */
    kern<<<grid, 384, smem, (cudaStream_t)s>>>(tm_b, tm_a, *g, num_n, (int)tiles);
    return cudaGetLastError() == cudaSuccess ? 0 : MOED_EDEVICE;
}

/* The instantiations: gathered A only for the up projection's epilogues; fp32 output (router
 * logits) is the portable kernel's. */
template <typename T, int BN> int dispatch_bn(const moe_gemm *g, moe_stream s)
{
    const bool gather = g->a_rows != nullptr;
    return moe_epi_dispatch(g->epi, [&]<int EPI>() -> int {
        if constexpr (EPI == MOE_EPI_STORE_F32)
            return MOED_EINVAL;
        else if constexpr (EPI == MOE_EPI_STORE)
            return gather ? MOED_EINVAL : launch<T, BN, false, EPI>(g, s);
        else
            return gather ? launch<T, BN, true, EPI>(g, s) : launch<T, BN, false, EPI>(g, s);
    });
}

template <typename T> int dispatch(const moe_gemm *g, int bn, moe_stream s)
{
    return bn == 256 ? dispatch_bn<T, 256>(g, s) : dispatch_bn<T, 128>(g, s);
}

} // namespace

extern "C" int moe_gemm_sm90(const moe_gemm *g, int bn, moe_stream s)
{
    if (g->bm != BM || (bn != 128 && bn != 256) || g->n % bn || g->k % BK || g->lda % 8)
        return MOED_EINVAL;
    if (g->cdtype == MOED_BF16) return dispatch<__nv_bfloat16>(g, bn, s);
    if (g->cdtype == MOED_F16) return dispatch<__half>(g, bn, s);
    return MOED_EINVAL;
}
