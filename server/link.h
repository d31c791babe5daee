/*
 * moed_links — NCCL links: Forwards whose tensors move over a two-rank NCCL communicator instead of
 * gRPC (moed.proto's OpenLink states the protocol for clients; common/moed_link.h is the call's
 * layout). The daemon's side: the registry of links by Regions session, and one thread per link.
 *
 * A link is opened and closed by its session's commands (open_link, close_link), belongs to the
 * session's principal, and is capped per principal (--max-links; 0 turns links off). Opening checks
 * max_tokens (1 .. --max-batch-tokens), max_top_k (1 .. MOED_LINK_MAX_TOP_K) and the GPU (default:
 * the home of the first served layer), each refusal INVALID_ARGUMENT naming the field; sizes the
 * link for the widest served layer with 4-byte elements (moed_link_capacity); has the backend make
 * its buffer, stream and communicator (moed_backend_link_create: UNIMPLEMENTED on a backend or a
 * host without links, RESOURCE_EXHAUSTED for a buffer that does not fit); makes the buffer a
 * region of the session (moed_regions_adopt), so that a call is the doorbell's ring descriptor
 * over it (moed_link_to_ring) and is validated by the same rules with the same principal; and
 * answers the NCCL unique id and a fresh 32-byte key from getrandom.
 *
 * The link's thread: the caller joins within 30 s (else the link closes), sends the key (compared
 * in constant time; a wrong one closes the link, nothing more is read), then call after call: the
 * header (no timeout), checked by moed_link_check_call (a failure closes the link: the messages
 * can no longer be read in step), the payload (30 s), the Forward through the scheduler, and the
 * reply (the header and the output the backend wrote right after it). A call refused by a Forward's
 * rules is answered with its status and message and the link goes on; after the drain every call
 * is answered UNAVAILABLE. Each close is logged with its reason.
 *
 * Closing (close_link, the session's end, moed_links_destroy) aborts the communicator, joins the
 * thread (a call being computed finishes first; its reply is not sent), and disowns the region:
 * the buffer is freed once no request holds it. A caller that dies mid-call costs nothing more.
 * close_link and the session's end take the link off the registry at once (it counts no more
 * against --max-links) and close it on a thread of their own, returning before NCCL's abort ends;
 * moed_links_destroy waits for those closes too.
 * During the drain a session's end leaves its links open, answering UNAVAILABLE, until the exit.
 *
 * Thread-safe: commands come on completion-queue threads; each link has its thread.
 */
#ifndef MOED_LINK_SRV_H
#define MOED_LINK_SRV_H

#include "metrics.h"
#include "moed_backend.h"
#include "moed_err.h"
#include "moed_link.h"
#include "moed_nccl.h"
#include "region.h"
#include "request.h"
#include "scheduler.h"

#include <stdint.h>

typedef struct moed_links moed_links;

typedef struct moed_links_config {
    const moed_served *served; /* layers, limits and the region registry (not NULL) */
    moed_backend *backend;     /* makes each link's buffer and communicator */
    moed_sched *sched;         /* where calls go */
    moed_metrics *metrics;     /* calls and durations of links; or NULL */
    int64_t max_links;         /* open links per principal (--max-links), >= 1 */
    int64_t join_ms;           /* for the caller's join and key (0: 30 s) */
    int64_t payload_ms;        /* for a payload after its header, and a reply (0: 30 s) */
} moed_links_config;

/* What an event says of a link (moed.v1.Link). */
typedef struct moed_link_info {
    uint64_t id;
    uint8_t unique_id[MOED_NCCL_UNIQUE_ID_BYTES];
    uint8_t key[MOED_LINK_KEY_BYTES];
    uint32_t device;
    uint32_t nccl_version; /* 0 where NCCL's version is unknown */
    uint64_t max_payload_bytes;
} moed_link_info;

/* MOED_ENOMEM. */
int moed_links_create(const moed_links_config *cfg, moed_links **out, moed_error *err);

/* Closes every link left and frees everything (after the scheduler drained). lk may be NULL. */
void moed_links_destroy(moed_links *lk);

/* open_link (a link of the session, its thread started). */
int moed_links_open(moed_links *lk, moed_region_session *s, uint32_t max_tokens, uint32_t max_top_k,
                    uint32_t device_plus_one, moed_link_info *out, moed_error *err);

/* close_link: closes the session's link `id` (out: what it was; no key). */
int moed_links_close(moed_links *lk, moed_region_session *s, uint64_t id, moed_link_info *out,
                     moed_error *err);

/* Closes every link of the session (before moed_regions_close_session); while draining they stay,
 * answering UNAVAILABLE, until moed_links_destroy. lk may be NULL. */
void moed_links_close_session(moed_links *lk, moed_region_session *s);

/* SIGTERM: every call from now on is answered UNAVAILABLE; no link opens. */
void moed_links_drain(moed_links *lk);
/* Waits until every close handed to a thread of its own (close_link, a session's end) has ended:
 * the links' communicators aborted and their buffers disowned. */
void moed_links_wait_closes(moed_links *lk);

/* Links open now, for the metrics; 0 for lk NULL. */
uint64_t moed_links_count(moed_links *lk);

#endif
