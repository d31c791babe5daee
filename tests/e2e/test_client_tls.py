"""The C tools over TLS (libmoedclient's moedc_opts.tls_*, moectl's and moed-load's --tls-* flags),
against daemons started with certificates that openssl makes (prod.Certs):

- TLS: moectl health, info and forward (output checked against the numpy model) trusting the CA;
  by name (localhost), by IP, and with --tls-server-name; --tls with gRPC's default roots pointed
  at the CA; the call fails (exit 1, UNAVAILABLE) without the CA, with a wrong server name, in
  plaintext against TLS and in TLS against plaintext.
- Mutual TLS: only a client certificate from the daemon's client CA gets in; with a bearer token
  too, the token file is needed as well.
- moed-load: a verified run over TLS and over mutual TLS; without a client certificate the health
  check fails (exit 1).
- Bad TLS material is a usage error (exit 2) naming the file, before any connection: missing,
  not PEM, encrypted, not a regular file (a FIFO must not hang the tool), a lone --tls-cert.
"""

import os
import subprocess

import numpy as np
import pytest

import oracle as O
from conftest import BUILD, DEFAULT_SPEC
from prod import Certs, wait_serving

MOECTL = BUILD / "client" / "c" / "moectl"
LOAD = BUILD / "client" / "c" / "moed-load"
SPEC = O.Spec.parse(DEFAULT_SPEC)
TOKEN = "c-t0ken-" + "5a" * 12


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    c = Certs(tmp_path_factory.mktemp("pki"))
    subprocess.run(["openssl", "pkey", "-in", c.path("client.key"), "-aes256", "-passout",
                    "pass:secret", "-out", c.path("encrypted.key")], check=True)
    return c


def tls_daemon(daemon, certs, *flags, client=None):
    d = daemon("--synthetic", DEFAULT_SPEC, "--threads", "1", "--tls-cert", certs.path("server.crt"),
               "--tls-key", certs.path("server.key"), *flags, wait=False)
    wait_serving(d, credentials=certs.credentials(client))
    return d


def run(tool, target, *args, env=None, timeout=120):
    # Names (localhost) are resolved by getaddrinfo: Debian's gRPC 1.51 resolves them with c-ares
    # by default, which leaks 10 bytes per process that the ASan stage would report as ours.
    env = {**os.environ, "GRPC_DNS_RESOLVER": "native", **(env or {})}
    return subprocess.run([str(tool), "--target", target, *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=env)


def ca(certs):
    return ["--tls-ca", certs.path("ca.crt")]


def client_cert(certs, who="client"):
    return ["--tls-cert", certs.path(f"{who}.crt"), "--tls-key", certs.path(f"{who}.key")]


def refused(p):
    assert p.returncode == 1 and "UNAVAILABLE" in p.stderr, (p.returncode, p.stderr)


def forward_checked(target, tls, tmp_path):
    """moectl forward with a client route; the output must be the numpy model's."""
    rng = np.random.default_rng(5)
    x, x64 = O.hidden(rng, 5, SPEC.d, "f32")
    ids = np.stack([rng.permutation(SPEC.experts)[:2] for _ in range(5)]).astype(np.int32)
    w = rng.uniform(0, 1, (5, 2)).astype(np.float32)
    for name, a in (("x", x), ("ids", ids), ("w", w)):
        np.save(tmp_path / f"{name}.npy", a)
    out = tmp_path / "y.npy"
    p = run(MOECTL, target, *tls, "--timeout", 30, "forward", "--layer", 0, "--hidden",
            tmp_path / "x.npy", "--ids", tmp_path / "ids.npy", "--weights", tmp_path / "w.npy",
            "--out", out)
    assert p.returncode == 0, p.stderr
    ref = O.forward(x64, SPEC.layer(0), O.choice_route(ids, w), SPEC.act)
    assert O.rel_err(np.load(out).astype(np.float64), ref) <= O.TOL["f32"]


# ---- TLS ---------------------------------------------------------------------------------------

def test_moectl_over_tls(daemon, certs, tmp_path):
    d = tls_daemon(daemon, certs)
    for target in (d.address, f"localhost:{d.port}"):  # the certificate names both
        p = run(MOECTL, target, *ca(certs), "--timeout", 30, "health")
        assert p.returncode == 0 and p.stdout == "SERVING\n", p.stderr
    p = run(MOECTL, d.address, *ca(certs), "--timeout", 30, "info")
    assert p.returncode == 0 and "backend   cpu" in p.stdout, p.stderr
    forward_checked(d.address, ca(certs), tmp_path)
    p = run(MOECTL, d.address, *ca(certs), "--tls-server-name", "localhost", "--timeout", 30,
            "health")
    assert p.returncode == 0, p.stderr
    # --tls alone: gRPC's default roots, here pointed at the test CA
    p = run(MOECTL, f"localhost:{d.port}", "--tls", "--timeout", 30, "health",
            env={"GRPC_DEFAULT_SSL_ROOTS_FILE_PATH": certs.path("ca.crt")})
    assert p.returncode == 0, p.stderr


def test_moectl_refuses_what_tls_must_refuse(daemon, certs):
    d = tls_daemon(daemon, certs)
    refused(run(MOECTL, d.address, "--timeout", 30, "health"))  # plaintext against TLS
    refused(run(MOECTL, d.address, "--tls-ca", certs.path("other-ca.crt"), "--timeout", 30, "health"))
    p = run(MOECTL, d.address, *ca(certs), "--tls-server-name", "moed.example", "--timeout", 30,
            "health")
    refused(p)
    assert "moed.example" in p.stderr
    refused(run(MOECTL, d.address, "--tls", "--timeout", 30, "health",  # roots without the test CA
                env={"GRPC_DEFAULT_SSL_ROOTS_FILE_PATH": certs.path("other-ca.crt")}))
    plain = daemon("--synthetic", DEFAULT_SPEC, "--threads", "1")
    refused(run(MOECTL, plain.address, *ca(certs), "--timeout", 30, "health"))  # TLS to plaintext


# ---- mutual TLS --------------------------------------------------------------------------------

def test_moectl_over_mutual_tls(daemon, certs, tmp_path):
    d = tls_daemon(daemon, certs, "--tls-client-ca", certs.path("ca.crt"), client="client")
    tls = [*ca(certs), *client_cert(certs)]
    p = run(MOECTL, d.address, *tls, "--timeout", 30, "health")
    assert p.returncode == 0 and p.stdout == "SERVING\n", p.stderr
    p = run(MOECTL, d.address, *tls, "--timeout", 30, "info")
    assert p.returncode == 0 and "backend   cpu" in p.stdout, p.stderr
    forward_checked(d.address, tls, tmp_path)
    refused(run(MOECTL, d.address, *ca(certs), "--timeout", 30, "health"))  # no certificate
    refused(run(MOECTL, d.address, *ca(certs), *client_cert(certs, "stranger"), "--timeout", 30,
                "info"))  # a certificate from another CA


def test_mutual_tls_and_token(daemon, certs, tmp_path):
    (tmp_path / "token").write_text(TOKEN + "\n")
    d = tls_daemon(daemon, certs, "--tls-client-ca", certs.path("ca.crt"), "--auth-token-file",
                   tmp_path / "token", client="client")
    tls = [*ca(certs), *client_cert(certs)]
    p = run(MOECTL, d.address, *tls, "--timeout", 30, "info")
    assert p.returncode == 1 and "UNAUTHENTICATED" in p.stderr, p.stderr
    p = run(MOECTL, d.address, *tls, "--token-file", tmp_path / "token", "--timeout", 30, "info")
    assert p.returncode == 0, p.stderr
    p = run(LOAD, d.address, *tls, "--token-file", tmp_path / "token", "--no-progress",
            "--requests", 50, "--warmup", 0)
    assert p.returncode == 0 and "50 ok" in p.stdout, p.stdout + p.stderr


# ---- moed-load ---------------------------------------------------------------------------------

@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mutual-tls"])
def test_moed_load_over_tls(daemon, certs, mutual):
    flags = ["--tls-client-ca", certs.path("ca.crt")] if mutual else []
    d = tls_daemon(daemon, certs, *flags, client="client" if mutual else None)
    tls = [*ca(certs), *(client_cert(certs) if mutual else [])]
    p = run(LOAD, d.address, *tls, "--no-progress", "--requests", 200, "--concurrency", 4,
            "--connections", 2, "--warmup", 0, "--verify", 50)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "200 ok" in p.stdout
    if mutual:
        p = run(LOAD, d.address, *ca(certs), "--no-progress", "--requests", 5)
        assert p.returncode == 1 and "health check failed: UNAVAILABLE" in p.stderr, p.stderr


# ---- bad TLS material --------------------------------------------------------------------------

@pytest.mark.parametrize("tool", [MOECTL, LOAD], ids=["moectl", "moed-load"])
def test_bad_tls_files_are_usage_errors(certs, tmp_path, tool):
    fifo = tmp_path / "ca.fifo"
    os.mkfifo(fifo)
    cases = [
        (["--tls-ca", tmp_path / "missing.crt"], ["tls_ca '", "missing.crt': cannot open it"]),
        (["--tls-ca", certs.path("client.key")], ["tls_ca '", "holds no PEM certificate"]),
        (["--tls-ca", fifo], ["tls_ca '", "ca.fifo' is not a regular file"]),
        ([*ca(certs), "--tls-cert", certs.path("client.key"), "--tls-key", certs.path("client.key")],
         ["tls_cert '", "holds no PEM certificate"]),
        ([*ca(certs), "--tls-cert", certs.path("client.crt"), "--tls-key", certs.path("client.crt")],
         ["tls_key '", "holds no PEM private key"]),
        ([*ca(certs), "--tls-cert", certs.path("client.crt"), "--tls-key",
          certs.path("encrypted.key")], ["encrypted.key' is encrypted with a passphrase"]),
        ([*ca(certs), "--tls-cert", certs.path("client.crt")],
         ["--tls-cert needs --tls-key"]),
    ]
    command = ["health"] if tool == MOECTL else ["--requests", 1]
    for flags, says in cases:
        p = run(tool, "127.0.0.1:1", *flags, "--timeout" if tool == MOECTL else "--deadline", 1000,
                *command, timeout=30)
        assert p.returncode == 2, (flags, p.returncode, p.stderr)
        for s in says:
            assert s in p.stderr, (flags, p.stderr)
        assert p.stdout == ""
