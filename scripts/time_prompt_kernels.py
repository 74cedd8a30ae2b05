#!/usr/bin/env python3
"""Time the grouped prompt kernels (``prefill_kernels.swiglu_grouped``) on CUDA at the S1 expert
shape (hidden 2048, expert FFN 768): 8 experts x 64 tokens each, bf16 stacks against kept Q8_0 and
Q4_K blocks; prints ms per call and GB/s of expert weights read.

    python scripts/time_prompt_kernels.py            # from the repository root, on the GPU machine
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.engine.test_blocks import _random_kquant  # noqa: E402
from workbench.engine import prefill_kernels  # noqa: E402

EXPERTS, HIDDEN, FFN, TOKENS = 8, 2048, 768, 64


def timed(name: str, nbytes: float, xs: torch.Tensor, tiles: np.ndarray, *stacks, **kw) -> None:
    """Print the mean of 20 calls after 3 warm-ups (the first builds and autotunes the kernels)."""
    for _ in range(3):
        prefill_kernels.swiglu_grouped(xs, tiles, *stacks, **kw)
    torch.cuda.synchronize()
    n = 20
    t = time.perf_counter()
    for _ in range(n):
        prefill_kernels.swiglu_grouped(xs, tiles, *stacks, **kw)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t) / n
    print(f"{name}: {dt * 1e3:.3f} ms for {EXPERTS} experts x {TOKENS} tokens, {nbytes / dt / 1e9:.0f} GB/s of weights",
          flush=True)


def main() -> int:
    e, h, f = EXPERTS, HIDDEN, FFN
    counts = np.full(e, TOKENS)
    tiles = prefill_kernels.tile_table(np.cumsum(counts) - counts, counts, np.arange(e))
    xs = torch.randn(e * TOKENS, h, device="cuda", dtype=torch.bfloat16) * 1e-2
    w13 = torch.randn(e, 2 * f, h, device="cuda", dtype=torch.bfloat16)
    w2 = torch.randn(e, h, f, device="cuda", dtype=torch.bfloat16)
    timed("bf16", (w13.numel() + w2.numel()) * 2, xs, tiles, w13, w2)
    q13 = torch.randint(-127, 127, (e, 2 * f, h), dtype=torch.int8, device="cuda")
    q2 = torch.randint(-127, 127, (e, h, f), dtype=torch.int8, device="cuda")
    d13 = (torch.rand(e, 2 * f, h // 32, device="cuda") * 1e-3).half()
    d2 = (torch.rand(e, h, f // 32, device="cuda") * 1e-3).half()
    timed("q8_0", (q13.numel() + q2.numel()) * 34 / 32, xs, tiles, q13, q2, d13, d2, fmt=("q8_0", "q8_0"))
    k13 = torch.from_numpy(_random_kquant("q4_k", e * 2 * f, h)).reshape(e, 2 * f, -1).cuda()
    k2 = torch.from_numpy(_random_kquant("q4_k", e * h, f)).reshape(e, h, -1).cuda()
    timed("q4_k", k13.numel() + k2.numel(), xs, tiles, k13, k2, fmt=("q4_k", "q4_k"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
