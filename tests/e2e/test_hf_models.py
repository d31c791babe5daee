"""Checkpoints written by transformers' own save_pretrained (tiny random Mixtral, Qwen3-MoE, OLMoE
and DeepSeek-V3 models, F32 and BF16: hf_models/make_hf_checkpoints.py), served by moed and
compared with the MoE block output transformers computes for them (hf_models/hf_refs.py: read from
the committed references, or recomputed live where torch and transformers import).

For every checkpoint and MoE layer, the three ways of routing (moed's server router, transformers'
router logits, transformers' expert ids and weights):
  * the model in float32: every token's output within 1e-5 of transformers' (relative), or within
    the compute type's error where the server multiplies in bf16 (MOED_TEST_COMPUTE=bf16, the CUDA
    backend); a token routed to one wrong expert is off by tenths;
  * BF16 checkpoints run in bf16 (hidden in bf16): within 3e-2 per token of transformers' bf16
    block, whose intermediates are rounded to bf16 (moed's are not);
  * in both, moed's own router chooses transformers' experts: its output equals the output for
    transformers' logits gated by moed (within 1e-5 per token), except for tokens transformers
    decided at a tie within one rounding step, which another backend may order either way.
"""

import numpy as np
import pytest

import oracle as O
from hf_models import hf_refs

RULES = {"deepseek_v3": "deepseek_v3"}


@pytest.fixture(scope="module", params=hf_refs.CHECKPOINTS)
def served(request, tmp_path_factory):
    """(name, references, daemon) for each committed checkpoint, one daemon each."""
    from conftest import Daemon

    name = request.param
    d = Daemon(["--model", str(hf_refs.HERE / name), "--threads", "1"],
               tmp_path_factory.mktemp("moed") / f"{name}.log")
    yield name, hf_refs.load(name), d
    assert d.stop() == 0, d.log()


def test_the_set_is_complete():
    archs = {n.rsplit("_", 1)[0] for n in hf_refs.CHECKPOINTS}
    assert archs == {"mixtral", "qwen3_moe", "olmoe", "deepseek_v3"}
    assert {n.rsplit("_", 1)[1] for n in hf_refs.CHECKPOINTS} == {"f32", "bf16"}


def test_checkpoint_matches_transformers(served):
    name, refs, d = served
    arch, wdtype = name.rsplit("_", 1)
    with d.client(timeout=60) as c:
        info = c.info()
        for kind in hf_refs.kinds(refs):
            for layer in hf_refs.layers(refs, kind):
                li = info.layer(layer)
                assert li.weight_dtype == wdtype and li.has_router
                assert li.router_rule == RULES.get(arch, "softmax_topk")
                ref = refs[f"{kind}.{layer}.out"]
                tok_bound, fro_bound = hf_refs.BOUNDS[kind, O.COMPUTE]
                out = {}
                for mode in hf_refs.MODES:
                    y = out[mode] = hf_refs.forward(c, layer, refs, kind, mode)
                    what = f"{name} layer {layer}, model in {kind}, {mode}"
                    te = hf_refs.token_errors(y, ref)
                    assert te.max() <= tok_bound, (
                        f"{what}: token {int(te.argmax())} is off by {te.max():.3g} relative "
                        f"(bound {tok_bound}); {int((te > tok_bound).sum())} tokens over")
                    fe = hf_refs.frobenius_error(y, ref)
                    assert fe <= fro_bound, f"{what}: relative Frobenius error {fe:.3g}"
                amb = hf_refs.ambiguous_tokens(name, refs, kind, layer)
                same = hf_refs.token_errors(out["server router"], out["client logits"])
                bad = np.flatnonzero((same > 1e-5) & ~amb)
                assert bad.size == 0, (
                    f"{name} layer {layer}, model in {kind}: moed's router chose other experts "
                    f"than transformers for tokens {bad.tolist()}")
