#!/usr/bin/env python3
"""What a prompt's CPU-tier expert costs the fused CPU kernel as more of the prompt's tokens pick it.

For ``c`` tokens per expert (``--tokens``), one call computes ``--per-call`` distinct experts of a
pool of ``--experts`` (larger than the caches at the default Qwen3-30B-A3B shape), each with all
``c`` tokens, as the engine's prompt split hands them to ``cpu_kernel.moe_decode`` /
``moe_decode_q8``. Per format and ``c`` it prints the fastest of ``--reps`` calls: milliseconds per
call, microseconds per (token, expert) pair, and the further tokens' cost in reads of the expert
(``(t_c - t_1) / (c - 1) / t_1``, what ``costmodel.prompt_pair_reads`` predicts from a calibrated
profile). ``--gemm`` adds torch's bf16 GEMMs per expert (the engine's path past
``costmodel.fused_prompt_limit``).

    python scripts/time_cpu_prompt.py --formats bf16,q8_0 --tokens 1,4,8,16,32 --gemm
    python scripts/time_cpu_prompt.py --experts 24 --reps 5 --json out.json   # a quick local look
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workbench.engine import cpu_kernel  # noqa: E402
from workbench.engine.calibrate import random_stacks, run_fused  # noqa: E402


def gemm(w: list[torch.Tensor], x: torch.Tensor, experts: np.ndarray, ffn: int) -> None:
    """torch's bf16 GEMMs, one expert at a time, every token on each."""
    for e in experts.tolist():
        h = F.linear(x, w[0][e])
        F.linear(F.silu(h[:, :ffn]) * h[:, ffn:], w[1][e])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="bf16,q8_0", help="of bf16, q8_0, q4_k")
    ap.add_argument("--tokens", default="1,2,4,8,16,32", help="tokens per expert, a list")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--per-call", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--gemm", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not cpu_kernel.available():
        print(f"fused CPU kernel unavailable: {cpu_kernel.unavailable_reason()}", file=sys.stderr)
        return 1
    counts = [int(c) for c in args.tokens.split(",")]
    rows_out = []
    for fmt in args.formats.split(","):
        w = random_stacks(fmt, args.experts, args.hidden, args.ffn)
        per_expert = sum(t[0].numel() * t.element_size() for t in w)
        one = None
        for c in counts:
            x = torch.randn(c, args.hidden).to(torch.bfloat16)
            best = {"fused": float("inf"), "gemm": float("inf")}
            for rep in range(args.reps):
                start = (rep * args.per_call) % max(1, args.experts - args.per_call)
                experts = np.arange(start, start + args.per_call)
                rows = np.repeat(experts, c)
                tokens = np.tile(np.arange(c), args.per_call)
                weights = np.ones(rows.size, dtype=np.float32)
                t0 = time.perf_counter()
                run_fused(fmt, w, x, rows, weights, tokens=tokens)
                best["fused"] = min(best["fused"], time.perf_counter() - t0)
                if args.gemm and fmt == "bf16":
                    t0 = time.perf_counter()
                    gemm(w, x, experts, args.ffn)
                    best["gemm"] = min(best["gemm"], time.perf_counter() - t0)
            t = best["fused"]
            one = t if c == 1 else one
            pair = (t - one) / (c - 1) / one if one and c > 1 else None
            row = {"format": fmt, "tokens": c, "ms": t * 1e3, "us_per_pair": t / args.per_call / c * 1e6,
                   "gbs": per_expert * args.per_call / t / 1e9, "pair_reads": pair,
                   "gemm_ms": best["gemm"] * 1e3 if best["gemm"] < float("inf") else None}
            rows_out.append(row)
            print(f"{fmt:5s} {c:3d} tokens/expert: {row['ms']:8.2f} ms, {row['us_per_pair']:7.1f} us per pair, "
                  f"{row['gbs']:6.1f} GB/s" + (f", further token {pair:.3f} reads" if pair is not None else "")
                  + (f"; torch GEMM {row['gemm_ms']:.2f} ms" if row["gemm_ms"] is not None else ""))
    if args.json:
        Path(args.json).write_text(json.dumps({"threads": torch.get_num_threads(), "rows": rows_out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
