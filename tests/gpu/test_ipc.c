/*
 * test_ipc — CUDA IPC from a second process: this program starts moed (the path in argv[1]) on
 * the CUDA backend, registers device memory of its own with it (moedc_region_register_cuda: the
 * IPC handle of the allocation, and the region's offset in it), and checks that a Forward whose
 * hidden rows and output lie in that memory gives, bit for bit, what the same request sent inline
 * gives: at T = 8 (a replayed graph: one device copy each way) and T = 700 (the kernels read and
 * write the client's memory in place), for a host region too; that ListRegions reports the
 * region's GPU; that a region claiming more bytes than its allocation holds is refused; and that
 * the daemon still serves afterwards and exits 0. Exits 77 (skipped) without a GPU.
 *
 *   test_ipc MOED             the caller's memory on GPU 0, moed on every GPU
 *   test_ipc MOED two-gpu     the caller's memory on GPU 0, moed computing on GPU 1 alone
 *                             (--devices 1): the same checks with peer access between the GPUs,
 *                             and again with the copies staged through host memory
 *                             (MOED_CUDA_NO_PEER=1); then moed seeing GPU 1 alone
 *                             (CUDA_VISIBLE_DEVICES), which refuses a region on GPU 0 by name.
 *                             Exits 77 (skipped) with fewer than two GPUs.
 */
#include "check.h"

#include "moedclient.h"

#include <cuda_runtime_api.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define D     512
#define E     8
#define MAX_T 1024

/* moed on the CUDA backend, the idx-th of this run (a port of its own); devices: its --devices, or
 * NULL for every GPU; env: "NAME=VALUE" or NULL, set in its environment (MOED_CUDA_NO_PEER being
 * unset there otherwise, so peer access is the default whatever this process was given). */
static pid_t start_moed(const char *bin, int idx, const char *devices, char *env, char *target,
                        size_t n)
{
    snprintf(target, n, "127.0.0.1:%d", 20000 + (int)(getpid() % 10000) * 4 + idx);
    pid_t pid = fork();
    if (pid == 0) {
        unsetenv("MOED_CUDA_NO_PEER");
        if (env) putenv(env);
        char *args[] = { (char *)bin,
                         "--listen",
                         target,
                         "--backend",
                         "cuda",
                         "--synthetic",
                         "layers=1,d=512,ff=1024,experts=8,topk=2,act=swiglu,dtype=bf16,seed=3",
                         "--log-level",
                         "warn",
                         devices ? "--devices" : NULL,
                         (char *)devices,
                         NULL };
        execv(bin, args);
        _exit(127);
    }
    return pid;
}

/* SIGTERM, and the daemon's exit checked to be 0. */
static void stop_moed(pid_t pid, const char *what)
{
    kill(pid, SIGTERM);
    int status = 0;
    waitpid(pid, &status, 0);
    CHECK_MSG(WIFEXITED(status) && WEXITSTATUS(status) == 0, "moed (%s) exited with status %d",
              what, status);
}

static int wait_serving(moedc *c)
{
    for (int i = 0; i < 600; i++) {
        int status;
        moedc_error err;
        if (!moedc_health(c, "", &status, &err) && status == MOEDC_HEALTH_SERVING) return 0;
        struct timespec ts = { 0, 100000000 };
        nanosleep(&ts, NULL);
    }
    return -1;
}

/* T rows of bf16 hidden from the pool, routed by client choice (ids and weights set here). */
static moedc_request request(const uint16_t *pool, int64_t T, int32_t *ids, float *w)
{
    for (int64_t i = 0; i < 2 * T; i++) {
        ids[i] = (int32_t)((i * 5 + i / 7) % E);
        w[i] = 0.25f + (float)(i % 3) * 0.25f;
    }
    return (moedc_request){ .layer = 0,
                            .dtype = MOEDC_BF16,
                            .tokens = T,
                            .d_model = D,
                            .hidden = pool,
                            .routing = MOEDC_ROUTE_EXPERTS,
                            .k = 2,
                            .expert_ids = ids,
                            .expert_weights = w,
                            .timeout_s = 60 };
}

/* The device ListRegions reports for region id, or -1 when it lists no such region. */
static int listed_device(moedc *c, uint64_t id)
{
    moedc_region_info *list = NULL;
    int n = 0, dev = -1;
    moedc_error err;
    CHECK_MSG(moedc_list_regions(c, &list, &n, &err) == 0, "ListRegions: %s", err.msg);
    for (int i = 0; i < n; i++)
        if (list[i].id == id) dev = list[i].device;
    free(list);
    return dev;
}

/* Requests of T tokens whose hidden and output lie in device memory of this process's GPU `gpu`
 * (which the server, seeing the same GPUs, reports as its GPU `gpu`), then in a host region: the
 * same bits as inline. */
static void check_device(moedc *c, moedc_session *s, const uint16_t *pool, int64_t T, int gpu)
{
    int32_t ids[2 * MAX_T];
    float w[2 * MAX_T];
    moedc_request req = request(pool, T, ids, w);
    moedc_result want, got;
    moedc_error err;
    CHECK_MSG(moedc_forward(c, &req, &want, &err) == 0, "inline T=%lld: %s", (long long)T, err.msg);
    /* one allocation: hidden from byte 4096 on (an offset into it), the output behind */
    const size_t bytes = (size_t)T * D * 2;
    char *dev = NULL;
    cudaSetDevice(gpu);
    CHECK(cudaMalloc((void **)&dev, 4096 + 2 * bytes) == cudaSuccess);
    cudaMemcpy(dev + 4096, pool, bytes, cudaMemcpyHostToDevice);
    cudaMemset(dev + 4096 + bytes, 0xff, bytes);
    moedc_region *r = NULL;
    CHECK_MSG(moedc_region_register_cuda(s, dev + 4096, 2 * bytes, &r, &err) == 0, "register: %s",
              err.msg);
    if (r) {
        const int listed = listed_device(c, r->id);
        CHECK_MSG(listed == gpu, "the region on GPU %d is listed on GPU %d", gpu, listed);
        req.hidden_at = (moedc_ref){ r, 0 };
        req.output_at = (moedc_ref){ r, bytes };
        CHECK_MSG(moedc_forward(c, &req, &got, &err) == 0, "cuda T=%lld: %s", (long long)T,
                  err.msg);
        void *host = malloc(bytes);
        cudaMemcpy(host, dev + 4096 + bytes, bytes, cudaMemcpyDeviceToHost);
        CHECK_MSG(want.output && !memcmp(host, want.output, bytes),
                  "T=%lld: the output in the CUDA region differs from inline", (long long)T);
        CHECK(got.output == dev + 4096 + bytes);
        fprintf(stderr, "  cuda region on GPU %d, T=%-4lld  compute %llu us, total %llu us\n", gpu,
                (long long)T, (unsigned long long)got.timings.compute_us,
                (unsigned long long)got.timings.total_us);
        free(host);
        moedc_result_free(&got);
        CHECK(moedc_region_free(r, &err) == 0);
    }
    /* a host region, the same way */
    moedc_region *h = NULL;
    CHECK(moedc_region_create_host(s, 2 * bytes, 0, &h, &err) == 0);
    if (h) {
        memcpy(h->ptr, pool, bytes);
        req.hidden_at = (moedc_ref){ h, 0 };
        req.output_at = (moedc_ref){ h, bytes };
        CHECK_MSG(moedc_forward(c, &req, &got, &err) == 0, "shm T=%lld: %s", (long long)T, err.msg);
        CHECK_MSG(!memcmp((char *)h->ptr + bytes, want.output, bytes),
                  "T=%lld: the output in the host region differs from inline", (long long)T);
        moedc_result_free(&got);
        moedc_region_free(h, &err);
    }
    moedc_result_free(&want);
    cudaFree(dev);
}

/* GPU i's UUID, as the client sends it ("GPU-..."). */
static void uuid_of(int i, char out[48])
{
    struct cudaDeviceProp pr;
    out[0] = 0;
    if (cudaGetDeviceProperties(&pr, i) != cudaSuccess) return;
    const unsigned char *b = (const unsigned char *)pr.uuid.bytes;
    snprintf(out, 48, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
             b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
             b[14], b[15]);
}

/* A client of the daemon at target and a region session of it, once it serves; false (a failed
 * check) if it never does. */
static bool connect_serving(const char *target, moedc **c, moedc_session **s)
{
    moedc_error err;
    *c = NULL;
    *s = NULL;
    CHECK_MSG(moedc_connect(target, NULL, c, &err) == 0, "connect %s: %s", target, err.msg);
    if (*c && wait_serving(*c) == 0 && moedc_session_open(*c, s, &err) == 0) return true;
    CHECK_MSG(0, "moed at %s did not serve", target);
    return false;
}

/* One daemon (start_moed's idx, devices and env): the caller's memory on GPU `gpu` at T = 8 and
 * 700 against inline, a region past its allocation refused, the daemon serving after it all. */
static void check_daemon(const char *bin, int idx, const char *devices, char *env, int gpu,
                         const char *what, const uint16_t *pool)
{
    char target[64];
    moedc *c = NULL;
    moedc_session *s = NULL;
    moedc_error err;
    fprintf(stderr, " %s:\n", what);
    const pid_t pid = start_moed(bin, idx, devices, env, target, sizeof target);
    if (connect_serving(target, &c, &s)) {
        check_device(c, s, pool, 8, gpu);
        check_device(c, s, pool, 700, gpu);
        void *dev = NULL;
        moedc_region *r = NULL;
        cudaSetDevice(gpu);
        cudaMalloc(&dev, 1 << 20);
        int rc = moedc_region_register_cuda(s, dev, 2 << 20, &r, &err);
        CHECK_MSG(rc == MOEDC_EINVAL, "%s: an oversized CUDA region: %d %s", what, rc, err.msg);
        cudaFree(dev);
        moedc_model_info info;
        CHECK(moedc_info(c, &info, &err) == 0 && info.cuda_regions); /* still serving */
        moedc_model_info_free(&info);
        moedc_session_close(s);
    }
    moedc_close(c);
    stop_moed(pid, what);
}

/* moed seeing GPU 1 alone (CUDA_VISIBLE_DEVICES naming it): memory on GPU 0 is refused with
 * FAILED_PRECONDITION, the message naming that GPU and the one it sees; it still serves. */
static void check_unseen(const char *bin, int idx)
{
    static char env[96];
    char uuid0[48], uuid1[48], target[64];
    uuid_of(0, uuid0);
    uuid_of(1, uuid1);
    snprintf(env, sizeof env, "CUDA_VISIBLE_DEVICES=%s", uuid1);
    fprintf(stderr, " moed seeing GPU 1 alone, the caller's memory on GPU 0:\n");
    const pid_t pid = start_moed(bin, idx, NULL, env, target, sizeof target);
    moedc *c = NULL;
    moedc_session *s = NULL;
    moedc_error err;
    if (connect_serving(target, &c, &s)) {
        void *dev = NULL;
        moedc_region *r = NULL;
        cudaSetDevice(0);
        CHECK(cudaMalloc(&dev, 1 << 20) == cudaSuccess);
        const int rc = moedc_region_register_cuda(s, dev, 1 << 20, &r, &err);
        CHECK_MSG(rc == MOEDC_EPRECOND && strstr(err.msg, "not visible to this server") &&
                      strstr(err.msg, uuid0) && strstr(err.msg, uuid1),
                  "a region on a GPU moed does not see: %d %s", rc, err.msg);
        fprintf(stderr, "  refused: %s\n", err.msg);
        if (!rc) moedc_region_free(r, &err);
        cudaFree(dev);
        moedc_model_info info;
        CHECK(moedc_info(c, &info, &err) == 0 && info.cuda_regions); /* still serving */
        moedc_model_info_free(&info);
        moedc_session_close(s);
    }
    moedc_close(c);
    stop_moed(pid, "seeing GPU 1 alone");
}

int main(int argc, char **argv)
{
    int n_gpus = 0;
    if (cudaGetDeviceCount(&n_gpus) != cudaSuccess || n_gpus == 0) {
        fprintf(stderr, "test_ipc: no CUDA device: skipped\n");
        return CHECK_SKIP;
    }
    const bool two = argc == 3 && !strcmp(argv[2], "two-gpu");
    if (argc != 2 && !two) {
        fprintf(stderr, "usage: test_ipc PATH-TO-MOED [two-gpu]\n");
        return 2;
    }
    if (two && n_gpus < 2) {
        fprintf(stderr, "test_ipc two-gpu: %d GPU: skipped\n", n_gpus);
        return CHECK_SKIP;
    }
    uint16_t *pool = malloc((size_t)MAX_T * D * 2);
    for (size_t i = 0; i < (size_t)MAX_T * D; i++)
        pool[i] = (uint16_t)(0x3c00 + ((i * 2654435761u) >> 22) % 0x200 - 0x100);
    if (!two) {
        check_daemon(argv[1], 0, NULL, NULL, 0, "moed on every GPU, the caller's memory on GPU 0",
                     pool);
    } else {
        int peer = 0;
        cudaDeviceCanAccessPeer(&peer, 1, 0);
        fprintf(stderr, "GPU 1 %s peer access to GPU 0\n", peer ? "has" : "has no");
        check_daemon(argv[1], 1, "1", NULL, 0,
                     peer ? "moed on GPU 1, the caller's memory on GPU 0 (peer access)"
                          : "moed on GPU 1, the caller's memory on GPU 0 (no peer access: staged)",
                     pool);
        static char no_peer[] = "MOED_CUDA_NO_PEER=1";
        check_daemon(argv[1], 2, "1", no_peer, 0,
                     "moed on GPU 1, the caller's memory on GPU 0, staged (MOED_CUDA_NO_PEER=1)",
                     pool);
        check_unseen(argv[1], 3);
    }
    free(pool);
    return check_status(two ? "test_ipc two-gpu" : "test_ipc");
}
