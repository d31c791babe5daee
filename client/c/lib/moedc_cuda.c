/*
 * moedc_cuda — the CUDA driver through dlopen (moedc_cuda.h states the contract).
 *
 * The table is filled once (pthread_once) by the first caller: a process's driver cannot change,
 * and a failed load is kept too, with its message, so every later call says the same thing.
 */
#include "moedc_cuda.h"

#include "moedc_common.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#define CU_SUCCESS                          0
#define CU_ERROR_INVALID_VALUE              1
#define CU_ERROR_INVALID_CONTEXT            201
#define CU_POINTER_ATTRIBUTE_MEMORY_TYPE    2
#define CU_POINTER_ATTRIBUTE_IS_MANAGED     8
#define CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL 9
#define CU_MEMORYTYPE_DEVICE                2

static pthread_once_t once = PTHREAD_ONCE_INIT;
static moedc_cuda_table table;
static bool loaded;
static moedc_error why; /* why not, when not loaded */

/* Each entry point by the name the driver exports: the versioned one where cuda.h maps the call
 * to it (cuMemAlloc is cuMemAlloc_v2, and so on). The optional ones may be missing. */
static const struct {
    const char *name;
    size_t at;
    bool optional;
} entries[] = {
#define ENTRY(FIELD, NAME)                                                                         \
    {                                                                                              \
        NAME, offsetof(moedc_cuda_table, FIELD), false                                             \
    }
#define OPTIONAL(FIELD, NAME)                                                                      \
    {                                                                                              \
        NAME, offsetof(moedc_cuda_table, FIELD), true                                              \
    }
    ENTRY(cuInit, "cuInit"),
    ENTRY(cuGetErrorName, "cuGetErrorName"),
    ENTRY(cuDeviceGet, "cuDeviceGet"),
    ENTRY(cuDeviceGetCount, "cuDeviceGetCount"),
    ENTRY(cuDeviceGetUuid, "cuDeviceGetUuid_v2"),
    ENTRY(cuDevicePrimaryCtxGetState, "cuDevicePrimaryCtxGetState"),
    ENTRY(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain"),
    ENTRY(cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2"),
    ENTRY(cuCtxPushCurrent, "cuCtxPushCurrent_v2"),
    ENTRY(cuCtxPopCurrent, "cuCtxPopCurrent_v2"),
    ENTRY(cuPointerGetAttributes, "cuPointerGetAttributes"),
    ENTRY(cuMemGetAddressRange, "cuMemGetAddressRange_v2"),
    ENTRY(cuIpcGetMemHandle, "cuIpcGetMemHandle"),
    ENTRY(cuMemAlloc, "cuMemAlloc_v2"),
    ENTRY(cuMemFree, "cuMemFree_v2"),
    ENTRY(cuMemcpyHtoD, "cuMemcpyHtoD_v2"),
    ENTRY(cuMemcpyDtoH, "cuMemcpyDtoH_v2"),
    ENTRY(cuCtxGetCurrent, "cuCtxGetCurrent"),
    ENTRY(cuCtxGetDevice, "cuCtxGetDevice"),
    ENTRY(cuMemHostRegister, "cuMemHostRegister_v2"),
    ENTRY(cuMemHostUnregister, "cuMemHostUnregister"),
    ENTRY(cuMemHostGetDevicePointer, "cuMemHostGetDevicePointer_v2"),
    ENTRY(cuStreamCreate, "cuStreamCreate"),
    ENTRY(cuStreamDestroy, "cuStreamDestroy_v2"),
    ENTRY(cuStreamSynchronize, "cuStreamSynchronize"),
    ENTRY(cuStreamGetCtx, "cuStreamGetCtx"),
    ENTRY(cuStreamIsCapturing, "cuStreamIsCapturing"),
    ENTRY(cuStreamQuery, "cuStreamQuery"),
    ENTRY(cuModuleLoadData, "cuModuleLoadData"),
    ENTRY(cuModuleUnload, "cuModuleUnload"),
    ENTRY(cuModuleGetFunction, "cuModuleGetFunction"),
    ENTRY(cuLaunchKernel, "cuLaunchKernel"),
    ENTRY(cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2"),
    ENTRY(cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2"),
    ENTRY(cuMemcpyDtoDAsync, "cuMemcpyDtoDAsync_v2"),
    ENTRY(cuMemsetD8Async, "cuMemsetD8Async"),
    ENTRY(cuMemHostAlloc, "cuMemHostAlloc"),
    ENTRY(cuMemFreeHost, "cuMemFreeHost"),
    ENTRY(cuEventCreate, "cuEventCreate"),
    ENTRY(cuEventDestroy, "cuEventDestroy_v2"),
    ENTRY(cuEventRecord, "cuEventRecord"),
    ENTRY(cuStreamWaitEvent, "cuStreamWaitEvent"),
    OPTIONAL(cuStreamWriteValue32, "cuStreamWriteValue32_v2"),
    OPTIONAL(cuStreamWaitValue32, "cuStreamWaitValue32_v2"),
#undef OPTIONAL
#undef ENTRY
};

static void load(void)
{
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        moedc_fail(&why, MOEDC_EUNSUPPORTED,
                   "no CUDA driver on this machine (%s): CUDA regions need an NVIDIA driver; "
                   "register a host region instead",
                   dlerror());
        return;
    }
    for (size_t i = 0; i < sizeof entries / sizeof entries[0]; i++) {
        void *fn = dlsym(lib, entries[i].name);
        if (!fn && entries[i].optional) continue;
        if (!fn) {
            moedc_fail(&why, MOEDC_EUNSUPPORTED,
                       "the CUDA driver lacks %s (it is older than CUDA 11.4): update the NVIDIA "
                       "driver, or register a host region instead",
                       entries[i].name);
            dlclose(lib);
            return;
        }
        memcpy((char *)&table + entries[i].at, &fn, sizeof fn);
    }
    int rc = table.cuInit(0);
    if (rc != CU_SUCCESS) {
        moedc_error e;
        moedc_cuda_fail(&table, rc, "cuInit", &e);
        moedc_fail(&why, MOEDC_EUNSUPPORTED,
                   "the CUDA driver has no usable GPU here (%s); register a host region instead",
                   e.msg);
        return; /* the library stays loaded: the process may hold it open for its own use too */
    }
    loaded = true;
}

const moedc_cuda_table *moedc_cuda_api(moedc_error *err)
{
    pthread_once(&once, load);
    if (loaded) return &table;
    *err = why;
    return NULL;
}

bool moedc_cuda_loaded(void)
{
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    if (lib) dlclose(lib); /* the reference RTLD_NOLOAD took */
    return lib != NULL;
}

const moedc_cuda_table *moedc_cuda_streams(moedc_error *err)
{
    const moedc_cuda_table *cu = moedc_cuda_api(err);
    if (cu && (!cu->cuStreamWriteValue32 || !cu->cuStreamWaitValue32)) {
        moedc_fail(err, MOEDC_EUNSUPPORTED,
                   "the CUDA driver lacks cuStreamWriteValue32_v2 (it is older than CUDA 11.7): "
                   "update the NVIDIA driver for stream-ordered calls, or call from the host");
        return NULL;
    }
    if (!cu) { /* say what a stream-ordered call needs, beside why there is no driver */
        char why_not[sizeof err->msg];
        snprintf(why_not, sizeof why_not, "%s", err->msg);
        moedc_fail(err, MOEDC_EUNSUPPORTED, "stream-ordered calls need the CUDA driver: %s",
                   why_not);
    }
    return cu;
}

int moedc_cuda_fail(const moedc_cuda_table *cu, int rc, const char *call, moedc_error *err)
{
    const char *name = NULL;
    if (cu->cuGetErrorName(rc, &name) != CU_SUCCESS || !name) name = "an unknown error";
    return moedc_fail(err, rc == CU_ERROR_INVALID_VALUE ? MOEDC_EINVAL : MOEDC_EDEVICE,
                      "%s: %s (%d)", call, name, rc);
}

int moedc_cuda_enter(const moedc_cuda_table *cu, int ordinal, moedc_error *err)
{
    int dev = 0, rc = cu->cuDeviceGet(&dev, ordinal);
    void *ctx = NULL;
    if (rc) return moedc_cuda_fail(cu, rc, "cuDeviceGet", err);
    if ((rc = cu->cuDevicePrimaryCtxRetain(&ctx, dev)))
        return moedc_cuda_fail(cu, rc, "cuDevicePrimaryCtxRetain", err);
    if ((rc = cu->cuCtxPushCurrent(ctx))) {
        cu->cuDevicePrimaryCtxRelease(dev);
        return moedc_cuda_fail(cu, rc, "cuCtxPushCurrent", err);
    }
    return 0;
}

void moedc_cuda_leave(const moedc_cuda_table *cu, int ordinal)
{
    void *ctx = NULL;
    int dev = 0;
    cu->cuCtxPopCurrent(&ctx);
    if (cu->cuDeviceGet(&dev, ordinal) == CU_SUCCESS) cu->cuDevicePrimaryCtxRelease(dev);
}

/* p's memory type, whether it is managed, and its device ordinal. The driver answers for any
 * address of the process's unified address space; one that insists on a current context gets the
 * first active primary context (the caller's runtime made it: nothing new is created). */
static int pointer_facts(const moedc_cuda_table *cu, const void *p, unsigned *type, bool *managed,
                         int *ordinal, moedc_error *err)
{
    int attrs[] = { CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_IS_MANAGED,
                    CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL };
    uint64_t v[3] = { 0, 0, 0 }; /* each wide enough for what the driver writes */
    void *data[] = { &v[0], &v[1], &v[2] };
    const moedc_cu_ptr ptr = (moedc_cu_ptr)(uintptr_t)p;
    int rc = cu->cuPointerGetAttributes(3, attrs, data, ptr), n = 0, entered = -1;
    if (rc == CU_ERROR_INVALID_CONTEXT && cu->cuDeviceGetCount(&n) == CU_SUCCESS) {
        for (int i = 0; i < n && entered < 0; i++) {
            unsigned flags = 0;
            int active = 0, dev = 0;
            if (cu->cuDeviceGet(&dev, i) == CU_SUCCESS &&
                cu->cuDevicePrimaryCtxGetState(dev, &flags, &active) == CU_SUCCESS && active &&
                moedc_cuda_enter(cu, i, err) == 0)
                entered = i;
        }
        if (entered >= 0) {
            rc = cu->cuPointerGetAttributes(3, attrs, data, ptr);
            moedc_cuda_leave(cu, entered);
        }
    }
    if (rc) return moedc_cuda_fail(cu, rc, "cuPointerGetAttributes", err);
    *type = (unsigned)(v[0] & 0xffffffffu);
    *managed = v[1] != 0;
    *ordinal = (int)(int32_t)(v[2] & 0xffffffffu);
    return 0;
}

static void uuid_text(const unsigned char b[16], char out[48])
{
    snprintf(out, 48, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
             b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
             b[14], b[15]);
}

int moedc_cuda_describe(const void *p, size_t bytes, moedc_cuda_region *out, moedc_error *err)
{
    memset(out, 0, sizeof *out);
    const moedc_cuda_table *cu = moedc_cuda_api(err);
    unsigned type = 0;
    bool managed = false;
    if (!cu || pointer_facts(cu, p, &type, &managed, &out->device, err)) return err->code;
    if (type != CU_MEMORYTYPE_DEVICE || managed)
        return moedc_fail(err, MOEDC_EINVAL,
                          "%p is not device memory (cudaMalloc it; managed and host memory have no "
                          "IPC handle)",
                          p);
    int rc = moedc_cuda_enter(cu, out->device, err);
    if (rc) return rc;
    moedc_cu_ptr base = 0;
    size_t size = 0;
    unsigned char uuid[16];
    int dev = 0;
    const moedc_cu_ptr ptr = (moedc_cu_ptr)(uintptr_t)p;
    if ((rc = cu->cuMemGetAddressRange(&base, &size, ptr)))
        rc = moedc_cuda_fail(cu, rc, "cuMemGetAddressRange", err);
    else if (bytes > size - (out->offset = ptr - base))
        rc = moedc_fail(err, MOEDC_EINVAL,
                        "%zu bytes from %p run past its allocation (%zu bytes from its start)",
                        bytes, p, size - (size_t)out->offset);
    else if ((rc = cu->cuIpcGetMemHandle(out->handle, base)))
        rc = moedc_cuda_fail(cu, rc, "cuIpcGetMemHandle", err);
    else if ((rc = cu->cuDeviceGet(&dev, out->device)) || (rc = cu->cuDeviceGetUuid(uuid, dev)))
        rc = moedc_cuda_fail(cu, rc, "cuDeviceGetUuid", err);
    else
        uuid_text(uuid, out->uuid);
    moedc_cuda_leave(cu, out->device);
    return rc;
}
