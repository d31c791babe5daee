/*
 * test_synth — the synthetic spec (defaults, round trip, every error) and the generator: splitmix64
 * against its published test vectors, elements recomputed here from the header's formula, slices
 * against full fills, and whole layers (threaded) against single fills.
 */
#include "check.h"
#include "moed_dtype.h"
#include "moed_synth.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static void test_defaults_and_format(void)
{
    moed_synth_spec s;
    moed_error err = { 0 };
    CHECK_EQ_INT(moed_synth_parse("", &s, &err), 0);
    const moed_layer_info *li = &s.layer;
    CHECK(s.layers == 2 && li->d_model == 256 && li->d_ff == 512 && li->n_experts == 8);
    CHECK(li->top_k == 2 && li->act == MOED_ACT_SWIGLU && li->wdtype == MOED_BF16 && s.seed == 1);
    CHECK(li->has_router && li->norm_topk && li->n_shared == 0 && li->shared_d_ff == 0);
    CHECK(li->rule == MOED_RULE_SOFTMAX_TOPK && li->n_group == 1 && li->topk_group == 1);
    CHECK(li->routed_scale == 1.0f);
    char buf[512];
    moed_synth_format(&s, buf, sizeof buf);
    CHECK_MSG(!strcmp(buf, "layers=2,d=256,ff=512,experts=8,topk=2,act=swiglu,dtype=bf16,seed=1,"
                           "router=1,norm=1,shared=0,shared_ff=0,rule=softmax,groups=1,"
                           "topk_groups=1,scale=1"),
              "%s", buf);

    const char *spec = "scale=2.5,rule=deepseek,groups=4,topk_groups=2,experts=16,topk=4,d=64,"
                       "ff=96,act=gelu,dtype=f16,seed=18446744073709551615,router=0,norm=0,"
                       "shared=2,shared_ff=192,layers=3";
    CHECK_EQ_INT(moed_synth_parse(spec, &s, &err), 0);
    CHECK(s.layers == 3 && li->d_model == 64 && li->d_ff == 96 && li->n_experts == 16);
    CHECK(li->top_k == 4 && li->act == MOED_ACT_GELU && li->wdtype == MOED_F16);
    CHECK(s.seed == UINT64_MAX && !li->has_router && !li->norm_topk);
    CHECK(li->n_shared == 2 && li->shared_d_ff == 192 && li->rule == MOED_RULE_DEEPSEEK_V3);
    CHECK(li->n_group == 4 && li->topk_group == 2 && li->routed_scale == 2.5f);
    moed_synth_format(&s, buf, sizeof buf);
    moed_synth_spec back;
    CHECK_EQ_INT(moed_synth_parse(buf, &back, &err), 0);
    CHECK(memcmp(&back, &s, sizeof s) == 0);
    CHECK(strstr(buf, "seed=18446744073709551615") && strstr(buf, "scale=2.5"));
}

static void test_errors(void)
{
    struct {
        const char *spec, *msg;
    } bad[] = {
        { "foo=1", "unknown key 'foo'" },
        { "d=abc", "d=abc is not valid" },
        { "d=0", "d=0 is not valid" },
        { "ff=-4", "ff=-4 is not valid" },
        { "layers=2x", "layers=2x is not valid" },
        { "experts=8,topk=9", "topk=9 is more than experts=8" },
        { "act=tanh", "act=tanh is not valid" },
        { "dtype=i32", "dtype=i32 is not valid" },
        { "seed=-1", "seed=-1 is not valid" },
        { "router=2", "router=2 is not valid" },
        { "rule=mixtral", "rule=mixtral is not valid" },
        { "scale=0", "scale=0 is not valid" },
        { "scale=nan", "scale=nan is not valid" },
        { "layers", "'layers' is not key=value" },
        { "d=1,d=2", "key 'd' is given twice" },
        { "shared=1", "shared=1 with shared_ff=0" },
        { "shared_ff=64", "shared=0 with shared_ff=64" },
        { "groups=2", "need rule=deepseek" },
        { "rule=deepseek,groups=3", "groups=3 does not divide experts=8" },
        { "rule=deepseek,groups=4,topk_groups=5", "topk_groups=5 is more than groups=4" },
        { "rule=deepseek,groups=4,topk_groups=1,topk=3", "topk=3 is more than the 2 experts" },
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        moed_synth_spec s;
        moed_error err = { 0 };
        CHECK_EQ_INT(moed_synth_parse(bad[i].spec, &s, &err), MOED_EINVAL);
        CHECK_MSG(strstr(err.msg, bad[i].msg) != NULL, "spec '%s': got '%s', want '%s'",
                  bad[i].spec, err.msg, bad[i].msg);
    }
}

/* ---- the generator ------------------------------------------------------------------------ */

static void test_splitmix(void)
{
    /* splitmix64 seeded with s returns mix(s + golden), mix(s + 2 golden), ...: the published
     * outputs for seeds 0 and 1234567 */
    CHECK(moed_splitmix64(0) == 0xE220A8397B1DCDAFull);
    CHECK(moed_splitmix64(1234567) == 6457827717110365317ull);
    CHECK(moed_splitmix64(1234567 + 0x9E3779B97F4A7C15ull) == 3203168211198807973ull);
    CHECK(moed_splitmix64(1234567 + 2 * 0x9E3779B97F4A7C15ull) == 9817491932198370423ull);
}

/* The header's formula, written out once more. */
static double expected(uint64_t seed, int layer, int tensor, int expert, int fan_in, uint64_t i)
{
    uint64_t key = moed_splitmix64(moed_splitmix64(seed) ^ ((uint64_t)layer << 40) ^
                                   ((uint64_t)tensor << 32) ^ (uint64_t)expert);
    double u = (double)(moed_splitmix64(key + i) >> 40) / 16777216.0;
    double scale = tensor == MOED_SYNTH_BIAS ? 0.1 : sqrt(3.0 / fan_in);
    return (float)((2 * u - 1) * scale);
}

static void test_values(void)
{
    static const struct {
        uint64_t seed;
        int layer, tensor, expert, fan_in;
    } c[] = {
        { 1, 0, MOED_SYNTH_W1, 0, 256 },       { 1, 1, MOED_SYNTH_W3, 7, 4096 },
        { 42, 3, MOED_SYNTH_W2, 255, 14336 },  { 7, 0, MOED_SYNTH_ROUTER, 0, 7168 },
        { 9, 60, MOED_SYNTH_SHARED_W2, 0, 3 }, { 5, 2, MOED_SYNTH_BIAS, 0, 1 },
    };
    for (size_t k = 0; k < sizeof c / sizeof c[0]; k++) {
        uint64_t first = 1000003 * k;
        float f[64];
        uint16_t b[64], h[64];
        moed_synth_fill(c[k].seed, c[k].layer, c[k].tensor, c[k].expert, c[k].fan_in, MOED_F32,
                        first, 64, f);
        moed_synth_fill(c[k].seed, c[k].layer, c[k].tensor, c[k].expert, c[k].fan_in, MOED_BF16,
                        first, 64, b);
        moed_synth_fill(c[k].seed, c[k].layer, c[k].tensor, c[k].expert, c[k].fan_in, MOED_F16,
                        first, 64, h);
        for (int i = 0; i < 64; i++) {
            float v = (float)expected(c[k].seed, c[k].layer, c[k].tensor, c[k].expert, c[k].fan_in,
                                      first + (uint64_t)i);
            CHECK(f[i] == v);
            CHECK(b[i] == moed_f32_to_bf16(v));
            CHECK(h[i] == moed_f32_to_f16(v));
        }
    }
    /* uniform on (-a, a) with a = sqrt(3 / fan_in): variance 1 / fan_in */
    enum { N = 1 << 20 };
    float *v = malloc(N * sizeof *v);
    moed_synth_fill(3, 1, MOED_SYNTH_W1, 2, 48, MOED_F32, 0, N, v);
    double a = sqrt(3.0 / 48), mean = 0, var = 0, lo = 1, hi = -1;
    for (int i = 0; i < N; i++) {
        mean += v[i];
        var += (double)v[i] * v[i];
        lo = fmin(lo, v[i]);
        hi = fmax(hi, v[i]);
    }
    mean /= N;
    var = var / N - mean * mean;
    CHECK(lo >= -a && hi < a && lo < -0.99 * a && hi > 0.99 * a);
    CHECK_NEAR(mean, 0, 3 * a / sqrt(3.0 * N) * 2);
    CHECK_NEAR(var, 1.0 / 48, 0.01 / 48);
    /* a slice alone equals the same slice of a full fill */
    float *s = malloc(1000 * sizeof *s);
    moed_synth_fill(3, 1, MOED_SYNTH_W1, 2, 48, MOED_F32, 123457, 1000, s);
    CHECK(memcmp(s, v + 123457, 1000 * sizeof *s) == 0);
    free(s);
    free(v);
}

/* Checks tensor p (n elements) of a synthetic layer against a single-threaded fill. */
static void check_tensor(const moed_synth_spec *s, int layer, int tensor, int expert, int fan_in,
                         int dtype, uint64_t n, const void *p)
{
    CHECK_MSG(p != NULL, "layer %d tensor %d expert %d missing", layer, tensor, expert);
    if (!p) return;
    size_t bytes = n * moed_dtype_size(dtype);
    void *want = malloc(bytes);
    moed_synth_fill(s->seed, layer, tensor, expert, fan_in, dtype, 0, n, want);
    CHECK_MSG(memcmp(want, p, bytes) == 0, "layer %d tensor %d expert %d differs", layer, tensor,
              expert);
    free(want);
}

static void test_layers(void)
{
    moed_synth_spec s;
    moed_error err = { 0 };
    /* W1 of 640 x 1024 spans several generator tasks */
    CHECK_EQ_INT(moed_synth_parse("layers=2,d=640,ff=1024,experts=3,topk=2,rule=deepseek,"
                                  "shared=1,shared_ff=200,seed=77",
                                  &s, &err),
                 0);
    moed_layer l;
    CHECK_EQ_INT(moed_synth_layer(&s, 1, &l, &err), 0);
    CHECK_EQ_INT(l.info.index, 1);
    uint64_t d = 640, ff = 1024;
    for (int e = 0; e < 3; e++) {
        check_tensor(&s, 1, MOED_SYNTH_W1, e, 640, MOED_BF16, ff * d, l.experts[e].w1);
        check_tensor(&s, 1, MOED_SYNTH_W3, e, 640, MOED_BF16, ff * d, l.experts[e].w3);
        check_tensor(&s, 1, MOED_SYNTH_W2, e, 1024, MOED_BF16, ff * d, l.experts[e].w2);
    }
    check_tensor(&s, 1, MOED_SYNTH_ROUTER, 0, 640, MOED_BF16, 3 * d, l.router);
    check_tensor(&s, 1, MOED_SYNTH_BIAS, 0, 1, MOED_F32, 3, l.router_bias);
    check_tensor(&s, 1, MOED_SYNTH_SHARED_W1, 0, 640, MOED_BF16, 200 * d, l.shared.w1);
    check_tensor(&s, 1, MOED_SYNTH_SHARED_W3, 0, 640, MOED_BF16, 200 * d, l.shared.w3);
    check_tensor(&s, 1, MOED_SYNTH_SHARED_W2, 0, 200, MOED_BF16, 200 * d, l.shared.w2);
    CHECK(fabsf(l.router_bias[2]) < 0.1f);
    moed_synth_free_layer(&l);
    CHECK(l.experts == NULL);

    /* gelu: no W3; no router; softmax rule: no bias; no shared experts */
    CHECK_EQ_INT(moed_synth_parse("layers=1,d=8,ff=4,experts=2,topk=1,act=gelu,router=0,dtype=f32",
                                  &s, &err),
                 0);
    CHECK_EQ_INT(moed_synth_layer(&s, 0, &l, &err), 0);
    CHECK(l.experts[1].w1 && !l.experts[1].w3 && l.experts[1].w2);
    CHECK(!l.router && !l.router_bias && !l.shared.w1 && !l.shared.w2);
    check_tensor(&s, 0, MOED_SYNTH_W2, 1, 4, MOED_F32, 32, l.experts[1].w2);
    moed_synth_free_layer(&l);
    CHECK_EQ_INT(moed_synth_layer(&s, 1, &l, &err), MOED_EINVAL);
    CHECK(strstr(err.msg, "layer 1 does not exist") != NULL);
}

int main(void)
{
    test_defaults_and_format();
    test_errors();
    test_splitmix();
    test_values();
    test_layers();
    return check_status("test_synth");
}
