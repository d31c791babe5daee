/*
 * fuzz_region — libFuzzer target over what a Regions stream does to its messages: each input is a
 * sequence of RegionCommands (each a 2-byte little-endian length, then its bytes; at most 8) run
 * on a fresh session of a registry (region_cmd.c: protobuf-c decoding, then region.c: names,
 * sizes, caps, the challenge, unregistering; doorbell.c: registering and closing rings, without
 * a poller), with the session closed at the end.
 *
 * Promises checked: every command gets an event that parses, with the command's seq when the
 * command parsed (unknown groups dropped: moed_wire_unpack_bytes; whatever protobuf-c parses as it
 * is parses so too), and a status code a caller can cause (never INTERNAL, UNKNOWN or OK for a
 * command that failed); and closing the session leaves nothing registered and no ring open. The
 * object /moed-fuzz-region-PID exists (4 KiB), so registrations of it (the seeds name it) get past
 * the name and reach mapping, the challenge and confirmation; this harness's getrandom gives every
 * challenge as 16 bytes of 0xab, so a fuzzer that writes nothing never confirms it, and ids count
 * 1, 2, 3, ... The object /moed-fuzz-rings-PID (4 KiB) holds the challenge already and a ring
 * header of 4 slots at offset 256, so its registrations confirm and rings can be registered in it.
 */
#include "fuzz_fake.h"
#include "moed_backend_impl.h"
#include "region_cmd.h"
#include "wire.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static moed_regions *registry;
static moed_doorbell *doorbell;
static moed_served served;
static char object[64], rings_object[64];

static void gone(void)
{
    shm_unlink(object);
    shm_unlink(rings_object);
}

static void setup(void)
{
    snprintf(object, sizeof object, "/moed-fuzz-region-%07d", (int)getpid() % 10000000);
    snprintf(rings_object, sizeof rings_object, "/moed-fuzz-rings--%07d", (int)getpid() % 10000000);
    int fd = shm_open(object, O_CREAT | O_RDWR, 0600);
    if (fd < 0 || ftruncate(fd, 4096)) abort();
    close(fd);
    fd = shm_open(rings_object, O_CREAT | O_RDWR, 0600);
    if (fd < 0 || ftruncate(fd, 4096)) abort();
    unsigned char *m = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) abort();
    memset(m, 0xab, MOED_REGION_CHALLENGE);
    *(moed_ring_header *)(m + 256) = (moed_ring_header){ .magic = MOED_RING_MAGIC,
                                                         .version = MOED_RING_VERSION,
                                                         .header_bytes = MOED_RING_HEADER_BYTES,
                                                         .slot_bytes = MOED_RING_SLOT_BYTES,
                                                         .n_slots = 4 };
    munmap(m, 4096);
    close(fd);
    atexit(gone);
    moed_regions_config rc = { .backend = &fake,
                               .mode = MOED_REGIONS_LOCAL,
                               .max_regions = 4,
                               .max_bytes = 1 << 20,
                               .max_total_bytes = 1 << 20 };
    moed_error err;
    if (moed_regions_create(&rc, &registry, &err)) abort();
    served.regions = registry;
    moed_doorbell_config dc = { .served = &served, .max_rings = 2 };
    if (moed_doorbell_create(&dc, &doorbell, &err)) abort();
}

static void die(const char *why)
{
    fprintf(stderr, "fuzz_region: %s\n", why);
    abort();
}

/* The names in the seeds, "/moed-fuzz-region-0000000" and "/moed-fuzz-rings--0000000", stand
 * for this process's objects. */
static void name_object(uint8_t *cmd, size_t n)
{
    static const char *const seed_names[2] = { "/moed-fuzz-region-0000000",
                                               "/moed-fuzz-rings--0000000" };
    const char *ours[2] = { object, rings_object };
    for (int k = 0; k < 2; k++) {
        const size_t len = strlen(seed_names[k]);
        for (size_t i = 0; i + len <= n; i++)
            if (!memcmp(cmd + i, seed_names[k], len) && strlen(ours[k]) == len)
                memcpy(cmd + i, ours[k], len);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static int ready;
    if (!ready) {
        setup();
        ready = 1;
    }
    moed_region_session *s = moed_regions_open_session(registry, 1);
    for (int k = 0; k < 8 && size >= 2; k++) {
        size_t n = (size_t)data[0] | (size_t)data[1] << 8;
        data += 2;
        size -= 2;
        if (n > size) n = size;
        uint8_t *cmd = malloc(n ? n : 1);
        memcpy(cmd, data, n);
        name_object(cmd, n);
        data += n;
        size -= n;
        size_t len;
        int status;
        uint8_t *ev = moed_region_command(registry, doorbell, NULL, s, cmd, n, &len, &status);
        if (!ev) die("no event");
        Moed__V1__RegionEvent *e = moed__v1__region_event__unpack(NULL, len, ev);
        Moed__V1__RegionCommand *plain = moed__v1__region_command__unpack(NULL, n, cmd), *c;
        moed_error err;
        moed_wire_unpack_bytes(&moed__v1__region_command__descriptor, cmd, n,
                               (ProtobufCMessage **)&c, &err);
        if (plain && !c) die("a command protobuf-c parses is refused");
        if (plain && c && plain->seq != c->seq) die("the seq differs from protobuf-c's");
        if (plain) moed__v1__region_command__free_unpacked(plain, NULL);
        if (!e) die("the event does not parse");
        if (c && e->seq != c->seq) die("the event answers another seq");
        if (e->code != status || status == 2 || status == 13 || status > 16)
            die("a status a caller cannot cause");
        if (!c && status != 3 && status != 8) die("an unparsed command not INVALID_ARGUMENT");
        if (status && !*e->message) die("an error without a message");
        moed__v1__region_event__free_unpacked(e, NULL);
        if (c) moed__v1__region_command__free_unpacked(c, NULL);
        free(ev);
        free(cmd);
    }
    moed_doorbell_close_session(doorbell, s);
    if (moed_doorbell_rings(doorbell)) die("closing the session left a ring open");
    moed_regions_close_session(registry, s);
    moed_regions_stats st;
    moed_regions_get_stats(registry, &st);
    if (st.count[MOED_REGION_HOST] || st.count[MOED_REGION_CUDA])
        die("closing the session left regions registered");
    return 0;
}
