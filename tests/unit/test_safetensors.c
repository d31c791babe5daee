/*
 * test_safetensors — the safetensors reader on files written by st_write.h: a valid file read
 * back byte for byte, every way a header can be broken (each must fail with MOED_EFORMAT and a
 * message naming the tensor), and the three folder layouts, including that an index opens a shard
 * only when one of its tensors is looked up. Copies by moed_st_read match the mapping, a file that
 * shrank gives an error (not a fault), and moed_st_dir_check sees a file written after its open.
 */
#include "check.h"
#include "moed_dtype.h"
#include "safetensors.h"
#include "st_write.h"

#include <fcntl.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

static char dir[256];

static const char *in_dir(const char *name)
{
    static char buf[4][512];
    static int k;
    k = (k + 1) % 4;
    return stw_path(buf[k], sizeof buf[k], dir, name);
}

static void test_valid_file(void)
{
    uint16_t a[6] = { 1, 2, 3, 4, 5, 0xffff };
    float b[4] = { 1.5f, -2, 3, 4 };
    int64_t c[2] = { -1, 7 };
    stw_tensor t[] = {
        { "layer.a", "BF16", 2, { 2, 3 }, a, sizeof a },
        { "layer.b", "F32", 1, { 4 }, b, sizeof b },
        { "empty", "F16", 2, { 0, 5 }, NULL, 0 },
        { "c", "I64", 1, { 2 }, c, sizeof c },
    };
    CHECK(!stw_file(in_dir("ok.safetensors"), t, 4));
    moed_st_file f;
    moed_error err = { 0 };
    int rc = moed_st_file_open(in_dir("ok.safetensors"), &f, &err);
    CHECK_MSG(rc == 0, "%s", err.msg);
    if (rc) return;
    CHECK_EQ_INT(f.n_tensors, 4);
    CHECK(!strcmp(f.name, "ok.safetensors"));
    const moed_st_tensor *x = moed_st_file_find(&f, "layer.a");
    CHECK(x && !strcmp(x->dtype, "BF16") && x->mdtype == MOED_BF16 && x->ndim == 2 &&
          x->shape[0] == 2 && x->shape[1] == 3 && x->nbytes == sizeof a &&
          !memcmp(x->data, a, sizeof a) && x->offset % 8 == 0 && !strcmp(x->file, f.name));
    x = moed_st_file_find(&f, "layer.b");
    CHECK(x && x->mdtype == MOED_F32 && x->ndim == 1 && x->shape[0] == 4 &&
          !memcmp(x->data, b, sizeof b));
    CHECK(x && x->offset == (uint64_t)((const char *)x->data - (const char *)f.map));
    x = moed_st_file_find(&f, "c");
    CHECK(x && x->mdtype == MOED_DTYPE_NONE && !strcmp(x->dtype, "I64") &&
          !memcmp(x->data, c, sizeof c));
    x = moed_st_file_find(&f, "empty");
    CHECK(x && x->nbytes == 0 && x->shape[0] == 0 && x->shape[1] == 5);
    char s[64];
    CHECK(x && !strcmp(moed_st_shape_str(x, s, sizeof s), "[0, 5]"));
    CHECK(!moed_st_file_find(&f, "layer"));
    CHECK(!moed_st_file_find(&f, "__metadata__"));
    moed_st_file_close(&f);
    CHECK(f.map == NULL && f.tensors == NULL);
    unlink(in_dir("ok.safetensors"));
}

/* Opens a file whose header is `header` (length hlen, or its true length when 0) over nbytes of
 * data, and checks the open returns code (0: succeeds) with a message holding `needle`. */
static void expect_bad(const char *header, uint64_t hlen, size_t nbytes, int code,
                       const char *needle)
{
    static unsigned char data[256];
    const char *path = in_dir("bad.safetensors");
    CHECK(!stw_raw(path, hlen ? hlen : strlen(header), header, data, nbytes));
    moed_st_file f;
    moed_error err = { 0 };
    int rc = moed_st_file_open(path, &f, &err);
    CHECK_MSG(rc == code, "header %s: rc %d, want %d (%s)", header, rc, code, err.msg);
    if (!rc) {
        moed_st_file_close(&f);
        return;
    }
    CHECK_MSG(strstr(err.msg, needle), "header %s: message \"%s\" lacks \"%s\"", header, err.msg,
              needle);
    CHECK_MSG(strstr(err.msg, "bad.safetensors"), "message \"%s\" does not name the file", err.msg);
}

static void test_bad_files(void)
{
    const char *ok = "{\"w\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,16]}}";
    /* the data was cut short */
    expect_bad(ok, 0, 12, MOED_EFORMAT, "tensor w: data_offsets [0, 16] are outside the 12-byte");
    expect_bad(ok, 1000, 16, MOED_EFORMAT, "header length 1000");
    expect_bad(ok, 1ull << 40, 16, MOED_EFORMAT, "runs past the end");
    expect_bad("{\"w\":{\"dtype\":", 0, 0, MOED_EFORMAT, "not valid JSON");
    expect_bad("[1, 2]", 0, 0, MOED_EFORMAT, "not a JSON object");
    expect_bad("{} x", 0, 0, MOED_EFORMAT, "after the header");
    expect_bad("{\"w\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,400]}}", 0, 16,
               MOED_EFORMAT, "tensor w: data_offsets [0, 400] are outside");
    expect_bad("{\"w\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[8,4]}}", 0, 16,
               MOED_EFORMAT, "tensor w");
    expect_bad("{\"w\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,12]}}", 0, 12,
               MOED_EFORMAT, "tensor w: data_offsets [0, 12] hold 12 bytes but shape [2, 2]");
    expect_bad("{\"w\":{\"dtype\":\"F32\",\"shape\":[-2,2],\"data_offsets\":[0,16]}}", 0, 16,
               MOED_EFORMAT, "tensor w: shape");
    expect_bad("{\"w\":{\"dtype\":\"F32\",\"shape\":[2.5,2],\"data_offsets\":[0,16]}}", 0, 16,
               MOED_EFORMAT, "tensor w: shape");
    expect_bad("{\"w\":{\"dtype\":\"Q7\",\"shape\":[2,2],\"data_offsets\":[0,16]}}", 0, 16,
               MOED_EFORMAT, "\"Q7\"");
    expect_bad("{\"w\":{\"shape\":[2,2],\"data_offsets\":[0,16]}}", 0, 16, MOED_EFORMAT,
               "tensor w");
    expect_bad("{\"w\":[1]}", 0, 0, MOED_EFORMAT, "entry w");
    expect_bad("{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0]}}", 0, 8, MOED_EFORMAT,
               "tensor w: data_offsets must be two");
    /* overlap, hole, trailing bytes, duplicate name */
    expect_bad("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
               "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
               0, 12, MOED_EFORMAT, "tensor b starts at data byte 4");
    expect_bad("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
               "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[12,20]}}",
               0, 20, MOED_EFORMAT, "tensor b starts at data byte 12");
    expect_bad(ok, 0, 20, MOED_EFORMAT, "extra data after the last tensor");
    expect_bad("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
               "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}",
               0, 16, MOED_EFORMAT, "tensor a appears twice");
    /* sub-byte dtypes must fill whole bytes */
    expect_bad("{\"w\":{\"dtype\":\"F4\",\"shape\":[3],\"data_offsets\":[0,2]}}", 0, 2,
               MOED_EFORMAT, "tensor w");
    expect_bad("{\"w\":{\"dtype\":\"F4\",\"shape\":[4],\"data_offsets\":[0,2]}}", 0, 2, 0, "");

    moed_st_file f;
    moed_error err = { 0 };
    CHECK(!stw_raw(in_dir("short.safetensors"), 0, "", NULL, 0));
    CHECK(!truncate(in_dir("short.safetensors"), 5));
    CHECK_EQ_INT(moed_st_file_open(in_dir("short.safetensors"), &f, &err), MOED_EFORMAT);
    CHECK(strstr(err.msg, "5 bytes"));
    CHECK_EQ_INT(moed_st_file_open(in_dir("absent.safetensors"), &f, &err), MOED_ENOTFOUND);
    CHECK(strstr(err.msg, "absent.safetensors"));
    unlink(in_dir("short.safetensors"));
    unlink(in_dir("bad.safetensors"));
}

static float vals[8] = { 1, 2, 3, 4, 5, 6, 7, 8 };

static void write_pair(const char *a, const char *b)
{
    stw_tensor t1[] = { { "x.one", "F32", 1, { 2 }, vals, 8 },
                        { "x.two", "F32", 1, { 2 }, vals + 2, 8 } };
    stw_tensor t2[] = { { "y.three", "F32", 1, { 4 }, vals + 4, 16 } };
    CHECK(!stw_file(in_dir(a), t1, 2));
    CHECK(!stw_file(in_dir(b), t2, 1));
}

static void expect_value(moed_st_dir *d, const char *name, float first)
{
    const moed_st_tensor *t = NULL;
    moed_error err = { 0 };
    int rc = moed_st_find(d, name, &t, &err);
    CHECK_MSG(rc == 0 && t, "%s: rc %d %s", name, rc, err.msg);
    CHECK(t && ((const float *)t->data)[0] == first);
}

static void test_dir_layouts(void)
{
    moed_st_dir *d;
    moed_error err = { 0 };
    const moed_st_tensor *t;

    CHECK_EQ_INT(moed_st_dir_open(dir, &d, &err), MOED_ENOTFOUND); /* empty folder */
    CHECK(strstr(err.msg, "no model.safetensors"));

    /* every *.safetensors, when there is no index and no model.safetensors */
    write_pair("b.safetensors", "a.safetensors");
    CHECK(!stw_text(in_dir("notes.txt"), "not a checkpoint"));
    int rc = moed_st_dir_open(dir, &d, &err);
    CHECK_MSG(rc == 0, "%s", err.msg);
    if (!rc) {
        CHECK(!strcmp(moed_st_dir_layout(d), "2 *.safetensors files"));
        CHECK_EQ_INT(moed_st_dir_mapped(d), 2);
        expect_value(d, "x.two", 3);
        expect_value(d, "y.three", 5);
        CHECK(!moed_st_find(d, "z", &t, &err) && !t);
        moed_st_dir_close(d);
    }
    /* a name in two files is ambiguous */
    stw_tensor dup[] = { { "x.one", "F32", 1, { 1 }, vals, 4 } };
    CHECK(!stw_file(in_dir("c.safetensors"), dup, 1));
    CHECK_EQ_INT(moed_st_dir_open(dir, &d, &err), MOED_EFORMAT);
    CHECK(strstr(err.msg, "x.one") && strstr(err.msg, "c.safetensors"));

    /* model.safetensors wins over the other files */
    stw_tensor one[] = { { "m", "F32", 1, { 1 }, vals + 7, 4 } };
    CHECK(!stw_file(in_dir("model.safetensors"), one, 1));
    rc = moed_st_dir_open(dir, &d, &err);
    CHECK_MSG(rc == 0, "%s", err.msg);
    if (!rc) {
        CHECK(!strcmp(moed_st_dir_layout(d), "model.safetensors"));
        expect_value(d, "m", 8);
        CHECK(!moed_st_find(d, "x.one", &t, &err) && !t);
        moed_st_dir_close(d);
    }

    /* an index wins over both, and opens a shard at its first lookup */
    CHECK(!stw_text(in_dir("model.safetensors.index.json"),
                    "{\"metadata\":{\"total_size\":32},\"weight_map\":{\"x.one\":\"b.safetensors\","
                    "\"y.three\":\"a.safetensors\",\"x.two\":\"b.safetensors\","
                    "\"ghost\":\"a.safetensors\",\"lost\":\"gone.safetensors\"}}"));
    rc = moed_st_dir_open(dir, &d, &err);
    CHECK_MSG(rc == 0, "%s", err.msg);
    if (!rc) {
        CHECK(strstr(moed_st_dir_layout(d), "index.json (3 shards)"));
        CHECK_EQ_INT(moed_st_dir_mapped(d), 0);
        expect_value(d, "x.two", 3);
        CHECK_EQ_INT(moed_st_dir_mapped(d), 1);
        expect_value(d, "x.one", 1);
        CHECK_EQ_INT(moed_st_dir_mapped(d), 1);
        CHECK(!moed_st_find(d, "m", &t, &err) && !t); /* not in the index */
        CHECK_EQ_INT(moed_st_find(d, "ghost", &t, &err), MOED_EFORMAT);
        CHECK(strstr(err.msg, "ghost") && strstr(err.msg, "a.safetensors"));
        CHECK_EQ_INT(moed_st_find(d, "lost", &t, &err), MOED_ENOTFOUND);
        CHECK(strstr(err.msg, "gone.safetensors"));
        CHECK_EQ_INT(moed_st_dir_mapped(d), 2);
        moed_st_dir_close(d);
    }
    CHECK(!stw_text(in_dir("model.safetensors.index.json"),
                    "{\"weight_map\":{\"x.one\":\"../b.safetensors\"}}"));
    CHECK_EQ_INT(moed_st_dir_open(dir, &d, &err), MOED_EFORMAT);
    CHECK(strstr(err.msg, "../b.safetensors"));
    CHECK(!stw_text(in_dir("model.safetensors.index.json"), "{\"weight_map\":{\"x.one\":3}}"));
    CHECK_EQ_INT(moed_st_dir_open(dir, &d, &err), MOED_EFORMAT);
    CHECK(strstr(err.msg, "x.one"));
    CHECK(!stw_text(in_dir("model.safetensors.index.json"), "{\"weight_map\":{"));
    CHECK_EQ_INT(moed_st_dir_open(dir, &d, &err), MOED_EFORMAT);
    CHECK(strstr(err.msg, "model.safetensors.index.json") && strstr(err.msg, "not valid JSON"));
    CHECK(!stw_text(in_dir("model.safetensors.index.json"), "{\"metadata\":{}}"));
    CHECK_EQ_INT(moed_st_dir_open(dir, &d, &err), MOED_EFORMAT);
    CHECK(strstr(err.msg, "weight_map"));
}

static void test_read_and_check(void)
{
    char sub[512];
    moed_st_dir *d;
    moed_error err = { 0 };
    const moed_st_tensor *t = NULL;
    CHECK(!mkdir(stw_path(sub, sizeof sub, dir, "rc"), 0700));
    stw_tensor one[] = { { "a", "F32", 1, { 4 }, vals, 16 },
                         { "b", "F32", 1, { 4 }, vals + 4, 16 } };
    char path[600];
    stw_path(path, sizeof path, sub, "model.safetensors");
    CHECK(!stw_file(path, one, 2));
    int rc = moed_st_dir_open(sub, &d, &err);
    CHECK_MSG(rc == 0, "%s", err.msg);
    if (rc) {
        stw_rmdir(sub);
        return;
    }
    float got[4] = { 0 };
    CHECK(!moed_st_find(d, "b", &t, &err) && t);
    CHECK_EQ_INT(moed_st_read(d, t, got, &err), 0);
    CHECK(!memcmp(got, vals + 4, sizeof got) && !memcmp(got, t->data, sizeof got));
    CHECK_EQ_INT(moed_st_dir_check(d, &err), 0);
    /* Written in place (same size, a later time): the check says so, naming the file. */
    struct timespec later[2] = { { 0, UTIME_OMIT }, { time(NULL) + 60, 0 } };
    CHECK(!utimensat(AT_FDCWD, path, later, 0));
    CHECK_EQ_INT(moed_st_dir_check(d, &err), MOED_EIO);
    CHECK(strstr(err.msg, path) && strstr(err.msg, "changed while moed read it"));
    /* Truncated: a read fails cleanly, where the mapping would fault. */
    CHECK(!truncate(path, 20));
    CHECK_EQ_INT(moed_st_read(d, t, got, &err), MOED_EIO);
    CHECK(strstr(err.msg, path) && strstr(err.msg, "shorter than when opened"));
    CHECK_EQ_INT(moed_st_dir_check(d, &err), MOED_EIO);
    moed_st_dir_close(d);
    stw_rmdir(sub);
}

int main(void)
{
    if (!stw_tmpdir(dir, sizeof dir)) {
        perror("mkdtemp");
        return 1;
    }
    test_valid_file();
    test_bad_files();
    test_dir_layouts();
    test_read_and_check();
    stw_rmdir(dir);
    return check_status("test_safetensors");
}
