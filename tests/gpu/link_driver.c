/*
 * link_driver — links against gRPC on a GPU machine, for the same daemons and the same inputs:
 *
 *   link_driver TARGETS DEVICE LAYER T K DTYPE SEED [N]
 *
 * TARGETS is one daemon or a comma-separated fleet (moedc_connect_many); DEVICE the caller's GPU;
 * DTYPE f32, f16 or bf16. It makes random hidden [T, d_model] and k distinct experts per token
 * (every third token's last pair padding) from SEED, puts them on DEVICE, and makes N calls
 * (default 20) over links (moedc_links_forward on a stream of its own) and N over gRPC
 * (moedc_forward with the same tensors from the host). It prints one JSON line: whether the outputs
 * are bit-identical and their largest absolute difference, p50 and p90 latency per call of each
 * transport, and tokens per second; it exits 1 on any mismatch or failure. Not run by ctest: it
 * needs daemons on GPUs, started by hand (the usage line above).
 */
#include "moed_dtype.h"
#include "moedclient.h"

#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_TARGETS 64

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double pct(double *v, int n, double p)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return v[(int)(p * (n - 1))];
}

static uint64_t rng_state;
static double uniform(void) /* splitmix64 */
{
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return (double)((z ^ (z >> 31)) >> 11) / 9007199254740992.0;
}

static int die(const char *what, const char *why)
{
    printf("{\"error\": \"%s: %s\"}\n", what, why);
    return 1;
}

int main(int argc, char **argv)
{
    if (argc < 8) {
        fprintf(stderr, "usage: %s TARGETS DEVICE LAYER T K DTYPE SEED [N]\n", argv[0]);
        return 2;
    }
    const char *targets[MAX_TARGETS];
    int n_targets = 0;
    for (char *t = strtok(argv[1], ","); t && n_targets < MAX_TARGETS; t = strtok(NULL, ","))
        targets[n_targets++] = t;
    const int device = atoi(argv[2]), layer = atoi(argv[3]), k = atoi(argv[5]);
    const int64_t T = atoll(argv[4]);
    const int dtype = moed_dtype_parse(argv[6]);
    rng_state = strtoull(argv[7], NULL, 10);
    const int N = argc > 8 ? atoi(argv[8]) : 20;
    if (!moed_dtype_is_float(dtype) || T < 1 || k < 1 || N < 1) return die("arguments", "invalid");
    moedc *c;
    moedc_error err;
    if (moedc_connect_many(targets, n_targets, NULL, &c, &err)) return die("connect", err.msg);
    moedc_model_info info;
    if (moedc_info(c, &info, &err)) return die("GetModel", err.msg);
    int64_t d = 0;
    int E = 0;
    for (int i = 0; i < info.n_layers; i++)
        if (info.layers[i].index == layer) d = info.layers[i].d_model, E = info.layers[i].n_experts;
    moedc_model_info_free(&info);
    if (!d || E < k) return die("layer", "not served, or fewer experts than k");

    const size_t es = moed_dtype_size(dtype), hb = (size_t)T * (size_t)d * es;
    const size_t pb = (size_t)T * (size_t)k * 4;
    float *x32 = malloc((size_t)T * (size_t)d * 4), *w = malloc(pb);
    int32_t *ids = malloc(pb);
    void *x = malloc(hb), *y_link = malloc(hb);
    for (int64_t i = 0; i < T * d; i++) x32[i] = (float)(uniform() * 2 - 1);
    moed_from_f32(dtype, x32, x, (size_t)(T * d));
    for (int64_t t = 0; t < T; t++)
        for (int j = 0; j < k; j++) {
            int e, again;
            do { /* k distinct experts */
                e = (int)(uniform() * E);
                again = 0;
                for (int q = 0; q < j; q++) again |= ids[t * k + q] == e;
            } while (again);
            ids[t * k + j] = e;
            w[t * k + j] = (float)(uniform() + 0.05);
        }
    for (int64_t t = 0; k > 1 && t < T; t += 3) ids[t * k + k - 1] = -1, w[t * k + k - 1] = 0;

    void *dx, *dy, *dids, *dw;
    cudaStream_t st;
    if (cudaSetDevice(device) || cudaMalloc(&dx, hb) || cudaMalloc(&dy, hb) ||
        cudaMalloc(&dids, pb) || cudaMalloc(&dw, pb) || cudaStreamCreate(&st) ||
        cudaMemcpy(dx, x, hb, cudaMemcpyHostToDevice) ||
        cudaMemcpy(dids, ids, pb, cudaMemcpyHostToDevice) ||
        cudaMemcpy(dw, w, pb, cudaMemcpyHostToDevice))
        return die("CUDA", cudaGetErrorString(cudaGetLastError()));

    moedc_links *l;
    moedc_links_opts o = { .device = device, .max_tokens = (uint32_t)T, .max_top_k = (uint32_t)k };
    if (moedc_links_open(c, &o, &l, &err)) return die("moedc_links_open", err.msg);
    double *lat_link = malloc(sizeof(double) * (size_t)N),
           *lat_grpc = malloc(sizeof(double) * (size_t)N);
    moedc_link_call call = { .layer = (uint32_t)layer,
                             .dtype = dtype,
                             .tokens = T,
                             .d_model = d,
                             .k = k,
                             .hidden = dx,
                             .expert_ids = dids,
                             .expert_weights = dw,
                             .output = dy,
                             .stream = st };
    for (int i = 0; i < N; i++) {
        const double t0 = now_s();
        if (moedc_links_forward(l, &call, NULL, &err)) return die("moedc_links_forward", err.msg);
        lat_link[i] = now_s() - t0;
    }
    if (cudaMemcpy(y_link, dy, hb, cudaMemcpyDeviceToHost))
        return die("CUDA", cudaGetErrorString(cudaGetLastError()));

    moedc_request req = { .layer = (uint32_t)layer,
                          .dtype = dtype,
                          .tokens = T,
                          .d_model = d,
                          .hidden = x,
                          .routing = MOEDC_ROUTE_EXPERTS,
                          .k = k,
                          .expert_ids = ids,
                          .expert_weights = w };
    moedc_result res = { 0 };
    int same = 1;
    double max_diff = 0;
    for (int i = 0; i < N; i++) {
        const double t0 = now_s();
        if (moedc_forward(c, &req, &res, &err)) return die("moedc_forward", err.msg);
        lat_grpc[i] = now_s() - t0;
        if (i < N - 1) moedc_result_free(&res);
    }
    same = res.output_bytes == hb && !memcmp(res.output, y_link, hb);
    float *a = malloc((size_t)T * (size_t)d * 4), *b = malloc((size_t)T * (size_t)d * 4);
    moed_to_f32(dtype, y_link, a, (size_t)(T * d));
    moed_to_f32(dtype, res.output, b, (size_t)(T * d));
    for (int64_t i = 0; i < T * d; i++) {
        const double diff = a[i] > b[i] ? a[i] - b[i] : b[i] - a[i];
        if (diff > max_diff || diff != diff) max_diff = diff;
    }
    const double p50_link = pct(lat_link, N, 0.5), p50_grpc = pct(lat_grpc, N, 0.5);
    printf("{\"transport\": \"%s\", \"tokens\": %lld, \"d_model\": %lld, \"k\": %d, \"dtype\": "
           "\"%s\", \"calls\": %d, \"bit_identical\": %s, \"max_abs_diff\": %g, "
           "\"link_p50_us\": %.1f, \"link_p90_us\": %.1f, \"grpc_p50_us\": %.1f, "
           "\"grpc_p90_us\": %.1f, \"link_tokens_per_s\": %.0f, \"grpc_tokens_per_s\": %.0f}\n",
           moedc_links_describe(l), (long long)T, (long long)d, k, argv[6], N,
           same ? "true" : "false", max_diff, p50_link * 1e6, pct(lat_link, N, 0.9) * 1e6,
           p50_grpc * 1e6, pct(lat_grpc, N, 0.9) * 1e6, (double)T / p50_link, (double)T / p50_grpc);
    moedc_result_free(&res);
    moedc_links_close(l);
    moedc_close(c);
    return same ? 0 : 1;
}
