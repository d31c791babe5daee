"""moed-load against a real moed on loopback: exact counts of good and deliberately bad requests,
every sampled reply checked against the CPU reference (--verify), the JSON and CSV reports, open-loop
rates, sweeps, usage errors; and, against a fake server that lies, that the checks do fail.

--verify recomputes replies with moed's own CPU backend, which the server runs too: a mistake the
two share would pass it. So the replies to moed-load's requests are also checked, through a proxy
that records them, against the tests' own float64 model (oracle.py).
"""

import concurrent.futures
import csv
import fcntl
import json
import math
import os
import pty
import re
import select
import signal
import struct
import subprocess
import termios
import time

import grpc
import numpy as np
import pytest

import oracle as O
from conftest import BUILD, DEFAULT_SPEC, free_port
from moed import MoEClient
from moed._proto.grpc.health.v1 import health_pb2, health_pb2_grpc
from moed._proto.moed.v1 import moed_pb2, moed_pb2_grpc

LOAD = BUILD / "client" / "c" / "moed-load"
QUANTILES = ("min", "p50", "p90", "p95", "p99", "p999", "max")


def load(target, *args, timeout=120, text=True):
    """Runs moed-load; returns the CompletedProcess."""
    assert LOAD.exists(), f"{LOAD} does not exist: build the moed-load target first"
    return subprocess.run([str(LOAD), "--target", target, "--no-progress", *map(str, args)],
                          capture_output=True, text=text, timeout=timeout)


def load_json(tmp_path, target, *args):
    out = tmp_path / "report.json"
    p = load(target, *args, "--json", out)
    report = json.loads(out.read_text()) if out.exists() else None
    return p, report


def check_level(lv):
    """What must hold for every level whatever the load: the counts add up, percentiles are
    ordered, the histogram holds every ok reply."""
    assert lv["requests"] == lv["ok"] + lv["expected_errors"] + lv["errors_total"]
    assert lv["errors_total"] == sum(lv["errors"].values())
    lat = lv["latency_ms"]
    values = [lat[q] for q in QUANTILES]
    assert values == sorted(values), lat
    if lv["ok"]:
        assert 0 < lat["min"] <= lat["mean"] <= lat["max"]
    assert sum(b["count"] for b in lv["histogram"]) == lv["ok"]


# ---- against moed ------------------------------------------------------------------------------

def test_mixed_requests_exact_counts_and_verified(shared_daemon, tmp_path):
    """2000 requests over both layers, 10% deliberately bad: exactly 200 fail INVALID_ARGUMENT, the
    other 1800 come back OK, and a sample checked against the CPU reference all match."""
    p, r = load_json(tmp_path, shared_daemon.address, "--requests", 2000, "--concurrency", 8,
                     "--warmup", 0.2, "--layers", "0,1", "--tokens", "1:24",
                     "--bad-fraction", 0.1, "--verify", 200)
    assert p.returncode == 0, p.stdout + p.stderr
    assert r["pass"] is True and len(r["levels"]) == 1
    lv = r["levels"][0]
    check_level(lv)
    assert lv["requests"] == 2000
    assert lv["bad_requests"] == math.floor(2000 * 0.1) == 200
    assert lv["expected_errors"] == 200
    assert lv["ok"] == 1800 and lv["errors_total"] == 0 and lv["errors"] == {}
    assert lv["verify"]["mismatches"] == 0
    assert 32 <= lv["verify"]["checked"] <= 200  # its queue (32) takes the first, however slow it is
    assert lv["server"]["batch_requests_mean"] >= 1
    assert lv["tokens_per_s"] > 0 and lv["mb_per_s_sent"] > 0 and lv["mb_per_s_received"] > 0
    assert "1800 ok, 200 expected errors" in p.stdout


@pytest.mark.parametrize("args", [
    ("--routing", "zipf:1.5", "--dtype", "f32"),
    ("--routing", "one", "--dtype", "f16"),
    ("--routing", "logits", "--strategy", "topk", "--top-k", "3"),
    ("--routing", "logits", "--strategy", "sigmoid"),
    ("--routing", "server"),
    ("--routing", "logits", "--batch-gating", "3"),
    ("--routing", "server", "--batch-gating", "0", "--layers", "1,0,0"),
], ids=lambda a: " ".join(a))
def test_routing_modes_verified(shared_daemon, tmp_path, args):
    p, r = load_json(tmp_path, shared_daemon.address, "--requests", 300, "--concurrency", 4,
                     "--warmup", 0, "--tokens", "1:16", "--verify", 60, *args)
    assert p.returncode == 0, p.stdout + p.stderr
    lv = r["levels"][0]
    check_level(lv)
    assert lv["ok"] == 300 and lv["errors_total"] == 0
    assert lv["verify"]["checked"] >= 30 and lv["verify"]["mismatches"] == 0


@pytest.mark.parametrize("arrival,tolerance", [("constant", 2), ("poisson", 135)])
def test_open_loop_rate(shared_daemon, tmp_path, arrival, tolerance):
    """300/s for 3 s: every arrival due in the window is sent, however late the machine lets the
    generator get to it, so the count depends on the rate alone: 900 for constant arrivals (give
    or take the rounding of the gaps), a Poisson count within 4.5 standard deviations (and fixed
    by the seed). The last is due near the window's end: the window lasted that long."""
    p, r = load_json(tmp_path, shared_daemon.address, "--rate", 300, "--arrival", arrival,
                     "--duration", 3, "--warmup", 0.5, "--bad-fraction", 0.25)
    assert p.returncode == 0, p.stdout + p.stderr
    assert r["mode"] == "open" and r["arrival"] == arrival
    lv = r["levels"][0]
    check_level(lv)
    assert lv["rate_asked"] == 300
    assert abs(lv["requests"] - 900) <= tolerance, lv["requests"]
    assert lv["elapsed_s"] >= (2.9 if arrival == "constant" else 2.5), lv["elapsed_s"]
    assert lv["bad_requests"] == math.floor(lv["requests"] * 0.25) == lv["expected_errors"]


def test_sweep_one_csv_row_per_level(shared_daemon, tmp_path):
    out = tmp_path / "sweep.csv"
    tokens = tmp_path / "tokens.txt"
    tokens.write_text("# request sizes\n1\n8\n\n32\n")
    p = load(shared_daemon.address, "--concurrency", "1:5:2", "--requests", 150, "--warmup", 0,
             "--tokens-file", tokens, "--csv", out)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = list(csv.DictReader(out.open()))
    assert [int(row["concurrency"]) for row in rows] == [1, 3, 5]
    for row in rows:
        assert int(row["requests"]) == int(row["ok"]) == 150 and int(row["errors"]) == 0
        lat = [float(row[f"latency_{q}_ms"]) for q in QUANTILES]
        assert lat == sorted(lat) and lat[0] > 0
    assert p.stdout.count("level      closed loop") == 3


def test_progress_line(shared_daemon):
    """The progress line is rewritten in place (\\r) every half second with the rate and, once
    replies came, the latency; it is cleared at the end. The run lasts until the test has seen two
    such lines and interrupts it (SIGINT: the report covers what was done, exit 0)."""
    p = subprocess.Popen([str(LOAD), "--target", shared_daemon.address, "--progress", "--concurrency", "2",
                          "--duration", "600", "--warmup", "0"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    err = b""
    try:
        deadline = time.monotonic() + 60
        while len([line for line in err.split(b"\r") if b"p99" in line]) < 2:
            assert time.monotonic() < deadline and p.poll() is None, err
            if select.select([p.stderr], [], [], 1.0)[0]:
                err += os.read(p.stderr.fileno(), 65536)
        p.send_signal(signal.SIGINT)
        out, rest = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    err += rest
    assert p.returncode == 0, err
    lines = err.split(b"\r")
    assert b"req/s" in lines[1] and b"p99" in lines[-2], lines
    assert lines[-1].startswith(b"\x1b[K") and b"interrupted" in lines[-1]  # cleared at the end
    assert b"ok" in out


def test_progress_on_a_terminal_only(shared_daemon):
    """Without --progress or --no-progress the line shows only where stderr is a terminal: on a
    pipe moed-load writes none; on a terminal of 60 columns it says which level of the sweep runs
    and how far its window is, and keeps to one row (59 columns), so \r rewrites it. The terminal's
    run lasts until the test has seen such a line and interrupts it."""
    quiet = subprocess.run([str(LOAD), "--target", shared_daemon.address, "--concurrency", "1:3:2",
                            "--requests", "20", "--warmup", "0"], capture_output=True, timeout=120)
    assert quiet.returncode == 0 and b"\r" not in quiet.stderr and b"\x1b[K" not in quiet.stderr, quiet.stderr
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 60, 0, 0))
    p = subprocess.Popen([str(LOAD), "--target", shared_daemon.address, "--concurrency", "1:3:2",
                          "--duration", "600", "--warmup", "0"], stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    err = b""
    try:
        deadline = time.monotonic() + 60
        while not re.search(rb"\[1/2 c=1\] \d+\.\d/600\.0 s \(\d+%\)  \d+ req/s", err):
            assert time.monotonic() < deadline and p.poll() is None, err
            if select.select([master], [], [], 1.0)[0]:
                err += os.read(master, 65536)
        p.send_signal(signal.SIGINT)
        out, _ = p.communicate(timeout=120)
        while select.select([master], [], [], 0.5)[0]:
            try:
                err += os.read(master, 65536)
            except OSError:  # the terminal closed with its last writer
                break
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        os.close(master)
    assert p.returncode == 0, err
    lines = [seg.split(b"\x1b[K")[0] for seg in err.split(b"\r") if b"req/s" in seg]
    assert lines and all(len(line) <= 59 for line in lines), lines
    assert b"[2/2" not in err  # interrupted in the first level: the second never ran


def test_deadline_errors_are_counted_by_status(daemon, tmp_path):
    """A merge window far longer than the deadline: every call ends DEADLINE_EXCEEDED, counted
    under that name, and the run fails (exit 1)."""
    d = daemon("--synthetic", DEFAULT_SPEC, "--threads", "1", "--max-delay-us", "60000000")
    p, r = load_json(tmp_path, d.address, "--requests", 20, "--concurrency", 4, "--warmup", 0,
                     "--deadline", 50)
    assert p.returncode == 1, p.stdout + p.stderr
    lv = r["levels"][0]
    check_level(lv)
    assert r["pass"] is False
    assert lv["errors"] == {"DEADLINE_EXCEEDED": 20} and lv["ok"] == 0
    assert "DEADLINE_EXCEEDED x20" in p.stdout


# ---- usage and reachability ----------------------------------------------------------------------

OTHER_SPEC = DEFAULT_SPEC.replace("seed=1", "seed=2")


@pytest.mark.parametrize("args,words", [
    (("--concurrency", "0"), "--concurrency"),
    (("--concurrency", "1:8"), "a:b:step"),
    (("--rate", "10", "--concurrency", "2"), "not both"),
    (("--arrival", "poisson"), "needs --rate"),
    (("--tokens", "0"), "--tokens"),
    (("--tokens", "8", "--tokens-file", "x"), "not both"),
    (("--tokens-file", "/nonexistent/tokens"), "cannot open"),
    (("--routing", "bogus"), "--routing bogus"),
    (("--batch-gating", "2"), "needs logits"),
    (("--duration", "1", "--requests", "5"), "not both"),
    (("--bad-fraction", "1.5"), "[0, 1]"),
    (("--bogus",), "unknown option"),
    (("--layer", "7"), "layer 7 is not served"),
    (("--layer", "0,1"), "--layers"),
    (("--tokens", "100000"), "limit"),
    (("--dtype", "i32"), "--dtype"),
    (("--verify", "5", "--synthetic", OTHER_SPEC), "seed=2"),
    (("--synthetic", DEFAULT_SPEC), "--verify"),
])
def test_usage_errors_exit_2(shared_daemon, args, words):
    p = load(shared_daemon.address, "--requests", 5, *args)
    assert p.returncode == 2, p.stdout + p.stderr
    assert words in p.stderr and p.stdout == ""


BAD_VALUES = [
    ("--deadline", "0", "give milliseconds > 0"),
    ("--duration", "-1", "give seconds > 0"),
    ("--warmup", "soon", "give seconds >= 0"),
    ("--requests", "0", "give a count >= 1"),
    ("--verify", "1e3", "give a count of replies >= 1"),
    ("--seed", "-1", "give an integer >= 0"),
    ("--connections", "1025", "give 1 to 1024"),
    ("--threads", "0", "give 1 to 256"),
    ("--max-inflight", "0", "give 1 to 1048576"),
    ("--top-k", "-1", "give a count >= 0"),
    ("--batch-gating", "x", "give a set size >= 0"),
    ("--bad-fraction", "nan", "give a share in [0, 1]"),
    ("--strategy", "best", "use model, topk, sigmoid"),
]


@pytest.mark.parametrize("flag,value,says", BAD_VALUES, ids=[f[0] for f in BAD_VALUES])
def test_bad_values_exit_2_naming_the_flag(flag, value, says):
    """Checked while parsing, before any connection: no server is needed."""
    p = load(f"127.0.0.1:{free_port()}", flag, value)
    assert p.returncode == 2, p.stdout + p.stderr
    assert f"moed-load: {flag} {value}: {says}" in p.stderr and p.stdout == ""
    assert "(moed-load --help lists the options)" in p.stderr


@pytest.mark.parametrize("args,says", [
    (("--progress=1",), "--progress takes no value"),
    (("--duration",), "--duration needs a value"),
    (("stray",), "unexpected argument 'stray'"),
    (("--token", "t", "--token-file", "/dev/null"), "not both"),
    (("--token-file", "/nonexistent/token"), "--token-file /nonexistent/token: cannot open it"),
    (("--tls-ca", "/nonexistent/ca.crt"), "tls_ca '/nonexistent/ca.crt': cannot open it"),
    (("--tls-key", "k.pem"), "--tls-key needs --tls-cert"),
], ids=lambda a: " ".join(a) if isinstance(a, tuple) else None)
def test_words_that_are_not_options_exit_2(args, says):
    p = load(f"127.0.0.1:{free_port()}", *args)
    assert p.returncode == 2, p.stdout + p.stderr
    assert says in p.stderr and p.stdout == ""


def test_help():
    p = subprocess.run([str(LOAD), "--help"], capture_output=True, text=True)
    assert p.returncode == 0 and "--bad-fraction" in p.stdout and "exit codes" in p.stdout
    # the defaults come from the option table's rows
    for flag, default in (("--duration S", "10"), ("--warmup S", "1"), ("--max-inflight N", "4096"),
                          ("--target ADDR", "127.0.0.1:50051"), ("--tokens SPEC", "8")):
        row = p.stdout[p.stdout.index(flag):].split("\n  --")[0]
        assert f"(default {default})" in row, row
    for flag in set(re.findall(r"^  (--[a-z-]+)", p.stdout, re.M)):  # every flag listed is taken
        q = subprocess.run([str(LOAD), flag], capture_output=True, text=True)
        assert "unknown option" not in q.stderr, (flag, q.stderr)


def test_unreachable_server_exit_1():
    p = load(f"127.0.0.1:{free_port()}", "--requests", 5)
    assert p.returncode == 1 and "health check failed" in p.stderr


# ---- against a server that lies ------------------------------------------------------------------

class Liar(moed_pb2_grpc.MoedServicer):
    """Answers GetModel as the real daemon does and Forward through it, then spoils the reply as
    `mode` says: 'row' perturbs one row of every output, 'shape' drops a row, 'accept' answers
    the requests the daemon refuses with zeros, as if they were fine."""

    def __init__(self, real, mode):
        self.stub = moed_pb2_grpc.MoedStub(real)
        self.mode = mode

    def GetModel(self, request, context):
        return self.stub.GetModel(request)

    def Forward(self, request, context):
        try:
            reply = self.stub.Forward(request)
        except grpc.RpcError as e:
            if self.mode != "accept":
                context.abort(e.code(), e.details())
            h = request.hidden
            return moed_pb2.ForwardResponse(output=moed_pb2.Tensor(dtype=h.dtype, shape=h.shape,
                                                                   data=bytes(len(h.data))))
        out = reply.output
        T, d = out.shape
        if self.mode == "shape" and T > 1:
            row = len(out.data) // T
            out.data = out.data[:-row]
            out.shape[0] = T - 1
        elif self.mode == "row":
            y = np.frombuffer(out.data, dtype=np.uint16).copy()  # bf16 bits
            t = T // 2
            y[t * d:(t + 1) * d] ^= 0x0040  # a wrong mantissa bit in every element of one row
            out.data = y.tobytes()
        return reply


class Healthy(health_pb2_grpc.HealthServicer):
    def Check(self, request, context):
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


class Recorder(Liar):
    """Passes every call through unchanged, and keeps each Forward request with its reply."""

    def __init__(self, real):
        super().__init__(real, "record")
        self.pairs = []

    def Forward(self, request, context):
        reply = super().Forward(request, context)
        self.pairs.append((request, reply))
        return reply


@pytest.fixture
def liar(shared_daemon):
    """liar(mode) starts a proxy to the shared daemon (Liar, or Recorder for "record") and returns
    its address; liar.servicers holds them."""
    servers, channels = [], []

    def start(mode):
        channel = shared_daemon.channel()
        server = grpc.server(concurrent.futures.ThreadPoolExecutor(8))
        servicer = Recorder(channel) if mode == "record" else Liar(channel, mode)
        moed_pb2_grpc.add_MoedServicer_to_server(servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(Healthy(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        channels.append(channel)
        start.servicers.append(servicer)
        return f"127.0.0.1:{port}"

    start.servicers = []
    yield start
    for s in servers:
        s.stop(0)
    for c in channels:
        c.close()


def test_verify_catches_one_wrong_row(liar, tmp_path):
    p, r = load_json(tmp_path, liar("row"), "--requests", 40, "--concurrency", 2, "--warmup", 0,
                     "--tokens", "2:64", "--verify", 40, "--dtype", "bf16")
    assert p.returncode == 1, p.stdout + p.stderr
    lv = r["levels"][0]
    assert lv["ok"] == 40 and lv["errors_total"] == 0
    assert lv["verify"]["checked"] >= 10
    assert lv["verify"]["mismatches"] == lv["verify"]["checked"]
    assert "differs from the reference" in lv["verify"]["first_mismatch"]


def test_malformed_replies_are_errors(liar, tmp_path):
    p, r = load_json(tmp_path, liar("shape"), "--requests", 30, "--concurrency", 2, "--warmup", 0,
                     "--tokens", 4)
    assert p.returncode == 1
    lv = r["levels"][0]
    check_level(lv)
    assert lv["errors"] == {"MALFORMED_REPLY": 30}


def test_bad_requests_accepted_are_errors(liar, tmp_path):
    p, r = load_json(tmp_path, liar("accept"), "--requests", 50, "--concurrency", 2, "--warmup", 0,
                     "--bad-fraction", 0.2)
    assert p.returncode == 1
    lv = r["levels"][0]
    check_level(lv)
    assert lv["bad_requests"] == 10 and lv["expected_errors"] == 0
    assert lv["errors"] == {"BAD_ACCEPTED": 10} and lv["ok"] == 40


# ---- moed-load's requests against the tests' own model ------------------------------------------

STRATEGIES = {0: "model", 1: "topk", 2: "sigmoid", 3: "sparsemax", 4: "quadratic", 5: "pioneer"}
RENORM = {0: None, 1: True, 2: False}
DTYPE = {1: "f32", 2: "f16", 3: "bf16"}


def tensor(t):
    """A request's Tensor as float64 (bf16 from its bits), or int32 for ids."""
    a = MoEClient.decode_output(t, np.uint16 if DTYPE.get(t.dtype) == "bf16" else None)
    return O.from_bf16_bits(a).astype(np.float64) if a.dtype == np.uint16 else a


def oracle_reference(req, spec):
    """What the float64 model says the reply to a ForwardRequest is, and its dtype's name."""
    w = spec.layer(req.layer)
    x64 = tensor(req.hidden).astype(np.float64)
    dtype = DTYPE[req.hidden.dtype]
    routing = req.WhichOneof("routing")
    if routing == "experts":
        route = O.choice_route(tensor(req.experts.expert_ids), tensor(req.experts.expert_weights))
    else:
        g = req.logits.gating if routing == "logits" else req.server_router.gating
        logits = tensor(req.logits.logits) if routing == "logits" else O.router_logits(x64, w, dtype)
        route = O.gate(logits, STRATEGIES[g.strategy], spec, g.top_k, RENORM[g.renormalize],
                       g.threshold)
    return O.forward(x64, w, route, spec.act), dtype


@pytest.mark.parametrize("args", [
    ("--routing", "zipf:1.2", "--dtype", "bf16"),
    ("--routing", "logits", "--strategy", "sparsemax", "--dtype", "f16"),
    ("--routing", "server", "--strategy", "topk", "--top-k", "3", "--dtype", "f32"),
], ids=lambda a: " ".join(a))
def test_replies_to_moed_load_match_the_oracle(liar, tmp_path, args):
    """moed-load through a recording proxy, with --verify: the run passes, and a sample of its
    requests recomputed by oracle.py matches the replies token by token."""
    target = liar("record")
    p, r = load_json(tmp_path, target, "--requests", 120, "--concurrency", 4, "--warmup", 0,
                     "--tokens", "1:16", "--layers", "0,1", "--verify", 30, *args)
    assert p.returncode == 0, p.stdout + p.stderr
    assert r["levels"][0]["verify"]["mismatches"] == 0
    pairs = liar.servicers[0].pairs
    assert len(pairs) == 120
    spec = O.Spec.parse(DEFAULT_SPEC)
    for req, reply in pairs[::4]:
        ref, dtype = oracle_reference(req, spec)
        O.check(tensor(reply.output), ref, dtype, f"moed-load's request to layer {req.layer}")


# ---- the HTML report (its rendering in a browser: tests/report) -------------------------------

def page_runs(page):
    """The runs a --report page carries, from its moed-runs block."""
    block = re.search(r'<script id="moed-runs" type="application/json">(.*?)</script>', page, re.S)
    assert block, "the page has no moed-runs block"
    return json.loads(block.group(1))["runs"]


def test_report_page_is_the_run_and_needs_no_network(shared_daemon, tmp_path):
    """--report writes one page holding the run's --json document, Chart.js and the page's own
    script inline: nothing is fetched (no src=, href= or url( to anywhere)."""
    page = tmp_path / "run.html"
    p, r = load_json(tmp_path, shared_daemon.address, "--concurrency", "1:3:2", "--requests", 40,
                     "--warmup", 0, "--report", page)
    assert p.returncode == 0, p.stdout + p.stderr
    text = page.read_text()
    runs = page_runs(text)
    assert len(runs) == 1 and runs[0] == r and r["transport"] == "inline"
    assert [lv["concurrency"] for lv in r["levels"]] == [1, 3]
    assert "Chart.js v3.9.1" in text and "Released under the MIT License" in text
    assert not re.search(r"<script[^>]+src=|<link|href=|url\(", text)


def test_report_from_earlier_runs(shared_daemon, tmp_path):
    """--from draws earlier runs' --json files on one page, each named by its file; no load runs
    (no --target is needed). A model name that holds markup stays text: '<' is escaped in the
    data block, so the block ends where the page ends it."""
    files = []
    for tokens in (4, 16):
        p, r = load_json(tmp_path, shared_daemon.address, "--requests", 20, "--tokens", tokens)
        assert p.returncode == 0, p.stderr
        r["model"] = '</script><script id="injected">alert(1)</script>'
        files.append(tmp_path / f"t{tokens}.json")
        files[-1].write_text(json.dumps(r))
    page = tmp_path / "both.html"
    p = subprocess.run([str(LOAD), "--report", str(page), "--from", ",".join(map(str, files))],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "(2 runs)" in p.stderr, p.stderr
    text = page.read_text()
    runs = page_runs(text)
    assert [r["tokens"] for r in runs] == ["4", "16"]
    assert [r["source"] for r in runs] == list(map(str, files))
    assert runs[0]["model"].startswith("</script>")
    assert 'id="injected"' not in text and text.count("</script>") == 3


@pytest.mark.parametrize("content,says", [
    (None, "cannot open it"),
    ("not json", "not a moed-load --json report"),
    ('{"levels": []}', "not a moed-load --json report"),
    ('{"levels": [{"latency_ms": {}}]}', "level 1 lacks server"),
    ("dir", "not a regular file"),
])
def test_report_from_bad_files_exit_2(tmp_path, content, says):
    f = tmp_path / "run.json"
    if content == "dir":
        f.mkdir()
    elif content is not None:
        f.write_text(content)
    p = subprocess.run([str(LOAD), "--report", str(tmp_path / "r.html"), "--from", str(f)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    assert f"--from {f}: {says}" in p.stderr and not (tmp_path / "r.html").exists()


def test_report_from_needs_report():
    p = subprocess.run([str(LOAD), "--from", "a.json"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "give --report FILE.html" in p.stderr, p.stderr
