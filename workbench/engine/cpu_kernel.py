"""A fused C++ kernel for the routed experts the CPU computes, built on first use.

At batch 1 an expert is a pair of matrix-vector products whose time is its weight bytes over the
bandwidth the code reaches; five torch ops per expert (``F.linear``, ``silu``, ``mul``, ``F.linear``,
``add``) reach a third of what RAM gives. ``moe_decode`` does all selected experts of a layer in one
call: one parallel pass over the gate+up rows of every selected expert, one over the output rows
of the down projections, f32 accumulation, the GIL released while it runs. A prompt's pairs go
through the same call (``x [T, H]`` with a token per pair): each weight row is read once and dotted
with every token that selected its expert, so an expert few tokens pick costs about one read.

The extension (``csrc/moe_decode.cpp``) is compiled with ``torch.utils.cpp_extension`` the first
time ``available()`` is called (tens of seconds) into
``<user cache>/moe-workbench/torch_ext/<hash>``, keyed by the source, the torch and Python versions,
the compiler flags and the CPU's features (``-march=native`` code must not run on another CPU).
Any failure (no C++ compiler, no ninja, no Python headers, a build error) logs one warning and
leaves ``available()`` False for the life of the process; ``WORKBENCH_CPU_KERNEL=0`` disables it.
Importing this module builds nothing.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import sysconfig
import threading
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import torch

log = logging.getLogger(__name__)

ENV_SWITCH = "WORKBENCH_CPU_KERNEL"
"""Set to ``0`` (or ``false``/``no``/``off``) to never build or use the kernel."""
ENV_BUILD_DIR = "WORKBENCH_CPU_KERNEL_DIR"
"""Optional root for the build directories instead of the user cache (the timing script uses it to
measure a first build)."""

SOURCE = Path(__file__).parent / "csrc" / "moe_decode.cpp"
HEADERS = (Path(__file__).parent / "csrc" / "int8_dots.h",)
ENV_MARCH = "WORKBENCH_CPU_KERNEL_MARCH"
"""A ``-march`` for the build instead of ``native`` (e.g. ``haswell``: the AVX2 code paths, which the
tests check on an AVX-512 machine too)."""
ENV_INT8 = "WORKBENCH_CPU_INT8_DOT"
"""Set to ``0`` to keep experts kept as Q8_0 / Q4_K / Q5_K / Q6_K blocks on the exact float dots (``int8_dots``)."""

_lock = threading.Lock()
_module = None  # the loaded extension
_failed: str | None = None  # why it is unavailable, once known


def available() -> bool:
    """Whether the fused kernel can run here, building it on the first call (thread-safe; never raises).

    The first call may take tens of seconds (compilation) or a fraction of a second (a cached
    build). A failure is logged once as a warning with its reason; later calls return False at once.
    """
    return _load() is not None


def unavailable_reason() -> str | None:
    """Why ``available()`` returned False (None when it returned True or was not called yet)."""
    return _failed


ACTIVATIONS = {"silu": 0, "clamped_swiglu": 1}
"""The experts' activations the kernel computes (``experts.activate``'s names) -> its codes."""


def moe_decode(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, rows: torch.Tensor | np.ndarray,
               weights: torch.Tensor | np.ndarray, background: int = 0,
               tokens: torch.Tensor | np.ndarray | None = None, b13: torch.Tensor | None = None,
               b2: torch.Tensor | None = None, act: tuple = ("silu",), out: torch.Tensor | None = None) -> torch.Tensor:
    """Weighted sum of the selected SwiGLU experts for one token (or for each token of a prompt), on
    the CPU.

    ``out = sum_j weights[j] * w2[rows[j]] @ (silu(g_j) * u_j)`` with ``[g_j; u_j] = w13[rows[j]] @ x``
    (``g_j`` the first ``I`` rows); with a 2-D ``x``, pair ``j`` reads and adds to row ``tokens[j]``.
    gpt-oss's experts: biases ``b13`` (added to ``[g_j; u_j]``) and ``b2`` (to the down projection,
    before the weight) and ``act=("clamped_swiglu", alpha, limit)``, as ``experts.activate``.

    Args:
        x: ``[H]``, or ``[T, H]`` with ``tokens``; bfloat16, float16 or float32 (made contiguous if needed).
        w13: ``[E, 2I, H]`` fused gate (first ``I`` rows) and up projections, bfloat16, float16 or
            float32, contiguous, on the CPU.
        w2: ``[E, H, I]`` down projections, the dtype of ``w13``, contiguous, on the CPU.
        rows: ``[n]`` indices into ``E`` (int64 tensor or array; repeats allowed, ``n`` may be 0).
        weights: ``[n]`` per-expert weights (converted to float32).
        background: 0 to run on this thread; else the run starts on the extension's own thread on
            ``background`` threads and this returns at once: the result is valid after ``wait()``
            (one background run at a time; the weights must stay alive, and ``x`` unchanged, until then:
            ``x``'s float copy and the zeroed result are made there too).
        tokens: ``[n]`` int64 rows of a 2-D ``x`` (one per pair); None for a 1-D ``x``.
        b13, b2: ``[E, 2I]`` and ``[E, H]`` float32 expert biases (both or neither), contiguous.
        act: ``("silu",)`` or ``("clamped_swiglu", alpha, limit)`` (``ACTIVATIONS``).
        out: where the result goes instead of a new tensor: float32, contiguous, ``T * H`` values
            (any shape), on the CPU, e.g. a page-locked buffer; overwritten (a background run zeroes it
            on its own thread) and returned.

    Returns:
        ``[H]`` (or ``[T, H]``) float32, accumulated in float32 throughout (``out`` when given).

    Runs on the intra-op threads of the calling thread, like any torch op: a thread takes
    ``torch.set_num_threads``' value when it first runs a parallel op and changes it only by
    calling ``torch.set_num_threads`` itself (so set it in a worker thread's initializer). The
    first call builds the extension if ``available()`` was not called before.

    Raises:
        RuntimeError: the kernel is unavailable (check ``available()`` first), or shapes, dtypes or
            rows are invalid (checked before any weight is read).
    """
    mod = _load()
    if mod is None:
        raise RuntimeError(f"the fused CPU decode kernel is unavailable: {_failed}")
    import torch

    rows = torch.as_tensor(rows, dtype=torch.int64)
    weights = torch.as_tensor(weights).to(torch.float32)
    _check(x, w13, w2, rows, weights)
    tokens = _tokens(x, tokens, rows, lambda msg: _raise("moe_decode", msg))
    extra = act_args(act, b13, b2, "moe_decode")
    dest = _dest(out, x, lambda msg: _raise("moe_decode", msg))
    return _start(lambda bg: mod.moe_decode(x.contiguous(), w13, w2, rows, weights, bg, tokens, *extra, **dest),
                  background)


def moe_decode_q8(x: torch.Tensor, q13: torch.Tensor, d13: torch.Tensor, q2: torch.Tensor, d2: torch.Tensor,
                  rows: torch.Tensor | np.ndarray, weights: torch.Tensor | np.ndarray, background: int = 0,
                  tokens: torch.Tensor | np.ndarray | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``moe_decode`` for experts kept in GGUF's Q8_0 blocks (``value = d * q`` per 32 values along
    the input axis), read as they are: half the bytes of bf16.

    Args:
        x: ``[H]``, or ``[T, H]`` with ``tokens``; bfloat16, float16 or float32.
        q13: ``[E, 2I, H]`` int8 and ``d13``: ``[E, 2I, H/32]`` float16: gate (first ``I`` rows) and up.
        q2: ``[E, H, I]`` int8 and ``d2``: ``[E, H, I/32]`` float16: down. ``H`` and ``I`` multiples of 32,
            all contiguous, on the CPU.
        rows, weights, background, tokens, out: as in ``moe_decode``.

    Returns ``[H]`` (or ``[T, H]``) float32. Raises RuntimeError as ``moe_decode`` does.
    """
    import torch

    mod, rows, weights, fail = _prepare("moe_decode_q8", rows, weights)
    if not all(t.device.type == "cpu" for t in (x, q13, d13, q2, d2, rows, weights)):
        fail("every tensor must be on the CPU")
    if q13.dim() != 3 or q2.dim() != 3 or q13.dtype != torch.int8 or q2.dtype != torch.int8:
        fail(f"q13 must be int8 [E, 2I, H] and q2 int8 [E, H, I], got {q13.dtype} {list(q13.shape)} and "
             f"{q2.dtype} {list(q2.shape)}")
    E, ffn, H = q13.shape[0], q13.shape[1] // 2, q13.shape[2]
    if q13.shape[1] != 2 * ffn or ffn % 32 or H % 32 or ffn <= 0 or H <= 0 or tuple(q2.shape) != (E, H, ffn):
        fail(f"q13 must be [E, 2I, H] and q2 [E, H, I] with H and I multiples of 32, got {list(q13.shape)} and "
             f"{list(q2.shape)}")
    if (tuple(d13.shape) != (E, 2 * ffn, H // 32) or tuple(d2.shape) != (E, H, ffn // 32)
            or d13.dtype != torch.float16 or d2.dtype != torch.float16):
        fail(f"d13 must be float16 [{E}, {2 * ffn}, {H // 32}] and d2 float16 [{E}, {H}, {ffn // 32}]")
    if not all(t.is_contiguous() for t in (q13, d13, q2, d2)):
        fail("the weight stacks must be contiguous")
    if x.dim() not in (1, 2) or x.shape[-1] != H or str(x.dtype) not in _FLOATS:
        fail(f"x must be bfloat16, float16 or float32 [H] or [T, H] with H = {H}, got {x.dtype} {list(x.shape)}")
    _check_rows(rows, weights, E, fail)
    tokens = _tokens(x, tokens, rows, fail)
    dest = _dest(out, x, fail)
    return _start(lambda bg: mod.moe_decode_q8(x.contiguous(), q13, d13, q2, d2, rows, weights, bg, tokens, **dest),
                  background)


def _dest(out, x, fail) -> dict:
    """The extension's ``out`` keyword: the destination, checked against ``x`` (``[H]`` or ``[T, H]``)
    here (an error raised inside the extension crashed the process with PyTorch 2.11 on Python 3.12),
    or an empty tensor (none: the extension makes the result; its bindings take no None)."""
    import torch

    if out is None:
        return {"out": torch.empty(0)}
    if (out.dtype != torch.float32 or not out.is_contiguous() or out.device.type != "cpu"
            or out.numel() != x.numel() or out.numel() == 0):
        fail(f"out must be float32, contiguous, on the CPU, with {x.numel()} values, got {out.dtype} "
             f"{list(out.shape)} on {out.device}")
    return {"out": out}


def _prepare(name: str, rows, weights):
    """The extension (or RuntimeError), ``rows`` as int64 and ``weights`` as float32 tensors, and a
    ``fail(message)`` that raises RuntimeError naming ``name``."""
    mod = _load()
    if mod is None:
        raise RuntimeError(f"the fused CPU decode kernel is unavailable: {_failed}")
    import torch

    def fail(msg: str):
        _raise(name, msg)

    return mod, torch.as_tensor(rows, dtype=torch.int64), torch.as_tensor(weights).to(torch.float32), fail


def _raise(name: str, msg: str):
    raise RuntimeError(f"{name}: {msg}")


_NO_TOKENS: list = []  # one empty int64 tensor: a 1-D x's tokens


def _tokens(x: torch.Tensor, tokens, rows: torch.Tensor, fail) -> torch.Tensor:
    """``tokens`` as int64 ``[n]`` checked against a 2-D ``x``; an empty tensor for a 1-D ``x``."""
    import torch

    if x.dim() == 1:
        if tokens is not None:
            fail("tokens are for a 2-D x [T, H]")
        if not _NO_TOKENS:
            _NO_TOKENS.append(torch.empty(0, dtype=torch.int64))
        return _NO_TOKENS[0]
    if tokens is None:
        fail(f"a 2-D x {list(x.shape)} needs tokens, one per pair")
    tokens = torch.as_tensor(tokens, dtype=torch.int64)
    if tokens.dim() != 1 or tokens.shape[0] != rows.shape[0]:
        fail(f"tokens must be int64 [n] with n = len(rows) = {rows.shape[0]}, got {list(tokens.shape)}")
    if tokens.numel() and not (0 <= int(tokens.min()) and int(tokens.max()) < x.shape[0]):
        fail(f"tokens must lie in [0, {x.shape[0]})")
    return tokens.contiguous()


def _check_rows(rows, weights, E: int, fail) -> None:
    if rows.dim() != 1 or weights.dim() != 1 or weights.shape[0] != rows.shape[0]:
        fail(f"rows must be int64 [n] and weights float32 [n], got {list(rows.shape)} and {list(weights.shape)}")
    for j, r in enumerate(rows.tolist()):
        if not 0 <= r < E:
            fail(f"rows[{j}] = {r} is outside [0, {E})")


KQUANT_CODES = {"q4_k": 0, "q6_k": 1, "q5_k": 2, "q2_k": 3, "q3_k": 4, "iq4_xs": 5, "mxfp4": 6}
"""The native kernel's codes of the raw-block formats it reads in place (``moe_decode_q4k``, the server)."""


def act_args(act: tuple, b13=None, b2=None, name: str = "moe_decode") -> tuple:
    """``(b13, b2, code, alpha, limit)`` as the native entry points (and the decode server's
    ``add_layer``) take an activation (``ACTIVATIONS``) and expert biases (empty tensors: none).
    Raises RuntimeError naming ``name`` for an activation the kernel does not compute."""
    import torch

    if act[0] not in ACTIVATIONS:
        _raise(name, f"unknown activation {act[0]!r}; the kernel computes {', '.join(ACTIVATIONS)}")
    code = ACTIVATIONS[act[0]]
    alpha, limit = (float(act[1]), float(act[2])) if code else (1.0, 0.0)
    none = torch.empty(0)
    return (none if b13 is None else b13), (none if b2 is None else b2), code, alpha, limit


def moe_decode_q4k(x: torch.Tensor, b13: torch.Tensor, b2: torch.Tensor, rows: torch.Tensor | np.ndarray,
                   weights: torch.Tensor | np.ndarray, fmt13: str = "q4_k", fmt2: str = "q4_k",
                   background: int = 0, tokens: torch.Tensor | np.ndarray | None = None,
                   bias13: torch.Tensor | None = None, bias2: torch.Tensor | None = None,
                   act: tuple = ("silu",), out: torch.Tensor | None = None) -> torch.Tensor:
    """``moe_decode`` for experts kept as raw GGUF blocks, read as they are: Q4_K (super-blocks of
    256 values in 144 bytes, 4.5 bits a value), Q5_K (176 bytes, 5.5 bits), Q6_K (210 bytes, 6.6
    bits), Q3_K (110 bytes, 3.4 bits), Q2_K (84 bytes, 2.6 bits), IQ4_XS (136 bytes, 4.25 bits) or
    MXFP4 (blocks of 32 values in 17 bytes, 4.25 bits), chosen per matrix (``fmt13`` for gate and
    up, ``fmt2`` for down: Q4_K_M and Q5_K_M files store some down matrices as Q6_K).

    Args:
        x: ``[H]``, or ``[T, H]`` with ``tokens``; bfloat16, float16 or float32.
        b13: ``[E, 2I, blocks.row_bytes(fmt13, H)]`` uint8: the gate (first ``I`` rows) and up rows' raw
            blocks.
        b2: ``[E, H, blocks.row_bytes(fmt2, I)]`` uint8: the down rows'. ``H`` and ``I`` multiples of the
            formats' blocks (256; MXFP4 32), contiguous.
        rows, weights, background, tokens, out: as in ``moe_decode``.
        bias13, bias2, act: the experts' biases and activation, as ``moe_decode``'s ``b13``, ``b2``,
            ``act`` (gpt-oss).

    Returns ``[H]`` (or ``[T, H]``) float32. Raises RuntimeError as ``moe_decode`` does.
    """
    import torch

    from .blocks import RAW, row_bytes

    mod, rows, weights, fail = _prepare("moe_decode_q4k", rows, weights)
    if fmt13 not in RAW or fmt2 not in RAW:
        fail(f"formats must be k-quants (q2_k ... q6_k), iq4_xs or mxfp4, got {fmt13} and {fmt2}")
    v13, v2 = RAW[fmt13][0], RAW[fmt2][0]
    if not all(t.device.type == "cpu" for t in (x, b13, b2, rows, weights)):
        fail("every tensor must be on the CPU")
    H = x.shape[-1] if x.dim() in (1, 2) else -1
    if H <= 0 or H % v13 or str(x.dtype) not in _FLOATS:
        fail(f"x must be bfloat16, float16 or float32 [H] or [T, H] with H a multiple of {v13}, got {x.dtype} "
             f"{list(x.shape)}")
    if b13.dim() != 3 or b2.dim() != 3 or b13.dtype != torch.uint8 or b2.dtype != torch.uint8:
        fail(f"b13 and b2 must be uint8 [E, 2I, row bytes of H] and [E, H, row bytes of I], got {list(b13.shape)} "
             f"and {list(b2.shape)}")
    E, ffn = b13.shape[0], b13.shape[1] // 2
    if (ffn <= 0 or ffn % v2 or tuple(b13.shape) != (E, 2 * ffn, row_bytes(fmt13, H))
            or tuple(b2.shape) != (E, H, row_bytes(fmt2, ffn))):
        fail(f"b13 must be [E, 2I, {row_bytes(fmt13, H)}] and b2 [E, {H}, row bytes of I] with I a multiple of "
             f"{v2}, got {list(b13.shape)} and {list(b2.shape)}")
    if not (b13.is_contiguous() and b2.is_contiguous()):
        fail("the weight stacks must be contiguous")
    _check_rows(rows, weights, E, fail)
    tokens = _tokens(x, tokens, rows, fail)
    extra = act_args(act, bias13, bias2, "moe_decode_q4k")
    codes = KQUANT_CODES
    dest = _dest(out, x, fail)
    return _start(lambda bg: mod.moe_decode_kq(x.contiguous(), b13, codes[fmt13], b2, codes[fmt2], ffn, rows,
                                               weights, bg, tokens, *extra, **dest), background)


def int8_dots(on: bool | None = None) -> bool:
    """Whether experts kept as Q8_0 / Q4_K / Q5_K / Q6_K blocks take the integer dots: each input (a token's hidden
    state, a pair's activations) rounded to int8 per 32 values (``dx = max|x| / 127``, as llama.cpp
    rounds its inputs for its own CPU dots), then multiplied by the weights' integers with AVX512-VNNI
    (or AVX2): 1.1-2x the float dots' speed per core, at 0.3-1% relative error on an expert's output.
    ``on`` switches them for the whole process (the decode server too); ``WORKBENCH_CPU_INT8_DOT=0``
    starts with them off. False where the build lacks AVX-512 with VNNI and AVX2, or the kernel is
    unavailable."""
    mod = _load()
    if mod is None:
        return False
    if on is not None:
        mod.set_int8_dots(bool(on))
    return bool(mod.int8_dots())


def server(threads: int, spin_us: int = 2000, own_team: bool = False, idle_us: int = 20000, chunks: int = 1):
    """A native decode server (``csrc/moe_decode.cpp``, ``Server``): a thread that computes the CPU
    experts of one-token steps from packets the accelerator copies into page-locked memory, polling
    their flags (``served.DecodeServer`` drives it). ``threads``: its parallel passes' threads;
    ``spin_us``: how long it (and its team) keeps spinning after the last packet before it sleeps.
    ``own_team``: the passes run on the server's own spinning threads (``SpinTeam``); False: on
    torch's OpenMP pool, whose workers may sleep between packets. ``idle_us``: after that long
    without a packet the thread stops polling every 50 µs and waits for ``wake()`` (or 1 ms).
    ``chunks``: parts per thread of each pass on its own team (1: one contiguous part each; more:
    taken in turn, so that a thread slowed by its core's neighbour takes fewer; process-wide).

    Raises RuntimeError when the kernel is unavailable."""
    mod = _load()
    if mod is None:
        raise RuntimeError(f"the fused CPU decode kernel is unavailable: {_failed}")
    mod.set_team_chunks(int(chunks))
    return mod.Server(int(threads), int(spin_us), bool(own_team), int(idle_us))


_background = threading.Lock()
"""Held from a background start to its ``wait``: the extension runs one background job at a time, so
a second thread's start waits here instead of replacing the first thread's job."""


def _start(call, background: int):
    """``call(threads)`` on this thread (``background`` 0) or started in the background."""
    if not background:
        return call(0)
    _background.acquire()
    try:
        return call(int(background))
    except BaseException:
        _background.release()
        raise


def wait() -> None:
    """Wait for the background run this thread started (returns at once if none is running). Every
    background start must be followed by a ``wait`` on the same thread, also when other work between
    them fails.

    Raises:
        RuntimeError: the run failed (its result is undefined).
    """
    if not _background.locked():
        return
    try:
        ok = _module.wait_background()
    finally:
        _background.release()
    if not ok:
        raise RuntimeError("the fused CPU decode kernel failed in its background run")


_checked: set[tuple] = set()
"""Weight stacks that passed the checks, by what the checks read (device, address, shape, strides,
dtype; no reference kept): a decode step calls with the same stacks every token."""

_FLOATS = ("torch.bfloat16", "torch.float16", "torch.float32")


def _check(x, w13, w2, rows, weights) -> None:
    """``moe_decode``'s input checks, here rather than in C++: an exception thrown by the extension
    crashed the process with PyTorch 2.11 on Python 3.12 (the C++ checks stay, unreached)."""
    def fail(msg: str):
        raise RuntimeError(f"moe_decode: {msg}")

    if not (x.device.type == rows.device.type == weights.device.type == "cpu"):
        fail("every tensor must be on the CPU")
    key = tuple((t.device.type, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for t in (w13, w2))
    if key in _checked:
        E, H = w13.shape[0], w13.shape[2]
    else:
        E, H = _check_weights(w13, w2, fail)
        if len(_checked) > 4096:
            _checked.clear()
        _checked.add(key)
    if x.dim() not in (1, 2) or x.shape[-1] != H:
        fail(f"x must be [H] or [T, H] with H = {H}, got {list(x.shape)}")
    if str(x.dtype) not in _FLOATS:
        fail(f"x must be bfloat16, float16 or float32, got {x.dtype}")
    if rows.dim() != 1:
        fail("rows must be int64 [n]")
    if weights.dim() != 1 or weights.shape[0] != rows.shape[0]:
        fail(f"weights must be float32 [n] with n = len(rows) = {rows.shape[0]}")
    for j, r in enumerate(rows.tolist()):
        if not 0 <= r < E:
            fail(f"rows[{j}] = {r} is outside [0, {E})")


def _check_weights(w13, w2, fail) -> tuple[int, int]:
    """The stacks' checks; ``(E, H)``."""
    if not (w13.device.type == w2.device.type == "cpu"):
        fail("every tensor must be on the CPU")
    if w13.dim() != 3 or w2.dim() != 3:
        fail(f"w13 must be [E, 2I, H] and w2 [E, H, I], got {list(w13.shape)} and {list(w2.shape)}")
    E, ffn, H = w13.shape[0], w13.shape[1] // 2, w13.shape[2]
    if w13.shape[1] != 2 * ffn or ffn <= 0 or H <= 0:
        fail(f"w13 must be [E, 2I, H], got {list(w13.shape)}")
    if tuple(w2.shape) != (E, H, ffn):
        fail(f"w2 must be [E, H, I] = [{E}, {H}, {ffn}], got {list(w2.shape)}")
    if w13.dtype != w2.dtype or str(w13.dtype) not in _FLOATS:
        fail(f"w13 and w2 must both be bfloat16, float16 or float32, got {w13.dtype} and {w2.dtype}")
    if not (w13.is_contiguous() and w2.is_contiguous()):
        fail("w13 and w2 must be contiguous")
    return E, H


def takes(w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether ``moe_decode`` accepts these stacked weights (CPU, contiguous, ``[E, 2I, H]`` and
    ``[E, H, I]``, both bfloat16, float16 or float32). Builds nothing."""
    import torch

    return (w13.device.type == "cpu" and w2.device.type == "cpu" and w13.dim() == 3 and w2.dim() == 3
            and w13.dtype == w2.dtype and w13.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and w13.is_contiguous() and w2.is_contiguous() and w13.shape[1] % 2 == 0
            and tuple(w2.shape) == (w13.shape[0], w13.shape[2], w13.shape[1] // 2))


def disabled() -> bool:
    """Whether ``WORKBENCH_CPU_KERNEL`` turns the kernel off."""
    return os.environ.get(ENV_SWITCH, "").strip().lower() in ("0", "false", "no", "off")


def compile_flags() -> list[str]:
    """C++ flags of the build: optimised for this CPU, OpenMP on (``at::parallel_for`` is an inline
    template that runs serially in code compiled without it; the extension then shares torch's
    ``libgomp.so.1``). No ``-ffast-math``: linked into a shared object it would switch the whole
    process to flush-to-zero; the kernel vectorises without it."""
    flags = ["-O3", "-ffp-contract=fast", "-fno-math-errno", "-fno-trapping-math", "-fopenmp"]
    if os.environ.get(ENV_MARCH):
        flags.append(f"-march={os.environ[ENV_MARCH]}")
    elif platform.machine().lower() in ("x86_64", "amd64", "i686", "x86"):
        flags.append("-march=native")
    elif platform.machine().lower() in ("aarch64", "arm64"):
        flags.append("-mcpu=native")
    return flags


def build_dir() -> Path:
    """The build directory of this source, torch, Python, flags and CPU."""
    import torch

    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), *(h.read_bytes() for h in HEADERS), torch.__version__.encode(), sys.version.encode(),
                 " ".join(compile_flags()).encode(), platform.machine().encode(), _cpu_features().encode()):
        key.update(part)
        key.update(b"\0")
    root = os.environ.get(ENV_BUILD_DIR)
    if root:
        base = Path(root)
    else:
        import platformdirs

        base = Path(platformdirs.user_cache_dir("moe-workbench")) / "torch_ext"
    return base / key.hexdigest()[:16]


def _cpu_features() -> str:
    """The CPU's model and feature flags (Linux), or what ``platform`` knows elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    keep = [line for line in text.splitlines() if line.split(":")[0].strip() in ("model name", "flags", "Features")]
    return "\n".join(sorted(set(keep)))


def _load():
    """The extension module, or None (building it on the first call)."""
    global _module, _failed
    if _module is not None:
        return _module
    if _failed is not None:
        return None
    with _lock:
        if _module is None and _failed is None:
            try:
                _module = _build()
            except Exception as exc:  # any failure means "use the torch ops path"
                _failed = _short_reason(exc)
                log.debug("fused CPU decode kernel build failed", exc_info=True)
                log.warning("fused CPU decode kernel unavailable, experts use torch ops: %s", _failed)
    return _module


class _Unavailable(Exception):
    """A missing prerequisite, with a message meant for the log line."""


def _build():
    if disabled():
        raise _Unavailable(f"disabled by {ENV_SWITCH}={os.environ[ENV_SWITCH]}")
    if not sys.platform.startswith("linux"):
        raise _Unavailable(f"built on Linux only (GCC/Clang with OpenMP), not on {sys.platform}")
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise _Unavailable(f"no C++ compiler ({compiler!r} not found; install g++)")
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        raise _Unavailable("no Python headers (Python.h; install python3-dev)")
    _find_ninja()
    import fcntl
    import time

    import torch
    from torch.utils import cpp_extension

    path = build_dir()
    path.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(path / "workbench.lock", "w") as held:
        # torch's own lock is a file that a killed build leaves behind, and the next load waits on
        # it forever; an flock dies with its process, so under it a leftover torch lock is stale
        fcntl.flock(held, fcntl.LOCK_EX)
        stale = path / "lock"
        if stale.exists():
            log.info("removing a stale build lock %s (an interrupted build)", stale)
            stale.unlink()
        mod = cpp_extension.load(name=f"workbench_moe_decode_{path.name}", sources=[str(SOURCE)],
                                 extra_cflags=compile_flags(), extra_ldflags=["-fopenmp"],
                                 build_directory=str(path), verbose=False)
    if torch.get_num_threads() > 1 and mod.parallel_threads() < 2:
        raise _Unavailable("the extension built without OpenMP threads (at::parallel_for runs serially)")
    mod.set_int8_dots(os.environ.get(ENV_INT8, "").strip().lower() not in ("0", "false", "no", "off"))
    log.info("fused CPU decode kernel ready in %.1f s (%s)", time.perf_counter() - t0, path)
    return mod


def _find_ninja() -> None:
    """Make ``ninja`` findable by torch: the ``ninja`` wheel's binary when PATH lacks one (a venv
    used without activating it)."""
    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:
        raise _Unavailable("no ninja build tool (pip install ninja)") from None
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def _short_reason(exc: Exception) -> str:
    """One line from a build failure: the message of a missing prerequisite, else the first compiler
    error line, else the last line of the message."""
    if isinstance(exc, _Unavailable):
        return str(exc)
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    line = errors[0] if errors else (lines[-1] if lines else type(exc).__name__)
    return f"{type(exc).__name__}: {line[:300]}"
