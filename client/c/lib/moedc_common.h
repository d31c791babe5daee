/*
 * moedc_common — what libmoedclient's own files share (private to lib/): filling a moedc_error
 * the way the daemon's modules fill theirs.
 */
#ifndef MOEDC_COMMON_H
#define MOEDC_COMMON_H

#include "moedclient.h"

/* Records code and a printf-style message in err (which may be NULL) and returns code. */
int moedc_fail(moedc_error *err, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#endif
