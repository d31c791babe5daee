/*
 * moed_region_cmd — RegionCommand in, RegionEvent out (region_cmd.h).
 *
 * protobuf-c unpacks the command (it is small; no tensor bytes travel here), after
 * moed_wire_unpack_bytes dropped the unknown groups protobuf-c cannot skip; every field it holds is
 * checked by the registry, and whatever goes wrong becomes the event's code and message: a command
 * never ends its stream. One that does not parse is answered with the seq it carried, if any.
 */
#include "region_cmd.h"

#include "log.h"
#include "wire.h"

#include <stdlib.h>
#include <string.h>

void moed_region_to_proto(const moed_region_info *i, Moed__V1__Region *out)
{
    moed__v1__region__init(out);
    out->id = i->id;
    out->kind = (Moed__V1__RegionKind)i->kind;
    out->name = (char *)i->name;
    out->bytes = i->bytes;
    out->device = (uint32_t)i->device;
    out->ready = i->ready;
    out->broken = i->broken;
    out->requests = i->requests;
}

static int no_doorbell(moed_error *err)
{
    return moed_fail(err, MOED_EPRECOND,
                     "this server has the doorbell off (--max-rings 0): send Forward calls over "
                     "gRPC");
}

static int no_links(moed_error *err)
{
    return moed_fail(
        err, MOED_EPRECOND,
        "this server has NCCL links off (--max-links 0): send Forward calls over gRPC");
}

/* What the command makes or closes, for the event. */
typedef struct outcome {
    moed_region_info info;
    uint8_t challenge[MOED_REGION_CHALLENGE];
    bool has_challenge;
    moed_ring_info ring;
    moed_link_info link;
} outcome;

/* Carries out one decoded command; fills *o for the event. */
static int run(moed_regions *r, moed_doorbell *db, moed_links *lk, moed_region_session *s,
               const Moed__V1__RegionCommand *cmd, outcome *o, moed_error *err)
{
    moed_region_info *info = &o->info;
    moed_ring_info *ring = &o->ring;
    switch (cmd->command_case) {
    case MOED__V1__REGION_COMMAND__COMMAND_REGISTER_HOST: {
        const Moed__V1__RegisterHostRegion *h = cmd->register_host;
        o->has_challenge = true;
        return moed_regions_register_host(r, s, h->name, strlen(h->name), h->bytes, info,
                                          o->challenge, err);
    }
    case MOED__V1__REGION_COMMAND__COMMAND_CONFIRM_HOST:
        return moed_regions_confirm_host(r, s, cmd->confirm_host->region, info, err);
    case MOED__V1__REGION_COMMAND__COMMAND_REGISTER_CUDA: {
        const Moed__V1__RegisterCudaRegion *g = cmd->register_cuda;
        if (g->device > INT32_MAX)
            return moed_fail(err, MOED_EINVAL, "register_cuda.device %u is out of range",
                             g->device);
        return moed_regions_register_cuda(r, s, g->ipc_handle.data, g->ipc_handle.len,
                                          g->device_uuid, (int)g->device, g->bytes, g->offset, info,
                                          err);
    }
    case MOED__V1__REGION_COMMAND__COMMAND_UNREGISTER:
        return moed_regions_unregister(r, s, cmd->unregister->region, info, err);
    case MOED__V1__REGION_COMMAND__COMMAND_REGISTER_RING: {
        const Moed__V1__RegisterRing *g = cmd->register_ring;
        return db ? moed_doorbell_register(db, s, g->region, g->offset, g->slots, ring, err)
                  : no_doorbell(err);
    }
    case MOED__V1__REGION_COMMAND__COMMAND_UNREGISTER_RING:
        return db ? moed_doorbell_unregister(db, s, cmd->unregister_ring->ring, ring, err)
                  : no_doorbell(err);
    case MOED__V1__REGION_COMMAND__COMMAND_OPEN_LINK: {
        const Moed__V1__OpenLink *g = cmd->open_link;
        return lk ? moed_links_open(lk, s, g->max_tokens, g->max_top_k, g->device_plus_one,
                                    &o->link, err)
                  : no_links(err);
    }
    case MOED__V1__REGION_COMMAND__COMMAND_CLOSE_LINK:
        return lk ? moed_links_close(lk, s, cmd->close_link->link, &o->link, err) : no_links(err);
    default:
        return moed_fail(err, MOED_EINVAL,
                         "the command sets none of register_host, confirm_host, register_cuda, "
                         "unregister, register_ring, unregister_ring, open_link or close_link");
    }
}

uint8_t *moed_region_command(moed_regions *r, moed_doorbell *db, moed_links *lk,
                             moed_region_session *s, const uint8_t *buf, size_t n, size_t *out_len,
                             int *status)
{
    Moed__V1__RegionEvent ev = MOED__V1__REGION_EVENT__INIT;
    Moed__V1__Region region;
    Moed__V1__Ring ring_msg = MOED__V1__RING__INIT;
    Moed__V1__Link link_msg = MOED__V1__LINK__INIT;
    outcome o;
    moed_error err = { 0 };
    Moed__V1__RegionCommand *cmd = NULL;
    int rc;
    memset(&o, 0, sizeof o);
    if (n > MOED_REGION_CMD_MAX)
        rc = moed_fail(&err, MOED_ETOOBIG, "a RegionCommand is at most %d bytes; this one is %zu",
                       MOED_REGION_CMD_MAX, n);
    else if (!(rc = moed_wire_unpack_bytes(&moed__v1__region_command__descriptor, buf, n,
                                           (ProtobufCMessage **)&cmd, &err)))
        rc = run(r, db, lk, s, cmd, &o, &err);
    /* One that does not parse still names its seq when it got that far: the caller can tell
     * which command failed. */
    ev.seq = cmd ? cmd->seq : moed_wire_find_uint(buf, n, 1);
    if (o.info.id) {
        moed_region_to_proto(&o.info, &region);
        ev.region = &region;
    }
    if (o.ring.id) {
        ring_msg.id = o.ring.id;
        ring_msg.region = o.ring.region;
        ring_msg.offset = o.ring.offset;
        ring_msg.slots = o.ring.slots;
        ring_msg.version = MOED_RING_VERSION;
        ev.ring = &ring_msg;
    }
    if (o.link.id) {
        link_msg.id = o.link.id;
        link_msg.unique_id = (ProtobufCBinaryData){ sizeof o.link.unique_id, o.link.unique_id };
        if (!rc && cmd->command_case == MOED__V1__REGION_COMMAND__COMMAND_OPEN_LINK)
            link_msg.key = (ProtobufCBinaryData){ sizeof o.link.key, o.link.key };
        link_msg.device = o.link.device;
        link_msg.version = MOED_LINK_VERSION;
        link_msg.nccl_version = o.link.nccl_version;
        link_msg.max_payload_bytes = o.link.max_payload_bytes;
        ev.link = &link_msg;
    }
    *status = moed_err_grpc_status(rc);
    ev.code = *status;
    ev.message = rc ? err.msg : "";
    if (!rc && o.has_challenge) {
        ev.challenge.data = o.challenge;
        ev.challenge.len = sizeof o.challenge;
    }
    if (rc)
        moed_log_debug("region command failed", "seq=%llu status=%d reason=\"%s\"",
                       (unsigned long long)ev.seq, *status, err.msg);
    *out_len = moed__v1__region_event__get_packed_size(&ev);
    uint8_t *out = malloc(*out_len ? *out_len : 1);
    if (out) moed__v1__region_event__pack(&ev, out);
    if (cmd) moed__v1__region_command__free_unpacked(cmd, NULL);
    return out;
}
