/*
 * fuzz_fake.h — what the region-aware fuzz targets link instead of the real thing, in the one
 * translation unit of each target: a getrandom(2) that hands out 8-byte ids 1, 2, 3, ... and every
 * other request (a challenge) as bytes of 0xab, so seeds and the fuzzer can name regions and never
 * confirm by luck; and a backend with no devices and no DMA (moed_backend.c's defaults for every
 * hook).
 */
#ifndef MOED_FUZZ_FAKE_H
#define MOED_FUZZ_FAKE_H

#include "moed_backend_impl.h"

#include <stdint.h>
#include <string.h>
#include <sys/random.h>

ssize_t getrandom(void *buf, size_t n, unsigned int flags)
{
    static uint64_t next_id;
    (void)flags;
    memset(buf, 0xab, n);
    if (n == 8) {
        uint64_t id = ++next_id;
        memcpy(buf, &id, 8);
    }
    return (ssize_t)n;
}

static const moed_backend_ops fake_ops = { .name = "fuzz" };
static moed_backend fake = { .ops = &fake_ops };

#endif
