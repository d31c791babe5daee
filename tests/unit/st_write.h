/*
 * st_write.h — what the weight-loading tests use to write small safetensors files, config.json and
 * index files into a temporary folder. The writer is independent of server/safetensors.c (it
 * builds the header with printf) so the reader is checked against the format, not against itself,
 * and it can write broken files on purpose.
 */
#ifndef MOED_ST_WRITE_H
#define MOED_ST_WRITE_H

#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct stw_tensor {
    const char *name;
    const char *dtype; /* "BF16", "F32", "F8_E4M3", ... */
    int ndim;
    uint64_t shape[4];
    const void *data;
    size_t nbytes;
} stw_tensor;

/* A file of exactly these bytes: header length hlen (which may lie), header, then data. */
static inline int stw_raw(const char *path, uint64_t hlen, const char *header, const void *data,
                          size_t nbytes)
{
    FILE *fp = fopen(path, "wb");
    if (!fp) return -1;
    unsigned char len[8];
    for (int i = 0; i < 8; i++) len[i] = (unsigned char)(hlen >> (8 * i));
    size_t hn = strlen(header);
    int ok = fwrite(len, 1, 8, fp) == 8 && fwrite(header, 1, hn, fp) == hn &&
             (!nbytes || fwrite(data, 1, nbytes, fp) == nbytes);
    return fclose(fp) || !ok ? -1 : 0;
}

/* A valid file as the safetensors package writes it: tensors back to back in the order given,
 * the header padded with spaces to a multiple of 8 bytes. */
static inline int stw_file(const char *path, const stw_tensor *t, int n)
{
    size_t cap = 256 + (size_t)n * 256, at = 0, total = 0;
    char *h = malloc(cap);
    if (!h) return -1;
    at += (size_t)snprintf(h + at, cap - at, "{\"__metadata__\":{\"format\":\"pt\"}");
    for (int i = 0; i < n; i++) {
        at += (size_t)snprintf(h + at, cap - at, ",\"%s\":{\"dtype\":\"%s\",\"shape\":[", t[i].name,
                               t[i].dtype);
        for (int k = 0; k < t[i].ndim; k++)
            at += (size_t)snprintf(h + at, cap - at, "%s%llu", k ? "," : "",
                                   (unsigned long long)t[i].shape[k]);
        at += (size_t)snprintf(h + at, cap - at, "],\"data_offsets\":[%zu,%zu]}", total,
                               total + t[i].nbytes);
        total += t[i].nbytes;
    }
    at += (size_t)snprintf(h + at, cap - at, "}");
    while (at % 8) h[at++] = ' ';
    h[at] = 0;
    unsigned char *data = malloc(total + 1);
    int rc = -1;
    if (data) {
        size_t off = 0;
        for (int i = 0; i < n; i++) {
            if (t[i].nbytes) memcpy(data + off, t[i].data, t[i].nbytes);
            off += t[i].nbytes;
        }
        rc = stw_raw(path, at, h, data, total);
    }
    free(data);
    free(h);
    return rc;
}

static inline int stw_text(const char *path, const char *text)
{
    FILE *fp = fopen(path, "w");
    if (!fp) return -1;
    int ok = fputs(text, fp) >= 0;
    return fclose(fp) || !ok ? -1 : 0;
}

/* dir/name into buf. */
static inline const char *stw_path(char *buf, size_t n, const char *dir, const char *name)
{
    snprintf(buf, n, "%s/%s", dir, name);
    return buf;
}

/* A fresh empty folder under $TMPDIR (or /tmp), into buf. */
static inline char *stw_tmpdir(char *buf, size_t n)
{
    const char *tmp = getenv("TMPDIR");
    snprintf(buf, n, "%s/moed-test-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    return mkdtemp(buf);
}

/* Removes the folder's files, then the folder (the tests write no subfolders). */
static inline void stw_rmdir(const char *dir)
{
    DIR *dp = opendir(dir);
    if (!dp) return;
    const struct dirent *de;
    char path[4096];
    while ((de = readdir(dp)))
        if (strcmp(de->d_name, ".") && strcmp(de->d_name, ".."))
            unlink(stw_path(path, sizeof path, dir, de->d_name));
    closedir(dp);
    rmdir(dir);
}

#endif
