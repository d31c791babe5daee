"""Helpers for the production-feature tests (test_metrics, test_security, test_lifecycle):
scraping and strictly parsing the Prometheus endpoint, raw HTTP, a certificate authority made with
openssl, waiting for a daemon that the conftest fixture cannot probe itself (TLS), and config files.
"""

import math
import re
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field

import grpc

from conftest import free_port
from moed import MoEClient

# ---- Prometheus text format ------------------------------------------------------------------

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"(,|$)')


@dataclass
class Exposition:
    """A parsed /metrics page: samples[(name, frozenset(labels))] = value, and the families'
    types."""
    samples: dict = field(default_factory=dict)
    types: dict = field(default_factory=dict)

    def get(self, metric, **labels):
        return self.samples.get((metric, frozenset(labels.items())))


def parse_exposition(text):
    """Parses text format 0.0.4 strictly: every line is HELP, TYPE or a sample of a family whose
    TYPE came first; no sample repeats; histograms have increasing `le` buckets ending in +Inf,
    non-decreasing counts, and _count equal to the +Inf bucket. AssertionError names the line."""
    e = Exposition()
    helped = set()
    assert text.endswith("\n"), "the page must end with a newline"
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name = line.split(" ")[2]
            assert name not in helped, f"HELP repeated: {line}"
            helped.add(name)
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge", "histogram"), line
            assert name in helped and name not in e.types, f"TYPE out of place: {line}"
            e.types[name] = kind
            continue
        m = _SAMPLE.match(line)
        assert m, f"not a sample line: {line!r}"
        name, _, body, value = m.groups()
        labels = {}
        if body:
            rest = body
            while rest:
                lm = _LABEL.match(rest)
                assert lm, f"bad labels in {line!r}"
                labels[lm.group(1)] = lm.group(2)
                rest = rest[lm.end():]
        family = re.sub(r"_(bucket|sum|count)$", "", name) if name not in e.types else name
        assert family in e.types, f"sample before its TYPE: {line}"
        key = (name, frozenset(labels.items()))
        assert key not in e.samples, f"sample repeated: {line}"
        e.samples[key] = float(value)
    for name, kind in e.types.items():
        if kind != "histogram":
            continue
        buckets = sorted(((float(dict(k[1])["le"]), v) for k, v in e.samples.items()
                          if k[0] == name + "_bucket"))
        assert buckets and math.isinf(buckets[-1][0]), f"{name}: no +Inf bucket"
        counts = [v for _, v in buckets]
        assert counts == sorted(counts), f"{name}: bucket counts decrease: {buckets}"
        assert e.get(name + "_count") == counts[-1], f"{name}: _count differs from +Inf bucket"
        assert e.get(name + "_sum") is not None, f"{name}: no _sum"
    return e


def http(port, request, timeout=10, read=True):
    """Sends raw bytes to 127.0.0.1:port and returns (status or None, the whole answer); with
    read=False it hangs up at once instead."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(request)
        if not read:
            return None, b""
        chunks = []
        while True:
            b = s.recv(65536)
            if not b:
                break
            chunks.append(b)
    answer = b"".join(chunks)
    m = re.match(rb"HTTP/1\.1 (\d{3}) ", answer)
    return (int(m.group(1)) if m else None), answer


def get(port, path):
    """GET over urllib (a real HTTP client): (status, body)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def scrape(port):
    status, body = get(port, "/metrics")
    assert status == 200, body
    return parse_exposition(body)


# Turns the endpoint on at a port the kernel picks; conftest's Daemon.metrics_port reads it from the
# log. Prefer it to metrics_flags(), whose port is free only until some other process takes it.
ANY_METRICS_PORT = ("--metrics-listen", "127.0.0.1:0")


def metrics_flags():
    """(flags that turn the endpoint on at a free port, the port)."""
    port = free_port()
    return ["--metrics-listen", f"127.0.0.1:{port}"], port


# ---- config files ----------------------------------------------------------------------------

def config_file(path, **options):
    """Writes `key = value` lines (underscores in keys become dashes) and returns the path."""
    lines = ["# written by the test"]
    lines += [f"{k.replace('_', '-')} = {v}" for k, v in options.items()]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


# ---- certificates ----------------------------------------------------------------------------

def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


class Certs:
    """A CA, a server certificate for 127.0.0.1 and localhost, a client certificate from the same
    CA, a client certificate from another CA, and a key that matches neither certificate."""

    def __init__(self, d):
        self.dir = d
        ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        for ca in ("ca", "other-ca"):
            _openssl("req", "-x509", *ec, "-keyout", f"{ca}.key", "-out", f"{ca}.crt", "-days", "2",
                     "-subj", f"/CN=moed test {ca}", cwd=d)
        (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                                      "extendedKeyUsage=serverAuth\n")
        (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
        for name, ca, ext in (("server", "ca", "server.ext"), ("client", "ca", "client.ext"),
                              ("stranger", "other-ca", "client.ext")):
            _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                     "-subj", f"/CN=moed test {name}", cwd=d)
            _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
                     "-CAcreateserial", "-out", f"{name}.crt", "-days", "2", "-extfile", ext, cwd=d)
        _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                 "-out", "unrelated.key", cwd=d)

    def path(self, name):
        return str(self.dir / name)

    def read(self, name):
        return (self.dir / name).read_bytes()

    def credentials(self, client=None):
        """Channel credentials trusting the CA, with a client certificate ("client", "stranger")."""
        if client is None:
            return grpc.ssl_channel_credentials(root_certificates=self.read("ca.crt"))
        return grpc.ssl_channel_credentials(root_certificates=self.read("ca.crt"),
                                            private_key=self.read(f"{client}.key"),
                                            certificate_chain=self.read(f"{client}.crt"))


def wait_serving(d, timeout=60.0, **client_kw):
    """Like conftest's wait, for daemons it cannot probe (TLS): health over a client built with
    client_kw must say SERVING."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        assert d.proc.poll() is None, f"moed exited {d.proc.returncode}:\n{d.log()}"
        try:
            with MoEClient(d.address, timeout=1.0, **client_kw) as c:
                if c.health() == "SERVING":
                    return
        except Exception as err:  # not up yet
            last = err
        time.sleep(0.05)
    raise AssertionError(f"moed not SERVING after {timeout}s ({last}):\n{d.log()}")


# ---- what the server counted -------------------------------------------------------------------

def server_counts(port):
    """The counters that show what the server did with Forward requests, from one scrape: answered
    requests as "Forward:CODE" or "ForwardStream:CODE" (moed_requests_total; health checks and
    GetModel are left out), "launches" (computed batches), "launched_requests" and
    "launched_tokens" (what they held), "queue_waits" (requests that left a queue for a launch) and
    "queued" (requests waiting now)."""
    e = scrape(port)
    out = {f"{dict(k[1])['method']}:{dict(k[1])['code']}": v for k, v in e.samples.items()
           if k[0] == "moed_requests_total" and dict(k[1])["method"].startswith("Forward")}
    out.update(launches=e.get("moed_compute_duration_seconds_count"),
               launched_requests=e.get("moed_batch_requests_sum"),
               launched_tokens=e.get("moed_batch_tokens_sum"),
               queue_waits=e.get("moed_queue_duration_seconds_count"),
               queued=e.get("moed_queue_requests"))
    return out


def counts_delta(after, before):
    """after - before for every key of either (a missing counter is 0); "queued" is a gauge, taken
    as it is in `after`."""
    out = {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}
    out["queued"] = after.get("queued", 0)
    return {k: v for k, v in out.items() if v or k == "queued"}


def wait_counts(port, before, want, timeout=10.0):
    """Scrapes until the counters moved from `before` exactly as `want` says (a dict of deltas; keys
    not named must not have moved, "queued" is the gauge) and returns the delta; AssertionError
    with the last delta after timeout seconds."""
    want = {k: v for k, v in want.items() if v or k == "queued"}
    want.setdefault("queued", 0)
    deadline = time.monotonic() + timeout
    while True:
        got = counts_delta(server_counts(port), before)
        if got == want or time.monotonic() > deadline:
            break
        time.sleep(0.1)  # scrapes are connections: a few per second, well under any limit
    assert got == want, f"the server counted {got}, expected {want}"
    return got
