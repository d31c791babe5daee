/*
 * moed_regions — the table of regions by id, the sessions' lists, reference counts and caps, and
 * the mapping of host regions (region.h states the rules).
 *
 * A region has one reference for being registered (the table's) and one per request that holds
 * it. Unregistering takes it out of the table and the session at once (so no new request finds
 * it) and drops the table's reference; whoever drops the last reference unmaps. Caps count what is
 * mapped, so memory an unregistered region keeps until its last request finishes still counts.
 * What a principal has mapped is kept in a small hash of its own, an entry from its first region
 * to the unmapping of its last (principals are tokens or uids: no bound on their numbers).
 */
#include "region.h"

#include "guard.h"
#include "moed_list.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#define BUCKETS       256
#define USAGE_BUCKETS 64

struct moed_region {
    uint64_t id;
    int kind;
    moed_principal principal;
    moed_region_session *session;
    char name[MOED_REGION_NAME_MAX + 1];
    uint64_t bytes;
    void *mem;       /* host: the mapping; CUDA: the device pointer to the region's byte 0 */
    void *cuda_base; /* CUDA: the opened allocation (what unmap_device takes) */
    int device;
    bool ready, pinned, listed;
    _Atomic bool broken;
    int refs;  /* under the registry's lock */
    int rings; /* open doorbell rings in it (under the lock): it cannot be unregistered meanwhile */
    /* Adopted (a link's buffer): the server's memory, let go by release(release_arg) instead of
     * unmapped, counted against no cap, and never unregistered by the client. */
    void (*release)(void *arg);
    void *release_arg;
    moed_backend *backend; /* set when it is let go (let_go) */
    uint8_t challenge[MOED_REGION_CHALLENGE];
    moed_list by_id, in_session;
};

struct moed_region_session {
    moed_principal principal;
    moed_list regions; /* of moed_region.in_session */
};

typedef struct usage {
    moed_list node; /* in its bucket of usage_buckets */
    moed_principal who;
    int64_t count, bytes; /* mapped now */
} usage;

struct moed_regions {
    moed_regions_config cfg;
    pthread_mutex_t lock;
    moed_list buckets[BUCKETS];             /* of moed_region.by_id: the registered regions */
    moed_list usage_buckets[USAGE_BUCKETS]; /* of usage.node: principals with regions mapped */
    int64_t total_bytes;
    moed_regions_stats stats; /* registered now, by kind */
};

int moed_regions_create(const moed_regions_config *cfg, moed_regions **out, moed_error *err)
{
    *out = NULL;
    moed_regions *r = calloc(1, sizeof *r);
    if (!r) return moed_fail(err, MOED_ENOMEM, "no memory for the region registry");
    r->cfg = *cfg;
    pthread_mutex_init(&r->lock, NULL);
    for (int i = 0; i < BUCKETS; i++) moed_list_init(&r->buckets[i]);
    for (int i = 0; i < USAGE_BUCKETS; i++) moed_list_init(&r->usage_buckets[i]);
    moed_guard_init();
    *out = r;
    return 0;
}

void moed_regions_destroy(moed_regions *r)
{
    if (!r) return;
    pthread_mutex_destroy(&r->lock);
    free(r);
}

int moed_regions_mode(const moed_regions *r)
{
    return r ? r->cfg.mode : MOED_REGIONS_OFF;
}

const moed_regions_config *moed_regions_limits(const moed_regions *r)
{
    return &r->cfg;
}

static moed_list *bucket(moed_regions *r, uint64_t id)
{
    return &r->buckets[(id ^ (id >> 32)) % BUCKETS];
}

static moed_region *find(moed_regions *r, uint64_t id)
{
    moed_list *q, *h = bucket(r, id);
    moed_list_foreach (q, h) {
        moed_region *g = moed_list_data(q, moed_region, by_id);
        if (g->id == id) return g;
    }
    return NULL;
}

static void info_of(const moed_region *g, moed_region_info *out)
{
    memset(out, 0, sizeof *out);
    out->id = g->id;
    out->kind = g->kind;
    memcpy(out->name, g->name, sizeof out->name);
    out->bytes = g->bytes;
    out->device = g->kind == MOED_REGION_CUDA ? g->device : 0;
    out->ready = g->ready;
    out->broken = atomic_load(&g->broken);
    out->requests = (uint32_t)(g->refs - g->listed);
}

/* ---- caps and life cycle ----------------------------------------------------------------- */

/* The principal's usage entry (under the lock), or NULL when it has nothing mapped; with `make`,
 * a new one then (NULL only when out of memory). */
static usage *usage_of(moed_regions *r, moed_principal who, bool make)
{
    moed_list *q, *h = &r->usage_buckets[(uint64_t)who % USAGE_BUCKETS];
    moed_list_foreach (q, h) {
        usage *u = moed_list_data(q, usage, node);
        if (u->who == who) return u;
    }
    usage *u = make ? calloc(1, sizeof *u) : NULL;
    if (u) {
        u->who = who;
        moed_list_insert_tail(h, &u->node);
    }
    return u;
}

/* Drops the principal's entry once it has nothing mapped (under the lock). */
static void usage_trim(usage *u)
{
    if (u->count) return;
    moed_list_remove(&u->node);
    free(u);
}

/* Counts `bytes` more for the principal if the caps allow (under the lock). */
static int reserve(moed_regions *r, moed_principal principal, uint64_t bytes, moed_error *err)
{
    usage *u = usage_of(r, principal, true);
    int rc = 0;
    if (!u) return moed_fail(err, MOED_ENOMEM, "no memory to count a principal's regions");
    if (u->count >= r->cfg.max_regions)
        rc = moed_fail(err, MOED_ETOOBIG,
                       "this principal has %lld regions registered, the most --max-regions "
                       "allows: unregister one first",
                       (long long)u->count);
    else if (bytes > (uint64_t)(r->cfg.max_bytes - u->bytes))
        rc = moed_fail(err, MOED_ETOOBIG,
                       "%llu more bytes would put this principal's regions over "
                       "--max-region-bytes = %lld (%lld registered)",
                       (unsigned long long)bytes, (long long)r->cfg.max_bytes, (long long)u->bytes);
    else if (bytes > (uint64_t)(r->cfg.max_total_bytes - r->total_bytes))
        rc = moed_fail(err, MOED_ETOOBIG,
                       "%llu more bytes would put the server's regions over "
                       "--max-region-bytes-total = %lld (%lld registered)",
                       (unsigned long long)bytes, (long long)r->cfg.max_total_bytes,
                       (long long)r->total_bytes);
    if (rc) {
        usage_trim(u);
        return rc;
    }
    u->count++;
    u->bytes += (int64_t)bytes;
    r->total_bytes += (int64_t)bytes;
    return 0;
}

static void unreserve(moed_regions *r, moed_principal principal, uint64_t bytes)
{
    usage *u = usage_of(r, principal, false);
    u->count--;
    u->bytes -= (int64_t)bytes;
    r->total_bytes -= (int64_t)bytes;
    usage_trim(u);
}

/* The memory of a region no one holds any more, unpinned and unmapped. */
static void let_go(void *arg)
{
    moed_region *g = arg;
    if (g->kind == MOED_REGION_HOST) {
        if (g->pinned) moed_backend_host_unregister(g->backend, g->mem);
        munmap(g->mem, (size_t)g->bytes);
    } else {
        moed_backend_unmap_device(g->backend, g->cuda_base, g->device);
    }
    free(g);
}

/* Lets go of the reservation and (outside the lock) of the memory. Page-locked host memory is
 * let go once the backend is quiet: unpinning it waits for every kernel on the GPU, an idle link's
 * receive among them (moed_backend_when_quiet), so its mapping may outlive the reservation a while;
 * nothing reads or writes it meanwhile. A CUDA region is closed at once: the client may free its
 * allocation as soon as the region is let go, and CUDA leaves a free before the importer's close
 * undefined. */
static void unmap(moed_regions *r, moed_region *g)
{
    if (g->release) {
        g->release(g->release_arg);
        free(g);
        return;
    }
    pthread_mutex_lock(&r->lock);
    unreserve(r, g->principal, g->bytes);
    pthread_mutex_unlock(&r->lock);
    g->backend = r->cfg.backend;
    if (g->kind == MOED_REGION_HOST && g->pinned)
        moed_backend_when_quiet(g->backend, let_go, g);
    else
        let_go(g);
}

/* A new region of the session with a fresh random id, entered into the table (under the lock). */
static void enter(moed_regions *r, moed_region_session *s, moed_region *g)
{
    do {
        if (getrandom(&g->id, sizeof g->id, 0) != sizeof g->id) g->id = 0;
    } while (!g->id || find(r, g->id));
    g->principal = s->principal;
    g->session = s;
    g->listed = true;
    g->refs = 1;
    moed_list_insert_tail(bucket(r, g->id), &g->by_id);
    moed_list_insert_tail(&s->regions, &g->in_session);
    r->stats.count[g->kind]++;
    r->stats.bytes[g->kind] += g->bytes;
}

/* Takes g out of the table and its session (under the lock); true when that was its last
 * reference, and the caller unmaps it. */
static bool leave(moed_regions *r, moed_region *g)
{
    moed_list_remove(&g->by_id);
    moed_list_remove(&g->in_session);
    g->listed = false;
    r->stats.count[g->kind]--;
    r->stats.bytes[g->kind] -= g->bytes;
    return --g->refs == 0;
}

moed_region_session *moed_regions_open_session(moed_regions *r, moed_principal principal)
{
    moed_region_session *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->principal = principal;
    moed_list_init(&s->regions);
    return s;
}

moed_principal moed_region_session_principal(const moed_region_session *s)
{
    return s->principal;
}

void moed_regions_close_session(moed_regions *r, moed_region_session *s)
{
    if (!s) return;
    for (;;) {
        pthread_mutex_lock(&r->lock);
        moed_region *g = moed_list_empty(&s->regions)
                             ? NULL
                             : moed_list_data(moed_list_head(&s->regions), moed_region, in_session);
        bool last = g && leave(r, g);
        pthread_mutex_unlock(&r->lock);
        if (!g) break;
        if (last) unmap(r, g);
    }
    free(s);
}

/* The session's region `id` (under the lock), or NULL. */
static moed_region *own(moed_region_session *s, uint64_t id)
{
    moed_list *q;
    moed_list_foreach (q, &s->regions) {
        moed_region *g = moed_list_data(q, moed_region, in_session);
        if (g->id == id) return g;
    }
    return NULL;
}

static int not_own(uint64_t id, moed_error *err)
{
    return moed_fail(err, MOED_ENOTFOUND,
                     "region %llu is not one this session registered (a region belongs to the "
                     "Regions stream that registered it)",
                     (unsigned long long)id);
}

int moed_regions_unregister(moed_regions *r, moed_region_session *s, uint64_t id,
                            moed_region_info *out, moed_error *err)
{
    pthread_mutex_lock(&r->lock);
    moed_region *g = own(s, id);
    const int rings = g ? g->rings : 0;
    const bool adopted = g && g->release;
    bool last = false;
    if (g && !rings && !adopted) {
        info_of(g, out);
        last = leave(r, g);
    }
    pthread_mutex_unlock(&r->lock);
    if (!g) return not_own(id, err);
    if (adopted)
        return moed_fail(err, MOED_EPRECOND,
                         "region %llu is the buffer of an open NCCL link: close_link the link",
                         (unsigned long long)id);
    if (rings)
        return moed_fail(err, MOED_EPRECOND,
                         "region %llu holds %d open doorbell ring%s: unregister_ring %s first",
                         (unsigned long long)id, rings, rings == 1 ? "" : "s",
                         rings == 1 ? "it" : "them");
    if (last) unmap(r, g);
    return 0;
}

/* ---- host regions -------------------------------------------------------------------------- */

bool moed_region_name_ok(const char *name, size_t len)
{
    if (len < 2 || len > MOED_REGION_NAME_MAX || name[0] != '/') return false;
    for (size_t i = 1; i < len; i++) {
        char c = name[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '.' || c == '_' || c == '-'))
            return false;
        if (c == '.' && i + 1 < len && name[i + 1] == '.') return false;
    }
    return !(len == 2 && name[1] == '.');
}

/* Opens and maps the object (outside the lock); *mem the mapping. */
static int map_host(const char *name, uint64_t bytes, void **mem, moed_error *err)
{
    int fd = shm_open(name, O_RDWR | O_CLOEXEC | O_NOFOLLOW, 0);
    if (fd < 0) {
        int e = errno;
        if (e == ENOENT)
            return moed_fail(err, MOED_ENOTFOUND,
                             "no shared-memory object is named %s: create it (shm_open) before "
                             "registering it",
                             name);
        return moed_fail(err, MOED_EPRECOND,
                         "moed cannot open the shared-memory object %s read-write: %s (it must be "
                         "a file under /dev/shm that moed's user may read and write)",
                         name, strerror(e));
    }
    struct stat st;
    int rc = 0;
    if (fstat(fd, &st))
        rc = moed_fail(err, MOED_EIO, "fstat of %s failed: %s", name, strerror(errno));
    else if (!S_ISREG(st.st_mode))
        rc = moed_fail(err, MOED_EPRECOND, "%s is not a regular shared-memory object", name);
    else if ((uint64_t)st.st_size < bytes)
        rc = moed_fail(err, MOED_EPRECOND,
                       "%s holds %lld bytes, fewer than the %llu registered: ftruncate it first",
                       name, (long long)st.st_size, (unsigned long long)bytes);
    if (!rc) {
        *mem = mmap(NULL, (size_t)bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (*mem == MAP_FAILED)
            rc = moed_fail(err, MOED_ENOMEM, "could not map %llu bytes of %s: %s",
                           (unsigned long long)bytes, name, strerror(errno));
    }
    close(fd);
    return rc;
}

int moed_regions_register_host(moed_regions *r, moed_region_session *s, const char *name,
                               size_t name_len, uint64_t bytes, moed_region_info *out,
                               uint8_t challenge[MOED_REGION_CHALLENGE], moed_error *err)
{
    if (!moed_region_name_ok(name, name_len))
        return moed_fail(err, MOED_EINVAL,
                         "register_host.name must be \"/\" then 1 to %d of A-Z a-z 0-9 . _ - "
                         "(no other \"/\", not \".\" and no \"..\"), e.g. /moed-1234-0",
                         MOED_REGION_NAME_MAX - 1);
    if (bytes < MOED_REGION_CHALLENGE)
        return moed_fail(err, MOED_EINVAL,
                         "register_host.bytes = %llu: a host region holds at least %d bytes (the "
                         "challenge)",
                         (unsigned long long)bytes, MOED_REGION_CHALLENGE);
    if (bytes > SIZE_MAX / 2)
        return moed_fail(err, MOED_EINVAL,
                         "register_host.bytes = %llu is more than this server can map (at most "
                         "%zu): give the object's size",
                         (unsigned long long)bytes, SIZE_MAX / 2);
    moed_region *g = calloc(1, sizeof *g);
    if (!g) return moed_fail(err, MOED_ENOMEM, "no memory for a region");
    g->kind = MOED_REGION_HOST;
    g->bytes = bytes;
    memcpy(g->name, name, name_len);
    pthread_mutex_lock(&r->lock);
    int rc = reserve(r, s->principal, bytes, err);
    pthread_mutex_unlock(&r->lock);
    const bool reserved = !rc;
    if (!rc) rc = map_host(g->name, bytes, &g->mem, err);
    if (!rc && getrandom(g->challenge, sizeof g->challenge, 0) != sizeof g->challenge) {
        munmap(g->mem, (size_t)bytes);
        rc = moed_fail(err, MOED_EIO, "getrandom failed: %s", strerror(errno));
    }
    pthread_mutex_lock(&r->lock);
    if (rc && reserved) unreserve(r, s->principal, bytes);
    if (!rc) {
        enter(r, s, g);
        info_of(g, out);
        memcpy(challenge, g->challenge, sizeof g->challenge);
    }
    pthread_mutex_unlock(&r->lock);
    if (rc) free(g);
    return rc;
}

int moed_region_broken(moed_region *g, moed_error *err)
{
    atomic_store(&g->broken, true);
    return moed_fail(err, MOED_EPRECOND,
                     "region %llu (%s) shrank under the server: its shared-memory object no longer "
                     "holds the %llu bytes registered; the region is unusable: unregister it and "
                     "register the object again",
                     (unsigned long long)g->id, g->name, (unsigned long long)g->bytes);
}

int moed_regions_confirm_host(moed_regions *r, moed_region_session *s, uint64_t id,
                              moed_region_info *out, moed_error *err)
{
    pthread_mutex_lock(&r->lock);
    moed_region *g = own(s, id);
    int rc = !g                            ? not_own(id, err)
             : g->kind != MOED_REGION_HOST ? moed_fail(err, MOED_EPRECOND,
                                                       "region %llu is a CUDA region: there is "
                                                       "nothing to confirm",
                                                       (unsigned long long)id)
             : g->ready ? moed_fail(err, MOED_EPRECOND, "region %llu is confirmed already",
                                    (unsigned long long)id)
                        : 0;
    if (!rc) g->refs++; /* held while it is read and pinned outside the lock */
    pthread_mutex_unlock(&r->lock);
    if (rc) return rc;
    uint8_t seen[MOED_REGION_CHALLENGE];
    if (moed_guard_copy(seen, g->mem, sizeof seen))
        rc = moed_region_broken(g, err);
    else if (memcmp(seen, g->challenge, sizeof seen))
        rc = moed_fail(err, MOED_EPRECOND,
                       "the first %d bytes of %s are not the challenge: write "
                       "RegionEvent.challenge at offset 0 of the object, then confirm",
                       MOED_REGION_CHALLENGE, g->name);
    else if (!(rc = moed_backend_host_register(r->cfg.backend, g->mem, (size_t)g->bytes, err)))
        g->pinned = true;
    pthread_mutex_lock(&r->lock);
    if (!rc) g->ready = true;
    info_of(g, out);
    bool last = --g->refs == 0;
    pthread_mutex_unlock(&r->lock);
    if (last) unmap(r, g); /* the session ended meanwhile */
    return rc;
}

/* ---- CUDA regions -------------------------------------------------------------------------- */

int moed_regions_register_cuda(moed_regions *r, moed_region_session *s, const void *handle,
                               size_t handle_len, const char *device_uuid, int device,
                               uint64_t bytes, uint64_t offset, moed_region_info *out,
                               moed_error *err)
{
    if (!bytes)
        return moed_fail(err, MOED_EINVAL, "register_cuda.bytes is 0: give the region's size");
    moed_region *g = calloc(1, sizeof *g);
    if (!g) return moed_fail(err, MOED_ENOMEM, "no memory for a region");
    g->kind = MOED_REGION_CUDA;
    g->bytes = bytes;
    pthread_mutex_lock(&r->lock);
    int rc = reserve(r, s->principal, bytes, err);
    pthread_mutex_unlock(&r->lock);
    const bool reserved = !rc;
    if (!rc)
        rc = moed_backend_map_device(r->cfg.backend, handle, handle_len, device_uuid, device, bytes,
                                     offset, &g->mem, &g->device, &g->cuda_base, err);
    pthread_mutex_lock(&r->lock);
    if (rc && reserved) unreserve(r, s->principal, bytes);
    if (!rc) {
        g->ready = true;
        enter(r, s, g);
        info_of(g, out);
    }
    pthread_mutex_unlock(&r->lock);
    if (rc) free(g);
    return rc;
}

/* ---- rings ---------------------------------------------------------------------------------- */

moed_region *moed_regions_hold_ring(moed_regions *r, moed_region_session *s, uint64_t id,
                                    void **mem, uint64_t *bytes, moed_error *err)
{
    pthread_mutex_lock(&r->lock);
    moed_region *g = own(s, id);
    int rc = !g ? not_own(id, err)
             : g->kind != MOED_REGION_HOST
                 ? moed_fail(err, MOED_EPRECOND,
                             "region %llu is a CUDA region: a ring lies in a host region (shared "
                             "memory the server's CPU polls)",
                             (unsigned long long)id)
             : !g->ready ? moed_fail(err, MOED_EPRECOND,
                                     "region %llu is not confirmed yet: confirm_host it first",
                                     (unsigned long long)id)
                         : 0;
    if (!rc && atomic_load(&g->broken)) rc = moed_region_broken(g, err);
    if (!rc) {
        g->refs++;
        g->rings++;
        *mem = g->mem;
        *bytes = g->bytes;
    }
    pthread_mutex_unlock(&r->lock);
    return rc ? NULL : g;
}

void moed_region_unring(moed_regions *r, moed_region *g)
{
    pthread_mutex_lock(&r->lock);
    g->rings--;
    pthread_mutex_unlock(&r->lock);
}

/* ---- adopted memory -------------------------------------------------------------------------- */

moed_region *moed_regions_adopt(moed_regions *r, moed_region_session *s, void *mem, uint64_t bytes,
                                int dev, void (*release)(void *arg), void *arg, moed_error *err)
{
    moed_region *g = calloc(1, sizeof *g);
    if (!g) {
        moed_fail(err, MOED_ENOMEM, "no memory for a region");
        return NULL;
    }
    *g = (moed_region){ .kind = MOED_REGION_CUDA,
                        .bytes = bytes,
                        .mem = mem,
                        .device = dev,
                        .ready = true,
                        .release = release,
                        .release_arg = arg };
    snprintf(g->name, sizeof g->name, "nccl link");
    pthread_mutex_lock(&r->lock);
    enter(r, s, g);
    g->refs++; /* the adopter's */
    pthread_mutex_unlock(&r->lock);
    return g;
}

uint64_t moed_region_id(const moed_region *g)
{
    return g->id;
}

void moed_region_disown(moed_regions *r, moed_region *g)
{
    pthread_mutex_lock(&r->lock);
    if (g->listed) leave(r, g); /* the table's reference: the adopter's is still held */
    bool last = --g->refs == 0;
    pthread_mutex_unlock(&r->lock);
    if (last) unmap(r, g);
}

/* ---- requests ------------------------------------------------------------------------------ */

moed_region *moed_regions_acquire(moed_regions *r, moed_principal principal, uint64_t id,
                                  moed_error *err)
{
    pthread_mutex_lock(&r->lock);
    moed_region *g = find(r, id);
    if (g && (g->principal != principal || !g->ready)) g = NULL;
    if (g) g->refs++;
    pthread_mutex_unlock(&r->lock);
    if (!g) {
        moed_fail(err, MOED_ENOTFOUND,
                  "region %llu is not registered for this caller (unknown, released with its "
                  "session, or not yet confirmed); ListRegions lists the caller's regions",
                  (unsigned long long)id);
        return NULL;
    }
    if (atomic_load(&g->broken)) {
        moed_region_broken(g, err);
        moed_region_release(r, g);
        return NULL;
    }
    return g;
}

void moed_region_release(moed_regions *r, moed_region *g)
{
    if (!g) return;
    pthread_mutex_lock(&r->lock);
    bool last = --g->refs == 0;
    pthread_mutex_unlock(&r->lock);
    if (last) unmap(r, g);
}

int moed_region_resolve(const moed_region *g, uint64_t offset, uint64_t length, uint64_t want,
                        size_t align, const char *what, void **ptr, int *dev, moed_error *err)
{
    if (length != want)
        return moed_fail(err, MOED_EINVAL,
                         "%s.region.length is %llu, but the tensor's shape and dtype need exactly "
                         "%llu bytes",
                         what, (unsigned long long)length, (unsigned long long)want);
    if (offset % align)
        return moed_fail(err, MOED_EINVAL,
                         "%s.region.offset %llu is not a multiple of %zu, the element size", what,
                         (unsigned long long)offset, align);
    if (offset > g->bytes || length > g->bytes - offset)
        return moed_fail(err, MOED_EINVAL,
                         "%s.region: offset %llu + length %llu run past the end of region %llu "
                         "(%llu bytes)",
                         what, (unsigned long long)offset, (unsigned long long)length,
                         (unsigned long long)g->id, (unsigned long long)g->bytes);
    *ptr = (char *)g->mem + offset;
    *dev = g->kind == MOED_REGION_CUDA ? g->device : MOED_HOST_MEM;
    return 0;
}

bool moed_region_direct(const moed_regions *r, const moed_region *g)
{
    return g->kind == MOED_REGION_CUDA || moed_backend_host_dma(r->cfg.backend);
}

int moed_region_copy_in(moed_regions *r, moed_region *g, void *dst, const void *p, size_t n,
                        moed_error *err)
{
    if (g->kind == MOED_REGION_CUDA)
        return moed_backend_read_device(r->cfg.backend, dst, p, g->device, n, err);
    return moed_guard_copy(dst, p, n) ? moed_region_broken(g, err) : 0;
}

int moed_region_copy_out(moed_regions *r, moed_region *g, void *p, const void *src, size_t n,
                         moed_error *err)
{
    (void)r;
    return moed_guard_copy(p, src, n) ? moed_region_broken(g, err) : 0;
}

/* ---- listings ------------------------------------------------------------------------------ */

int moed_regions_list(moed_regions *r, moed_principal principal, moed_region_info **out, int *n,
                      moed_error *err)
{
    *out = NULL;
    *n = 0;
    pthread_mutex_lock(&r->lock);
    const usage *u = usage_of(r, principal, false);
    int cap = (u ? (int)u->count : 0) + 1;
    moed_region_info *a = calloc((size_t)cap, sizeof *a);
    for (int b = 0; a && b < BUCKETS; b++) {
        moed_list *q;
        moed_list_foreach (q, &r->buckets[b]) {
            moed_region *g = moed_list_data(q, moed_region, by_id);
            if (g->principal == principal && *n < cap) info_of(g, &a[(*n)++]);
        }
    }
    pthread_mutex_unlock(&r->lock);
    if (!a) return moed_fail(err, MOED_ENOMEM, "no memory to list regions");
    *out = a;
    return 0;
}

void moed_regions_get_stats(moed_regions *r, moed_regions_stats *out)
{
    if (!r) {
        memset(out, 0, sizeof *out);
        return;
    }
    pthread_mutex_lock(&r->lock);
    *out = r->stats;
    pthread_mutex_unlock(&r->lock);
}
