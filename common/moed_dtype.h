/*
 * moed_dtype — element types on the wire and in weights, and conversions to and from float32.
 *
 * The values match moed.v1.DType, so a wire value is a moed_dtype after a range check. Conversions
 * to half types round to nearest, ties to even (what torch and ml_dtypes do); NaN stays NaN.
 *
 * MOED_FP8 is OCP FP8 E4M3 (torch.float8_e4m3fn, ml_dtypes.float8_e4m3fn): sign, 4 exponent bits
 * (bias 7), 3 mantissa bits; no infinity; S.1111.111 is NaN; the largest value is 448 and the
 * smallest subnormal 2^-9. It is a weight type only (block-scaled, see moed_fp8.h): activations
 * are F32, F16 or BF16.
 */
#ifndef MOED_DTYPE_H
#define MOED_DTYPE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef enum moed_dtype {
    MOED_DTYPE_NONE = 0,
    MOED_F32 = 1,
    MOED_F16 = 2,
    MOED_BF16 = 3,
    MOED_I32 = 4,
    MOED_FP8 = 5, /* e4m3, weights only */
} moed_dtype;

/* Bytes per element; 0 for an unknown dtype. */
size_t moed_dtype_size(int dtype);
/* "f32", "f16", "bf16", "i32", "fp8", or "unknown". */
const char *moed_dtype_name(int dtype);
/* Parses a name as above (also "float32", "float16", "bfloat16", "int32", "e4m3",
 * "float8_e4m3fn"); MOED_DTYPE_NONE if not. */
moed_dtype moed_dtype_parse(const char *name);
/* True for the activation types (F32, F16, BF16), which are also the unscaled weight types. */
int moed_dtype_is_float(int dtype);
/* True for the types expert weights may have: the activation types and FP8. */
int moed_dtype_is_weight(int dtype);

static inline float moed_bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t moed_f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

float moed_f16_to_f32(uint16_t h);
uint16_t moed_f32_to_f16(float f);

/* e4m3 to float32: exact (every e4m3 value is a float32); the NaN codes give NaN. */
static inline float moed_e4m3_to_f32(uint8_t q)
{
    const uint32_t e = (q >> 3) & 15u, m = q & 7u;
    uint32_t u;
    if (e == 15 && m == 7) {
        u = 0x7fc00000u;
    } else if (e != 0) {
        u = ((e + 120u) << 23) | (m << 20); /* rebias 7 -> 127 */
    } else {
        float v = (float)m * 0x1p-9f; /* subnormal: m * 2^-9, exact */
        memcpy(&u, &v, 4);
    }
    u |= (uint32_t)(q & 0x80u) << 24;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* float32 to e4m3: round to nearest, ties to even; a magnitude at or above 448 (infinity too)
 * saturates to +-448; NaN gives the NaN code of its sign. */
uint8_t moed_f32_to_e4m3(float f);

/* n elements of dtype at src to float32 at dst (src and dst must not overlap); FP8 codes are
 * decoded unscaled. */
void moed_to_f32(int dtype, const void *src, float *dst, size_t n);
/* n float32 at src to dtype at dst (FP8: moed_f32_to_e4m3, unscaled). */
void moed_from_f32(int dtype, const float *src, void *dst, size_t n);

#endif
