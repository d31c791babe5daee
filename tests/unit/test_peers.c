/*
 * test_peers — the per-connection count of open calls behind --max-streams: addresses counted
 * apart, the limit refusing the call past it and only that address, leaving freeing a place, and
 * an address forgotten once its last call ends (so the table holds live connections only).
 */
#include "check.h"
#include "peers.h"

#include <stdio.h>

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

int main(void)
{
    test_local();
    moed_peers *p = moed_peers_create();
    CHECK(p != NULL);
    moed_peer *a[4], *b;
    for (int i = 0; i < 3; i++) CHECK((a[i] = moed_peers_enter(p, "ipv4:127.0.0.1:40000", 3)));
    CHECK(moed_peers_enter(p, "ipv4:127.0.0.1:40000", 3) == NULL); /* the fourth */
    CHECK_EQ_INT(moed_peers_count(p, "ipv4:127.0.0.1:40000"), 3);
    CHECK((b = moed_peers_enter(p, "ipv4:127.0.0.1:40001", 3))); /* another connection */
    moed_peers_leave(p, a[0]);
    CHECK((a[3] = moed_peers_enter(p, "ipv4:127.0.0.1:40000", 3)));
    CHECK_EQ_INT(moed_peers_count(p, "ipv4:127.0.0.1:40000"), 3);
    moed_peers_leave(p, a[1]);
    moed_peers_leave(p, a[2]);
    moed_peers_leave(p, a[3]);
    CHECK_EQ_INT(moed_peers_count(p, "ipv4:127.0.0.1:40000"), 0);
    CHECK_EQ_INT(moed_peers_count(p, "ipv4:127.0.0.1:40001"), 1);
    /* Many addresses, some sharing buckets: each keeps its own count. */
    char addr[64];
    moed_peer *many[5000];
    for (int i = 0; i < 5000; i++) {
        snprintf(addr, sizeof addr, "ipv6:[::1]:%d", i);
        CHECK((many[i] = moed_peers_enter(p, addr, 1)));
    }
    for (int i = 0; i < 5000; i += 499) {
        snprintf(addr, sizeof addr, "ipv6:[::1]:%d", i);
        CHECK(moed_peers_enter(p, addr, 1) == NULL);
        CHECK_EQ_INT(moed_peers_count(p, addr), 1);
    }
    for (int i = 0; i < 5000; i++) moed_peers_leave(p, many[i]);
    moed_peers_destroy(p); /* b is still counted: destroy frees it */
    return check_status("test_peers");
}
