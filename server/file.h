/*
 * moed_file — opening the files moed reads at start (the config file, a checkpoint's config.json,
 * index and .safetensors files, the metrics token) so that anything but a regular file is refused
 * at once with a message naming it: a FIFO would block the open until some writer came, a
 * directory or /dev/zero would be read forever. Paths are opened with O_NONBLOCK (which never
 * blocks an open), checked with fstat, and only then read.
 */
#ifndef MOED_FILE_H
#define MOED_FILE_H

#include "moed_err.h"

#include <stddef.h>
#include <sys/stat.h>

/* Opens path read-only (O_CLOEXEC) and checks that it is a regular file; returns the descriptor
 * with *st filled (st may be NULL), or MOED_ENOTFOUND (no such file) or MOED_EIO (cannot open it,
 * or it is a directory, FIFO, device or socket: the message says which) with err naming `what`
 * (e.g. "--config") and the path. Reads from the descriptor block as usual. */
int moed_file_open(const char *path, const char *what, struct stat *st, moed_error *err);

/* Reads a whole regular file of at most max bytes into a malloc'd buffer with a NUL after its
 * *len bytes. Errors: those of moed_file_open, MOED_ETOOBIG (over max, saying so), MOED_EIO (a
 * read failed, or the file grew while it was read), MOED_ENOMEM. */
int moed_file_read(const char *path, const char *what, size_t max, char **out, size_t *len,
                   moed_error *err);

#endif
