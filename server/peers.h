/*
 * moed_peers — what each connection's calls cost, so that moed holds every connection to the
 * MAX_CONCURRENT_STREAMS it advertises (--max-streams), and closes those that do not keep to it.
 *
 * Why this is kept here and not left to gRPC: gRPC core 1.51 enforces the limit only once the peer
 * has acknowledged the SETTINGS frame that carries it, and a peer that never reads never does. gRPC
 * makes a call of every stream such a peer opens, a call held for its request costs about 13 KB,
 * and with enough such connections gRPC makes them faster than moed can turn them away one by one:
 * its queue of new calls grows without bound (hundreds of MB a second) and a legitimate call waits
 * behind all of it. Closing the connection is the one thing that stops gRPC reading it.
 *
 * gRPC names each call's peer (ip:port: one per TCP connection); a connection moed's own unix
 * listener accepted is counted as "fd:N/SEQ" (its descriptor, and its number in accept order). With
 * `limit` = twice the stream setting, a connection is closed at the call that finds it
 *  - with `limit` calls open,
 *  - or with MOED_PEERS_UNREAD calls that ended unread (turned away at their headers, or ended by
 *    the peer before a request of them was read) more than calls read: few, since a connection
 *    sending faster than it is parsed keeps a thread that reads connections until it is closed
 *    (a reconnecting flood of 32 such connections kept legitimate calls waiting 1.2-1.7 s, median,
 *    when `limit` was the bound here, and 0.1-0.2 s at 64),
 *  - or holding the most of the calls waiting for their request (a unary call is let in on its
 *    headers, then waits for its message), if more than one, when MOED_PEERS_FRESH of them wait
 *    on connections that have had no request read yet (among those), or `limit` on all: a peer
 *    that opens calls and never sends them soon holds the most, its connections never having had a
 *    request read, and a connection with one call waiting (a new one) is never closed for it.
 * Every later call of a closed connection (gRPC delivers those it had read before) is dropped.
 *
 * Replies count too: a client that reads its socket but grants no HTTP/2 window takes none, and
 * its replies (and the requests behind them) stay in moed's memory. A connection is closed when
 * the replies waiting for their clients, of all connections together, pass `held_limit` bytes
 * (it is the one holding the most), or when it has held some for MOED_PEERS_STALL_NS without
 * taking one (a client slower than that to take a reply loses its connection).
 *
 * An address is forgotten once it has no call open and nothing against it, or, when it has (it was
 * closed, or has calls unread), once it has had no call for MOED_PEERS_IDLE_NS: a closed
 * connection's last calls come within that, and the table keeps no address long after its last
 * call.
 *
 * Thread-safe: one mutex over a hash of the addresses, and lists of them by calls waiting.
 */
#ifndef MOED_PEERS_H
#define MOED_PEERS_H

#include "moed_list.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define MOED_PEERS_IDLE_NS  ((uint64_t)10 * 1000000000)
#define MOED_PEERS_STALL_NS ((uint64_t)20 * 1000000000)
#define MOED_PEERS_UNREAD   64
#define MOED_PEERS_FRESH    64

typedef struct moed_peers moed_peers;
typedef struct moed_peer moed_peer;

/* A call as counted here; kept in the call's own state. Zeroed: not counted. */
typedef struct moed_peer_call {
    moed_peer *peer; /* its connection; NULL: not counted */
    int64_t held;    /* bytes of its replies waiting for the client to take them */
    bool read;       /* a request of it was read */
    bool waiting;    /* it waits for its request */
} moed_peer_call;

typedef enum moed_peer_verdict {
    MOED_PEER_ADMIT,  /* counted in *c (unless no memory was left for a new address) */
    MOED_PEER_CLOSED, /* its connection was closed before: the call is dropped */
    /* Its connection is to be closed (moed_peers_disconnect), and the call dropped, for: */
    MOED_PEER_CLOSE_CALLS,   /* `limit` calls open */
    MOED_PEER_CLOSE_UNREAD,  /* MOED_PEERS_UNREAD calls unread */
    MOED_PEER_CLOSE_WAITING, /* holding the most of the `limit` calls waiting */
} moed_peer_verdict;

/* `limit` (at least 1) and `held_limit`: see above. NULL when out of memory. */
moed_peers *moed_peers_create(int limit, int64_t held_limit);
void moed_peers_destroy(moed_peers *p);

/* A call from `addr` arrived at `now_ns` (any monotonic clock, the same for every call); `conn`
 * tells its connection from an earlier one of the same address (a port the kernel gave again, once
 * the connection moed closed had gone: its calls must not be dropped as the old one's); `waits`:
 * it waits for its request (a unary call). When admitting it closes another connection (the one
 * holding the most calls waiting), that one's address is copied into victim (else victim[0] = 0;
 * cap must hold an address: 64 bytes do). */
moed_peer_verdict moed_peers_enter(moed_peers *p, const char *addr, const void *conn, bool waits,
                                   uint64_t now_ns, moed_peer_call *c, char *victim, size_t cap);

/* A request of the call was read (its first: later ones are no-ops). */
void moed_peers_read(moed_peers *p, moed_peer_call *c);

/* The call has ended (what it held is let go). */
void moed_peers_leave(moed_peers *p, moed_peer_call *c, uint64_t now_ns);

/* The call holds `bytes` more (a reply made; negative: taken by its client, its send complete).
 * Returns whether that takes the replies held in all past `held_limit`: then the connection
 * holding the most is closed (its address in victim). */
bool moed_peers_hold(moed_peers *p, moed_peer_call *c, int64_t bytes, uint64_t now_ns, char *victim,
                     size_t cap);

/* Whether a connection has held replies for MOED_PEERS_STALL_NS without taking one: then it is
 * closed (its address in victim). One at a time: call again until false. */
bool moed_peers_stalled(moed_peers *p, uint64_t now_ns, char *victim, size_t cap);

/* Of `addr` now: calls open, calls unread, whether it is closed; and calls waiting in all (tests).
 */
int moed_peers_count(moed_peers *p, const char *addr);
int moed_peers_unread(moed_peers *p, const char *addr);
bool moed_peers_closed(moed_peers *p, const char *addr);
int moed_peers_waiting(moed_peers *p);

/* Resets the TCP connections of this process whose peer is `addr` (as gRPC names it: "ipv4:a.b.c.d:
 * port" or "ipv6:[addr]:port") and whose local port is `port`, through their sockets: connect with
 * AF_UNSPEC aborts the connection and drops what it had not read (also once the peer has reset it:
 * then only that), and leaves the descriptor to its owner, gRPC, which sees the connection end. A
 * connection moed's unix listener handed gRPC ("fd:N/SEQ", SEQ its number in accept order) is shut
 * down through descriptor N. addr NULL: every TCP connection whose local port is `port` (a drain
 * cut short: what flooding connections had sent and gRPC had not parsed yet is dropped, so its
 * reading threads are free to shut down). Returns how many it reset. */
int moed_peers_disconnect(const char *addr, int port);

/* How many TCP connections of this process have local port `port` (accepted ones: a listening
 * socket has no peer), as moed_peers_disconnect finds them with addr NULL. */
int moed_peers_connections(int port);

/* Whether a gRPC peer address ("ipv4:127.0.0.1:5000", "ipv6:[::1]:5000", "unix:/path", ...) is on
 * this host: loopback (127.0.0.0/8, ::1, ::ffff:127.x) or a unix socket ("fd:N" too: a connection
 * moed accepted on its own unix socket). */
bool moed_peer_is_local(const char *peer);

#endif
