/*
 * fake_libcuda — the fake CUDA driver's exports (fake_libcuda.c says what it fakes): the entry
 * points libmoedclient resolves, as cuda.h declares them, and the state test_moedc_cuda reads.
 */
#ifndef FAKE_LIBCUDA_H
#define FAKE_LIBCUDA_H

#include <stddef.h>
#include <stdint.h>

#define FAKE_CUDA_ALLOC 4096 /* bytes of each fake allocation */

typedef struct fake_cuda_state {
    int retained[2], released[2]; /* primary contexts, per device */
    int pushes, pops, depth;      /* contexts made current on the calling thread */
    int need_context;             /* cuPointerGetAttributes refuses without a current context */
    int ipc_fails;                /* cuIpcGetMemHandle answers CUDA_ERROR_NOT_SUPPORTED */
} fake_cuda_state;

extern fake_cuda_state fake_cuda;
void *fake_cuda_device_mem(void);
void *fake_cuda_managed_mem(void);

int cuInit(unsigned flags);
int cuGetErrorName(int result, const char **name);
int cuDeviceGet(int *device, int ordinal);
int cuDeviceGetCount(int *count);
int cuDeviceGetUuid_v2(unsigned char uuid[16], int device);
int cuDevicePrimaryCtxGetState(int device, unsigned *flags, int *active);
int cuDevicePrimaryCtxRetain(void **ctx, int device);
int cuDevicePrimaryCtxRelease_v2(int device);
int cuCtxPushCurrent_v2(void *ctx);
int cuCtxPopCurrent_v2(void **ctx);
int cuPointerGetAttributes(unsigned n, int *attributes, void **data, uint64_t ptr);
int cuMemGetAddressRange_v2(uint64_t *base, size_t *bytes, uint64_t ptr);
int cuIpcGetMemHandle(unsigned char handle[64], uint64_t ptr);
int cuMemAlloc_v2(uint64_t *ptr, size_t bytes);
int cuMemFree_v2(uint64_t ptr);
int cuMemcpyHtoD_v2(uint64_t dst, const void *src, size_t bytes);
int cuMemcpyDtoH_v2(void *dst, uint64_t src, size_t bytes);

#endif
