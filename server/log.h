/*
 * moed_log — structured log lines (logfmt) on stderr or a file, one write per line so lines from
 * different threads never interleave:
 *
 *   ts=2026-11-21T21:31:00.123Z level=info msg="listening" addr=127.0.0.1:50051 backend=cpu
 *
 * The message is a fixed phrase (grep-able); variable facts go into key=value pairs.
 *
 * Every value is escaped here, not by the caller: a value may come from a client (a request id, a
 * file name in an error), and one a caller forgot to escape could end its field or the line and
 * forge another. So msg and every %s, %.*s and %c argument of kv are written escaped — inside a
 * quoted value of the format (`reason=\"%s\"`) as logfmt's \" \\ \n \r \t, \u00XX for the other
 * control characters (C0, DEL, C1) and for U+2028/U+2029, and \ufffd for each byte that is not
 * UTF-8; a bare value (`addr=%s`) is quoted and escaped when it holds a space, `=`, `"`, a control
 * character or a byte that is not UTF-8, and is empty-quoted when empty. Numbers and the format's
 * own text pass through as printf writes them. A line over 4 KiB is cut, any quote it leaves open
 * is closed, and it ends with ` truncated=true`: one event is always exactly one line.
 */
#ifndef MOED_LOG_H
#define MOED_LOG_H

#include <stdarg.h>
#include <stddef.h>

typedef enum moed_log_level {
    MOED_LOG_DEBUG = 0,
    MOED_LOG_INFO = 1,
    MOED_LOG_WARN = 2,
    MOED_LOG_ERROR = 3,
} moed_log_level;

/* The longest line written, newline included. */
#define MOED_LOG_LINE_MAX 4096

/* Sets the threshold and the destination (NULL or "-": stderr). Returns 0 or MOED_EIO. */
int moed_log_init(moed_log_level level, const char *path);
/* Reopens the log file (SIGHUP after rotation); a no-op on stderr. */
int moed_log_reopen(void);
void moed_log_close(void);
/* "debug", "info", "warn", "error" -> level; -1 if unknown. */
int moed_log_parse_level(const char *name);
int moed_log_enabled(moed_log_level level);

/* One line: msg is quoted; kv is a printf format of further ` key=value` pairs (may be NULL). The
 * conversions kv may use: d i u x X o c s p f F e E g G a A and %%, with the usual flags, width,
 * precision (also `*`) and length modifiers; %n is refused (nothing is written for it). */
void moed_log(moed_log_level level, const char *msg, const char *kv, ...)
    __attribute__((format(printf, 3, 4)));

/* The line moed_log writes (without its timestamp: ts= is left out when with_ts is 0), into buf
 * of size cap (at most MOED_LOG_LINE_MAX bytes are used); returns its length, newline included.
 * For the tests: the escaping is all here. A cap under 64 bytes gives 0 (nothing written). */
size_t moed_log_format(char *buf, size_t cap, int with_ts, moed_log_level level, const char *msg,
                       const char *kv, va_list ap);

#define moed_log_debug(...) moed_log(MOED_LOG_DEBUG, __VA_ARGS__)
#define moed_log_info(...)  moed_log(MOED_LOG_INFO, __VA_ARGS__)
#define moed_log_warn(...)  moed_log(MOED_LOG_WARN, __VA_ARGS__)
#define moed_log_error(...) moed_log(MOED_LOG_ERROR, __VA_ARGS__)

#endif
