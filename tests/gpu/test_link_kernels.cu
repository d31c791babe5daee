/*
 * test_link_kernels — the links' device code (client/c/lib/link_kernels.cu, which libmoedclient
 * loads as PTX) against the host running the same moedc_link_sum.h: the combine's output bit for
 * bit over random parts (every dtype, one to five shards, tokens a shard got or all of them, the
 * verbatim layer of one shard), a reply out of step or refused leaving the output untouched and
 * counted, and the stamp counting a link's calls on the device.
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
    moedc_link_combine<<<7, 128>>>(dev, n, verbatim, dtype, T, d, d_out, d_failures);
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

/* The stamp: each launch the next seq, in the header it writes and in the counter. */
static void test_stamp(void)
{
    moed_link_call head, *d_head, got;
    moed_error e;
    CHECK_EQ_INT(moed_link_call_init(&head, 0, 3, MOED_BF16, 5, 2, 64, 0, 9, &e), 0);
    unsigned long long *counter, c = 41;
    CUDA_OK(cudaMalloc(&d_head, sizeof head));
    CUDA_OK(cudaMalloc(&counter, sizeof c));
    CUDA_OK(cudaMemcpy(counter, &c, sizeof c, cudaMemcpyHostToDevice));
    for (int i = 0; i < 3; i++) moedc_link_stamp<<<1, 256>>>(head, d_head, counter);
    CUDA_OK(cudaMemcpy(&got, d_head, sizeof got, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(&c, counter, sizeof c, cudaMemcpyDeviceToHost));
    CHECK_MSG(c == 44 && got.seq == 44, "counter %llu, header seq %llu", c,
              (unsigned long long)got.seq);
    got.seq = 0;
    CHECK(!memcmp(&got, &head, sizeof head)); /* the rest as the host wrote it */
    cudaFree(d_head), cudaFree(counter);
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
