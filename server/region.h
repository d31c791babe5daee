/*
 * moed_regions — the registry of tensor regions: memory a same-host client shares with the server
 * (POSIX shared memory, or CUDA device memory through an IPC handle), registered once and named by
 * requests as (region, offset, length). moed.proto states the rules to clients; this is where they
 * are kept:
 *
 *   ownership  a region belongs to a principal (moed_principal: the caller's token, or without
 *              tokens the local user who connected) and to the session (the Regions stream) that
 *              registered it; a lookup by another principal finds nothing, exactly as for an id
 *              that never existed; ids are random 64-bit numbers from getrandom(2), never 0;
 *   leases     closing a session releases every region it registered;
 *   rings      a region that holds open doorbell rings cannot be unregistered (a ring keeps a
 *              reference until its calls finish);
 *   references a request takes a region with moed_regions_acquire and lets go with
 *              moed_region_release; unregistering (or a session's end) makes the id unknown at
 *              once, and whoever drops the last reference — never while a request holds it —
 *              frees its reservation and unmaps the memory (cudaIpcCloseMemHandle at once;
 *              cudaHostUnregister and munmap once the backend is quiet, moed_backend_when_quiet:
 *              not while a link waits for its caller on the GPU, which unpinning would wait for);
 *   host       registration is two steps: map the object by name and answer a random challenge,
 *              then, once the client wrote it at offset 0, read it back (guarded) and only then
 *              page-lock the memory and make the region usable;
 *   faults     every CPU access to a host region is a guarded copy (guard.h); one that faults marks
 *              the region broken, and every later use fails the same way;
 *   caps       regions and bytes per principal, bytes in all;
 *   adopted    the server's own device memory (an NCCL link's buffer, link.h) made a CUDA region of
 *              a session: usable and direct at once, counted against no cap (--max-links bounds
 *              links), refused to moed_regions_unregister while adopted, listed under its
 *              principal like any other; once its adopter disowned it and the last request holding
 *              it let go, the adopter's release function frees the memory.
 *
 * Thread-safe: one mutex over the table; mapping, unmapping and the backend's calls happen outside
 * it.
 */
#ifndef MOED_REGION_H
#define MOED_REGION_H

#include "moed_backend.h"
#include "moed_err.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum { MOED_REGIONS_OFF = 0, MOED_REGIONS_LOCAL = 1, MOED_REGIONS_ANY = 2 };
enum { MOED_REGION_HOST = 1, MOED_REGION_CUDA = 2 }; /* moed.v1.RegionKind */

#define MOED_REGION_NAME_MAX  255 /* a shm name, the leading '/' included */
#define MOED_REGION_CHALLENGE 16

/* Who owns regions: with tokens, the token (MOED_PRINCIPAL_TOKEN of its number among them);
 * without, the local user who connected (its uid, which the kernel reports: rpc_principal in
 * caller.c). */
typedef int64_t moed_principal;
#define MOED_PRINCIPAL_TOKEN(n) (((moed_principal)1 << 32) + (n))

typedef struct moed_regions moed_regions;
typedef struct moed_region moed_region;
typedef struct moed_region_session moed_region_session;

typedef struct moed_regions_config {
    moed_backend *backend;   /* page-locks host regions and opens CUDA ones */
    int mode;                /* MOED_REGIONS_*: who may use regions (--regions) */
    int64_t max_regions;     /* per principal (--max-regions) */
    int64_t max_bytes;       /* registered per principal (--max-region-bytes) */
    int64_t max_total_bytes; /* registered by everyone (--max-region-bytes-total) */
} moed_regions_config;

/* What a listing, a metric or an event says of a region. */
typedef struct moed_region_info {
    uint64_t id;
    int kind;
    char name[MOED_REGION_NAME_MAX + 1];
    uint64_t bytes;
    int device; /* CUDA: its GPU's CUDA ordinal here, computed on or not */
    bool ready, broken;
    uint32_t requests; /* references held by requests now (one per tensor naming it) */
} moed_region_info;

/* Totals by kind (index MOED_REGION_HOST, MOED_REGION_CUDA), for the metrics. */
typedef struct moed_regions_stats {
    uint64_t count[3], bytes[3];
} moed_regions_stats;

int moed_regions_create(const moed_regions_config *cfg, moed_regions **out, moed_error *err);
/* Every session must be closed and every reference released first. */
void moed_regions_destroy(moed_regions *r);
int moed_regions_mode(const moed_regions *r);
const moed_regions_config *moed_regions_limits(const moed_regions *r);

/* ---- sessions (the Regions stream) ---- */

/* NULL when out of memory. */
moed_region_session *moed_regions_open_session(moed_regions *r, moed_principal principal);
/* Releases every region the session registered (unmapped once no request holds it) and frees
 * the session. */
void moed_regions_close_session(moed_regions *r, moed_region_session *s);

moed_principal moed_region_session_principal(const moed_region_session *s);

/* Step 1 of a host region: opens the POSIX shared-memory object `name` read-write, checks it (a
 * regular file of at least `bytes`), maps it, and fills the region's id and the challenge the
 * client must write at offset 0. The region is not usable until confirmed. */
int moed_regions_register_host(moed_regions *r, moed_region_session *s, const char *name,
                               size_t name_len, uint64_t bytes, moed_region_info *out,
                               uint8_t challenge[MOED_REGION_CHALLENGE], moed_error *err);
/* Step 2: the challenge is read back from offset 0 and compared; on a match the memory is
 * page-locked (backend host_register) and the region made usable. */
int moed_regions_confirm_host(moed_regions *r, moed_region_session *s, uint64_t id,
                              moed_region_info *out, moed_error *err);
/* A CUDA region: the backend opens the IPC handle (map_device). */
int moed_regions_register_cuda(moed_regions *r, moed_region_session *s, const void *handle,
                               size_t handle_len, const char *device_uuid, int device,
                               uint64_t bytes, uint64_t offset, moed_region_info *out,
                               moed_error *err);
/* Unregisters one of the session's regions (out: what it was). */
int moed_regions_unregister(moed_regions *r, moed_region_session *s, uint64_t id,
                            moed_region_info *out, moed_error *err);

/* ---- requests ---- */

/* The usable region `id` of `principal` with a reference taken, or NULL (err: NOT_FOUND, the same
 * message for an unknown id and another principal's; FAILED_PRECONDITION for a broken region). */
moed_region *moed_regions_acquire(moed_regions *r, moed_principal principal, uint64_t id,
                                  moed_error *err);
/* Drops a reference (NULL: nothing); the last one of an unregistered region unmaps it. */
void moed_region_release(moed_regions *r, moed_region *g);

/* Checks a reference against the region — offset + length within its bytes (overflow-safe),
 * length == want, offset a multiple of align — and returns where those bytes are (host memory, or
 * device memory of *dev; MOED_HOST_MEM for host). `what` names the tensor in messages. */
int moed_region_resolve(const moed_region *g, uint64_t offset, uint64_t length, uint64_t want,
                        size_t align, const char *what, void **ptr, int *dev, moed_error *err);

/* Whether the backend may be handed this region's memory as it is (a CUDA region, or a host region
 * and a backend that moves host memory by DMA only); otherwise the caller copies it with
 * moed_region_copy_in / copy_out. */
bool moed_region_direct(const moed_regions *r, const moed_region *g);

/* Guarded copies between a region's memory (p from moed_region_resolve) and host memory: a host
 * region that shrank fails with MOED_EPRECOND naming it and is marked broken; a CUDA region is
 * read through the backend. */
int moed_region_copy_in(moed_regions *r, moed_region *g, void *dst, const void *p, size_t n,
                        moed_error *err);
int moed_region_copy_out(moed_regions *r, moed_region *g, void *p, const void *src, size_t n,
                         moed_error *err);

/* Marks a host region broken after an access to its memory faulted (it shrank under the server):
 * MOED_EPRECOND and the message every later use of it gets. */
int moed_region_broken(moed_region *g, moed_error *err);

/* ---- rings (the doorbell: doorbell.h) ---- */

/* The session's confirmed host region `id` for a doorbell ring: held (a reference) and in use by a
 * ring, which keeps moed_regions_unregister from it (FAILED_PRECONDITION) until moed_region_unring;
 * its memory in *mem, *bytes. NOT_FOUND (not the session's), FAILED_PRECONDITION (CUDA, not yet
 * confirmed, broken). The ring lets go with moed_region_unring, then moed_region_release. */
moed_region *moed_regions_hold_ring(moed_regions *r, moed_region_session *s, uint64_t id,
                                    void **mem, uint64_t *bytes, moed_error *err);
void moed_region_unring(moed_regions *r, moed_region *g);

/* ---- adopted memory (links: link.h) ---- */

/* Makes server-owned device memory [mem, mem + bytes) of GPU dev (CUDA ordinal) a CUDA region of
 * session s, named "nccl link": usable at once, direct (moed_region_direct), counted against no
 * cap, and held by the adopter (a reference) until moed_region_disown; moed_regions_unregister
 * refuses it (FAILED_PRECONDITION) meanwhile. The session's end takes it out of the table as any
 * of its regions; the memory is the adopter's until release(arg) runs, after the adopter disowned
 * it and no request holds it. NULL and MOED_ENOMEM when out of memory (release is not called). */
moed_region *moed_regions_adopt(moed_regions *r, moed_region_session *s, void *mem, uint64_t bytes,
                                int dev, void (*release)(void *arg), void *arg, moed_error *err);
/* Ends the adoption: the region's id is unknown at once, and release runs once no request holds
 * it (maybe now, on this thread). */
void moed_region_disown(moed_regions *r, moed_region *g);

/* The region's id. */
uint64_t moed_region_id(const moed_region *g);

/* ---- listings ---- */

/* The principal's regions (malloc'd array in *out, *n entries; free() it). */
int moed_regions_list(moed_regions *r, moed_principal principal, moed_region_info **out, int *n,
                      moed_error *err);
void moed_regions_get_stats(moed_regions *r, moed_regions_stats *out);

/* Whether a shm name is one moed opens: "/" then 1 to 254 of [A-Za-z0-9._-], not "." or "..",
 * without ".." anywhere. */
bool moed_region_name_ok(const char *name, size_t len);

#endif
