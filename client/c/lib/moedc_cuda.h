/*
 * moedc_cuda — the CUDA driver, reached at run time. libmoedclient links no CUDA library: the first
 * call that needs a GPU opens libcuda.so.1 (dlopen) and resolves the entry points below into one
 * table, kept for the life of the process. So one build of the client serves machines with and
 * without a GPU, beside whatever CUDA runtime the calling process loaded (torch's): the driver is
 * one per process, and the primary contexts it keeps are the ones every runtime uses.
 *
 * Contract:
 * - moedc_cuda_api() answers the table, or NULL and MOEDC_EUNSUPPORTED with a message saying why
 *   (no driver on this machine, or one too old to have an entry point); the answer never changes
 *   within a process.
 * - A driver call's failure becomes moedc_cuda_fail: MOEDC_EINVAL for an invalid value,
 *   MOEDC_EDEVICE otherwise, the message naming the call and the driver's error name.
 * - Calls that need a context run between moedc_cuda_enter and moedc_cuda_leave: the primary
 *   context of the device (created by the caller's runtime already, so retaining it creates
 *   nothing) made current on this thread, and the thread's own context current again after.
 * - The types are the driver's, written here so the client builds without the CUDA toolkit:
 *   CUresult is an int (0 success), CUdevice an int ordinal, CUdeviceptr 64 bits, CUcontext and
 *   CUstream pointers.
 * - The stream memory operations (cuStreamWriteValue32, cuStreamWaitValue32: the doorbell's
 *   stream-ordered calls) came with CUDA 11.7's driver: an older driver still serves CUDA regions,
 *   and moedc_cuda_streams() says why stream-ordered calls are not offered.
 */
#ifndef MOEDC_CUDA_H
#define MOEDC_CUDA_H

#include "moedclient.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define MOEDC_CUDA_IPC_HANDLE_BYTES 64 /* CU_IPC_HANDLE_SIZE */

typedef uint64_t moedc_cu_ptr; /* CUdeviceptr */

/* The entry points resolved (by their versioned names where the driver has several), each as
 * cuda.h declares it. */
typedef struct moedc_cuda_table {
    int (*cuInit)(unsigned flags);
    int (*cuGetErrorName)(int result, const char **name);
    int (*cuDeviceGet)(int *device, int ordinal);
    int (*cuDeviceGetCount)(int *count);
    int (*cuDeviceGetUuid)(unsigned char uuid[16], int device);
    int (*cuDevicePrimaryCtxGetState)(int device, unsigned *flags, int *active);
    int (*cuDevicePrimaryCtxRetain)(void **ctx, int device);
    int (*cuDevicePrimaryCtxRelease)(int device);
    int (*cuCtxPushCurrent)(void *ctx);
    int (*cuCtxPopCurrent)(void **ctx);
    int (*cuPointerGetAttributes)(unsigned n, int *attributes, void **data, moedc_cu_ptr ptr);
    int (*cuMemGetAddressRange)(moedc_cu_ptr *base, size_t *bytes, moedc_cu_ptr ptr);
    int (*cuIpcGetMemHandle)(unsigned char handle[MOEDC_CUDA_IPC_HANDLE_BYTES], moedc_cu_ptr ptr);
    int (*cuMemAlloc)(moedc_cu_ptr *ptr, size_t bytes);
    int (*cuMemFree)(moedc_cu_ptr ptr);
    int (*cuMemcpyHtoD)(moedc_cu_ptr dst, const void *src, size_t bytes);
    int (*cuMemcpyDtoH)(void *dst, moedc_cu_ptr src, size_t bytes);
    int (*cuCtxGetCurrent)(void **ctx);
    int (*cuCtxGetDevice)(int *device);
    int (*cuMemHostRegister)(void *p, size_t bytes, unsigned flags);
    int (*cuMemHostUnregister)(void *p);
    int (*cuMemHostGetDevicePointer)(moedc_cu_ptr *dev, void *p, unsigned flags);
    int (*cuStreamCreate)(void **stream, unsigned flags);
    int (*cuStreamDestroy)(void *stream);
    int (*cuStreamSynchronize)(void *stream);
    int (*cuStreamGetCtx)(void *stream, void **ctx);
    int (*cuStreamIsCapturing)(void *stream, int *status);
    int (*cuStreamQuery)(void *stream);
    /* what a link call runs on the caller's stream (moedc_link.c): its kernels, loaded from PTX,
     * and its copies through page-locked host memory */
    int (*cuModuleLoadData)(void **module, const void *image);
    int (*cuModuleUnload)(void *module);
    int (*cuModuleGetFunction)(void **fn, void *module, const char *name);
    int (*cuLaunchKernel)(void *fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                          unsigned bz, unsigned shared_bytes, void *stream, void **params,
                          void **extra);
    int (*cuMemcpyHtoDAsync)(moedc_cu_ptr dst, const void *src, size_t bytes, void *stream);
    int (*cuMemcpyDtoHAsync)(void *dst, moedc_cu_ptr src, size_t bytes, void *stream);
    int (*cuMemcpyDtoDAsync)(moedc_cu_ptr dst, moedc_cu_ptr src, size_t bytes, void *stream);
    int (*cuMemsetD8Async)(moedc_cu_ptr dst, unsigned char value, size_t bytes, void *stream);
    int (*cuMemHostAlloc)(void **p, size_t bytes, unsigned flags);
    int (*cuMemFreeHost)(void *p);
    /* a fleet's call forks from the caller's stream into its links' and joins back */
    int (*cuEventCreate)(void **event, unsigned flags);
    int (*cuEventDestroy)(void *event);
    int (*cuEventRecord)(void *event, void *stream);
    int (*cuStreamWaitEvent)(void *stream, void *event, unsigned flags);
    /* the stream memory operations: NULL from a driver older than CUDA 11.7 */
    int (*cuStreamWriteValue32)(void *stream, moedc_cu_ptr addr, uint32_t value, unsigned flags);
    int (*cuStreamWaitValue32)(void *stream, moedc_cu_ptr addr, uint32_t value, unsigned flags);
} moedc_cuda_table;

#define MOEDC_CU_MEMHOSTREGISTER_PORTABLE  0x01
#define MOEDC_CU_MEMHOSTREGISTER_DEVICEMAP 0x02
#define MOEDC_CU_STREAM_WAIT_VALUE_EQ      0x1
#define MOEDC_CU_STREAM_CAPTURE_ACTIVE     1 /* CUstreamCaptureStatus */
#define MOEDC_CU_STREAM_NON_BLOCKING       0x1
#define MOEDC_CU_EVENT_DISABLE_TIMING      0x2
#define MOEDC_CU_ERROR_NOT_READY           600 /* cuStreamQuery: work still queued */

const moedc_cuda_table *moedc_cuda_api(moedc_error *err);

/* Whether this process loaded the CUDA driver already (its CUDA runtime did, or a call here),
 * without loading it. */
bool moedc_cuda_loaded(void);

/* The table when it has the stream memory operations too; NULL and MOEDC_EUNSUPPORTED saying why
 * (no driver, or one older than CUDA 11.7) otherwise. */
const moedc_cuda_table *moedc_cuda_streams(moedc_error *err);

/* err from a driver call's result rc; returns the code. */
int moedc_cuda_fail(const moedc_cuda_table *cu, int rc, const char *call, moedc_error *err);

/* The device ordinal's primary context, current on this thread until moedc_cuda_leave. */
int moedc_cuda_enter(const moedc_cuda_table *cu, int ordinal, moedc_error *err);
void moedc_cuda_leave(const moedc_cuda_table *cu, int ordinal);

/* What the server needs to open device memory p .. p + bytes of this process: its allocation's IPC
 * handle, p's offset in that allocation, the device's ordinal and UUID ("GPU-xxxxxxxx-..."). */
typedef struct moedc_cuda_region {
    unsigned char handle[MOEDC_CUDA_IPC_HANDLE_BYTES];
    uint64_t offset;
    int device;
    char uuid[48];
} moedc_cuda_region;

/* MOEDC_EINVAL when p is not device memory of this process (host or managed memory have no IPC
 * handle) or the bytes run past its allocation. */
int moedc_cuda_describe(const void *p, size_t bytes, moedc_cuda_region *out, moedc_error *err);

#endif
