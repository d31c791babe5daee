/*
 * moed_ring — the ring header's checks (moed_ring.h holds the layout).
 */
#include "moed_ring.h"

int moed_ring_check_header(const moed_ring_header *h, uint32_t slots, uint64_t avail,
                           moed_error *err)
{
    if (h->magic != MOED_RING_MAGIC)
        return moed_fail(err, MOED_EINVAL,
                         "the ring's header does not start with the ring magic 0x%08x: write the "
                         "header (moed_ring.h) before registering the ring",
                         MOED_RING_MAGIC);
    if (h->version != MOED_RING_VERSION)
        return moed_fail(err, MOED_EINVAL,
                         "the ring's layout version is %u; this server speaks version %d",
                         (unsigned)h->version, MOED_RING_VERSION);
    if (h->header_bytes != MOED_RING_HEADER_BYTES || h->slot_bytes != MOED_RING_SLOT_BYTES)
        return moed_fail(err, MOED_EINVAL,
                         "the ring's header says %u header bytes and %u bytes a slot; the layout "
                         "has %d and %d",
                         (unsigned)h->header_bytes, (unsigned)h->slot_bytes, MOED_RING_HEADER_BYTES,
                         MOED_RING_SLOT_BYTES);
    if (slots < 1 || slots > MOED_RING_MAX_SLOTS)
        return moed_fail(err, MOED_EINVAL, "a ring has 1 to %d slots, not %u", MOED_RING_MAX_SLOTS,
                         (unsigned)slots);
    if (h->n_slots != slots)
        return moed_fail(err, MOED_EINVAL,
                         "the ring's header says %u slots, the command %u: they must agree",
                         (unsigned)h->n_slots, (unsigned)slots);
    if (moed_ring_bytes(slots) > avail)
        return moed_fail(err, MOED_EINVAL,
                         "a ring of %u slots takes %llu bytes; the region holds %llu from the "
                         "ring's offset",
                         (unsigned)slots, (unsigned long long)moed_ring_bytes(slots),
                         (unsigned long long)avail);
    return 0;
}
