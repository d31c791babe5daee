/*
 * moed_peers — a chained hash of peer addresses (FNV-1a into a fixed array of buckets), and the
 * addresses with calls waiting in lists by how many (the most found in O(1), as an LFU cache finds
 * its least). An address with neither a call open nor anything against it is dropped when its last
 * call ends; one that was closed or has calls unread waits on the idle list (oldest first) and is
 * dropped by the calls that come MOED_PEERS_IDLE_NS after its last one.
 */
#include "peers.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <limits.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#define N_BUCKETS 4096

/* Addresses of the idle list looked at per call: more than one, to keep ahead of the calls that
 * fill it. */
#define SWEEP_PER_CALL 2

struct moed_peer {
    moed_list node;   /* in its bucket */
    moed_list idle;   /* on the idle list while no call is open (else linked to itself) */
    moed_list count;  /* on its pool's by_waiting[waiting] while waiting > 0 (else to itself) */
    moed_list holder; /* on the holders while held > 0 (else linked to itself) */
    uint64_t last_ns;
    uint64_t taken_ns; /* when it last took a reply, or began to hold one */
    int64_t held;      /* reply bytes waiting for it to take them */
    const void *conn;  /* the connection's identity beside its address (moed_peers_enter) */
    int calls, waiting, unread;
    bool closed;
    bool seasoned; /* a request of it has been read: its calls waiting count in p->seasoned */
    char addr[];
};

/* Connections with calls waiting, in lists by how many (LFU-like: the most found in O(1)). */
typedef struct pool {
    moed_list *by_waiting; /* [size + 1]: of moed_peer.count */
    int most;              /* no list above this one holds a connection */
    int n;                 /* calls waiting */
} pool;

struct moed_peers {
    pthread_mutex_t lock;
    int limit;
    int64_t held_limit, held; /* reply bytes waiting for their clients: the bound, and now */
    moed_list holders;        /* of moed_peer.holder */
    pool fresh;               /* connections that have had no request read (at most FRESH each) */
    pool seasoned;            /* the others (at most `limit` each) */
    moed_list idle;           /* of moed_peer.idle, oldest first */
    moed_list buckets[N_BUCKETS];
};

static bool pool_init(pool *l, int size)
{
    if (!(l->by_waiting = malloc(((size_t)size + 1) * sizeof *l->by_waiting))) return false;
    for (int i = 0; i <= size; i++) moed_list_init(&l->by_waiting[i]);
    return true;
}

moed_peers *moed_peers_create(int limit, int64_t held_limit)
{
    moed_peers *p = calloc(1, sizeof *p);
    if (!p || !pool_init(&p->fresh, MOED_PEERS_FRESH) || !pool_init(&p->seasoned, limit)) {
        if (p) free(p->fresh.by_waiting);
        free(p);
        return NULL;
    }
    pthread_mutex_init(&p->lock, NULL);
    p->limit = limit;
    p->held_limit = held_limit;
    moed_list_init(&p->holders);
    moed_list_init(&p->idle);
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
    free(p->fresh.by_waiting);
    free(p->seasoned.by_waiting);
    free(p);
}

static moed_list *bucket(moed_peers *p, const char *addr)
{
    uint32_t h = 2166136261u;
    for (const unsigned char *s = (const unsigned char *)addr; *s; s++) h = (h ^ *s) * 16777619u;
    return &p->buckets[h % N_BUCKETS];
}

/* The entry of addr and conn (any conn, with `any`). */
static moed_peer *find(moed_list *b, const char *addr, const void *conn, bool any)
{
    moed_list *q;
    moed_list_foreach (q, b) {
        moed_peer *e = moed_list_data(q, moed_peer, node);
        if ((any || e->conn == conn) && !strcmp(e->addr, addr)) return e;
    }
    return NULL;
}

/* Unlinks q and links it to itself, so that unlinking it again changes nothing. */
static void unlink_node(moed_list *q)
{
    moed_list_remove(q);
    moed_list_init(q);
}

static pool *pool_of(moed_peers *p, const moed_peer *e)
{
    return e->seasoned ? &p->seasoned : &p->fresh;
}

/* e's calls waiting become n: at most its calls open, so at most `limit`, and, while it is fresh,
 * at most FRESH (under the lock). */
static void set_waiting(moed_peers *p, moed_peer *e, int n)
{
    pool *l = pool_of(p, e);
    l->n += n - e->waiting;
    e->waiting = n;
    unlink_node(&e->count);
    if (n <= 0) return;
    moed_list_insert_tail(&l->by_waiting[n], &e->count);
    if (n > l->most) l->most = n;
}

/* The connection of l holding the most calls waiting, or NULL (under the lock). */
static moed_peer *most_waiting(pool *l)
{
    while (l->most > 0 && moed_list_empty(&l->by_waiting[l->most])) l->most--;
    return l->most ? moed_list_data(moed_list_head(&l->by_waiting[l->most]), moed_peer, count)
                   : NULL;
}

/* e has had a request read: its calls waiting move to the seasoned pool (under the lock). */
static void season(moed_peers *p, moed_peer *e)
{
    if (e->seasoned) return;
    int n = e->waiting;
    set_waiting(p, e, 0);
    e->seasoned = true;
    set_waiting(p, e, n);
}

/* Marks e closed; its calls wait, and its replies are held, no more (its connection goes, and they
 * with it). */
static void close_peer(moed_peers *p, moed_peer *e)
{
    set_waiting(p, e, 0);
    p->held -= e->held;
    unlink_node(&e->holder);
    e->closed = true;
}

/* c's connection holds `delta` more reply bytes (under the lock). A closed connection's count no
 * more in the total: they go with it. */
static void hold(moed_peers *p, moed_peer_call *c, int64_t delta, uint64_t now_ns)
{
    moed_peer *e = c->peer;
    c->held += delta;
    if (delta < 0 || !e->held) e->taken_ns = now_ns; /* a reply taken, or the first held */
    e->held += delta;
    if (e->closed) return;
    p->held += delta;
    unlink_node(&e->holder);
    if (e->held > 0) moed_list_insert_tail(&p->holders, &e->holder);
}

/* Drops the addresses idle for long enough (under the lock). */
static void sweep(moed_peers *p, uint64_t now_ns)
{
    for (int i = 0; i < SWEEP_PER_CALL && !moed_list_empty(&p->idle); i++) {
        moed_peer *e = moed_list_data(moed_list_head(&p->idle), moed_peer, idle);
        if (now_ns - e->last_ns < MOED_PEERS_IDLE_NS) break;
        moed_list_remove(&e->node);
        moed_list_remove(&e->idle);
        free(e);
    }
}

static moed_peer *lookup(moed_peers *p, const char *addr, const void *conn)
{
    moed_list *b = bucket(p, addr);
    moed_peer *e = find(b, addr, conn, false);
    if (!e && (e = calloc(1, sizeof *e + strlen(addr) + 1))) {
        strcpy(e->addr, addr);
        e->conn = conn;
        moed_list_insert_tail(b, &e->node);
        moed_list_init(&e->idle);
        moed_list_init(&e->count);
        moed_list_init(&e->holder);
    }
    return e;
}

/* Once `size` calls wait in pool l, the connection of l that holds the most of them with this call
 * of e's (e itself, if the call makes it so), provided that is more than one; else NULL (under the
 * lock). */
static moed_peer *over(moed_peers *p, pool *l, int size, moed_peer *e)
{
    if (l->n < size) return NULL;
    moed_peer *most = most_waiting(l);
    if (pool_of(p, e) == l && (!most || most->waiting < e->waiting + 1)) most = e;
    if (!most || most->waiting + (most == e) <= 1) return NULL; /* one each: let it in */
    return most;
}

/* The verdict on a call of e (under the lock): whether its connection is closed now, or was. */
static moed_peer_verdict judge(moed_peers *p, moed_peer *e, bool waits, char *victim, size_t cap)
{
    if (e->closed) return MOED_PEER_CLOSED;
    if (e->calls >= p->limit || e->unread >= MOED_PEERS_UNREAD) {
        close_peer(p, e);
        return e->calls >= p->limit ? MOED_PEER_CLOSE_CALLS : MOED_PEER_CLOSE_UNREAD;
    }
    if (!waits) return MOED_PEER_ADMIT;
    /* Fresh connections first: a peer that opens calls and never sends a request holds the most
     * there long before the bound over all is reached. */
    moed_peer *most = e->seasoned ? NULL : over(p, &p->fresh, MOED_PEERS_FRESH, e);
    if (!most && p->fresh.n + p->seasoned.n >= p->limit) {
        moed_peer *a = over(p, &p->fresh, 0, e), *b = over(p, &p->seasoned, 0, e);
        most = !a ? b : !b ? a : a->waiting + (a == e) >= b->waiting + (b == e) ? a : b;
    }
    if (!most) return MOED_PEER_ADMIT;
    close_peer(p, most);
    if (most == e) return MOED_PEER_CLOSE_WAITING;
    snprintf(victim, cap, "%s", most->addr);
    return MOED_PEER_ADMIT;
}

moed_peer_verdict moed_peers_enter(moed_peers *p, const char *addr, const void *conn, bool waits,
                                   uint64_t now_ns, moed_peer_call *c, char *victim, size_t cap)
{
    moed_peer_verdict v = MOED_PEER_ADMIT;
    memset(c, 0, sizeof *c);
    if (cap) victim[0] = 0;
    pthread_mutex_lock(&p->lock);
    sweep(p, now_ns);
    moed_peer *e = lookup(p, addr, conn);
    if (e) {
        e->last_ns = now_ns;
        v = judge(p, e, waits, victim, cap);
    }
    if (e && v == MOED_PEER_ADMIT) {
        if (e->calls++ == 0) unlink_node(&e->idle); /* off the idle list while calls are open */
        c->peer = e;
        c->waiting = waits;
        if (waits) set_waiting(p, e, e->waiting + 1);
    } else if (e && e->calls == 0) { /* stays idle: to the list's end */
        moed_list_remove(&e->idle);
        moed_list_insert_tail(&p->idle, &e->idle);
    }
    pthread_mutex_unlock(&p->lock);
    return v;
}

/* The call waits no more (under the lock); a closed connection's calls were let go at its close. */
static void stop_waiting(moed_peers *p, moed_peer_call *c)
{
    if (!c->waiting) return;
    c->waiting = false;
    if (!c->peer->closed) set_waiting(p, c->peer, c->peer->waiting - 1);
}

void moed_peers_read(moed_peers *p, moed_peer_call *c)
{
    if (!c->peer || c->read) return;
    c->read = true;
    pthread_mutex_lock(&p->lock);
    stop_waiting(p, c);
    season(p, c->peer);
    if (c->peer->unread > 0) c->peer->unread--;
    pthread_mutex_unlock(&p->lock);
}

void moed_peers_leave(moed_peers *p, moed_peer_call *c, uint64_t now_ns)
{
    moed_peer *e = c->peer;
    if (!e) return;
    pthread_mutex_lock(&p->lock);
    stop_waiting(p, c);
    if (c->held) hold(p, c, -c->held, now_ns);
    e->unread += !c->read;
    e->last_ns = now_ns;
    if (--e->calls == 0) {
        if (!e->unread && !e->closed) {
            moed_list_remove(&e->node);
            free(e);
        } else {
            moed_list_insert_tail(&p->idle, &e->idle);
        }
    }
    pthread_mutex_unlock(&p->lock);
    c->peer = NULL;
}

/* Closes e, copying its address into victim (under the lock). */
static void close_victim(moed_peers *p, moed_peer *e, char *victim, size_t cap)
{
    close_peer(p, e);
    snprintf(victim, cap, "%s", e->addr);
}

bool moed_peers_hold(moed_peers *p, moed_peer_call *c, int64_t bytes, uint64_t now_ns, char *victim,
                     size_t cap)
{
    if (cap) victim[0] = 0;
    if (!c->peer) return false;
    pthread_mutex_lock(&p->lock);
    hold(p, c, bytes, now_ns);
    moed_peer *most = NULL;
    moed_list *q;
    if (bytes > 0 && p->held > p->held_limit)
        moed_list_foreach (q, &p->holders) {
            moed_peer *e = moed_list_data(q, moed_peer, holder);
            if (!most || e->held > most->held) most = e;
        }
    if (most) close_victim(p, most, victim, cap);
    pthread_mutex_unlock(&p->lock);
    return most != NULL;
}

bool moed_peers_stalled(moed_peers *p, uint64_t now_ns, char *victim, size_t cap)
{
    moed_peer *stalled = NULL;
    moed_list *q;
    if (cap) victim[0] = 0;
    pthread_mutex_lock(&p->lock);
    moed_list_foreach (q, &p->holders) {
        moed_peer *e = moed_list_data(q, moed_peer, holder);
        if (now_ns - e->taken_ns >= MOED_PEERS_STALL_NS) {
            stalled = e;
            break;
        }
    }
    if (stalled) close_victim(p, stalled, victim, cap);
    pthread_mutex_unlock(&p->lock);
    return stalled != NULL;
}

/* One of the test accessors' fields, for addr (0 when unknown). */
enum { F_CALLS, F_UNREAD, F_CLOSED };

static int field(moed_peers *p, const char *addr, int f)
{
    pthread_mutex_lock(&p->lock);
    moed_peer *e = find(bucket(p, addr), addr, NULL, true);
    int n = !e ? 0 : f == F_CALLS ? e->calls : f == F_UNREAD ? e->unread : e->closed;
    pthread_mutex_unlock(&p->lock);
    return n;
}

int moed_peers_count(moed_peers *p, const char *addr)
{
    return field(p, addr, F_CALLS);
}

int moed_peers_unread(moed_peers *p, const char *addr)
{
    return field(p, addr, F_UNREAD);
}

bool moed_peers_closed(moed_peers *p, const char *addr)
{
    return field(p, addr, F_CLOSED);
}

int moed_peers_waiting(moed_peers *p)
{
    pthread_mutex_lock(&p->lock);
    int n = p->fresh.n + p->seasoned.n;
    pthread_mutex_unlock(&p->lock);
    return n;
}

/* ---- closing a connection -------------------------------------------------------------------- */

/* An address as a socket reports it, IPv4-mapped IPv6 read as the IPv4 it maps (gRPC names a peer
 * of a dual-stack listener so): family, 16 address bytes (IPv4 in the first 4) and port. */
typedef struct sock_addr {
    int family;
    unsigned char a[16];
    int port;
} sock_addr;

static bool from_sockaddr(const struct sockaddr_storage *ss, sock_addr *out)
{
    memset(out, 0, sizeof *out);
    if (ss->ss_family == AF_INET) {
        const struct sockaddr_in *s4 = (const struct sockaddr_in *)ss;
        out->family = AF_INET;
        memcpy(out->a, &s4->sin_addr, 4);
        out->port = ntohs(s4->sin_port);
        return true;
    }
    if (ss->ss_family != AF_INET6) return false;
    const struct sockaddr_in6 *s6 = (const struct sockaddr_in6 *)ss;
    out->port = ntohs(s6->sin6_port);
    if (IN6_IS_ADDR_V4MAPPED(&s6->sin6_addr)) {
        out->family = AF_INET;
        memcpy(out->a, &s6->sin6_addr.s6_addr[12], 4);
    } else {
        out->family = AF_INET6;
        memcpy(out->a, &s6->sin6_addr, 16);
    }
    return true;
}

/* gRPC's "ipv4:a.b.c.d:port" or "ipv6:[addr]:port" (a scope, "%25eth0", is ignored: a connection
 * is told apart by its port). */
static bool from_peer(const char *peer, sock_addr *out)
{
    char host[INET6_ADDRSTRLEN + 1];
    const char *h, *end;
    memset(out, 0, sizeof *out);
    if (!strncmp(peer, "ipv4:", 5)) {
        out->family = AF_INET;
        h = peer + 5;
        end = strrchr(h, ':');
    } else if (!strncmp(peer, "ipv6:[", 6)) {
        out->family = AF_INET6;
        h = peer + 6;
        end = strchr(h, ']');
        const char *pct = memchr(h, '%', end ? (size_t)(end - h) : 0);
        if (!end || end[1] != ':') return false;
        if (pct) end = pct;
    } else {
        return false;
    }
    if (!end || end == h || (size_t)(end - h) >= sizeof host) return false;
    memcpy(host, h, (size_t)(end - h));
    host[end - h] = 0;
    const char *port = strrchr(peer, ':') + 1;
    char *stop;
    long n = strtol(port, &stop, 10);
    if (*port == 0 || *stop || n < 1 || n > 65535) return false;
    out->port = (int)n;
    return inet_pton(out->family, host, out->a) == 1;
}

/* The TCP connections of this process whose local port is `port` and, with `want`, whose peer is
 * it; each reset when `reset`. Returns how many it found (reset: how many it reset). */
static int scan_connections(const sock_addr *want, int port, bool reset)
{
    DIR *d = opendir("/proc/self/fd");
    if (!d) return 0;
    int n = 0, self = dirfd(d);
    struct dirent *de;
    while ((de = readdir(d))) {
        char *stop;
        long fd = strtol(de->d_name, &stop, 10);
        if (*stop || fd == self) continue;
        struct sockaddr_storage ps, ls;
        socklen_t ll = sizeof ls;
        if (getsockname((int)fd, (struct sockaddr *)&ls, &ll)) continue;
        socklen_t pl = ll;
        sock_addr peer, local;
        /* SO_PEERNAME, not getpeername: it also names the peer of a connection the peer has
         * already reset, which getpeername refuses (ENOTCONN). Linux keeps what such a connection
         * had sent readable, and gRPC would parse all of it (megabytes of a flood's streams, for
         * seconds each, with a reading thread held) unless the reset here drops it. It takes a
         * length no longer than the address (else EINVAL): the local one's, of the same family.
         * A listening socket has no peer. */
        if (getsockopt((int)fd, SOL_SOCKET, SO_PEERNAME, &ps, &pl) || !from_sockaddr(&ps, &peer) ||
            !from_sockaddr(&ls, &local) || local.port != port ||
            (want && (peer.port != want->port || peer.family != want->family ||
                      memcmp(peer.a, want->a, sizeof peer.a))))
            continue;
        if (!reset) {
            n++;
            continue;
        }
        /* Checked and reset back to back: gRPC could close this descriptor between the two, and a
         * new connection take its number, only if the peer went at that very moment. */
        struct sockaddr unspec = { .sa_family = AF_UNSPEC };
        n += connect((int)fd, &unspec, sizeof unspec) == 0;
    }
    closedir(d);
    return n;
}

int moed_peers_disconnect(const char *addr, int port)
{
    sock_addr want;
    if (addr && !strncmp(addr, "fd:", 3)) { /* "fd:N/SEQ": moed's own unix listener handed gRPC this
                                       descriptor, which stays open while a call of its connection
                                       is alive */
        char *stop;
        long fd = strtol(addr + 3, &stop, 10);
        return (!*stop || *stop == '/') && fd >= 0 && fd <= INT_MAX &&
               shutdown((int)fd, SHUT_RDWR) == 0;
    }
    if (addr && !from_peer(addr, &want)) return 0;
    return scan_connections(addr ? &want : NULL, port, true);
}

int moed_peers_connections(int port)
{
    return scan_connections(NULL, port, false);
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
