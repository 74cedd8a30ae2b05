#!/usr/bin/env python3
"""gpt-oss's CPU experts (biases, clamped SwiGLU) through the fused kernel against PyTorch's
per-expert ops (the engine's path for them before the kernel took biases), on this machine's CPU.

One token's ``-k`` experts of a pool of ``--experts`` at gpt-oss-20b's expert shape (2880 x 2880,
bf16, biases in float32), drawn at random per call; medians after a tenth of the calls, ms per call.

    python scripts/time_cpu_gpt_oss.py --threads 1,2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workbench.engine import cpu_kernel  # noqa: E402
from workbench.engine.experts import expert_ffn  # noqa: E402

ACT = ("clamped_swiglu", 1.702, 7.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--experts", type=int, default=24, help="pool size (24: 1.2 GB in bf16)")
    ap.add_argument("--hidden", type=int, default=2880)
    ap.add_argument("--ffn", type=int, default=2880)
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    e, h, i = a.experts, a.hidden, a.ffn
    w13 = (torch.randn(e, 2 * i, h, generator=g) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(e, h, i, generator=g) * 0.02).to(torch.bfloat16)
    b13, b2 = torch.randn(e, 2 * i, generator=g) * 0.1, torch.randn(e, h, generator=g) * 0.1
    b13h, b2h = b13.to(torch.bfloat16), b2.to(torch.bfloat16)
    x = torch.randn(h, generator=g).to(torch.bfloat16)
    rows_out = []
    for threads in (int(t) for t in a.threads.split(",")):
        torch.set_num_threads(threads)
        fused, ops = [], []
        for _ in range(a.calls):
            rows = torch.randperm(e, generator=g)[:a.k]
            w = torch.full((a.k,), 1.0 / a.k)
            t = time.perf_counter()
            cpu_kernel.moe_decode(x, w13, w2, rows, w, b13=b13, b2=b2, act=ACT)
            fused.append(time.perf_counter() - t)
            t = time.perf_counter()
            out = torch.zeros(1, h, dtype=torch.bfloat16)
            for r, wt in zip(rows.tolist(), w.tolist()):
                out += wt * expert_ffn(x[None], w13[r], w2[r], b13h[r], b2h[r], ACT)
            ops.append(time.perf_counter() - t)
        skip = a.calls // 10
        row = {"threads": threads, "fused_s": statistics.median(fused[skip:]), "torch_ops_s": statistics.median(ops[skip:]),
               "bytes_per_call": a.k * 3 * h * i * 2}
        rows_out.append(row)
        print(f"{threads} threads: fused {1e3 * row['fused_s']:.2f} ms, PyTorch ops {1e3 * row['torch_ops_s']:.2f} ms "
              f"({row['torch_ops_s'] / row['fused_s']:.2f}x)", flush=True)
    if a.json:
        a.json.write_text(json.dumps({"experts": e, "k": a.k, "hidden": h, "ffn": i, "calls": a.calls, "rows": rows_out},
                                     indent=1))


if __name__ == "__main__":
    main()
