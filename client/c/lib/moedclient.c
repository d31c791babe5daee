/*
 * moedclient — libmoedclient's calls on a moedc (moedclient.h states the contract), whatever is
 * behind it: each goes through the moedc's table (moedc_impl.h), one daemon's channel
 * (moedc_channel.c) or a fleet's (moedc_fleet.c). The blocking Forward is the asynchronous one
 * waited for on a queue of its own.
 */
#include "moedc_impl.h"

#include <stdlib.h>
#include <string.h>

const char *moedc_health_name(int status)
{
    switch (status) {
    case MOEDC_HEALTH_SERVING:
        return "SERVING";
    case MOEDC_HEALTH_NOT_SERVING:
        return "NOT_SERVING";
    case MOEDC_HEALTH_SERVICE_UNKNOWN:
        return "SERVICE_UNKNOWN";
    }
    return "UNKNOWN";
}

void moedc_close(moedc *c)
{
    if (c) c->ops->close(c);
}

int moedc_forward_start(moedc *c, const moedc_request *req, moedc_queue *q, void *user,
                        moedc_call **out, moedc_error *err)
{
    *out = NULL;
    return c->ops->forward_start(c, req, &(moedc_start){ .user = user }, q, out, err);
}

void *moedc_call_user(const moedc_call *call)
{
    return call->user;
}

void moedc_call_cancel(moedc_call *call)
{
    call->ops->forward_cancel(call);
}

int moedc_call_finish(moedc_call *call, moedc_result *res, moedc_error *err)
{
    memset(res, 0, sizeof *res);
    return call->ops->forward_finish(call, res, err);
}

int moedc_forward(moedc *c, const moedc_request *req, moedc_result *res, moedc_error *err)
{
    memset(res, 0, sizeof *res);
    moedc_queue *q;
    moedc_call *call;
    int rc = moedc_queue_create(&q, err);
    if (rc) return rc;
    rc = moedc_forward_start(c, req, q, NULL, &call, err);
    if (!rc) {
        moedc_queue_next(q, -1, &call);
        rc = moedc_call_finish(call, res, err);
    }
    moedc_queue_destroy(q);
    return rc;
}

int moedc_info(moedc *c, moedc_model_info *out, moedc_error *err)
{
    memset(out, 0, sizeof *out);
    return c->ops->info(c, 0, out, err);
}

int moedc_health(moedc *c, const char *service, int *status, moedc_error *err)
{
    *status = MOEDC_HEALTH_UNKNOWN;
    return c->ops->health(c, service, 0, status, err);
}

int moedc_list_regions(moedc *c, moedc_region_info **out, int *n, moedc_error *err)
{
    *out = NULL;
    *n = 0;
    return c->ops->list_regions(c, out, n, err);
}

int moedc_session_open(moedc *c, moedc_session **out, moedc_error *err)
{
    *out = NULL;
    return c->ops->session_open(c, out, err);
}

void moedc_layout_free(moedc_layout *l)
{
    moedc_plan_copy_free(&l->plan);
    free(l->daemons);
    free(l->names);
    memset(l, 0, sizeof *l);
}
