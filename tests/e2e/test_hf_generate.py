"""transformers' own Mixtral, Qwen3-MoE and DeepSeek-V3 (tiny random checkpoints written by
save_pretrained, tests/e2e/hf_generate) generating 32 tokens greedily, with moed computing every
sparse MoE block's experts (DeepSeek-V3's shared expert too) from the block's own router choice.

Replayed (numpy, no torch: CI): every MoE call of transformers' recorded generation, for the model
in float32 and in bf16, sent to a moed serving the checkpoint:
  * each call's output within hf_refs.BOUNDS of the block's recorded output, per token (relative
    error of the row) and per call (relative Frobenius error): 1e-5 / 1e-6 for float32, whose only
    difference is the order of float32 sums; 3e-2 / 1.5e-2 where a side is bf16 (transformers
    rounds each intermediate to bf16, moed's CPU backend only the output; the CUDA backend
    multiplies in bf16), a few bf16 steps of 2^-8;
  * at every step, the last MoE layer's output taken the rest of the way (the recorded residual,
    the final RMSNorm, the LM head, in numpy as transformers computes them) leads to transformers'
    token. The references lead by replay.MARGIN at every step (checked here too), so a token moed
    changes is a logit it moved by a margin's worth, not a tie's rounding.
Live (torch and transformers importing, else skipped, only this): the whole generation with
moed in the loop (harness.served) gives transformers' own 32 tokens, through generate() and
through the static-cache decode step (harness.generate_static) that the GPU run captures in a
CUDA graph; the MoE call through the Python client, and through the torch op where moed.torch
registers it.
"""

import contextlib

import numpy as np
import pytest

import oracle as O
from hf_generate import replay
from hf_models import hf_refs

LIVE_REASON = "torch and transformers generate live (the GPU machine and make_generation.py's venv)"


@pytest.fixture(scope="module", params=replay.CHECKPOINTS)
def served(request, tmp_path_factory):
    """(arch, references, daemon) for each committed checkpoint, one daemon each."""
    from conftest import Daemon

    arch = request.param
    d = Daemon(["--model", str(replay.HERE / arch), "--threads", "1"],
               tmp_path_factory.mktemp("moed") / f"{arch}.log")
    yield arch, replay.load(arch), d
    assert d.stop() == 0, d.log()


def tokens_decidable_at(kind):
    """Whether a token check holds at the server's precision: bf16 compute moves a float32
    model's logits by about bf16's step, over the float32 margin."""
    return not (kind == "f32" and O.COMPUTE != "f32")


def test_the_set_is_complete():
    assert replay.CHECKPOINTS == ["deepseek_v3", "mixtral", "qwen3_moe"]


@pytest.mark.parametrize("arch", replay.CHECKPOINTS)
@pytest.mark.parametrize("kind", replay.KINDS)
def test_references_are_decidable(arch, kind):
    """The references hold 32 steps, two MoE layers or more, each step leading by the margin, and
    the numpy head reproduces transformers' logits and tokens from its own recorded outputs."""
    refs = replay.load(arch)
    layers = replay.layers(refs, kind)
    assert len(layers) >= 2 and refs[f"{kind}.tokens"].shape == (32,)
    rows = int(refs[f"{kind}.rows"].sum())
    assert all(refs[f"{kind}.{layer}.{w}"].shape[0] == rows for layer in layers
               for w in ("hidden", "out", "ids", "weights"))
    leads = replay.leads(refs[f"{kind}.logits"], kind)
    assert (leads >= replay.MARGIN[kind]).all(), f"steps {np.flatnonzero(leads < replay.MARGIN[kind])}"
    head = replay.Head(arch, kind)
    for step, r in replay.steps(refs, kind):
        logits = head(refs[f"{kind}.tail"][r], refs[f"{kind}.{layers[-1]}.out"][r].astype(np.float64))
        ref = refs[f"{kind}.logits"][step]
        # bf16: transformers' rounding reproduced (half a step of slack); float32: sums' order
        bound = np.abs(ref).max() * (2.0 ** -9 if kind == "bf16" else 1e-5)
        assert np.abs(logits - ref).max() <= bound, f"{arch} {kind} step {step}"
        assert int(np.argmax(logits)) == refs[f"{kind}.tokens"][step], f"{arch} {kind} step {step}"


@pytest.mark.parametrize("kind", replay.KINDS)
def test_replayed_calls_match_transformers(served, kind):
    arch, refs, d = served
    layers = replay.layers(refs, kind)
    head = replay.Head(arch, kind)
    tok_bound, fro_bound = hf_refs.BOUNDS[kind, O.COMPUTE]
    calls = 0
    with d.client(timeout=60) as c:
        for step, rows in replay.steps(refs, kind):
            for layer in layers:
                y = replay.forward(c, refs, kind, layer, rows)
                ref = refs[f"{kind}.{layer}.out"][rows]
                what = f"{arch}, model in {kind}, step {step}, layer {layer}"
                te = hf_refs.token_errors(y, ref)
                assert te.max() <= tok_bound, (f"{what}: token {int(te.argmax())} is off by "
                                               f"{te.max():.3g} relative (bound {tok_bound})")
                fe = hf_refs.frobenius_error(y, ref)
                assert fe <= fro_bound, f"{what}: relative Frobenius error {fe:.3g}"
                calls += 1
            if tokens_decidable_at(kind):
                logits = head(refs[f"{kind}.tail"][rows], y)
                want = int(refs[f"{kind}.tokens"][step])
                assert int(np.argmax(logits)) == want, (
                    f"{arch}, model in {kind}, step {step}: moed's last block output leads to token "
                    f"{int(np.argmax(logits))} (logit {logits.max():.4g}), transformers' was {want} "
                    f"(logit {logits[want]:.4g} with moed's output)")
    assert calls == 32 * len(layers)


@pytest.mark.parametrize("via", ("client", "op"))
@pytest.mark.parametrize("kind", replay.KINDS)
def test_generation_with_moed_in_the_loop(served, kind, via):
    pytest.importorskip("torch", reason=LIVE_REASON)
    pytest.importorskip("transformers", reason=LIVE_REASON)
    if not tokens_decidable_at(kind):
        pytest.skip(f"the server multiplies in {O.COMPUTE}: a float32 model's tokens are decided "
                    f"finer than that")
    from hf_generate import harness

    if via == "op" and harness.import_op() is None:
        pytest.skip("needs torch.ops.moed (moed.torch_op)")
    arch, refs, d = served
    prompt = refs["prompt"].tolist()
    model = harness.load(replay.HERE / arch, kind)
    own, own_logits = harness.generate(model, prompt)
    own_static, own_static_logits = harness.generate_static(model, prompt)
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(d.client(timeout=60) if via == "client" else
                                     harness.op_client(d.address))
        stack.enter_context(harness.served(model, harness.MoedCall(client, via=via)))
        moed, _ = harness.generate(model, prompt)
        moed_static, _ = harness.generate_static(model, prompt)
    recorded = refs[f"{kind}.tokens"].tolist()
    assert own.tolist() == recorded, (
        f"{arch} {kind}: this transformers generates {own.tolist()}, the references say {recorded}: "
        f"regenerate them (tests/e2e/hf_generate/make_generation.py)")
    same_tokens(arch, kind, "generate()", moed, own, own_logits)
    same_tokens(arch, kind, "static cache", moed_static, own_static, own_static_logits)


def same_tokens(arch, kind, how, got, want, want_logits):
    """got equals want; on a bf16-computing backend, up to a step where want's lead is under
    replay.COMPOUNDED_MARGIN (the tokens after it follow from it)."""
    got, want = got.tolist(), want.tolist()
    if got == want:
        return
    step = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    lead = float(replay.leads(want_logits[step].float().numpy(), kind))
    assert O.COMPUTE == "bf16" and lead < replay.COMPOUNDED_MARGIN, (
        f"{arch} {kind}, {how}: {got} with moed, {want} without: step {step} differs, where "
        f"transformers leads by {lead:.3g}{' ulps' if kind == 'bf16' else ''}")
