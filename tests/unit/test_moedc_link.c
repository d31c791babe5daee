/*
 * test_moedc_link — the host side of libmoedclient's links, without a GPU:
 *
 *   test_moedc_link           the combine's sum (moedc_link_sum.h, the code the kernel runs) equal
 *                             bit for bit to the gRPC fleet's (moedc_plan_sum) over
 *                             $MOED_TEST_DATA/fleet_scenarios.json's sums, parts of some tokens
 *                             included; a missing, stale or refused reply stops the combine
 *   test_moedc_link no-nccl   (MOED_NCCL_LIB naming no library) moedc_links_open fails
 *                             MOEDC_EUNSUPPORTED naming MOED_NCCL_LIB before asking any daemon (its
 *                             target has none: asking would fail UNAVAILABLE)
 */
#include "check.h"
#include "moed_dtype.h"
#include "moedc_link_sum.h"
#include "moedc_plan.h"

#include <cjson/cJSON.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_PARTS 8

static const cJSON *get(const cJSON *o, const char *key)
{
    return cJSON_GetObjectItemCaseSensitive(o, key);
}

static void bits_of(const cJSON *list, size_t size, unsigned char *out)
{
    for (int i = 0; i < cJSON_GetArraySize(list); i++) {
        const uint32_t v = (uint32_t)cJSON_GetArrayItem(list, i)->valuedouble;
        memcpy(out + (size_t)i * size, &v, size); /* little-endian: the low bytes */
    }
}

/* One scenario: each part laid out as a link's reply (header, then its rows), summed element by
 * element as the kernel does, against the table's bits and moedc_plan_sum's. */
static void test_scenario(const cJSON *sc)
{
    const char *name = get(sc, "name")->valuestring, *dt_name = get(sc, "dtype")->valuestring;
    const int dt = moed_dtype_parse(dt_name);
    const size_t size = moed_dtype_size(dt);
    const cJSON *parts = get(sc, "parts"), *want = get(sc, "sum"), *rows = get(sc, "rows");
    const int n = cJSON_GetArraySize(parts);
    const size_t count = (size_t)cJSON_GetArraySize(want);
    const int64_t T = rows ? get(sc, "tokens")->valueint : (int64_t)count;
    const int64_t d = (int64_t)count / T;
    CHECK(n <= MAX_PARTS && T <= 64);
    unsigned char *replies[MAX_PARTS], expect[256], out[256], plan_out[256];
    int32_t row_of[MAX_PARTS][64];
    int64_t lists[MAX_PARTS][64], n_rows[MAX_PARTS];
    const int64_t *row_ptrs[MAX_PARTS];
    const void *outs[MAX_PARTS];
    moedc_link_part lp[MAX_PARTS];
    static const uint64_t seven = 7;
    for (int i = 0; i < n; i++) {
        const cJSON *list = rows ? cJSON_GetArrayItem(rows, i) : NULL;
        n_rows[i] = list ? cJSON_GetArraySize(list) : T;
        for (int64_t t = 0; t < T; t++) row_of[i][t] = list ? -1 : (int32_t)t;
        for (int64_t j = 0; list && j < n_rows[i]; j++) {
            lists[i][j] = cJSON_GetArrayItem(list, (int)j)->valueint;
            row_of[i][lists[i][j]] = (int32_t)j;
        }
        row_ptrs[i] = list ? lists[i] : NULL;
        replies[i] = calloc(1, MOED_LINK_HEADER_BYTES + (size_t)n_rows[i] * (size_t)d * size);
        moed_link_reply_init((moed_link_reply *)replies[i], 7, 0, NULL, 0, 0, 0, 0);
        bits_of(cJSON_GetArrayItem(parts, i), size, replies[i] + MOED_LINK_HEADER_BYTES);
        outs[i] = replies[i] + MOED_LINK_HEADER_BYTES;
        lp[i] = (moedc_link_part){ replies[i], rows || i % 2 ? row_of[i] : NULL, &seven };
    }
    bits_of(want, size, expect);
    CHECK(moedc_link_replies_ok(lp, n));
    for (int64_t t = 0; t < T; t++)
        for (int64_t c = 0; c < d; c++) moedc_link_sum_element(dt, lp, n, 0, t, d, c, out);
    moedc_error err;
    CHECK_EQ_INT(moedc_plan_sum(dt, outs, row_ptrs, n_rows, n, T, d, plan_out, &err), 0);
    CHECK_MSG(!memcmp(out, expect, count * size), "%s: the link's sum is not the table's", name);
    CHECK_MSG(!memcmp(out, plan_out, count * size), "%s: the link's sum is not the fleet's", name);
    /* a layer of one shard: that shard's reply, verbatim */
    for (int64_t t = 0; !rows && t < T; t++)
        for (int64_t c = 0; c < d; c++) moedc_link_sum_element(dt, lp, 1, 1, t, d, c, out);
    CHECK_MSG(rows || !memcmp(out, outs[0], count * size), "%s: verbatim", name);
    for (int i = 0; i < n; i++) free(replies[i]);
}

/* The combine writes nothing unless every reply is its call's and OK. */
static void test_replies(void)
{
    static unsigned char a[MOED_LINK_HEADER_BYTES + 4], b[MOED_LINK_HEADER_BYTES + 4];
    int32_t map[1] = { 0 };
    static const uint64_t three = 3, five = 5;
    moedc_link_part lp[2] = { { a, map, &three }, { b, NULL, &five } };
    moed_link_reply_init((moed_link_reply *)a, 3, 0, NULL, 0, 0, 0, 0);
    moed_link_reply_init((moed_link_reply *)b, 5, 0, NULL, 0, 0, 0, 0);
    CHECK(moedc_link_replies_ok(lp, 2));
    moed_link_reply_init((moed_link_reply *)b, 4, 0, NULL, 0, 0, 0, 0); /* the call before's */
    CHECK(!moedc_link_replies_ok(lp, 2));
    memset(b, 0, sizeof b); /* zeroed before the call, never written: no answer */
    CHECK(!moedc_link_replies_ok(lp, 2));
    moed_link_reply_init((moed_link_reply *)b, 5, 3, "bad layer", 0, 0, 0, 0);
    CHECK(!moedc_link_replies_ok(lp, 2));
    CHECK(moedc_link_replies_ok(lp, 1));
}

static void test_no_nccl(void)
{
    moedc *c = NULL;
    moedc_links *l = NULL;
    moedc_error err = { 0 };
    CHECK_EQ_INT(moedc_connect("127.0.0.1:1", NULL, &c, &err), 0);
    moedc_links_opts o = { .device = 0, .max_tokens = 16, .max_top_k = 2, .send = 7 };
    CHECK_EQ_INT(moedc_links_open(c, &o, &l, &err), MOEDC_EINVAL); /* before NCCL is looked for */
    CHECK_MSG(strstr(err.msg, "send 7") && strstr(err.msg, "MOEDC_LINKS_SEND_ALL"), "%s", err.msg);
    o.send = MOEDC_LINKS_SEND_ALL;
    CHECK_EQ_INT(moedc_links_open(c, &o, &l, &err), MOEDC_EUNSUPPORTED);
    CHECK_MSG(strstr(err.msg, "MOED_NCCL_LIB") != NULL, "%s", err.msg);
    CHECK(l == NULL);
    CHECK(!strcmp(moedc_links_describe(NULL), "links are not open"));
    moedc_close(c);
}

int main(int argc, char **argv)
{
    if (argc > 1 && !strcmp(argv[1], "no-nccl")) {
        test_no_nccl();
        return check_status("test_moedc_link no-nccl");
    }
    char path[4096];
    const char *dir = getenv("MOED_TEST_DATA");
    snprintf(path, sizeof path, "%s/fleet_scenarios.json", dir ? dir : "tests/data");
    FILE *f = fopen(path, "rb");
    CHECK_MSG(f != NULL, "cannot open %s", path);
    if (!f) return check_status("test_moedc_link");
    static char text[1 << 20];
    text[fread(text, 1, sizeof text - 1, f)] = 0;
    fclose(f);
    cJSON *root = cJSON_Parse(text);
    const cJSON *sums = get(root, "sums");
    for (int i = 0; i < cJSON_GetArraySize(sums); i++) test_scenario(cJSON_GetArrayItem(sums, i));
    CHECK(cJSON_GetArraySize(sums) >= 5);
    test_replies();
    cJSON_Delete(root);
    return check_status("test_moedc_link");
}
