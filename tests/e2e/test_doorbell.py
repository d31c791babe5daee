"""The doorbell (same-host calls through a ring in shared memory) on the CPU backend, driven by
ring.py's writes into the layout as moed_ring.h and moed.proto state it: a call's output is the
gRPC path's bit for bit (every dtype, padding, several layers), alone and merged into one launch
with gRPC calls; every descriptor field wrong on its own fails that call alone with a message
naming it (bounds that overflow, alignment, dtype, layer, T, k, lengths that disagree, another
principal's or an unregistered region) while a region of another session of the same principal
serves; registration's rules; tickets that wrap; every slot rung at once; a caller that never
reads its completions; a caller killed mid-call; 1,000 sessions opened and closed without a leaked
fd, mapping or shared-memory object; a ring whose memory shrank; the drain; the idle cost.
"""

import os
import signal
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest

import oracle as O
from conftest import Daemon
from daemons import DaemonPool, Worker
from held import held_call
from prod import ANY_METRICS_PORT, scrape
from regions import Session, Shm, list_regions, unary
from ring import CLOSED, DRAINING, SERVING, Ring, ring_bytes, wait_for, write_header

from moed._proto.moed.v1 import moed_pb2 as pb

SPEC = O.Spec(layers=3, d=64, ff=96, experts=8, topk=2, seed=11)
TOKENS = ("token-alpha", "token-beta")
A = [("authorization", f"Bearer {TOKENS[0]}")]
B = [("authorization", f"Bearer {TOKENS[1]}")]
MAX_RINGS = 3
MAX_TOKENS = 64
MAX_PAIRS = 100
HERE = os.path.dirname(os.path.abspath(__file__))
WIRE = {"f32": pb.F32, "f16": pb.F16, "bf16": pb.BF16}
OK, INVALID, NOT_FOUND, EXHAUSTED, PRECONDITION, UNAVAILABLE = 0, 3, 5, 8, 9, 14


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("doorbell")
    (tmp / "tokens").write_text(f"{TOKENS[0]}\n{TOKENS[1]}\n")
    p = DaemonPool(tmp)
    p.tokens = str(tmp / "tokens")
    yield p
    p.close()


def plain(pool):
    """The daemon most tests share: two tokens, small caps, metrics on."""
    return pool.synthetic(SPEC, "--auth-token-file", pool.tokens, "--max-rings", MAX_RINGS,
                          "--max-batch-tokens", MAX_TOKENS, "--max-batch-pairs", MAX_PAIRS,
                          *ANY_METRICS_PORT)


def merging(pool, n=3):
    """Every launch waits for n requests."""
    return pool.synthetic(SPEC, "--auth-token-file", pool.tokens, "--max-delay-us", "30000000",
                          "--min-batch-requests", n, *ANY_METRICS_PORT)


# ---- calls --------------------------------------------------------------------------------------

class Case:
    """One call's tensors: hidden [T, d] of dtype (its bits), expert ids and weights [T, k] with a
    padding pair (-1, 0) in every other row."""

    def __init__(self, T, seed, layer=0, dtype="f32", k=2):
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((T, SPEC.d)).astype(np.float32)
        self.x = {"f32": x, "f16": x.astype(np.float16), "bf16": O.bf16_bits(x)}[dtype]
        self.ids = np.stack([rng.permutation(SPEC.experts)[:k] for _ in range(T)]).astype(np.int32)
        self.w = rng.uniform(0, 1, (T, k)).astype(np.float32)
        self.ids[1::2, -1] = -1
        self.w[1::2, -1] = 0
        self.T, self.k, self.layer, self.dtype = T, k, layer, dtype

    @property
    def out_bytes(self):
        return self.x.nbytes

    def grpc(self, ch, md=A):
        """The output bytes the gRPC path gives for the same call (tensors inline)."""
        q = pb.ForwardRequest(request_id="alone", layer=self.layer,
                              hidden=pb.Tensor(dtype=WIRE[self.dtype], shape=list(self.x.shape),
                                               data=self.x.tobytes()))
        q.experts.CopyFrom(pb.ExpertChoice(
            expert_ids=pb.Tensor(dtype=pb.I32, shape=list(self.ids.shape), data=self.ids.tobytes()),
            expert_weights=pb.Tensor(dtype=pb.F32, shape=list(self.w.shape), data=self.w.tobytes())))
        return q


def forward(ch, q, md=A, timeout=60):
    return unary(ch, "Forward", pb.ForwardRequest, pb.ForwardResponse)(q, metadata=md, timeout=timeout)


def forward_future(ch, q, md=A):
    return unary(ch, "Forward", pb.ForwardRequest, pb.ForwardResponse).future(q, metadata=md, timeout=120)


class Caller:
    """A Regions session with one shared-memory object as a confirmed region, a ring of `slots`
    slots at its start, and room behind it for each slot's tensors (64 KiB a slot)."""

    def __init__(self, ch, md=A, slots=8, stride=65536):
        self.stride = stride
        self.base = (ring_bytes(slots) + 4095) // 4096 * 4096
        self.shm = Shm(self.base + slots * stride)
        self.session = Session(ch, md)
        self.region = self.session.host(self.shm)
        self.ring = Ring(self.session, self.shm, self.region, 0, slots)

    def put(self, slot, case):
        """Writes case's tensors into slot's room (the output's bytes to 0xee); returns the
        descriptor's fields for them."""
        at = self.base + slot * self.stride
        refs = {}
        for name, a in (("hidden", case.x), ("ids", case.ids), ("weights", case.w)):
            self.shm.put(at, a)
            refs[name] = (self.region, at, a.nbytes)
            at = (at + a.nbytes + 63) // 64 * 64
        refs["output"] = (self.region, at, case.out_bytes)
        self.shm.map[at:at + case.out_bytes] = b"\xee" * case.out_bytes
        return dict(layer=case.layer, dtype=WIRE[case.dtype], tokens=case.T, top_k=case.k, tag=slot, **refs)

    def place(self, slot, case, **over):
        """put, and the slot's descriptor written (fields in `over` replacing put's); returns
        where the output goes."""
        desc = self.put(slot, case)
        desc.update(over)
        self.ring.write(slot, **desc)
        return desc["output"]

    def output(self, out):
        return self.shm.get(out[1], out[2])

    def call(self, slot, case, **over):
        out = self.place(slot, case, **over)
        self.ring.ring(slot)
        return self.ring.wait(slot), self.output(out)

    def close(self):
        self.session.close()
        self.shm.close()


def expect_ok(done, got, want):
    assert done.status == OK, done.message
    assert done.message == ""
    assert got == want


# ---- results ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_outputs_are_the_grpc_paths(pool, dtype):
    d = plain(pool)
    with d.channel() as ch:
        c = Caller(ch)
        try:
            n = 0
            for layer in range(SPEC.layers):
                for T in (1, 5, 33):
                    case = Case(T, 100 * layer + T, layer, dtype)
                    want = forward(ch, case.grpc(ch)).output.data
                    done, got = c.call(n % 8, case)
                    expect_ok(done, got, want)
                    assert done.batch_tokens == T and done.batch_requests == 1
                    n += 1
            assert c.ring.completed() == n and c.ring.failures() == 0
            assert c.ring.state() == SERVING
        finally:
            c.close()


def test_merged_with_grpc_calls_bit_identical_to_alone(pool):
    """Two doorbell calls and one gRPC call in one launch (the merging daemon waits for three):
    each output is what it is alone."""
    cases = [Case(3, 1), Case(4, 2, dtype="f32"), Case(5, 3)]
    with plain(pool).channel() as ch:
        alone = [forward(ch, c.grpc(ch)).output.data for c in cases]
    with merging(pool).channel() as ch:
        c = Caller(ch)
        try:
            outs = [c.place(i, cases[i]) for i in range(2)]
            c.ring.ring(0)
            c.ring.ring(1)
            reply = forward_future(ch, cases[2].grpc(ch)).result()
            dones = [c.ring.wait(i) for i in range(2)]
            for i in range(2):
                expect_ok(dones[i], c.output(outs[i]), alone[i])
                assert dones[i].batch_requests == 3 and dones[i].batch_tokens == 12
            assert reply.output.data == alone[2]
            assert reply.timings.batch_requests == 3
        finally:
            c.close()


# ---- one bad field at a time --------------------------------------------------------------------

def bad_cases():
    """(id, descriptor fields over the good ones (a function of the caller and the good refs),
    code, what the message must say)."""
    big = 2 ** 64 - 64
    return [
        ("flags", lambda c, r: dict(flags=1), INVALID, "flags = 0x1"),
        ("reserved", lambda c, r: dict(reserved=7), INVALID, "reserved word"),
        ("layer", lambda c, r: dict(layer=9), NOT_FOUND, "layer 9 is not served"),
        ("dtype-i32", lambda c, r: dict(dtype=pb.I32), INVALID, "hidden has dtype"),
        ("dtype-unknown", lambda c, r: dict(dtype=99), INVALID, "hidden has dtype"),
        ("tokens-zero", lambda c, r: dict(tokens=0), INVALID, "T = 0"),
        ("tokens-over", lambda c, r: dict(tokens=MAX_TOKENS + 1), EXHAUSTED, "--max-batch-tokens"),
        ("tokens-disagree", lambda c, r: dict(tokens=3), INVALID, "hidden.region.length is 2048"),
        ("top_k-zero", lambda c, r: dict(top_k=0), INVALID, "expert_ids has shape [8, 0]"),
        ("top_k-disagree", lambda c, r: dict(top_k=3), INVALID, "expert_ids.region.length is 64"),
        ("hidden-misaligned", lambda c, r: dict(hidden=(r["hidden"][0], r["hidden"][1] + 2, r["hidden"][2])),
         INVALID, "hidden.region.offset"),
        ("hidden-overflow", lambda c, r: dict(hidden=(r["hidden"][0], big, r["hidden"][2])), INVALID,
         "run past the end"),
        ("hidden-length", lambda c, r: dict(hidden=(*r["hidden"][:2], 12)), INVALID, "hidden.region.length is 12"),
        ("ids-past-end", lambda c, r: dict(ids=(r["ids"][0], c.shm.size - 32, r["ids"][2])), INVALID,
         "experts.expert_ids.region: offset"),
        ("weights-length", lambda c, r: dict(weights=(*r["weights"][:2], 60)), INVALID,
         "experts.expert_weights.region.length is 60"),
        ("output-overflow", lambda c, r: dict(output=(r["output"][0], big + 32, r["output"][2])), INVALID,
         "output.region: offset"),
        ("output-misaligned", lambda c, r: dict(output=(r["output"][0], r["output"][1] + 1, r["output"][2])),
         INVALID, "output.region.offset"),
        ("output-over-hidden", lambda c, r: dict(output=(r["hidden"][0], r["hidden"][1] + 64, r["output"][2])),
         INVALID, "overlaps hidden"),
        ("ids-unknown-region", lambda c, r: dict(ids=(12345, *r["ids"][1:])), NOT_FOUND,
         "experts.expert_ids: region 12345 is not registered"),
        ("output-unknown-region", lambda c, r: dict(output=(1, *r["output"][1:])), NOT_FOUND,
         "output: region 1 is not registered"),
    ]


@pytest.mark.parametrize("name,over,code,says", bad_cases(), ids=[b[0] for b in bad_cases()])
def test_a_bad_field_fails_its_call_alone(pool, name, over, code, says):
    """Slot 0 carries the bad field, slot 1 a good call, rung with one bell: slot 0 fails with the
    code and a message naming the field, slot 1 is served, the ring serves on."""
    d = plain(pool)
    good, bad = Case(8, 5), Case(8, 6)
    with d.channel() as ch:
        want = forward(ch, good.grpc(ch)).output.data
        c = Caller(ch)
        try:
            c.place(0, bad, **over(c, c.put(0, bad)))
            good_out = c.place(1, good)
            c.ring.ring(0, bell=False)
            c.ring.ring(1)
            failed, served = c.ring.wait(0), c.ring.wait(1)
            assert failed.status == code, failed
            assert says in failed.message, failed.message
            expect_ok(served, c.output(good_out), want)
            assert c.ring.failures() == 1 and c.ring.completed() == 2
            assert c.ring.state() == SERVING
            expect_ok(*c.call(2, good), want)  # and the ring serves on
        finally:
            c.close()


def test_pairs_over_the_limit_fail_their_call(pool):
    """T x k with every pair an expert over --max-batch-pairs: RESOURCE_EXHAUSTED for that call."""
    d = plain(pool)
    case = Case(30, 31, k=4)  # 120 - 15 padding = 105 pairs
    with d.channel() as ch:
        c = Caller(ch)
        try:
            done, _ = c.call(0, case)
            assert done.status == EXHAUSTED and "routes 105 (token, expert) pairs" in done.message, done
            assert "--max-batch-pairs" in done.message
        finally:
            c.close()


def test_whose_regions_a_call_may_name(pool):
    """Another principal's region (token B) fails as an unknown one does; an unregistered region
    too; a region of another session of the same principal serves."""
    d = plain(pool)
    case = Case(4, 7)
    with d.channel() as ch:
        want = forward(ch, case.grpc(ch)).output.data
        c, mine, theirs = Caller(ch), Caller(ch, A), Caller(ch, B)
        gone_shm = Shm(65536)
        try:
            gone = c.session.host(gone_shm)
            assert c.session.unregister(gone).code == 0
            unknown = 0x7777_0000_0000_0001
            desc = mine.put(0, case)  # every tensor in the other session's region
            c.ring.write(0, **desc)
            c.ring.ring(0)
            expect_ok(c.ring.wait(0), mine.output(desc["output"]), want)
            for region in (theirs.region, gone, unknown):
                c.place(0, case, hidden=(region, 4096, case.x.nbytes))
                c.ring.ring(0)
                done = c.ring.wait(0)
                assert done.status == NOT_FOUND, done
                assert done.message == (f"hidden: region {region} is not registered for this caller (unknown, "
                                        "released with its session, or not yet confirmed); ListRegions lists "
                                        "the caller's regions"), done.message
        finally:
            for x in (c, mine, theirs):
                x.close()
            gone_shm.close()


# ---- registration -------------------------------------------------------------------------------

def test_registration_rules(pool):
    d = plain(pool)
    with d.channel() as ch:
        c = Caller(ch)
        s, shm, region = c.session, c.shm, c.region
        others = []
        try:
            def refused(code, says, **kw):
                ev = c.ring.register(**kw)
                assert ev.code == code and says in ev.message, ev
                assert not ev.HasField("ring")

            second = 1 << 16  # a place for more rings in the same region
            write_header(shm, second, 8)
            refused(INVALID, "not a multiple of 64", offset=second + 32)
            refused(INVALID, "no room for a ring's 256-byte header", offset=2 ** 64 - 64)
            refused(INVALID, "no room", offset=shm.size - 128)
            write_header(shm, second, 4096)
            refused(INVALID, "takes 2097408 bytes", offset=second, slots=4096)
            refused(INVALID, "1 to 4096 slots", offset=second, slots=5000)
            write_header(shm, second, 8)
            refused(INVALID, "must agree", offset=second, slots=7)
            refused(INVALID, "1 to 4096 slots", offset=second, slots=0)
            write_header(shm, second, 8, magic=0x12345678)
            refused(INVALID, "magic", offset=second)
            write_header(shm, second, 8, version=2)
            refused(INVALID, "version is 2", offset=second)
            write_header(shm, second, 8, slot_bytes=256)
            refused(INVALID, "256 bytes a slot", offset=second)
            write_header(shm, second, 8)
            refused(NOT_FOUND, "not one this session registered", offset=second, region=12345)
            other = Caller(ch)
            others.append(other)
            refused(NOT_FOUND, "not one this session registered", offset=second, region=other.region)
            pending_shm = Shm(65536)
            others.append(pending_shm)
            ev = s.command(register_host=pb.RegisterHostRegion(name=pending_shm.name, bytes=65536))
            refused(PRECONDITION, "not confirmed", offset=0, region=ev.region.id)

            # a region with an open ring cannot be unregistered; after unregister_ring it can
            ev = s.unregister(region)
            assert ev.code == PRECONDITION and "open doorbell ring" in ev.message, ev
            ev = c.ring.unregister()
            assert ev.code == 0 and ev.ring.id == c.ring.id and ev.ring.slots == 8 and ev.ring.version == 1
            assert c.ring.state() == CLOSED
            ev = c.ring.unregister()
            assert ev.code == NOT_FOUND and "not an open ring of this session" in ev.message
            assert s.unregister(region).code == 0
            ev = s.command(unregister_ring=pb.UnregisterRing(ring=other.ring.id))  # another session's
            assert ev.code == NOT_FOUND, ev
            assert other.ring.state() == SERVING
        finally:
            for o in others:
                o.close()
            c.close()


def test_a_ring_closes_after_the_calls_it_holds(pool):
    """unregister_ring while the ring's call waits in a merge window: the command is answered at
    once and the ring takes nothing more, but it says SERVING until that call is finished (its
    completion written), then CLOSED; its region can be unregistered meanwhile."""
    d = merging(pool)
    case = Case(3, 37)
    with plain(pool).channel() as ch:
        want = forward(ch, case.grpc(ch)).output.data
    with d.channel() as ch:
        c = Caller(ch)
        try:
            out = c.place(0, case)
            c.ring.ring(0)
            wait_for("the call to queue", lambda: scrape(d.metrics_port).get("moed_queue_requests") == 1)
            assert c.ring.unregister().code == 0
            assert c.session.unregister(c.region).code == 0
            c.place(1, case)
            c.ring.ring(1)  # not taken: the ring is closed
            assert c.ring.state() == SERVING
            others = [forward_future(ch, case.grpc(ch)) for _ in range(2)]
            expect_ok(c.ring.wait(0), c.output(out), want)
            assert all(f.result().output.data == want for f in others)
            wait_for("the ring to say CLOSED", lambda: c.ring.state() == CLOSED)
            assert c.ring.ticket(1) != 0
        finally:
            c.close()


def test_rings_per_principal_and_get_model(pool):
    d = plain(pool)
    with d.channel() as ch:
        info = unary(ch, "GetModel", pb.GetModelRequest, pb.ModelInfo)(pb.GetModelRequest(), metadata=A)
        assert info.regions.max_rings == MAX_RINGS
        callers = [Caller(ch) for _ in range(MAX_RINGS)]
        try:
            shm = Shm(1 << 16)
            s = Session(ch, A)
            region = s.host(shm)
            r = Ring(s, shm, region, 0, 4, register=False)
            ev = r.register()
            assert ev.code == EXHAUSTED and "--max-rings" in ev.message, ev
            b = Caller(ch, B)  # another principal has its own
            callers.append(b)
            assert callers[0].ring.unregister().code == 0
            ev = r.register()
            assert ev.code == 0, ev.message
            s.close()  # closing the session closes its ring
            assert r.state() == CLOSED
            shm.close()
            done, got = callers[1].call(0, Case(2, 3))
            assert done.status == OK, done
            assert scrape(d.metrics_port).get("moed_rings_open") == MAX_RINGS  # 2 of A's, 1 of B's
        finally:
            for c in callers:
                c.close()


def test_doorbell_off(tmp_path):
    d = Daemon(["--synthetic", str(SPEC), "--threads", "1", "--max-rings", "0"], tmp_path / "moed.log")
    try:
        with d.channel() as ch:
            info = unary(ch, "GetModel", pb.GetModelRequest, pb.ModelInfo)(pb.GetModelRequest())
            assert info.regions.max_rings == 0
            shm = Shm(1 << 16)
            try:
                s = Session(ch)
                r = Ring(s, shm, s.host(shm), 0, 4, register=False)
                ev = r.register()
                assert ev.code == PRECONDITION and "--max-rings 0" in ev.message, ev
                s.close()
            finally:
                shm.close()
    finally:
        assert d.stop() == 0, d.log()


# ---- tickets, slots, callers --------------------------------------------------------------------

def test_tickets_wrap(pool):
    d = plain(pool)
    case = Case(2, 9)
    with d.channel() as ch:
        want = forward(ch, case.grpc(ch)).output.data
        c = Caller(ch)
        try:
            out = c.place(3, case)
            for n, ticket in enumerate((2 ** 32 - 2, 2 ** 32 - 1, 1, 2), 1):
                c.ring.ring(3, ticket)
                done = c.ring.wait(3, ticket)
                assert c.ring.ticket(3) == 0  # taken
                expect_ok(done, c.output(out), want)
                assert done.done == ticket and done.completions == n
        finally:
            c.close()


def test_every_slot_rung_at_once(pool):
    d = plain(pool)
    slots = 64
    cases = [Case(1 + i % 5, 200 + i, i % SPEC.layers) for i in range(slots)]
    with d.channel() as ch:
        wants = [forward(ch, x.grpc(ch)).output.data for x in cases]
        c = Caller(ch, slots=slots, stride=16384)
        try:
            outs = [c.place(i, x) for i, x in enumerate(cases)]
            for i in range(slots):
                c.ring.ring(i, bell=False)
            c.ring.ring(slots - 1, ticket=c.ring.tickets[slots - 1])  # the one bell, once
            for i in range(slots):
                expect_ok(c.ring.wait(i), c.output(outs[i]), wants[i])
            assert c.ring.completed() == slots and c.ring.failures() == 0
        finally:
            c.close()


def test_a_caller_that_never_reads_completions(pool):
    """One caller rings its slots over and over without ever waiting (its slots rewritten while
    their calls run); another's calls are served meanwhile and after, and the queue empties."""
    d = plain(pool)
    case = Case(4, 11)
    with d.channel() as ch:
        want = forward(ch, case.grpc(ch)).output.data
        rude, polite = Caller(ch), Caller(ch)
        try:
            for i in range(8):
                rude.place(i, case)
            for _ in range(50):
                for i in range(8):
                    rude.ring.ring(i)
                expect_ok(*polite.call(0, case), want)
            wait_for("the queue to empty", lambda: scrape(d.metrics_port).get("moed_queue_requests") == 0)
            assert rude.ring.state() == SERVING
            expect_ok(*polite.call(1, case), want)
        finally:
            rude.close()
            polite.close()


KILLED = r"""
import sys
sys.path.insert(0, sys.argv[1])
import grpc
from regions import Session, Shm
from ring import Ring
from test_doorbell import Caller, Case
ch = grpc.insecure_channel(sys.argv[2])
c = Caller(ch, [("authorization", "Bearer " + sys.argv[3])])
c.place(0, Case(3, 5))
c.ring.ring(0)
print(c.shm.name, c.region, c.ring.id, flush=True)
sys.stdin.read()
"""


def test_a_caller_killed_mid_call(pool):
    """A caller's call waits in a merge window when it is killed (SIGKILL): the launch runs when
    two more calls come, the other caller's outputs are right, and the dead caller's ring and
    region are reclaimed: unmapped, unlisted, the rings gauge back."""
    d = merging(pool)
    case = Case(3, 5)
    with plain(pool).channel() as ch:
        want = forward(ch, case.grpc(ch)).output.data
    proc = subprocess.Popen([sys.executable, "-c", KILLED, HERE, d.address, TOKENS[0]], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=HERE)
    name, region, ring_id = proc.stdout.readline().split()
    try:
        wait_for("the dead caller's call to queue", lambda: scrape(d.metrics_port).get("moed_queue_requests") == 1)
        proc.kill()
        proc.wait(30)
        with d.channel() as ch:
            other = Caller(ch)
            try:
                outs = [other.place(i, case) for i in range(2)]
                other.ring.ring(0)
                other.ring.ring(1)
                for i in range(2):
                    done = other.ring.wait(i)
                    expect_ok(done, other.output(outs[i]), want)
                    assert done.batch_requests == 3
                maps = f"/proc/{d.proc.pid}/maps"
                wait_for("the dead caller's region to be unmapped", lambda: name not in open(maps).read())
                assert int(region) not in [r.id for r in list_regions(ch, A)]
                assert scrape(d.metrics_port).get("moed_rings_open") == 1
            finally:
                other.close()
    finally:
        if proc.poll() is None:
            proc.kill()
        if os.path.exists("/dev/shm" + name):
            os.unlink("/dev/shm" + name)


def counts(pid):
    """(descriptors open, mappings, mappings of shared-memory objects) of process pid."""
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    with open(f"/proc/{pid}/maps") as f:
        maps = f.read().splitlines()
    return fds, len(maps), sum("/dev/shm/" in m for m in maps)


def test_a_thousand_sessions_leak_nothing(daemon):
    """1,000 sessions, each with a region, a ring and a call, opened and closed: the daemon's
    descriptors and shared-memory mappings come back to what they were, and this test's objects in
    /dev/shm too (the daemon makes none). Its other
    mappings may grow by what gRPC and malloc make once (a thread's stack, an arena: a few), never
    by one per session."""
    d = daemon("--synthetic", str(SPEC), "--threads", "1")
    case = Case(2, 13)
    ours = f"moed-test-{os.getpid()}-"  # /dev/shm is the machine's: other tests may use it meanwhile

    def shm_objects():
        return {n for n in os.listdir("/dev/shm") if n.startswith(ours)}

    shm_before = shm_objects()
    with d.channel() as ch:
        want = forward(ch, case.grpc(ch), md=()).output.data

        def one():
            c = Caller(ch, md=(), slots=2, stride=16384)
            try:
                expect_ok(*c.call(1, case), want)
            finally:
                c.close()

        for _ in range(20):  # the one-time costs (threads, the pool's first mappings)
            one()
        fds, maps, _ = counts(d.proc.pid)
        for _ in range(1000):
            one()
        wait_for("the descriptors and shared-memory mappings to come back",
                 lambda: (lambda n: n[0] == fds and n[2] == 0)(counts(d.proc.pid)), timeout=30)
        assert counts(d.proc.pid)[1] < maps + 16, (maps, counts(d.proc.pid))
        assert list_regions(ch) == []
    assert shm_objects() == shm_before


def test_a_ring_whose_memory_shrank(pool):
    """The object behind a ring is cut short: the poller's next look faults (guarded), the ring is
    closed and its region marked broken; the daemon and other rings serve on."""
    d = plain(pool)
    case = Case(2, 17)
    with d.channel() as ch:
        want = forward(ch, case.grpc(ch)).output.data
        victim, other = Caller(ch), Caller(ch)
        try:
            before = scrape(d.metrics_port).get("moed_rings_open")
            victim.shm.map.close()
            victim.shm.truncate(0)
            wait_for("the shrunk ring to close", lambda: scrape(d.metrics_port).get("moed_rings_open") == before - 1)
            broken = [r for r in list_regions(ch, A) if r.id == victim.region]
            assert broken and broken[0].broken
            expect_ok(*other.call(0, case), want)
        finally:
            victim.session.close()
            victim.shm.close()
            other.close()


def test_drain(daemon):
    """SIGTERM: the call already taken (waiting in a merge window) is finished, the ring says
    DRAINING, a call rung after that completes UNAVAILABLE, and once moed exits (0) the ring says
    CLOSED. A held gRPC call keeps the drain open meanwhile, so nothing here is a race."""
    d = daemon("--synthetic", str(SPEC), "--threads", "1", "--max-delay-us", "30000000",
               "--min-batch-requests", "2", *ANY_METRICS_PORT)
    case = Case(3, 19)
    with d.channel() as ch:
        c = Caller(ch, md=())
        try:
            out = c.place(0, case)
            c.ring.ring(0)
            wait_for("the call to queue", lambda: scrape(d.metrics_port).get("moed_queue_requests") == 1)
            held = held_call(d)
            d.send_signal(signal.SIGTERM)
            done = c.ring.wait(0)
            assert done.status == OK, done
            wait_for("the ring to say DRAINING", lambda: c.ring.state() == DRAINING)
            c.place(1, case)
            c.ring.ring(1)
            late = c.ring.wait(1)
            assert late.status == UNAVAILABLE and "draining" in late.message, late
            held.release()
            assert d.proc.wait(60) == 0
            assert d.stop() == 0
            assert c.ring.state() == CLOSED
            assert c.output(out) != b"\xee" * case.out_bytes
        finally:
            c.shm.close()


def test_idle_daemon_with_open_rings(daemon):
    """Rings open and no call: the daemon's CPU time over a few seconds stays under 5% of a core
    (the poller sleeps in steps up to 1 ms). The measured share is printed."""
    d = daemon("--synthetic", str(SPEC), "--threads", "1")
    with d.channel() as ch:
        callers = [Caller(ch, md=()) for _ in range(4)]
        try:
            expect_ok(*callers[0].call(0, Case(1, 1)), forward(ch, Case(1, 1).grpc(ch), md=()).output.data)
            time.sleep(0.1)  # past the poller's spin after the call: what follows is idle
            tick = os.sysconf("SC_CLK_TCK")

            def cpu():
                with open(f"/proc/{d.proc.pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                return (int(fields[11]) + int(fields[12])) / tick

            c0, t0 = cpu(), time.monotonic()
            time.sleep(5)
            share = (cpu() - c0) / (time.monotonic() - t0)
            print(f"idle daemon with 4 rings open: {100 * share:.2f}% of a core")
            assert share < 0.05, f"{100 * share:.1f}% of a core"
        finally:
            for c in callers:
                c.close()


def test_metrics_by_transport(pool):
    d = plain(pool)
    case = Case(2, 23)
    before = scrape(d.metrics_port)
    with d.channel() as ch:
        c = Caller(ch)
        try:
            assert scrape(d.metrics_port).get("moed_rings_open") == (before.get("moed_rings_open") or 0) + 1
            for i in range(3):
                assert c.call(i, case)[0].status == OK
            assert c.call(3, case, layer=9)[0].status == NOT_FOUND
        finally:
            c.close()
    after = scrape(d.metrics_port)

    def delta(name, **labels):
        return (after.get(name, **labels) or 0) - (before.get(name, **labels) or 0)

    assert delta("moed_doorbell_requests_total", code="OK") == 3
    assert delta("moed_doorbell_requests_total", code="NOT_FOUND") == 1
    assert delta("moed_doorbell_request_duration_seconds_count") == 4
    assert delta("moed_request_duration_seconds_count") == 0  # gRPC's own
    assert after.types["moed_rings_open"] == "gauge"


root_only = pytest.mark.skipif(os.geteuid() != 0, reason="starting a process of another user needs root")


@root_only
def test_another_users_region(tmp_path):
    """Without tokens the principal is the local user: a region of uid 65534 named by root's ring is
    NOT_FOUND, worded as an id that never existed, and nothing is read from or written to it."""
    from test_region_owners import Agent
    d = Daemon(["--synthetic", str(SPEC), "--threads", "1"], tmp_path / "moed.log")
    try:
        agent = Agent(d.address)
        theirs = agent.ask(op="register", bytes=65536)["id"]
        case = Case(2, 29)
        with d.channel() as ch:
            c = Caller(ch, md=())
            try:
                for field in ("hidden", "output"):
                    c.place(0, case, **{field: (theirs, 64, case.out_bytes)})
                    c.ring.ring(0)
                    done = c.ring.wait(0)
                    assert done.status == NOT_FOUND, done
                    assert done.message.startswith(f"{field}: region {theirs} is not registered for this caller")
            finally:
                c.close()
        import base64
        assert base64.b64decode(agent.ask(op="get", id=theirs, offset=64, n=64)["data"]) == bytes(64)
        agent.close()
    finally:
        assert d.stop() == 0, d.log()
