/*
 * fuzz_link — an NCCL link's messages as the daemon's link thread receives them (server/link.c,
 * common/moed_link.c, server/request.c), over the faked communicator of tests/unit/fake_link.h
 * and a backend whose forward writes zeros (the fuzz build has no CPU backend).
 *
 * An input: one byte of flags (bit 0: send a wrong key), then records [kind u8][len u16 LE][len
 * bytes]: kind 0 a call header, the next seq's valid header (layer, dtype, T, k, d_model from its
 * first bytes) XORed with the rest; kind 1 those bytes as a message; kind 2 the last header's
 * payload_bytes (at most 64 KiB), the bytes repeated over it. After each message the harness waits
 * until the link took it or ended; then it closes the link. Invariants: nothing crashes, leaks or
 * hangs, and every reply is moed_link_reply_bytes of its call.
 */
#include "fake_link.h"
#include "link.h"
#include "moed_dtype.h"
#include "moed_synth.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static moed_layer layer;
static const moed_layer *layers[1] = { &layer };

static int fz_load(moed_backend *b, int slot, const moed_layer *l, moed_error *err)
{
    return 0;
}

static int fz_start(moed_backend *b, moed_error *err)
{
    b->n_exec = 1;
    return 0;
}

static int fz_forward(moed_backend *b, int exec, const moed_job *job, moed_error *err)
{
    const size_t row = (size_t)fake_layers[job->slot]->info.d_model * moed_dtype_size(job->dtype);
    for (int i = 0; i < job->n_parts; i++) memset(job->parts[i].y, 0, row * job->parts[i].rows);
    return 0;
}

static int fz_logits(moed_backend *b, int exec, const moed_job *job, float *logits, moed_error *err)
{
    return moed_fail(err, MOED_EUNSUPPORTED, "fuzz: no router");
}

static int fz_info(moed_backend *b, int i, moed_device_info *out)
{
    memset(out, 0, sizeof *out);
    return 0;
}

static int fz_place(moed_backend *b, int slot, moed_layer_place *out)
{
    memset(out, 0, sizeof *out);
    return 0;
}

static void fz_destroy(moed_backend *b) {}

static const moed_backend_ops fz_ops = { .name = "fuzz",
                                         .load_layer = fz_load,
                                         .start = fz_start,
                                         .forward = fz_forward,
                                         .router_logits = fz_logits,
                                         .device_info = fz_info,
                                         .layer_place = fz_place,
                                         .destroy = fz_destroy };
static moed_backend backend = { .ops = &fz_ops, .n_devices = 1 };
static moed_regions *regions;
static moed_sched *sched;
static moed_served served;
static moed_links *lk;

static void setup(void)
{
    moed_error err;
    moed_synth_spec spec;
    if (moed_synth_parse("layers=1,d=16,ff=16,experts=4,topk=2,seed=1", &spec, &err) ||
        moed_synth_layer(&spec, 0, &layer, &err))
        abort();
    fake_link_backend(&backend, layers);
    moed_backend_start(&backend, &err);
    moed_regions_config rc = { .backend = &backend,
                               .mode = MOED_REGIONS_LOCAL,
                               .max_regions = 8,
                               .max_bytes = 1 << 20,
                               .max_total_bytes = 1 << 20 };
    served = (moed_served){
        .layers = layers, .n_layers = 1, .max_batch_tokens = 16, .max_message_bytes = 1 << 20
    };
    moed_sched_config sc = { .backend = &backend,
                             .layers = layers,
                             .n_layers = 1,
                             .max_batch_tokens = 16,
                             .max_queue_requests = 16 };
    if (moed_regions_create(&rc, &regions, &err) || moed_sched_create(&sc, &sched, &err)) abort();
    served.regions = regions;
    moed_links_config lc = { .served = &served,
                             .backend = &backend,
                             .sched = sched,
                             .max_links = 1,
                             .join_ms = 1000,
                             .payload_ms = 200 };
    if (moed_links_create(&lc, &lk, &err)) abort();
}

/* Waits until the link took every message given it, or ended. */
static void settle(fake_link *f)
{
    for (int i = 0; i < 2000; i++) {
        pthread_mutex_lock(&f->lock);
        bool idle = moed_list_empty(&f->to_server) || f->aborted;
        pthread_mutex_unlock(&f->lock);
        if (idle) return;
        usleep(100);
    }
}

/* Drops the replies, checking each one's size against the calls sent. */
static void drain_replies(fake_link *f, const uint64_t *want, int *n_want)
{
    size_t n;
    void *r;
    while ((r = fake_get(f, &n, 0))) {
        if (*n_want && n != want[0]) abort();
        if (*n_want) memmove((void *)want, want + 1, (size_t)-- * n_want * sizeof *want);
        free(r);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static bool ready;
    if (!ready) {
        setup();
        ready = true;
    }
    if (!size) return 0;
    moed_error err;
    moed_link_info info;
    moed_region_session *s = moed_regions_open_session(regions, 7);
    if (moed_links_open(lk, s, 8, 4, 0, &info, &err)) abort();
    fake_link *f = fake_links[fake_n_links - 1];
    fake_n_links = 0; /* one link at a time: the table never fills */
    fake_join(f);
    if (data[0] & 1) info.key[0] ^= 1;
    fake_put(f, info.key, sizeof info.key);
    settle(f);
    if (!(data[0] & 1)) { /* the right key: the hello (a reply of seq 0) comes first */
        size_t n;
        void *hello = fake_get(f, &n, 1000);
        if (!hello || n != sizeof(moed_link_reply) || !moed_link_reply_matches(hello, 0)) abort();
        free(hello);
    }
    moed_link_call h;
    memset(&h, 0, sizeof h);
    uint64_t seq = 0, want[64];
    int n_want = 0;
    for (size_t at = 1; at + 3 <= size;) {
        const uint8_t kind = data[at];
        size_t len = (size_t)data[at + 1] | (size_t)data[at + 2] << 8;
        at += 3;
        if (len > size - at) len = size - at;
        const uint8_t *b = data + at;
        at += len;
        if (kind % 3 == 0) {
            uint8_t p[4] = { 0 };
            memcpy(p, b, len < 4 ? len : 4);
            const uint32_t dtypes[3] = { MOED_F32, MOED_F16, MOED_BF16 };
            seq++;
            if (moed_link_call_init(&h, seq, p[0] % 2, dtypes[p[1] % 3], 1 + p[2] % 8, 1 + p[3] % 4,
                                    16, 0, seq, &err))
                abort();
            for (size_t i = 4; i < len && i - 4 < sizeof h; i++) ((uint8_t *)&h)[i - 4] ^= b[i];
            if (n_want < 64)
                want[n_want++] =
                    moed_link_reply_bytes(h.tokens, h.d_model, moed_dtype_size((int)h.dtype));
            fake_put(f, &h, sizeof h);
        } else if (kind % 3 == 1) {
            fake_put(f, b, len);
        } else {
            const size_t n = h.payload_bytes < 65536 ? (size_t)h.payload_bytes : 65536;
            uint8_t *p = malloc(n ? n : 1);
            for (size_t i = 0; i < n; i++) p[i] = len ? b[i % len] : 0;
            fake_put(f, p, n);
            free(p);
        }
        settle(f);
        drain_replies(f, want, &n_want);
    }
    moed_links_close_session(lk, s);
    moed_links_wait_closes(lk); /* the next input's link never meets this one's close */
    moed_regions_close_session(regions, s);
    return 0;
}
