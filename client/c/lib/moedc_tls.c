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

/* What each item must hold; a key must not be encrypted (no one could type its passphrase). */
typedef struct pem_kind {
    const char *field, *block, *name;
    bool is_key;
} pem_kind;

static const pem_kind CA = { "tls_ca", "-----BEGIN CERTIFICATE-----", "certificate", false };
static const pem_kind CERT = { "tls_cert", "-----BEGIN CERTIFICATE-----", "certificate", false };
static const pem_kind KEY = { "tls_key", "PRIVATE KEY-----", "private key", true };

bool moedc_tls_wanted(const moedc_opts *opts)
{
    return opts &&
           (opts->tls || opts->tls_ca || opts->tls_cert || opts->tls_key || opts->tls_server_name);
}

/* path opened for reading if it is a regular file of at most PEM_MAX_BYTES (*size). */
static int open_regular(const pem_kind *k, const char *path, int *fd, size_t *size,
                        moedc_error *err)
{
    *fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (*fd < 0)
        return moedc_fail(err, MOEDC_EINVAL, "%s '%s': cannot open it: %s", k->field, path,
                          strerror(errno));
    struct stat st;
    int rc = 0;
    if (fstat(*fd, &st) || !S_ISREG(st.st_mode))
        rc = moedc_fail(err, MOEDC_EINVAL, "%s '%s' is not a regular file", k->field, path);
    else if (st.st_size > PEM_MAX_BYTES)
        rc = moedc_fail(err, MOEDC_EINVAL, "%s '%s' is %lld bytes, over %d: not a PEM file?",
                        k->field, path, (long long)st.st_size, PEM_MAX_BYTES);
    if (rc) close(*fd);
    *size = rc ? 0 : (size_t)st.st_size;
    return rc;
}

/* The whole file at path, NUL-terminated, into *out. */
static int read_file(const pem_kind *k, const char *path, char **out, moedc_error *err)
{
    int fd;
    size_t size = 0, n = 0;
    int rc = open_regular(k, path, &fd, &size, err);
    if (rc) return rc;
    char *buf = malloc(size + 1);
    if (!buf) rc = moedc_fail(err, MOEDC_ENOMEM, "out of memory reading %s", k->field);
    while (!rc && n < size) {
        ssize_t got = read(fd, buf + n, size - n);
        if (got > 0)
            n += (size_t)got;
        else if (!got || errno != EINTR)
            rc = moedc_fail(err, MOEDC_EINVAL, "%s '%s': cannot read it: %s", k->field, path,
                            got ? strerror(errno) : "it shrank while read");
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

/* One item (a path, or the PEM text itself) into *out, checked to be of its kind. */
static int load_pem(const pem_kind *k, const char *item, char **out, moedc_error *err)
{
    bool text = !strncmp(item, "-----BEGIN", 10);
    const char *name = text ? "(PEM text)" : item;
    int rc = 0;
    if (text) {
        *out = strdup(item);
        if (!*out) return moedc_fail(err, MOEDC_ENOMEM, "out of memory copying %s", k->field);
    } else if ((rc = read_file(k, item, out, err))) {
        return rc;
    }
    if (!strstr(*out, k->block))
        rc = moedc_fail(err, MOEDC_EINVAL, "%s '%s' holds no PEM %s", k->field, name, k->name);
    else if (k->is_key && strstr(*out, "ENCRYPTED"))
        rc = moedc_fail(err, MOEDC_EINVAL,
                        "%s '%s' is encrypted with a passphrase: give it unencrypted (and "
                        "protect it with file permissions)",
                        k->field, name);
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
    if (opts->tls_ca) rc = load_pem(&CA, opts->tls_ca, &ca, err);
    if (!rc && opts->tls_cert) rc = load_pem(&CERT, opts->tls_cert, &cert, err);
    if (!rc && opts->tls_key) rc = load_pem(&KEY, opts->tls_key, &key, err);
    if (!rc) {
        /* NULL roots: gRPC's defaults ($GRPC_DEFAULT_SSL_ROOTS_FILE_PATH, else its roots.pem);
         * gRPC copies what it is given */
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
