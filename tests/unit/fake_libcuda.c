/*
 * fake_libcuda — a CUDA driver for test_moedc_cuda, built as libcuda.so.1 in a folder of its own
 * that the test's LD_LIBRARY_PATH puts first, so libmoedclient's loader opens it instead of a real
 * one. It exports the entry points moedc_cuda.c resolves, over fake device memory: one device
 * allocation (ordinal 1, whose primary context is active; device 0's is not) and one managed one;
 * every other address is host memory. Its counters (fake_cuda, found by dlsym) let the test check
 * that each retained context is released and each push popped.
 *
 * Streams are threads that run their memory operations in order: a write stores the value, a wait
 * polls its word until it equals the value (as cuStreamWaitValue32 with EQ). An event is a word
 * too: recording it queues a write of its next count, and a stream waiting on it polls until the
 * word reaches the count recorded last (as cuStreamWaitEvent orders one stream after another). A
 * device pointer of host memory is the host address. So a test can make the ring's stream calls on
 * a machine without a GPU, against a daemon on the CPU backend, and capture and replay them
 * (fake_cuda_capture).
 */
#include "fake_libcuda.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define INVALID_VALUE   1
#define INVALID_CONTEXT 201
#define NOT_SUPPORTED   801
#define NOT_READY       600

fake_cuda_state fake_cuda;
static _Alignas(256) unsigned char device_mem[FAKE_CUDA_ALLOC];
static _Alignas(256) unsigned char managed_mem[FAKE_CUDA_ALLOC];

static int in(const unsigned char *mem, uint64_t p)
{
    return p >= (uintptr_t)mem && p < (uintptr_t)mem + FAKE_CUDA_ALLOC;
}

void *fake_cuda_device_mem(void)
{
    return device_mem;
}

void *fake_cuda_managed_mem(void)
{
    return managed_mem;
}

int cuInit(unsigned flags)
{
    return flags ? INVALID_VALUE : 0;
}

int cuGetErrorName(int result, const char **name)
{
    *name = result == NOT_SUPPORTED     ? "CUDA_ERROR_NOT_SUPPORTED"
            : result == INVALID_CONTEXT ? "CUDA_ERROR_INVALID_CONTEXT"
            : result == INVALID_VALUE   ? "CUDA_ERROR_INVALID_VALUE"
                                        : NULL;
    return *name ? 0 : INVALID_VALUE;
}

int cuDeviceGet(int *device, int ordinal)
{
    if (ordinal < 0 || ordinal > 1) return INVALID_VALUE;
    *device = ordinal;
    return 0;
}

int cuDeviceGetCount(int *count)
{
    *count = 2;
    return 0;
}

int cuDeviceGetUuid_v2(unsigned char uuid[16], int device)
{
    for (int i = 0; i < 16; i++) uuid[i] = (unsigned char)(0x10 * device + i);
    return 0;
}

int cuDevicePrimaryCtxGetState(int device, unsigned *flags, int *active)
{
    *flags = 0;
    *active = device == 1;
    return 0;
}

int cuDevicePrimaryCtxRetain(void **ctx, int device)
{
    fake_cuda.retained[device]++;
    *ctx = &fake_cuda.retained[device];
    return 0;
}

int cuDevicePrimaryCtxRelease_v2(int device)
{
    fake_cuda.released[device]++;
    return 0;
}

int cuCtxPushCurrent_v2(void *ctx)
{
    fake_cuda.depth++;
    fake_cuda.pushes++;
    return ctx ? 0 : INVALID_VALUE;
}

int cuCtxPopCurrent_v2(void **ctx)
{
    fake_cuda.depth--;
    fake_cuda.pops++;
    *ctx = NULL;
    return 0;
}

int cuPointerGetAttributes(unsigned n, int *attributes, void **data, uint64_t ptr)
{
    if (fake_cuda.need_context && !fake_cuda.depth) return INVALID_CONTEXT;
    const int device = in(device_mem, ptr), managed = in(managed_mem, ptr);
    for (unsigned i = 0; i < n; i++) {
        if (attributes[i] == 2) *(unsigned *)data[i] = device || managed ? 2 : 0; /* MEMORY_TYPE */
        if (attributes[i] == 8) *(unsigned char *)data[i] = (unsigned char)managed; /* IS_MANAGED */
        if (attributes[i] == 9) *(int *)data[i] = device || managed ? 1 : -1; /* DEVICE_ORDINAL */
    }
    return 0;
}

int cuMemGetAddressRange_v2(uint64_t *base, size_t *bytes, uint64_t ptr)
{
    if (!fake_cuda.depth) return INVALID_CONTEXT;
    if (!in(device_mem, ptr)) return INVALID_VALUE;
    *base = (uintptr_t)device_mem;
    *bytes = FAKE_CUDA_ALLOC;
    return 0;
}

int cuIpcGetMemHandle(unsigned char handle[64], uint64_t ptr)
{
    if (!fake_cuda.depth) return INVALID_CONTEXT;
    if (fake_cuda.ipc_fails) return NOT_SUPPORTED;
    if (ptr != (uintptr_t)device_mem) return INVALID_VALUE;
    for (int i = 0; i < 64; i++) handle[i] = (unsigned char)(i ^ 0x5a);
    return 0;
}

int cuMemAlloc_v2(uint64_t *ptr, size_t bytes)
{
    void *p = malloc(bytes);
    *ptr = (uintptr_t)p;
    return p ? 0 : 2;
}

int cuMemFree_v2(uint64_t ptr)
{
    free((void *)(uintptr_t)ptr);
    return 0;
}

int cuMemcpyHtoD_v2(uint64_t dst, const void *src, size_t bytes)
{
    memcpy((void *)(uintptr_t)dst, src, bytes);
    return 0;
}

int cuMemcpyDtoH_v2(void *dst, uint64_t src, size_t bytes)
{
    memcpy(dst, (const void *)(uintptr_t)src, bytes);
    return 0;
}

int cuCtxGetCurrent(void **ctx)
{
    *ctx = fake_cuda.depth ? &fake_cuda.retained[1] : NULL;
    return 0;
}

int cuCtxGetDevice(int *device)
{
    *device = 1;
    return fake_cuda.depth ? 0 : INVALID_CONTEXT;
}

int cuMemHostRegister_v2(void *p, size_t bytes, unsigned flags)
{
    if (!fake_cuda.depth) return INVALID_CONTEXT;
    fake_cuda.host_registered++;
    return p && bytes && flags <= 0xf ? 0 : INVALID_VALUE;
}

int cuMemHostUnregister(void *p)
{
    fake_cuda.host_registered--;
    return p ? 0 : INVALID_VALUE;
}

int cuMemHostGetDevicePointer_v2(uint64_t *dev, void *p, unsigned flags)
{
    if (!fake_cuda.depth) return INVALID_CONTEXT;
    *dev = (uintptr_t)p;
    return flags ? INVALID_VALUE : 0;
}

/* ---- streams ---- */

typedef struct op {
    int wait; /* 0: store value; 1: poll until *addr == value; 2: until *addr reaches value */
    uint32_t *addr;
    uint32_t value;
} op;

typedef struct ops {
    op *v;
    size_t n, cap;
} ops;

typedef struct stream {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    ops queue, graph;
    size_t head; /* queue[head ..] is still to run */
    int busy, stop, capturing;
    pthread_t thread;
} stream;

static void push(ops *o, op x)
{
    if (o->n == o->cap) {
        o->cap = o->cap ? 2 * o->cap : 64;
        o->v = realloc(o->v, o->cap * sizeof *o->v);
        if (!o->v) abort();
    }
    o->v[o->n++] = x;
}

static void *stream_main(void *arg)
{
    stream *s = arg;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (s->head == s->queue.n && !s->stop) pthread_cond_wait(&s->cv, &s->mu);
        if (s->head == s->queue.n) break;
        op x = s->queue.v[s->head++];
        s->busy = 1;
        pthread_mutex_unlock(&s->mu);
        if (!x.wait) {
            __atomic_store_n(x.addr, x.value, __ATOMIC_RELEASE);
        } else {
            for (uint32_t v; (v = __atomic_load_n(x.addr, __ATOMIC_ACQUIRE)) != x.value &&
                             (x.wait == 1 || (int32_t)(v - x.value) < 0);) {
                struct timespec ts = { 0, 20000 };
                nanosleep(&ts, NULL);
            }
        }
        pthread_mutex_lock(&s->mu);
        s->busy = 0;
        pthread_cond_broadcast(&s->cv);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

int cuStreamCreate(void **out, unsigned flags)
{
    stream *s = calloc(1, sizeof *s);
    if (!s || flags > 1) return INVALID_VALUE;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    pthread_create(&s->thread, NULL, stream_main, s);
    *out = s;
    return 0;
}

int cuStreamSynchronize(void *stream_)
{
    stream *s = stream_;
    if (!s) return INVALID_VALUE;
    pthread_mutex_lock(&s->mu);
    while (s->head < s->queue.n || s->busy) pthread_cond_wait(&s->cv, &s->mu);
    pthread_mutex_unlock(&s->mu);
    return 0;
}

int cuStreamDestroy_v2(void *stream_)
{
    stream *s = stream_;
    if (!s) return INVALID_VALUE;
    pthread_mutex_lock(&s->mu);
    s->stop = 1;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->thread, NULL);
    free(s->queue.v);
    free(s->graph.v);
    free(s);
    return 0;
}

int cuStreamGetCtx(void *stream_, void **ctx)
{
    *ctx = &fake_cuda.retained[1];
    return stream_ ? 0 : INVALID_VALUE;
}

int cuStreamIsCapturing(void *stream_, int *status)
{
    stream *s = stream_;
    if (!s) return INVALID_VALUE;
    *status = s->capturing;
    return 0;
}

int cuStreamQuery(void *stream_)
{
    stream *s = stream_;
    if (!s) return 0; /* the legacy stream: nothing is ever queued on it here */
    pthread_mutex_lock(&s->mu);
    const int idle = s->head >= s->queue.n && !s->busy;
    pthread_mutex_unlock(&s->mu);
    return idle ? 0 : NOT_READY;
}

/* The fake runs no kernels: a module does not load (a link open says so). */
int cuModuleLoadData(void **module, const void *image)
{
    (void)image;
    *module = NULL;
    return NOT_SUPPORTED;
}

int cuModuleUnload(void *module)
{
    return module ? INVALID_VALUE : 0;
}

int cuModuleGetFunction(void **fn, void *module, const char *name)
{
    (void)module, (void)name;
    *fn = NULL;
    return NOT_SUPPORTED;
}

int cuLaunchKernel(void *fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                   unsigned bz, unsigned shared_bytes, void *stream_, void **params, void **extra)
{
    return NOT_SUPPORTED;
}

/* The asynchronous copies: in stream order, done by the time they return. */
int cuMemcpyHtoDAsync_v2(uint64_t dst, const void *src, size_t bytes, void *stream_)
{
    if (stream_) cuStreamSynchronize(stream_);
    return cuMemcpyHtoD_v2(dst, src, bytes);
}

int cuMemcpyDtoHAsync_v2(void *dst, uint64_t src, size_t bytes, void *stream_)
{
    if (stream_) cuStreamSynchronize(stream_);
    return cuMemcpyDtoH_v2(dst, src, bytes);
}

int cuMemcpyDtoDAsync_v2(uint64_t dst, uint64_t src, size_t bytes, void *stream_)
{
    if (stream_) cuStreamSynchronize(stream_);
    memmove((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, bytes);
    return 0;
}

int cuMemsetD8Async(uint64_t dst, unsigned char value, size_t bytes, void *stream_)
{
    if (stream_) cuStreamSynchronize(stream_);
    memset((void *)(uintptr_t)dst, value, bytes);
    return 0;
}

int cuMemHostAlloc(void **p, size_t bytes, unsigned flags)
{
    (void)flags;
    *p = calloc(1, bytes ? bytes : 1);
    return *p ? 0 : INVALID_VALUE;
}

int cuMemFreeHost(void *p)
{
    free(p);
    return 0;
}

static int enqueue(void *stream_, uint64_t addr, uint32_t value, int wait)
{
    stream *s = stream_;
    if (!s || !addr) return INVALID_VALUE;
    pthread_mutex_lock(&s->mu);
    push(s->capturing ? &s->graph : &s->queue, (op){ wait, (uint32_t *)(uintptr_t)addr, value });
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    return 0;
}

int cuStreamWriteValue32_v2(void *stream_, uint64_t addr, uint32_t value, unsigned flags)
{
    return flags ? INVALID_VALUE : enqueue(stream_, addr, value, 0);
}

int cuStreamWaitValue32_v2(void *stream_, uint64_t addr, uint32_t value, unsigned flags)
{
    return flags != 1 ? INVALID_VALUE : enqueue(stream_, addr, value, 1); /* EQ only */
}

/* ---- events ---- */

typedef struct event {
    uint32_t word, recorded;
} event;

int cuEventCreate(void **out, unsigned flags)
{
    if (flags & ~2u) return INVALID_VALUE; /* CU_EVENT_DISABLE_TIMING only */
    event *e = calloc(1, sizeof *e);
    if (!e) return INVALID_VALUE;
    *out = e;
    return 0;
}

int cuEventDestroy_v2(void *event_)
{
    free(event_);
    return event_ ? 0 : INVALID_VALUE;
}

int cuEventRecord(void *event_, void *stream_)
{
    event *e = event_;
    if (!e) return INVALID_VALUE;
    return enqueue(stream_, (uintptr_t)&e->word, ++e->recorded, 0);
}

int cuStreamWaitEvent(void *stream_, void *event_, unsigned flags)
{
    event *e = event_;
    if (!e || flags) return INVALID_VALUE;
    return enqueue(stream_, (uintptr_t)&e->word, e->recorded, 2);
}

void fake_cuda_capture(void *stream_, int on)
{
    stream *s = stream_;
    pthread_mutex_lock(&s->mu);
    if (on) s->graph.n = 0;
    s->capturing = on;
    pthread_mutex_unlock(&s->mu);
}

void fake_cuda_replay(void *stream_)
{
    stream *s = stream_;
    pthread_mutex_lock(&s->mu);
    for (size_t i = 0; i < s->graph.n; i++) push(&s->queue, s->graph.v[i]);
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}
