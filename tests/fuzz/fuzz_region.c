/*
 * fuzz_region — libFuzzer target over what a Regions stream does to its messages: each input is a
 * sequence of RegionCommands (each a 2-byte little-endian length, then its bytes; at most 8) run
 * on a fresh session of a registry (region_cmd.c: protobuf-c decoding, then region.c: names,
 * sizes, caps, the challenge, unregistering), with the session closed at the end.
 *
 * Promises checked: every command gets an event that parses, with the command's seq when the
 * command parsed (unknown groups dropped: moed_wire_unpack_bytes; whatever protobuf-c parses as it
 * is parses so too), and a status code a caller can cause (never INTERNAL, UNKNOWN or OK for a
 * command that failed); and closing the session leaves nothing registered. The object
 * /moed-fuzz-region-PID exists (4 KiB), so registrations of it (the seeds name it) get past the
 * name and reach mapping, the challenge and confirmation; this harness's getrandom gives every
 * challenge as 16 bytes of 0xab, so a fuzzer that writes nothing never confirms, and ids count 1,
 * 2, 3, ...
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
static char object[64];

static void gone(void)
{
    shm_unlink(object);
}

static void setup(void)
{
    snprintf(object, sizeof object, "/moed-fuzz-region-%07d", (int)getpid() % 10000000);
    int fd = shm_open(object, O_CREAT | O_RDWR, 0600);
    if (fd < 0 || ftruncate(fd, 4096)) abort();
    close(fd);
    atexit(gone);
    moed_regions_config rc = { .backend = &fake,
                               .mode = MOED_REGIONS_LOCAL,
                               .max_regions = 4,
                               .max_bytes = 1 << 20,
                               .max_total_bytes = 1 << 20 };
    moed_error err;
    if (moed_regions_create(&rc, &registry, &err)) abort();
}

static void die(const char *why)
{
    fprintf(stderr, "fuzz_region: %s\n", why);
    abort();
}

/* The name in the seeds, "/moed-fuzz-region", stands for this process's object. */
static void name_object(uint8_t *cmd, size_t n)
{
    static const char seed_name[] = "/moed-fuzz-region-0000000";
    for (size_t i = 0; i + sizeof seed_name - 1 <= n; i++)
        if (!memcmp(cmd + i, seed_name, sizeof seed_name - 1) &&
            strlen(object) == sizeof seed_name - 1)
            memcpy(cmd + i, object, sizeof seed_name - 1);
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
        uint8_t *ev = moed_region_command(registry, NULL, s, cmd, n, &len, &status);
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
    moed_regions_close_session(registry, s);
    moed_regions_stats st;
    moed_regions_get_stats(registry, &st);
    if (st.count[MOED_REGION_HOST] || st.count[MOED_REGION_CUDA])
        die("closing the session left regions registered");
    return 0;
}
