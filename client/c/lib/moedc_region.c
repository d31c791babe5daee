/*
 * moedc_region — region sessions: the moed.v1.Moed/Regions stream, host regions in POSIX shared
 * memory with the server's challenge, CUDA regions by IPC handle, described through the driver
 * moedc_cuda loads at run time (moedclient.h states the contract; moed.proto the rules the server
 * keeps).
 *
 * A session is one call on the channel with a completion queue of its own. Each command is one
 * batch (send the command, receive its event) waited for under the session's mutex, so commands
 * from several threads go one at a time, each answered in order. A receive of the call's status is
 * posted when it opens: a stream the server ended (refused, or draining) shows as a command that
 * gets no event, and its status is the command's error. Between commands nothing but that status
 * can arrive on the queue, so moedc_session_ended looks for it without waiting whenever no command
 * holds the mutex (one that does records it itself).
 */
#include "moedc_channel.h"
#include "moedc_common.h"
#include "moedc_cuda.h"
#include "moedc_session.h"

#include "moed/v1/moed.pb-c.h"

#include <errno.h>
#include <fcntl.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/support/time.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

/* How long a command may take when the channel sets no deadline. */
#define COMMAND_TIMEOUT_S 60.0

struct moedc_session {
    moedc *c;
    pthread_mutex_t mu; /* one command at a time; everything below */
    grpc_completion_queue *cq;
    grpc_call *call;
    grpc_metadata auth_md;
    grpc_metadata_array initial_md, trailing_md;
    grpc_status_code status;
    grpc_slice details;
    bool md_received, status_in, ended; /* status_in: read by moedc_session_ended too (atomic) */
    uint64_t seq;
    char tag_open, tag_cmd, tag_status, tag_close; /* their addresses are the batches' tags */
    moedc_region **regions;                        /* registered here and not yet freed */
    int n_regions, cap_regions;
    pthread_mutex_t rings_mu; /* the rings on it (moedc_ring.c) */
    moedc_ring **rings;
    int n_rings, cap_rings;
};

/* Waits for the batch tagged `tag` (the status receive may complete meanwhile). False on timeout:
 * the call is then cancelled and the batch waited for. */
static bool wait_for(moedc_session *s, void *tag, double timeout_s)
{
    gpr_timespec until =
        gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                     gpr_time_from_micros((int64_t)(timeout_s * 1e6), GPR_TIMESPAN));
    bool in_time = true;
    for (;;) {
        grpc_event ev = grpc_completion_queue_next(s->cq, until, NULL);
        if (ev.type == GRPC_QUEUE_TIMEOUT) {
            grpc_call_cancel(s->call, NULL);
            until = gpr_inf_future(GPR_CLOCK_MONOTONIC);
            in_time = false;
            continue;
        }
        if (ev.tag == &s->tag_status) __atomic_store_n(&s->status_in, true, __ATOMIC_RELEASE);
        if (ev.tag == tag) return in_time;
    }
}

/* The stream's end as an error: the server's status and message. */
static int ended_error(moedc_session *s, moedc_error *err)
{
    if (!s->status_in) wait_for(s, &s->tag_status, 10);
    s->ended = true;
    int len = (int)GRPC_SLICE_LENGTH(s->details);
    return moedc_fail(err, s->status ? moedc_code_from_grpc(s->status) : MOEDC_EUNAVAIL,
                      "the region session ended: %s%s%.*s", moedc_grpc_status_name(s->status),
                      len ? ": " : "", len, (const char *)GRPC_SLICE_START_PTR(s->details));
}

/* Sends one command and returns its event (free with moed__v1__region_event__free_unpacked), or
 * the error: the event's status, the stream's end, or a command unanswered in time. */
static int command(moedc_session *s, Moed__V1__RegionCommand *cmd, Moed__V1__RegionEvent **out,
                   moedc_error *err)
{
    *out = NULL;
    if (s->ended) return ended_error(s, err);
    cmd->seq = ++s->seq;
    size_t n = moed__v1__region_command__get_packed_size(cmd);
    grpc_slice sl = grpc_slice_malloc(n);
    moed__v1__region_command__pack(cmd, GRPC_SLICE_START_PTR(sl));
    grpc_byte_buffer *send = grpc_raw_byte_buffer_create(&sl, 1), *recv = NULL;
    grpc_slice_unref(sl);
    grpc_op ops[3];
    size_t k = 0;
    memset(ops, 0, sizeof ops);
    ops[k].op = GRPC_OP_SEND_MESSAGE;
    ops[k++].data.send_message.send_message = send;
    if (!s->md_received) {
        ops[k].op = GRPC_OP_RECV_INITIAL_METADATA;
        ops[k++].data.recv_initial_metadata.recv_initial_metadata = &s->initial_md;
        s->md_received = true;
    }
    ops[k].op = GRPC_OP_RECV_MESSAGE;
    ops[k++].data.recv_message.recv_message = &recv;
    int rc = 0;
    if (grpc_call_start_batch(s->call, ops, k, &s->tag_cmd, NULL) != GRPC_CALL_OK)
        rc = moedc_fail(err, MOEDC_EINTERNAL, "gRPC refused a region command");
    else if (!wait_for(s, &s->tag_cmd, s->c->timeout_s > 0 ? s->c->timeout_s : COMMAND_TIMEOUT_S))
        rc = moedc_fail(err, MOEDC_EDEADLINE,
                        "the server did not answer a region command in time; the session is "
                        "closed");
    grpc_byte_buffer_destroy(send);
    if (!rc && !recv) return ended_error(s, err);
    if (rc) {
        if (recv) grpc_byte_buffer_destroy(recv);
        s->ended = true;
        return rc;
    }
    grpc_byte_buffer_reader rd;
    grpc_slice all = grpc_empty_slice();
    if (grpc_byte_buffer_reader_init(&rd, recv)) {
        all = grpc_byte_buffer_reader_readall(&rd);
        grpc_byte_buffer_reader_destroy(&rd);
    }
    grpc_byte_buffer_destroy(recv);
    Moed__V1__RegionEvent *ev =
        moed__v1__region_event__unpack(NULL, GRPC_SLICE_LENGTH(all), GRPC_SLICE_START_PTR(all));
    grpc_slice_unref(all);
    if (!ev || ev->seq != cmd->seq)
        rc = moedc_fail(err, MOEDC_EFORMAT, "the server's region event %s",
                        ev ? "answers another command" : "does not parse");
    else if (ev->code)
        rc = moedc_fail(err, moedc_code_from_grpc(ev->code), "%s", ev->message);
    if (rc && ev) moed__v1__region_event__free_unpacked(ev, NULL);
    if (!rc) *out = ev;
    return rc;
}

int moedc_session_command(moedc_session *s, Moed__V1__RegionCommand *cmd,
                          Moed__V1__RegionEvent **out, moedc_error *err)
{
    pthread_mutex_lock(&s->mu);
    int rc = command(s, cmd, out, err);
    pthread_mutex_unlock(&s->mu);
    return rc;
}

bool moedc_session_ended(moedc_session *s)
{
    if (__atomic_load_n(&s->status_in, __ATOMIC_ACQUIRE)) return true;
    if (pthread_mutex_trylock(&s->mu)) return false; /* a command runs: it will see the status */
    if (!s->status_in) {
        grpc_event ev = grpc_completion_queue_next(s->cq, gpr_inf_past(GPR_CLOCK_MONOTONIC), NULL);
        if (ev.type == GRPC_OP_COMPLETE && ev.tag == &s->tag_status)
            __atomic_store_n(&s->status_in, true, __ATOMIC_RELEASE);
    }
    bool ended = s->status_in || s->ended;
    pthread_mutex_unlock(&s->mu);
    return ended;
}

double moedc_session_timeout(const moedc_session *s)
{
    return s->c->timeout_s;
}

int moedc_session_add_ring(moedc_session *s, moedc_ring *r, moedc_error *err)
{
    pthread_mutex_lock(&s->rings_mu);
    int rc = 0;
    if (s->n_rings == s->cap_rings) {
        int cap = s->cap_rings ? 2 * s->cap_rings : 4;
        moedc_ring **g = realloc(s->rings, (size_t)cap * sizeof *g);
        if (g) {
            s->rings = g;
            s->cap_rings = cap;
        } else {
            rc = moedc_fail(err, MOEDC_ENOMEM, "out of memory for a ring");
        }
    }
    if (!rc) s->rings[s->n_rings++] = r;
    pthread_mutex_unlock(&s->rings_mu);
    return rc;
}

void moedc_session_remove_ring(moedc_session *s, moedc_ring *r)
{
    pthread_mutex_lock(&s->rings_mu);
    for (int i = 0; i < s->n_rings; i++)
        if (s->rings[i] == r) s->rings[i] = s->rings[--s->n_rings];
    pthread_mutex_unlock(&s->rings_mu);
}

int moedc_channel_session_open(moedc *c, moedc_session **out, moedc_error *err)
{
    const moedc_channel *ch = (const moedc_channel *)c;
    moedc_session *s = calloc(1, sizeof *s);
    if (!s) return moedc_fail(err, MOEDC_ENOMEM, "out of memory opening a region session");
    grpc_init();
    s->c = c;
    pthread_mutex_init(&s->mu, NULL);
    pthread_mutex_init(&s->rings_mu, NULL);
    grpc_metadata_array_init(&s->initial_md);
    grpc_metadata_array_init(&s->trailing_md);
    s->details = grpc_empty_slice();
    s->cq = grpc_completion_queue_create_for_next(NULL);
    s->call = grpc_channel_create_registered_call(ch->channel, NULL, GRPC_PROPAGATE_DEFAULTS, s->cq,
                                                  ch->m_regions, gpr_inf_future(GPR_CLOCK_REALTIME),
                                                  NULL);
    if (ch->auth) {
        s->auth_md.key = grpc_slice_from_static_string("authorization");
        s->auth_md.value = grpc_slice_from_static_string(ch->auth);
    }
    grpc_op ops[1], st[1];
    memset(ops, 0, sizeof ops);
    memset(st, 0, sizeof st);
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[0].data.send_initial_metadata.count = ch->auth ? 1 : 0;
    ops[0].data.send_initial_metadata.metadata = &s->auth_md;
    st[0].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    st[0].data.recv_status_on_client.trailing_metadata = &s->trailing_md;
    st[0].data.recv_status_on_client.status = &s->status;
    st[0].data.recv_status_on_client.status_details = &s->details;
    if (!s->call || grpc_call_start_batch(s->call, ops, 1, &s->tag_open, NULL) != GRPC_CALL_OK ||
        grpc_call_start_batch(s->call, st, 1, &s->tag_status, NULL) != GRPC_CALL_OK) {
        moedc_session_close(s);
        return moedc_fail(err, MOEDC_EINTERNAL, "gRPC could not open a region session");
    }
    wait_for(s, &s->tag_open, COMMAND_TIMEOUT_S);
    *out = s;
    return 0;
}

/* ---- the regions of a session -----------------------------------------------------------------
 */

static int keep(moedc_session *s, moedc_region *r, moedc_error *err)
{
    if (s->n_regions == s->cap_regions) {
        int cap = s->cap_regions ? 2 * s->cap_regions : 8;
        moedc_region **g = realloc(s->regions, (size_t)cap * sizeof *g);
        if (!g) return moedc_fail(err, MOEDC_ENOMEM, "out of memory for a region");
        s->regions = g;
        s->cap_regions = cap;
    }
    s->regions[s->n_regions++] = r;
    return 0;
}

/* Lets go of r here (the server's side is the caller's business). */
static void drop(moedc_session *s, moedc_region *r)
{
    for (int i = 0; i < s->n_regions; i++)
        if (s->regions[i] == r) s->regions[i] = s->regions[--s->n_regions];
    if (r->kind == MOEDC_REGION_HOST) munmap(r->ptr, r->bytes);
    free(r);
}

static void unregister(moedc_session *s, uint64_t id)
{
    Moed__V1__RegionCommand cmd = MOED__V1__REGION_COMMAND__INIT;
    Moed__V1__UnregisterRegion u = MOED__V1__UNREGISTER_REGION__INIT;
    Moed__V1__RegionEvent *ev;
    moedc_error ignored;
    u.region = id;
    cmd.command_case = MOED__V1__REGION_COMMAND__COMMAND_UNREGISTER;
    cmd.unregister = &u;
    if (!command(s, &cmd, &ev, &ignored)) moed__v1__region_event__free_unpacked(ev, NULL);
}

int moedc_region_free(moedc_region *r, moedc_error *err)
{
    if (!r) return 0;
    moedc_session *s = r->session;
    pthread_mutex_lock(&s->mu);
    Moed__V1__RegionCommand cmd = MOED__V1__REGION_COMMAND__INIT;
    Moed__V1__UnregisterRegion u = MOED__V1__UNREGISTER_REGION__INIT;
    Moed__V1__RegionEvent *ev = NULL;
    u.region = r->id;
    cmd.command_case = MOED__V1__REGION_COMMAND__COMMAND_UNREGISTER;
    cmd.unregister = &u;
    int rc = command(s, &cmd, &ev, err);
    if (ev) moed__v1__region_event__free_unpacked(ev, NULL);
    drop(s, r);
    pthread_mutex_unlock(&s->mu);
    return rc;
}

void moedc_session_close(moedc_session *s)
{
    if (!s) return;
    for (;;) { /* its rings first: each unregisters itself and frees its region */
        pthread_mutex_lock(&s->rings_mu);
        moedc_ring *r = s->n_rings ? s->rings[0] : NULL;
        pthread_mutex_unlock(&s->rings_mu);
        if (!r) break;
        moedc_ring_close(r);
    }
    pthread_mutex_lock(&s->mu);
    while (s->n_regions) drop(s, s->regions[0]); /* the stream's end releases them there */
    if (s->call && !s->ended) {
        grpc_op op = { .op = GRPC_OP_SEND_CLOSE_FROM_CLIENT };
        if (grpc_call_start_batch(s->call, &op, 1, &s->tag_close, NULL) == GRPC_CALL_OK)
            wait_for(s, &s->tag_close, 10);
    }
    if (s->call && !s->status_in) wait_for(s, &s->tag_status, 10);
    pthread_mutex_unlock(&s->mu);
    if (s->call) grpc_call_unref(s->call);
    grpc_completion_queue_shutdown(s->cq);
    while (grpc_completion_queue_next(s->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
           GRPC_QUEUE_SHUTDOWN) {
    }
    grpc_completion_queue_destroy(s->cq);
    grpc_metadata_array_destroy(&s->initial_md);
    grpc_metadata_array_destroy(&s->trailing_md);
    grpc_slice_unref(s->details);
    pthread_mutex_destroy(&s->mu);
    pthread_mutex_destroy(&s->rings_mu);
    free(s->regions);
    free(s->rings);
    free(s);
    grpc_shutdown();
}

/* ---- host regions ------------------------------------------------------------------------------
 */

/* A new shared-memory object of `bytes`, mapped: its name in r->name, the mapping in r->ptr. */
static int make_shm(moedc_region *r, size_t bytes, unsigned mode, moedc_error *err)
{
    uint64_t rnd = 0;
    if (getrandom(&rnd, sizeof rnd, 0) != sizeof rnd) rnd = (uint64_t)random();
    snprintf(r->name, sizeof r->name, "/moedc-%d-%016llx", (int)getpid(), (unsigned long long)rnd);
    int fd = shm_open(r->name, O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, mode ? mode : 0600);
    if (fd < 0) return moedc_fail(err, MOEDC_EIO, "shm_open %s: %s", r->name, strerror(errno));
    int rc = 0;
    if ((mode && fchmod(fd, mode)) || ftruncate(fd, (off_t)bytes))
        rc = moedc_fail(err, MOEDC_EIO, "sizing %s to %zu bytes: %s", r->name, bytes,
                        strerror(errno));
    else if ((r->ptr = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)) == MAP_FAILED)
        rc = moedc_fail(err, MOEDC_ENOMEM, "mapping %zu bytes of %s: %s", bytes, r->name,
                        strerror(errno));
    close(fd);
    if (rc) shm_unlink(r->name);
    return rc;
}

/* The two steps: register (the server maps it and sends a challenge), write the challenge, confirm.
 */
static int register_host(moedc_session *s, moedc_region *r, moedc_error *err)
{
    Moed__V1__RegionCommand cmd = MOED__V1__REGION_COMMAND__INIT;
    Moed__V1__RegisterHostRegion h = MOED__V1__REGISTER_HOST_REGION__INIT;
    Moed__V1__ConfirmHostRegion c = MOED__V1__CONFIRM_HOST_REGION__INIT;
    Moed__V1__RegionEvent *ev = NULL;
    h.name = r->name;
    h.bytes = r->bytes;
    cmd.command_case = MOED__V1__REGION_COMMAND__COMMAND_REGISTER_HOST;
    cmd.register_host = &h;
    int rc = command(s, &cmd, &ev, err);
    if (rc) return rc;
    if (!ev->region || ev->challenge.len != 16) {
        moed__v1__region_event__free_unpacked(ev, NULL);
        return moedc_fail(err, MOEDC_EFORMAT,
                          "the server's answer to register_host lacks the "
                          "region or its challenge");
    }
    r->id = ev->region->id;
    memcpy(r->ptr, ev->challenge.data, 16);
    moed__v1__region_event__free_unpacked(ev, NULL);
    c.region = r->id;
    cmd = (Moed__V1__RegionCommand)MOED__V1__REGION_COMMAND__INIT;
    cmd.command_case = MOED__V1__REGION_COMMAND__COMMAND_CONFIRM_HOST;
    cmd.confirm_host = &c;
    if ((rc = command(s, &cmd, &ev, err))) {
        unregister(s, r->id);
        return rc;
    }
    moed__v1__region_event__free_unpacked(ev, NULL);
    memset(r->ptr, 0, 16);
    return 0;
}

int moedc_region_create_host(moedc_session *s, size_t bytes, unsigned mode, moedc_region **out,
                             moedc_error *err)
{
    *out = NULL;
    moedc_region *r = calloc(1, sizeof *r);
    if (!r) return moedc_fail(err, MOEDC_ENOMEM, "out of memory for a region");
    r->kind = MOEDC_REGION_HOST;
    r->bytes = bytes < 16 ? 16 : bytes;
    r->session = s;
    int rc = make_shm(r, r->bytes, mode, err);
    if (rc) {
        free(r);
        return rc;
    }
    pthread_mutex_lock(&s->mu);
    rc = register_host(s, r, err);
    shm_unlink(r->name); /* the server has it mapped now (or never will): nothing stays behind */
    if (!rc) rc = keep(s, r, err);
    if (rc) {
        munmap(r->ptr, r->bytes);
        free(r);
    } else {
        *out = r;
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

/* ---- CUDA regions ------------------------------------------------------------------------------
 */

int moedc_region_register_cuda(moedc_session *s, void *dev_ptr, size_t bytes, moedc_region **out,
                               moedc_error *err)
{
    *out = NULL;
    moedc_cuda_region where;
    int rc = moedc_cuda_describe(dev_ptr, bytes, &where, err);
    if (rc) return rc;
    moedc_region *r = calloc(1, sizeof *r);
    if (!r) return moedc_fail(err, MOEDC_ENOMEM, "out of memory for a region");
    r->kind = MOEDC_REGION_CUDA;
    r->ptr = dev_ptr;
    r->bytes = bytes;
    r->session = s;
    r->device = where.device;
    Moed__V1__RegionCommand cmd = MOED__V1__REGION_COMMAND__INIT;
    Moed__V1__RegisterCudaRegion g = MOED__V1__REGISTER_CUDA_REGION__INIT;
    Moed__V1__RegionEvent *ev = NULL;
    g.ipc_handle.data = where.handle;
    g.ipc_handle.len = sizeof where.handle;
    g.device_uuid = where.uuid;
    g.device = (uint32_t)where.device;
    g.bytes = bytes;
    g.offset = where.offset;
    cmd.command_case = MOED__V1__REGION_COMMAND__COMMAND_REGISTER_CUDA;
    cmd.register_cuda = &g;
    pthread_mutex_lock(&s->mu);
    rc = command(s, &cmd, &ev, err);
    if (!rc && !ev->region)
        rc =
            moedc_fail(err, MOEDC_EFORMAT, "the server's answer to register_cuda lacks the region");
    if (!rc) {
        r->id = ev->region->id;
        rc = keep(s, r, err);
    }
    if (ev) moed__v1__region_event__free_unpacked(ev, NULL);
    pthread_mutex_unlock(&s->mu);
    if (rc) {
        free(r);
        return rc;
    }
    *out = r;
    return 0;
}
