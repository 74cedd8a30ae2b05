"""Scratch A/B, as this call ran it (failed to compile the new form: BENCHMARKS.md, sixteenth stop): route_softmax_topk's kernel as it is against the rank-by-comparison form
it replaced (49ac3ee^), one token at E experts, k=8, 64 calls in one CUDA graph, median of 50 replays."""
import json, os, statistics, sys
import torch
import triton
import triton.language as tl
from workbench.engine import gpu_kernels


@triton.jit
def _old_kernel(logits_ptr, ids_ptr, w_ptr, counts_ptr, E, scaling, K: tl.constexpr, BLOCK_E: tl.constexpr,
                NORM: tl.constexpr):
    offs = tl.arange(0, BLOCK_E)
    valid = offs < E
    x = tl.load(logits_ptr + offs, mask=valid, other=-float("inf")).to(tl.float32)
    e = tl.where(valid, tl.exp(x - tl.max(x, axis=0)), 0.0)
    p = e / tl.sum(e, axis=0)
    work = tl.where(valid, p, -1.0)
    wo = work[None, :]
    ahead = (wo > work[:, None]) | ((wo == work[:, None]) & (offs[None, :] < offs[:, None]))
    rank = tl.sum(ahead.to(tl.int32), axis=1)
    pick = valid & (rank < K)
    top = tl.where(pick, p, 0.0)
    if NORM:
        top = top / tl.sum(top, axis=0)
    top = top * scaling
    tl.store(ids_ptr + rank, offs.to(tl.int64), mask=pick)
    tl.store(w_ptr + rank, top.to(w_ptr.dtype.element_ty), mask=pick)
    tl.atomic_add(counts_ptr + offs, tl.full((BLOCK_E,), 1, tl.int64), mask=pick)


def timed(fns, reps=50):
    for f in fns[:2]:
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize()
        out.append(a.elapsed_time(b) * 1e3 / len(fns))
    return statistics.median(out)


res = {}
dev = torch.device("cuda")
for E in (128, 8):
    k = 8
    logits = [torch.randn(1, E, device=dev).to(torch.bfloat16) for _ in range(64)]
    counts = torch.zeros(E, dtype=torch.int64, device=dev)
    ids = torch.empty(1, k, dtype=torch.int64, device=dev)
    w = torch.empty(1, k, dtype=torch.bfloat16, device=dev)
    for nw in (4, 1):
        res[f"old E={E} warps={nw}"] = timed([lambda l=l: _old_kernel[(1,)](l, ids, w, counts, E, 1.0, K=k, BLOCK_E=E,
                                              NORM=True, num_warps=nw) for l in logits])
    for nw in (1, 2, 4):
        res[f"new E={E} warps={nw}"] = timed([lambda l=l: gpu_kernels._route_kernel[(1,)](l, ids, w, counts, E, 1.0, K=k,
                                              BLOCK_E=E, NORM=True, num_warps=nw) for l in logits])
    # same picks, both forms
    for l in logits[:16]:
        i1 = torch.empty_like(ids); i2 = torch.empty_like(ids); w1 = torch.empty_like(w); w2 = torch.empty_like(w)
        c = torch.zeros_like(counts)
        _old_kernel[(1,)](l, i1, w1, c, E, 1.0, K=k, BLOCK_E=E, NORM=True)
        gpu_kernels._route_kernel[(1,)](l, i2, w2, c, E, 1.0, K=k, BLOCK_E=E, NORM=True, num_warps=1)
        assert torch.equal(i1, i2) and torch.equal(w1, w2), (E, i1, i2)
    res[f"E={E} same picks"] = True
for kname, v in res.items():
    print(f"route A/B {kname}: {v if isinstance(v, bool) else f'{v:.2f} us'}")
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "route_ab.json"), "w"), indent=1)
