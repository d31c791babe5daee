/*
 * moed_dtype — element types on the wire and in weights, and conversions to and from float32.
 *
 * The values match moed.v1.DType, so a wire value is a moed_dtype after a range check. Conversions
 * to half types round to nearest, ties to even (what torch and ml_dtypes do); NaN stays NaN.
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
} moed_dtype;

/* Bytes per element; 0 for an unknown dtype. */
size_t moed_dtype_size(int dtype);
/* "f32", "f16", "bf16", "i32", or "unknown". */
const char *moed_dtype_name(int dtype);
/* Parses a name as above (also "float32", "float16", "bfloat16", "int32"); MOED_DTYPE_NONE if not.
 */
moed_dtype moed_dtype_parse(const char *name);
/* True for the activation and weight types (F32, F16, BF16). */
int moed_dtype_is_float(int dtype);

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

/* n elements of dtype at src to float32 at dst (src and dst must not overlap). */
void moed_to_f32(int dtype, const void *src, float *dst, size_t n);
/* n float32 at src to dtype at dst. */
void moed_from_f32(int dtype, const float *src, void *dst, size_t n);

#endif
