"""The bus as a second server of the CPU tier's experts in decode steps.

At batch 1 a CPU-tier expert is read once per token where it lies: by the CPU at its RAM read rate,
or over PCIe into the GPU at the bus rate (~55 GB/s pinned on PCIe 5), and the two barely slow each
other until their sum reaches the RAM's bandwidth. So when a token selects ``n`` experts of the CPU
tier in a layer, a ``BusShare`` copies about ``n * fraction`` of them (``costmodel.bus_count``) into a few device slots on a
copy stream while the CPU computes the others, and the GPU computes the copied ones in place
(``gpu_kernels.experts_one_token`` over the slots). Only the selected experts travel; nothing is
cached, so the placement stays what the user chose.

The copies need page-locked host memory: ``register`` pins the CPU tier's existing stacks in place
(``cudaHostRegister``, no copy and no power-of-two rounding), ``unregister`` releases them before the
stacks are freed.

``WORKBENCH_BUS_SHARE``: the fraction of a layer's CPU-selected experts sent over the bus (default
``costmodel.BUS_SHARE``; with a hardware profile, ``fraction_for``: the share that balances the bus's
and the CPU's read rates, which the cost model predicts with); 0 turns the bus share off.

Prefill chunks use the same slots differently: a CPU-tier expert that travels is copied to the GPU
once and computed there for all of its tokens (two halves of the slots alternate, so a batch travels
while the previous one computes). Those that ``fetch_tokens`` or more tokens of the chunk select
always travel; of the others the hottest travel and the coldest stay with the CPU
(``costmodel.prefill_fetch``: the CPU's fused kernel costs a weight read plus what each further
token costs, as calibration measured it or a read per token, a copy about ``(1 - fraction) /
fraction`` reads), and the CPU computes them on its own thread meanwhile.
``WORKBENCH_PREFILL_FETCH_TOKENS`` sets the threshold for measuring other splits; the first batch's
copies are queued before the CPU's share is set up (``WORKBENCH_EARLY_BATCHES=2``: the first two). Device slots:
``costmodel.BUS_SLOTS`` bf16 experts' bytes (151 MB at the Qwen3-30B-A3B shape), which hold that
many float experts or, kept in blocks, as many more as fit (30 in Q8_0, 56 in Q4_K: ``slot_count``);
``WORKBENCH_BUS_SLOTS`` sets another count, for measuring. A prompt's fetched experts are computed
on a stream of their own (``kernel_stream``), so that the resident tier's kernels, queued on the
layer's stream, neither delay the copies nor wait for them.

Experts a GGUF file keeps in its quantized blocks travel as blocks and stay blocks in the slots; the
kernels read them in place, as they read the resident tier's blocks. Nothing is dequantized on the
way: each expert is its copies alone, and consecutive rows of a batch travel in one copy per tensor.
gpt-oss's experts take their biases along (a row of each, copied or read in place beside the
weights) and are computed with its clamped SwiGLU.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import weakref

import numpy as np
import torch

from workbench.core.costmodel import BUS_SHARE as DEFAULT_FRACTION
from workbench.core.costmodel import BUS_SLOTS as SLOTS
from workbench.core.costmodel import PREFILL_FETCH_TOKENS, bus_count

from . import blocks, h2d

log = logging.getLogger(__name__)


def fraction_from_env() -> float:
    """``WORKBENCH_BUS_SHARE`` as a fraction in [0, 1] (default ``DEFAULT_FRACTION``)."""
    raw = os.environ.get("WORKBENCH_BUS_SHARE", "").strip()
    if not raw:
        return DEFAULT_FRACTION
    try:
        return min(1.0, max(0.0, float(raw)))
    except ValueError:
        log.warning("WORKBENCH_BUS_SHARE=%r is not a number; using %.2f", raw, DEFAULT_FRACTION)
        return DEFAULT_FRACTION


def unit_shares_from_env(shares, n_layers: int) -> np.ndarray | None:
    """Served decode's unit split per layer (``Engine.load(unit_shares=...)``): ``WORKBENCH_BUS_UNITS``
    when set, for measuring (``0``: none, whole experts by the bus share; a number in (0, 1): that
    share of each CPU-tier pair's units on the bus in every layer), else ``shares`` (one value per
    layer; None: none) as float64 ``[n_layers]``."""
    raw = os.environ.get("WORKBENCH_BUS_UNITS", "").strip()
    if raw:
        try:
            share = min(1.0, max(0.0, float(raw)))
        except ValueError:
            log.warning("WORKBENCH_BUS_UNITS=%r is not a number; ignored", raw)
        else:
            return None if share <= 0 else np.full(n_layers, share)
    if shares is None:
        return None
    out = np.zeros(n_layers)
    given = np.asarray(shares, dtype=float).reshape(-1)[:n_layers]
    out[:given.size] = np.clip(np.nan_to_num(given), 0.0, 1.0)
    return out


def fraction_for(inventory, profile) -> float:
    """The bus share a loaded ``inventory`` decodes with on the machine ``profile`` describes:
    ``WORKBENCH_BUS_SHARE`` when set (for measuring), else the share that balances the bus's and the
    CPU's reads (``costmodel.model_bus_share``, which the cost model predicts with); the default
    without a profile."""
    from workbench.core.costmodel import model_bus_share

    if os.environ.get("WORKBENCH_BUS_SHARE", "").strip() or profile is None or not profile.gpus:
        return fraction_from_env()
    return model_bus_share(inventory, profile)


def _whole_from_env(name: str, default: int, least: int) -> int:
    """The environment variable ``name`` as a whole number of at least ``least`` (``default`` when
    unset, or, with a warning, when it is not a whole number)."""
    raw = os.environ.get(name, "").strip()
    try:
        return max(least, int(raw)) if raw else default
    except ValueError:
        log.warning("%s=%r is not a whole number; using %d", name, raw, default)
        return default


def fetch_tokens_from_env() -> int:
    """``WORKBENCH_PREFILL_FETCH_TOKENS``: how many of a prompt chunk's tokens must select a CPU-tier
    expert for it to be fetched to the GPU (default ``costmodel.PREFILL_FETCH_TOKENS``, which the
    cost model predicts with; for measuring other splits)."""
    return _whole_from_env("WORKBENCH_PREFILL_FETCH_TOKENS", PREFILL_FETCH_TOKENS, 1)


def early_batches_from_env() -> int:
    """``WORKBENCH_EARLY_BATCHES``: how many of a prompt layer's fetched batches are queued before the
    CPU's share is set up (1, the measured default; 2, one in each half of the slots, for measuring)."""
    return min(2, _whole_from_env("WORKBENCH_EARLY_BATCHES", 1, 1))


def slots_from_env() -> int:
    """``WORKBENCH_BUS_SLOTS``: device slots of the bus share (default ``SLOTS``; at least 2, one per
    half of a prompt's batches; for measuring other counts)."""
    return _whole_from_env("WORKBENCH_BUS_SLOTS", SLOTS, 2)


def register(t: torch.Tensor) -> bool:
    """Page-lock the host memory of ``t`` in place (CUDA's ``cudaHostRegister``); False if refused."""
    if t is None or t.numel() == 0 or t.device.type != "cpu" or t.is_pinned():
        return False
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    if int(err) != 0:
        log.warning("could not page-lock %.1f MB of expert weights (CUDA error %d): the bus share is off for them",
                    t.numel() * t.element_size() / 1e6, int(err))
        return False
    return True


def unregister(t: torch.Tensor) -> None:
    """Undo ``register`` (before ``t``'s memory is freed)."""
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


def _unregister_all(registered: dict[int, list[torch.Tensor]], device: torch.device) -> None:
    """Release every page lock in ``registered`` (which keeps the stacks alive until then). A range
    left registered after its memory is freed makes later copies from memory mapped there fail
    with "invalid argument", so this also runs when a share is dropped without ``close``."""
    if not any(registered.values()):
        registered.clear()
        return
    with contextlib.suppress(Exception):  # at interpreter exit CUDA may be gone already
        torch.cuda.synchronize(device)  # no copy from them still in flight
    for owner in list(registered):
        for t in registered.pop(owner):
            with contextlib.suppress(Exception):
                unregister(t)


def runs(rows: np.ndarray) -> list[tuple[int, int]]:
    """``[(j0, j1), ...]``: the pieces ``rows[j0:j1]`` of consecutive values (each one more than the last)."""
    rows = np.asarray(rows, dtype=np.int64)
    if not rows.size:
        return []
    cuts = (np.nonzero(np.diff(rows) != 1)[0] + 1).tolist()
    return list(zip([0, *cuts], [*cuts, rows.size]))


def copy_table(native: list[tuple[tuple[int, int], tuple[int, int]]], base: int, rows: np.ndarray
               ) -> tuple[list[int], list[int], list[int]]:
    """``(device addresses, host addresses, bytes)`` of the copies that load rows ``rows`` of host stacks
    into slots ``base``, ``base + 1``, ...: for each ``((slots address, row bytes), (stack address,
    row bytes))`` of ``native``, one copy per run of consecutive rows (``runs``), tensor by tensor."""
    rows = np.asarray(rows, dtype=np.int64)
    spans = np.array(runs(rows), dtype=np.int64).reshape(-1, 2)
    first, n = spans[:, 0], spans[:, 1] - spans[:, 0]
    dst, src, size = [], [], []
    for (d, row), (s, _) in native:
        dst += (d + (base + first) * row).tolist()
        src += (s + rows[first] * row).tolist()
        size += (n * row).tolist()
    return dst, src, size


def slot_shapes(shape13: tuple[int, int], shape2: tuple[int, int], dtype: torch.dtype,
                kept: tuple | None = None, bias: bool = False) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """``(shape, dtype)`` of one expert in each of a slot set's tensors: float ``[2I, H]``, ``[H, I]``
    in ``dtype`` (``kept`` None), or the blocks of layout ``kept`` (``LayerExperts.kept_layout``);
    with ``bias`` (gpt-oss) then its biases ``[2I]``, ``[H]`` in ``dtype``, which travel with it."""
    if kept is None:
        out = [(tuple(shape13), dtype), (tuple(shape2), dtype)]
    else:
        (f13, f2), _, k13, k2 = kept
        parts = blocks.alloc(f13, (), shape13[0], k13, "meta") + blocks.alloc(f2, (), shape2[0], k2, "meta")
        out = [(tuple(t.shape), t.dtype) for t in parts]
    return out + ([((shape13[0],), dtype), ((shape2[0],), dtype)] if bias else [])


def slot_bytes(shape13: tuple[int, int], shape2: tuple[int, int], dtype: torch.dtype, kept: tuple | None = None,
               bias: bool = False) -> int:
    """Bytes of one slot of layout ``kept`` (one expert's tensors, ``slot_shapes``)."""
    return sum(math.prod(shape) * torch.empty((), dtype=dt).element_size()
               for shape, dt in slot_shapes(shape13, shape2, dtype, kept, bias))


@functools.lru_cache(maxsize=64)
def slot_count(slots: int, shape13: tuple[int, int], shape2: tuple[int, int], dtype: torch.dtype,
               kept: tuple | None = None, bias: bool = False) -> int:
    """Slots of layout ``kept`` (see ``slot_shapes``) for a share of ``slots`` float slots: as many of
    its experts as fit in the bytes of ``slots`` float ones (at least ``slots``): 30 Q8_0 experts for
    16 bf16 ones, 56 Q4_K. A prompt's fetched experts travel half the slots at a time, and each batch
    costs the host about the same (two kernel launches, events), so smaller experts travel in
    bigger batches, not in more of them."""
    own = slot_bytes(shape13, shape2, dtype, kept, bias)
    return max(slots, slots * slot_bytes(shape13, shape2, dtype, None, bias) // max(1, own))


class BusShare:
    """Device slots for experts fetched over the bus in one decode step, shared by every layer (a
    layer's copies start after its routing is known, so the previous layer's kernel has finished
    reading the slots). ``shape13 = (2I, H)``, ``shape2 = (H, I)``.

    The slots hold an expert as its CPU stacks hold it: float ``[w13, w2]`` rows, or a kept layout's
    blocks (``LayerExperts.kept_layout``), which the kernels read in place. One set of slots per
    layout the layers bring (``slot_stacks``): a Q4_K_M file whose down matrices are Q4_K in some
    layers and Q6_K in others has two. gpt-oss's experts bring their biases along (``bias``): the
    last two tensors of their stacks and slots."""

    def __init__(self, device: torch.device, dtype: torch.dtype, n_experts: int, shape13: tuple[int, int],
                 shape2: tuple[int, int], fraction: float, slots: int | None = None):
        slots = slots_from_env() if slots is None else slots
        self.device, self.dtype, self.fraction, self.slots = device, dtype, fraction, slots
        self.shape13, self.shape2 = shape13, shape2
        self.cuda = device.type == "cuda"  # elsewhere (tests: Triton's interpreter) the copies are plain
        self.map_host = torch.full((n_experts,), -1, dtype=torch.int64, pin_memory=self.cuda)
        self._map_np = self.map_host.numpy()  # the same memory, written without per-item tensor calls
        self.map_dev = torch.full((n_experts,), -1, dtype=torch.int64, device=device)
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.kernel_stream = torch.cuda.Stream(device) if self.cuda else None  # a prompt's fetched experts
        self.done = torch.cuda.Event() if self.cuda else None
        self.ready = [torch.cuda.Event() for _ in range(2)] if self.cuda else None  # prefill: two halves
        self.free = [torch.cuda.Event() for _ in range(2)] if self.cuda else None
        self.fetch_tokens = fetch_tokens_from_env()
        self.early_batches = early_batches_from_env()
        self._slots: dict[tuple | None, list[torch.Tensor]] = {}
        self._set = np.zeros(0, dtype=np.int64)
        self.registered: dict[int, list[torch.Tensor]] = {}  # by id() of the owner (a LayerExperts)
        self._release_all = weakref.finalize(self, _unregister_all, self.registered, device)
        self.copied = 0  # experts sent over the bus so far
        self.batches = 0  # prompt batches fetched so far
        self.copy_calls = 0  # host-to-GPU copies queued so far
        self._copier: h2d.Copier | bool | None = None  # None: not tried yet; False: torch's copies

    @property
    def nbytes(self) -> int:
        """Device bytes of the slots (of every layout made so far)."""
        return sum(t.numel() * t.element_size() for ts in self._slots.values() for t in ts)

    def slot_stacks(self, kept: tuple | None = None, bias: bool = False) -> list[torch.Tensor]:
        """The slots of layout ``kept`` (None: float), shaped as the CPU stacks, ``[n, ...]`` each (``n``:
        ``slot_count``, ``slots`` for float):
        float ``[w13, w2]``, Q8_0 ``[q13, d13, q2, d2]``, k-quants and MXFP4 ``[b13, b2]``; with
        ``bias``, then the biases ``[slots, 2I]``, ``[slots, H]``. Made on first use."""
        stacks = self._slots.get((kept, bias))
        if stacks is None:
            n = slot_count(self.slots, self.shape13, self.shape2, self.dtype, kept, bias)
            stacks = self._slots[(kept, bias)] = [
                torch.empty((n, *shape), dtype=dt, device=self.device)
                for shape, dt in slot_shapes(self.shape13, self.shape2, self.dtype, kept, bias)]
        return stacks

    def weight_slots(self, kept: tuple | None = None, bias: bool = False
                     ) -> tuple[list[torch.Tensor], torch.Tensor | None, torch.Tensor | None]:
        """``slot_stacks(kept, bias)`` as the kernels take them: ``(weight slots, b13 slots, b2 slots)``,
        the biases None without ``bias``."""
        stacks = self.slot_stacks(kept, bias)
        return (stacks[:-2], stacks[-2], stacks[-1]) if bias else (stacks, None, None)

    def share(self, n: int) -> int:
        """How many of ``n`` CPU-selected experts of one token go over the bus (``costmodel.bus_count``)."""
        return bus_count(n, self.fraction, self.slots)

    def pin(self, owner, stacks: list[torch.Tensor], kept: tuple | None = None, bias: bool = False) -> bool:
        """Page-lock ``owner``'s CPU-tier ``stacks``; True when all of them are (then it may share).
        ``kept``: ``LayerExperts.kept_layout()`` when the stacks are kept quantized blocks: the slots
        then hold that layout's blocks (half of bf16's bytes for Q8_0, about a quarter for Q4_K).
        ``bias``: the last two of ``stacks`` are the experts' biases (``LayerExperts.bus_stacks``)."""
        self.slot_stacks(kept, bias)
        if not self.cuda:
            return True
        ok = True
        mine = self.registered.setdefault(id(owner), [])
        for t in stacks:
            if t is None or t.numel() == 0:
                continue
            if register(t):
                mine.append(t)
            else:
                ok = ok and t.is_pinned()
        return ok

    def release(self, owner) -> None:
        """Undo ``pin`` for ``owner`` (its stacks are about to be dropped)."""
        mine = self.registered.pop(id(owner), [])
        if mine:
            torch.cuda.synchronize(self.device)  # no copy from them still in flight
        for t in mine:
            unregister(t)

    @property
    def pinned_bytes(self) -> int:
        """Host bytes page-locked by ``pin``."""
        return sum(t.numel() * t.element_size() for ts in self.registered.values() for t in ts)

    def _load(self, base: int, rows: np.ndarray, src: list[torch.Tensor], kept: tuple | None = None,
              bias: bool = False) -> None:
        """Queue on the current stream the copies of rows ``rows`` of the pinned host stacks ``src``
        (float, or kept blocks of layout ``kept``) into slots ``base``, ``base + 1``, ..., as they are:
        one copy per tensor for each run of consecutive rows (a prompt's batch is often one run)."""
        pairs = list(zip(self._slots[(kept, bias)], src, strict=True))
        native = self._native_rows(pairs) if self.cuda else None
        if native is not None and all(n is not None for n in native):  # every copy through the driver
            table = copy_table(native, base, rows)
            self._copier.many(*table)
            self.copy_calls += len(table[0])
            return
        for j0, j1 in runs(rows):
            r = int(rows[j0])
            for i, (dst, t) in enumerate(pairs):
                if native is not None and native[i] is not None:
                    self._copier.rows(native[i][0], base + j0, native[i][1], r, j1 - j0)
                else:
                    dst[base + j0:base + j1].copy_(t[r:r + j1 - j0], non_blocking=True)
                self.copy_calls += 1

    def _native_rows(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list | None:
        """For each ``(slots, host stack)`` pair, their ``h2d.rows_of`` when the driver can copy between
        them (both contiguous, the same bytes per row), else None; None for all without the driver or
        a CUDA context on this thread (``h2d.Copier``, made on first use, queues on the bus's stream)."""
        if self._copier is None:
            self._copier = h2d.Copier(self.stream) if h2d.available() else False
        if not self._copier or not h2d.available():
            return None
        out = []
        for dst, t in pairs:
            a, b = h2d.rows_of(dst), h2d.rows_of(t)
            out.append((a, b) if a is not None and b is not None and a[1] == b[1] else None)
        return out

    def run(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: np.ndarray,
            rows: np.ndarray, src: list[torch.Tensor], kept: tuple | None = None, bias: bool = False,
            act: tuple = ("silu",)) -> torch.Tensor:
        """Copy experts ``experts`` (host ids; their rows ``rows`` of the pinned host stacks ``src``,
        with ``kept`` their layout if they are kept blocks and ``bias`` if their biases come last, see
        ``_load``) into the slots on the copy stream and queue, on the current stream after the copies,
        their weighted sum for the token ``x [1, H]`` with routing ``ids``/``weights`` ``[k]`` on the
        device and activation ``act``: ``[1, H]`` (pairs of other experts read nothing). Does not wait."""
        from .experts import one_token_on

        m = self._map_np  # the previous step's copy of the map finished before this step's routing
        m[self._set] = -1
        self._set = np.asarray(experts, dtype=np.int64)
        m[self._set] = np.arange(len(self._set))

        def then():
            self.map_dev.copy_(self.map_host, non_blocking=True)

        # a prefill's grouped kernels may still read the slots
        self._copy_in(0, rows, src, kept, self.free, self.done, then, bias)
        slots, b13, b2 = self.weight_slots(kept, bias)
        return one_token_on(x, ids, weights, self.map_dev, slots, None if kept is None else kept[0], b13, b2, act)

    def _copy_in(self, base: int, rows: np.ndarray, src: list[torch.Tensor], kept: tuple | None, after: list,
                 done, then=None, bias: bool = False) -> None:
        """On the copy stream, once the events ``after`` are reached: load rows ``rows`` of ``src`` into
        slots ``base``, ``base + 1``, ..., run ``then()``, record ``done``; the current stream waits for
        ``done``. Without CUDA the same work, in order."""
        if not self.cuda:
            self._load(base, rows, src, kept, bias)
            if then is not None:
                then()
            self.copied += len(rows)
            return
        cur = torch.cuda.current_stream(self.device)  # once: each call costs ~10 µs of host time
        torch.cuda.set_stream(self.stream)
        try:
            for ev in after:
                self.stream.wait_event(ev)
            self._load(base, rows, src, kept, bias)
            if then is not None:
                then()
            done.record(self.stream)
        finally:
            torch.cuda.set_stream(cur)
        cur.wait_event(done)
        self.copied += len(rows)

    def fetch(self, half: int, experts: np.ndarray, rows: np.ndarray, src: list[torch.Tensor],
              kept: tuple | None = None, bias: bool = False) -> int:
        """Prefill: copy experts (rows ``rows`` of the pinned stacks ``src``, of layout ``kept``; at most
        ``half_slots(kept, bias)`` of them) into half ``half`` (0 or 1) of that layout's slots on the copy
        stream, once the kernels that read that half before are done (``done_with``); the current
        stream waits for the copies. Returns the first slot. Alternating halves lets one batch travel
        while the previous one computes."""
        base = self.half_base(half, kept, bias)
        self.batches += 1
        self._copy_in(base, rows, src, kept, self.free[half:half + 1] if self.cuda else [],
                      self.ready[half] if self.cuda else None, bias=bias)
        return base

    def half_base(self, half: int, kept: tuple | None = None, bias: bool = False) -> int:
        """The first slot of prefill half ``half`` (0 or 1) in the slots of layout ``kept``."""
        n = self.half_slots(kept, bias)
        return half * n if 2 * n <= self.slots_of(kept, bias) else 0

    def done_with(self, half: int) -> None:
        """The kernels queued so far on the current stream are the last readers of ``half``."""
        if self.cuda:
            self.free[half].record(torch.cuda.current_stream(self.device))

    def slots_of(self, kept: tuple | None = None, bias: bool = False) -> int:
        """How many experts of layout ``kept`` the slots hold (``slot_count``)."""
        return slot_count(self.slots, self.shape13, self.shape2, self.dtype, kept, bias)

    def half_slots(self, kept: tuple | None = None, bias: bool = False) -> int:
        """Experts of layout ``kept`` per prefill batch."""
        return max(1, self.slots_of(kept, bias) // 2)

    def close(self) -> None:
        """Release every page lock (the engine calls this before freeing the stacks)."""
        self._release_all()
