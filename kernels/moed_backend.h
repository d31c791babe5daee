/*
 * moed_backend — the one interface every compute backend implements, so the daemon, the tests and
 * the benchmarks drive the CPU and CUDA backends through the same calls. The handle is opaque: a
 * caller uses only the functions below, which supply the default of any call an implementation
 * leaves out (moed_backend_impl.h, the implementations' side, says which may be left out).
 *
 * Life cycle: open (by name through moed_registry.h, or one backend's own constructor) → load_layer
 * for every layer → start → (forward | router_logits)* → destroy. A backend offers n_exec execution
 * slots (CUDA: one per stream of the pool, each with its own pinned staging and device workspace;
 * CPU: one, running on all its threads). Calls on different slots may run concurrently from
 * different threads; calls on one slot must not. forward and router_logits return when the result
 * is complete where the job said it goes (host or device memory) and visible to any reader there.
 *
 * A job's tokens come in parts (moed_part): the rows of each merged request lie where that request
 * keeps them — staging memory, a client's shared memory, a client's GPU memory — and its output
 * goes where it asked. The backend moves each part once (CUDA: host to device straight from pinned
 * pages, device to device or peer from other GPUs, nothing at all for a lone part already on the
 * layer's GPU) and never assumes the parts lie side by side. Memory of other processes comes in
 * through the region hooks at the end (host_register, map_device), called when a region is
 * registered, never per job; a CUDA region may lie on any GPU the process sees, also one the
 * backend does not compute on, whose parts it moves by copies alone.
 *
 * Contract on results: a token's output depends only on its own row of x and its own pairs of the
 * route, in their order — never on T or on the other tokens of the job — so merged requests are
 * bit-identical to the same requests run alone.
 *
 * Routing where the caller keeps it: a part may bring its expert choice in device memory
 * (moed_part_route) instead of the job's host route. A backend with devices (CUDA) reads and checks
 * it there, with no copy to the host, and reports that part's own status: a refused choice fails
 * its part alone, and every other part's output is the same bits as without it. A backend without
 * devices (CPU) refuses such a part (MOED_EPRECOND): its callers give host routes. A layer split
 * over devices reads the choice to the host first (moed_backend_host_route) and runs as with a host
 * route. On an expert shard's view (moed_layer.local_of) the job's host route is in the held
 * experts' numbering (the caller renumbers it, moed_route_localize) and device routing in the
 * whole layer's: its ids are checked against router_experts and each pair of an expert not held
 * counts as padding, exactly as if the caller had renumbered it.
 */
#ifndef MOED_BACKEND_H
#define MOED_BACKEND_H

#include "moed_err.h"
#include "moed_model.h"
#include "moed_nccl.h"
#include "moed_place.h"
#include "moed_route.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct moed_backend moed_backend;

typedef struct moed_backend_config {
    int threads;        /* CPU: worker threads, 0 = one per core */
    int streams;        /* CUDA: streams per device, 0 = default (4) */
    const int *devices; /* CUDA: device ordinals to use, in order, a GPU listed twice counting as
                           two devices (to run a split on one GPU); NULL = all */
    int n_devices;
    int64_t max_tokens;   /* the most tokens one job may carry: sizes staging and workspaces */
    bool expert_parallel; /* CUDA: split every layer's experts over the devices (moed_place.h);
                             refused by a backend with one device */
} moed_backend_config;

/* Where a part's memory is: host memory, or device memory of a GPU, by its CUDA ordinal as the
 * process sees it (CUDA_VISIBLE_DEVICES applied: the numbering of moed_backend_config.devices). */
#define MOED_HOST_MEM (-1)

/* A part's expert choice in device memory: ids int32 [rows, k] and weights float32 [rows, k],
 * row-major, on GPU `dev` (as moed_part's memory may be), k >= 1. Its pairs are exactly those
 * moed_route_from_choice makes of the same ids and weights, in their order (padding, id -1 with
 * weight 0, left out; a repeated id adds), so the part's outputs are the same bits as with those
 * pairs in the job's route. The choice is checked by moed_choice_rule's rules; the first refused
 * pair (row-major) fails the part: err.code MOED_EINVAL, err.msg naming the pair's row (within the
 * part) and column and the rule broken, never a value. A refused pair counts as no pair, so it
 * touches no other part: every other part's output is the same bits as the same launch without this
 * part. A failed part's rows of y are written, with unspecified values. Each token counts k pairs
 * (padding included) toward the workspace, which runs a job in chunks of what it holds
 * (MOED_ETOOBIG for the job when one token's k is over it). */
typedef struct moed_part_route {
    const int32_t *ids;
    const float *weights;
    int k;
    int dev;
    moed_error err; /* set by forward when it returns 0: code 0, or MOED_EINVAL and why */
} moed_part_route;

/* One run of consecutive tokens of a job: where its rows of x come from and where its rows of y
 * go. Host memory may be pageable, pinned (host_alloc) or registered (host_register); device
 * memory must be the backend's own (on one of its devices) or mapped by map_device (on any GPU the
 * process sees: one the backend does not compute on is reached by copies alone). */
typedef struct moed_part {
    int64_t rows;  /* tokens in this part, >= 1 */
    const void *x; /* [rows, d_model] */
    int x_dev;     /* MOED_HOST_MEM or the device holding x */
    void *y;       /* [rows, d_model], fully written */
    int y_dev;
    /* NULL: the part's pairs are in the job's route. Else the part's choice in device memory; the
     * job's route then has no pair for its tokens (empty entries: off[t + 1] == off[t]). */
    moed_part_route *route;
} moed_part;

typedef struct moed_job {
    int slot;  /* which resident layer: the slot given to load_layer */
    int dtype; /* of x and y: MOED_F32, MOED_F16 or MOED_BF16 */
    int64_t T; /* tokens, 1 .. max_tokens */
    /* The tokens, in route order: parts[0] holds tokens 0 .. parts[0].rows - 1, and so on; their
     * rows add up to T. n_parts == 0 is one part of host memory: x and y below. */
    const moed_part *parts;
    int n_parts;
    const void *x; /* [T, d_model] host memory, when n_parts == 0 */
    void *y;
    const moed_route *route; /* T tokens (forward; router_logits does not read it) */
} moed_job;

typedef struct moed_device_info {
    char name[96];
    uint64_t memory_total; /* bytes */
    uint64_t memory_used;  /* bytes */
} moed_device_info;

/* "cpu", "cuda". */
const char *moed_backend_name(const moed_backend *b);

/* Whether the backend computes from the host memory of its layers for as long as it runs (the
 * CPU backend) instead of copying it to a device while loading (CUDA): such memory must be
 * memory moed owns, never a mapping of a file that can change under it. */
bool moed_backend_computes_from_host(const moed_backend *b);

/* Makes layer l resident as `slot` (0, 1, ... in load order). l and the memory it points to stay
 * valid until the backend is destroyed, so a backend may compute from it in place (the CPU backend
 * does) or copy it to its device (CUDA). */
int moed_backend_load_layer(moed_backend *b, int slot, const moed_layer *l, moed_error *err);

/* Sizes and allocates per-slot staging and workspaces once every layer is loaded; fails with
 * MOED_ENOMEM naming bytes needed and free. */
int moed_backend_start(moed_backend *b, moed_error *err);

/* Execution slots, valid after start (0 before). */
int moed_backend_n_exec(const moed_backend *b);

/* Devices device_info answers for. */
int moed_backend_n_devices(const moed_backend *b);

/* Runs job on execution slot `exec`. Returns 0 when the launch ran, whatever the statuses of its
 * parts' device routing (moed_part_route.err); anything else fails the whole job. */
int moed_backend_forward(moed_backend *b, int exec, const moed_job *job, moed_error *err);

/* The job's route with the pairs of its parts' device routing read to the host (read_device) and
 * checked there by the rules forward applies, for ids numbered [0, n_experts), then renumbered by
 * local_of when it is not NULL (an expert shard's map, moed_layer.local_of): into *out (which
 * the caller frees with moed_route_free), job->T tokens; each such part's err set as forward sets
 * it, a failed part's tokens left with no pair. The caller then runs the job on *out with those
 * parts' route set to NULL (a failed part's rows of y being unspecified, as with forward).
 * MOED_EPRECOND on a backend without devices, MOED_ENOMEM, or read_device's error. */
int moed_backend_host_route(moed_backend *b, const moed_job *job, int n_experts,
                            const int32_t *local_of, moed_route *out, moed_error *err);

/* logits [T, n_experts] float32 (host memory) = x [T, d_model] @ router^T of the job's layer, x
 * being the job's parts (their y and the route are not used), accumulated in float32 from x and
 * the router as stored (neither rounded to a compute type first), then moed_router_round_logits:
 * the model's own logits, the same bits on every backend. */
int moed_backend_router_logits(moed_backend *b, int exec, const moed_job *job, float *logits,
                               moed_error *err);

/* Host memory the backend moves fastest (pinned for CUDA), 64-byte aligned; NULL when out of
 * memory. Freed with moed_backend_host_free (p may be NULL). */
void *moed_backend_host_alloc(moed_backend *b, size_t bytes);
void moed_backend_host_free(moed_backend *b, void *p);

/* Device i's name and memory, 0 <= i < n_devices. */
int moed_backend_device_info(moed_backend *b, int i, moed_device_info *out);

/* Whether execution slot `exec` can run layer `slot`: with several GPUs a layer is resident on one
 * of them, and only that GPU's slots can run it. */
int moed_backend_exec_accepts(moed_backend *b, int exec, int slot);

/* Where layer `slot` lives (moed_place.h): its home device and its experts' ranges, in the
 * backend's numbering of the layer's experts (0 .. n_experts-1) and of devices (device_info's). A
 * split layer's job runs on its home device's slots; its result is deterministic for the placement
 * and within one rounding of the output dtype of the same layer unsplit (docs/cuda.md). */
int moed_backend_layer_place(moed_backend *b, int slot, moed_layer_place *out);

/* What a re-placement of a split layer by its measured load weighs. */
typedef struct moed_replace_req {
    const double *pairs; /* (token, expert) pairs each expert of the layer's view had, n_experts */
    double launches;     /* launches of the layer over the same period (0: unknown) */
    int max_replicas;    /* extra copies of hot experts it may make (0: none), memory allowing */
    double min_gain;     /* applied only if the heaviest device's predicted work drops by at least
                          * this fraction of it (0.05: 5 %) */
} moed_replace_req;

typedef struct moed_replace_result {
    bool changed;         /* the layer now runs on the new placement */
    double before, after; /* the heaviest device's predicted work under the old and the new
                           * placement, in rows' time (moed_place_costs) */
} moed_replace_result;

/* Re-places split layer `slot` by the load in req: a new cut of its experts (and copies of hot
 * ones) over the same devices, built beside the old one and swapped in between jobs, so no call
 * fails or waits for more than the swap; the layer's replies stay deterministic for each placement
 * and within one rounding of the layer unsplit. Unchanged (res->changed false, rc 0) when the gain
 * is below req->min_gain. MOED_EPRECOND for a layer the backend keeps whole (every layer on the
 * cpu backend), MOED_ENOMEM (nothing changed) when the new parts do not fit beside the old.
 * Called from one thread at a time, not from an execution slot's. */
int moed_backend_replace_layer(moed_backend *b, int slot, const moed_replace_req *req,
                               moed_replace_result *res, moed_error *err);
/* ---- regions: other processes' memory (registered once, used by many jobs) ---- */

/* Whether the backend moves host memory only by DMA, never reading or writing it with a CPU (CUDA:
 * copies from pinned pages). Such a backend may be handed a client's shared memory directly: a
 * DMA into pages that were pinned cannot fault when the client shrinks the object, where a CPU
 * read would raise SIGBUS. Other backends (cpu) get copies made under moed_guard. */
bool moed_backend_host_dma(const moed_backend *b);

/* Page-locks host memory [p, p + bytes) for DMA until host_unregister (CUDA: cudaHostRegister);
 * backends without DMA do nothing. */
int moed_backend_host_register(moed_backend *b, void *p, size_t bytes, moed_error *err);
void moed_backend_host_unregister(moed_backend *b, void *p);

/* Opens another process's device memory: an IPC handle (handle_len bytes: cudaIpcMemHandle_t) of
 * an allocation on the GPU named by device_uuid ("GPU-...", as nvidia-smi -L prints it; NULL or
 * "": the GPU of CUDA ordinal `device`), any GPU the process sees, whether the backend computes on
 * it or not. Checks that offset + bytes lie within the allocation and returns the pointer to its
 * byte `offset` in *ptr, the GPU's ordinal in *dev and what to hand unmap_device in *base. CUDA
 * opens it in that GPU's primary context and, the first time a GPU is mapped, enables peer access
 * between it and the backend's GPUs where they allow it (none with MOED_CUDA_NO_PEER=1), so jobs
 * copy over NVLink or PCIe, else staged through host memory. MOED_EPRECOND on a backend without
 * devices ("this server runs the cpu backend; ...") or for a GPU the process does not see (the
 * message lists those it sees); MOED_EINVAL for a handle that does not open or an allocation too
 * small. */
int moed_backend_map_device(moed_backend *b, const void *handle, size_t handle_len,
                            const char *device_uuid, int device, uint64_t bytes, uint64_t offset,
                            void **ptr, int *dev, void **base, moed_error *err);
void moed_backend_unmap_device(moed_backend *b, void *base, int dev);

/* Runs fn(arg) once nothing of the backend waits on a peer: now, or later on another thread (CUDA:
 * once no link is live, by the thread that stops the last one, or at destroy). For what would wait
 * for every kernel on the GPU, a link's pending receive among them (which runs until its caller
 * sends): host_unregister and unmap_device (docs/fleets.md, "What waits for an idle link").
 * Backends without links run it now. */
void moed_backend_when_quiet(moed_backend *b, void (*fn)(void *arg), void *arg);

/* Copies bytes from device memory (of GPU dev: the backend's own, or mapped by map_device) to host
 * memory, synchronously: routing tensors that a client keeps on its GPU. */
int moed_backend_read_device(moed_backend *b, void *dst, const void *src, int dev, size_t bytes,
                             moed_error *err);

/* GPU dev's UUID (any GPU the process sees) as "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", for
 * region listings; "" when the backend has no devices or the process no such GPU. */
void moed_backend_device_uuid(moed_backend *b, int dev, char out[48]);

/* ---- links: a two-rank NCCL communicator with a buffer of device memory (server/link.h) ---- */

/* A link's end on the server: one device buffer of the payload area at byte 0 and the reply area at
 * moed_backend_link_reply_at, a stream of its own, and the communicator, rank 0 of 2, created with
 * NCCL's non-blocking config (common/moed_nccl.h) so that no wait below outlasts its timeout or
 * its stop flag. The link's calls come from one thread; moed_backend_link_abort from any. */
typedef struct moed_backend_link moed_backend_link;

/* The CUDA ordinal of device i (device_info's numbering, as LayerInfo.home_device); MOED_HOST_MEM
 * on a backend without GPUs. */
int moed_backend_device_ordinal(moed_backend *b, int i);

/* Creates a link on GPU `device` (a CUDA ordinal, as regions number GPUs; one the backend computes
 * on: the caller checks it with moed_backend_device_ordinal) with room for payload_bytes and
 * reply_bytes, gets an NCCL unique id into unique_id (what the caller joins with) and starts the
 * communicator's creation (moed_backend_link_ready finishes it). MOED_EUNSUPPORTED on a backend
 * without links (the cpu backend: the message says to start moed with the cuda backend) or where
 * NCCL does not load (the loader's message); MOED_ENOMEM naming the bytes of a buffer that does
 * not fit; NCCL's own failures by moed_nccl_fail. */
int moed_backend_link_create(moed_backend *b, int device, uint64_t payload_bytes,
                             uint64_t reply_bytes, uint8_t unique_id[MOED_NCCL_UNIQUE_ID_BYTES],
                             moed_backend_link **out, moed_error *err);

/* Waits until the caller joined: 0; MOED_EDEADLINE after timeout_ms (-1: none), MOED_ECANCELLED
 * once *stop is set, or NCCL's failure. */
int moed_backend_link_ready(moed_backend_link *l, int64_t timeout_ms, const _Atomic bool *stop,
                            moed_error *err);

/* Receives `bytes` from the caller into the buffer at `offset`, or sends `bytes` of the buffer from
 * `offset` to it, and waits for it to be done, as moed_backend_link_ready waits. MOED_EINVAL when
 * the range is not within the buffer. */
int moed_backend_link_recv(moed_backend_link *l, uint64_t offset, uint64_t bytes,
                           int64_t timeout_ms, const _Atomic bool *stop, moed_error *err);
int moed_backend_link_send(moed_backend_link *l, uint64_t offset, uint64_t bytes,
                           int64_t timeout_ms, const _Atomic bool *stop, moed_error *err);

/* Receives the caller's next message, of `bytes` (at most MOED_LINK_HEADER_BYTES: a call's header),
 * into dst on the host, waiting as moed_backend_link_recv does. The CUDA backend has NCCL receive
 * it into page-locked host memory, so it needs no copy and no synchronisation; a backend without
 * that receives it at offset 0 of the buffer and reads it back. MOED_EINVAL for a larger message.
 */
int moed_backend_link_recv_header(moed_backend_link *l, void *dst, size_t bytes, int64_t timeout_ms,
                                  const _Atomic bool *stop, moed_error *err);

/* Small copies between host memory and the buffer, on the link's stream: read (a call's header to
 * the host) is done when it returns; write (a reply's header to the device) may be queued, src
 * reusable at once, and is done before the link's next send or receive is. MOED_EINVAL outside
 * the buffer. */
int moed_backend_link_read(moed_backend_link *l, void *dst, uint64_t offset, size_t bytes,
                           moed_error *err);
int moed_backend_link_write(moed_backend_link *l, uint64_t offset, const void *src, size_t bytes,
                            moed_error *err);

/* The buffer: its device address, its GPU, its size, and where its reply area starts (payload_bytes
 * rounded up to MOED_LINK_ALIGN). */
void *moed_backend_link_mem(const moed_backend_link *l);
int moed_backend_link_device(const moed_backend_link *l);
uint64_t moed_backend_link_bytes(const moed_backend_link *l);
uint64_t moed_backend_link_reply_at(const moed_backend_link *l);

/* Aborts the communicator (ncclCommAbort): a wait in progress, and every later one, fails at once.
 * Thread-safe and idempotent. */
void moed_backend_link_abort(moed_backend_link *l);

/* Aborts if need be and frees everything; l may be NULL. No call of l may be in progress. */
void moed_backend_link_destroy(moed_backend_link *l);

/* Frees everything; b may be NULL. */
void moed_backend_destroy(moed_backend *b);

#endif
