/*
 * fake_libcuda — a CUDA driver for test_moedc_cuda, built as libcuda.so.1 in a folder of its own
 * that the test's LD_LIBRARY_PATH puts first, so libmoedclient's loader opens it instead of a real
 * one. It exports the entry points moedc_cuda.c resolves, over fake device memory: one device
 * allocation (ordinal 1, whose primary context is active; device 0's is not) and one managed one;
 * every other address is host memory. Its counters (fake_cuda, found by dlsym) let the test check
 * that each retained context is released and each push popped.
 */
#include "fake_libcuda.h"

#include <stdlib.h>
#include <string.h>

#define INVALID_VALUE   1
#define INVALID_CONTEXT 201
#define NOT_SUPPORTED   801

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
