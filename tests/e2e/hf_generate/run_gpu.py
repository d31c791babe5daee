"""The generation check on the GPU machine: transformers' Mixtral, Qwen3-MoE and DeepSeek-V3
(tests/e2e/hf_generate) on cuda, each sparse MoE block served by a moed on the CUDA backend, 32
greedy tokens compared with transformers' own on the GPU; then the decode step over a StaticCache
with moed's torch op in it, eager and captured in one CUDA graph (harness.generate_static), against
transformers' own static-cache decoding.

    python3 tests/e2e/hf_generate/run_gpu.py --moed .gpu/bin/moed --md $OUT/generate.md
    (tools/gpu/run-on-gpu.sh generate)

Rows per checkpoint and kind the model runs in (bf16, then f32):
    transformers      its own generate() on the GPU against the CPU's recorded tokens (information:
                      GPU kernels round otherwise)
    client            generate() with MoedCall(via="client"): the Python client, CUDA tensors
    transformers, CUDA graph
                      generate_static(graph=True) with transformers' own MoE blocks, against its
                      eager static decoding (information: the capture's own fidelity)
    op                generate_static() with MoedCall(via="op"), eager
    op, CUDA graph    generate_static(graph=True): the decode step captured once, replayed; held to
                      transformers' own graph where that one ran (token for token), else to eager
The op rows say "skipped: needs moed.torch_op" where torch.ops.moed is not there. A row that differs
names the first step that does and transformers' own lead there (replay.leads: bf16 in ulps): at a
lead under replay.MARGIN the token is the last rounding's choice, and such a row does not fail.
The CUDA backend multiplies in bf16 whatever the request's dtype, so the f32 rows are information.

Exits 0 when every bf16 row that compares is identical or differs first at a near-tie, 1 when one
is not, 77 (skipped) without torch, transformers, a GPU or the daemon.
"""

import argparse
import os
import pathlib
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]


def compare(got, own, own_logits, kind, cuda=False):
    """(ok, text) for tokens got against transformers' own (and its logits, for the lead)."""
    import replay

    got, own = list(got), list(own)
    if got == own:
        return True, "identical"
    step = next(i for i, (a, b) in enumerate(zip(got, own)) if a != b)
    lead = float(replay.leads(own_logits[step].numpy(), kind))
    unit = " ulps" if kind == "bf16" else ""
    # the CUDA backend (bf16 products) against transformers' own decoding: replay.COMPOUNDED_MARGIN
    tie = lead < (replay.COMPOUNDED_MARGIN if kind == "bf16" and cuda else replay.MARGIN[kind])
    return tie, (f"differs from step {step} ({got[step]} for {own[step]}; transformers' lead there "
                 f"{lead:.3g}{unit}{': a near-tie' if tie else ''})")


def timed(fn):
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t = time.perf_counter()
    out = fn()
    sync()
    return out, (time.perf_counter() - t) * 1e3


def run(arch, kind, daemon, rows, device):
    """Appends (arch, kind, what, ok, text, ms) rows; ok None where nothing is asserted."""
    import harness
    import replay
    import torch

    refs = replay.load(arch)
    prompt = refs["prompt"].tolist()
    model = harness.load(replay.HERE / arch, kind, device=device)
    asserted = kind == "bf16"

    def row(what, ok, text, ms=None):
        rows.append((arch, kind, what, ok if asserted else None, text, ms))

    (own, own_logits), ms = timed(lambda: harness.generate(model, prompt))
    same = own.tolist() == refs[f"{kind}.tokens"].tolist()
    row("transformers", None, "the CPU's tokens" if same else
        compare(own.tolist(), refs[f"{kind}.tokens"].tolist(), torch.from_numpy(refs[f"{kind}.logits"]),
                kind)[1].replace("transformers' lead", "the CPU's lead"), ms)
    with daemon.client(timeout=60) as c, harness.served(model, harness.MoedCall(c)):
        (got, _), ms = timed(lambda: harness.generate(model, prompt))
    row("client", *compare(got.tolist(), own.tolist(), own_logits, kind, device == "cuda"), ms)
    if harness.import_op() is None:
        for what in ("op", "op, CUDA graph"):
            rows.append((arch, kind, what, None, "skipped: needs moed.torch_op", None))
        return
    own_static, static_logits = harness.generate_static(model, prompt)
    # The capture itself, without moed: transformers' own MoE blocks in the same decode step captured
    # the same way. Where it runs, it is what the op's graph row is held to: a capture that drifts
    # from eager decoding (transformers 5.17 does, from the second replay, with or without moed)
    # must drift the same with moed's experts in it, token for token.
    own_graph = None
    if device == "cuda":
        try:
            (own_graph, _), ms = timed(lambda: harness.generate_static(model, prompt, graph=True))
            rows.append((arch, kind, "transformers, CUDA graph", None,
                         compare(own_graph.tolist(), own_static.tolist(), static_logits, kind,
                                 device == "cuda")[1]
                         .replace("transformers' lead", "eager decoding's lead"), ms))
        except Exception as e:
            rows.append((arch, kind, "transformers, CUDA graph", None,
                         f"raised {type(e).__name__}: {str(e).splitlines()[0][:120]}", None))
    with harness.op_client(daemon.address) as handle, harness.served(model, harness.MoedCall(handle, via="op")):
        for what, graph in (("op", False), ("op, CUDA graph", True)):
            if graph and device != "cuda":
                rows.append((arch, kind, what, None, "skipped: a CUDA graph needs cuda", None))
                continue
            try:
                (got, _), ms = timed(lambda: harness.generate_static(model, prompt, graph=graph))
            except Exception as e:  # a capture the op cannot join: the row says how
                row(what, False, f"raised {type(e).__name__}: {str(e).splitlines()[0][:160]}")
                continue
            if graph and own_graph is not None:
                same = got.tolist() == own_graph.tolist()
                row(what, same, "identical to transformers' own graph" if same else
                    compare(got.tolist(), own_graph.tolist(), static_logits, kind,
                            device == "cuda")[1] +
                    " (against transformers' own graph)", ms)
            else:
                row(what, *compare(got.tolist(), own_static.tolist(), static_logits, kind,
                                   device == "cuda"), ms)


def markdown(rows, device, backend):
    lines = [f"# Generation with moed in the loop ({device}, moed on the {backend} backend)", "",
             "32 greedy tokens; each row against transformers' own on the same device (generate(), or its "
             "static-cache decoding for the op rows); ms: the whole generation, once.", "",
             "| checkpoint | model in | MoE call | tokens | ms |", "|---|---|---|---|---|"]
    for arch, kind, what, ok, text, ms in rows:
        mark = "" if ok is None or ok else " **FAILED**"
        lines.append(f"| {arch} | {kind} | {what} | {text}{mark} | {'' if ms is None else f'{ms:.0f}'} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--moed", type=pathlib.Path, required=True, help="the daemon")
    ap.add_argument("--md", type=pathlib.Path, required=True, help="where the summary goes")
    ap.add_argument("--logs", type=pathlib.Path, default=pathlib.Path("/tmp"))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: the same run with the model and moed on the CPU, no graph (a dry run)")
    a = ap.parse_args()
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError as e:
        print(f"generate: skipped (needs torch and transformers: {e})")
        return 77
    if (a.device == "cuda" and not torch.cuda.is_available()) or not os.access(a.moed, os.X_OK):
        print("generate: skipped (needs a GPU and the daemon)")
        return 77
    import conftest
    import replay

    conftest.MOED_BIN = a.moed
    rows, backend = [], "?"
    for arch in replay.CHECKPOINTS:
        d = conftest.Daemon(["--model", str(replay.HERE / arch), "--backend", a.device],
                            a.logs / f"moed-generate-{arch}.log")
        try:
            with d.client(timeout=60) as c:
                backend = c.info().backend
            for kind in ("bf16", "f32"):
                run(arch, kind, d, rows, a.device)
        finally:
            d.stop()
    device = torch.cuda.get_device_name() if a.device == "cuda" else "the CPU"
    a.md.write_text(markdown(rows, device, backend))
    print(a.md.read_text())
    return 1 if any(r[3] is False for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
