/*
 * test_region — the region registry (region.h), its guard (guard.h) and the staging pool
 * (bufpool.h), against real POSIX shared memory and the CPU backend (no DMA: every access is a
 * guarded copy): names; the two-step registration and its challenge; ownership by principal (uids
 * and tokens, caps each its own), with the same answer for another principal's id as for an
 * unknown one; bounds with overflow,
 * alignment and length; a region shrunk under the registry (the copy fails, the region is broken
 * for good, the process lives); references outliving an unregister and a session's end; caps and
 * their release; a region let go while the backend is not quiet (moed_backend_when_quiet: its
 * reservation back at once, its memory unpinned later); CUDA regions refused; the pool's first
 * fit, coalescing and exhaustion.
 */
#include "bufpool.h"
#include "check.h"
#include "cpu_backend.h"
#include "guard.h"
#include "moed_backend_impl.h" /* test_let_go_when_quiet's backend fills the table */
#include "region.h"

#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static moed_backend *cpu;

/* A shared-memory object of `bytes`, named /moed-unit-<pid>-<n>, mapped here in *map. */
static void make_shm(int n, size_t bytes, char *name, size_t len, unsigned char **map)
{
    snprintf(name, len, "/moed-unit-%d-%d", (int)getpid(), n);
    int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
    CHECK(fd >= 0 && ftruncate(fd, (off_t)bytes) == 0);
    *map = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    CHECK(*map != MAP_FAILED);
    close(fd);
}

static moed_regions *open_registry(int64_t max_regions, int64_t max_bytes, int64_t total)
{
    moed_regions_config c = { .backend = cpu,
                              .mode = MOED_REGIONS_LOCAL,
                              .max_regions = max_regions,
                              .max_bytes = max_bytes,
                              .max_total_bytes = total };
    moed_regions *r;
    moed_error err;
    CHECK_EQ_INT(moed_regions_create(&c, &r, &err), 0);
    return r;
}

/* Registers and confirms name for session s; its id. */
static uint64_t host(moed_regions *r, moed_region_session *s, const char *name, size_t bytes,
                     unsigned char *map)
{
    moed_region_info info;
    uint8_t ch[MOED_REGION_CHALLENGE];
    moed_error err;
    CHECK_EQ_INT(moed_regions_register_host(r, s, name, strlen(name), bytes, &info, ch, &err), 0);
    CHECK(!info.ready && info.id != 0);
    memcpy(map, ch, sizeof ch);
    CHECK_EQ_INT(moed_regions_confirm_host(r, s, info.id, &info, &err), 0);
    CHECK(info.ready);
    return info.id;
}

static void test_names(void)
{
    const char *good[] = { "/a", "/moed-1234-0", "/A.b_c-9", "/.hidden", "/a.b" };
    const char *bad[] = { "", "/", "a", "//a", "/a/b", "/..", "/a..b", "/.", "/a b", "/a\\b" };
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++)
        CHECK_MSG(moed_region_name_ok(good[i], strlen(good[i])), "%s", good[i]);
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        CHECK_MSG(!moed_region_name_ok(bad[i], strlen(bad[i])), "%s", bad[i]);
    char longest[MOED_REGION_NAME_MAX + 2];
    memset(longest, 'x', sizeof longest);
    longest[0] = '/';
    CHECK(moed_region_name_ok(longest, MOED_REGION_NAME_MAX));
    CHECK(!moed_region_name_ok(longest, MOED_REGION_NAME_MAX + 1));
}

static void test_register_and_use(void)
{
    moed_regions *r = open_registry(8, 1 << 20, 1 << 20);
    moed_region_session *s = moed_regions_open_session(r, 1);
    moed_region_info info;
    uint8_t ch[MOED_REGION_CHALLENGE];
    moed_error err;
    char name[64];
    unsigned char *map;
    make_shm(0, 4096, name, sizeof name, &map);
    CHECK_EQ_INT(moed_regions_register_host(r, s, "/moed-unit-none", 15, 4096, &info, ch, &err),
                 MOED_ENOTFOUND);
    CHECK_EQ_INT(moed_regions_register_host(r, s, name, strlen(name), 8192, &info, ch, &err),
                 MOED_EPRECOND); /* smaller than registered */
    CHECK(strstr(err.msg, "fewer than") != NULL);
    CHECK_EQ_INT(moed_regions_register_host(r, s, name, strlen(name), 4096, &info, ch, &err), 0);
    uint64_t id = info.id;
    CHECK(moed_regions_acquire(r, 1, id, &err) == NULL); /* not usable before the confirm */
    CHECK_EQ_INT(moed_regions_confirm_host(r, s, id, &info, &err), MOED_EPRECOND);
    CHECK(strstr(err.msg, "challenge") != NULL);
    memcpy(map, ch, sizeof ch);
    CHECK_EQ_INT(moed_regions_confirm_host(r, s, id, &info, &err), 0);
    CHECK_EQ_INT(moed_regions_confirm_host(r, s, id, &info, &err), MOED_EPRECOND);

    /* another principal's id reads as an id that never was */
    moed_error e_other, e_unknown;
    CHECK(moed_regions_acquire(r, 2, id, &e_other) == NULL);
    CHECK(moed_regions_acquire(r, 2, 42, &e_unknown) == NULL);
    CHECK_EQ_INT(e_other.code, MOED_ENOTFOUND);
    CHECK_EQ_INT(e_unknown.code, MOED_ENOTFOUND);
    char a[64], b[64];
    snprintf(a, sizeof a, "%llu", (unsigned long long)id);
    CHECK(strstr(e_other.msg, a) && strstr(e_unknown.msg, "42 "));
    CHECK(!strcmp(strstr(e_other.msg, a) + strlen(a), strstr(e_unknown.msg, "42 ") + 2));
    (void)b;

    moed_region *g = moed_regions_acquire(r, 1, id, &err);
    CHECK(g != NULL);
    void *p;
    int dev;
    CHECK_EQ_INT(moed_region_resolve(g, 4096 - 64, 64, 64, 4, "hidden", &p, &dev, &err), 0);
    CHECK(dev == MOED_HOST_MEM && !moed_region_direct(r, g)); /* the CPU backend: guarded copies */
    CHECK_EQ_INT(moed_region_resolve(g, 4096 - 60, 64, 64, 4, "hidden", &p, &dev, &err),
                 MOED_EINVAL);
    CHECK(strstr(err.msg, "run past the end") != NULL);
    CHECK_EQ_INT(moed_region_resolve(g, UINT64_MAX - 7, 64, 64, 4, "hidden", &p, &dev, &err),
                 MOED_EINVAL); /* offset + length overflows */
    CHECK_EQ_INT(moed_region_resolve(g, 2, 64, 64, 4, "hidden", &p, &dev, &err), MOED_EINVAL);
    CHECK(strstr(err.msg, "multiple of 4") != NULL);
    CHECK_EQ_INT(moed_region_resolve(g, 0, 60, 64, 4, "hidden", &p, &dev, &err), MOED_EINVAL);
    /* guarded copies both ways */
    CHECK_EQ_INT(moed_region_resolve(g, 64, 64, 64, 4, "hidden", &p, &dev, &err), 0);
    unsigned char buf[64], back[64];
    for (int i = 0; i < 64; i++) buf[i] = (unsigned char)(i * 3);
    CHECK_EQ_INT(moed_region_copy_out(r, g, p, buf, 64, &err), 0);
    CHECK(!memcmp(map + 64, buf, 64));
    CHECK_EQ_INT(moed_region_copy_in(r, g, back, p, 64, &err), 0);
    CHECK(!memcmp(back, buf, 64));

    /* unregistered while held: unknown at once, readable until let go */
    CHECK_EQ_INT(moed_regions_unregister(r, s, id, &info, &err), 0);
    CHECK(moed_regions_acquire(r, 1, id, &err) == NULL && err.code == MOED_ENOTFOUND);
    CHECK_EQ_INT(moed_regions_unregister(r, s, id, &info, &err), MOED_ENOTFOUND);
    CHECK_EQ_INT(moed_region_copy_in(r, g, back, p, 64, &err), 0);
    moed_regions_stats st;
    moed_regions_get_stats(r, &st);
    CHECK_EQ_INT(st.count[MOED_REGION_HOST], 0);
    moed_region_release(r, g); /* the last reference: unmapped now */

    /* CUDA regions need the cuda backend */
    CHECK_EQ_INT(moed_regions_register_cuda(r, s, "0123456789", 10, "", 0, 64, 0, &info, &err),
                 MOED_EPRECOND);
    CHECK(strstr(err.msg, "cpu backend") != NULL);
    moed_regions_close_session(r, s);
    moed_regions_destroy(r);
    munmap(map, 4096);
    shm_unlink(name);
}

/* A client shrinks the object: copies fail instead of killing the process, for good. */
static void test_shrunk(void)
{
    moed_regions *r = open_registry(8, 1 << 20, 1 << 20);
    moed_region_session *s = moed_regions_open_session(r, 0);
    char name[64];
    unsigned char *map;
    make_shm(1, 65536, name, sizeof name, &map);
    uint64_t id = host(r, s, name, 65536, map);
    moed_error err;
    moed_region *g = moed_regions_acquire(r, 0, id, &err);
    void *p;
    int dev;
    CHECK_EQ_INT(moed_region_resolve(g, 8192, 4096, 4096, 2, "hidden", &p, &dev, &err), 0);
    int fd = shm_open(name, O_RDWR, 0);
    CHECK(fd >= 0 && ftruncate(fd, 0) == 0);
    close(fd);
    unsigned char buf[4096];
    CHECK_EQ_INT(moed_region_copy_in(r, g, buf, p, sizeof buf, &err), MOED_EPRECOND);
    CHECK(strstr(err.msg, "shrank under the server") && strstr(err.msg, name));
    CHECK_EQ_INT(moed_region_copy_out(r, g, p, buf, sizeof buf, &err), MOED_EPRECOND);
    moed_region_release(r, g);
    CHECK(moed_regions_acquire(r, 0, id, &err) == NULL && err.code == MOED_EPRECOND);
    CHECK_EQ_INT(moed_guard_copy(buf, map, 16), MOED_EPRECOND); /* the guard itself */
    moed_region_info *list;
    int n;
    CHECK_EQ_INT(moed_regions_list(r, 0, &list, &n, &err), 0);
    CHECK(n == 1 && list[0].broken);
    free(list);
    moed_regions_close_session(r, s);
    moed_regions_destroy(r);
    munmap(map, 65536);
    shm_unlink(name);
}

/* Caps count mapped memory: a region released late still counts until its last reference. */
static void test_caps_and_sessions(void)
{
    moed_regions *r = open_registry(2, 3 * 4096, 3 * 4096);
    moed_region_session *s = moed_regions_open_session(r, 3), *t = moed_regions_open_session(r, 4);
    char names[4][64];
    unsigned char *maps[4];
    for (int i = 0; i < 4; i++) make_shm(10 + i, 4096, names[i], sizeof names[i], &maps[i]);
    moed_region_info info;
    uint8_t ch[MOED_REGION_CHALLENGE];
    moed_error err;
    uint64_t a = host(r, s, names[0], 4096, maps[0]);
    host(r, s, names[1], 4096, maps[1]);
    CHECK_EQ_INT(
        moed_regions_register_host(r, s, names[2], strlen(names[2]), 4096, &info, ch, &err),
        MOED_ETOOBIG); /* a third region for this principal */
    CHECK(strstr(err.msg, "--max-regions") != NULL);
    host(r, t, names[2], 4096, maps[2]);
    CHECK_EQ_INT(
        moed_regions_register_host(r, t, names[3], strlen(names[3]), 4096, &info, ch, &err),
        MOED_ETOOBIG); /* the process-wide total */
    CHECK(strstr(err.msg, "--max-region-bytes-total") != NULL);
    moed_region *held = moed_regions_acquire(r, 3, a, &err);
    moed_regions_close_session(r, s); /* releases both; `a` stays mapped while held */
    moed_regions_stats st;
    moed_regions_get_stats(r, &st);
    CHECK_EQ_INT(st.count[MOED_REGION_HOST], 1);
    moed_region_info *list;
    int n;
    CHECK_EQ_INT(moed_regions_list(r, 3, &list, &n, &err), 0);
    CHECK_EQ_INT(n, 0);
    free(list);
    CHECK_EQ_INT(
        moed_regions_register_host(r, t, names[3], strlen(names[3]), 8192, &info, ch, &err),
        MOED_ETOOBIG); /* `a` still counts */
    moed_region_release(r, held);
    uint64_t d = host(r, t, names[3], 4096, maps[3]);
    CHECK(d != 0);
    moed_regions_close_session(r, t);
    moed_regions_get_stats(r, &st);
    CHECK(st.count[MOED_REGION_HOST] == 0 && st.bytes[MOED_REGION_HOST] == 0);
    moed_regions_destroy(r);
    for (int i = 0; i < 4; i++) {
        munmap(maps[i], 4096);
        shm_unlink(names[i]);
    }
}

/* Principals are uids and tokens, any number of each: caps and lists stay each one's own, and one
 * refused for its cap leaves nothing counted. */
static void test_uid_and_token_principals(void)
{
    const moed_principal who[] = { 0, 65534, 4000000000u, MOED_PRINCIPAL_TOKEN(1),
                                   MOED_PRINCIPAL_TOKEN(64) };
    enum { N = sizeof who / sizeof who[0] };
    moed_regions *r = open_registry(1, 4096, N * 4096);
    moed_region_session *s[N];
    unsigned char *maps[N + 1];
    char names[N + 1][64];
    uint64_t id[N];
    moed_region_info info;
    uint8_t ch[MOED_REGION_CHALLENGE];
    moed_error err;
    for (int i = 0; i <= N; i++) make_shm(20 + i, 4096, names[i], sizeof names[i], &maps[i]);
    for (int i = 0; i < N; i++) {
        s[i] = moed_regions_open_session(r, who[i]);
        id[i] = host(r, s[i], names[i], 4096, maps[i]);
        CHECK_EQ_INT(
            moed_regions_register_host(r, s[i], names[N], strlen(names[N]), 4096, &info, ch, &err),
            MOED_ETOOBIG); /* its own cap of one, whoever else has one */
    }
    for (int i = 0; i < N; i++) {
        moed_region_info *list;
        int n;
        CHECK_EQ_INT(moed_regions_list(r, who[i], &list, &n, &err), 0);
        CHECK(n == 1 && list[0].id == id[i]);
        free(list);
        for (int j = 0; j < N; j++) {
            moed_region *g = moed_regions_acquire(r, who[i], id[j], &err);
            CHECK(!g == (i != j));
            moed_region_release(r, g);
        }
    }
    moed_regions_close_session(r, s[1]);
    moed_region_session *again = moed_regions_open_session(r, who[1]);
    CHECK(host(r, again, names[N], 4096, maps[N]) != 0); /* nothing of the first is counted */
    moed_regions_close_session(r, again);
    for (int i = 0; i < N; i++)
        if (i != 1) moed_regions_close_session(r, s[i]);
    for (int i = 0; i <= N; i++) {
        munmap(maps[i], 4096);
        shm_unlink(names[i]);
    }
    moed_regions_destroy(r);
}

/* A backend whose when_quiet puts every call off (as CUDA's does while a link is live) and which
 * counts its host_unregister calls: the CPU backend's table otherwise. */
static struct {
    void (*fn)(void *arg);
    void *arg;
    int put_off, unregistered;
} quiet;

static void put_off(moed_backend *b, void (*fn)(void *arg), void *arg)
{
    (void)b;
    CHECK(quiet.fn == NULL); /* the test runs each before the next */
    quiet.fn = fn;
    quiet.arg = arg;
    quiet.put_off++;
}

static void count_unregister(moed_backend *b, void *p)
{
    (void)b;
    (void)p;
    quiet.unregistered++;
}

static void run_put_off(void)
{
    void (*fn)(void *arg) = quiet.fn;
    quiet.fn = NULL;
    if (fn) fn(quiet.arg);
}

/* A region let go while the backend is not quiet: its reservation comes back at once (a cap of one
 * region takes the next), its memory stays pinned and mapped until the backend runs the call. */
static void test_let_go_when_quiet(void)
{
    moed_backend_ops ops = *cpu->ops;
    ops.when_quiet = put_off;
    ops.host_unregister = count_unregister;
    moed_backend fake = *cpu;
    fake.ops = &ops;
    moed_regions_config c = { .backend = &fake,
                              .mode = MOED_REGIONS_LOCAL,
                              .max_regions = 1,
                              .max_bytes = 1 << 20,
                              .max_total_bytes = 1 << 20 };
    moed_regions *r;
    moed_error err;
    CHECK_EQ_INT(moed_regions_create(&c, &r, &err), 0);
    moed_region_session *s = moed_regions_open_session(r, 1);
    char name[2][64];
    unsigned char *map[2];
    make_shm(20, 4096, name[0], sizeof name[0], &map[0]);
    make_shm(21, 4096, name[1], sizeof name[1], &map[1]);
    moed_region_info info;
    const uint64_t first = host(r, s, name[0], 4096, map[0]);
    CHECK_EQ_INT(moed_regions_unregister(r, s, first, &info, &err), 0);
    CHECK(quiet.put_off == 1 && quiet.unregistered == 0);
    const uint64_t second = host(r, s, name[1], 4096, map[1]); /* the cap of one: freed at once */
    run_put_off();
    CHECK_EQ_INT(quiet.unregistered, 1);
    moed_regions_close_session(r, s); /* the second, put off in turn */
    CHECK(quiet.put_off == 2 && quiet.unregistered == 1);
    run_put_off();
    CHECK_EQ_INT(quiet.unregistered, 2);
    (void)second;
    moed_regions_destroy(r);
    for (int i = 0; i < 2; i++) {
        munmap(map[i], 4096);
        shm_unlink(name[i]);
    }
}

static void test_pool(void)
{
    moed_bufpool *p;
    moed_error err;
    CHECK_EQ_INT(moed_bufpool_create(cpu, 40 * 1024, &p, &err), 0);
    void *b[16];
    int n = 0;
    while (n < 16 && (b[n] = moed_bufpool_get(p, 3000))) {
        CHECK((uintptr_t)b[n] % 64 == 0);
        memset(b[n], n, 3000);
        n++;
    }
    CHECK(n > 10 && n < 16); /* 3000 bytes take 3328 with the header */
    CHECK(moed_bufpool_get(p, 3000) == NULL);
    for (int i = 0; i < n; i += 2) moed_bufpool_put(b[i]); /* every other: fragments */
    CHECK(moed_bufpool_get(p, 8000) == NULL);              /* no room in one piece */
    for (int i = 1; i < n; i += 2) moed_bufpool_put(b[i]); /* and they all coalesce */
    CHECK_EQ_INT(moed_bufpool_used(p), 0);
    void *all = moed_bufpool_get(p, 40 * 1024 - 256);
    CHECK(all != NULL && moed_bufpool_get(p, 1) == NULL);
    moed_bufpool_put(all);
    moed_bufpool_put(NULL);
    moed_bufpool_destroy(p);
    CHECK_EQ_INT(moed_bufpool_create(cpu, 0, &p, &err), 0); /* a pool that never has room */
    CHECK(moed_bufpool_get(p, 1) == NULL);
    moed_bufpool_destroy(p);
}

int main(void)
{
    moed_backend_config bc = { .threads = 1, .max_tokens = 8 };
    moed_error err;
    CHECK_EQ_INT(moed_backend_cpu_open(&bc, &cpu, &err), 0);
    test_names();
    test_register_and_use();
    test_shrunk();
    test_caps_and_sessions();
    test_uid_and_token_principals();
    test_let_go_when_quiet();
    test_pool();
    moed_backend_destroy(cpu);
    return check_status("test_region");
}
