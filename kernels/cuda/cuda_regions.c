/*
 * cuda_regions — memory a client shares with the backend: host regions page-locked for the GPU's
 * copies, and GPU regions another process exports by CUDA IPC, opened on the device the client
 * names (by UUID, or by the server's ordinal) and checked against the exported allocation's bounds
 * before any byte of it is used. Also peer access between the backend's GPUs, which both IPC
 * regions and split layers need.
 */
#include "cuda_ctx.h"

#include <cuda.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

int cuda_host_register(moed_backend *b, void *p, size_t bytes, moed_error *err)
{
    (void)b;
    cudaError_t e = cudaHostRegister(p, bytes, cudaHostRegisterPortable);
    if (e == cudaSuccess) return 0;
    cudaGetLastError();
    return moed_fail(err, MOED_ENOMEM,
                     "could not page-lock the region's %zu bytes for the GPU's copies: %s (%s)",
                     bytes, cudaGetErrorName(e), cudaGetErrorString(e));
}

void cuda_host_unregister(moed_backend *b, void *p)
{
    (void)b;
    if (cudaHostUnregister(p) != cudaSuccess) cudaGetLastError();
}

static void uuid_str(const cudaUUID_t *u, char out[48])
{
    const unsigned char *b = (const unsigned char *)u->bytes;
    snprintf(out, 48, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
             b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
             b[14], b[15]);
}

void cuda_device_uuid(moed_backend *b, int dev, char out[48])
{
    const cuda_ctx *c = b->ctx;
    out[0] = 0;
    for (int i = 0; i < c->n_dev; i++)
        if (c->dev[i] == dev) uuid_str(&c->prop[i].uuid, out);
}

/* Which of the backend's devices a client means: by UUID, or else by the server's ordinal. */
static int find_device(const cuda_ctx *c, const char *uuid, int device, moed_error *err)
{
    char have[MAX_DEVICES * 50] = "", one[48];
    for (int i = 0; i < c->n_dev; i++) {
        uuid_str(&c->prop[i].uuid, one);
        if (uuid && *uuid ? !strcasecmp(one, uuid) : c->dev[i] == device) return i;
        snprintf(have + strlen(have), sizeof have - strlen(have), "%s%d %s", i ? ", " : "",
                 c->dev[i], one);
    }
    if (uuid && *uuid)
        return moed_fail(err, MOED_EPRECOND,
                         "GPU %.60s is not one this server computes on (its GPUs: %s); register "
                         "memory on one of them, or a host region",
                         uuid, have);
    return moed_fail(err, MOED_EPRECOND,
                     "this server has no GPU %d (its GPUs: %s); give the device's UUID", device,
                     have);
}

typedef CUresult (*get_range_fn)(CUdeviceptr *base, size_t *size, CUdeviceptr p);

/* cuMemGetAddressRange from the driver, without linking it: the daemon still starts where no
 * driver is installed. */
static get_range_fn get_range(void)
{
    static get_range_fn fn;
    static int looked;
    if (!looked) {
        void *p = NULL;
        enum cudaDriverEntryPointQueryResult q;
        if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &p, 12000, cudaEnableDefault,
                                             &q) == cudaSuccess &&
            q == cudaDriverEntryPointSuccess)
            fn = (get_range_fn)p;
        looked = 1;
    }
    return fn;
}

/* Lets the backend's other GPUs copy from and to dev directly (peer copies work without it, more
 * slowly, through the host). */
void cuda_enable_peers(const cuda_ctx *c, int dev)
{
    for (int i = 0; i < c->n_dev; i++) {
        int can = 0;
        if (c->dev[i] == dev || cudaDeviceCanAccessPeer(&can, c->dev[i], dev) != cudaSuccess ||
            !can)
            continue;
        cudaSetDevice(c->dev[i]);
        cudaDeviceEnablePeerAccess(dev, 0);
        cudaGetLastError(); /* already enabled is fine */
    }
}

int cuda_map_device(moed_backend *b, const void *handle, size_t handle_len, const char *device_uuid,
                    int device, uint64_t bytes, uint64_t offset, void **ptr, int *dev, void **base,
                    moed_error *err)
{
    cuda_ctx *c = b->ctx;
    if (handle_len != sizeof(cudaIpcMemHandle_t))
        return moed_fail(err, MOED_EINVAL,
                         "ipc_handle is %zu bytes; a cudaIpcMemHandle_t is %zu (send the bytes "
                         "cudaIpcGetMemHandle wrote)",
                         handle_len, sizeof(cudaIpcMemHandle_t));
    const int di = find_device(c, device_uuid, device, err);
    if (di < 0) return di;
    cudaIpcMemHandle_t h;
    memcpy(&h, handle, sizeof h);
    void *p = NULL;
    cudaSetDevice(c->dev[di]);
    cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return moed_fail(err, MOED_EINVAL,
                         "the IPC handle does not open on GPU %d: %s (%s); send a handle of a live "
                         "allocation on that GPU, made by another process",
                         c->dev[di], cudaGetErrorName(e), cudaGetErrorString(e));
    }
    CUdeviceptr abase = 0;
    size_t asize = 0;
    get_range_fn range = get_range();
    if (!range || range(&abase, &asize, (CUdeviceptr)(uintptr_t)p) != CUDA_SUCCESS ||
        offset > asize || bytes > asize - offset) {
        cudaIpcCloseMemHandle(p);
        if (!range)
            return moed_fail(
                err, MOED_EPRECOND,
                "the CUDA driver does not offer cuMemGetAddressRange, which moed needs "
                "to check a region's bounds");
        return moed_fail(err, MOED_EINVAL,
                         "offset %llu + bytes %llu run past the exported allocation (%zu bytes)",
                         (unsigned long long)offset, (unsigned long long)bytes, asize);
    }
    cuda_enable_peers(c, c->dev[di]);
    *ptr = (char *)p + offset;
    *dev = c->dev[di];
    *base = p;
    return 0;
}

void cuda_unmap_device(moed_backend *b, void *base, int dev)
{
    (void)b;
    cudaSetDevice(dev);
    if (cudaIpcCloseMemHandle(base) != cudaSuccess) cudaGetLastError();
}

int cuda_read_device(moed_backend *b, void *dst, const void *src, int dev, size_t bytes,
                     moed_error *err)
{
    (void)b;
    cudaSetDevice(dev);
    cudaError_t e = cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost);
    return e == cudaSuccess ? 0 : cuda_fail(err, e, "a copy from a CUDA region");
}
