/*
 * moed_region_cmd — one RegionCommand, as the Regions stream receives it (its encoded bytes),
 * carried out on a session of the registry (regions; rings through the doorbell, links through
 * link.h), and the
 * RegionEvent that answers it (encoded). The stream's plumbing is region_rpc.c's; this is
 * everything a command's bytes reach, so the fuzzer drives it as the stream does.
 */
#ifndef MOED_REGION_CMD_H
#define MOED_REGION_CMD_H

#include "doorbell.h"
#include "link.h"
#include "region.h"

#include "moed/v1/moed.pb-c.h"

#include <stddef.h>
#include <stdint.h>

/* The largest command accepted: a name, a handle and a few numbers. */
#define MOED_REGION_CMD_MAX 4096

/* Decodes and runs the command in buf[0..n) on session s (its rings in db, its links in lk; NULL:
 * the doorbell, or links, are off, and their commands fail FAILED_PRECONDITION). Returns the
 * event's bytes (malloc'd, *out_len of them; NULL when out of memory) and in *status the gRPC code
 * it carries: a command that does not parse, or is over MOED_REGION_CMD_MAX bytes, is answered too.
 */
uint8_t *moed_region_command(moed_regions *r, moed_doorbell *db, moed_links *lk,
                             moed_region_session *s, const uint8_t *buf, size_t n, size_t *out_len,
                             int *status);

/* A region's listing as moed.v1.Region (out points into info). */
void moed_region_to_proto(const moed_region_info *info, Moed__V1__Region *out);

#endif
