/*
 * moed_nccl — NCCL, reached at run time. Neither the daemon nor libmoedclient links NCCL: the first
 * use opens libnccl.so.2 (dlopen) and resolves the entry points below into one table, kept for the
 * life of the process. So one build serves machines with and without NCCL (a fleet then falls back
 * to gRPC, saying so in its log), and a caller inside torch shares the NCCL torch loaded.
 *
 * Contract:
 * - moed_nccl_api() answers the table, or NULL and MOED_EUNSUPPORTED with a message saying why (no
 *   library found, or one without an entry point); the answer never changes within a process.
 *   The library is the one MOED_NCCL_LIB names (that one only, when it is set), else
 *   "libnccl.so.2" as the loader finds it (one already loaded by the process, LD_LIBRARY_PATH, the
 *   system's), else the copy this build was configured with (the nvidia-nccl-cu13 wheel
 *   deploy/install-deps.sh puts in .venv).
 * - The types are NCCL's, written here so that code using them needs neither nccl.h nor CUDA's
 *   headers: results are ints (0 success, 7 in progress), a communicator and a CUDA stream are
 *   pointers, a unique id is 128 bytes. tests/unit/test_nccl_abi.c checks every one of them, and
 *   the prefix of ncclConfig_t used here, against the wheel's nccl.h at build time.
 * - moed_nccl_fail turns an NCCL result into a moed code and a message naming the call and NCCL's
 *   own description of the error (MOED_EUNAVAIL for a remote or system error: the peer is gone or
 *   unreachable; MOED_EDEVICE otherwise).
 */
#ifndef MOED_NCCL_H
#define MOED_NCCL_H

#include "moed_err.h"

#include <stddef.h>
#include <stdint.h>

#define MOED_NCCL_UNIQUE_ID_BYTES 128

enum {
    MOED_NCCL_SUCCESS = 0,
    MOED_NCCL_SYSTEM_ERROR = 2,
    MOED_NCCL_INVALID_ARGUMENT = 4,
    MOED_NCCL_REMOTE_ERROR = 6,
    MOED_NCCL_IN_PROGRESS = 7,
};
enum { MOED_NCCL_UINT8 = 1 }; /* ncclUint8: every link message is bytes */

typedef struct moed_nccl_comm *moed_nccl_comm; /* ncclComm_t */
typedef struct {
    char internal[MOED_NCCL_UNIQUE_ID_BYTES];
} moed_nccl_unique_id; /* ncclUniqueId */

/* The prefix of ncclConfig_t that NCCL 2.18 defined; NCCL reads a config by its size and version
 * and fills every later field with its default, so this is a complete config for any NCCL since. */
typedef struct moed_nccl_config {
    size_t size;      /* sizeof(moed_nccl_config) */
    unsigned magic;   /* MOED_NCCL_CONFIG_MAGIC */
    unsigned version; /* MOED_NCCL_CONFIG_VERSION */
    int blocking;     /* 0: every call returns at once (poll comm_get_async_error) */
    int cga_cluster_size, min_ctas, max_ctas; /* MOED_NCCL_UNDEF_INT: NCCL's defaults */
    const char *net_name;                     /* NULL: NCCL's default */
    int split_share; /* 1: a communicator split from another uses its connections */
} moed_nccl_config;
#define MOED_NCCL_CONFIG_MAGIC   0xcafebeefu
#define MOED_NCCL_CONFIG_VERSION 21800 /* NCCL_VERSION(2, 18, 0) */
#define MOED_NCCL_UNDEF_INT      (-2147483647 - 1)

/* A config: blocking (0 or 1) and split_share as given, the rest NCCL's defaults. A link's
 * communicator is made non-blocking, so that its join can time out and be aborted, and split once
 * connected into a blocking one sharing its connections for the calls: NCCL runs each call on a
 * non-blocking communicator through a thread of its own (moed_link.h). */
moed_nccl_config moed_nccl_config_make(int blocking, int split_share);

typedef struct moed_nccl {
    int (*get_version)(int *version);
    const char *(*get_error_string)(int result);
    int (*get_unique_id)(moed_nccl_unique_id *id);
    int (*comm_init_rank_config)(moed_nccl_comm *comm, int nranks, moed_nccl_unique_id id, int rank,
                                 moed_nccl_config *config);
    int (*comm_get_async_error)(moed_nccl_comm comm, int *async_error);
    int (*comm_abort)(moed_nccl_comm comm);
    int (*comm_destroy)(moed_nccl_comm comm);
    int (*send)(const void *buf, size_t count, int datatype, int peer, moed_nccl_comm comm,
                void *stream);
    int (*recv)(void *buf, size_t count, int datatype, int peer, moed_nccl_comm comm, void *stream);
    int (*comm_split)(moed_nccl_comm comm, int color, int key, moed_nccl_comm *newcomm,
                      moed_nccl_config *config);
    /* ncclCommRevoke (NCCL 2.28 and newer; NULL before): ends the communicator's operations in
     * flight and frees nothing, so that its abort can come later (flags 0). */
    int (*comm_revoke)(moed_nccl_comm comm, int flags);
    int version;    /* get_version's answer, e.g. 22703 for 2.27.3 */
    char path[256]; /* the library opened, for logs */
} moed_nccl;

/* Aborts a communicator split with shared resources and the one it was split from, each NULLed:
 * the split one first (its kernels may be waiting on a peer that is gone; its abort ends them and
 * frees it before its parent goes), then the parent, which ends a split still in flight; a split
 * that completed meanwhile is aborted last. */
void moed_nccl_abort_pair(const moed_nccl *n, moed_nccl_comm *split, moed_nccl_comm *parent);

/* The table, or NULL (err: MOED_EUNSUPPORTED, why). Thread-safe; opened once. */
const moed_nccl *moed_nccl_api(moed_error *err);

/* result != 0 as a moed code and "CALL: NCCL's description (result N)". */
int moed_nccl_fail(const moed_nccl *n, int result, const char *call, moed_error *err);

/* "2.27.3" for 22703 (and 2.8.4 for 2804, NCCL's older numbering) into buf. */
void moed_nccl_version_string(int version, char *buf, size_t n);

/* Whether two NCCL versions may share a communicator: the same major and minor. */
int moed_nccl_versions_match(int a, int b);

#endif
