"""The peer moed's kernels are measured against beside torch._grouped_mm: SonicMoE (Dao-AILab's MoE
kernels in the CuTe DSL on QuACK's GEMMs; PyPI sonic-moe 0.1.2.post1), timed in the same run on the
GPU machine with torch_ref.py's harness: the same shapes, T, routing rules, timing and JSON.

What is timed: SonicMoE's forward of the expert layer with the routing given — the body of its
moe_TC_softmax_topk_layer after the router (no router GEMM, no top-k): the routing metadata
(TC_topk_router_metadata_triton on torch_ref's route() ids), the up projection with SwiGLU fused
into its epilogue (gathering token rows), the down projection, and the weighted sum over each
token's k experts. bf16, inference mode (the pre-activation not stored), under torch.no_grad().
QuACK autotunes each GEMM per problem (its default, as SonicMoE publishes its figures) where
T >= SONIC_TUNE_MIN_T (default 4096: the rows the targets compare); below, it runs QuACK's
default tile config (what tuned=False runs), since tuning every T of every shape would take most of
a device call (about 60 tile configs timed per GEMM and problem). Each row says which ("autotuned").
Its public entry for given routing, moe_general_routing_inputs, takes a variable number of experts
per token and sums them by another kernel; the fixed-k path here is the one its MoE module runs.

It fails soft: where SonicMoE cannot be imported (the wheels were not carried: tests/gpu/
peer-wheels.sh) or a shape fails, each row records its error and the run still exits 0.

usage: python3 sonic_ref.py [the options of torch_ref.py] --json FILE
"""
import os

import torch

from torch_ref import aligned, bench, uniform

try:
    import quack.gemm_interface as quack_gemm
    import sonicmoe
    from sonicmoe.enums import ActivationType
    from sonicmoe.functional import TC_topk_router_metadata_triton, _DownProjection, _UpProjection
    IMPORT_ERROR = None
    TUNERS = {n: getattr(quack_gemm, n) for n in ("gemm_tuned", "gemm_act_tuned")}
except Exception as e:  # reported in every row
    IMPORT_ERROR = f"sonic-moe not importable: {type(e).__name__}: {e}"[:300]
TUNE_MIN_T = int(os.environ.get("SONIC_TUNE_MIN_T", "4096"))


class Untuned:
    """QuACK's untuned path (its tuned=False: the default tile config) behind the name of its
    autotuner, which SonicMoE calls with no way to pass tuned."""

    def __init__(self, tuner):
        self.fn = tuner.fn

    def __call__(self, *args, **kwargs):
        return self.fn(*args, config=None, **kwargs)


def autotune(on):
    for name, tuner in TUNERS.items():
        setattr(quack_gemm, name, tuner if on else Untuned(tuner))


class SonicLayer:
    """SonicMoE's weight layout: W1|W3 interleaved (gate row, up row, ...) as (2 ff, d, E) and W2 as
    (d, ff, E), each with E outermost in memory (stride order 2, 0, 1), as its MoE module holds
    them (c_fc.weight (E, 2 ff, d) and c_proj.weight (E, d, ff), permuted (1, 2, 0))."""

    def __init__(self, d, ff, E, k, gen):
        if IMPORT_ERROR:
            raise RuntimeError(IMPORT_ERROR)
        d8, f8 = aligned(d), aligned(ff)
        self.d, self.E = d8, E
        self.w1 = uniform((E, 2 * f8, d8), (3 / d) ** 0.5, gen).permute(1, 2, 0)
        self.w2 = uniform((E, d8, f8), (3 / ff) ** 0.5, gen).permute(1, 2, 0)
        self.info = {"sonic_moe": sonicmoe.__version__, "inference_mode": True}

    def given(self, ids, wts):
        """Its router's index type, and the per-token expert offsets of its variable-k path, which
        the fixed-k path never reads (a tensor, not None, where its custom ops declare a Tensor)."""
        unused = torch.zeros(ids.shape[0] + 1, dtype=torch.int32, device=ids.device)
        return ids.to(torch.int32), wts, unused

    def forward(self, x, ids, wts, unused):
        self.info["autotuned"] = x.shape[0] >= TUNE_MIN_T
        autotune(self.info["autotuned"])
        with torch.no_grad():
            try:
                return self.layer(x, ids, wts, unused, self.info["inference_mode"])
            except Exception:
                if not self.info["inference_mode"]:
                    raise
            # Where its custom op will not take the absent pre-activation, store it (training's
            # path: one more write of pairs x 2 ff), and say so in the rows.
            self.info["inference_mode"] = False
            return self.layer(x, ids, wts, unused, False)

    def layer(self, x, ids, wts, unused, inference):
        T, k = ids.shape
        P, dev = T * k, x.device
        scatter, rscatter, gather = (torch.empty(P, dtype=torch.int32, device=dev) for _ in range(3))
        freq = torch.empty(self.E, dtype=torch.int32, device=dev)
        offs = torch.empty(self.E + 1, dtype=torch.int32, device=dev)
        TC_topk_router_metadata_triton(ids, self.E, freq, offs, gather, scatter, rscatter)
        a, h = _UpProjection.apply(x, self.w1, None, offs, P, k, gather, scatter, rscatter, unused, False,
                                   ActivationType.SWIGLU, inference, False)
        return _DownProjection.apply(a, h, self.w2, None, wts, offs, T, k, gather, scatter, rscatter,
                                     unused, False, ActivationType.SWIGLU)


if __name__ == "__main__":
    bench("sonic", SonicLayer, {"impl": "fixed-k forward, routing given", "autotune_min_T": TUNE_MIN_T,
                                "import_error": IMPORT_ERROR})
