"""Prints a table for one backend: the relative Frobenius error of moed's layer output
against transformers' own MoE block output, per checkpoint (hf_models/*) and way of routing.

    python tests/e2e/hf_models/table.py [--build-dir build] [--backend cpu|cuda|auto]

Rows "model in f32" compare with transformers running the checkpoint in float32 (a BF16 checkpoint
upcast) on float32 hidden states; rows "model in bf16" with transformers running a BF16 checkpoint
in bf16 on bf16 hidden states. The references are recomputed by transformers where torch and
transformers import, else read from the committed refs.safetensors (the first line says which).
"""

import argparse
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import conftest  # noqa: E402  (the e2e suite's Daemon)
from hf_models import hf_refs  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build-dir", type=pathlib.Path, default=HERE.parents[2] / "build")
    ap.add_argument("--moed", type=pathlib.Path, help="the daemon (default: BUILD_DIR/server/moed)")
    ap.add_argument("--backend", default="cpu", choices=("cpu", "cuda", "auto"))
    ap.add_argument("--logs", type=pathlib.Path, default=pathlib.Path("/tmp"))
    a = ap.parse_args()
    conftest.MOED_BIN = a.moed or a.build_dir / "server" / "moed"
    print(f"references: {'recomputed by transformers' if hf_refs.live() else 'committed refs.safetensors'}")
    print(f"\n| checkpoint | model in | {a.backend}: " + f" | {a.backend}: ".join(hf_refs.MODES) + " |")
    print("|---|---|" + "---|" * len(hf_refs.MODES))
    for name in hf_refs.CHECKPOINTS:
        refs = hf_refs.load(name)
        d = conftest.Daemon(["--model", str(hf_refs.HERE / name), "--backend", a.backend],
                            a.logs / f"moed-table-{name}.log")
        try:
            with d.client(timeout=60) as c:
                for kind in hf_refs.kinds(refs):
                    for layer in hf_refs.layers(refs, kind):
                        ref = refs[f"{kind}.{layer}.out"]
                        errs = [hf_refs.frobenius_error(hf_refs.forward(c, layer, refs, kind, m), ref)
                                for m in hf_refs.MODES]
                        print(f"| {name} | {kind} | " + " | ".join(f"{e:.1e}" for e in errs) + " |")
        finally:
            d.stop()


if __name__ == "__main__":
    main()
