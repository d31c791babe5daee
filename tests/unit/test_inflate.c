/*
 * test_inflate — compressed requests (--accept-compression): gzip and deflate bodies, split over
 * many slices as gRPC hands them, come out whole; a body that inflates past --max-message-bytes
 * fails with MOED_ETOOBIG naming the flag after at most that many bytes; truncated or corrupt
 * bodies fail with MOED_EFORMAT; uncompressed buffers pass untouched.
 */
#include "check.h"
#include "rpc_call.h"

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#define PLAIN_BYTES (300 * 1000)

static unsigned char plain[PLAIN_BYTES];

/* plain compressed in gRPC's gzip (RFC 1952) or deflate (zlib, RFC 1950) format. */
static size_t compress_as(grpc_compression_algorithm algo, unsigned char *out, size_t cap)
{
    z_stream z;
    memset(&z, 0, sizeof z);
    CHECK_EQ_INT(deflateInit2(&z, 6, Z_DEFLATED, algo == GRPC_COMPRESS_GZIP ? 31 : 15, 8,
                              Z_DEFAULT_STRATEGY),
                 Z_OK);
    z.next_in = plain;
    z.avail_in = PLAIN_BYTES;
    z.next_out = out;
    z.avail_out = (uInt)cap;
    CHECK_EQ_INT(deflate(&z, Z_FINISH), Z_STREAM_END);
    size_t n = cap - z.avail_out;
    deflateEnd(&z);
    return n;
}

/* A compressed byte buffer of data[0, n), in slices of `piece` bytes. */
static grpc_byte_buffer *buffer(grpc_compression_algorithm algo, const unsigned char *data,
                                size_t n, size_t piece)
{
    grpc_slice s[4096];
    size_t k = 0;
    for (size_t off = 0; off < n; off += piece)
        s[k++] = grpc_slice_from_copied_buffer((const char *)data + off,
                                               n - off < piece ? n - off : piece);
    grpc_byte_buffer *bb = grpc_raw_compressed_byte_buffer_create(s, k, algo);
    for (size_t i = 0; i < k; i++) grpc_slice_unref(s[i]);
    return bb;
}

static int inflate_into(int64_t limit, grpc_byte_buffer **bb, moed_error *err)
{
    moed_rpc r;
    memset(&r, 0, sizeof r);
    r.cfg.max_message_bytes = limit;
    rpc_call c = { .rpc = &r }; /* no grpc_call: its flags are the e2e tests' */
    return rpc_inflate(&c, bb, err);
}

static void expect_plain(grpc_byte_buffer *bb)
{
    CHECK(bb->data.raw.compression == GRPC_COMPRESS_NONE);
    CHECK_EQ_INT(grpc_byte_buffer_length(bb), PLAIN_BYTES);
    grpc_byte_buffer_reader rd;
    CHECK(grpc_byte_buffer_reader_init(&rd, bb));
    grpc_slice all = grpc_byte_buffer_reader_readall(&rd);
    CHECK(GRPC_SLICE_LENGTH(all) == PLAIN_BYTES &&
          !memcmp(GRPC_SLICE_START_PTR(all), plain, PLAIN_BYTES));
    grpc_slice_unref(all);
    grpc_byte_buffer_reader_destroy(&rd);
}

int main(void)
{
    grpc_init();
    for (size_t i = 0; i < PLAIN_BYTES; i++)
        plain[i] = (unsigned char)((i * 2654435761u) >> 13) % 7;
    static unsigned char z[PLAIN_BYTES * 2];
    grpc_compression_algorithm algos[2] = { GRPC_COMPRESS_GZIP, GRPC_COMPRESS_DEFLATE };
    moed_error err;
    for (int a = 0; a < 2; a++) {
        size_t n = compress_as(algos[a], z, sizeof z);
        size_t pieces[3] = { 1 << 20, 4096, 7 };
        for (int p = 0; p < 3; p++) {
            grpc_byte_buffer *bb = buffer(algos[a], z, n, pieces[p]);
            CHECK_MSG(inflate_into(PLAIN_BYTES, &bb, &err) == 0, "%s", err.msg);
            expect_plain(bb);
            grpc_byte_buffer_destroy(bb);
        }
        grpc_byte_buffer *bb = buffer(algos[a], z, n, 4096);
        CHECK_EQ_INT(inflate_into(PLAIN_BYTES - 1, &bb, &err), MOED_ETOOBIG);
        CHECK_MSG(strstr(err.msg, "--max-message-bytes") != NULL, "%s", err.msg);
        grpc_byte_buffer_destroy(bb);
        bb = buffer(algos[a], z, n / 2, 4096);
        CHECK_EQ_INT(inflate_into(PLAIN_BYTES, &bb, &err), MOED_EFORMAT);
        CHECK_MSG(strstr(err.msg, "ends early") != NULL, "%s", err.msg);
        grpc_byte_buffer_destroy(bb);
        z[0] ^= 0xff; /* not the format its grpc-encoding names */
        bb = buffer(algos[a], z, n, 4096);
        CHECK_EQ_INT(inflate_into(PLAIN_BYTES, &bb, &err), MOED_EFORMAT);
        CHECK_MSG(strstr(err.msg, "header") != NULL, "%s", err.msg);
        grpc_byte_buffer_destroy(bb);
    }
    grpc_slice s = grpc_slice_from_static_buffer(plain, PLAIN_BYTES);
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1), *same = bb;
    CHECK_EQ_INT(inflate_into(1, &bb, &err), 0); /* not compressed: not looked at */
    CHECK(bb == same);
    grpc_byte_buffer_destroy(bb);
    grpc_shutdown();
    return check_status("test_inflate");
}
