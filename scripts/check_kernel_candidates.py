#!/usr/bin/env python3
"""Check every autotuning candidate of the one-token kernels on the GPU at hand, one at a time: the
kept-block matrix-vector kernel (``packed._matvec_kernel``) at S1's q/k/v, o and head shapes and the
experts' gate/up and down kernels at S1's expert shape and the grouped prompt kernel, for Q8_0 /
Q4_K / Q6_K blocks. For each
candidate: the largest error relative to PyTorch's decoding of the same blocks (``blocks.dequantize``,
float64 products) and µs per call replayed from a CUDA graph (no Python launch cost, as the engine's
decode runs). Then what the engine runs: the candidates checked (``kernel_check``) and the
autotuner's pick among those kept, its error on the first and the second call; and the Triton
dequantizing kernel against PyTorch's decoder.

    python scripts/check_kernel_candidates.py          # from the repository root, on the GPU machine
    python scripts/check_kernel_candidates.py --explore --formats q4_k,q8_0 --dense qkv,o --no-prompt

``--explore`` adds the forms in ``EXPLORE`` to each kernel's candidates (for choosing new ones:
smaller row blocks and other warp counts); ``--formats`` / ``--experts`` (the experts' formats,
default ``--formats``) / ``--dense`` / ``--no-prompt`` narrow the run.

A candidate whose error is above ``kernel_check.CHECK_TOL`` is marked WRONG; if what the engine runs
(checked, then autotuned) is off by that much, or a dequantizing kernel is, the script says so and
exits 1.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.engine.engine_helpers import random_kquant  # noqa: E402
from workbench.engine import blocks, gpu_kernels, kernel_check, packed  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU only for a smoke run under TRITON_INTERPRET=1
SMOKE = DEV == "cpu"
DENSE = {"qkv": (5120, 2048), "o": (2048, 4096), "head": (151936, 2048)} if not SMOKE else {"smoke": (48, 512)}
EXPERTS = (128, 2048, 768, 8) if not SMOKE else (4, 256, 256, 2)  # E, H, I, k
bad: list[str] = []
ARGS = sys.argv[1:]


def _opt(name: str, default: str | None) -> str | None:
    return ARGS[ARGS.index(name) + 1] if name in ARGS else default


FORMATS = (_opt("--formats", None) or "bf16,q4_k,q6_k,q8_0").split(",")
EXPERT_FORMATS = (_opt("--experts", None) or ",".join(FORMATS)).split(",")
if _opt("--dense", None):
    DENSE = {k: v for k, v in DENSE.items() if k in _opt("--dense", "").split(",")}
_T, _NT = {"TILE": True}, {"TILE": False}
EXPLORE = {  # (BLOCK_N, BLOCK_K, warps, constexprs) tried besides each kernel's own candidates
    "rows": [(2, 256, 4, _T), (4, 256, 4, _T), (2, 256, 2, _T), (8, 256, 2, _T), (8, 512, 4, _T),
             (16, 256, 8, _T), (4, 256, 4, _NT), (2, 256, 4, _NT)],
    "down": [(2, 256, 4, _T), (4, 256, 2, _T), (4, 256, 8, _T), (2, 256, 4, _NT), (32, 128, 4, _NT)],
}


def explore(kernel, which: str) -> None:
    """With ``--explore``: ``EXPLORE[which]``'s forms appended to ``kernel``'s candidates."""
    if "--explore" in ARGS:
        from triton import Config

        def form(c) -> tuple:
            return c.num_warps, tuple(sorted(c.kwargs.items()))

        have = {form(c) for c in kernel.configs}
        for o in EXPLORE[which]:
            c = Config({"BLOCK_N": o[0], "BLOCK_K": o[1], **o[3]}, num_warps=o[2])
            if form(c) not in have:
                kernel.configs.append(c)


def kept_parts(fmt: str, n: int, k: int, lead: tuple[int, ...] = ()) -> list[torch.Tensor]:
    """Random blocks of ``fmt`` for ``[*lead, n, k]`` (``"bf16"``: plain values), on DEV."""
    rows = n * (lead[0] if lead else 1)
    if fmt == "bf16":
        g = torch.Generator().manual_seed(n + k)
        return [(torch.randn(*lead, n, k, generator=g) / k ** 0.5).to(DEV, torch.bfloat16)]
    if fmt == "q8_0":
        g = torch.Generator().manual_seed(n + k)
        q = torch.randint(-127, 128, (rows, k), dtype=torch.int8, generator=g)
        d = (torch.rand(rows, k // 32, generator=g) * 1e-3 + 1e-4).to(torch.float16)
        parts = [q, d]
    else:
        parts = [random_kquant(fmt, rows, k, g)[0]]
    return [p.reshape(*lead, n, -1).to(DEV).contiguous() for p in parts]


def graph_us(fn, n: int = 20) -> float:
    """µs per call of ``fn()`` replayed from a CUDA graph of ``n`` calls (wall clock per call elsewhere)."""
    fn()
    if DEV != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(5):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / (5 * n)


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).abs().max() / ref.abs().max())


def cfg(c) -> str:
    return " ".join(f"{k}={v}" for k, v in c.kwargs.items()) + f" warps={c.num_warps}"


def each_candidate(kernel, run, ref, label: str, nbytes: int) -> None:
    """Run ``run()`` with each of ``kernel``'s candidates alone, then with all (the autotuner's pick)."""
    full = list(kernel.configs)
    check = kernel_check.needs_check
    kernel_check.needs_check = lambda kernels, key: False  # each candidate as it computes
    for c in full:
        kernel.configs, kernel.cache = [c], {}
        try:
            err = rel(run(), ref)
            us = graph_us(run)
        except Exception as exc:  # a candidate that does not build here: reported, the others go on
            print(f"{label} {cfg(c)}: FAILED {type(exc).__name__}: {str(exc)[:160]}", flush=True)
            continue
        flag = "" if err < kernel_check.CHECK_TOL else "  <-- WRONG (the engine's check drops it)"
        print(f"{label} {cfg(c)}: err {err:.1e}, {us:.1f} us, {nbytes / us / 1e3:.0f} GB/s{flag}", flush=True)
    kernel.configs, kernel.cache = full, {}
    kernel_check.needs_check = check  # as the engine runs: the candidates checked, then timed
    kernel_check._checked.clear()
    e1 = rel(run(), ref)
    e2 = rel(run(), ref)
    us = graph_us(run)
    kept, pick = len(kernel.configs), cfg(kernel.best_config) if getattr(kernel, "best_config", None) else "?"
    kernel.configs, kernel.cache = full, {}  # the next shape checks every candidate again
    print(f"{label} checked and autotuned: {kept} of {len(full)} kept, pick {pick}, err first call {e1:.1e}, "
          f"second {e2:.1e}, {us:.1f} us", flush=True)
    if max(e1, e2) >= kernel_check.CHECK_TOL:
        bad.append(f"{label} autotuned")


def dense() -> None:
    for name, (n, k) in DENSE.items():
        x = torch.randn(1, k, device=DEV, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16)
        print(f"{name} bf16 F.linear: {graph_us(lambda x=x, w=w: F.linear(x, w)):.1f} us", flush=True)
        del w
        for fmt in [f for f in ("q8_0", "q4_k", "q6_k") if f in FORMATS]:
            p = packed.Packed(fmt, kept_parts(fmt, n, k), k, torch.bfloat16)
            w64 = blocks.dequantize(fmt, p.parts, k, torch.float32).double()
            ref = x.double() @ w64.T
            tk = packed.dequantize_blocks(fmt, p.parts, k, torch.float32, kernel=True)
            derr = float((tk.double() - w64).abs().max() / w64.abs().max())
            print(f"{name} {fmt} Triton dequantizing kernel: err {derr:.1e}", flush=True)
            if derr >= 1e-6:
                bad.append(f"{name} {fmt} dequantizing kernel")
            del w64, tk
            each_candidate(packed._matvec_kernel, lambda x=x, p=p: packed.linear(x, p), ref, f"{name} {fmt} matvec",
                           p.nbytes)
            del p
            if DEV == "cuda":
                torch.cuda.empty_cache()


def experts() -> None:
    E, H, FFN, k = EXPERTS
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, H, generator=g).to(DEV, torch.bfloat16)
    ids = torch.randperm(E, generator=g)[:k].to(DEV)
    scale = (torch.rand(k, generator=g) + 0.1).to(DEV, torch.bfloat16)
    rowmap = torch.arange(E, device=DEV)
    pairs = (("q4_k", "q4_k"), ("q8_0", "q8_0"), ("q4_k", "q6_k"), ("bf16", "bf16"))
    for fmt, fmt2 in [p for p in pairs if p[0] in EXPERT_FORMATS and p[1] in EXPERT_FORMATS]:
        p13, p2 = kept_parts(fmt, 2 * FFN, H, (E,)), kept_parts(fmt2, H, FFN, (E,))
        f = tuple(None if v == "bf16" else v for v in (fmt, fmt2))
        ref = sum(s * gpu_kernels.expert_f32(x, e, f, p13[0], p2[0], p13[-1], p2[-1])
                  for e, s in zip(ids.tolist(), scale.float().tolist()))
        if fmt == "bf16":
            def run(p13=p13, p2=p2):
                return gpu_kernels.experts_one_token(x, ids, scale, rowmap, p13[0], p2[0])
        elif fmt == "q8_0":
            def run(p13=p13, p2=p2):
                return gpu_kernels.experts_one_token(x, ids, scale, rowmap, p13[0], p2[0], p13[1], p2[1])
        else:
            def run(p13=p13, p2=p2, fmt=fmt, fmt2=fmt2):
                return gpu_kernels.experts_one_token(x, ids, scale, rowmap, p13[0], p2[0], fmt=(fmt, fmt2))
        nbytes = k * (blocks.nbytes([t[0] for t in p13]) + blocks.nbytes([t[0] for t in p2]))
        for kern, part in ((gpu_kernels._gate_up_kernel, "gate/up"), (gpu_kernels._down_split_kernel, "down")):
            other = gpu_kernels._down_split_kernel if kern is gpu_kernels._gate_up_kernel else gpu_kernels._gate_up_kernel
            keep = list(other.configs)
            other.configs, other.cache = keep[:1], {}
            each_candidate(kern, run, ref, f"experts {fmt}+{fmt2} {part}", nbytes)
            other.configs, other.cache = keep, {}


def prompt() -> None:
    """The grouped prompt kernel (gate/up and down in two launches of one autotuned kernel) on 64 tokens
    of one expert."""
    import numpy as np

    from workbench.engine import prefill_kernels

    _, H, FFN, _ = EXPERTS
    n = 64 if not SMOKE else 8
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(n, H, generator=g).to(DEV, torch.bfloat16)
    tiles = prefill_kernels.tile_table(np.array([0]), np.array([n]), np.array([0]))
    for fmt, fmt2 in (("q4_k", "q4_k"), ("q8_0", "q8_0")):
        p13, p2 = kept_parts(fmt, 2 * FFN, H, (1,)), kept_parts(fmt2, H, FFN, (1,))
        ref = gpu_kernels.expert_f32(xs, 0, (fmt, fmt2), p13[0], p2[0], p13[-1], p2[-1])
        if fmt == "q8_0":
            def run(p13=p13, p2=p2):
                return prefill_kernels.swiglu_grouped(xs, tiles, p13[0], p2[0], p13[1], p2[1], fmt=("q8_0", "q8_0"))
        else:
            def run(p13=p13, p2=p2, fmt=fmt, fmt2=fmt2):
                return prefill_kernels.swiglu_grouped(xs, tiles, p13[0], p2[0], fmt=(fmt, fmt2))
        nbytes = blocks.nbytes([t[0] for t in p13]) + blocks.nbytes([t[0] for t in p2])
        each_candidate(prefill_kernels._grouped_kernel, run, ref, f"prompt {fmt}+{fmt2} {n} tokens", nbytes)


if __name__ == "__main__":
    torch.backends.cuda.matmul.allow_tf32 = False
    explore(gpu_kernels._gate_up_kernel, "rows")
    explore(gpu_kernels._down_split_kernel, "down")
    explore(packed._matvec_kernel, "rows")
    experts()
    if "--no-prompt" not in ARGS:
        prompt()
    dense()
    print("WRONG: " + "; ".join(bad) if bad else "what the engine runs is within CHECK_TOL everywhere", flush=True)
    sys.exit(1 if bad else 0)
