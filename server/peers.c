/*
 * moed_peers — a chained hash of peer addresses (FNV-1a into a fixed array of buckets; an address
 * is dropped when its last call ends, so the table holds only connections with calls open).
 */
#include "peers.h"

#include "moed_list.h"

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define N_BUCKETS 4096

struct moed_peer {
    moed_list node; /* in its bucket */
    int calls;
    char addr[];
};

struct moed_peers {
    pthread_mutex_t lock;
    moed_list buckets[N_BUCKETS];
};

moed_peers *moed_peers_create(void)
{
    moed_peers *p = malloc(sizeof *p);
    if (!p) return NULL;
    pthread_mutex_init(&p->lock, NULL);
    for (int i = 0; i < N_BUCKETS; i++) moed_list_init(&p->buckets[i]);
    return p;
}

void moed_peers_destroy(moed_peers *p)
{
    if (!p) return;
    for (int i = 0; i < N_BUCKETS; i++)
        while (!moed_list_empty(&p->buckets[i])) {
            moed_list *q = moed_list_head(&p->buckets[i]);
            moed_list_remove(q);
            free(moed_list_data(q, moed_peer, node));
        }
    pthread_mutex_destroy(&p->lock);
    free(p);
}

static moed_list *bucket(moed_peers *p, const char *addr)
{
    uint32_t h = 2166136261u;
    for (const unsigned char *s = (const unsigned char *)addr; *s; s++) h = (h ^ *s) * 16777619u;
    return &p->buckets[h % N_BUCKETS];
}

static moed_peer *find(moed_list *b, const char *addr)
{
    moed_list *q;
    moed_list_foreach (q, b) {
        moed_peer *e = moed_list_data(q, moed_peer, node);
        if (!strcmp(e->addr, addr)) return e;
    }
    return NULL;
}

moed_peer *moed_peers_enter(moed_peers *p, const char *addr, int limit)
{
    moed_list *b = bucket(p, addr);
    pthread_mutex_lock(&p->lock);
    moed_peer *e = find(b, addr);
    if (!e && (e = malloc(sizeof *e + strlen(addr) + 1))) {
        e->calls = 0;
        strcpy(e->addr, addr);
        moed_list_insert_tail(b, &e->node);
    }
    if (e && e->calls >= limit) e = NULL;
    if (e) e->calls++;
    pthread_mutex_unlock(&p->lock);
    return e;
}

void moed_peers_leave(moed_peers *p, moed_peer *e)
{
    pthread_mutex_lock(&p->lock);
    if (--e->calls == 0) {
        moed_list_remove(&e->node);
        free(e);
    }
    pthread_mutex_unlock(&p->lock);
}

int moed_peers_count(moed_peers *p, const char *addr)
{
    pthread_mutex_lock(&p->lock);
    moed_peer *e = find(bucket(p, addr), addr);
    int n = e ? e->calls : 0;
    pthread_mutex_unlock(&p->lock);
    return n;
}

bool moed_peer_is_local(const char *peer)
{
    if (!strncmp(peer, "unix:", 5) || !strncmp(peer, "unix-abstract:", 14)) return true;
    if (!strncmp(peer, "fd:", 3)) return true; /* accepted on moed's own unix socket (moed_unix) */
    if (!strncmp(peer, "ipv4:", 5)) return !strncmp(peer + 5, "127.", 4);
    if (strncmp(peer, "ipv6:[", 6)) return false;
    const char *h = peer + 6;
    return !strncmp(h, "::1]", 4) || !strncmp(h, "::ffff:127.", 11);
}
