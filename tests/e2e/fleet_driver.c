/*
 * fleet_driver — one libmoedclient fleet (moedc_connect_many) kept open while a test drives it
 * from stdin, so the test can change the daemons between calls of the same client.
 *
 *   fleet_driver TARGETS HIDDEN IDS WEIGHTS T D K
 *
 * TARGETS is comma-separated; HIDDEN is T x D float32, IDS and WEIGHTS T x K int32 / float32, raw
 * little-endian files. Prints "OPEN" (or "ERR STATUS message" and exits 1), then for each stdin
 * line "call LAYER" one line: "OK <output as hex>" or "ERR STATUS message". Built by the e2e tests
 * against the build's library.
 */
#include "moedclient.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void *slurp(const char *path, size_t n)
{
    void *p = malloc(n);
    FILE *f = fopen(path, "rb");
    if (!p || !f || fread(p, 1, n, f) != n) {
        fprintf(stderr, "cannot read %zu bytes of %s\n", n, path);
        exit(2);
    }
    fclose(f);
    return p;
}

static void say_error(const moedc_error *err)
{
    printf("ERR %s %s\n", moedc_grpc_status_name(moedc_code_to_grpc(err->code)), err->msg);
    fflush(stdout);
}

int main(int argc, char **argv)
{
    if (argc != 8) {
        fprintf(stderr, "usage: fleet_driver TARGETS HIDDEN IDS WEIGHTS T D K\n");
        return 2;
    }
    const int T = atoi(argv[5]), D = atoi(argv[6]), K = atoi(argv[7]);
    const char *targets[64];
    int n = 0;
    for (char *t = strtok(argv[1], ","); t && n < 64; t = strtok(NULL, ",")) targets[n++] = t;
    float *x = slurp(argv[2], sizeof(float) * (size_t)(T * D));
    int32_t *ids = slurp(argv[3], sizeof(int32_t) * (size_t)(T * K));
    float *w = slurp(argv[4], sizeof(float) * (size_t)(T * K));
    moedc_opts opts = { .timeout_s = 30 };
    moedc *c;
    moedc_error err;
    int rc = moedc_connect_many(targets, n, &opts, &c, &err);
    if (rc)
        say_error(&err);
    else
        printf("OPEN\n");
    fflush(stdout);
    char line[64];
    int layer;
    while (!rc && fgets(line, sizeof line, stdin) && sscanf(line, "call %d", &layer) == 1) {
        moedc_request req = { .layer = (uint32_t)layer,
                              .dtype = MOEDC_F32,
                              .tokens = T,
                              .d_model = D,
                              .hidden = x,
                              .routing = MOEDC_ROUTE_EXPERTS,
                              .k = K,
                              .expert_ids = ids,
                              .expert_weights = w };
        moedc_result res;
        if (moedc_forward(c, &req, &res, &err)) {
            say_error(&err);
            continue;
        }
        printf("OK ");
        for (size_t i = 0; i < res.output_bytes; i++)
            printf("%02x", ((const unsigned char *)res.output)[i]);
        printf("\n");
        fflush(stdout);
        moedc_result_free(&res);
    }
    if (!rc) moedc_close(c);
    free(x);
    free(ids);
    free(w);
    return rc ? 1 : 0;
}
