/*
 * moedc_session — what a region session (moedc_region.c) offers the rest of the library: its
 * commands, whether its stream has ended, and the rings on it (moedc_ring.c), which the session's
 * close closes first.
 */
#ifndef MOEDC_SESSION_H
#define MOEDC_SESSION_H

#include "moed/v1/moed.pb-c.h"
#include "moedclient.h"

#include <stdbool.h>

/* Sends one command and waits for its event, as the session's own calls do (one at a time, from
 * any thread): *out is the event to free with moed__v1__region_event__free_unpacked, or NULL and
 * the error (the event's status, the stream's end, or no answer in time). */
int moedc_session_command(moedc_session *s, Moed__V1__RegionCommand *cmd,
                          Moed__V1__RegionEvent **out, moedc_error *err);

/* Whether the session's stream has ended (the server closed it, died, or the connection dropped),
 * without blocking: safe from any thread, also while another runs a command. */
bool moedc_session_ended(moedc_session *s);

/* The channel's default deadline (moedc_opts.timeout_s) of the session's moedc. */
double moedc_session_timeout(const moedc_session *s);

/* A ring on s, closed by moedc_session_close (before s's regions are freed) unless it is removed
 * first. */
int moedc_session_add_ring(moedc_session *s, moedc_ring *r, moedc_error *err);
void moedc_session_remove_ring(moedc_session *s, moedc_ring *r);

#endif
