/*
 * moed_peers — how many calls each connection has open, so that moed holds every connection to
 * the MAX_CONCURRENT_STREAMS it advertises (--max-streams).
 *
 * Why the count is kept here and not left to gRPC: gRPC core 1.51 enforces the limit only once the
 * peer has acknowledged the SETTINGS frame that carries it, and a peer that never reads never
 * does, so it could open streams without end. gRPC tells the application each call's peer address
 * (ip:port: one per TCP connection), and the count is kept per address.
 *
 * Thread-safe: one mutex over a hash of the addresses with calls open.
 */
#ifndef MOED_PEERS_H
#define MOED_PEERS_H

#include <stdbool.h>

typedef struct moed_peers moed_peers;
typedef struct moed_peer moed_peer;

/* NULL when out of memory. */
moed_peers *moed_peers_create(void);
void moed_peers_destroy(moed_peers *p);

/* Counts one more call from `addr`, or returns NULL when `addr` has `limit` calls open already
 * (or no memory is left for a new address). */
moed_peer *moed_peers_enter(moed_peers *p, const char *addr, int limit);

/* The call counted by moed_peers_enter has ended. */
void moed_peers_leave(moed_peers *p, moed_peer *e);

/* Calls open from `addr` now (for tests). */
int moed_peers_count(moed_peers *p, const char *addr);

/* Whether a gRPC peer address ("ipv4:127.0.0.1:5000", "ipv6:[::1]:5000", "unix:/path", ...) is on
 * this host: loopback (127.0.0.0/8, ::1, ::ffff:127.x) or a unix socket ("fd:N" too: a connection
 * moed accepted on its own unix socket). */
bool moed_peer_is_local(const char *peer);

#endif
