/*
 * moed_security — loads the TLS material and the bearer token, checks them, and checks calls.
 *
 * Why check the PEM files with OpenSSL here when gRPC reads them too: gRPC core finds a bad key
 * only when it builds its TLS context, and then says little more than that the handshaker could
 * not be created. OpenSSL (already linked, through gRPC) tells which file is wrong and how, so
 * the daemon can refuse to start with a sentence a person can act on.
 *
 * Why a bearer token and not just mutual TLS: many deployments terminate TLS in front of the
 * daemon (a mesh sidecar) or cannot hand certificates to every caller; a shared token in call
 * metadata works through all of them. The two combine.
 */
#include "security.h"

#include "file.h"
#include "log.h"

#include <ctype.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#define MAX_PEM_BYTES   (1 << 20)
#define MAX_TOKEN_BYTES 4096

/* ---- files ----------------------------------------------------------------------------------- */

/* The whole file, NUL-terminated, in *out (malloc'd): a regular file only (moed_file), so a FIFO
 * or a device is refused at once instead of blocking the start or being read forever. */
static int read_file(const char *flag, const char *path, size_t max, char **out, moed_error *err)
{
    size_t n;
    return moed_file_read(path, flag, max, out, &n, err);
}

/* OpenSSL's password callback: never prompt on a terminal; an encrypted key simply fails. */
static int no_password(char *buf, int size, int rwflag, void *u)
{
    return 0;
}

static X509 *read_cert(const char *pem)
{
    BIO *bio = BIO_new_mem_buf(pem, -1);
    X509 *x = bio ? PEM_read_bio_X509(bio, NULL, no_password, NULL) : NULL;
    BIO_free(bio);
    return x;
}

static int count_certs(const char *pem)
{
    BIO *bio = BIO_new_mem_buf(pem, -1);
    int n = 0;
    X509 *x;
    while (bio && (x = PEM_read_bio_X509(bio, NULL, no_password, NULL))) {
        X509_free(x);
        n++;
    }
    BIO_free(bio);
    ERR_clear_error(); /* the read that ends the loop leaves an error on the queue */
    return n;
}

static EVP_PKEY *read_key(const char *pem)
{
    BIO *bio = BIO_new_mem_buf(pem, -1);
    EVP_PKEY *k = bio ? PEM_read_bio_PrivateKey(bio, NULL, no_password, NULL) : NULL;
    BIO_free(bio);
    return k;
}

static void warn_validity(const char *path, X509 *cert)
{
    if (X509_cmp_current_time(X509_get0_notAfter(cert)) < 0)
        moed_log_warn("the TLS certificate has expired: clients will refuse it", "file=\"%s\"",
                      path);
    else if (X509_cmp_current_time(X509_get0_notBefore(cert)) > 0)
        moed_log_warn("the TLS certificate is not valid yet: clients will refuse it", "file=\"%s\"",
                      path);
}

/* The certificate parses, the key parses (unencrypted) and the key belongs to the certificate. */
static int check_pair(const moed_security_config *cfg, const moed_security *s, moed_error *err)
{
    X509 *cert = read_cert(s->cert_pem);
    EVP_PKEY *key = cert ? read_key(s->key_pem) : NULL;
    int rc = 0;
    if (!cert)
        rc = moed_fail(err, MOED_EINVAL,
                       "--tls-cert '%s' holds no PEM certificate (-----BEGIN CERTIFICATE-----); "
                       "give the server's certificate chain in PEM",
                       cfg->tls_cert);
    else if (!key && strstr(s->key_pem, "ENCRYPTED"))
        rc = moed_fail(err, MOED_EINVAL,
                       "--tls-key '%s' is encrypted with a passphrase, which moed cannot ask for; "
                       "give an unencrypted key (openssl pkey -in KEY -out NEW) and protect the "
                       "file with its permissions",
                       cfg->tls_key);
    else if (!key)
        rc = moed_fail(err, MOED_EINVAL,
                       "--tls-key '%s' holds no PEM private key (-----BEGIN PRIVATE KEY-----); "
                       "give the key of the certificate in --tls-cert",
                       cfg->tls_key);
    else if (X509_check_private_key(cert, key) != 1)
        rc = moed_fail(err, MOED_EINVAL,
                       "--tls-key '%s' does not match the certificate in --tls-cert '%s' (their "
                       "public keys differ); give the key the certificate was issued for",
                       cfg->tls_key, cfg->tls_cert);
    else
        warn_validity(cfg->tls_cert, cert);
    ERR_clear_error();
    EVP_PKEY_free(key);
    X509_free(cert);
    return rc;
}

/* One token, n bytes at p: printable ASCII without spaces, as an HTTP header value carries it
 * unchanged. */
static int add_token(moed_security *s, const char *p, size_t n, const char *source, int line,
                     moed_error *err)
{
    if (n > MAX_TOKEN_BYTES)
        return moed_fail(err, MOED_EINVAL, "%s line %d: the token is %zu bytes; at most %d", source,
                         line, n, MAX_TOKEN_BYTES);
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)p[i] <= 0x20 || (unsigned char)p[i] >= 0x7f)
            return moed_fail(err, MOED_EINVAL,
                             "%s line %d: the token has a space or a non-printable byte at offset "
                             "%zu; use printable ASCII only (e.g. openssl rand -hex 32)",
                             source, line, i);
    for (int t = 0; t < s->n_tokens; t++)
        if (s->token_lens[t] == n && !memcmp(s->tokens[t], p, n))
            return moed_fail(err, MOED_EINVAL,
                             "%s line %d repeats an earlier token: each token is a principal of "
                             "its own, so each must differ",
                             source, line);
    if (s->n_tokens == MOED_SECURITY_MAX_TOKENS)
        return moed_fail(err, MOED_EINVAL, "%s holds more than %d tokens", source,
                         MOED_SECURITY_MAX_TOKENS);
    char *t = malloc(n + 1);
    if (!t) return moed_fail(err, MOED_ENOMEM, "no memory for the token");
    memcpy(t, p, n);
    t[n] = 0;
    s->tokens[s->n_tokens] = t;
    s->token_lens[s->n_tokens++] = n;
    return 0;
}

/* The tokens: each line of the file (or the variable), trimmed, that is neither blank nor a
 * comment ('#'); one at least. */
static int set_tokens(moed_security *s, char *raw, const char *source, moed_error *err)
{
    s->tokens = calloc(MOED_SECURITY_MAX_TOKENS, sizeof *s->tokens);
    s->token_lens = calloc(MOED_SECURITY_MAX_TOKENS, sizeof *s->token_lens);
    if (!s->tokens || !s->token_lens) return moed_fail(err, MOED_ENOMEM, "no memory for tokens");
    int line = 0;
    for (char *p = raw; *p;) {
        char *e = p + strcspn(p, "\r\n"), *next = e + strspn(e, "\r\n");
        line++;
        while (p < e && isspace((unsigned char)*p)) p++;
        while (e > p && isspace((unsigned char)e[-1])) e--;
        int rc = e > p && *p != '#' ? add_token(s, p, (size_t)(e - p), source, line, err) : 0;
        if (rc) return rc;
        p = next;
    }
    if (!s->n_tokens)
        return moed_fail(err, MOED_EINVAL,
                         "%s is empty: put the bearer token on a line of its own (e.g. from "
                         "openssl rand -hex 32)",
                         source);
    return 0;
}

static int load_token(const moed_security_config *cfg, moed_security *s, moed_error *err)
{
    if (cfg->token_file) {
        char *raw, source[600];
        int rc = read_file("--auth-token-file", cfg->token_file, MAX_TOKEN_BYTES * 2, &raw, err);
        if (rc) return rc;
        snprintf(source, sizeof source, "--auth-token-file '%s'", cfg->token_file);
        rc = set_tokens(s, raw, source, err);
        free(raw);
        s->token_source = "--auth-token-file";
        return rc;
    }
    if (!cfg->token_env) return 0;
    char *raw = strdup(cfg->token_env);
    if (!raw) return moed_fail(err, MOED_ENOMEM, "no memory for the token");
    int rc = set_tokens(s, raw, "$MOED_AUTH_TOKEN", err);
    free(raw);
    s->token_source = "MOED_AUTH_TOKEN";
    return rc;
}

int moed_security_load(const moed_security_config *cfg, moed_security *s, moed_error *err)
{
    memset(s, 0, sizeof *s);
    int rc = 0;
    if (cfg->tls_cert) {
        if ((rc = read_file("--tls-cert", cfg->tls_cert, MAX_PEM_BYTES, &s->cert_pem, err)) ||
            (rc = read_file("--tls-key", cfg->tls_key, MAX_PEM_BYTES, &s->key_pem, err)) ||
            (rc = check_pair(cfg, s, err)))
            return rc;
    }
    if (cfg->tls_client_ca) {
        if ((rc = read_file("--tls-client-ca", cfg->tls_client_ca, MAX_PEM_BYTES, &s->ca_pem, err)))
            return rc;
        if (!count_certs(s->ca_pem))
            return moed_fail(err, MOED_EINVAL,
                             "--tls-client-ca '%s' holds no PEM certificate; give the CA "
                             "certificate(s) that sign your clients' certificates",
                             cfg->tls_client_ca);
    }
    return load_token(cfg, s, err);
}

void moed_security_free(moed_security *s)
{
    free(s->cert_pem);
    free(s->key_pem);
    free(s->ca_pem);
    for (int i = 0; i < s->n_tokens; i++) free(s->tokens[i]);
    free(s->tokens);
    free(s->token_lens);
    memset(s, 0, sizeof *s);
}

grpc_server_credentials *moed_security_credentials(const moed_security *s)
{
    if (!s || !s->cert_pem) return grpc_insecure_server_credentials_create();
    grpc_ssl_pem_key_cert_pair pair = { .private_key = s->key_pem, .cert_chain = s->cert_pem };
    return grpc_ssl_server_credentials_create_ex(
        s->ca_pem, &pair, 1,
        s->ca_pem ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                  : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE,
        NULL);
}

/* ---- calls ----------------------------------------------------------------------------------- */

/* Compares all of got against want in time that depends only on got's length (which the caller
 * chose), never on where the first difference is. */
static bool same_token(const char *want, size_t wlen, const uint8_t *got, size_t glen)
{
    unsigned diff = wlen != glen;
    for (size_t i = 0; i < glen; i++) diff |= (unsigned)(got[i] ^ (uint8_t)want[i % wlen]);
    return diff == 0;
}

static bool slice_is(grpc_slice s, const char *str)
{
    size_t n = strlen(str);
    return GRPC_SLICE_LENGTH(s) == n && !memcmp(GRPC_SLICE_START_PTR(s), str, n);
}

/* The number (1, 2, ...) of the token got is, or 0; every token is compared whichever matches. */
static int which_token(const moed_security *s, const uint8_t *got, size_t glen)
{
    unsigned found = 0;
    for (int t = 0; t < s->n_tokens; t++) {
        unsigned match = same_token(s->tokens[t], s->token_lens[t], got, glen);
        found |= (unsigned)(t + 1) & (0u - match);
    }
    return (int)found;
}

int moed_security_check_call(const moed_security *s, const grpc_metadata_array *md, int *token,
                             moed_error *err)
{
    *token = 0;
    if (!s || !s->n_tokens) return 0;
    bool seen = false;
    for (size_t i = 0; i < md->count; i++) {
        if (!slice_is(md->metadata[i].key, "authorization")) continue;
        seen = true;
        const uint8_t *v = GRPC_SLICE_START_PTR(md->metadata[i].value);
        size_t n = GRPC_SLICE_LENGTH(md->metadata[i].value);
        if (n < 7 || strncasecmp((const char *)v, "bearer ", 7)) continue;
        size_t at = 7;
        while (at < n && v[at] == ' ') at++;
        if ((*token = which_token(s, v + at, n - at))) return 0;
    }
    if (!seen)
        return moed_fail(err, MOED_EUNAUTH,
                         "this server requires a bearer token: send the metadata "
                         "'authorization: Bearer <token>' (moectl --token, MoEClient(token=...))");
    return moed_fail(err, MOED_EUNAUTH,
                     "the authorization metadata was not accepted: send 'authorization: Bearer "
                     "<token>' with a token this server was given");
}

bool moed_listen_is_loopback(const char *listen)
{
    if (!strncmp(listen, "unix:", 5) || !strncmp(listen, "unix-abstract:", 14)) return true;
    if (!strncmp(listen, "ipv4:", 5) || !strncmp(listen, "ipv6:", 5)) listen += 5;
    const char *colon = strrchr(listen, ':');
    size_t n = colon ? (size_t)(colon - listen) : strlen(listen);
    char host[256];
    if (n >= sizeof host) return false;
    memcpy(host, listen, n);
    host[n] = 0;
    return !strcmp(host, "localhost") || !strncmp(host, "127.", 4) || !strcmp(host, "[::1]") ||
           !strcmp(host, "::1");
}
