/*
 * moed_dtype — sizes, names and the float32 conversions of the element types.
 *
 * f16 is converted bit by bit rather than through _Float16 so the code builds on any C11 compiler
 * and rounds the same everywhere; these loops run over whole rows, so their cost is per element.
 */
#include "moed_dtype.h"

#include <strings.h>

size_t moed_dtype_size(int dtype)
{
    switch (dtype) {
    case MOED_F32:
    case MOED_I32:
        return 4;
    case MOED_F16:
    case MOED_BF16:
        return 2;
    case MOED_FP8:
        return 1;
    }
    return 0;
}

const char *moed_dtype_name(int dtype)
{
    switch (dtype) {
    case MOED_F32:
        return "f32";
    case MOED_F16:
        return "f16";
    case MOED_BF16:
        return "bf16";
    case MOED_I32:
        return "i32";
    case MOED_FP8:
        return "fp8";
    }
    return "unknown";
}

moed_dtype moed_dtype_parse(const char *name)
{
    static const struct {
        const char *name;
        moed_dtype dtype;
    } names[] = {
        { "f32", MOED_F32 },     { "float32", MOED_F32 },       { "f16", MOED_F16 },
        { "float16", MOED_F16 }, { "bf16", MOED_BF16 },         { "bfloat16", MOED_BF16 },
        { "i32", MOED_I32 },     { "int32", MOED_I32 },         { "fp8", MOED_FP8 },
        { "e4m3", MOED_FP8 },    { "float8_e4m3fn", MOED_FP8 },
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (!strcasecmp(name, names[i].name)) return names[i].dtype;
    return MOED_DTYPE_NONE;
}

int moed_dtype_is_float(int dtype)
{
    return dtype == MOED_F32 || dtype == MOED_F16 || dtype == MOED_BF16;
}

int moed_dtype_is_weight(int dtype)
{
    return moed_dtype_is_float(dtype) || dtype == MOED_FP8;
}

uint8_t moed_f32_to_e4m3(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    const uint32_t abs = u & 0x7fffffffu;
    if (abs > 0x7f800000u) return sign | 0x7f;  /* NaN */
    if (abs >= 0x43e00000u) return sign | 0x7e; /* >= 448, infinity too: saturate */
    if (abs >= 0x3c800000u) {                   /* >= 2^-6: normal in e4m3 */
        uint32_t r = abs - (120u << 23);        /* rebias exponent 127 -> 7 */
        r += 0x7ffffu + ((r >> 20) & 1u);       /* round to nearest even at bit 20 */
        return sign | (uint8_t)(r >> 20);       /* at most 0x7e: 448 is below the ties */
    }
    if (abs <= 0x3a800000u) return sign; /* at or below 2^-10, half the smallest subnormal */
    /* subnormal in e4m3 (2^-10 < |f| < 2^-6): m = |f| * 2^9 rounded to nearest even; m = 8 is the
     * smallest normal, whose code is 8 too */
    const uint32_t e = abs >> 23, man = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 141u - e; /* 21 .. 24 */
    uint32_t q = man >> shift;
    const uint32_t rem = man & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) q++;
    return sign | (uint8_t)q;
}

void moed_to_f32(int dtype, const void *src, float *dst, size_t n)
{
    switch (dtype) {
    case MOED_F32:
        memcpy(dst, src, n * 4);
        break;
    case MOED_BF16: {
        const uint16_t *s = src;
        for (size_t i = 0; i < n; i++) dst[i] = moed_bf16_to_f32(s[i]);
        break;
    }
    case MOED_F16: {
        const uint16_t *s = src;
        for (size_t i = 0; i < n; i++) dst[i] = moed_f16_to_f32(s[i]);
        break;
    }
    case MOED_FP8: {
        const uint8_t *s = src;
        for (size_t i = 0; i < n; i++) dst[i] = moed_e4m3_to_f32(s[i]);
        break;
    }
    }
}

void moed_from_f32(int dtype, const float *src, void *dst, size_t n)
{
    switch (dtype) {
    case MOED_F32:
        memcpy(dst, src, n * 4);
        break;
    case MOED_BF16: {
        uint16_t *d = dst;
        for (size_t i = 0; i < n; i++) d[i] = moed_f32_to_bf16(src[i]);
        break;
    }
    case MOED_F16: {
        uint16_t *d = dst;
        for (size_t i = 0; i < n; i++) d[i] = moed_f32_to_f16(src[i]);
        break;
    }
    case MOED_FP8: {
        uint8_t *d = dst;
        for (size_t i = 0; i < n; i++) d[i] = moed_f32_to_e4m3(src[i]);
        break;
    }
    }
}
