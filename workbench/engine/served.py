"""Hybrid decode steps without a host round trip per layer: the CPU experts served by a native thread.

In the host-driven step (``experts.LayerExperts.__call__``) every hybrid layer waits on the host for
its routing, runs Python to start the CPU experts and queues their result back: ~0.4 ms per layer
on the H200 machine beyond the weight reads, 24 layers a token. Here the accelerator and a native
thread (``cpu_kernel.server``) talk through page-locked memory instead, and a whole decode step is
one CUDA graph:

1. ``publish`` (on the accelerator): one kernel splits the token's ``k`` selections into the CPU's
   (``packet`` rows; -2 where the bus's, -1 elsewhere), the bus's (``bus_rows``: the first ``costmodel.bus_count(n, fraction, slots)`` of the
   ``n`` CPU-tier selections, as ``bus.BusShare.share`` counts them) and the rest, and writes the
   packet ``[rows, weights, x]`` (float32 ``[2k + H]``) and then the step number (``step``, counted on
   the device) straight into page-locked memory, fenced at system scope (``direct_publish``; with
   ``WORKBENCH_SERVED_DIRECT=0`` it writes them on the device and two copies send them).
2. The native thread sees the new step number in the layer's ``flag_in``, computes the packet's
   experts into ``out`` (float32 ``[H]``) with the fused kernel and stores the step number in
   ``flag_out``.
3. Meanwhile the accelerator computes the resident experts and, with a bus share, the bus's experts
   on a side stream by reading their weights from page-locked host memory in place
   (``experts_one_token`` over the CPU stacks: only the selected rows cross the bus, nothing is
   copied first).
   Under a unit split (``split_units``: the layer's ``bus_units``, which the engine takes from the
   cost model's ``CostModel.unit_shares`` or ``WORKBENCH_BUS_UNITS``; off by default, as measured it
   did not pay on a RAM-bound host) every CPU-tier pair is both the CPU's and the bus's: the
   native thread computes each expert's first ``units`` intermediate units (``Server.set_units``),
   the accelerator the others from views of the same stacks (``blocks.unit_views``), and the two
   parts add up to the expert. A lone CPU-tier expert then no longer leaves the bus idle.
4. ``wait_add`` (one kernel) polls ``flag_out`` until it holds this step's number and adds ``out``;
   when ``publish`` left the CPU no pair (every selection resident or the bus's), it returns at once:
   the thread still sees the empty packet, but nothing waits for it.

A kernel that waits longer than ``TIMEOUT_S`` gives up, sets ``status`` and adds nothing: ``check``
raises ``ServedError`` and the step is run again without the server. On a CPU accelerator (tests)
the same pieces run eagerly and the host polls instead of a kernel.
"""

from __future__ import annotations

import functools
import logging
import os
import time
import weakref

import numpy as np
import torch

from workbench.core.costmodel import bus_count, bus_ratio, units_for

from . import blocks, cpu_kernel, gpu_kernels
from .experts import COMPUTE, STREAM, LayerExperts, one_token_on

log = logging.getLogger(__name__)

TIMEOUT_S = 10.0
"""How long a step waits for the CPU's result of one layer before it gives up (a hang guard: a
layer's CPU experts take milliseconds)."""

triton = gpu_kernels.triton
if triton is not None:
    tl = gpu_kernels.tl
    try:
        from triton.language.extra.cuda import globaltimer
    except ImportError:  # pragma: no cover - older Triton: the CUDA path is off (see ``usable``)
        globaltimer = None

    @triton.jit
    def _publish_kernel(ids_ptr, w_ptr, x_ptr, tier_ptr, local_ptr, packet_ptr, bus_ptr, count_ptr, host_ptr, H,
                        fraction, ratio, slots, flag_ptr, step_ptr, K: tl.constexpr, KP: tl.constexpr,
                        BLOCK_H: tl.constexpr, DIRECT: tl.constexpr = False, SPLIT: tl.constexpr = False):
        """The packet ``[rows of the CPU's pairs (-2 the bus's, -1 others), weights, x]`` (float32) and the bus's rows
        per pair (-1: not the bus's) from one token's ``ids``/``w [K]`` and ``x [H]``; adds the bus's
        pairs to ``count`` and stores the CPU's in ``host`` (int32: 0 lets ``wait_add`` skip the layer).
        ``SPLIT`` (a unit split): every CPU-tier pair is both the CPU's and the bus's, each computing its
        own units of the expert; ``fraction``, ``ratio`` and ``slots`` are then unused.
        ``DIRECT``: ``packet`` is the page-locked host packet itself, and once every thread's stores
        are fenced at system scope the kernel stores ``step`` into the host's ``flag`` (no copies
        after it); else ``flag``/``step`` are unused."""
        offs = tl.arange(0, KP)
        km = offs < K
        ids = tl.load(ids_ptr + offs, mask=km, other=0)
        w = tl.load(w_ptr + offs, mask=km, other=0.0).to(tl.float32)
        tier = tl.load(tier_ptr + ids, mask=km, other=-1)
        row = tl.load(local_ptr + ids, mask=km, other=-1)
        cpu = (tier == 1) & km
        ci = cpu.to(tl.int32)
        n = tl.sum(ci, axis=0)
        rank = tl.cumsum(ci, axis=0) - 1
        # costmodel.bus_count: floor(n * fraction) or one more, whichever ends the slower lane first
        if SPLIT:
            tl.store(count_ptr, tl.load(count_ptr) + n)
            tl.store(host_ptr, n)
            tl.store(bus_ptr + offs, tl.where(cpu, row, -1), mask=km)
            tl.store(packet_ptr + offs, tl.where(cpu, row, -1).to(tl.float32), mask=km)
        else:
            m0 = (n.to(tl.float32) * fraction).to(tl.int32)
            a0 = tl.maximum((n - m0).to(tl.float32), m0.to(tl.float32) * ratio)
            a1 = tl.maximum((n - m0 - 1).to(tl.float32), (m0 + 1).to(tl.float32) * ratio)
            m = m0 + ((a1 < a0) & (m0 < n)).to(tl.int32)
            m = tl.where(fraction > 0, tl.minimum(tl.minimum(m, n), slots), 0)
            bus = cpu & (rank < m)
            tl.store(count_ptr, tl.load(count_ptr) + m)
            tl.store(host_ptr, n - m)
            tl.store(bus_ptr + offs, tl.where(bus, row, -1), mask=km)
            tl.store(packet_ptr + offs, tl.where(cpu & (rank >= m), row, tl.where(bus, -2, -1)).to(tl.float32),
                     mask=km)
        tl.store(packet_ptr + K + offs, w, mask=km)
        h = tl.arange(0, BLOCK_H)
        for h0 in range(0, H, BLOCK_H):
            hm = h0 + h < H
            tl.store(packet_ptr + 2 * K + h0 + h, tl.load(x_ptr + h0 + h, mask=hm).to(tl.float32), mask=hm)
        if DIRECT:
            # each thread's packet stores reach the host before any thread goes on (fence.sc.sys, one
            # per element of a block every thread holds part of); the flag's value depends on every
            # fence's result, so its store comes after all of them
            done = tl.inline_asm_elementwise("fence.sc.sys;\n\tmov.u32 $0, 0;", "=r,r", [h], dtype=tl.int32,
                                             is_pure=False, pack=1)
            tl.debug_barrier()
            tl.store(flag_ptr, tl.load(step_ptr) + tl.sum(done, axis=0).to(tl.int64))

    @triton.jit
    def _wait_add_kernel(flag_ptr, step_ptr, src_ptr, out_ptr, status_ptr, host_ptr, H, timeout_ns,
                         BLOCK_H: tl.constexpr):
        """If the packet gave the CPU pairs (``host`` > 0), poll ``flag`` (page-locked host memory) until
        it equals ``step``, then ``out += src`` (``src`` float32 in host memory); after ``timeout_ns``
        give up: status 1, nothing added. Without pairs, nothing to wait for or add."""
        want = tl.load(step_ptr)
        need = tl.load(host_ptr) > 0
        t0 = globaltimer()
        now = t0
        got = tl.load(flag_ptr, mask=need, other=0, volatile=True)
        while need & (got != want) & (now - t0 < timeout_ns):
            got = tl.load(flag_ptr, volatile=True)
            now = globaltimer()
        add = need & (got == want)
        h = tl.arange(0, BLOCK_H)
        for h0 in range(0, H, BLOCK_H):
            hm = (h0 + h < H) & add
            s = tl.load(src_ptr + h0 + h, mask=hm, other=0.0, volatile=True)
            o = tl.load(out_ptr + h0 + h, mask=hm, other=0.0).to(tl.float32)
            tl.store(out_ptr + h0 + h, (o + s).to(out_ptr.dtype.element_ty), mask=hm)
        if need & (got != want):
            tl.store(status_ptr, 1)


class ServedError(RuntimeError):
    """The CPU experts' thread did not answer a layer in time, failed on a packet, or a served
    layer's piece could not run here (e.g. a kernel that does not build)."""


def _guarded(method):
    """``method`` with any failure raised as ``ServedError`` (the step then runs without the server)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except ServedError:
            raise
        except Exception as exc:
            raise ServedError(f"{method.__name__}: {type(exc).__name__}: {exc}") from exc
    return run


def _env_count(name: str, least: int = 1) -> int | None:
    """The whole number in the environment variable ``name`` when it is one of at least ``least``, else None."""
    raw = os.environ.get(name, "").strip()
    return int(raw) if raw.isdigit() and int(raw) >= least else None


def server_threads() -> int:
    """Threads of the decode server's team (its polling thread among them): ``WORKBENCH_SERVER_THREADS``
    when set, else torch's thread count less one (the caller's thread waits on the GPU meanwhile)."""
    n = _env_count("WORKBENCH_SERVER_THREADS")
    return n if n is not None else max(1, torch.get_num_threads() - 1)


def server_chunks() -> int:
    """``WORKBENCH_SERVER_CHUNKS``: parts per thread of each pass on the server's own team (default 1:
    one contiguous part each; more are taken in turn, ``cpu_kernel.server``). On an H100 host 4 gave
    S1 Q8_0 ``frequency`` the same one-expert packets (65.5 against 66.5 µs; BENCHMARKS.md, twelfth stop)."""
    return _env_count("WORKBENCH_SERVER_CHUNKS") or 1


def server_team() -> bool:
    """``WORKBENCH_SERVER_TEAM``: ``spin`` (default) runs the server's passes on its own spinning
    threads (``SpinTeam`` in ``csrc/moe_decode.cpp``); ``omp`` on torch's OpenMP pool, whose workers
    sleep between packets. On the H200 host (16 cores, 15 server threads) S1's decode gained 4-16%
    with the team in 9 of 10 paired runs (Q8_0 ``frequency`` 246 -> 283 / 287 tok/s; BENCHMARKS.md,
    2026-12-05). With more spinning threads than cores it loses a time slice per pass, so the server
    keeps one core for the thread that launches the GPU's work (``server_threads``)."""
    return os.environ.get("WORKBENCH_SERVER_TEAM", "spin").strip().lower() != "omp"


class StackServer:
    """One layer of the native decode server over plain expert stacks, driven from this thread:
    calibration times the CPU experts of one-token steps where the engine's decode runs them (its
    own spinning team on a GPU machine: on the H100 host one Q8_0 expert took 40 µs there against
    ~60 µs on torch's pool, where the bf16 kernel took the same on both; BENCHMARKS.md, sixth stop).
    ``fmt``: ``"bf16"`` / ``"f32"`` (stacks ``[w13, w2]``), ``"q8_0"`` (``[q13, d13, q2, d2]``) or a
    k-quant (``[b13, b2]``), as ``calibrate.random_stacks`` lays them out; ``k`` selections a packet.
    Use it as a context manager (the server's threads stop on exit)."""

    def __init__(self, fmt: str, stacks: list[torch.Tensor], hidden: int, ffn: int, k: int,
                 threads: int | None = None, timeout_s: float = 10.0):
        kind, f13, f2 = _native_kind(None if fmt in ("bf16", "f32") else (fmt, fmt))
        self.k, self.hidden, self.timeout_s, self.step = k, hidden, timeout_s, 0
        self.packet = torch.zeros(2 * k + hidden, dtype=torch.float32)
        self.flag_in, self.flag_out = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
        self.out = torch.zeros(hidden, dtype=torch.float32)
        self.native = cpu_kernel.server(threads or server_threads(), own_team=server_team(), chunks=server_chunks())
        self.native.add_layer(kind, list(stacks), f13, f2, ffn, k, self.packet, self.flag_in, self.out,
                              self.flag_out, *cpu_kernel.act_args(("silu",)))
        self.native.start()

    def __enter__(self) -> StackServer:
        return self

    def __exit__(self, *exc) -> None:
        self.native.stop()

    def __call__(self, x: torch.Tensor, rows, weights) -> torch.Tensor:
        """One token ``x [hidden]``'s experts ``rows`` (at most ``k``) weighted by ``weights``, as the
        server computes a packet: ``[hidden]`` float32 (its own buffer, overwritten by the next call).
        Raises RuntimeError when the server reports an error or gives no result in ``timeout_s``."""
        p, k = self.packet.numpy(), self.k
        rows, weights = np.asarray(rows, dtype=np.float32), np.asarray(weights, dtype=np.float32)
        p[:k], p[k:2 * k] = -1.0, 0.0
        p[:rows.size], p[k:k + weights.size] = rows, weights
        p[2 * k:] = x.detach().reshape(-1).float().numpy()
        self.step += 1
        flag_out, deadline = self.flag_out.numpy(), time.monotonic() + self.timeout_s
        self.flag_in.numpy()[0] = self.step
        while flag_out[0] != self.step:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the decode server gave no result in {self.timeout_s:.0f} s")
        if self.native.errors():
            raise RuntimeError("the decode server failed on a calibration packet")
        return self.out


def supports(lx: LayerExperts) -> bool:
    """Whether ``lx``'s one-token steps can be served: a hybrid layer whose CPU tier runs through the
    fused kernel (float stacks or kept Q8_0 / k-quant / MXFP4 blocks; gpt-oss's biased, clamped
    experts too), nothing streamed."""
    return (lx.needs_host and lx.n_tier[COMPUTE] > 0 and lx.n_tier[STREAM] == 0
            and lx.act[0] in cpu_kernel.ACTIVATIONS and lx._fused_cpu(False))


class _Layer:
    """One served layer's buffers: device packet and bus rows, page-locked packet, flags and out."""

    def __init__(self, lx: LayerExperts, k: int, hidden: int, pin: bool):
        dev = lx.device
        self.lx = lx
        self.k = k
        self.ffn = _ffn(lx)  # each expert's intermediate units
        self.units = self.ffn  # those the CPU computes (fewer under a unit split)
        self.bus_stacks: list[torch.Tensor] | None = None  # a unit split: the bus's units (blocks.unit_views)
        self.packet_dev = torch.zeros(2 * k + hidden, dtype=torch.float32, device=dev)
        self.bus_rows = torch.full((k,), -1, dtype=torch.int64, device=dev)
        self.packet = torch.zeros(2 * k + hidden, dtype=torch.float32, pin_memory=pin)
        self.flag_in = torch.zeros(1, dtype=torch.int64, pin_memory=pin)
        self.out = torch.zeros(hidden, dtype=torch.float32, pin_memory=pin)
        self.flag_out = torch.zeros(1, dtype=torch.int64, pin_memory=pin)
        self.flag_out_np = self.flag_out.numpy()
        self.host = torch.zeros(1, dtype=torch.int32, device=dev)  # the packet's CPU pairs (publish)


class DecodeServer:
    """The served hybrid layers of one decode step and the native thread that serves them.

    ``layers``: the layers ``supports`` accepts; ``k`` selections per token; ``hidden`` = H;
    ``threads``: the CPU threads of the experts (the caller's thread keeps one core to launch).
    Call ``begin`` once per step before the layers' pieces, ``publish`` / ``start_bus`` /
    ``join_bus`` / ``wait_add`` per layer in that order, ``check`` after the step; ``close`` stops the thread.
    """

    def __init__(self, device: torch.device, layers: list[LayerExperts], k: int, hidden: int, threads: int):
        self.device = device
        self.cuda = device.type == "cuda"
        self.k, self.hidden = k, hidden
        self.step = torch.zeros(1, dtype=torch.int64, device=device)
        self.status = torch.zeros(1, dtype=torch.int32, device=device)
        self.bus_count = torch.zeros(1, dtype=torch.int64, device=device)  # pairs the bus computed so far
        self.pair_ids = torch.arange(k, dtype=torch.int64, device=device)  # the bus kernel's "experts": pairs
        self.bus_stream = torch.cuda.Stream(device) if self.cuda and _bus_side_stream() else None
        self.direct = self.cuda and direct_publish()
        self.native = cpu_kernel.server(threads, own_team=server_team(), chunks=server_chunks())
        self.layers: dict[int, _Layer] = {}
        for lx in layers:
            slot = _Layer(lx, k, hidden, self.cuda)
            kind, stacks, f13, f2 = _native_stacks(lx)
            b13, b2, act, alpha, limit = cpu_kernel.act_args(lx.act, *lx._cpu_biases())
            index = self.native.add_layer(kind, stacks, f13, f2, slot.ffn, k, slot.packet, slot.flag_in, slot.out,
                                          slot.flag_out, b13, b2, act, alpha, limit)
            units = split_units(lx)
            if units < slot.ffn:
                self.native.set_units(index, units)
                slot.units, slot.bus_stacks = units, blocks.unit_views(_kept(lx), stacks, units)
            self.layers[lx.layer] = slot
        self._stop = weakref.finalize(self, self.native.stop)
        self.native.set_trace(trace_capacity())
        self.native.start()
        log.info("decode server: %d hybrid layers served by a native thread on %d threads", len(layers), threads)

    def begin(self) -> None:
        """Start a step: the step number the layers' flags will carry."""
        self.step.add_(1)

    def wake(self) -> None:
        """A step is about to run (host side, before its graph): the native thread, waiting on its
        condition after a long idle, spins again for the step's packets."""
        self.native.wake()

    @_guarded
    def publish(self, lx: LayerExperts, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> None:
        """Send the CPU its share of the token ``x [1, H]`` with routing ``ids``/``w [1, k]``."""
        s = self.layers[lx.layer]
        frac, slots = (lx.bus.fraction, lx.bus.slots) if lx.bus is not None else (0.0, 0)
        direct = self.direct  # on CUDA only, where x is
        split = s.bus_stacks is not None
        if gpu_kernels.usable(x):
            _publish_kernel[(1,)](ids, w, x, lx.tier_dev, lx.local_dev, s.packet if direct else s.packet_dev, s.bus_rows,
                                  self.bus_count, s.host, self.hidden, float(frac), bus_ratio(frac), int(slots),
                                  s.flag_in, self.step, K=self.k, KP=triton.next_power_of_2(self.k),
                                  BLOCK_H=min(1024, triton.next_power_of_2(self.hidden)), DIRECT=direct, SPLIT=split)
            if direct:
                return
        else:
            self.bus_count += _publish_torch(ids.reshape(-1), w.reshape(-1), x.reshape(-1), lx, s, frac, slots, split)
        if self.cuda:
            s.packet.copy_(s.packet_dev, non_blocking=True)
            s.flag_in.copy_(self.step, non_blocking=True)
        else:
            s.packet.copy_(s.packet_dev)
            s.flag_in.copy_(self.step)  # after the packet: the thread reads the packet once it sees this

    @_guarded
    def start_bus(self, lx: LayerExperts, x: torch.Tensor, w: torch.Tensor):
        """With a bus share, start the bus's pairs of the token ``x [1, H]`` (weights ``w [1, k]``):
        the accelerator reads their rows from the CPU tier's page-locked stacks, on a side stream
        (CUDA) so that the resident experts run meanwhile. Returns what ``join_bus`` takes."""
        if lx.bus is None:
            return None
        s = self.layers[lx.layer]
        if self.bus_stream is None:
            return self._bus_experts(lx, s, x, w)
        cur = torch.cuda.current_stream(self.device)
        self.bus_stream.wait_stream(cur)
        with torch.cuda.stream(self.bus_stream):
            return self._bus_experts(lx, s, x, w)

    @_guarded
    def join_bus(self, started, out: torch.Tensor) -> None:
        """Add ``start_bus``'s result to ``out [1, H]`` once it is done."""
        if started is None:
            return
        if self.bus_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.bus_stream)
        out.add_(started)

    def _bus_experts(self, lx: LayerExperts, s: _Layer, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if s.bus_stacks is not None:  # a unit split: the bus's units of every CPU-tier pair (no biases)
            return one_token_on(x, self.pair_ids, w.reshape(-1), s.bus_rows, s.bus_stacks, _kept(lx), act=lx.act)
        return one_token_on(x, self.pair_ids, w.reshape(-1), s.bus_rows, lx.cpu_stacks(), _kept(lx),
                            lx.b13[COMPUTE], lx.b2[COMPUTE], lx.act)  # biases (None without): page-locked with the stacks

    @_guarded
    def wait_add(self, lx: LayerExperts, out: torch.Tensor) -> None:
        """Wait for the CPU's result of this step and add it to ``out [1, H]``."""
        s = self.layers[lx.layer]
        if self.cuda:
            _wait_add_kernel[(1,)](s.flag_out, self.step, s.out, out, self.status, s.host, self.hidden,
                                   int(TIMEOUT_S * 1e9), BLOCK_H=min(1024, triton.next_power_of_2(self.hidden)))
            return
        if int(s.host[0]) == 0:
            return
        want = int(self.step[0])
        deadline = time.monotonic() + TIMEOUT_S
        while int(s.flag_out_np[0]) != want:
            if time.monotonic() > deadline:
                self.status.fill_(1)
                return
        out.add_(s.out.to(out.dtype).view_as(out))

    def check(self) -> None:
        """Raise ``ServedError`` if a layer of the steps so far timed out or failed (reads the
        device's status: call after the step's result is needed anyway)."""
        if int(self.status[0]) or self.native.errors():
            raise ServedError(f"the CPU experts' thread did not answer within {TIMEOUT_S:g} s or failed on a "
                              f"packet ({self.native.errors()} failed)")

    def trace(self) -> np.ndarray:
        """The packets the native thread recorded (``WORKBENCH_SERVER_TRACE``), int64 ``[n, 6]``: the
        model layer, the step, the steady clock (ns, ``time.monotonic_ns``'s clock) when the thread saw
        the packet and when it stored the result's flag, the packet's CPU pairs (0: empty) and the
        bus's pairs of that layer and step."""
        t = self.native.trace().numpy().copy()
        order = np.array(list(self.layers), dtype=np.int64)
        if len(t):
            t[:, 0] = order[t[:, 0]]
        return t

    @property
    def bus_pairs(self) -> int:
        """Pairs the accelerator computed from the CPU stacks so far (reads the device)."""
        return int(self.bus_count[0])

    @property
    def served(self) -> int:
        """Packets served so far (one per layer and step)."""
        return int(self.native.served())

    def close(self) -> None:
        """Stop the native thread (it holds the CPU stacks until then)."""
        self._stop()


def direct_publish() -> bool:
    """Whether on CUDA the publish kernel writes each layer's packet and its flag into page-locked
    memory itself, two copies fewer a served layer: on unless ``WORKBENCH_SERVED_DIRECT=0`` (the
    copies). On an H100 host S1 Q8_0 ``frequency`` decoded a step in 3.0 ms this way against 3.4 ms
    with the copies, bf16 in 7.0 against 7.5 ms, and the served token tests passed on CUDA both ways
    (BENCHMARKS.md, thirteenth stop)."""
    return os.environ.get("WORKBENCH_SERVED_DIRECT", "1").strip() != "0"


def trace_capacity() -> int:
    """``WORKBENCH_SERVER_TRACE``: packets the decode server records for ``DecodeServer.trace`` (default
    0: none; each costs two clock reads on the server's thread)."""
    return _env_count("WORKBENCH_SERVER_TRACE", least=0) or 0


def _bus_side_stream() -> bool:
    """``WORKBENCH_SERVED_BUS_STREAM`` (default 1): the bus's experts on a side stream, beside the
    resident ones; 0: after them on the step's stream (for measuring the difference)."""
    return os.environ.get("WORKBENCH_SERVED_BUS_STREAM", "1") != "0"


def split_units(lx: LayerExperts) -> int:
    """The units of each of ``lx``'s CPU-tier experts that the CPU computes in a served decode step: under
    a unit split (``lx.bus_units``, the bus's share, which the engine takes from the cost model's
    ``unit_shares``) ``costmodel.units_for`` of them, the bus computing the rest from the same stacks
    in place; else all (``_ffn``). Experts with biases (gpt-oss) are not split."""
    ffn = _ffn(lx)
    if lx.bus is None or lx.bias or not lx.bus_units > 0:
        return ffn
    return units_for(ffn, float(lx.bus_units), blocks.unit_block(_kept(lx)))


def _kept(lx: LayerExperts) -> tuple[str, str] | None:
    """The formats of ``lx``'s CPU tier's kept blocks, None for float stacks."""
    return lx.kept if lx.kept_cpu is not None else None


def _ffn(lx: LayerExperts) -> int:
    """The experts' intermediate size ``I``."""
    if lx.kept_cpu is not None:
        return lx.k2
    return lx.w2[COMPUTE].shape[2]


def _native_kind(kept: tuple[str, str] | None) -> tuple[int, int, int]:
    """``(kind, f13, f2)`` of the native server's ``add_layer`` for CPU experts kept in the block formats
    ``kept`` (gate/up, down), or float stacks (None)."""
    if kept is None:
        return 0, 0, 0
    if kept[0] == "q8_0":
        return 1, 0, 0
    codes = cpu_kernel.KQUANT_CODES
    return 2, codes[kept[0]], codes[kept[1]]


def _native_stacks(lx: LayerExperts) -> tuple[int, list[torch.Tensor], int, int]:
    """``(kind, stacks, f13, f2)`` of the native server's ``add_layer`` for ``lx``'s CPU tier."""
    kind, f13, f2 = _native_kind(_kept(lx))
    return kind, lx.cpu_stacks(), f13, f2


def _publish_torch(ids: torch.Tensor, w: torch.Tensor, x: torch.Tensor, lx: LayerExperts, s: _Layer, frac: float,
                   slots: int, split: bool = False) -> int:
    """``_publish_kernel`` in torch ops (a CPU accelerator without Triton's interpreter); the bus's pairs."""
    k = ids.shape[0]
    cpu = lx.tier_dev[ids] == COMPUTE
    n = int(cpu.sum())
    row = lx.local_dev[ids]
    if split:
        s.bus_rows.copy_(torch.where(cpu, row, -1))
        s.packet_dev[:k] = torch.where(cpu, row, -1).float()
        m = n
    else:
        m = bus_count(n, frac, slots)
        rank = torch.cumsum(cpu.long(), 0) - 1
        bus = cpu & (rank < m)
        s.bus_rows.copy_(torch.where(bus, row, -1))
        s.packet_dev[:k] = torch.where(cpu & ~bus, row, torch.where(bus, -2, -1)).float()
    s.packet_dev[k:2 * k] = w.float()
    s.packet_dev[2 * k:] = x.float()
    s.host.fill_(n if split else n - m)
    return m
