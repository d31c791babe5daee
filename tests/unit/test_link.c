/*
 * test_link — the NCCL link's call layout (common/moed_link.h): the payload's offsets against hand
 * arithmetic, every way a header can break the layout refused naming its field, a checked call's
 * ring descriptor (what the daemon validates as a Forward), replies matched by seq.
 */
#include "check.h"
#include "moed_dtype.h"
#include "moed_link.h"
#include "moed_synth.h"

#include <stddef.h>
#include <string.h>

static void test_layout(void)
{
    moed_link_payload p;
    moed_error err;
    /* 3 tokens of 5 bf16 columns: hidden 30 bytes, ids at 256, 3 x 2 x 4 = 24, weights at 512 */
    CHECK_EQ_INT(moed_link_layout(3, 2, 5, 2, &p, &err), 0);
    CHECK(p.hidden == 0 && p.hidden_bytes == 30);
    CHECK(p.ids == 256 && p.ids_bytes == 24);
    CHECK(p.weights == 512 && p.weights_bytes == 24);
    CHECK(p.total == 536);
    /* an exact multiple of 256 is not padded */
    CHECK_EQ_INT(moed_link_layout(128, 8, 7168, 2, &p, &err), 0);
    CHECK(p.ids == 128ull * 7168 * 2 && p.weights == p.ids + 4096 && p.total == p.weights + 4096);
    CHECK_EQ_INT(moed_link_layout(0, 2, 5, 2, &p, &err), MOED_EINVAL);
    CHECK_EQ_INT(moed_link_layout(1, 65, 5, 2, &p, &err), MOED_EINVAL);
    CHECK(strstr(err.msg, "at most 64") != NULL);
    CHECK_EQ_INT(moed_link_layout(UINT64_C(1) << 40, 8, UINT64_C(1) << 30, 4, &p, &err),
                 MOED_EINVAL);
    CHECK(moed_link_reply_bytes(3, 5, 2) == 256 + 30);
    CHECK(moed_link_reply_bytes(UINT64_C(1) << 40, UINT64_C(1) << 30, 4) == 0);
    uint64_t pay, rep;
    CHECK_EQ_INT(moed_link_capacity(16, 4, 10, 4, &pay, &rep, &err), 0);
    CHECK(pay == 1024 + 256 && rep == 256 + 640);
}

static moed_link_call good(void)
{
    moed_link_call c;
    moed_error err;
    CHECK_EQ_INT(moed_link_call_init(&c, 7, 3, MOED_BF16, 3, 2, 5, 1000, 42, &err), 0);
    return c;
}

#define REFUSED(mutate, word)                                                                      \
    do {                                                                                           \
        moed_link_call c = good();                                                                 \
        moed_error e;                                                                              \
        mutate;                                                                                    \
        CHECK_EQ_INT(moed_link_check_call(&c, 7, 16, 8, 4096, &e), MOED_EFORMAT);                  \
        CHECK_MSG(strstr(e.msg, word) != NULL, "%s: %s", #mutate, e.msg);                          \
    } while (0)

static void test_check(void)
{
    moed_link_call ok = good();
    moed_error err;
    CHECK_EQ_INT(moed_link_check_call(&ok, 7, 16, 8, 4096, &err), 0);
    CHECK(ok.payload_bytes == 536);
    REFUSED(c.magic ^= 1, "magic");
    REFUSED(c.version = MOED_LINK_VERSION + 1, "version");
    REFUSED(c.header_bytes = 128, "header_bytes");
    REFUSED(c.seq = 8, "seq 8");
    REFUSED(c.seq = 6, "seq 6");
    REFUSED(c.flags = 2, "flags");
    REFUSED(c.expect_adds_shared = 2, "expect_adds_shared");
    REFUSED(c.reserved = 1, "reserved");
    REFUSED(c.dtype = MOED_I32, "dtype");
    REFUSED(c.dtype = 99, "dtype");
    REFUSED(c.tokens = 0, "tokens");
    REFUSED(c.tokens = 17, "tokens = 17");
    REFUSED(c.top_k = 0, "top_k");
    REFUSED(c.top_k = 9, "top_k = 9");
    REFUSED(c.d_model = 0, "layout");
    REFUSED(c.payload_bytes += 1, "payload_bytes");
    REFUSED(c.payload_bytes = 0, "payload_bytes");
    /* a well-formed call over the link's capacity */
    CHECK_EQ_INT(moed_link_check_call(&ok, 7, 16, 8, 535, &err), MOED_EFORMAT);
    CHECK(strstr(err.msg, "over this link") != NULL);
    /* the caller side refuses what it could not send */
    CHECK_EQ_INT(moed_link_call_init(&ok, 1, 0, MOED_I32, 3, 2, 5, 0, 0, &err), MOED_EINVAL);
    CHECK_EQ_INT(moed_link_call_init(&ok, 1, 0, MOED_F32, 3, 0, 5, 0, 0, &err), MOED_EINVAL);
}

static void test_expect(void)
{
    moed_link_call c = good();
    moed_error err;
    const uint32_t first[10] = { 0, 4, 8, 12, 16, 20, 24, 28, 32, 36 };
    const uint32_t last[10] = { 1, 5, 9, 13, 17, 21, 25, 29, 33, 37 };
    moed_link_call_expect(&c, 0xabcu, first, last, 10, true);
    CHECK_EQ_INT(moed_link_check_call(&c, 7, 16, 8, 4096, &err), 0);
    CHECK(c.flags == MOED_LINK_EXPECT && c.expect_model == 0xabcu && c.expect_n_ranges == 10);
    CHECK(c.expect_adds_shared == 1);
    uint64_t h = 0; /* every range in the hash, the first eight in the header */
    for (int i = 0; i < 10; i++) h = moed_ranges_fold(h, first[i], last[i]);
    CHECK(c.expect_ranges_hash == h);
    CHECK(c.expect_first[7] == 28 && c.expect_last[7] == 29);
    moed_link_call d = good();
    moed_link_call_expect(&d, 0xabcu, first, last, 9, true);
    CHECK(d.expect_ranges_hash != h);
}

static void test_to_ring(void)
{
    moed_link_call c = good();
    moed_ring_request r;
    moed_link_to_ring(&c, 99, 1024, 8192, &r);
    CHECK(r.layer == 3 && r.dtype == MOED_BF16 && r.tokens == 3 && r.top_k == 2);
    CHECK(r.deadline_us == 1000 && r.tag == 42 && r.flags == 0 && r.reserved == 0);
    CHECK(r.hidden.region == 99 && r.hidden.offset == 1024 && r.hidden.length == 30);
    CHECK(r.expert_ids.offset == 1024 + 256 && r.expert_ids.length == 24);
    CHECK(r.expert_weights.offset == 1024 + 512 && r.expert_weights.length == 24);
    CHECK(r.output.region == 99 && r.output.offset == 8192 + 256 && r.output.length == 30);
}

static void test_reply(void)
{
    moed_link_reply r;
    char long_msg[400];
    memset(long_msg, 'x', sizeof long_msg - 1);
    long_msg[sizeof long_msg - 1] = 0;
    moed_link_reply_init(&r, 5, 3, long_msg, 1, 2, 3, 4);
    CHECK(moed_link_reply_matches(&r, 5));
    CHECK(!moed_link_reply_matches(&r, 4));
    CHECK(r.status == 3 && r.queue_us == 1 && r.batch_requests == 4);
    CHECK(strlen(r.message) == MOED_LINK_MESSAGE_BYTES - 1);
    memset(&r, 0, sizeof r); /* a zeroed buffer is no answer */
    CHECK(!moed_link_reply_matches(&r, 0));
    CHECK(offsetof(moed_link_reply, message) == 256 - MOED_LINK_MESSAGE_BYTES);
}

int main(void)
{
    test_layout();
    test_check();
    test_expect();
    test_to_ring();
    test_reply();
    return check_status("test_link");
}
