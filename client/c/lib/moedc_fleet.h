/*
 * moedc_fleet — libmoedclient's fleets (moedc_connect_many in moedclient.h says what they do): the
 * contract between the calls (moedclient.c) and the fan-out (moedc_fleet.c). Internal.
 *
 * A fleet's moedc holds a moedc_fleet instead of a channel. A Forward over it is a handle call
 * (a moedc_call with no gRPC call of its own, carrying a moedc_fleet_call) and one sub-call per
 * shard: an ordinary call on a member's moedc, tagged with its moedc_part. moedc_queue_next hands
 * sub-calls to moedc_fleet_part_done, which starts another replica or records the part, and
 * returns the handle once every part is in; the caller never sees a sub-call.
 */
#ifndef MOEDC_FLEET_H
#define MOEDC_FLEET_H

#include "moedc_codec.h"
#include "moedclient.h"

#include <stdbool.h>

typedef struct moedc_fleet moedc_fleet;
typedef struct moedc_fleet_call moedc_fleet_call;
typedef struct moedc_part moedc_part;

/* ---- moedclient.c, for the fleet ---- */

/* A handle call carrying fc (freed with moedc_call_free_handle); NULL when out of memory. */
moedc_call *moedc_call_new_handle(void *user, moedc_fleet_call *fc);
void moedc_call_free_handle(moedc_call *call);
/* A handle's fleet call, or NULL for an ordinary call. */
moedc_fleet_call *moedc_call_fleet(const moedc_call *call);
/* moedc_forward_start of a fleet's sub-call for part p (tagged before it can complete), stating
 * what it expects of the daemon. */
int moedc_forward_start_part(moedc *c, const moedc_request *req, const moedc_expect *expect,
                             moedc_queue *q, moedc_part *p, moedc_call **out, moedc_error *err);
/* Makes c's channel try to connect now, whatever gRPC's reconnect backoff (which grows to 120 s)
 * would wait, and waits until it is connected, at most timeout_s: the fleet asks a daemon again
 * on its own schedule. */
void moedc_reconnect_now(moedc *c, double timeout_s);
/* GetModel and health with a deadline of their own (seconds; < 0: none). */
int moedc_info_within(moedc *c, double timeout_s, moedc_model_info *out, moedc_error *err);
int moedc_health_within(moedc *c, const char *service, double timeout_s, int *status,
                        moedc_error *err);

/* ---- moedc_fleet.c, for the calls ---- */

/* Whether moedc_connect_many of these targets is a fleet (several, or a name of several). */
bool moedc_fleet_wanted(const char *const *targets, int n);
int moedc_fleet_open(const char *const *targets, int n, const moedc_opts *opts, moedc_fleet **out,
                     moedc_error *err);
void moedc_fleet_close(moedc_fleet *f);
int moedc_fleet_forward_start(moedc_fleet *f, const moedc_request *req, moedc_queue *q, void *user,
                              moedc_call **out, moedc_error *err);
/* A sub-call of part p finished (on the queue it was started on): returns its handle when this was
 * the last part outstanding, else NULL. */
moedc_call *moedc_fleet_part_done(moedc_call *sub, moedc_part *p);
int moedc_fleet_finish(moedc_call *handle, moedc_result *res, moedc_error *err);
void moedc_fleet_cancel(moedc_call *handle);
int moedc_fleet_info(moedc_fleet *f, moedc_model_info *out, moedc_error *err);
int moedc_fleet_health(moedc_fleet *f, const char *service, int *status, moedc_error *err);

#endif
