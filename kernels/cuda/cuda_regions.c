/*
 * cuda_regions — memory a client shares with the backend: host regions page-locked for the GPU's
 * copies, and GPU regions another process exports by CUDA IPC, opened on the GPU the client names
 * (by UUID, or by CUDA ordinal as this process sees it) and checked against the exported
 * allocation's bounds before any byte of it is used. That GPU may be any the process sees, also one
 * the backend does not compute on (attention on one GPU, the experts on another): the handle is
 * opened in that GPU's primary context, and jobs move its memory by copies (cuda_forward.c), over
 * peer access where the GPUs have it, else staged through host memory by the driver. Also peer
 * access between GPUs, which those regions and split layers need.
 */
#include "cuda_ctx.h"

#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
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
    if (dev >= 0 && dev < c->n_gpus) uuid_str(&c->gpu_uuid[dev], out);
}

/* The GPU (CUDA ordinal) a client means, among every GPU this process sees: by UUID, or else by
 * ordinal. Refusals name the GPUs it sees, so the caller can tell a hidden GPU from a typo. */
static int find_gpu(const cuda_ctx *c, const char *uuid, int device, moed_error *err)
{
    char seen[MAX_GPUS * 50] = "", one[48];
    for (int g = 0; g < c->n_gpus; g++) {
        uuid_str(&c->gpu_uuid[g], one);
        if (uuid && *uuid ? !strcasecmp(one, uuid) : g == device) return g;
        snprintf(seen + strlen(seen), sizeof seen - strlen(seen), "%s%d %s", g ? ", " : "", g, one);
    }
    const char *vis = getenv("CUDA_VISIBLE_DEVICES");
    char why[200] = "";
    if (vis) snprintf(why, sizeof why, "; CUDA_VISIBLE_DEVICES=%.120s", vis);
    if (uuid && *uuid)
        return moed_fail(err, MOED_EPRECOND,
                         "GPU %.60s is not visible to this server (it sees %d GPU%s: %s%s): make "
                         "that GPU visible to moed, or register a host region",
                         uuid, c->n_gpus, c->n_gpus == 1 ? "" : "s", seen, why);
    return moed_fail(err, MOED_EPRECOND,
                     "this server sees no GPU %d (it sees %d GPU%s: %s%s); give the device's UUID",
                     device, c->n_gpus, c->n_gpus == 1 ? "" : "s", seen, why);
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

/* Peer access between GPU `gpu` and each of the backend's GPUs, both ways, where the two allow it:
 * copies between them then go straight over NVLink or PCIe, and a split layer's parts write their
 * home's memory directly. Without it the driver stages copies through host memory. Set up once a
 * GPU (the first region there, or start for the backend's own); never with MOED_CUDA_NO_PEER=1. */
void cuda_enable_peers(cuda_ctx *c, int gpu)
{
    if (c->no_peer || gpu < 0 || gpu >= MAX_GPUS || atomic_exchange(&c->peered[gpu], true)) return;
    for (int i = 0; i < c->n_dev; i++) {
        int to = 0, from = 0;
        if (c->dev[i] == gpu) continue;
        if (cudaDeviceCanAccessPeer(&to, c->dev[i], gpu) == cudaSuccess && to) {
            cudaSetDevice(c->dev[i]);
            cudaDeviceEnablePeerAccess(gpu, 0);
        }
        if (cudaDeviceCanAccessPeer(&from, gpu, c->dev[i]) == cudaSuccess && from) {
            cudaSetDevice(gpu);
            cudaDeviceEnablePeerAccess(c->dev[i], 0);
        }
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
    const int g = find_gpu(c, device_uuid, device, err);
    if (g < 0) return g;
    cuda_enable_peers(c, g);
    cudaIpcMemHandle_t h;
    memcpy(&h, handle, sizeof h);
    void *p = NULL;
    cudaSetDevice(g); /* its primary context, which the backend's copies from and to it use */
    cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return moed_fail(err, MOED_EINVAL,
                         "the IPC handle does not open on GPU %d: %s (%s); send a handle of a live "
                         "allocation on that GPU, made by another process",
                         g, cudaGetErrorName(e), cudaGetErrorString(e));
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
    *ptr = (char *)p + offset;
    *dev = g;
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
