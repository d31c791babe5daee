/*
 * moed_file — non-blocking opens of regular files only, and bounded whole-file reads (file.h).
 */
#include "file.h"

#include <errno.h>
#include <stdint.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char *kind(mode_t m)
{
    return S_ISDIR(m)    ? "a directory"
           : S_ISFIFO(m) ? "a FIFO (named pipe)"
           : S_ISCHR(m)  ? "a character device"
           : S_ISBLK(m)  ? "a block device"
           : S_ISSOCK(m) ? "a socket"
                         : "not a regular file";
}

int moed_file_open(const char *path, const char *what, struct stat *st, moed_error *err)
{
    struct stat own;
    if (!st) st = &own;
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
    if (fd < 0)
        return moed_fail(err, errno == ENOENT ? MOED_ENOTFOUND : MOED_EIO, "%s: cannot open %s: %s",
                         what, path, strerror(errno));
    if (fstat(fd, st)) {
        int e = errno;
        close(fd);
        return moed_fail(err, MOED_EIO, "%s: cannot stat %s: %s", what, path, strerror(e));
    }
    if (!S_ISREG(st->st_mode)) {
        close(fd);
        return moed_fail(err, MOED_EIO, "%s: %s is %s, not a regular file", what, path,
                         kind(st->st_mode));
    }
    /* Regular files ignore O_NONBLOCK, but a descriptor handed on should not surprise anyone. */
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    return fd;
}

int moed_file_read(const char *path, const char *what, size_t max, char **out, size_t *len,
                   moed_error *err)
{
    *out = NULL;
    *len = 0;
    struct stat st;
    int fd = moed_file_open(path, what, &st, err), rc = 0;
    if (fd < 0) return fd;
    char *buf = NULL;
    size_t n = 0;
    if ((uint64_t)st.st_size > max) {
        rc = moed_fail(err, MOED_ETOOBIG, "%s: %s has %lld bytes, over the %zu allowed", what, path,
                       (long long)st.st_size, max);
        goto out;
    }
    /* One byte past the size fstat gave, so a file that grew since is noticed. */
    size_t want = (size_t)st.st_size + 1;
    if (!(buf = malloc(want + 1))) {
        rc = moed_fail(err, MOED_ENOMEM, "%s: no memory to read %s", what, path);
        goto out;
    }
    for (;;) {
        ssize_t r = read(fd, buf + n, want - n);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) {
            rc = moed_fail(err, MOED_EIO, "%s: cannot read %s: %s", what, path, strerror(errno));
            goto out;
        }
        if (r == 0) break;
        n += (size_t)r;
        if (n == want) {
            rc = moed_fail(err, MOED_EIO, "%s: %s grew while it was read; try again", what, path);
            goto out;
        }
    }
    buf[n] = 0;
    *out = buf;
    *len = n;
    buf = NULL;
out:
    free(buf);
    close(fd);
    return rc;
}
