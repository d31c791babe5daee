/*
 * test_dtype — names and sizes, and the half-precision conversions: every f16 and bf16 value
 * decoded against a formula, every value round-tripped, and float32 -> half rounding checked as a
 * property (the result is a nearest half value, ties to the even one) over a stride through all
 * 2^32 bit patterns plus the edges: halfway cases, subnormals, overflow, NaN and Inf.
 */
#include "check.h"
#include "moed_dtype.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

static float bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* An f16 value from its fields, by the IEEE 754 definition. */
static double f16_formula(uint16_t h)
{
    int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
    double v = e == 0 ? ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexp(1024 + m, e - 25);
    return s ? -v : v;
}

static void test_names(void)
{
    CHECK_EQ_INT(moed_dtype_size(MOED_F32), 4);
    CHECK_EQ_INT(moed_dtype_size(MOED_BF16), 2);
    CHECK_EQ_INT(moed_dtype_size(MOED_F16), 2);
    CHECK_EQ_INT(moed_dtype_size(MOED_I32), 4);
    CHECK_EQ_INT(moed_dtype_size(9), 0);
    for (int d = MOED_F32; d <= MOED_I32; d++)
        CHECK_EQ_INT(moed_dtype_parse(moed_dtype_name(d)), d);
    CHECK_EQ_INT(moed_dtype_parse("bfloat16"), MOED_BF16);
    CHECK_EQ_INT(moed_dtype_parse("FLOAT16"), MOED_F16);
    CHECK_EQ_INT(moed_dtype_parse("f64"), MOED_DTYPE_NONE);
    CHECK(moed_dtype_is_float(MOED_BF16) && !moed_dtype_is_float(MOED_I32));
}

/* Every half value decodes to its formula and encodes back to itself (NaN stays NaN). */
static void test_all_halves(void)
{
    int bad16 = 0, badb = 0;
    for (uint32_t i = 0; i < 65536; i++) {
        uint16_t h = (uint16_t)i;
        double want = f16_formula(h);
        float f = moed_f16_to_f32(h);
        if (isnan(want) ? !isnan(f) : (double)f != want || !signbit(f) != !signbit(want)) bad16++;
        if (isnan(want) ? !isnan(moed_f16_to_f32(moed_f32_to_f16(f))) : moed_f32_to_f16(f) != h)
            bad16++;
        float b = moed_bf16_to_f32(h);
        CHECK(f32_bits(b) == (uint32_t)h << 16);
        if (isnan(b) ? !isnan(moed_bf16_to_f32(moed_f32_to_bf16(b))) : moed_f32_to_bf16(b) != h)
            badb++;
    }
    CHECK_EQ_INT(bad16, 0);
    CHECK_EQ_INT(badb, 0);
}

/* f16 neighbours of a (finite, non-negative) f16 value h, by magnitude. */
static int f16_rounds_right(float x, uint16_t got)
{
    if (isnan(x)) return isnan(moed_f16_to_f32(got));
    double ax = fabs((double)x);
    uint16_t sign = signbit(x) ? 0x8000 : 0;
    if ((got & 0x8000) != sign) return 0;
    uint16_t m = got & 0x7fff;
    if (ax >= 65520.0) return m == 0x7c00; /* at or past the halfway point to 2^16: Inf */
    if (m >= 0x7c00) return 0;
    double v = f16_formula(m), up = f16_formula((uint16_t)(m + 1));
    double down = m ? f16_formula((uint16_t)(m - 1)) : -1;
    if (m + 1 == 0x7c00) up = 65536.0; /* the rounding boundary above 65504 */
    double d = fabs(ax - v);
    if (d > fabs(ax - up) || (m && d > fabs(ax - down))) return 0;
    if (d == fabs(ax - up) || (m && d == fabs(ax - down))) return (m & 1) == 0; /* tie: even */
    return 1;
}

static int bf16_rounds_right(float x, uint16_t got)
{
    if (isnan(x)) return isnan(moed_bf16_to_f32(got));
    double ax = fabs((double)x);
    if (((got & 0x8000) != 0) != (signbit(x) != 0)) return 0;
    uint16_t m = got & 0x7fff;
    if (isinf(x)) return m == 0x7f80;
    if (m == 0x7f80) /* Inf: only for values at or past the halfway point above the largest */
        return ax >= (double)bits_f32(0x7f7f0000) + ldexp(1, 127 - 8);
    double v = moed_bf16_to_f32(m), up = m + 1 == 0x7f80 ? ldexp(1, 128) : moed_bf16_to_f32(m + 1);
    double down = m ? moed_bf16_to_f32((uint16_t)(m - 1)) : -1;
    double d = fabs(ax - v);
    if (d > fabs(ax - up) || (m && d > fabs(ax - down))) return 0;
    if (d == fabs(ax - up) || (m && d == fabs(ax - down))) return (m & 1) == 0;
    return 1;
}

static void test_rounding_sweep(void)
{
    int bad16 = 0, badb = 0;
    /* a prime stride visits every exponent and many mantissa patterns of both signs */
    for (uint64_t u = 0; u < (1ull << 32); u += 4099) {
        float x = bits_f32((uint32_t)u);
        if (!f16_rounds_right(x, moed_f32_to_f16(x)) && bad16++ < 5)
            fprintf(stderr, "f16: %a -> 0x%04x\n", (double)x, moed_f32_to_f16(x));
        if (!bf16_rounds_right(x, moed_f32_to_bf16(x)) && badb++ < 5)
            fprintf(stderr, "bf16: %a -> 0x%04x\n", (double)x, moed_f32_to_bf16(x));
    }
    CHECK_EQ_INT(bad16, 0);
    CHECK_EQ_INT(badb, 0);
}

/* Exactly halfway between neighbours, and one float32 ulp either side, for every half value. */
static void test_ties(void)
{
    int bad = 0;
    for (uint32_t m = 0; m < 0x7bff; m++) { /* f16: finite, the next one up finite too */
        float mid = (float)((f16_formula((uint16_t)m) + f16_formula((uint16_t)(m + 1))) / 2);
        uint16_t even = (m & 1) ? (uint16_t)(m + 1) : (uint16_t)m;
        bad += moed_f32_to_f16(mid) != even;
        bad += moed_f32_to_f16(-mid) != (even | 0x8000);
        bad += moed_f32_to_f16(nextafterf(mid, 0)) != m;
        bad += moed_f32_to_f16(nextafterf(mid, INFINITY)) != m + 1;
    }
    CHECK_EQ_INT(bad, 0);
    bad = 0;
    for (uint32_t m = 0; m < 0x7f7f; m++) { /* bf16 */
        float mid = bits_f32((m << 16) | 0x8000);
        uint16_t even = (m & 1) ? (uint16_t)(m + 1) : (uint16_t)m;
        bad += moed_f32_to_bf16(mid) != even;
        bad += moed_f32_to_bf16(nextafterf(mid, 0)) != m;
        bad += moed_f32_to_bf16(nextafterf(mid, INFINITY)) != m + 1;
    }
    CHECK_EQ_INT(bad, 0);
}

static void test_edges(void)
{
    /* f16 */
    CHECK_EQ_INT(moed_f32_to_f16(65504.0f), 0x7bff);
    CHECK_EQ_INT(moed_f32_to_f16(nextafterf(65520.0f, 0)), 0x7bff);
    CHECK_EQ_INT(moed_f32_to_f16(65520.0f), 0x7c00);
    CHECK_EQ_INT(moed_f32_to_f16(1e30f), 0x7c00);
    CHECK_EQ_INT(moed_f32_to_f16(-INFINITY), 0xfc00);
    CHECK(isnan(moed_f16_to_f32(moed_f32_to_f16(NAN))));
    CHECK(isnan(moed_f16_to_f32(moed_f32_to_f16(-NAN))));
    CHECK_EQ_INT(moed_f32_to_f16(ldexpf(1, -24)), 0x0001);           /* smallest subnormal */
    CHECK_EQ_INT(moed_f32_to_f16(ldexpf(1, -25)), 0x0000);           /* half of it: tie to 0 */
    CHECK_EQ_INT(moed_f32_to_f16(nextafterf(ldexpf(1, -25), 1)), 1); /* just above: up */
    CHECK_EQ_INT(moed_f32_to_f16(ldexpf(3, -25)), 0x0002);           /* 1.5: tie to 2 */
    CHECK_EQ_INT(moed_f32_to_f16(-ldexpf(1, -26)), 0x8000);          /* underflow keeps sign */
    CHECK_EQ_INT(moed_f32_to_f16(ldexpf(1023, -24)), 0x03ff);        /* largest subnormal */
    CHECK_EQ_INT(moed_f32_to_f16(ldexpf(2047, -25)), 0x0400);        /* rounds up into normals */
    CHECK_EQ_INT(moed_f32_to_f16(-0.0f), 0x8000);
    CHECK_EQ_INT(moed_f32_to_f16(bits_f32(1)), 0x0000); /* float32 subnormal */
    CHECK(moed_f16_to_f32(0x8000) == 0 && signbit(moed_f16_to_f32(0x8000)));
    CHECK(isinf(moed_f16_to_f32(0x7c00)) && isnan(moed_f16_to_f32(0x7e01)));
    /* bf16 */
    CHECK_EQ_INT(moed_f32_to_bf16(INFINITY), 0x7f80);
    CHECK_EQ_INT(moed_f32_to_bf16(-INFINITY), 0xff80);
    CHECK_EQ_INT(moed_f32_to_bf16(bits_f32(0x7f7fffff)), 0x7f80); /* FLT_MAX rounds to Inf */
    CHECK_EQ_INT(moed_f32_to_bf16(bits_f32(0x7f7f7fff)), 0x7f7f);
    uint16_t qn = moed_f32_to_bf16(bits_f32(0x7f800001)); /* signalling NaN: stays NaN */
    CHECK(isnan(moed_bf16_to_f32(qn)) && (qn & 0x40));
    CHECK(isnan(moed_bf16_to_f32(moed_f32_to_bf16(bits_f32(0xffffffff)))));
    CHECK_EQ_INT(moed_f32_to_bf16(bits_f32(0x00008000)), 0x0000); /* subnormal tie to even */
    CHECK_EQ_INT(moed_f32_to_bf16(bits_f32(0x00018000)), 0x0002);
    CHECK_EQ_INT(moed_f32_to_bf16(bits_f32(0x00008001)), 0x0001);
    CHECK_EQ_INT(moed_f32_to_bf16(-0.0f), 0x8000);
}

/* The array conversions agree with the scalar ones. */
static void test_arrays(void)
{
    float src[257], back[257];
    uint16_t h[257];
    for (int i = 0; i < 257; i++) src[i] = (float)((i - 128) * 0.37 + 1e-3 * i * i);
    for (int d = MOED_F32; d <= MOED_BF16; d++) {
        moed_from_f32(d, src, h, 0); /* n = 0 touches nothing */
        float f32[257];
        void *dst = d == MOED_F32 ? (void *)f32 : (void *)h;
        moed_from_f32(d, src, dst, 257);
        moed_to_f32(d, dst, back, 257);
        for (int i = 0; i < 257; i++) {
            float want = d == MOED_F32   ? src[i]
                         : d == MOED_F16 ? moed_f16_to_f32(moed_f32_to_f16(src[i]))
                                         : moed_bf16_to_f32(moed_f32_to_bf16(src[i]));
            CHECK(back[i] == want);
        }
    }
}

int main(void)
{
    test_names();
    test_all_halves();
    test_rounding_sweep();
    test_ties();
    test_edges();
    test_arrays();
    return check_status("test_dtype");
}
