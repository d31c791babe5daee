/*
 * moe_bench — the kernel benchmark: the whole expert pipeline of the CUDA backend
 * (moed_cuda_pipeline: route prep → up GEMM → down GEMM → combine) on device-resident data, for the
 * standard shapes (mixtral d 4096 ff 14336 E 8 k 2; qwen3-30b-a3b d 2048 ff 768 E 128 k 8;
 * deepseek-v3 d 7168 ff 2048 E 256 k 8) or any --shape d,ff,E,k (d and ff padded to 128 as the
 * backend pads them), bf16, block-scaled FP8 and/or 2:4 sparse (sparse24: the routed experts
 * compressed as the backend holds them, on the Sparse Tensor Cores) weights, and T = 8 to 16384,
 * timed with CUDA
 * events (median of many runs after warm-up) on random, never-zero data, beside the ceilings
 * measured in the same run: large cuBLAS bf16 and cuBLASLt FP8 (e4m3, bf16 out) 8192³ matmuls and a
 * large device-to-device copy (bytes read plus written). Counted work: FLOPs = 2·pairs·d·3·ff;
 * minimum bytes = the weights of every expert that received a token (FP8: one byte each, and their
 * scales; sparse24: the kept values and their metadata, 0.5625 of bf16's) + activations in and
 * out. The %mm column compares with the ceiling of the weights' type.
 *
 * The command line is one moed_opt table (`moe-bench --help` prints it). Prints one table row per
 * run; --json writes every figure, the stage times included.
 */
#include "bench.h"
#include "moed_opt.h"
#include "moed_cuda.h"

#include "moed_dtype.h"
#include "moed_synth.h"

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct shape {
    char name[48];
    int d, ff, E, k;
} shape;

static const shape shapes[] = {
    { "mixtral", 4096, 14336, 8, 2 },
    { "qwen3-30b-a3b", 2048, 768, 128, 8 },
    { "deepseek-v3", 7168, 2048, 256, 8 },
};

#define CK(call)                                                                                   \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "moe-bench: %s failed: %s (line %d)\n", #call, cudaGetErrorString(e_), \
                    __LINE__);                                                                     \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

static uint64_t rng = 42;

static double urand(void)
{
    rng = moed_splitmix64(rng);
    return (double)(rng >> 11) / 9007199254740992.0;
}

static int cmp_double(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

typedef struct run {
    char shape[48], routing[16], kernel[12], weights[8];
    int64_t T, P;
    int active, bm;
    double ms, stage_ms[6], tflops, gbs;
    double
        cublas_ms; /* the same per-expert GEMMs through cuBLAS, pre-permuted rows, no epilogues */
} run;

static double g_matmul_tflops, g_fp8_tflops, g_copy_gbs;
static cublasHandle_t g_cublas;

/* Median ms of reps timed calls of f(arg) after 5 warm-ups. */
static double time_ms(void (*f)(void *), void *arg, int reps)
{
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    double t[64];
    for (int i = 0; i < reps + 5; i++) {
        cudaEventRecord(e0, 0);
        f(arg);
        cudaEventRecord(e1, 0);
        CK(cudaEventSynchronize(e1));
        float ms;
        cudaEventElapsedTime(&ms, e0, e1);
        if (i >= 5) t[i - 5] = ms;
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    return median(t, reps);
}

/* The FP8 matmul ceiling: cuBLASLt e4m3 x e4m3 -> bf16 (fp32 accumulation), n x n x n, "TN" (the
 * layout FP8 matmuls take). */
typedef struct lt_mm {
    cublasLtHandle_t lt;
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t la, lb, lc;
    cublasLtMatmulHeuristicResult_t algo;
    void *a, *b, *c, *ws;
    size_t ws_bytes;
} lt_mm;

static void lt_run(void *arg)
{
    lt_mm *m = arg;
    const float alpha = 1, beta = 0;
    cublasLtMatmul(m->lt, m->op, &alpha, m->a, m->la, m->b, m->lb, &beta, m->c, m->lc, m->c, m->lc,
                   &m->algo.algo, m->ws, m->ws_bytes, 0);
}

static double fp8_ceiling(int n)
{
    lt_mm m = { .ws_bytes = (size_t)64 << 20 };
    CK(cudaMalloc(&m.a, (size_t)n * n));
    CK(cudaMalloc(&m.b, (size_t)n * n));
    CK(cudaMalloc(&m.c, (size_t)n * n * 2));
    CK(cudaMalloc(&m.ws, m.ws_bytes));
    bench_fill_fp8(m.a, (size_t)n * n, 21);
    bench_fill_fp8(m.b, (size_t)n * n, 22);
    const cublasOperation_t T = CUBLAS_OP_T, N = CUBLAS_OP_N;
    int found = 0;
    cublasLtMatmulPreference_t pref = NULL;
    if (cublasLtCreate(&m.lt) == CUBLAS_STATUS_SUCCESS &&
        cublasLtMatmulDescCreate(&m.op, CUBLAS_COMPUTE_32F, CUDA_R_32F) == CUBLAS_STATUS_SUCCESS &&
        cublasLtMatmulDescSetAttribute(m.op, CUBLASLT_MATMUL_DESC_TRANSA, &T, sizeof T) ==
            CUBLAS_STATUS_SUCCESS &&
        cublasLtMatmulDescSetAttribute(m.op, CUBLASLT_MATMUL_DESC_TRANSB, &N, sizeof N) ==
            CUBLAS_STATUS_SUCCESS &&
        cublasLtMatrixLayoutCreate(&m.la, CUDA_R_8F_E4M3, n, n, n) == CUBLAS_STATUS_SUCCESS &&
        cublasLtMatrixLayoutCreate(&m.lb, CUDA_R_8F_E4M3, n, n, n) == CUBLAS_STATUS_SUCCESS &&
        cublasLtMatrixLayoutCreate(&m.lc, CUDA_R_16BF, n, n, n) == CUBLAS_STATUS_SUCCESS &&
        cublasLtMatmulPreferenceCreate(&pref) == CUBLAS_STATUS_SUCCESS &&
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                             &m.ws_bytes,
                                             sizeof m.ws_bytes) == CUBLAS_STATUS_SUCCESS)
        cublasLtMatmulAlgoGetHeuristic(m.lt, m.op, m.la, m.lb, m.lc, m.lc, pref, 1, &m.algo,
                                       &found);
    double tflops = 0;
    if (found)
        tflops = 2.0 * n * (double)n * n / (time_ms(lt_run, &m, 20) * 1e-3) / 1e12;
    else
        fprintf(stderr, "moe-bench: cuBLASLt found no FP8 algorithm; no FP8 ceiling\n");
    CK(cudaGetLastError());
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (m.la) cublasLtMatrixLayoutDestroy(m.la);
    if (m.lb) cublasLtMatrixLayoutDestroy(m.lb);
    if (m.lc) cublasLtMatrixLayoutDestroy(m.lc);
    if (m.op) cublasLtMatmulDescDestroy(m.op);
    if (m.lt) cublasLtDestroy(m.lt);
    cudaFree(m.a);
    cudaFree(m.b);
    cudaFree(m.c);
    cudaFree(m.ws);
    return tflops;
}

static void ceilings(void)
{
    g_fp8_tflops = fp8_ceiling(8192);
    const int n = 8192, reps = 20;
    void *a, *b, *c;
    CK(cudaMalloc(&a, (size_t)n * n * 2));
    CK(cudaMalloc(&b, (size_t)n * n * 2));
    CK(cudaMalloc(&c, (size_t)n * n * 2));
    bench_fill(a, MOED_BF16, (size_t)n * n, 1, 1.0f);
    bench_fill(b, MOED_BF16, (size_t)n * n, 2, 1.0f);
    cublasHandle_t h;
    cublasCreate(&h);
    const float alpha = 1, beta = 0;
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    double t[32];
    for (int i = 0; i < reps + 5; i++) {
        cudaEventRecord(e0, 0);
        cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &alpha, a, CUDA_R_16BF, n, b,
                     CUDA_R_16BF, n, &beta, c, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F,
                     CUBLAS_GEMM_DEFAULT);
        cudaEventRecord(e1, 0);
        CK(cudaEventSynchronize(e1));
        float ms;
        cudaEventElapsedTime(&ms, e0, e1);
        if (i >= 5) t[i - 5] = ms;
    }
    g_matmul_tflops = 2.0 * n * (double)n * n / (median(t, reps) * 1e-3) / 1e12;
    cublasDestroy(h);
    cudaFree(c);
    cudaFree(b);
    cudaFree(a);
    const size_t bytes = (size_t)2 << 30;
    CK(cudaMalloc(&a, bytes));
    CK(cudaMalloc(&b, bytes));
    bench_fill(a, MOED_F32, bytes / 4, 3, 1.0f);
    for (int i = 0; i < reps + 3; i++) {
        cudaEventRecord(e0, 0);
        cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, 0);
        cudaEventRecord(e1, 0);
        CK(cudaEventSynchronize(e1));
        float ms;
        cudaEventElapsedTime(&ms, e0, e1);
        if (i >= 3) t[i - 3] = ms;
    }
    g_copy_gbs = 2.0 * bytes / (median(t, reps) * 1e-3) / 1e9;
    cudaFree(a);
    cudaFree(b);
}

/* The headroom line: for each expert with rows, cuBLAS up (cnt x 2ff x d) then down (cnt x d x ff)
 * on contiguous rows — the dense GEMM time of the same work, with no gather, SwiGLU or combine. */
static double bench_cublas(const shape *s, const moed_cuda_layer_dev *L, const int64_t *counts,
                           int64_t P, void *xp, void *h, void *y)
{
    const float alpha = 1, beta = 0;
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    double t[64];
    int n = 0;
    for (int it = 0; it < 23; it++) {
        cudaEventRecord(e0, 0);
        int64_t row = 0;
        for (int e = 0; e < s->E; e++) {
            const int m = (int)counts[e];
            if (!m) continue;
            const int d = L->d_pad, ff = L->ff_pad;
            const char *w13 = (const char *)L->w13 + (size_t)e * L->n_up * d * 2;
            const char *w2 = (const char *)L->w2 + (size_t)e * d * ff * 2;
            cublasGemmEx(g_cublas, CUBLAS_OP_T, CUBLAS_OP_N, L->n_up, m, d, &alpha, w13,
                         CUDA_R_16BF, d, (const char *)xp + (size_t)row * d * 2, CUDA_R_16BF, d,
                         &beta, (char *)h + (size_t)row * L->n_up * 2, CUDA_R_16BF, L->n_up,
                         CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
            cublasGemmEx(g_cublas, CUBLAS_OP_T, CUBLAS_OP_N, d, m, ff, &alpha, w2, CUDA_R_16BF, ff,
                         (const char *)h + (size_t)row * L->n_up * 2, CUDA_R_16BF, L->n_up, &beta,
                         (char *)y + (size_t)row * d * 2, CUDA_R_16BF, d, CUBLAS_COMPUTE_32F,
                         CUBLAS_GEMM_DEFAULT);
            row += m;
        }
        cudaEventRecord(e1, 0);
        CK(cudaEventSynchronize(e1));
        float ms;
        cudaEventElapsedTime(&ms, e0, e1);
        if (it >= 3) t[n++] = ms;
    }
    (void)P;
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    return median(t, n);
}

/* Times the pipeline for one shape (weights resident in L) at T tokens with one routing rule. */
static void bench_one(const shape *s, const moed_cuda_layer_dev *L, int sm, int64_t T,
                      const char *routing, const char *kernel, double min_ms, int with_cublas,
                      int graph, run *out)
{
    const int E = s->E, k = s->k, force = moed_cuda_kernel_parse(kernel);
    const int64_t P = T * k;
    int64_t *off = malloc(sizeof(int64_t) * (size_t)(T + 1));
    int32_t *ex = malloc(sizeof(int32_t) * (size_t)P);
    float *w = malloc(sizeof(float) * (size_t)P);
    uint8_t *seen = calloc((size_t)E, 1);
    int active = 0;
    for (int64_t t = 0; t < T; t++) {
        off[t] = t * k;
        bench_choose(routing, E, k, &rng, ex + t * k);
        for (int j = 0; j < k; j++) {
            w[t * k + j] = (float)(0.1 + 0.9 * urand());
            if (!seen[ex[t * k + j]]) {
                seen[ex[t * k + j]] = 1;
                active++;
            }
        }
    }
    off[T] = P;

    const int bm = moed_cuda_tile_bm(sm, P, active, moed_cuda_routed_wfmt(L), force);
    const size_t words =
        moed_cuda_route_words(T, P, E, moed_cuda_route_max_tiles((int32_t)P, E, bm));
    int32_t *hroute = malloc(4 * moed_cuda_route_in_words(T, P)), *droute;
    const moed_cuda_route_src src = { off, ex, w, off, NULL, 0 };
    moed_cuda_route_pack(hroute, &src, 0, T);
    CK(cudaMalloc((void **)&droute, words * 4));
    CK(cudaMemcpy(droute, hroute, 4 * moed_cuda_route_in_words(T, P), cudaMemcpyHostToDevice));
    moed_cuda_route_dev r;
    memset(&r, 0, sizeof r);
    moed_cuda_route_layout(&r, droute, T, P, E, bm);

    void *x, *y;
    moed_cuda_work_dev wk;
    memset(&wk, 0, sizeof wk);
    CK(cudaMalloc(&x, (size_t)T * s->d * 2));
    CK(cudaMalloc(&y, (size_t)T * s->d * 2));
    CK(cudaMalloc(&wk.xc, (size_t)T * L->d_pad * 2));
    CK(cudaMalloc(&wk.h, (size_t)P * L->ff_pad * 2));
    CK(cudaMalloc(&wk.y, (size_t)P * L->d_pad * 2));
    if (L->wdtype == MOED_FP8) { /* quantized X and H, as cuda_pool.c sizes them */
        wk.xs_ld = T;
        wk.hs_ld = P;
        CK(cudaMalloc(&wk.xq, (size_t)T * L->d_pad));
        CK(cudaMalloc((void **)&wk.xs, sizeof(float) * (size_t)wk.xs_ld * (L->d_pad / 128)));
        CK(cudaMalloc(&wk.hq, (size_t)P * L->ff_pad));
        CK(cudaMalloc((void **)&wk.hs_scale, sizeof(float) * (size_t)wk.hs_ld * (L->ff_pad / 128)));
    }
    bench_fill(x, MOED_BF16, (size_t)T * s->d, 7, 1.0f);

    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    cudaEvent_t ev[7];
    for (int i = 0; i < 7; i++) cudaEventCreate(&ev[i]);
    /* --graph: the pipeline captured once and replayed, as the backend runs small batches (the
     * stage events cannot live inside the graph, so only the total is timed). */
    cudaGraphExec_t gexec = NULL;
    if (graph) {
        cudaGraph_t gr;
        CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
        int rc = moed_cuda_pipeline(L, &r, &wk, x, MOED_BF16, y, sm, active, force,
                                    (moed_cuda_stream)st, NULL);
        CK(cudaStreamEndCapture(st, &gr));
        if (rc) {
            fprintf(stderr, "moe-bench: capture refused (%d)\n", rc);
            exit(1);
        }
        CK(cudaGraphInstantiate(&gexec, gr, 0));
        cudaGraphDestroy(gr);
    }
    double tot[512], stage[6][512];
    int n = 0;
    double spent = 0;
    for (int it = 0; n < 512 && (it < 3 || spent < min_ms || n < 10); it++) {
        cudaEventRecord(ev[6], st);
        int rc = 0;
        if (gexec) { /* only the end: each record is work on the stream, a microsecond or so */
            CK(cudaGraphLaunch(gexec, st));
            cudaEventRecord(ev[5], st);
        } else {
            rc = moed_cuda_pipeline(L, &r, &wk, x, MOED_BF16, y, sm, active, force,
                                    (moed_cuda_stream)st, (void *const *)ev);
        }
        if (rc) {
            fprintf(stderr, "moe-bench: pipeline refused (%d) for %s T=%lld\n", rc, s->name,
                    (long long)T);
            exit(1);
        }
        CK(cudaEventSynchronize(ev[5]));
        if (it < 3) continue; /* warm-up */
        float ms;
        cudaEventElapsedTime(&ms, ev[6], ev[5]);
        tot[n] = ms;
        spent += ms;
        for (int i = 0; i < 6; i++) {
            ms = 0.0f;
            if (!gexec) cudaEventElapsedTime(&ms, i ? ev[i - 1] : ev[6], ev[i]);
            stage[i][n] = ms;
        }
        n++;
    }
    CK(cudaGetLastError());

    memset(out, 0, sizeof *out);
    snprintf(out->shape, sizeof out->shape, "%s", s->name);
    snprintf(out->routing, sizeof out->routing, "%s", routing);
    snprintf(out->kernel, sizeof out->kernel, "%s%s", kernel, graph ? "+g" : "");
    snprintf(out->weights, sizeof out->weights, "%s",
             L->sparse24 ? "sp24" : moed_dtype_name(L->wdtype));
    out->T = T;
    out->P = P;
    out->active = active;
    out->bm = bm;
    out->ms = median(tot, n);
    for (int i = 0; i < 6; i++) out->stage_ms[i] = median(stage[i], n);
    const double flops = 2.0 * P * s->d * 3.0 * s->ff;
    const double wb = L->wdtype == MOED_FP8 ? 1.0 + 4.0 / (128.0 * 128.0)
                      : L->sparse24         ? 2.0 * 0.5625
                                            : 2.0;
    const double bytes = (double)active * 3.0 * s->ff * s->d * wb + 2.0 * T * s->d * 2;
    out->tflops = flops / (out->ms * 1e-3) / 1e12;
    out->gbs = bytes / (out->ms * 1e-3) / 1e9;
    if (with_cublas && L->wdtype != MOED_FP8 && !L->sparse24) {
        int64_t *counts = calloc((size_t)E, sizeof *counts);
        for (int64_t p = 0; p < P; p++) counts[ex[p]]++;
        void *hh, *yy; /* cuBLAS writes both halves of the up output, then [P, d] */
        CK(cudaMalloc(&hh, (size_t)P * L->n_up * 2));
        CK(cudaMalloc(&yy, (size_t)P * L->d_pad * 2));
        out->cublas_ms = bench_cublas(s, L, counts, P, wk.y, hh, yy);
        cudaFree(hh);
        cudaFree(yy);
        free(counts);
    }

    if (gexec) cudaGraphExecDestroy(gexec);
    for (int i = 0; i < 7; i++) cudaEventDestroy(ev[i]);
    cudaStreamDestroy(st);
    cudaFree(x);
    cudaFree(y);
    cudaFree(wk.xc);
    cudaFree(wk.h);
    cudaFree(wk.y);
    cudaFree(wk.xq);
    cudaFree(wk.xs);
    cudaFree(wk.hq);
    cudaFree(wk.hs_scale);
    cudaFree(droute);
    free(hroute);
    free(off);
    free(ex);
    free(w);
    free(seen);
}

/* Splits a comma list in place; returns the count. */
static int split(char *s, char **out, int max)
{
    int n = 0;
    for (char *tok = strtok(s, ","); tok && n < max; tok = strtok(NULL, ",")) out[n++] = tok;
    return n;
}

/* Random metadata for n words of 2:4 metadata: every group one of the six valid position pairs
 * (first index below the second). One expert's worth is made on the host and copied to each. */
static void fill_meta(uint32_t *dev, int E, size_t per_expert)
{
    static const uint32_t pairs[6] = { 0x4, 0x8, 0xc, 0x9, 0xd, 0xe };
    uint32_t *h = malloc(4 * per_expert);
    for (size_t i = 0; i < per_expert; i++) {
        uint32_t w = 0;
        for (int q = 0; q < 8; q++) w |= pairs[(int)(urand() * 6)] << (4 * q);
        h[i] = w;
    }
    for (int e = 0; e < E; e++)
        CK(cudaMemcpy(dev + (size_t)e * per_expert, h, 4 * per_expert, cudaMemcpyHostToDevice));
    free(h);
}

/* Device weights of one shape in the backend's layout (d and ff padded to MOED_CUDA_PAD, W1|W3
 * interleaved, SwiGLU): bf16, FP8 (random codes, scales that make them uniform in the same range
 * as the bf16 ones), or 2:4 sparse (wfmt MOED_CUDA_SP24: random kept values in the same range,
 * random valid metadata). */
static void make_layer(const shape *s, int wfmt, moed_cuda_layer_dev *L)
{
    const int pad = MOED_CUDA_PAD, fp8 = wfmt == MOED_FP8, sp = wfmt == MOED_CUDA_SP24;
    memset(L, 0, sizeof *L);
    L->cdtype = MOED_BF16;
    L->wdtype = sp ? MOED_BF16 : wfmt;
    L->sparse24 = sp;
    L->act = 1; /* SwiGLU */
    L->d = s->d;
    L->d_pad = (s->d + pad - 1) / pad * pad;
    L->E = s->E;
    L->ff_pad = (s->ff + pad - 1) / pad * pad;
    L->n_up = 2 * L->ff_pad;
    const size_t n13 = (size_t)s->E * L->n_up * L->d_pad, n2 = (size_t)s->E * L->d_pad * L->ff_pad;
    const size_t eb = fp8 ? 1 : 2, kept = sp ? 2 : 1; /* bytes an element; 1 in kept stored */
    void *w13, *w2;
    CK(cudaMalloc(&w13, n13 / kept * eb));
    CK(cudaMalloc(&w2, n2 / kept * eb));
    if (sp) {
        uint32_t *m13, *m2;
        CK(cudaMalloc((void **)&m13, 4 * MOED_CUDA_SP24_META_WORDS(n13, 1)));
        CK(cudaMalloc((void **)&m2, 4 * MOED_CUDA_SP24_META_WORDS(n2, 1)));
        fill_meta(m13, s->E, MOED_CUDA_SP24_META_WORDS(n13 / s->E, 1));
        fill_meta(m2, s->E, MOED_CUDA_SP24_META_WORDS(n2 / s->E, 1));
        bench_fill(w13, MOED_BF16, n13 / 2, 11, sqrtf(6.0f / s->d));
        bench_fill(w2, MOED_BF16, n2 / 2, 12, sqrtf(6.0f / s->ff));
        L->w13_meta = m13;
        L->w2_meta = m2;
    } else if (fp8) {
        float *s13, *s2;
        const size_t c13 = n13 / (MOED_CUDA_FP8_K * MOED_CUDA_FP8_SROWS),
                     c2 = n2 / (MOED_CUDA_FP8_K * MOED_CUDA_FP8_SROWS);
        CK(cudaMalloc((void **)&s13, c13 * sizeof(float)));
        CK(cudaMalloc((void **)&s2, c2 * sizeof(float)));
        bench_fill_fp8(w13, n13, 11);
        bench_fill_fp8(w2, n2, 12);
        bench_fill_value(s13, c13, sqrtf(3.0f / s->d) / 448.0f);
        bench_fill_value(s2, c2, sqrtf(3.0f / s->ff) / 448.0f);
        L->w13_scale = s13;
        L->w2_scale = s2;
    } else {
        bench_fill(w13, MOED_BF16, n13, 11, sqrtf(3.0f / s->d));
        bench_fill(w2, MOED_BF16, n2, 12, sqrtf(3.0f / s->ff));
    }
    L->w13 = w13;
    L->w2 = w2;
}

static void free_layer(moed_cuda_layer_dev *L)
{
    cudaFree((void *)L->w13);
    cudaFree((void *)L->w2);
    cudaFree((void *)L->w13_scale);
    cudaFree((void *)L->w2_scale);
    cudaFree((void *)L->w13_meta);
    cudaFree((void *)L->w2_meta);
}

static void print_run(const run *r, const shape *s)
{
    const double ceil =
        !strcmp(r->weights, "fp8") && g_fp8_tflops > 0 ? g_fp8_tflops : g_matmul_tflops;
    printf("%-14s %-4s %6lld %-8s %-7s %4d %9.3f %8.1f %8.0f %5.1f%% %5.1f%%  %.3f %.3f %.3f %.3f "
           "%.3f %.3f\n",
           r->shape, r->weights, (long long)r->T, r->routing, r->kernel, r->bm, r->ms, r->tflops,
           r->gbs, 100 * r->tflops / ceil, 100 * r->gbs / g_copy_gbs, r->stage_ms[0],
           r->stage_ms[1], r->stage_ms[2], r->stage_ms[3], r->stage_ms[4], r->stage_ms[5]);
    if (r->cublas_ms > 0)
        printf("%-14s %6lld %-8s cublas per-expert GEMMs alone: %.3f ms (%.1f TFLOP/s)\n", r->shape,
               (long long)r->T, r->routing, r->cublas_ms,
               2.0 * r->P * s->d * 3.0 * s->ff / (r->cublas_ms * 1e-3) / 1e12);
    fflush(stdout);
}

static void write_json(const char *path, const struct cudaDeviceProp *prop, int sm, const run *runs,
                       int nruns)
{
    FILE *f = fopen(path, "w");
    if (!f) {
        perror(path);
        exit(1);
    }
    fprintf(f,
            "{\"device\": \"%s\", \"sm\": %d, \"matmul_tflops\": %.1f, \"fp8_matmul_tflops\": "
            "%.1f, \"copy_gbs\": %.1f, \"runs\": [\n",
            prop->name, sm, g_matmul_tflops, g_fp8_tflops, g_copy_gbs);
    for (int i = 0; i < nruns; i++) {
        const run *r = &runs[i];
        fprintf(f,
                "  {\"shape\": \"%s\", \"weights\": \"%s\", \"T\": %lld, \"routing\": \"%s\", "
                "\"kernel\": \"%s\", \"pairs\": %lld, \"active_experts\": %d, \"bm\": %d, \"ms\": "
                "%.4f, \"tflops\": %.2f, \"gbs\": %.1f, \"stages_ms\": {\"convert\": %.4f, "
                "\"route\": %.4f, \"up\": %.4f, \"down\": %.4f, \"shared\": %.4f, \"combine\": "
                "%.4f}, \"cublas_ms\": %.4f}%s\n",
                r->shape, r->weights, (long long)r->T, r->routing, r->kernel, (long long)r->P,
                r->active, r->bm, r->ms, r->tflops, r->gbs, r->stage_ms[0], r->stage_ms[1],
                r->stage_ms[2], r->stage_ms[3], r->stage_ms[4], r->stage_ms[5], r->cublas_ms,
                i + 1 < nruns ? "," : "");
    }
    fprintf(f, "]}\n");
    fclose(f);
}

#define MAX_SHAPES 16

/* --shape, repeatable: the words as given, each checked to be d,ff,E,k with k <= E. */
typedef struct shape_list {
    int n;
    shape v[MAX_SHAPES];
} shape_list;

static int add_shape(const char *value, void *field, moed_error *err)
{
    (void)err; /* the row's want says what is wrong */
    shape_list *l = field;
    if (l->n >= MAX_SHAPES) return -1;
    shape *s = &l->v[l->n];
    char end;
    if (sscanf(value, "%d,%d,%d,%d%c", &s->d, &s->ff, &s->E, &s->k, &end) != 4 || s->d < 1 ||
        s->ff < 1 || s->E < 1 || s->k < 1 || s->k > s->E)
        return -1;
    snprintf(s->name, sizeof s->name, "%d,%d,%d,%d", s->d, s->ff, s->E, s->k);
    l->n++;
    return 0;
}

typedef struct bench_args {
    const char *shapes, *weights, *tokens, *routing, *kernel, *json;
    shape_list custom;
    double min_ms;
    int cublas, graph;
} bench_args;

#define F(x) offsetof(bench_args, x)
static const moed_opt options[] = {
    MOED_OPT_SECTION_ROW("what to run:", NULL),
    MOED_OPT_STR_ROW("shapes", F(shapes), "LIST", "mixtral,qwen3-30b-a3b,deepseek-v3", NULL,
                     "standard shapes: mixtral (d 4096, ff 14336, E 8, k 2), qwen3-30b-a3b\n"
                     "(2048, 768, 128, 8), deepseek-v3 (7168, 2048, 256, 8); given with --shape,\n"
                     "these run first"),
    MOED_OPT_CUSTOM_ROW("shape", F(custom), "d,ff,E,k", add_shape, NULL,
                        "give d,ff,E,k with 1 <= k <= E, at most 16 times", NULL,
                        "any layer, d and ff padded to 128 as the backend pads them; repeatable;\n"
                        "alone (without --shapes) it runs just these"),
    MOED_OPT_STR_ROW("weights", F(weights), "LIST", "bf16", NULL,
                     "bf16, fp8, sparse24 (2:4 sparse, compressed, on the Sparse Tensor Cores)\n"
                     "or a list of them, each timed on the same shapes and T"),
    MOED_OPT_STR_ROW("tokens", F(tokens), "LIST", "8,64,512,4096,16384", NULL, "batch sizes T"),
    MOED_OPT_STR_ROW("routing", F(routing), "LIST", "uniform", NULL,
                     "uniform, zipf (P(e) ~ 1/(e+1)^1.2), hot (every token's first choice\n"
                     "expert 0), empty (half the experts get none)"),
    MOED_OPT_STR_ROW("kernel", F(kernel), "LIST", "auto", NULL,
                     "auto (the heuristic table), sm80, sm90, sm90p; for FP8 weights sm80 is the\n"
                     "portable path and sm90 the FP8 Tensor Core kernel"),
    MOED_OPT_SECTION_ROW("how:", NULL),
    MOED_OPT_NUM_ROW("min-ms", F(min_ms), "MS", 1e-3, 1e7, "200", "give milliseconds > 0", NULL,
                     "time each row for at least MS milliseconds"),
    MOED_OPT_FLAG_ROW("cublas", F(cublas), 1, NULL,
                      "add the headroom line (bf16 weights): the same per-expert GEMMs through\n"
                      "cuBLAS on pre-permuted rows, no epilogues"),
    MOED_OPT_FLAG_ROW("graph", F(graph), 1, NULL,
                      "time the pipeline captured as a CUDA graph and replayed (what the backend\n"
                      "does for small batches)"),
    MOED_OPT_STR_ROW("json", F(json), "FILE", NULL, NULL,
                     "write every figure, stage times included"),
    MOED_OPT_HELP_ROW("this text"),
};
#undef F

static const moed_opt_cmd tool = {
    .head = "usage: moe-bench [options]\n"
            "\n"
            "Times the CUDA backend's expert pipeline (route prep, up GEMM, down GEMM, combine)\n"
            "on device-resident data beside the ceilings measured in the same run.\n",
    .tail = "exit codes: 0 done; 1 no CUDA device or a CUDA call failed; 2 bad usage\n",
};

static const moed_opt_spec command_line = MOED_OPT_TOOL_SPEC("moe-bench", options, tool);

/* The shapes to run: the named ones, then the --shape ones; 0 after a usage error printed. */
static int pick_shapes(char *names, const shape_list *custom, shape *out)
{
    char *sh[MAX_SHAPES];
    int n = 0, nn = names[0] ? split(names, sh, MAX_SHAPES) : 0;
    for (int i = 0; i < nn; i++) {
        const shape *s = NULL;
        for (size_t j = 0; j < sizeof shapes / sizeof shapes[0]; j++)
            if (!strcmp(sh[i], shapes[j].name)) s = &shapes[j];
        if (!s) {
            moed_opt_usage(&command_line, "unknown shape %s in --shapes", sh[i]);
            return 0;
        }
        out[n++] = *s;
    }
    for (int i = 0; i < custom->n && n < MAX_SHAPES; i++) out[n++] = custom->v[i];
    return n;
}

int main(int argc, char **argv)
{
    bench_args o = { 0 };
    moed_opt_parsed p;
    int rc;
    if (!moed_opt_parse(&command_line, argc, argv, &o, &p, &rc)) return rc;
    /* strtok writes into the lists: copies of the words */
    char shapes_arg[256], tokens_arg[256], routing_arg[128], kernel_arg[64], weights_arg[32];
    snprintf(shapes_arg, sizeof shapes_arg, "%s",
             o.custom.n && !moed_opt_given(&command_line, &p, "shapes") ? "" : o.shapes);
    snprintf(tokens_arg, sizeof tokens_arg, "%s", o.tokens);
    snprintf(routing_arg, sizeof routing_arg, "%s", o.routing);
    snprintf(kernel_arg, sizeof kernel_arg, "%s", o.kernel);
    snprintf(weights_arg, sizeof weights_arg, "%s", o.weights);
    const double min_ms = o.min_ms;
    const char *json = o.json;
    const int with_cublas = o.cublas, graph = o.graph;
    shape sel[MAX_SHAPES];
    const int nsh = pick_shapes(shapes_arg, &o.custom, sel);
    if (!nsh) return MOED_OPT_EXIT_USAGE;
    char *tk[16], *rt[8], *kn[4], *wt[3];
    const int ntk = split(tokens_arg, tk, 16), nrt = split(routing_arg, rt, 8),
              nkn = split(kernel_arg, kn, 4), nwt = split(weights_arg, wt, 3);
    int wfmt[3];
    for (int i = 0; i < nwt; i++) {
        wfmt[i] = !strcmp(wt[i], "sparse24") ? MOED_CUDA_SP24 : moed_dtype_parse(wt[i]);
        if (wfmt[i] != MOED_BF16 && wfmt[i] != MOED_FP8 && wfmt[i] != MOED_CUDA_SP24)
            return moed_opt_usage(&command_line, "--weights %s: use bf16, fp8, sparse24", wt[i]);
    }
    for (int i = 0; i < ntk; i++) {
        char *end;
        const long long t = strtoll(tk[i], &end, 10);
        if (*end || t < 1 || t > (1 << 20))
            return moed_opt_usage(&command_line, "--tokens %s: give batch sizes 1 to 1048576",
                                  tk[i]);
    }
    for (int i = 0; i < nrt; i++)
        if (strcmp(rt[i], "uniform") && strcmp(rt[i], "zipf") && strcmp(rt[i], "hot") &&
            strcmp(rt[i], "empty"))
            return moed_opt_usage(&command_line, "--routing %s: use uniform, zipf, hot or empty",
                                  rt[i]);
    for (int i = 0; i < nkn; i++)
        if (strcmp(kn[i], "auto") && !moed_cuda_kernel_parse(kn[i]))
            return moed_opt_usage(&command_line, "--kernel %s: use auto, sm80, sm90 or sm90p",
                                  kn[i]);
    int dev = 0;
    struct cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, dev) != cudaSuccess) {
        fprintf(stderr, "moe-bench: no CUDA device\n");
        return 1;
    }
    const int sm = prop.major * 10 + prop.minor;
    fprintf(stderr, "moe-bench: %s (sm_%d, %d SMs); measuring ceilings\n", prop.name, sm,
            prop.multiProcessorCount);
    ceilings();
    cublasCreate(&g_cublas);
    printf("device %s: ceilings %.0f TFLOP/s (cuBLAS bf16 8192^3), %.0f TFLOP/s (cuBLASLt FP8 "
           "e4m3 8192^3), %.0f GB/s (D2D copy, read+write)\n",
           prop.name, g_matmul_tflops, g_fp8_tflops, g_copy_gbs);
    printf("%-14s %-4s %6s %-8s %-7s %4s %9s %8s %8s %6s %6s  %s\n", "shape", "w", "T", "routing",
           "kern", "bm", "ms", "TFLOP/s", "GB/s", "%mm", "%copy",
           "stages ms: convert route up down shared combine");

    run *runs = calloc(512, sizeof *runs);
    int nruns = 0;
    for (int i = 0; i < nsh; i++)
        for (int w = 0; w < nwt; w++) {
            const shape *s = &sel[i];
            moed_cuda_layer_dev L;
            make_layer(s, wfmt[w], &L);
            for (int a = 0; a < ntk; a++)
                for (int b = 0; b < nrt; b++)
                    for (int c = 0; c < nkn && nruns < 512; c++) {
                        run *r = &runs[nruns++];
                        bench_one(s, &L, sm, atoll(tk[a]), rt[b], kn[c], min_ms, with_cublas, graph,
                                  r);
                        print_run(r, s);
                    }
            free_layer(&L);
        }
    if (json) write_json(json, &prop, sm, runs, nruns);
    free(runs);
    return 0;
}
