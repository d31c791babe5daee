/*
 * load_regions — moed-load's --transport shm|cuda|doorbell|doorbell-stream: the request pools and
 * every call's output in tensor regions, so requests carry references and replies no bytes.
 *
 * shm: the hidden pool, the routing pools and the outputs in POSIX shared memory registered with
 * the server. cuda: the hidden pool and the outputs in device memory of this process (GPU --device,
 * as CUDA_VISIBLE_DEVICES numbers them) registered by IPC handle; the routing pools stay in shared
 * memory, which the server copies when it validates a request. Every call in flight has its own
 * output rows (its slot), so no reply overwrites another's.
 *
 * doorbell: as shm, and the calls go through doorbell rings (moedc_ring) on the same session, one
 * ring per worker, each worker one call at a time, rung and waited for from the host.
 * doorbell-cuda: the same calls with every pool and the outputs in device memory of GPU --device
 * (routing too: the server reads it there). doorbell-stream: as doorbell-cuda, and each worker
 * enqueues its calls on a CUDA stream of its own, which it synchronises.
 */
#ifndef LOAD_REGIONS_H
#define LOAD_REGIONS_H

#include "load_run.h"
#include "moed_err.h"
#include "moedclient.h"

#include <stdbool.h>
#include <stdint.h>

enum {
    LOAD_TRANSPORT_INLINE = 0,
    LOAD_TRANSPORT_SHM = 1,
    LOAD_TRANSPORT_CUDA = 2,
    LOAD_TRANSPORT_DOORBELL = 3, /* the ring transports: from here on */
    LOAD_TRANSPORT_DOORBELL_CUDA = 4,
    LOAD_TRANSPORT_DOORBELL_STREAM = 5,
};

/* "inline", "shm", "cuda", "doorbell", "doorbell-cuda" or "doorbell-stream" into *transport;
 * MOED_EINVAL names the choices. cuda, doorbell-cuda and doorbell-stream need the CUDA driver,
 * found at run time (moedc_cuda.h): without one, load_regions_open fails with MOED_EUNSUPPORTED
 * and says so. */
int load_transport_parse(const char *s, int *transport, moed_error *err);
/* The transport's name, as parsed. */
const char *load_transport_name(int transport);
/* Whether the transport's calls go through doorbell rings. */
bool load_transport_rings(int transport);

/* Registers the plan's pools (hidden, and the routing ones) and `slots` output slots of up to
 * max_tokens rows of max_d values of the plan's dtype on a session of c, device memory on GPU
 * `device` where the transport keeps them there, and points the plan at them (plan->regions). A
 * level of C calls in flight on W workers uses the slots up to C + W. A ring transport also opens
 * `rings` rings (and for doorbell-stream as many CUDA streams): worker i uses ring i. */
int load_regions_open(int transport, moedc *c, load_plan *plan, int slots, int rings,
                      int64_t max_tokens, int max_d, int device, load_regions **out,
                      moed_error *err);
void load_regions_close(load_regions *r);

/* Whether r (NULL: inline) is of a ring transport. */
bool load_regions_rings(const load_regions *r);
/* Worker i's ring, and its CUDA stream (doorbell-stream; NULL for doorbell). */
moedc_ring *load_regions_ring(const load_regions *r, int i, void **stream);
/* Waits for everything enqueued on a worker's stream (cuStreamSynchronize). */
int load_regions_sync(const load_regions *r, void *stream, moed_error *err);

/* The request of slot `slot`, which build_request filled for rows [row, row + T) of the pools
 * (layer l), pointed at the regions. */
void load_regions_refer(const load_regions *r, const load_plan *p, int layer, int64_t row, int slot,
                        moedc_request *req);

/* A malloc'd copy of a reply's output (for --verify: the slot is reused by the next call). */
void *load_regions_copy_output(const load_regions *r, const moedc_result *res);

#endif
