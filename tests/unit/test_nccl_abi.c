/*
 * test_nccl_abi — moed_nccl.h writes NCCL's types and entry points itself, so nothing that uses it
 * needs nccl.h or CUDA's headers; this test compiles those declarations against the real nccl.h
 * (the nvidia-nccl-cu13 wheel's) and fails to build, or to pass, where one differs.
 */
#include "check.h"
#include "moed_nccl.h"

#ifdef MOED_HAVE_NCCL_H
#include <nccl.h>
#include <stddef.h>

_Static_assert(sizeof(moed_nccl_unique_id) == sizeof(ncclUniqueId), "unique id size");
_Static_assert(MOED_NCCL_UNIQUE_ID_BYTES == NCCL_UNIQUE_ID_BYTES, "unique id bytes");
_Static_assert((int)MOED_NCCL_SUCCESS == (int)ncclSuccess &&
                   (int)MOED_NCCL_IN_PROGRESS == (int)ncclInProgress &&
                   (int)MOED_NCCL_REMOTE_ERROR == (int)ncclRemoteError &&
                   (int)MOED_NCCL_SYSTEM_ERROR == (int)ncclSystemError &&
                   (int)MOED_NCCL_INVALID_ARGUMENT == (int)ncclInvalidArgument,
               "results");
_Static_assert((int)MOED_NCCL_UINT8 == (int)ncclUint8, "datatype");
_Static_assert(MOED_NCCL_UNDEF_INT == NCCL_CONFIG_UNDEF_INT, "undefined int");
_Static_assert(MOED_NCCL_CONFIG_VERSION == NCCL_VERSION(2, 18, 0), "config version");
#define SAME_FIELD(ours, theirs)                                                                   \
    _Static_assert(offsetof(moed_nccl_config, ours) == offsetof(ncclConfig_t, theirs) &&           \
                       sizeof(((moed_nccl_config *)0)->ours) ==                                    \
                           sizeof(((ncclConfig_t *)0)->theirs),                                    \
                   #ours)
SAME_FIELD(size, size);
SAME_FIELD(magic, magic);
SAME_FIELD(version, version);
SAME_FIELD(blocking, blocking);
SAME_FIELD(cga_cluster_size, cgaClusterSize);
SAME_FIELD(min_ctas, minCTAs);
SAME_FIELD(max_ctas, maxCTAs);
SAME_FIELD(net_name, netName);
SAME_FIELD(split_share, splitShare);

int main(void)
{
    /* each entry point's type as the table holds it, against NCCL's declaration: the enum and
     * struct pointers differ in name only, so the calls are compared through their arguments */
    ncclResult_t (*send)(const void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) =
        ncclSend;
    ncclResult_t (*recv)(void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) = ncclRecv;
    ncclResult_t (*split)(ncclComm_t, int, int, ncclComm_t *, ncclConfig_t *) = ncclCommSplit;
    (void)send;
    (void)recv;
    (void)split;
#if NCCL_VERSION_CODE >= 22800
    ncclResult_t (*revoke)(ncclComm_t, int) = ncclCommRevoke;
    (void)revoke;
#endif
    CHECK(sizeof(ncclComm_t) == sizeof(moed_nccl_comm));
    CHECK(sizeof(cudaStream_t) == sizeof(void *));
    CHECK(sizeof(ncclResult_t) == sizeof(int) && sizeof(ncclDataType_t) == sizeof(int));
    /* NCCL reads the config's prefix by its size: ours must not be longer than theirs */
    CHECK(sizeof(moed_nccl_config) <= sizeof(ncclConfig_t));
    ncclConfig_t theirs = NCCL_CONFIG_INITIALIZER;
    moed_nccl_config ours = moed_nccl_config_make(0, theirs.splitShare);
    CHECK(ours.magic == theirs.magic); /* NCCL_API_MAGIC, which older headers spell only here */
    CHECK(ours.cga_cluster_size == theirs.cgaClusterSize && ours.min_ctas == theirs.minCTAs &&
          ours.max_ctas == theirs.maxCTAs);
    return check_status("test_nccl_abi");
}
#else
int main(void)
{
    printf("test_nccl_abi: no nccl.h at build time (deploy/install-deps.sh installs it)\n");
    return CHECK_SKIP;
}
#endif
