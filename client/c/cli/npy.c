/*
 * moed_npy — .npy files (npy.h states which): a header parser that reads exactly the dict literal
 * numpy writes, and a writer that produces what np.load reads.
 *
 * The header is parsed rather than pattern-matched, so key order, spacing and both quote styles
 * are accepted as numpy does, and every way a header can be wrong gets its own message. One parser
 * serves files (read straight into the array's buffer, no second copy) and memory (for tests).
 */
#include "npy.h"

#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NPY_MAGIC     "\x93NUMPY"
#define NPY_MAGIC_LEN 6
/* The elements in one array this module accepts: any larger is a corrupt or hostile header. */
#define NPY_MAX_BYTES ((uint64_t)1 << 46)

static const struct {
    const char *descr;
    int dtype;
} npy_types[] = {
    { "<f4", MOED_F32 },     { "<f2", MOED_F16 },     { "<i4", MOED_I32 },
    { "<u2", MOED_NPY_U16 }, { "<i8", MOED_NPY_I64 }, { "<f8", MOED_NPY_F64 },
    { "<V2", MOED_BF16 },    { "|V2", MOED_BF16 },    { "bfloat16", MOED_BF16 },
};

size_t moed_npy_itemsize(int dtype)
{
    switch (dtype) {
    case MOED_NPY_U16:
        return 2;
    case MOED_NPY_I64:
    case MOED_NPY_F64:
        return 8;
    }
    return moed_dtype_size(dtype);
}

const char *moed_npy_type_name(int dtype)
{
    switch (dtype) {
    case MOED_F32:
        return "float32";
    case MOED_F16:
        return "float16";
    case MOED_BF16:
        return "bfloat16";
    case MOED_I32:
        return "int32";
    case MOED_NPY_U16:
        return "uint16";
    case MOED_NPY_I64:
        return "int64";
    case MOED_NPY_F64:
        return "float64";
    }
    return "unknown";
}

/* What the writer names a dtype: the first descr of the table that maps to it ('<u2' for bf16). */
static const char *descr_of(int dtype)
{
    if (dtype == MOED_BF16) return "<u2";
    for (size_t i = 0; i < sizeof npy_types / sizeof npy_types[0]; i++)
        if (npy_types[i].dtype == dtype) return npy_types[i].descr;
    return NULL;
}

/* ---- the header's dict literal ---- */

typedef struct cursor {
    const char *p, *end;
} cursor;

static void skip_ws(cursor *c)
{
    while (c->p < c->end && (*c->p == ' ' || *c->p == '\t' || *c->p == '\n' || *c->p == '\r'))
        c->p++;
}

static int eat(cursor *c, char ch)
{
    skip_ws(c);
    if (c->p < c->end && *c->p == ch) {
        c->p++;
        return 1;
    }
    return 0;
}

/* A quoted string into buf (n bytes); 0 if there is none or it does not fit. */
static int quoted(cursor *c, char *buf, size_t n)
{
    skip_ws(c);
    if (c->p >= c->end || (*c->p != '\'' && *c->p != '"')) return 0;
    char q = *c->p++;
    const char *s = c->p;
    while (c->p < c->end && *c->p != q && *c->p != '\\') c->p++;
    if (c->p >= c->end || *c->p != q || (size_t)(c->p - s) >= n) return 0;
    memcpy(buf, s, (size_t)(c->p - s));
    buf[c->p - s] = 0;
    c->p++;
    return 1;
}

/* A size: decimal digits (bounded by the header, which is not NUL-terminated). */
static int size_value(cursor *c, int64_t *out)
{
    skip_ws(c);
    const char *s = c->p;
    int64_t v = 0;
    for (; c->p < c->end && *c->p >= '0' && *c->p <= '9'; c->p++) {
        if (v > (INT64_MAX - 9) / 10) return 0;
        v = v * 10 + (*c->p - '0');
    }
    if (c->p < c->end && *c->p == 'L') c->p++; /* Python 2 longs, as old numpy wrote them */
    *out = v;
    return c->p > s;
}

static int shape_tuple(cursor *c, moed_npy *out, moed_error *err)
{
    if (!eat(c, '(')) return moed_fail(err, MOED_EFORMAT, "'shape' is not a tuple such as (3, 4)");
    out->ndim = 0;
    while (!eat(c, ')')) {
        int64_t v;
        if (!size_value(c, &v))
            return moed_fail(err, MOED_EFORMAT, "'shape' holds something other than sizes >= 0");
        if (out->ndim == MOED_NPY_MAX_DIMS)
            return moed_fail(err, MOED_EFORMAT, "'shape' has more than %d dimensions",
                             MOED_NPY_MAX_DIMS);
        out->shape[out->ndim++] = v;
        if (!eat(c, ',') && !(skip_ws(c), c->p < c->end && *c->p == ')'))
            return moed_fail(err, MOED_EFORMAT, "'shape' is not a tuple of integers");
    }
    return 0;
}

static int descr_dtype(const char *descr, moed_npy *out, moed_error *err)
{
    for (size_t i = 0; i < sizeof npy_types / sizeof npy_types[0]; i++)
        if (!strcmp(descr, npy_types[i].descr)) {
            out->dtype = npy_types[i].dtype;
            return 0;
        }
    if (descr[0] == '>')
        return moed_fail(err, MOED_EFORMAT,
                         "the array is big-endian ('%s'): save it little-endian, e.g. "
                         "np.save(f, a.astype(a.dtype.newbyteorder('<')))",
                         descr);
    return moed_fail(err, MOED_EFORMAT,
                     "element type '%s' is not supported: use float32, float16, bfloat16 (as "
                     "ml_dtypes or uint16 bits), int32, int64 or float64",
                     descr);
}

/* The dict literal {'descr': ..., 'fortran_order': ..., 'shape': (...), } in any key order. */
static int parse_dict(const char *text, size_t len, moed_npy *out, moed_error *err)
{
    cursor c = { text, text + len };
    char key[32], descr[32];
    int have = 0, fortran = 0, rc;
    if (!eat(&c, '{')) return moed_fail(err, MOED_EFORMAT, "the header is not a dict literal");
    while (!eat(&c, '}')) {
        if (!quoted(&c, key, sizeof key) || !eat(&c, ':'))
            return moed_fail(err, MOED_EFORMAT, "the header dict has a malformed key");
        if (!strcmp(key, "descr")) {
            if (!quoted(&c, descr, sizeof descr))
                return moed_fail(err, MOED_EFORMAT,
                                 "'descr' is not a simple type string (structured "
                                 "arrays are not supported)");
            if ((rc = descr_dtype(descr, out, err))) return rc;
            have |= 1;
        } else if (!strcmp(key, "fortran_order")) {
            skip_ws(&c);
            size_t left = (size_t)(c.end - c.p);
            if (left >= 4 && !memcmp(c.p, "True", 4))
                fortran = 1, c.p += 4;
            else if (left >= 5 && !memcmp(c.p, "False", 5))
                c.p += 5;
            else
                return moed_fail(err, MOED_EFORMAT, "'fortran_order' is not True or False");
            have |= 2;
        } else if (!strcmp(key, "shape")) {
            if ((rc = shape_tuple(&c, out, err))) return rc;
            have |= 4;
        } else {
            return moed_fail(err, MOED_EFORMAT, "the header has an unknown key '%s'", key);
        }
        if (eat(&c, ',') || (skip_ws(&c), c.p < c.end && *c.p == '}')) continue;
        if (c.p >= c.end)
            return moed_fail(err, MOED_EFORMAT, "the header dict ends without its closing '}'");
        return moed_fail(err, MOED_EFORMAT, "the header dict is missing a ',' after '%s'", key);
    }
    if (have != 7)
        return moed_fail(err, MOED_EFORMAT, "the header lacks '%s'",
                         !(have & 1)   ? "descr"
                         : !(have & 2) ? "fortran_order"
                                       : "shape");
    if (fortran)
        return moed_fail(err, MOED_EFORMAT,
                         "the array is in Fortran order: save np.ascontiguousarray(a) instead");
    return 0;
}

/* The magic and version at buf (n >= 12 bytes, or the whole file if shorter): where the header
 * dict starts and its length. */
static int parse_prefix(const uint8_t *buf, size_t n, size_t *start, size_t *hlen, moed_error *err)
{
    if (n < 10 || memcmp(buf, NPY_MAGIC, NPY_MAGIC_LEN))
        return moed_fail(err, MOED_EFORMAT, "not a .npy file (no \\x93NUMPY magic)");
    int major = buf[6];
    if (major == 1) {
        *hlen = (size_t)buf[8] | (size_t)buf[9] << 8;
        *start = 10;
    } else if (major == 2 || major == 3) {
        if (n < 12) return moed_fail(err, MOED_EFORMAT, "the .npy header is truncated");
        *hlen =
            (size_t)buf[8] | (size_t)buf[9] << 8 | (size_t)buf[10] << 16 | (size_t)buf[11] << 24;
        *start = 12;
    } else {
        return moed_fail(err, MOED_EFORMAT,
                         ".npy format version %d.%d is not supported (1 to 3 are)", major, buf[7]);
    }
    return 0;
}

/* Parses the magic, version and header at buf (n bytes available); sets everything in out but
 * data, and *data_off to where the data starts. */
static int parse_header(const uint8_t *buf, size_t n, moed_npy *out, size_t *data_off,
                        moed_error *err)
{
    memset(out, 0, sizeof *out);
    size_t start, hlen;
    int rc = parse_prefix(buf, n, &start, &hlen, err);
    if (rc) return rc;
    if (hlen > n - start)
        return moed_fail(err, MOED_EFORMAT, "the .npy header says %zu bytes, only %zu follow", hlen,
                         n - start);
    if ((rc = parse_dict((const char *)buf + start, hlen, out, err))) return rc;
    uint64_t count = 1;
    size_t item = moed_npy_itemsize(out->dtype);
    for (int i = 0; i < out->ndim; i++) {
        if (out->shape[i] && count > NPY_MAX_BYTES / item / (uint64_t)out->shape[i])
            return moed_fail(err, MOED_EFORMAT, "the array's shape is implausibly large");
        count *= (uint64_t)out->shape[i];
    }
    out->count = (int64_t)count;
    out->nbytes = (size_t)count * item;
    *data_off = start + hlen;
    return 0;
}

static int check_data_size(const moed_npy *a, size_t have, moed_error *err)
{
    if (have == a->nbytes) return 0;
    return moed_fail(err, MOED_EFORMAT, "the data is %zu bytes, its %s shape needs %zu (%s file?)",
                     have, moed_npy_type_name(a->dtype), a->nbytes,
                     have < a->nbytes ? "a truncated" : "a corrupt");
}

int moed_npy_parse(const void *buf, size_t n, moed_npy *out, moed_error *err)
{
    size_t off;
    int rc = parse_header(buf, n, out, &off, err);
    if (!rc) rc = check_data_size(out, n - off, err);
    if (rc) return rc;
    out->data = malloc(out->nbytes ? out->nbytes : 1);
    if (!out->data) return moed_fail(err, MOED_ENOMEM, "out of memory for %zu bytes", out->nbytes);
    memcpy(out->data, (const uint8_t *)buf + off, out->nbytes);
    return 0;
}

/* Reads n bytes at offset off of f into buf: the whole file is known to be that long. */
static int read_at(FILE *f, long off, void *buf, size_t n, moed_error *err)
{
    if (fseek(f, off, SEEK_SET) || fread(buf, 1, n, f) != n)
        return moed_fail(err, MOED_EIO, "cannot read %zu bytes at offset %ld: %s", n, off,
                         ferror(f) ? strerror(errno) : "the file is shorter than that");
    return 0;
}

int moed_npy_read(const char *path, moed_npy *out, moed_error *err)
{
    memset(out, 0, sizeof *out);
    uint8_t pre[12], *head = NULL;
    size_t start, hlen, off;
    int rc;
    FILE *f = fopen(path, "rb");
    if (!f) return moed_fail(err, MOED_EIO, "%s: cannot open: %s", path, strerror(errno));
    long size = fseek(f, 0, SEEK_END) ? -1 : ftell(f);
    if (size < 0) {
        rc = moed_fail(err, MOED_EIO, "cannot find its size: %s", strerror(errno));
        goto err;
    }
    size_t npre = (size_t)size < sizeof pre ? (size_t)size : sizeof pre;
    if ((rc = read_at(f, 0, pre, npre, err)) || (rc = parse_prefix(pre, npre, &start, &hlen, err)))
        goto err;
    if (start + hlen > (size_t)size) {
        rc = moed_fail(err, MOED_EFORMAT, "the .npy header says %zu bytes, only %zu follow", hlen,
                       (size_t)size - start);
        goto err;
    }
    if (!(head = malloc(start + hlen))) {
        rc = moed_fail(err, MOED_ENOMEM, "out of memory for a %zu-byte header", hlen);
        goto err;
    }
    if ((rc = read_at(f, 0, head, start + hlen, err)) ||
        (rc = parse_header(head, start + hlen, out, &off, err)) ||
        (rc = check_data_size(out, (size_t)size - off, err)))
        goto err;
    if (!(out->data = malloc(out->nbytes ? out->nbytes : 1))) {
        rc = moed_fail(err, MOED_ENOMEM, "out of memory for %zu bytes of data", out->nbytes);
        goto err;
    }
    if ((rc = read_at(f, (long)off, out->data, out->nbytes, err))) goto err;
    free(head);
    fclose(f);
    return 0;
err:
    moed_npy_free(out);
    free(head);
    fclose(f);
    moed_error_prefix(err, "%s", path);
    return rc;
}

int moed_npy_write(const char *path, int dtype, int ndim, const int64_t *shape, const void *data,
                   moed_error *err)
{
    const char *descr = descr_of(dtype);
    if (!descr) return moed_fail(err, MOED_EINVAL, "%s: cannot write element type %d", path, dtype);
    if (ndim < 0 || ndim > MOED_NPY_MAX_DIMS)
        return moed_fail(err, MOED_EINVAL, "%s: %d dimensions (at most %d)", path, ndim,
                         MOED_NPY_MAX_DIMS);
    char dims[MOED_NPY_MAX_DIMS * 22 + 4] = "";
    size_t dl = 0;
    uint64_t count = 1;
    for (int i = 0; i < ndim; i++) {
        dl += (size_t)snprintf(dims + dl, sizeof dims - dl, "%s%lld", i ? ", " : "",
                               (long long)shape[i]);
        count *= (uint64_t)shape[i];
    }
    if (ndim == 1) snprintf(dims + dl, sizeof dims - dl, ",");
    /* numpy pads the header with spaces so the data starts 64-byte aligned, ending in '\n'. */
    char header[512];
    int len = snprintf(header, sizeof header,
                       "{'descr': '%s', 'fortran_order': False, 'shape': (%s), }", descr, dims);
    size_t total = (10 + (size_t)len + 1 + 63) / 64 * 64;
    size_t hlen = total - 10;
    memset(header + len, ' ', hlen - 1 - (size_t)len);
    header[hlen - 1] = '\n';
    uint8_t pre[10] = { 0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0, (uint8_t)hlen, (uint8_t)(hlen >> 8) };
    size_t nbytes = (size_t)count * moed_npy_itemsize(dtype);
    FILE *f = fopen(path, "wb");
    if (!f) return moed_fail(err, MOED_EIO, "%s: cannot create: %s", path, strerror(errno));
    int ok = fwrite(pre, 1, 10, f) == 10 && fwrite(header, 1, hlen, f) == hlen &&
             fwrite(data, 1, nbytes, f) == nbytes;
    ok = (fclose(f) == 0) && ok;
    if (!ok) return moed_fail(err, MOED_EIO, "%s: cannot write: %s", path, strerror(errno));
    return 0;
}

void moed_npy_free(moed_npy *a)
{
    if (!a) return;
    free(a->data);
    memset(a, 0, sizeof *a);
}

int moed_npy_convert(moed_npy *a, int dtype, const char *what, moed_error *err)
{
    if (a->dtype == dtype) return 0;
    if (a->dtype == MOED_NPY_F64 && dtype == MOED_F32) {
        /* In place, front to back: element i is written at 4i, below where 8(i+1) is read. */
        const double *d = a->data;
        float *f = a->data;
        for (int64_t i = 0; i < a->count; i++) f[i] = (float)d[i];
    } else if (a->dtype == MOED_NPY_I64 && dtype == MOED_I32) {
        const int64_t *s = a->data;
        int32_t *t = a->data;
        for (int64_t i = 0; i < a->count; i++) {
            if (s[i] < INT32_MIN || s[i] > INT32_MAX)
                return moed_fail(err, MOED_EINVAL, "%s: element %lld is %lld, outside int32", what,
                                 (long long)i, (long long)s[i]);
            t[i] = (int32_t)s[i];
        }
    } else if (!(a->dtype == MOED_NPY_U16 && dtype == MOED_BF16)) {
        return moed_fail(
            err, MOED_EINVAL, "%s holds %s, it must be %s%s", what, moed_npy_type_name(a->dtype),
            moed_npy_type_name(dtype),
            a->dtype == MOED_NPY_U16 ? " (uint16 is taken as bf16 bits only when asked)" : "");
    }
    a->dtype = dtype;
    a->nbytes = (size_t)a->count * moed_npy_itemsize(dtype);
    return 0;
}
