/*
 * test_npy — client/c/cli/npy.c: round trips of every element type through a file, headers as numpy
 * and ml_dtypes write them (byte for byte, from np.save), and the malformed files each get their
 * own error instead of a crash or a wrong array.
 */
#include "check.h"
#include "moed_dtype.h"
#include "npy.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char tmpdir[] = "/tmp/test_npy.XXXXXX";

static void tmp_path(char *buf, size_t n, const char *name)
{
    snprintf(buf, n, "%s/%s", tmpdir, name);
}

/* A file with a v1.0 header around `dict` (padded as numpy pads) followed by data. */
static size_t make_npy(uint8_t *buf, const char *dict, const void *data, size_t nbytes)
{
    size_t len = strlen(dict), hlen = (10 + len + 1 + 63) / 64 * 64 - 10;
    memcpy(buf, "\x93NUMPY\x01\x00", 8);
    buf[8] = (uint8_t)hlen;
    buf[9] = (uint8_t)(hlen >> 8);
    memcpy(buf + 10, dict, len);
    memset(buf + 10 + len, ' ', hlen - len - 1);
    buf[10 + hlen - 1] = '\n';
    memcpy(buf + 10 + hlen, data, nbytes);
    return 10 + hlen + nbytes;
}

static void test_round_trips(void)
{
    static const int dtypes[] = { MOED_F32,     MOED_F16,     MOED_BF16,   MOED_I32,
                                  MOED_NPY_I64, MOED_NPY_F64, MOED_NPY_U16 };
    uint8_t data[3 * 5 * 8];
    for (size_t i = 0; i < sizeof data; i++) data[i] = (uint8_t)(i * 37 + 11);
    for (size_t k = 0; k < sizeof dtypes / sizeof dtypes[0]; k++) {
        char path[256];
        tmp_path(path, sizeof path, "rt.npy");
        int64_t shape[2] = { 3, 5 };
        moed_error err;
        moed_npy a;
        CHECK_EQ_INT(moed_npy_write(path, dtypes[k], 2, shape, data, &err), 0);
        CHECK_EQ_INT(moed_npy_read(path, &a, &err), 0);
        /* bf16 is written as uint16 bits: it reads back as such, and converts to bf16. */
        int want = dtypes[k] == MOED_BF16 ? MOED_NPY_U16 : dtypes[k];
        CHECK_EQ_INT(a.dtype, want);
        CHECK_EQ_INT(a.ndim, 2);
        CHECK_EQ_INT(a.shape[0], 3);
        CHECK_EQ_INT(a.shape[1], 5);
        CHECK_EQ_INT(a.count, 15);
        CHECK_EQ_INT(a.nbytes, 15 * moed_npy_itemsize(dtypes[k]));
        CHECK(a.data && !memcmp(a.data, data, a.nbytes));
        FILE *f = fopen(path, "rb");
        uint8_t head[10];
        CHECK(f && fread(head, 1, 10, f) == 10);
        if (f) fclose(f);
        CHECK_EQ_INT((10 + (head[8] | head[9] << 8)) % 64, 0); /* data 64-byte aligned */
        moed_npy_free(&a);
    }
    /* 1-d and 0-d shapes are written as numpy writes them, "(4,)" and "()". */
    char path[256];
    tmp_path(path, sizeof path, "shapes.npy");
    moed_error err;
    moed_npy a;
    float v[4] = { 1, 2, 3, 4 };
    int64_t n4 = 4;
    CHECK_EQ_INT(moed_npy_write(path, MOED_F32, 1, &n4, v, &err), 0);
    CHECK_EQ_INT(moed_npy_read(path, &a, &err), 0);
    CHECK_EQ_INT(a.ndim, 1);
    CHECK_EQ_INT(a.shape[0], 4);
    moed_npy_free(&a);
    CHECK_EQ_INT(moed_npy_write(path, MOED_F32, 0, NULL, v, &err), 0);
    CHECK_EQ_INT(moed_npy_read(path, &a, &err), 0);
    CHECK_EQ_INT(a.ndim, 0);
    CHECK_EQ_INT(a.count, 1);
    CHECK(a.data && ((float *)a.data)[0] == 1.0f);
    moed_npy_free(&a);
}

static void test_numpy_headers(void)
{
    uint8_t buf[512];
    moed_error err;
    moed_npy a;
    uint16_t bits[4] = { 0x0000, 0x3f80, 0x4000, 0x4040 }; /* bf16 0, 1, 2, 3 */
    /* The exact header np.save writes for np.arange(4).astype(ml_dtypes.bfloat16). */
    size_t n = make_npy(buf, "{'descr': '<V2', 'fortran_order': False, 'shape': (4,), }", bits,
                        sizeof bits);
    CHECK_EQ_INT(moed_npy_parse(buf, n, &a, &err), 0);
    CHECK_EQ_INT(a.dtype, MOED_BF16);
    CHECK(a.data && moed_bf16_to_f32(((uint16_t *)a.data)[3]) == 3.0f);
    moed_npy_free(&a);
    /* Keys in another order, double quotes, no trailing comma, a 2.0 header. */
    const char *dict = "{\"shape\": (2, 2), \"fortran_order\": False, \"descr\": \"<f2\"}";
    size_t len = strlen(dict);
    memcpy(buf, "\x93NUMPY\x02\x00", 8);
    buf[8] = (uint8_t)len;
    buf[9] = buf[10] = buf[11] = 0;
    memcpy(buf + 12, dict, len);
    memcpy(buf + 12 + len, bits, sizeof bits);
    CHECK_EQ_INT(moed_npy_parse(buf, 12 + len + sizeof bits, &a, &err), 0);
    CHECK_EQ_INT(a.dtype, MOED_F16);
    CHECK_EQ_INT(a.shape[0] * a.shape[1], 4);
    moed_npy_free(&a);
}

/* Each malformed file fails with MOED_EFORMAT and a message containing `want`. */
static void expect_bad(const uint8_t *buf, size_t n, const char *want)
{
    moed_error err;
    memset(&err, 0, sizeof err);
    moed_npy a;
    int rc = moed_npy_parse(buf, n, &a, &err);
    CHECK_MSG(rc == MOED_EFORMAT, "rc %d for a file that should fail with '%s'", rc, want);
    CHECK_MSG(strstr(err.msg, want) != NULL, "message '%s' lacks '%s'", err.msg, want);
    CHECK(a.data == NULL);
}

static void test_malformed(void)
{
    uint8_t buf[512];
    float v[6] = { 0 };
    const char *ok = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
    size_t n = make_npy(buf, ok, v, sizeof v);
    expect_bad(buf, n - 4, "truncated");
    uint8_t longer[600];
    memcpy(longer, buf, n);
    memset(longer + n, 0, 4);
    expect_bad(longer, n + 4, "the data is 28 bytes");
    expect_bad(buf, 8, "not a .npy file");
    memcpy(longer, buf, n);
    longer[0] = 'x';
    expect_bad(longer, n, "not a .npy file");
    memcpy(longer, buf, n);
    longer[6] = 9;
    expect_bad(longer, n, "version 9.0");
    memcpy(longer, buf, n);
    longer[8] = 0xff;
    longer[9] = 0x7f;
    expect_bad(longer, n, "header says");
    static const struct {
        const char *dict, *want;
    } cases[] = {
        { "{'descr': '>f4', 'fortran_order': False, 'shape': (2, 3), }", "big-endian" },
        { "{'descr': '<c8', 'fortran_order': False, 'shape': (2, 3), }", "'<c8' is not supported" },
        { "{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }", "Fortran order" },
        { "{'descr': '<f4', 'shape': (2, 3), }", "lacks 'fortran_order'" },
        { "{'descr': '<f4', 'fortran_order': False, }", "lacks 'shape'" },
        { "{'descr': '<f4', 'fortran_order': False, 'shape': (2, -3), }", "sizes >= 0" },
        { "{'descr': '<f4', 'fortran_order': False, 'shape': [2, 3], }", "not a tuple" },
        { "{'descr': '<f4', 'fortran_order': Maybe, 'shape': (2, 3), }", "True or False" },
        { "{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (2,), }", "structured" },
        { "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), 'x': 1}", "unknown key 'x'" },
        { "{'descr': '<f4' 'fortran_order': False, 'shape': (2, 3)}", "missing a ','" },
        { "['descr', '<f4']", "not a dict" },
        { "{'descr': '<f4', 'fortran_order': False, 'shape': (1,2,3,4,5,6,7,8,9), }",
          "more than 8" },
        { "{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999, 99999999999), }",
          "implausibly large" },
        { "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3)", "closing '}'" },
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        n = make_npy(buf, cases[i].dict, v, sizeof v);
        expect_bad(buf, n, cases[i].want);
    }
}

static void test_files_and_conversions(void)
{
    char path[256];
    moed_error err;
    moed_npy a;
    CHECK_EQ_INT(moed_npy_read("/nonexistent/x.npy", &a, &err), MOED_EIO);
    CHECK(strstr(err.msg, "/nonexistent/x.npy") != NULL);
    tmp_path(path, sizeof path, "short.npy");
    FILE *f = fopen(path, "wb");
    CHECK(f != NULL);
    if (f) {
        fwrite("\x93NUMPY\x01\x00\x76\x00{'descr'", 1, 17, f); /* header cut short */
        fclose(f);
    }
    CHECK_EQ_INT(moed_npy_read(path, &a, &err), MOED_EFORMAT);
    CHECK_MSG(strstr(err.msg, path) && strstr(err.msg, "header says"), "%s", err.msg);

    int64_t ids[4] = { 0, 7, -1, 3 }, big[1] = { (int64_t)1 << 40 }, shape = 4, one = 1;
    double d[4] = { 0.5, -1.25, 3.0e38, 1.0 / 3.0 };
    tmp_path(path, sizeof path, "conv.npy");
    CHECK_EQ_INT(moed_npy_write(path, MOED_NPY_I64, 1, &shape, ids, &err), 0);
    CHECK_EQ_INT(moed_npy_read(path, &a, &err), 0);
    CHECK_EQ_INT(moed_npy_convert(&a, MOED_I32, "--ids", &err), 0);
    CHECK(a.dtype == MOED_I32 && a.nbytes == 16 && ((int32_t *)a.data)[2] == -1 &&
          ((int32_t *)a.data)[3] == 3);
    moed_npy_free(&a);
    CHECK_EQ_INT(moed_npy_write(path, MOED_NPY_I64, 1, &one, big, &err), 0);
    CHECK_EQ_INT(moed_npy_read(path, &a, &err), 0);
    CHECK_EQ_INT(moed_npy_convert(&a, MOED_I32, "--ids", &err), MOED_EINVAL);
    CHECK_MSG(strstr(err.msg, "--ids") && strstr(err.msg, "outside int32"), "%s", err.msg);
    moed_npy_free(&a);
    CHECK_EQ_INT(moed_npy_write(path, MOED_NPY_F64, 1, &shape, d, &err), 0);
    CHECK_EQ_INT(moed_npy_read(path, &a, &err), 0);
    CHECK_EQ_INT(moed_npy_convert(&a, MOED_F32, "--weights", &err), 0);
    for (int i = 0; i < 4; i++) CHECK(((float *)a.data)[i] == (float)d[i]);
    CHECK_EQ_INT(moed_npy_convert(&a, MOED_I32, "--ids", &err), MOED_EINVAL);
    CHECK_MSG(strstr(err.msg, "float32") && strstr(err.msg, "int32"), "%s", err.msg);
    moed_npy_free(&a);
}

int main(void)
{
    if (!mkdtemp(tmpdir)) {
        perror("mkdtemp");
        return 1;
    }
    test_round_trips();
    test_numpy_headers();
    test_malformed();
    test_files_and_conversions();
    const char *names[] = { "rt.npy", "shapes.npy", "short.npy", "conv.npy" };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        char path[256];
        tmp_path(path, sizeof path, names[i]);
        unlink(path);
    }
    rmdir(tmpdir);
    return check_status("test_npy");
}
