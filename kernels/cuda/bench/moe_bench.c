/*
 * moe_bench — the kernel benchmark: the whole expert pipeline of the CUDA backend
 * (moed_cuda_pipeline: route prep → up GEMM → down GEMM → combine) on device-resident data, for the
 * standard shapes (bf16: mixtral d 4096 ff 14336 E 8 k 2; qwen3-30b-a3b d 2048 ff 768 E 128 k 8;
 * deepseek-v3 d 7168 ff 2048 E 256 k 8) and T = 8 to 16384, timed with CUDA events (median of many
 * runs after warm-up) on random, never-zero data, beside the two ceilings measured in the same
 * run: a large cuBLAS bf16 matmul and a large device-to-device copy (bytes read plus written).
 * Counted work: FLOPs = 2·pairs·d·3·ff; minimum bytes = the weights of every expert that received a
 * token + activations in and out.
 *
 * usage: moe-bench [--shapes mixtral,qwen3-30b-a3b,deepseek-v3] [--tokens 8,64,512,4096,16384]
 *                  [--routing uniform,zipf,hot,empty] [--kernel auto,sm80,sm90,sm90p]
 *                  [--min-ms 200] [--cublas] [--graph] [--json FILE]
 * Prints one table row per run; --json writes every figure, the stage times included. --cublas adds
 * the headroom line: the same per-expert GEMMs through cuBLAS on pre-permuted rows, no epilogues.
 * --graph times the pipeline captured as a CUDA graph and replayed (what the backend does for small
 * batches).
 */
#include "bench.h"
#include "moed_cuda.h"

#include "moed_dtype.h"
#include "moed_synth.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct shape {
    const char *name;
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

/* One token's k distinct experts by the routing rule. */
static void choose(const char *routing, int E, int k, int32_t *out)
{
    for (int j = 0; j < k; j++) {
        int32_t e;
        int dup;
        do {
            if (!strcmp(routing, "zipf")) { /* P(e) ∝ 1/(e+1)^1.2, by inversion over the table */
                double u = urand(), z = 0, acc = 0;
                for (int i = 0; i < E; i++) z += pow(i + 1, -1.2);
                e = E - 1;
                for (int i = 0; i < E; i++)
                    if ((acc += pow(i + 1, -1.2) / z) >= u) {
                        e = i;
                        break;
                    }
            } else if (!strcmp(routing, "hot") && j == 0) {
                e = 0; /* every token sends one pair to expert 0 */
            } else if (!strcmp(routing, "empty")) {
                e = (int32_t)(urand() *
                              (E / 4 > k ? E / 4 : k)); /* three quarters of the experts idle */
            } else {
                e = (int32_t)(urand() * E);
            }
            dup = 0;
            for (int i = 0; i < j; i++) dup |= out[i] == e;
        } while (dup);
        out[j] = e;
    }
}

typedef struct run {
    char shape[32], routing[16], kernel[12];
    int64_t T, P;
    int active, bm;
    double ms, stage_ms[6], tflops, gbs;
    double
        cublas_ms; /* the same per-expert GEMMs through cuBLAS, pre-permuted rows, no epilogues */
} run;

static double g_matmul_tflops, g_copy_gbs;
static cublasHandle_t g_cublas;

static void ceilings(void)
{
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
            const char *w13 = (const char *)L->w13 + (size_t)e * L->n_up * s->d * 2;
            const char *w2 = (const char *)L->w2 + (size_t)e * s->d * s->ff * 2;
            cublasGemmEx(g_cublas, CUBLAS_OP_T, CUBLAS_OP_N, L->n_up, m, s->d, &alpha, w13,
                         CUDA_R_16BF, s->d, (const char *)xp + (size_t)row * s->d * 2, CUDA_R_16BF,
                         s->d, &beta, (char *)h + (size_t)row * L->n_up * 2, CUDA_R_16BF, L->n_up,
                         CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
            cublasGemmEx(g_cublas, CUBLAS_OP_T, CUBLAS_OP_N, s->d, m, s->ff, &alpha, w2,
                         CUDA_R_16BF, s->ff, (const char *)h + (size_t)row * L->n_up * 2,
                         CUDA_R_16BF, L->n_up, &beta, (char *)y + (size_t)row * s->d * 2,
                         CUDA_R_16BF, s->d, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
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
        choose(routing, E, k, ex + t * k);
        for (int j = 0; j < k; j++) {
            w[t * k + j] = (float)(0.1 + 0.9 * urand());
            if (!seen[ex[t * k + j]]) {
                seen[ex[t * k + j]] = 1;
                active++;
            }
        }
    }
    off[T] = P;

    const int bm = moed_cuda_tile_bm(P, active, force);
    const size_t words =
        moed_cuda_route_words(T, P, E, moed_cuda_route_max_tiles((int32_t)P, E, bm));
    int32_t *hroute = malloc(4 * moed_cuda_route_in_words(T, P)), *droute;
    moed_cuda_route_pack(hroute, off, ex, w, 0, T);
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
        if (gexec) {
            CK(cudaGraphLaunch(gexec, st));
            for (int i = 0; i < 6; i++) cudaEventRecord(ev[i], st);
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
            cudaEventElapsedTime(&ms, i ? ev[i - 1] : ev[6], ev[i]);
            stage[i][n] = ms;
        }
        n++;
    }
    CK(cudaGetLastError());

    memset(out, 0, sizeof *out);
    snprintf(out->shape, sizeof out->shape, "%s", s->name);
    snprintf(out->routing, sizeof out->routing, "%s", routing);
    snprintf(out->kernel, sizeof out->kernel, "%s%s", kernel, graph ? "+g" : "");
    out->T = T;
    out->P = P;
    out->active = active;
    out->bm = bm;
    out->ms = median(tot, n);
    for (int i = 0; i < 6; i++) out->stage_ms[i] = median(stage[i], n);
    const double flops = 2.0 * P * s->d * 3.0 * s->ff;
    const double bytes = (double)active * 3.0 * s->ff * s->d * 2 + 2.0 * T * s->d * 2;
    out->tflops = flops / (out->ms * 1e-3) / 1e12;
    out->gbs = bytes / (out->ms * 1e-3) / 1e9;
    if (with_cublas) {
        int64_t *counts = calloc((size_t)E, sizeof *counts);
        for (int64_t p = 0; p < P; p++) counts[ex[p]]++;
        void *hh, *yy; /* cuBLAS writes both halves of the up output, then [P, d] */
        CK(cudaMalloc(&hh, (size_t)P * L->n_up * 2));
        CK(cudaMalloc(&yy, (size_t)P * s->d * 2));
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

int main(int argc, char **argv)
{
    char shapes_arg[256] = "mixtral,qwen3-30b-a3b,deepseek-v3",
         tokens_arg[256] = "8,64,512,4096,16384";
    char routing_arg[128] = "uniform", kernel_arg[64] = "auto";
    const char *json = NULL;
    double min_ms = 200;
    int with_cublas = 0, graph = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--shapes") && v)
            snprintf(shapes_arg, sizeof shapes_arg, "%s", argv[++i]);
        else if (!strcmp(a, "--tokens") && v)
            snprintf(tokens_arg, sizeof tokens_arg, "%s", argv[++i]);
        else if (!strcmp(a, "--routing") && v)
            snprintf(routing_arg, sizeof routing_arg, "%s", argv[++i]);
        else if (!strcmp(a, "--kernel") && v)
            snprintf(kernel_arg, sizeof kernel_arg, "%s", argv[++i]);
        else if (!strcmp(a, "--min-ms") && v)
            min_ms = atof(argv[++i]);
        else if (!strcmp(a, "--json") && v)
            json = argv[++i];
        else if (!strcmp(a, "--cublas"))
            with_cublas = 1;
        else if (!strcmp(a, "--graph"))
            graph = 1;
        else {
            fprintf(stderr, "usage: moe-bench [--shapes LIST] [--tokens LIST] [--routing "
                            "uniform,zipf,hot,empty] "
                            "[--kernel auto,sm80,sm90,sm90p] [--min-ms MS] [--cublas] [--graph] "
                            "[--json FILE]\n");
            return 2;
        }
    }
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
    printf(
        "device %s: ceilings %.0f TFLOP/s (cuBLAS bf16 8192^3), %.0f GB/s (D2D copy, read+write)\n",
        prop.name, g_matmul_tflops, g_copy_gbs);
    printf("%-14s %6s %-8s %-7s %4s %9s %8s %8s %6s %6s  %s\n", "shape", "T", "routing", "kern",
           "bm", "ms", "TFLOP/s", "GB/s", "%mm", "%copy",
           "stages ms: convert route up down shared combine");

    char *sh[8], *tk[16], *rt[8], *kn[4];
    const int nsh = split(shapes_arg, sh, 8), ntk = split(tokens_arg, tk, 16),
              nrt = split(routing_arg, rt, 8), nkn = split(kernel_arg, kn, 4);
    run *runs = calloc(512, sizeof *runs);
    int nruns = 0;
    for (int i = 0; i < nsh; i++) {
        const shape *s = NULL;
        for (size_t j = 0; j < sizeof shapes / sizeof shapes[0]; j++)
            if (!strcmp(sh[i], shapes[j].name)) s = &shapes[j];
        if (!s) {
            fprintf(stderr, "moe-bench: unknown shape %s\n", sh[i]);
            return 2;
        }
        moed_cuda_layer_dev L;
        memset(&L, 0, sizeof L);
        L.cdtype = MOED_BF16;
        L.act = 1; /* SwiGLU */
        L.d = L.d_pad = s->d;
        L.E = s->E;
        L.ff_pad = s->ff;
        L.n_up = 2 * s->ff;
        void *w13, *w2;
        CK(cudaMalloc(&w13, (size_t)s->E * L.n_up * s->d * 2));
        CK(cudaMalloc(&w2, (size_t)s->E * s->d * s->ff * 2));
        bench_fill(w13, MOED_BF16, (size_t)s->E * L.n_up * s->d, 11, sqrtf(3.0f / s->d));
        bench_fill(w2, MOED_BF16, (size_t)s->E * s->d * s->ff, 12, sqrtf(3.0f / s->ff));
        L.w13 = w13;
        L.w2 = w2;
        for (int a = 0; a < ntk; a++)
            for (int b = 0; b < nrt; b++)
                for (int c = 0; c < nkn && nruns < 512; c++) {
                    run *r = &runs[nruns++];
                    bench_one(s, &L, sm, atoll(tk[a]), rt[b], kn[c], min_ms, with_cublas, graph, r);
                    printf("%-14s %6lld %-8s %-7s %4d %9.3f %8.1f %8.0f %5.1f%% %5.1f%%  %.3f %.3f "
                           "%.3f %.3f %.3f "
                           "%.3f\n",
                           r->shape, (long long)r->T, r->routing, r->kernel, r->bm, r->ms,
                           r->tflops, r->gbs, 100 * r->tflops / g_matmul_tflops,
                           100 * r->gbs / g_copy_gbs, r->stage_ms[0], r->stage_ms[1],
                           r->stage_ms[2], r->stage_ms[3], r->stage_ms[4], r->stage_ms[5]);
                    if (r->cublas_ms > 0)
                        printf("%-14s %6lld %-8s cublas per-expert GEMMs alone: %.3f ms (%.1f "
                               "TFLOP/s)\n",
                               r->shape, (long long)r->T, r->routing, r->cublas_ms,
                               2.0 * r->P * s->d * 3.0 * s->ff / (r->cublas_ms * 1e-3) / 1e12);
                    fflush(stdout);
                }
        cudaFree(w13);
        cudaFree(w2);
    }
    if (json) {
        FILE *f = fopen(json, "w");
        if (!f) {
            perror(json);
            return 1;
        }
        fprintf(f,
                "{\"device\": \"%s\", \"sm\": %d, \"matmul_tflops\": %.1f, \"copy_gbs\": %.1f, "
                "\"runs\": [\n",
                prop.name, sm, g_matmul_tflops, g_copy_gbs);
        for (int i = 0; i < nruns; i++) {
            const run *r = &runs[i];
            fprintf(
                f,
                "  {\"shape\": \"%s\", \"T\": %lld, \"routing\": \"%s\", \"kernel\": \"%s\", "
                "\"pairs\": %lld, "
                "\"active_experts\": %d, \"bm\": %d, \"ms\": %.4f, \"tflops\": %.2f, \"gbs\": "
                "%.1f, "
                "\"stages_ms\": {\"convert\": %.4f, \"route\": %.4f, \"up\": %.4f, \"down\": %.4f, "
                "\"shared\": %.4f, \"combine\": %.4f}, \"cublas_ms\": %.4f}%s\n",
                r->shape, (long long)r->T, r->routing, r->kernel, (long long)r->P, r->active, r->bm,
                r->ms, r->tflops, r->gbs, r->stage_ms[0], r->stage_ms[1], r->stage_ms[2],
                r->stage_ms[3], r->stage_ms[4], r->stage_ms[5], r->cublas_ms,
                i + 1 < nruns ? "," : "");
        }
        fprintf(f, "]}\n");
        fclose(f);
    }
    free(runs);
    return 0;
}
