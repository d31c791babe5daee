/*
 * fuzz_request — libFuzzer target over what a Forward call does to its bytes before they reach a
 * queue: moed_wire_decode_request (wire.c) and moed_request_validate (request.c), against a small
 * served model of four layers (two alike, one with DeepSeek routing, one without a router).
 *
 * Why a differential oracle and not just "does not crash": the decoder's one hard part is bytes
 * split across slices at arbitrary points, so every input is decoded twice — as one slice, and
 * split into many (1-byte slices, random cuts, empty slices in between) — and both decodes must
 * agree on every field and every byte of every span. Sanitizers catch reads out of a slice
 * (each slice is its own allocation). What validation accepts must be consistent: hidden holds
 * exactly T x d_model elements, and a route has T tokens, experts in range and finite, non-negative
 * weights; batch gating then runs on the copied logits as the scheduler's worker would.
 *
 * Region references: the caller (principal 1, on this host) has host regions 1 and 2 (8 KiB of
 * finite floats, then small ints), 4 (shrunk to nothing after it was confirmed: its first use
 * faults, guarded, and breaks it), and principal 2 has region 3; this harness's getrandom hands out
 * 8-byte ids 1, 2, 3, 4 in order, so the seeds and the fuzzer can name them. Inline hidden rows go
 * into a small staging pool (copied there once, read back here) until it is full.
 */
#include "fuzz_fake.h"
#include "moed_backend_impl.h"
#include "moed_dtype.h"
#include "moed_synth.h"
#include "request.h"
#include "wire.h"

#include <fcntl.h>
#include <grpc/slice.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static int principal_1(void *ctx, moed_principal *out, moed_error *err)
{
    *out = 1;
    return 0;
}

static const moed_caller caller = { .local = true, .principal = principal_1 };

static moed_layer layers[4];
static const moed_layer *served_layers[4];
static moed_served served;

/* A registered and confirmed host region of `principal` (the session's); the object is unlinked
 * at once (the registry keeps it mapped), and with `shrink` truncated to nothing afterwards. */
static void add_region(moed_region_session *s, int n, bool shrink)
{
    char name[64];
    snprintf(name, sizeof name, "/moed-fuzz-%d-%d", (int)getpid(), n);
    int fd = shm_open(name, O_CREAT | O_RDWR, 0600);
    if (fd < 0 || ftruncate(fd, 8192)) abort();
    float *f = mmap(NULL, 8192, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (f == MAP_FAILED) abort();
    for (int i = 0; i < 1024; i++) f[i] = 0.25f * (float)(i % 9) - 1.0f; /* finite floats */
    for (int i = 1024; i < 2048; i++) ((int32_t *)f)[i] = i % 8;         /* expert ids */
    moed_region_info info;
    uint8_t ch[MOED_REGION_CHALLENGE];
    moed_error err;
    if (moed_regions_register_host(served.regions, s, name, strlen(name), 8192, &info, ch, &err))
        abort();
    memcpy(f, ch, sizeof ch);
    if (moed_regions_confirm_host(served.regions, s, info.id, &info, &err)) abort();
    memset(f, 0, sizeof ch);
    shm_unlink(name);
    if (shrink && ftruncate(fd, 0)) abort();
    munmap(f, 8192);
    close(fd);
}

/* Regions 1, 2, 4 of principal 1 (4 shrunk) and 3 of principal 2, for the life of the process. */
static void setup_regions(void)
{
    moed_regions_config rc = { .backend = &fake,
                               .mode = MOED_REGIONS_LOCAL,
                               .max_regions = 8,
                               .max_bytes = 1 << 20,
                               .max_total_bytes = 1 << 20 };
    moed_error err;
    if (moed_regions_create(&rc, &served.regions, &err) ||
        moed_bufpool_create(&fake, 1 << 16, &served.pool, &err))
        abort();
    moed_region_session *mine = moed_regions_open_session(served.regions, 1),
                        *theirs = moed_regions_open_session(served.regions, 2);
    add_region(mine, 1, false);
    add_region(mine, 2, false);
    add_region(theirs, 3, false);
    add_region(mine, 4, true);
}

/* Layers 0 and 1: d=8, 8 experts; layer 3: d=16, DeepSeek group routing; layer 7: no router. */
static void setup(void)
{
    static const struct {
        const char *spec;
        int layer, index;
    } made[4] = {
        { "layers=2,d=8,ff=16,experts=8,topk=2,act=swiglu,dtype=bf16,seed=1", 0, 0 },
        { "layers=2,d=8,ff=16,experts=8,topk=2,act=swiglu,dtype=bf16,seed=1", 1, 1 },
        { "layers=1,d=16,ff=8,experts=16,topk=4,act=gelu,dtype=f16,rule=deepseek,groups=4,"
          "topk_groups=2,scale=2.5,shared=1,shared_ff=8,seed=2",
          0, 3 },
        { "layers=1,d=8,ff=8,experts=4,topk=1,act=relu,dtype=f32,router=0,seed=3", 0, 7 },
    };
    moed_error err;
    for (int i = 0; i < 4; i++) {
        moed_synth_spec spec;
        if (moed_synth_parse(made[i].spec, &spec, &err) ||
            moed_synth_layer(&spec, made[i].layer, &layers[i], &err)) {
            fprintf(stderr, "fuzz_request: synthetic layer %d: %s\n", i, err.msg);
            abort();
        }
        layers[i].info.index = made[i].index; /* what clients name it */
        served_layers[i] = &layers[i];
    }
    served = (moed_served){ .layers = served_layers,
                            .n_layers = 4,
                            .max_batch_tokens = 64,
                            .max_message_bytes = 1 << 16,
                            .max_batch_pairs = 64 * 8 };
    setup_regions();
}

/* ---- splitting ------------------------------------------------------------------------------- */

static uint64_t rng_next(uint64_t *s)
{
    *s += 0x9e3779b97f4a7c15ull;
    uint64_t z = *s;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Splits data into slices (out has room for 2n + 1), each copied into its own allocation; the
 * cut points are a function of the bytes, so a crash reproduces from its input alone. Returns the
 * count. */
static size_t split(const uint8_t *data, size_t n, grpc_slice *out)
{
    uint64_t s = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) s = (s ^ data[i]) * 1099511628211ull;
    size_t k = 0, at = 0;
    int mode = (int)(rng_next(&s) % 4);
    while (at < n) {
        size_t len;
        if (mode == 0)
            len = 1;
        else if (mode == 3)
            len = k == 0 ? (size_t)(rng_next(&s) % n) : n - at;
        else
            len = (size_t)(rng_next(&s) % (n / 8 + 2));
        if (len > n - at) len = n - at;
        /* Empty slices only in mode 2, never two in a row: at most 2n + 1 slices. */
        if (len == 0 && (mode != 2 || (k && !GRPC_SLICE_LENGTH(out[k - 1])))) len = 1;
        out[k++] = grpc_slice_from_copied_buffer((const char *)data + at, len);
        at += len;
    }
    return k;
}

/* A broken promise: say which, then crash so libFuzzer saves the input. */
static void die(const char *why)
{
    fprintf(stderr, "fuzz_request: %s\n", why);
    abort();
}

/* ---- comparing two decodes ------------------------------------------------------------------- */

static void *span_bytes(const moed_span *sp)
{
    void *p = malloc(sp->len ? sp->len : 1);
    moed_span_copy(sp, p);
    return p;
}

static void same_span(const moed_span *a, const moed_span *b, const char *what)
{
    if (a->len != b->len) {
        fprintf(stderr, "%s: span lengths %zu and %zu differ\n", what, a->len, b->len);
        abort();
    }
    void *x = span_bytes(a), *y = span_bytes(b);
    if (memcmp(x, y, a->len)) {
        fprintf(stderr, "%s: span bytes differ\n", what);
        abort();
    }
    free(x);
    free(y);
}

static void same_tensor(const moed_wire_tensor *a, const moed_wire_tensor *b, const char *what)
{
    int n = a->n_shape < MOED_WIRE_MAX_DIMS ? a->n_shape : MOED_WIRE_MAX_DIMS;
    if (a->present != b->present || a->dtype != b->dtype || a->n_shape != b->n_shape ||
        memcmp(a->shape, b->shape, (size_t)n * sizeof a->shape[0])) {
        fprintf(stderr, "%s: tensors differ\n", what);
        abort();
    }
    if (a->in_region != b->in_region || memcmp(&a->region, &b->region, sizeof a->region)) {
        fprintf(stderr, "%s: region references differ\n", what);
        abort();
    }
    same_span(&a->data, &b->data, what);
}

static void same_request(const moed_wire_request *a, const moed_wire_request *b)
{
    if (a->bytes != b->bytes || a->layer != b->layer || a->routing != b->routing ||
        a->batch_gating != b->batch_gating || a->k_batch != b->k_batch ||
        memcmp(&a->gating, &b->gating, sizeof a->gating) || a->has_output != b->has_output ||
        memcmp(&a->output, &b->output, sizeof a->output)) {
        fprintf(stderr, "requests differ in their scalars\n");
        abort();
    }
    same_span(&a->request_id, &b->request_id, "request_id");
    same_tensor(&a->hidden, &b->hidden, "hidden");
    same_tensor(&a->expert_ids, &b->expert_ids, "expert_ids");
    same_tensor(&a->expert_weights, &b->expert_weights, "expert_weights");
    same_tensor(&a->logits, &b->logits, "logits");
}

/* ---- what validation promises ---------------------------------------------------------------- */

static void check_work(const moed_work *w)
{
    const moed_sched_item *it = &w->item;
    const moed_layer_info *li = &it->layer->info;
    size_t need = (size_t)it->T * (size_t)li->d_model * moed_dtype_size(it->dtype);
    if (it->T < 1 || it->T > served.max_batch_tokens ||
        (w->hidden_region ? w->hidden.len != 0 : w->hidden.len != need))
        die("validated hidden does not hold T x d_model elements");
    void *rows = malloc(need);
    moed_error err;
    /* every byte of hidden is readable: from the staging pool, the message, or (guarded) the
     * region, which only a shrunk region may refuse */
    if (it->mem.x) {
        if (it->mem.x != w->buf && !w->hidden_region) die("hidden is read from elsewhere");
        memcpy(rows, it->mem.x, need);
        if (!w->hidden_region) {
            void *sent = span_bytes(&w->hidden);
            if (memcmp(sent, rows, need)) die("the staging buffer holds other rows than sent");
            free(sent);
        }
    } else {
        int rc = it->copy_in((moed_sched_item *)it, rows, &err);
        if (rc && !(w->hidden_region && rc == MOED_EPRECOND)) die("hidden's copy-in failed");
    }
    free(rows);
    if (w->out_region && !w->out_at) die("an output region without its place");
    if (it->route.off) {
        const moed_route *r = &it->route;
        if (r->T != it->T || r->off[0] != 0) die("route does not cover T tokens");
        for (int64_t t = 0; t < r->T; t++)
            if (r->off[t + 1] < r->off[t]) die("route offsets decrease");
        for (int64_t i = 0; i < r->off[r->T]; i++) {
            if (r->expert[i] < 0 || r->expert[i] >= li->n_experts) die("route expert out of range");
            if (!isfinite(r->weight[i]) || r->weight[i] < 0) die("route weight not finite or < 0");
        }
    }
    if (it->k_batch && it->logits) {
        int32_t set[64];
        moed_route out = { 0 };
        moed_error err;
        if (moed_gate_batch(it->logits, it->T, li->n_experts, it->k_batch, set, &out, &err))
            die("batch gating failed on validated logits");
        for (int i = 0; i < it->k_batch; i++)
            if (set[i] < 0 || set[i] >= li->n_experts) die("batch gating chose an unknown expert");
        for (int64_t i = 0; i < out.off[out.T]; i++)
            if (!isfinite(out.weight[i]) || out.weight[i] < 0)
                die("batch gating weight not finite or < 0");
        moed_route_free(&out);
    }
    if (!it->route.off && !it->server_logits && !it->logits) die("validated work has no route");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static int ready;
    if (!ready) {
        setup();
        ready = 1;
    }
    grpc_slice one = grpc_slice_from_copied_buffer((const char *)data, size);
    grpc_slice *many = malloc((2 * size + 1) * sizeof *many);
    size_t k = split(data, size, many);
    moed_wire_request a, b;
    moed_error ea, eb;
    int ra = moed_wire_decode_request(&one, size ? 1 : 0, &a, &ea);
    int rb = moed_wire_decode_request(many, k, &b, &eb);
    if (ra != rb || (ra && strcmp(ea.msg, eb.msg))) {
        fprintf(stderr, "decodes differ: %d '%s' vs %d '%s'\n", ra, ea.msg, rb, eb.msg);
        abort();
    }
    if (!ra) {
        same_request(&a, &b);
        moed_work wa, wb;
        ra = moed_request_validate(&served, &caller, &a, &wa, &ea);
        rb = moed_request_validate(&served, &caller, &b, &wb, &eb);
        if (ra != rb || (ra && strcmp(ea.msg, eb.msg)))
            die("validations of the two decodes differ");
        if (!ra) {
            check_work(&wa);
            if (wa.item.T != wb.item.T || wa.item.dtype != wb.item.dtype ||
                wa.item.slot != wb.item.slot)
                die("validated work of the two decodes differs");
        } else if (ra != MOED_EINVAL && ra != MOED_ENOTFOUND && ra != MOED_ETOOBIG &&
                   ra != MOED_EPRECOND) {
            die("validation failed with a code that is not the caller's mistake");
        }
        moed_work_free(&wa);
        moed_work_free(&wb);
    } else if (ra != MOED_EFORMAT) {
        die("decoding failed with a code other than MOED_EFORMAT");
    }
    grpc_slice_unref(one);
    for (size_t i = 0; i < k; i++) grpc_slice_unref(many[i]);
    free(many);
    return 0;
}
