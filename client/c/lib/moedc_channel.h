/*
 * moedc_channel — the one-daemon moedc: a gRPC channel (moedc_channel.c, made by moedc_connect).
 * Private: its layout is shared with the region sessions (moedc_region.c), which open their stream
 * on the same channel.
 */
#ifndef MOEDC_CHANNEL_H
#define MOEDC_CHANNEL_H

#include "moedc_impl.h"

#include <grpc/grpc.h>

typedef struct moedc_channel {
    moedc base;
    grpc_channel *channel;
    void *m_forward, *m_get_model, *m_health, *m_regions, *m_list_regions; /* registered methods */
    char *auth; /* "Bearer TOKEN" or NULL */
} moedc_channel;

/* moedc_session_open on a channel (moedc_region.c). */
int moedc_channel_session_open(moedc *c, moedc_session **out, moedc_error *err);

#endif
