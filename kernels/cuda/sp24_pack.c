/*
 * sp24_pack — 2:4 compression of a padded, interleaved expert matrix into the layout the sparse
 * kernel reads (moed_cuda.h: the kept values and the metadata as mma.sp's fragments take it).
 * Plain C on 16-bit patterns, so the loader and a CPU-only unit test (tests/unit/test_sp24_pack.c)
 * share it without the CUDA runtime.
 */
#include "moed_cuda.h"

#include "moed_err.h"

/* Which 16-bit half of a [rows, k] matrix's metadata holds row r's K 16·c .. 16·c+15 (moed_cuda.h's
 * layout; a 32-bit word's low half first, as the GPU reads it). */
static size_t meta_at(int64_t r, int64_t c, int64_t k)
{
    const int64_t rb = r / 16, rr = r % 16, s = c / 2, kb = s / 4, s4 = s % 4;
    const int64_t lane = 4 * (rr % 8) + 2 * (s4 % 2) + c % 2;
    return (size_t)((((rb * (k / 128) + kb) * 32 + lane) * 2 + s4 / 2) * 2 + rr / 8);
}

static int is_zero(uint16_t v)
{
    return (v & 0x7fffu) == 0; /* +0 or -0, in bf16 and f16 alike */
}

int moed_cuda_sp24_pack(const uint16_t *w, int64_t rows, int64_t k, uint16_t *vals, uint16_t *meta,
                        int64_t *bad_row, int64_t *bad_col)
{
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *row = w + r * k;
        uint16_t *out = vals + r * (k / 2);
        for (int64_t c = 0; c < k / 16; c++) {
            uint16_t bits = 0;
            for (int q = 0; q < 4; q++) {
                const int64_t c0 = 16 * c + 4 * q;
                int idx[2], n = 0;
                for (int i = 0; i < 4; i++)
                    if (!is_zero(row[c0 + i])) {
                        if (n == 2) {
                            *bad_row = r;
                            *bad_col = c0;
                            return MOED_EINVAL;
                        }
                        idx[n++] = i;
                    }
                /* Fewer than two non-zeros: the lowest free positions, kept in increasing order
                 * (mma.sp::ordered_metadata wants the first index below the second). */
                for (int i = 0; n < 2; i++) {
                    if (n == 1 && idx[0] == i) continue;
                    if (n == 1 && idx[0] > i) {
                        idx[1] = idx[0];
                        idx[0] = i;
                    } else {
                        idx[n] = i;
                    }
                    n++;
                }
                out[c0 / 2] = row[c0 + idx[0]];
                out[c0 / 2 + 1] = row[c0 + idx[1]];
                bits |= (uint16_t)((idx[0] | idx[1] << 2) << (4 * q));
            }
            meta[meta_at(r, c, k)] = bits;
        }
    }
    return 0;
}

void moed_cuda_sp24_unpack(const uint16_t *vals, const uint16_t *meta, int64_t rows, int64_t k,
                           uint16_t *w)
{
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < k / 16; c++) {
            const unsigned bits = meta[meta_at(r, c, k)];
            for (int q = 0; q < 4; q++) {
                const int64_t c0 = 16 * c + 4 * q;
                uint16_t *dst = w + r * k + c0;
                dst[0] = dst[1] = dst[2] = dst[3] = 0;
                dst[(bits >> (4 * q)) & 3u] = vals[r * (k / 2) + c0 / 2];
                dst[(bits >> (4 * q + 2)) & 3u] = vals[r * (k / 2) + c0 / 2 + 1];
            }
        }
}
