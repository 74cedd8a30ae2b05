#!/usr/bin/env python3
"""Time the dense weights kept in GGUF blocks (``packed.Packed``) on CUDA at the S1 shapes (hidden
2048, q/k/v fused 5120 rows, head 151,936 x 2048): the one-token kernel and a 512-token prompt
product for Q8_0 and Q4_K against bf16 ``F.linear``; prints µs per call and GB/s of weights read.

    python scripts/time_dense_kernels.py            # from the repository root, on the GPU machine
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.engine.test_blocks import _random_kquant  # noqa: E402
from workbench.engine import packed  # noqa: E402

SHAPES = {"qkv": (5120, 2048), "head": (151936, 2048)}
FORMATS = ("q8_0", "q4_k")  # Q6_K decodes like Q4_K; each shape and format compiles every autotuning candidate
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU only for a smoke run under TRITON_INTERPRET=1


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def timed(fn, *args, n: int = 50) -> float:
    """Mean seconds of ``n`` calls ``fn(*args)`` after 3 warm-ups (the first builds and autotunes)."""
    for _ in range(3):
        fn(*args)
    sync()
    t = time.perf_counter()
    for _ in range(n):
        fn(*args)
    sync()
    return (time.perf_counter() - t) / n


def kept(fmt: str, n: int, k: int) -> packed.Packed:
    if fmt == "q8_0":
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        d = (torch.rand(n, k // 32) * 1e-3 + 1e-4).to(torch.float16)
        return packed.Packed(fmt, [q.to(DEV), d.to(DEV)], k, torch.bfloat16)
    return packed.Packed(fmt, [torch.from_numpy(_random_kquant(fmt, n, k)).to(DEV)], k, torch.bfloat16)


def main(shapes: dict[str, tuple[int, int]]) -> None:
    for name, (n, k) in shapes.items():
        x1 = torch.randn(1, k, device=DEV, dtype=torch.bfloat16)
        xp = torch.randn(512, k, device=DEV, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16)
        dt = timed(F.linear, x1, w)
        print(f"{name} bf16 one token: {dt * 1e6:.1f} us, {2 * n * k / dt / 1e9:.0f} GB/s", flush=True)
        dt = timed(F.linear, xp, w, n=10)
        print(f"{name} bf16 512 tokens: {dt * 1e6:.1f} us", flush=True)
        del w
        for fmt in FORMATS:
            p = kept(fmt, n, k)
            ref = F.linear(x1.float(), p.dequantize().float())
            err = float((packed.linear(x1, p).float() - ref).abs().max() / ref.abs().max())
            dt = timed(packed.linear, x1, p)
            print(f"{name} {fmt} one token: {dt * 1e6:.1f} us, {p.nbytes / dt / 1e9:.0f} GB/s (max rel err {err:.1e})",
                  flush=True)
            dt = timed(packed.linear, xp, p, n=10)
            print(f"{name} {fmt} 512 tokens: {dt * 1e6:.1f} us (dequantized copy + F.linear)", flush=True)
            del p
            if DEV == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main(SHAPES if DEV == "cuda" else {"smoke": (48, 512)})
