/*
 * test_config — flags and the config file: defaults, both flag syntaxes, byte suffixes, layer
 * lists, the file's precedence below the command line, and bad values naming the flag (or the
 * file and line), the value and what is accepted. Also the hardening docs/security.md lists under
 * "Files" and "Addresses": ports checked (1..65535, 0 for any), quoted values kept whole before
 * comments, a config path that is a directory, device or FIFO refused at once (a FIFO must not
 * block), a bound on the file's size, and layer lists expanded in linear time with a bound on
 * their numbers and length.
 */
#include "check.h"
#include "config.h"
#include "log.h"
#include "moed_time.h"

#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static int load(moed_config *cfg, moed_error *err, FILE *out, int argc, char **argv)
{
    memset(err, 0, sizeof *err);
    return moed_config_load(cfg, argc, argv, out ? out : stderr, err);
}

#define ARGV(...)           ((char *[]){ "moed", __VA_ARGS__, NULL })
#define ARGC(...)           ((int)(sizeof((char *[]){ "moed", __VA_ARGS__ }) / sizeof(char *)))
#define LOAD(cfg, err, ...) load(cfg, err, NULL, ARGC(__VA_ARGS__), ARGV(__VA_ARGS__))

static void test_defaults(void)
{
    moed_config c;
    moed_error err;
    char *argv[] = { "moed", NULL };
    CHECK_EQ_INT(load(&c, &err, NULL, 1, argv), MOED_CONFIG_RUN);
    CHECK(!strcmp(c.listen, "127.0.0.1:50051") && !strcmp(c.backend, "auto"));
    CHECK(!strcmp(c.weights, "stored"));
    CHECK(!c.model && !c.synthetic && !c.layers.text && c.devices.n == 0);
    CHECK_EQ_INT(c.cq_threads, 4);
    CHECK_EQ_INT(c.max_message_bytes, 256 << 20);
    CHECK_EQ_INT(c.max_batch_tokens, 8192);
    CHECK_EQ_INT(c.max_delay_us, 0);
    CHECK_EQ_INT(c.max_queue_requests, 1024);
    CHECK_EQ_INT(c.log_level, MOED_LOG_INFO);
    CHECK(moed_config_wants_layer(&c, 12345));
    moed_config_free(&c);
}

static void test_flags(void)
{
    moed_config c;
    moed_error err;
    CHECK_EQ_INT(LOAD(&c, &err, "--listen=0.0.0.0:7000", "--threads", "8", "--max-message-bytes",
                      "64MiB", "--layers", "3,0-1,3", "--backend", "cpu", "--devices", "1,0",
                      "--log-level", "debug", "--synthetic", "layers=4", "--max-delay-us", "250"),
                 MOED_CONFIG_RUN);
    CHECK(!strcmp(c.listen, "0.0.0.0:7000") && !strcmp(c.backend, "cpu"));
    CHECK_EQ_INT(c.threads, 8);
    CHECK_EQ_INT(c.max_message_bytes, 64 << 20);
    CHECK_EQ_INT(c.max_delay_us, 250);
    CHECK_EQ_INT(c.log_level, MOED_LOG_DEBUG);
    CHECK(!strcmp(c.synthetic, "layers=4") && !strcmp(c.layers.text, "3,0-1,3"));
    CHECK(c.layers.n == 3 && c.layers.v[0] == 0 && c.layers.v[1] == 1 && c.layers.v[2] == 3);
    CHECK(moed_config_wants_layer(&c, 3) && !moed_config_wants_layer(&c, 2));
    CHECK(c.devices.n == 2 && c.devices.v[0] == 1 && c.devices.v[1] == 0); /* in the order given */
    moed_config_free(&c);
    CHECK_EQ_INT(LOAD(&c, &err, "--max-message-bytes", "4096", "--max-batch-tokens", "1"), 0);
    CHECK(c.max_message_bytes == 4096 && c.max_batch_tokens == 1);
    moed_config_free(&c);
    CHECK_EQ_INT(LOAD(&c, &err, "--max-message-bytes", "1 GiB"), 0);
    CHECK_EQ_INT(c.max_message_bytes, 1 << 30);
    moed_config_free(&c);
}

static void expect_bad(moed_error *err, const char *what, const char *n1, const char *n2)
{
    CHECK_MSG(err->code == MOED_EINVAL, "%s: code %d", what, err->code);
    CHECK_MSG(strstr(err->msg, n1) && strstr(err->msg, n2), "%s: '%s' lacks '%s' or '%s'", what,
              err->msg, n1, n2);
}

static void test_bad_values(void)
{
    moed_config c;
    moed_error err;
    CHECK_EQ_INT(LOAD(&c, &err, "--threads", "-1"), MOED_EINVAL);
    expect_bad(&err, "negative threads", "--threads", "[0, 4096]");
    moed_config_free(&c);
    CHECK_EQ_INT(LOAD(&c, &err, "--cq-threads", "0"), MOED_EINVAL);
    expect_bad(&err, "zero cq threads", "--cq-threads", "[1, 256]");
    moed_config_free(&c);
    CHECK_EQ_INT(LOAD(&c, &err, "--backend", "gpu"), MOED_EINVAL);
    expect_bad(&err, "backend", "'gpu'", "cpu|cuda|auto");
    moed_config_free(&c);
    CHECK_EQ_INT(LOAD(&c, &err, "--weights", "fp8"), MOED_CONFIG_RUN);
    CHECK(!strcmp(c.weights, "fp8"));
    moed_config_free(&c);
    CHECK_EQ_INT(LOAD(&c, &err, "--weights", "fp"), MOED_EINVAL); /* a prefix is no choice */
    expect_bad(&err, "weights", "--weights", "stored|fp8");
    moed_config_free(&c);
    CHECK_EQ_INT(LOAD(&c, &err, "--backend", "cpu|cuda"), MOED_EINVAL);
    expect_bad(&err, "two backends", "'cpu|cuda'", "cpu|cuda|auto");
    moed_config_free(&c);
    CHECK_EQ_INT(LOAD(&c, &err, "--max-message-bytes", "12XB"), MOED_EINVAL);
    expect_bad(&err, "bytes suffix", "--max-message-bytes", "'12XB'");
    moed_config_free(&c);
    CHECK_EQ_INT(LOAD(&c, &err, "--max-message-bytes", "4GiB"), MOED_EINVAL);
    expect_bad(&err, "bytes too big", "--max-message-bytes", "out of range");
    moed_config_free(&c);
    CHECK_EQ_INT(LOAD(&c, &err, "--max-batch-tokens", "12abc"), MOED_EINVAL);
    expect_bad(&err, "trailing junk", "--max-batch-tokens", "'12abc'");
    moed_config_free(&c);
    CHECK_EQ_INT(LOAD(&c, &err, "--layers", "3-"), MOED_EINVAL);
    expect_bad(&err, "layer range", "--layers", "'3-'");
    moed_config_free(&c);
    CHECK_EQ_INT(LOAD(&c, &err, "--layers", "5-2"), MOED_EINVAL);
    expect_bad(&err, "reversed range", "--layers", "0-3,7");
    moed_config_free(&c);
    CHECK_EQ_INT(LOAD(&c, &err, "--log-level", "loud"), MOED_EINVAL);
    expect_bad(&err, "log level", "--log-level", "debug|info|warn|error");
    moed_config_free(&c);
    CHECK_EQ_INT(LOAD(&c, &err, "--model", "/m", "--synthetic", "layers=1"), MOED_EINVAL);
    expect_bad(&err, "model and synthetic", "--model", "--synthetic");
    moed_config_free(&c);
    CHECK_EQ_INT(LOAD(&c, &err, "--nope"), MOED_EINVAL);
    expect_bad(&err, "unknown flag", "--nope", "unknown option");
    moed_config_free(&c);
    CHECK_EQ_INT(LOAD(&c, &err, "--listen"), MOED_EINVAL);
    expect_bad(&err, "missing value", "--listen", "ADDR");
    moed_config_free(&c);
    CHECK_EQ_INT(LOAD(&c, &err, "stray"), MOED_EINVAL);
    expect_bad(&err, "positional", "'stray'", "--");
    moed_config_free(&c);
}

static void test_file(void)
{
    char path[] = "/tmp/moed-test-config-XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    FILE *f = fdopen(fd, "w");
    fprintf(f, "# a comment\n\n  listen = 10.0.0.1:9000   # trailing comment\n"
               "threads=3\nlog-file = \"/var/log/moed.log\"\nmax-delay-us = 100\n");
    fclose(f);
    moed_config c;
    moed_error err;
    /* The file sets what the command line does not; the command line wins. */
    CHECK_EQ_INT(LOAD(&c, &err, "--threads", "5", "--config", path), MOED_CONFIG_RUN);
    CHECK(!strcmp(c.listen, "10.0.0.1:9000") && !strcmp(c.log_file, "/var/log/moed.log"));
    CHECK_EQ_INT(c.threads, 5);
    CHECK_EQ_INT(c.max_delay_us, 100);
    moed_config_free(&c);

    f = fopen(path, "w");
    fprintf(f, "threads = 2\nbogus-key = 1\n");
    fclose(f);
    CHECK_EQ_INT(LOAD(&c, &err, "--config", path), MOED_EINVAL);
    expect_bad(&err, "unknown key", ":2", "bogus-key");
    moed_config_free(&c);

    f = fopen(path, "w");
    fprintf(f, "threads = many\n");
    fclose(f);
    CHECK_EQ_INT(LOAD(&c, &err, "--config", path), MOED_EINVAL);
    expect_bad(&err, "bad file value", ":1", "'many'");
    moed_config_free(&c);

    f = fopen(path, "w");
    fprintf(f, "just words\n");
    fclose(f);
    CHECK_EQ_INT(LOAD(&c, &err, "--config", path), MOED_EINVAL);
    expect_bad(&err, "no equals", ":1", "key = value");
    moed_config_free(&c);
    unlink(path);

    CHECK_EQ_INT(LOAD(&c, &err, "--config", "/nonexistent/moed.conf"), MOED_EINVAL);
    expect_bad(&err, "missing file", "--config", "/nonexistent/moed.conf");
    moed_config_free(&c);
}

static void test_help_version(void)
{
    char buf[8192] = { 0 };
    FILE *out = fmemopen(buf, sizeof buf - 1, "w");
    moed_config c;
    moed_error err;
    /* --help answers even after a bad value: the person asked for help. */
    CHECK_EQ_INT(
        load(&c, &err, out, ARGC("--threads", "9", "--help"), ARGV("--threads", "9", "--help")),
        MOED_CONFIG_EXIT);
    fflush(out);
    CHECK(strstr(buf, "--max-delay-us") && strstr(buf, "default 8192") && strstr(buf, "usage"));
    fclose(out);
    moed_config_free(&c);
    memset(buf, 0, sizeof buf);
    out = fmemopen(buf, sizeof buf - 1, "w");
    CHECK_EQ_INT(load(&c, &err, out, ARGC("--version"), ARGV("--version")), MOED_CONFIG_EXIT);
    fflush(out);
    CHECK(strstr(buf, MOED_VERSION) != NULL);
    fclose(out);
    moed_config_free(&c);
}

static void test_listen_ports(void)
{
    moed_config c;
    moed_error err;
    static const char *const good[] = { "127.0.0.1:50051", "0.0.0.0:1",        "[::1]:65535",
                                        "localhost:0",     "unix:/tmp/m.s",    "unix-abstract:moed",
                                        "[::]:7",          "moed-1.example:80" };
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
        CHECK_MSG(LOAD(&c, &err, "--listen", (char *)good[i]) == 0, "%s: %s", good[i], err.msg);
        moed_config_free(&c);
    }
    CHECK_EQ_INT(LOAD(&c, &err, "--listen", "127.0.0.1:70000"), MOED_EINVAL);
    expect_bad(&err, "port over 65535", "--listen", "70000");
    CHECK(strstr(err.msg, "1 to 65535") != NULL);
    moed_config_free(&c);
    CHECK_EQ_INT(LOAD(&c, &err, "--metrics-listen", "127.0.0.1:65536"), MOED_EINVAL);
    expect_bad(&err, "metrics port over 65535", "--metrics-listen", "65536");
    moed_config_free(&c);
    /* Also what gRPC's server cannot bind (it failed with gRPC's own words and exit 1): a scheme,
     * no host, a literal that is no address, a path longer than a socket address holds. */
    char long_path[160];
    snprintf(long_path, sizeof long_path, "unix:/tmp/%0*d", MOED_CONFIG_MAX_UNIX_PATH - 4, 0);
    const char *const bad[] = {
        "127.0.0.1",   "127.0.0.1:", "127.0.0.1:-1", "127.0.0.1:80x",    "127.0.0.1:000080",
        "::1:80",      "unix:",      ":9000",        "ipv4:127.0.0.1:1", "dns:///a.b:1",
        "256.0.0.1:1", "[::1x]:1",   "a/b:1",        long_path
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        CHECK_MSG(LOAD(&c, &err, "--listen", (char *)bad[i]) == MOED_EINVAL, "%s accepted", bad[i]);
        expect_bad(&err, bad[i], "--listen", bad[i]);
        moed_config_free(&c);
    }
    long_path[strlen(long_path) - 1] = 0; /* the longest a socket path may be */
    CHECK_MSG(LOAD(&c, &err, "--listen", long_path) == 0, "%s", err.msg);
    moed_config_free(&c);
    CHECK_MSG(LOAD(&c, &err, "--metrics-listen", ":9000") == 0, "%s",
              err.msg); /* every interface */
    moed_config_free(&c);
    /* The metrics endpoint is HTTP over TCP: no unix sockets. */
    CHECK_EQ_INT(LOAD(&c, &err, "--metrics-listen", "unix:/tmp/x"), MOED_EINVAL);
    expect_bad(&err, "metrics on unix", "--metrics-listen", "host:port");
    moed_config_free(&c);
}

static char *write_file(const char *text, size_t len)
{
    static char path[64];
    snprintf(path, sizeof path, "/tmp/moed-test-config-XXXXXX");
    int fd = mkstemp(path);
    CHECK(fd >= 0 && write(fd, text, len) == (ssize_t)len);
    close(fd);
    return path;
}

static void test_quoted_values(void)
{
    moed_config c;
    moed_error err;
    static const char text[] = "log-file = \"/var/log/a # b.log\"   # the # is kept\n"
                               "tls-cert=\"/c/with \\\"quote\\\" and \\\\\" # c\n"
                               "tls-key = k#\n"
                               "listen = 127.0.0.1:7000#comment right after\n";
    char *path = write_file(text, sizeof text - 1);
    CHECK_EQ_INT(LOAD(&c, &err, "--config", path), MOED_CONFIG_RUN);
    CHECK_MSG(!strcmp(c.log_file, "/var/log/a # b.log"), "log-file '%s'", c.log_file);
    CHECK_MSG(!strcmp(c.tls_cert, "/c/with \"quote\" and \\"), "tls-cert '%s'", c.tls_cert);
    CHECK(!strcmp(c.tls_key, "k") && !strcmp(c.listen, "127.0.0.1:7000"));
    moed_config_free(&c);
    unlink(path);
    static const struct {
        const char *line, *says;
    } bad[] = {
        { "log-file = \"/no/end\n", "no closing quote" },
        { "log-file = \"a\\nb\"\n", "unknown escape" },
        { "log-file = \"a\" b\n", "after the closing quote" },
        { "# = x\nlisten # = 1\n", ":2" },
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        path = write_file(bad[i].line, strlen(bad[i].line));
        CHECK_EQ_INT(LOAD(&c, &err, "--config", path), MOED_EINVAL);
        expect_bad(&err, bad[i].line, path, bad[i].says);
        moed_config_free(&c);
        unlink(path);
    }
}

static void on_alarm(int sig)
{
    (void)sig;
    static const char msg[] = "test_config: --config on a FIFO blocked\n";
    if (write(2, msg, sizeof msg - 1)) _exit(1);
    _exit(1);
}

static void test_config_file_kinds(void)
{
    moed_config c;
    moed_error err;
    CHECK_EQ_INT(LOAD(&c, &err, "--config", "/tmp"), MOED_EINVAL);
    expect_bad(&err, "directory", "/tmp", "a directory");
    moed_config_free(&c);
    CHECK_EQ_INT(LOAD(&c, &err, "--config", "/dev/zero"), MOED_EINVAL);
    expect_bad(&err, "/dev/zero", "/dev/zero", "character device");
    moed_config_free(&c);
    char fifo[] = "/tmp/moed-test-fifo-XXXXXX";
    int fd = mkstemp(fifo);
    close(fd);
    unlink(fifo);
    CHECK(mkfifo(fifo, 0600) == 0);
    signal(SIGALRM, on_alarm); /* a FIFO with no writer would block a plain open */
    alarm(10);
    CHECK_EQ_INT(LOAD(&c, &err, "--config", fifo), MOED_EINVAL);
    alarm(0);
    expect_bad(&err, "fifo", fifo, "FIFO");
    moed_config_free(&c);
    unlink(fifo);

    size_t big = MOED_CONFIG_MAX_FILE + 1;
    char *text = malloc(big);
    memset(text, '#', big);
    char *path = write_file(text, big);
    free(text);
    CHECK_EQ_INT(LOAD(&c, &err, "--config", path), MOED_EINVAL);
    expect_bad(&err, "huge file", path, "1024 KiB");
    moed_config_free(&c);
    unlink(path);

    path = write_file("threads = 2\nlisten = a\0b\n", 25);
    CHECK_EQ_INT(LOAD(&c, &err, "--config", path), MOED_EINVAL);
    expect_bad(&err, "NUL", ":2", "NUL");
    moed_config_free(&c);
    unlink(path);
}

static void test_layer_lists(void)
{
    moed_config c;
    moed_error err;
    /* Over 20 s with an insertion sort; linear now. */
    double t0 = moed_now_s();
    CHECK_EQ_INT(LOAD(&c, &err, "--layers", "50000-65535,0-49999"), 0);
    double took = moed_now_s() - t0;
    CHECK_MSG(took < 0.5, "took %.3f s", took);
    CHECK_EQ_INT(c.layers.n, 65536);
    for (int i = 0; i < c.layers.n; i++)
        if (c.layers.v[i] != i) {
            CHECK_MSG(0, "layer_list[%d] = %d", i, c.layers.v[i]);
            break;
        }
    CHECK(moed_config_wants_layer(&c, 0) && moed_config_wants_layer(&c, 65535));
    moed_config_free(&c);
    CHECK_EQ_INT(LOAD(&c, &err, "--layers", "9,3-5,4,0,9"), 0);
    CHECK(c.layers.n == 5 && c.layers.v[0] == 0 && c.layers.v[1] == 3 && c.layers.v[3] == 5 &&
          c.layers.v[4] == 9);
    CHECK(moed_config_wants_layer(&c, 4) && !moed_config_wants_layer(&c, 6) &&
          !moed_config_wants_layer(&c, 10) && !moed_config_wants_layer(&c, -1));
    moed_config_free(&c);
    CHECK_EQ_INT(LOAD(&c, &err, "--layers", "0-65536"), MOED_EINVAL);
    expect_bad(&err, "layer over the bound", "--layers", "65535");
    moed_config_free(&c);
    /* Many overlapping whole ranges: still linear in the text. */
    char *list = malloc(MOED_CONFIG_MAX_LIST + 2);
    size_t at = 0;
    while (at + 8 < MOED_CONFIG_MAX_LIST)
        at += (size_t)sprintf(list + at, "%s0-65535", at ? "," : "");
    t0 = moed_now_s();
    CHECK_EQ_INT(LOAD(&c, &err, "--layers", list), 0);
    took = moed_now_s() - t0;
    CHECK_MSG(took < 0.5, "took %.3f s", took);
    CHECK_EQ_INT(c.layers.n, 65536);
    moed_config_free(&c);
    memset(list, '1', MOED_CONFIG_MAX_LIST + 1);
    list[MOED_CONFIG_MAX_LIST + 1] = 0;
    CHECK_EQ_INT(LOAD(&c, &err, "--layers", list), MOED_EINVAL);
    expect_bad(&err, "list too long", "--layers", "at most 4096");
    moed_config_free(&c);
    free(list);
}

/* --devices keeps order and repeats (a GPU twice is two placements); --expert-parallel is a bare
 * flag, or =0|1. */
static void test_devices_and_flag(void)
{
    moed_config c;
    moed_error err;
    CHECK_EQ_INT(LOAD(&c, &err, "--devices", "0,0"), 0);
    CHECK(c.devices.n == 2 && c.devices.v[0] == 0 && c.devices.v[1] == 0 && !c.expert_parallel);
    moed_config_free(&c);
    CHECK_EQ_INT(LOAD(&c, &err, "--devices", "2-3,1,3", "--expert-parallel", "--threads", "2"), 0);
    CHECK(c.devices.n == 4 && c.devices.v[0] == 2 && c.devices.v[1] == 3 && c.devices.v[2] == 1 &&
          c.devices.v[3] == 3);
    CHECK(c.expert_parallel == 1 && c.threads == 2); /* the bare flag took no value */
    moed_config_free(&c);
    CHECK_EQ_INT(LOAD(&c, &err, "--expert-parallel=0"), 0);
    CHECK(c.expert_parallel == 0);
    moed_config_free(&c);
    CHECK_EQ_INT(LOAD(&c, &err, "--expert-parallel=yes"), MOED_EINVAL);
    expect_bad(&err, "flag value", "--expert-parallel", "[0, 1]");
    moed_config_free(&c);
    CHECK_EQ_INT(LOAD(&c, &err, "--devices", "0,,1"), MOED_EINVAL);
    expect_bad(&err, "device list", "'0,,1'", "0-3");
    moed_config_free(&c);
    CHECK_EQ_INT(LOAD(&c, &err, "--devices", "0-70"), MOED_EINVAL);
    expect_bad(&err, "too many devices", "--devices", "more than 64");
    moed_config_free(&c);
}

int main(void)
{
    test_defaults();
    test_listen_ports();
    test_quoted_values();
    test_config_file_kinds();
    test_layer_lists();
    test_flags();
    test_devices_and_flag();
    test_bad_values();
    test_file();
    test_help_version();
    return check_status("test_config");
}
