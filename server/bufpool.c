/*
 * moed_bufpool — first fit over a sorted array of free extents, coalesced on every put.
 *
 * Why not fixed-size buffers: a request's size ranges from a few KiB (T = 1) to the whole batch
 * (hundreds of MiB), and one size class per possible size would take the pool many times over.
 * Each buffer carries its extent's size and its pool in a header just before it, so put needs no
 * lookup and no pool argument.
 */
#include "bufpool.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Bytes: the granule of every size, and of a buffer's header; buffers keep the arena's alignment
 * (64 bytes from host_alloc, a page when pinned). */
#define GRAIN 256

typedef struct header {
    size_t len; /* of the extent, header included */
    moed_bufpool *pool;
} header;

typedef struct extent {
    size_t off, len; /* in bytes from the arena's start, multiples of GRAIN */
} extent;

struct moed_bufpool {
    moed_backend *backend;
    char *arena;
    size_t size, used;
    pthread_mutex_t lock;
    extent *free; /* sorted by offset, never adjacent (coalesced) */
    size_t n_free, cap_free;
};

int moed_bufpool_create(moed_backend *b, size_t bytes, moed_bufpool **out, moed_error *err)
{
    *out = NULL;
    moed_bufpool *p = calloc(1, sizeof *p);
    if (!p) return moed_fail(err, MOED_ENOMEM, "no memory for the staging pool");
    p->backend = b;
    p->size = bytes / GRAIN * GRAIN;
    /* every extent is at least GRAIN apart from the next, so this many always suffice */
    p->cap_free = p->size / (2 * GRAIN) + 1;
    pthread_mutex_init(&p->lock, NULL);
    p->free = malloc(p->cap_free * sizeof *p->free);
    if (p->size) p->arena = moed_backend_host_alloc(b, p->size);
    if (!p->free || (p->size && !p->arena)) {
        moed_bufpool_destroy(p);
        return moed_fail(err, MOED_ENOMEM,
                         "no memory for the %zu-byte staging pool (--staging-pool): lower it, or "
                         "set it to 0 to go without",
                         bytes);
    }
    if (p->size) p->free[p->n_free++] = (extent){ 0, p->size };
    *out = p;
    return 0;
}

void moed_bufpool_destroy(moed_bufpool *p)
{
    if (!p) return;
    moed_backend_host_free(p->backend, p->arena);
    free(p->free);
    pthread_mutex_destroy(&p->lock);
    free(p);
}

void *moed_bufpool_get(moed_bufpool *p, size_t n)
{
    if (!p || n > p->size) return NULL;
    const size_t need = (n + GRAIN - 1) / GRAIN * GRAIN + GRAIN; /* with its header */
    char *buf = NULL;
    pthread_mutex_lock(&p->lock);
    for (size_t i = 0; i < p->n_free; i++) {
        extent *e = &p->free[i];
        if (e->len < need) continue;
        buf = p->arena + e->off + GRAIN;
        *(header *)(buf - GRAIN) = (header){ need, p };
        e->off += need;
        e->len -= need;
        if (!e->len) {
            memmove(e, e + 1, (p->n_free - i - 1) * sizeof *e);
            p->n_free--;
        }
        p->used += need;
        break;
    }
    pthread_mutex_unlock(&p->lock);
    return buf;
}

void moed_bufpool_put(void *buf)
{
    if (!buf) return;
    char *h = (char *)buf - GRAIN;
    moed_bufpool *p = ((header *)h)->pool;
    const size_t off = (size_t)(h - p->arena), len = ((header *)h)->len;
    pthread_mutex_lock(&p->lock);
    size_t i = 0; /* the first free extent after this one */
    while (i < p->n_free && p->free[i].off < off) i++;
    const bool joins_prev = i > 0 && p->free[i - 1].off + p->free[i - 1].len == off;
    const bool joins_next = i < p->n_free && off + len == p->free[i].off;
    if (joins_prev && joins_next) {
        p->free[i - 1].len += len + p->free[i].len;
        memmove(&p->free[i], &p->free[i + 1], (p->n_free - i - 1) * sizeof *p->free);
        p->n_free--;
    } else if (joins_prev) {
        p->free[i - 1].len += len;
    } else if (joins_next) {
        p->free[i].off = off;
        p->free[i].len += len;
    } else {
        memmove(&p->free[i + 1], &p->free[i], (p->n_free - i) * sizeof *p->free);
        p->free[i] = (extent){ off, len };
        p->n_free++;
    }
    p->used -= len;
    pthread_mutex_unlock(&p->lock);
}

size_t moed_bufpool_used(moed_bufpool *p)
{
    pthread_mutex_lock(&p->lock);
    size_t n = p->used;
    pthread_mutex_unlock(&p->lock);
    return n;
}

size_t moed_bufpool_size(const moed_bufpool *p)
{
    return p->size;
}
