/*
 * fuzz_safetensors — libFuzzer target over the safetensors header parser (server/safetensors.c:
 * moed_st_parse_header), which every checkpoint file moed loads goes through. The input is a whole
 * file: 8 bytes of little-endian header length, the header JSON, the data.
 *
 * What an accepted header must promise (the loader points into, or copies from, the data by
 * these numbers alone): every tensor inside the data region, its byte count equal to its shape
 * times its element size, the tensors tiling the region exactly, names sorted and unique, and
 * each one found by moed_st_file_find. A refusal is MOED_EFORMAT (or MOED_ENOMEM) with a message.
 */
#include "moed_dtype.h"
#include "safetensors.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void die(const char *why)
{
    fprintf(stderr, "fuzz_safetensors: %s\n", why);
    abort();
}

static uint64_t bits_of(const char *dtype)
{
    static const struct {
        const char *name;
        int bits;
    } known[] = { { "BOOL", 8 },    { "U8", 8 },      { "I8", 8 },      { "F8_E5M2", 8 },
                  { "F8_E4M3", 8 }, { "F8_E8M0", 8 }, { "I16", 16 },    { "U16", 16 },
                  { "F16", 16 },    { "BF16", 16 },   { "I32", 32 },    { "U32", 32 },
                  { "F32", 32 },    { "C64", 64 },    { "F64", 64 },    { "I64", 64 },
                  { "U64", 64 },    { "F4", 4 },      { "F6_E2M3", 6 }, { "F6_E3M2", 6 } };
    for (size_t i = 0; i < sizeof known / sizeof known[0]; i++)
        if (!strcmp(dtype, known[i].name)) return (uint64_t)known[i].bits;
    die("accepted an unknown dtype");
    return 0;
}

static void check(const moed_st_file *f, uint64_t hlen)
{
    uint64_t start = 8 + hlen, total = 0;
    for (int i = 0; i < f->n_tensors; i++) {
        const moed_st_tensor *t = &f->tensors[i];
        if (t->offset < start || t->offset > f->size || t->nbytes > f->size - t->offset)
            die("a tensor outside the data region");
        uint64_t bits = bits_of(t->dtype);
        for (int k = 0; k < t->ndim; k++) bits *= t->shape[k];
        if (bits != t->nbytes * 8) die("bytes and shape times element size differ");
        if (t->mdtype != MOED_DTYPE_NONE && moed_dtype_size(t->mdtype) * 8 != bits_of(t->dtype))
            die("moed dtype of another size");
        if (i && strcmp(f->tensors[i - 1].name, t->name) >= 0) die("names not sorted and unique");
        if (moed_st_file_find(f, t->name) != t) die("a tensor not found by its name");
        if (t->data) die("a data pointer without a mapping");
        total += t->nbytes;
    }
    if (total != f->size - start) die("the tensors do not tile the data region");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 8) return 0;
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = hlen << 8 | data[i];
    /* The header in its own allocation of exactly hlen bytes, so a read past it is caught. */
    size_t avail = size - 8, n = hlen < avail ? (size_t)hlen : avail;
    char *hdr = malloc(n ? n : 1);
    memcpy(hdr, data + 8, n);
    moed_st_file f = { .path = strdup("fuzz.safetensors"), .fd = -1, .size = size };
    f.name = f.path;
    moed_error err = { 0 };
    int rc = moed_st_parse_header(&f, hdr, hlen, &err);
    if (!rc)
        check(&f, hlen);
    else if ((rc != MOED_EFORMAT && rc != MOED_ENOMEM) || !err.msg[0])
        die("refused with a code other than MOED_EFORMAT, or no message");
    moed_st_file_close(&f);
    free(hdr);
    return 0;
}
