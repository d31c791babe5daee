/*
 * moed_link — the layout of a call on an NCCL link (moed.proto's OpenLink states it for clients;
 * docs/fleets.md, "Over NCCL", explains the transport). Both sides include this header (the
 * daemon's link thread, libmoedclient), so they cannot disagree on a byte; it is pure layout and
 * plain functions, no I/O. All fields are little-endian.
 *
 * A link is a two-rank NCCL communicator: the server rank 0, the caller rank 1, both joining it
 * non-blocking (so that a join that never comes times out and is aborted). After the caller joins
 * it sends the link's 32-byte key, and the server answers with a moed_link_reply of seq 0 and
 * status 0 (the hello): NCCL connects each direction at its first message with both ranks taking
 * part, so both are connected before the first call.
 *
 * Communicators. Once the hello is through, both ranks split the communicator (ncclCommSplit,
 * color 0, key its rank, blocking, splitShare 0), and every call goes over the split one: NCCL
 * runs each operation on a non-blocking communicator from a thread it starts for it, and a blocking
 * operation on a connected communicator only enqueues. The split one's first two messages connect
 * it both ways: the server's hello again, then the caller's answer (MOED_LINK_HEADER_BYTES, which
 * the server ignores). Each side posts one operation at a time (a group of a call's header,
 * payload and reply never completed on H200s, the server receiving the header alone to learn the
 * payload's size).
 *
 * Then each call is three messages, every one bytes (ncclUint8):
 *   caller -> server  a moed_link_call (MOED_LINK_HEADER_BYTES);
 *   caller -> server  the payload, call.payload_bytes: hidden [T, d_model] of dtype at 0, then
 *                     expert_ids [T, k] int32 and expert_weights [T, k] float32, each at the next
 *                     multiple of MOED_LINK_ALIGN (moed_link_layout);
 *   server -> caller  a moed_link_reply (MOED_LINK_HEADER_BYTES) and, right after it, the output
 *                     [T, d_model] of dtype: moed_link_reply_bytes in all, whatever the status (the
 *                     output is meaningful only when status is 0).
 * The server reads the header before it posts the payload's receive (NCCL needs both sides to
 * agree on a message's size), so a header that breaks the layout (moed_link_check_call) ends the
 * link: after it the messages can no longer be read in step. Everything else about a call (the
 * layer, T against the limits, ids, weights) is a Forward's rules, checked by the daemon as for a
 * doorbell call (moed_link_to_ring gives the ring descriptor the call stands for), with the
 * header's expectation as ForwardRequest.expect, and a call that breaks them is answered with its
 * status; the link goes on.
 */
#ifndef MOED_LINK_H
#define MOED_LINK_H

#include "moed_err.h"
#include "moed_ring.h"

#include <stdbool.h>
#include <stdint.h>

#define MOED_LINK_MAGIC         0x4b4c444du /* "MDLK" */
#define MOED_LINK_REPLY_MAGIC   0x524c444du /* "MDLR" */
#define MOED_LINK_VERSION       2           /* 2: the split after the hello */
#define MOED_LINK_HEADER_BYTES  256
#define MOED_LINK_ALIGN         256
#define MOED_LINK_KEY_BYTES     32
#define MOED_LINK_MAX_TOP_K     64
#define MOED_LINK_MESSAGE_BYTES 192
#define MOED_LINK_SHOWN_RANGES  8 /* an expectation's ranges carried for messages */

/* moed_link_call.flags */
enum { MOED_LINK_EXPECT = 1 }; /* the expect_ fields are set */

typedef struct moed_link_call {
    uint32_t magic;         /* MOED_LINK_MAGIC */
    uint16_t version;       /* MOED_LINK_VERSION */
    uint16_t header_bytes;  /* MOED_LINK_HEADER_BYTES */
    uint64_t seq;           /* 1 for a link's first call, then one more each call */
    uint32_t layer;         /* as ForwardRequest's */
    uint32_t dtype;         /* moed.v1.DType of hidden and of the output */
    uint32_t tokens;        /* T, >= 1 */
    uint32_t top_k;         /* k, 1 .. MOED_LINK_MAX_TOP_K */
    uint32_t d_model;       /* columns of hidden and of the output */
    uint32_t flags;         /* MOED_LINK_EXPECT or 0 */
    uint32_t deadline_us;   /* from when the server has the payload; 0: none */
    uint32_t reserved;      /* 0 */
    uint64_t tag;           /* the caller's, echoed in the server's logs */
    uint64_t payload_bytes; /* moed_link_layout's total */
    /* With MOED_LINK_EXPECT, what the caller takes the daemon to be, as ForwardRequest.expect: a
     * daemon restarted as another shard or model refuses the call (FAILED_PRECONDITION) rather
     * than answer a partial that no longer fits the fleet's sum. */
    uint64_t expect_model;       /* ModelInfo.model_fingerprint; 0: not checked */
    uint64_t expect_ranges_hash; /* moed_ranges_fold over every range, from 0 */
    uint32_t expect_n_ranges;    /* the layer's experts_held ranges; 0: not checked */
    uint32_t expect_adds_shared; /* 0 or 1 (checked with the ranges) */
    uint32_t expect_first[MOED_LINK_SHOWN_RANGES], expect_last[MOED_LINK_SHOWN_RANGES];
    uint8_t pad[104];
} moed_link_call;

typedef struct moed_link_reply {
    uint32_t magic;        /* MOED_LINK_REPLY_MAGIC */
    uint16_t version;      /* MOED_LINK_VERSION */
    uint16_t header_bytes; /* MOED_LINK_HEADER_BYTES */
    uint64_t seq;          /* the call's */
    int32_t status;        /* a google.rpc.Code value (0 = OK) */
    uint32_t queue_us;     /* as ForwardResponse's timings */
    uint32_t compute_us;
    uint32_t batch_tokens;   /* tokens of the launch that computed the call */
    uint32_t batch_requests; /* requests merged into it */
    uint8_t pad0[28];
    char message[MOED_LINK_MESSAGE_BYTES]; /* why, when status != 0; NUL-terminated */
} moed_link_reply;

#if defined(__cplusplus)
#define MOED_LINK_ASSERT static_assert
#else
#define MOED_LINK_ASSERT _Static_assert
#endif
MOED_LINK_ASSERT(sizeof(moed_link_call) == MOED_LINK_HEADER_BYTES, "link call layout");
MOED_LINK_ASSERT(sizeof(moed_link_reply) == MOED_LINK_HEADER_BYTES, "link reply layout");

/* Where a call's tensors lie in its payload. */
typedef struct moed_link_payload {
    uint64_t hidden, ids, weights; /* offsets */
    uint64_t hidden_bytes, ids_bytes, weights_bytes;
    uint64_t total; /* payload_bytes */
} moed_link_payload;

/* The payload of T tokens, k choices, d_model columns of elem_bytes each. MOED_EINVAL when a
 * count is 0, k is over MOED_LINK_MAX_TOP_K, or a size does not fit in 63 bits. */
int moed_link_layout(uint64_t tokens, uint64_t top_k, uint64_t d_model, uint64_t elem_bytes,
                     moed_link_payload *out, moed_error *err);

/* The reply's size: the header and T x d_model elements (0 when that overflows). */
uint64_t moed_link_reply_bytes(uint64_t tokens, uint64_t d_model, uint64_t elem_bytes);

/* The largest payload and reply of a link opened for max_tokens, max_top_k and the widest layer
 * (d_model, elem_bytes): what the server allocates. MOED_EINVAL as moed_link_layout. */
int moed_link_capacity(uint64_t max_tokens, uint64_t max_top_k, uint64_t d_model,
                       uint64_t elem_bytes, uint64_t *payload, uint64_t *reply, moed_error *err);

/* The header's own layout: magic, version, header_bytes, seq == expect_seq, flags within
 * MOED_LINK_EXPECT, reserved 0, expect_adds_shared 0 or 1,
 * a dtype with an element size, tokens and top_k within max_tokens / max_top_k, d_model >= 1, and
 * payload_bytes equal to the layout's and at most max_payload. A failure here ends the link; err
 * names the field and what it held. */
int moed_link_check_call(const moed_link_call *c, uint64_t expect_seq, uint32_t max_tokens,
                         uint32_t max_top_k, uint64_t max_payload, moed_error *err);

/* The ring descriptor the (checked) call stands for, its tensors in region `region`: the payload at
 * payload_at, the reply at reply_at (the output right after the reply header). */
void moed_link_to_ring(const moed_link_call *c, uint64_t region, uint64_t payload_at,
                       uint64_t reply_at, moed_ring_request *out);

/* A call's header as the client writes it (payload_bytes from the layout). */
int moed_link_call_init(moed_link_call *c, uint64_t seq, uint32_t layer, uint32_t dtype,
                        uint32_t tokens, uint32_t top_k, uint32_t d_model, uint32_t deadline_us,
                        uint64_t tag, moed_error *err);

/* Sets c's expectation (MOED_LINK_EXPECT): the model (0: any) and the layer's n held ranges
 * [first[i], last[i]] (n 0: any experts), adding the shared experts or not. */
void moed_link_call_expect(moed_link_call *c, uint64_t model, const uint32_t *first,
                           const uint32_t *last, uint32_t n, bool adds_shared);

/* A reply's header: status, message (clipped, NUL-terminated) and timings. */
void moed_link_reply_init(moed_link_reply *r, uint64_t seq, int32_t status, const char *message,
                          uint32_t queue_us, uint32_t compute_us, uint32_t batch_tokens,
                          uint32_t batch_requests);

/* Whether a received reply is the answer to call seq (magic, version, header_bytes, seq): a caller
 * that finds otherwise got no answer (its reply buffer was zeroed before the call). */
int moed_link_reply_matches(const moed_link_reply *r, uint64_t seq);

#endif
