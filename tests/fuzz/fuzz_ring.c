/*
 * fuzz_ring — libFuzzer target over what reaches moed from a doorbell ring: a ring header's copy
 * (moed_ring_check_header) and call descriptors as the poller takes them (moed_request_from_ring,
 * then moed_request_validate: request.c's rules, regions acquired with the ring's principal).
 *
 * An input is a header (256 bytes), the slots and the bytes available that register_ring would
 * give (u32, u64, little-endian), then up to four descriptors of 256 bytes (the last one padded
 * with zeros). Promises checked: a header passes only when every field is what the layout says,
 * its slots agree and the ring fits; a descriptor is refused only with a status the caller can
 * cause and a message, and one accepted is a work item the scheduler can run: T within
 * --max-batch-tokens, hidden and the output held in regions of the principal with T x d_model
 * elements each, and either a host route of T tokens (experts in range, weights finite and >= 0,
 * pairs within --max-batch-pairs) or device routing whose ids and weights lie in CUDA regions of
 * one device (k within the layer's experts, T x k pairs within the limit). After the work is freed
 * no region is held.
 *
 * Regions (this harness's getrandom hands out ids 1, 2, ... in order): 1 and 2 host regions of the
 * caller (principal 1, 8 KiB each: floats, then ids 0..7), 3 another principal's, 4 the caller's
 * shrunk to nothing after it was confirmed, 5 and 6 CUDA regions of the caller on devices 0 and 1
 * (this harness's backend maps them over a buffer of its own).
 */
#include "fuzz_fake.h"
#include "moed_backend_impl.h"
#include "moed_dtype.h"
#include "moed_ring.h"
#include "moed_synth.h"
#include "request.h"

#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define REGION_BYTES 8192

static unsigned char device_mem[2][REGION_BYTES] __attribute__((aligned(64)));

static int dev_map(moed_backend *b, const void *handle, size_t handle_len, const char *uuid,
                   int device, uint64_t bytes, uint64_t offset, void **ptr, int *dev, void **base,
                   moed_error *err)
{
    *ptr = device_mem[device];
    *dev = device;
    *base = device_mem[device];
    return 0;
}

static void dev_unmap(moed_backend *b, void *base, int dev) {}

static int dev_read(moed_backend *b, void *dst, const void *src, int dev, size_t bytes,
                    moed_error *err)
{
    memcpy(dst, src, bytes);
    return 0;
}

static const moed_backend_ops dev_ops = {
    .name = "fuzz", .map_device = dev_map, .unmap_device = dev_unmap, .read_device = dev_read
};
static moed_backend dev_backend = { .ops = &dev_ops, .n_devices = 2 };

static int principal_1(void *ctx, moed_principal *out, moed_error *err)
{
    *out = 1;
    return 0;
}

static const moed_caller ring_caller = { .local = true, .principal = principal_1 };

static moed_layer layers[2];
static const moed_layer *served_layers[2];
static moed_served served;

static void die(const char *why)
{
    fprintf(stderr, "fuzz_ring: %s\n", why);
    abort();
}

/* A confirmed host region of the session's principal, filled as fuzz_request's are. */
static void add_host(moed_region_session *s, int n, bool shrink)
{
    char name[64];
    snprintf(name, sizeof name, "/moed-fuzz-ring-%d-%d", (int)getpid(), n);
    int fd = shm_open(name, O_CREAT | O_RDWR, 0600);
    if (fd < 0 || ftruncate(fd, REGION_BYTES)) abort();
    float *f = mmap(NULL, REGION_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (f == MAP_FAILED) abort();
    for (int i = 0; i < 1024; i++) f[i] = 0.25f * (float)(i % 9) - 1.0f;
    for (int i = 1024; i < 2048; i++) ((int32_t *)f)[i] = i % 8;
    moed_region_info info;
    uint8_t ch[MOED_REGION_CHALLENGE];
    moed_error err;
    if (moed_regions_register_host(served.regions, s, name, strlen(name), REGION_BYTES, &info, ch,
                                   &err))
        abort();
    memcpy(f, ch, sizeof ch);
    if (moed_regions_confirm_host(served.regions, s, info.id, &info, &err)) abort();
    memset(f, 0, sizeof ch);
    shm_unlink(name);
    if (shrink && ftruncate(fd, 0)) abort();
    munmap(f, REGION_BYTES);
    close(fd);
}

static void setup(void)
{
    static const char *const specs[2] = {
        "layers=1,d=8,ff=16,experts=8,topk=2,act=swiglu,dtype=bf16,seed=1",
        "layers=1,d=16,ff=8,experts=16,topk=4,act=gelu,dtype=f16,seed=2",
    };
    moed_error err;
    for (int i = 0; i < 2; i++) {
        moed_synth_spec spec;
        if (moed_synth_parse(specs[i], &spec, &err) || moed_synth_layer(&spec, 0, &layers[i], &err))
            die(err.msg);
        layers[i].info.index = 3 * i; /* layers 0 and 3 */
        served_layers[i] = &layers[i];
    }
    served = (moed_served){ .layers = served_layers,
                            .n_layers = 2,
                            .max_batch_tokens = 64,
                            .max_message_bytes = 1 << 16,
                            .max_batch_pairs = 256 };
    (void)fake; /* fuzz_fake.h's backend has no devices; this one maps CUDA regions */
    moed_regions_config rc = { .backend = &dev_backend,
                               .mode = MOED_REGIONS_LOCAL,
                               .max_regions = 8,
                               .max_bytes = 1 << 20,
                               .max_total_bytes = 1 << 20 };
    if (moed_regions_create(&rc, &served.regions, &err)) abort();
    moed_region_session *mine = moed_regions_open_session(served.regions, 1),
                        *theirs = moed_regions_open_session(served.regions, 2);
    add_host(mine, 1, false);
    add_host(mine, 2, false);
    add_host(theirs, 3, false);
    add_host(mine, 4, true);
    moed_region_info info;
    for (int dev = 0; dev < 2; dev++) {
        for (int i = 0; i < REGION_BYTES / 4; i++)
            ((int32_t *)device_mem[dev])[i] = i < 512 ? (int32_t)(i % 9) - 1 : i % 5;
        if (moed_regions_register_cuda(served.regions, mine, "h", 1, NULL, dev, REGION_BYTES, 0,
                                       &info, &err))
            die(err.msg);
    }
}

/* The references validation holds on every region now. */
static uint32_t held_now(void)
{
    uint32_t n = 0;
    for (moed_principal p = 1; p <= 2; p++) {
        moed_region_info *all;
        int k;
        moed_error err;
        if (moed_regions_list(served.regions, p, &all, &k, &err)) abort();
        for (int i = 0; i < k; i++) n += all[i].requests;
        free(all);
    }
    return n;
}

static void check_header(const moed_ring_header *h, uint32_t slots, uint64_t avail)
{
    moed_error err = { 0 };
    int rc = moed_ring_check_header(h, slots, avail, &err);
    const bool ok = h->magic == MOED_RING_MAGIC && h->version == MOED_RING_VERSION &&
                    h->header_bytes == MOED_RING_HEADER_BYTES &&
                    h->slot_bytes == MOED_RING_SLOT_BYTES && slots >= 1 &&
                    slots <= MOED_RING_MAX_SLOTS && h->n_slots == slots &&
                    moed_ring_bytes(slots) <= avail;
    if (!rc != ok) die("the header check disagrees with the layout");
    if (rc && (rc != MOED_EINVAL || !err.msg[0])) die("a header refused without INVALID_ARGUMENT");
}

static void check_work(const moed_ring_request *d, const moed_work *w)
{
    const moed_sched_item *it = &w->item;
    const moed_layer_info *li = &it->layer->info;
    if ((uint32_t)li->index != d->layer || it->T != d->tokens || it->T < 1 ||
        it->T > served.max_batch_tokens || it->dtype != (int)d->dtype)
        die("validated work is not the descriptor's call");
    if (!w->hidden_region || !w->out_region || !it->copy_in)
        die("hidden and the output are not held in regions");
    if (d->hidden.length != (uint64_t)it->T * (uint64_t)li->d_model * moed_dtype_size(it->dtype) ||
        d->output.length != d->hidden.length)
        die("hidden or the output is not T x d_model elements");
    const moed_route *r = &it->route;
    if (!r->off || r->T != it->T || r->off[0] != 0) die("the route does not cover T tokens");
    if (it->mem.route) {
        const moed_part_route *pr = it->mem.route;
        if (r->off[r->T] != 0 || !w->ids_region || !w->weights_region || pr->dev < 0 ||
            pr->k != (int)d->top_k || pr->k > li->n_experts || it->pairs != it->T * pr->k ||
            it->pairs > served.max_batch_pairs)
            die("device routing out of its bounds");
        return;
    }
    if (w->ids_region || w->weights_region) die("a host route holds routing regions");
    for (int64_t t = 0; t < r->T; t++)
        if (r->off[t + 1] < r->off[t]) die("route offsets decrease");
    if (r->off[r->T] > served.max_batch_pairs || it->pairs != r->off[r->T])
        die("a route over --max-batch-pairs");
    for (int64_t i = 0; i < r->off[r->T]; i++)
        if (r->expert[i] < 0 || r->expert[i] >= li->n_experts || !isfinite(r->weight[i]) ||
            r->weight[i] < 0)
            die("a route pair breaks the rules");
}

static void check_descriptor(const moed_ring_request *d)
{
    moed_wire_request q;
    moed_work w;
    moed_error err = { 0 };
    memset(&w, 0, sizeof w);
    int rc = moed_request_from_ring(&served, d, &q, &err);
    if (!rc) rc = moed_request_validate(&served, &ring_caller, &q, &w, &err);
    if (!rc)
        check_work(d, &w);
    else if ((rc != MOED_EINVAL && rc != MOED_ENOTFOUND && rc != MOED_ETOOBIG &&
              rc != MOED_EPRECOND) ||
             !err.msg[0])
        die("a descriptor refused with a status the caller cannot cause, or no message");
    moed_work_free(&w);
    if (held_now()) die("a region is still held after the work was freed");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static int ready;
    if (!ready) {
        setup();
        ready = 1;
    }
    moed_ring_header h;
    uint32_t slots = 0;
    uint64_t avail = 0;
    memset(&h, 0, sizeof h);
    memcpy(&h, data, size < sizeof h ? size : sizeof h);
    if (size >= sizeof h + 4) memcpy(&slots, data + sizeof h, 4);
    if (size >= sizeof h + 12) memcpy(&avail, data + sizeof h + 4, 8);
    check_header(&h, slots, avail);
    size_t at = sizeof h + 12;
    for (int k = 0; k < 4 && at < size; k++, at += sizeof(moed_ring_request)) {
        moed_ring_request d;
        memset(&d, 0, sizeof d);
        size_t n = size - at < sizeof d ? size - at : sizeof d;
        memcpy(&d, data + at, n);
        check_descriptor(&d);
    }
    return 0;
}
