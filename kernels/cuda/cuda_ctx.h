/*
 * cuda_ctx — the CUDA backend's state, and what its files share: the resident layers
 * (cuda_weights.c loads them, cuda_replace.c re-places split ones), the execution slots
 * (cuda_pool.c makes them at start), the batches that run on them (cuda_forward.c) and the memory
 * regions (cuda_regions.c); cuda_backend.c opens and destroys the backend and fills its ops table.
 * Not a public header.
 */
#ifndef MOED_CUDA_CTX_H
#define MOED_CUDA_CTX_H

#include "moed_backend_impl.h"
#include "moed_cuda.h"
#include "moed_list.h"
#include "moed_place.h"

#include <cuda_runtime_api.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#define MAX_DEVICES MOED_PLACE_MAX
_Static_assert(MAX_DEVICES <= MOED_CUDA_MAX_PARTS,
               "a split layer's combine adds every entry's part");
#define MAX_GPUS 64 /* GPUs of the host a region may lie on: CUDA ordinals below this */

/* One set of experts as resident: the routed ones (E of them), or the shared experts (one). */
typedef struct dev_set {
    void *w13, *w2;
    float *w13_scale, *w2_scale;
    uint32_t *w13_meta, *w2_meta; /* 2:4 sparse: w13, w2 hold the kept values */
    int E, ff, ff_pad, n_up;
    bool sparse; /* the routed experts of a 2:4 sparse layer (moed_cuda.h's compressed form) */
} dev_set;

/* A split layer's range of experts on one device: their weights, and the kernels' view of them
 * (the layer's shapes, these experts numbered from 0, no shared experts). */
typedef struct cuda_part {
    int entry, device; /* the device entry (index of c->dev) and its GPU */
    dev_set set;
    moed_cuda_layer_dev k;
} cuda_part;

/* A split layer's parts as one placement runs them (a re-placement builds another beside it and
 * swaps it in whole: cuda_replace.c): the placement, its parts (moed_place_parts' entries, each
 * holding its range and copies, numbered locally as moed_place.h says), and the route split's
 * tables: without copies each expert's part and each part's first expert (moed_route_split),
 * with copies each expert's copies (moed_place_copies, moed_route_split_copies). A whole layer has
 * its placement here and no parts. */
typedef struct cuda_split {
    moed_layer_place place;
    int n;
    cuda_part *parts;
    uint8_t *part_of;
    int first[MAX_DEVICES];
    int32_t *copy_off, *copy_local;
    uint8_t *copy_part;
} cuda_split;

typedef struct cuda_layer {
    moed_layer_info info;
    int device; /* the home GPU: its slots run the layer */
    /* Held shared by each job on the layer for its whole run (to its final synchronisation), and
     * exclusively by a re-placement only to swap sp: so no job sees parts being freed. Preferring
     * writers, so that a swap is not put off for ever by overlapping jobs. Allocated apart: the
     * layers' array moves as layers load. */
    pthread_rwlock_t *lock;
    cuda_split sp;
    moed_cuda_layer_dev k; /* what the kernels see (a split layer: its shared experts alone) */
    void *w13, *w2;        /* the allocations behind k (k's pointers are const) */
    void *s13, *s2;
    float *w13_scale, *w2_scale, *s13_scale, *s2_scale; /* FP8 layers */
    uint32_t *w13_meta, *w2_meta;                       /* 2:4 sparse layers */
    void *router; /* [E][d] in router_dtype, as the checkpoint stores it; NULL if none */
    int router_dtype;
    /* An expert shard's map (moed_layer.local_of, [router_experts]) on the home GPU, which the
     * device routing's check applies where the choice lies, and the layer's own on the host, for
     * a choice read to the host; both NULL for a whole layer. */
    int32_t *local_of;
    const int32_t *local_of_host;
} cuda_layer;

/* Small batches replay a captured graph of the pipeline instead of launching its kernels one by
 * one: at a few tokens the launch gaps are a large share of the time. A graph's launches depend
 * only on this key (the buffers are the slot's own and the route lives in device memory). */
#define GRAPH_MAX_PAIRS 512
#define GRAPH_CACHE     16

typedef struct graph_key {
    int slot, dtype, n_active;
    int64_t T, P;
    const void *x; /* the slot's buffers the graph reads and writes (a chunk's rows) */
    void *out;
} graph_key;

typedef struct graph_entry {
    graph_key key;
    cudaGraphExec_t exec;
    uint64_t used; /* for least-recently-used eviction */
} graph_entry;

typedef struct cuda_exec {
    int device;
    cudaStream_t stream;
    cudaStream_t copy;     /* the next chunk's rows come in on it while a chunk computes */
    cudaEvent_t copied;    /* recorded on copy after a chunk's rows are in */
    cudaEvent_t routed[2]; /* recorded after each half of h_route was uploaded */
    /* pinned: the packed input route, in two halves used in turn (a split layer's: followed by
     * where each pair's row is) */
    int32_t *h_route[2];
    void *x_in, *out;
    moed_cuda_work_dev w;
    float *logits;
    int32_t *route; /* device: the packed input route, then route prep's arrays */
    moed_cuda_route_dev r;
    /* Jobs whose parts bring device routing (a home slot; max_tokens entries, a part having at
     * least one token): the packed route's offsets [T+1] and the runs on the host, and a status
     * word per run on the device and in pinned memory, where it comes back with the outputs. */
    int64_t *lay;
    moed_cuda_drun *runs;
    unsigned long long *bad, *h_bad;
    graph_entry graphs[GRAPH_CACHE];
    uint64_t graph_clock;
    /* Split layers (cuda_forward.c). A slot on a home device: a part workspace per device entry
     * (parts[entry]), the event its inputs are ready at, each part's tokens of a chunk (ptok, host,
     * [n_dev][max_tokens]: moed_route_split's tok), the parts' fp32 partial rows (psum, device,
     * min(max_pairs, n_dev * max_tokens) rows of max_d) and where each token's are (prow, device,
     * moed_route_split's row). A part workspace: its tokens' route on the host, their numbers on
     * the device (tok), a landing buffer (max_tokens rows of max_d floats) for its partial rows
     * where it lies on another GPU than the home (and x's rows where peer access is not enabled),
     * and the event its rows are home at. */
    struct cuda_exec *parts;
    int32_t *ptok, *prow, *tok;
    float *psum;
    cudaEvent_t ready, done;
    moed_route sub;
    void *landing;
} cuda_exec;

typedef struct cuda_ctx {
    moed_backend_config cfg;
    int n_dev, dev[MAX_DEVICES], sm[MAX_DEVICES];
    struct cudaDeviceProp prop[MAX_DEVICES];
    cuda_layer *layers;
    int n_layers;
    cuda_exec *execs;
    int n_exec;
    int64_t max_tokens, max_pairs;
    int max_e, max_d_pad, max_ff_pad, max_sff_pad, max_router_e, max_d;
    int fp8_native; /* an FP8 layer runs on the FP8 Tensor Cores: slots need its buffers */
    int force_kernel;
    moed_place_dev place[MAX_DEVICES]; /* the planner's counts per entry */
    /* entry i's GPU writes entry j's memory directly (the same GPU, or peer access enabled) */
    bool direct[MAX_DEVICES][MAX_DEVICES];
    bool landing; /* some part of a split layer lies on another GPU than its home */
    /* Every GPU the process sees (CUDA ordinals 0 .. n_gpus - 1), computed on or not: a client's
     * memory may lie on any of them (map_device), and parts there are moved by copies alone. */
    int n_gpus;
    cudaUUID_t gpu_uuid[MAX_GPUS];
    bool no_peer;                  /* MOED_CUDA_NO_PEER=1: no peer access is ever enabled */
    _Atomic bool peered[MAX_GPUS]; /* peer access with GPU g was set up (cuda_enable_peers) */
    /* Links (cuda_link.c), under link_lock. A free waits for every kernel on the GPU, an open
     * link's receive among them, and may hold off every other thread's CUDA calls meanwhile
     * (docs/fleets.md, "What waits for an idle link"), so a closed link frees nothing while
     * another may have an operation in flight: its page-locked headers go to the next link (freed
     * with the backend), a stopped link's communicators, buffer and stream wait in link_graves,
     * and what moed_backend_when_quiet is handed in quiet_calls, until no link is live (created
     * and not yet stopped). A graph's instantiation can wait so too, so a batch captures no new
     * graph while a link is live (cuda_forward.c, graph_for). */
    pthread_mutex_t link_lock;
    moed_list link_headers;
    moed_list link_graves;
    moed_list quiet_calls;
    int n_graves, n_quiet_calls;
    _Atomic int links_live; /* changed under link_lock; graph_for reads it without */
} cuda_ctx;

/* Rows of the widest layer that a slot's Y holds past the max_pairs rows batches write: zeros,
 * which no kernel writes, for null pairs to read (moed_cuda.h). */
#define NULL_ROWS 2

/* The row of Y that null pairs read for a layer of d_pad columns: the first row at that stride
 * that starts in the zero rows (and so, being d_pad <= max_d_pad long, ends in them too). */
static inline int32_t cuda_null_row(const cuda_ctx *c, int d_pad)
{
    return (int32_t)((c->max_pairs * c->max_d_pad + d_pad - 1) / d_pad);
}

/* A CUDA error as the backend reports it: MOED_EDEVICE, naming the call that failed. */
int cuda_fail(moed_error *err, cudaError_t e, const char *what);

/* Runs a CUDA call; on failure sets rc (cuda_fail) and jumps to the caller's `err` label. */
#define CU(call, what)                                                                             \
    do {                                                                                           \
        cudaError_t cu_e_ = (call);                                                                \
        if (cu_e_ != cudaSuccess) {                                                                \
            rc = cuda_fail(err, cu_e_, what);                                                      \
            goto err;                                                                              \
        }                                                                                          \
    } while (0)

/* The entry (index of c->dev) of GPU `device`. */
static inline int cuda_dev_index(const cuda_ctx *c, int device)
{
    for (int i = 0; i < c->n_dev; i++)
        if (c->dev[i] == device) return i;
    return 0;
}

/* Rows of a GEMM an H200 computes in the time it streams one expert's weights (moed_place_costs'
 * stream_rows): DeepSeek-V3's bf16 expert (88 MB) streams in 21 us at 4.2 TB/s and its rows take
 * 0.163 us each at T = 16384 (docs/benchmarks.md). Half as many bytes (FP8) are twice as many FLOPs
 * a second, so the same. */
#define STREAM_ROWS 128.0

/* cuda_weights.c: loading a layer (the ops table's load_layer), and freeing what it holds. */
int cuda_load_layer(moed_backend *b, int slot, const moed_layer *l, moed_error *err);
void cuda_layer_free(cuda_layer *L);
/* What the planner weighs of L (moed_place_need): its bytes per routed expert, the rest's (router
 * of router_b bytes, shared experts) and the shared experts' work: as measured where the experts'
 * pairs over `launches` launches are given (moed_place_shared_work_measured), else expected. */
moed_place_need cuda_layer_need(const cuda_layer *L, uint64_t router_b, bool split,
                                const double *pairs, double launches);
/* The parts of placement sp->place for split layer L: entries, GPUs, shapes and the route split's
 * tables, their weights not yet allocated (cuda_split_alloc); cuda_split_free frees what is. */
int cuda_split_init(const cuda_ctx *c, const cuda_layer *L, cuda_split *sp, moed_error *err);
void cuda_split_free(cuda_split *sp);
/* Allocates part P's weights on its GPU (the current device) and points its kernels' view at
 * them. */
int cuda_part_alloc(const cuda_layer *L, cuda_part *P, moed_error *err);

/* cuda_replace.c: the ops table's replace_layer. */
int cuda_replace_layer(moed_backend *b, int slot, const moed_replace_req *req,
                       moed_replace_result *res, moed_error *err);
/* Whether `need` bytes are free on GPU `device`; else MOED_ENOMEM saying what needed them. */
int cuda_check_free(int device, uint64_t need, const char *what, moed_error *err);

/* cuda_pool.c: the execution slots (the ops table's start), and freeing one. */
int cuda_start(moed_backend *b, moed_error *err);
void cuda_exec_free(cuda_ctx *c, cuda_exec *x);

/* cuda_forward.c: the ops table's forward and router_logits. */
int cuda_forward(moed_backend *b, int exec, const moed_job *job, moed_error *err);
int cuda_router_logits(moed_backend *b, int exec, const moed_job *job, float *logits,
                       moed_error *err);

/* cuda_regions.c: the ops table's region calls, and peer access between a GPU and the backend's. */
int cuda_host_register(moed_backend *b, void *p, size_t bytes, moed_error *err);
void cuda_host_unregister(moed_backend *b, void *p);
void cuda_device_uuid(moed_backend *b, int dev, char out[48]);
int cuda_map_device(moed_backend *b, const void *handle, size_t handle_len, const char *device_uuid,
                    int device, uint64_t bytes, uint64_t offset, void **ptr, int *dev, void **base,
                    moed_error *err);
void cuda_unmap_device(moed_backend *b, void *base, int dev);
int cuda_read_device(moed_backend *b, void *dst, const void *src, int dev, size_t bytes,
                     moed_error *err);
void cuda_enable_peers(cuda_ctx *c, int gpu);

/* cuda_link.c: the ops table's links, and the release of what closed links kept (with the
 * backend, once no link is left). */
extern const moed_backend_link_ops cuda_link_ops;
void cuda_links_free(cuda_ctx *c);
void cuda_when_quiet(moed_backend *b, void (*fn)(void *arg), void *arg);

#endif
