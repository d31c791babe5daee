"""The 2:4 sparse reference moed's sparse path (moe-bench --weights sparse24) is measured against,
timed in the same run: PyTorch's semi-structured sparse matmul (torch.sparse.to_sparse_semi_structured,
on cuSPARSELt where torch has it, else its CUTLASS kernels) on the same per-expert GEMMs. The
routed pairs are sorted by expert and the token rows gathered outside the timed part; timed is, for
every expert with rows, F.linear(rows, W13_e) on the compressed W1|W3 (the sparse operand is the
weight, as in moed), SwiGLU, F.linear(h, W2_e) on the compressed W2, after one gather of the rows
and with no combine, so it is a floor for what a torch user gets from these kernels, launch overheads of the per-expert loop
included. bf16, weights pruned 2:4 at random positions, the shapes, T and routing rules of
torch_ref.py (whose harness this uses), into the JSON report.py reads.

usage: python3 torch_sparse_ref.py [--shapes mixtral,...] [--shape d,ff,E,k]... [--tokens 8,...]
                                   --json FILE
"""
import torch
import torch.nn.functional as F

from torch_ref import aligned, bench, uniform


def pruned(shape, scale, gen):
    """bf16 uniform weights with two of each four along K zeroed at random positions."""
    w = uniform(shape, scale, gen)
    keep = torch.rand(*shape[:-1], shape[-1] // 4, 4, device="cuda", generator=gen)
    mask = keep >= keep.kthvalue(3, dim=-1, keepdim=True).values  # the two largest of each four
    return (w.view(*shape[:-1], -1, 4) * mask).view(shape)


class SparseLayer:
    """Per expert, W1|W3 (2 ff, d) and W2 (d, ff) compressed for the Sparse Tensor Cores."""

    def __init__(self, d, ff, E, k, gen):
        from torch.sparse import SparseSemiStructuredTensor, to_sparse_semi_structured

        self.d, f8 = aligned(d), aligned(ff)
        self.w13 = [to_sparse_semi_structured(pruned((2 * f8, self.d), (6 / d) ** 0.5, gen))
                    for _ in range(E)]
        self.w2 = [to_sparse_semi_structured(pruned((self.d, f8), (6 / ff) ** 0.5, gen))
                   for _ in range(E)]
        self.E = E
        self.info = {"backend": "cutlass" if SparseSemiStructuredTensor._FORCE_CUTLASS
                     else "cusparselt"}

    def given(self, ids, wts):
        """The per-expert row blocks (expert, first row, rows) of the sorted pairs."""
        flat = ids.flatten()
        counts = torch.bincount(flat, minlength=self.E).tolist()
        order = torch.argsort(flat, stable=True)
        blocks, row = [], 0
        for e, n in enumerate(counts):
            if n:
                blocks.append((e, row, n))
                row += n
        return (order // ids.shape[1], blocks)

    def forward(self, x, tok, blocks):
        xs = x[tok]
        out = []
        for e, r0, n in blocks:
            h = F.linear(xs[r0:r0 + n], self.w13[e])
            g, u = h.chunk(2, dim=-1)
            out.append(F.linear(F.silu(g) * u, self.w2[e]))
        return out

if __name__ == "__main__":
    bench("torch-sp24", SparseLayer, {"impl": "torch semi-structured sparse (per-expert F.linear)"})
