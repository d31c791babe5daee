/*
 * test_peers — what each connection's calls cost (moed_peers): the calls-open limit closing the
 * connection at the call past it and dropping its later calls, other addresses unaffected; calls
 * ended unread counted against calls read; when `limit` calls wait in all, the connection holding
 * the most closed, never one with a single call waiting; closed and unread addresses forgotten
 * after MOED_PEERS_IDLE_NS; replies held past the bound or for MOED_PEERS_STALL_NS closing the
 * connection that holds them; and moed_peers_disconnect resetting exactly the socket gRPC names, an
 * IPv4 peer of a dual-stack listener included, and one its peer has already reset, whose unread
 * bytes it drops, and moed_peers_connections counting a listening port's accepted connections.
 */
#include "check.h"
#include "peers.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define A "ipv4:127.0.0.1:40000"
#define B "ipv4:127.0.0.1:40001"

/* Same-host peers, as gRPC names them: loopback and unix sockets only. */
static void test_local(void)
{
    const char *local[] = { "ipv4:127.0.0.1:5000", "ipv4:127.3.4.5:1",
                            "ipv6:[::1]:5000",     "ipv6:[::ffff:127.0.0.1]:5000",
                            "unix:/run/moed.sock", "unix-abstract:moed" };
    const char *remote[] = { "ipv4:10.0.0.1:5000",       "ipv4:128.0.0.1:5000",
                             "ipv6:[::2]:5000",          "ipv6:[fe80::1]:5000",
                             "ipv6:[::ffff:10.0.0.1]:1", "ipv4:1127.0.0.1:5",
                             "127.0.0.1:5000",           "" };
    for (size_t i = 0; i < sizeof local / sizeof local[0]; i++)
        CHECK_MSG(moed_peer_is_local(local[i]), "%s", local[i]);
    for (size_t i = 0; i < sizeof remote / sizeof remote[0]; i++)
        CHECK_MSG(!moed_peer_is_local(remote[i]), "%s", remote[i]);
}

static moed_peer_verdict enter(moed_peers *p, const char *addr, bool waits, uint64_t now,
                               moed_peer_call *c, char *victim)
{
    char none[64];
    return moed_peers_enter(p, addr, NULL, waits, now, c, victim ? victim : none, 64);
}

/* Calls open: `limit` of one address let in, the next closes it and later ones are dropped, even
 * once its calls have ended; another address counts apart, and so does a later connection of the
 * same address. */
static void test_calls_open(void)
{
    moed_peers *p = moed_peers_create(3, 1 << 30);
    moed_peer_call a[3], b, x;
    for (int i = 0; i < 3; i++) CHECK_EQ_INT(enter(p, A, false, 1, &a[i], NULL), MOED_PEER_ADMIT);
    CHECK_EQ_INT(moed_peers_count(p, A), 3);
    CHECK_EQ_INT(enter(p, B, false, 1, &b, NULL), MOED_PEER_ADMIT);
    CHECK_EQ_INT(enter(p, A, false, 1, &x, NULL), MOED_PEER_CLOSE_CALLS);
    CHECK(x.peer == NULL && moed_peers_closed(p, A) && !moed_peers_closed(p, B));
    for (int i = 0; i < 3; i++) {
        moed_peers_read(p, &a[i]);
        moed_peers_leave(p, &a[i], 2);
    }
    CHECK_EQ_INT(moed_peers_count(p, A), 0);
    CHECK_EQ_INT(enter(p, A, false, 3, &x, NULL), MOED_PEER_CLOSED); /* still remembered */
    moed_peers_leave(p, &x, 3);                                      /* not counted: no-op */
    /* The kernel gives A's port to a new connection: its calls are its own. */
    int again;
    char none[64];
    CHECK_EQ_INT(moed_peers_enter(p, A, &again, false, 3, &x, none, sizeof none), MOED_PEER_ADMIT);
    moed_peers_leave(p, &x, 3);
    CHECK_EQ_INT(moed_peers_count(p, B), 1);
    moed_peers_destroy(p); /* b is still counted: destroy frees it */
}

/* Calls ended unread (turned away, or reset before their request) less calls read: at
 * MOED_PEERS_UNREAD the next call closes the connection. */
static void test_unread(void)
{
    moed_peers *p = moed_peers_create(3, 1 << 30);
    moed_peer_call c;
    for (int i = 0; i < MOED_PEERS_UNREAD - 1; i++) {
        CHECK_EQ_INT(enter(p, A, true, 1, &c, NULL), MOED_PEER_ADMIT);
        moed_peers_leave(p, &c, 1);
    }
    CHECK_EQ_INT(moed_peers_unread(p, A), MOED_PEERS_UNREAD - 1);
    CHECK_EQ_INT(moed_peers_waiting(p), 0);
    CHECK_EQ_INT(enter(p, A, true, 1, &c, NULL), MOED_PEER_ADMIT); /* one read takes one back */
    moed_peers_read(p, &c);
    moed_peers_read(p, &c); /* a second request of the call counts nothing */
    moed_peers_leave(p, &c, 1);
    CHECK_EQ_INT(moed_peers_unread(p, A), MOED_PEERS_UNREAD - 2);
    for (int i = 0; i < 2; i++) {
        CHECK_EQ_INT(enter(p, A, false, 1, &c, NULL), MOED_PEER_ADMIT);
        moed_peers_leave(p, &c, 1);
    }
    CHECK_EQ_INT(enter(p, A, false, 1, &c, NULL), MOED_PEER_CLOSE_UNREAD);
    moed_peers_destroy(p);
}

/* Calls waiting for their request, all connections together: at `limit` the one holding the most
 * is closed (another's address handed back, or this call's own connection), its calls no longer
 * counted as waiting; a connection with one call waiting is never the one. */
static void test_waiting(void)
{
    moed_peers *p = moed_peers_create(4, 1 << 30);
    char victim[64], addr[64];
    moed_peer_call a[3], one[4], x;
    for (int i = 0; i < 3; i++) CHECK_EQ_INT(enter(p, A, true, 1, &a[i], NULL), MOED_PEER_ADMIT);
    CHECK_EQ_INT(enter(p, B, true, 1, &one[0], NULL), MOED_PEER_ADMIT);
    CHECK_EQ_INT(moed_peers_waiting(p), 4);
    snprintf(addr, sizeof addr, "ipv4:127.0.0.1:%d", 40100);
    CHECK_EQ_INT(enter(p, addr, true, 1, &one[1], victim), MOED_PEER_ADMIT);
    CHECK_MSG(!strcmp(victim, A), "victim %s", victim);
    CHECK(moed_peers_closed(p, A) && !moed_peers_closed(p, B));
    CHECK_EQ_INT(moed_peers_waiting(p), 2);
    for (int i = 0; i < 3; i++) moed_peers_leave(p, &a[i], 1); /* A's calls end, cancelled */
    CHECK_EQ_INT(moed_peers_waiting(p), 2);
    /* One call waiting on each of four connections: a fifth is let in all the same. */
    for (int i = 2; i < 4; i++) {
        snprintf(addr, sizeof addr, "ipv4:127.0.0.1:%d", 40100 + i);
        CHECK_EQ_INT(enter(p, addr, true, 1, &one[i], victim), MOED_PEER_ADMIT);
        CHECK_MSG(!victim[0], "victim %s", victim);
    }
    CHECK_EQ_INT(enter(p, "ipv4:127.0.0.1:40200", true, 1, &x, victim), MOED_PEER_ADMIT);
    CHECK(!victim[0]);
    CHECK_EQ_INT(moed_peers_waiting(p), 5);
    /* A call that does not wait (a stream) is let in past the count. */
    moed_peer_call s;
    CHECK_EQ_INT(enter(p, B, false, 1, &s, victim), MOED_PEER_ADMIT);
    CHECK(!victim[0]);
    /* B's second waiting call would make it hold the most: B itself is closed. */
    moed_peer_call b2;
    CHECK_EQ_INT(enter(p, B, true, 1, &b2, victim), MOED_PEER_CLOSE_WAITING);
    CHECK(!victim[0] && moed_peers_closed(p, B));
    CHECK_EQ_INT(moed_peers_waiting(p), 4);
    /* A request read: no longer waiting. */
    moed_peers_read(p, &x);
    CHECK_EQ_INT(moed_peers_waiting(p), 3);
    moed_peers_destroy(p);
}

/* Connections that have had no request read: when MOED_PEERS_FRESH of their calls wait, the one
 * holding the most is closed, long before `limit`; one that has had a request read is judged
 * with all the others, at `limit`. */
static void test_fresh(void)
{
    moed_peers *p = moed_peers_create(1000, 1 << 30);
    char victim[64];
    static moed_peer_call a[MOED_PEERS_FRESH], s[MOED_PEERS_FRESH + 10], b[4], c;
    CHECK_EQ_INT(enter(p, "ipv4:127.0.0.1:1", true, 1, &s[0], NULL), MOED_PEER_ADMIT);
    moed_peers_read(p, &s[0]); /* seasoned: its calls waiting are not the fresh ones */
    for (int i = 1; i < MOED_PEERS_FRESH + 10; i++)
        CHECK_EQ_INT(enter(p, "ipv4:127.0.0.1:1", true, 1, &s[i], NULL), MOED_PEER_ADMIT);
    for (int i = 0; i < MOED_PEERS_FRESH - 4; i++)
        CHECK_EQ_INT(enter(p, A, true, 1, &a[i], NULL), MOED_PEER_ADMIT);
    for (int i = 0; i < 4; i++) CHECK_EQ_INT(enter(p, B, true, 1, &b[i], NULL), MOED_PEER_ADMIT);
    CHECK_EQ_INT(enter(p, "ipv4:127.0.0.1:2", true, 1, &c, victim), MOED_PEER_ADMIT);
    CHECK_MSG(!strcmp(victim, A), "victim %s", victim);
    CHECK(!moed_peers_closed(p, B) && !moed_peers_closed(p, "ipv4:127.0.0.1:1"));
    moed_peers_destroy(p);
}

/* Closed and unread addresses are remembered, then forgotten MOED_PEERS_IDLE_NS after their last
 * call; an address with calls open is never forgotten. */
static void test_idle(void)
{
    moed_peers *p = moed_peers_create(1, 1 << 30);
    moed_peer_call c, d;
    CHECK_EQ_INT(enter(p, A, false, 1, &c, NULL), MOED_PEER_ADMIT);
    CHECK_EQ_INT(enter(p, A, false, 1, &d, NULL), MOED_PEER_CLOSE_CALLS);
    moed_peers_read(p, &c);
    moed_peers_leave(p, &c, 100);
    CHECK_EQ_INT(enter(p, B, false, 100, &d, NULL), MOED_PEER_ADMIT); /* B stays open */
    CHECK_EQ_INT(enter(p, A, false, 100 + MOED_PEERS_IDLE_NS - 1, &c, NULL), MOED_PEER_CLOSED);
    CHECK(moed_peers_closed(p, A));
    CHECK_EQ_INT(enter(p, "ipv4:127.0.0.1:1", false, 100 + 2 * MOED_PEERS_IDLE_NS, &c, NULL),
                 MOED_PEER_ADMIT);
    CHECK(!moed_peers_closed(p, A));
    CHECK_EQ_INT(moed_peers_count(p, B), 1);
    moed_peers_destroy(p);
}

/* Replies held for their clients: past the bound in all, the connection holding the most is
 * closed (no longer counted in the total); one that has taken no reply for MOED_PEERS_STALL_NS is
 * closed too; a call's end lets go of what it held. */
static void test_held(void)
{
    moed_peers *p = moed_peers_create(8, 100);
    moed_peer_call a, b, b2;
    char victim[64];
    CHECK_EQ_INT(enter(p, A, false, 1, &a, NULL), MOED_PEER_ADMIT);
    CHECK_EQ_INT(enter(p, B, false, 1, &b, NULL), MOED_PEER_ADMIT);
    CHECK_EQ_INT(enter(p, B, false, 1, &b2, NULL), MOED_PEER_ADMIT);
    CHECK(!moed_peers_hold(p, &a, 60, 1, victim, sizeof victim) && !victim[0]);
    CHECK(!moed_peers_hold(p, &b, 30, 1, victim, sizeof victim));
    CHECK(moed_peers_hold(p, &b2, 20, 2, victim, sizeof victim)); /* 110: A (60) holds the most */
    CHECK_MSG(!strcmp(victim, A), "victim %s", victim);
    CHECK(moed_peers_closed(p, A) && !moed_peers_closed(p, B));
    CHECK(!moed_peers_hold(p, &b, 40, 3, victim, sizeof victim)); /* 90: A's 60 went with it */
    moed_peers_leave(p, &a, 3);
    CHECK(!moed_peers_hold(p, &b2, 10, 3, victim, sizeof victim)); /* 100 */
    /* B took a reply at 4: not stalled until 4 + MOED_PEERS_STALL_NS. */
    CHECK(!moed_peers_hold(p, &b2, -30, 4, victim, sizeof victim));
    CHECK(!moed_peers_stalled(p, 4 + MOED_PEERS_STALL_NS - 1, victim, sizeof victim));
    CHECK(moed_peers_stalled(p, 4 + MOED_PEERS_STALL_NS, victim, sizeof victim));
    CHECK_MSG(!strcmp(victim, B), "victim %s", victim);
    CHECK(!moed_peers_stalled(p, 5 + MOED_PEERS_STALL_NS, victim, sizeof victim));
    moed_peers_leave(p, &b, 5);
    moed_peers_leave(p, &b2, 5);
    /* A new connection holding and taking replies is never stalled. */
    CHECK_EQ_INT(enter(p, "ipv4:127.0.0.1:40002", false, 10, &a, NULL), MOED_PEER_ADMIT);
    CHECK(!moed_peers_hold(p, &a, 50, 10, victim, sizeof victim));
    CHECK(!moed_peers_stalled(p, 10 + MOED_PEERS_STALL_NS - 1, victim, sizeof victim));
    moed_peers_leave(p, &a, 11); /* what it held goes with it */
    CHECK(!moed_peers_stalled(p, 11 + 2 * MOED_PEERS_STALL_NS, victim, sizeof victim));
    moed_peers_destroy(p);
}

/* A listening socket on `family`'s loopback (or any address, for a dual-stack one), a client of
 * it from 127.0.0.1 or ::1, and the accepted end: returns the listener's port, or 0. */
static int connected(int family, bool dual, int *lfd, int *cfd, int *sfd, char *peer, size_t cap)
{
    struct sockaddr_storage ss;
    socklen_t len;
    memset(&ss, 0, sizeof ss);
    if (family == AF_INET) {
        struct sockaddr_in *s4 = (struct sockaddr_in *)&ss;
        s4->sin_family = AF_INET;
        s4->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        len = sizeof *s4;
    } else {
        struct sockaddr_in6 *s6 = (struct sockaddr_in6 *)&ss;
        s6->sin6_family = AF_INET6;
        s6->sin6_addr = dual ? in6addr_any : in6addr_loopback;
        len = sizeof *s6;
    }
    *lfd = socket(family, SOCK_STREAM, 0);
    if (*lfd < 0 || bind(*lfd, (struct sockaddr *)&ss, len) || listen(*lfd, 4) ||
        getsockname(*lfd, (struct sockaddr *)&ss, &len))
        return 0;
    int port = ntohs(family == AF_INET ? ((struct sockaddr_in *)&ss)->sin_port
                                       : ((struct sockaddr_in6 *)&ss)->sin6_port);
    struct sockaddr_in to4 = { .sin_family = AF_INET, .sin_port = htons((uint16_t)port) };
    struct sockaddr_in6 to6 = { .sin6_family = AF_INET6, .sin6_port = htons((uint16_t)port) };
    to4.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    to6.sin6_addr = in6addr_loopback;
    bool v4 = family == AF_INET || dual;
    *cfd = socket(v4 ? AF_INET : AF_INET6, SOCK_STREAM, 0);
    if (*cfd < 0 || connect(*cfd, v4 ? (struct sockaddr *)&to4 : (struct sockaddr *)&to6,
                            v4 ? sizeof to4 : sizeof to6))
        return 0;
    *sfd = accept(*lfd, NULL, NULL);
    len = sizeof ss;
    if (*sfd < 0 || getsockname(*cfd, (struct sockaddr *)&ss, &len)) return 0;
    int cport =
        ntohs(v4 ? ((struct sockaddr_in *)&ss)->sin_port : ((struct sockaddr_in6 *)&ss)->sin6_port);
    snprintf(peer, cap, v4 ? "ipv4:127.0.0.1:%d" : "ipv6:[::1]:%d", cport);
    return port;
}

/* The socket named is reset (its client reads ECONNRESET) and stays open for its owner; a peer
 * of another port, or of another listening port, is left alone. */
static void test_disconnect(int family, bool dual)
{
    int lfd = -1, cfd = -1, sfd = -1;
    char peer[64], other[80];
    int port = connected(family, dual, &lfd, &cfd, &sfd, peer, sizeof peer);
    CHECK_MSG(port > 0, "family %d dual %d: %s", family, dual, strerror(errno));
    if (port <= 0) return;
    snprintf(other, sizeof other, "%.*s%d", (int)(strrchr(peer, ':') + 1 - peer), peer,
             port == 65535 ? 1 : port + 1);
    CHECK_EQ_INT(moed_peers_disconnect(other, port), 0);
    CHECK_EQ_INT(moed_peers_disconnect(peer, port == 65535 ? 1 : port + 1), 0);
    CHECK_EQ_INT(moed_peers_disconnect("unix:/x", port), 0);
    CHECK_EQ_INT(moed_peers_disconnect(peer, port), 1);
    char buf[8];
    errno = 0;
    ssize_t n = recv(cfd, buf, sizeof buf, 0);
    CHECK_MSG(n == -1 && errno == ECONNRESET, "recv = %zd (%s)", n, strerror(errno));
    CHECK(fcntl(sfd, F_GETFD) != -1); /* the descriptor is still its owner's to close */
    close(sfd);
    close(cfd);
    close(lfd);
}

/* A connection its client has reset (close with a zero linger) with bytes moed had not read: the
 * kernel keeps them readable, and getpeername no longer names the peer. It is found all the same,
 * and reset: what it had not read is dropped, so its reader sees the end at once. */
static void test_disconnect_reset_by_peer(int family, bool dual)
{
    int lfd = -1, cfd = -1, sfd = -1;
    char peer[64];
    int port = connected(family, dual, &lfd, &cfd, &sfd, peer, sizeof peer);
    CHECK_MSG(port > 0, "family %d dual %d: %s", family, dual, strerror(errno));
    if (port <= 0) return;
    struct linger abort_close = { .l_onoff = 1, .l_linger = 0 };
    CHECK(send(cfd, "flood", 5, 0) == 5);
    CHECK(!setsockopt(cfd, SOL_SOCKET, SO_LINGER, &abort_close, sizeof abort_close));
    close(cfd);
    /* Waits for the reset to arrive (POLLHUP; 10 s: a hang guard only). */
    struct pollfd pf = { .fd = sfd };
    CHECK_MSG(poll(&pf, 1, 10000) == 1 && (pf.revents & POLLHUP), "revents %#x", pf.revents);
    struct sockaddr_storage ss;
    socklen_t len = sizeof ss;
    CHECK(getpeername(sfd, (struct sockaddr *)&ss, &len) == -1 && errno == ENOTCONN);
    CHECK_EQ_INT(moed_peers_disconnect(peer, port), 1);
    char buf[8];
    ssize_t n = recv(sfd, buf, sizeof buf, MSG_DONTWAIT);
    CHECK_MSG(n <= 0, "recv = %zd: the peer's unread bytes were not dropped", n);
    close(sfd);
    close(lfd);
}

/* Every connection of a listening port at once (a drain cut short): both clients' connections
 * are reset, the listener itself is left alone, and another port's connection too. Before, they
 * are counted as the drain counts them: not the listener, not the clients' own sockets (another
 * local port), not another port's; after they are closed, none. */
static void test_disconnect_all(void)
{
    int lfd = -1, cfd = -1, sfd = -1, lfd2 = -1, cfd2 = -1, sfd2 = -1;
    char peer[64], peer2[64];
    int port = connected(AF_INET, false, &lfd, &cfd, &sfd, peer, sizeof peer);
    int port2 = connected(AF_INET, false, &lfd2, &cfd2, &sfd2, peer2, sizeof peer2);
    CHECK_MSG(port > 0 && port2 > 0, "%s", strerror(errno));
    if (port <= 0 || port2 <= 0) return;
    struct sockaddr_in to = { .sin_family = AF_INET, .sin_port = htons((uint16_t)port) };
    to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int cfd3 = socket(AF_INET, SOCK_STREAM, 0);
    CHECK(cfd3 >= 0 && !connect(cfd3, (struct sockaddr *)&to, sizeof to));
    int sfd3 = accept(lfd, NULL, NULL);
    CHECK(sfd3 >= 0);
    CHECK_EQ_INT(moed_peers_connections(port), 2);
    CHECK_EQ_INT(moed_peers_connections(port2), 1);
    CHECK_EQ_INT(moed_peers_disconnect(NULL, port), 2);
    char buf[8];
    for (int i = 0; i < 2; i++) {
        errno = 0;
        ssize_t n = recv(i ? cfd3 : cfd, buf, sizeof buf, 0);
        CHECK_MSG(n == -1 && errno == ECONNRESET, "client %d: recv = %zd (%s)", i, n,
                  strerror(errno));
    }
    errno = 0;
    CHECK_MSG(recv(cfd2, buf, sizeof buf, MSG_DONTWAIT) == -1 && errno == EAGAIN,
              "another port's connection: %s", strerror(errno));
    int c4 = socket(AF_INET, SOCK_STREAM, 0); /* the listener still accepts */
    CHECK(c4 >= 0 && !connect(c4, (struct sockaddr *)&to, sizeof to));
    int s4 = accept(lfd, NULL, NULL);
    CHECK(s4 >= 0);
    int fds[] = { cfd, sfd, lfd, cfd2, sfd2, lfd2, cfd3, sfd3, c4, s4 };
    for (size_t i = 0; i < sizeof fds / sizeof fds[0]; i++)
        if (fds[i] >= 0) close(fds[i]);
    CHECK_EQ_INT(moed_peers_connections(port), 0);
}

int main(void)
{
    test_local();
    test_calls_open();
    test_unread();
    test_waiting();
    test_fresh();
    test_idle();
    test_held();
    test_disconnect(AF_INET, false);
    test_disconnect(AF_INET6, false);
    test_disconnect(AF_INET6, true); /* an IPv4 client of a dual-stack listener, as gRPC binds */
    test_disconnect_reset_by_peer(AF_INET, false);
    test_disconnect_reset_by_peer(AF_INET6, false);
    test_disconnect_reset_by_peer(AF_INET6, true);
    test_disconnect_all();
    return check_status("test_peers");
}
