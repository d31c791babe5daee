/*
 * check.h — the unit tests' few assertions. A failed check prints where and why and marks the
 * test failed but keeps going, so one run shows every failure; main returns check_status().
 */
#ifndef MOED_CHECK_H
#define MOED_CHECK_H

#include <math.h>
#include <stdio.h>

static int check_failures;

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: CHECK(%s) failed\n", __FILE__, __LINE__, #cond);               \
            check_failures++;                                                                      \
        }                                                                                          \
    } while (0)

#define CHECK_MSG(cond, ...)                                                                       \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #cond);               \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fputc('\n', stderr);                                                                   \
            check_failures++;                                                                      \
        }                                                                                          \
    } while (0)

#define CHECK_EQ_INT(a, b)                                                                         \
    do {                                                                                           \
        long long check_a_ = (long long)(a), check_b_ = (long long)(b);                            \
        CHECK_MSG(check_a_ == check_b_, "%s = %lld, %s = %lld", #a, check_a_, #b, check_b_);       \
    } while (0)

#define CHECK_NEAR(a, b, tol)                                                                      \
    do {                                                                                           \
        double check_a_ = (double)(a), check_b_ = (double)(b);                                     \
        CHECK_MSG(fabs(check_a_ - check_b_) <= (tol), "%s = %.9g, %s = %.9g (tol %g)", #a,         \
                  check_a_, #b, check_b_, (double)(tol));                                          \
    } while (0)

static inline int check_status(const char *name)
{
    if (check_failures)
        fprintf(stderr, "%s: %d check(s) failed\n", name, check_failures);
    else
        fprintf(stderr, "%s: ok\n", name);
    return check_failures ? 1 : 0;
}

#define CHECK_SKIP 77

#endif
