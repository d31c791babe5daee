/*
 * test_ipc — CUDA IPC from a second process: this program starts moed (the path in argv[1]) on
 * the CUDA backend, registers device memory of its own with it (moedc_region_register_cuda: the
 * IPC handle of the allocation, and the region's offset in it), and checks that a Forward whose
 * hidden rows and output lie in that memory gives, bit for bit, what the same request sent inline
 * gives: at T = 8 (a replayed graph: one device copy each way) and T = 700 (the kernels read and
 * write the client's memory in place), for a host region too; that a region claiming more bytes
 * than its allocation holds is refused; and that the daemon still serves afterwards and exits 0.
 * Exits 77 (skipped) without a GPU.
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

static pid_t start_moed(const char *bin, char *target, size_t n)
{
    snprintf(target, n, "127.0.0.1:%d", 20000 + (int)(getpid() % 20000));
    pid_t pid = fork();
    if (pid == 0) {
        execl(bin, bin, "--listen", target, "--backend", "cuda", "--synthetic",
              "layers=1,d=512,ff=1024,experts=8,topk=2,act=swiglu,dtype=bf16,seed=3", "--log-level",
              "warn", (char *)NULL);
        _exit(127);
    }
    return pid;
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

static void check_device(moedc *c, moedc_session *s, const uint16_t *pool, int64_t T)
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
    CHECK(cudaMalloc((void **)&dev, 4096 + 2 * bytes) == cudaSuccess);
    cudaMemcpy(dev + 4096, pool, bytes, cudaMemcpyHostToDevice);
    cudaMemset(dev + 4096 + bytes, 0xff, bytes);
    moedc_region *r = NULL;
    CHECK_MSG(moedc_region_register_cuda(s, dev + 4096, 2 * bytes, &r, &err) == 0, "register: %s",
              err.msg);
    if (r) {
        req.hidden_at = (moedc_ref){ r, 0 };
        req.output_at = (moedc_ref){ r, bytes };
        CHECK_MSG(moedc_forward(c, &req, &got, &err) == 0, "cuda T=%lld: %s", (long long)T,
                  err.msg);
        void *host = malloc(bytes);
        cudaMemcpy(host, dev + 4096 + bytes, bytes, cudaMemcpyDeviceToHost);
        CHECK_MSG(want.output && !memcmp(host, want.output, bytes),
                  "T=%lld: the output in the CUDA region differs from inline", (long long)T);
        CHECK(got.output == dev + 4096 + bytes);
        fprintf(stderr, "  cuda region T=%-4lld  compute %llu us, total %llu us\n", (long long)T,
                (unsigned long long)got.timings.compute_us,
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

int main(int argc, char **argv)
{
    int n_gpus = 0;
    if (cudaGetDeviceCount(&n_gpus) != cudaSuccess || n_gpus == 0) {
        fprintf(stderr, "test_ipc: no CUDA device: skipped\n");
        return CHECK_SKIP;
    }
    if (argc != 2) {
        fprintf(stderr, "usage: test_ipc PATH-TO-MOED\n");
        return 2;
    }
    char target[64];
    pid_t pid = start_moed(argv[1], target, sizeof target);
    moedc *c = NULL;
    moedc_session *s = NULL;
    moedc_error err;
    CHECK(moedc_connect(target, NULL, &c, &err) == 0);
    if (c && wait_serving(c) == 0 && moedc_session_open(c, &s, &err) == 0) {
        uint16_t *pool = malloc((size_t)MAX_T * D * 2);
        for (size_t i = 0; i < (size_t)MAX_T * D; i++)
            pool[i] = (uint16_t)(0x3c00 + ((i * 2654435761u) >> 22) % 0x200 - 0x100);
        check_device(c, s, pool, 8);
        check_device(c, s, pool, 700);
        /* more bytes than the allocation holds */
        void *dev = NULL;
        moedc_region *r = NULL;
        cudaMalloc(&dev, 1 << 20);
        int rc = moedc_region_register_cuda(s, dev, 2 << 20, &r, &err);
        CHECK_MSG(rc == MOEDC_EINVAL, "an oversized CUDA region: %d %s", rc, err.msg);
        cudaFree(dev);
        moedc_model_info info;
        CHECK(moedc_info(c, &info, &err) == 0 && info.cuda_regions); /* still serving */
        moedc_model_info_free(&info);
        free(pool);
        moedc_session_close(s);
    } else {
        CHECK_MSG(0, "moed at %s did not serve", target);
    }
    moedc_close(c);
    kill(pid, SIGTERM);
    int status = 0;
    waitpid(pid, &status, 0);
    CHECK_MSG(WIFEXITED(status) && WEXITSTATUS(status) == 0, "moed exited with status %d", status);
    return check_status("test_ipc");
}
