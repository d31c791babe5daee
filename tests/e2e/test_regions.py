"""Tensor regions (docs/regions.md) on the CPU backend: a request whose tensors and output lie in shared
memory gets, bit for bit, what the same request sent inline gets, for every routing kind, alone and
merged with others; and every rule of moed.proto's list holds: bounds (overflow too) and alignment,
ownership by token (another token's region is NOT_FOUND exactly as an unknown one), names, caps,
the challenge, a region shrunk under the server (FAILED_PRECONDITION, the daemon stays up), an
unregister or a session's end while a request holding the region waits in the queue (it completes:
no use after unmap, which the ASan stage would catch), leases ending with the stream, a client
killed with SIGKILL leaving nothing registered, deadlines and the drain, and the same-host rule (a
caller over the host's own non-loopback address is remote). After each refusal the next call is
served.
"""

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest

import oracle as O
from conftest import Daemon
from daemons import DaemonPool
from prod import metrics_flags, scrape
from regions import Session, Shm, list_regions, ref, tensor, unary

from moed._proto.moed.v1 import moed_pb2 as pb

SPEC = O.Spec(layers=2, d=64, ff=96, experts=8, topk=2, seed=11)
TOKENS = ("token-alpha", "token-beta")
A = [("authorization", f"Bearer {TOKENS[0]}")]
B = [("authorization", f"Bearer {TOKENS[1]}")]
MERGE = 3  # requests of one merged launch in the merging daemon
KINDS = ("experts", "topk", "sigmoid", "server", "batch")


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("regions")
    (tmp / "tokens").write_text(f"# two principals\n{TOKENS[0]}\n{TOKENS[1]}\n")
    p = DaemonPool(tmp)
    p.tokens = str(tmp / "tokens")
    yield p
    p.close()


def plain(pool):
    """The daemon most tests share: two tokens, small caps, metrics on."""
    if not hasattr(pool, "port"):
        flags, pool.port = metrics_flags()
        pool.flags = ["--auth-token-file", pool.tokens, "--max-regions", "4", "--max-region-bytes",
                      "1MiB", *flags]
    return pool.synthetic(SPEC, *pool.flags)


def merging(pool):
    """Every launch waits for MERGE requests."""
    return pool.synthetic(SPEC, "--auth-token-file", pool.tokens, "--max-delay-us", "30000000",
                          "--min-batch-requests", str(MERGE))


def forward(ch, q, md=A, timeout=30):
    return unary(ch, "Forward", pb.ForwardRequest, pb.ForwardResponse)(q, metadata=md, timeout=timeout)


def forward_future(ch, q, md=A):
    return unary(ch, "Forward", pb.ForwardRequest, pb.ForwardResponse).future(q, metadata=md, timeout=60)


def refused(fn):
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value.code(), e.value.details()


# ---- requests, inline or in a region ------------------------------------------------------------

class Case:
    """One request's tensors (name -> (dtype, array)) and how it is routed."""

    def __init__(self, kind, T, seed, layer=0, dtype="f32"):
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((T, SPEC.d)).astype(np.float32)
        self.kind, self.layer, self.T, self.dtype = kind, layer, T, dtype
        self.tensors = {"hidden": (dtype, O.bf16_bits(x) if dtype == "bf16" else x)}
        if kind == "experts":
            ids = np.stack([rng.permutation(SPEC.experts)[:2] for _ in range(T)]).astype(np.int32)
            self.tensors["expert_ids"] = ("i32", ids)
            self.tensors["expert_weights"] = ("f32", rng.uniform(0, 1, (T, 2)).astype(np.float32))
        elif kind in ("topk", "sigmoid", "batch"):
            self.tensors["logits"] = ("f32", (2 * rng.standard_normal((T, SPEC.experts))).astype(np.float32))

    @property
    def out_bytes(self):
        return self.T * SPEC.d * (4 if self.dtype == "f32" else 2)

    def request(self, where=None, output=None):
        """The ForwardRequest: inline, or (where = (shm, region, offset)) every tensor placed in the
        region from offset on; output = (region, offset) puts the output there."""
        at = [where[2]] if where else None

        def t(name):
            dt, a = self.tensors[name]
            if not where:
                return tensor(dt, a)
            shm, region, _ = where
            off = shm.put(at[0], a)
            at[0] = (off + a.nbytes + 63) // 64 * 64
            return tensor(dt, a, (region, off))

        q = pb.ForwardRequest(request_id=f"{self.kind}-{self.T}", layer=self.layer, hidden=t("hidden"))
        if self.kind == "experts":
            q.experts.CopyFrom(pb.ExpertChoice(expert_ids=t("expert_ids"), expert_weights=t("expert_weights")))
        elif self.kind == "server":
            q.server_router.CopyFrom(pb.ServerRouter(gating=pb.Gating(strategy=pb.TOPK, top_k=2)))
        else:
            strategy = pb.SIGMOID if self.kind == "sigmoid" else pb.TOPK
            q.logits.CopyFrom(pb.RouterLogits(logits=t("logits"), gating=pb.Gating(strategy=strategy)))
        if self.kind == "batch":
            q.batch_gating.CopyFrom(pb.BatchGating(k_batch=2))
        if output:
            q.output.CopyFrom(ref(output[0], output[1], self.out_bytes))
        return q


def placed(shm, region, case, base=64):
    """case's request with every tensor in the region and the output behind them (its offset)."""
    out = base + 16384
    return case.request((shm, region, base), (region, out)), out


# ---- results ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_region_forward_is_inline_forward_for_every_routing(pool, dtype):
    d = plain(pool)
    shm = Shm(1 << 16)
    try:
        with d.channel() as ch:
            s = Session(ch, A)
            region = s.host(shm)
            for i, kind in enumerate(KINDS):
                c = Case(kind, 3 + 5 * i, 100 + i, layer=i % 2, dtype=dtype)
                want = forward(ch, c.request())
                q, out = placed(shm, region, c)
                got = forward(ch, q)
                assert got.output.WhichOneof("contents") == "region" and got.output.region == q.output
                assert list(got.output.shape) == [c.T, SPEC.d] and got.output.dtype == want.output.dtype
                assert shm.get(out, c.out_bytes) == want.output.data, kind
                assert list(got.expert_set) == list(want.expert_set), kind
                t = got.timings  # reported as for inline requests
                assert (t.batch_tokens, t.batch_requests) == (c.T, 1) and 0 < t.total_us >= t.queue_us, t
                # hidden in the region, the output inline, and the other way round
                half = forward(ch, c.request((shm, region, 64)))
                assert half.output.data == want.output.data, kind
                back = forward(ch, c.request(output=(region, out)))
                assert not back.output.data and shm.get(out, c.out_bytes) == want.output.data, kind
            s.close()
    finally:
        shm.close()


def test_merged_region_requests_are_bit_identical_to_alone(pool):
    """A launch of MERGE requests — one inline, one with hidden in a region, one entirely in regions
    and answering into one — gives each the bytes it gets alone (from the plain daemon), for every
    routing kind; batch gating chooses across the launch, so there the same launch sent inline is
    the reference."""
    alone, merged = plain(pool), merging(pool)
    shm = Shm(1 << 17)
    try:
        with alone.channel() as ach, merged.channel() as ch:
            s = Session(ch, A)
            region = s.host(shm)
            for kind in KINDS:
                cases = [Case(kind, 2 + 3 * i, 300 + i) for i in range(MERGE)]
                if kind == "batch":
                    want = [f.result().output.data for f in [forward_future(ch, c.request()) for c in cases]]
                else:
                    want = [forward(ach, c.request()).output.data for c in cases]
                q2, out2 = placed(shm, region, cases[2], base=32768)
                reqs = [cases[0].request(), cases[1].request((shm, region, 64)), q2]
                got = [f.result() for f in [forward_future(ch, q) for q in reqs]]
                assert all(g.timings.batch_requests == MERGE for g in got), [g.timings for g in got]
                assert got[0].output.data == want[0] and got[1].output.data == want[1], kind
                assert shm.get(out2, cases[2].out_bytes) == want[2], kind
            s.close()
    finally:
        shm.close()


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_output_over_hidden_is_inline_forward(pool, dtype):
    """The output written over hidden's own bytes (as the Python client's arenas ask) is, bit for
    bit, the inline output, for every routing kind, alone and in a merged launch whose other
    requests lie right before and after it in the same region; an output that overlaps hidden
    without being the same bytes is INVALID_ARGUMENT, and the next call is served."""
    alone, merged = plain(pool), merging(pool)
    shm = Shm(1 << 17)
    try:
        with alone.channel() as ach, merged.channel() as ch:
            sa, s = Session(ach, A), Session(ch, A)
            ra, region = sa.host(shm), s.host(shm)
            for i, kind in enumerate(KINDS):
                c = Case(kind, 3 + 4 * i, 500 + i, layer=i % 2, dtype=dtype)
                want = forward(ach, c.request()).output.data
                q, _ = placed(shm, ra, c)
                q.output.offset = q.hidden.region.offset
                got = forward(ach, q)
                assert got.output.region == q.output
                assert shm.get(q.output.offset, c.out_bytes) == want, kind
                # merged: three requests in place, their hidden rows side by side
                cases = [Case(kind, 2 + 3 * j, 600 + 10 * i + j, dtype=dtype) for j in range(MERGE)]
                if kind == "batch":  # chosen over the launch: the same launch inline is the reference
                    wants = [f.result().output.data for f in [forward_future(ch, k.request()) for k in cases]]
                else:
                    wants = [forward(ach, k.request()).output.data for k in cases]
                reqs, at = [], 64
                for k in cases:  # each hidden right behind the one before; routing inline
                    rq = k.request(output=(region, shm.put(at, k.tensors["hidden"][1])))
                    rq.hidden.CopyFrom(tensor(dtype, k.tensors["hidden"][1], (region, at)))
                    reqs.append(rq)
                    at += k.out_bytes
                got = [f.result() for f in [forward_future(ch, rq) for rq in reqs]]
                assert all(g.timings.batch_requests == MERGE for g in got), [g.timings for g in got]
                for k, rq, w in zip(cases, reqs, wants):
                    assert shm.get(rq.output.offset, k.out_bytes) == w, kind
            c = Case("experts", 4, 7, dtype=dtype)
            q, _ = placed(shm, ra, c, base=4096)
            row = SPEC.d * (4 if dtype == "f32" else 2)
            for shift in (row, -row, c.out_bytes - row):
                q.output.offset = q.hidden.region.offset + shift
                code, msg = refused(lambda: forward(ach, q))
                assert code == grpc.StatusCode.INVALID_ARGUMENT and "overlaps hidden" in msg, msg
            q.output.offset = q.hidden.region.offset + c.out_bytes  # right behind it: fine
            forward(ach, q)
            assert shm.get(q.output.offset, c.out_bytes) == forward(ach, c.request()).output.data
            sa.close()
            s.close()
    finally:
        shm.close()


# ---- references --------------------------------------------------------------------------------

def test_bad_references_and_foreign_regions(pool):
    d = plain(pool)
    shm, theirs = Shm(4096), Shm(4096)
    c = Case("experts", 4, 7)
    try:
        with d.channel() as ch:
            s, t = Session(ch, A), Session(ch, B)
            region, other = s.host(shm), t.host(theirs)
            n = c.out_bytes

            def with_hidden(offset, length=n, region_id=region):
                q = c.request()
                q.hidden.region.CopyFrom(ref(region_id, offset, length))
                return q

            for q, words in [(with_hidden(4096 - n + 4), "run past the end"),
                             (with_hidden(2**64 - 8), "run past the end"),   # offset + length overflows
                             (with_hidden(2), "not a multiple of 4"),
                             (with_hidden(0, n - 4), "need exactly")]:
                code, msg = refused(lambda: forward(ch, q))
                assert code == grpc.StatusCode.INVALID_ARGUMENT and words in msg, msg
            q = c.request(output=(region, 4096 - 64))
            code, msg = refused(lambda: forward(ch, q))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "output.region" in msg
            # another token's region reads exactly as one that never existed
            unknown = refused(lambda: forward(ch, with_hidden(0, region_id=12345)))
            foreign = refused(lambda: forward(ch, with_hidden(0, region_id=other)))
            assert unknown[0] == foreign[0] == grpc.StatusCode.NOT_FOUND
            assert unknown[1].replace("12345", "ID") == foreign[1].replace(str(other), "ID")
            assert other not in [r.id for r in list_regions(ch, A)]
            assert region not in [r.id for r in list_regions(ch, B)]
            assert s.unregister(other).code == grpc.StatusCode.NOT_FOUND.value[0]
            # each owner uses its own, and the refused callers are served as ever
            shm.put(0, c.tensors["hidden"][1])
            theirs.put(0, c.tensors["hidden"][1])
            want = forward(ch, c.request(), md=B).output.data
            assert forward(ch, with_hidden(0), md=A).output.data == want
            assert forward(ch, with_hidden(0, region_id=other), md=B).output.data == want
            s.close()
            t.close()
    finally:
        shm.close()
        theirs.close()


# ---- registration -------------------------------------------------------------------------------

def test_registration_rules(pool):
    d = plain(pool)
    shms = [Shm(4096) for _ in range(5)]
    small = Shm(1024)
    try:
        with d.channel() as ch:
            info = unary(ch, "GetModel", pb.GetModelRequest, pb.ModelInfo)(pb.GetModelRequest(), metadata=A)
            assert info.regions.mode == "local" and info.regions.max_regions == 4
            assert info.regions.max_region_bytes == 1 << 20 and not info.regions.cuda
            s = Session(ch, A)

            def reg(name, size=4096):
                return s.command(register_host=pb.RegisterHostRegion(name=name, bytes=size))

            INVALID, NOT_FOUND, PRECOND, EXHAUSTED = (grpc.StatusCode.INVALID_ARGUMENT.value[0],
                                                      grpc.StatusCode.NOT_FOUND.value[0],
                                                      grpc.StatusCode.FAILED_PRECONDITION.value[0],
                                                      grpc.StatusCode.RESOURCE_EXHAUSTED.value[0])
            for name in ("/a/b", "/..", "/a..b", "/.", "noslash", "/", "/" + "x" * 255, "/bad name"):
                ev = reg(name)
                assert ev.code == INVALID and "register_host.name" in ev.message, name
            assert reg(shms[0].name, 8).code == INVALID                 # under the 16-byte challenge
            for size in (2**64 - 1, 2**63):                             # no object holds that much
                ev = reg(shms[0].name, size)
                assert ev.code in (INVALID, EXHAUSTED) and f"{size}" in ev.message, ev
                assert "at least" not in ev.message, ev.message
            assert reg(small.name, 4096).code == PRECOND                 # the object is smaller
            assert reg("/moed-test-none-such").code == NOT_FOUND
            ev = reg(shms[0].name, 2 << 20)                              # over --max-region-bytes
            assert ev.code == EXHAUSTED and "--max-region-bytes" in ev.message
            ev = s.register_host(shms[0], challenge=b"\0" * 16)         # the challenge not written
            assert ev.code == PRECOND and "challenge" in ev.message
            if ev.region.id:
                assert s.unregister(ev.region.id).code == 0
            assert s.command(confirm_host=pb.ConfirmHostRegion(region=999)).code == NOT_FOUND
            cuda = s.command(register_cuda=pb.RegisterCudaRegion(ipc_handle=b"\1" * 64, bytes=64))
            assert cuda.code == PRECOND and "cpu backend" in cuda.message
            ids = [s.host(x) for x in shms[:4]]                          # up to --max-regions
            ev = reg(shms[4].name)
            assert ev.code == EXHAUSTED and "--max-regions" in ev.message
            again = s.command(confirm_host=pb.ConfirmHostRegion(region=ids[0]))
            assert again.code == PRECOND and "confirmed already" in again.message
            assert s.command().code == INVALID                           # no command at all
            listed = {r.id: r for r in list_regions(ch, A)}
            assert set(ids) <= set(listed) and all(listed[i].ready for i in ids)
            for i in ids:
                assert s.unregister(i).code == 0
            assert s.unregister(ids[0]).code == NOT_FOUND
            s.close()
            assert forward(ch, Case("topk", 2, 1).request()).output.data   # still serving
    finally:
        for x in shms + [small]:
            x.close()


# ---- a region that shrinks ----------------------------------------------------------------------

def test_shrunk_region_fails_its_request_and_nothing_else(pool):
    d = plain(pool)
    shm, out = Shm(1 << 16), Shm(1 << 16)
    c = Case("topk", 6, 5)
    try:
        with d.channel() as ch:
            s = Session(ch, A)
            region, oregion = s.host(shm), s.host(out)
            want = forward(ch, c.request()).output.data
            q, _ = placed(shm, region, c)
            shm.truncate(0)                     # hidden's pages are gone: the copy-in faults
            code, msg = refused(lambda: forward(ch, q))
            assert code == grpc.StatusCode.FAILED_PRECONDITION and "shrank under the server" in msg
            code, msg = refused(lambda: forward(ch, q))   # and every later use the same way
            assert code == grpc.StatusCode.FAILED_PRECONDITION and "shrank" in msg
            assert [r.broken for r in list_regions(ch, A) if r.id == region] == [True]
            out.truncate(0)                     # the output's pages are gone: the copy-out faults
            code, msg = refused(lambda: forward(ch, c.request(output=(oregion, 64))))
            assert code == grpc.StatusCode.FAILED_PRECONDITION and "shrank" in msg
            assert forward(ch, c.request()).output.data == want
            s.close()
    finally:
        shm.close()
        out.close()


# ---- leases and references ------------------------------------------------------------------------

def wait_holding(ch, region, n, md=A):
    """Until ListRegions says requests hold `n` references on the region (validated, waiting in
    the queue)."""
    for _ in range(3000):  # a hang guard of a minute, never the thing asserted
        if [r.requests for r in list_regions(ch, md) if r.id == region] == [n]:
            return
        time.sleep(0.02)
    raise AssertionError(f"region {region} never held by {n} requests")


@pytest.mark.parametrize("how", ["unregister", "session end"])
def test_release_while_a_request_waits_in_the_queue(pool, how):
    alone, d = plain(pool), merging(pool)
    shm = Shm(1 << 17)
    cases = [Case("experts", 3 + i, 900 + i) for i in range(MERGE)]
    try:
        with alone.channel() as ach, d.channel() as ch:
            want = [forward(ach, c.request()).output.data for c in cases]
            s = Session(ch, A)
            region = s.host(shm)
            q, out = placed(shm, region, cases[0])
            first = forward_future(ch, q)
            wait_holding(ch, region, 2)  # hidden and the output
            if how == "unregister":
                assert s.unregister(region).code == 0
            else:
                s.close()
            assert region not in [r.id for r in list_regions(ch, A)]   # unknown at once
            code, _ = refused(lambda: forward(ch, q))                   # to new requests
            assert code == grpc.StatusCode.NOT_FOUND
            rest = [forward_future(ch, c.request()) for c in cases[1:]]  # the launch can go now
            assert first.result().output.region == q.output
            assert shm.get(out, cases[0].out_bytes) == want[0]
            assert [f.result().output.data for f in rest] == want[1:]
            if how == "unregister":
                s.close()
    finally:
        shm.close()


HOLDER = """
import sys, time
sys.path.insert(0, {here!r})
import grpc
from regions import Session, Shm
ch = grpc.insecure_channel({addr!r})
s = Session(ch, [("authorization", "Bearer {token}")])
shms = [Shm(8192) for _ in range(2)]
print(" ".join(x.path for x in shms), [s.host(x) for x in shms], flush=True)
time.sleep(120)
"""


def test_killed_client_leaves_nothing_registered(pool):
    d = plain(pool)
    here = os.path.dirname(os.path.abspath(__file__))
    p = subprocess.Popen([sys.executable, "-c", HOLDER.format(here=here, addr=d.address, token=TOKENS[0])],
                         stdout=subprocess.PIPE, text=True)
    paths = []
    try:
        line = p.stdout.readline()
        paths = line.split("[")[0].split()
        with d.channel() as ch:
            assert len([r for r in list_regions(ch, A) if r.ready]) >= 2, line
            assert scrape(pool.port).get("moed_regions", kind="host") >= 2
            p.send_signal(signal.SIGKILL)
            p.wait(10)
            for _ in range(3000):  # a hang guard of a minute
                if not list_regions(ch, A) and scrape(pool.port).get("moed_regions", kind="host") == 0:
                    break
                time.sleep(0.02)
            assert not list_regions(ch, A)
            m = scrape(pool.port)
            assert m.get("moed_regions", kind="host") == 0 and m.get("moed_region_bytes", kind="host") == 0
            assert forward(ch, Case("server", 2, 3).request()).output.data
    finally:
        if p.poll() is None:
            p.kill()
        for path in paths:
            if os.path.exists(path):
                os.unlink(path)


def test_regions_off(daemon):
    d = daemon("--synthetic", str(SPEC), "--threads", "1", "--regions", "off")
    shm = Shm(4096)
    try:
        with d.channel() as ch:
            s = Session(ch)
            with pytest.raises(grpc.RpcError) as e:
                s.command(register_host=pb.RegisterHostRegion(name=shm.name, bytes=4096))
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "--regions off" in e.value.details()
            q = Case("topk", 2, 1).request()
            q.hidden.region.CopyFrom(ref(1, 0, 2 * SPEC.d * 4))
            code, msg = refused(lambda: forward(ch, q, md=()))
            assert code == grpc.StatusCode.FAILED_PRECONDITION and "--regions off" in msg
    finally:
        shm.close()


def host_address():
    """This host's address on its default route, or None (only loopback)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("198.51.100.1", 9))  # a UDP connect picks the source address, sends nothing
        except OSError:
            return None
        ip = s.getsockname()[0]
    return None if ip.startswith("127.") else ip


@pytest.mark.parametrize("mode", ["local", "any"])
def test_same_host_rule(tmp_path, mode):
    """Over the host's own non-loopback address a caller counts as remote: --regions local refuses
    it a session and a reference to a region registered over loopback; --regions any serves both.
    With a token, which is what makes a remote caller's regions its own (without one it gets none:
    test_region_owners.py)."""
    ip = host_address()
    if not ip:
        pytest.skip("this host has no address but loopback")
    (tmp_path / "token").write_text(TOKENS[0] + "\n")
    # The last --listen wins: the wildcard one, on a port the kernel picks (the log names it).
    d = Daemon(["--synthetic", str(SPEC), "--threads", "1", "--regions", mode, "--auth-token-file",
                str(tmp_path / "token"), "--listen", "0.0.0.0:0"], tmp_path / "moed.log")
    port = d.port
    shm, theirs = Shm(1 << 16), Shm(1 << 16)
    c = Case("topk", 3, 8)
    try:
        with d.channel() as ch, grpc.insecure_channel(f"{ip}:{port}") as far:
            s = Session(ch, A)  # its regions live as long as it does
            region = s.host(shm)
            q, out = placed(shm, region, c)
            want = forward(ch, c.request()).output.data
            if mode == "any":
                t = Session(far, A)
                assert t.host(theirs) and len(list_regions(far, A)) == 2  # one principal: both
                forward(far, q)
                assert shm.get(out, c.out_bytes) == want
            else:
                with pytest.raises(grpc.RpcError) as e:
                    Session(far, A).host(theirs)
                assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "own host" in e.value.details()
                code, msg = refused(lambda: forward(far, q))
                assert code == grpc.StatusCode.FAILED_PRECONDITION and "own host" in msg
                assert forward(far, c.request()).output.data == want  # inline, as ever
    finally:
        shm.close()
        theirs.close()
        assert d.stop() == 0, d.log()


def test_c_client_shm_transport(pool, tmp_path):
    """moectl forward --shm and moed-load --transport shm --verify, against the same daemon."""
    from conftest import BUILD
    d = plain(pool)
    rng = np.random.default_rng(3)
    np.save(tmp_path / "x.npy", rng.standard_normal((7, SPEC.d)).astype(np.float32))
    np.save(tmp_path / "l.npy", rng.standard_normal((7, SPEC.experts)).astype(np.float32))
    moectl = str(BUILD / "client" / "c" / "moectl")
    base = [moectl, "--target", d.address, "--token", TOKENS[0], "forward", "--layer", "1",
            "--hidden", str(tmp_path / "x.npy"), "--logits", str(tmp_path / "l.npy")]
    for extra, out in (([], "a.npy"), (["--shm"], "b.npy")):
        r = subprocess.run(base + ["--out", str(tmp_path / out), *extra], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    assert (tmp_path / "a.npy").read_bytes() == (tmp_path / "b.npy").read_bytes()
    r = subprocess.run([str(BUILD / "client" / "c" / "moed-load"), "--target", d.address, "--token",
                        TOKENS[1], "--transport", "shm", "--concurrency", "3", "--threads", "2",
                        "--tokens", "1:16", "--routing", "logits", "--duration", "0.5", "--warmup", "0",
                        "--verify", "50", "--no-progress"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "transport shm" in r.stdout and " 0 mismatches" in r.stdout
    with d.channel() as ch:
        assert not list_regions(ch, B)  # moed-load's session ended with it


def test_deadline_and_drain_with_regions(daemon):
    """A region request past its deadline in the queue is DEADLINE_EXCEEDED and lets its region go;
    on SIGTERM a queued region request is launched and answered, the session ends UNAVAILABLE, and
    moed exits 0."""
    d = daemon("--synthetic", str(SPEC), "--threads", "1", "--max-delay-us", "30000000",
               "--min-batch-requests", "5")
    shm = Shm(1 << 17)
    c = Case("topk", 4, 21)
    try:
        with d.channel() as ch:
            s = Session(ch)
            region = s.host(shm)
            q, out = placed(shm, region, c)
            code, _ = refused(lambda: forward(ch, q, md=(), timeout=0.3))
            assert code == grpc.StatusCode.DEADLINE_EXCEEDED
            wait_holding(ch, region, 0, md=())  # the expired request let its references go
            waiting = forward_future(ch, q, md=())
            wait_holding(ch, region, 2, md=())
            d.send_signal(signal.SIGTERM)
            assert waiting.result().output.region == q.output
            with pytest.raises(grpc.RpcError) as e:
                s.command(unregister=pb.UnregisterRegion(region=region))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in e.value.details()
        assert d.stop() == 0
    finally:
        shm.close()

