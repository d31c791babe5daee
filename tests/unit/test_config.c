/*
 * test_config — flags and the config file: defaults, both flag syntaxes, byte suffixes, layer
 * lists, the file's precedence below the command line, and bad values naming the flag (or the
 * file and line), the value and what is accepted.
 */
#include "check.h"
#include "config.h"
#include "log.h"

#include <stdlib.h>
#include <string.h>
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
    CHECK(!c.model && !c.synthetic && !c.layers && c.n_devices == 0);
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
    CHECK(!strcmp(c.synthetic, "layers=4") && !strcmp(c.layers, "3,0-1,3"));
    CHECK(c.n_layer_list == 3 && c.layer_list[0] == 0 && c.layer_list[1] == 1 &&
          c.layer_list[2] == 3);
    CHECK(moed_config_wants_layer(&c, 3) && !moed_config_wants_layer(&c, 2));
    CHECK(c.n_devices == 2 && c.devices[0] == 0 && c.devices[1] == 1);
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
    expect_bad(&err, "unknown flag", "--nope", "--help");
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

int main(void)
{
    test_defaults();
    test_flags();
    test_bad_values();
    test_file();
    test_help_version();
    return check_status("test_config");
}
