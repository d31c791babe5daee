/*
 * moed_unix — the unix-socket listener (unix_listener.h): the claim, the accept thread with its
 * connections waiting for their first bytes, and the table of uids by descriptor.
 */
#include "unix_listener.h"

#include "log.h"
#include "moed_time.h"

#include <errno.h>
#include <grpc/grpc_posix.h>
#include <grpc/grpc_security.h>
#include <poll.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

typedef struct pending {
    int fd;
    uint32_t uid;
    uint64_t since_ms;
} pending;

struct moed_unix {
    struct sockaddr_un sa;
    socklen_t sa_len;
    bool is_path; /* unix:PATH (a file to remove at the end), not unix-abstract: */
    dev_t dev;    /* the socket file this listener bound */
    ino_t ino;
    int fd, wake; /* the listening socket; an eventfd that ends the thread */
    pthread_t thread;
    bool thread_started, stopped;
    pthread_mutex_t lock; /* server, go, uids */
    pthread_cond_t go_cond;
    grpc_server *server;
    bool go;
    /* by descriptor: the connection accepted on it (uid -1: none), numbered in accept order */
    struct accepted {
        int64_t uid;
        uint64_t seq;
    } * uids;
    size_t n_uids;
    uint64_t accepts;
    pending *waiting;   /* [MOED_UNIX_PENDING]: accepted, no byte received yet (the thread's) */
    struct pollfd *fds; /* [2 + MOED_UNIX_PENDING] */
};

bool moed_unix_is_address(const char *listen)
{
    return !strncmp(listen, "unix:", 5) || !strncmp(listen, "unix-abstract:", 14);
}

/* The socket address of unix:PATH or unix-abstract:NAME (an abstract name after a NUL byte). */
static int address_of(const char *listen, struct sockaddr_un *sa, socklen_t *len, bool *is_path,
                      moed_error *err)
{
    memset(sa, 0, sizeof *sa);
    sa->sun_family = AF_UNIX;
    *is_path = !strncmp(listen, "unix:", 5);
    const char *name = listen + (*is_path ? 5 : 14);
    size_t n = strlen(name), at = *is_path ? 0 : 1;
    if (!n || at + n >= sizeof sa->sun_path)
        return moed_fail(err, MOED_EINVAL, "--listen %s: a socket path of 1 to %zu bytes is needed",
                         listen, sizeof sa->sun_path - 1 - at);
    memcpy(sa->sun_path + at, name, n);
    *len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + at + n + (*is_path ? 1 : 0));
    return 0;
}

int moed_unix_claim(const char *address, moed_error *err)
{
    struct sockaddr_un sa;
    socklen_t len;
    bool is_path;
    int rc = address_of(address, &sa, &len, &is_path, err);
    if (rc) return rc;
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s < 0) return moed_fail(err, MOED_EIO, "--listen %s: socket: %s", address, strerror(errno));
    int answered = connect(s, (struct sockaddr *)&sa, len) == 0, e = errno;
    close(s);
    if (answered)
        return moed_fail(err, MOED_EIO,
                         "--listen %s: something answers there already (another moed?); stop it "
                         "or choose another path: moed does not take a live socket over",
                         address);
    struct stat st;
    if (!is_path || e == ENOENT) return 0;
    if (lstat(sa.sun_path, &st))
        return errno == ENOENT
                   ? 0
                   : moed_fail(err, MOED_EIO, "--listen %s: cannot look at the path: %s", address,
                               strerror(errno));
    if (!S_ISSOCK(st.st_mode))
        return moed_fail(err, MOED_EIO,
                         "--listen %s: the path is not a socket: moed will not remove it; choose "
                         "another path",
                         address);
    if (e != ECONNREFUSED)
        return moed_fail(err, MOED_EIO, "--listen %s: cannot tell whether a server is there: %s",
                         address, strerror(e));
    /* A socket nobody answers on: its server is gone. */
    if (unlink(sa.sun_path) && errno != ENOENT)
        return moed_fail(err, MOED_EIO, "--listen %s: cannot remove the stale socket: %s", address,
                         strerror(errno));
    moed_log_info("removed a stale socket", "path=\"%s\"", sa.sun_path);
    return 0;
}

/* ---- the uid table ------------------------------------------------------------------------- */

static int remember(moed_unix *u, int fd, uint32_t uid)
{
    pthread_mutex_lock(&u->lock);
    if ((size_t)fd >= u->n_uids) {
        size_t n = u->n_uids ? u->n_uids : 256;
        while (n <= (size_t)fd) n *= 2;
        struct accepted *a = realloc(u->uids, n * sizeof *a);
        if (!a) {
            pthread_mutex_unlock(&u->lock);
            return MOED_ENOMEM;
        }
        for (size_t i = u->n_uids; i < n; i++) a[i].uid = -1;
        u->uids = a;
        u->n_uids = n;
    }
    u->uids[fd] = (struct accepted){ .uid = uid, .seq = ++u->accepts };
    pthread_mutex_unlock(&u->lock);
    return 0;
}

bool moed_unix_uid(moed_unix *u, const char *peer, uint32_t *uid, uint64_t *seq)
{
    if (!u || strncmp(peer, "fd:", 3)) return false;
    char *end;
    long fd = strtol(peer + 3, &end, 10);
    if (*end || fd < 0) return false;
    pthread_mutex_lock(&u->lock);
    struct accepted a = (size_t)fd < u->n_uids ? u->uids[fd] : (struct accepted){ .uid = -1 };
    pthread_mutex_unlock(&u->lock);
    if (a.uid < 0) return false;
    if (uid) *uid = (uint32_t)a.uid;
    if (seq) *seq = a.seq;
    return true;
}

/* ---- the accept thread ----------------------------------------------------------------------- */

static uint64_t now_ms(void)
{
    return moed_now_ns() / 1000000u;
}

/* A connection that has sent its first bytes goes to gRPC, which owns its descriptor from now. */
static void hand_over(moed_unix *u, const pending *p)
{
    if (remember(u, p->fd, p->uid)) {
        moed_log_error("out of memory", "what=\"the uid of a unix-socket connection\"");
        close(p->fd);
        return;
    }
    grpc_server_credentials *creds = grpc_insecure_server_credentials_create();
    grpc_server_add_channel_from_fd(u->server, p->fd, creds);
    grpc_server_credentials_release(creds);
}

/* Takes the connections waiting in the backlog, each with the uid that opened it. */
static void accept_new(moed_unix *u, pending *waiting, int *n)
{
    for (;;) {
        int fd = accept4(u->fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) return; /* EAGAIN: none left; anything else: poll says so again */
        struct ucred cred;
        socklen_t len = sizeof cred;
        if (*n == MOED_UNIX_PENDING || getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len)) {
            moed_log_debug("unix connection closed", "why=\"%s\"",
                           *n == MOED_UNIX_PENDING ? "too many waiting for their first bytes"
                                                   : "no peer credentials");
            close(fd);
            continue;
        }
        waiting[(*n)++] = (pending){ .fd = fd, .uid = cred.uid, .since_ms = now_ms() };
    }
}

static void *accept_main(void *arg)
{
    moed_unix *u = arg;
    pthread_mutex_lock(&u->lock);
    while (!u->go) pthread_cond_wait(&u->go_cond, &u->lock);
    const bool serve = u->server != NULL;
    pthread_mutex_unlock(&u->lock);
    pending *waiting = u->waiting;
    struct pollfd *fds = u->fds;
    int n = 0;
    while (serve) {
        uint64_t now = now_ms();
        int timeout = -1;
        fds[0] = (struct pollfd){ .fd = u->wake, .events = POLLIN };
        fds[1] = (struct pollfd){ .fd = u->fd, .events = POLLIN };
        for (int i = 0; i < n; i++) {
            fds[2 + i] = (struct pollfd){ .fd = waiting[i].fd, .events = POLLIN };
            uint64_t end = waiting[i].since_ms + MOED_HANDSHAKE_MS;
            int left = end > now ? (int)(end - now) : 0;
            if (timeout < 0 || left < timeout) timeout = left;
        }
        if (poll(fds, (nfds_t)(2 + n), timeout) < 0 && errno != EINTR) break;
        if (fds[0].revents) break;
        now = now_ms();
        int kept = 0;
        for (int i = 0; i < n; i++) {
            short ev = fds[2 + i].revents;
            if (ev & POLLIN)
                hand_over(u, &waiting[i]);
            else if (ev || now >= waiting[i].since_ms + MOED_HANDSHAKE_MS)
                close(waiting[i].fd); /* gone, or silent past the deadline */
            else
                waiting[kept++] = waiting[i];
        }
        n = kept;
        if (fds[1].revents) accept_new(u, waiting, &n);
    }
    for (int i = 0; i < n; i++) close(waiting[i].fd);
    return NULL;
}

/* ---- life cycle ------------------------------------------------------------------------------ */

int moed_unix_open(const char *address, moed_unix **out, moed_error *err)
{
    *out = NULL;
    moed_unix *u = calloc(1, sizeof *u);
    if (!u) return moed_fail(err, MOED_ENOMEM, "no memory for the unix-socket listener");
    u->fd = u->wake = -1;
    pthread_mutex_init(&u->lock, NULL);
    pthread_cond_init(&u->go_cond, NULL);
    u->waiting = calloc(MOED_UNIX_PENDING, sizeof *u->waiting);
    u->fds = calloc(2 + MOED_UNIX_PENDING, sizeof *u->fds);
    int rc = !u->waiting || !u->fds
                 ? moed_fail(err, MOED_ENOMEM, "no memory for the unix-socket listener")
                 : address_of(address, &u->sa, &u->sa_len, &u->is_path, err);
    if (!rc) rc = moed_unix_claim(address, err);
    struct stat st;
    if (!rc && ((u->fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0)) < 0 ||
                bind(u->fd, (struct sockaddr *)&u->sa, u->sa_len) || listen(u->fd, 4096) ||
                (u->is_path && lstat(u->sa.sun_path, &st))))
        rc = moed_fail(err, MOED_EIO, "cannot listen on %s: %s; choose another --listen", address,
                       strerror(errno));
    if (!rc && u->is_path) {
        u->dev = st.st_dev;
        u->ino = st.st_ino;
    }
    if (!rc && (u->wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) < 0)
        rc = moed_fail(err, MOED_EIO, "eventfd: %s", strerror(errno));
    if (!rc && pthread_create(&u->thread, NULL, accept_main, u))
        rc = moed_fail(err, MOED_EINTERNAL, "could not start the unix-socket accept thread");
    u->thread_started = !rc;
    if (rc) {
        moed_unix_free(u);
        return rc;
    }
    *out = u;
    return 0;
}

void moed_unix_serve(moed_unix *u, grpc_server *server)
{
    pthread_mutex_lock(&u->lock);
    u->server = server;
    u->go = true;
    pthread_cond_signal(&u->go_cond);
    pthread_mutex_unlock(&u->lock);
}

void moed_unix_stop(moed_unix *u)
{
    if (!u || u->stopped) return;
    u->stopped = true;
    if (u->thread_started) {
        uint64_t one = 1;
        ssize_t w = write(u->wake, &one, sizeof one); /* fails only on a full counter: awake too */
        (void)w;
        pthread_mutex_lock(&u->lock);
        u->go = true; /* a thread never told to serve ends at once */
        pthread_cond_signal(&u->go_cond);
        pthread_mutex_unlock(&u->lock);
        pthread_join(u->thread, NULL);
    }
    if (u->fd >= 0) close(u->fd);
    if (u->wake >= 0) close(u->wake);
    u->fd = u->wake = -1;
    /* Only our own socket: a later daemon may have claimed the path since. */
    struct stat st;
    if (u->is_path && u->ino && !lstat(u->sa.sun_path, &st) && st.st_dev == u->dev &&
        st.st_ino == u->ino)
        unlink(u->sa.sun_path);
}

void moed_unix_free(moed_unix *u)
{
    if (!u) return;
    moed_unix_stop(u);
    pthread_mutex_destroy(&u->lock);
    pthread_cond_destroy(&u->go_cond);
    free(u->uids);
    free(u->waiting);
    free(u->fds);
    free(u);
}
