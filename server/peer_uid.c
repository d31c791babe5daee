/*
 * moed_peer_uid — the owner of a loopback TCP peer's socket (peer_uid.h): one exact
 * SOCK_DIAG_BY_FAMILY request (not a dump) for the peer's socket, the peer's address as its source
 * and ours as its destination.
 */
#include "peer_uid.h"

#include <arpa/inet.h>
#include <errno.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

bool moed_tcp_self_of(const char *listen, int port, moed_tcp_self *self)
{
    memset(self, 0, sizeof *self);
    const char *colon = strrchr(listen, ':');
    char host[64];
    size_t n = colon ? (size_t)(colon - listen) : 0;
    if (!colon || n >= sizeof host || port <= 0 || port > 65535) return false;
    memcpy(host, listen, n);
    host[n] = 0;
    self->port = (uint16_t)port;
    if (!strcmp(host, "localhost")) {
        self->v4 = inet_pton(AF_INET, "127.0.0.1", &self->addr4) == 1;
        self->v6 = inet_pton(AF_INET6, "::1", &self->addr6) == 1;
    } else if (n > 2 && host[0] == '[' && host[n - 1] == ']') {
        host[n - 1] = 0;
        self->v6 =
            inet_pton(AF_INET6, host + 1, &self->addr6) == 1 && IN6_IS_ADDR_LOOPBACK(&self->addr6);
    } else {
        self->v4 =
            inet_pton(AF_INET, host, &self->addr4) == 1 && (ntohl(self->addr4.s_addr) >> 24) == 127;
    }
    if (!self->v4 && !self->v6) memset(self, 0, sizeof *self);
    return self->v4 || self->v6;
}

/* "ipv4:127.0.0.1:40000" or "ipv6:[::1]:40000" into its family, address and port. */
static bool parse_peer(const char *peer, int *family, void *addr, uint16_t *port)
{
    char host[64];
    const char *colon = strrchr(peer, ':');
    if (!colon) return false;
    char *end;
    long p = strtol(colon + 1, &end, 10);
    if (*end || p <= 0 || p > 65535) return false;
    *port = (uint16_t)p;
    if (!strncmp(peer, "ipv4:", 5)) {
        size_t n = (size_t)(colon - peer) - 5;
        if (n >= sizeof host) return false;
        memcpy(host, peer + 5, n);
        host[n] = 0;
        *family = AF_INET;
    } else if (!strncmp(peer, "ipv6:[", 6) && colon[-1] == ']') {
        size_t n = (size_t)(colon - peer) - 7;
        if (n >= sizeof host) return false;
        memcpy(host, peer + 6, n);
        host[n] = 0;
        *family = AF_INET6;
    } else {
        return false;
    }
    return inet_pton(*family, host, addr) == 1;
}

/* Whether an address of the kernel's answer is the one asked for: the same bytes, or for an IPv4
 * request the IPv4-mapped form in which a dual-stack IPv6 socket (what gRPC clients open) reports
 * it. */
static bool same_addr(const struct inet_diag_msg *m, const __be32 *got, const __be32 *want)
{
    if (m->idiag_family == AF_INET6 && want[1] == 0 && want[2] == 0 && want[3] == 0 &&
        got[0] == 0 && got[1] == 0 && got[2] == htonl(0xffff))
        return got[3] == want[0];
    return !memcmp(got, want, 4 * sizeof *got);
}

/* Sends the exact request and reads its answer: the uid when the socket is there, established,
 * and the one asked for. */
static int ask_kernel(const struct inet_diag_req_v2 *want, uint32_t *uid, moed_error *err)
{
    int fd = socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_SOCK_DIAG);
    if (fd < 0)
        return moed_fail(err, MOED_EPRECOND, "the kernel's socket diagnostics are unavailable: %s",
                         strerror(errno));
    struct timeval tv = { .tv_sec = 1 };
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    struct {
        struct nlmsghdr nh;
        struct inet_diag_req_v2 r;
    } req = { .nh = { .nlmsg_len = sizeof req,
                      .nlmsg_type = SOCK_DIAG_BY_FAMILY,
                      .nlmsg_flags = NLM_F_REQUEST,
                      .nlmsg_seq = 1 },
              .r = *want };
    struct sockaddr_nl kernel = { .nl_family = AF_NETLINK };
    long buf[1024]; /* aligned for nlmsghdr */
    ssize_t n = sendto(fd, &req, sizeof req, 0, (struct sockaddr *)&kernel, sizeof kernel) < 0
                    ? -1
                    : recv(fd, buf, sizeof buf, 0);
    int e = errno, rc = MOED_EPRECOND;
    close(fd);
    if (n < 0)
        return moed_fail(err, MOED_EPRECOND, "the kernel's socket diagnostics did not answer: %s",
                         strerror(e));
    for (struct nlmsghdr *h = (struct nlmsghdr *)buf; NLMSG_OK(h, (size_t)n);
         h = NLMSG_NEXT(h, n)) {
        if (h->nlmsg_type != SOCK_DIAG_BY_FAMILY ||
            h->nlmsg_len < NLMSG_LENGTH(sizeof(struct inet_diag_msg)))
            continue;
        const struct inet_diag_msg *m = NLMSG_DATA(h);
        if (m->idiag_state == TCP_ESTABLISHED && m->id.idiag_sport == want->id.idiag_sport &&
            m->id.idiag_dport == want->id.idiag_dport &&
            same_addr(m, m->id.idiag_src, want->id.idiag_src) &&
            same_addr(m, m->id.idiag_dst, want->id.idiag_dst)) {
            *uid = m->idiag_uid;
            rc = 0;
        }
    }
    return rc ? moed_fail(err, MOED_EPRECOND,
                          "the connection's socket is not an established one the kernel knows")
              : 0;
}

int moed_peer_uid_tcp(const moed_tcp_self *self, const char *peer, uint32_t *uid, moed_error *err)
{
    int family;
    uint16_t port;
    struct in6_addr addr; /* room for either family */
    if (!parse_peer(peer, &family, &addr, &port) || (family == AF_INET ? !self->v4 : !self->v6))
        return moed_fail(err, MOED_EPRECOND, "%.100s is not a loopback TCP peer of this listener",
                         peer);
    struct inet_diag_req_v2 want = { .sdiag_family = (uint8_t)family,
                                     .sdiag_protocol = IPPROTO_TCP,
                                     .idiag_states = 1u << TCP_ESTABLISHED,
                                     .id = { .idiag_sport = htons(port),
                                             .idiag_dport = htons(self->port),
                                             .idiag_cookie = { INET_DIAG_NOCOOKIE,
                                                               INET_DIAG_NOCOOKIE } } };
    const size_t len = family == AF_INET ? 4 : 16;
    memcpy(want.id.idiag_src, &addr, len);
    memcpy(want.id.idiag_dst, family == AF_INET ? (const void *)&self->addr4 : &self->addr6, len);
    return ask_kernel(&want, uid, err);
}
