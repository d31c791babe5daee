/*
 * fuzz_npy — libFuzzer target over the .npy reader moectl and moed-load use on the files people
 * hand them (client/c/npy.c: moed_npy_parse, the magic, version, header dict and data size).
 *
 * An accepted file must promise what the tools rely on: a known element type, at most
 * MOED_NPY_MAX_DIMS dimensions, count equal to the product of the shape, nbytes equal to count
 * times the element size, and the data copied whole (every byte readable). The conversions the
 * tools apply (to float32, int32, bf16) then run on it; a refusal is MOED_EFORMAT (or
 * MOED_ENOMEM) with a message.
 */
#include "npy.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void die(const char *why)
{
    fprintf(stderr, "fuzz_npy: %s\n", why);
    abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    moed_npy a;
    moed_error err = { 0 };
    int rc = moed_npy_parse(data, size, &a, &err);
    if (rc) {
        if ((rc != MOED_EFORMAT && rc != MOED_ENOMEM) || !err.msg[0])
            die("refused with a code other than MOED_EFORMAT, or no message");
        return 0;
    }
    size_t item = moed_npy_itemsize(a.dtype);
    if (!item) die("accepted an unknown element type");
    if (a.ndim < 0 || a.ndim > MOED_NPY_MAX_DIMS) die("accepted too many dimensions");
    int64_t count = 1;
    for (int i = 0; i < a.ndim; i++) {
        if (a.shape[i] < 0) die("a negative dimension");
        count *= a.shape[i];
    }
    if (count != a.count || a.nbytes != (size_t)count * item) die("count or nbytes disagree");
    if (a.nbytes > size || memcmp(a.data, data + size - a.nbytes, a.nbytes))
        die("the data is not the file's last nbytes");
    static const int targets[] = { MOED_F32, MOED_I32, MOED_BF16 };
    for (int i = 0; i < 3; i++)
        if (!moed_npy_convert(&a, targets[i], "fuzz", &err)) {
            if (a.dtype != targets[i] || a.nbytes != (size_t)a.count * moed_npy_itemsize(a.dtype))
                die("a conversion left the wrong type or size");
            break;
        }
    moed_npy_free(&a);
    return 0;
}
