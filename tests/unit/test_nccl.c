/*
 * test_nccl — moed_nccl's loader: the version arithmetic, and the library as this machine has it.
 * With MOED_NCCL_LIB pointing nowhere the loader must say why, naming the variable; with the
 * wheel's libnccl.so.2 (the build's, the last place it looks) it must resolve every entry point
 * (ncclCommRevoke exactly from 2.28) and answer a version of 2.18 or newer, and a unique id (which
 * needs no GPU).
 */
#include "check.h"
#include "moed_nccl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char **argv)
{
    char v[32];
    moed_nccl_version_string(22703, v, sizeof v);
    CHECK(strcmp(v, "2.27.3") == 0);
    moed_nccl_version_string(2804, v, sizeof v);
    CHECK(strcmp(v, "2.8.4") == 0);
    CHECK(moed_nccl_versions_match(22703, 22709));
    CHECK(!moed_nccl_versions_match(22703, 22803));
    CHECK(moed_nccl_versions_match(2804, 2807));
    CHECK(!moed_nccl_versions_match(2804, 20904));
    moed_nccl_config c = moed_nccl_config_make(0, MOED_NCCL_UNDEF_INT);
    CHECK(c.size == sizeof c && c.magic == MOED_NCCL_CONFIG_MAGIC && c.blocking == 0);
    c = moed_nccl_config_make(1, 1);
    CHECK(c.blocking == 1 && c.split_share == 1 && c.min_ctas == MOED_NCCL_UNDEF_INT);

    moed_error err = { 0 };
    const moed_nccl *n = moed_nccl_api(&err);
    if (argc > 1 && strcmp(argv[1], "missing") == 0) {
        /* run with MOED_NCCL_LIB=/nonexistent and no libnccl.so.2 on the loader's path */
        if (n) {
            printf("test_nccl missing: an NCCL was found at %s; nothing to check\n", n->path);
            return CHECK_SKIP;
        }
        CHECK_EQ_INT(err.code, MOED_EUNSUPPORTED);
        CHECK_MSG(strstr(err.msg, "MOED_NCCL_LIB") != NULL, "%s", err.msg);
        return check_status("test_nccl missing");
    }
#ifndef MOED_NCCL_BUILD_LIB
    if (!n) {
        printf("test_nccl: no NCCL here (%s)\n", err.msg);
        return CHECK_SKIP;
    }
#endif
    CHECK_MSG(n != NULL, "%s", err.msg);
    if (n) {
        CHECK(n->version >= 21800);
        /* ncclCommRevoke, which a link's close uses where it exists, exists from 2.28 */
        CHECK_MSG((n->comm_revoke != NULL) == (n->version >= 22800), "version %d, revoke %s",
                  n->version, n->comm_revoke ? "found" : "missing");
        moed_nccl_unique_id id;
        memset(&id, 0, sizeof id);
        int rc = n->get_unique_id(&id);
        CHECK_MSG(rc == 0, "ncclGetUniqueId: %d", rc);
        int nonzero = 0;
        for (int i = 0; i < MOED_NCCL_UNIQUE_ID_BYTES; i++) nonzero |= id.internal[i];
        CHECK(nonzero);
        moed_nccl_fail(n, MOED_NCCL_REMOTE_ERROR, "ncclRecv", &err);
        CHECK_EQ_INT(err.code, MOED_EUNAVAIL);
        CHECK(strstr(err.msg, "ncclRecv: ") == err.msg);
    }
    return check_status("test_nccl");
}
