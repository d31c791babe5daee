/*
 * moed_log — logfmt lines, formatted into one buffer and written with one write(2), so concurrent
 * threads never interleave and the log needs no lock on the hot path. The destination swap on
 * SIGHUP takes a lock; readers load the descriptor atomically.
 *
 * Why the module escapes and not its callers: values that came from a client reach the log through
 * many call sites (a request id, a path in an error message, gRPC's own details), and a single
 * site that printed one raw would let a client write a line of its own. Walking kv's conversions
 * here makes every string escaped by construction, and keeps the printf-style call sites (and the
 * compiler's format checks) as they are. The escapes are those logfmt readers decode (go-logfmt's,
 * which writes \ufffd for bytes that are not UTF-8 too).
 */
#include "log.h"

#include "moed_err.h"

#include <ctype.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static _Atomic int log_level = MOED_LOG_INFO;
static _Atomic int log_fd = STDERR_FILENO;
static char log_path[4096];
static pthread_mutex_t log_lock = PTHREAD_MUTEX_INITIALIZER;

static const char *const level_names[] = { "debug", "info", "warn", "error" };

int moed_log_parse_level(const char *name)
{
    for (int i = 0; i < 4; i++)
        if (!strcmp(name, level_names[i])) return i;
    if (!strcmp(name, "warning")) return MOED_LOG_WARN;
    return -1;
}

static int open_log(const char *path)
{
    return open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
}

int moed_log_init(moed_log_level level, const char *path)
{
    atomic_store(&log_level, level);
    if (!path || !*path || !strcmp(path, "-")) {
        log_path[0] = 0;
        return 0;
    }
    int fd = open_log(path);
    if (fd < 0) return MOED_EIO;
    snprintf(log_path, sizeof log_path, "%s", path);
    atomic_store(&log_fd, fd);
    return 0;
}

int moed_log_reopen(void)
{
    if (!log_path[0]) return 0;
    int fd = open_log(log_path);
    if (fd < 0) return MOED_EIO;
    pthread_mutex_lock(&log_lock);
    int old = atomic_exchange(&log_fd, fd);
    pthread_mutex_unlock(&log_lock);
    if (old != STDERR_FILENO) close(old);
    return 0;
}

void moed_log_close(void)
{
    int old = atomic_exchange(&log_fd, STDERR_FILENO);
    if (old != STDERR_FILENO) close(old);
    log_path[0] = 0;
}

int moed_log_enabled(moed_log_level level)
{
    return (int)level >= atomic_load(&log_level);
}

/* ---- the line -------------------------------------------------------------------------------- */

#define TAIL " truncated=true\n"

/* The line being built. Pieces go in whole or not at all (an escape is never cut in two); once
 * one does not fit the line is full and takes nothing more. `open` says whether a quote written
 * so far is unclosed, so a cut line can close it. */
typedef struct line {
    char *p;
    size_t len, cap; /* cap: room for content, the tail kept apart */
    bool full, open;
} line;

static bool put(line *l, const char *s, size_t n)
{
    if (l->full || n > l->cap - l->len) {
        l->full = true;
        return false;
    }
    memcpy(l->p + l->len, s, n);
    l->len += n;
    return true;
}

static bool put_char(line *l, char c)
{
    return put(l, &c, 1);
}

static bool put_quote(line *l)
{
    if (!put_char(l, '"')) return false;
    l->open = !l->open;
    return true;
}

/* The length of the UTF-8 sequence at s (at most n bytes) and its code point, or 0 when s does not
 * start one (a stray continuation byte, an overlong form, a surrogate, past U+10FFFF, cut short).
 */
static size_t utf8_seq(const unsigned char *s, size_t n, uint32_t *cp)
{
    static const uint32_t min[5] = { 0, 0, 0x80, 0x800, 0x10000 };
    size_t len = s[0] < 0x80   ? 1
                 : s[0] < 0xc2 ? 0
                 : s[0] < 0xe0 ? 2
                 : s[0] < 0xf0 ? 3
                 : s[0] < 0xf5 ? 4
                               : 0;
    if (!len || len > n) return 0;
    uint32_t c = len == 1 ? s[0] : s[0] & (0x7f >> len);
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xc0) != 0x80) return 0;
        c = c << 6 | (s[i] & 0x3f);
    }
    if (c < min[len] || c > 0x10ffff || (c >= 0xd800 && c <= 0xdfff)) return 0;
    *cp = c;
    return len;
}

/* Characters a log reader could take for the end of a line or a field, or cannot show. */
static bool is_control(uint32_t c)
{
    return c < 0x20 || (c >= 0x7f && c <= 0x9f) || c == 0x2028 || c == 0x2029;
}

/* s[0..n) inside quotes. */
static void put_escaped(line *l, const char *s, size_t n)
{
    const unsigned char *u = (const unsigned char *)s;
    for (size_t i = 0; i < n && !l->full;) {
        uint32_t c = 0;
        size_t len = utf8_seq(u + i, n - i, &c);
        char esc[8];
        if (!len) {
            put(l, "\\ufffd", 6);
            i++;
            continue;
        }
        if (c == '"' || c == '\\') {
            esc[0] = '\\';
            esc[1] = (char)c;
            put(l, esc, 2);
        } else if (c == '\n' || c == '\r' || c == '\t') {
            esc[0] = '\\';
            esc[1] = c == '\n' ? 'n' : c == '\r' ? 'r' : 't';
            put(l, esc, 2);
        } else if (is_control(c)) {
            snprintf(esc, sizeof esc, "\\u%04x", (unsigned)c);
            put(l, esc, 6);
        } else {
            put(l, s + i, len);
        }
        i += len;
    }
}

/* Whether a bare value must be quoted to stay one field: logfmt ends a bare value at a space and
 * gives `=` and `"` meaning. */
static bool needs_quotes(const char *s, size_t n)
{
    const unsigned char *u = (const unsigned char *)s;
    if (!n) return true;
    for (size_t i = 0; i < n;) {
        uint32_t c = 0;
        size_t len = utf8_seq(u + i, n - i, &c);
        if (!len || c <= ' ' || c == '=' || c == '"' || is_control(c)) return true;
        i += len;
    }
    return false;
}

/* A string argument: escaped inside the format's quotes, else written bare or quoted. */
static void put_value(line *l, const char *s, size_t n)
{
    if (l->open) {
        put_escaped(l, s, n);
    } else if (!needs_quotes(s, n)) {
        put(l, s, n);
    } else if (put_quote(l)) {
        put_escaped(l, s, n);
        put_quote(l);
    }
}

/* ---- kv's conversions ------------------------------------------------------------------------ */

/* spec is built here from kv, a format the compiler checked at the call site. */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wformat-nonliteral"

/* One conversion of kv at *f (just past its '%'): its value written, *f moved past it. */
static void put_conversion(line *l, const char **f, va_list *ap)
{
    char spec[48] = "%", tmp[512];
    size_t at = 1;
    const char *p = *f;
    int prec = -1;
    while (*p && strchr("-+ #0", *p) && at < 8) spec[at++] = *p++;
    if (*p == '*') {
        at += (size_t)snprintf(spec + at, sizeof spec - at, "%d", va_arg(*ap, int));
        p++;
    } else {
        while (isdigit((unsigned char)*p) && at < 16) spec[at++] = *p++;
    }
    if (*p == '.') {
        p++;
        if (*p == '*') {
            prec = va_arg(*ap, int);
            p++;
        } else {
            for (prec = 0; isdigit((unsigned char)*p) && prec < 100000; p++)
                prec = prec * 10 + (*p - '0');
        }
        if (prec >= 0) at += (size_t)snprintf(spec + at, sizeof spec - at, ".%d", prec);
    }
    char len[3] = "";
    for (int k = 0; k < 2 && *p && strchr("hlzjtL", *p); k++) len[k] = *p++;
    char conv = *p ? *p++ : 0;
    *f = p;
    snprintf(spec + at, sizeof spec - at, "%s%c", len, conv);
    bool ll = !strcmp(len, "ll") || !strcmp(len, "j"), lo = !strcmp(len, "l");
    bool sz = !strcmp(len, "z") || !strcmp(len, "t");
    int n = 0;
    switch (conv) {
    case 's': {
        const char *s = va_arg(*ap, const char *);
        if (!s) s = "(null)";
        put_value(l, s, prec >= 0 ? strnlen(s, (size_t)prec) : strlen(s));
        return;
    }
    case 'c': {
        char c = (char)va_arg(*ap, int);
        put_value(l, &c, 1);
        return;
    }
    case 'd':
    case 'i':
        n = ll   ? snprintf(tmp, sizeof tmp, spec, va_arg(*ap, long long))
            : lo ? snprintf(tmp, sizeof tmp, spec, va_arg(*ap, long))
            : sz ? snprintf(tmp, sizeof tmp, spec, va_arg(*ap, ptrdiff_t))
                 : snprintf(tmp, sizeof tmp, spec, va_arg(*ap, int));
        break;
    case 'u':
    case 'x':
    case 'X':
    case 'o':
        n = ll   ? snprintf(tmp, sizeof tmp, spec, va_arg(*ap, unsigned long long))
            : lo ? snprintf(tmp, sizeof tmp, spec, va_arg(*ap, unsigned long))
            : sz ? snprintf(tmp, sizeof tmp, spec, va_arg(*ap, size_t))
                 : snprintf(tmp, sizeof tmp, spec, va_arg(*ap, unsigned));
        break;
    case 'f':
    case 'F':
    case 'e':
    case 'E':
    case 'g':
    case 'G':
    case 'a':
    case 'A':
        n = len[0] == 'L' ? snprintf(tmp, sizeof tmp, spec, va_arg(*ap, long double))
                          : snprintf(tmp, sizeof tmp, spec, va_arg(*ap, double));
        break;
    case 'p':
        n = snprintf(tmp, sizeof tmp, "%p", va_arg(*ap, void *));
        break;
    case '%':
        put_char(l, '%');
        return;
    default: /* %n, or a conversion this does not know: its argument cannot be skipped safely */
        l->full = true;
        return;
    }
    if (n > 0) put(l, tmp, (size_t)n < sizeof tmp ? (size_t)n : sizeof tmp - 1);
}

#pragma GCC diagnostic pop

static void put_kv(line *l, const char *kv, va_list *ap)
{
    for (const char *f = kv; *f && !l->full;) {
        if (*f == '%') {
            f++;
            put_conversion(l, &f, ap);
        } else if (*f == '"') {
            put_quote(l);
            f++;
        } else {
            put_char(l, *f++);
        }
    }
}

size_t moed_log_format(char *buf, size_t cap, int with_ts, moed_log_level level, const char *msg,
                       const char *kv, va_list ap)
{
    if (cap > MOED_LOG_LINE_MAX) cap = MOED_LOG_LINE_MAX;
    if (cap < 64) return 0;
    line l = { .p = buf, .cap = cap - sizeof TAIL - 1 };
    char head[80];
    if (with_ts) {
        struct timespec ts;
        struct tm tm;
        clock_gettime(CLOCK_REALTIME, &ts);
        gmtime_r(&ts.tv_sec, &tm);
        int n = snprintf(head, sizeof head, "ts=%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ ",
                         tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min,
                         tm.tm_sec, ts.tv_nsec / 1000000);
        put(&l, head, (size_t)n);
    }
    put(&l, "level=", 6);
    put(&l, level_names[level], strlen(level_names[level]));
    put(&l, " msg=", 5);
    put_quote(&l);
    put_escaped(&l, msg, strlen(msg));
    put_quote(&l);
    if (kv) {
        va_list copy;
        va_copy(copy, ap);
        put_char(&l, ' ');
        put_kv(&l, kv, &copy);
        va_end(copy);
    }
    if (l.full) {
        l.full = false;
        l.cap = cap - 1;
        if (l.open) put_quote(&l);
        put(&l, TAIL, sizeof TAIL - 2); /* the newline comes below */
    }
    if (l.open) put_quote(&l); /* a format with an odd number of quotes */
    l.cap = cap;
    put_char(&l, '\n');
    return l.len;
}

void moed_log(moed_log_level level, const char *msg, const char *kv, ...)
{
    if (!moed_log_enabled(level)) return;
    char buf[MOED_LOG_LINE_MAX];
    va_list ap;
    va_start(ap, kv);
    size_t n = moed_log_format(buf, sizeof buf, 1, level, msg, kv, ap);
    va_end(ap);
    pthread_mutex_lock(&log_lock);
    ssize_t w = write(atomic_load(&log_fd), buf, n);
    pthread_mutex_unlock(&log_lock);
    (void)w;
}
