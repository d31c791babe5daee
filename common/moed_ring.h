/*
 * moed_ring — the layout of a doorbell ring, the same-host data path's one shared structure: a
 * caller on the server's host makes a Forward by writing a call descriptor into a slot of a ring in
 * shared memory and ringing it, instead of sending a gRPC message; the server's poller takes the
 * call, runs it through the same scheduler as gRPC calls, and writes the completion into the slot.
 * docs/doorbell.md explains the path; moed.proto's RegisterRing states the rules to clients. Both
 * sides include this header (the server's poller, libmoedclient), so they cannot disagree on a
 * byte; it is pure layout and plain functions, no I/O.
 *
 * Memory: a ring lies in a confirmed host region of a Regions session (shared memory the caller
 * proved it can write), from a 64-byte aligned offset: a header, then n_slots slots of
 * MOED_RING_SLOT_BYTES. All fields are little-endian. Each side writes only its own fields:
 *   header   the caller writes magic .. n_slots before registering (the server copies and checks
 *            them once; later writes there change nothing), and `bell`; the server writes `state`,
 *            `failures` and `completed`;
 *   slot     the caller writes the request half (bytes 0-255) and `ticket`; the server writes
 *            `ticket` = 0 when it takes the call, and the completion half (bytes 256-511).
 * Fields one side polls while the other writes them (bell, ticket, done, state) are 32-bit words,
 * each on a cache line of its own or at the head of one, read and written with atomic loads and
 * stores (acquire / release), or by a CUDA stream's memory operations (cuStreamWriteValue32,
 * cuStreamWaitValue32), which is how a call is enqueued on a stream and captured in a CUDA graph.
 *
 * A call, host side: the caller fills the request half of a free slot, stores `ticket` (release) as
 * a non-zero number new to the slot (its count of the slot's calls, wrapping, 0 skipped), then
 * `bell` = 1. The server clears `bell`, finds slots whose `ticket` is non-zero, copies the request
 * half once (it validates its copy, never the shared bytes), stores `ticket` = 0, and once the call
 * is finished writes the completion half and stores `done` = the ticket it took (release) last.
 * The caller waits for `done` to equal its ticket, then reads status and message.
 * A call, stream side: the request half is written when the call is enqueued (a captured graph
 * replays the same descriptor); the stream writes `ticket` = K (a fixed non-zero ticket of the
 * slot) and `bell` = 1, waits for `done` == K, and writes `done` = 0, so every replay waits anew.
 * A slot's previous call is over when `completions` has moved past the count the caller saw when
 * it started it: only then may the caller write the request half again.
 */
#ifndef MOED_RING_H
#define MOED_RING_H

#include "moed_err.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define MOED_RING_MAGIC         0x4752444du /* "MDRG" */
#define MOED_RING_VERSION       1
#define MOED_RING_HEADER_BYTES  256
#define MOED_RING_SLOT_BYTES    512
#define MOED_RING_MAX_SLOTS     4096
#define MOED_RING_ALIGN         64
#define MOED_RING_MESSAGE_BYTES 224

/* ring.state */
enum { MOED_RING_SERVING = 1, MOED_RING_DRAINING = 2, MOED_RING_CLOSED = 3 };

/* A tensor in a registered region (moed.v1.RegionRef): `length` bytes from `offset`. */
typedef struct moed_ring_ref {
    uint64_t region, offset, length;
} moed_ring_ref;

typedef struct moed_ring_header {
    /* the caller's, checked once at registration */
    uint32_t magic;
    uint16_t version;
    uint16_t header_bytes; /* MOED_RING_HEADER_BYTES */
    uint32_t slot_bytes;   /* MOED_RING_SLOT_BYTES */
    uint32_t n_slots;      /* 1 .. MOED_RING_MAX_SLOTS */
    uint8_t pad0[48];
    /* +64: the caller's doorbell: 1 after it rang a slot; the server clears it before it looks */
    uint32_t bell;
    uint8_t pad1[60];
    /* +128: the server's */
    uint32_t state;     /* MOED_RING_SERVING, DRAINING or CLOSED */
    uint32_t failures;  /* calls completed with a status other than OK */
    uint32_t completed; /* calls completed */
    uint8_t pad2[116];
} moed_ring_header;

/* The caller's half of a slot: one Forward with expert choices (as ForwardRequest's expert_ids and
 * expert_weights; padding is id -1 with weight 0), every tensor in a region. */
typedef struct moed_ring_request {
    uint32_t ticket;              /* +0: the doorbell of this slot (see above) */
    uint32_t flags;               /* reserved: 0 */
    uint32_t layer;               /* the layer's index, as in ForwardRequest */
    uint32_t dtype;               /* moed.v1.DType of hidden and of the output */
    uint32_t tokens;              /* T, >= 1 */
    uint32_t top_k;               /* k: columns of expert_ids and expert_weights, >= 1 */
    uint32_t deadline_us;         /* from when the server takes the call; 0: none */
    uint32_t reserved;            /* 0 */
    uint64_t tag;                 /* the caller's, echoed in the server's logs */
    moed_ring_ref hidden;         /* [T, d_model] of dtype */
    moed_ring_ref expert_ids;     /* [T, k] int32 */
    moed_ring_ref expert_weights; /* [T, k] float32 */
    moed_ring_ref output;         /* [T, d_model] of dtype, written by the server */
    uint8_t pad[120];
} moed_ring_request;

/* The server's half. */
typedef struct moed_ring_completion {
    uint32_t done;     /* +256: the ticket of the call completed, stored last */
    int32_t status;    /* a google.rpc.Code value (0 = OK) */
    uint32_t queue_us; /* as ForwardResponse's timings */
    uint32_t compute_us;
    uint32_t batch_tokens;   /* tokens of the launch that computed the call */
    uint32_t batch_requests; /* requests merged into it */
    uint32_t completions;    /* calls of this slot completed (wrapping): the slot is free again */
    uint32_t reserved;
    char message[MOED_RING_MESSAGE_BYTES]; /* why, when status != 0; NUL-terminated */
} moed_ring_completion;

typedef struct moed_ring_slot {
    moed_ring_request req;
    moed_ring_completion done;
} moed_ring_slot;

#if defined(__cplusplus)
#define MOED_RING_ASSERT static_assert
#else
#define MOED_RING_ASSERT _Static_assert
#endif
MOED_RING_ASSERT(sizeof(moed_ring_header) == MOED_RING_HEADER_BYTES, "ring header layout");
MOED_RING_ASSERT(offsetof(moed_ring_header, bell) == 64, "bell on a line of its own");
MOED_RING_ASSERT(offsetof(moed_ring_header, state) == 128, "server fields on a line of their own");
MOED_RING_ASSERT(sizeof(moed_ring_request) == 256, "request half layout");
MOED_RING_ASSERT(offsetof(moed_ring_request, hidden) == 40, "request refs layout");
MOED_RING_ASSERT(sizeof(moed_ring_completion) == 256, "completion half layout");
MOED_RING_ASSERT(sizeof(moed_ring_slot) == MOED_RING_SLOT_BYTES, "slot layout");

/* Bytes of a ring of n slots. */
static inline uint64_t moed_ring_bytes(uint32_t n_slots)
{
    return MOED_RING_HEADER_BYTES + (uint64_t)n_slots * MOED_RING_SLOT_BYTES;
}

/* Slot i of the ring whose header is at h. */
static inline moed_ring_slot *moed_ring_slot_at(moed_ring_header *h, uint32_t i)
{
    return (moed_ring_slot *)((char *)h + MOED_RING_HEADER_BYTES) + i;
}

/* Whether a header copy describes a ring of `slots` slots that fits in `avail` bytes from where it
 * starts: magic, version, sizes; MOED_EINVAL naming the field and what it must be otherwise. */
int moed_ring_check_header(const moed_ring_header *h, uint32_t slots, uint64_t avail,
                           moed_error *err);

/* The next ticket after t: t + 1, wrapping, never 0. */
static inline uint32_t moed_ring_next_ticket(uint32_t t)
{
    return t + 1 ? t + 1 : 1;
}

/* Atomic loads and stores of the polled words, as both sides and both compilers (C11 and CUDA's
 * C++) see them. */
static inline uint32_t moed_ring_load(const uint32_t *p)
{
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
static inline void moed_ring_store(uint32_t *p, uint32_t v)
{
    __atomic_store_n(p, v, __ATOMIC_RELEASE);
}

#endif
