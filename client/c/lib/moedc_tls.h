/*
 * moedc_tls — the channel credentials a moedc_opts asks for (private to lib/): plaintext, or TLS
 * with the CA certificates, client certificate and key it names, each checked before gRPC sees it
 * so a wrong file is reported at connect time, naming the file, rather than as a failed handshake.
 */
#ifndef MOEDC_TLS_H
#define MOEDC_TLS_H

#include "moedclient.h"

#include <grpc/grpc_security.h>

/* True when opts ask for TLS: opts->tls, or any tls_* item set. */
bool moedc_tls_wanted(const moedc_opts *opts);

/* Insecure credentials, or TLS ones built from opts' PEM items (each a file's path, or the PEM
 * text itself when it starts with "-----BEGIN"). MOEDC_EINVAL with a message naming the item
 * (tls_ca, tls_cert, tls_key) and the file when one is unreadable, not PEM or encrypted, or
 * when tls_cert and tls_key do not come together. */
int moedc_tls_credentials(const moedc_opts *opts, grpc_channel_credentials **out, moedc_error *err);

#endif
