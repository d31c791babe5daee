/*
 * moed_peer_uid — which local user is at the other end of a loopback TCP connection, as the kernel
 * reports it: the owner of the peer's socket, looked up with NETLINK_SOCK_DIAG (what `ss -e`
 * reads) by the connection's four addresses.
 *
 * Why all four must be known: the peer's socket is found by its own address and port (gRPC's peer
 * string, "ipv4:127.0.0.1:40000") and by the address and port it connected to, ours. A listener on
 * a wildcard address cannot tell which of the host's addresses a connection reached, and two
 * connections from one address and port to two of them differ in nothing else; so only a listener
 * on one loopback address (127.x.y.z, [::1], or localhost, whose two addresses the peer's family
 * tells apart) can name its peers' users (moed_tcp_self_of). Only an established socket counts: the
 * kernel reports no owner for one that is closing.
 */
#ifndef MOED_PEER_UID_H
#define MOED_PEER_UID_H

#include "moed_err.h"

#include <netinet/in.h>
#include <stdbool.h>
#include <stdint.h>

/* The one loopback address of each family a TCP listener serves, and its port. */
typedef struct moed_tcp_self {
    bool v4, v6;
    struct in_addr addr4;
    struct in6_addr addr6;
    uint16_t port;
} moed_tcp_self;

/* *self from the --listen address and the port bound; false (self cleared) when that address is
 * not one loopback address (a wildcard, another host, a unix socket): no peer's user can be told.
 */
bool moed_tcp_self_of(const char *listen, int port, moed_tcp_self *self);

/* The uid owning the peer's end of a connection to self, from gRPC's peer string. MOED_EPRECOND
 * with the reason in err: not a TCP peer of a family self serves, no established socket at those
 * addresses (it closed), or no answer from the kernel. */
int moed_peer_uid_tcp(const moed_tcp_self *self, const char *peer, uint32_t *uid, moed_error *err);

#endif
