/*
 * moed_unix — moed's own listener on a unix socket (--listen unix:PATH or unix-abstract:NAME,
 * without TLS): it accepts each connection itself, reads who connected (SO_PEERCRED: the uid of
 * the process that called connect) and hands the connection to gRPC
 * (grpc_server_add_channel_from_fd), which names the peer of its calls "fd:N"; moed_unix_uid maps
 * that back to the uid.
 *
 * Why not gRPC's listener: gRPC 1.51 names every unix peer alike ("unix:PATH"), so moed could not
 * tell whose calls are whose; and it removes any socket file at the path before it binds, taking a
 * live daemon's socket over. moed_unix_claim connects to the path first: when something answers
 * there the start fails; a socket file nobody answers on is stale (its daemon died) and is
 * removed; anything else at the path is left alone and the start fails. gRPC 1.51 takes
 * connections from descriptors with insecure credentials only, so TLS on a unix socket keeps
 * gRPC's listener (the path claimed first all the same), and its peers have no uid.
 *
 * What gRPC's listener gave a connection and a descriptor does not get is its handshake deadline:
 * a connection that sends nothing for MOED_HANDSHAKE_MS is closed here before gRPC sees it.
 * The server's channel arguments (stream limits, keepalive, the resource quota) apply to it as to
 * any. At most MOED_UNIX_PENDING connections wait for their first bytes; past that new ones are
 * closed at once.
 *
 * Why the uid of "fd:N" is never another connection's: gRPC closes a connection's descriptor only
 * when its transport is destroyed, which waits for every call on it; so while a call asks, N is
 * its connection's, and the entry for N was written when that connection was accepted.
 *
 * Threads: one accept thread; moed_unix_uid from any thread.
 */
#ifndef MOED_UNIX_LISTENER_H
#define MOED_UNIX_LISTENER_H

#include "moed_err.h"

#include <grpc/grpc.h>
#include <stdbool.h>
#include <stdint.h>

#define MOED_UNIX_PENDING 1024
/* A new connection's deadline for its first bytes here (this thread polls it at once: no reading of
 * other connections delays it). */
#define MOED_HANDSHAKE_MS 10000

typedef struct moed_unix moed_unix;

/* Whether a --listen address is a unix socket (unix:PATH or unix-abstract:NAME). */
bool moed_unix_is_address(const char *listen);

/* Makes sure nothing answers at the address, removing a stale socket file (see above); MOED_EIO
 * naming the address and what is there otherwise. */
int moed_unix_claim(const char *address, moed_error *err);

/* Claims the address, binds and listens, and starts the accept thread, which waits for
 * moed_unix_serve. MOED_EIO naming the address when it cannot. */
int moed_unix_open(const char *address, moed_unix **out, moed_error *err);

/* Hands every connection from now on to server (started: grpc_server_start). */
void moed_unix_serve(moed_unix *u, grpc_server *server);

/* Stops accepting: the thread ends, waiting connections are closed, and the socket file is removed
 * if it is still this listener's. Idempotent; moed_unix_uid keeps answering. */
void moed_unix_stop(moed_unix *u);

/* Stops (if need be) and frees; NULL: nothing. */
void moed_unix_free(moed_unix *u);

/* The uid of the process that opened the connection of a call whose peer is "fd:N", and the
 * connection's number in accept order (which tells it from an earlier connection on the same
 * descriptor); false for any other peer. uid or seq may be NULL. */
bool moed_unix_uid(moed_unix *u, const char *peer, uint32_t *uid, uint64_t *seq);

#endif
