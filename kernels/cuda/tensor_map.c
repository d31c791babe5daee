/*
 * tensor_map — tensor maps through the driver's encoder, which is found at run time so moed needs
 * no libcuda at link time (it must start on machines without a GPU driver, where the CPU backend
 * serves).
 */
#include "tensor_map.h"

#include "moed_err.h"

#include <cuda_runtime_api.h>
#include <pthread.h>

typedef CUresult (*encode_tiled_fn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *,
                                    const cuuint64_t *, const cuuint64_t *, const cuuint32_t *,
                                    const cuuint32_t *, CUtensorMapInterleave, CUtensorMapSwizzle,
                                    CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

static encode_tiled_fn encoder_fn;
static pthread_once_t encoder_once = PTHREAD_ONCE_INIT;

static void find_encoder(void)
{
    void *p = NULL;
    enum cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                         &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
        encoder_fn = (encode_tiled_fn)p;
}

static const struct {
    CUtensorMapDataType type;
    cuuint64_t bytes;
} tm_types[] = {
    [MOED_CUDA_TM_BF16] = { CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2 },
    [MOED_CUDA_TM_F16] = { CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2 },
    [MOED_CUDA_TM_E4M3] = { CU_TENSOR_MAP_DATA_TYPE_UINT8, 1 },
    [MOED_CUDA_TM_F32] = { CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4 },
};

int moed_cuda_tensor_map(CUtensorMap *m, int type, const void *p, int64_t rows, int64_t cols,
                         int64_t ld, int box_cols, int box_rows, int swizzle128)
{
    pthread_once(&encoder_once, find_encoder);
    if (!encoder_fn || type < 0 || type > MOED_CUDA_TM_F32) return MOED_EDEVICE;
    const cuuint64_t dims[2] = { (cuuint64_t)cols, (cuuint64_t)rows };
    const cuuint64_t strides[1] = { (cuuint64_t)ld * tm_types[type].bytes };
    const cuuint32_t box[2] = { (cuuint32_t)box_cols, (cuuint32_t)box_rows };
    const cuuint32_t estr[2] = { 1, 1 };
    CUresult r = encoder_fn(m, tm_types[type].type, 2, (void *)p, dims, strides, box, estr,
                            CU_TENSOR_MAP_INTERLEAVE_NONE,
                            swizzle128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return r == CUDA_SUCCESS ? 0 : MOED_EDEVICE;
}
