/*
 * moed_wire — ForwardRequest decoding and ForwardResponse encoding straight over gRPC slices.
 *
 * Tensors are megabytes: the decoder never copies them. It walks the request's slice list (a
 * message arrives in many slices, split wherever the transport split it) and records each tensor's
 * data as a span over those slices; moed_span_copy is the one copy on the way to staging memory.
 * Protobuf semantics are kept: scalars last-wins, repeated occurrences of a message merge, the
 * `shape` field packed or not, a oneof switching member clears the old one, unknown fields
 * skipped. Every length is checked against what is left, so malformed, truncated or random bytes
 * give MOED_EFORMAT with the byte offset and what was wrong, never a read out of bounds.
 *
 * The response is three slices: a hand-encoded header (request_id, the output tensor's dtype,
 * shape and data length), the output bytes (a slice the backend wrote into: no CPU copy at all
 * when it is a buffer of the staging pool), and a trailer (expert_set, timings). An output that
 * went to a region is named in the header instead, and the reply has no data slice.
 * The small messages (GetModel, Health, RegionCommand) go through protobuf-c with
 * moed_wire_pack/unpack; unpacking first drops the unknown groups protobuf-c cannot skip.
 * Groups may nest 100 deep everywhere, protobuf's own parsers' default limit.
 */
#ifndef MOED_WIRE_H
#define MOED_WIRE_H

#include "moed_err.h"
#include "timings.h"

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/slice.h>
#include <protobuf-c/protobuf-c.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Bytes of a message that lie in a run of consecutive slices of one slice array. */
typedef struct moed_span {
    const grpc_slice *slice; /* the first slice holding them */
    size_t off;              /* offset of the first byte in that slice */
    size_t len;              /* bytes in all (they continue into the following slices) */
} moed_span;

/* Copies the span's len bytes to dst. */
void moed_span_copy(const moed_span *s, void *dst);

#define MOED_WIRE_MAX_DIMS 8

/* moed.v1.RegionRef: bytes of a registered region. */
typedef struct moed_wire_ref {
    uint64_t region, offset, length;
} moed_wire_ref;

typedef struct moed_wire_tensor {
    bool present;
    int32_t dtype; /* the wire value, unchecked (open enum) */
    int n_shape;   /* dims seen; only the first MOED_WIRE_MAX_DIMS kept */
    int64_t shape[MOED_WIRE_MAX_DIMS];
    moed_span data; /* the contents oneof: data ... */
    bool in_region; /* ... or region (then data is empty) */
    moed_wire_ref region;
} moed_wire_tensor;

typedef struct moed_wire_gating {
    int32_t strategy; /* the wire values, unchecked */
    uint32_t top_k;
    int32_t renormalize;
    float threshold;
} moed_wire_gating;

/* Values are ForwardRequest's field numbers of the routing oneof. */
enum {
    MOED_ROUTING_NONE = 0,
    MOED_ROUTING_EXPERTS = 4,
    MOED_ROUTING_LOGITS = 5,
    MOED_ROUTING_SERVER = 6
};

/* ForwardRequest.expect. The ranges are kept as a count and a hash of them all in order
 * (moed_ranges_fold from 0), so any number is compared in fixed space; the first few are kept
 * for messages. */
#define MOED_WIRE_SHOWN_RANGES 8
typedef struct moed_wire_expect {
    bool present;
    uint64_t model; /* 0: not checked */
    uint32_t n_ranges;
    uint64_t ranges_hash;
    uint32_t first[MOED_WIRE_SHOWN_RANGES], last[MOED_WIRE_SHOWN_RANGES];
    bool adds_shared;
} moed_wire_expect;

typedef struct moed_wire_request {
    size_t bytes;         /* the encoded message's size */
    moed_span request_id; /* unchecked bytes (UTF-8 and length are validated later) */
    uint32_t layer;
    moed_wire_tensor hidden;
    int routing;                                 /* MOED_ROUTING_* */
    moed_wire_tensor expert_ids, expert_weights; /* MOED_ROUTING_EXPERTS */
    moed_wire_tensor logits;                     /* MOED_ROUTING_LOGITS */
    moed_wire_gating gating;                     /* LOGITS and SERVER; zeros when absent */
    bool batch_gating;
    uint32_t k_batch;
    bool has_output; /* ForwardRequest.output: write the output into this region */
    moed_wire_ref output;
    moed_wire_expect expect;
} moed_wire_request;

/* Decodes a ForwardRequest from n slices. The spans in out point into slices, which must outlive
 * them. MOED_EFORMAT with the offset and the reason when the bytes are not a valid message. */
int moed_wire_decode_request(const grpc_slice *slices, size_t n, moed_wire_request *out,
                             moed_error *err);

/* A received message opened for decoding: decompressed if it came compressed, its slices in a
 * row. Spans from moed_wire_decode_request over `slices` stay valid until moed_wire_msg_close. */
typedef struct moed_wire_msg {
    grpc_byte_buffer_reader reader;
    const grpc_slice *slices;
    size_t n_slices;
    bool open;
} moed_wire_msg;

int moed_wire_msg_open(moed_wire_msg *m, grpc_byte_buffer *bb, moed_error *err);
void moed_wire_msg_close(moed_wire_msg *m);

typedef struct moed_wire_response {
    const char *request_id; /* request_id_len bytes, not NUL-terminated */
    size_t request_id_len;
    int dtype;                 /* moed_dtype of the output */
    int64_t rows, cols;        /* output shape [T, d_model] */
    const int32_t *expert_set; /* batch gating's S, or NULL */
    int n_expert_set;
    moed_timings timings;
    const moed_wire_ref *out_region; /* the output went to this region: the reply names it */
} moed_wire_response;

/* A ForwardResponse whose output data is `data` (rows * cols * sizeof(dtype) bytes, filled by the
 * caller), or, with out_region set, whose output names that region and carries no data (data is
 * then an empty slice). Takes over the caller's reference to data. NULL when out of memory. */
grpc_byte_buffer *moed_wire_encode_response(const moed_wire_response *r, grpc_slice data);

/* A protobuf-c message packed into one slice, as a byte buffer (NULL when out of memory). */
grpc_byte_buffer *moed_wire_pack(const ProtobufCMessage *m);

/* Unpacks a small protobuf-c message from buf[0, n). Unknown groups are skipped at any depth of
 * the schema's sub-messages, as protobuf's own parsers skip them (protobuf-c refuses them), nested
 * up to 100 deep as there. MOED_EFORMAT when it does not parse (with the offset and the reason
 * where moed's reader found it). Free *out with protobuf_c_message_free_unpacked. */
int moed_wire_unpack_bytes(const ProtobufCMessageDescriptor *d, const uint8_t *buf, size_t n,
                           ProtobufCMessage **out, moed_error *err);

/* The same from a byte buffer (NULL bb reads as an empty message). */
int moed_wire_unpack(const ProtobufCMessageDescriptor *d, grpc_byte_buffer *bb,
                     ProtobufCMessage **out, moed_error *err);

/* The last value of varint field `field` at the top level of the message in buf[0, n), read up to
 * where it stops parsing; 0 if none: a RegionCommand's seq, for the event answering one that
 * does not parse. */
uint64_t moed_wire_find_uint(const uint8_t *buf, size_t n, uint32_t field);

#endif
