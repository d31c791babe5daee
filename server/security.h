/*
 * moed_security — transport security and caller authentication for the gRPC port: TLS with an
 * optional client-certificate requirement (mutual TLS), and an optional bearer token.
 *
 * Everything is read and checked once at start-up, before the weights load, so a bad file stops
 * the daemon in a second with a message naming the file and what is wrong with it (unreadable,
 * not PEM, an encrypted key, a key that does not belong to the certificate).
 *
 * The token: every call except the health service's must carry the metadata
 * `authorization: Bearer <token>`; the comparison takes the same time whatever the bytes. Health
 * stays open so that Kubernetes probes and load balancers (which send no credentials) can check
 * the server. The token file may hold several tokens, one a line (blank lines and lines starting
 * with '#' are skipped): each is a principal of its own, which owns the tensor regions it
 * registers (region.h); $MOED_AUTH_TOKEN holds one.
 */
#ifndef MOED_SECURITY_H
#define MOED_SECURITY_H

#include "moed_err.h"

#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <stdbool.h>
#include <stddef.h>

typedef struct moed_security_config {
    const char *tls_cert;      /* PEM certificate chain, or NULL for plaintext */
    const char *tls_key;       /* PEM private key (unencrypted) */
    const char *tls_client_ca; /* PEM CA bundle: require client certificates it signed; or NULL */
    const char *token_file;    /* the bearer token's file (first line), or NULL */
    const char *token_env;     /* $MOED_AUTH_TOKEN's value, or NULL; the file wins */
} moed_security_config;

typedef struct moed_security {
    char *cert_pem, *key_pem, *ca_pem; /* NULL when TLS is off */
    char **tokens;                     /* [n_tokens]; NULL when no token is required */
    size_t *token_lens;
    int n_tokens;
    const char *token_source; /* "--auth-token-file" or "MOED_AUTH_TOKEN", for the log */
} moed_security;

/* Reads and checks what cfg names. MOED_EINVAL (bad content or a missing companion flag) or
 * MOED_EIO (unreadable file), with the file and the fix in err. *s is freed by
 * moed_security_free whatever the result. */
int moed_security_load(const moed_security_config *cfg, moed_security *s, moed_error *err);
void moed_security_free(moed_security *s);

/* Server credentials for grpc_server_add_http2_port: TLS (requiring client certificates when a
 * client CA is set) or insecure. Release with grpc_server_credentials_release. */
grpc_server_credentials *moed_security_credentials(const moed_security *s);

/* The most tokens a token file may hold. */
#define MOED_SECURITY_MAX_TOKENS 64

/* 0 when no token is required or md carries one of the tokens; MOED_EUNAUTH with a message that
 * says what to send otherwise (never anything about the expected tokens). *token: 0 when no token
 * is required, else the number (1, 2, ...) of the token's line among the tokens (its principal:
 * MOED_PRINCIPAL_TOKEN, region.h). */
int moed_security_check_call(const moed_security *s, const grpc_metadata_array *md, int *token,
                             moed_error *err);

/* True for addresses only this host can reach: 127.0.0.0/8, ::1, localhost, unix sockets. */
bool moed_listen_is_loopback(const char *listen);

#endif
