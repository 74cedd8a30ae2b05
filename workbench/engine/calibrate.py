"""Calibration: measure this machine in well under 30 s and return a HardwareProfile.

Measures host RAM read bandwidth, CPU expert throughput for every CPU weight format the engine
supports at the model's expert shape (batch 1, the engine's thread count), the CPU bf16 GEMM rate
(prefill), and with CUDA: pinned and pageable host<->GPU copies, GPU memory bandwidth, bf16 matmul
rate, batch-1 expert throughput, kernel launch cost and the per-layer host sync. Without CUDA the
GPU fields come from a chosen preset, or stay absent (NaN, ``provenance`` says which).

Every step runs against its share of the time budget, reports ``progress(fraction, message)``
and checks ``cancel`` between repetitions.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.nn.functional as F

from workbench.core.errors import WorkbenchError
from workbench.core.hardware import GpuProfile, HardwareProfile
from workbench.core.hardware import preset as load_preset
from workbench.engine import cpu_formats, cpu_kernel, hostmem
from workbench.engine.blocks import KQUANT_HALVES, KQUANTS, RAW, row_bytes
from workbench.telemetry.host import cpu_info
from workbench.telemetry.nvml import default_nvml

log = logging.getLogger(__name__)

ProgressFn = Callable[[float, str], None]
MAX_BUDGET_S = 28.0


class CalibrationCancelled(WorkbenchError):
    """The user stopped the calibration."""


class _Run:
    """Time budget, progress and cancel for one calibration."""

    def __init__(
        self, budget_s: float, progress: ProgressFn | None, cancel: Any, steps: list[tuple[str, float]]
    ):
        self.t0 = time.perf_counter()
        self.budget_s = budget_s
        self.progress = progress
        self.cancel = cancel
        total = sum(w for _, w in steps)
        self.share = {name: budget_s * w / total for name, w in steps}
        self.done_weight = 0.0
        self.weights = {name: w / total for name, w in steps}
        self.ram_reads: list[float] = []
        """Bytes/s the fused CPU kernels read from pools many times the last-level caches: the RAM
        gives at least that much (``calibrate`` raises the host read figure to their best)."""

    def cancelled(self) -> bool:
        c = self.cancel
        if c is None:
            return False
        if isinstance(c, threading.Event):
            return c.is_set()
        return bool(c())

    def check(self) -> None:
        if self.cancelled():
            raise CalibrationCancelled("calibration cancelled")

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)

    def report(self, message: str) -> None:
        log.info("calibrate: %s", message)
        if self.progress is not None:
            self.progress(min(1.0, self.done_weight), message)

    def finish(self, step: str, message: str) -> None:
        self.done_weight += self.weights.get(step, 0.0)
        self.report(message)


def _repeat(
    run: _Run, fn: Callable[[], Any], seconds: float, min_reps: int = 3, max_reps: int = 10_000,
    best: bool = False,
) -> float:
    """Call ``fn`` until ``seconds`` pass and it ran ``min_reps`` times, but never past twice
    ``seconds`` (a slow or busy machine gets fewer repetitions, not a blown budget); median seconds
    per call (``best``: the fastest call's). When ``fn`` returns a float it is taken as that call's
    own time (CUDA events)."""
    times: list[float] = []
    start = time.perf_counter()
    hard_stop = start + max(2 * seconds, 0.02)
    while len(times) < max_reps:
        run.check()
        t = time.perf_counter()
        own = fn()
        now = time.perf_counter()
        times.append(own if isinstance(own, float) else now - t)
        if (now - start >= seconds and len(times) >= min_reps) or now >= hard_stop:
            break
    return min(times) if best else statistics.median(times)


# -- CPU weight formats --------------------------------------------------------------------------


@dataclass(frozen=True)
class CalibrationFormat:
    """How calibration packs a bf16 weight ``[N, K]`` into one CPU format (``pack(w)`` returns a
    callable ``[T, K] -> [T, N]`` with ``.nbytes`` and ``.act_dtype``) and which shapes it takes."""

    name: str
    pack: Callable[[torch.Tensor], Any]
    supports: Callable[[int, int], bool]


def format_table() -> dict[str, CalibrationFormat]:
    """The CPU weight formats to measure: exactly the engine's (``cpu_formats.available_formats()``),
    so a format added there is calibrated with no change here."""
    return {
        name: CalibrationFormat(
            name, lambda w, f=name: cpu_formats.pack(w, f), lambda n, k, f=name: cpu_formats.supports(f, n, k)
        )
        for name in cpu_formats.available_formats()
    }


# -- CPU ---------------------------------------------------------------------------------------


def l3_bytes() -> int:
    """Bytes of L3 cache on this machine, every instance counted once (Linux ``/sys``; 0 elsewhere or
    when the kernel does not say)."""
    sizes: dict[str, int] = {}
    for d in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/cache/index3"):
        try:
            shared = (d / "shared_cpu_list").read_text().strip()
            raw = (d / "size").read_text().strip().upper()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(raw[-1:], 1)
        try:
            sizes[shared] = int(raw.rstrip("KMG")) * mult
        except ValueError:
            continue
    return sum(sizes.values())


RAM_FILL_RATE = 1e9
"""Bytes/s at which the host-read step may assume it fills its buffer at the least (first touch on a
virtual machine: ~0.8 GB/s seen on a 2-core one): a short calibration's buffer holds what its time
share fills at this rate."""
FILL_SLICE = 1 << 26
"""Bytes of the host-read buffer filled between two checks for a cancel."""


def _ram_buffer(nbytes: int, seconds: float = math.inf, check: Callable[[], None] | None = None) -> torch.Tensor:
    """A float32 buffer of ``nbytes``, but at least eight times the last-level caches (within an
    eighth of the free memory, and of what ``seconds`` fill at ``RAM_FILL_RATE``: a 480 MiB L3 asks
    for 3.8 GB, 6 s of a 1.5 s calibration on a 2-core host): summed, it reads the RAM, not the
    caches. ``check()`` runs between slices of the fill (a cancel raises there)."""
    nbytes = int(min(max(nbytes, min(8 * l3_bytes(), seconds * RAM_FILL_RATE)), psutil.virtual_memory().available // 8))
    buf = torch.empty(max(1, nbytes // 4), dtype=torch.float32)
    step = FILL_SLICE // 4
    for start in range(0, buf.numel(), step):
        if check is not None:
            check()
        buf[start:start + step].fill_(1.0)
    return buf


def _host_read(run: _Run, nbytes: int) -> float:
    """Bytes/s a multi-threaded sum reads from a buffer much larger than the caches: ``nbytes``, but
    at least eight times the last-level caches (within an eighth of the free memory). A server's L3
    holds hundreds of MB and keeps part of a smaller buffer between passes: 512 MiB read at 123 GB/s
    on the H200 machine (300 MiB of L3), whose RAM gives 88."""
    buf = _ram_buffer(nbytes, run.share["host"], run.check)
    # the fastest pass: what the RAM can give; slower passes met other readers (the median moved
    # 117 -> 93 GB/s between calls on the H200 machine while the engine's speed did not)
    t = _repeat(run, lambda: buf.sum(), run.share["host"], best=True)
    return buf.numel() * 4 / t


def host_read_now(passes: int = 4) -> float:
    """Bytes/s the host's RAM reads now: the fastest of ``passes`` multi-threaded sums over a
    buffer of eight times the last-level caches (within an eighth of the free memory), as the
    calibration's host read takes it; ~0.2 s on the H200 machine. For re-scaling a calibration
    to the host's speed at the moment of a run (``HardwareProfile.at_host_read``)."""
    buf = _ram_buffer(1 << 29)
    buf.sum()  # first touch
    best = math.inf
    for _ in range(max(1, passes)):
        t = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t)
    return buf.numel() * 4 / best


def _expert_weights(hidden: int, ffn: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w1 = (torch.randn(2 * ffn, hidden, generator=g) * 0.02).to(torch.bfloat16)  # gate_up [2I, H]
    w2 = (torch.randn(hidden, ffn, generator=g) * 0.02).to(torch.bfloat16)  # down [H, I]
    return w1, w2


def _cpu_expert(run: _Run, step: str, pack: Callable, hidden: int, ffn: int, weight_bytes: int):
    """Pack experts of shape (hidden, ffn) up to ``weight_bytes`` and time batch-1 passes over all of
    them. Returns (bytes/s of packed weights, seconds per expert, the packed experts).

    The expert count is also capped so that a pass fits the step's time share: on a slow machine
    fewer experts (possibly cache-resident, flattering the figure) rather than a blown budget.
    """
    t_step = time.perf_counter()
    share = run.share[step]
    w1, w2 = _expert_weights(hidden, ffn)
    first = (pack(w1), pack(w2))
    x = torch.randn(1, hidden).to(first[0].act_dtype)

    def forward(p1, p2) -> None:
        h = p1(x)  # [1, 2I]
        p2(F.silu(h[:, :ffn]) * h[:, ffn:])  # [1, H]

    forward(*first)  # warm up: first-touch, kernel selection
    t1 = _repeat(run, lambda: forward(*first), 0.02 * share)
    per_expert = first[0].nbytes + first[1].nbytes
    want = max(1, min(256, weight_bytes // max(1, per_expert), int(0.1 * share / max(t1, 1e-7))))
    experts = [first]
    setup_until = t_step + 0.4 * share
    while len(experts) < want and time.perf_counter() < setup_until:
        run.check()
        experts.append((pack(w1), pack(w2)))
    if len(experts) < weight_bytes // max(1, per_expert):
        log.info(
            "calibrate %s: timed %d experts (%s); caches may flatter the figure", step, len(experts), "budget"
        )

    def one_pass() -> None:
        for p1, p2 in experts:
            forward(p1, p2)

    one_pass()
    t = _repeat(run, one_pass, max(0.0, share - (time.perf_counter() - t_step)))
    return per_expert * len(experts) / t, t / len(experts), experts


def _pool_experts(per_expert: int, top_k: int, weight_bytes: int) -> int:
    """Experts in a timing pool of at least 2 GiB (if RAM allows; server CPUs have L3 caches of
    hundreds of MiB, which flatter a smaller pool)."""
    pool = int(min(max(weight_bytes, 2 << 30), psutil.virtual_memory().available // 8))
    return max(top_k, min(512, pool // per_expert))


PROMPT_TOKENS = 16
"""Tokens per expert in the calibration's prompt pass over the fused kernels (``cpu_prompt_flops``)."""


def _time_fused(run: _Run, step: str, n: int, top_k: int, per_expert: int, call: _FusedCall,
                served: Callable | None = None) -> tuple[float, float]:
    """``(bytes/s, prompt FLOP/s)`` of a fused kernel over a pool of ``n`` experts of ``per_expert``
    bytes: ``call(x, rows, weights, tokens)`` with ``top_k`` distinct experts per call as in a decode
    step, each pass reading the whole pool; then the same with ``PROMPT_TOKENS`` tokens per expert
    as in a prompt, whose time beyond the decode pass's is the further tokens' FLOP/s
    (``HardwareProfile.cpu_prompt_flops``; 2 FLOP per weight and token). ``served(x, rows,
    weights)``: where the engine's decode runs the same experts (``served.StackServer``), the
    decode rate is that pass's (the prompt's still counts from ``call``'s own decode pass)."""
    k = min(top_k, n)
    weights = torch.full((k,), 1.0 / k)
    starts = list(range(0, n - k + 1, k)) or [0]

    def one_pass() -> None:
        for s in starts:
            call(None, torch.arange(s, s + k), weights, None)

    one_pass()
    t = _repeat(run, one_pass, 0.2 * run.share[step])
    rate = per_expert * k * len(starts) / t
    if served is not None:
        def served_pass() -> None:
            for s in starts:
                served(call.x[0], range(s, s + k), weights)

        served_pass()
        rate = per_expert * k * len(starts) / _repeat(run, served_pass, 0.2 * run.share[step])
    if n * per_expert >= 8 * l3_bytes():  # read from RAM, not from the caches
        run.ram_reads.append(rate)

    c = PROMPT_TOKENS
    tokens = torch.arange(c).repeat(k)
    prompt_weights = weights.repeat_interleave(c)

    def prompt_pass() -> None:
        for s in starts:
            call(c, torch.arange(s, s + k).repeat_interleave(c), prompt_weights, tokens)

    prompt_pass()
    tp = _repeat(run, prompt_pass, 0.2 * run.share[step])
    flops = 2.0 * call.params * k * len(starts) * (c - 1) / max(tp - t, 1e-9)
    return rate, min(flops, 1e15)


def random_stacks(fmt: str, n: int, hidden: int, ffn: int, seed: int = 0) -> list[torch.Tensor]:
    """``n`` random experts stacked as the fused CPU kernels take them, for timing: ``"bf16"``
    ``[w13, w2]``, ``"q8_0"`` ``[q13, d13, q2, d2]`` (int8 values, float16 scales of 1e-3) or
    a k-quant (``"q2_k"`` ... ``"q6_k"``) ``[b13, b2]`` (raw super-blocks whose d and dmin are about 1e-3,
    so every value is finite), or ``"mxfp4"`` ``[b13, b2]`` (blocks whose scales are 2^-9). In host
    memory as the engine's CPU tier holds it (``hostmem.empty``: huge pages where the OS gives them),
    filled in place expert by expert, so no second copy of the stacks is ever held."""
    g = torch.Generator().manual_seed(seed)
    if fmt == "bf16":
        stacks = [hostmem.empty((n, 2 * ffn, hidden), torch.bfloat16), hostmem.empty((n, hidden, ffn), torch.bfloat16)]
        for s in stacks:
            for e in range(n):
                s[e].copy_(torch.randn(tuple(s.shape[1:]), generator=g) * 0.02)
        return stacks
    if fmt == "q8_0":
        stacks = [hostmem.empty((n, 2 * ffn, hidden), torch.int8), hostmem.empty((n, 2 * ffn, hidden // 32), torch.float16),
                  hostmem.empty((n, hidden, ffn), torch.int8), hostmem.empty((n, hidden, ffn // 32), torch.float16)]
        for q, d in (stacks[:2], stacks[2:]):
            torch.randint(-127, 128, tuple(q.shape), dtype=torch.int8, generator=g, out=q)
            d.fill_(1e-3)
        return stacks
    b13 = hostmem.empty((n, 2 * ffn, row_bytes(fmt, hidden)), torch.uint8)
    b2 = hostmem.empty((n, hidden, row_bytes(fmt, ffn)), torch.uint8)
    for b in (b13, b2):
        torch.randint(0, 256, tuple(b.shape), dtype=torch.uint8, generator=g, out=b)
    if fmt == "mxfp4":
        for b in (b13, b2):
            b.view(n, b.shape[1], -1, 17)[..., 0] = 128 - 9
        return [b13, b2]
    size = KQUANTS[fmt]
    for b in (b13, b2):  # small finite float16 d and dmin (0x1400: about 1e-3)
        for at in KQUANT_HALVES[fmt]:
            b.view(n, b.shape[1], -1, size)[..., at:at + 2] = torch.tensor([0x00, 0x14], dtype=torch.uint8)
    return [b13, b2]


def run_fused(fmt: str, stacks: list[torch.Tensor], x: torch.Tensor, rows, weights, **kw) -> torch.Tensor:
    """The fused CPU kernel of ``fmt`` (``random_stacks``' formats) over ``stacks``: ``cpu_kernel.moe_decode``,
    ``moe_decode_q8`` or ``moe_decode_q4k`` with ``x``, ``rows``, ``weights`` and ``kw`` (``tokens``...)."""
    if fmt == "q8_0":
        return cpu_kernel.moe_decode_q8(x, *stacks, rows, weights, **kw)
    if fmt in RAW:
        return cpu_kernel.moe_decode_q4k(x, *stacks, rows, weights, fmt, fmt, **kw)
    return cpu_kernel.moe_decode(x, *stacks, rows, weights, **kw)


class _FusedCall:
    """``call(x_tokens, rows, weights, tokens)`` for ``_time_fused``: ``kernel(x, rows, weights,
    tokens=...)`` with ``x`` one token (``x_tokens`` None) or ``x_tokens`` tokens of ``hidden`` values."""

    def __init__(self, kernel, hidden: int, ffn: int, dtype: torch.dtype, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.kernel, self.params = kernel, 3 * hidden * ffn
        self.x = torch.randn(PROMPT_TOKENS, hidden, generator=g).to(dtype)

    def __call__(self, x_tokens, rows, weights, tokens):
        if x_tokens is None:
            return self.kernel(self.x[0], rows, weights)
        return self.kernel(self.x[:x_tokens], rows, weights, tokens=tokens)


def _timed_on_stacks(run: _Run, step: str, fmt: str, stacks: list[torch.Tensor], n: int, hidden: int, ffn: int,
                     top_k: int, per_expert: int, call: _FusedCall, served: bool) -> tuple[float, float]:
    """``_time_fused`` over ``stacks`` (``fmt``, ``n`` experts), its decode rate through the decode
    server's team (``served.StackServer``) when ``served``."""
    if served:
        from .served import StackServer

        try:
            with StackServer(fmt, stacks, hidden, ffn, min(top_k, n)) as srv:
                return _time_fused(run, step, n, top_k, per_expert, call, srv)
        except RuntimeError as exc:  # the server failed or hung here: the pool's timing still stands
            log.warning("calibrate %s: the decode server's team gave no timing (%s); timing on torch's pool", fmt, exc)
    return _time_fused(run, step, n, top_k, per_expert, call)


def _cpu_fused(run: _Run, step: str, experts: list, hidden: int, ffn: int, top_k: int,
               weight_bytes: int, served: bool = False) -> tuple[float, float]:
    """``_time_fused`` of the fused decode kernel (``cpu_kernel.moe_decode``) over a ``_pool_experts``
    pool stacked as ``[E, 2I, H]`` / ``[E, H, I]`` (copies of the first packed expert)."""
    p1, p2 = experts[0]  # bf16/f32 formats keep the plain weight in ``data``
    n = _pool_experts(p1.nbytes + p2.nbytes, top_k, weight_bytes)
    w13 = p1.data.expand(n, *p1.data.shape).clone()
    w2 = p2.data.expand(n, *p2.data.shape).clone()
    per_expert = (w13[0].numel() + w2[0].numel()) * w13.element_size()  # gate, up and down
    call = _FusedCall(lambda x, r, w, **kw: cpu_kernel.moe_decode(x, w13, w2, r, w, **kw), hidden, ffn, w13.dtype)
    fmt = "f32" if w13.dtype == torch.float32 else "bf16"
    return _timed_on_stacks(run, step, fmt, [w13, w2], n, hidden, ffn, top_k, per_expert, call, served)


def _cpu_fused_q8(run: _Run, step: str, hidden: int, ffn: int, top_k: int, weight_bytes: int,
                  served: bool = False) -> tuple[float, float]:
    """``_time_fused`` of the fused Q8_0 kernel (``cpu_kernel.moe_decode_q8``) over a ``_pool_experts``
    pool of Q8_0 blocks (int8 values and float16 scales)."""
    per_expert = 3 * hidden * ffn * 34 // 32
    n = _pool_experts(per_expert, top_k, weight_bytes)
    w = random_stacks("q8_0", n, hidden, ffn)
    call = _FusedCall(lambda x, r, wt, **kw: run_fused("q8_0", w, x, r, wt, **kw), hidden, ffn, torch.bfloat16)
    return _timed_on_stacks(run, step, "q8_0", w, n, hidden, ffn, top_k, per_expert, call, served)


def _cpu_fused_kquant(run: _Run, step: str, fmt: str, hidden: int, ffn: int, top_k: int,
                      weight_bytes: int, served: bool = False) -> tuple[float, float]:
    """``_time_fused`` of the fused k-quant kernel (``cpu_kernel.moe_decode_q4k``) over a
    ``_pool_experts`` pool of ``fmt`` blocks (``q4_k``, or another of ``blocks.RAW``)."""
    per_expert = 2 * ffn * row_bytes(fmt, hidden) + hidden * row_bytes(fmt, ffn)
    n = _pool_experts(per_expert, top_k, weight_bytes)
    w = random_stacks(fmt, n, hidden, ffn)
    call = _FusedCall(lambda x, r, wt, **kw: run_fused(fmt, w, x, r, wt, **kw), hidden, ffn, torch.bfloat16)
    return _timed_on_stacks(run, step, fmt, w, n, hidden, ffn, top_k, per_expert, call, served)


# -- GPU ---------------------------------------------------------------------------------------


def _cuda_time(fn: Callable[[], Any], reps: int = 1) -> float:
    """Seconds per call of ``fn`` on the current CUDA stream, timed with events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def _gpu_copies(run: _Run, dev: torch.device, size: int, share: float) -> tuple[float, float, float]:
    """(pinned host->GPU, pageable host->GPU, pinned GPU->host) in bytes/s, ``size``-byte copies."""
    pinned = torch.ones(size, dtype=torch.uint8, pin_memory=True)
    pageable = torch.ones(size, dtype=torch.uint8)
    gbuf = torch.empty(size, dtype=torch.uint8, device=dev)
    h2d = size / _repeat(run, lambda: _cuda_time(lambda: gbuf.copy_(pinned, non_blocking=True)), share / 3)
    d2h = size / _repeat(run, lambda: _cuda_time(lambda: pinned.copy_(gbuf, non_blocking=True)), share / 3)

    def pageable_copy() -> None:
        gbuf.copy_(pageable)
        torch.cuda.synchronize(dev)

    return h2d, size / _repeat(run, pageable_copy, share / 3), d2h


def _gpu_memory(run: _Run, dev: torch.device, size: int, share: float) -> float:
    """Device copy rate counting read + write bytes (as BENCH.md reports it), bytes/s."""
    a = torch.ones(size, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    return 2 * size / _repeat(run, lambda: _cuda_time(lambda: b.copy_(a)), share)


def _gpu_matmul(run: _Run, dev: torch.device, n: int, share: float) -> float:
    """Dense bf16 ``[n, n] @ [n, n]`` rate, FLOP/s."""
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    return 2 * n**3 / _repeat(run, lambda: _cuda_time(lambda: a @ b), share)


def _gpu_experts(run: _Run, dev: torch.device, hidden: int, ffn: int, nbytes: int, share: float,
                 top_k: int = 8) -> float:
    """Bytes/s of bf16 expert weights that one token's resident experts read on the GPU, the way
    the engine's decode step runs them: ``top_k`` experts per call (the Triton kernels reading the
    selected rows in place where available, else batch-1 ``F.linear``), calls replayed from a CUDA
    graph like the engine's decode graphs."""
    from . import gpu_kernels

    per = 3 * ffn * hidden * 2
    n_exp = max(top_k, min(256, nbytes // per))
    w1 = torch.randn(n_exp, 2 * ffn, hidden, device=dev, dtype=torch.bfloat16) * 0.02  # [E, 2I, H]
    w2 = torch.randn(n_exp, hidden, ffn, device=dev, dtype=torch.bfloat16) * 0.02  # [E, H, I]
    x = torch.randn(1, hidden, device=dev, dtype=torch.bfloat16)
    calls = n_exp // top_k
    rows = [torch.arange(c * top_k, (c + 1) * top_k, device=dev) for c in range(calls)]
    scale = torch.full((top_k,), 1.0 / top_k, device=dev, dtype=torch.bfloat16)
    rowmap = torch.arange(n_exp, device=dev)

    def experts() -> None:
        for r in rows:
            if gpu_kernels.available():
                gpu_kernels.experts_one_token(x, r, scale, rowmap, w1, w2)
            else:
                for e in r.tolist():
                    h = F.linear(x, w1[e])  # [1, 2I]
                    F.linear(F.silu(h[:, :ffn]) * h[:, ffn:], w2[e])  # [1, H]

    experts()
    torch.cuda.synchronize(dev)
    if not gpu_kernels.available():  # the fallback reads rows on the host: no graph
        return per * calls * top_k / _repeat(run, lambda: _cuda_time(experts), share)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        experts()
    return per * calls * top_k / _repeat(run, lambda: _cuda_time(g.replay), share)


def finite_q4k(raw: torch.Tensor) -> torch.Tensor:
    """Random Q4_K rows ``raw [..., n * 144]`` (uint8) with each block's two float16 scales (``d``,
    ``dmin``: its first 4 bytes) set to 1e-3, in place: random bytes there are NaN or infinite in
    about 1 block of 16, and the kernels' check then finds every probe non-finite and leaves the
    candidates unchecked. Returns ``raw``."""
    scales = torch.tensor([1e-3, 1e-3], dtype=torch.float16).view(torch.uint8).to(raw.device)
    raw.view(*raw.shape[:-1], -1, 144)[..., :4] = scales
    return raw


def _gpu_kept_experts(run: _Run, dev: torch.device, hidden: int, ffn: int, nbytes: int, share: float,
                      top_k: int = 8) -> dict[str, float]:
    """Bytes/s of expert blocks (``q8_0``, ``q4_k``) that one token's resident experts read through the
    engine's Triton block kernels (``gpu_kernels.experts_one_token``), replayed from a CUDA graph:
    ``{format: B/s}``; empty without the kernels or for shapes the formats do not tile."""
    from . import gpu_kernels

    if not gpu_kernels.available():
        return {}
    out: dict[str, float] = {}
    x = torch.randn(1, hidden, device=dev, dtype=torch.bfloat16)
    scale = torch.full((top_k,), 1.0 / top_k, device=dev, dtype=torch.bfloat16)
    for fmt in ("q8_0", "q4_k"):
        if (fmt == "q8_0" and (hidden % 32 or ffn % 32)) or (fmt == "q4_k" and (hidden % 256 or ffn % 256)):
            continue
        per = 3 * ffn * hidden * 34 // 32 if fmt == "q8_0" else 3 * ffn * hidden * 144 // 256
        n_exp = max(top_k, min(256, nbytes // per))
        if fmt == "q8_0":
            q13 = torch.randint(-127, 128, (n_exp, 2 * ffn, hidden), device=dev, dtype=torch.int8)
            q2 = torch.randint(-127, 128, (n_exp, hidden, ffn), device=dev, dtype=torch.int8)
            d13 = torch.full((n_exp, 2 * ffn, hidden // 32), 1e-3, device=dev, dtype=torch.float16)
            d2 = torch.full((n_exp, hidden, ffn // 32), 1e-3, device=dev, dtype=torch.float16)
            stacks, extra = (q13, q2, d13, d2), {}
        else:
            b13 = finite_q4k(torch.randint(0, 256, (n_exp, 2 * ffn, hidden // 256 * 144), device=dev, dtype=torch.uint8))
            b2 = finite_q4k(torch.randint(0, 256, (n_exp, hidden, ffn // 256 * 144), device=dev, dtype=torch.uint8))
            stacks, extra = (b13, b2), {"fmt": ("q4_k", "q4_k")}
        calls = n_exp // top_k
        rows = [torch.arange(c * top_k, (c + 1) * top_k, device=dev) for c in range(calls)]
        rowmap = torch.arange(n_exp, device=dev)

        def experts(stacks=stacks, extra=extra, rows=rows, rowmap=rowmap) -> None:
            for r in rows:
                gpu_kernels.experts_one_token(x, r, scale, rowmap, *stacks, **extra)

        experts()
        torch.cuda.synchronize(dev)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            experts()
        out[fmt] = per * calls * top_k / _repeat(run, lambda g=g: _cuda_time(g.replay), share)
        del stacks, g
    return out


BUS_READ_EXPERTS = 4
"""Experts per call in the bus's read rate (``_gpu_bus_read``): what decode's bus share sends of a
token's CPU-selected experts in a layer where the CPU tier holds all of them."""


def _gpu_bus_read(run: _Run, dev: torch.device, hidden: int, ffn: int, nbytes: int, share: float) -> float:
    """Bytes/s of bf16 expert weights that the engine's one-token expert kernels read in place from
    page-locked host memory, as decode's bus share runs them (``served``: the selected rows cross
    PCIe, nothing is copied first): a pool of ``nbytes`` of experts in host memory the way the CPU
    tier holds it (``hostmem``), page-locked in place (``bus.register``), ``BUS_READ_EXPERTS``
    distinct experts a call, calls replayed from a CUDA graph; 0 without the Triton kernels or where
    the memory cannot be page-locked."""
    from . import bus, gpu_kernels

    if not gpu_kernels.available():
        return 0.0
    per = 3 * ffn * hidden * 2
    k = BUS_READ_EXPERTS
    n_exp = max(k, min(256, nbytes // per) // k * k)
    w13 = hostmem.empty((n_exp, 2 * ffn, hidden), torch.bfloat16)
    w2 = hostmem.empty((n_exp, hidden, ffn), torch.bfloat16)
    w13.fill_(0.01)
    w2.fill_(0.01)
    if not bus.register(w13):
        return 0.0
    try:
        if not bus.register(w2):
            return 0.0
        try:
            x = torch.randn(1, hidden, device=dev, dtype=torch.bfloat16)
            scale = torch.full((k,), 1.0 / k, device=dev, dtype=torch.bfloat16)
            rowmap = torch.arange(n_exp, device=dev)
            rows = [torch.arange(c * k, (c + 1) * k, device=dev) for c in range(n_exp // k)]

            def experts() -> None:
                for r in rows:
                    gpu_kernels.experts_one_token(x, r, scale, rowmap, w13, w2)

            experts()
            torch.cuda.synchronize(dev)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                experts()
            return per * n_exp / _repeat(run, lambda: _cuda_time(g.replay), share)
        finally:
            torch.cuda.synchronize(dev)
            bus.unregister(w2)
    finally:
        torch.cuda.synchronize(dev)
        bus.unregister(w13)


def _gpu_launch_sync(
    run: _Run, dev: torch.device, n_router: int, top_k: int, share: float
) -> tuple[float, float]:
    """(seconds per small kernel inside a CUDA graph, seconds of one host point of a hybrid layer).

    The engine's decode steps replay CUDA graphs, so a kernel costs its place in the graph, not a
    host launch. A host point (``graphs.DecodeStep``) is: replay the graph that ends with the router
    and its top-k copied to pinned memory, record an event, replay the next graph, wait for the
    event, read the routing, copy a hidden-size result back to the GPU."""
    tiny = torch.zeros(1, device=dev)
    graph = torch.cuda.CUDAGraph()
    tiny.add_(1)
    torch.cuda.synchronize(dev)
    with torch.cuda.graph(graph):
        for _ in range(200):
            tiny.add_(1)
    launch = _repeat(run, lambda: _cuda_time(graph.replay), share / 2) / 200
    logits = torch.randn(n_router, device=dev)
    ids_host = torch.empty(top_k, dtype=torch.long, pin_memory=True)
    back = torch.zeros(1, 4096, pin_memory=True)
    back_dev = torch.zeros(1, 4096, device=dev)
    route, after = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    ids_host.copy_(torch.topk(logits, top_k).indices, non_blocking=True)
    torch.cuda.synchronize(dev)
    with torch.cuda.graph(route):
        ids_host.copy_(torch.topk(logits, top_k).indices, non_blocking=True)
    with torch.cuda.graph(after):
        back_dev.mul_(0.5)
    event = torch.cuda.Event()

    def host_point() -> None:
        route.replay()
        event.record()
        after.replay()
        event.synchronize()
        ids_host.numpy().sum()
        back_dev.add_(back.to(dev, non_blocking=True))

    def timed() -> float:
        t = time.perf_counter()
        for _ in range(20):
            host_point()
        torch.cuda.synchronize(dev)
        return (time.perf_counter() - t) / 20

    sync = _repeat(run, timed, share / 2)
    return launch, sync


def _pcie_link(uuid: str) -> tuple[int | None, int | None]:
    """Max PCIe generation and width of the GPU with this CUDA UUID, from NVML (None if unknown)."""
    nvml = default_nvml()
    index = nvml.index_of_uuid(uuid) if uuid else None
    if index is None:
        return None, None
    snap = nvml.gpu(index, processes=False)
    gen = None if math.isnan(snap.pcie_gen_max) else int(snap.pcie_gen_max)
    width = None if math.isnan(snap.pcie_width_max) else int(snap.pcie_width_max)
    return gen, width


def _gpu(run: _Run, index: int, hidden: int, ffn: int, n_router: int, top_k: int) -> tuple[GpuProfile, dict]:
    """Measure CUDA device ``index``: its GpuProfile and the bus/sync figures."""
    dev = torch.device("cuda", index)
    step = f"gpu{index}"
    share = run.share[step] / 5
    torch.cuda.set_device(dev)
    props = torch.cuda.get_device_properties(dev)
    free, _ = torch.cuda.mem_get_info(dev)
    h2d, h2d_pageable, d2h = _gpu_copies(run, dev, int(min(256 << 20, free // 8)), share)
    run.report(f"GPU {index}: host->GPU pinned {h2d / 1e9:.1f} GB/s, pageable {h2d_pageable / 1e9:.1f} GB/s")
    mem_bw = _gpu_memory(run, dev, int(min(1 << 30, free // 8)), share)
    flops = _gpu_matmul(run, dev, 8192 if free > 8 * 3 * 8192 * 8192 * 2 else 2048, share)
    expert_bw = _gpu_experts(run, dev, hidden, ffn, int(min(1 << 30, free // 8)), share)
    try:  # the kept-block kernels: a failure leaves those formats at expert_bandwidth
        kept = _gpu_kept_experts(run, dev, hidden, ffn, int(min(1 << 30, free // 8)), share)
    except Exception as exc:  # noqa: BLE001 - calibration goes on without them
        log.warning("GPU %d: expert block kernels not measured: %s", index, exc)
        kept = {}
    try:  # the bus share's in-place reads: a failure leaves them at a share of the pinned copy rate
        bus_read = _gpu_bus_read(run, dev, hidden, ffn, int(min(1 << 30, psutil.virtual_memory().available // 8)),
                                 share)
    except Exception as exc:  # noqa: BLE001 - calibration goes on without it
        log.warning("GPU %d: the bus's in-place reads not measured: %s", index, exc)
        bus_read = 0.0
    bus_read = min(bus_read, h2d)  # reads in place cross the same link as the copies
    launch, sync = _gpu_launch_sync(run, dev, n_router, top_k, share)
    torch.cuda.empty_cache()
    gen, width = _pcie_link(str(getattr(props, "uuid", "") or ""))
    gpu = GpuProfile(
        name=props.name,
        vram_bytes=int(props.total_memory),
        mem_bandwidth=mem_bw,
        bf16_flops=flops,
        launch_s=launch,
        expert_bandwidth=expert_bw,
        pcie_gen=gen,
        pcie_width=width,
        expert_throughput=kept,
    )
    run.finish(
        step,
        f"GPU {index} {props.name}: memory {mem_bw / 1e12:.2f} TB/s, bf16 {flops / 1e12:.0f} TFLOP/s, "
        f"experts {expert_bw / 1e9:.0f} GB/s"
        + "".join(f", {fmt} blocks {rate / 1e9:.0f} GB/s" for fmt, rate in kept.items())
        + f", launch {launch * 1e6:.1f} us, sync {sync * 1e6:.0f} us"
        + (f"; experts read in place over the bus {bus_read / 1e9:.1f} GB/s" if bus_read else ""),
    )
    return gpu, {"h2d_pinned": h2d, "h2d_pageable": h2d_pageable, "d2h_pinned": d2h, "sync_s": sync,
                 "bus_read_rate": bus_read}


# -- the whole run -----------------------------------------------------------------------------


def calibrate(
    hidden: int = 2048,
    expert_ffn: int = 768,
    *,
    budget_s: float = 20.0,
    progress: ProgressFn | None = None,
    cancel: threading.Event | Callable[[], bool] | None = None,
    preset: HardwareProfile | str | None = None,
    formats: list[str] | None = None,
    weight_bytes: int = 512 << 20,
    use_cuda: bool | None = None,
    n_router: int = 128,
    top_k: int = 8,
    fit_engine: bool = True,
    kquants: tuple[str, ...] = ("q4_k",),
    kept_fits: tuple[str, ...] | None = None,
) -> HardwareProfile:
    """Measure this machine at the expert shape ``hidden`` x ``expert_ffn`` (gate_up ``[2I, H]``,
    down ``[H, I]``) and return its HardwareProfile.

    ``budget_s``: target wall time (capped at 28 s). ``progress(fraction 0..1, message)`` is called
    after each step; ``cancel`` (an Event or a callable) stops the run with
    :class:`CalibrationCancelled`. ``preset`` (a profile or a preset name) supplies what cannot be
    measured here (GPU fields without CUDA). ``formats`` restricts the CPU formats measured (default:
    all the engine supports). ``weight_bytes``: expert bytes per CPU format (more than the caches).
    ``n_router``/``top_k``: the router size used to time the per-layer sync. ``fit_engine`` (CUDA
    only): fit the per-kernel and per-host-point costs to the engine's own decode steps
    (``calibrate_engine``; ~10 s more). ``kquants``: the kept block formats (``blocks.RAW``: the
    k-quants, IQ4_XS and gpt-oss's MXFP4) whose fused CPU kernel is timed with ``int4`` (the cost model rates the others as Q4_K:
    ``costmodel.KQUANT_KIN``). ``kept_fits``: the kept block formats whose GPU rate is fitted to the
    engine's decode (``calibrate_engine.fit_kept_rates``; None: Q8_0 and Q4_K, ~30 s and ~140 s on a
    fresh H100 host, most of it the Triton kernels' first compiles); the others keep their kernels' rates.
    With CUDA the fused CPU kernels' decode rates are timed through the decode server's team
    (``served.StackServer``), where the engine's one-token steps run them (``WORKBENCH_CALIBRATE_SERVED=0``:
    on torch's pool, as prompts run them).
    """
    bad = sorted(set(kquants) - set(RAW))
    if bad:
        raise WorkbenchError(f"unknown kept format(s) {', '.join(bad)}; known: {', '.join(RAW)}")
    if hidden < 1 or expert_ffn < 1:
        raise WorkbenchError(f"expert shape must be positive, got hidden={hidden}, ffn={expert_ffn}")
    budget_s = min(max(budget_s, 0.5), MAX_BUDGET_S)
    base = load_preset(preset) if isinstance(preset, str) else preset
    table = format_table()
    names = [f for f in (formats or list(table)) if f in table]
    unknown = sorted(set(formats or ()) - set(table))
    if unknown:
        raise WorkbenchError(f"unknown CPU weight format(s) {', '.join(unknown)}; known: {', '.join(table)}")
    cuda = torch.cuda.is_available() if use_cuda is None else use_cuda
    n_gpus = torch.cuda.device_count() if cuda else 0
    avail = psutil.virtual_memory().available
    weight_bytes = int(min(weight_bytes, avail // 8))

    steps = [("host", 1.0)] + [(f"cpu:{f}", 1.0) for f in names] + [("prefill", 0.5)]
    steps += [(f"gpu{i}", 5.0 / max(1, n_gpus)) for i in range(n_gpus)]
    run = _Run(budget_s, progress, cancel, steps)
    run.report(f"calibrating for {budget_s:.0f} s at expert shape {hidden} x {expert_ffn}")

    read = _host_read(run, weight_bytes)
    run.finish("host", f"host RAM read {read / 1e9:.1f} GB/s")

    throughput: dict[str, float] = {}
    prompt_flops: dict[str, float] = {}  # fused kernels' further tokens per expert in a prompt
    # with a GPU the engine's decode runs the CPU experts on the decode server's team: time them there
    served = cuda and cpu_kernel.available() and os.environ.get("WORKBENCH_CALIBRATE_SERVED", "1") != "0"
    if served:
        run.report("CPU experts' decode rates timed on the decode server's team, as the engine runs them")
    bf16_experts = None
    for name in names:
        step = f"cpu:{name}"
        fmt = table[name]
        if not fmt.supports(2 * expert_ffn, hidden) or not fmt.supports(hidden, expert_ffn):
            run.finish(step, f"CPU {name}: skipped (this kernel does not take shape {hidden} x {expert_ffn})")
            continue
        try:
            bps, per_expert, experts = _cpu_expert(run, step, fmt.pack, hidden, expert_ffn, weight_bytes)
        except CalibrationCancelled:
            raise
        except (
            WorkbenchError,
            RuntimeError,
            ValueError,
            NotImplementedError,
        ) as e:  # a kernel this CPU lacks
            run.finish(step, f"CPU {name}: skipped ({e})")
            continue
        if name in ("bf16", "f32") and cpu_kernel.available():  # what the engine's decode runs
            bps, prompt_flops[name] = _cpu_fused(run, step, experts, hidden, expert_ffn, top_k, weight_bytes, served)
            run.report(f"CPU {name} (fused) prompt: {prompt_flops[name] / 1e9:.0f} GFLOP/s per further token")
        if name == "int8" and cpu_kernel.available() and hidden % 32 == 0 and expert_ffn % 32 == 0:
            # GGUF Q8_0 experts: the engine keeps the blocks and runs the fused Q8_0 kernel
            throughput["q8_0"], prompt_flops["q8_0"] = _cpu_fused_q8(run, step, hidden, expert_ffn, top_k,
                                                                     weight_bytes, served)
            run.report(f"CPU q8_0 (fused): {throughput['q8_0'] / 1e9:.1f} GB/s of weights, prompt "
                       f"{prompt_flops['q8_0'] / 1e9:.0f} GFLOP/s per further token")
        if name == "int4" and cpu_kernel.available() and hidden % 256 == 0 and expert_ffn % 256 == 0:
            for kq in kquants:  # GGUF k-quant experts: kept as blocks, the fused kernel
                throughput[kq], prompt_flops[kq] = _cpu_fused_kquant(run, step, kq, hidden, expert_ffn, top_k,
                                                                     weight_bytes, served)
                run.report(f"CPU {kq} (fused): {throughput[kq] / 1e9:.1f} GB/s of weights, prompt "
                           f"{prompt_flops[kq] / 1e9:.0f} GFLOP/s per further token")
        throughput[name] = bps
        bf16_experts = experts if name == "bf16" else bf16_experts
        del experts
        run.finish(step, f"CPU {name}: {bps / 1e9:.1f} GB/s of weights, {per_expert * 1e6:.0f} us per expert")

    if run.ram_reads and max(run.ram_reads) > read:
        # The sum's read moves by up to a fifth between runs on a server (93 vs 117 GB/s on the H200
        # machine) while the kernels' own reads do not: the RAM gives at least what they read.
        read = max(run.ram_reads)
        run.report(f"host RAM read raised to {read / 1e9:.1f} GB/s: the fused CPU kernels read that much")
    cpu_flops = _prefill_flops(run, bf16_experts, hidden, expert_ffn)
    del bf16_experts
    run.finish(
        "prefill", f"CPU bf16 GEMM (32 tokens): {cpu_flops / 1e12:.2f} TFLOP/s" if cpu_flops else "no bf16"
    )

    measured = [_gpu(run, i, hidden, expert_ffn, n_router, top_k) for i in range(n_gpus)]
    info = cpu_info()
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    source = (
        f"measured on {platform.node() or 'this machine'} at {now} (torch {torch.__version__}, "
        f"{torch.get_num_threads()} CPU threads, expert {hidden} x {expert_ffn}, "
        f"{time.perf_counter() - run.t0:.1f} s)"
    )
    provenance = {
        "host_read_bandwidth": "measured",
        "cpu_expert_throughput": "measured",
        "host_ram_bytes": "measured",
        "cpu_cores": "measured",
        "cpu_flops": "measured" if cpu_flops else "default",
        "cpu_prompt_flops": "measured" if prompt_flops else "absent",
    }
    prof = HardwareProfile(
        name=info.model,
        gpus=(),
        host_ram_bytes=int(psutil.virtual_memory().total),
        host_read_bandwidth=read,
        h2d_pinned=math.nan,
        h2d_pageable=math.nan,
        d2h_pinned=math.nan,
        cpu_expert_throughput=throughput,
        cpu_flops=cpu_flops or 1e11,
        cpu_prompt_flops=prompt_flops,
        cpu_cores=info.usable_cores,
        source=source,
        provenance=provenance,
    )
    if measured:
        gpus = tuple(g for g, _ in measured)
        bus = {k: statistics.median(b[k] for _, b in measured) for k in _GPU_SIDE[1:]}
        label = f"{len(gpus)}x {gpus[0].name}" if len(gpus) > 1 else gpus[0].name
        prof = replace(
            prof, name=f"{label} + {info.model}", gpus=gpus, **bus,
            provenance=provenance | dict.fromkeys(_GPU_SIDE, "measured"),
        )  # fmt: skip
    elif base is not None:
        tag = f"preset:{preset}" if isinstance(preset, str) else f"preset:{base.name}"
        prof = with_preset_gpus(prof, base, tag)
        prof = replace(prof, source=source + f"; no CUDA here: GPU, bus and sync figures from {tag}")
    else:
        prof = replace(
            prof,
            name=f"no GPU + {info.model}",
            source=source + "; no CUDA here: no GPU or bus figures (pick a preset to plan with a GPU)",
            provenance=provenance | dict.fromkeys(_GPU_SIDE, "absent") | {"sync_s": "default"},
        )
    if measured and fit_engine:
        from .calibrate_engine import PROMPT_FORMATS, depth_runs, fit_engine_costs, resident_runs

        run.check()
        resident_formats: tuple[str, ...] = ()
        try:
            bf16_rate = prof.cpu_expert_throughput.get("bf16")
            prof, fit = fit_engine_costs(prof, hidden, expert_ffn, top_k, kept=kept_fits)
            # kept formats the prompt fit does not write: their resident prompt layer timed alone
            resident_formats = tuple(f for f in fit.get("kept", {}) if f not in PROMPT_FORMATS)
            deep = fit.get("deep")
            host = (f"{fit['resident_queued_s'] * 1e3:.2f} ms a step queued" if deep is None else
                    depth_runs(deep["resident_s"], deep["depths"]) + " all resident")
            run.report(f"engine decode per 8-layer step: {fit['resident_s'] * 1e3:.2f} ms all resident "
                       f"({host}: the host {fit['step_s'] * 1e6:.0f} us a step), "
                       f"{fit['sixteenth_s'] * 1e3:.2f} / {fit['quarter_s'] * 1e3:.2f} / {fit['half_s'] * 1e3:.2f} / "
                       f"{fit['three_quarters_s'] * 1e3:.2f} ms a sixteenth / quarter / half / three quarters on the CPU, "
                       f"{fit['cpu_s'] * 1e3:.2f} ms all on the CPU ({fit['cpu_predicted_s'] * 1e3:.2f} ms predicted); "
                       f"fitted kernel {fit['launch_s'] * 1e6:.2f} us, "
                       + (f"routing {w['route_s_per_expert'] * 1e9:.0f} ns a layer per expert beyond those picked "
                          f"({w['wide_s'] * 1e3:.2f} ms for {w['depth']} layers of {w['experts']} experts), "
                          if (w := fit.get("wide")) else "")
                       + f"host point {fit['sync_s'] * 1e6:.0f} us, "
                       f"CPU experts {fit['cpu_rate'] / 1e9:.1f} GB/s"
                       + "".join(f"; {fmt} blocks all resident {resident_runs(k)}, GPU rate "
                                 f"{k['rate'] / 1e9:.0f} GB/s (kernels alone {k['measured_rate'] / 1e9:.0f})"
                                 + (f", a sixteenth / half on the CPU {k['hybrid_s'][0] * 1e3:.2f} / "
                                    f"{k['hybrid_s'][1] * 1e3:.2f} ms, CPU rate {k['cpu_rate'] / 1e9:.1f} GB/s "
                                    f"(kernel alone {k['cpu_measured_rate'] / 1e9:.1f})" if "cpu_rate" in k else "")
                                 for fmt, k in fit.get("kept", {}).items()))
            prof = replace(prof, provenance=prof.provenance | dict.fromkeys(("sync_s", "decode_step_s"),
                                                                            "fitted to the engine"))
            cpu_fits = ["bf16"] if fit["cpu_rate"] != bf16_rate else []
            cpu_fits += [fmt for fmt, k in fit.get("kept", {}).items()
                         if "cpu_rate" in k and k["cpu_rate"] != k["cpu_measured_rate"]]
            if cpu_fits:
                prof = replace(prof, provenance=prof.provenance | {
                    "cpu_expert_throughput": f"measured; {', '.join(cpu_fits)} fitted to the engine's decode"})
        except (WorkbenchError, RuntimeError, OSError) as e:
            run.report(f"engine decode not timed ({e}); launch and sync stay as measured")
        prof = refit_prompt(prof, hidden, expert_ffn, top_k, run.report, resident_formats=resident_formats)
    run.done_weight = 1.0
    run.report(f"done in {time.perf_counter() - run.t0:.1f} s")
    return prof


_GPU_SIDE = ("gpus", "h2d_pinned", "h2d_pageable", "d2h_pinned", "sync_s", "bus_read_rate")


def refit_prompt(prof: HardwareProfile, hidden: int, expert_ffn: int, top_k: int = 8,
                 report: Callable[[str], None] | None = None, device: str = "cuda",
                 resident_formats: tuple[str, ...] = ()) -> HardwareProfile:
    """``prof`` with the prompt's host lane (``prompt_host_*``), ``prompt_sync_s``, ``prompt_cpu_scale``,
    ``prompt_h2d`` and ``prompt_resident_layer_s`` (and per format) fitted to the engine's prompts at this expert shape
    (``calibrate_engine.fit_prompt_costs``, ~60 s on CUDA); ``prof`` as it
    was, with the reason reported, when the engine cannot run them."""
    from .calibrate_engine import fit_prompt_costs

    say = report or (lambda message: log.info("%s", message))
    try:
        fitted, fit = fit_prompt_costs(prof, hidden, expert_ffn, top_k, device=device,
                                       resident_formats=resident_formats)
    except (WorkbenchError, RuntimeError, OSError) as e:
        say(f"engine prompts not timed ({e}); the prompt's host time per hybrid layer stays "
            f"{prof.prompt_sync_s * 1e6:.0f} us (+{prof.prompt_cpu_sync_s * 1e6:.0f} us with a CPU share)")
        return prof
    runs = ", ".join(f"{r['name']}, {r['tokens']} tokens: {r['measured_s'] * 1e3:.1f} ms "
                     f"({r['predicted_s'] * 1e3:.1f} predicted)" for r in fit["runs"])
    lane = fit["host_lane"]
    say(f"engine prompts ({runs}); the engine thread's lane per hybrid prompt layer "
        f"{lane['prompt_host_layer_s'] * 1e6:.0f} us, +{lane['prompt_host_cpu_s'] * 1e6:.0f} us with a CPU share, "
        f"{lane['prompt_host_batch_s'] * 1e6:.0f} us a fetched batch, {lane['prompt_host_copy_s'] * 1e6:.1f} us a copy "
        f"({fit['host_layers']} layers recorded); beyond the lanes {fit['prompt_sync_s'] * 1e6:.0f} us per hybrid "
        f"prompt layer, +{fit.get('prompt_cpu_sync_s', 0.0) * 1e6:.0f} us with a CPU share"
        + ("" if fit.get("cpu_lead_s") is None else f" (outside the CPU's run: {fit['cpu_lead_s'] * 1e6:.0f} us)")
        + f"; the CPU's share {fit['prompt_cpu_scale']:.2f}x its kernel's time; a prompt's copies at "
        f"{fit['prompt_h2d'] / 1e9:.1f} GB/s; a resident prompt layer at least "
        f"{fit['prompt_resident_layer_s'] * 1e6:.0f} us"
        + "".join(f", {f.upper()} {v * 1e6:.0f} us" for f, v in fit["prompt_resident_layer_by_format"].items()))
    names = ("prompt_sync_s", "prompt_cpu_sync_s", "prompt_cpu_scale", "prompt_h2d", "prompt_resident_layer_s")
    names += ("prompt_resident_layer_by_format",) if fit["prompt_resident_layer_by_format"] else ()
    names += tuple(lane) if fit["host_layers"] else ()
    fitted_by_engine = dict.fromkeys(names, "fitted to the engine")
    return replace(fitted, provenance=fitted.provenance | fitted_by_engine)


def _prefill_flops(run: _Run, experts, hidden: int, ffn: int, tokens: int = 32) -> float:
    """bf16 FLOP/s of a ``tokens``-token pass over the packed bf16 experts (0 when none)."""
    if not experts:
        return 0.0
    x = torch.randn(tokens, hidden).to(experts[0][0].act_dtype)

    def one_pass() -> None:
        for p1, p2 in experts:
            h = p1(x)
            p2(F.silu(h[:, :ffn]) * h[:, ffn:])

    one_pass()
    t = _repeat(run, one_pass, run.share["prefill"], min_reps=2)
    return 2 * tokens * 3 * hidden * ffn * len(experts) / t


def with_preset_gpus(
    measured: HardwareProfile, base: HardwareProfile | str, tag: str = ""
) -> HardwareProfile:
    """A measured CPU-side profile with the GPUs, bus and sync figures of a preset (what-if)."""
    if isinstance(base, str):
        tag = tag or f"preset:{base}"
        base = load_preset(base)
    tag = tag or f"preset:{base.name}"
    label = " + ".join(dict.fromkeys(g.name for g in base.gpus)) or "no GPU"
    return replace(
        measured,
        name=f"{label} + {measured.name.split(' + ')[-1]}",
        gpus=base.gpus,
        h2d_pinned=base.h2d_pinned,
        h2d_pageable=base.h2d_pageable,
        d2h_pinned=base.d2h_pinned,
        sync_s=base.sync_s,
        decode_step_s=base.decode_step_s,
        bus_read_rate=base.bus_read_rate,
        provenance=dict(measured.provenance) | dict.fromkeys(_GPU_SIDE + ("decode_step_s",), tag),
    )
