"""The Python client's doorbell (moed.RingClient over libmoedclient through ctypes), on the CPU
backend: the ctypes structs equal the header's as the C compiler lays them out; outputs equal the
gRPC path's (MoEClient, grpcio, in the same process) bit for bit over f32, f16 and bf16, k 1..4
with padding, T 1..300, tensors copied in or named in place, out= written; bad inputs raise
MoEError with a status and a message and the daemon goes on; a daemon killed with a call rung
answers UNAVAILABLE, never hangs; the GIL is released while a call is waited for; many threads at once; two calls in flight at once from one
thread (forward_async); a full ring refuses a call at once; a client across fork refuses; an
install without the library says how to get one; and the stream calls' binding (enqueue,
stream_result, release, failures) over the fake CUDA driver of tests/unit.
"""

import os
import signal
import subprocess
import sys
import textwrap
import threading

import ml_dtypes
import numpy as np
import pytest

from conftest import BUILD, ROOT, Daemon
from test_c_library import INCLUDE

import moed._clib as L
from moed import MoEClient, MoEError, RingClient

SPEC = "layers=2,d=64,ff=96,experts=8,topk=2,act=swiglu,dtype=bf16,seed=7"
D, E = 64, 8
NP = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}


def client_library():
    """The build's libmoedclient, or with a sanitizer build (which Python cannot load without its
    runtime) the copy `pip install ./client/python` packaged."""
    cache = BUILD / "CMakeCache.txt"
    if cache.exists() and "MOED_SANITIZE:BOOL=ON" in cache.read_text():
        assert os.path.isfile(L.PACKAGED), "no libmoedclient in the installed package (tests/run-all.sh client)"
        return L.PACKAGED
    return str(BUILD / "client" / "c" / "libmoedclient.so")


os.environ["MOED_CLIENT_LIB"] = client_library()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = Daemon(["--synthetic", SPEC, "--threads", "2"], tmp_path_factory.mktemp("moed") / "moed.log")
    yield d
    assert d.stop() == 0, d.log()


def inputs(rng, T, k, dtype="f32"):
    x = rng.standard_normal((T, D)).astype(np.float32).astype(NP[dtype])
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int64)
    w = (rng.random((T, k)) + 0.05).astype(np.float32)
    if k > 1:  # padding pairs, as the gRPC path takes them
        ids[::3, -1], w[::3, -1] = -1, 0.0
    return x, ids, w


def grpc_output(address, layer, x, ids, w):
    with MoEClient(address, timeout=60) as c:
        return c.forward(layer, x, expert_ids=ids, expert_weights=w)


def test_structs_match_the_header(tmp_path):
    """Each ctypes struct's size and every field's offset equal the C compiler's for moedclient.h."""
    lines = ['#include "moedclient.h"', "#include <stddef.h>", "#include <stdio.h>", "int main(void) {"]
    for cname, cls in L.STRUCTS.items():
        lines.append(f'printf("{cname} %zu\\n", sizeof({cname}));')
        for field, _ in cls._fields_:
            lines.append(f'printf("{cname}.{field} %zu\\n", offsetof({cname}, {field}));')
    lines.append("return 0; }")
    src = tmp_path / "sizes.c"
    src.write_text("\n".join(lines))
    exe = tmp_path / "sizes"
    p = subprocess.run(["cc", "-std=c11", "-I", str(INCLUDE), str(src), "-o", str(exe)],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    c_says = dict(line.split() for line in subprocess.check_output([str(exe)], text=True).splitlines())
    py_says = {}
    for cname, cls in L.STRUCTS.items():
        py_says[cname] = str(__import__("ctypes").sizeof(cls))
        for field, _ in cls._fields_:
            py_says[f"{cname}.{field}"] = str(getattr(cls, field).offset)
    assert py_says == c_says


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_outputs_equal_grpc(served, dtype):
    """Over k 1..4 and T 1..300, copied in, named in place (host_array) and written into out=,
    every output equals the gRPC path's bit for bit, in hidden's dtype."""
    rng = np.random.default_rng(11)
    with RingClient(served.address) as rc:
        arena = rc.host_array(2 * 300 * D * 4 + 4096)
        for k in (1, 2, 3, 4):
            for T in (1, 7, 64, 300):
                layer = (k + T) % 2
                x, ids, w = inputs(rng, T, k, dtype)
                want = grpc_output(served.address, layer, x, ids, w)
                y = rc.forward(layer, x, ids, w)
                assert y.dtype == x.dtype and y.shape == x.shape and y.flags.writeable
                assert y.tobytes() == want.tobytes(), (k, T)
                x_in = arena[:x.nbytes].view(x.dtype).reshape(x.shape)
                out = arena[x.nbytes + 256:2 * x.nbytes + 256].view(x.dtype).reshape(x.shape)
                x_in[:] = x
                assert rc.forward(layer, x_in, ids, w, out=out) is out
                assert out.tobytes() == want.tobytes(), (k, T)
                mine = np.empty_like(x)
                assert rc.forward(layer, x, expert_ids=ids, expert_weights=w, out=mine) is mine
                assert mine.tobytes() == want.tobytes(), (k, T)


def test_bad_inputs(served):
    """Each bad input is a MoEError with its status and a message; the daemon and the client go
    on answering."""
    rng = np.random.default_rng(3)
    x, ids, w = inputs(rng, 4, 2)
    want = grpc_output(served.address, 0, x, ids, w)
    bad_ids = ids.copy()
    bad_ids[1, 0] = E + 1
    nan_w = w.copy()
    nan_w[2, 0] = np.nan
    cases = [
        (dict(layer=9), "NOT_FOUND", "layer 9"),
        (dict(ids=bad_ids), "INVALID_ARGUMENT", "expert"),
        (dict(w=nan_w), "INVALID_ARGUMENT", "weight"),
        (dict(ids=ids[:3]), "INVALID_ARGUMENT", "[T, k]"),
        (dict(x=x.astype(np.int32)), "INVALID_ARGUMENT", "dtype"),
        (dict(x=rng.standard_normal((4, D // 2)).astype(np.float32)), "INVALID_ARGUMENT", "hidden.region.length"),
        (dict(w=None), "INVALID_ARGUMENT", "topk_weights"),
        (dict(out=np.empty((5, D), np.float32)), "INVALID_ARGUMENT", "out"),
    ]
    with RingClient(served.address) as rc:
        for change, code, words in cases:
            a = dict(layer=0, x=x, ids=ids, w=w, out=None)
            a.update(change)
            with pytest.raises(MoEError) as e:
                rc.forward(a["layer"], a["x"], a["ids"], a["w"], out=a["out"])
            assert e.value.code_name == code and words in e.value.message, (change, e.value)
            assert rc.forward(0, x, ids, w).tobytes() == want.tobytes()


def test_killed_daemon_answers_unavailable(daemon):
    """A call rung to a daemon that is then killed (stopped first, so the call is surely in
    flight) completes UNAVAILABLE, and later calls are refused UNAVAILABLE: nothing hangs."""
    d = daemon("--synthetic", SPEC)
    x, ids, w = inputs(np.random.default_rng(5), 3, 2)
    with RingClient(d.address) as rc:
        rc.forward(0, x, ids, w)
        d.pause()
        h = rc.forward_async(0, x, ids, w)
        assert not h.done()
        assert d.stop(signal.SIGKILL) == -signal.SIGKILL
        with pytest.raises(MoEError) as e:
            h.wait(timeout=120)  # a hang guard: the library's watchdog answers in milliseconds
        assert e.value.code_name == "UNAVAILABLE", e.value
        with pytest.raises(MoEError) as e:
            rc.forward(0, x, ids, w)
        assert e.value.code_name == "UNAVAILABLE", e.value


def test_threads_at_once(served):
    """Eight threads on one client, 20 calls each of their own shapes: every output is the gRPC
    path's."""
    rng = np.random.default_rng(8)
    work = []
    for i in range(8):
        x, ids, w = inputs(rng, 1 + 13 * i, 1 + i % 4, ["f32", "f16", "bf16"][i % 3])
        work.append((x, ids, w, grpc_output(served.address, i % 2, x, ids, w)))
    wrong = []
    with RingClient(served.address, slots=8) as rc:
        def run(i):
            x, ids, w, want = work[i]
            for _ in range(20):
                if rc.forward(i % 2, x, ids, w).tobytes() != want.tobytes():
                    wrong.append(i)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not wrong


def test_async_calls_overlap(daemon):
    """Two forward_async calls of one thread are in flight at once (neither done while the daemon
    is stopped), then both complete with the gRPC path's outputs."""
    d = daemon("--synthetic", SPEC)
    rng = np.random.default_rng(9)
    a, b = inputs(rng, 6, 2), inputs(rng, 9, 3, "bf16")
    want = [grpc_output(d.address, 0, *a), grpc_output(d.address, 1, *b)]
    with RingClient(d.address) as rc:
        ha, hb = rc.forward_async(0, *a), rc.forward_async(1, *b)  # the two calls' buffers, made
        ha.wait(), hb.wait()                                       # while the daemon answers
        d.pause()
        try:
            ha, hb = rc.forward_async(0, *a), rc.forward_async(1, *b)
            assert not ha.done() and not hb.done()
        finally:
            d.send_signal(signal.SIGCONT)
        assert hb.wait().tobytes() == want[1].tobytes()
        assert ha.wait().tobytes() == want[0].tobytes()
        assert ha.done() and ha.timings.compute_us > 0


def test_the_gil_is_released_while_waiting(daemon):
    """A thread waiting for a call (the daemon stopped, so it surely waits) leaves the GIL to the
    others: this thread runs Python meanwhile and finds the waiter still waiting. (Were the GIL
    held, this thread would run only once the wait had ended: its timeout, a hang guard.)"""
    d = daemon("--synthetic", SPEC)
    x, ids, w = inputs(np.random.default_rng(13), 3, 2)
    want = grpc_output(d.address, 0, x, ids, w)
    with RingClient(d.address) as rc:
        rc.forward(0, x, ids, w)
        d.pause()
        got = []
        try:
            h = rc.forward_async(0, x, ids, w)
            waiter = threading.Thread(target=lambda: got.append(h.wait(timeout=20)))
            waiter.start()
            while waiter.is_alive() and "_wait_host" not in repr(sys._current_frames().get(waiter.ident)):
                pass  # until the waiter is in the wait (in the frame that calls moedc_ring_wait)
            assert sum(range(200000)) > 0 and waiter.is_alive() and not got
        finally:
            d.send_signal(signal.SIGCONT)
        waiter.join()
        assert got[0].tobytes() == want.tobytes()


def test_full_ring_refuses_at_once(daemon):
    """With every slot in flight a call is refused RESOURCE_EXHAUSTED saying what to do; once the
    calls are waited for, calls go through again."""
    d = daemon("--synthetic", SPEC)
    x, ids, w = inputs(np.random.default_rng(4), 2, 2)
    want = grpc_output(d.address, 0, x, ids, w)
    with RingClient(d.address, slots=2) as rc:
        [h.wait() for h in [rc.forward_async(0, x, ids, w) for _ in range(2)]]  # two buffers made
        d.pause()
        try:
            hs = [rc.forward_async(0, x, ids, w) for _ in range(2)]
            with pytest.raises(MoEError) as e:
                rc.forward_async(0, x, ids, w)
            assert e.value.code_name == "RESOURCE_EXHAUSTED" and "more slots" in e.value.message
        finally:
            d.send_signal(signal.SIGCONT)
        assert all(h.wait().tobytes() == want.tobytes() for h in hs)
        assert rc.forward(0, x, ids, w).tobytes() == want.tobytes()


def test_client_across_fork(served):
    """A client used in a forked child refuses FAILED_PRECONDITION (open one in the child); the
    parent's goes on."""
    x, ids, w = inputs(np.random.default_rng(6), 2, 2)
    with RingClient(served.address) as rc:
        want = rc.forward(0, x, ids, w)
        r, wr = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report what the call raised, touch nothing else
            try:
                rc.forward(0, x, ids, w)
                msg = b"no error"
            except MoEError as e:
                msg = f"{e.code_name} {e.message}".encode()
            os.write(wr, msg)
            os._exit(0)
        os.close(wr)
        said = os.read(r, 4096).decode()
        os.waitpid(pid, 0)
        os.close(r)
        assert said.startswith("FAILED_PRECONDITION") and "fork" in said, said
        assert rc.forward(0, x, ids, w).tobytes() == want.tobytes()


def test_without_the_library(served):
    """The package's sources alone (no packaged library) and no $MOED_CLIENT_LIB: FAILED_PRECONDITION
    saying how to get it; MoEClient works as ever."""
    code = textwrap.dedent(f"""
        import moed
        assert moed._clib.path() is None, moed._clib.path()
        with moed.MoEClient({served.address!r}) as c:
            c.health()
        try:
            moed.RingClient({served.address!r})
        except moed.MoEError as e:
            print(e.code_name, e.message)
    """)
    env = {k: v for k, v in os.environ.items() if k != "MOED_CLIENT_LIB"}
    env["PYTHONPATH"] = str(ROOT / "client" / "python")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd="/")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("FAILED_PRECONDITION") and "MOED_CLIENT_LIB" in p.stdout, p.stdout


STREAM_SCRIPT = """
import ctypes, sys
import numpy as np
import moed._clib as L
from moed import MoEClient, RingClient

target, T, K = sys.argv[1], 5, 2
rng = np.random.default_rng(2)
x = rng.standard_normal((T, 64)).astype(np.float32)
ids = np.stack([rng.choice(8, K, replace=False) for _ in range(T)]).astype(np.int32)
w = rng.random((T, K)).astype(np.float32)
with MoEClient(target) as c:
    want = c.forward(0, x, expert_ids=ids, expert_weights=w)
cu = ctypes.CDLL("libcuda.so.1")  # the fake: streams are threads, device pointers host addresses
rc = RingClient(target, slots=4)
mem = rc.host_array(1 << 16)
region = rc._regions[0][2]
mem[:x.nbytes] = x.view(np.uint8).reshape(-1)
mem[4096:4096 + ids.nbytes] = ids.view(np.uint8).reshape(-1)
mem[8192:8192 + w.nbytes] = w.view(np.uint8).reshape(-1)
y = mem[16384:16384 + x.nbytes].view(np.float32).reshape(T, 64)
call = rc._call(0, 1, (T, 64), K)
call.hidden, call.expert_ids = L.Ref(region, 0), L.Ref(region, 4096)
call.expert_weights, call.output = L.Ref(region, 8192), L.Ref(region, 16384)
stream = ctypes.c_void_p()
assert cu.cuStreamCreate(ctypes.byref(stream), 0) == 0
res, err = L.RingResult(), L.Error()
t = rc._start(rc._ring, call, stream)
assert cu.cuStreamSynchronize(stream) == 0
assert rc._lib.moedc_ring_stream_result(rc._ring, ctypes.byref(t), ctypes.byref(res), ctypes.byref(err)) == 1
assert res.status == 0 and y.tobytes() == want.tobytes(), res.message
cu.fake_cuda_capture(stream, 1)
tc = rc._start(rc._ring, call, stream)
cu.fake_cuda_capture(stream, 0)
for _ in range(3):
    y[:] = 0
    cu.fake_cuda_replay(stream)
    assert cu.cuStreamSynchronize(stream) == 0
    assert y.tobytes() == want.tobytes()
assert rc._lib.moedc_ring_release(rc._ring, ctypes.byref(tc), ctypes.byref(err)) == 0, err.msg
assert rc._lib.moedc_ring_failures(rc._ring) == 0
rc.close()
print("STREAM OK")
"""


def test_stream_binding_over_the_fake_driver(served, tmp_path):
    """moedc_ring_enqueue, stream_result, release and failures through the ctypes binding, over
    the fake driver (a stream call, then one captured and replayed three times): the gRPC path's
    output each time, the captured slot released, no failure counted."""
    # built here without the build's sanitizer flags: Python loads it (and the library) as they are
    fake = tmp_path / "fake-cuda"
    fake.mkdir()
    p = subprocess.run(["cc", "-std=c11", "-shared", "-fPIC", str(ROOT / "tests" / "unit" / "fake_libcuda.c"),
                        "-o", str(fake / "libcuda.so.1"), "-lpthread"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    script = tmp_path / "stream.py"
    script.write_text(STREAM_SCRIPT)
    env = dict(os.environ, LD_LIBRARY_PATH=f"{fake}:{os.environ.get('LD_LIBRARY_PATH', '')}")
    p = subprocess.run([sys.executable, str(script), served.address], capture_output=True, text=True,
                       env=env, timeout=300)
    assert p.returncode == 0 and "STREAM OK" in p.stdout, p.stdout + p.stderr

