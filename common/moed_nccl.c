/*
 * moed_nccl — NCCL through dlopen (moed_nccl.h states the contract).
 *
 * The table is filled once (pthread_once) by the first caller; what it found, or why it found
 * nothing, is the answer for the rest of the process.
 */
#include "moed_nccl.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static pthread_once_t once = PTHREAD_ONCE_INIT;
static moed_nccl table;
static int loaded;
static char why[400];

/* MOED_NCCL_LIB, when set, is the one library tried: an operator who named one means it. */
static void *open_lib(char *tried, size_t n)
{
    const char *env = getenv("MOED_NCCL_LIB");
    const char *names[2] = { "libnccl.so.2",
#ifdef MOED_NCCL_BUILD_LIB
                             MOED_NCCL_BUILD_LIB
#else
                             NULL
#endif
    };
    if (env && *env) {
        names[0] = env;
        names[1] = NULL;
    }
    size_t used = 0;
    for (int i = 0; i < 2; i++) {
        if (!names[i]) continue;
        void *lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
        if (lib) {
            snprintf(table.path, sizeof table.path, "%s", names[i]);
            return lib;
        }
        if (used < n)
            used += (size_t)snprintf(tried + used, n - used, "%s%s", used ? ", " : "", names[i]);
    }
    return NULL;
}

static void load(void)
{
    char tried[256] = "";
    void *lib = open_lib(tried, sizeof tried);
    if (!lib) {
        snprintf(why, sizeof why,
                 "NCCL is not available: no libnccl.so.2 could be opened (tried %s); set "
                 "MOED_NCCL_LIB to the path of one (pip's nvidia-nccl-cu13 puts it in "
                 "site-packages/nvidia/nccl/lib)",
                 tried);
        return;
    }
    static const struct {
        const char *name;
        size_t at;
    } entries[] = {
        { "ncclGetVersion", offsetof(moed_nccl, get_version) },
        { "ncclGetErrorString", offsetof(moed_nccl, get_error_string) },
        { "ncclGetUniqueId", offsetof(moed_nccl, get_unique_id) },
        { "ncclCommInitRankConfig", offsetof(moed_nccl, comm_init_rank_config) },
        { "ncclCommGetAsyncError", offsetof(moed_nccl, comm_get_async_error) },
        { "ncclCommAbort", offsetof(moed_nccl, comm_abort) },
        { "ncclCommDestroy", offsetof(moed_nccl, comm_destroy) },
        { "ncclSend", offsetof(moed_nccl, send) },
        { "ncclRecv", offsetof(moed_nccl, recv) },
        { "ncclCommSplit", offsetof(moed_nccl, comm_split) },
    };
    for (size_t i = 0; i < sizeof entries / sizeof entries[0]; i++) {
        void *fn = dlsym(lib, entries[i].name);
        if (!fn) {
            snprintf(why, sizeof why,
                     "NCCL at %s has no %s: it is older than 2.18, which links need", table.path,
                     entries[i].name);
            dlclose(lib);
            return;
        }
        memcpy((char *)&table + entries[i].at, &fn, sizeof fn);
    }
    void *revoke = dlsym(lib, "ncclCommRevoke"); /* optional: cuda_link.c does without */
    memcpy(&table.comm_revoke, &revoke, sizeof revoke);
    if (table.get_version(&table.version) != 0 || table.version <= 0) {
        snprintf(why, sizeof why, "NCCL at %s did not answer ncclGetVersion", table.path);
        dlclose(lib);
        return;
    }
    if (table.version < 21800) {
        char v[32];
        moed_nccl_version_string(table.version, v, sizeof v);
        snprintf(why, sizeof why, "NCCL at %s is %s: links need 2.18 or newer", table.path, v);
        dlclose(lib);
        return;
    }
    loaded = 1;
}

const moed_nccl *moed_nccl_api(moed_error *err)
{
    pthread_once(&once, load);
    if (!loaded) {
        moed_fail(err, MOED_EUNSUPPORTED, "%s", why);
        return NULL;
    }
    return &table;
}

moed_nccl_config moed_nccl_config_make(int blocking, int split_share)
{
    moed_nccl_config c = {
        .size = sizeof c,
        .magic = MOED_NCCL_CONFIG_MAGIC,
        .version = MOED_NCCL_CONFIG_VERSION,
        .blocking = blocking,
        .cga_cluster_size = MOED_NCCL_UNDEF_INT,
        .min_ctas = MOED_NCCL_UNDEF_INT,
        .max_ctas = MOED_NCCL_UNDEF_INT,
        .net_name = NULL,
        .split_share = split_share,
    };
    return c;
}

void moed_nccl_abort_pair(const moed_nccl *n, moed_nccl_comm *split, moed_nccl_comm *parent)
{
    if (*split) n->comm_abort(*split);
    *split = NULL;
    if (*parent) n->comm_abort(*parent); /* NCCL joins a split in flight before it frees */
    *parent = NULL;
    if (*split) n->comm_abort(*split); /* NCCL wrote it as the split completed */
    *split = NULL;
}

int moed_nccl_fail(const moed_nccl *n, int result, const char *call, moed_error *err)
{
    const char *text = n && n->get_error_string ? n->get_error_string(result) : NULL;
    int code = result == MOED_NCCL_REMOTE_ERROR || result == MOED_NCCL_SYSTEM_ERROR ? MOED_EUNAVAIL
                                                                                    : MOED_EDEVICE;
    return moed_fail(err, code, "%s: %s (NCCL result %d)", call, text ? text : "unknown error",
                     result);
}

/* NCCL numbers 2.8.4 as 2804 and 2.27.3 as 22703 (NCCL_VERSION in nccl.h). */
static void split_version(int v, int *major, int *minor, int *patch)
{
    int base = v < 10000 ? 1000 : 10000;
    *major = v / base;
    *minor = v % base / 100;
    *patch = v % 100;
}

void moed_nccl_version_string(int v, char *buf, size_t n)
{
    int major, minor, patch;
    split_version(v, &major, &minor, &patch);
    snprintf(buf, n, "%d.%d.%d", major, minor, patch);
}

int moed_nccl_versions_match(int a, int b)
{
    int ma, na, pa, mb, nb, pb;
    split_version(a, &ma, &na, &pa);
    split_version(b, &mb, &nb, &pb);
    return ma == mb && na == nb;
}
