"""The Python half of `make demo` (client/demo.sh runs it): calls a running moed, prints what came
back and how far it is from moed.reference, the float64 numpy reference of the same layer.

    demo.py python TARGET DIR   the Python client: info, Forward with the server's router and with
                                client routing; writes DIR/x.npy, ids.npy, w.npy and ref.npy for
                                the C client's turn
    demo.py c DIR               compares the C client's output DIR/y_c.npy with DIR/ref.npy

Exit status 0 when every output is within the dtype's tolerance of the reference, 1 otherwise.
"""

import sys
import time

import ml_dtypes
import numpy as np

import moed
from moed import reference

TOKENS = 16
TOL_BF16 = 1e-2  # relative to the largest reference value: bf16 output rounding plus fp32 sums


def rel_err(y, ref):
    return float(np.abs(np.asarray(y, np.float64) - ref).max() / np.abs(ref).max())


def show(name, y, ref, ms=None, timings=None):
    err = rel_err(y.astype(np.float64), ref)
    print(f"  {name}: output {list(y.shape)} {y.dtype}, row 0 starts {np.round(y[0, :4].astype(np.float32), 4)}")
    line = f"    max |out - reference| / max |reference| = {err:.2e} (bf16 tolerance {TOL_BF16:g})"
    print(line + ("  ok" if err <= TOL_BF16 else "  TOO LARGE"))
    if ms is not None:
        t = timings
        print(f"    {ms:.2f} ms per call (client, median of 20); server: queue {t.queue_us} us, "
              f"compute {t.compute_us} us, total {t.total_us} us")
    return err <= TOL_BF16


def timed(c, *args, **kw):
    """The median wall time of 20 identical calls, and the last result."""
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        r = c.forward(*args, return_info=True, **kw)
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3, r


def python_turn(target, out_dir):
    ok = True
    with moed.MoEClient(target, timeout=60) as c:
        print(f"health: {c.health()}")
        info = c.info()
        layer = info.layers[0]
        print(f"model: {info.model}\nbackend: {info.backend}, version {info.version}, "
              f"{len(info.layers)} layers of d_model {layer.d_model}, d_ff {layer.d_ff}, "
              f"{layer.num_experts} experts, top-{layer.top_k}, {layer.activation}, {layer.weight_dtype} weights")
        weights = reference.synthetic_weights(info.model, layer.index)
        rng = np.random.default_rng(0)
        x = rng.standard_normal((TOKENS, layer.d_model)).astype(ml_dtypes.bfloat16)

        print(f"Python client, hidden [{TOKENS}, {layer.d_model}] bf16, layer {layer.index}:")
        ms, r = timed(c, layer.index, x)  # the server's router and the layer's own rule
        route = reference.gate(reference.router_logits(x, weights), info=weights.info, bias=weights.bias)
        ok &= show("server router (softmax top-k)", r.output, reference.forward(x, weights, route), ms, r.timings)

        logits = rng.standard_normal((TOKENS, layer.num_experts)).astype(np.float32)
        ms, r = timed(c, layer.index, x, router_logits=logits, strategy="sparsemax")
        route = reference.gate(logits, "sparsemax", info=weights.info)
        ok &= show("client logits, sparsemax", r.output, reference.forward(x, weights, route), ms, r.timings)

        ids = np.stack([rng.permutation(layer.num_experts)[:layer.top_k] for _ in range(TOKENS)]).astype(np.int32)
        w = rng.uniform(0.1, 1.0, (TOKENS, layer.top_k)).astype(np.float32)
        ms, r = timed(c, layer.index, x, expert_ids=ids, expert_weights=w)
        ref = reference.forward(x, weights, reference.route_from_choice(ids, w))
        ok &= show("client expert choice", r.output, ref, ms, r.timings)

    np.save(f"{out_dir}/x.npy", x)
    np.save(f"{out_dir}/ids.npy", ids)
    np.save(f"{out_dir}/w.npy", w)
    np.save(f"{out_dir}/ref.npy", ref)
    return ok


def c_turn(out_dir):
    y = np.load(f"{out_dir}/y_c.npy")  # moectl writes bf16 as its uint16 bits
    y = y.view(ml_dtypes.bfloat16) if y.dtype == np.uint16 else y
    return show("C client (moectl forward, client expert choice)", y, np.load(f"{out_dir}/ref.npy"))


def main(argv):
    if len(argv) == 3 and argv[0] == "python":
        return 0 if python_turn(argv[1], argv[2]) else 1
    if len(argv) == 2 and argv[0] == "c":
        return 0 if c_turn(argv[1]) else 1
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
