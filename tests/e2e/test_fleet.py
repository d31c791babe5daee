"""Fleets of daemons behind one client (moed --layers and --experts; moed.connect([...]), and
the C client's moedc_connect_many through moed-load and moectl).

Two and three daemons splitting the layers and the experts of a layer (with non-contiguous expert
lists, and replicas) answer every routing kind as one daemon holding everything does: in float32
up to float32 summation order, in bf16 within the bound moed.proto's "Expert shards" note states
(each shard's partial is asked of it directly to compute the bound); a layer held whole by one
daemon of the fleet answers bit for bit. The asyncio client and forward_stream agree. A replica
drained (SIGTERM) while a loop of calls runs loses none of them; a shard that is down fails calls
UNAVAILABLE naming its experts and its daemon; batch gating is refused by a shard (the daemon
itself, FAILED_PRECONDITION) and by the client over a split layer; GetModel says what each daemon
holds; moed_expert_tokens_total counts exactly the routes sent, on the daemon holding each expert;
a "dns:" name with two addresses makes a fleet of its addresses. The C client: moed-load --verify
against both fleets for every routing kind (the fleet's sums against the CPU reference of the whole
layer), moed-load losing no call while a replica drains, its tokens per expert equal to the
daemons' counters, moectl naming a shard that is down.
A daemon restarted under a client (Python, and C through fleet_driver.c) holding other experts or
serving another model never makes a call answer OK and wrong, and calls answer again once it is
back as it was; a fleet of two models is refused. A crashed replica is used again within the
documented 5 s of its return (C), a shard that is down fails calls only as often as it is tried
and moed-load counts no bytes for calls it could not start, and the Python RetryPolicy applies to
a shard whose every replica was passed over.
With expert ids each shard gets only the tokens it has terms for: the sum has the bits of every
shard answering every token (f32 and bf16, Python blocking, asyncio and streams, and C), each
daemon's moed_tokens_total grows by its shard's tokens (Python, C, and moed-load --verify), and a
shard that is down fails only the calls that need one of its experts (Python and C).
"""

import asyncio
import json
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import moed
import moed.aio
from conftest import BUILD, Daemon, free_port, refused_address
from daemons import DaemonPool
from moed import MoEClient, MoEError
from moed import fleet_plan
from moed.tensors import BF16, F32
from prod import ANY_METRICS_PORT, metrics_flags, scrape, server_counts

# DeepSeek-V3's rule (sigmoid scores plus a bias, group-limited) and a shared expert: the server
# router and the layer's own rule are exercised with what a fleet most needs to agree on.
SPEC = ("layers=2,d=64,ff=96,experts=8,topk=2,act=swiglu,dtype=bf16,seed=5,shared=1,shared_ff=32,"
        "rule=deepseek,groups=4,topk_groups=2,scale=2.5")
E, D, T = 8, 64, 12
LOAD, MOECTL = BUILD / "client" / "c" / "moed-load", BUILD / "client" / "c" / "moectl"
U = {"bf16": 2.0 ** -8, "f32": 0.0}  # the unit roundoff of the hidden dtype (f32: see below)

ROUTINGS = {
    "ids": lambda rng: _choice(rng),
    **{f"logits-{s}": (lambda s: lambda rng: dict(router_logits=rng.standard_normal((T, E)).astype(np.float32),
                                                  strategy=s))(s)
       for s in ("model", "topk", "sigmoid", "sparsemax", "quadratic", "pioneer")},
    "server-model": lambda rng: {},
    "server-topk": lambda rng: dict(strategy="topk", top_k=3),
}


def _ids(rng):
    """Three experts per token, a repeated one and a padded slot among them."""
    ids = rng.integers(0, E, (T, 3)).astype(np.int32)
    ids[0, 1] = ids[0, 0]
    ids[1, 2] = -1
    return ids


def _choice(rng):
    ids = _ids(rng)
    return dict(expert_ids=ids, expert_weights=np.where(ids >= 0, rng.uniform(0, 1, ids.shape), 0).astype(np.float32))


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    p = DaemonPool(tmp_path_factory.mktemp("fleet"))
    yield p
    p.close()


def one(pool):
    return pool.synthetic(SPEC)


def fleet2(pool):
    """Two daemons, one expert shard each (the first adds the shared expert)."""
    return [pool.synthetic(SPEC, "--experts", "0-3"), pool.synthetic(SPEC, "--experts", "4-7")]


def fleet3(pool):
    """Three daemons: layer 0 whole on one; layer 1 split over two, in non-contiguous lists (the
    shard holding expert 0 adds the shared expert)."""
    return [pool.synthetic(SPEC, "--layers", "0"),
            pool.synthetic(SPEC, "--layers", "1", "--experts", "0-2,6"),
            pool.synthetic(SPEC, "--layers", "1", "--experts", "3-5,7")]


def hidden(rng, dtype):
    x = rng.standard_normal((T, D)).astype(np.float32)
    if dtype == "bf16":
        import ml_dtypes
        x = x.astype(ml_dtypes.bfloat16)
    return x


def f32(a):
    return np.asarray(a).astype(np.float32)


def check(y, y_one, partials, dtype):
    """y (the fleet's) against y_one (one daemon's): per element, within u * (sum |partial_s| +
    2 |y_one|), plus float32 summation order (a few float32 ulps of the terms' magnitudes)."""
    y, y_one = f32(y), f32(y_one)
    mag = sum(np.abs(f32(p)) for p in partials) + 2 * np.abs(y_one)
    bound = U[dtype] * mag + 8 * 2.0 ** -24 * mag + 1e-30
    worst = np.max(np.abs(y - y_one) - bound)
    assert worst <= 0, f"off by {worst} beyond the bound; max |y| {np.abs(y_one).max()}"
    assert np.abs(y_one).max() > 0.1  # the comparison compared something


@pytest.mark.parametrize("topology", ["fleet2", "fleet3"])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_fleet_equals_one_daemon(pool, topology, dtype):
    daemons = globals()[topology](pool)
    rng = np.random.default_rng(7)
    with MoEClient(one(pool).address, timeout=30) as c1, \
            moed.connect([d.address for d in daemons], timeout=30) as fl:
        assert type(fl) is moed.FleetClient
        for layer in (0, 1):
            holders = [d for d in daemons if layer in [li.index for li in d.client().info().layers]]
            for name, routing in ROUTINGS.items():
                if dtype == "bf16" and name not in ("ids", "logits-model", "logits-sparsemax", "server-model"):
                    continue
                x, kw = hidden(rng, dtype), routing(rng)
                y_one = c1.forward(layer, x, **kw)
                y = fl.forward(layer, x, **kw)
                assert y.dtype == x.dtype and y.shape == x.shape, name
                if name == "ids":  # out= is written as a single daemon's client writes it
                    out = np.empty_like(x)
                    assert fl.forward(layer, x, **kw, out=out) is out and np.array_equal(f32(out), f32(y))
                if len(holders) == 1:  # a layer held whole by one daemon: its reply, unchanged
                    assert np.array_equal(f32(y), f32(y_one)), name
                    continue
                partials = []
                for d in holders:
                    with d.client() as c:
                        partials.append(c.forward(layer, x, **kw))
                check(y, y_one, partials, dtype)


def test_getmodel_says_what_each_daemon_holds(pool):
    a, b, c = fleet3(pool)
    assert [(li.index, li.experts_held, li.adds_shared_experts) for li in a.client().info().layers] == \
        [(0, [(0, 7)], True)]
    assert [(li.experts_held, li.adds_shared_experts) for li in b.client().info().layers] == [([(0, 2), (6, 6)], True)]
    assert [(li.experts_held, li.adds_shared_experts) for li in c.client().info().layers] == [([(3, 5), (7, 7)], False)]
    with moed.connect([a.address, b.address, c.address]) as fl:
        info = fl.info()
        assert [(li.index, li.experts_held, li.num_experts) for li in info.layers] == [(0, [(0, 7)], 8), (1, [(0, 7)], 8)]
        assert [m.target for m in fl.members()] == [a.address, b.address, c.address]
        assert fl.health() == "SERVING"
    p = subprocess.run([sys.executable, "-m", "moed", "--target", f"{b.address},{c.address}", "info"],
                       capture_output=True, text=True, timeout=60)  # the fleet from the command line
    assert p.returncode == 0 and p.stdout.split("\n")[-2].split()[-1] == "0-7+shared", p.stdout + p.stderr
    with pytest.raises(MoEError) as e, moed.connect([a.address, b.address]) as half:
        half.forward(1, np.zeros((2, D), np.float32))
    assert e.value.code_name == "UNAVAILABLE" and "experts 3-5,7" in e.value.message, e.value.message


def test_asyncio_and_stream(pool):
    daemons = fleet2(pool)
    rng = np.random.default_rng(11)
    xs = [hidden(rng, "f32") for _ in range(4)]
    with MoEClient(one(pool).address) as c1:
        want = [c1.forward(i % 2, x) for i, x in enumerate(xs)]
    tol = 1e-5 * max(np.abs(w).max() for w in want)

    async def run():
        async with moed.aio.connect([d.address for d in daemons], timeout=30) as fl:
            assert type(fl) is moed.aio.FleetClient
            got = await asyncio.gather(*(fl.forward(i % 2, x) for i, x in enumerate(xs)))
            streamed = [y async for y in fl.forward_stream([dict(layer=i % 2, hidden=x) for i, x in enumerate(xs)])]
            return got, streamed, await fl.health()

    got, streamed, health = asyncio.run(run())
    assert health == "SERVING"
    with moed.connect([d.address for d in daemons]) as fl:
        blocking = list(fl.forward_stream([dict(layer=i % 2, hidden=x) for i, x in enumerate(xs)]))
    for w, g, s, b in zip(want, got, streamed, blocking):
        assert np.abs(g - w).max() <= tol and np.abs(s - w).max() <= tol and np.abs(b - w).max() <= tol


def test_batch_gating_refused_on_a_shard(pool):
    shard, _ = fleet2(pool)
    x = np.zeros((3, D), np.float32)
    with shard.client() as c, pytest.raises(MoEError) as e:
        c.forward(0, x, batch_gating=True)
    assert e.value.code_name == "FAILED_PRECONDITION", e.value
    assert "experts 0-3" in e.value.message and "--experts" in e.value.message, e.value.message
    with moed.connect([d.address for d in fleet2(pool)]) as fl, pytest.raises(MoEError) as e:
        fl.forward(0, x, batch_gating=True)
    assert e.value.code_name == "FAILED_PRECONDITION" and "2 shards" in e.value.message, e.value.message
    with one(pool).client() as c:  # a daemon holding every expert still gates batches
        assert len(c.forward(0, x, batch_gating=True, return_info=True).expert_set) == 2


def test_replica_drained_mid_run_loses_no_call(daemon):
    """Two replicas of experts 0-3 and one daemon of 4-7: a loop of calls keeps going while one
    replica is drained (SIGTERM) and exits; every call is answered, and right."""
    r1 = daemon("--synthetic", SPEC, "--threads", "1", "--experts", "0-3")
    r2 = daemon("--synthetic", SPEC, "--threads", "1", "--experts", "0-3")
    s = daemon("--synthetic", SPEC, "--threads", "1", "--experts", "4-7")
    full = daemon("--synthetic", SPEC, "--threads", "1")
    rng = np.random.default_rng(3)
    x = hidden(rng, "f32")
    with full.client() as c:
        want = c.forward(0, x)
    tol = 1e-5 * np.abs(want).max()
    answered, failed, sent, gone = [], [], threading.Event(), threading.Event()
    states = []

    def loop():
        with moed.connect([r1.address, r2.address, s.address], timeout=30) as fl:
            after = 0
            while after < 30:  # until 30 calls after r1 has exited
                try:
                    answered.append(np.abs(fl.forward(0, x) - want).max())
                except Exception as e:  # counted: none may happen
                    failed.append(repr(e))
                if len(answered) == 20:
                    sent.set()
                after += gone.is_set()
            states.extend(m.error for m in fl.fleet.members)

    t = threading.Thread(target=loop)
    t.start()
    assert sent.wait(60)
    assert r1.stop() == 0, r1.log()  # drains: calls in flight answered, new ones UNAVAILABLE
    gone.set()
    t.join(120)
    assert not failed, failed[:3]
    assert len(answered) >= 50 and max(answered) <= tol
    assert states[0].startswith("UNAVAILABLE"), states  # r1 turned calls away: they went to r2


def test_shard_down_is_unavailable_naming_it(daemon):
    a = daemon("--synthetic", SPEC, "--threads", "1", "--experts", "0-3")
    b = daemon("--synthetic", SPEC, "--threads", "1", "--experts", "4-7")
    x = np.zeros((2, D), np.float32)
    with moed.connect([a.address, b.address], timeout=20) as fl:
        fl.forward(0, x)
        b.begin_drain()  # draining, then gone: UNAVAILABLE either way
        with pytest.raises(MoEError) as e:
            fl.forward(0, x)
    assert b.stop() == 0, b.log()
    assert e.value.code_name == "UNAVAILABLE", e.value
    assert "experts 4-7" in e.value.message and b.address in e.value.message, e.value.message
    # a fleet that learns what it holds with that daemon already down says the same
    with moed.connect([a.address, b.address], timeout=20) as fl, pytest.raises(MoEError) as e:
        fl.forward(1, x)
    assert e.value.code_name == "UNAVAILABLE", e.value
    assert "layer 1: experts 4-7" in e.value.message and b.address in e.value.message, e.value.message


def test_expert_token_metrics_match_the_routes(daemon, tmp_path):
    fa, pa = metrics_flags()
    fb, pb = metrics_flags()
    a = daemon("--synthetic", SPEC, "--threads", "1", "--experts", "0-2,6", *fa)
    b = daemon("--synthetic", SPEC, "--threads", "1", "--experts", "3-5,7", *fb)
    rng = np.random.default_rng(5)
    want = np.zeros((2, E), np.int64)
    with moed.connect([a.address, b.address], timeout=30) as fl:
        for layer in (0, 1, 1):
            ids = _ids(rng)
            fl.forward(layer, hidden(rng, "f32"), expert_ids=ids, expert_weights=(ids >= 0).astype(np.float32))
            for e in ids[ids >= 0]:
                want[layer, e] += 1
    for port, held in ((pa, (0, 1, 2, 6)), (pb, (3, 4, 5, 7))):
        m = scrape(port)
        for layer in (0, 1):
            for e in range(E):
                got = m.get("moed_expert_tokens_total", layer=str(layer), expert=str(e))
                assert got == (want[layer, e] if e in held else None), (layer, e, got, port)
    assert want.sum() > 0
    # moed-load's tokens per expert: from the routes it sent, and from the daemons' counters
    out = tmp_path / "r.json"
    p = moed_load([a.address, b.address], "--metrics", f"127.0.0.1:{pa},127.0.0.1:{pb}", "--layers", "0,1",
                  "--routing", "zipf:1", "--requests", 40, "--warmup", 0, "--tokens", "1:8", "--json", out)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr
    ex = json.loads(out.read_text())["levels"][0]["expert_tokens"]
    assert ex["sent"] == ex["servers"] and sum(map(sum, ex["sent"].values())) > 0, ex
    assert "tokens per expert (from the routes sent)" in p.stdout


def test_dns_name_with_two_addresses_is_a_fleet(pool, tmp_path, monkeypatch):
    """As a Kubernetes headless Service resolves: one name, the two daemons' addresses (here two
    loopback addresses on one port); a daemon that comes back at another address is found by
    resolving the name again."""
    port = free_port()
    shards = []
    try:
        for host, experts in (("127.0.0.1", "0-3"), ("127.0.0.2", "4-7")):
            d = Daemon(["--synthetic", SPEC, "--threads", "1", "--experts", experts, "--listen", f"{host}:{port}"],
                       tmp_path / f"moed-{host}.log", port=port, wait=False)
            d.address = f"{host}:{port}"  # the later --listen wins
            shards.append(d)
        for d in shards:
            d.wait_serving()
        real, ips = socket.getaddrinfo, ["127.0.0.2", "127.0.0.1"]

        def resolver(host, *args, **kw):
            if host == "moed-fleet.test":
                return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in ips]
            return real(host, *args, **kw)

        monkeypatch.setattr(socket, "getaddrinfo", resolver)
        monkeypatch.setattr(moed.targets, "RESOLVE_EVERY", 0.0)  # no waiting between resolutions here
        x = hidden(np.random.default_rng(1), "f32")
        with moed.connect(f"dns:///moed-fleet.test:{port}", timeout=30) as fl, one(pool).client() as c1:
            assert [m.target for m in fl.members()] == [f"ipv4:127.0.0.1:{port}", f"ipv4:127.0.0.2:{port}"]
            want = c1.forward(0, x)
            assert np.abs(fl.forward(0, x) - want).max() <= 1e-5 * np.abs(want).max()
            # the pod of experts 4-7 is replaced by one at another address, which the name now gives
            shards[1].send_signal(signal.SIGTERM)  # draining: it turns calls away
            d = Daemon(["--synthetic", SPEC, "--threads", "1", "--experts", "4-7", "--listen", f"127.0.0.3:{port}"],
                       tmp_path / "moed-127.0.0.3.log", port=port, wait=False)
            d.address = f"127.0.0.3:{port}"
            shards.append(d)
            d.wait_serving()
            ips.remove("127.0.0.2")
            ips.append("127.0.0.3")
            assert np.abs(fl.forward(0, x) - want).max() <= 1e-5 * np.abs(want).max()
            live = [m.target for m in fl.fleet.members if not m.retired]
            assert live == [f"ipv4:127.0.0.1:{port}", f"ipv4:127.0.0.3:{port}"], live
    finally:
        for d in shards:
            assert d.stop() == 0, d.log()


# ---- daemons that change under a fleet ---------------------------------------------------------

class CFleet:
    """A C fleet client (moedc_connect_many) kept open while the test changes its daemons: the
    program tests/e2e/fleet_driver.c, built against the build's library, makes one call per line
    it reads. call() returns the output, or (status name, message)."""

    def __init__(self, tmp_path, targets, x, ids, weights):
        from test_c_library import INCLUDE, LIBDIR, sanitizer_flags
        exe = tmp_path / "fleet_driver"
        p = subprocess.run(["cc", "-std=c11", "-Wall", "-Wextra", "-Werror", *sanitizer_flags(),
                            str(pathlib.Path(__file__).parent / "fleet_driver.c"), "-I", str(INCLUDE),
                            "-L", str(LIBDIR), "-lmoedclient", f"-Wl,-rpath,{LIBDIR}", "-o", str(exe)],
                           capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
        files = []
        for name, a in (("x", x), ("ids", ids), ("w", weights)):
            files.append(tmp_path / f"{name}.bin")
            files[-1].write_bytes(np.ascontiguousarray(a).tobytes())
        self.shape = x.shape
        self.proc = subprocess.Popen([str(exe), ",".join(targets), *map(str, files), str(x.shape[0]),
                                      str(x.shape[1]), str(ids.shape[1])],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.opened = self._answer(self.proc.stdout.readline())

    def _answer(self, line):
        assert line, "fleet_driver ended"
        word, _, rest = line.rstrip("\n").partition(" ")
        if word == "OK":
            return np.frombuffer(bytes.fromhex(rest), np.float32).reshape(self.shape)
        if word == "ERR":
            return tuple(rest.split(" ", 1))
        return word

    def call(self, layer=0):
        self.proc.stdin.write(f"call {layer}\n")
        self.proc.stdin.flush()
        return self._answer(self.proc.stdout.readline())

    def close(self):
        """Ends the program; its exit status (0: it ran to the end, 1: the fleet did not open)."""
        self.proc.stdin.close()
        return self.proc.wait(60)


class PyFleet:
    """The Python fleet client, answering as CFleet does."""

    def __init__(self, targets, x, ids, weights):
        self.fl, self.kw = moed.connect(targets, timeout=30), dict(hidden=x, expert_ids=ids, expert_weights=weights)

    def call(self, layer=0):
        try:
            return self.fl.forward(layer, **self.kw)
        except MoEError as e:
            return e.code_name, e.message

    def close(self):
        self.fl.close()
        return 0


def fleet_client(kind, tmp_path, targets, x, kw):
    if kind == "c":
        return CFleet(tmp_path, targets, x, kw["expert_ids"], kw["expert_weights"])
    return PyFleet(targets, x, kw["expert_ids"], kw["expert_weights"])


def restart(d, tmp_path, name, *flags):
    """Stops daemon d (it must exit 0) and starts another with these flags at its address."""
    assert d.stop() == 0, d.log()
    return Daemon(list(flags), tmp_path / f"moed-{name}.log", port=d.port)


def right(answer, want):
    """The answer is an output equal to want up to float32 summation order (a failure is not)."""
    if isinstance(answer, tuple):
        return False
    worst = np.abs(f32(answer) - want).max()
    assert worst <= 1e-5 * np.abs(want).max(), f"answered OK but wrong: off by {worst}"
    return True


@pytest.mark.parametrize("kind", ["python", "c"])
@pytest.mark.parametrize("change", ["experts", "model"])
def test_a_daemon_restarted_as_something_else_never_answers_wrong(daemon, tmp_path, kind, change):
    """The daemon of experts 4-7 in a fleet of two is restarted at its address holding experts 0-3
    (so the fleet lacks 4-7), or serving another model of the same shapes (another seed), while one
    client of the fleet goes on calling: no call answers OK with a wrong output (each is compared
    with one daemon holding the whole model), each failure names the daemon, the first one
    FAILED_PRECONDITION; once the daemon is back as it was, calls answer right again."""
    a = daemon("--synthetic", SPEC, "--threads", "1", "--experts", "0-3")
    full = daemon("--synthetic", SPEC, "--threads", "1")
    flags = ["--synthetic", SPEC, "--threads", "1", "--experts", "4-7"]
    other = {"experts": ["--synthetic", SPEC, "--threads", "1", "--experts", "0-3"],
             "model": ["--synthetic", SPEC.replace("seed=5", "seed=6"), "--threads", "1", "--experts", "4-7"]}
    b = Daemon(flags, tmp_path / "moed-b.log")
    rng = np.random.default_rng(9)
    x, kw = hidden(rng, "f32"), _choice(rng)
    with full.client() as c:
        want = f32(c.forward(0, x, **kw))
    fl = fleet_client(kind, tmp_path, [a.address, b.address], x, kw)
    try:
        assert right(fl.call(), want)
        b = restart(b, tmp_path, "b-changed", *other[change])
        answers = [fl.call() for _ in range(4)]
        assert not any(right(r, want) for r in answers)  # the fleet lacks experts 4-7 now
        assert answers[0][0] == "FAILED_PRECONDITION", answers[0]
        for code, msg in answers:
            assert code in ("FAILED_PRECONDITION", "UNAVAILABLE") and b.address in msg, (code, msg)
        b = restart(b, tmp_path, "b-back", *flags)
        give_up = time.monotonic() + 60  # a hang guard: the client asks again within seconds
        while not right(answer := fl.call(), want):
            assert b.address in answer[1] and time.monotonic() < give_up, answer
            time.sleep(0.05)
    finally:
        assert fl.close() == 0
        assert b.stop() == 0, b.log()


@pytest.mark.parametrize("kind", ["python", "c"])
@pytest.mark.parametrize("layout", [("0-3", "4-7"), ("0-7", "0-7")], ids=["shards", "replicas"])
def test_a_fleet_of_two_models_is_refused(daemon, tmp_path, kind, layout):
    """Two daemons of the same shapes but another seed, as two shards or as two replicas: the
    fleet is refused at once, FAILED_PRECONDITION naming both daemons and their models'
    fingerprints (whichever answered first)."""
    a = daemon("--synthetic", SPEC, "--threads", "1", "--experts", layout[0])
    b = daemon("--synthetic", SPEC.replace("seed=5", "seed=6"), "--threads", "1", "--experts", layout[1])
    fps = [hex(d.client().info().model_fingerprint)[2:] for d in (a, b)]
    assert fps[0] != fps[1]
    rng = np.random.default_rng(9)
    x, kw = hidden(rng, "f32"), _choice(rng)
    fl = fleet_client(kind, tmp_path, [a.address, b.address], x, kw)
    try:
        answer = fl.opened if kind == "c" else fl.call()
        assert isinstance(answer, tuple), f"the fleet opened and answered: {type(answer).__name__}"
        assert answer[0] == "FAILED_PRECONDITION", answer
        for d, fp in zip((a, b), fps):
            assert d.address in answer[1] and fp in answer[1], answer
    finally:
        fl.close()


# ---- daemons that go and come back -------------------------------------------------------------

class Doorstep:
    """A crashed daemon's port, listening in its place: every connection a client makes is
    accepted, counted and closed at once (to the client, the daemon is still gone)."""

    def __init__(self, port):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen(64)
        self.knocks = 0
        self.knocked = threading.Condition()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            conn.close()
            with self.knocked:
                self.knocks += 1
                self.knocked.notify_all()

    def wait(self, knocks, timeout):
        with self.knocked:
            return self.knocked.wait_for(lambda: self.knocks >= knocks, timeout)

    def close(self):
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.thread.join(10)


DOWN_MAX = 5.0  # docs/fleets.md: a replica turned away is passed over 0.5 s, doubling to 5 s


def forward_count(port):
    return scrape(port).get("moed_requests_total", method="Forward", code="OK") or 0


def test_c_client_uses_a_replica_again_soon_after_it_is_back(daemon, tmp_path):
    """Replica r1 of two crashes (SIGKILL) while a C fleet client keeps calling; its port is then
    held by a Doorstep counting the client's connection attempts. Once the client has tried it 7
    times (gRPC's own reconnect backoff, 1 s growing by 1.6 to 120 s, would wait 21 s or more before
    an 8th), r1 comes back on its port: the client sends it a call within the documented 5 s of it
    serving (plus 5 s for a busy machine), while every call is answered by r2 meanwhile."""
    flags, mport = metrics_flags()
    r1 = Daemon(["--synthetic", SPEC, "--threads", "1", *flags], tmp_path / "moed-r1.log")
    r2 = daemon("--synthetic", SPEC, "--threads", "1")
    rng = np.random.default_rng(4)
    x, kw = hidden(rng, "f32"), _choice(rng)
    with r2.client() as c:
        want = f32(c.forward(0, x, **kw))
    fl = CFleet(tmp_path, [r1.address, r2.address], x, kw["expert_ids"], kw["expert_weights"])
    door = None
    try:
        assert r1.stop(signal.SIGKILL) == -signal.SIGKILL
        door = Doorstep(r1.port)
        give_up = time.monotonic() + 180  # hang guard
        while door.knocks < 7:
            assert right(fl.call(), want)
            assert time.monotonic() < give_up, f"{door.knocks} connection attempts in 180 s"
            time.sleep(0.02)
        door.close()
        door = None
        r1 = Daemon(["--synthetic", SPEC, "--threads", "1", *flags], tmp_path / "moed-r1-back.log",
                    port=r1.port)
        back = time.monotonic()
        while forward_count(mport) == 0:
            assert right(fl.call(), want)
            assert time.monotonic() < back + 120
            time.sleep(0.02)
        took = time.monotonic() - back
        assert took <= DOWN_MAX + 5, f"the client used r1 again {took:.1f} s after it was back"
    finally:
        if door:
            door.close()
        assert fl.close() == 0
        assert r1.returncode is not None or r1.stop() == 0, r1.log()


def test_c_client_fails_at_the_rate_of_real_attempts_while_a_shard_is_down(daemon, tmp_path):
    """The only daemon of experts 4-7 crashes under moed-load: each call fails only after a real
    attempt on it (its re-probe: 0.5 s doubling to 5 s), not as fast as moed-load can ask (the
    library used to fail 400,000 a second locally); and what could not be started is not counted as
    bytes sent."""
    fb, pb = metrics_flags()
    a = daemon("--synthetic", SPEC, "--threads", "1", "--experts", "0-3")
    b = Daemon(["--synthetic", SPEC, "--threads", "1", "--experts", "4-7", *fb], tmp_path / "moed-b.log")
    out = tmp_path / "r.json"
    T, K, C, DURATION = 4, 2, 2, 6.0
    load = subprocess.Popen([str(LOAD), "--target", f"{a.address},{b.address}", "--no-progress",
                             "--duration", str(DURATION), "--warmup", "0", "--concurrency", str(C),
                             "--tokens", str(T), "--dtype", "f32", "--routing", "uniform", "--json", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        give_up = time.monotonic() + 60
        # b has answered more calls than moed-load has workers: a worker sent its next call, so its
        # first had both replies and counts as ok (a's count alone can run ahead of b's reply)
        while forward_count(pb) <= C:
            assert time.monotonic() < give_up and load.poll() is None, load.communicate()
            time.sleep(0.02)
        assert b.stop(signal.SIGKILL) == -signal.SIGKILL
        stdout, stderr = load.communicate(timeout=120)
    finally:
        if load.poll() is None:
            load.kill()
            load.wait()
    lv = json.loads(out.read_text())["levels"][0]
    errors, ok = lv["errors_total"], lv["ok"]
    assert ok > 0 and errors > 0, lv
    assert errors <= C * (DURATION / 0.5 + 2), (errors, lv["errors"], lv["error_messages"])
    # every request is T tokens of d_model f32 and T x K ids and weights: bytes sent are those of
    # the requests that were started
    started = lv["requests"] - lv["errors"].get("CLIENT", 0)
    sent = lv["mb_per_s_sent"] * lv["elapsed_s"] * 1e6
    assert abs(sent - started * (T * D * 4 + T * K * 8)) <= 1e-6 * sent + 1, (sent, started, lv["errors"])


def test_python_retries_a_shard_whose_every_replica_is_passed_over(daemon):
    """The only daemon of experts 4-7 is gone: a call that finds it passed over still makes its
    RetryPolicy's attempts (each round asks the daemon again), as one that found it up does."""
    a = daemon("--synthetic", SPEC, "--threads", "1", "--experts", "0-3")
    b = daemon("--synthetic", SPEC, "--threads", "1", "--experts", "4-7")
    x = np.zeros((2, D), np.float32)
    policy = moed.RetryPolicy(max_attempts=4, initial_backoff=0.01, max_backoff=0.02)
    with moed.connect([a.address, b.address], timeout=30, retry=policy) as fl:
        fl.forward(0, x)
        assert b.stop() == 0, b.log()
        for call in ("found it up", "found it passed over"):
            with pytest.raises(MoEError) as e:
                fl.forward(0, x)
            assert e.value.code_name == "UNAVAILABLE" and b.address in e.value.message, e.value
            assert e.value.attempts == policy.max_attempts, (call, e.value.attempts, e.value.message)


# ---- the C client (libmoedclient's moedc_connect_many, through moed-load and moectl) --------------

def moed_load(targets, *args, timeout=120):
    return subprocess.run([str(LOAD), "--target", ",".join(targets), "--no-progress", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


C_ROUTINGS = [["--routing", "uniform"], ["--routing", "server"]] + \
    [["--routing", "logits", "--strategy", s] for s in ("model", "topk", "sigmoid", "sparsemax", "quadratic", "pioneer")]


@pytest.mark.parametrize("topology,dtype,routings", [
    ("fleet3", "f32", C_ROUTINGS),
    ("fleet3", "bf16", C_ROUTINGS[:3]),
    ("fleet2", "f32", [C_ROUTINGS[0], C_ROUTINGS[1], C_ROUTINGS[5]]),
])
def test_c_client_fleet_verified(pool, tmp_path, topology, dtype, routings):
    """moed-load over the fleet, every reply checked against the CPU reference of the whole layer."""
    targets = [d.address for d in globals()[topology](pool)]
    for routing in routings:
        out = tmp_path / "r.json"
        p = moed_load(targets, "--layers", "0,1", "--dtype", dtype, *routing, "--requests", 60,
                      "--verify", 60, "--concurrency", 4, "--tokens", "1:12", "--warmup", 0, "--json", out)
        assert p.returncode == 0, (routing, p.stdout[-2000:], p.stderr)
        lv = json.loads(out.read_text())["levels"][0]
        # moed-load's verifier drops replies its queue (32) has no room for, so a slow verifier
        # checks fewer than were answered: 32 are checked whatever the machine's pace.
        assert lv["ok"] == 60 and lv["verify"]["checked"] >= 32 and lv["verify"]["mismatches"] == 0, lv


def test_c_client_loses_no_call_while_a_replica_drains(daemon, tmp_path):
    """A replica drains (SIGTERM) while moed-load keeps four calls in flight over the fleet: no call
    fails, none is wrong. The drain starts once r1 has answered calls, and the run is interrupted
    (SIGINT) only once r2 has answered more after r1 exited, so the drain always falls inside it."""
    r1 = daemon("--synthetic", SPEC, "--threads", "1", "--experts", "0-3", "--metrics-listen", "127.0.0.1:0")
    r2 = daemon("--synthetic", SPEC, "--threads", "1", "--experts", "0-3", "--metrics-listen", "127.0.0.1:0")
    s = daemon("--synthetic", SPEC, "--threads", "1", "--experts", "4-7")
    out = tmp_path / "r.json"
    load = subprocess.Popen([str(LOAD), "--target", f"{r1.address},{r2.address},{s.address}", "--no-progress",
                             "--duration", "600", "--warmup", "0", "--concurrency", "4", "--dtype", "f32",
                             "--verify", "100", "--json", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def answered(d):
        return sum(v for k, v in server_counts(d.metrics_port).items() if k == "Forward:OK")

    def wait_answered(d, n):
        deadline = time.monotonic() + 60  # a hang guard, never the thing asserted
        while answered(d) < n:
            assert load.poll() is None and time.monotonic() < deadline, (answered(d), load.poll())
            time.sleep(0.05)

    try:
        wait_answered(r1, 10)
        assert r1.stop() == 0, r1.log()
        wait_answered(r2, answered(r2) + 10)
        load.send_signal(signal.SIGINT)
        stdout, stderr = load.communicate(timeout=120)
    finally:
        if load.poll() is None:
            load.kill()
            load.wait()
    assert load.returncode == 0, stdout[-2000:] + stderr
    lv = json.loads(out.read_text())["levels"][0]
    assert lv["errors_total"] == 0 and lv["ok"] >= 20 and lv["verify"]["mismatches"] == 0, lv


def test_c_client_names_a_shard_that_is_down(daemon, tmp_path):
    a = daemon("--synthetic", SPEC, "--threads", "1", "--experts", "0-3")
    np.save(tmp_path / "x.npy", np.zeros((2, D), np.float32))
    with refused_address() as gone:  # nothing listens there, nor can while it lasts
        p = subprocess.run([str(MOECTL), "--target", f"{a.address},{gone}", "--timeout", "10", "forward",
                            "--layer", "0", "--hidden", str(tmp_path / "x.npy"), "--server-router",
                            "--out", str(tmp_path / "y.npy")], capture_output=True, text=True, timeout=60)
    assert p.returncode == 1, p
    assert "UNAVAILABLE" in p.stderr and "experts 4-7" in p.stderr and gone in p.stderr, p.stderr


# ---- each shard gets only the tokens it serves (client expert ids) ---------------------------

SPEC_NO_SHARED = SPEC.replace(",shared=1,shared_ff=32", "")
assert SPEC_NO_SHARED != SPEC


def fleet2_no_shared(pool):
    """Two expert shards of a model with no shared experts: neither gets every token."""
    return [pool.synthetic(SPEC_NO_SHARED, "--experts", "0-3"), pool.synthetic(SPEC_NO_SHARED, "--experts", "4-7")]


# topology: (the daemons, the one daemon holding everything, the layer split, its two shards' experts)
SLICED = {
    "fleet2": (fleet2, one, 0, ((0, 1, 2, 3), (4, 5, 6, 7))),
    "fleet3": (fleet3, one, 1, ((0, 1, 2, 6), (3, 4, 5, 7))),
    "fleet2-no-shared": (fleet2_no_shared, lambda pool: pool.synthetic(SPEC_NO_SHARED), 0,
                         ((0, 1, 2, 3), (4, 5, 6, 7))),
}


def sliced_choice(rng, a, b):
    """Expert ids [T, 2] over shards holding experts a and b: tokens on a's experts alone, on b's
    alone, on both, of padding alone, one expert and padding, a repeated expert."""
    pick = lambda held, n: rng.choice(held, n)
    ids = np.concatenate([np.stack([pick(a, 3), pick(a, 3)], 1), np.stack([pick(b, 3), pick(b, 3)], 1),
                          np.stack([pick(a, 3), pick(b, 3)], 1), [[-1, -1], [pick(b, 1)[0], -1]],
                          [[pick(a, 1)[0]] * 2]]).astype(np.int32)
    assert ids.shape == (T, 2)
    return dict(expert_ids=ids, expert_weights=np.where(ids >= 0, rng.uniform(0.1, 1, ids.shape), 0).astype(np.float32))


def bits(a):
    """An output's bits: float32 as uint32, bf16 as uint16."""
    a = np.asarray(a)
    return a.view(np.uint32) if a.dtype == np.float32 else a.view(np.uint16)


def shard_rows(ids, held, adds_every_token):
    """The rows a shard holding `held` gets (moed.fleet_plan.token_rows, for valid ids)."""
    if adds_every_token:
        return list(range(len(ids)))
    return [t for t, row in enumerate(ids) if any(e in held for e in row if e >= 0)]


@pytest.mark.parametrize("topology", list(SLICED))
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_sliced_calls_equal_every_shard_answering_every_token(pool, tmp_path, topology, dtype):
    """Each shard gets only its tokens, and the sum has the very bits of each shard's answer to
    the whole call added as before (moed.fleet_plan.add_up of every token's partials), blocking,
    asyncio and streams (and the C client in f32); against one daemon holding everything it is
    within the documented bound (f32: float32 summation order); a token of padding alone answers
    as one daemon does."""
    make, make_one, layer, (a, b) = SLICED[topology]
    daemons = make(pool)
    holders = [d for d in daemons if layer in [li.index for li in d.client().info().layers]]
    rng = np.random.default_rng(21)
    x, kw = hidden(rng, dtype), sliced_choice(rng, a, b)
    with MoEClient(make_one(pool).address, timeout=30) as c1:
        y_one = c1.forward(layer, x, **kw)
    partials = []
    for d in holders:
        with d.client() as c:
            partials.append(c.forward(layer, x, **kw))
    before = fleet_plan.add_up(F32 if dtype == "f32" else BF16,
                               [f32(p) if dtype == "f32" else bits(p) for p in partials])
    want = bits(before)
    targets = [d.address for d in daemons]
    with moed.connect(targets, timeout=30) as fl:
        fl.members()  # every daemon's GetModel: the layer is planned
        shards = fl.fleet.plan(layer, time.monotonic())[0]
        rows = [r.tolist() for r in fleet_plan.token_rows(shards, kw["expert_ids"], kw["expert_weights"])]
        assert rows == [shard_rows(kw["expert_ids"], held, s.adds_every_token)
                        for s, held in zip(shards, (a, b))], rows
        assert min(len(r) for r in rows) < T  # a shard got fewer than every token
        blocking = fl.forward(layer, x, **kw)
        streamed = list(fl.forward_stream([dict(layer=layer, hidden=x, **kw)] * 2))

    async def run():
        async with moed.aio.connect(targets, timeout=30) as fl:
            got = await fl.forward(layer, x, **kw)
            return [got] + [y async for y in fl.forward_stream([dict(layer=layer, hidden=x, **kw)])]

    for y in [blocking, *streamed, *asyncio.run(run())]:
        assert y.dtype == x.dtype and np.array_equal(bits(y), want)
    check(blocking, y_one, partials, dtype)
    padding = 9  # a token of padding alone: the shared experts' term, or zero, as one daemon gives
    assert np.array_equal(bits(blocking)[padding], bits(y_one)[padding])
    if dtype == "f32":
        fl = CFleet(tmp_path, targets, x, kw["expert_ids"], kw["expert_weights"])
        try:
            assert np.array_equal(bits(fl.call(layer)), want)
        finally:
            assert fl.close() == 0


def tokens_computed(d):
    return scrape(d.metrics_port).get("moed_tokens_total") or 0


@pytest.mark.parametrize("kind", ["python", "c"])
def test_each_daemon_computes_only_its_tokens(daemon, tmp_path, kind):
    """moed_tokens_total on each daemon grows by the tokens its shard got: every token on the one
    adding the shared experts, only those with a pair on its experts on the other; its
    moed_expert_tokens_total still counts exactly the pairs routed to its experts."""
    a = daemon("--synthetic", SPEC, "--threads", "1", "--experts", "0-3", *ANY_METRICS_PORT)
    b = daemon("--synthetic", SPEC, "--threads", "1", "--experts", "4-7", *ANY_METRICS_PORT)
    rng = np.random.default_rng(13)
    x, kw = hidden(rng, "f32"), sliced_choice(rng, (0, 1, 2, 3), (4, 5, 6, 7))
    ids = kw["expert_ids"]
    fl = fleet_client(kind, tmp_path, [a.address, b.address], x, kw)
    try:
        start = [tokens_computed(d) for d in (a, b)]
        assert not isinstance(fl.call(0), tuple)
        got = [tokens_computed(d) - s for d, s in zip((a, b), start)]
    finally:
        assert fl.close() == 0
    assert got == [T, len(shard_rows(ids, (4, 5, 6, 7), False))] and got[1] < T, got
    for d, held in ((a, (0, 1, 2, 3)), (b, (4, 5, 6, 7))):
        m = scrape(d.metrics_port)
        for e in held:
            assert (m.get("moed_expert_tokens_total", layer="0", expert=str(e)) or 0) == np.sum(ids == e), (e, kind)


def test_moed_load_verified_with_each_shard_given_its_tokens(daemon, tmp_path):
    """moed-load --verify over a fleet of two expert shards (uniform expert ids, 8 tokens a call):
    every reply right; the daemon adding the shared expert computed every token sent, the other
    fewer (only those with a pair on its experts), and at least half its pairs (two a token)."""
    a = daemon("--synthetic", SPEC, "--threads", "1", "--experts", "0-3", *ANY_METRICS_PORT)
    b = daemon("--synthetic", SPEC, "--threads", "1", "--experts", "4-7", *ANY_METRICS_PORT)
    out = tmp_path / "r.json"
    p = moed_load([a.address, b.address], "--layers", "0,1", "--dtype", "f32", "--routing", "uniform",
                  "--requests", 60, "--verify", 60, "--concurrency", 4, "--tokens", 8, "--warmup", 0,
                  "--json", out)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr
    lv = json.loads(out.read_text())["levels"][0]
    assert lv["ok"] == 60 and lv["verify"]["checked"] >= 32 and lv["verify"]["mismatches"] == 0, lv
    sent = 60 * 8
    m = scrape(b.metrics_port)
    pairs_b = sum(m.get("moed_expert_tokens_total", layer=str(layer), expert=str(e)) or 0
                  for layer in (0, 1) for e in range(4, 8))
    assert tokens_computed(a) == sent
    assert pairs_b / 2 <= tokens_computed(b) < sent, (tokens_computed(b), pairs_b)


@pytest.mark.parametrize("kind", ["python", "c"])
def test_a_shard_down_fails_only_the_calls_that_need_it(daemon, tmp_path, kind):
    """The only daemon of experts 4-7 is gone: a call whose tokens have no pair on them is
    answered (without it, as one daemon answers), and one with a token on expert 5 still fails
    UNAVAILABLE naming the daemon and its experts."""
    a = daemon("--synthetic", SPEC, "--threads", "1", "--experts", "0-3")
    b = daemon("--synthetic", SPEC, "--threads", "1", "--experts", "4-7")
    full = daemon("--synthetic", SPEC, "--threads", "1")
    rng = np.random.default_rng(17)
    x = hidden(rng, "f32")
    ids = rng.integers(0, 4, (T, 2)).astype(np.int32)
    ids[3, 1] = -1
    kw = dict(expert_ids=ids, expert_weights=np.where(ids >= 0, 0.5, 0).astype(np.float32))
    needs_b = dict(kw, expert_ids=np.where(np.arange(T)[:, None] == 7, 5, ids).astype(np.int32))
    with full.client() as c:
        want = [f32(c.forward(0, x, **k)) for k in (kw, needs_b)]
    clients = []
    for i, k in enumerate((kw, needs_b)):
        (tmp_path / str(i)).mkdir()
        clients.append(fleet_client(kind, tmp_path / str(i), [a.address, b.address], x, k))
    try:
        assert right(clients[0].call(), want[0]) and right(clients[1].call(), want[1])
        assert b.stop() == 0, b.log()
        for _ in range(3):
            assert right(clients[0].call(), want[0])
            code, msg = clients[1].call()
            assert code == "UNAVAILABLE" and "experts 4-7" in msg and b.address in msg, (code, msg)
    finally:
        for fl in clients:
            assert fl.close() == 0
