/*
 * moed_st — the safetensors reader (see safetensors.h for the format and the folder layouts).
 *
 * Checkpoints come from outside, so every header field is checked before anything points into the
 * mapping: a pointer past the end would fault later in a kernel, far from the file that caused it.
 * The rules are those of the reference implementation, so a file moed accepts is one the Python
 * `safetensors` package loads and vice versa. Tensor names are kept sorted for binary search: a
 * DeepSeek-V3 checkpoint has about 90,000 of them and a load looks most of a layer's up.
 */
#include "safetensors.h"

#include "moed_dtype.h"

#include "file.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* The reference implementation's limit: a bigger header is not a safetensors file. */
#define ST_MAX_HEADER  100000000ull
#define JSON_MAX_BYTES (64u << 20)
/* JSON numbers are doubles: offsets and sizes above 2^53 cannot be represented exactly. */
#define JSON_MAX_INT 9007199254740992.0

static const struct {
    const char *name;
    int bits;
    int mdtype;
} st_dtypes[] = {
    { "BOOL", 8, MOED_DTYPE_NONE },    { "U8", 8, MOED_DTYPE_NONE },
    { "I8", 8, MOED_DTYPE_NONE },      { "F8_E5M2", 8, MOED_DTYPE_NONE },
    { "F8_E4M3", 8, MOED_FP8 },        { "F8_E8M0", 8, MOED_DTYPE_NONE },
    { "I16", 16, MOED_DTYPE_NONE },    { "U16", 16, MOED_DTYPE_NONE },
    { "F16", 16, MOED_F16 },           { "BF16", 16, MOED_BF16 },
    { "I32", 32, MOED_DTYPE_NONE },    { "U32", 32, MOED_DTYPE_NONE },
    { "F32", 32, MOED_F32 },           { "C64", 64, MOED_DTYPE_NONE },
    { "F64", 64, MOED_DTYPE_NONE },    { "I64", 64, MOED_DTYPE_NONE },
    { "U64", 64, MOED_DTYPE_NONE },    { "F4", 4, MOED_DTYPE_NONE },
    { "F6_E2M3", 6, MOED_DTYPE_NONE }, { "F6_E3M2", 6, MOED_DTYPE_NONE },
};

static int st_dtype_find(const char *name)
{
    for (size_t i = 0; i < sizeof st_dtypes / sizeof st_dtypes[0]; i++)
        if (!strcmp(name, st_dtypes[i].name)) return (int)i;
    return -1;
}

static char *path_join(const char *dir, const char *name)
{
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = malloc(n);
    if (p) snprintf(p, n, "%s/%s", dir, name);
    return p;
}

static int open_fail(moed_error *err, const char *path)
{
    int code = errno == ENOENT ? MOED_ENOTFOUND : MOED_EIO;
    return moed_fail(err, code, "cannot open %s: %s", path, strerror(errno));
}

typedef struct json_member {
    cJSON *item;
    size_t at; /* its place in the object */
} json_member;

static int by_key_then_place(const void *a, const void *b)
{
    const json_member *x = a, *y = b;
    int c = strcmp(x->item->string, y->item->string);
    return c ? c : (x->at > y->at) - (x->at < y->at);
}

/* Drops every member of an object under node (node included) that a later one of the same key
 * repeats, so that a lookup (cJSON's finds the first) sees the value Python's json, and so
 * transformers, takes: the last. Sorted, not compared pairwise: an index's weight_map holds tens of
 * thousands of keys. Recursion is bounded by cJSON's nesting limit. */
static int json_last_wins(cJSON *node)
{
    size_t n = 0;
    for (cJSON *c = node->child; c; c = c->next, n++) {
        int rc = json_last_wins(c);
        if (rc) return rc;
    }
    if (!cJSON_IsObject(node) || n < 2) return 0;
    json_member *m = malloc(n * sizeof *m);
    if (!m) return MOED_ENOMEM;
    n = 0;
    for (cJSON *c = node->child; c; c = c->next, n++) m[n] = (json_member){ c, n };
    qsort(m, n, sizeof *m, by_key_then_place);
    for (size_t i = 0; i + 1 < n; i++)
        if (!strcmp(m[i].item->string, m[i + 1].item->string))
            cJSON_Delete(cJSON_DetachItemViaPointer(node, m[i].item));
    free(m);
    return 0;
}

int moed_json_load(const char *path, cJSON **root, moed_error *err)
{
    *root = NULL;
    char *buf;
    size_t n;
    int rc = moed_file_read(path, "checkpoint", JSON_MAX_BYTES, &buf, &n, err);
    if (rc == MOED_ETOOBIG)
        return moed_fail(err, MOED_EFORMAT, "%s is over the %u MiB of a config or index", path,
                         JSON_MAX_BYTES >> 20);
    if (rc) return rc;
    const char *end = NULL;
    *root = cJSON_ParseWithLengthOpts(buf, n, &end, 0);
    if (!*root) {
        rc = moed_fail(err, MOED_EFORMAT, "%s is not valid JSON (error at byte %td)", path,
                       end - buf);
    } else if (!cJSON_IsObject(*root)) {
        rc = moed_fail(err, MOED_EFORMAT, "%s: the top level is not a JSON object", path);
    } else if (json_last_wins(*root)) {
        rc = moed_fail(err, MOED_ENOMEM, "no memory to read %s", path);
    }
    if (rc && *root) {
        cJSON_Delete(*root);
        *root = NULL;
    }
    free(buf);
    return rc;
}

/* ---- one file ---- */

static int json_uint(const cJSON *v, uint64_t *out)
{
    if (!cJSON_IsNumber(v)) return -1;
    double d = v->valuedouble;
    if (!(d >= 0 && d <= JSON_MAX_INT) || d != (double)(uint64_t)d) return -1;
    *out = (uint64_t)d;
    return 0;
}

const char *moed_st_shape_str(const moed_st_tensor *t, char *buf, size_t n)
{
    size_t at = (size_t)snprintf(buf, n, "[");
    for (int i = 0; i < t->ndim && at < n; i++)
        at += (size_t)snprintf(buf + at, n - at, "%s%llu", i ? ", " : "",
                               (unsigned long long)t->shape[i]);
    if (at < n) snprintf(buf + at, n - at, "]");
    return buf;
}

/* Fills t from one header entry; the data region starts at byte data_start and has data_size
 * bytes. */
static int parse_entry(const moed_st_file *f, const cJSON *e, uint64_t data_start,
                       uint64_t data_size, moed_st_tensor *t, moed_error *err)
{
    const char *fn = f->path, *name = t->name;
    if (!cJSON_IsObject(e))
        return moed_fail(err, MOED_EFORMAT, "%s: header entry %s is not an object", fn, name);
    const cJSON *dt = cJSON_GetObjectItemCaseSensitive(e, "dtype");
    const cJSON *sh = cJSON_GetObjectItemCaseSensitive(e, "shape");
    const cJSON *off = cJSON_GetObjectItemCaseSensitive(e, "data_offsets");
    if (!cJSON_IsString(dt) || !cJSON_IsArray(sh) || !cJSON_IsArray(off))
        return moed_fail(err, MOED_EFORMAT,
                         "%s: tensor %s needs a string dtype, an array shape and an array "
                         "data_offsets in the header",
                         fn, name);
    int k = st_dtype_find(dt->valuestring);
    if (k < 0)
        return moed_fail(err, MOED_EFORMAT,
                         "%s: tensor %s has dtype \"%s\", not a safetensors dtype", fn, name,
                         dt->valuestring);
    t->dtype = st_dtypes[k].name;
    t->mdtype = st_dtypes[k].mdtype;

    t->ndim = cJSON_GetArraySize(sh);
    if (t->ndim > MOED_ST_MAX_DIMS)
        return moed_fail(err, MOED_EFORMAT,
                         "%s: tensor %s has %d dimensions; moed reads at most %d", fn, name,
                         t->ndim, MOED_ST_MAX_DIMS);
    uint64_t elems = 1;
    int i = 0;
    const cJSON *v;
    cJSON_ArrayForEach(v, sh)
    {
        if (json_uint(v, &t->shape[i]))
            return moed_fail(err, MOED_EFORMAT,
                             "%s: tensor %s: shape entry %d is not a non-negative integer", fn,
                             name, i);
        if (t->shape[i] && elems > UINT64_MAX / 64 / t->shape[i])
            return moed_fail(err, MOED_EFORMAT, "%s: tensor %s: shape overflows", fn, name);
        elems *= t->shape[i++];
    }
    uint64_t range[2];
    if (cJSON_GetArraySize(off) != 2 || json_uint(off->child, &range[0]) ||
        json_uint(off->child->next, &range[1]))
        return moed_fail(err, MOED_EFORMAT,
                         "%s: tensor %s: data_offsets must be two non-negative integers", fn, name);
    if (range[0] > range[1] || range[1] > data_size)
        return moed_fail(err, MOED_EFORMAT,
                         "%s: tensor %s: data_offsets [%llu, %llu] are outside the %llu-byte data "
                         "region (truncated file?)",
                         fn, name, (unsigned long long)range[0], (unsigned long long)range[1],
                         (unsigned long long)data_size);
    uint64_t bits = elems * (uint64_t)st_dtypes[k].bits;
    t->nbytes = range[1] - range[0];
    if (bits % 8 || bits / 8 != t->nbytes) {
        char sbuf[160];
        return moed_fail(err, MOED_EFORMAT,
                         "%s: tensor %s: data_offsets [%llu, %llu] hold %llu bytes but shape %s of "
                         "%s needs %llu bits",
                         fn, name, (unsigned long long)range[0], (unsigned long long)range[1],
                         (unsigned long long)t->nbytes, moed_st_shape_str(t, sbuf, sizeof sbuf),
                         t->dtype, (unsigned long long)bits);
    }
    t->offset = data_start + range[0];
    t->file = f->name;
    return 0;
}

static int cmp_tensor_name(const void *a, const void *b)
{
    return strcmp(((const moed_st_tensor *)a)->name, ((const moed_st_tensor *)b)->name);
}

static int cmp_tensor_offset(const void *a, const void *b)
{
    const moed_st_tensor *x = *(const moed_st_tensor *const *)a;
    const moed_st_tensor *y = *(const moed_st_tensor *const *)b;
    if (x->offset != y->offset) return x->offset < y->offset ? -1 : 1;
    return x->nbytes < y->nbytes ? -1 : x->nbytes > y->nbytes;
}

/* The tensors must tile the data region exactly: no overlap, no hole, nothing after the last. */
static int check_tiling(const moed_st_file *f, uint64_t data_start, moed_error *err)
{
    int rc = 0;
    const moed_st_tensor **by = malloc(sizeof *by * (size_t)(f->n_tensors ? f->n_tensors : 1));
    if (!by) return moed_fail(err, MOED_ENOMEM, "no memory to index %s", f->path);
    for (int i = 0; i < f->n_tensors; i++) by[i] = &f->tensors[i];
    qsort(by, (size_t)f->n_tensors, sizeof *by, cmp_tensor_offset);
    uint64_t at = data_start;
    for (int i = 0; i < f->n_tensors && !rc; i++) {
        if (by[i]->offset != at)
            rc = moed_fail(err, MOED_EFORMAT,
                           "%s: tensor %s starts at data byte %llu but the previous tensor ends at "
                           "%llu (tensors overlap or leave a hole)",
                           f->path, by[i]->name, (unsigned long long)(by[i]->offset - data_start),
                           (unsigned long long)(at - data_start));
        at += by[i]->nbytes;
    }
    if (!rc && at != f->size)
        rc = moed_fail(err, MOED_EFORMAT,
                       "%s: the tensors end at byte %llu but the file has %zu bytes (extra data "
                       "after the last tensor)",
                       f->path, (unsigned long long)at, f->size);
    free(by);
    return rc;
}

int moed_st_parse_header(moed_st_file *f, const char *hdr, uint64_t hlen, moed_error *err)
{
    const char *end = NULL;
    int rc = 0;
    if (f->size < 8 || hlen > f->size - 8)
        return moed_fail(err, MOED_EFORMAT, "%s: a %llu-byte header does not fit the file", f->path,
                         (unsigned long long)hlen);
    cJSON *root = cJSON_ParseWithLengthOpts(hdr, hlen, &end, 0);
    if (!root)
        return moed_fail(err, MOED_EFORMAT,
                         "%s: the header is not valid JSON (error at header byte %td)", f->path,
                         end - hdr);
    if (!cJSON_IsObject(root)) {
        rc = moed_fail(err, MOED_EFORMAT, "%s: the header is not a JSON object", f->path);
        goto out;
    }
    for (; end < hdr + hlen; end++)
        if (*end != ' ' && *end != '\t' && *end != '\r' && *end != '\n') {
            rc = moed_fail(err, MOED_EFORMAT, "%s: bytes after the header's JSON object", f->path);
            goto out;
        }

    size_t name_bytes = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, root)
    {
        if (strcmp(e->string, "__metadata__")) {
            f->n_tensors++;
            name_bytes += strlen(e->string) + 1;
        }
    }
    f->tensors = calloc((size_t)f->n_tensors + 1, sizeof *f->tensors);
    f->names = malloc(name_bytes + 1);
    if (!f->tensors || !f->names) {
        rc = moed_fail(err, MOED_ENOMEM, "no memory for the header of %s", f->path);
        goto out;
    }
    uint64_t data_start = 8 + hlen;
    char *nb = f->names;
    int i = 0;
    cJSON_ArrayForEach(e, root)
    {
        if (!strcmp(e->string, "__metadata__")) continue;
        moed_st_tensor *t = &f->tensors[i++];
        t->name = strcpy(nb, e->string);
        nb += strlen(nb) + 1;
        rc = parse_entry(f, e, data_start, f->size - data_start, t, err);
        if (rc) goto out;
    }
    qsort(f->tensors, (size_t)f->n_tensors, sizeof *f->tensors, cmp_tensor_name);
    for (i = 1; i < f->n_tensors; i++)
        if (!strcmp(f->tensors[i].name, f->tensors[i - 1].name)) {
            rc = moed_fail(err, MOED_EFORMAT, "%s: tensor %s appears twice in the header", f->path,
                           f->tensors[i].name);
            goto out;
        }
    rc = check_tiling(f, data_start, err);
out:
    cJSON_Delete(root);
    return rc;
}

/* pread of exactly n bytes at off: MOED_EIO naming the file if it ends first or fails. */
static int read_at(const moed_st_file *f, void *dst, uint64_t n, uint64_t off, moed_error *err)
{
    for (uint64_t done = 0; done < n;) {
        size_t chunk = n - done > (1u << 30) ? 1u << 30 : (size_t)(n - done);
        ssize_t r = pread(f->fd, (char *)dst + done, chunk, (off_t)(off + done));
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0)
            return moed_fail(err, MOED_EIO, "cannot read %s at byte %llu: %s", f->path,
                             (unsigned long long)(off + done),
                             r < 0 ? strerror(errno) : "the file is shorter than when opened");
        done += (uint64_t)r;
    }
    return 0;
}

/* The header length and the header, read (not mapped), then parsed. */
static int read_header(moed_st_file *f, moed_error *err)
{
    uint8_t len[8];
    int rc = read_at(f, len, 8, 0, err);
    if (rc) return rc;
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = hlen << 8 | len[i];
    if (hlen > ST_MAX_HEADER || hlen > f->size - 8)
        return moed_fail(err, MOED_EFORMAT,
                         "%s: header length %llu runs past the end of the %zu-byte file "
                         "(truncated, or not a safetensors file)",
                         f->path, (unsigned long long)hlen, f->size);
    char *hdr = malloc(hlen ? hlen : 1);
    if (!hdr) return moed_fail(err, MOED_ENOMEM, "no memory for the header of %s", f->path);
    if (!(rc = read_at(f, hdr, hlen, 8, err))) rc = moed_st_parse_header(f, hdr, hlen, err);
    free(hdr);
    return rc;
}

int moed_st_file_open(const char *path, moed_st_file *f, moed_error *err)
{
    memset(f, 0, sizeof *f);
    int rc = 0;
    if (!(f->path = strdup(path))) return moed_fail(err, MOED_ENOMEM, "no memory to open %s", path);
    if ((f->fd = moed_file_open(path, "checkpoint", &f->st, err)) < 0) {
        rc = f->fd;
        /* the path alone names the file: drop moed_file's "checkpoint: " */
        if (!strncmp(err->msg, "checkpoint: ", 12))
            memmove(err->msg, err->msg + 12, strlen(err->msg + 12) + 1);
        goto err;
    }
    if (f->st.st_size < 8) {
        rc = moed_fail(err, MOED_EFORMAT,
                       "%s has %lld bytes, fewer than the 8 of a safetensors header length "
                       "(truncated?)",
                       path, (long long)f->st.st_size);
        goto err;
    }
    f->size = (size_t)f->st.st_size;
    const char *slash = strrchr(f->path, '/');
    f->name = slash ? slash + 1 : f->path;
    if ((rc = read_header(f, err))) goto err;
    f->map = mmap(NULL, f->size, PROT_READ, MAP_PRIVATE, f->fd, 0);
    if (f->map == MAP_FAILED) {
        f->map = NULL;
        rc = moed_fail(err, MOED_EIO, "cannot map %s (%zu bytes): %s", path, f->size,
                       strerror(errno));
        goto err;
    }
    for (int i = 0; i < f->n_tensors; i++)
        f->tensors[i].data = (const uint8_t *)f->map + f->tensors[i].offset;
    return 0;
err:
    moed_st_file_close(f);
    return rc;
}

const moed_st_tensor *moed_st_file_find(const moed_st_file *f, const char *name)
{
    moed_st_tensor key = { .name = name };
    return bsearch(&key, f->tensors, (size_t)f->n_tensors, sizeof key, cmp_tensor_name);
}

void moed_st_file_close(moed_st_file *f)
{
    if (f->map) munmap(f->map, f->size);
    if (f->path && f->fd >= 0) close(f->fd);
    free(f->tensors);
    free(f->names);
    free(f->path);
    memset(f, 0, sizeof *f);
}

/* ---- a folder ---- */

/* Where a name lives: with an index, t stays NULL until the first lookup opens the shard. */
typedef struct st_entry {
    const char *name;
    int file;
    const moed_st_tensor *t;
} st_entry;

struct moed_st_dir {
    char *dir;
    char layout[64];
    char **paths;        /* n_files */
    moed_st_file *files; /* files[i].map is NULL until opened */
    int n_files;
    st_entry *entries; /* sorted by name */
    int n_entries;
    cJSON *index; /* owns the entries' names in index mode */
};

static int cmp_entry(const void *a, const void *b)
{
    return strcmp(((const st_entry *)a)->name, ((const st_entry *)b)->name);
}

static int add_file(moed_st_dir *d, const char *name, moed_error *err)
{
    char **p = realloc(d->paths, sizeof *p * (size_t)(d->n_files + 1));
    if (!p) return moed_fail(err, MOED_ENOMEM, "no memory for the file list of %s", d->dir);
    d->paths = p;
    p[d->n_files] = path_join(d->dir, name);
    if (!p[d->n_files]) return moed_fail(err, MOED_ENOMEM, "no memory for the file list");
    d->n_files++;
    return 0;
}

static int sort_entries(moed_st_dir *d, moed_error *err)
{
    qsort(d->entries, (size_t)d->n_entries, sizeof *d->entries, cmp_entry);
    for (int i = 1; i < d->n_entries; i++) {
        const st_entry *a = &d->entries[i - 1], *b = &d->entries[i];
        if (!strcmp(a->name, b->name))
            return moed_fail(err, MOED_EFORMAT, "tensor %s is in both %s and %s: %s is ambiguous",
                             a->name, d->paths[a->file], d->paths[b->file], d->dir);
    }
    return 0;
}

/* The shard of `file` in the index's file list, adding it if new. Shards are listed in runs, so
 * the last one found is tried first. */
static int index_file(moed_st_dir *d, const char *file, int *last, moed_error *err)
{
    if (*last >= 0 && !strcmp(strrchr(d->paths[*last], '/') + 1, file)) return *last;
    for (int i = 0; i < d->n_files; i++)
        if (!strcmp(strrchr(d->paths[i], '/') + 1, file)) return *last = i;
    if (!*file || strchr(file, '/') || !strcmp(file, ".") || !strcmp(file, ".."))
        return moed_fail(err, MOED_EFORMAT,
                         "%s/model.safetensors.index.json names shard \"%s\": shards must be files "
                         "in the checkpoint folder",
                         d->dir, file);
    int rc = add_file(d, file, err);
    return rc ? rc : (*last = d->n_files - 1);
}

static int open_index(moed_st_dir *d, const char *path, moed_error *err)
{
    int rc = moed_json_load(path, &d->index, err);
    if (rc) return rc;
    const cJSON *map = cJSON_GetObjectItemCaseSensitive(d->index, "weight_map");
    if (!cJSON_IsObject(map))
        return moed_fail(err, MOED_EFORMAT, "%s has no \"weight_map\" object", path);
    d->entries = calloc((size_t)cJSON_GetArraySize(map) + 1, sizeof *d->entries);
    if (!d->entries) return moed_fail(err, MOED_ENOMEM, "no memory for %s", path);
    int last = -1;
    const cJSON *e;
    cJSON_ArrayForEach(e, map)
    {
        if (!cJSON_IsString(e))
            return moed_fail(err, MOED_EFORMAT, "%s: weight_map[\"%s\"] is not a file name", path,
                             e->string);
        int file = index_file(d, e->valuestring, &last, err);
        if (file < 0) return file;
        d->entries[d->n_entries++] = (st_entry){ .name = e->string, .file = file };
    }
    d->files = calloc((size_t)d->n_files + 1, sizeof *d->files);
    if (!d->files) return moed_fail(err, MOED_ENOMEM, "no memory for %s", path);
    snprintf(d->layout, sizeof d->layout, "model.safetensors.index.json (%d shards)", d->n_files);
    return sort_entries(d, err);
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Every *.safetensors of the folder, in name order, when it has no index and no model.safetensors.
 */
static int list_files(moed_st_dir *d, moed_error *err)
{
    DIR *dp = opendir(d->dir);
    if (!dp) return open_fail(err, d->dir);
    int rc = 0;
    const struct dirent *de;
    while (!rc && (de = readdir(dp))) {
        size_t n = strlen(de->d_name), s = strlen(".safetensors");
        if (n > s && !strcmp(de->d_name + n - s, ".safetensors")) rc = add_file(d, de->d_name, err);
    }
    closedir(dp);
    if (rc) return rc;
    if (!d->n_files)
        return moed_fail(err, MOED_ENOTFOUND,
                         "%s has no model.safetensors.index.json, no model.safetensors and no "
                         "other *.safetensors file",
                         d->dir);
    qsort(d->paths, (size_t)d->n_files, sizeof *d->paths, cmp_str);
    snprintf(d->layout, sizeof d->layout, "%d *.safetensors files", d->n_files);
    return 0;
}

/* Without an index every file is opened now: only their headers say which tensors they hold. */
static int open_all(moed_st_dir *d, moed_error *err)
{
    int total = 0;
    d->files = calloc((size_t)d->n_files, sizeof *d->files);
    if (!d->files) return moed_fail(err, MOED_ENOMEM, "no memory for %s", d->dir);
    for (int i = 0; i < d->n_files; i++) {
        int rc = moed_st_file_open(d->paths[i], &d->files[i], err);
        if (rc) return rc;
        total += d->files[i].n_tensors;
    }
    d->entries = calloc((size_t)total + 1, sizeof *d->entries);
    if (!d->entries) return moed_fail(err, MOED_ENOMEM, "no memory for %s", d->dir);
    for (int i = 0; i < d->n_files; i++)
        for (int j = 0; j < d->files[i].n_tensors; j++) {
            const moed_st_tensor *t = &d->files[i].tensors[j];
            d->entries[d->n_entries++] = (st_entry){ .name = t->name, .file = i, .t = t };
        }
    return sort_entries(d, err);
}

int moed_st_dir_open(const char *dir, moed_st_dir **out, moed_error *err)
{
    *out = NULL;
    int rc;
    char *index = NULL;
    moed_st_dir *d = calloc(1, sizeof *d);
    if (!d || !(d->dir = strdup(dir)) ||
        !(index = path_join(dir, "model.safetensors.index.json"))) {
        rc = moed_fail(err, MOED_ENOMEM, "no memory to open %s", dir);
        goto err;
    }
    struct stat st;
    if (!stat(index, &st)) {
        rc = open_index(d, index, err);
    } else {
        char *single = path_join(dir, "model.safetensors");
        if (!single) {
            rc = moed_fail(err, MOED_ENOMEM, "no memory to open %s", dir);
            goto err;
        }
        int found = !stat(single, &st);
        free(single);
        rc = found ? add_file(d, "model.safetensors", err) : list_files(d, err);
        if (!rc) {
            if (found) snprintf(d->layout, sizeof d->layout, "model.safetensors");
            rc = open_all(d, err);
        }
    }
    if (rc) goto err;
    free(index);
    *out = d;
    return 0;
err:
    free(index);
    moed_st_dir_close(d);
    return rc;
}

int moed_st_find(moed_st_dir *d, const char *name, const moed_st_tensor **t, moed_error *err)
{
    st_entry key = { .name = name };
    st_entry *e = bsearch(&key, d->entries, (size_t)d->n_entries, sizeof key, cmp_entry);
    *t = NULL;
    if (!e) return 0;
    if (!e->t) {
        moed_st_file *f = &d->files[e->file];
        if (!f->map) {
            int rc = moed_st_file_open(d->paths[e->file], f, err);
            if (rc) return rc;
        }
        e->t = moed_st_file_find(f, name);
        if (!e->t)
            return moed_fail(err, MOED_EFORMAT,
                             "%s/model.safetensors.index.json puts tensor %s in %s, but that file "
                             "has no such tensor",
                             d->dir, name, f->name);
    }
    *t = e->t;
    return 0;
}

int moed_st_read(const moed_st_dir *d, const moed_st_tensor *t, void *dst, moed_error *err)
{
    return moed_st_read_part(d, t, 0, t->nbytes, dst, err);
}

int moed_st_read_part(const moed_st_dir *d, const moed_st_tensor *t, uint64_t at, uint64_t n,
                      void *dst, moed_error *err)
{
    st_entry key = { .name = t->name };
    const st_entry *e = bsearch(&key, d->entries, (size_t)d->n_entries, sizeof key, cmp_entry);
    if (!e || e->t != t)
        return moed_fail(err, MOED_EINTERNAL, "tensor %s was not found in %s", t->name, d->dir);
    if (at > t->nbytes || n > t->nbytes - at)
        return moed_fail(err, MOED_EINTERNAL, "bytes %llu + %llu of tensor %s are past its end",
                         (unsigned long long)at, (unsigned long long)n, t->name);
    return read_at(&d->files[e->file], dst, n, t->offset + at, err);
}

int moed_st_dir_check(const moed_st_dir *d, moed_error *err)
{
    for (int i = 0; i < d->n_files; i++) {
        const moed_st_file *f = &d->files[i];
        struct stat now;
        if (!f->path) continue; /* a shard never opened */
        if (fstat(f->fd, &now) || now.st_size != f->st.st_size ||
            now.st_mtim.tv_sec != f->st.st_mtim.tv_sec ||
            now.st_mtim.tv_nsec != f->st.st_mtim.tv_nsec)
            return moed_fail(err, MOED_EIO,
                             "%s changed while moed read it (its size or modification time is not "
                             "what it was); start moed again once the checkpoint is complete",
                             f->path);
    }
    return 0;
}

const char *moed_st_dir_layout(const moed_st_dir *d)
{
    return d->layout;
}

int moed_st_dir_mapped(const moed_st_dir *d)
{
    int n = 0;
    for (int i = 0; i < d->n_files; i++) n += d->files && d->files[i].map;
    return n;
}

void moed_st_dir_close(moed_st_dir *d)
{
    if (!d) return;
    for (int i = 0; i < d->n_files; i++) {
        if (d->files) moed_st_file_close(&d->files[i]);
        free(d->paths[i]);
    }
    free(d->files);
    free(d->paths);
    free(d->entries);
    cJSON_Delete(d->index);
    free(d->dir);
    free(d);
}
