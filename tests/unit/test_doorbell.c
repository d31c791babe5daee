/*
 * test_doorbell — the pure pieces of the doorbell path: a ring header's check
 * (moed_ring_check_header: each field wrong on its own, sizes that overflow), a descriptor turned
 * into the request it stands for (moed_request_from_ring) and validated by the gRPC path's rules
 * (moed_request_validate) with regions, and where its expert choice goes: to the backend as device
 * routing when ids and weights both lie in CUDA regions of one GPU (held until the work is freed,
 * T x k pairs), read to the host otherwise. The backend is a fake whose "device memory" is host
 * memory of this process (map_device hands out a buffer of its own).
 */
#include "check.h"
#include "moed_backend_impl.h"
#include "moed_dtype.h"
#include "moed_ring.h"
#include "request.h"

#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* ---- the header -------------------------------------------------------------------------------
 */

static moed_ring_header good_header(uint32_t slots)
{
    moed_ring_header h;
    memset(&h, 0, sizeof h);
    h.magic = MOED_RING_MAGIC;
    h.version = MOED_RING_VERSION;
    h.header_bytes = MOED_RING_HEADER_BYTES;
    h.slot_bytes = MOED_RING_SLOT_BYTES;
    h.n_slots = slots;
    return h;
}

static void expect_header(const moed_ring_header *h, uint32_t slots, uint64_t avail, int code,
                          const char *needle)
{
    moed_error err = { 0 };
    int rc = moed_ring_check_header(h, slots, avail, &err);
    CHECK_MSG(rc == code, "slots %u avail %llu: %d, not %d (%s)", slots, (unsigned long long)avail,
              rc, code, err.msg);
    if (needle) CHECK_MSG(strstr(err.msg, needle) != NULL, "'%s' lacks '%s'", err.msg, needle);
}

static void test_header(void)
{
    moed_ring_header h = good_header(8);
    expect_header(&h, 8, moed_ring_bytes(8), 0, NULL);
    expect_header(&h, 8, UINT64_MAX, 0, NULL);
    expect_header(&h, 8, moed_ring_bytes(8) - 1, MOED_EINVAL, "takes 4352 bytes");
    expect_header(&h, 7, UINT64_MAX, MOED_EINVAL, "must agree");
    h.magic ^= 1;
    expect_header(&h, 8, UINT64_MAX, MOED_EINVAL, "magic");
    h = good_header(8);
    h.version = 2;
    expect_header(&h, 8, UINT64_MAX, MOED_EINVAL, "version is 2");
    h = good_header(8);
    h.header_bytes = 128;
    expect_header(&h, 8, UINT64_MAX, MOED_EINVAL, "128 header bytes");
    h = good_header(8);
    h.slot_bytes = 256;
    expect_header(&h, 8, UINT64_MAX, MOED_EINVAL, "256 bytes a slot");
    h = good_header(0);
    expect_header(&h, 0, UINT64_MAX, MOED_EINVAL, "1 to 4096 slots");
    h = good_header(MOED_RING_MAX_SLOTS + 1);
    expect_header(&h, MOED_RING_MAX_SLOTS + 1, UINT64_MAX, MOED_EINVAL, "1 to 4096 slots");
    h = good_header(UINT32_MAX); /* 256 + 512 x (2^32 - 1) does not wrap in 64 bits */
    expect_header(&h, UINT32_MAX, UINT64_MAX, MOED_EINVAL, "1 to 4096 slots");
    h = good_header(MOED_RING_MAX_SLOTS);
    expect_header(&h, MOED_RING_MAX_SLOTS, moed_ring_bytes(MOED_RING_MAX_SLOTS), 0, NULL);
    CHECK_EQ_INT(moed_ring_next_ticket(UINT32_MAX), 1);
    CHECK_EQ_INT(moed_ring_next_ticket(1), 2);
}

/* ---- descriptors ------------------------------------------------------------------------------
 */

#define MEM_BYTES 65536

static unsigned char device_mem[MEM_BYTES] __attribute__((aligned(64)));

static int fake_map_device(moed_backend *b, const void *handle, size_t handle_len,
                           const char *device_uuid, int device, uint64_t bytes, uint64_t offset,
                           void **ptr, int *dev, void **base, moed_error *err)
{
    if (offset + bytes > MEM_BYTES) return moed_fail(err, MOED_EINVAL, "too large");
    *ptr = device_mem + offset;
    *dev = device;
    *base = device_mem;
    return 0;
}

static void fake_unmap_device(moed_backend *b, void *base, int dev) {}

static int fake_read_device(moed_backend *b, void *dst, const void *src, int dev, size_t bytes,
                            moed_error *err)
{
    memcpy(dst, src, bytes);
    return 0;
}

static const moed_backend_ops fake_ops = { .name = "fake",
                                           .host_dma = true,
                                           .map_device = fake_map_device,
                                           .unmap_device = fake_unmap_device,
                                           .read_device = fake_read_device };
static moed_backend fake = { .ops = &fake_ops, .n_devices = 2 };

static moed_layer layers[2];
static const moed_layer *ptrs[2] = { &layers[0], &layers[1] };
static moed_served served = { .layers = ptrs,
                              .n_layers = 2,
                              .max_batch_tokens = 64,
                              .max_batch_pairs = 100,
                              .max_message_bytes = 1 << 20 };

static int principal_7(void *ctx, moed_principal *out, moed_error *err)
{
    *out = 7;
    return 0;
}

static const moed_caller ring_caller = { .local = true, .principal = principal_7 };

/* Regions of principal 7: a host region (64 KiB of shared memory, mapped here in *host_map) and
 * CUDA regions of device 0 and device 1 over the fake's memory; their ids. */
static uint64_t host_id, cuda0, cuda1;
static unsigned char *host_map;

static void setup(void)
{
    for (int i = 0; i < 2; i++)
        layers[i].info = (moed_layer_info){ .index = 3 + i,
                                            .d_model = 4,
                                            .d_ff = 8,
                                            .n_experts = 8,
                                            .top_k = 2,
                                            .act = MOED_ACT_SWIGLU,
                                            .wdtype = MOED_F32 };
    moed_regions_config rc = { .backend = &fake,
                               .mode = MOED_REGIONS_LOCAL,
                               .max_regions = 8,
                               .max_bytes = 1 << 20,
                               .max_total_bytes = 1 << 20 };
    moed_error err;
    CHECK_EQ_INT(moed_regions_create(&rc, &served.regions, &err), 0);
    moed_region_session *s = moed_regions_open_session(served.regions, 7);
    char name[64];
    snprintf(name, sizeof name, "/moed-unit-db-%d", (int)getpid());
    int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
    CHECK(fd >= 0 && ftruncate(fd, MEM_BYTES) == 0);
    host_map = mmap(NULL, MEM_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    moed_region_info info;
    uint8_t ch[MOED_REGION_CHALLENGE];
    CHECK_EQ_INT(moed_regions_register_host(served.regions, s, name, strlen(name), MEM_BYTES, &info,
                                            ch, &err),
                 0);
    memcpy(host_map, ch, sizeof ch);
    CHECK_EQ_INT(moed_regions_confirm_host(served.regions, s, info.id, &info, &err), 0);
    host_id = info.id;
    shm_unlink(name);
    CHECK_EQ_INT(
        moed_regions_register_cuda(served.regions, s, "h", 1, NULL, 0, 32768, 0, &info, &err), 0);
    cuda0 = info.id;
    CHECK_EQ_INT(
        moed_regions_register_cuda(served.regions, s, "h", 1, NULL, 1, 32768, 32768, &info, &err),
        0);
    cuda1 = info.id;
    /* the session stays open: the regions live as long as the test */
}

/* A good descriptor: T = 2 tokens of layer 3, k = 2; hidden, ids, weights and the output in the
 * host region, ids 1, 5 / 7, -1 (padding, weight 0). */
static moed_ring_request good_desc(void)
{
    moed_ring_request d;
    memset(&d, 0, sizeof d);
    d.ticket = 1;
    d.layer = 3;
    d.dtype = MOED_F32;
    d.tokens = 2;
    d.top_k = 2;
    d.tag = 99;
    d.hidden = (moed_ring_ref){ host_id, 1024, 2 * 4 * 4 };
    d.expert_ids = (moed_ring_ref){ host_id, 2048, 2 * 2 * 4 };
    d.expert_weights = (moed_ring_ref){ host_id, 3072, 2 * 2 * 4 };
    d.output = (moed_ring_ref){ host_id, 4096, 2 * 4 * 4 };
    const int32_t ids[4] = { 1, 5, 7, -1 };
    const float w[4] = { 0.5f, 0.25f, 1.0f, 0.0f };
    memcpy(host_map + 2048, ids, sizeof ids);
    memcpy(host_map + 3072, w, sizeof w);
    memcpy(device_mem + 2048, ids, sizeof ids);
    memcpy(device_mem + 3072, w, sizeof w);
    memcpy(device_mem + 32768 + 3072, w, sizeof w);
    return d;
}

/* Validates d as the poller does: 0 or the code, the message in err. */
static int run(const moed_ring_request *d, moed_work *w, moed_error *err)
{
    moed_wire_request q;
    memset(w, 0, sizeof *w);
    int rc = moed_request_from_ring(&served, d, &q, err);
    return rc ? rc : moed_request_validate(&served, &ring_caller, &q, w, err);
}

static void expect_desc(const moed_ring_request *d, int code, const char *needle)
{
    moed_work w;
    moed_error err = { 0 };
    int rc = run(d, &w, &err);
    CHECK_MSG(rc == code, "%d, not %d: %s", rc, code, err.msg);
    if (needle) CHECK_MSG(strstr(err.msg, needle) != NULL, "'%s' lacks '%s'", err.msg, needle);
    moed_work_free(&w);
}

/* The references the registry counts on region id now (requests holding it). */
static uint32_t held(uint64_t id)
{
    moed_region_info *all;
    int n;
    moed_error err;
    uint32_t refs = 0;
    CHECK_EQ_INT(moed_regions_list(served.regions, 7, &all, &n, &err), 0);
    for (int i = 0; i < n; i++)
        if (all[i].id == id) refs = all[i].requests;
    free(all);
    return refs;
}

static void test_descriptor(void)
{
    moed_ring_request d = good_desc();
    moed_work w;
    moed_error err = { 0 };
    CHECK_EQ_INT(run(&d, &w, &err), 0);
    moed_sched_item *it = &w.item;
    CHECK_EQ_INT(it->slot, 0);
    CHECK_EQ_INT(it->T, 2);
    CHECK_EQ_INT(it->dtype, MOED_F32);
    CHECK(it->mem.route == NULL);
    CHECK_EQ_INT(it->route.off[2], 3); /* the padding pair is left out */
    CHECK_EQ_INT(it->route.expert[2], 7);
    CHECK_EQ_INT(it->pairs, 3);
    CHECK(w.hidden_region && w.out_region && it->mem.x && it->mem.y);
    CHECK_EQ_INT(held(host_id), 2); /* hidden and the output; the choice was copied */
    moed_work_free(&w);
    CHECK_EQ_INT(held(host_id), 0);

    d.flags = 1;
    expect_desc(&d, MOED_EINVAL, "flags = 0x1");
    d = good_desc();
    d.reserved = 3;
    expect_desc(&d, MOED_EINVAL, "reserved word");
    d = good_desc();
    d.layer = 0;
    expect_desc(&d, MOED_ENOTFOUND, "layer 0 is not served");
    d = good_desc();
    d.dtype = MOED_I32;
    expect_desc(&d, MOED_EINVAL, "hidden has dtype");
    d = good_desc();
    d.tokens = 0;
    expect_desc(&d, MOED_EINVAL, "T = 0");
    d = good_desc();
    d.tokens = 65;
    expect_desc(&d, MOED_ETOOBIG, "--max-batch-tokens");
    d = good_desc();
    d.top_k = 0;
    expect_desc(&d, MOED_EINVAL, "expert_ids has shape [2, 0]");
    d = good_desc();
    d.top_k = 3; /* the lengths say 2 */
    expect_desc(&d, MOED_EINVAL, "expert_ids.region.length is 16");
    d = good_desc();
    d.tokens = 64; /* T x k x 4 is a terabyte: the reference is checked before anything is copied */
    d.top_k = UINT32_MAX;
    d.hidden.length = d.output.length = 64 * 16;
    d.output.offset = 8192;
    expect_desc(&d, MOED_EINVAL, "expert_ids.region.length is 16");
    d = good_desc();
    d.hidden.offset = 1026;
    expect_desc(&d, MOED_EINVAL, "hidden.region.offset 1026 is not a multiple of 4");
    d = good_desc();
    d.hidden.offset = UINT64_MAX - 7; /* offset + length wraps */
    expect_desc(&d, MOED_EINVAL, "run past the end");
    d = good_desc();
    d.output.length = 8;
    expect_desc(&d, MOED_EINVAL, "output.region.length is 8");
    d = good_desc();
    d.output.offset = 1024 + 16;
    expect_desc(&d, MOED_EINVAL, "overlaps hidden");
    d = good_desc();
    d.expert_weights.region = 12345;
    expect_desc(&d, MOED_ENOTFOUND, "experts.expert_weights");
    d = good_desc();
    d.top_k = 60; /* 120 pairs (no padding) > --max-batch-pairs 100 */
    d.expert_ids.length = d.expert_weights.length = 2 * 60 * 4;
    d.expert_weights.offset = 8192;
    for (int i = 0; i < 120; i++) ((int32_t *)(host_map + 2048))[i] = i % 8;
    expect_desc(&d, MOED_ETOOBIG, "routes 120 (token, expert) pairs");
}

static void test_device_choice(void)
{
    /* both in CUDA regions of device 0: device routing, both regions held */
    moed_ring_request d = good_desc();
    d.expert_ids = (moed_ring_ref){ cuda0, 2048, 16 };
    d.expert_weights = (moed_ring_ref){ cuda0, 3072, 16 };
    moed_work w;
    moed_error err = { 0 };
    CHECK_EQ_INT(run(&d, &w, &err), 0);
    const moed_sched_item *it = &w.item;
    CHECK(it->mem.route == &w.route);
    CHECK(w.route.ids == (const int32_t *)(device_mem + 2048));
    CHECK(w.route.weights == (const float *)(device_mem + 3072));
    CHECK_EQ_INT(w.route.k, 2);
    CHECK_EQ_INT(w.route.dev, 0);
    CHECK_EQ_INT(it->route.T, 2);
    CHECK_EQ_INT(it->route.off[2], 0);
    CHECK_EQ_INT(it->pairs, 4); /* T x k: padding counts */
    CHECK_EQ_INT(held(cuda0), 2);
    moed_work_free(&w);
    CHECK_EQ_INT(held(cuda0), 0);

    /* ids on device 0, weights on device 1: read to the host and checked there */
    d.expert_weights = (moed_ring_ref){ cuda1, 3072, 16 };
    CHECK_EQ_INT(run(&d, &w, &err), 0);
    CHECK(w.item.mem.route == NULL);
    CHECK_EQ_INT(w.item.route.off[2], 3);
    CHECK_EQ_INT(held(cuda0) + held(cuda1), 0);
    moed_work_free(&w);

    /* ids in a CUDA region, weights in the host region: the same */
    d.expert_weights = (moed_ring_ref){ host_id, 3072, 16 };
    CHECK_EQ_INT(run(&d, &w, &err), 0);
    CHECK(w.item.mem.route == NULL);
    moed_work_free(&w);

    /* a bad id on the device is the backend's to find: validation takes it */
    d.expert_weights = (moed_ring_ref){ cuda0, 3072, 16 };
    ((int32_t *)(device_mem + 2048))[1] = 8;
    CHECK_EQ_INT(run(&d, &w, &err), 0);
    CHECK(w.item.mem.route != NULL);
    moed_work_free(&w);
    /* ... while read to the host, it is refused at once, naming it */
    d.expert_weights = (moed_ring_ref){ cuda1, 3072, 16 };
    expect_desc(&d, MOED_EINVAL, "expert_ids[0][1] is out of range");

    /* k over the layer's experts: to the host */
    d = good_desc();
    d.top_k = 9;
    d.expert_ids = (moed_ring_ref){ cuda0, 4096, 2 * 9 * 4 };
    d.expert_weights = (moed_ring_ref){ cuda0, 8192, 2 * 9 * 4 };
    for (int i = 0; i < 18; i++) {
        ((int32_t *)(device_mem + 4096))[i] = i % 9 == 0 ? 2 : -1;
        ((float *)(device_mem + 8192))[i] = i % 9 == 0 ? 1.0f : 0.0f;
    }
    CHECK_EQ_INT(run(&d, &w, &err), 0);
    CHECK(w.item.mem.route == NULL);
    CHECK_EQ_INT(w.item.route.off[2], 2);
    moed_work_free(&w);

    /* T x k over --max-batch-pairs on the device */
    d = good_desc();
    d.tokens = 51;
    d.hidden.length = d.output.length = 51 * 16;
    d.output.offset = 8192;
    d.expert_ids = (moed_ring_ref){ cuda0, 4096, 51 * 2 * 4 };
    d.expert_weights = (moed_ring_ref){ cuda0, 8192, 51 * 2 * 4 };
    expect_desc(&d, MOED_ETOOBIG, "102 (token, expert) pairs (T x k");
}

int main(void)
{
    test_header();
    setup();
    test_descriptor();
    test_device_choice();
    return check_status("test_doorbell");
}
