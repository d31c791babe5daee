/*
 * moedc_common — what libmoedclient's own files share (private to lib/): the channel, and filling
 * a moedc_error the way the daemon's modules fill theirs.
 */
#ifndef MOEDC_COMMON_H
#define MOEDC_COMMON_H

#include "moedclient.h"

#include <grpc/grpc.h>

/* A channel: what every call on it needs (moedclient.c makes it). */
struct moedc {
    struct moedc_fleet *fleet; /* a fleet's moedc (moedc_connect_many) has this, not a channel */
    grpc_channel *channel;
    void *m_forward, *m_get_model, *m_health, *m_regions, *m_list_regions; /* registered methods */
    double timeout_s;
    char *auth; /* "Bearer TOKEN" or NULL */
};

/* Records code and a printf-style message in err (which may be NULL) and returns code. */
int moedc_fail(moedc_error *err, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#endif
