/* moed_backoff — see moed_backoff.h. */
#include "moed_backoff.h"

#include <sched.h>
#include <time.h>

void moed_backoff_start(moed_backoff *b)
{
    *b = (moed_backoff){ .start_ns = moed_now_ns(), .nap_ns = MOED_BACKOFF_NAP_MIN_NS };
}

bool moed_backoff_spinning(const moed_backoff *b)
{
    return moed_now_ns() - b->start_ns < MOED_BACKOFF_SPIN_NS;
}

static void relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

uint64_t moed_backoff_sleep_ns(const moed_backoff *b, uint64_t now_ns, uint64_t until_ns)
{
    if (now_ns - b->start_ns < MOED_BACKOFF_SPIN_NS) return 0;
    if (until_ns && until_ns <= now_ns) return 0;
    return until_ns && until_ns - now_ns < b->nap_ns ? until_ns - now_ns : b->nap_ns;
}

void moed_backoff_pause(moed_backoff *b, uint64_t until_ns)
{
    const uint64_t now = moed_now_ns();
    if (now - b->start_ns < MOED_BACKOFF_SPIN_NS) {
        if (b->relaxed < MOED_BACKOFF_RELAX) {
            b->relaxed++;
            relax();
        } else {
            sched_yield();
        }
        return;
    }
    const uint64_t ns = moed_backoff_sleep_ns(b, now, until_ns);
    if (!ns) return;
    struct timespec ts = { (time_t)(ns / 1000000000ull), (long)(ns % 1000000000ull) };
    nanosleep(&ts, NULL);
    b->nap_ns = b->nap_ns * 2 < MOED_BACKOFF_NAP_MAX_NS ? b->nap_ns * 2 : MOED_BACKOFF_NAP_MAX_NS;
}
