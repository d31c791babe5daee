"""Flags whose effect shows only in what the daemon does: --log-level keeps exactly the lines at or
above it, and --layers with a subset that is not contiguous serves each of its layers with that
layer's own weights and refuses the others.
"""

import re

import numpy as np
import pytest

import oracle as O
from conftest import DEFAULT_SPEC
from moed import MoEError

LEVELS = ("debug", "info", "warn", "error")


def levels_in(log):
    lines = [l for l in log.splitlines() if l.strip()]
    for l in lines:
        assert re.match(r"ts=\S+ level=(debug|info|warn|error) msg=\"", l), l
    return [re.match(r"ts=\S+ level=(\w+)", l).group(1) for l in lines]


@pytest.mark.parametrize("level", LEVELS)
def test_log_level_keeps_the_lines_at_or_above_it(daemon, level):
    """One line of each level is provoked: debug (a refused request), info (ready, stopped), warn
    (a NOTIFY_SOCKET that is no socket); nothing is at error. The log holds exactly those at or
    above --log-level."""
    d = daemon("--synthetic", DEFAULT_SPEC, "--threads", "1", "--log-level", level,
               env={"NOTIFY_SOCKET": "not-a-socket"})
    with d.client(timeout=10) as c:
        with pytest.raises(MoEError):
            c.forward(7, np.zeros((1, 64), np.float32), strategy="topk")  # no layer 7: debug
    assert d.stop() == 0
    log = d.log()
    seen = levels_in(log)
    wanted = set(LEVELS[LEVELS.index(level):]) & {"debug", "info", "warn"}
    assert set(seen) == wanted, (level, sorted(set(seen)), log)
    says = {"debug": 'msg="forward failed"', "info": 'msg="ready"', "warn": "NOTIFY_SOCKET is not"}
    for lv, words in says.items():
        assert (words in log) == (lv in wanted), (level, words, log)


# Six layers, of which 1, 3, 4 are served: slots 0, 1, 2 hold layers 1, 3, 4.
SUBSET = O.Spec(layers=6, d=64, ff=96, experts=8, topk=2, seed=61)


def test_non_contiguous_layers_forward_to_their_own_weights(daemon):
    d = daemon("--synthetic", str(SUBSET), "--layers", "4,1,3", "--threads", "1")
    rng = np.random.default_rng(62)
    x, x64 = O.hidden(rng, 5, SUBSET.d, "f32")
    ids = np.stack([rng.permutation(SUBSET.experts)[:2] for _ in range(5)]).astype(np.int32)
    w = rng.uniform(0.1, 1, (5, 2)).astype(np.float32)
    outs = {}
    with d.client(timeout=30) as c:
        assert [l.index for l in c.info().layers] == [1, 3, 4]
        for layer in (4, 1, 3):
            outs[layer] = c.forward(layer, x, expert_ids=ids, expert_weights=w)
            O.check(outs[layer], O.forward(x64, SUBSET.layer(layer), O.choice_route(ids, w),
                                           SUBSET.act), "f32", f"layer {layer}")
            y = c.forward(layer, x)  # the server router of that layer too
            route = O.gate(O.router_logits(x64, SUBSET.layer(layer)), "model", SUBSET)
            O.check(y, O.forward(x64, SUBSET.layer(layer), route, SUBSET.act), "f32",
                    f"layer {layer}, server router")
        for layer in (0, 2, 5):
            with pytest.raises(MoEError) as e:
                c.forward(layer, x, expert_ids=ids, expert_weights=w)
            assert e.value.code_name == "NOT_FOUND", e.value
            assert f"layer {layer} is not served" in e.value.message and "1,3-4" in e.value.message
    assert not np.allclose(outs[1], outs[3]) and not np.allclose(outs[3], outs[4])
