/*
 * moed_st — safetensors files, memory-mapped and validated, and the checkpoint folders that hold
 * them.
 *
 * A safetensors file is an 8-byte little-endian header length N, N bytes of JSON
 * ({"name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {..}})
 * and the tensors' bytes. A file is accepted only if the reference implementation (the
 * `safetensors` package) would accept it: known dtype strings, data_offsets that match shape times
 * element size, and a data region covered exactly, with no overlap, no hole and nothing after the
 * last tensor.
 *
 * Only a regular file is opened (moed_file: a FIFO, directory or device in its place fails at once,
 * naming it), and its header is read with pread, so validating a file never touches a mapping.
 * The file is then mapped read-only (MAP_PRIVATE) and never read whole: a tensor's data pointer
 * points into the mapping, valid until the file (or the folder) is closed — and only while the
 * file keeps its size: a mapping of a file truncated under it faults (SIGBUS), and one rewritten in
 * place shows the new bytes. So a caller that computes from the weights for as long as it runs
 * copies them (moed_st_read, which fails cleanly on a file that shrank) and closes the folder;
 * moed_st_dir_check tells whether a file changed while it was being read.
 *
 * A folder is model.safetensors.index.json and the shards its weight_map names, else
 * model.safetensors, else every *.safetensors in it. With an index, a shard is opened only when one
 * of its tensors is first looked up, so a daemon that holds a few layers maps only their shards.
 */
#ifndef MOED_SAFETENSORS_H
#define MOED_SAFETENSORS_H

#include "moed_err.h"

#include <stddef.h>
#include <stdint.h>
#include <sys/stat.h>

#define MOED_ST_MAX_DIMS 8

typedef struct moed_st_tensor {
    const char *name;
    const char *dtype; /* as the header spells it: "BF16", "F8_E4M3", ... */
    int mdtype;        /* the moed_dtype for F32, F16, BF16 and F8_E4M3; MOED_DTYPE_NONE else */
    int ndim;
    uint64_t shape[MOED_ST_MAX_DIMS];
    const void *data; /* in the mapping (see above for how long it holds) */
    uint64_t nbytes;
    uint64_t offset;  /* data's byte offset in the file */
    const char *file; /* the file's name (no folder), for messages */
} moed_st_tensor;

typedef struct moed_st_file {
    char *path;
    const char *name; /* the last component of path */
    int fd;           /* while path is set: moed_st_read reads through it (-1: none) */
    struct stat st;   /* as it was when opened */
    void *map;
    size_t size;
    moed_st_tensor *tensors; /* sorted by name */
    int n_tensors;
    char *names; /* the tensors' names */
} moed_st_file;

/* Maps and validates one file. Errors: MOED_ENOTFOUND, MOED_EIO, MOED_EFORMAT, MOED_ENOMEM. */
int moed_st_file_open(const char *path, moed_st_file *f, moed_error *err);
const moed_st_tensor *moed_st_file_find(const moed_st_file *f, const char *name);
void moed_st_file_close(moed_st_file *f);

/* The header check on its own, for the fuzzer: parses hlen bytes of header JSON (hdr, which need
 * not be NUL-terminated) of a file of f->size bytes named f->path, filling f->tensors with names,
 * dtypes, shapes, offsets and sizes (data pointers NULL), under the rules above. f must otherwise
 * be zeroed, with fd -1 (no file); moed_st_file_close frees what it filled, also after a
 * failure. */
int moed_st_parse_header(moed_st_file *f, const char *hdr, uint64_t hlen, moed_error *err);

typedef struct moed_st_dir moed_st_dir;

/* Opens a checkpoint folder as described above (with an index, only the index is read now). */
int moed_st_dir_open(const char *dir, moed_st_dir **out, moed_error *err);

/* Looks a tensor up: 0 with *t set, or 0 with *t NULL if the folder has no such tensor, or a
 * negative code if the shard that holds it fails to open or lacks the tensor its index promised. */
int moed_st_find(moed_st_dir *d, const char *name, const moed_st_tensor **t, moed_error *err);

/* How the folder is laid out ("model.safetensors.index.json", "model.safetensors" or "3 files"),
 * and how many of its files are mapped now. */
const char *moed_st_dir_layout(const moed_st_dir *d);
int moed_st_dir_mapped(const moed_st_dir *d);

/* Copies tensor t (found in d) into dst (t->nbytes) with pread, not through the mapping: a file
 * that shrank gives MOED_EIO naming it instead of a fault. */
int moed_st_read(const moed_st_dir *d, const moed_st_tensor *t, void *dst, moed_error *err);
/* The same for n bytes from byte `at` of t's data (within it). */
int moed_st_read_part(const moed_st_dir *d, const moed_st_tensor *t, uint64_t at, uint64_t n,
                      void *dst, moed_error *err);

/* MOED_EIO naming the first file opened from d whose size or modification time is no longer what
 * it was when opened (it was written while moed read it), else 0. */
int moed_st_dir_check(const moed_st_dir *d, moed_error *err);

void moed_st_dir_close(moed_st_dir *d);

/* A shape as "[4, 128]" into buf. */
const char *moed_st_shape_str(const moed_st_tensor *t, char *buf, size_t n);

struct cJSON;
/* Reads and parses a small JSON file (config.json, the index) whose top level must be an object.
 * A key an object holds twice has its last value, as Python's json reads it.
 * Errors: MOED_ENOTFOUND (no such file), MOED_EIO (unreadable, or not a regular file: a FIFO,
 * directory or device is refused without blocking), MOED_EFORMAT (not JSON, or over 64 MiB). */
int moed_json_load(const char *path, struct cJSON **root, moed_error *err);

#endif
