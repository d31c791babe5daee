/*
 * moed_link — the call layout of an NCCL link (moed_link.h states the contract).
 */
#include "moed_link.h"

#include "moed_dtype.h"
#include "moed_synth.h"

#include <stdio.h>
#include <string.h>

#define LIMIT (UINT64_C(1) << 62) /* every size and sum below stays under 2^63 */

static uint64_t round_up(uint64_t x)
{
    return (x + MOED_LINK_ALIGN - 1) / MOED_LINK_ALIGN * MOED_LINK_ALIGN;
}

/* a * b, or 0 when it reaches LIMIT (neither factor is 0 here) */
static uint64_t mul(uint64_t a, uint64_t b)
{
    return a > LIMIT / b ? 0 : a * b;
}

int moed_link_layout(uint64_t tokens, uint64_t top_k, uint64_t d_model, uint64_t elem_bytes,
                     moed_link_payload *out, moed_error *err)
{
    memset(out, 0, sizeof *out);
    if (!tokens || !top_k || !d_model || !elem_bytes)
        return moed_fail(err, MOED_EINVAL,
                         "a link call needs tokens, top_k, d_model and an element size >= 1 (got "
                         "%llu, %llu, %llu, %llu)",
                         (unsigned long long)tokens, (unsigned long long)top_k,
                         (unsigned long long)d_model, (unsigned long long)elem_bytes);
    if (top_k > MOED_LINK_MAX_TOP_K)
        return moed_fail(err, MOED_EINVAL, "top_k = %llu: a link call takes at most %d choices",
                         (unsigned long long)top_k, MOED_LINK_MAX_TOP_K);
    uint64_t row = mul(d_model, elem_bytes);
    uint64_t hidden = row ? mul(tokens, row) : 0;
    uint64_t pairs = mul(tokens, top_k);
    if (!hidden || !pairs || hidden > LIMIT / 4 || pairs > LIMIT / 16)
        return moed_fail(err, MOED_EINVAL,
                         "a link call of %llu tokens x %llu columns is too large to lay out",
                         (unsigned long long)tokens, (unsigned long long)d_model);
    out->hidden = 0;
    out->hidden_bytes = hidden;
    out->ids = round_up(hidden);
    out->ids_bytes = pairs * 4;
    out->weights = round_up(out->ids + out->ids_bytes);
    out->weights_bytes = pairs * 4;
    out->total = out->weights + out->weights_bytes;
    return 0;
}

uint64_t moed_link_reply_bytes(uint64_t tokens, uint64_t d_model, uint64_t elem_bytes)
{
    if (!tokens || !d_model || !elem_bytes) return MOED_LINK_HEADER_BYTES;
    uint64_t row = mul(d_model, elem_bytes), out = row ? mul(tokens, row) : 0;
    return out && out < LIMIT / 2 ? MOED_LINK_HEADER_BYTES + out : 0;
}

int moed_link_capacity(uint64_t max_tokens, uint64_t max_top_k, uint64_t d_model,
                       uint64_t elem_bytes, uint64_t *payload, uint64_t *reply, moed_error *err)
{
    moed_link_payload p;
    int rc = moed_link_layout(max_tokens, max_top_k, d_model, elem_bytes, &p, err);
    if (rc) return rc;
    *payload = p.total;
    *reply = moed_link_reply_bytes(max_tokens, d_model, elem_bytes);
    return 0;
}

int moed_link_check_call(const moed_link_call *c, uint64_t expect_seq, uint32_t max_tokens,
                         uint32_t max_top_k, uint64_t max_payload, moed_error *err)
{
    if (c->magic != MOED_LINK_MAGIC)
        return moed_fail(err, MOED_EFORMAT, "call header magic 0x%08x is not \"MDLK\" (0x%08x)",
                         c->magic, MOED_LINK_MAGIC);
    if (c->version != MOED_LINK_VERSION || c->header_bytes != MOED_LINK_HEADER_BYTES)
        return moed_fail(err, MOED_EFORMAT,
                         "call header version %u, header_bytes %u: this server speaks version %d "
                         "with %d-byte headers",
                         c->version, c->header_bytes, MOED_LINK_VERSION, MOED_LINK_HEADER_BYTES);
    if (c->seq != expect_seq)
        return moed_fail(err, MOED_EFORMAT, "call seq %llu where %llu was next",
                         (unsigned long long)c->seq, (unsigned long long)expect_seq);
    if ((c->flags & ~(uint32_t)MOED_LINK_EXPECT) || c->reserved || c->expect_adds_shared > 1)
        return moed_fail(err, MOED_EFORMAT,
                         "call flags 0x%x, reserved %u, expect_adds_shared %u: link version %d "
                         "defines only flag 0x%x (MOED_LINK_EXPECT), reserved 0 and a 0 or 1",
                         c->flags, c->reserved, c->expect_adds_shared, MOED_LINK_VERSION,
                         MOED_LINK_EXPECT);
    size_t elem = moed_dtype_size((int)c->dtype);
    if (!moed_dtype_is_float((int)c->dtype) || !elem)
        return moed_fail(err, MOED_EFORMAT, "call dtype %u is not F32, F16 or BF16", c->dtype);
    if (c->tokens < 1 || c->tokens > max_tokens)
        return moed_fail(err, MOED_EFORMAT, "call tokens = %u: this link was opened for 1 .. %u",
                         c->tokens, max_tokens);
    if (c->top_k < 1 || c->top_k > max_top_k)
        return moed_fail(err, MOED_EFORMAT, "call top_k = %u: this link was opened for 1 .. %u",
                         c->top_k, max_top_k);
    moed_link_payload p;
    int rc = moed_link_layout(c->tokens, c->top_k, c->d_model, elem, &p, err);
    if (rc) return moed_fail(err, MOED_EFORMAT, "call layout: %s", err ? err->msg : "invalid");
    if (c->payload_bytes != p.total)
        return moed_fail(err, MOED_EFORMAT,
                         "call payload_bytes = %llu: %u tokens, top_k %u, d_model %u of %s lay out "
                         "in %llu",
                         (unsigned long long)c->payload_bytes, c->tokens, c->top_k, c->d_model,
                         moed_dtype_name((int)c->dtype), (unsigned long long)p.total);
    if (p.total > max_payload)
        return moed_fail(err, MOED_EFORMAT,
                         "call payload of %llu bytes is over this link's %llu (d_model %u is wider "
                         "than every layer served?)",
                         (unsigned long long)p.total, (unsigned long long)max_payload, c->d_model);
    return 0;
}

void moed_link_to_ring(const moed_link_call *c, uint64_t region, uint64_t payload_at,
                       uint64_t reply_at, moed_ring_request *out)
{
    memset(out, 0, sizeof *out);
    moed_link_payload p;
    size_t elem = moed_dtype_size((int)c->dtype);
    if (moed_link_layout(c->tokens, c->top_k, c->d_model, elem, &p, NULL))
        memset(&p, 0, sizeof p); /* unchecked call: every length 0, which validation refuses */
    out->layer = c->layer;
    out->dtype = c->dtype;
    out->tokens = c->tokens;
    out->top_k = c->top_k;
    out->deadline_us = c->deadline_us;
    out->tag = c->tag;
    out->hidden = (moed_ring_ref){ region, payload_at + p.hidden, p.hidden_bytes };
    out->expert_ids = (moed_ring_ref){ region, payload_at + p.ids, p.ids_bytes };
    out->expert_weights = (moed_ring_ref){ region, payload_at + p.weights, p.weights_bytes };
    out->output = (moed_ring_ref){ region, reply_at + MOED_LINK_HEADER_BYTES, p.hidden_bytes };
}

int moed_link_call_init(moed_link_call *c, uint64_t seq, uint32_t layer, uint32_t dtype,
                        uint32_t tokens, uint32_t top_k, uint32_t d_model, uint32_t deadline_us,
                        uint64_t tag, moed_error *err)
{
    memset(c, 0, sizeof *c);
    moed_link_payload p;
    size_t elem = moed_dtype_size((int)dtype);
    if (!moed_dtype_is_float((int)dtype))
        return moed_fail(err, MOED_EINVAL, "a link call's dtype must be F32, F16 or BF16 (got %u)",
                         dtype);
    int rc = moed_link_layout(tokens, top_k, d_model, elem, &p, err);
    if (rc) return rc;
    c->magic = MOED_LINK_MAGIC;
    c->version = MOED_LINK_VERSION;
    c->header_bytes = MOED_LINK_HEADER_BYTES;
    c->seq = seq;
    c->layer = layer;
    c->dtype = dtype;
    c->tokens = tokens;
    c->top_k = top_k;
    c->d_model = d_model;
    c->deadline_us = deadline_us;
    c->tag = tag;
    c->payload_bytes = p.total;
    return 0;
}

void moed_link_call_expect(moed_link_call *c, uint64_t model, const uint32_t *first,
                           const uint32_t *last, uint32_t n, bool adds_shared)
{
    c->flags |= MOED_LINK_EXPECT;
    c->expect_model = model;
    c->expect_n_ranges = n;
    c->expect_adds_shared = adds_shared;
    c->expect_ranges_hash = 0;
    for (uint32_t i = 0; i < n; i++) {
        c->expect_ranges_hash = moed_ranges_fold(c->expect_ranges_hash, first[i], last[i]);
        if (i < MOED_LINK_SHOWN_RANGES) {
            c->expect_first[i] = first[i];
            c->expect_last[i] = last[i];
        }
    }
}

void moed_link_reply_init(moed_link_reply *r, uint64_t seq, int32_t status, const char *message,
                          uint32_t queue_us, uint32_t compute_us, uint32_t batch_tokens,
                          uint32_t batch_requests)
{
    memset(r, 0, sizeof *r);
    r->magic = MOED_LINK_REPLY_MAGIC;
    r->version = MOED_LINK_VERSION;
    r->header_bytes = MOED_LINK_HEADER_BYTES;
    r->seq = seq;
    r->status = status;
    r->queue_us = queue_us;
    r->compute_us = compute_us;
    r->batch_tokens = batch_tokens;
    r->batch_requests = batch_requests;
    snprintf(r->message, sizeof r->message, "%s", message ? message : "");
}

int moed_link_reply_matches(const moed_link_reply *r, uint64_t seq)
{
    return r->magic == MOED_LINK_REPLY_MAGIC && r->version == MOED_LINK_VERSION &&
           r->header_bytes == MOED_LINK_HEADER_BYTES && r->seq == seq;
}
