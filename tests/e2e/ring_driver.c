/*
 * ring_driver — one libmoedclient ring (moedc_ring_open) kept open while a test drives it from
 * stdin, so the test can change the daemon (stop it, kill it) between and during its calls.
 *
 *   ring_driver TARGET HIDDEN IDS WEIGHTS T D K SLOTS
 *
 * HIDDEN is T x D float32, IDS and WEIGHTS T x K int32 / float32, raw little-endian files: they go
 * into a host region of the ring's session, and each call of layer 0 reads them and writes its
 * output into a part of the output region of its own (zeroed first), SLOTS parts. Prints "OPEN" (or
 * "ERR STATUS message" and exits 1), then answers each stdin line with one line: start "TICKET slot
 * ticket" (or ERR) wait SLOT TICKET    "OK <output as hex>", "ERR STATUS message", or "TIMEOUT"
 * after 60 s call                start and wait stream              a call enqueued on a CUDA
 * stream, the stream synchronised: as wait capture N           N calls enqueued on a stream while
 * it is captured: "CAPTURED" replay              the capture run on the stream, synchronised: one
 * line per call, as wait release             the captured calls' slots released: "RELEASED"
 *   failures            "FAILURES n" (moedc_ring_failures)
 *   threads N M         N threads at once on the ring, M host calls each, each thread's output in
 *                       a part of its own: "THREADS ok" with every output the same bytes, or
 *                       "ERR ..." naming the first that was not
 * Streams come from the CUDA driver found at run time (libcuda.so.1; the tests give it
 * tests/unit/fake_libcuda.c, whose fake_cuda_capture and fake_cuda_replay capture and replay).
 * Built by the e2e tests against the build's library.
 */
#include "moedclient.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_CAPTURED 64

static int T, D, K;
static uint32_t n_parts;
static bool part_busy[4096];
static uint32_t part_of[4096]; /* the output part of each slot's call */
static moedc_region *input, *output;
static moedc_ring *ring;
static void *stream;
static moedc_ring_ticket captured[MAX_CAPTURED];
static int n_captured;

/* The driver's entry points this program calls itself (the library resolves its own). */
static int (*stream_create)(void **stream, unsigned flags);
static int (*stream_sync)(void *stream);
static void (*capture)(void *stream, int on);
static void (*replay)(void *stream);

static void slurp(const char *path, void *p, size_t n)
{
    FILE *f = fopen(path, "rb");
    if (!f || fread(p, 1, n, f) != n) {
        fprintf(stderr, "cannot read %zu bytes of %s\n", n, path);
        exit(2);
    }
    fclose(f);
}

static void say_error(int code, const char *msg)
{
    printf("ERR %s %s\n", moedc_grpc_status_name(moedc_code_to_grpc(code)), msg);
}

static size_t out_bytes(void)
{
    return (size_t)T * (size_t)D * 4;
}

/* A part of the output region no call in flight writes, zeroed; n_parts when none is. */
static uint32_t take_part(void)
{
    for (uint32_t p = 0; p < n_parts; p++)
        if (!part_busy[p]) {
            part_busy[p] = true;
            memset((char *)output->ptr + p * out_bytes(), 0, out_bytes());
            return p;
        }
    return 0; /* more calls than slots: the ring refuses the call before it writes anything */
}

/* The call of every line: layer 0 over the input region, output into part p. */
static moedc_ring_call the_call(uint32_t p)
{
    const size_t x = (size_t)T * (size_t)D * 4, r = (size_t)T * (size_t)K * 4;
    return (moedc_ring_call){ .layer = 0,
                              .dtype = MOEDC_F32,
                              .tokens = T,
                              .d_model = D,
                              .k = K,
                              .hidden = { input, 0 },
                              .expert_ids = { input, x },
                              .expert_weights = { input, x + r },
                              .output = { output, p * out_bytes() },
                              .timeout_s = 30 };
}

/* The call's output from its part, or its failure; keep: the part stays the call's (captured). */
static void say_result(uint32_t slot, const moedc_ring_result *res, bool keep)
{
    part_busy[part_of[slot]] = keep;
    if (res->status) {
        say_error(res->status, res->message);
        return;
    }
    const unsigned char *y = (const unsigned char *)output->ptr + part_of[slot] * out_bytes();
    printf("OK ");
    for (size_t i = 0; i < out_bytes(); i++) printf("%02x", y[i]);
    printf("\n");
}

static void do_start(bool then_wait)
{
    const uint32_t p = take_part();
    moedc_ring_call call = the_call(p);
    moedc_ring_ticket t;
    moedc_error err;
    int rc = moedc_ring_start(ring, &call, &t, &err);
    if (rc) {
        part_busy[p] = false;
        say_error(rc, err.msg);
        return;
    }
    part_of[t.slot] = p;
    if (!then_wait) {
        printf("TICKET %u %u\n", t.slot, t.ticket);
        return;
    }
    moedc_ring_result res;
    rc = moedc_ring_wait(ring, &t, 60, &res, &err);
    if (rc < 0)
        say_error(rc, err.msg);
    else if (rc == 0)
        printf("TIMEOUT\n");
    else
        say_result(t.slot, &res, false);
}

static void do_wait(uint32_t slot, uint32_t ticket)
{
    moedc_ring_ticket t = { slot, ticket };
    moedc_ring_result res;
    moedc_error err;
    int rc = moedc_ring_wait(ring, &t, 60, &res, &err);
    if (rc < 0)
        say_error(rc, err.msg);
    else if (rc == 0)
        printf("TIMEOUT\n");
    else
        say_result(slot, &res, false);
}

/* A stream for the stream calls, from the driver (NULL when there is none: the library then
 * answers for itself). */
static void *the_stream(void)
{
    if (stream || !stream_create) return stream;
    if (stream_create(&stream, 0)) stream = NULL;
    return stream;
}

/* The result of stream call t after its stream was synchronised. */
static void say_stream_result(const moedc_ring_ticket *t, bool keep)
{
    moedc_ring_result res;
    moedc_error err;
    int rc = moedc_ring_stream_result(ring, t, &res, &err);
    if (rc < 0)
        say_error(rc, err.msg);
    else if (rc == 0)
        printf("ERR INTERNAL the stream passed the call but its slot says it did not\n");
    else
        say_result(t->slot, &res, keep);
}

static int enqueue(moedc_ring_ticket *t, moedc_error *err)
{
    const uint32_t p = take_part();
    moedc_ring_call call = the_call(p);
    int rc = moedc_ring_enqueue(ring, &call, the_stream(), t, err);
    if (rc)
        part_busy[p] = false;
    else
        part_of[t->slot] = p;
    return rc;
}

static void do_stream(void)
{
    moedc_ring_ticket t;
    moedc_error err;
    int rc = enqueue(&t, &err);
    if (rc) {
        say_error(rc, err.msg);
        return;
    }
    stream_sync(stream);
    say_stream_result(&t, false);
}

static void do_capture(int n)
{
    moedc_error err;
    if (!capture || !the_stream() || n > MAX_CAPTURED) {
        printf("ERR INTERNAL no driver that captures here, or over %d calls\n", MAX_CAPTURED);
        return;
    }
    capture(stream, 1);
    n_captured = 0;
    for (int i = 0; i < n; i++) {
        int rc = enqueue(&captured[n_captured], &err);
        if (rc) {
            capture(stream, 0);
            say_error(rc, err.msg);
            return;
        }
        n_captured++;
    }
    capture(stream, 0);
    printf("CAPTURED\n");
}

static void do_replay(void)
{
    replay(stream);
    stream_sync(stream);
    for (int i = 0; i < n_captured; i++) say_stream_result(&captured[i], true);
}

static void do_release(void)
{
    moedc_error err;
    for (int i = 0; i < n_captured; i++) {
        if (moedc_ring_release(ring, &captured[i], &err)) {
            say_error(err.code, err.msg);
            return;
        }
        part_busy[part_of[captured[i].slot]] = false;
    }
    n_captured = 0;
    printf("RELEASED\n");
}

typedef struct thread_arg {
    uint32_t part, calls;
    char error[512];
} thread_arg;

/* M calls from one of several threads, each output compared with the first thread's first. */
static void *calls_thread(void *p)
{
    thread_arg *a = p;
    const char *y = (const char *)output->ptr + a->part * out_bytes();
    for (uint32_t i = 0; i < a->calls && !a->error[0]; i++) {
        moedc_ring_call call = the_call(a->part);
        moedc_ring_ticket t;
        moedc_ring_result res;
        moedc_error err;
        memset((void *)y, 0, out_bytes());
        if (moedc_ring_start(ring, &call, &t, &err))
            snprintf(a->error, sizeof a->error, "start: %s", err.msg);
        else if (moedc_ring_wait(ring, &t, 60, &res, &err) != 1 || res.status)
            snprintf(a->error, sizeof a->error, "wait: %s", res.status ? res.message : err.msg);
        else if (memcmp(y, output->ptr, out_bytes()))
            snprintf(a->error, sizeof a->error, "call %u of part %u differs", i, a->part);
    }
    return NULL;
}

static void do_threads(uint32_t n, uint32_t m)
{
    thread_arg args[64];
    pthread_t th[64];
    if (n < 2 || n > 64 || n > n_parts) {
        printf("ERR INVALID_ARGUMENT threads: 2 to 64, at most the slots\n");
        return;
    }
    /* part 0's output first: what every other must equal */
    moedc_ring_call call = the_call(0);
    moedc_ring_ticket t;
    moedc_ring_result res;
    moedc_error err;
    if (moedc_ring_start(ring, &call, &t, &err) || moedc_ring_wait(ring, &t, 60, &res, &err) != 1 ||
        res.status) {
        printf("ERR INTERNAL the first call failed\n");
        return;
    }
    for (uint32_t i = 0; i < n - 1; i++) {
        args[i] = (thread_arg){ .part = i + 1, .calls = m };
        pthread_create(&th[i], NULL, calls_thread, &args[i]);
    }
    const char *bad = NULL;
    for (uint32_t i = 0; i < n - 1; i++) {
        pthread_join(th[i], NULL);
        if (!bad && args[i].error[0]) bad = args[i].error;
    }
    if (bad)
        printf("ERR INTERNAL %s\n", bad);
    else
        printf("THREADS ok\n");
}

static void find_driver(void)
{
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) return;
    *(void **)&stream_create = dlsym(lib, "cuStreamCreate");
    *(void **)&stream_sync = dlsym(lib, "cuStreamSynchronize");
    *(void **)&capture = dlsym(lib, "fake_cuda_capture");
    *(void **)&replay = dlsym(lib, "fake_cuda_replay");
    int (*init)(unsigned) = (int (*)(unsigned))dlsym(lib, "cuInit");
    if (init) init(0);
}

int main(int argc, char **argv)
{
    if (argc != 9) {
        fprintf(stderr, "usage: ring_driver TARGET HIDDEN IDS WEIGHTS T D K SLOTS\n");
        return 2;
    }
    T = atoi(argv[5]);
    D = atoi(argv[6]);
    K = atoi(argv[7]);
    const uint32_t slots = (uint32_t)atoi(argv[8]);
    n_parts = slots < 4096 ? slots : 4096;
    const size_t x = (size_t)T * (size_t)D * 4, r = (size_t)T * (size_t)K * 4;
    find_driver();
    moedc_opts opts = { .timeout_s = 30 };
    moedc *c;
    moedc_session *s = NULL;
    moedc_error err;
    int rc = moedc_connect(argv[1], &opts, &c, &err);
    if (!rc) rc = moedc_session_open(c, &s, &err);
    if (!rc) rc = moedc_region_create_host(s, x + 2 * r, 0, &input, &err);
    if (!rc) rc = moedc_region_create_host(s, slots * out_bytes(), 0, &output, &err);
    if (!rc) rc = moedc_ring_open(s, slots, &ring, &err);
    if (rc) {
        say_error(rc, err.msg);
        return 1;
    }
    slurp(argv[2], input->ptr, x);
    slurp(argv[3], (char *)input->ptr + x, r);
    slurp(argv[4], (char *)input->ptr + x + r, r);
    printf("OPEN\n");
    fflush(stdout);
    char line[128];
    unsigned a, b;
    while (fgets(line, sizeof line, stdin)) {
        if (!strcmp(line, "start\n"))
            do_start(false);
        else if (!strcmp(line, "call\n"))
            do_start(true);
        else if (sscanf(line, "wait %u %u", &a, &b) == 2)
            do_wait(a, b);
        else if (!strcmp(line, "stream\n"))
            do_stream();
        else if (sscanf(line, "capture %u", &a) == 1)
            do_capture((int)a);
        else if (!strcmp(line, "replay\n"))
            do_replay();
        else if (!strcmp(line, "release\n"))
            do_release();
        else if (sscanf(line, "threads %u %u", &a, &b) == 2)
            do_threads(a, b);
        else if (!strcmp(line, "failures\n"))
            printf("FAILURES %u\n", moedc_ring_failures(ring));
        else
            printf("ERR INVALID_ARGUMENT unknown command %s", line);
        fflush(stdout);
    }
    moedc_session_close(s); /* closes the ring, frees the regions */
    moedc_close(c);
    return 0;
}
