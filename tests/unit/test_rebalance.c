/*
 * test_rebalance — re-placing split layers by measured load (server/rebalance.h), over a fake
 * backend that records each moed_backend_replace_layer request and answers as told.
 *
 * The request of a pass is the deltas of the metrics' counters since the layer's last placement,
 * in the backend's numbering (an expert shard's local ids), with the layer's launches over the
 * same period and the configured replicas and gain; a layer under its minimum of pairs, or not
 * split, is not asked about; the baseline moves only when the placement changed (unchanged and
 * failed ones keep accumulating); the generation and the metrics count each result. The
 * --expert-load application goes through the same call. The thread makes its passes on its own,
 * stops without starting another, and destroy waits for a slow re-placement in progress; with no
 * split layer it does not start.
 */
#include "check.h"
#include "metrics.h"
#include "moed_backend_impl.h" /* the fake is a backend: it fills the table the wrappers call */
#include "moed_synth.h"
#include "moed_time.h"
#include "rebalance.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define SPEC  "layers=1,d=16,ff=16,experts=8,topk=2,seed=3"
#define SLOTS 3 /* 0: an expert shard of 1,2,3,6, split; 1: whole, split; 2: whole, not split */

static struct {
    _Atomic int calls;
    int slot;
    double pairs[8], launches, min_gain;
    int max_replicas;
    int answer;   /* 0, or the error to fail with */
    bool change;  /* answer changed */
    int delay_ms; /* a slow re-placement */
    bool whole;   /* every layer whole (as on the cpu backend) */
    int gen[SLOTS];
} fake;

static int fake_place(moed_backend *b, int slot, moed_layer_place *out)
{
    (void)b;
    const bool whole = slot == 2 || fake.whole;
    *out = (moed_layer_place){ .home = 0, .n_parts = whole ? 1 : 2 };
    const int n = slot == 0 ? 4 : 8, cut = fake.gen[slot] ? 1 : n / 2;
    out->part[0] = (moed_place_part){ 0, 0, whole ? n : cut };
    out->part[1] = (moed_place_part){ 1, cut, n - cut };
    if (fake.gen[slot]) out->replica[out->n_replicas++] = (moed_place_replica){ n - 1, 0 };
    return 0;
}

static int fake_replace(moed_backend *b, int slot, const moed_replace_req *req,
                        moed_replace_result *res, moed_error *err)
{
    (void)b;
    if (fake.delay_ms) {
        struct timespec ts = { 0, (long)fake.delay_ms * 1000000L };
        nanosleep(&ts, NULL);
    }
    fake.slot = slot;
    for (int e = 0; e < (slot == 0 ? 4 : 8); e++) fake.pairs[e] = req->pairs[e];
    fake.launches = req->launches;
    fake.max_replicas = req->max_replicas;
    fake.min_gain = req->min_gain;
    atomic_fetch_add(&fake.calls, 1);
    if (fake.answer) return moed_fail(err, fake.answer, "fake: no room beside the old parts");
    res->changed = fake.change;
    res->before = 10;
    res->after = fake.change ? 7 : 10;
    fake.gen[slot] += fake.change;
    return 0;
}

static const moed_backend_ops fake_ops = { .name = "fake",
                                           .layer_place = fake_place,
                                           .replace_layer = fake_replace };
static moed_backend be = { .ops = &fake_ops, .n_devices = 2 };

static moed_layer full;
static moed_shard shards[SLOTS];
static moed_metrics *m;

static void setup(void)
{
    moed_synth_spec spec;
    moed_error err = { 0 };
    CHECK_EQ_INT(moed_synth_parse(SPEC, &spec, &err), 0);
    CHECK_EQ_INT(moed_synth_layer(&spec, 0, &full, &err), 0);
    full.info.index = 3;
    static const int ids[] = { 1, 2, 3, 6 };
    moed_expert_subset held = moed_shard_subset(ids, 4, "auto");
    CHECK_EQ_INT(moed_shard_make(&full, &held, &shards[0], &err), 0);
    CHECK_EQ_INT(moed_shard_make(&full, NULL, &shards[1], &err), 0);
    CHECK_EQ_INT(moed_shard_make(&full, NULL, &shards[2], &err), 0);
    m = moed_metrics_create();
    CHECK_EQ_INT(moed_metrics_set_layers(m, shards, SLOTS), 0);
}

static moed_rebalance *make(int period_s, int64_t min_pairs)
{
    moed_rebalance_config c = { .backend = &be,
                                .shards = shards,
                                .n_slots = SLOTS,
                                .metrics = m,
                                .period_s = period_s,
                                .max_replicas = 5,
                                .min_gain = 0.25,
                                .min_pairs = min_pairs };
    moed_rebalance *r;
    moed_error err = { 0 };
    CHECK_EQ_INT(moed_rebalance_create(&c, &r, &err), 0);
    return r;
}

static void count(int slot, uint64_t a, uint64_t b, uint64_t c, uint64_t d)
{
    const uint64_t v[8] = { a, b, c, d, 0, 0, 0, 0 };
    moed_metrics_expert_tokens(m, slot, v, slot == 0 ? 4 : 8);
}

static bool pairs_are(double a, double b, double c, double d)
{
    return fake.pairs[0] == a && fake.pairs[1] == b && fake.pairs[2] == c && fake.pairs[3] == d;
}

static void test_delta(void)
{
    const uint64_t now[3] = { 10, 5, 7 }, base[3] = { 4, 5, 9 };
    double pairs[3], launches;
    CHECK(moed_rebalance_delta(now, base, 3, 9, 2, 6, pairs, &launches));
    CHECK(pairs[0] == 6 && pairs[1] == 0 && pairs[2] == 0 && launches == 7); /* never negative */
    CHECK(!moed_rebalance_delta(now, base, 3, 9, 2, 7, pairs, &launches));
    CHECK(!moed_rebalance_delta(now, now, 3, 9, 9, 0, pairs, &launches)); /* nothing measured */
}

static void test_passes(void)
{
    moed_rebalance *r = make(0, 50);
    count(0, 10, 0, 5, 20); /* counted before the baseline was taken: not weighed */
    moed_rebalance_destroy(r);
    r = make(0, 50);
    count(0, 10, 0, 5, 20);
    count(0, 10, 0, 5, 20);
    count(1, 10, 10, 10, 0); /* 30 pairs: under the minimum */
    count(2, 100, 0, 0, 0);  /* not split: never asked */
    fake.change = false;
    CHECK_EQ_INT(moed_rebalance_pass(r), 0);
    CHECK_EQ_INT(fake.calls, 1);
    CHECK(fake.slot == 0 && pairs_are(20, 0, 10, 40) && fake.launches == 2);
    CHECK(fake.max_replicas == 5 && fake.min_gain == 0.25);
    CHECK_EQ_INT(moed_rebalance_generation(r, 0), 0);
    /* unchanged: the baseline stays, the next pass weighs the longer period */
    count(0, 1, 1, 1, 1);
    fake.change = true;
    CHECK_EQ_INT(moed_rebalance_pass(r), 1);
    CHECK(fake.slot == 0 && pairs_are(21, 1, 11, 41) && fake.launches == 3);
    CHECK_EQ_INT(moed_rebalance_generation(r, 0), 1);
    /* changed: the baseline moved, nothing new is nothing to weigh */
    const int calls = fake.calls;
    CHECK_EQ_INT(moed_rebalance_pass(r), 0);
    CHECK_EQ_INT(fake.calls, calls);
    count(0, 0, 0, 0, 60);
    fake.answer = MOED_ENOMEM; /* failed: logged, the baseline stays */
    CHECK_EQ_INT(moed_rebalance_pass(r), 0);
    CHECK(pairs_are(0, 0, 0, 60) && fake.launches == 1);
    fake.answer = 0;
    count(1, 10, 10, 0, 0); /* slot 1 now has 50 */
    count(0, 0, 0, 0, 1);
    CHECK_EQ_INT(moed_rebalance_pass(r), 2);
    CHECK(fake.slot == 1 && fake.pairs[0] == 20 && fake.pairs[1] == 20 && fake.pairs[2] == 10);
    CHECK_EQ_INT(moed_rebalance_generation(r, 0), 2);
    CHECK_EQ_INT(moed_rebalance_generation(r, 1), 1);
    CHECK_EQ_INT(moed_rebalance_generation(r, 2), 0);
    CHECK_EQ_INT(moed_rebalance_generation(NULL, 0), 0);
    moed_metrics_gauges g = { .version = "1", .backend = "fake" };
    size_t len;
    char *text = moed_metrics_render(m, &g, &len);
    CHECK(text && strstr(text, "moed_rebalances_total{layer=\"3\",result=\"changed\"} 2\n"));
    CHECK(text && strstr(text, "moed_rebalances_total{layer=\"3\",result=\"unchanged\"} 1\n"));
    CHECK(text && strstr(text, "moed_rebalances_total{layer=\"3\",result=\"failed\"} 1\n"));
    CHECK(text && strstr(text, "moed_layer_placement_generation{layer=\"3\"} 2\n"));
    CHECK(text && strstr(text, "# TYPE moed_layer_launches_total counter\n"));
    free(text);
    moed_rebalance_destroy(r);
}

/* 0: 32 pairs per held expert, 128 for the shard of 4 experts. */
static void test_default_minimum(void)
{
    moed_rebalance *r = make(0, 0);
    const int calls = fake.calls;
    count(0, 127, 0, 0, 0);
    CHECK_EQ_INT(moed_rebalance_pass(r), 0);
    CHECK_EQ_INT(fake.calls, calls);
    count(0, 0, 1, 0, 0);
    moed_rebalance_pass(r);
    CHECK_EQ_INT(fake.calls, calls + 1);
    CHECK(pairs_are(127, 1, 0, 0));
    moed_rebalance_destroy(r);
}

static void test_apply(void)
{
    moed_rebalance *r = make(0, 1);
    moed_error err = { 0 };
    bool changed;
    const double load[4] = { 1, 2, 3, 4 };
    count(0, 5, 5, 5, 5);
    fake.change = true;
    CHECK_EQ_INT(moed_rebalance_apply(r, 0, load, 7, &changed, &err), 0);
    CHECK(changed && pairs_are(1, 2, 3, 4) && fake.launches == 7);
    CHECK_EQ_INT(moed_rebalance_generation(r, 0), 1);
    const int calls = fake.calls; /* the baseline moved to the counters at the change */
    CHECK_EQ_INT(moed_rebalance_pass(r), 0);
    CHECK_EQ_INT(fake.calls, calls);
    fake.answer = MOED_ENOMEM;
    CHECK_EQ_INT(moed_rebalance_apply(r, 0, load, 7, &changed, &err), MOED_ENOMEM);
    CHECK(!changed && strstr(err.msg, "no room"));
    fake.answer = 0;
    moed_rebalance_destroy(r);
}

static void test_thread(void)
{
    moed_error err = { 0 };
    fake.change = true;
    fake.delay_ms = 600;
    moed_rebalance *r = make(1, 1);
    CHECK_EQ_INT(moed_rebalance_start(r, &err), 0);
    const int calls = fake.calls;
    count(0, 3, 0, 0, 0);
    const double t0 = moed_now_s();
    while (fake.calls == calls && moed_now_s() - t0 < 5) {
        struct timespec ts = { 0, 1000000 };
        nanosleep(&ts, NULL);
    }
    CHECK_MSG(fake.calls == calls + 1, "no pass within 5 s of a 1 s period");
    /* a second one is in progress (slot 1 after slot 0) or about to be: destroy waits at most for
     * it and starts no other */
    count(1, 3, 0, 0, 0);
    count(0, 3, 0, 0, 0);
    struct timespec ts = { 1, 200000000 };
    nanosleep(&ts, NULL);
    const double t1 = moed_now_s();
    moed_rebalance_destroy(r);
    CHECK_MSG(moed_now_s() - t1 < 1.0, "destroy took %.2f s", moed_now_s() - t1);
    const int after = fake.calls;
    nanosleep(&ts, NULL);
    CHECK_EQ_INT(fake.calls, after);
    fake.delay_ms = 0;

    /* stopped before its first pass: none is made */
    r = make(1, 1);
    CHECK_EQ_INT(moed_rebalance_start(r, &err), 0);
    moed_rebalance_stop(r);
    count(0, 3, 0, 0, 0);
    nanosleep(&ts, NULL);
    CHECK_EQ_INT(fake.calls, after);
    moed_rebalance_destroy(r);
}

/* No split layer: start logs why and starts nothing. */
static void test_nothing_split(void)
{
    moed_error err = { 0 };
    fake.whole = true;
    moed_rebalance *r = make(1, 1);
    CHECK_EQ_INT(moed_rebalance_start(r, &err), 0);
    const int calls = fake.calls;
    count(0, 3, 0, 0, 0);
    CHECK_EQ_INT(moed_rebalance_pass(r), 0);
    CHECK_EQ_INT(fake.calls, calls);
    moed_rebalance_destroy(r);
    fake.whole = false;
}

int main(void)
{
    setup();
    test_delta();
    test_passes();
    test_default_minimum();
    test_apply();
    test_thread();
    test_nothing_split();
    moed_metrics_destroy(m);
    for (int i = 0; i < SLOTS; i++) moed_shard_free(&shards[i]);
    moed_synth_free_layer(&full);
    return check_status("test_rebalance");
}
