/*
 * load_regions — moed-load's --transport shm|cuda: the request pools and every call's output in
 * tensor regions, so requests carry references and replies no bytes.
 *
 * shm: the hidden pool, the routing pools and the outputs in POSIX shared memory registered with
 * the server. cuda: the hidden pool and the outputs in device memory of this process (GPU 0 as
 * CUDA_VISIBLE_DEVICES numbers them) registered by IPC handle; the routing pools stay in shared
 * memory, which the server copies when it validates a request. Every call in flight has its own
 * output rows (its slot), so no reply overwrites another's.
 */
#ifndef LOAD_REGIONS_H
#define LOAD_REGIONS_H

#include "load_run.h"
#include "moed_err.h"
#include "moedclient.h"

#include <stdint.h>

enum { LOAD_TRANSPORT_INLINE = 0, LOAD_TRANSPORT_SHM = 1, LOAD_TRANSPORT_CUDA = 2 };

/* "inline", "shm" or "cuda" into *transport; MOED_EINVAL names the choices. cuda needs the CUDA
 * driver, found at run time (moedc_cuda.h): without one, load_regions_open fails with
 * MOED_EUNSUPPORTED and says so. */
int load_transport_parse(const char *s, int *transport, moed_error *err);

/* Registers the plan's pools (hidden, and the routing ones) and `slots` output slots of up to
 * max_tokens rows of max_d values of the plan's dtype on a session of c, and points the plan at
 * them (plan->regions). A level of C calls in flight on W workers uses the slots up to C + W. */
int load_regions_open(int transport, moedc *c, load_plan *plan, int slots, int64_t max_tokens,
                      int max_d, load_regions **out, moed_error *err);
void load_regions_close(load_regions *r);

/* The request of slot `slot`, which build_request filled for rows [row, row + T) of the pools
 * (layer l), pointed at the regions. */
void load_regions_refer(const load_regions *r, const load_plan *p, int layer, int64_t row, int slot,
                        moedc_request *req);

/* A malloc'd copy of a reply's output (for --verify: the slot is reused by the next call). */
void *load_regions_copy_output(const load_regions *r, const moedc_result *res);

#endif
