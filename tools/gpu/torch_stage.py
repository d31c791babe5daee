"""The command-line entry of the torch GPU tests in tests/gpu (run-on-gpu.sh runs them as scripts):
`python3 tests/gpu/TEST.py --bin FOLDER [pytest args]` names the daemon's folder, exits 77
(skipped) where torch, a GPU or the daemon is missing, and otherwise runs the file under pytest
and exits with its status."""

import argparse
import importlib.util
import os
import sys


def run_stage(path):
    name = os.path.splitext(os.path.basename(path))[0]
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True, help="the folder of moed")
    a, rest = ap.parse_known_args()
    os.environ["MOED_BIN"] = os.path.join(os.path.abspath(a.bin), "moed")
    if importlib.util.find_spec("torch") is None or not os.access(os.environ["MOED_BIN"], os.X_OK):
        print(f"{name}: skipped (needs torch and the daemon)")
        sys.exit(77)
    import torch

    if not torch.cuda.is_available():
        print(f"{name}: skipped (no GPU answered torch.cuda.is_available())")
        sys.exit(77)
    import pytest

    sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-rsx", os.path.abspath(path), *rest]))
