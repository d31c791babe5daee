/*
 * cuda_backend — the CUDA implementation of moed_backend (host code, C): its life cycle (open, the
 * device query, destroy) and its ops table. The rest lives by job: resident weights and placement
 * in cuda_weights.c, re-placing a split layer while it serves in cuda_replace.c, the execution
 * slots in cuda_pool.c, the per-batch pipeline of moed_cuda.h in cuda_forward.c, memory regions in
 * cuda_regions.c; cuda_ctx.h holds what they share.
 *
 * Open checks the devices (sm_80 or newer, the ones --devices names) and records their free
 * memory for the placement of the layers that load_layer then receives, and the UUID of every GPU
 * the process sees (a region may lie on one it does not compute on); start sizes the slots.
 */
#include "cuda_backend.h"
#include "cuda_ctx.h"

#include <stdio.h>
#include <stdlib.h>

int cuda_fail(moed_error *err, cudaError_t e, const char *what)
{
    return moed_fail(err, MOED_EDEVICE, "CUDA error during %s: %s (%s)", what, cudaGetErrorName(e),
                     cudaGetErrorString(e));
}

/* Every kernel loaded when the process first touches CUDA (unless the environment says otherwise):
 * a kernel loaded lazily, at its first launch, waits for every kernel running on the GPU, and a
 * link's receive runs until its caller's next message comes (docs/fleets.md, "What waits for an
 * idle link"), which may wait on this very launch: measured on an H200, a first launch beside a
 * spinning kernel returned only when that kernel ended. Called before the first CUDA call of the
 * backend's entry points, when the driver reads the setting. */
static void load_kernels_eagerly(void)
{
    setenv("CUDA_MODULE_LOADING", "EAGER", 0);
}

int moed_backend_cuda_available(void)
{
    load_kernels_eagerly();
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    for (int i = 0; i < n; i++) {
        int major = 0;
        if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, i) == cudaSuccess &&
            major >= 8)
            return 1;
    }
    return 0;
}

static int cuda_exec_accepts(moed_backend *b, int exec, int slot)
{
    const cuda_ctx *c = b->ctx;
    return exec >= 0 && exec < c->n_exec && slot >= 0 && slot < c->n_layers &&
           c->execs[exec].device == c->layers[slot].device;
}

static int cuda_layer_place(moed_backend *b, int slot, moed_layer_place *out)
{
    const cuda_ctx *c = b->ctx;
    if (slot < 0 || slot >= c->n_layers) return MOED_EINVAL;
    const cuda_layer *L = &c->layers[slot];
    pthread_rwlock_rdlock(L->lock); /* a re-placement may be swapping it in */
    *out = L->sp.place;
    pthread_rwlock_unlock(L->lock);
    return 0;
}

static void *cuda_host_alloc(moed_backend *b, size_t bytes)
{
    void *p = NULL;
    (void)b;
    return cudaHostAlloc(&p, bytes ? bytes : 1, cudaHostAllocPortable) == cudaSuccess ? p : NULL;
}

static void cuda_host_free(moed_backend *b, void *p)
{
    (void)b;
    if (p) cudaFreeHost(p);
}

static int cuda_device_info(moed_backend *b, int i, moed_device_info *out)
{
    cuda_ctx *c = b->ctx;
    if (i < 0 || i >= c->n_dev) return MOED_EINVAL;
    size_t free_b = 0, total_b = 0;
    cudaSetDevice(c->dev[i]);
    cudaMemGetInfo(&free_b, &total_b);
    snprintf(out->name, sizeof out->name, "%.64s (GPU %d, sm_%d)", c->prop[i].name, c->dev[i],
             c->sm[i]);
    out->memory_total = total_b;
    out->memory_used = total_b - free_b;
    return 0;
}

static void cuda_destroy(moed_backend *b)
{
    cuda_ctx *c = b->ctx;
    for (int i = 0; i < c->n_exec; i++) cuda_exec_free(c, &c->execs[i]);
    for (int i = 0; i < c->n_layers; i++) cuda_layer_free(&c->layers[i]);
    cuda_links_free(c);
    pthread_mutex_destroy(&c->link_lock);
    free(c->execs);
    free(c->layers);
    free(c);
    free(b);
}

static int cuda_device_ordinal(moed_backend *b, int i)
{
    const cuda_ctx *c = b->ctx;
    return i >= 0 && i < c->n_dev ? c->dev[i] : MOED_HOST_MEM;
}

static const moed_backend_ops cuda_ops = {
    .name = "cuda",
    .host_dma = true,
    .load_layer = cuda_load_layer,
    .start = cuda_start,
    .forward = cuda_forward,
    .router_logits = cuda_router_logits,
    .host_alloc = cuda_host_alloc,
    .host_free = cuda_host_free,
    .device_info = cuda_device_info,
    .exec_accepts = cuda_exec_accepts,
    .layer_place = cuda_layer_place,
    .replace_layer = cuda_replace_layer,
    .host_register = cuda_host_register,
    .host_unregister = cuda_host_unregister,
    .map_device = cuda_map_device,
    .unmap_device = cuda_unmap_device,
    .read_device = cuda_read_device,
    .device_uuid = cuda_device_uuid,
    .device_ordinal = cuda_device_ordinal,
    .links = &cuda_link_ops,
    .when_quiet = cuda_when_quiet,
    .destroy = cuda_destroy,
};

int moed_backend_cuda_open(const moed_backend_config *cfg, moed_backend **out, moed_error *err)
{
    int n = 0, rc = 0;
    cuda_ctx *c = NULL;
    moed_backend *b = NULL;
    *out = NULL;
    load_kernels_eagerly();
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
        cudaGetLastError();
        return moed_fail(err, MOED_ENODEV, "no CUDA device answers (%s); use --backend cpu",
                         e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
    }
    c = calloc(1, sizeof *c);
    b = calloc(1, sizeof *b);
    if (!c || !b) {
        rc = moed_fail(err, MOED_ENOMEM, "out of host memory");
        goto err;
    }
    c->cfg = *cfg;
    pthread_mutex_init(&c->link_lock, NULL);
    moed_list_init(&c->link_headers);
    moed_list_init(&c->link_graves);
    moed_list_init(&c->quiet_calls);
    c->max_tokens = cfg->max_tokens > 0 ? cfg->max_tokens : 8192;
    c->force_kernel = moed_cuda_kernel_parse(getenv("MOED_CUDA_KERNEL"));
    const char *no_peer = getenv("MOED_CUDA_NO_PEER");
    c->no_peer = no_peer && *no_peer == '1';
    c->n_gpus = n < MAX_GPUS ? n : MAX_GPUS;
    for (int i = 0; i < c->n_gpus; i++) { /* a GPU that does not answer keeps a UUID of zeros */
        struct cudaDeviceProp pr;
        if (cudaGetDeviceProperties(&pr, i) == cudaSuccess)
            c->gpu_uuid[i] = pr.uuid;
        else
            cudaGetLastError();
    }
    const int listed = cfg->devices && cfg->n_devices > 0;
    const int want = listed ? cfg->n_devices : n;
    for (int i = 0; i < want && c->n_dev < MAX_DEVICES; i++) {
        const int id = listed ? cfg->devices[i] : i;
        struct cudaDeviceProp *pr = &c->prop[c->n_dev];
        if (id < 0 || id >= n) {
            rc = moed_fail(err, MOED_EINVAL, "--devices names GPU %d, but only GPUs 0..%d exist",
                           id, n - 1);
            goto err;
        }
        CU(cudaGetDeviceProperties(pr, id), "cudaGetDeviceProperties");
        const int sm = pr->major * 10 + pr->minor;
        if (sm < 80) {
            rc = moed_fail(err, MOED_ENODEV,
                           "GPU %d (%.64s) is sm_%d; the CUDA backend needs sm_80 or newer", id,
                           pr->name, sm);
            goto err;
        }
        size_t free_b = 0, total_b = 0;
        CU(cudaSetDevice(id), "cudaSetDevice");
        CU(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
        c->place[c->n_dev] = (moed_place_dev){ .gpu = id, .free = free_b };
        c->sm[c->n_dev] = sm;
        c->dev[c->n_dev++] = id;
    }
    if (cfg->expert_parallel && c->n_dev < 2) {
        rc = moed_fail(err, MOED_EINVAL,
                       "--expert-parallel splits each layer's experts over the devices, but only "
                       "GPU %d is used: list two or more (--devices 0,1; or --devices 0,0 to run "
                       "the split on one GPU)",
                       c->dev[0]);
        goto err;
    }
    b->ops = &cuda_ops;
    b->ctx = c;
    b->n_devices = c->n_dev;
    *out = b;
    return 0;
err:
    if (c) pthread_mutex_destroy(&c->link_lock);
    free(c);
    free(b);
    return rc;
}
