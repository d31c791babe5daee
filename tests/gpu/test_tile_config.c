/*
 * test_tile_config — the heuristic table (kernels/cuda/tile_config.c) at each of its boundaries:
 * kernel family, bm, bn, gathered or pre-permuted rows (and how gathered rows complete a stage),
 * and clusters, for a batch described by its pairs, active experts and GEMM shape, on Hopper and on
 * an Ampere-class device, chosen or forced, for bf16, FP8 and 2:4 sparse weights.
 * Needs no GPU: the table is arithmetic on the batch's figures. Every GEMM of a batch must share
 * bm, so the test also checks that moed_cuda_tile_bm agrees with moed_cuda_tile_choose.
 */
#include "check.h"

#include "moed_cuda.h"
#include "moed_dtype.h"

#include <stdio.h>
#include <stdlib.h>

typedef struct tcase {
    const char *name;
    int sm, rows, n_active, n, k, wdtype, force; /* rows: pairs an active expert */
    int kernel, bm, bn, gather, cluster;         /* expected */
} tcase;

enum { S80 = MOED_CUDA_KERNEL_SM80, S90 = MOED_CUDA_KERNEL_SM90, S90P = MOED_CUDA_KERNEL_SM90P };
enum { S90F = MOED_CUDA_KERNEL_SM90_FP8, S80S = MOED_CUDA_KERNEL_SM80_SP };
enum { S90S = MOED_CUDA_KERNEL_SM90_SP };
enum { BF = MOED_BF16, F8 = MOED_FP8, SP = MOED_CUDA_SP24 };

static const tcase cases[] = {
    /* Hopper, bf16: bm 128 on the Hopper kernel from 56 rows an expert, bm 64 below */
    { "qwen3 56 rows", 90, 56, 128, 1536, 2048, BF, 0, S90, 128, 256, 1, 2 },
    { "qwen3 55 rows", 90, 55, 128, 1536, 2048, BF, 0, S80, 64, 128, 1, 1 },
    { "24 rows", 90, 24, 128, 1536, 2048, BF, 0, S80, 64, 128, 1, 1 },
    { "23 rows", 90, 23, 128, 1536, 2048, BF, 0, S80, 32, 128, 1, 1 },
    { "12 rows", 90, 12, 128, 1536, 2048, BF, 0, S80, 32, 128, 1, 1 },
    { "11 rows", 90, 11, 128, 1536, 2048, BF, 0, S80, 16, 128, 1, 1 },
    /* pre-permuted rows from 192 rows an expert at d >= 4096, gathered below or at smaller d */
    { "mixtral 192 rows", 90, 192, 8, 28672, 4096, BF, 0, S90, 128, 256, 0, 2 },
    { "mixtral 191 rows", 90, 191, 8, 28672, 4096, BF, 0, S90, 128, 256, 1, 2 },
    { "deepseek 128 rows", 90, 128, 256, 4096, 7168, BF, 0, S90, 128, 256, 1, 2 },
    { "gpt-oss 1024 rows (d 2944)", 90, 1024, 128, 5888, 2944, BF, 0, S90, 128, 256, 1, 2 },
    /* N not a multiple of 256: bn 256 with a half last n-tile, in clusters (gpt-oss's down GEMM) */
    { "gpt-oss down", 90, 512, 128, 2944, 2944, BF, 0, S90, 128, 256, 1, 2 },
    /* other GPUs: the portable kernel, bm 128 only from 96 rows */
    { "sm80 56 rows", 80, 56, 128, 1536, 2048, BF, 0, S80, 64, 128, 1, 1 },
    { "sm80 95 rows", 80, 95, 128, 1536, 2048, BF, 0, S80, 64, 128, 1, 1 },
    { "sm80 96 rows", 80, 96, 128, 1536, 2048, BF, 0, S80, 128, 128, 1, 1 },
    /* forced families */
    { "sm80 forced on Hopper", 90, 56, 128, 1536, 2048, BF, S80, S80, 64, 128, 1, 1 },
    { "sm90 forced at 1 row", 90, 1, 128, 1536, 2048, BF, S90, S90, 128, 256, 1, 2 },
    { "sm90p forced at 1 row", 90, 1, 128, 1536, 2048, BF, S90P, S90, 128, 256, 0, 2 },
    /* FP8 weights on Hopper: the FP8 kernel, bm 128 in clusters of two from 96 rows, its rows
     * pre-permuted; at bm 64 pre-permuted only at d >= 4096 from 16 rows and 1024 pairs */
    { "fp8 96 rows", 90, 96, 8, 28672, 4096, F8, 0, S90F, 128, 128, 0, 2 },
    { "fp8 96 rows (d 2048)", 90, 96, 128, 1536, 2048, F8, 0, S90F, 128, 128, 0, 2 },
    { "fp8 95 rows (760 pairs)", 90, 95, 8, 28672, 4096, F8, 0, S90F, 64, 128, 1, 1 },
    { "fp8 deepseek 16 rows", 90, 16, 256, 4096, 7168, F8, 0, S90F, 64, 128, 0, 1 },
    { "fp8 deepseek 15 rows", 90, 15, 256, 4096, 7168, F8, 0, S90F, 64, 128, 1, 1 },
    { "fp8 95 rows (d 2048)", 90, 95, 128, 1536, 2048, F8, 0, S90F, 64, 128, 1, 1 },
    { "fp8 sm90 forced at 96 rows", 90, 96, 8, 28672, 4096, F8, S90, S90F, 128, 128, 1, 2 },
    { "fp8 sm90p forced at 1 row", 90, 1, 8, 28672, 4096, F8, S90P, S90F, 64, 128, 0, 1 },
    { "fp8 on sm80", 80, 96, 8, 28672, 4096, F8, 0, S80, 128, 128, 1, 1 },
    /* 2:4 sparse routed experts: on Hopper wgmma.sp (bm 128, 256 features, clusters of two) from
     * 32 rows an expert, mma.sp below and elsewhere; pre-permuted rows at K >= 4096; a half last
     * n-tile where n is not a multiple of 256; force_kernel changes nothing */
    { "sp24 Hopper 32 rows", 90, 32, 128, 1536, 2048, SP, 0, S90S, 128, 256, 1, 2 },
    { "sp24 Hopper 31 rows", 90, 31, 128, 1536, 2048, SP, 0, S80S, 64, 128, 1, 1 },
    { "sp24 mixtral 96 rows (k 4096)", 90, 96, 8, 28672, 4096, SP, 0, S90S, 128, 256, 0, 2 },
    { "sp24 gpt-oss down 32 rows", 90, 32, 128, 2944, 2944, SP, 0, S90S, 128, 256, 1, 2 },
    { "sp24 Hopper 11 rows", 90, 11, 128, 1536, 2048, SP, 0, S80S, 16, 128, 1, 1 },
    { "sp24 sm80 12 rows", 80, 12, 128, 1536, 2048, SP, 0, S80S, 32, 128, 1, 1 },
    { "sp24 sm80 96 rows", 80, 96, 8, 28672, 4096, SP, 0, S80S, 128, 128, 1, 1 },
    { "sp24 sm90 forced at 1 row", 90, 1, 128, 1536, 2048, SP, S90, S80S, 16, 128, 1, 1 },
    { "sp24 sm80 forced at 96 rows", 90, 96, 8, 28672, 4096, SP, S80, S90S, 128, 256, 0, 2 },
};

/* How the Hopper kernels' gathered rows complete a stage (MOED_CUDA_GATHER_*): bf16 arrives on the
 * barrier from 256 rows an expert and lags below, FP8 (gathered only at bm 64) lags across tiles.
 */
typedef struct pcase {
    const char *name;
    int rows, n_active, n, k, wdtype;
    int policy; /* expected */
} pcase;

enum { TILE = MOED_CUDA_GATHER_LAG_TILE, RUN = MOED_CUDA_GATHER_LAG_RUN };
enum { ARRIVE = MOED_CUDA_GATHER_ARRIVE };

static const pcase policy_cases[] = {
    { "qwen3 256 rows", 256, 128, 1536, 2048, BF, ARRIVE },
    { "qwen3 255 rows", 255, 128, 1536, 2048, BF, TILE },
    { "mixtral 128 rows (gathered at d 4096)", 128, 8, 28672, 4096, BF, TILE },
    { "gpt-oss 1024 rows", 1024, 128, 5888, 2944, BF, ARRIVE },
    { "fp8 95 rows (d 2048)", 95, 128, 1536, 2048, F8, RUN },
    { "fp8 64 rows", 64, 8, 28672, 4096, F8, RUN },
};

int main(void)
{
    unsetenv("MOED_CUDA_GATHER_POLICY");
    unsetenv("MOED_CUDA_NO_CLUSTER");  /* the table's own choice of clusters */
    unsetenv("MOED_CUDA_SP24_KERNEL"); /* and of the 2:4 kernels */
    unsetenv("MOED_CUDA_SP24_PREPERMUTE");
    const int n = (int)(sizeof cases / sizeof cases[0]);
    for (int i = 0; i < n; i++) {
        const tcase *c = &cases[i];
        const int64_t P = (int64_t)c->rows * c->n_active;
        const moed_cuda_tile_cfg g =
            moed_cuda_tile_choose(c->sm, P, c->n_active, c->n, c->k, c->wdtype, c->force);
        CHECK_MSG(g.kernel == c->kernel && g.bm == c->bm && g.bn == c->bn &&
                      g.gather == c->gather && g.cluster == c->cluster,
                  "%s: kernel %d bm %d bn %d gather %d cluster %d, expected %d %d %d %d %d",
                  c->name, g.kernel, g.bm, g.bn, g.gather, g.cluster, c->kernel, c->bm, c->bn,
                  c->gather, c->cluster);
        CHECK_MSG(moed_cuda_tile_bm(c->sm, P, c->n_active, c->wdtype, c->force) == g.bm,
                  "%s: moed_cuda_tile_bm disagrees with moed_cuda_tile_choose", c->name);
    }
    const int np = (int)(sizeof policy_cases / sizeof policy_cases[0]);
    for (int i = 0; i < np; i++) {
        const pcase *c = &policy_cases[i];
        const int64_t P = (int64_t)c->rows * c->n_active;
        const moed_cuda_tile_cfg g =
            moed_cuda_tile_choose(90, P, c->n_active, c->n, c->k, c->wdtype, 0);
        CHECK_MSG(g.gather && g.gather_policy == c->policy,
                  "%s: gather %d policy %d, expected gathered rows and policy %d", c->name,
                  g.gather, g.gather_policy, c->policy);
    }
    printf("test_tile_config: %d cases, %d gather policies\n", n, np);
    return check_status("test_tile_config");
}
