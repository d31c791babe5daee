/*
 * tile_config — the one heuristic table that picks kernel family and tile shape per batch, and the
 * dispatch to it. The figure that decides is the expected rows per active expert (P / n_active):
 *
 *   rows/expert   kernel   bm    bn    why
 *   >= 192 and    sm90p    128   256   (Hopper) long rows (d >= 4096): pre-permuting the rows once
 *   d >= 4096                          and letting TMA stream A beats gathering them in the load
 *                                      (deepseek-v3 T=8192: 6% faster); at 128 rows an expert, and
 *                                      on the d 2048-2880 layers, gathering wins
 *   >= 56         sm90     128   256   (Hopper) wgmma, TMA, warp-specialised: from 56 rows an
 *                                      expert it beats bm 64 on mma.sync despite the padding
 *                                      (qwen3 T=1024, 64 rows: 20% faster); at 48-51 rows bm 64 is
 *                                      faster
 *   >= 96         sm80     128   128   (other GPUs) compute-bound on mma.sync
 *   >= 24         sm80      64   128   mid-size: half the padding waste of bm 128 (on Hopper up to
 *                                      55 rows an expert)
 *   >= 12         sm80      32   128   weight streaming, 12-24 rows an expert: bm 16 would split
 *                                      many experts in two m-tiles, each streaming the weights
 *                                      (mixtral T=64: 16% faster)
 *   <  12         sm80      16   128   few rows: weight streaming; deep pipeline, 2 CTAs per SM
 *                                      (bn 64, one warp and twice the CTAs: up to 12% slower at
 *                                      T=8)
 *
 * sm90 is bn 256 throughout: where N is a multiple of 128 but not of 256 its last n-tile is a half
 * (gemm_sm90.cu), in clusters, faster than the whole GEMM at bn 128 alone (gpt-oss's down GEMM, N =
 * 2944, at T=16384 1.05x, a d 2688 layer's 1.02-1.09x). Both GEMMs of a batch share bm (route prep
 * lays the tiles out once).
 *
 * sm90's gathered rows (moed_cuda.h, MOED_CUDA_GATHER_*) complete a stage by arriving on its
 * barrier once landed (ARRIVE) from 256 rows an expert, which only the d 2048-2880 layers gather
 * (gpt-oss T=16384 7.25-7.31 -> 6.86-6.99 ms, Qwen1.5 T=16384 2.06-2.09 -> 2.00; at 256 rows and
 * up never slower beyond the runs' noise); below, each thread signals its copies two stages late
 * (LAG_TILE), which was as fast or faster at 64-128 rows an expert on some layers (mixtral T=512).
 * The FP8 kernel counts that lag across tiles (LAG_RUN): ARRIVE measured mixed there (DBRX
 * T=16384 6% slower).
 *
 * sm90 runs in clusters of two CTAs that share the weight tile (deepseek-v3 T=4096: 12% faster,
 * other layers at T >= 4096 within -2%..+4%).
 *
 * The runs behind each line, dated: docs/kernels-notes.md, "The heuristic table".
 *
 * FP8 (block-scaled e4m3) weights on Hopper always run on the FP8 kernel, so every batch size
 * rounds alike (a token alone and the same token in a large batch give the same bits):
 *
 *   rows/expert   kernel     bm    bn    why
 *   >= 96         sm90 fp8   128   128   compute-bound: two consumer warpgroups interleave wgmma
 *                                        and promotion; bn 128 keeps acc + sums in registers (bn
 *                                        192, at 232 registers a consumer, 0.87-1.06x). The
 *                                        up GEMM's rows pre-permuted with their scales (A by TMA:
 *                                        mixtral T=16384 up GEMM 11% faster, every layer measured
 *                                        at 128 rows an expert and up 0.88-1.02x), and clusters of
 *                                        two share the weight tile (down GEMM 0.89-1.02x; gathered
 *                                        up GEMMs were 0-4% slower in clusters)
 *   <  96         sm90 fp8    64   128   weight streaming: one consumer, 8 stages of 16 KB tiles;
 *                                        rows pre-permuted at d >= 4096 from 16 rows an expert and
 *                                        1024 pairs (deepseek-v3 T=512 0.90x, Phi-3.5 T=512
 *                                        0.95x), gathered below (mixtral T=64: the extra pass
 *                                        cost 0.5%) and at d < 4096 (2-4% slower pre-permuted)
 *
 * Elsewhere (and with sm80 forced) FP8 layers take the bf16 rows above on the portable kernel,
 * which dequantizes the weights as it loads them.
 *
 * 2:4 sparse routed experts (MOED_CUDA_SP24): on Hopper wgmma.sp (gemm_sp_sm90.cu) from 32 rows an
 * expert, mma.sp below and on other GPUs, the rows of the portable kernel's table; force_kernel
 * does not apply (MOED_CUDA_SP24_KERNEL=sm80|sm90 pins the family, for tests and benchmarks). The
 * two kernels give the same bits for a token (the same K-steps of 32 in the same order, the same
 * epilogue: measured bit-identical), so a token alone on mma.sp and in a batch on wgmma.sp agree:
 *
 *   rows/expert   kernel   bm    bn    why
 *   >= 32         sm90sp   128   256   (Hopper) wgmma.sp: faster than mma.sp from 32 rows an
 *                                      expert on every layer measured (deepseek-v3 T=1024 4.02
 *                                      ms against 4.41, gpt-oss 1.26 against 1.39; at 16 rows
 *                                      mma.sp is 1.25-1.3x faster), 1.5-1.8x mma.sp at T >= 4096;
 *                                      clusters of two share the weight tile (mixtral T=16384
 *                                      16.7 -> 15.5 ms on an H100); the up GEMM's rows
 *                                      pre-permuted at K >= 4096 (mixtral T=16384 16.19 -> 14.37
 *                                      ms, deepseek-v3 19.92 -> 18.47; below, gathering is as
 *                                      fast or faster); a half last n-tile where n is not a
 *                                      multiple of 256
 *   >= 96         sm80sp   128   128   (other GPUs) compute-bound: 8 warps, 3 stages
 *   >= 24         sm80sp    64   128
 *   >= 12         sm80sp    32   128
 *   <  12         sm80sp    16   128   weight streaming: 5 stages of 0.5625 of the dense bytes
 *
 * The runs: docs/kernels-notes.md, "2:4 sparse experts on wgmma.sp".
 */
#include "moed_cuda.h"

#include "moed_dtype.h"
#include "moed_err.h"

#include <stdlib.h>
#include <string.h>

/* Rows an expert from which 2:4 sparse layers run on wgmma.sp on Hopper (the table above). */
#define SP24_SM90_ROWS 32

/* MOED_CUDA_NO_CLUSTER=1 runs the Hopper kernel one CTA at a time: the same kernel without the
 * shared weight tiles, for measuring what they buy. */
static int clusters_off(void)
{
    static int off = -1; /* every thread computes the same value, so the race is benign */
    if (off < 0) {
        const char *v = getenv("MOED_CUDA_NO_CLUSTER");
        off = v && *v == '1';
    }
    return off;
}

/* MOED_CUDA_SP24_KERNEL=sm80 keeps 2:4 sparse layers on mma.sp whatever the batch, =sm90 runs them
 * on wgmma.sp (bm 128) for every batch on Hopper, where n allows: for tests and benchmarks. */
static int sp24_forced(void)
{
    static int k = -1; /* every thread computes the same value, so the race is benign */
    if (k < 0) {
        const char *v = getenv("MOED_CUDA_SP24_KERNEL");
        k = !v                   ? 0
            : !strcmp(v, "sm80") ? MOED_CUDA_KERNEL_SM80
            : !strcmp(v, "sm90") ? MOED_CUDA_KERNEL_SM90
                                 : 0;
    }
    return k;
}

/* Whether wgmma.sp's up GEMM reads token rows pre-permuted (by TMA) rather than gathering them: at
 * K >= 4096 (the table above). MOED_CUDA_SP24_PREPERMUTE=1 always, =0 never: for tests and
 * measurements. */
static int sp24_prepermute(int k)
{
    static int v = -2; /* every thread computes the same value, so the race is benign */
    if (v == -2) {
        const char *e = getenv("MOED_CUDA_SP24_PREPERMUTE");
        v = e && *e == '1' ? 1 : e && *e == '0' ? 0 : -1;
    }
    return v >= 0 ? v : k >= 4096;
}

static int rows_per_expert_at_least(int64_t P, int n_active, int64_t rows)
{
    if (n_active < 1) n_active = 1;
    return P >= rows * n_active;
}

/* The bf16 Hopper kernel's gather policy for P pairs over n_active experts: the table's (above),
 * unless MOED_CUDA_GATHER_POLICY=tile|arrive pins it, for tests and measurements. */
static int sm90_gather_policy(int64_t P, int n_active)
{
    static int v = -2; /* every thread computes the same value, so the race is benign */
    if (v == -2) {
        const char *e = getenv("MOED_CUDA_GATHER_POLICY");
        v = e && !strcmp(e, "tile")     ? MOED_CUDA_GATHER_LAG_TILE
            : e && !strcmp(e, "arrive") ? MOED_CUDA_GATHER_ARRIVE
                                        : -1;
    }
    if (v >= 0) return v;
    return rows_per_expert_at_least(P, n_active, 256) ? MOED_CUDA_GATHER_ARRIVE
                                                      : MOED_CUDA_GATHER_LAG_TILE;
}

int moed_cuda_kernel_parse(const char *name)
{
    if (!name) return 0;
    if (!strcmp(name, "sm80")) return MOED_CUDA_KERNEL_SM80;
    if (!strcmp(name, "sm90")) return MOED_CUDA_KERNEL_SM90;
    if (!strcmp(name, "sm90p")) return MOED_CUDA_KERNEL_SM90P;
    return 0;
}

int moed_cuda_fp8_native(int sm, int force_kernel)
{
    return force_kernel ? force_kernel != MOED_CUDA_KERNEL_SM80 : sm == 90;
}

int moed_cuda_tile_bm(int sm, int64_t P, int n_active, int wdtype, int force_kernel)
{
    /* the dense Hopper kernels run (2:4 sparse weights have their own: wgmma.sp, bm 128) */
    const int hopper = wdtype != MOED_CUDA_SP24 && moed_cuda_fp8_native(sm, force_kernel);
    if (wdtype == MOED_CUDA_SP24 && sm == 90 && sp24_forced() != MOED_CUDA_KERNEL_SM80 &&
        (sp24_forced() || rows_per_expert_at_least(P, n_active, SP24_SM90_ROWS)))
        return 128; /* wgmma.sp */
    if (wdtype == MOED_FP8 && hopper) return rows_per_expert_at_least(P, n_active, 96) ? 128 : 64;
    if (hopper && (force_kernel || rows_per_expert_at_least(P, n_active, 56))) return 128;
    if (rows_per_expert_at_least(P, n_active, 96)) return 128;
    if (rows_per_expert_at_least(P, n_active, 24)) return 64;
    if (rows_per_expert_at_least(P, n_active, 12)) return 32;
    return 16;
}

moed_cuda_tile_cfg moed_cuda_tile_choose(int sm, int64_t P, int n_active, int n, int k, int wdtype,
                                         int force_kernel)
{
    moed_cuda_tile_cfg c;
    c.bm = moed_cuda_tile_bm(sm, P, n_active, wdtype, force_kernel);
    const int hopper = moed_cuda_fp8_native(sm, force_kernel); /* the Hopper kernels run */
    c.gather = 1;
    c.gather_policy = MOED_CUDA_GATHER_LAG_TILE;
    c.cluster = 1;
    if (wdtype == MOED_CUDA_SP24) {
        const int forced = sp24_forced();
        const int wg = sm == 90 && c.bm == 128 && forced != MOED_CUDA_KERNEL_SM80;
        c.kernel = wg ? MOED_CUDA_KERNEL_SM90_SP : MOED_CUDA_KERNEL_SM80_SP;
        c.bn = wg ? 256 : 128;
        c.cluster = wg && !clusters_off() ? 2 : 1;
        c.gather = !(wg && sp24_prepermute(k));
    } else if (wdtype == MOED_FP8 && hopper) {
        c.kernel = MOED_CUDA_KERNEL_SM90_FP8;
        c.bn = 128;
        c.gather = force_kernel ? force_kernel != MOED_CUDA_KERNEL_SM90P
                                : !(c.bm == 128 || (k >= 4096 && P >= 1024 &&
                                                    rows_per_expert_at_least(P, n_active, 16)));
        c.cluster = c.bm == 128 && !clusters_off() ? 2 : 1;
        c.gather_policy = MOED_CUDA_GATHER_LAG_RUN;
    } else if (hopper && c.bm == 128) {
        c.kernel = MOED_CUDA_KERNEL_SM90;
        c.bn = 256;
        c.gather = force_kernel ? force_kernel == MOED_CUDA_KERNEL_SM90
                                : !(k >= 4096 && rows_per_expert_at_least(P, n_active, 192));
        c.cluster = clusters_off() ? 1 : 2;
        c.gather_policy = sm90_gather_policy(P, n_active);
    } else {
        c.kernel = MOED_CUDA_KERNEL_SM80;
        c.bn = 128;
    }
    return c;
}

int moed_cuda_gemm_run(const moed_cuda_gemm *g, const moed_cuda_tile_cfg *cfg, moed_cuda_stream s)
{
    if (cfg->bm != g->bm) return MOED_EINVAL;
    if (cfg->kernel == MOED_CUDA_KERNEL_SM80_SP) return moed_cuda_gemm_sp_sm80(g, s);
    if (cfg->kernel == MOED_CUDA_KERNEL_SM90_SP) return moed_cuda_gemm_sp_sm90(g, cfg->cluster, s);
    if (cfg->kernel == MOED_CUDA_KERNEL_SM90_FP8)
        return moed_cuda_gemm_fp8_sm90(g, cfg->cluster, cfg->gather_policy, s);
    if (cfg->kernel == MOED_CUDA_KERNEL_SM90)
        return moed_cuda_gemm_sm90(g, cfg->cluster, cfg->gather_policy, s);
    return moed_cuda_gemm_sm80(g, cfg->bn, s);
}
