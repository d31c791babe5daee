"""moed --expert-load FILE: the measured load of each expert, scraped from a running moed's /metrics
(moed_expert_tokens_total), as the placement hint of the layers a backend splits over devices.

A file that cannot be used is bad usage, found before anything loads: a missing file, a directory,
a FIFO (refused at once, not waited on) and a malformed line each exit 2 with a message naming the
file (and the line), from the command line and from a config file. What only the model can tell
fails the start (exit 1, like --layers naming a layer the model lacks): a layer that is not a MoE
layer of the model, an expert id past the layer's, each named with its line and the range.

The operator's workflow end to end: forwards routed mostly to one expert, /metrics scraped into a
file, a second moed started with it: the log states each layer's load (its experts, the pairs
counted, the largest expert and its share), that a layer whose counts are all zero keeps the
uniform placement, and that the CPU backend, which never splits a layer, leaves the hint unused.
An expert shard (--experts) takes the counts of the experts it holds, and --layers skips the
layers of the file it does not serve.
"""

import os
import re
import subprocess

import numpy as np

import oracle as O
from conftest import DEFAULT_SPEC, MOED_BIN
from prod import ANY_METRICS_PORT, config_file, get

SPEC = O.Spec.parse(DEFAULT_SPEC)
SMALL = "layers=2,d=16,ff=16,experts=8,topk=2,seed=3"


def moed(*args, timeout=60):
    return subprocess.run([str(MOED_BIN), "--listen", "127.0.0.1:0", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


def sample(layer, expert, value):
    return f'moed_expert_tokens_total{{layer="{layer}",expert="{expert}"}} {value}\n'


def load_file(path, counts):
    """counts: {layer: [count per expert]} as /metrics writes them, with its HELP and TYPE lines."""
    text = ("# HELP moed_expert_tokens_total (token, expert) pairs computed.\n"
            "# TYPE moed_expert_tokens_total counter\n")
    for layer, v in counts.items():
        text += "".join(sample(layer, e, c) for e, c in enumerate(v))
    path.write_text(text)
    return path


def load_lines(log):
    """{layer: {key: value}} of the log's msg="expert load" lines."""
    out = {}
    for m in re.finditer(r'msg="expert load" (layer=(\d+) .*)', log):
        out[int(m.group(2))] = dict(kv.split("=", 1) for kv in m.group(1).split())
    return out


# ---- refused at once: bad usage ----------------------------------------------------------------

def test_missing_file_exits_2(tmp_path):
    p = moed("--synthetic", SMALL, "--expert-load", tmp_path / "nothing.prom")
    assert p.returncode == 2, p.stderr
    assert "--expert-load" in p.stderr and str(tmp_path / "nothing.prom") in p.stderr, p.stderr
    assert "No such file" in p.stderr


def test_directory_exits_2(tmp_path):
    p = moed("--synthetic", SMALL, "--expert-load", tmp_path)
    assert p.returncode == 2 and "a directory" in p.stderr and str(tmp_path) in p.stderr, p.stderr


def test_fifo_exits_2_at_once(tmp_path):
    fifo = tmp_path / "load.prom"
    os.mkfifo(fifo)
    p = moed("--synthetic", SMALL, "--expert-load", fifo, timeout=10)
    assert p.returncode == 2 and "FIFO" in p.stderr and str(fifo) in p.stderr, p.stderr


def test_malformed_line_exits_2_naming_file_and_line(tmp_path):
    f = tmp_path / "load.prom"
    for bad, words in ((sample(0, 1, "-5"), ["negative"]),
                       (sample(0, 1, "NaN"), ["not a finite number"]),
                       ('moed_expert_tokens_total{layer="0",expert="1",job="x"} 3\n', ["unknown label 'job'"]),
                       ('moed_expert_tokens_total{layer="0"} 3\n', ["label expert is missing"]),
                       (sample(0, 0, 9), ["layer 0 expert 0 again, first given on line 2"])):
        f.write_text("# TYPE moed_expert_tokens_total counter\n" + sample(0, 0, 7) + "moed_up 1\n" + bad)
        p = moed("--synthetic", SMALL, "--expert-load", f)
        assert p.returncode == 2, p.stderr
        assert f"--expert-load {f} line 4: " in p.stderr, p.stderr
        for w in words:
            assert w in p.stderr, p.stderr
        assert "ready" not in p.stderr and "weights loaded" not in p.stderr, "refused before loading"
    # From a config file the same.
    conf = config_file(tmp_path / "moed.conf", synthetic=SMALL, expert_load=f)
    p = moed("--config", conf)
    assert p.returncode == 2 and f"--expert-load {f} line 4: " in p.stderr, p.stderr


def test_control_bytes_are_not_echoed(tmp_path):
    f = tmp_path / "load.prom"
    f.write_bytes(b'moed_expert_tokens_total{layer="0",expert="0"} 1 \x1b]0;pwned\x07' + b"x" * 500 + b"\n")
    p = moed("--synthetic", SMALL, "--expert-load", f)
    assert p.returncode == 2 and "line 1: " in p.stderr, p.stderr
    assert "\x1b" not in p.stderr and "\x07" not in p.stderr and "x" * 100 not in p.stderr, p.stderr


# ---- against the model: the start fails --------------------------------------------------------

def test_layer_not_in_model_exits_1(tmp_path):
    f = load_file(tmp_path / "load.prom", {0: [1] * 8, 7: [1, 2]})
    p = moed("--synthetic", SMALL, "--backend", "cpu", "--threads", "1", "--expert-load", f)
    assert p.returncode == 1, p.stderr
    assert f"--expert-load {f} line 11: layer 7 is not a MoE layer" in p.stderr, p.stderr
    assert "it has 2 MoE layers, from 0 to 1" in p.stderr, p.stderr


def test_expert_out_of_range_exits_1(tmp_path):
    f = load_file(tmp_path / "load.prom", {1: [1] * 9})
    p = moed("--synthetic", SMALL, "--backend", "cpu", "--threads", "1", "--expert-load", f)
    assert p.returncode == 1, p.stderr
    assert (f"--expert-load {f} line 11: expert 8 of layer 1 is out of range: the layer has 8 "
            "experts (0 to 7)") in p.stderr, p.stderr


# ---- the workflow ------------------------------------------------------------------------------

def test_scrape_and_restart(daemon, tmp_path):
    """Forwards to layer 0 with expert 5 in every token's choice, /metrics saved, and a moed started
    with it: layer 0's load is the pairs sent, expert 5 the largest with half of them; layer 1,
    never called, keeps the uniform placement; the CPU backend uses no hint."""
    a = daemon("--synthetic", DEFAULT_SPEC, "--threads", "1", "--backend", "cpu", *ANY_METRICS_PORT)
    rng = np.random.default_rng(4)
    T = 16
    ids = np.stack([np.array([5, e]) for e in rng.choice([0, 1, 2, 3, 4, 6, 7], T)]).astype(np.int32)
    w = np.full((T, 2), 0.5, np.float32)
    x, _ = O.hidden(rng, T, SPEC.d, "bf16")
    with a.client(timeout=30) as c:
        for _ in range(3):
            c.forward(0, x, expert_ids=ids, expert_weights=w)
    status, page = get(a.metrics_port, "/metrics")
    assert status == 200
    f = tmp_path / "load.prom"
    f.write_text(page)  # curl -s HOST:PORT/metrics > load.prom

    b = daemon("--synthetic", DEFAULT_SPEC, "--threads", "1", "--backend", "cpu", "--expert-load", f)
    log = b.log()
    loads = load_lines(log)
    assert set(loads) == {0}, log
    assert loads[0]["experts"] == "8" and loads[0]["pairs"] == str(3 * T * 2), loads
    assert loads[0]["top_expert"] == "5" and float(loads[0]["top_share"]) == 0.5, loads
    assert re.search(r'msg="expert load: none for this layer, its placement stays uniform" layer=1 '
                     r"reason=every_held_expert_counts_0", log), log
    assert re.search(r'msg="expert load unused: the layers are served whole, not split over devices" '
                     r"layers=1 backend=cpu", log), log
    with b.client(timeout=30) as c:  # and it serves as ever
        y = c.forward(0, x, expert_ids=ids, expert_weights=w)
    assert np.asarray(y).shape == (T, SPEC.d)


def test_shard_takes_its_experts_and_layers_skips_others(daemon, tmp_path):
    counts = {0: [1, 2, 3, 4, 40, 5, 6, 7], 1: [0, 0, 0, 0, 0, 0, 9, 9], 5: [1]}
    f = load_file(tmp_path / "load.prom", counts)
    d = daemon("--synthetic", SMALL, "--threads", "1", "--backend", "cpu", "--experts", "2-5",
               "--expert-load", f, "--layers", "0,1")
    log = d.log()
    loads = load_lines(log)
    assert set(loads) == {0}, log
    assert loads[0]["experts"] == "4" and loads[0]["pairs"] == "52", loads  # 3 + 4 + 40 + 5
    assert loads[0]["top_expert"] == "4", loads  # the whole layer's id
    assert re.search(r"layer=1 reason=every_held_expert_counts_0", log), log  # experts 2-5 all 0
    assert re.search(r'msg="expert load: layers not served are skipped" file=\S+ layers=1', log), log


def test_empty_file_and_absent_layers(daemon, tmp_path):
    f = tmp_path / "load.prom"
    f.write_text("")
    d = daemon("--synthetic", SMALL, "--threads", "1", "--backend", "cpu", "--expert-load", f)
    log = d.log()
    assert not load_lines(log), log
    assert len(re.findall(r"reason=not_in_file", log)) == 2, log
    assert "expert load unused" not in log
