/*
 * test_security — TLS material checks, the bearer token, loopback detection and sd_notify.
 *
 * TLS: keys and self-signed certificates are made with OpenSSL in a temporary folder; a matching
 * pair loads; a key of another certificate, an encrypted key, a file that is not PEM, a missing
 * file and a CA file without certificates are each refused with a message naming the file.
 * Token: read from the file's first line (trimmed) or the environment (the file wins); checked
 * against call metadata — right token, wrong token, a prefix of it, a longer one, another scheme,
 * no metadata, several authorization entries. Notify: datagrams arrive on a socket named by
 * $NOTIFY_SOCKET (path and abstract), and nothing is sent without it.
 */
#include "check.h"
#include "notify.h"
#include "security.h"

#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

static char dir[256];

static const char *path_of(const char *name)
{
    static char buf[8][400];
    static int next;
    char *p = buf[next++ % 8];
    snprintf(p, 400, "%s/%s", dir, name);
    return p;
}

static void write_text(const char *name, const char *text)
{
    FILE *f = fopen(path_of(name), "w");
    fputs(text, f);
    fclose(f);
}

/* ---- TLS files ------------------------------------------------------------------------------- */

static EVP_PKEY *new_key(void)
{
    return EVP_EC_gen("P-256");
}

static void write_cert(const char *name, EVP_PKEY *key)
{
    X509 *x = X509_new();
    X509_set_version(x, 2);
    ASN1_INTEGER_set(X509_get_serialNumber(x), 1);
    X509_gmtime_adj(X509_getm_notBefore(x), 0);
    X509_gmtime_adj(X509_getm_notAfter(x), 3600);
    X509_set_pubkey(x, key);
    X509_NAME_add_entry_by_txt(X509_get_subject_name(x), "CN", MBSTRING_ASC,
                               (const unsigned char *)"localhost", -1, -1, 0);
    X509_set_issuer_name(x, X509_get_subject_name(x));
    X509_sign(x, key, EVP_sha256());
    FILE *f = fopen(path_of(name), "w");
    PEM_write_X509(f, x);
    fclose(f);
    X509_free(x);
}

static void write_key(const char *name, EVP_PKEY *key, const char *passphrase)
{
    FILE *f = fopen(path_of(name), "w");
    PEM_write_PrivateKey(f, key, passphrase ? EVP_aes_256_cbc() : NULL, NULL, 0, NULL,
                         (void *)passphrase);
    fclose(f);
}

/* Loads with the given files; returns the code and leaves the message in err. */
static int load(const char *cert, const char *key, const char *ca, moed_error *err)
{
    moed_security s;
    moed_security_config c = { .tls_cert = cert ? path_of(cert) : NULL,
                               .tls_key = key ? path_of(key) : NULL,
                               .tls_client_ca = ca ? path_of(ca) : NULL };
    int rc = moed_security_load(&c, &s, err);
    if (!rc) CHECK(s.cert_pem && s.key_pem && (!ca || s.ca_pem) && !s.n_tokens);
    moed_security_free(&s);
    return rc;
}

static void test_tls_files(void)
{
    EVP_PKEY *a = new_key(), *b = new_key();
    write_cert("a.crt", a);
    write_key("a.key", a, NULL);
    write_key("b.key", b, NULL);
    write_key("a-enc.key", a, "secret");
    write_text("junk.pem", "this is not PEM\n");
    moed_error err;
    CHECK_EQ_INT(load("a.crt", "a.key", NULL, &err), 0);
    CHECK_EQ_INT(load("a.crt", "a.key", "a.crt", &err), 0); /* a self-signed cert is its own CA */

    CHECK_EQ_INT(load("a.crt", "b.key", NULL, &err), MOED_EINVAL);
    CHECK_MSG(strstr(err.msg, "does not match") && strstr(err.msg, "b.key") &&
                  strstr(err.msg, "a.crt"),
              "%s", err.msg);
    CHECK_EQ_INT(load("a.crt", "a-enc.key", NULL, &err), MOED_EINVAL);
    CHECK_MSG(strstr(err.msg, "encrypted") && strstr(err.msg, "a-enc.key"), "%s", err.msg);
    CHECK_EQ_INT(load("a.crt", "junk.pem", NULL, &err), MOED_EINVAL);
    CHECK_MSG(strstr(err.msg, "no PEM private key") && strstr(err.msg, "junk.pem"), "%s", err.msg);
    CHECK_EQ_INT(load("junk.pem", "a.key", NULL, &err), MOED_EINVAL);
    CHECK_MSG(strstr(err.msg, "no PEM certificate") && strstr(err.msg, "--tls-cert"), "%s",
              err.msg);
    CHECK_EQ_INT(load("missing.crt", "a.key", NULL, &err), MOED_ENOTFOUND);
    CHECK_MSG(strstr(err.msg, "missing.crt") && strstr(err.msg, "No such file"), "%s", err.msg);
    CHECK_EQ_INT(load("a.crt", "a.key", "junk.pem", &err), MOED_EINVAL);
    CHECK_MSG(strstr(err.msg, "--tls-client-ca") && strstr(err.msg, "junk.pem"), "%s", err.msg);
    if (geteuid() != 0) { /* root reads anything */
        chmod(path_of("a.key"), 0);
        CHECK_EQ_INT(load("a.crt", "a.key", NULL, &err), MOED_EIO);
        CHECK_MSG(strstr(err.msg, "a.key"), "%s", err.msg);
    }
    EVP_PKEY_free(a);
    EVP_PKEY_free(b);
}

/* ---- the token ------------------------------------------------------------------------------- */

static int check_md(const moed_security *s, const char *const *values, int n, moed_error *err)
{
    grpc_metadata md[4];
    grpc_metadata_array arr = { .count = (size_t)n, .capacity = 4, .metadata = md };
    for (int i = 0; i < n; i++) {
        memset(&md[i], 0, sizeof md[i]);
        md[i].key = grpc_slice_from_static_string(i == 1 && n == 3 ? "x-other" : "authorization");
        md[i].value = grpc_slice_from_static_string(values[i]);
    }
    int principal;
    return moed_security_check_call(s, &arr, &principal, err);
}

static int check1(const moed_security *s, const char *value, moed_error *err)
{
    return value ? check_md(s, &value, 1, err) : check_md(s, NULL, 0, err);
}

static void test_token(void)
{
    moed_security s;
    moed_error err;
    write_text("token", "  s3cr3t-T0ken \r\n# a comment\n\n  other-token\n");
    moed_security_config c = { .token_file = path_of("token"), .token_env = "from-env" };
    CHECK_EQ_INT(moed_security_load(&c, &s, &err), 0);
    CHECK(s.n_tokens == 2 && !strcmp(s.tokens[0], "s3cr3t-T0ken") &&
          !strcmp(s.tokens[1], "other-token") && !strcmp(s.token_source, "--auth-token-file"));
    CHECK(!s.cert_pem);
    CHECK_EQ_INT(check1(&s, "Bearer s3cr3t-T0ken", &err), 0);
    CHECK_EQ_INT(check1(&s, "bearer   s3cr3t-T0ken", &err), 0);
    /* Each token is a principal: its line's number among the tokens. */
    int principal = -1;
    grpc_metadata one = { .key = grpc_slice_from_static_string("authorization"),
                          .value = grpc_slice_from_static_string("Bearer other-token") };
    grpc_metadata_array arr1 = { .count = 1, .capacity = 1, .metadata = &one };
    CHECK_EQ_INT(moed_security_check_call(&s, &arr1, &principal, &err), 0);
    CHECK_EQ_INT(principal, 2);
    one.value = grpc_slice_from_static_string("Bearer s3cr3t-T0ken");
    CHECK_EQ_INT(moed_security_check_call(&s, &arr1, &principal, &err), 0);
    CHECK_EQ_INT(principal, 1);
    const char *wrong[] = { "Bearer s3cr3t-T0ke",
                            "Bearer s3cr3t-T0kenX",
                            "Bearer S3cr3t-T0ken",
                            "Basic s3cr3t-T0ken",
                            "s3cr3t-T0ken",
                            "Bearer ",
                            "Bearer",
                            "" };
    for (size_t i = 0; i < sizeof wrong / sizeof wrong[0]; i++) {
        CHECK_MSG(check1(&s, wrong[i], &err) == MOED_EUNAUTH, "'%s' accepted", wrong[i]);
        CHECK(strstr(err.msg, "not accepted") && !strstr(err.msg, "s3cr3t"));
    }
    CHECK_EQ_INT(check1(&s, NULL, &err), MOED_EUNAUTH);
    CHECK(strstr(err.msg, "requires a bearer token") && strstr(err.msg, "authorization: Bearer"));
    /* Any authorization entry with the right token will do; other keys are not looked at. */
    const char *several[] = { "Bearer wrong", "Bearer s3cr3t-T0ken", "Bearer s3cr3t-T0ken" };
    CHECK_EQ_INT(check_md(&s, several, 2, &err), 0);
    CHECK_EQ_INT(check_md(&s, several, 3, &err), 0);
    moed_security_free(&s);

    moed_security_config env = { .token_env = "from-env" };
    CHECK_EQ_INT(moed_security_load(&env, &s, &err), 0);
    CHECK(!strcmp(s.token_source, "MOED_AUTH_TOKEN"));
    CHECK_EQ_INT(check1(&s, "Bearer from-env", &err), 0);
    moed_security_free(&s);

    moed_security_config none = { 0 };
    CHECK_EQ_INT(moed_security_load(&none, &s, &err), 0);
    CHECK_EQ_INT(check1(&s, NULL, &err), 0); /* no token configured: every call passes */
    moed_security_free(&s);

    const char *bad[] = { "\n\n", "two words\n", "", "# only a comment\n", "same\nsame\n" };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        write_text("bad-token", bad[i]);
        moed_security_config b = { .token_file = path_of("bad-token") };
        CHECK_EQ_INT(moed_security_load(&b, &s, &err), MOED_EINVAL);
        CHECK_MSG(strstr(err.msg, "bad-token"), "%s", err.msg);
        moed_security_free(&s);
    }
    moed_security_config missing = { .token_file = path_of("nope") };
    CHECK_EQ_INT(moed_security_load(&missing, &s, &err), MOED_ENOTFOUND);
    CHECK(strstr(err.msg, "--auth-token-file") && strstr(err.msg, "nope"));
    moed_security_free(&s);
    /* a FIFO would block the open until a writer came: refused without opening it for reading */
    CHECK_EQ_INT(mkfifo(path_of("fifo-token"), 0600), 0);
    moed_security_config fifo = { .token_file = path_of("fifo-token") };
    CHECK_EQ_INT(moed_security_load(&fifo, &s, &err), MOED_EIO);
    CHECK_MSG(strstr(err.msg, "--auth-token-file") && strstr(err.msg, "FIFO"), "%s", err.msg);
    moed_security_free(&s);
    moed_security_config empty_env = { .token_env = "" };
    CHECK_EQ_INT(moed_security_load(&empty_env, &s, &err), MOED_EINVAL);
    CHECK(strstr(err.msg, "MOED_AUTH_TOKEN"));
    moed_security_free(&s);
}

static void test_loopback(void)
{
    const char *yes[] = { "127.0.0.1:50051",   "127.1.2.3:1",      "localhost:50051",
                          "[::1]:50051",       "ipv4:127.0.0.1:5", "unix:/run/moed.sock",
                          "unix-abstract:moed" };
    const char *no[] = { "0.0.0.0:50051",     "[::]:50051",  ":50051", "10.0.0.5:50051",
                         "example.com:50051", "128.0.0.1:1", "[::2]:1" };
    for (size_t i = 0; i < sizeof yes / sizeof yes[0]; i++)
        CHECK_MSG(moed_listen_is_loopback(yes[i]), "%s", yes[i]);
    for (size_t i = 0; i < sizeof no / sizeof no[0]; i++)
        CHECK_MSG(!moed_listen_is_loopback(no[i]), "%s", no[i]);
}

/* ---- sd_notify ------------------------------------------------------------------------------- */

static void test_notify(void)
{
    unsetenv("NOTIFY_SOCKET");
    CHECK_EQ_INT(moed_notify("READY=1"), 0);
    for (int abstract = 0; abstract < 2; abstract++) {
        struct sockaddr_un sa = { .sun_family = AF_UNIX };
        char name[300];
        snprintf(name, sizeof name, "%s%s/notify%d", abstract ? "@" : "", dir, abstract);
        strcpy(sa.sun_path, name);
        if (abstract) sa.sun_path[0] = 0;
        int fd = socket(AF_UNIX, SOCK_DGRAM, 0);
        CHECK_EQ_INT(bind(fd, (struct sockaddr *)&sa,
                          (socklen_t)(offsetof(struct sockaddr_un, sun_path) + strlen(name))),
                     0);
        setenv("NOTIFY_SOCKET", name, 1);
        CHECK_EQ_INT(moed_notify("READY=1\nSTATUS=serving %d layers", 3), 1);
        char buf[256];
        ssize_t n = recv(fd, buf, sizeof buf - 1, MSG_DONTWAIT);
        buf[n > 0 ? n : 0] = 0;
        CHECK_MSG(!strcmp(buf, "READY=1\nSTATUS=serving 3 layers"), "got '%s'", buf);
        close(fd);
    }
    setenv("NOTIFY_SOCKET", "/nonexistent/socket", 1);
    CHECK_EQ_INT(moed_notify("STOPPING=1"), MOED_EIO);
    setenv("NOTIFY_SOCKET", "relative", 1);
    CHECK_EQ_INT(moed_notify("STOPPING=1"), MOED_EIO);
    unsetenv("NOTIFY_SOCKET");
}

int main(void)
{
    snprintf(dir, sizeof dir, "/tmp/moed-test-security-XXXXXX");
    if (!mkdtemp(dir)) return 1;
    test_tls_files();
    test_token();
    test_loopback();
    test_notify();
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd)) fprintf(stderr, "could not remove %s\n", dir);
    return check_status("test_security");
}
