/*
 * test_dtype — names and sizes, and the half-precision conversions: every f16 and bf16 value
 * decoded against a formula, every value round-tripped, and float32 -> half rounding checked as a
 * property (the result is a nearest half value, ties to the even one) over a stride through all
 * 2^32 bit patterns plus the edges: halfway cases, subnormals, overflow, NaN and Inf. The same for
 * e4m3 (FP8): all 256 codes against the OCP formula, every rounding boundary (the midpoint of each
 * pair of neighbours and one float32 ulp either side), saturation at 448 and NaN; and the block
 * quantizer and scale check of moed_fp8.h.
 */
#include "check.h"
#include "moed_dtype.h"
#include "moed_fp8.h"

#include <float.h>
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
    CHECK(!moed_dtype_is_float(MOED_FP8) && moed_dtype_is_weight(MOED_FP8) &&
          moed_dtype_is_weight(MOED_F32) && !moed_dtype_is_weight(MOED_I32));
    CHECK_EQ_INT(moed_dtype_size(MOED_FP8), 1);
    CHECK_EQ_INT(moed_dtype_parse("fp8"), MOED_FP8);
    CHECK_EQ_INT(moed_dtype_parse("float8_e4m3fn"), MOED_FP8);
    CHECK(!strcmp(moed_dtype_name(MOED_FP8), "fp8"));
}

/* An e4m3 code's value by the OCP definition: (-1)^s 2^(e-7) (1 + m/8), subnormal 2^-6 m/8. */
static double e4m3_formula(uint8_t q)
{
    int s = q >> 7, e = (q >> 3) & 15, m = q & 7;
    double v = e == 15 && m == 7 ? NAN : e == 0 ? ldexp(m, -9) : ldexp(8 + m, e - 10);
    return s ? -v : v;
}

/* Every code decodes to its formula (the sign of zero too) and encodes back to itself. */
static void test_e4m3_codes(void)
{
    int bad = 0;
    for (int i = 0; i < 256; i++) {
        const uint8_t q = (uint8_t)i;
        const double want = e4m3_formula(q);
        const float f = moed_e4m3_to_f32(q);
        if (isnan(want)) {
            bad += !isnan(f) || moed_f32_to_e4m3(f) != q; /* NaN keeps its sign's code */
            continue;
        }
        bad += (double)f != want || !signbit(f) != !signbit(want);
        bad += moed_f32_to_e4m3(f) != q;
    }
    CHECK_EQ_INT(bad, 0);
    CHECK_EQ_INT(e4m3_formula(0x7e) == 448.0 && e4m3_formula(0x01) == ldexp(1, -9), 1);
}

/* The midpoint between each pair of neighbouring codes rounds to the even one, and one float32
 * ulp below or above it to the nearer one; both signs. */
static void test_e4m3_ties(void)
{
    int bad = 0;
    for (int m = 0; m < 0x7e; m++) {
        const float lo = moed_e4m3_to_f32((uint8_t)m), hi = moed_e4m3_to_f32((uint8_t)(m + 1));
        const float mid = (float)(((double)lo + hi) / 2); /* exact: 5 significant bits at most */
        const uint8_t even = (m & 1) ? (uint8_t)(m + 1) : (uint8_t)m;
        bad += moed_f32_to_e4m3(mid) != even;
        bad += moed_f32_to_e4m3(-mid) != (even | 0x80);
        bad += moed_f32_to_e4m3(nextafterf(mid, 0)) != m;
        bad += moed_f32_to_e4m3(nextafterf(mid, INFINITY)) != m + 1;
        bad += moed_f32_to_e4m3(-nextafterf(mid, INFINITY)) != ((m + 1) | 0x80);
    }
    CHECK_EQ_INT(bad, 0);
    /* saturation and the specials */
    CHECK_EQ_INT(moed_f32_to_e4m3(448.0f), 0x7e);
    CHECK_EQ_INT(moed_f32_to_e4m3(464.0f), 0x7e); /* the tie past 448 (480 is NaN's slot) */
    CHECK_EQ_INT(moed_f32_to_e4m3(1e30f), 0x7e);
    CHECK_EQ_INT(moed_f32_to_e4m3(INFINITY), 0x7e);
    CHECK_EQ_INT(moed_f32_to_e4m3(-INFINITY), 0xfe);
    CHECK_EQ_INT(moed_f32_to_e4m3(NAN) & 0x7f, 0x7f);
    CHECK_EQ_INT(moed_f32_to_e4m3(ldexpf(1, -10)), 0x00); /* half the smallest subnormal: even */
    CHECK_EQ_INT(moed_f32_to_e4m3(nextafterf(ldexpf(1, -10), 1)), 0x01);
    CHECK_EQ_INT(moed_f32_to_e4m3(-ldexpf(1, -12)), 0x80); /* underflow keeps the sign */
    CHECK_EQ_INT(moed_f32_to_e4m3(bits_f32(1)), 0x00);     /* float32 subnormal */
    CHECK_EQ_INT(moed_f32_to_e4m3(ldexpf(15, -10)), 0x08); /* 7.5 * 2^-9: tie up into normals */
    CHECK_EQ_INT(moed_f32_to_e4m3(-0.0f), 0x80);
}

/* moed_fp8.h's quantizer: scale amax / 448 per 128 x 128 block (1 for a block of zeros), codes the
 * quotients rounded, partial edge blocks, and the refusal of non-finite input. */
static void test_fp8_quantize(void)
{
    enum { R = 130, C = 260 };
    static float v[R * C], s[2 * 3];
    static uint8_t q[R * C];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            v[r * C + c] = r < 128 && c >= 128 && c < 256 ? 0.0f : (float)sin(r * 0.37 + c * 1.3);
    v[5 * C + 7] = -3.5f; /* block (0, 0)'s largest magnitude */
    int64_t bad = -7;
    CHECK_EQ_INT(moed_fp8_quantize(v, MOED_F32, R, C, q, s, &bad), 0);
    CHECK(bad == -1);
    CHECK(s[0] == 3.5f / 448.0f && q[5 * C + 7] == 0xfe); /* -448 */
    CHECK(s[1] == 1.0f && q[3 * C + 130] == 0);           /* zeros */
    int off = 0;
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            const float sc = s[(r / 128) * 3 + c / 128];
            off += q[r * C + c] != moed_f32_to_e4m3(v[r * C + c] / sc);
        }
    CHECK_EQ_INT(off, 0);
    for (int i = 0; i < 6; i++) CHECK(s[i] > 0 && isfinite(s[i]));
    CHECK(moed_fp8_weight(q, s, C, 5, 7) == -3.5f);
    v[129 * C + 259] = NAN;
    CHECK_EQ_INT(moed_fp8_quantize(v, MOED_F32, R, C, q, s, &bad), MOED_EINVAL);
    CHECK(bad == 129 * C + 259);
    /* bf16 input widens exactly first */
    uint16_t b[4] = { 0x3f80, 0xc000, 0x0000, 0x3e00 }; /* 1, -2, 0, 0.125 */
    float sb;
    uint8_t qb[4];
    CHECK_EQ_INT(moed_fp8_quantize(b, MOED_BF16, 2, 2, qb, &sb, &bad), 0);
    CHECK(sb == 2.0f / 448.0f && qb[1] == 0xfe && qb[2] == 0 && qb[0] == moed_f32_to_e4m3(224.0f));
    /* scales: > 0, and at most FLT_MAX / (448 x cols): a row of 7168 weights at 448 x the
     * largest scale, summed over activations of 1, stays finite in float32 */
    const float top = moed_fp8_scale_max(7168);
    CHECK(top > 0 && (double)top * 448.0 * 7168.0 <= (double)FLT_MAX);
    CHECK((double)nextafterf(top, INFINITY) * 448.0 * 7168.0 > (double)FLT_MAX);
    const float ok[3] = { 1e-30f, 1.0f, top }, nan3[3] = { 1, NAN, 1 }, neg[2] = { 1, -1 },
                zero[1] = { 0.0f }, inf[2] = { 1, INFINITY }, huge[2] = { 1, 1e38f },
                over[1] = { nextafterf(top, INFINITY) };
    CHECK(moed_fp8_check_scales(ok, 3, 7168) == -1);
    CHECK(moed_fp8_check_scales(nan3, 3, 7168) == 1);
    CHECK(moed_fp8_check_scales(neg, 2, 7168) == 1);
    CHECK(moed_fp8_check_scales(zero, 1, 7168) == 0);
    CHECK(moed_fp8_check_scales(inf, 2, 7168) == 1);
    CHECK(moed_fp8_check_scales(huge, 2, 7168) == 1);
    CHECK(moed_fp8_check_scales(over, 1, 7168) == 0);
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
    test_e4m3_codes();
    test_e4m3_ties();
    test_fp8_quantize();
    return check_status("test_dtype");
}
