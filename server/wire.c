/*
 * moed_wire — a protobuf reader over a slice list, the ForwardRequest schema on top of it, and
 * the three-slice ForwardResponse writer.
 *
 * Why hand-written: protobuf-c's unpack wants the message in one buffer and copies every bytes
 * field out of it: for a 64 MiB request that is two extra copies of the tensor and a 64 MiB
 * allocation per call. Here the reader keeps a cursor (slice, pointer) and a count of the bytes
 * left in the current message, so a nested message is "the next len bytes" and a tensor's data
 * is a span the scheduler copies once into staging memory.
 *
 * Invariant: r->left never exceeds the bytes actually left in the slices (it starts as their sum
 * and only shrinks), so every read that first checks `need <= r->left` stays in bounds.
 */
#include "wire.h"

#include "moed_dtype.h"
#include "moed_synth.h"

#include <grpc/byte_buffer.h>
#include <grpc/slice.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the reader ------------------------------------------------------------------------------ */

/* How deep unknown groups may nest: protobuf's own parsers read 100 levels by default, and the
 * recursion it takes here (two small frames a level) is nothing to a thread's stack. */
#define GROUP_DEPTH_MAX 100

typedef struct rd {
    const grpc_slice *s;  /* current slice */
    const uint8_t *p, *e; /* cursor and end within it */
    size_t left;          /* bytes left in the message being decoded */
    size_t pos;           /* offset from the start of the outer message, for messages */
    int depth;            /* nested group depth */
    moed_error *err;
} rd;

enum { WT_VARINT = 0, WT_I64 = 1, WT_LEN = 2, WT_SGROUP = 3, WT_EGROUP = 4, WT_I32 = 5 };

static const char *const wt_names[] = { "varint",    "64-bit", "length-delimited", "start-group",
                                        "end-group", "32-bit", "invalid (6)",      "invalid (7)" };

static const uint8_t *slice_start(const grpc_slice *s)
{
    return GRPC_SLICE_START_PTR(*s);
}

static void rd_enter_slice(rd *r, const grpc_slice *s, size_t off)
{
    r->s = s;
    r->p = slice_start(s) + off;
    r->e = slice_start(s) + GRPC_SLICE_LENGTH(*s);
}

/* Moves to the next slice that has bytes; only called while r->left > 0, so one exists. */
static void rd_refill(rd *r)
{
    while (r->p == r->e) rd_enter_slice(r, r->s + 1, 0);
}

static int rd_fail(rd *r, const char *what)
{
    return moed_fail(r->err, MOED_EFORMAT, "malformed message at byte %zu: %s", r->pos, what);
}

static int rd_byte(rd *r, uint8_t *b)
{
    if (!r->left) return rd_fail(r, "truncated (ends inside a field)");
    rd_refill(r);
    *b = *r->p++;
    r->left--;
    r->pos++;
    return 0;
}

static int rd_varint(rd *r, uint64_t *v)
{
    uint64_t x = 0;
    for (int shift = 0; shift < 70; shift += 7) {
        uint8_t b = 0;
        int rc = rd_byte(r, &b);
        if (rc) return rc;
        /* The tenth byte may only carry the top bit of 64. */
        if (shift == 63 && b > 1) return rd_fail(r, "varint longer than 64 bits");
        x |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) {
            *v = x;
            return 0;
        }
    }
    return rd_fail(r, "varint longer than 10 bytes");
}

/* Skips n bytes (checked against left); if span is not NULL, records them as a span. */
static int rd_skip(rd *r, uint64_t n, moed_span *span)
{
    if (n > r->left) return rd_fail(r, "a length runs past the end of its message");
    if (n) rd_refill(r);
    if (span) *span = (moed_span){ r->s, (size_t)(r->p - slice_start(r->s)), (size_t)n };
    r->left -= n;
    r->pos += n;
    while (n) {
        size_t have = (size_t)(r->e - r->p);
        if (have >= n) {
            r->p += n;
            break;
        }
        n -= have;
        rd_enter_slice(r, r->s + 1, 0);
    }
    return 0;
}

static int rd_fixed32(rd *r, uint32_t *v)
{
    uint32_t x = 0;
    for (int i = 0; i < 4; i++) {
        uint8_t b = 0;
        int rc = rd_byte(r, &b);
        if (rc) return rc;
        x |= (uint32_t)b << (8 * i);
    }
    *v = x;
    return 0;
}

static int rd_tag(rd *r, uint32_t *field, int *wt)
{
    uint64_t t;
    int rc = rd_varint(r, &t);
    if (rc) return rc;
    *field = (uint32_t)(t >> 3);
    *wt = (int)(t & 7);
    if (t >> 3 == 0 || t >> 3 > 0x1fffffff) return rd_fail(r, "field number 0 or above 2^29-1");
    return 0;
}

static int skip_field(rd *r, uint32_t field, int wt);

/* Skips a group's fields up to its end tag (unknown proto2 groups; never sent by moed clients). */
static int skip_group(rd *r, uint32_t field)
{
    if (++r->depth > GROUP_DEPTH_MAX) {
        char what[64];
        snprintf(what, sizeof what, "groups nested deeper than %d", GROUP_DEPTH_MAX);
        return rd_fail(r, what);
    }
    for (;;) {
        uint32_t f;
        int wt, rc = rd_tag(r, &f, &wt);
        if (rc) return rc;
        if (wt == WT_EGROUP) {
            if (f != field) return rd_fail(r, "end-group tag does not match its start");
            r->depth--;
            return 0;
        }
        if ((rc = skip_field(r, f, wt))) return rc;
    }
}

static int skip_field(rd *r, uint32_t field, int wt)
{
    uint64_t v;
    int rc;
    switch (wt) {
    case WT_VARINT:
        return rd_varint(r, &v);
    case WT_I64:
        return rd_skip(r, 8, NULL);
    case WT_LEN:
        if ((rc = rd_varint(r, &v))) return rc;
        return rd_skip(r, v, NULL);
    case WT_SGROUP:
        return skip_group(r, field);
    case WT_I32:
        return rd_skip(r, 4, NULL);
    }
    return rd_fail(r, wt == WT_EGROUP ? "end-group tag without a start" : "invalid wire type");
}

/* Checks a known field's wire type; names the field for the person reading the status. */
static int expect_wt(rd *r, const char *msg, const char *name, uint32_t field, int wt, int want)
{
    if (wt == want) return 0;
    char what[200];
    snprintf(what, sizeof what, "%s.%s (field %u) has wire type %s; the schema says %s", msg, name,
             field, wt_names[wt], wt_names[want]);
    return rd_fail(r, what);
}

/* Enters a nested message: reads its length, then decodes it with `left` limited to it. */
typedef int (*decode_fn)(rd *r, void *obj);

static int rd_message(rd *r, decode_fn fn, void *obj)
{
    uint64_t len;
    int rc = rd_varint(r, &len);
    if (rc) return rc;
    if (len > r->left) return rd_fail(r, "a nested message runs past the end of its parent");
    size_t outer = r->left - (size_t)len;
    r->left = (size_t)len;
    if ((rc = fn(r, obj))) return rc;
    r->left = outer;
    return 0;
}

/* ---- the schema ------------------------------------------------------------------------------ */

static void add_dim(moed_wire_tensor *t, uint64_t v)
{
    if (t->n_shape < MOED_WIRE_MAX_DIMS) t->shape[t->n_shape] = (int64_t)v;
    if (t->n_shape < 1 << 30) t->n_shape++;
}

static int decode_ref(rd *r, void *obj)
{
    moed_wire_ref *x = obj;
    static const char *const names[] = { "", "region", "offset", "length" };
    while (r->left) {
        uint32_t f;
        int wt, rc = rd_tag(r, &f, &wt);
        uint64_t v;
        if (rc) return rc;
        if (f < 1 || f > 3) {
            if ((rc = skip_field(r, f, wt))) return rc;
            continue;
        }
        if ((rc = expect_wt(r, "RegionRef", names[f], f, wt, WT_VARINT)) || (rc = rd_varint(r, &v)))
            return rc;
        if (f == 1) x->region = v;
        if (f == 2) x->offset = v;
        if (f == 3) x->length = v;
    }
    return 0;
}

static int decode_tensor(rd *r, void *obj)
{
    moed_wire_tensor *t = obj;
    t->present = true;
    while (r->left) {
        uint32_t f;
        int wt, rc = rd_tag(r, &f, &wt);
        uint64_t v;
        if (rc) return rc;
        if (f == 1) {
            if ((rc = expect_wt(r, "Tensor", "dtype", f, wt, WT_VARINT)) || (rc = rd_varint(r, &v)))
                return rc;
            t->dtype = (int32_t)(uint32_t)v;
        } else if (f == 2 && wt == WT_LEN) {
            /* Packed: varints filling exactly the given length. */
            uint64_t len;
            if ((rc = rd_varint(r, &len))) return rc;
            if (len > r->left) return rd_fail(r, "packed Tensor.shape runs past its message");
            size_t end = r->left - (size_t)len;
            while (r->left > end) {
                if ((rc = rd_varint(r, &v))) return rc;
                if (r->left < end) return rd_fail(r, "a varint crosses the end of packed shape");
                add_dim(t, v);
            }
        } else if (f == 2) {
            if ((rc = expect_wt(r, "Tensor", "shape", f, wt, WT_VARINT)) || (rc = rd_varint(r, &v)))
                return rc;
            add_dim(t, v);
        } else if (f == 3) { /* the contents oneof: data replaces a region */
            if ((rc = expect_wt(r, "Tensor", "data", f, wt, WT_LEN)) || (rc = rd_varint(r, &v)) ||
                (rc = rd_skip(r, v, &t->data)))
                return rc;
            t->in_region = false;
            memset(&t->region, 0, sizeof t->region);
        } else if (f == 4) { /* ... and a region replaces data (and merges into a region) */
            if ((rc = expect_wt(r, "Tensor", "region", f, wt, WT_LEN))) return rc;
            if (!t->in_region) memset(&t->region, 0, sizeof t->region);
            if ((rc = rd_message(r, decode_ref, &t->region))) return rc;
            t->in_region = true;
            memset(&t->data, 0, sizeof t->data);
        } else if ((rc = skip_field(r, f, wt))) {
            return rc;
        }
    }
    return 0;
}

static int decode_gating(rd *r, void *obj)
{
    moed_wire_gating *g = obj;
    while (r->left) {
        uint32_t f, bits;
        int wt, rc = rd_tag(r, &f, &wt);
        uint64_t v;
        if (rc) return rc;
        if (f >= 1 && f <= 3) {
            static const char *const names[] = { "", "strategy", "top_k", "renormalize" };
            if ((rc = expect_wt(r, "Gating", names[f], f, wt, WT_VARINT)) ||
                (rc = rd_varint(r, &v)))
                return rc;
            if (f == 1) g->strategy = (int32_t)(uint32_t)v;
            if (f == 2) g->top_k = (uint32_t)v;
            if (f == 3) g->renormalize = (int32_t)(uint32_t)v;
        } else if (f == 4) {
            if ((rc = expect_wt(r, "Gating", "threshold", f, wt, WT_I32)) ||
                (rc = rd_fixed32(r, &bits)))
                return rc;
            memcpy(&g->threshold, &bits, 4);
        } else if ((rc = skip_field(r, f, wt))) {
            return rc;
        }
    }
    return 0;
}

/* ExpertChoice, RouterLogits and ServerRouter: each a pair of optional sub-messages. */
static int decode_routing(rd *r, void *obj)
{
    moed_wire_request *q = obj;
    while (r->left) {
        uint32_t f;
        int wt, rc = rd_tag(r, &f, &wt);
        if (rc) return rc;
        void *sub = NULL;
        decode_fn fn = decode_tensor;
        const char *msg = "", *name = "";
        if (q->routing == MOED_ROUTING_EXPERTS && (f == 1 || f == 2)) {
            sub = f == 1 ? &q->expert_ids : &q->expert_weights;
            msg = "ExpertChoice";
            name = f == 1 ? "expert_ids" : "expert_weights";
        } else if (q->routing == MOED_ROUTING_LOGITS && f == 1) {
            sub = &q->logits;
            msg = "RouterLogits";
            name = "logits";
        } else if ((q->routing == MOED_ROUTING_LOGITS && f == 2) ||
                   (q->routing == MOED_ROUTING_SERVER && f == 1)) {
            sub = &q->gating;
            fn = decode_gating;
            msg = q->routing == MOED_ROUTING_LOGITS ? "RouterLogits" : "ServerRouter";
            name = "gating";
        }
        if (!sub) {
            if ((rc = skip_field(r, f, wt))) return rc;
            continue;
        }
        if ((rc = expect_wt(r, msg, name, f, wt, WT_LEN)) || (rc = rd_message(r, fn, sub)))
            return rc;
    }
    return 0;
}

static int decode_batch_gating(rd *r, void *obj)
{
    moed_wire_request *q = obj;
    q->batch_gating = true;
    while (r->left) {
        uint32_t f;
        int wt, rc = rd_tag(r, &f, &wt);
        uint64_t v;
        if (rc) return rc;
        if (f == 1) {
            if ((rc = expect_wt(r, "BatchGating", "k_batch", f, wt, WT_VARINT)) ||
                (rc = rd_varint(r, &v)))
                return rc;
            q->k_batch = (uint32_t)v;
        } else if ((rc = skip_field(r, f, wt))) {
            return rc;
        }
    }
    return 0;
}

static int decode_range(rd *r, void *obj)
{
    uint32_t *fl = obj; /* first, last */
    static const char *const names[] = { "", "first", "last" };
    while (r->left) {
        uint32_t f;
        int wt, rc = rd_tag(r, &f, &wt);
        uint64_t v;
        if (rc) return rc;
        if (f < 1 || f > 2) {
            if ((rc = skip_field(r, f, wt))) return rc;
            continue;
        }
        if ((rc = expect_wt(r, "ExpertRange", names[f], f, wt, WT_VARINT)) ||
            (rc = rd_varint(r, &v)))
            return rc;
        fl[f - 1] = (uint32_t)v;
    }
    return 0;
}

static int decode_expect(rd *r, void *obj)
{
    moed_wire_expect *x = obj;
    x->present = true;
    while (r->left) {
        uint32_t f;
        int wt, rc = rd_tag(r, &f, &wt);
        uint64_t v;
        if (rc) return rc;
        if (f == 1 || f == 3) {
            if ((rc = expect_wt(r, "Expectation",
                                f == 1 ? "model_fingerprint" : "adds_shared_experts", f, wt,
                                WT_VARINT)) ||
                (rc = rd_varint(r, &v)))
                return rc;
            if (f == 1) x->model = v;
            if (f == 3) x->adds_shared = v != 0;
        } else if (f == 2) {
            uint32_t fl[2] = { 0, 0 };
            if ((rc = expect_wt(r, "Expectation", "experts_held", f, wt, WT_LEN)) ||
                (rc = rd_message(r, decode_range, fl)))
                return rc;
            if (x->n_ranges < MOED_WIRE_SHOWN_RANGES) {
                x->first[x->n_ranges] = fl[0];
                x->last[x->n_ranges] = fl[1];
            }
            x->ranges_hash = moed_ranges_fold(x->ranges_hash, fl[0], fl[1]);
            if (x->n_ranges < UINT32_MAX) x->n_ranges++;
        } else if ((rc = skip_field(r, f, wt))) {
            return rc;
        }
    }
    return 0;
}

/* A oneof member replaces another member (clearing it) and merges into itself. */
static void switch_routing(moed_wire_request *q, int routing)
{
    if (q->routing == routing) return;
    q->routing = routing;
    memset(&q->expert_ids, 0, sizeof q->expert_ids);
    memset(&q->expert_weights, 0, sizeof q->expert_weights);
    memset(&q->logits, 0, sizeof q->logits);
    memset(&q->gating, 0, sizeof q->gating);
}

static int decode_request(rd *r, moed_wire_request *q)
{
    static const char *const names[] = { "",        "request_id", "layer",         "hidden",
                                         "experts", "logits",     "server_router", "batch_gating",
                                         "output",  "expect" };
    while (r->left) {
        uint32_t f;
        int wt, rc = rd_tag(r, &f, &wt);
        uint64_t v;
        if (rc) return rc;
        if (f < 1 || f > 9) {
            if ((rc = skip_field(r, f, wt))) return rc;
            continue;
        }
        if ((rc = expect_wt(r, "ForwardRequest", names[f], f, wt, f == 2 ? WT_VARINT : WT_LEN)))
            return rc;
        switch (f) {
        case 1:
            if ((rc = rd_varint(r, &v)) || (rc = rd_skip(r, v, &q->request_id))) return rc;
            break;
        case 2:
            if ((rc = rd_varint(r, &v))) return rc;
            q->layer = (uint32_t)v;
            break;
        case 3:
            if ((rc = rd_message(r, decode_tensor, &q->hidden))) return rc;
            break;
        case 4:
        case 5:
        case 6:
            switch_routing(q, (int)f);
            if ((rc = rd_message(r, decode_routing, q))) return rc;
            break;
        case 7:
            if ((rc = rd_message(r, decode_batch_gating, q))) return rc;
            break;
        case 8:
            q->has_output = true;
            if ((rc = rd_message(r, decode_ref, &q->output))) return rc;
            break;
        case 9:
            if ((rc = rd_message(r, decode_expect, &q->expect))) return rc;
            break;
        }
    }
    return 0;
}

int moed_wire_decode_request(const grpc_slice *slices, size_t n, moed_wire_request *out,
                             moed_error *err)
{
    static const grpc_slice empty; /* the cursor's home when there are no slices at all */
    memset(out, 0, sizeof *out);
    rd r = { .err = err };
    for (size_t i = 0; i < n; i++) r.left += GRPC_SLICE_LENGTH(slices[i]);
    rd_enter_slice(&r, n ? slices : &empty, 0);
    out->bytes = r.left;
    return decode_request(&r, out);
}

void moed_span_copy(const moed_span *s, void *dst)
{
    const grpc_slice *sl = s->slice;
    size_t off = s->off, left = s->len;
    uint8_t *d = dst;
    while (left) {
        size_t have = GRPC_SLICE_LENGTH(*sl) - off, n = have < left ? have : left;
        memcpy(d, slice_start(sl) + off, n);
        d += n;
        left -= n;
        sl++;
        off = 0;
    }
}

/* ---- received messages ----------------------------------------------------------------------- */

int moed_wire_msg_open(moed_wire_msg *m, grpc_byte_buffer *bb, moed_error *err)
{
    memset(m, 0, sizeof *m);
    if (!bb) return 0; /* an empty message arrives as no buffer */
    if (!grpc_byte_buffer_reader_init(&m->reader, bb))
        return moed_fail(err, MOED_EFORMAT,
                         "the message could not be decompressed; send it uncompressed");
    m->open = true;
    m->slices = m->reader.buffer_out->data.raw.slice_buffer.slices;
    m->n_slices = m->reader.buffer_out->data.raw.slice_buffer.count;
    return 0;
}

void moed_wire_msg_close(moed_wire_msg *m)
{
    if (m->open) grpc_byte_buffer_reader_destroy(&m->reader);
    m->open = false;
}

/* ---- responses ------------------------------------------------------------------------------- */

static uint8_t *put_varint(uint8_t *p, uint64_t v)
{
    while (v >= 0x80) {
        *p++ = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    *p++ = (uint8_t)v;
    return p;
}

static size_t varint_len(uint64_t v)
{
    size_t n = 1;
    while (v >= 0x80) v >>= 7, n++;
    return n;
}

static uint8_t *put_tag(uint8_t *p, uint32_t field, int wt)
{
    return put_varint(p, (uint64_t)field << 3 | (uint64_t)wt);
}

static uint8_t *put_uint_field(uint8_t *p, uint32_t field, uint64_t v)
{
    if (!v) return p; /* proto3: zero is the default and is not written */
    return put_varint(put_tag(p, field, WT_VARINT), v);
}

grpc_byte_buffer *moed_wire_encode_response(const moed_wire_response *r, grpc_slice data)
{
    grpc_byte_buffer *bb = NULL;
    size_t data_len = GRPC_SLICE_LENGTH(data);
    uint8_t *tail = malloc(80 + 10 * (size_t)r->n_expert_set);
    if (!tail) goto out;

    /* Header: request_id, then output's tag, length and its fields up to data's length (or its
     * region). */
    uint8_t head[64 + 128 + 64], tensor[96], *p = head, *t = tensor;
    size_t id_len = r->request_id_len <= 128 ? r->request_id_len : 128;
    t = put_uint_field(t, 1, (uint64_t)r->dtype);
    uint8_t shape[24], *s = put_varint(put_varint(shape, (uint64_t)r->rows), (uint64_t)r->cols);
    t = put_varint(put_tag(t, 2, WT_LEN), (uint64_t)(s - shape));
    memcpy(t, shape, (size_t)(s - shape));
    t += s - shape;
    if (r->out_region) {
        uint8_t ref[32], *e = ref;
        e = put_uint_field(e, 1, r->out_region->region);
        e = put_uint_field(e, 2, r->out_region->offset);
        e = put_uint_field(e, 3, r->out_region->length);
        t = put_varint(put_tag(t, 4, WT_LEN), (uint64_t)(e - ref));
        memcpy(t, ref, (size_t)(e - ref));
        t += e - ref;
        data_len = 0;
    } else {
        t = put_varint(put_tag(t, 3, WT_LEN), data_len);
    }
    if (id_len) {
        p = put_varint(put_tag(p, 1, WT_LEN), id_len);
        memcpy(p, r->request_id, id_len);
        p += id_len;
    }
    p = put_varint(put_tag(p, 2, WT_LEN), (size_t)(t - tensor) + data_len);
    memcpy(p, tensor, (size_t)(t - tensor));
    p += t - tensor;

    /* Trailer: expert_set packed, then timings. */
    uint8_t *q = tail;
    if (r->n_expert_set) {
        size_t n = 0;
        for (int i = 0; i < r->n_expert_set; i++) n += varint_len((uint64_t)r->expert_set[i]);
        q = put_varint(put_tag(q, 3, WT_LEN), n);
        for (int i = 0; i < r->n_expert_set; i++) q = put_varint(q, (uint64_t)r->expert_set[i]);
    }
    uint8_t tim[64], *m = tim;
    m = put_uint_field(m, 1, r->timings.queue_us);
    m = put_uint_field(m, 2, r->timings.compute_us);
    m = put_uint_field(m, 3, r->timings.total_us);
    m = put_uint_field(m, 4, r->timings.batch_tokens);
    m = put_uint_field(m, 5, r->timings.batch_requests);
    q = put_varint(put_tag(q, 4, WT_LEN), (size_t)(m - tim));
    memcpy(q, tim, (size_t)(m - tim));
    q += m - tim;

    grpc_slice parts[3] = { grpc_slice_from_copied_buffer((const char *)head, (size_t)(p - head)),
                            data,
                            grpc_slice_from_copied_buffer((const char *)tail, (size_t)(q - tail)) };
    if (r->out_region) parts[1] = parts[2];
    bb = grpc_raw_byte_buffer_create(parts, r->out_region ? 2 : 3);
    grpc_slice_unref(parts[0]);
    grpc_slice_unref(r->out_region ? parts[1] : parts[2]);
out:
    free(tail);
    grpc_slice_unref(data);
    return bb;
}

grpc_byte_buffer *moed_wire_pack(const ProtobufCMessage *m)
{
    size_t n = protobuf_c_message_get_packed_size(m);
    grpc_slice s = grpc_slice_malloc(n);
    protobuf_c_message_pack(m, GRPC_SLICE_START_PTR(s));
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    return bb;
}

/* ---- small messages (protobuf-c) ------------------------------------------------------------- */

/* A reader over buf[0, n), which *slice must hold (a static slice: nothing is copied). */
static rd flat_reader(const uint8_t *buf, size_t n, grpc_slice *slice, moed_error *err)
{
    *slice = grpc_slice_from_static_buffer(buf, n);
    rd r = { .left = n, .err = err };
    rd_enter_slice(&r, slice, 0);
    return r;
}

/* Copies the message r is in (its r->left bytes) to *o, less its groups, which protobuf-c cannot
 * skip (a proto3 schema has none of its own, so each is an unknown field). A known sub-message is
 * copied the same way, after its new length. Nothing is written ahead of what was read (tags and
 * varints are written in their shortest form), so the copy fits in the message's own size. */
static int strip_groups(rd *r, const ProtobufCMessageDescriptor *d, uint8_t **o)
{
    while (r->left) {
        uint32_t f;
        int wt, rc = rd_tag(r, &f, &wt);
        uint64_t v;
        moed_span span;
        if (rc) return rc;
        if (wt == WT_SGROUP) {
            if ((rc = skip_group(r, f))) return rc;
            continue;
        }
        const ProtobufCFieldDescriptor *fd = protobuf_c_message_descriptor_get_field(d, f);
        *o = put_tag(*o, f, wt);
        switch (wt) {
        case WT_VARINT:
            if ((rc = rd_varint(r, &v))) return rc;
            *o = put_varint(*o, v);
            break;
        case WT_I64:
        case WT_I32:
            if ((rc = rd_skip(r, wt == WT_I64 ? 8 : 4, &span))) return rc;
            moed_span_copy(&span, *o);
            *o += span.len;
            break;
        case WT_LEN:
            if ((rc = rd_varint(r, &v))) return rc;
            if (v > r->left) return rd_fail(r, "a length runs past the end of its message");
            if (fd && fd->type == PROTOBUF_C_TYPE_MESSAGE) {
                uint8_t *len_at = *o, *body = *o + varint_len(v);
                size_t outer = r->left - (size_t)v;
                r->left = (size_t)v;
                *o = body;
                if ((rc = strip_groups(r, fd->descriptor, o))) return rc;
                r->left = outer;
                size_t n = (size_t)(*o - body);
                uint8_t *moved = put_varint(len_at, n); /* no longer than v's varint */
                memmove(moved, body, n);
                *o = moved + n;
            } else {
                if ((rc = rd_skip(r, v, &span))) return rc;
                *o = put_varint(*o, v);
                moed_span_copy(&span, *o);
                *o += span.len;
            }
            break;
        default:
            return rd_fail(r,
                           wt == WT_EGROUP ? "end-group tag without a start" : "invalid wire type");
        }
    }
    return 0;
}

int moed_wire_unpack_bytes(const ProtobufCMessageDescriptor *d, const uint8_t *buf, size_t n,
                           ProtobufCMessage **out, moed_error *err)
{
    *out = protobuf_c_message_unpack(d, NULL, n, buf);
    if (*out) return 0;
    uint8_t *copy = malloc(n ? n : 1), *end = copy;
    if (!copy) return moed_fail(err, MOED_ENOMEM, "%s: no memory to read the message", d->name);
    grpc_slice slice;
    rd r = flat_reader(buf, n, &slice, err);
    int rc = strip_groups(&r, d, &end);
    if (rc)
        moed_error_prefix(err, "%s", d->name);
    else if (!(*out = protobuf_c_message_unpack(d, NULL, (size_t)(end - copy), copy)))
        rc = moed_fail(err, MOED_EFORMAT, "%s: the message does not parse", d->name);
    free(copy);
    return rc;
}

int moed_wire_unpack(const ProtobufCMessageDescriptor *d, grpc_byte_buffer *bb,
                     ProtobufCMessage **out, moed_error *err)
{
    *out = NULL;
    grpc_slice all = grpc_empty_slice();
    if (bb) {
        grpc_byte_buffer_reader rdr;
        if (!grpc_byte_buffer_reader_init(&rdr, bb))
            return moed_fail(err, MOED_EFORMAT, "%s: could not decompress the message", d->name);
        all = grpc_byte_buffer_reader_readall(&rdr);
        grpc_byte_buffer_reader_destroy(&rdr);
    }
    int rc = moed_wire_unpack_bytes(d, GRPC_SLICE_START_PTR(all), GRPC_SLICE_LENGTH(all), out, err);
    grpc_slice_unref(all);
    return rc;
}

uint64_t moed_wire_find_uint(const uint8_t *buf, size_t n, uint32_t field)
{
    moed_error err;
    grpc_slice slice;
    rd r = flat_reader(buf, n, &slice, &err);
    uint64_t found = 0, v;
    uint32_t f;
    int wt;
    while (r.left && !rd_tag(&r, &f, &wt)) {
        if (f == field && wt == WT_VARINT) {
            if (rd_varint(&r, &v)) break;
            found = v;
        } else if (skip_field(&r, f, wt)) {
            break;
        }
    }
    return found;
}
