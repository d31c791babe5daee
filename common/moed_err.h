/*
 * moed_err — the one table of error codes every moed module returns.
 *
 * Functions return 0 on success or a negative MOED_E* code. Where a person needs to know more than
 * the code (which tensor, which shape, which flag to raise), the function also fills a moed_error,
 * whose message is written for that person: the gRPC front end sends it as the status message and
 * the daemon logs it. The table maps each code to its gRPC status, so the mapping lives in one
 * place.
 */
#ifndef MOED_ERR_H
#define MOED_ERR_H

#include <stddef.h>

/* gRPC status codes run 0 (OK) .. 16 (UNAUTHENTICATED): the size of every table indexed by one. */
#define MOED_GRPC_STATUS_COUNT 17

/* X(name, value, grpc status code, description) — grpc codes as in grpc/status.h. */
#define MOED_ERR_TABLE(X)                                                                          \
    X(MOED_OK, 0, 0, "success")                                                                    \
    X(MOED_EINVAL, -1, 3, "invalid argument")                                                      \
    X(MOED_ENOTFOUND, -2, 5, "not found")                                                          \
    X(MOED_ETOOBIG, -3, 8, "over the size limit")                                                  \
    X(MOED_EFULL, -4, 14, "queue full")                                                            \
    X(MOED_EDRAINING, -5, 14, "server draining")                                                   \
    X(MOED_EDEADLINE, -6, 4, "deadline exceeded")                                                  \
    X(MOED_ECANCELLED, -7, 1, "cancelled")                                                         \
    X(MOED_ENOMEM, -8, 8, "out of memory")                                                         \
    X(MOED_EIO, -9, 13, "input/output error")                                                      \
    X(MOED_EFORMAT, -10, 3, "malformed file or message")                                           \
    X(MOED_EDEVICE, -11, 13, "device error")                                                       \
    X(MOED_ENODEV, -12, 9, "no usable device")                                                     \
    X(MOED_EUNSUPPORTED, -13, 12, "not supported")                                                 \
    X(MOED_EUNAUTH, -14, 16, "unauthenticated")                                                    \
    X(MOED_EUNAVAIL, -15, 14, "unavailable")                                                       \
    X(MOED_EINTERNAL, -16, 13, "internal error")                                                   \
    X(MOED_EPRECOND, -17, 9, "failed precondition")

enum {
#define MOED_ERR_ENUM(name, value, grpc, text) name = value,
    MOED_ERR_TABLE(MOED_ERR_ENUM)
#undef MOED_ERR_ENUM
};

/* A code and the sentence that explains it to a person. */
typedef struct moed_error {
    int code;
    char msg[480];
} moed_error;

/* The table's description of a code ("unknown error" outside the table). */
const char *moed_strerror(int code);

/* The gRPC status code (grpc_status_code's value) that a moed code is answered with. */
int moed_err_grpc_status(int code);

/* A gRPC status code's name as gRPC spells it ("OK", "INVALID_ARGUMENT", ...; "UNKNOWN" outside
 * 0 .. MOED_GRPC_STATUS_COUNT - 1): for logs, metrics labels and client messages. */
const char *moed_grpc_status_name(int grpc_status);

/* Records code and a printf-style message in err (which may be NULL) and returns code, so a
 * failing check reads `return moed_fail(err, MOED_EINVAL, "hidden has %d dims", n);`. */
int moed_fail(moed_error *err, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Prefixes err's message with context ("layer 3: ..."), keeping its code. */
void moed_error_prefix(moed_error *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#endif
