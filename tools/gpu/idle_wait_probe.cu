/*
 * idle_wait_probe — which CUDA calls wait for a kernel that runs until someone else acts, as an
 * idle link's NCCL receive runs until its caller's next header (docs/fleets.md, "What waits for an
 * idle link"). A kernel spins on one stream until the host releases it 1.5 s later; meanwhile a
 * second thread makes the call under test, and a third launches a loaded kernel and waits for it:
 * each line says how long the call took and whether the third thread was held off. The graph
 * calls act on a one-kernel graph made and run before (in the daemon, instantiating a batch's graph
 * did wait: docs/fleets.md). Run on the GPU machine, once as it is and once with
 * CUDA_MODULE_LOADING=EAGER:
 *   nvcc -O2 -arch=sm_90 -o idle_wait_probe tools/gpu/idle_wait_probe.cu -lpthread
 */
#include <cuda_runtime.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

__global__ void spin(volatile int *flag)
{
    while (!*flag) {
    }
}
template <int N> __global__ void fresh(int *p)
{
    p[0] += N;
}
__global__ void loaded(int *p)
{
    p[0] += 1;
}
/* never launched before its graph: 96 KiB of dynamic shared memory, as the daemon's GEMMs take */
__global__ void wide(int *p)
{
    extern __shared__ int smem[];
    smem[threadIdx.x] = p[0];
    __syncthreads();
    p[1] = smem[0];
}

static volatile int *h_flag;
static int *d_flag, *d_p;
static const char *what;

/* A one-kernel graph (blocks wide), captured on s, instantiated and launched. */
static cudaGraphExec_t graph_run(cudaStream_t s, int blocks, cudaGraph_t *g)
{
    cudaGraphExec_t e;
    cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
    loaded<<<blocks, 1, 0, s>>>(d_p);
    cudaStreamEndCapture(s, g);
    cudaGraphInstantiate(&e, *g, 0);
    cudaGraphLaunch(e, s);
    return e;
}

/* The call under test, on a stream of its own. */
static void *call(void *)
{
    cudaStream_t s;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    void *p = NULL;
    cudaGraph_t g = NULL, g2 = NULL;
    cudaGraphExec_t e = NULL;
    if (!strncmp(what, "cudaGraph", 9)) { /* graphs made and run before the call */
        e = graph_run(s, 1, &g);
        cudaGraphExecDestroy(graph_run(s, 2, &g2));
        cudaStreamSynchronize(s);
    }
    if (!strcmp(what, "cudaFree")) cudaMalloc(&p, 1 << 20);
    if (!strcmp(what, "cudaFreeHost")) cudaHostAlloc(&p, 256, cudaHostAllocMapped);
    if (!strcmp(what, "cudaHostUnregister")) {
        p = aligned_alloc(4096, 4096);
        cudaHostRegister(p, 4096, cudaHostRegisterMapped);
    }
    const double t = now();
    if (!strcmp(what, "first launch of a kernel")) fresh<7><<<1, 1, 0, s>>>(d_p);
    if (!strcmp(what, "cudaFree")) cudaFree(p);
    if (!strcmp(what, "cudaFreeHost")) cudaFreeHost(p);
    if (!strcmp(what, "cudaHostUnregister")) cudaHostUnregister(p);
    if (!strcmp(what, "cudaMalloc")) cudaMalloc(&p, 1 << 20);
    if (!strcmp(what, "cudaHostAlloc")) cudaHostAlloc(&p, 256, cudaHostAllocMapped);
    if (!strcmp(what, "cudaGraphExecDestroy")) cudaGraphExecDestroy(e);
    if (!strcmp(what, "cudaGraphDestroy")) cudaGraphDestroy(g);
    if (!strcmp(what, "cudaGraphExecUpdate")) {
        cudaGraphExecUpdateResultInfo info;
        cudaGraphExecUpdate(e, g2, &info);
    }
    if (!strcmp(what, "cudaMemcpy to the host")) {
        int v;
        cudaMemcpy(&v, d_p, sizeof v, cudaMemcpyDeviceToHost);
    }
    if (!strcmp(what, "graph capture, instantiate, launch")) graph_run(s, 1, &g);
    if (!strcmp(what, "graph instantiate, a wide kernel's first")) {
        cudaGraphExec_t x;
        cudaFuncSetAttribute(wide, cudaFuncAttributeMaxDynamicSharedMemorySize, 96 << 10);
        cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
        wide<<<1, 32, 96 << 10, s>>>(d_p);
        cudaStreamEndCapture(s, &g);
        cudaGraphInstantiate(&x, g, 0);
    }
    if (!strcmp(what, "cudaMemGetInfo")) {
        size_t free_b, total_b;
        cudaMemGetInfo(&free_b, &total_b);
    }
    cudaStreamSynchronize(s);
    printf("  %-36s %.3f s\n", what, now() - t);
    return NULL;
}

/* A loaded kernel launched and waited for from a third thread while the call runs. */
static void *other(void *)
{
    cudaStream_t s;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    usleep(100000);
    const double t = now();
    loaded<<<1, 1, 0, s>>>(d_p);
    cudaStreamSynchronize(s);
    printf("  %-36s %.3f s\n", "  another thread's launch meanwhile", now() - t);
    return NULL;
}

int main(void)
{
    const char *calls[] = { "first launch of a kernel",
                            "cudaFree",
                            "cudaFreeHost",
                            "cudaHostUnregister",
                            "cudaMalloc",
                            "cudaHostAlloc",
                            "graph capture, instantiate, launch",
                            "cudaGraphExecDestroy",
                            "cudaGraphDestroy",
                            "cudaGraphExecUpdate",
                            "cudaMemcpy to the host",
                            "graph instantiate, a wide kernel's first",
                            "cudaMemGetInfo" };
    const char *env = getenv("CUDA_MODULE_LOADING");
    if (cudaHostAlloc((void **)&h_flag, 4, cudaHostAllocMapped) != cudaSuccess) {
        fprintf(stderr, "idle_wait_probe: no CUDA device\n");
        return 1;
    }
    cudaHostGetDevicePointer((void **)&d_flag, (void *)h_flag, 0);
    cudaMalloc((void **)&d_p, 4096);
    loaded<<<1, 1>>>(d_p);
    cudaDeviceSynchronize();
    printf("CUDA_MODULE_LOADING=%s; a kernel spins for 1.5 s beside each call:\n",
           env ? env : "(unset)");
    for (size_t i = 0; i < sizeof calls / sizeof calls[0]; i++) {
        what = calls[i];
        *h_flag = 0;
        cudaStream_t s;
        cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
        spin<<<1, 1, 0, s>>>(d_flag);
        usleep(50000);
        pthread_t a, b;
        pthread_create(&a, NULL, call, NULL);
        pthread_create(&b, NULL, other, NULL);
        usleep(1500000);
        *h_flag = 1;
        pthread_join(a, NULL);
        pthread_join(b, NULL);
        cudaStreamSynchronize(s);
        cudaStreamDestroy(s);
    }
    return 0;
}
