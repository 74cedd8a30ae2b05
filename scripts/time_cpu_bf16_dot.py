#!/usr/bin/env python3
"""A/B of the fused CPU kernel's bf16 experts: GB/s of weights per call of ``k`` random experts of 128
at the S1 shape (hidden 2048, expert 768), best and median of 8 rounds of 20 calls, for k = 2 and 8.

    python3 scripts/time_cpu_bf16_dot.py 16                              # VDPBF16PS gate/up rows
    WORKBENCH_CPU_BF16_DOT=0 python3 scripts/time_cpu_bf16_dot.py 16     # the f32 path
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workbench.engine import cpu_kernel  # noqa: E402


def main(threads: int) -> None:
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    E, H, ffn = 128, 2048, 768
    w13 = (torch.randn(E, 2 * ffn, H, generator=g) * 0.02).bfloat16()
    w2 = (torch.randn(E, H, ffn, generator=g) * 0.02).bfloat16()
    x = torch.randn(H, generator=g).bfloat16()
    for k in (2, 8):
        times = []
        for _ in range(8):
            t0 = time.perf_counter()
            for _ in range(20):
                rows = torch.randperm(E, generator=g)[:k]
                cpu_kernel.moe_decode(x, w13, w2, rows, torch.full((k,), 1.0 / k))
            times.append((time.perf_counter() - t0) / 20)
        times.sort()
        nbytes = k * 3 * ffn * H * 2
        print(f"{threads} threads {k} experts {nbytes / times[0] / 1e9:.1f} GB/s best, "
              f"{nbytes / times[4] / 1e9:.1f} median", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else torch.get_num_threads())
