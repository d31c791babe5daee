/*
 * test_moedc_cuda — libmoedclient's CUDA regions reach the driver at run time (moedc_cuda.h).
 *
 *   test_moedc_cuda         where no CUDA driver loads (skipped, 77, where one does): a CUDA region
 *                           is refused with MOEDC_EUNSUPPORTED naming the missing driver, through
 *                           the public call, and a host region's way is unaffected
 *   test_moedc_cuda fake    over tests/unit/fake_libcuda.c (LD_LIBRARY_PATH): the IPC handle, the
 *                           offset in the allocation, the device and its UUID as the driver gives
 *                           them; host, managed and overlong memory refused with MOEDC_EINVAL;
 *                           a driver error named; a driver that wants a current context given an
 *                           active primary context, never a new one; every context retained is
 *                           released and every push popped
 */
#include "check.h"
#include "fake_libcuda.h"
#include "moedc_cuda.h"

#include <dlfcn.h>
#include <string.h>

static void test_no_driver(void)
{
    moedc *c = NULL;
    moedc_session *s = NULL;
    moedc_region *r = NULL;
    moedc_error err = { 0 };
    static char buf[256];
    CHECK_EQ_INT(moedc_connect("127.0.0.1:1", NULL, &c, &err), 0);
    CHECK_EQ_INT(moedc_session_open(c, &s, &err), 0);
    int rc = s ? moedc_region_register_cuda(s, buf, sizeof buf, &r, &err) : -1;
    CHECK_MSG(rc == MOEDC_EUNSUPPORTED, "register_cuda without a driver: %d (%s)", rc, err.msg);
    CHECK_MSG(strstr(err.msg, "no CUDA driver") && strstr(err.msg, "host region"), "%s", err.msg);
    CHECK(r == NULL);
    rc = moedc_cuda_api(&err) ? 0 : err.code; /* the same answer every time */
    CHECK_EQ_INT(rc, MOEDC_EUNSUPPORTED);
    moedc_session_close(s);
    moedc_close(c);
}

static fake_cuda_state *state;
static void *(*managed_mem)(void);

static void check_balanced(const char *what)
{
    CHECK_MSG(state->pushes == state->pops && state->depth == 0, "%s: %d pushes, %d pops", what,
              state->pushes, state->pops);
    for (int d = 0; d < 2; d++)
        CHECK_MSG(state->retained[d] == state->released[d],
                  "%s: device %d retained %d, released %d", what, d, state->retained[d],
                  state->released[d]);
}

static void test_describe(unsigned char *mem)
{
    moedc_cuda_region g;
    moedc_error err = { 0 };
    CHECK_EQ_INT(moedc_cuda_describe(mem + 100, 200, &g, &err), 0);
    CHECK_EQ_INT((int)g.offset, 100);
    CHECK_EQ_INT(g.device, 1);
    CHECK_MSG(!strcmp(g.uuid, "GPU-10111213-1415-1617-1819-1a1b1c1d1e1f"), "uuid %s", g.uuid);
    int pattern = 1;
    for (int i = 0; i < MOEDC_CUDA_IPC_HANDLE_BYTES; i++) pattern &= g.handle[i] == (i ^ 0x5a);
    CHECK_MSG(pattern, "the IPC handle is not the driver's");
    CHECK_EQ_INT(moedc_cuda_describe(mem + FAKE_CUDA_ALLOC - 8, 8, &g, &err), 0);
    check_balanced("described");
}

static void test_refused(unsigned char *mem)
{
    moedc_cuda_region g;
    moedc_error err = { 0 };
    static char host[64];
    CHECK_EQ_INT(moedc_cuda_describe(host, sizeof host, &g, &err), MOEDC_EINVAL);
    CHECK_MSG(strstr(err.msg, "is not device memory"), "%s", err.msg);
    CHECK_EQ_INT(moedc_cuda_describe(managed_mem(), 64, &g, &err), MOEDC_EINVAL);
    CHECK_MSG(strstr(err.msg, "managed"), "%s", err.msg);
    CHECK_EQ_INT(moedc_cuda_describe(mem + 100, FAKE_CUDA_ALLOC - 99, &g, &err), MOEDC_EINVAL);
    CHECK_MSG(strstr(err.msg, "run past its allocation (3996 bytes from its start)"), "%s",
              err.msg);
    state->ipc_fails = 1;
    CHECK_EQ_INT(moedc_cuda_describe(mem, 64, &g, &err), MOEDC_EDEVICE);
    CHECK_MSG(strstr(err.msg, "cuIpcGetMemHandle: CUDA_ERROR_NOT_SUPPORTED"), "%s", err.msg);
    state->ipc_fails = 0;
    check_balanced("refused");
}

static void test_context_wanted(unsigned char *mem)
{
    moedc_cuda_region g;
    moedc_error err = { 0 };
    state->need_context = 1;
    CHECK_EQ_INT(moedc_cuda_describe(mem + 64, 64, &g, &err), 0);
    CHECK_EQ_INT((int)g.offset, 64);
    CHECK_MSG(state->retained[0] == 0, "device 0's primary context (inactive) was retained");
    state->need_context = 0;
    check_balanced("with a context wanted");
}

int main(int argc, char **argv)
{
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (argc < 2) {
        if (lib) {
            fprintf(stderr, "test_moedc_cuda: a CUDA driver loads here: skipped\n");
            return CHECK_SKIP;
        }
        test_no_driver();
        return check_status("test_moedc_cuda");
    }
    /* the fake's own symbols, where the loader found it too */
    void *(*device_mem)(void) = lib ? (void *(*)(void))dlsym(lib, "fake_cuda_device_mem") : NULL;
    managed_mem = lib ? (void *(*)(void))dlsym(lib, "fake_cuda_managed_mem") : NULL;
    state = lib ? dlsym(lib, "fake_cuda") : NULL;
    if (!state || !device_mem || !managed_mem) {
        fprintf(stderr, "test_moedc_cuda: libcuda.so.1 is not the fake (LD_LIBRARY_PATH)\n");
        return 1;
    }
    test_describe(device_mem());
    test_refused(device_mem());
    test_context_wanted(device_mem());
    return check_status("test_moedc_cuda fake");
}
