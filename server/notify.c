/*
 * moed_notify — the sd_notify protocol in a few lines, instead of linking libsystemd.
 *
 * Why not libsystemd: the protocol is one datagram to the AF_UNIX socket named by $NOTIFY_SOCKET
 * (a path, or an abstract name when it starts with '@'), and a dependency on libsystemd would
 * follow the binary into containers and onto the GPU machine, where it is of no use. Each call
 * opens, sends and closes: messages are a handful per lifetime, so there is nothing to keep.
 */
#include "notify.h"

#include "log.h"
#include "moed_err.h"

#include <errno.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

int moed_notify(const char *fmt, ...)
{
    const char *path = getenv("NOTIFY_SOCKET");
    if (!path || !*path) return 0;
    struct sockaddr_un sa = { .sun_family = AF_UNIX };
    size_t n = strlen(path);
    if ((path[0] != '/' && path[0] != '@') || n >= sizeof sa.sun_path) {
        moed_log_warn("NOTIFY_SOCKET is not a socket path or abstract name: not notifying",
                      "notify_socket=\"%s\"", path);
        return MOED_EIO;
    }
    memcpy(sa.sun_path, path, n);
    if (path[0] == '@') sa.sun_path[0] = 0; /* abstract namespace */
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    int len = vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (len < 0) return MOED_EIO;
    if ((size_t)len >= sizeof msg) len = sizeof msg - 1; /* a long STATUS is cut, not dropped */
    int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    ssize_t sent = -1;
    if (fd >= 0) {
        sent = sendto(fd, msg, (size_t)len, MSG_NOSIGNAL, (struct sockaddr *)&sa,
                      (socklen_t)(offsetof(struct sockaddr_un, sun_path) + n));
        int e = errno;
        close(fd);
        errno = e;
    }
    if (sent == len) return 1;
    moed_log_warn("cannot notify the service manager", "notify_socket=\"%s\" error=\"%s\"", path,
                  strerror(errno));
    return MOED_EIO;
}
