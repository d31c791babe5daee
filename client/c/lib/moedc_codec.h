/*
 * moedc_codec — the client's messages to and from bytes, with no gRPC in sight (so it can be tested
 * and fuzzed alone). Internal to libmoedclient.
 *
 * A ForwardRequest is encoded as three pieces whose concatenation is the message, in field order:
 * head (request_id, layer and the hidden Tensor up to its data's length prefix), body (the caller's
 * hidden bytes, untouched: gRPC sends them from where they are) and tail (the routing oneof,
 * batch_gating, the output's region and a fleet's expect, packed by protobuf-c). A hidden tensor in
 * a region is all head, and there is no body.
 */
#ifndef MOEDC_CODEC_H
#define MOEDC_CODEC_H

#include "moedclient.h"

#include <stddef.h>
#include <stdint.h>

typedef struct moedc_wire {
    uint8_t *head; /* malloc'd */
    size_t head_len;
    const void *body; /* req->hidden */
    size_t body_len;
    uint8_t *tail; /* malloc'd */
    size_t tail_len;
} moedc_wire;

/* What a fleet's sub-call states it expects of its daemon (ForwardRequest.expect, moed.proto). */
typedef struct moedc_expect {
    uint64_t fingerprint; /* ModelInfo.model_fingerprint; 0: not checked */
    const moedc_expert_range *held;
    int n_held; /* 0: not checked */
    bool adds_shared;
} moedc_expect;

/* Checks req (what the client must know to encode it; the server checks the rest) and encodes it,
 * with expect in the tail when not NULL. Release with moedc_wire_free. */
int moedc_encode_forward(const moedc_request *req, const moedc_expect *expect, moedc_wire *out,
                         moedc_error *err);
void moedc_wire_free(moedc_wire *w);

/* Decodes a ForwardResponse to a request of dtype [tokens, d_model] into res, checking the output
 * is exactly that: its bytes, or (out->region set) a reference to where the request put it. */
int moedc_decode_forward(const uint8_t *buf, size_t n, int dtype, int64_t tokens, int64_t d_model,
                         const moedc_ref *out, moedc_result *res, moedc_error *err);

/* Gives res (decoded by moedc_decode_forward, its output in the reply) the output at buf, malloc'd,
 * tokens x d_model elements of its dtype, which it then owns in place of the reply's: a fleet's
 * sum over shards that each got fewer tokens. */
void moedc_result_set_output(moedc_result *res, void *buf, int64_t tokens);

/* GetModelRequest / grpc.health.v1.HealthCheckRequest into malloc'd bytes. */
int moedc_encode_get_model(uint8_t **buf, size_t *n, moedc_error *err);
int moedc_encode_health(const char *service, uint8_t **buf, size_t *n, moedc_error *err);

int moedc_decode_model_info(const uint8_t *buf, size_t n, moedc_model_info *out, moedc_error *err);
int moedc_decode_health(const uint8_t *buf, size_t n, int *status, moedc_error *err);
int moedc_decode_region_list(const uint8_t *buf, size_t n, moedc_region_info **out, int *count,
                             moedc_error *err);

/* A link the server opened (moed.proto's Link, the event answering open_link), checked. */
typedef struct moedc_link_grant {
    uint64_t id;
    unsigned char unique_id[128]; /* ncclUniqueId: join as rank 1 of 2 */
    unsigned char key[32];        /* the link's first message */
    uint32_t device, version, nccl_version;
    uint64_t max_payload_bytes;
} moedc_link_grant;

/* The grant of a RegionEvent's link (NULL: the event carries none), or MOEDC_EFORMAT naming the
 * field that breaks moed.proto's Link (an id of 0, a unique_id of other than 128 bytes, a key of
 * other than 32, no max_payload_bytes) and MOEDC_EUNSUPPORTED for a call layout other than this
 * client's (MOED_LINK_VERSION). */
struct Moed__V1__Link;
int moedc_decode_link(const struct Moed__V1__Link *l, moedc_link_grant *out, moedc_error *err);

#endif
