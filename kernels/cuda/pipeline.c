/*
 * pipeline — the sequence of launches for one batch, in one place, so the backend and the kernel
 * benchmark run exactly the same thing: convert → route prep → up GEMM → down GEMM → shared experts
 * → combine, all queued on one stream, nothing synchronised. A layer split over devices runs the
 * same stages in two pieces (moed_cuda_pipeline_routed on each part, moed_cuda_pipeline_shared and
 * the combine on the home device), so each row is computed by the same code either way.
 */
#include "moed_cuda.h"

#include "moed_dtype.h"
#include "moed_err.h"
#include "moed_model.h"

#include <cuda_runtime_api.h>
#include <string.h>

static void mark(void *const *ev, int i, moed_cuda_stream s)
{
    if (ev) cudaEventRecord((cudaEvent_t)ev[i], (cudaStream_t)s);
}

/* One set of experts: the routed ones, or the shared experts as one expert of width sff. */
typedef struct expert_set {
    const void *w13, *w2;
    const float *w13_scale, *w2_scale;  /* FP8 */
    const uint32_t *w13_meta, *w2_meta; /* 2:4 sparse: w13, w2 hold the kept values */
    int wfmt;                           /* the table's weight format (moed_cuda_tile_choose) */
    int E, ff_pad, n_up;
    void *h, *y; /* H (bf16/f16) and Y of its rows */
} expert_set;

/* Elements of one expert's [n, k] matrix as stored: half of them kept where 2:4 sparse. */
static int64_t expert_elems(const expert_set *es, int64_t n, int64_t k)
{
    return es->w13_meta ? n * k / 2 : n * k;
}

/* Up then down projection of T tokens over the route's m-tiles or, with r NULL, over all T rows in
 * order as one expert (the shared experts). P is the rows H and Y hold. x is the convert stage's
 * output: compute-type rows (w->xc or the request's own), or for FP8 layers on the FP8 Tensor
 * Cores (fp8 set) w->xq with its scales. ev, if not NULL, is recorded between the two. */
static int expert_gemms(const moed_cuda_layer_dev *L, const moed_cuda_route_dev *r,
                        const moed_cuda_work_dev *w, const void *x, int fp8, const expert_set *es,
                        int64_t T, int64_t P, int n_active, int sm, int force_kernel,
                        moed_cuda_stream s, void *const *ev)
{
    moed_cuda_gemm g;
    memset(&g, 0, sizeof g);
    g.cdtype = L->cdtype;
    g.b_experts = es->E;
    if (r) {
        g.tile_exp = r->tile_exp;
        g.tile_row = r->tile_row;
        g.n_tiles = r->n_tiles;
        g.exp_off = r->exp_off;
        g.max_tiles = r->max_tiles;
        g.bm = r->bm;
    } else {
        g.identity_rows = (int32_t)T;
        g.bm = moed_cuda_tile_bm(sm, T, 1, es->wfmt, force_kernel);
        g.max_tiles = (int32_t)((T + g.bm - 1) / g.bm);
    }
    /* up: A = X rows gathered by token, B = W13 (or W1), SwiGLU/GELU/ReLU epilogue into H */
    g.a = x;
    g.lda = L->d_pad;
    g.a_rows = r ? r->slot_tok : NULL;
    g.a_rows_total = T;
    g.b = es->w13;
    g.b_scale = es->w13_scale;
    g.b_meta = es->w13_meta;
    if (fp8) {
        g.a_scale = w->xs;
        g.a_scale_ld = w->xs_ld;
    }
    g.n = es->n_up;
    g.k = L->d_pad;
    g.b_estride = expert_elems(es, es->n_up, L->d_pad);
    g.c = es->h;
    g.ldc = es->ff_pad;
    g.c_rows = P; /* H, and Y below, hold P rows */
    g.epi = L->act == MOED_ACT_SWIGLU ? MOED_CUDA_EPI_SWIGLU
            : L->act == MOED_ACT_GELU ? MOED_CUDA_EPI_GELU
                                      : MOED_CUDA_EPI_RELU;
    moed_cuda_tile_cfg cfg =
        moed_cuda_tile_choose(sm, P, n_active, g.n, g.k, es->wfmt, force_kernel);
    /* The portable kernel starts while the kernel before drains (moed_cuda.h): the routed up
     * GEMM reads nothing before route prep is done, since its tiles are route prep's; the
     * shared experts' tiles need no table, so they load weights at once, as the down GEMM does.
     * The Hopper kernels start plainly: started early, the large batches they run were slower
     * (deepseek-v3 T=16384 by about 15%: docs/kernels-notes.md, "each small-batch kernel starts
     * while the one before drains"). Both GEMMs of a batch share bm, hence the kernel family. */
    const int early = cfg.kernel == MOED_CUDA_KERNEL_SM80 || cfg.kernel == MOED_CUDA_KERNEL_SM80_SP;
    g.overlap = !early ? MOED_CUDA_OVERLAP_NONE
                : r    ? MOED_CUDA_OVERLAP_LAUNCH
                       : MOED_CUDA_OVERLAP_WEIGHTS;
    int rc = 0;
    if (r && !cfg.gather) { /* rows pre-permuted into y (free until the down GEMM), A by TMA */
        rc = moed_cuda_gather_rows(es->y, x, r->slot_tok, r->P,
                                   fp8 ? (size_t)L->d_pad : moed_cuda_cbytes(L->d_pad), s);
        if (fp8) { /* e4m3 rows take y's first P * d_pad bytes (of its 2 * P * d_pad): their
                    * scales after them */
            float *ps = (float *)((uint8_t *)es->y + P * L->d_pad);
            if (!rc)
                rc = moed_cuda_gather_cols(ps, P, w->xs, w->xs_ld, r->slot_tok, r->P,
                                           L->d_pad / MOED_CUDA_FP8_K, s);
            g.a_scale = ps;
            g.a_scale_ld = P;
        }
        g.a = es->y;
        g.a_rows = NULL;
        g.a_rows_total = P;
    }
    if (!rc) rc = moed_cuda_gemm_run(&g, &cfg, s);
    /* FP8 on the FP8 Tensor Cores: H quantized per row per 128 columns for the down GEMM */
    if (!rc && fp8)
        rc = moed_cuda_quant_fp8(es->h, L->cdtype, P, es->ff_pad, es->ff_pad, w->hq, es->ff_pad,
                                 w->hs_scale, w->hs_ld, s);
    mark(ev, 0, s);
    if (rc) return rc;
    /* down: A = H rows in order, B = W2, plain store into Y */
    g.a = fp8 ? w->hq : es->h;
    g.lda = es->ff_pad;
    g.a_rows = NULL;
    g.a_rows_total = P;
    if (fp8) {
        g.a_scale = w->hs_scale;
        g.a_scale_ld = w->hs_ld;
    }
    g.b = es->w2;
    g.b_scale = es->w2_scale;
    g.b_meta = es->w2_meta;
    g.n = L->d_pad;
    g.k = es->ff_pad;
    g.b_estride = expert_elems(es, L->d_pad, es->ff_pad);
    g.c = es->y;
    g.ldc = L->d_pad;
    g.epi = MOED_CUDA_EPI_STORE;
    cfg = moed_cuda_tile_choose(sm, P, n_active, g.n, g.k, es->wfmt, force_kernel);
    g.overlap = early ? MOED_CUDA_OVERLAP_WEIGHTS : MOED_CUDA_OVERLAP_NONE;
    return moed_cuda_gemm_run(&g, &cfg, s);
}

/* The convert stage: x (dtype) into what the up GEMM reads, in *xg: the compute type (w->xc, or x
 * itself when it already is that, unpadded), or for native FP8 e4m3 rows with their scales. */
static int convert_stage(const moed_cuda_layer_dev *L, const moed_cuda_work_dev *w, const void *x,
                         int dtype, int64_t T, int fp8, const void **xg, moed_cuda_stream s)
{
    if (fp8) {
        *xg = w->xq;
        return moed_cuda_quant_fp8(x, dtype, T, L->d, L->d, w->xq, L->d_pad, w->xs, w->xs_ld, s);
    }
    if (dtype == L->cdtype && L->d == L->d_pad) { /* the GEMMs read the input where it is */
        *xg = x;
        return 0;
    }
    *xg = w->xc;
    return moed_cuda_convert_in(x, dtype, T, L->d, w->xc, L->cdtype, L->d_pad, s);
}

/* Route prep and the routed experts' GEMMs, into w->y in sorted order (r->pair_slot says where
 * each pair's row is); events 1..3 of ev. */
static int routed_stage(const moed_cuda_layer_dev *L, moed_cuda_route_dev *r,
                        const moed_cuda_work_dev *w, const void *xg, int fp8, int sm, int n_active,
                        int force_kernel, moed_cuda_stream s, void *const *ev)
{
    int rc = r->P > 0 ? moed_cuda_route_prep(r, s) : 0;
    mark(ev, 1, s);
    const expert_set routed = { L->w13,
                                L->w2,
                                L->w13_scale,
                                L->w2_scale,
                                L->w13_meta,
                                L->w2_meta,
                                moed_cuda_routed_wfmt(L),
                                L->E,
                                L->ff_pad,
                                L->n_up,
                                w->h,
                                w->y };
    if (!rc && r->P > 0)
        rc = expert_gemms(L, r, w, xg, fp8, &routed, r->T, r->P, n_active, sm, force_kernel, s,
                          ev ? ev + 2 : NULL);
    else
        mark(ev, 2, s);
    mark(ev, 3, s);
    return rc;
}

/* The shared experts (if the layer has them) into w->ys. */
static int shared_stage(const moed_cuda_layer_dev *L, int64_t T, const moed_cuda_work_dev *w,
                        const void *xg, int fp8, int sm, int force_kernel, moed_cuda_stream s)
{
    const expert_set shared = { L->s13,    L->s2, L->s13_scale, L->s2_scale, NULL,  NULL,
                                L->wdtype, 1,     L->sff_pad,   L->sn_up,    w->hs, w->ys };
    return L->s13 ? expert_gemms(L, NULL, w, xg, fp8, &shared, T, T, 1, sm, force_kernel, s, NULL)
                  : 0;
}

static int fp8_layer(const moed_cuda_layer_dev *L, int sm, int force_kernel)
{
    return L->wdtype == MOED_FP8 && moed_cuda_fp8_native(sm, force_kernel);
}

int moed_cuda_pipeline(const moed_cuda_layer_dev *L, moed_cuda_route_dev *r,
                       const moed_cuda_work_dev *w, const void *x, int dtype, void *out, int sm,
                       int n_active, int force_kernel, moed_cuda_stream s, void *const *ev)
{
    const int fp8 = fp8_layer(L, sm, force_kernel);
    const void *xg = NULL;
    int rc = convert_stage(L, w, x, dtype, r->T, fp8, &xg, s);
    mark(ev, 0, s);
    if (!rc) rc = routed_stage(L, r, w, xg, fp8, sm, n_active, force_kernel, s, ev);
    if (!rc) rc = shared_stage(L, r->T, w, xg, fp8, sm, force_kernel, s);
    mark(ev, 4, s);
    if (!rc)
        rc = moed_cuda_combine(r, w->y, L->s13 ? w->ys : NULL, L->cdtype, L->d, L->d_pad, out,
                               dtype, s);
    mark(ev, 5, s);
    return rc;
}

int moed_cuda_pipeline_routed(const moed_cuda_layer_dev *L, moed_cuda_route_dev *r,
                              const moed_cuda_work_dev *w, const void *x, int dtype, int sm,
                              int n_active, int force_kernel, moed_cuda_stream s)
{
    const int fp8 = fp8_layer(L, sm, force_kernel);
    const void *xg = NULL;
    int rc = convert_stage(L, w, x, dtype, r->T, fp8, &xg, s);
    if (!rc) rc = routed_stage(L, r, w, xg, fp8, sm, n_active, force_kernel, s, NULL);
    return rc;
}

int moed_cuda_pipeline_shared(const moed_cuda_layer_dev *L, int64_t T, const moed_cuda_work_dev *w,
                              const void *x, int dtype, int sm, int force_kernel,
                              moed_cuda_stream s)
{
    if (!L->s13) return 0;
    const int fp8 = fp8_layer(L, sm, force_kernel);
    const void *xg = NULL;
    int rc = convert_stage(L, w, x, dtype, T, fp8, &xg, s);
    if (!rc) rc = shared_stage(L, T, w, xg, fp8, sm, force_kernel, s);
    return rc;
}
