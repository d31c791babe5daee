/*
 * moedc_tls — TLS credentials for a channel (moedc_tls.h states the contract).
 *
 * Files are read here rather than by gRPC so that what is wrong with one can be said plainly: gRPC
 * core would take any bytes and fail the handshake later as UNAVAILABLE. A file must be regular
 * (a FIFO would block the connect for ever) and small; the checks look for the PEM block each item
 * needs, which catches swapped or truncated files, not a key that belongs to another certificate
 * (that only the handshake can tell).
 */
#include "moedc_tls.h"
#include "moedc_common.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

enum { PEM_MAX_BYTES = 1 << 20 }; /* far above any certificate bundle */

bool moedc_tls_wanted(const moedc_opts *opts)
{
    return opts &&
           (opts->tls || opts->tls_ca || opts->tls_cert || opts->tls_key || opts->tls_server_name);
}

/* The whole regular file at path, NUL-terminated, into *out. */
static int read_file(const char *what, const char *path, char **out, moedc_error *err)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0)
        return moedc_fail(err, MOEDC_EINVAL, "%s '%s': cannot open it: %s", what, path,
                          strerror(errno));
    struct stat st;
    int rc = 0;
    if (fstat(fd, &st) || !S_ISREG(st.st_mode))
        rc = moedc_fail(err, MOEDC_EINVAL, "%s '%s' is not a regular file", what, path);
    else if (st.st_size > PEM_MAX_BYTES)
        rc = moedc_fail(err, MOEDC_EINVAL, "%s '%s' is %lld bytes, over %d: not a PEM file?", what,
                        path, (long long)st.st_size, PEM_MAX_BYTES);
    char *buf = rc ? NULL : malloc((size_t)st.st_size + 1);
    if (!rc && !buf) rc = moedc_fail(err, MOEDC_ENOMEM, "out of memory reading %s", what);
    size_t n = 0;
    while (!rc && n < (size_t)st.st_size) {
        ssize_t got = read(fd, buf + n, (size_t)st.st_size - n);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0)
            rc = moedc_fail(err, MOEDC_EINVAL, "%s '%s': cannot read it: %s", what, path,
                            got ? strerror(errno) : "it shrank while read");
        else
            n += (size_t)got;
    }
    close(fd);
    if (rc) {
        free(buf);
        return rc;
    }
    buf[n] = 0;
    *out = buf;
    return 0;
}

/* One PEM item (a path, or the text), checked to hold `block` ("CERTIFICATE-----", ...). */
static int load_pem(const char *what, const char *item, const char *block, const char *kind,
                    char **out, moedc_error *err)
{
    bool inline_pem = !strncmp(item, "-----BEGIN", 10);
    const char *name = inline_pem ? "(PEM text)" : item;
    int rc = 0;
    if (inline_pem) {
        *out = strdup(item);
        if (!*out) return moedc_fail(err, MOEDC_ENOMEM, "out of memory copying %s", what);
    } else if ((rc = read_file(what, item, out, err))) {
        return rc;
    }
    if (!strstr(*out, block))
        rc = moedc_fail(err, MOEDC_EINVAL, "%s '%s' holds no PEM %s", what, name, kind);
    else if (strstr(*out, "ENCRYPTED"))
        rc = moedc_fail(err, MOEDC_EINVAL,
                        "%s '%s' is encrypted with a passphrase: give it unencrypted (and "
                        "protect it with file permissions)",
                        what, name);
    if (rc) {
        free(*out);
        *out = NULL;
    }
    return rc;
}

int moedc_tls_credentials(const moedc_opts *opts, grpc_channel_credentials **out, moedc_error *err)
{
    *out = NULL;
    if (!moedc_tls_wanted(opts)) {
        *out = grpc_insecure_credentials_create();
        return 0;
    }
    if (!opts->tls_cert != !opts->tls_key)
        return moedc_fail(err, MOEDC_EINVAL, "%s without %s: a client certificate needs its key",
                          opts->tls_cert ? "tls_cert" : "tls_key",
                          opts->tls_cert ? "tls_key" : "tls_cert");
    char *ca = NULL, *cert = NULL, *key = NULL;
    int rc = 0;
    if (opts->tls_ca)
        rc = load_pem("tls_ca", opts->tls_ca, "CERTIFICATE-----", "certificate", &ca, err);
    if (!rc && opts->tls_cert)
        rc = load_pem("tls_cert", opts->tls_cert, "CERTIFICATE-----", "certificate", &cert, err);
    if (!rc && opts->tls_key)
        rc = load_pem("tls_key", opts->tls_key, "PRIVATE KEY-----", "private key", &key, err);
    if (!rc) {
        /* NULL roots: gRPC's defaults ($GRPC_DEFAULT_SSL_ROOTS_FILE_PATH, else its roots.pem) */
        grpc_ssl_pem_key_cert_pair pair = { .private_key = key, .cert_chain = cert };
        *out = grpc_ssl_credentials_create(ca, cert ? &pair : NULL, NULL, NULL);
        if (!*out) rc = moedc_fail(err, MOEDC_EINVAL, "gRPC refused the TLS settings");
    }
    free(ca);
    free(cert);
    if (key) explicit_bzero(key, strlen(key)); /* no copy of the key left in freed memory */
    free(key);
    return rc;
}
