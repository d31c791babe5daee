/*
 * moed_err — the error table's lookups and the helpers that fill a moed_error.
 */
#include "moed_err.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

const char *moed_strerror(int code)
{
    switch (code) {
#define MOED_ERR_TEXT(name, value, grpc, text)                                                     \
    case value:                                                                                    \
        return text;
        MOED_ERR_TABLE(MOED_ERR_TEXT)
#undef MOED_ERR_TEXT
    }
    return "unknown error";
}

int moed_err_grpc_status(int code)
{
    switch (code) {
#define MOED_ERR_GRPC(name, value, grpc, text)                                                     \
    case value:                                                                                    \
        return grpc;
        MOED_ERR_TABLE(MOED_ERR_GRPC)
#undef MOED_ERR_GRPC
    }
    return 2; /* UNKNOWN */
}

const char *moed_grpc_status_name(int grpc_status)
{
    static const char *const names[] = {
        "OK",
        "CANCELLED",
        "UNKNOWN",
        "INVALID_ARGUMENT",
        "DEADLINE_EXCEEDED",
        "NOT_FOUND",
        "ALREADY_EXISTS",
        "PERMISSION_DENIED",
        "RESOURCE_EXHAUSTED",
        "FAILED_PRECONDITION",
        "ABORTED",
        "OUT_OF_RANGE",
        "UNIMPLEMENTED",
        "INTERNAL",
        "UNAVAILABLE",
        "DATA_LOSS",
        "UNAUTHENTICATED",
    };
    _Static_assert(sizeof names / sizeof names[0] == MOED_GRPC_STATUS_COUNT,
                   "one name per gRPC status code");
    if (grpc_status < 0 || grpc_status >= MOED_GRPC_STATUS_COUNT) return "UNKNOWN";
    return names[grpc_status];
}

int moed_fail(moed_error *err, int code, const char *fmt, ...)
{
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        err->code = code;
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        va_end(ap);
    }
    return code;
}

void moed_error_prefix(moed_error *err, const char *fmt, ...)
{
    if (!err) return;
    char head[160], tail[sizeof err->msg];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(head, sizeof head, fmt, ap);
    va_end(ap);
    memcpy(tail, err->msg, sizeof tail);
    size_t n = strlen(head);
    if (n + 2 >= sizeof err->msg) return;
    memcpy(err->msg, head, n);
    memcpy(err->msg + n, ": ", 2);
    size_t room = sizeof err->msg - n - 3;
    size_t t = strnlen(tail, room);
    memcpy(err->msg + n + 2, tail, t);
    err->msg[n + 2 + t] = 0;
}
