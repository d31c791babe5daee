/*
 * cli_common — what moectl and moed-load share beyond the parser: the options that reach the
 * daemon (address, bearer token, TLS) and the values of the gating options.
 *
 * Each tool embeds a cli_conn named `conn` in its argument struct and puts CLI_CONN_OPTS(struct)
 * in its option table, so both take the same flags with the same meaning and help.
 */
#ifndef MOED_CLI_COMMON_H
#define MOED_CLI_COMMON_H

#include "moed_opt.h"
#include "moedclient.h"

#include <stddef.h>

typedef struct cli_conn {
    const char *target;
    const char *token, *token_file;
    int tls;
    const char *tls_ca, *tls_cert, *tls_key, *tls_server_name;
    char *token_read; /* --token-file's token, owned (cli_conn_free) */
} cli_conn;

#define CLI_CONN_OPTS(T)                                                                           \
    MOED_OPT_STR_ROW("target", offsetof(T, conn.target), "ADDR", "127.0.0.1:50051", NULL,          \
                     "the daemon: host:port, or unix:/path for a Unix socket; a fleet of\n"        \
                     "daemons holding parts of the layers and experts: several, comma-\n"          \
                     "separated, or a dns:///NAME:PORT name with several addresses"),              \
        MOED_OPT_STR_ROW("token", offsetof(T, conn.token), "T", NULL, NULL,                        \
                         "bearer token sent as 'authorization: Bearer T' (other local users\n"     \
                         "can see it in ps: prefer --token-file)"),                                \
        MOED_OPT_STR_ROW("token-file", offsetof(T, conn.token_file), "FILE", NULL, NULL,           \
                         "the bearer token: the file's first line"),                               \
        MOED_OPT_FLAG_ROW(                                                                         \
            "tls", offsetof(T, conn.tls), 1, NULL,                                                 \
            "TLS, the daemon's certificate checked against gRPC's default roots\n"                 \
            "($GRPC_DEFAULT_SSL_ROOTS_FILE_PATH); --tls-ca and the others imply it"),              \
        MOED_OPT_STR_ROW("tls-ca", offsetof(T, conn.tls_ca), "FILE", NULL, NULL,                   \
                         "TLS: the CA certificates (PEM) the daemon's certificate must chain to"), \
        MOED_OPT_STR_ROW("tls-cert", offsetof(T, conn.tls_cert), "FILE", NULL, NULL,               \
                         "mutual TLS: this client's certificate (PEM), with --tls-key"),           \
        MOED_OPT_STR_ROW("tls-key", offsetof(T, conn.tls_key), "FILE", NULL, NULL,                 \
                         "mutual TLS: its private key (PEM, unencrypted)"),                        \
        MOED_OPT_STR_ROW("tls-server-name", offsetof(T, conn.tls_server_name), "NAME", NULL, NULL, \
                         "TLS: the name the daemon's certificate must carry, when ADDR does\n"     \
                         "not give it (an IP address; for a unix: socket, localhost is checked)")

/* The moedc_opts the options ask for (timeout_s left 0). A usage error, printed and returned as
 * MOED_OPT_EXIT_USAGE, when they do not go together or a file named cannot be used. */
int cli_conn_opts(const moed_opt_spec *spec, cli_conn *c, moedc_opts *out);
void cli_conn_free(cli_conn *c);

/* A token file's token (its first line, without surrounding blanks; a regular file only: a FIFO
 * would hold the tool up for ever) into *out (malloc'd); a usage error naming flag otherwise. */
int cli_read_token(const moed_opt_spec *spec, const char *flag, const char *path, char **out);

/* Connects to --target: one daemon (moedc_connect), or a fleet (moedc_connect_many) when it lists
 * several, comma-separated (gRPC's own ipv4:/ipv6: address lists are passed whole). */
int cli_connect(const cli_conn *c, const moedc_opts *o, moedc **out, moedc_error *err);

/* MOED_OPT_CUSTOM parsers into an int: a gating strategy's name (model, topk, sigmoid, ...), and
 * on|off for renormalisation (MOEDC_RENORM_ON / _OFF). */
int cli_parse_strategy(const char *value, void *field, moed_error *err);
int cli_parse_on_off(const char *value, void *field, moed_error *err);

#endif
