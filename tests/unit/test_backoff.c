/*
 * test_backoff — the one wait policy (common/moed_backoff.h): within its spin a pause never sleeps
 * and the wait says it spins; past it a pause sleeps at least its nap, the naps double up to the
 * most and stay there, and a pause never sleeps past the wait's bound (nor at all once it has
 * passed).
 */
#include "check.h"
#include "moed_backoff.h"

/* How long one pause of b took, in nanoseconds. */
static uint64_t timed_pause(moed_backoff *b)
{
    const uint64_t t0 = moed_now_ns();
    moed_backoff_pause(b, 0);
    return moed_now_ns() - t0;
}

static void test_spin(void)
{
    moed_backoff b;
    moed_backoff_start(&b);
    CHECK(moed_backoff_spinning(&b));
    CHECK(moed_backoff_sleep_ns(&b, b.start_ns + MOED_BACKOFF_SPIN_NS - 1, 0) == 0);
    CHECK(moed_backoff_sleep_ns(&b, b.start_ns + MOED_BACKOFF_SPIN_NS, 0) ==
          MOED_BACKOFF_NAP_MIN_NS);
    /* past the relaxed pauses, into the yields (fewer where a loaded machine ends the spin first)
     */
    unsigned pauses = 0;
    for (; pauses < MOED_BACKOFF_RELAX + 100 && moed_backoff_spinning(&b); pauses++)
        moed_backoff_pause(&b, 0);
    const unsigned relaxed = pauses < MOED_BACKOFF_RELAX ? pauses : MOED_BACKOFF_RELAX;
    CHECK_MSG(b.relaxed == relaxed, "relaxed %u of %u pauses, want %u", b.relaxed, pauses, relaxed);
    if (moed_backoff_spinning(&b))
        CHECK_MSG(b.nap_ns == MOED_BACKOFF_NAP_MIN_NS, "a pause within the spin napped");
}

static void test_naps(void)
{
    moed_backoff b;
    moed_backoff_start(&b);
    b.start_ns -= MOED_BACKOFF_SPIN_NS; /* the spin is over */
    CHECK(!moed_backoff_spinning(&b));
    uint64_t want = MOED_BACKOFF_NAP_MIN_NS;
    for (int i = 0; i < 8; i++) {
        const uint64_t ns = timed_pause(&b);
        CHECK_MSG(ns >= want, "nap %d slept %llu ns, want at least %llu", i, (unsigned long long)ns,
                  (unsigned long long)want);
        want = want * 2 < MOED_BACKOFF_NAP_MAX_NS ? want * 2 : MOED_BACKOFF_NAP_MAX_NS;
        CHECK_MSG(b.nap_ns == want, "after nap %d the next is %llu ns, want %llu", i,
                  (unsigned long long)b.nap_ns, (unsigned long long)want);
    }
}

/* The bound: a sleep ends at it, and none follows once it has passed (the policy's own answer,
 * so no clock of a loaded machine decides the test). */
static void test_bound(void)
{
    moed_backoff b;
    moed_backoff_start(&b);
    const uint64_t t = b.start_ns;
    CHECK(moed_backoff_sleep_ns(&b, t + 1000, t + 5000000) == 0); /* spinning */
    b.nap_ns = MOED_BACKOFF_NAP_MAX_NS;
    const uint64_t after = t + MOED_BACKOFF_SPIN_NS;
    CHECK(moed_backoff_sleep_ns(&b, after, 0) == MOED_BACKOFF_NAP_MAX_NS);
    CHECK(moed_backoff_sleep_ns(&b, after, after + 5000000) == MOED_BACKOFF_NAP_MAX_NS);
    CHECK(moed_backoff_sleep_ns(&b, after, after + 100000) == 100000);
    CHECK(moed_backoff_sleep_ns(&b, after, after) == 0);
    CHECK(moed_backoff_sleep_ns(&b, after + 1, after) == 0);
    b.start_ns -= MOED_BACKOFF_SPIN_NS;
    const uint64_t t0 = moed_now_ns();
    moed_backoff_pause(&b, t0); /* the bound has passed: it returns at once */
    CHECK_MSG(b.nap_ns == MOED_BACKOFF_NAP_MAX_NS, "a pause past its bound changed the nap");
}

int main(void)
{
    test_spin();
    test_naps();
    test_bound();
    return check_status("test_backoff");
}
