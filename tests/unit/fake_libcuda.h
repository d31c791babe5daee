/*
 * fake_libcuda — the fake CUDA driver's exports (fake_libcuda.c says what it fakes): the entry
 * points libmoedclient resolves, as cuda.h declares them, the state test_moedc_cuda reads, and the
 * fake's own capture of a stream (fake_cuda_capture, fake_cuda_replay) for the ring's tests.
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
    int host_registered;          /* cuMemHostRegister calls not undone */
} fake_cuda_state;

extern fake_cuda_state fake_cuda;
void *fake_cuda_device_mem(void);
void *fake_cuda_managed_mem(void);
/* Starts (on) or ends (off) capturing `stream`: while it captures, its memory operations are
 * recorded instead of run, and cuStreamIsCapturing says so; ending forgets the earlier capture. */
void fake_cuda_capture(void *stream, int on);
/* Runs what the stream's last capture recorded, on the stream (as a graph launch would). */
void fake_cuda_replay(void *stream);

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
int cuCtxGetCurrent(void **ctx);
int cuCtxGetDevice(int *device);
int cuMemHostRegister_v2(void *p, size_t bytes, unsigned flags);
int cuMemHostUnregister(void *p);
int cuMemHostGetDevicePointer_v2(uint64_t *dev, void *p, unsigned flags);
int cuStreamCreate(void **stream, unsigned flags);
int cuStreamDestroy_v2(void *stream);
int cuStreamSynchronize(void *stream);
int cuStreamGetCtx(void *stream, void **ctx);
int cuStreamIsCapturing(void *stream, int *status);
int cuStreamQuery(void *stream);
int cuModuleLoadData(void **module, const void *image);
int cuModuleUnload(void *module);
int cuModuleGetFunction(void **fn, void *module, const char *name);
int cuLaunchKernel(void *fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                   unsigned bz, unsigned shared_bytes, void *stream, void **params, void **extra);
int cuMemcpyHtoDAsync_v2(uint64_t dst, const void *src, size_t bytes, void *stream);
int cuMemcpyDtoHAsync_v2(void *dst, uint64_t src, size_t bytes, void *stream);
int cuMemcpyDtoDAsync_v2(uint64_t dst, uint64_t src, size_t bytes, void *stream);
int cuMemsetD8Async(uint64_t dst, unsigned char value, size_t bytes, void *stream);
int cuMemHostAlloc(void **p, size_t bytes, unsigned flags);
int cuMemFreeHost(void *p);
int cuEventCreate(void **event, unsigned flags);
int cuEventDestroy_v2(void *event);
int cuEventRecord(void *event, void *stream);
int cuStreamWaitEvent(void *stream, void *event, unsigned flags);
int cuStreamWriteValue32_v2(void *stream, uint64_t addr, uint32_t value, unsigned flags);
int cuStreamWaitValue32_v2(void *stream, uint64_t addr, uint32_t value, unsigned flags);

#endif
