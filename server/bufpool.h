/*
 * moed_bufpool — host buffers for the inline path, taken once at start from the backend's fastest
 * host memory (pinned for CUDA): a request's hidden rows are decoded straight into one, the backend
 * copies them to its device from there and its output back into the same buffer's second half,
 * which then becomes the reply's data slice, handed back to the pool when gRPC has sent it. So a
 * tensor is copied once on the way in and not at all by the CPU on the way out.
 *
 * When the pool has no room, moed_bufpool_get returns NULL and the caller takes the slower way
 * (staging copies, a plain reply slice): a full pool slows requests down, never fails them.
 *
 * Thread-safe (one mutex; a get or put is a walk over the free extents, a few in practice).
 */
#ifndef MOED_BUFPOOL_H
#define MOED_BUFPOOL_H

#include "moed_backend.h"
#include "moed_err.h"

#include <stddef.h>

typedef struct moed_bufpool moed_bufpool;

/* A pool of `bytes` from the backend's host_alloc; bytes == 0 makes a pool that never has room.
 * MOED_ENOMEM names the bytes. */
int moed_bufpool_create(moed_backend *b, size_t bytes, moed_bufpool **out, moed_error *err);
void moed_bufpool_destroy(moed_bufpool *p);

/* A buffer of at least n bytes, 64-byte aligned, or NULL when there is no room. */
void *moed_bufpool_get(moed_bufpool *p, size_t n);
/* Gives a buffer back to the pool it came from (NULL: nothing); a void * alone, so it can be a
 * slice's destroy callback. */
void moed_bufpool_put(void *buf);

/* Bytes handed out now, and the pool's size. */
size_t moed_bufpool_used(moed_bufpool *p);
size_t moed_bufpool_size(const moed_bufpool *p);

#endif
