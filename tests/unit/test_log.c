/*
 * test_log — the log module's escaping: whatever a value holds (quotes, backslashes, newlines,
 * control bytes, bytes that are not UTF-8, C1 controls and the Unicode line separators), the line
 * is one line, every field the format wrote is still a field, and nothing a value holds reads as
 * a field of its own; bare values are quoted when they need it; numbers pass through; an
 * over-long line is cut with its quote closed and `truncated=true`.
 */
#include "check.h"
#include "log.h"

#include <stdarg.h>
#include <string.h>

static char out[MOED_LOG_LINE_MAX];

static const char *fmt(const char *msg, const char *kv, ...) __attribute__((format(printf, 2, 3)));

static const char *fmt(const char *msg, const char *kv, ...)
{
    va_list ap;
    va_start(ap, kv);
    size_t n = moed_log_format(out, sizeof out, 0, MOED_LOG_INFO, msg, kv, ap);
    va_end(ap);
    out[n] = 0;
    return out;
}

#define CHECK_LINE(got, want) CHECK_MSG(!strcmp(got, want), "got  %s\nwant %s", got, want)

/* One line: a single newline, at the end; no other byte below 0x20. */
static void check_one_line(const char *s)
{
    size_t n = strlen(s);
    CHECK(n > 0 && s[n - 1] == '\n');
    for (size_t i = 0; i + 1 < n; i++)
        CHECK_MSG((unsigned char)s[i] >= 0x20, "byte %zu is %#x", i, s[i]);
}

static void quoted_values(void)
{
    CHECK_LINE(
        fmt("forward failed", "request_id=\"%s\" code=%d", "x\" level=error msg=\"FORGED", 3),
        "level=info msg=\"forward failed\" request_id=\"x\\\" level=error msg=\\\"FORGED\" "
        "code=3\n");
    CHECK_LINE(
        fmt("m", "id=\"%s\"", "a\nts=2026 level=error msg=\"admin login\"\r\n"),
        "level=info msg=\"m\" id=\"a\\nts=2026 level=error msg=\\\"admin login\\\"\\r\\n\"\n");
    CHECK_LINE(fmt("m", "v=\"%s\"", "back\\slash\ttab\x01\x1b[31m\x7f"),
               "level=info msg=\"m\" v=\"back\\\\slash\\ttab\\u0001\\u001b[31m\\u007f\"\n");
    /* Not UTF-8: each bad byte is U+FFFD; good multi-byte characters pass; C1, U+2028/9 escaped. */
    CHECK_LINE(fmt("m", "v=\"%s\"", "ok\xc3\xa9 \xff\xc3 \xe2\x82 \xed\xa0\x80 \xc0\xaf"),
               "level=info msg=\"m\" v=\"ok\xc3\xa9 \\ufffd\\ufffd \\ufffd\\ufffd "
               "\\ufffd\\ufffd\\ufffd \\ufffd\\ufffd\"\n");
    CHECK_LINE(fmt("m", "v=\"%s\"", "a\xc2\x85 b\xe2\x80\xa8 c\xe2\x80\xa9 \xe2\x82\xac"),
               "level=info msg=\"m\" v=\"a\\u0085 b\\u2028 c\\u2029 \xe2\x82\xac\"\n");
    /* Inside a quoted value with other text around it, and with a precision. */
    CHECK_LINE(fmt("m", "what=\"a slot for %s\" id=\"%.*s\"", "x\"y", 3, "ab\"cdef"),
               "level=info msg=\"m\" what=\"a slot for x\\\"y\" id=\"ab\\\"\"\n");
    /* As in printf, a NUL ends a %.*s span early. */
    CHECK_LINE(fmt("m", "id=\"%.*s\"", 3, "a\0b"), "level=info msg=\"m\" id=\"a\"\n");
}

static void bare_values(void)
{
    CHECK_LINE(fmt("m", "addr=%s n=%d", "127.0.0.1:50051", 7),
               "level=info msg=\"m\" addr=127.0.0.1:50051 n=7\n");
    CHECK_LINE(fmt("m", "addr=%s", "a b=c"), "level=info msg=\"m\" addr=\"a b=c\"\n");
    CHECK_LINE(fmt("m", "addr=%s", "x\nlevel=error"),
               "level=info msg=\"m\" addr=\"x\\nlevel=error\"\n");
    CHECK_LINE(fmt("m", "addr=%s", ""), "level=info msg=\"m\" addr=\"\"\n");
    CHECK_LINE(fmt("m", "c=%c", '"'), "level=info msg=\"m\" c=\"\\\"\"\n");
    /* The message itself is escaped too. */
    CHECK_LINE(fmt("a\"b\nc", NULL), "level=info msg=\"a\\\"b\\nc\"\n");
}

static void numbers(void)
{
    CHECK_LINE(fmt("m", "a=%d b=%u c=%lld d=%llu e=%zu f=%x g=%5.2f h=%-3d| i=%*d j=%%", -1, 2u,
                   -3ll, 4ull, (size_t)5, 255u, 3.14159, 7, 4, 9),
               "level=info msg=\"m\" a=-1 b=2 c=-3 d=4 e=5 f=ff g= 3.14 h=7  | i=   9 j=%\n");
    CHECK_LINE(fmt("m", "t=%.3f l=%ld", 0.5, -9l), "level=info msg=\"m\" t=0.500 l=-9\n");
}

static void hostile_lines_stay_one(void)
{
    static const char *const bad[] = { "\"",           "\n",        "\r",           "\\",
                                       "\"\n\"",       "\\\"",      "\x1b]0;x\x07", "\xff\xfe",
                                       "\xe2\x80\xa8", "=\" msg=\"" };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        const char *s = fmt(bad[i], "q=\"%s\" b=%s", bad[i], bad[i]);
        check_one_line(s);
        /* Exactly the fields the format wrote: level, msg, q and b (nothing a value forged). */
        int fields = 0, quoted = 0;
        for (const char *p = s; *p; p++) {
            if (*p == '\\' && quoted) {
                p++;
                continue;
            }
            if (*p == '"') quoted = !quoted;
            if (*p == '=' && !quoted) fields++;
        }
        CHECK_MSG(fields == 4 && !quoted, "value %zu: %d fields in %s", i, fields, s);
    }
}

static void long_lines_are_cut_cleanly(void)
{
    static char big[3 * MOED_LOG_LINE_MAX];
    memset(big, '"', sizeof big - 1);
    const char *s = fmt("m", "v=\"%s\" after=1", big);
    size_t n = strlen(s);
    check_one_line(s);
    CHECK(n <= MOED_LOG_LINE_MAX);
    CHECK(n > 20 && !strcmp(s + n - 17, "\" truncated=true\n"));
    CHECK(!strstr(s, "after=1"));
    /* No escape was cut in two: the quote before the tail is not escaped. */
    CHECK(s[n - 18] == '"' && s[n - 19] == '\\');
    memset(big, 'a', sizeof big - 1);
    s = fmt("m", "bare=%s", big);
    n = strlen(s);
    check_one_line(s);
    CHECK(n <= MOED_LOG_LINE_MAX && !strcmp(s + n - 16, " truncated=true\n"));
}

int main(void)
{
    quoted_values();
    bare_values();
    numbers();
    hostile_lines_stay_one();
    long_lines_are_cut_cleanly();
    return check_status("test_log");
}
