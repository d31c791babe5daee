/*
 * moedc_common — libmoedclient's errors and status codes (moedclient.h), and the proof that the
 * public header's values are the daemon's.
 *
 * The public header stands alone, so it spells out the codes and protocol enumerations that the
 * daemon's core headers define too; this is the one file that sees both, and it refuses to
 * compile if they ever differ.
 */
#include "moedc_common.h"

#include "moed_dtype.h"
#include "moed_err.h"
#include "moed_model.h"
#include "moed_route.h"

#include <stdarg.h>
#include <stdio.h>
#include <time.h>

#define MOEDC_SAME(name, value, text)                                                              \
    _Static_assert((int)MOEDC_##name == (int)MOED_##name,                                          \
                   "MOEDC_" #name " is not the daemon's value");
MOEDC_ERR_MAP(MOEDC_SAME)
#undef MOEDC_SAME
#define MOEDC_ONE(...) +1
_Static_assert(0 MOEDC_ERR_MAP(MOEDC_ONE) == 0 MOED_ERR_TABLE(MOEDC_ONE),
               "the daemon has error codes the public header lacks");
#undef MOEDC_ONE

_Static_assert((int)MOEDC_F32 == (int)MOED_F32 && (int)MOEDC_F16 == (int)MOED_F16 &&
                   (int)MOEDC_BF16 == (int)MOED_BF16,
               "dtypes differ from the daemon's");
_Static_assert((int)MOEDC_GATE_MODEL == (int)MOED_GATE_MODEL &&
                   (int)MOEDC_GATE_TOPK == (int)MOED_GATE_TOPK &&
                   (int)MOEDC_GATE_SIGMOID == (int)MOED_GATE_SIGMOID &&
                   (int)MOEDC_GATE_SPARSEMAX == (int)MOED_GATE_SPARSEMAX &&
                   (int)MOEDC_GATE_QUADRATIC == (int)MOED_GATE_QUADRATIC &&
                   (int)MOEDC_GATE_PIONEER == (int)MOED_GATE_PIONEER,
               "gating strategies differ from the daemon's");
_Static_assert((int)MOEDC_RENORM_DEFAULT == (int)MOED_RENORM_DEFAULT &&
                   (int)MOEDC_RENORM_ON == (int)MOED_RENORM_ON &&
                   (int)MOEDC_RENORM_OFF == (int)MOED_RENORM_OFF,
               "renormalize values differ from the daemon's");
_Static_assert((int)MOEDC_ACT_SWIGLU == (int)MOED_ACT_SWIGLU &&
                   (int)MOEDC_ACT_GELU == (int)MOED_ACT_GELU &&
                   (int)MOEDC_ACT_RELU == (int)MOED_ACT_RELU,
               "activations differ from the daemon's");
_Static_assert((int)MOEDC_RULE_SOFTMAX_TOPK == (int)MOED_RULE_SOFTMAX_TOPK &&
                   (int)MOEDC_RULE_DEEPSEEK_V3 == (int)MOED_RULE_DEEPSEEK_V3,
               "router rules differ from the daemon's");

int moedc_fail(moedc_error *err, int code, const char *fmt, ...)
{
    if (!err) return code;
    err->code = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->msg, sizeof err->msg, fmt, ap);
    va_end(ap);
    return code;
}

const char *moedc_strerror(int code)
{
    switch (code) {
#define MOEDC_TEXT(name, value, text)                                                              \
    case MOEDC_##name:                                                                             \
        return text;
        MOEDC_ERR_MAP(MOEDC_TEXT)
#undef MOEDC_TEXT
    }
    return "unknown error";
}

int moedc_code_to_grpc(int code)
{
    return moed_err_grpc_status(code);
}

const char *moedc_grpc_status_name(int grpc_status)
{
    return moed_grpc_status_name(grpc_status);
}

int moedc_code_from_grpc(int grpc_status)
{
    /* The inverse of the daemon's table where it is one-to-one; the closest code elsewhere. */
    static const int codes[] = {
        MOEDC_OK,        MOEDC_ECANCELLED, MOEDC_EINTERNAL,    MOEDC_EINVAL,    MOEDC_EDEADLINE,
        MOEDC_ENOTFOUND, MOEDC_EINVAL,     MOEDC_EUNAUTH,      MOEDC_ETOOBIG,   MOEDC_EPRECOND,
        MOEDC_EUNAVAIL,  MOEDC_EINVAL,     MOEDC_EUNSUPPORTED, MOEDC_EINTERNAL, MOEDC_EUNAVAIL,
        MOEDC_EIO,       MOEDC_EUNAUTH,
    };
    if (grpc_status < 0 || grpc_status >= (int)(sizeof codes / sizeof codes[0]))
        return MOEDC_EINTERNAL;
    return codes[grpc_status];
}

void moedc_watch_cond_init(pthread_cond_t *cv)
{
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(cv, &ca);
    pthread_condattr_destroy(&ca);
}

void moedc_watch_wait(pthread_cond_t *cv, pthread_mutex_t *mu, int64_t ns)
{
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    ns += until.tv_nsec;
    until.tv_sec += ns / 1000000000;
    until.tv_nsec = ns % 1000000000;
    pthread_cond_timedwait(cv, mu, &until);
}

void moedc_watch_stop(pthread_mutex_t *mu, pthread_cond_t *cv, bool *stop, pthread_t thread)
{
    pthread_mutex_lock(mu);
    *stop = true;
    pthread_cond_signal(cv);
    pthread_mutex_unlock(mu);
    pthread_join(thread, NULL);
}
