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

/* The 16-bit conversions are inline and, under nvcc, device functions too: libmoedclient's link
 * kernels (compiled to PTX) round a fleet's sum with these very functions, so a link's output and
 * the gRPC fleet's have the same bits. */
#if defined(__CUDACC__)
#define MOED_DTYPE_FN static inline __host__ __device__
#else
#define MOED_DTYPE_FN static inline
#endif

MOED_DTYPE_FN float moed_bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

MOED_DTYPE_FN uint16_t moed_f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

MOED_DTYPE_FN float moed_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    uint32_t u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13); /* inf or NaN */
    } else if (exp != 0) {
        u = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        u = sign;
    } else { /* subnormal: normalise */
        int e = -1;
        do {
            man <<= 1;
            e++;
        } while (!(man & 0x400u));
        u = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* to nearest, ties to even */
MOED_DTYPE_FN uint16_t moed_f32_to_f16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t abs = u & 0x7fffffffu;
    if (abs > 0x7f800000u) return sign | 0x7e00u;  /* NaN */
    if (abs >= 0x477ff000u) return sign | 0x7c00u; /* rounds to inf (>= 65520) */
    if (abs >= 0x38800000u) {                      /* normal in f16 */
        uint32_t r = abs - 0x38000000u;            /* rebias exponent 127 -> 15 */
        r += 0xfffu + ((r >> 13) & 1u);            /* round to nearest even */
        return sign | (uint16_t)(r >> 13);
    }
    if (abs < 0x33000000u) return sign; /* below half the smallest subnormal */
    /* subnormal in f16: shift the implicit-1 mantissa into place, rounding to nearest even */
    uint32_t e = abs >> 23;
    uint32_t man = (abs & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126u - e; /* 14..24 */
    uint32_t q = man >> shift;
    uint32_t rem = man & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) q++;
    return sign | (uint16_t)q;
}

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
