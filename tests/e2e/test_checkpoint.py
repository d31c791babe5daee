"""Hugging Face checkpoints that moed did not write: written by the `safetensors` Python package
(make_checkpoint.py), in Mixtral, Qwen3-MoE, OLMoE and DeepSeek-V3 naming, single-file and sharded
with an index. Each loads, GetModel describes it as its config says, and its outputs (the model's
own router and client routes) match the numpy model computed from the weights as written. A broken
checkpoint makes moed exit 1 with a message naming what is wrong.

The checkpoint changing under a serving daemon (docs/weights.md): truncated, or rewritten in place with the
same size, moed keeps answering with the weights it loaded (it served from a mapping, and died of
SIGBUS or silently changed its outputs). A FIFO in place of config.json, the index or a
.safetensors file fails the start at once, naming the file (it blocked forever).
"""

import json
import os
import subprocess

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import oracle as O
from conftest import MOED_BIN
from make_checkpoint import write_checkpoint

CASES = {
    "mixtral": dict(arch="mixtral", layers=2, d=64, ff=80, experts=4, top_k=2, dtype="bf16", seed=1),
    "qwen3_moe_sharded": dict(arch="qwen3_moe", layers=3, d=64, ff=48, experts=8, top_k=3, dtype="f16",
                              router_dtype="f32", first_dense=1, shards=3, seed=2),
    "olmoe": dict(arch="olmoe", layers=1, d=32, ff=40, experts=6, top_k=2, dtype="f32", seed=3),
    "deepseek_v3_sharded": dict(arch="deepseek_v3", layers=3, d=64, ff=32, experts=8, top_k=2, dtype="bf16",
                                n_shared=2, n_group=4, topk_group=2, routed_scale=2.5, shards=2, seed=4),
}


def routing_spec(w, experts):
    """The layer's routing rule as an oracle.Spec, from what make_checkpoint says it wrote."""
    return O.Spec(experts=experts, topk=w["top_k"], norm=int(w["norm_topk"]), rule=w["rule"],
                  groups=w["n_group"], topk_groups=w["topk_group"], scale=w["routed_scale"])


@pytest.mark.parametrize("name", CASES)
def test_checkpoint_loads_and_matches(daemon, tmp_path, name):
    kw = CASES[name]
    layers = write_checkpoint(tmp_path / name, **kw)
    if kw.get("shards", 1) > 1:
        index = json.loads((tmp_path / name / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) == kw["shards"]
    d = daemon("--model", tmp_path / name, "--threads", "1")
    rng = np.random.default_rng(kw["seed"])
    with d.client(timeout=30) as c:
        info = c.info()
        assert sorted(layers) == [l.index for l in info.layers], "the MoE layers, by checkpoint number"
        assert str(tmp_path / name) in info.model
        for index, w in layers.items():
            li = info.layer(index)
            assert (li.d_model, li.d_ff, li.num_experts, li.top_k) == (kw["d"], kw["ff"], kw["experts"], kw["top_k"])
            assert li.activation == "swiglu" and li.weight_dtype == kw["dtype"] and li.has_router
            assert li.norm_topk_prob == w["norm_topk"]
            assert li.router_rule == ("deepseek_v3" if w["rule"] == "deepseek" else "softmax_topk")
            shared_ff = 0 if w["shared_w1"] is None else w["shared_w1"].shape[0]
            assert (li.num_shared_experts, li.shared_d_ff) == (w["n_shared"], shared_ff)
            assert (li.n_group, li.topk_group) == (w["n_group"], w["topk_group"])
            assert li.routed_scaling_factor == pytest.approx(w["routed_scale"])

            spec = routing_spec(w, kw["experts"])
            x, x64 = O.hidden(rng, 7, kw["d"], "f32", scale=2.0)
            y = c.forward(index, x)  # the model's own router and rule
            route = O.gate(O.router_logits(x64, w), "model", spec, bias=w["bias"])
            O.check(y, O.forward(x64, w, route, "swiglu"), "f32", f"{name} layer {index} server router")

            logits = (2 * rng.standard_normal((7, kw["experts"]))).astype(np.float32)
            y = c.forward(index, x, router_logits=logits)
            route = O.gate(logits, "model", spec, bias=w["bias"])
            O.check(y, O.forward(x64, w, route, "swiglu"), "f32", f"{name} layer {index} logits")

            xb, xb64 = O.hidden(rng, 5, kw["d"], "bf16")
            ids = np.stack([rng.permutation(kw["experts"])[:2] for _ in range(5)]).astype(np.int32)
            gw = rng.uniform(0, 1, (5, 2)).astype(np.float32)
            y = c.forward(index, xb, expert_ids=ids, expert_weights=gw)
            O.check(y, O.forward(xb64, w, O.choice_route(ids, gw), "swiglu"), "bf16", f"{name} layer {index} choice")


def test_layers_flag_on_a_checkpoint(daemon, tmp_path):
    layers = write_checkpoint(tmp_path / "m", **CASES["mixtral"])
    d = daemon("--model", tmp_path / "m", "--layers", "1", "--threads", "1")
    x, x64 = O.hidden(np.random.default_rng(0), 3, 64, "f32")
    with d.client(timeout=30) as c:
        assert [l.index for l in c.info().layers] == [1]
        y = c.forward(1, x)
        with pytest.raises(Exception) as e:
            c.forward(0, x)
    w = layers[1]
    O.check(y, O.forward(x64, w, O.gate(O.router_logits(x64, w), "model", routing_spec(w, 4)), "swiglu"), "f32")
    assert e.value.code_name == "NOT_FOUND" and "layer 0" in e.value.message


def start_fails(path, timeout=60):
    p = subprocess.run([str(MOED_BIN), "--listen", "127.0.0.1:0", "--model", str(path), "--threads", "1"],
                       capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stderr


def rewrite(path, change):
    """Loads a single-file checkpoint (f16 or f32), applies change(dict) and writes it back."""
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    change(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


BROKEN_KW = dict(arch="mixtral", layers=2, d=32, ff=48, experts=4, top_k=2, dtype="f16", seed=5)


@pytest.mark.parametrize("missing", [["model.layers.1.block_sparse_moe.experts.2.w3.weight"],
                                     ["model.layers.0.block_sparse_moe.gate.weight",
                                      "model.layers.1.block_sparse_moe.experts.0.w1.weight"]],
                         ids=["one", "two"])
def test_missing_tensors_are_named(tmp_path, missing):
    write_checkpoint(tmp_path, **BROKEN_KW)
    rewrite(tmp_path, lambda t: [t.pop(name) for name in missing])
    code, err = start_fails(tmp_path)
    assert code == 1, err
    for name in missing:
        assert name in err


def test_misshapen_tensor_names_it_and_the_shapes(tmp_path):
    write_checkpoint(tmp_path, **BROKEN_KW)
    name = "model.layers.0.block_sparse_moe.experts.1.w2.weight"

    def shrink(t):
        t[name] = t[name][:, :40].copy()

    rewrite(tmp_path, shrink)
    code, err = start_fails(tmp_path)
    assert code == 1, err
    assert name in err and "40" in err and "48" in err


def test_missing_shard_names_the_file(tmp_path):
    write_checkpoint(tmp_path, **{**BROKEN_KW, "shards": 2})
    shard = "model-00002-of-00002.safetensors"
    (tmp_path / shard).unlink()
    code, err = start_fails(tmp_path)
    assert code == 1, err
    assert shard in err


def test_missing_config_says_so(tmp_path):
    write_checkpoint(tmp_path, **BROKEN_KW)
    (tmp_path / "config.json").unlink()
    code, err = start_fails(tmp_path)
    assert code == 1, err
    assert "config.json" in err


def _forward_checked(c, w, rng, what):
    x, x64 = O.hidden(rng, 6, BROKEN_KW["d"], "f32")
    y = c.forward(0, x)
    spec = routing_spec(w, BROKEN_KW["experts"])
    O.check(y, O.forward(x64, w, O.gate(O.router_logits(x64, w), "model", spec), "swiglu"), "f32", what)
    return np.asarray(y)


@pytest.mark.parametrize("how", ["truncate", "rewrite-same-size"])
def test_checkpoint_changing_under_the_daemon(daemon, tmp_path, how):
    """The weights served are moed's own copy: the file changing after the start changes nothing."""
    layers = write_checkpoint(tmp_path, **{**BROKEN_KW, "dtype": "f32"})
    d = daemon("--model", tmp_path, "--threads", "1", "--backend", "cpu")
    file = tmp_path / "model.safetensors"
    with d.client(timeout=30) as c:
        before = _forward_checked(c, layers[0], np.random.default_rng(11), "before")
        if how == "truncate":
            os.truncate(file, 0)
        else:  # the same size, every byte after the header changed: a mapping would show it
            size = file.stat().st_size
            hlen = int.from_bytes(file.read_bytes()[:8], "little")
            with open(file, "r+b") as f:
                f.seek(8 + hlen)
                f.write(np.full((size - 8 - hlen) // 4, 7.0, np.float32).tobytes())
            assert file.stat().st_size == size
        for i in range(3):
            after = _forward_checked(c, layers[0], np.random.default_rng(11), f"after {how} {i}")
            assert np.array_equal(before, after)
        assert c.health() == "SERVING"
    assert d.proc.poll() is None


@pytest.mark.parametrize("name,shards", [("config.json", 1), ("model.safetensors", 1),
                                         ("model.safetensors.index.json", 2),
                                         ("model-00001-of-00002.safetensors", 2)])
def test_fifo_in_the_checkpoint_fails_at_once(tmp_path, name, shards):
    write_checkpoint(tmp_path, **{**BROKEN_KW, "shards": shards})
    (tmp_path / name).unlink()
    os.mkfifo(tmp_path / name)
    code, err = start_fails(tmp_path, timeout=60)  # an open that waited for a writer would hang
    assert code == 1, err
    assert f"{tmp_path / name} is a FIFO (named pipe), not a regular file" in err, err
