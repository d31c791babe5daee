/*
 * moed_log — structured log lines (logfmt) on stderr or a file, one write per line so lines from
 * different threads never interleave:
 *
 *   ts=2026-11-21T21:31:00.123Z level=info msg="listening" addr=127.0.0.1:50051 backend=cpu
 *
 * The message is a fixed phrase (grep-able); variable facts go into key=value pairs.
 */
#ifndef MOED_LOG_H
#define MOED_LOG_H

typedef enum moed_log_level {
    MOED_LOG_DEBUG = 0,
    MOED_LOG_INFO = 1,
    MOED_LOG_WARN = 2,
    MOED_LOG_ERROR = 3,
} moed_log_level;

/* Sets the threshold and the destination (NULL or "-": stderr). Returns 0 or MOED_EIO. */
int moed_log_init(moed_log_level level, const char *path);
/* Reopens the log file (SIGHUP after rotation); a no-op on stderr. */
int moed_log_reopen(void);
void moed_log_close(void);
/* "debug", "info", "warn", "error" -> level; -1 if unknown. */
int moed_log_parse_level(const char *name);
int moed_log_enabled(moed_log_level level);

/* One line: msg is quoted; kv is a printf format of further ` key=value` pairs (may be NULL). */
void moed_log(moed_log_level level, const char *msg, const char *kv, ...)
    __attribute__((format(printf, 3, 4)));

#define moed_log_debug(...) moed_log(MOED_LOG_DEBUG, __VA_ARGS__)
#define moed_log_info(...)  moed_log(MOED_LOG_INFO, __VA_ARGS__)
#define moed_log_warn(...)  moed_log(MOED_LOG_WARN, __VA_ARGS__)
#define moed_log_error(...) moed_log(MOED_LOG_ERROR, __VA_ARGS__)

#endif
