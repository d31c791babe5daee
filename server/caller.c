/*
 * caller — whose regions a call may use: its principal (region.h), found once per call and only
 * by calls that use regions.
 *
 *   - With tokens: the token the call carries (rpc.c let it in on that token).
 *   - Without: the local user at the other end, as the kernel reports it. On moed's unix socket,
 *     the uid read when the connection was accepted (moed_unix); over loopback TCP, the owner of
 *     the peer's socket (moed_peer_uid_tcp), kept on the connection's gRPC auth context (one per
 *     connection, gone with it) so that a connection asks the kernel once.
 *   - Nobody else: a peer beyond this host without a token, one on a unix socket with TLS (gRPC's
 *     listener names no peer there), one of a wildcard --listen, one whose socket the kernel does
 *     not know. Their regions would be anyone's, so they get none.
 */
#include "rpc_call.h"

#include <grpc/grpc_security.h>
#include <grpc/support/alloc.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define UID_PROPERTY "moed.uid"

/* gRPC does not lock an auth context: every read and write of ours is under this. */
static pthread_mutex_t auth_lock = PTHREAD_MUTEX_INITIALIZER;

/* The uid kept on the call's connection, or false. */
static bool kept_uid(grpc_auth_context *ctx, uint32_t *uid)
{
    pthread_mutex_lock(&auth_lock);
    grpc_auth_property_iterator it = grpc_auth_context_find_properties_by_name(ctx, UID_PROPERTY);
    const grpc_auth_property *p = grpc_auth_property_iterator_next(&it);
    bool found = p && sscanf(p->value, "%" SCNu32, uid) == 1;
    pthread_mutex_unlock(&auth_lock);
    return found;
}

static void keep_uid(grpc_auth_context *ctx, uint32_t uid)
{
    char v[16];
    uint32_t seen;
    snprintf(v, sizeof v, "%" PRIu32, uid);
    if (kept_uid(ctx, &seen)) return; /* another call of the connection got there first */
    pthread_mutex_lock(&auth_lock);
    grpc_auth_context_add_cstring_property(ctx, UID_PROPERTY, v);
    pthread_mutex_unlock(&auth_lock);
}

/* The loopback TCP peer's uid, from its connection or the kernel. */
static int tcp_uid(rpc_call *c, const char *peer, uint32_t *uid, moed_error *err)
{
    grpc_auth_context *ctx = grpc_call_auth_context(c->call);
    int rc = 0;
    if (!ctx || !kept_uid(ctx, uid)) {
        rc = moed_peer_uid_tcp(&c->rpc->tcp_self, peer, uid, err);
        if (!rc && ctx) keep_uid(ctx, *uid);
    }
    if (ctx) grpc_auth_context_release(ctx);
    return rc;
}

/* The uid of the local user at the other end of the call's connection; err says why not. */
static int local_uid(rpc_call *c, uint32_t *uid, moed_error *err)
{
    const moed_rpc *r = c->rpc;
    char *peer = grpc_call_get_peer(c->call);
    int rc = 0;
    if (!peer)
        rc = moed_fail(err, MOED_ENOMEM, "no memory for the peer's address");
    else if (moed_unix_uid(r->unix_listener, peer, uid, NULL))
        rc = 0;
    else if (!c->local)
        rc = moed_fail(err, MOED_EPRECOND, "it connects from beyond this host");
    else if (!strncmp(peer, "unix", 4))
        rc = moed_fail(err, MOED_EPRECOND, "TLS on a unix socket hides who connects");
    else if (!r->tcp_self.v4 && !r->tcp_self.v6)
        rc = moed_fail(err, MOED_EPRECOND,
                       "the server listens on %.100s, not on one loopback address, so a TCP "
                       "peer's socket cannot be found",
                       r->cfg.listen);
    else
        rc = tcp_uid(c, peer, uid, err);
    gpr_free(peer);
    return rc;
}

int rpc_principal(rpc_call *c, moed_principal *out, moed_error *err)
{
    if (c->has_principal) {
        *out = c->principal;
        return 0;
    }
    uint32_t uid;
    int rc = 0;
    if (c->token)
        c->principal = MOED_PRINCIPAL_TOKEN(c->token);
    else if ((rc = local_uid(c, &uid, err)) == 0)
        c->principal = uid;
    if (rc) {
        char why[200];
        snprintf(why, sizeof why, "%.199s", err->msg);
        return moed_fail(err, MOED_EPRECOND,
                         "regions belong to a bearer token or, without tokens, to the local user "
                         "who connected, and moed cannot tell this caller's (%s): send a token "
                         "(the server's --auth-token-file), connect through the server's unix "
                         "socket or loopback address, or send tensors inline",
                         why);
    }
    c->has_principal = true;
    *out = c->principal;
    return 0;
}
