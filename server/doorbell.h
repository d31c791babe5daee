/*
 * moed_doorbell — the same-host data path: doorbell rings (common/moed_ring.h holds the layout,
 * moed.proto's RegisterRing the rules clients read, docs/doorbell.md the rest) and the one thread
 * that polls them.
 *
 * A ring lies in a confirmed host region of a Regions session and is registered, and closed, by
 * that session's commands; it belongs to the session's principal, and every region its calls name
 * is acquired with that principal. Registering checks a copy of the ring's header (once: later
 * writes to those fields change nothing), its 64-byte aligned offset and its size, caps the
 * principal's open rings (--max-rings), holds the region (which cannot be unregistered while the
 * ring is open) and writes state SERVING. Closing (unregister_ring, or the session's end) takes no
 * further call from the ring; its calls already taken finish, and then state CLOSED is written and
 * the region let go.
 *
 * The poller: for every open ring whose bell is set (it clears it), each slot whose ticket is
 * non-zero is taken: its request half copied once into the server's memory, ticket stored 0, the
 * copy validated as a Forward of expert choices in regions (request.c, the gRPC path's rules) and
 * submitted to the scheduler, where it merges with gRPC calls alike. A call that fails validation
 * is completed at once with its status and message; a computed one when its launch is done: the
 * completion half, the slot's completions, the header's completed and failures, and `done` stored
 * last. Every access to a ring's memory is guarded (guard.h): a ring whose object shrank under the
 * server is closed, its region marked broken. The poller spins while calls run and for a few ms
 * after the last one (yielding the core to any thread that wants it), then sleeps in growing steps
 * up to 1 ms: an idle daemon with open rings costs little, and a call after a pause waits at most
 * one step. It never waits for a client.
 *
 * Drain (SIGTERM): moed_doorbell_drain takes every call rung by then, then writes DRAINING to every
 * open ring; calls rung after that complete UNAVAILABLE, also on rings whose session the drain
 * ended, until moed_doorbell_destroy (after the scheduler drained: every call taken is finished)
 * writes CLOSED to all of them. No ring holds up the exit.
 *
 * Thread-safe: the commands come on completion-queue threads, completions on scheduler workers.
 */
#ifndef MOED_DOORBELL_H
#define MOED_DOORBELL_H

#include "metrics.h"
#include "moed_err.h"
#include "moed_ring.h"
#include "region.h"
#include "request.h"
#include "scheduler.h"

#include <stdint.h>

typedef struct moed_doorbell moed_doorbell;

typedef struct moed_doorbell_config {
    const moed_served *served; /* layers, limits and the region registry (not NULL) */
    moed_sched *sched;         /* where calls go; NULL: a registry of rings only (no poller) */
    moed_metrics *metrics;     /* requests and durations by transport; or NULL */
    int64_t max_rings;         /* open rings per principal (--max-rings), >= 1 */
} moed_doorbell_config;

/* What an event says of a ring (moed.v1.Ring). */
typedef struct moed_ring_info {
    uint64_t id, region, offset;
    uint32_t slots;
} moed_ring_info;

/* Creates the registry and, with a scheduler, starts the poller. MOED_ENOMEM / MOED_EINTERNAL. */
int moed_doorbell_create(const moed_doorbell_config *cfg, moed_doorbell **out, moed_error *err);

/* Stops the poller (the scheduler must have drained: no call is in flight), writes CLOSED to
 * every ring left and frees everything; every session must be closed. db may be NULL. */
void moed_doorbell_destroy(moed_doorbell *db);

/* register_ring: a ring of `slots` slots at `offset` of the session's region `region`. */
int moed_doorbell_register(moed_doorbell *db, moed_region_session *s, uint64_t region,
                           uint64_t offset, uint32_t slots, moed_ring_info *out, moed_error *err);

/* unregister_ring: closes the session's ring `ring` (out: what it was). */
int moed_doorbell_unregister(moed_doorbell *db, moed_region_session *s, uint64_t ring,
                             moed_ring_info *out, moed_error *err);

/* Closes every ring of the session (before moed_regions_close_session). db may be NULL. */
void moed_doorbell_close_session(moed_doorbell *db, moed_region_session *s);

/* SIGTERM: returns once the calls rung by now are taken and every open ring says DRAINING. */
void moed_doorbell_drain(moed_doorbell *db);

/* Rings open now (registered, not closed), for the metrics. */
uint64_t moed_doorbell_rings(moed_doorbell *db);

/* --max-rings (GetModel's RegionLimits); 0 for db NULL (the doorbell off). */
int64_t moed_doorbell_max_rings(const moed_doorbell *db);

#endif
