/*
 * test_backend_route — parts that bring their routing in device memory (moed_part_route), as the
 * backend interface takes them, without a GPU: the CPU backend refuses them (it has no device
 * memory: its callers give host routes); a backend with devices (a fake whose "device memory" is
 * host memory, read_device a copy) gets from moed_backend_forward only well-formed ones (k >= 1,
 * both tensors, no pair of theirs in the job's route); and moed_backend_host_route reads them to
 * the host and builds the job's route exactly as moed_route_from_choice would from every choice,
 * a refused choice failing its own part alone (status and message as forward words them) and
 * leaving its tokens with no pair, and a failed read failing the call.
 */
#include "check.h"
#include "cpu_backend.h"
#include "moed_backend_impl.h" /* the fake is a backend: it fills the table the wrappers call */
#include "moed_dtype.h"
#include "moed_synth.h"

#include <stdlib.h>
#include <string.h>

static int forwards;
static const moed_job *seen;
static const void *unreadable; /* a "device" pointer whose read fails */

static int fake_forward(moed_backend *b, int exec, const moed_job *job, moed_error *err)
{
    forwards++;
    seen = job;
    return 0;
}

static int fake_read(moed_backend *b, void *dst, const void *src, int dev, size_t bytes,
                     moed_error *err)
{
    if (src == unreadable) return moed_fail(err, MOED_EDEVICE, "the fake device failed a read");
    memcpy(dst, src, bytes);
    return 0;
}

static const moed_backend_ops fake_ops = { .name = "fake",
                                           .forward = fake_forward,
                                           .read_device = fake_read };

/* The CPU backend has no device memory: a part with device routing is refused, and so is reading
 * one to the host. */
static void test_cpu_refuses(void)
{
    moed_synth_spec spec;
    moed_layer layer;
    moed_error err;
    moed_backend *cpu = NULL;
    moed_backend_config cfg = { .threads = 1, .max_tokens = 8 };
    CHECK(moed_synth_parse("layers=1,d=16,ff=32,experts=4,topk=2,seed=1", &spec, &err) == 0);
    CHECK(moed_synth_layer(&spec, 0, &layer, &err) == 0);
    CHECK(moed_backend_cpu_open(&cfg, &cpu, &err) == 0);
    CHECK(moed_backend_load_layer(cpu, 0, &layer, &err) == 0);
    CHECK(moed_backend_start(cpu, &err) == 0);
    float x[4 * 16] = { 0 }, y[4 * 16];
    int32_t ids[4] = { 0, 1, 2, 3 };
    float w[4] = { 1, 1, 1, 1 };
    moed_part_route pr = { .ids = ids, .weights = w, .k = 2, .dev = 0 };
    moed_part parts[2] = {
        { .rows = 2, .x = x, .x_dev = MOED_HOST_MEM, .y = y, .y_dev = MOED_HOST_MEM },
        { .rows = 2,
          .x = x + 32,
          .x_dev = MOED_HOST_MEM,
          .y = y + 32,
          .y_dev = MOED_HOST_MEM,
          .route = &pr }
    };
    moed_route r, out;
    CHECK(moed_route_init(&r, 4, 0) == 0);
    moed_job job = { .dtype = MOED_F32, .T = 4, .parts = parts, .n_parts = 2, .route = &r };
    CHECK_EQ_INT(moed_backend_forward(cpu, 0, &job, &err), MOED_EPRECOND);
    CHECK_MSG(strstr(err.msg, "cpu backend") != NULL, "%s", err.msg);
    CHECK_EQ_INT(moed_backend_host_route(cpu, &job, 4, NULL, &out, &err), MOED_EPRECOND);
    parts[1].route = NULL; /* the same job with a host route runs */
    CHECK_EQ_INT(moed_backend_forward(cpu, 0, &job, &err), 0);
    moed_route_free(&r);
    moed_backend_destroy(cpu);
    moed_synth_free_layer(&layer);
}

/* What moed_backend_forward lets through to a backend with devices. */
static void test_forward_checks(void)
{
    moed_backend fake = { .ops = &fake_ops, .n_exec = 1 };
    moed_error err;
    int32_t ids[6] = { 0, 1, 2, 3, 1, 0 };
    float w[6] = { 1, 1, 1, 1, 1, 1 }, x[5];
    moed_part_route pr = { .ids = ids, .weights = w, .k = 2 };
    moed_part parts[2] = { { .rows = 2, .x = x, .y = x }, { .rows = 3, .x = x, .y = x } };
    moed_route r;
    CHECK(moed_route_from_choice(&r, ids, w, 5, 1, 4, &err) == 0); /* a pair for every token */
    moed_job job = { .T = 5, .parts = parts, .n_parts = 2, .route = &r };
    parts[1].route = &pr;
    forwards = 0;
    CHECK_EQ_INT(moed_backend_forward(&fake, 0, &job, &err), MOED_EINVAL);
    CHECK_MSG(strstr(err.msg, "part 1 brings its routing in device memory, but the job's route "
                              "holds 3 pairs"),
              "%s", err.msg);
    moed_route_free(&r);
    CHECK(moed_route_init(&r, 5, 2) == 0); /* a pair for each token of part 0, none for part 1 */
    r.expert[0] = r.expert[1] = 0;
    r.weight[0] = r.weight[1] = 1;
    r.off[1] = 1;
    r.off[2] = r.off[3] = r.off[4] = r.off[5] = 2;
    pr.k = 0;
    CHECK_EQ_INT(moed_backend_forward(&fake, 0, &job, &err), MOED_EINVAL);
    CHECK_MSG(strstr(err.msg, "part 1's device routing has k = 0") != NULL, "%s", err.msg);
    pr.k = 2;
    pr.weights = NULL;
    CHECK_EQ_INT(moed_backend_forward(&fake, 0, &job, &err), MOED_EINVAL);
    CHECK_MSG(strstr(err.msg, "a NULL tensor") != NULL, "%s", err.msg);
    pr.weights = w;
    r.T = 4;
    CHECK_EQ_INT(moed_backend_forward(&fake, 0, &job, &err), MOED_EINVAL);
    CHECK_MSG(strstr(err.msg, "route has 4 tokens, its T is 5") != NULL, "%s", err.msg);
    r.T = 5;
    CHECK_EQ_INT(forwards, 0);
    CHECK_EQ_INT(moed_backend_forward(&fake, 0, &job, &err), 0);
    CHECK(forwards == 1 && seen->parts[1].route == &pr);
    moed_route_free(&r);
}

/* moed_backend_host_route: parts H2, D3 (padding and a repeated id), D2 (refused: a NaN weight),
 * H1, D1 (all padding) equal moed_route_from_choice over the whole choice, the refused part's rows
 * all padding. */
static void test_host_route(void)
{
    enum { K = 3, T = 9 };
    int32_t ids[T * K] = { 0,
                           1,
                           -1,
                           /**/ 2,
                           3,
                           4,
                           /* part D3: */ 1,
                           1,
                           -1,
                           3,
                           -1,
                           -1,
                           0,
                           2,
                           3,
                           /* part D2: */ 2,
                           3,
                           0,
                           1,
                           2,
                           3,
                           /**/ 4,
                           4,
                           0,
                           /* D1: */ -1,
                           -1,
                           -1 };
    float w[T * K] = { .5f, .5f, 0, 1, 2, 3,   .25f, .75f, 0, 1, 0, 0, 1, 1,
                       1,   1,   1, 1, 1, NAN, 1,    2,    2, 2, 0, 0, 0 };
    moed_error err;
    moed_route hp[2], want, got;
    CHECK(moed_route_from_choice(&hp[0], ids, w, 2, K, 5, &err) == 0);
    CHECK(moed_route_from_choice(&hp[1], ids + 7 * K, w + 7 * K, 1, K, 5, &err) == 0);
    moed_route job_r;
    CHECK(moed_route_init(&job_r, T, 16) == 0);
    moed_route e3, e2, e1;
    moed_route_init(&e3, 3, 0);
    moed_route_init(&e2, 2, 0);
    moed_route_init(&e1, 1, 0);
    CHECK(moed_route_concat(&job_r, (const moed_route *[]){ &hp[0], &e3, &e2, &hp[1], &e1 }, 5) ==
          0);
    moed_part_route pr[3] = { { .ids = ids + 2 * K, .weights = w + 2 * K, .k = K },
                              { .ids = ids + 5 * K, .weights = w + 5 * K, .k = K },
                              { .ids = ids + 8 * K, .weights = w + 8 * K, .k = K } };
    float x[1];
    moed_part parts[5] = { { .rows = 2, .x = x, .y = x },
                           { .rows = 3, .x = x, .y = x, .route = &pr[0] },
                           { .rows = 2, .x = x, .y = x, .route = &pr[1] },
                           { .rows = 1, .x = x, .y = x },
                           { .rows = 1, .x = x, .y = x, .route = &pr[2] } };
    moed_job job = { .T = T, .parts = parts, .n_parts = 5, .route = &job_r };
    for (int i = 0; i < 3; i++) memset(&pr[i].err, 0x5a, sizeof pr[i].err);
    moed_backend fake = { .ops = &fake_ops, .n_exec = 1 };
    CHECK_EQ_INT(moed_backend_host_route(&fake, &job, 5, NULL, &got, &err), 0);
    int32_t wi[T * K];
    float ww[T * K];
    memcpy(wi, ids, sizeof ids);
    memcpy(ww, w, sizeof w);
    for (int i = 5 * K; i < 7 * K; i++) { /* the refused part: no pair */
        wi[i] = -1;
        ww[i] = 0;
    }
    CHECK(moed_route_from_choice(&want, wi, ww, T, K, 5, &err) == 0);
    CHECK_EQ_INT(got.T, T);
    CHECK(!memcmp(got.off, want.off, sizeof(int64_t) * (T + 1)));
    CHECK(!memcmp(got.expert, want.expert, sizeof(int32_t) * (size_t)want.off[T]));
    CHECK(!memcmp(got.weight, want.weight, sizeof(float) * (size_t)want.off[T]));
    CHECK(pr[0].err.code == 0 && pr[0].err.msg[0] == 0);
    CHECK(pr[2].err.code == 0 && pr[2].err.msg[0] == 0);
    moed_error want_err = { 0 };
    moed_choice_fail(&want_err, moed_choice_check(pr[1].ids, pr[1].weights, 2, K, 5), K, 5);
    CHECK_MSG(pr[1].err.code == MOED_EINVAL && !strcmp(pr[1].err.msg, want_err.msg), "'%s'",
              pr[1].err.msg);
    CHECK(strstr(pr[1].err.msg, "expert_weights[1][1]") != NULL); /* the part's own row */
    moed_route_free(&got);

    /* On an expert shard's view (holding experts 1, 3 and 4 of 5): the device parts' pairs
     * renumbered as moed_route_localize does, the host parts' (already in its numbering) as they
     * are, the refusal the same. */
    static const int32_t local_of[5] = { -1, 0, -1, 1, 2 };
    moed_route piece[5], want_shard;
    CHECK(moed_route_from_choice(&piece[1], ids + 2 * K, w + 2 * K, 3, K, 5, &err) == 0);
    CHECK(moed_route_from_choice(&piece[4], ids + 8 * K, w + 8 * K, 1, K, 5, &err) == 0);
    moed_route_localize(&piece[1], local_of);
    moed_route_localize(&piece[4], local_of);
    piece[0] = hp[0];
    piece[2] = e2;
    piece[3] = hp[1];
    CHECK(moed_route_init(&want_shard, T, want.off[T]) == 0);
    CHECK(moed_route_concat(
              &want_shard,
              (const moed_route *[]){ &piece[0], &piece[1], &piece[2], &piece[3], &piece[4] },
              5) == 0);
    CHECK_EQ_INT(moed_backend_host_route(&fake, &job, 5, local_of, &got, &err), 0);
    CHECK(!memcmp(got.off, want_shard.off, sizeof(int64_t) * (T + 1)));
    CHECK(!memcmp(got.expert, want_shard.expert, sizeof(int32_t) * (size_t)got.off[T]));
    CHECK(!memcmp(got.weight, want_shard.weight, sizeof(float) * (size_t)got.off[T]));
    CHECK_MSG(pr[1].err.code == MOED_EINVAL && !strcmp(pr[1].err.msg, want_err.msg), "'%s'",
              pr[1].err.msg);
    /* token 4's ids 0, 2, 3: expert 3 alone is held, as id 1 */
    CHECK(got.off[5] - got.off[4] == 1 && got.expert[got.off[4]] == 1);
    moed_route_free(&got);
    moed_route_free(&want_shard);
    moed_route_free(&piece[1]);
    moed_route_free(&piece[4]);

    /* A read that fails fails the call, with the backend's message. */
    unreadable = pr[1].weights;
    CHECK_EQ_INT(moed_backend_host_route(&fake, &job, 5, NULL, &got, &err), MOED_EDEVICE);
    CHECK(strstr(err.msg, "the fake device failed a read") != NULL && got.off == NULL);
    unreadable = NULL;
    moed_route_free(&want);
    moed_route_free(&job_r);
    moed_route_free(&hp[0]);
    moed_route_free(&hp[1]);
    moed_route_free(&e3);
    moed_route_free(&e2);
    moed_route_free(&e1);
}

int main(void)
{
    test_cpu_refuses();
    test_forward_checks();
    test_host_route();
    return check_status("test_backend_route");
}
