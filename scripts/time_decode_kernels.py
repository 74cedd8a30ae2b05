#!/usr/bin/env python3
"""Time one decode step's GPU kernels at S1's shapes (Qwen3-30B-A3B), each form we have of them.

Every case runs ``--calls`` times in a row inside one CUDA graph, each call on its own weights
(another layer's matrices, another token's experts), so that the L2 cache holds none of what a call
reads, as in a decode step; the graph is replayed ``--reps`` times and the time per call is the
median replay over the calls. Cases (bf16 and Q8_0 experts):

- ``gate_up`` / ``down``: ``_gate_up_kernel`` / ``_down_split_kernel`` alone; ``experts``:
  ``experts_one_token`` as the engine calls it.
- ``qkv`` / ``o`` / ``router``: ``F.linear`` (cuBLAS) against ``packed._matvec_kernel`` (one pass
  over whole rows; the engine's path for a router, ``packed.float_matvec``) on bf16 rows.
- ``o_add_norm``: the attention's output projection (cuBLAS) then ``add_rms_norm``, against all
  three in one kernel (``out_norm.out_add_norm``, with ``WORKBENCH_OUT_NORM=1``).
- ``route``: the router's product (cuBLAS, or ``float_matvec``) then ``route_softmax_topk``, against
  both in one kernel (``router_route``, with ``WORKBENCH_FUSED_ROUTING=1``).

    python scripts/time_decode_kernels.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workbench.engine import gpu_kernels, out_norm, packed  # noqa: E402

H, FFN, E, K, Q, KV, HD = 2048, 768, 128, 8, 32, 4, 128


def per_call_us(fns: list, reps: int) -> float:
    """Median µs per call of ``fns`` (one call each, in order) captured as one CUDA graph."""
    for fn in fns[:2]:
        fn()  # autotuning and the kernels' checks, eagerly
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            for fn in fns:
                fn()
    torch.cuda.current_stream().wait_stream(s)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(fns))
    return statistics.median(times)


def q8(shape, dev):
    """Random GGUF-Q8_0-like stacks: int8 values and float16 scales, one per 32 along the last axis."""
    q = torch.randint(-127, 128, shape, dtype=torch.int8, device=dev)
    d = (torch.rand(*shape[:-1], shape[-1] // 32, device=dev) * 1e-3).half()
    return q, d


def expert_cases(fmt: str, calls: int, reps: int, dev) -> dict:
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(1, H, device=dev, dtype=torch.bfloat16, generator=g)
    if fmt == "bf16":
        w13 = torch.randn(E, 2 * FFN, H, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
        w2 = torch.randn(E, H, FFN, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
        d13 = d2 = None
        code = 0
        nbytes = K * 3 * H * FFN * 2
    else:
        (w13, d13), (w2, d2) = q8((E, 2 * FFN, H), dev), q8((E, H, FFN), dev)
        code = 1
        nbytes = K * 3 * H * FFN * (1 + 2 / 32)
    rowmap = torch.arange(E, device=dev)
    ids = [torch.randperm(E, device=dev)[:K] for _ in range(calls)]
    scale = torch.softmax(torch.randn(K, device=dev), 0).to(torch.bfloat16)
    hs = [torch.empty(K, 2 * FFN, device=dev, dtype=torch.float32) for _ in range(calls)]
    out = torch.empty(1, H, device=dev, dtype=torch.bfloat16)
    tri = gpu_kernels.triton

    def gate_up(j):
        gpu_kernels._gate_up_kernel[lambda m: (K, tri.cdiv(2 * FFN, m["BLOCK_N"]))](
            x, w13, d13 if d13 is not None else w13, ids[j], rowmap, scale, hs[j], hs[j], 2 * FFN, H, w13.stride(0),
            w13.stride(1), FFN * w13.stride(1), FMT=code, BIAS=False)

    part, cnt = gpu_kernels._down_workspace(w2, K, H, dev)

    def down_split(j):
        gpu_kernels._down_split_kernel[lambda m: (tri.cdiv(H, m["BLOCK_N"]), K)](
            hs[j], w2, d2 if d2 is not None else w2, ids[j], rowmap, scale, out, hs[j], part, cnt, H, FFN,
            w2.stride(0), w2.stride(1), K=K, FMT=code, BIAS=False, SWIGLU=True)

    def experts(j):
        gpu_kernels.experts_one_token(x, ids[j], scale, rowmap, w13, w2, d13, d2)

    for j in range(calls):
        gate_up(j)
    res = {}
    for name, fn, share in (("gate_up", gate_up, 2 / 3), ("down", down_split, 1 / 3), ("experts", experts, 1.0)):
        us = per_call_us([lambda j=j, fn=fn: fn(j) for j in range(calls)], reps)
        res[name] = {"us": us, "GB/s": nbytes * share / us / 1e3}
    return res


def dense_cases(calls: int, reps: int, dev) -> dict:
    res = {}
    x_in = {"qkv": H, "o": Q * HD, "router": H}
    n_out = {"qkv": (Q + 2 * KV) * HD, "o": H, "router": E}
    for name in ("qkv", "o", "router"):
        k, n = x_in[name], n_out[name]
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(calls)]
        outs = [torch.empty(1, n, device=dev, dtype=torch.bfloat16) for _ in range(calls)]
        nbytes = n * k * 2

        def mv(j, n=n, k=k, x=x, ws=ws, outs=outs):
            packed._matvec_kernel[lambda m: (gpu_kernels.triton.cdiv(n, m["BLOCK_N"]),)](
                x, ws[j], ws[j], outs[j], n, k, ws[j].stride(0), FMT=0)

        mv(0)
        torch.cuda.synchronize()
        err = (outs[0].float() - F.linear(x, ws[0]).float()).abs().max().item()
        r = {"matvec_max_abs_diff": err}
        for form, fn in (("cublas", lambda j, x=x, ws=ws: F.linear(x, ws[j])), ("matvec", mv)):
            us = per_call_us([lambda j=j, fn=fn: fn(j) for j in range(calls)], reps)
            r[form] = {"us": us, "GB/s": nbytes / us / 1e3}
        res[name] = r
    # routing: the router's product, then softmax and top-k
    x = torch.randn(1, H, device=dev, dtype=torch.bfloat16)
    rs = [torch.randn(E, H, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(calls)]
    counts = torch.zeros(E, dtype=torch.int64, device=dev)
    r = {}
    for form, product in (("cublas", lambda j: F.linear(x, rs[j])), ("matvec", lambda j: packed.float_matvec(x, rs[j]))):
        r[f"{form}_then_route_us"] = per_call_us(
            [lambda j=j, product=product: gpu_kernels.route_softmax_topk(product(j), K, True, 1.0, counts)
             for j in range(calls)], reps)
    for j in range(calls):  # each router's first call checks the candidates (eager, outside the graph)
        gpu_kernels.router_route(x, rs[j], K, True, 1.0, counts)
    r["fused_us"] = per_call_us([lambda j=j: gpu_kernels.router_route(x, rs[j], K, True, 1.0, counts)
                                 for j in range(calls)], reps)
    res["route"] = r
    # the attention's output projection, then the residual add and the MoE block's norm
    x = torch.randn(1, Q * HD, device=dev, dtype=torch.bfloat16)
    os_ = [torch.randn(H, Q * HD, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(calls)]
    resid = torch.randn(1, H, device=dev, dtype=torch.bfloat16)
    nw = torch.ones(H, device=dev, dtype=torch.bfloat16)
    r = {"cublas_then_add_norm_us": per_call_us(
        [lambda j=j: gpu_kernels.add_rms_norm(resid, F.linear(x, os_[j]), nw, 1e-6) for j in range(calls)], reps)}
    for j in range(calls):  # each matrix's first call checks the candidates (eager, outside the graph)
        out_norm.out_add_norm(x, os_[j], resid, nw, 1e-6)
    r["fused_us"] = per_call_us([lambda j=j: out_norm.out_add_norm(x, os_[j], resid, nw, 1e-6)
                                 for j in range(calls)], reps)
    res["o_add_norm"] = r
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not (torch.cuda.is_available() and gpu_kernels.available()):
        print("needs CUDA and Triton")
        return 2
    dev = torch.device("cuda")
    res = {"device": torch.cuda.get_device_name(0)}
    for fmt in ("bf16", "q8_0"):
        res[fmt] = expert_cases(fmt, args.calls, args.reps, dev)
    res["dense"] = dense_cases(args.calls, args.reps, dev)
    text = json.dumps(res, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
