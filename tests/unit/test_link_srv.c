/*
 * test_link_srv — server/link.c end to end over a CPU backend with faked links (fake_link.h): the
 * test plays the caller over the fake communicator. A good call's output is the bits of the CPU
 * backend's Forward of the same inputs; a wrong key ends the link; a header that breaks the layout
 * ends it and the log says why; refused calls (a layer not served, ids out of range) are answered
 * with their status and message and the next call works (a call expecting another daemon too); T
 * over the link's max_tokens breaks the layout's check (moed_link_check_call), so it ends the link;
 * after the drain calls are answered UNAVAILABLE; closing during a call returns at once, and so do
 * close_link and a session's end whose abort takes long (the close runs on its own thread); the
 * principal cap; the link's buffer is a region its client cannot unregister; the plain cpu backend
 * answers UNIMPLEMENTED.
 */
#include "check.h"
#include "cpu_backend.h"
#include "fake_link.h"
#include "link.h"
#include "log.h"
#include "moed_dtype.h"
#include "moed_synth.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define D     16
#define K     2
#define WAIT  5000 /* ms for anything the test waits for */
#define PRINC 7

static moed_layer layer;
static const moed_layer *layers[1] = { &layer };
static moed_backend *be;
static moed_regions *regions;
static moed_sched *sched;
static moed_served served;
static moed_links *lk;
static char log_path[64];

static void setup(void)
{
    moed_error err = { 0 };
    moed_synth_spec spec;
    CHECK_EQ_INT(moed_synth_parse("layers=1,d=16,ff=32,experts=4,topk=2,seed=3", &spec, &err), 0);
    CHECK_EQ_INT(moed_synth_layer(&spec, 0, &layer, &err), 0);
    moed_backend_config bc = { .threads = 1, .max_tokens = 64 };
    CHECK_EQ_INT(moed_backend_cpu_open(&bc, &be, &err), 0);
    fake_link_backend(be, layers);
    CHECK_EQ_INT(moed_backend_load_layer(be, 0, &layer, &err), 0);
    CHECK_EQ_INT(moed_backend_start(be, &err), 0);
    moed_regions_config rc = { .backend = be,
                               .mode = MOED_REGIONS_LOCAL,
                               .max_regions = 64,
                               .max_bytes = 1 << 30,
                               .max_total_bytes = 1 << 30 };
    CHECK_EQ_INT(moed_regions_create(&rc, &regions, &err), 0);
    served = (moed_served){ .layers = layers,
                            .n_layers = 1,
                            .max_batch_tokens = 64,
                            .max_message_bytes = 1 << 26,
                            .regions = regions,
                            .fingerprint = 0x5eedu };
    moed_sched_config sc = { .backend = be,
                             .layers = layers,
                             .n_layers = 1,
                             .max_batch_tokens = 64,
                             .max_queue_requests = 64 };
    CHECK_EQ_INT(moed_sched_create(&sc, &sched, &err), 0);
    moed_links_config lc = { .served = &served,
                             .backend = be,
                             .sched = sched,
                             .max_links = 3,
                             .join_ms = WAIT,
                             .payload_ms = WAIT };
    CHECK_EQ_INT(moed_links_create(&lc, &lk, &err), 0);
}

/* A link of session s, joined with its key; its fake in *f. */
static uint64_t open_joined(moed_region_session *s, uint32_t max_tokens, fake_link **f)
{
    moed_link_info info;
    moed_error err = { 0 };
    int rc = moed_links_open(lk, s, max_tokens, K, 0, &info, &err);
    CHECK_MSG(rc == 0, "open_link: %s", err.msg);
    if (rc) return 0;
    *f = fake_links[fake_n_links - 1];
    CHECK_EQ_INT(info.device, 0);
    CHECK(info.max_payload_bytes >= (uint64_t)max_tokens * D * 4);
    fake_join(*f);
    fake_put(*f, info.key, sizeof info.key);
    size_t n = 0; /* the hello: a reply of seq 0, status 0, before any call */
    moed_link_reply *hello = fake_get(*f, &n, 2000);
    CHECK(hello && n == sizeof *hello && moed_link_reply_matches(hello, 0) && hello->status == 0);
    free(hello);
    return info.id;
}

typedef struct call {
    moed_link_call h;
    unsigned char *payload;
    moed_link_payload at;
} call;

/* A call of T tokens of float32 rows, every token choosing experts t % 4 and (t + 1) % 4, with
 * `bad_id` (>= 0) as token 0's first choice instead. */
static call make_call(uint64_t seq, uint32_t layer_no, uint32_t T, int bad_id)
{
    call c;
    moed_error err = { 0 };
    CHECK_EQ_INT(moed_link_call_init(&c.h, seq, layer_no, MOED_F32, T, K, D, 0, seq, &err), 0);
    CHECK_EQ_INT(moed_link_layout(T, K, D, 4, &c.at, &err), 0);
    c.payload = calloc(1, c.at.total);
    float *x = (float *)(c.payload + c.at.hidden);
    int32_t *ids = (int32_t *)(c.payload + c.at.ids);
    float *w = (float *)(c.payload + c.at.weights);
    for (uint32_t i = 0; i < T * D; i++) x[i] = (float)((int)(i * 37 % 23) - 11) / 8.0f;
    for (uint32_t t = 0; t < T; t++) {
        ids[t * K] = (int32_t)(t % 4);
        ids[t * K + 1] = (int32_t)((t + 1) % 4);
        w[t * K] = 0.75f;
        w[t * K + 1] = 0.25f;
    }
    if (bad_id >= 0) ids[0] = bad_id;
    return c;
}

/* The CPU backend's Forward of the call's inputs. */
static float *reference(const call *c)
{
    const uint32_t T = c->h.tokens;
    float *y = calloc(T * D, sizeof *y);
    moed_route rt;
    moed_error err = { 0 };
    CHECK_EQ_INT(moed_route_from_choice(&rt, (const int32_t *)(c->payload + c->at.ids),
                                        (const float *)(c->payload + c->at.weights), T, K, 4, &err),
                 0);
    moed_job job = {
        .slot = 0, .dtype = MOED_F32, .T = T, .x = c->payload + c->at.hidden, .y = y, .route = &rt
    };
    CHECK_EQ_INT(moed_backend_forward(be, 0, &job, &err), 0);
    moed_route_free(&rt);
    return y;
}

/* Sends the call and returns its reply (malloc'd), checked for its seq and size. */
static moed_link_reply *send_call(fake_link *f, const call *c)
{
    fake_put(f, &c->h, sizeof c->h);
    fake_put(f, c->payload, c->at.total);
    size_t n = 0;
    moed_link_reply *r = fake_get(f, &n, WAIT);
    CHECK_MSG(r != NULL, "no reply to call %llu", (unsigned long long)c->h.seq);
    if (!r) return NULL;
    CHECK_EQ_INT(n, moed_link_reply_bytes(c->h.tokens, D, 4));
    CHECK(moed_link_reply_matches(r, c->h.seq));
    return r;
}

static void expect_ok(fake_link *f, uint64_t seq, uint32_t T)
{
    call c = make_call(seq, 0, T, -1);
    moed_link_reply *r = send_call(f, &c);
    if (r) {
        CHECK_MSG(r->status == 0, "call %llu: status %d: %s", (unsigned long long)seq, r->status,
                  r->message);
        float *want = reference(&c);
        CHECK(!memcmp((char *)r + MOED_LINK_HEADER_BYTES, want, (size_t)T * D * 4));
        CHECK(r->batch_tokens >= T);
        free(want);
    }
    free(r);
    free(c.payload);
}

static void expect_refused(fake_link *f, const call *c, int status, const char *needle)
{
    moed_link_reply *r = send_call(f, c);
    if (r) {
        CHECK_MSG(r->status == status, "status %d, not %d: %s", r->status, status, r->message);
        CHECK_MSG(strstr(r->message, needle) != NULL, "'%s' lacks '%s'", r->message, needle);
    }
    free(r);
}

/* Lines of the log with a and b. */
static int log_count(const char *a, const char *b)
{
    FILE *fp = fopen(log_path, "r");
    char line[2048];
    int n = 0;
    while (fp && fgets(line, sizeof line, fp)) n += strstr(line, a) && strstr(line, b);
    if (fp) fclose(fp);
    return n;
}

static bool log_has(const char *a, const char *b)
{
    return log_count(a, b) > 0;
}

/* Whether the log holds more than `before` lines with a and b within WAIT ms: a close runs on a
 * thread of its own. */
static bool log_grows(const char *a, const char *b, int before)
{
    for (const uint64_t t0 = fake_now_ms(); fake_now_ms() - t0 < WAIT; usleep(1000))
        if (log_count(a, b) > before) return true;
    return false;
}

/* The regions the principal holds, once they number `want` (within WAIT ms) or at the end. */
static int regions_held(int want)
{
    int n = -1;
    for (const uint64_t t0 = fake_now_ms(); fake_now_ms() - t0 < WAIT; usleep(1000)) {
        moed_region_info *list = NULL;
        moed_error err;
        if (moed_regions_list(regions, PRINC, &list, &n, &err)) return -1;
        free(list);
        if (n == want) break;
    }
    return n;
}

static void test_calls(void)
{
    moed_region_session *s = moed_regions_open_session(regions, PRINC);
    fake_link *f = NULL;
    moed_error err = { 0 };
    uint64_t id = open_joined(s, 8, &f);
    if (!id) return;
    expect_ok(f, 1, 1);
    expect_ok(f, 2, 8);
    call bad = make_call(3, 9, 2, -1); /* layer 9 is not served */
    expect_refused(f, &bad, 5, "layer 9");
    free(bad.payload);
    bad = make_call(4, 0, 2, 11); /* expert 11 of 4 */
    expect_refused(f, &bad, 3, "expert_ids");
    free(bad.payload);
    expect_ok(f, 5, 3);
    /* A call stating what it expects of the daemon (as a fleet's do): another expert set or
     * another model is refused, naming both, and the link goes on; the right one is answered. */
    uint32_t lo = 0, hi = 1; /* experts 0-1: the daemon holds 0-3 */
    call other = make_call(6, 0, 2, -1);
    moed_link_call_expect(&other.h, 0x5eedu, &lo, &hi, 1, false);
    expect_refused(f, &other, 9, "experts 0-1");
    free(other.payload);
    hi = 3;
    other = make_call(7, 0, 2, -1);
    moed_link_call_expect(&other.h, 0xbadu, &lo, &hi, 1, false);
    expect_refused(f, &other, 9, "model 0000000000000bad");
    free(other.payload);
    other = make_call(8, 0, 2, -1);
    moed_link_call_expect(&other.h, 0x5eedu, &lo, &hi, 1, false);
    moed_link_reply *r = send_call(f, &other);
    CHECK_MSG(r && r->status == 0, "the expected daemon refused: %s", r ? r->message : "");
    free(r);
    free(other.payload);
    /* The buffer is a region of the session, which its client cannot unregister. */
    moed_region_info *list = NULL;
    int n = 0;
    CHECK_EQ_INT(moed_regions_list(regions, PRINC, &list, &n, &err), 0);
    CHECK_EQ_INT(n, 1);
    moed_region_info gone;
    if (n == 1) {
        CHECK_EQ_INT(moed_regions_unregister(regions, s, list[0].id, &gone, &err), MOED_EPRECOND);
        CHECK(strstr(err.msg, "close_link") != NULL);
    }
    free(list);
    /* T over max_tokens: the header's check fails, and the link ends, saying why. */
    call big = make_call(9, 0, 9, -1);
    fake_put(f, &big.h, sizeof big.h);
    CHECK(fake_aborted(f, WAIT));
    free(big.payload);
    CHECK(log_has("link ended", "tokens"));
    moed_link_info info;
    CHECK_EQ_INT(moed_links_close(lk, s, id, &info, &err), 0);
    CHECK_EQ_INT(moed_links_close(lk, s, id, &info, &err), MOED_ENOTFOUND);
    CHECK_EQ_INT(moed_links_count(lk), 0);
    CHECK_EQ_INT(regions_held(0), 0); /* disowned and freed by the close's thread */

    /* A header that breaks the layout (its magic) ends the link; the log says why. */
    id = open_joined(s, 4, &f);
    expect_ok(f, 1, 2);
    call broken = make_call(2, 0, 1, -1);
    broken.h.magic ^= 1;
    fake_put(f, &broken.h, sizeof broken.h);
    CHECK(fake_aborted(f, WAIT));
    CHECK(log_has("link ended", "magic"));
    free(broken.payload);
    CHECK_EQ_INT(moed_links_close(lk, s, id, &info, &err), 0);

    /* A call out of order (seq 3 where 2 is due) likewise. */
    id = open_joined(s, 4, &f);
    expect_ok(f, 1, 2);
    call skip = make_call(3, 0, 1, -1);
    fake_put(f, &skip.h, sizeof skip.h);
    CHECK(fake_aborted(f, WAIT));
    free(skip.payload);
    moed_links_close_session(lk, s); /* the links first, as region_rpc.c does */
    CHECK_EQ_INT(moed_links_count(lk), 0);
    moed_regions_close_session(regions, s);
    (void)id;
}

static void test_key_and_join(void)
{
    moed_region_session *s = moed_regions_open_session(regions, PRINC);
    moed_link_info info;
    moed_error err = { 0 };
    CHECK_EQ_INT(moed_links_open(lk, s, 4, K, 0, &info, &err), 0);
    fake_link *f = fake_links[fake_n_links - 1];
    fake_join(f);
    uint8_t wrong[MOED_LINK_KEY_BYTES];
    memcpy(wrong, info.key, sizeof wrong);
    wrong[31] ^= 1;
    fake_put(f, wrong, sizeof wrong);
    CHECK(fake_aborted(f, WAIT));
    CHECK(log_has("link ended", "not the link's key"));
    /* Nothing after the wrong key was read. */
    call c = make_call(1, 0, 1, -1);
    fake_put(f, &c.h, sizeof c.h);
    size_t n;
    CHECK(fake_get(f, &n, 50) == NULL);
    free(c.payload);
    moed_links_close_session(lk, s);
    CHECK_EQ_INT(moed_links_count(lk), 0);
    moed_regions_close_session(regions, s);
}

static void test_close_mid_call(void)
{
    moed_region_session *s = moed_regions_open_session(regions, PRINC);
    fake_link *f = NULL;
    moed_error err = { 0 };
    uint64_t id = open_joined(s, 4, &f);
    expect_ok(f, 1, 1);
    call c = make_call(2, 0, 4, -1);
    fake_put(f, &c.h, sizeof c.h); /* and no payload: the link waits for it */
    usleep(20000);
    const uint64_t t0 = fake_now_ms();
    const int closed = log_count("link closed", "close_link");
    moed_link_info info;
    CHECK_EQ_INT(moed_links_close(lk, s, id, &info, &err), 0);
    CHECK_MSG(fake_now_ms() - t0 < 1000, "close_link took %llu ms",
              (unsigned long long)(fake_now_ms() - t0));
    CHECK(log_grows("link closed", "close_link", closed));
    free(c.payload);
    moed_regions_close_session(regions, s);
}

/* A close whose abort takes long (NCCL's, a receive pending on a peer that died) holds neither
 * the session's end nor close_link, which run on the completion-queue threads: the link is off
 * the registry at once, another session's link opens and answers meanwhile, and the close ends
 * later on its own thread. */
static void test_slow_abort(void)
{
    moed_region_session *s = moed_regions_open_session(regions, PRINC);
    fake_link *f = NULL;
    moed_error err = { 0 };
    open_joined(s, 4, &f);
    expect_ok(f, 1, 2);
    const uint64_t id = open_joined(s, 4, &f);
    expect_ok(f, 1, 1);
    const int ended = log_count("link closed", "the session ended"),
              commanded = log_count("link closed", "close_link");
    atomic_store(&fake_abort_ms, 3000);
    uint64_t t0 = fake_now_ms();
    moed_link_info info;
    CHECK_EQ_INT(moed_links_close(lk, s, id, &info, &err), 0);
    moed_links_close_session(lk, s);
    CHECK_MSG(fake_now_ms() - t0 < 1500, "close_link and the session's end took %llu ms",
              (unsigned long long)(fake_now_ms() - t0));
    CHECK_EQ_INT(moed_links_count(lk), 0);
    moed_regions_close_session(regions, s);
    moed_region_session *s2 = moed_regions_open_session(regions, PRINC);
    fake_link *f2 = NULL;
    open_joined(s2, 4, &f2);
    expect_ok(f2, 1, 3);
    /* the closes are still in their aborts: the new link did not wait for them */
    CHECK_MSG(log_count("link closed", "the session ended") == ended &&
                  log_count("link closed", "close_link") == commanded,
              "a close ended before the new link answered (%llu ms)",
              (unsigned long long)(fake_now_ms() - t0));
    CHECK(log_grows("link closed", "the session ended", ended));
    CHECK(log_grows("link closed", "close_link", commanded));
    atomic_store(&fake_abort_ms, 0);
    moed_links_close_session(lk, s2);
    moed_regions_close_session(regions, s2);
    CHECK_EQ_INT(regions_held(0), 0);
}

static void test_caps_and_refusals(void)
{
    moed_region_session *s = moed_regions_open_session(regions, PRINC);
    moed_region_session *other = moed_regions_open_session(regions, PRINC + 1);
    moed_link_info info;
    moed_error err = { 0 };
    for (int i = 0; i < 3; i++) CHECK_EQ_INT(moed_links_open(lk, s, 4, K, 0, &info, &err), 0);
    CHECK_EQ_INT(moed_links_open(lk, s, 4, K, 0, &info, &err), MOED_ETOOBIG);
    CHECK(strstr(err.msg, "--max-links") != NULL);
    CHECK_EQ_INT(moed_links_open(lk, other, 4, K, 0, &info, &err), 0); /* another principal's */
    CHECK_EQ_INT(moed_links_close(lk, s, info.id, &info, &err), MOED_ENOTFOUND);
    moed_links_close_session(lk, s);
    moed_links_close_session(lk, other);
    CHECK_EQ_INT(moed_links_count(lk), 0);
    CHECK_EQ_INT(moed_links_open(lk, s, 0, K, 0, &info, &err), MOED_EINVAL);
    CHECK(strstr(err.msg, "open_link.max_tokens") != NULL);
    CHECK_EQ_INT(moed_links_open(lk, s, 65, K, 0, &info, &err), MOED_EINVAL);
    CHECK_EQ_INT(moed_links_open(lk, s, 4, 65, 0, &info, &err), MOED_EINVAL);
    CHECK(strstr(err.msg, "open_link.max_top_k") != NULL);
    CHECK_EQ_INT(moed_links_open(lk, s, 4, K, 3, &info, &err), MOED_EINVAL);
    CHECK(strstr(err.msg, "open_link.device_plus_one") != NULL);
    CHECK_EQ_INT(moed_links_open(lk, s, 4, K, 1, &info, &err), 0); /* GPU 0, named */
    moed_links_close_session(lk, s);
    moed_regions_close_session(regions, s);
    moed_regions_close_session(regions, other);

    /* The cpu backend has no links. */
    moed_backend *cpu;
    moed_backend_config bc = { .threads = 1, .max_tokens = 8 };
    CHECK_EQ_INT(moed_backend_cpu_open(&bc, &cpu, &err), 0);
    moed_links *plain;
    moed_links_config lc = { .served = &served, .backend = cpu, .sched = sched, .max_links = 1 };
    CHECK_EQ_INT(moed_links_create(&lc, &plain, &err), 0);
    s = moed_regions_open_session(regions, PRINC);
    CHECK_EQ_INT(moed_links_open(plain, s, 4, K, 0, &info, &err), MOED_EUNSUPPORTED);
    CHECK(strstr(err.msg, "start moed with the cuda backend") != NULL);
    moed_links_destroy(plain);
    moed_regions_close_session(regions, s);
    moed_backend_destroy(cpu);
}

/* Last: the drain answers every call UNAVAILABLE and opens no link; destroy closes the rest. */
static void test_drain(void)
{
    moed_region_session *s = moed_regions_open_session(regions, PRINC);
    fake_link *f = NULL;
    moed_error err = { 0 };
    open_joined(s, 4, &f);
    expect_ok(f, 1, 2);
    moed_links_drain(lk);
    call c = make_call(2, 0, 2, -1);
    expect_refused(f, &c, 14, "draining");
    free(c.payload);
    moed_link_info info;
    CHECK_EQ_INT(moed_links_open(lk, s, 4, K, 0, &info, &err), MOED_EDRAINING);
    moed_links_close_session(lk, s); /* draining: the link stays, answering UNAVAILABLE */
    CHECK_EQ_INT(moed_links_count(lk), 1);
    c = make_call(3, 0, 1, -1);
    expect_refused(f, &c, 14, "draining");
    free(c.payload);
    moed_regions_close_session(regions, s);
}

int main(void)
{
    snprintf(log_path, sizeof log_path, "/tmp/test_link_srv.%d.log", (int)getpid());
    CHECK_EQ_INT(moed_log_init(MOED_LOG_INFO, log_path), 0);
    setup();
    test_calls();
    test_key_and_join();
    test_close_mid_call();
    test_slow_abort();
    test_caps_and_refusals();
    test_drain();
    moed_sched_drain(sched);
    moed_links_destroy(lk);
    CHECK(log_has("link closed", "the server exits"));
    moed_sched_destroy(sched);
    moed_regions_destroy(regions);
    moed_backend_destroy(be);
    moed_log_close();
    unlink(log_path);
    return check_status("test_link_srv");
}
