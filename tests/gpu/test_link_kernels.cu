/*
 * test_link_kernels — the links' device code (client/c/lib/link_kernels.cu, which libmoedclient
 * loads as PTX) against the host running the same moedc_link_sum.h: the combine's output bit for
 * bit over random parts (every dtype, one to five shards, tokens a shard got or all of them, the
 * verbatim layer of one shard), a reply out of step or refused leaving the output untouched and
 * counted, the stamp counting a link's calls on the device and zeroing the reply's header, and
 * the gather copying a payload's rows (chosen rows or every one; rows whose width or address
 * allows 16-, 4- or 2-byte units) as the host indexes them.
 */
#include "check.h"
/* C headers of C functions (moed_common), first, so that link_kernels.cu's includes are these */
extern "C" {
#include "moed_dtype.h"
#include "moed_link.h"
#include "moed_synth.h"
}
#include "link_kernels.cu"

#include <cuda_runtime.h>
#include <stdlib.h>
#include <string.h>

static uint64_t counter;
static uint64_t next(void)
{
    return moed_splitmix64(++counter);
}
static float uniform(void)
{
    return (float)(next() >> 40) / (float)(1 << 24);
}

#define CUDA_OK(call) CHECK_MSG((call) == cudaSuccess, "%s", cudaGetErrorString(cudaGetLastError()))

static unsigned long long *d_failures;

/* One combine of n parts, T tokens, d columns: 0 when the device's bits are the host's. */
static void one_case(int dtype, int n, int64_t T, int64_t d, int verbatim, int out_of_step)
{
    const size_t es = moed_dtype_size(dtype);
    moedc_link_part host[MOEDC_LINK_MAX_PARTS];
    moedc_link_parts dev;
    unsigned char *h_rep[8], *d_rep[8];
    int32_t *h_map[8], *d_map[8];
    uint64_t seq[8], *d_seq[8];
    for (int s = 0; s < n; s++) {
        const bool all = verbatim || next() % 3 == 0; /* NULL row_of: every token, in order */
        h_map[s] = (int32_t *)malloc(sizeof(int32_t) * (size_t)T);
        int32_t rows = 0;
        for (int64_t t = 0; t < T; t++) h_map[s][t] = all || next() % 2 ? rows++ : -1;
        const size_t bytes = MOED_LINK_HEADER_BYTES + (size_t)rows * (size_t)d * es;
        h_rep[s] = (unsigned char *)calloc(1, bytes);
        seq[s] = 1 + next() % 1000;
        const uint64_t said = out_of_step && s == n - 1 ? seq[s] - 1 : seq[s];
        moed_link_reply_init((moed_link_reply *)h_rep[s], said, 0, NULL, 0, 0, 0, 0);
        for (int64_t i = 0; i < (int64_t)rows * d; i++)
            moedc_link_store(dtype, h_rep[s] + MOED_LINK_HEADER_BYTES, i, uniform() * 4 - 2);
        CUDA_OK(cudaMalloc(&d_rep[s], bytes));
        CUDA_OK(cudaMemcpy(d_rep[s], h_rep[s], bytes, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMalloc(&d_map[s], sizeof(int32_t) * (size_t)T));
        CUDA_OK(
            cudaMemcpy(d_map[s], h_map[s], sizeof(int32_t) * (size_t)T, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMalloc(&d_seq[s], sizeof(uint64_t)));
        CUDA_OK(cudaMemcpy(d_seq[s], &seq[s], sizeof(uint64_t), cudaMemcpyHostToDevice));
        host[s] = (moedc_link_part){ h_rep[s], all ? NULL : h_map[s], &seq[s] };
        dev.p[s] = (moedc_link_part){ d_rep[s], all ? NULL : d_map[s], d_seq[s] };
    }
    const size_t out_bytes = (size_t)T * (size_t)d * es;
    unsigned char *want = (unsigned char *)malloc(out_bytes),
                  *got = (unsigned char *)malloc(out_bytes);
    memset(want, 0x5a, out_bytes); /* the sentinel a refused call leaves */
    if (moedc_link_replies_ok(host, n))
        for (int64_t t = 0; t < T; t++)
            for (int64_t c = 0; c < d; c++)
                moedc_link_sum_element(dtype, host, n, verbatim, t, d, c, want);
    void *d_out;
    unsigned long long before = 0, after = 0;
    CUDA_OK(cudaMalloc(&d_out, out_bytes));
    CUDA_OK(cudaMemset(d_out, 0x5a, out_bytes));
    CUDA_OK(cudaMemcpy(&before, d_failures, sizeof before, cudaMemcpyDeviceToHost));
    /* fewer rows of blocks than tokens: the launch strides */
    moedc_link_combine<<<dim3((unsigned)((d + 127) / 128), 5), 128>>>(dev, n, verbatim, dtype, T, d,
                                                                      d_out, d_failures);
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaMemcpy(got, d_out, out_bytes, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(&after, d_failures, sizeof after, cudaMemcpyDeviceToHost));
    CHECK_MSG(!memcmp(got, want, out_bytes),
              "dtype %d, %d parts, T %lld, d %lld, verbatim %d, out of step %d: device != host",
              dtype, n, (long long)T, (long long)d, verbatim, out_of_step);
    CHECK_MSG(after - before == (unsigned long long)(out_of_step ? 1 : 0),
              "failures counted %llu for out of step %d", after - before, out_of_step);
    for (int s = 0; s < n; s++) {
        cudaFree(d_rep[s]), cudaFree(d_map[s]), cudaFree(d_seq[s]);
        free(h_rep[s]), free(h_map[s]);
    }
    cudaFree(d_out);
    free(want), free(got);
}

/* The stamp: each launch the next seq, in the header it writes and in the counter, and the
 * reply's header zeroed (the bytes after it untouched). */
static void test_stamp(void)
{
    moed_link_call head, *d_head, got;
    moed_error e;
    CHECK_EQ_INT(moed_link_call_init(&head, 0, 3, MOED_BF16, 5, 2, 64, 0, 9, &e), 0);
    unsigned long long *counter, c = 41;
    uint32_t *d_reply;
    unsigned char reply[MOED_LINK_HEADER_BYTES + 4];
    CUDA_OK(cudaMalloc(&d_head, sizeof head));
    CUDA_OK(cudaMalloc(&counter, sizeof c));
    CUDA_OK(cudaMalloc(&d_reply, sizeof reply));
    CUDA_OK(cudaMemset(d_reply, 0xa5, sizeof reply));
    CUDA_OK(cudaMemcpy(counter, &c, sizeof c, cudaMemcpyHostToDevice));
    for (int i = 0; i < 3; i++) moedc_link_stamp<<<1, 256>>>(head, d_head, counter, d_reply);
    CUDA_OK(cudaMemcpy(&got, d_head, sizeof got, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(&c, counter, sizeof c, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(reply, d_reply, sizeof reply, cudaMemcpyDeviceToHost));
    CHECK_MSG(c == 44 && got.seq == 44, "counter %llu, header seq %llu", c,
              (unsigned long long)got.seq);
    got.seq = 0;
    CHECK(!memcmp(&got, &head, sizeof head)); /* the rest as the host wrote it */
    int zeroed = 1;
    for (int i = 0; i < MOED_LINK_HEADER_BYTES; i++) zeroed &= reply[i] == 0;
    CHECK_MSG(zeroed, "the reply's header was not zeroed");
    CHECK(reply[MOED_LINK_HEADER_BYTES] == 0xa5 && reply[MOED_LINK_HEADER_BYTES + 3] == 0xa5);
    cudaFree(d_head), cudaFree(counter), cudaFree(d_reply);
}

/* The gather of n of R rows (every row when all) of three tensors of the given row widths, the
 * sources `shift` bytes past an allocation's start: each destination row the host's choice. */
static unsigned gather_rows_of_blocks = 1024; /* moedc_link.c's GRID_ROWS */
static void gather_case(int64_t R, int64_t n, int all, const long long bytes[3], int shift)
{
    int32_t *h_rows = (int32_t *)malloc(sizeof(int32_t) * (size_t)(n ? n : 1)), *d_rows = NULL;
    for (int64_t j = 0; j < n; j++) h_rows[j] = all ? (int32_t)j : (int32_t)(next() % R);
    moedc_link_copies copies;
    unsigned char *h_src[3], *d_src[3], *d_dst[3];
    for (int i = 0; i < 3; i++) {
        const size_t sb = (size_t)(R * bytes[i]) + (size_t)shift, db = (size_t)(n * bytes[i]) + 1;
        h_src[i] = (unsigned char *)malloc(sb);
        for (size_t b = 0; b < sb; b++) h_src[i][b] = (unsigned char)next();
        CUDA_OK(cudaMalloc(&d_src[i], sb));
        CUDA_OK(cudaMalloc(&d_dst[i], db));
        CUDA_OK(cudaMemcpy(d_src[i], h_src[i], sb, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemset(d_dst[i], 0, db));
        copies.t[i] = (moedc_link_copy){ d_src[i] + shift, d_dst[i], bytes[i] };
    }
    if (!all) {
        CUDA_OK(cudaMalloc(&d_rows, sizeof(int32_t) * (size_t)(n ? n : 1)));
        CUDA_OK(cudaMemcpy(d_rows, h_rows, sizeof(int32_t) * (size_t)n, cudaMemcpyHostToDevice));
    }
    /* as moedc_link.c launches it: the hidden row in 16-byte units along x, rows along y */
    const unsigned gx = (unsigned)((bytes[0] / 16 + 255) / 256),
                   gy = (unsigned)(n < gather_rows_of_blocks ? (n ? n : 1) : gather_rows_of_blocks);
    moedc_link_gather<<<dim3(gx ? gx : 1, gy), 256>>>(copies, d_rows, n);
    CUDA_OK(cudaDeviceSynchronize());
    for (int i = 0; i < 3; i++) {
        const size_t db = (size_t)(n * bytes[i]);
        unsigned char *got = (unsigned char *)malloc(db + 1);
        CUDA_OK(cudaMemcpy(got, d_dst[i], db + 1, cudaMemcpyDeviceToHost));
        int same = got[db] == 0; /* nothing past the last row */
        for (int64_t j = 0; j < n && same; j++)
            same = !memcmp(got + j * bytes[i], h_src[i] + shift + h_rows[j] * bytes[i],
                           (size_t)bytes[i]);
        CHECK_MSG(same, "gather: %lld of %lld rows (all %d), tensor %d of %lld bytes, shift %d",
                  (long long)n, (long long)R, all, i, bytes[i], shift);
        free(got), free(h_src[i]);
        cudaFree(d_src[i]), cudaFree(d_dst[i]);
    }
    cudaFree(d_rows);
    free(h_rows);
}

static void test_gather(void)
{
    const long long wide[3] = { 7168 * 2, 8 * 4, 8 * 4 }, odd[3] = { 6, 2, 12 },
                    mixed[3] = { 5 * 4, 3 * 4, 64 * 2 };
    const int64_t sizes[][2] = { { 1, 1 }, { 9, 5 }, { 300, 257 }, { 40, 0 } };
    for (int s = 0; s < 4; s++)
        for (int all = 0; all < 2; all++) {
            const int64_t R = sizes[s][0], n = all ? R : sizes[s][1];
            gather_case(R, n, all, wide, 0);
            gather_case(R, n, all, odd, 0);
            gather_case(R, n, all, mixed, 0);
            gather_case(R, n, all, wide, 4); /* 4-byte units where rows allow 16 */
            gather_case(R, n, all, wide, 2);
        }
    gather_rows_of_blocks = 7; /* more rows than the launch has rows of blocks */
    gather_case(5000, 4500, 0, wide, 0);
    gather_case(5000, 4500, 0, odd, 2);
}

int main(void)
{
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count < 1) {
        printf("test_link_kernels: no GPU\n");
        return CHECK_SKIP;
    }
    CUDA_OK(cudaMalloc(&d_failures, sizeof(unsigned long long)));
    CUDA_OK(cudaMemset(d_failures, 0, sizeof(unsigned long long)));
    test_stamp();
    test_gather();
    const int dtypes[] = { MOED_F32, MOED_F16, MOED_BF16 };
    const int64_t Ts[] = { 1, 7, 64 }, ds[] = { 3, 128 };
    for (int a = 0; a < 3; a++)
        for (int n = 1; n <= 5; n++)
            for (int b = 0; b < 3; b++)
                for (int c = 0; c < 2; c++) {
                    one_case(dtypes[a], n, Ts[b], ds[c], 0, 0);
                    if (n == 1) one_case(dtypes[a], 1, Ts[b], ds[c], 1, 0);
                    one_case(dtypes[a], n, Ts[b], ds[c], 0, 1);
                }
    return check_status("test_link_kernels");
}
