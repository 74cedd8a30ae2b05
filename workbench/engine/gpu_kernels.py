"""Triton kernels for one token on CUDA: a MoE layer's routing and routed experts in three kernels,
the attention inputs (head norm, RoPE, KV cache write) in one, and the attention itself in two.

At batch 1 the resident experts of a layer are ``k`` matrix-vector products over ``k`` rows of the
stacked weights. Gathering those rows first (``w13[rows]``) copies ~75 MB per layer at the
Qwen3-30B-A3B shape and reads it again; ``experts_one_token`` reads each selected row where it lies
(pairs whose expert is not on this tier read nothing), with SiLU·up and the routing weight folded
into the down projection. ``route_softmax_topk`` does softmax, top-k, renormalisation and the
routing counts in one kernel. A decode step is a chain of such small kernels inside a CUDA graph,
where each kernel costs a few µs whatever its size, so fewer kernels is faster.

``available()`` is False without Triton or CUDA; the engine then keeps its PyTorch paths.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from . import blocks, kernel_check

log = logging.getLogger(__name__)

try:  # Triton ships with PyTorch's CUDA wheels; a CPU-only install has none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


_disabled: list[str] = []

FMT_CODES = {"q8_0": 1, "q4_k": 2, "q6_k": 3, "q5_k": 4, "q2_k": 5, "q3_k": 6, "iq4_xs": 7, "mxfp4": 8}
"""The one-token kernels' ``FMT`` for each kept block format (0: float weights)."""
EXPERTS_ONLY = frozenset({"mxfp4"})
"""Formats only the expert kernels (one-token here, prompts in ``prefill_kernels``) read in place
(gpt-oss's MXFP4 experts): the dense kernels of ``packed`` do not take them."""


def takes_formats(fmt: tuple[str, str]) -> bool:
    """Whether the one-token kernels read experts kept in ``fmt`` (gate/up, down) in place."""
    return all(f in FMT_CODES for f in fmt)


@functools.cache
def _importable() -> bool:
    return triton is not None and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")


def available() -> bool:
    """Whether the Triton kernels can run (Triton importable and CUDA present, or Triton's
    interpreter for tests: ``TRITON_INTERPRET=1``), and none failed to build here (``disable``)."""
    return not _disabled and _importable()


def disable(reason: str) -> None:
    """Stop using the kernels in this process (one failed to build or run); the engine's PyTorch
    paths take over."""
    if not _disabled:
        log.warning("Triton kernels off, PyTorch paths instead: %s", reason[:300])
    _disabled.append(reason)


_routing_off: list[str] = []


def routing_kernels() -> bool:
    """Whether one token's routing runs on its kernels (``router_route``, ``route_softmax_topk``):
    until one fails to build or run here (``routing_failed``)."""
    return not _routing_off


def routing_failed(exc: BaseException) -> None:
    """A routing kernel failed to build or run here: route on PyTorch from now on and keep every other
    kernel. (A routing kernel that did not build once turned all of them off: S1 all on the GPU then
    decoded 183 tok/s instead of 530; BENCHMARKS.md, sixteenth stop.)"""
    if not _routing_off:
        log.warning("the routing kernels are off, PyTorch routes instead (the other kernels stay on): %s",
                    f"{type(exc).__name__}: {exc}"[:300])
    _routing_off.append(str(exc))


def failed_here(exc: BaseException) -> bool:
    """Whether ``exc`` came from building or launching one of these kernels (or none of a kernel's
    candidates computing the right thing here: ``kernel_check.CandidatesWrong``)."""
    if isinstance(exc, kernel_check.CandidatesWrong):
        return True
    tb = exc.__traceback__
    while tb is not None:
        mod = tb.tb_frame.f_globals.get("__name__", "")
        if mod == __name__ or mod.startswith("triton"):
            return True
        tb = tb.tb_next
    return False


def usable(t: torch.Tensor) -> bool:
    """Whether the kernels take tensors like ``t``: on CUDA, or anywhere under Triton's interpreter
    (``TRITON_INTERPRET=1``: the engine's tests run these kernels on the CPU against transformers)."""
    return available() and (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


@functools.cache
def pdl() -> bool:
    """Whether the one-token kernels launch with programmatic dependent launch: on Hopper or later,
    with a Triton that has ``launch_pdl``, unless ``WORKBENCH_PDL=0``. In a decode step's CUDA graph
    each kernel then starts while the one before it finishes: it waits (``gdc_wait``) only before it
    reads what earlier kernels wrote or stores anything, and lets the next one start once its own
    programs have all passed that wait, so the ~1 µs between dependent kernels and each kernel's
    ramp-up overlap the previous kernel's tail. On an H100 (Triton 3.6) S1 all on the GPU decoded
    483.5 tok/s with it against 456.8 without, 499.8 with the dense matvec too (``packed.dense_matvec``),
    and ``tests/engine/test_decode_in_place.py`` passed on CUDA with it on, with and without the
    dense matvec (BENCHMARKS.md, seventh stop). Off under Triton's interpreter."""
    if triton is None or os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("WORKBENCH_PDL", "1") == "0":
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra import cuda as tl_cuda

        has = "launch_pdl" in CUDAOptions.__dataclass_fields__ and hasattr(tl_cuda, "gdc_wait")
        return has and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
    except Exception:  # noqa: BLE001 - an older Triton or no CUDA: plain launches
        return False


def pdl_args() -> dict:
    """Launch arguments of a one-token kernel that takes ``PDL``: ``PDL`` and ``launch_pdl`` when
    ``pdl()``, else none (the kernels' ``PDL`` defaults to False)."""
    return {"PDL": True, "launch_pdl": True} if pdl() else {}


if triton is not None:

    @triton.jit
    def _after_inputs(PDL: tl.constexpr):
        """With ``PDL``: wait until the kernels before this one have finished and their writes are
        visible, then let the next kernel's programs start (they wait likewise before reading what
        this one writes). Every program of a kernel launched with ``launch_pdl`` calls this before
        its first read of another kernel's output and before its first store."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def _inputs(x_ptr, offs, K, m, SWIGLU: tl.constexpr):
        """float32 inputs at ``offs`` (any shape; 0 where ``m`` is False): ``x[offs]``, or with
        ``SWIGLU`` ``silu(x[offs]) * x[K + offs]`` (the gate half, then the up half, of one row)."""
        if SWIGLU:
            g = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
            u = tl.load(x_ptr + K + offs, mask=m, other=0.0).to(tl.float32)
            return g * tl.sigmoid(g) * u
        else:
            return tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)

    @triton.jit
    def _half(sb, off, rm):
        """The float32 value of the float16 at byte ``off`` of each super-block ``sb [BN]`` (0 where
        ``rm`` is False, nothing read)."""
        lo = tl.load(sb + off, mask=rm, other=0).to(tl.uint16)
        hi = tl.load(sb + off + 1, mask=rm, other=0).to(tl.uint16)
        return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _q4k_scale_min(sb, j, rm):
        """Q4_K's 6-bit scale and min of sub-blocks ``j [J]`` of super-blocks ``sb [BN]``:
        two float32 ``[BN, J]`` (0 where ``rm`` is False)."""
        sc = sb[:, None] + 4
        m = rm[:, None]
        a = tl.load(sc + j[None, :], mask=m, other=0).to(tl.int32)
        b = tl.load(sc + j[None, :] + 4, mask=m, other=0).to(tl.int32)
        c = tl.load(sc + tl.where(j >= 4, j - 4, j)[None, :], mask=m, other=0).to(tl.int32)
        low = (j < 4)[None, :]
        scale = tl.where(low, a & 63, (b & 15) | ((c >> 6) << 4))
        mn = tl.where(low, b & 63, (b >> 4) | ((a >> 6) << 4))
        return scale.to(tl.float32), mn.to(tl.float32)

    @triton.jit
    def _q4k_dot(sb, rm, x_ptr, k0, K, SWIGLU: tl.constexpr, Q5: tl.constexpr = False):
        """Dot products ``[BN]`` of one Q4_K super-block per row (``sb [BN]``: uint8 pointers to each
        row's 144 bytes) with inputs ``k0 .. k0 + 255``. Byte ``32 g + p`` of the quants holds input
        ``64 g + p`` (low nibble, sub-block ``2 g``) and ``64 g + 32 + p`` (high nibble, ``2 g + 1``);
        ``d * sc * q - dmin * mn`` summed per sub-block as ``d * sc * (q . x) - dmin * mn * sum(x)``.
        ``Q5``: Q5_K's 176 bytes, whose 32 bytes after the scales hold each value's fifth bit (bit
        ``j`` of byte ``p``: sub-block ``j``, value ``p``), the quants after them."""
        g = tl.arange(0, 4)
        p = tl.arange(0, 32)
        at = g[:, None] * 64 + p[None, :]  # [4, 32]
        xlo = _inputs(x_ptr, k0 + at, K, at < 256, SWIGLU)
        xhi = _inputs(x_ptr, k0 + at + 32, K, at < 256, SWIGLU)
        m3 = rm[:, None, None]
        qb = tl.load(sb[:, None, None] + (48 if Q5 else 16) + (g[:, None] * 32 + p[None, :])[None, :, :], mask=m3,
                     other=0).to(tl.int32)
        qlo = qb & 15
        qhi = qb >> 4
        if Q5:
            qh = tl.load(sb[:, None, None] + 16 + (g[:, None] * 0 + p[None, :])[None, :, :], mask=m3, other=0).to(tl.int32)
            qlo = qlo | (((qh >> (2 * g)[None, :, None]) & 1) << 4)
            qhi = qhi | (((qh >> (2 * g + 1)[None, :, None]) & 1) << 4)
        dlo = tl.sum(qlo.to(tl.float32) * xlo[None, :, :], axis=2)  # [BN, 4]
        dhi = tl.sum(qhi.to(tl.float32) * xhi[None, :, :], axis=2)
        sc_lo, mn_lo = _q4k_scale_min(sb, 2 * g, rm)
        sc_hi, mn_hi = _q4k_scale_min(sb, 2 * g + 1, rm)
        s = tl.sum(sc_lo * dlo + sc_hi * dhi, axis=1)
        mins = tl.sum(mn_lo * tl.sum(xlo, axis=1)[None, :] + mn_hi * tl.sum(xhi, axis=1)[None, :], axis=1)
        return _half(sb, 0, rm) * s - _half(sb, 2, rm) * mins

    @triton.jit
    def _q6k_part(sb, rm, x_ptr, k0, K, lq, shift, hshift, sc_off, SWIGLU: tl.constexpr):
        """One of Q6_K's four value groups of a super-block: ``sum_u sc[u] * (q[u, :] . x[u, :])``
        ``[BN, 4]`` for ``u = 2 n + h`` (``n``: half of 128 inputs, ``h``: 16-input sub-block), the
        quants' low 4 bits from ``ql[lq + 64 n + 16 h + t] >> shift`` and high 2 from
        ``qh[32 n + 16 h + t] >> hshift``, inputs ``128 n + 16 h + t + 32 c``, scales at ``sc_off``."""
        u = tl.arange(0, 4)
        t = tl.arange(0, 16)
        n = u // 2
        h = u % 2
        lt = (n * 64 + h * 16)[:, None] + t[None, :]  # [4, 16]
        ht = (n * 32 + h * 16)[:, None] + t[None, :]
        x = _inputs(x_ptr, k0 + (n * 128 + h * 16)[:, None] + t[None, :] + sc_off * 16, K, lt >= 0, SWIGLU)
        m3 = rm[:, None, None]
        lo = tl.load(sb[:, None, None] + (lq + lt)[None, :, :], mask=m3, other=0).to(tl.int32)
        hi = tl.load(sb[:, None, None] + 128 + ht[None, :, :], mask=m3, other=0).to(tl.int32)
        q = ((lo >> shift) & 15) | (((hi >> hshift) & 3) << 4)
        dot = tl.sum((q - 32).to(tl.float32) * x[None, :, :], axis=2)
        sc = tl.load(sb[:, None] + 192 + (n * 8 + h)[None, :] + sc_off, mask=rm[:, None], other=0).to(tl.int32)
        sc = tl.where(sc > 127, sc - 256, sc)  # int8
        return sc.to(tl.float32) * dot

    @triton.jit
    def _q6k_dot(sb, rm, x_ptr, k0, K, SWIGLU: tl.constexpr):
        """Dot products ``[BN]`` of one Q6_K super-block per row (``sb [BN]``: pointers to each row's
        210 bytes: ql[128], qh[64], int8 scales[16], float16 d) with inputs ``k0 .. k0 + 255``."""
        s = _q6k_part(sb, rm, x_ptr, k0, K, 0, 0, 0, 0, SWIGLU)
        s += _q6k_part(sb, rm, x_ptr, k0, K, 32, 0, 2, 2, SWIGLU)
        s += _q6k_part(sb, rm, x_ptr, k0, K, 0, 4, 4, 4, SWIGLU)
        s += _q6k_part(sb, rm, x_ptr, k0, K, 32, 4, 6, 6, SWIGLU)
        return _half(sb, 208, rm) * tl.sum(s, axis=1)

    @triton.jit
    def _iq4_value(q):
        """IQ4_XS's value of each 4-bit index ``q`` (int32, any shape), as float32 (``blocks.IQ4_VALUES``)."""
        v = tl.where(q < 8,
                     tl.where(q < 4, tl.where(q < 2, tl.where(q == 0, -127, -104), tl.where(q == 2, -83, -65)),
                              tl.where(q < 6, tl.where(q == 4, -49, -35), tl.where(q == 6, -22, -10))),
                     tl.where(q < 12, tl.where(q < 10, tl.where(q == 8, 1, 13), tl.where(q == 10, 25, 38)),
                              tl.where(q < 14, tl.where(q == 12, 53, 69), tl.where(q == 14, 89, 113))))
        return v.to(tl.float32)

    @triton.jit
    def _mx_value(q):
        """MXFP4's FP4 code ``q`` (int32, 0..15) as its value doubled (llama.cpp's ``kvalues_mxfp4``),
        float32: magnitude m = q & 7 is m below 4, else (2 or 3) << (m / 2 - 1); bit 3 the sign."""
        m = q & 7
        mag = tl.where(m < 4, m, (2 + (m & 1)) << tl.maximum((m >> 1) - 1, 0))
        return tl.where(q >= 8, -mag, mag).to(tl.float32)

    @triton.jit
    def _mx_scale(e):
        """An MXFP4 block's E8M0 exponent ``e`` (int32) as its scale 2^(e - 128), float32."""
        bits = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _block_tile(rows, d_rows, k0, rm, K, FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Float32 weights ``[BLOCK_N, BLOCK_K]`` of rows ``rows [BLOCK_N]`` (pointers to each row's
        first byte) at inputs ``k0 .. k0 + BLOCK_K`` (``k0`` a multiple of ``BLOCK_K``, which divides
        256), decoded a block at a time: ``FMT`` 1 Q8_0 (``d_rows``: each row's float16 scales, one
        load per 32 values), 2 Q4_K, 3 Q6_K, 4 Q5_K, 5 Q2_K, 6 Q3_K, 7 IQ4_XS (each super-block's scales
        decoded once per sub-block).
        0 where ``rm`` is False or past ``K`` (nothing read there)."""
        return tl.reshape(_block_tile3(rows, d_rows, k0, rm, K, FMT, BLOCK_N, BLOCK_K), (BLOCK_N, BLOCK_K))

    @triton.jit
    def _block_tile3(rows, d_rows, k0, rm, K, FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """``_block_tile`` as decoded, ``[BLOCK_N, BLOCK_K / S, S]``: sub-blocks of ``S`` inputs (16
        for Q6_K, Q2_K and Q3_K, else 32) along the middle axis, inputs in order (no reshape, no layout change)."""
        if FMT == 1:
            NB: tl.constexpr = BLOCK_K // 32
            blk = k0 // 32 + tl.arange(0, NB)
            bm = blk < K // 32
            at = blk[:, None] * 32 + tl.arange(0, 32)[None, :]  # [NB, 32]
            m3 = rm[:, None, None] & bm[None, :, None]
            q = tl.load(rows[:, None, None] + at[None, :, :], mask=m3, other=0).to(tl.float32)
            d = tl.load(d_rows[:, None] + blk[None, :], mask=rm[:, None] & bm[None, :], other=0.0).to(tl.float32)
            w = q * d[:, :, None]
        elif FMT == 2 or FMT == 4:  # Q4_K; Q5_K: the same with a fifth bit per value (``_q4k_dot``)
            J: tl.constexpr = BLOCK_K // 32
            sb = rows + (k0 // 256) * (144 if FMT == 2 else 176)
            j = (k0 % 256) // 32 + tl.arange(0, J)  # sub-blocks of 32 values
            sc, mn = _q4k_scale_min(sb, j, rm)  # [BN, J]
            at = (j // 2 * 32)[:, None] + tl.arange(0, 32)[None, :]  # byte 32 g + p holds sub-blocks 2g, 2g + 1
            q = tl.load(sb[:, None, None] + (16 if FMT == 2 else 48) + at[None, :, :], mask=rm[:, None, None],
                        other=0).to(tl.int32)
            q = (q >> ((j % 2) * 4)[None, :, None]) & 15
            if FMT == 4:
                p = (j * 0)[:, None] + tl.arange(0, 32)[None, :]  # [J, 32]: the value's byte of the fifth bits
                qh = tl.load(sb[:, None, None] + 16 + p[None, :, :], mask=rm[:, None, None], other=0).to(tl.int32)
                q = q | (((qh >> j[None, :, None]) & 1) << 4)
            d = _half(sb, 0, rm)[:, None]
            dmin = _half(sb, 2, rm)[:, None]
            w = (d * sc)[:, :, None] * q.to(tl.float32) - (dmin * mn)[:, :, None]
        elif FMT == 8:  # MXFP4: blocks of 32 values in 17 bytes (E8M0 exponent, then indices), K % 32 == 0
            NB: tl.constexpr = BLOCK_K // 32
            blk = k0 // 32 + tl.arange(0, NB)
            bm = blk < K // 32
            t = tl.arange(0, 32)
            m3 = rm[:, None, None] & bm[None, :, None]
            byte = tl.load(rows[:, None, None] + (blk[:, None] * 17 + 1 + t[None, :] % 16)[None, :, :], mask=m3,
                           other=0).to(tl.int32)
            q = (byte >> (4 * (t // 16))[None, None, :]) & 15
            e = tl.load(rows[:, None] + (blk * 17)[None, :], mask=rm[:, None] & bm[None, :], other=0).to(tl.int32)
            w = _mx_scale(e)[:, :, None] * _mx_value(q)
        elif FMT == 7:  # IQ4_XS: sub-block j's indices in bytes 8 + 16 j + t % 16 (t >= 16: high nibbles)
            J: tl.constexpr = BLOCK_K // 32
            sb = rows + (k0 // 256) * 136
            j = (k0 % 256) // 32 + tl.arange(0, J)
            t = tl.arange(0, 32)
            m3 = rm[:, None, None]
            byte = tl.load(sb[:, None, None] + (8 + j[:, None] * 16 + t[None, :] % 16)[None, :, :], mask=m3,
                           other=0).to(tl.int32)
            q = (byte >> (4 * (t // 16))[None, None, :]) & 15
            low = (tl.load(sb[:, None] + 4 + (j // 2)[None, :], mask=rm[:, None], other=0).to(tl.int32)
                   >> (4 * (j % 2))[None, :]) & 15
            hb = (tl.load(sb + 2, mask=rm, other=0).to(tl.int32) | (tl.load(sb + 3, mask=rm, other=0).to(tl.int32) << 8))
            ls = (low | (((hb[:, None] >> (2 * j)[None, :]) & 3) << 4)) - 32
            w = (_half(sb, 0, rm)[:, None] * ls.to(tl.float32))[:, :, None] * _iq4_value(q)
        elif FMT == 5 or FMT == 6:  # Q2_K, Q3_K: 2-bit values (byte 32 n + l, bits 2 g: value 128 n + 32 g + l)
            U: tl.constexpr = BLOCK_K // 16
            sb = rows + (k0 // 256) * (84 if FMT == 5 else 110)
            u = (k0 % 256) // 16 + tl.arange(0, U)  # sub-blocks of 16 values
            at = (u * 16)[:, None] + tl.arange(0, 16)[None, :]  # [U, 16]: positions in the super-block
            n = at // 128
            g = (at % 128) // 32
            lb = n * 32 + at % 32
            m3 = rm[:, None, None]
            q = (tl.load(sb[:, None, None] + ((16 if FMT == 5 else 32) + lb)[None, :, :], mask=m3, other=0)
                 .to(tl.int32) >> (2 * g)[None, :, :]) & 3
            if FMT == 5:  # scale and minimum: the low and high nibbles of byte u; float16 d and dmin last
                sc = tl.load(sb[:, None] + u[None, :], mask=rm[:, None], other=0).to(tl.int32)
                w = ((_half(sb, 80, rm)[:, None] * (sc & 15).to(tl.float32))[:, :, None] * q.to(tl.float32)
                     - (_half(sb, 82, rm)[:, None] * (sc >> 4).to(tl.float32))[:, :, None])
            else:  # bit 2 of q: bit 4 n + g of byte l of the high bits; 6-bit scales - 32; float16 d last
                hb = tl.load(sb[:, None, None] + (at % 32)[None, :, :], mask=m3, other=0).to(tl.int32)
                q = q | (((hb >> (4 * n + g)[None, :, :]) & 1) << 2)
                lo = tl.load(sb[:, None] + 96 + (u % 8)[None, :], mask=rm[:, None], other=0).to(tl.int32)
                hi = tl.load(sb[:, None] + 104 + (u % 4)[None, :], mask=rm[:, None], other=0).to(tl.int32)
                sc = ((lo >> ((u // 8) * 4)[None, :]) & 15) | (((hi >> ((u // 4) * 2)[None, :]) & 3) << 4)
                w = (_half(sb, 108, rm)[:, None] * (sc - 32).to(tl.float32))[:, :, None] * (q - 4).to(tl.float32)
        else:
            U: tl.constexpr = BLOCK_K // 16
            sb = rows + (k0 // 256) * 210
            u = (k0 % 256) // 16 + tl.arange(0, U)  # sub-blocks of 16 values
            at = (u * 16)[:, None] + tl.arange(0, 16)[None, :]  # [U, 16]: positions in the super-block
            half = at // 128
            r = at % 128
            g = r // 32
            m3 = rm[:, None, None]
            lo = tl.load(sb[:, None, None] + (half * 64 + (g % 2) * 32 + r % 32)[None, :, :], mask=m3,
                         other=0).to(tl.int32)
            hi = tl.load(sb[:, None, None] + (128 + half * 32 + r % 32)[None, :, :], mask=m3, other=0).to(tl.int32)
            q = ((lo >> ((g // 2) * 4)[None, :, :]) & 15) | (((hi >> (2 * g)[None, :, :]) & 3) << 4)
            sc = tl.load(sb[:, None] + 192 + u[None, :], mask=rm[:, None], other=0).to(tl.int32)
            sc = tl.where(sc > 127, sc - 256, sc)  # int8
            w = (_half(sb, 208, rm)[:, None] * sc.to(tl.float32))[:, :, None] * (q - 32).to(tl.float32)
        return w

    @triton.jit
    def _tile3_dots(w_rows, d_rows, x_ptr, K, rm, FMT: tl.constexpr, SWIGLU: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, S: tl.constexpr):
        """``_row_dots`` with ``TILE``: products of ``_block_tile3`` tiles and the inputs in the same
        ``[BLOCK_K / S, S]`` shape summed elementwise into a 3-D accumulator, reduced once per row.
        Tiles stay in their decoded shape: the H200 computed a form that reshaped each tile to
        ``[BLOCK_N, BLOCK_K]`` wrong at 4 and 8 rows (``scripts/check_kernel_candidates.py``)."""
        A: tl.constexpr = BLOCK_K // S
        acc3 = tl.zeros((BLOCK_N, A, S), dtype=tl.float32)
        at = tl.arange(0, A)[:, None] * S + tl.arange(0, S)[None, :]  # [A, S]: inputs in order
        for k0 in tl.static_range(0, K, BLOCK_K):  # unrolled: every tile's loads in flight at once
            x = _inputs(x_ptr, k0 + at, K, k0 + at < K, SWIGLU)
            acc3 += _block_tile3(w_rows, d_rows, k0, rm, K, FMT, BLOCK_N, BLOCK_K) * x[None, :, :]
        return tl.sum(tl.sum(acc3, axis=2), axis=1)

    @triton.jit
    def _row_dots(w_rows, d_rows, x_ptr, K, rm, FMT: tl.constexpr, SWIGLU: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TILE: tl.constexpr):
        """Dot products ``[BLOCK_N]`` float32 of whole weight rows with ``K`` inputs (``_inputs``).
        ``w_rows [BLOCK_N]``: pointers to each row's start; ``FMT`` 0: float values; 1: Q8_0 int8
        values with ``d_rows`` pointing at each row's float16 scales (one per 32 inputs); 2 / 3 / 4: the
        row's raw Q4_K / Q6_K / Q5_K super-blocks (5 / 6 / 7: Q2_K / Q3_K / IQ4_XS, a super-block a tile), read a super-block at a time (scales once per sub-block,
        not per value). Rows where ``rm`` is False give 0 and read nothing.

        ``TILE`` (``K`` a compile-time constant; blocks: ``BLOCK_K`` dividing 256): the row
        decoded ``BLOCK_K`` values at a time (``_tile3_dots``; float rows: loaded), the loop unrolled,
        products summed elementwise into an accumulator ``[BLOCK_N, BLOCK_K]`` and reduced across
        threads once per row, not once per block: the autotuner keeps whichever form is faster on
        the GPU at hand."""
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        if TILE and FMT == 3:
            acc = _tile3_dots(w_rows, d_rows, x_ptr, K, rm, FMT, SWIGLU, BLOCK_N, BLOCK_K, 16)
        elif FMT == 5 or FMT == 6:  # Q2_K, Q3_K: always a super-block a tile
            acc = _tile3_dots(w_rows, d_rows, x_ptr, K, rm, FMT, SWIGLU, BLOCK_N, 256, 16)
        elif FMT == 7 or FMT == 8:  # IQ4_XS likewise; MXFP4 8 blocks of 32 a tile (the last one masked)
            acc = _tile3_dots(w_rows, d_rows, x_ptr, K, rm, FMT, SWIGLU, BLOCK_N, 256, 32)
        elif TILE and FMT != 0:
            acc = _tile3_dots(w_rows, d_rows, x_ptr, K, rm, FMT, SWIGLU, BLOCK_N, BLOCK_K, 32)
        elif FMT == 2 or FMT == 3 or FMT == 4:
            size: tl.constexpr = 144 if FMT == 2 else (210 if FMT == 3 else 176)
            for s in tl.static_range(0, K // 256):  # unrolled: every super-block's loads in flight at once
                if FMT == 2 or FMT == 4:
                    acc += _q4k_dot(w_rows + s * size, rm, x_ptr, s * 256, K, SWIGLU, FMT == 4)
                else:
                    acc += _q6k_dot(w_rows + s * size, rm, x_ptr, s * 256, K, SWIGLU)
        elif FMT == 1:
            NB: tl.constexpr = BLOCK_K // 32
            b = tl.arange(0, NB)
            t = tl.arange(0, 32)
            for k0 in range(0, K, BLOCK_K):
                blk = k0 // 32 + b  # [NB]
                bm = blk < K // 32
                at = blk[:, None] * 32 + t[None, :]  # [NB, 32]
                x = _inputs(x_ptr, at, K, bm[:, None], SWIGLU)
                m3 = rm[:, None, None] & bm[None, :, None]
                q = tl.load(w_rows[:, None, None] + at[None, :, :], mask=m3, other=0).to(tl.float32)
                d = tl.load(d_rows[:, None] + blk[None, :], mask=rm[:, None] & bm[None, :], other=0.0)
                acc += tl.sum(tl.sum(q * x[None, :, :], axis=2) * d.to(tl.float32), axis=1)
        elif TILE:  # float rows, every block's loads in flight at once, one reduction per row
            acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            for k0 in tl.static_range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                km = offs_k < K
                x = _inputs(x_ptr, offs_k, K, km, SWIGLU)
                w = tl.load(w_rows[:, None] + offs_k[None, :], mask=rm[:, None] & km[None, :], other=0)
                acc2 += w.to(tl.float32) * x[None, :]
            acc = tl.sum(acc2, axis=1)
        else:
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                km = offs_k < K
                x = _inputs(x_ptr, offs_k, K, km, SWIGLU)
                w = tl.load(w_rows[:, None] + offs_k[None, :], mask=rm[:, None] & km[None, :], other=0)
                acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        return acc

    @triton.jit
    def _add_norm_row(a_ptr, o_ptr, nw_ptr, sum_ptr, norm_ptr, N, eps, BLOCK_H: tl.constexpr):
        """The last program of a one-token product: ``s = a + o`` over the row's ``N`` values (``o``
        read from L2, as other programs of the kernel stored it; ``s`` rounded to the sum's dtype as
        a separate add would round it), then ``rms_norm(s) * nw``."""
        offs = tl.arange(0, BLOCK_H)
        m = offs < N
        a = tl.load(a_ptr + offs, mask=m, other=0.0).to(tl.float32)
        b = tl.load(o_ptr + offs, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
        s = (a + b).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + offs, s, mask=m)
        sf = s.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(sf * sf, axis=0) / N + eps)
        w = tl.load(nw_ptr + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(norm_ptr + offs, (sf * inv * w).to(norm_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _part_done(part, j, blk, offs_n, nm, N, part_ptr, cnt_ptr, out_ptr, PARTS: tl.constexpr,
                   BLOCK_N: tl.constexpr, ADD_NORM: tl.constexpr = False, a_ptr=None, nw_ptr=None, sum_ptr=None,
                   norm_ptr=None, eps=0.0, BLOCK_H: tl.constexpr = 16):
        """A program's part ``j`` ``[BLOCK_N]`` (float32) of outputs ``offs_n`` of block ``blk``, stored
        in ``part [PARTS, N]`` and counted in ``cnt[blk]``; the block's last program sums its parts in
        part order into ``out`` (its dtype) and sets the count back to 0. ``ADD_NORM`` (``out_norm``'s
        kernel): then the last block to finish (``cnt[blocks]``) adds the residual and norms the row
        (``_add_norm_row``)."""
        tl.store(part_ptr + j * N + offs_n, part, mask=nm)
        tl.debug_barrier()  # every thread's part stored before the count says so
        if tl.atomic_add(cnt_ptr + blk, 1, sem="acq_rel") == PARTS - 1:
            acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for p in tl.static_range(PARTS):
                acc += tl.load(part_ptr + p * N + offs_n, mask=nm, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + offs_n, acc.to(out_ptr.dtype.element_ty), mask=nm)
            tl.atomic_xchg(cnt_ptr + blk, 0)
            if ADD_NORM:
                tl.debug_barrier()  # the block's outputs stored before the blocks' count says so
                blocks = tl.num_programs(0)
                if tl.atomic_add(cnt_ptr + blocks, 1, sem="acq_rel") == blocks - 1:
                    _add_norm_row(a_ptr, out_ptr, nw_ptr, sum_ptr, norm_ptr, N, eps, BLOCK_H)
                    tl.atomic_xchg(cnt_ptr + blocks, 0)

    @triton.jit
    def _add_norm_kernel(a_ptr, b_ptr, w_ptr, sum_ptr, norm_ptr, H, eps, BLOCK: tl.constexpr,
                         PDL: tl.constexpr = False):
        """One row: ``s = a + b`` (rounded to the output dtype, as a separate add would), and
        ``s``'s RMS norm times ``w``."""
        offs = tl.arange(0, BLOCK)
        m = offs < H
        w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)  # a weight: before the wait
        _after_inputs(PDL)
        a = tl.load(a_ptr + offs, mask=m, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + offs, mask=m, other=0.0).to(tl.float32)
        s = (a + b).to(sum_ptr.dtype.element_ty)  # PyTorch adds bfloat16 in float32 and rounds once
        tl.store(sum_ptr + offs, s, mask=m)
        sf = s.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(sf * sf, axis=0) / H + eps)
        tl.store(norm_ptr + offs, (sf * inv * w).to(norm_ptr.dtype.element_ty), mask=m)

    _INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
    ONE_CONFIG = _INTERPRETED or os.environ.get("WORKBENCH_AUTOTUNE", "1") == "0"
    """Only each kernel's first autotuning candidate: under the interpreter, and with
    ``WORKBENCH_AUTOTUNE=0`` (the CUDA test runs: every other candidate compiles per shape)."""

    def _configs(options: list[tuple]) -> list:
        """Autotuning candidates ``(BLOCK_N, BLOCK_K, num_warps[, other constexprs])``: Triton times
        them on the GPU at the first call per shape (the decode step's eager warm-up, before graph
        capture) and keeps the fastest; only the first with ``ONE_CONFIG``. Few: each is compiled
        once per machine."""
        return [triton.Config({"BLOCK_N": o[0], "BLOCK_K": o[1], **(o[3] if len(o) > 3 else {})}, num_warps=o[2])
                for o in options[:1 if ONE_CONFIG else None]]

    _NO_TILE = {"TILE": False}
    _TILE = {"TILE": True}

    @triton.autotune(configs=_configs([(16, 256, 4, _TILE), (4, 256, 2, _TILE), (2, 256, 2, _TILE), (8, 256, 4, _TILE),
                                       (16, 256, 4, _NO_TILE), (8, 256, 4, _NO_TILE), (32, 256, 4, _NO_TILE),
                                       (16, 512, 4, _NO_TILE), (32, 128, 8, _NO_TILE)]),
                     key=["N", "K", "FMT"])
    @triton.jit
    def _gate_up_kernel(x_ptr, w_ptr, d_ptr, ids_ptr, rowmap_ptr, scale_ptr, out_ptr, b_ptr, N, K: tl.constexpr,
                        stride_e, stride_n, stride_h, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FMT: tl.constexpr,
                        TILE: tl.constexpr, BIAS: tl.constexpr = False, PDL: tl.constexpr = False):
        """out[j, n] = w[rowmap[ids[j]], n, :] . x  (float32; ``BIAS``: plus ``b[row, n]``, rows of ``N``),
        zero where the pair is inactive. The up rows (``n >= N / 2``) start ``stride_h`` after the gate
        rows (``N / 2 * stride_n`` in a whole stack; more for a part of each expert's units).
        ``FMT`` 1: ``w`` int8 and ``d_ptr`` its float16 scales, one per 32 values along K (GGUF
        Q8_0); 2: ``w`` the rows' raw GGUF Q4_K bytes (``stride_n`` bytes a row); 3 ... 8: raw GGUF
        Q6_K, Q5_K, Q2_K, Q3_K, IQ4_XS, MXFP4 bytes."""
        pair = tl.program_id(0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        _after_inputs(PDL)
        row = tl.load(rowmap_ptr + tl.load(ids_ptr + pair))
        active = (row >= 0) & (tl.load(scale_ptr + pair).to(tl.float32) != 0)
        row = tl.maximum(row, 0)
        rm = offs_n < tl.where(active, N, 0)  # an inactive pair loads no weights
        up = (offs_n >= N // 2).to(tl.int64)
        at = row * stride_e + (offs_n - up * (N // 2)) * stride_n + up * stride_h
        acc = _row_dots(w_ptr + at, d_ptr + at // 32, x_ptr, K, rm, FMT, False, BLOCK_N, BLOCK_K, TILE)
        if BIAS:
            acc += tl.load(b_ptr + row * N + offs_n, mask=rm, other=0.0).to(tl.float32)
        tl.store(out_ptr + pair * N + offs_n, acc, mask=offs_n < N)

    @triton.jit
    def _down_pair(h_ptr, w_ptr, d_ptr, ids_ptr, rowmap_ptr, scale_ptr, b_ptr, pair, offs_n, N, FFN: tl.constexpr,
                   stride_e, stride_n, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FMT: tl.constexpr,
                   TILE: tl.constexpr, BIAS: tl.constexpr, SWIGLU: tl.constexpr):
        """Pair ``pair``'s weighted down projection at outputs ``offs_n`` ``[BLOCK_N]`` float32 (0 and
        nothing read when the pair is inactive). Its inputs: ``silu(gate) * up`` of ``h``'s row
        (``SWIGLU``), or the row's first ``FFN`` values as they are (an activation computed before);
        ``BIAS``: plus ``b[row, n]`` before the weight."""
        row = tl.load(rowmap_ptr + tl.load(ids_ptr + pair))
        s = tl.load(scale_ptr + pair).to(tl.float32)
        active = (row >= 0) & (s != 0)
        row = tl.maximum(row, 0)
        rm = offs_n < tl.where(active, N, 0)  # an inactive pair loads no weights
        at = row * stride_e + offs_n * stride_n
        part = _row_dots(w_ptr + at, d_ptr + at // 32, h_ptr + pair * 2 * FFN, FFN, rm, FMT, SWIGLU, BLOCK_N,
                         BLOCK_K, TILE)
        if BIAS:
            part += tl.load(b_ptr + row * N + offs_n, mask=rm, other=0.0).to(tl.float32)
        return tl.where(active, part * s, 0.0)

    @triton.autotune(configs=_configs([(16, 256, 4, _TILE), (8, 256, 4, _TILE), (4, 256, 4, _TILE), (2, 256, 4, _TILE),
                                       (8, 256, 4, _NO_TILE), (4, 256, 4, _NO_TILE), (16, 256, 4, _NO_TILE),
                                       (32, 256, 4, _NO_TILE), (16, 256, 8, _NO_TILE)]),
                     key=["N", "FFN", "K", "FMT"])
    @triton.jit
    def _down_split_kernel(h_ptr, w_ptr, d_ptr, ids_ptr, rowmap_ptr, scale_ptr, out_ptr, b_ptr, part_ptr, cnt_ptr, N,
                           FFN: tl.constexpr, stride_e, stride_n, K: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, FMT: tl.constexpr, TILE: tl.constexpr, BIAS: tl.constexpr = False,
                           SWIGLU: tl.constexpr = True, PDL: tl.constexpr = False):
        """out[n] = sum_j scale[j] * (w[row_j, n, :] . (silu(h[j, :FFN]) * h[j, FFN:]) [+ b[row_j, n]]), in
        out's dtype (``SWIGLU`` False: ``h[j, :FFN]`` as the inputs, an activation computed before).
        One program per pair and block of outputs, so that all ``K`` pairs' rows are read at once
        (a program per block looping over the pairs read at ~1.2 TB/s on the H100 at S1's shapes
        against ~2.1 here): each stores its pair's weighted part in ``part [K, N]`` (float32) and
        counts itself in ``cnt[block]``; the block's last program sums the parts in pair order,
        stores the result in out's dtype and sets the count back to 0 for the next call (``_part_done``)."""
        blk = tl.program_id(0)
        pair = tl.program_id(1)
        offs_n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = offs_n < N
        _after_inputs(PDL)
        part = _down_pair(h_ptr, w_ptr, d_ptr, ids_ptr, rowmap_ptr, scale_ptr, b_ptr, pair, offs_n, N, FFN,
                          stride_e, stride_n, BLOCK_N, BLOCK_K, FMT, TILE, BIAS, SWIGLU)
        _part_done(part, pair, blk, offs_n, nm, N, part_ptr, cnt_ptr, out_ptr, K, BLOCK_N)

    @triton.jit
    def _decode_attn_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, po_ptr, pm_ptr, pl_ptr, NKV, scale,
                            REP: tl.constexpr, REPP: tl.constexpr, HD: tl.constexpr, HDP: tl.constexpr,
                            SPLIT: tl.constexpr, BLOCK_S: tl.constexpr, F32_DOT: tl.constexpr,
                            PDL: tl.constexpr = False):
        """Flash-decoding, first pass: the ``REP`` query heads of key/value head ``program_id(0)``
        over keys ``0..pos`` split ``SPLIT`` ways (``program_id(1)``); writes each split's running
        max ``pm``, denominator ``pl`` ``[NKV, SPLIT, REPP]`` and unnormalised output ``po [.., HDP]``
        (``HDP``: the head dim padded to the 16 a tensor-core dot needs)."""
        g = tl.program_id(0)
        sp = tl.program_id(1)
        _after_inputs(PDL)
        n = tl.load(pos_ptr) + 1
        chunk = tl.cdiv(n, SPLIT)
        lo = sp * chunk
        hi = tl.minimum(n, lo + chunk)
        r = tl.arange(0, REPP)
        d = tl.arange(0, HDP)
        dm = d < HD
        q = tl.load(q_ptr + (g * REP + r[:, None]) * HD + d[None, :], mask=(r < REP)[:, None] & dm[None, :],
                    other=0.0)
        m = tl.full((REPP,), -float("inf"), dtype=tl.float32)
        den = tl.zeros((REPP,), dtype=tl.float32)
        acc = tl.zeros((REPP, HDP), dtype=tl.float32)
        for start in range(lo, hi, BLOCK_S):
            offs = start + tl.arange(0, BLOCK_S)
            km = offs < hi
            kv_off = (offs[:, None] * NKV + g) * HD + d[None, :]
            kb = tl.load(k_ptr + kv_off, mask=km[:, None] & dm[None, :], other=0.0)  # [BLOCK_S, HDP]
            if F32_DOT:  # float32 caches, or Triton's interpreter (whose bfloat16 dot is wrong)
                sc = tl.dot(q.to(tl.float32), tl.trans(kb.to(tl.float32)), input_precision="ieee")
            else:
                sc = tl.dot(q, tl.trans(kb))
            sc = sc * scale  # [REPP, BLOCK_S]
            sc = tl.where(km[None, :], sc, -float("inf"))
            m_new = tl.maximum(m, tl.max(sc, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(sc - m_new[:, None])
            den = den * alpha + tl.sum(p, axis=1)
            vb = tl.load(v_ptr + kv_off, mask=km[:, None] & dm[None, :], other=0.0)
            if F32_DOT:
                acc = acc * alpha[:, None] + tl.dot(p, vb.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb)
            m = m_new
        base = g * SPLIT + sp
        tl.store(pm_ptr + base * REPP + r, m)
        tl.store(pl_ptr + base * REPP + r, den)
        tl.store(po_ptr + (base * REPP + r[:, None]) * HDP + d[None, :], acc)

    @triton.jit
    def _decode_attn_combine_kernel(po_ptr, pm_ptr, pl_ptr, out_ptr, REP: tl.constexpr, REPP: tl.constexpr,
                                    HD: tl.constexpr, HDP: tl.constexpr, SPLIT: tl.constexpr,
                                    PDL: tl.constexpr = False):
        """Flash-decoding, second pass: query head ``program_id(0)``'s splits merged into ``out [HD]``."""
        h = tl.program_id(0)
        _after_inputs(PDL)
        g = h // REP
        r = h % REP
        sp = tl.arange(0, SPLIT)
        d = tl.arange(0, HDP)
        idx = (g * SPLIT + sp) * REPP + r  # [SPLIT]
        pm = tl.load(pm_ptr + idx)
        wt = tl.exp(pm - tl.max(pm, axis=0))  # an empty split (max -inf) weighs 0
        den = tl.sum(wt * tl.load(pl_ptr + idx), axis=0)
        po = tl.load(po_ptr + idx[:, None] * HDP + d[None, :])
        o = tl.sum(po * wt[:, None], axis=0) / den
        tl.store(out_ptr + h * HD + d, o.to(out_ptr.dtype.element_ty), mask=d < HD)

    @triton.jit
    def _route_picks(x, offs, valid, ids_ptr, w_ptr, counts_ptr, scaling, K: tl.constexpr, BLOCK_E: tl.constexpr,
                     NORM: tl.constexpr):
        """Softmax over the float32 logits ``x [BLOCK_E]`` (``-inf`` where not ``valid``), the ``K``
        largest (descending, the lowest index among equals first), renormalised when ``NORM``, times
        ``scaling``: their indices to ``ids_ptr``, weights to ``w_ptr``, 1 added to ``counts`` per pick.
        The picks come from ``K`` rounds of one max over 64-bit keys (a probability's bits above its
        index, reversed, so that the max is the largest probability and among equals the lowest
        index): ``K`` reductions, where counting every probability's rank against all the others
        (a ``[BLOCK_E, BLOCK_E]`` comparison) took ~3,300 PTX lines a thread at 128 experts."""
        e = tl.where(valid, tl.exp(x - tl.max(x, axis=0)), 0.0)
        p = e / tl.sum(e, axis=0)
        # p >= 0, so its bits order as it does; invalid entries -1, below every valid key
        key = tl.where(valid, (p.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (BLOCK_E - 1 - offs).to(tl.int64),
                       -1)
        rank = tl.full((BLOCK_E,), K, tl.int32)
        for r in range(K):
            best = tl.max(key, axis=0)
            hit = (key == best) & (best >= 0)  # none once the valid keys are used up (E < K)
            rank = tl.where(hit, r, rank)
            key = tl.where(hit, -1, key)
        pick = valid & (rank < K)
        top = tl.where(pick, p, 0.0)
        if NORM:
            top = top / tl.sum(top, axis=0)
        top = top * scaling
        tl.store(ids_ptr + rank, offs.to(tl.int64), mask=pick)
        tl.store(w_ptr + rank, top.to(w_ptr.dtype.element_ty), mask=pick)
        tl.atomic_add(counts_ptr + offs, tl.full((BLOCK_E,), 1, tl.int64), mask=pick)

    @triton.jit
    def _route_kernel(logits_ptr, ids_ptr, w_ptr, counts_ptr, E, scaling,
                      K: tl.constexpr, BLOCK_E: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr = False):
        """Routing of one token from its ``E`` logits (``_route_picks``)."""
        offs = tl.arange(0, BLOCK_E)
        valid = offs < E
        _after_inputs(PDL)
        x = tl.load(logits_ptr + offs, mask=valid, other=-float("inf")).to(tl.float32)
        _route_picks(x, offs, valid, ids_ptr, w_ptr, counts_ptr, scaling, K, BLOCK_E, NORM)

    @triton.autotune(configs=_configs([(2, 1024, 4), (4, 512, 4), (2, 512, 2), (4, 256, 4), (8, 256, 4),
                                       (1, 2048, 4)]),
                     key=["E", "H"], restore_value=["counts_ptr"])
    @triton.jit
    def _router_route_kernel(x_ptr, r_ptr, logits_ptr, cnt_ptr, ids_ptr, w_ptr, counts_ptr, E, H: tl.constexpr,
                             scaling, K: tl.constexpr, BLOCK_E: tl.constexpr, NORM: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
        """A MoE router's product and the routing of one token in one kernel: each program computes
        ``BLOCK_N`` logits ``r[e, :] . x`` (float32 sums, stored to ``logits`` in its dtype, as the
        separate product rounds them), then counts itself in ``cnt`` (int32, 0 between calls); the
        last program reads all ``E`` logits back and routes (``_route_picks``), and sets the count
        back to 0. One kernel and one hand-off less per layer than the product and ``_route_kernel``."""
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = offs_n < E
        at = offs_n.to(tl.int64) * H
        _after_inputs(PDL)
        acc = _row_dots(r_ptr + at, r_ptr, x_ptr, H, rm, 0, False, BLOCK_N, BLOCK_K, False)
        tl.store(logits_ptr + offs_n, acc.to(logits_ptr.dtype.element_ty), mask=rm)
        tl.debug_barrier()  # every thread's logits stored before the count says so
        if tl.atomic_add(cnt_ptr, 1, sem="acq_rel") == tl.num_programs(0) - 1:
            offs = tl.arange(0, BLOCK_E)
            valid = offs < E
            x = tl.load(logits_ptr + offs, mask=valid, other=-float("inf"), cache_modifier=".cg").to(tl.float32)
            _route_picks(x, offs, valid, ids_ptr, w_ptr, counts_ptr, scaling, K, BLOCK_E, NORM)
            tl.atomic_xchg(cnt_ptr, 0)

    @triton.jit
    def _qkv_rope_cache_kernel(qkv_ptr, norm_ptr, cos_ptr, sin_ptr, pos_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
                               slot_pos_ptr, NH, NKV, SIZE, eps, HD: tl.constexpr, HAS_NORM: tl.constexpr,
                               ROPE: tl.constexpr, RING: tl.constexpr, PDL: tl.constexpr = False):
        """One token's q/k/v heads: RMS head norm and RoPE for q and k; q to ``q_ptr [NH, HD]``, k and v
        into the KV cache at slot ``pos % SIZE`` (a ring also records the position in ``slot_pos``)."""
        h = tl.program_id(0)
        offs = tl.arange(0, HD)
        _after_inputs(PDL)
        pos = tl.load(pos_ptr)
        slot = pos % SIZE
        x = tl.load(qkv_ptr + h * HD + offs).to(tl.float32)
        if h >= NH + NKV:  # a value head: into the cache as it is
            tl.store(v_cache_ptr + (slot * NKV + h - NH - NKV) * HD + offs, x)
        else:
            rot = (offs + HD // 2) % HD
            xr = tl.load(qkv_ptr + h * HD + rot).to(tl.float32)
            if HAS_NORM:
                inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / HD + eps)
                x = x * inv * tl.load(norm_ptr + h * HD + offs).to(tl.float32)
                xr = xr * inv * tl.load(norm_ptr + h * HD + rot).to(tl.float32)
            if ROPE:  # sin carries rotate_half's sign
                x = x * tl.load(cos_ptr + pos * HD + offs) + xr * tl.load(sin_ptr + pos * HD + offs)
            if h < NH:
                tl.store(q_ptr + h * HD + offs, x)
            else:
                tl.store(k_cache_ptr + (slot * NKV + h - NH) * HD + offs, x)
                if RING:
                    if h == NH:
                        tl.store(slot_pos_ptr + slot, pos)




def qkv_rope_cache(qkv: torch.Tensor, norm: torch.Tensor | None, cos: torch.Tensor | None, sin: torch.Tensor | None,
                   pos: torch.Tensor, n_heads: int, n_kv: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_pos: torch.Tensor | None, eps: float) -> torch.Tensor:
    """One token's attention inputs in one kernel: ``qkv [1, (nH + 2 nKV) hd]`` -> ``q [1, nH, hd]``
    (head RMS norm with ``norm [nH + nKV, hd]`` if given, then RoPE from the tables ``cos``/``sin``
    ``[S, hd]`` (float32, ``sin`` with rotate_half's sign) if given), with k and v written into
    ``k_cache``/``v_cache [size, nKV, hd]`` at slot ``pos % size`` and, for a ring, ``slot_pos``
    updated. ``hd`` must be a power of two."""
    hd = k_cache.shape[-1]
    q = torch.empty((1, n_heads, hd), dtype=qkv.dtype, device=qkv.device)
    dummy = pos
    _qkv_rope_cache_kernel[(n_heads + 2 * n_kv,)](
        qkv, norm if norm is not None else dummy, cos if cos is not None else dummy,
        sin if sin is not None else dummy, pos, q, k_cache, v_cache, slot_pos if slot_pos is not None else dummy,
        n_heads, n_kv, k_cache.shape[0], float(eps), HD=hd, HAS_NORM=norm is not None, ROPE=cos is not None,
        RING=slot_pos is not None, **pdl_args())
    return q


_NEW_FORMS = ("TILE",)
"""Autotuning constexprs of kernel forms not yet run on a GPU before (``run_dropping_new_forms``)."""


def run_dropping_new_forms(kernels: list, launch):
    """``launch()``; if it fails to build a Triton kernel while any of the autotuned ``kernels`` still
    has candidates of the newer forms (``_NEW_FORMS`` set), those candidates are dropped (the forms
    that ran on the GPU before remain) and ``launch()`` runs once more. A newer form that does not
    build on some GPU then costs one warning, not the Triton kernels."""
    try:
        return launch()
    except Exception as exc:
        if not failed_here(exc):
            raise
        dropped = False
        for k in kernels:
            keep = [c for c in k.configs if not any(c.kwargs.get(f) for f in _NEW_FORMS)]
            if keep and len(keep) < len(k.configs):
                k.configs, k.cache, dropped = keep, {}, True
        if not dropped:
            raise
        log.warning("a newer form of the one-token kernels did not build here; the others go on: %s",
                    f"{type(exc).__name__}: {exc}"[:300])
        return launch()


def experts_one_token(x: torch.Tensor, ids: torch.Tensor, scale: torch.Tensor, rowmap: torch.Tensor,
                      w13: torch.Tensor, w2: torch.Tensor, d13: torch.Tensor | None = None,
                      d2: torch.Tensor | None = None, fmt: tuple[str, str] | None = None,
                      b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                      act: tuple = ("silu",)) -> torch.Tensor:
    """SwiGLU experts of one token, weighted and summed: ``[1, H]`` in ``x.dtype``.

    ``x [1, H]``; ``ids``/``scale [k]``: the selected experts and their routing weights;
    ``rowmap [E]`` int64: each expert's row in ``w13 [R, 2I, H]`` (gate rows first) and
    ``w2 [R, H, I]``, or -1 when it lives elsewhere (that pair adds nothing and reads nothing).
    A part of each expert's intermediate units (``unit_views``): ``w13 [R, 2, I', H]`` (gate, up) and
    ``w2 [R, H, I']``, views into whole stacks.
    With ``d13 [R, 2I, H/32]`` / ``d2 [R, H, I/32]`` (float16) the stacks are GGUF Q8_0: ``w13``/``w2``
    int8 values, one scale per 32 along the input axis (contiguous stacks; ``fmt`` may then say
    ``("q8_0", "q8_0")`` or be None). ``fmt=(gate/up format, down format)`` of raw blocks (``"q2_k"``
    ... ``"q6_k"``, ``"iq4_xs"``, ``"mxfp4"``): ``w13 [R, 2I, blocks.row_bytes(fmt[0], H)]`` and
    ``w2 [R, H, blocks.row_bytes(fmt[1], I)]`` are the rows' raw GGUF bytes (uint8).
    gpt-oss: expert biases ``b13 [R, 2I]``, ``b2 [R, H]`` (rows as the stacks) and
    ``act=("clamped_swiglu", alpha, limit)`` (``experts.activate``), computed by PyTorch between the
    two kernels.
    The first call per shape checks the kernels' autotuning candidates against PyTorch
    (``kernel_check``: host syncs, eager only); later calls: no host sync, capturable in a CUDA graph.
    """
    from .experts import activate  # the experts' own activation (this module is imported by them)

    k = ids.shape[0]
    n13 = 2 * w13.shape[2] if w13.dim() == 4 else w13.shape[1]
    s13 = (w13.stride(0), w13.stride(2), w13.stride(1)) if w13.dim() == 4 else \
        (w13.stride(0), w13.stride(1), n13 // 2 * w13.stride(1))
    H = w2.shape[1]
    q8 = d13 is not None
    code13 = code2 = 1 if q8 else 0
    i = w2.shape[2]
    if fmt is not None:
        code13, code2 = FMT_CODES[fmt[0]], FMT_CODES[fmt[1]]
        i = w2.shape[2] if fmt[1] == "q8_0" else blocks.row_values(fmt[1], w2.shape[2])
    bias = b13 is not None
    swiglu = act[0] == "silu"

    def launch(x=x, ids=ids, scale=scale, rowmap=rowmap):
        h = torch.empty((k, n13), dtype=torch.float32, device=x.device)
        _gate_up_kernel[lambda meta: (k, triton.cdiv(n13, meta["BLOCK_N"]))](
            x, w13, d13 if q8 else w13, ids, rowmap, scale, h, b13 if bias else h, n13, H, *s13,
            FMT=code13, BIAS=bias, **pdl_args())
        if not swiglu:  # gpt-oss's clamped SwiGLU into h's first I columns, which the down kernel reads
            h[:, :i] = activate(h, act)
        out = torch.empty((1, H), dtype=x.dtype, device=x.device)
        part, cnt = _down_workspace(w2, k, H, x.device)
        _down_split_kernel[lambda meta: (triton.cdiv(H, meta["BLOCK_N"]), k)](
            h, w2, d2 if q8 else w2, ids, rowmap, scale, out, b2 if bias else h, part, cnt, H, i, w2.stride(0),
            w2.stride(1), K=k, FMT=code2, BIAS=bias, SWIGLU=swiglu, **pdl_args())
        return out

    def probe():  # a random token on the rows this call reads (else the first): kernel_check's probe
        g = torch.Generator(device=x.device).manual_seed(0)
        xc = torch.randn(x.shape, generator=g, device=x.device).to(x.dtype)
        live = [r for r in rowmap[ids].tolist() if r >= 0] or list(range(min(k, w13.shape[0])))
        rows = torch.tensor((live * k)[:k], device=x.device)  # rows other calls left unwritten are not read
        mapc = torch.full_like(rowmap, -1)
        mapc[:k] = rows
        idc = torch.arange(k, device=x.device, dtype=ids.dtype)
        sc = torch.linspace(0.5, 1.0, k, device=x.device).to(scale.dtype)
        f = fmt or (("q8_0", "q8_0") if q8 else (None, None))
        ref = sum(s * expert_f32(xc, r, f, w13, w2, d13, d2, b13, b2, act)
                  for r, s in zip(rows.tolist(), sc.float().tolist()))
        return (lambda: launch(xc, idc, sc, mapc)), ref

    if w13.shape[0] == 0:  # no expert on this tier: every pair inactive
        return torch.zeros((1, H), dtype=x.dtype, device=x.device)
    key = ("experts", n13, H, i, code13, code2, k, x.dtype, w13.dtype, bias, act)
    return run_checked([_gate_up_kernel, _down_split_kernel], launch, key, probe)


_down_workspaces: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _down_workspace(w2: torch.Tensor, k: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``_down_split_kernel``'s parts ``[k, n]`` float32 and block counts ``[n]`` int32 (zero between
    calls) on ``device``, where the kernel runs: the stack ``w2`` may lie elsewhere (the served bus
    reads page-locked host stacks in place). One pair per stack and device, made on its first call
    (eager, before any graph capture), so calls on other stacks (tiers, layers, streams) never share."""
    key = (w2.data_ptr(), torch.device(device), k, n)
    ws = _down_workspaces.get(key)
    if ws is None:
        ws = (torch.empty((k, n), dtype=torch.float32, device=device), torch.zeros(n, dtype=torch.int32, device=device))
        _down_workspaces[key] = ws
    return ws


def run_checked(kernels: list, launch, key, probe):
    """``launch()`` through ``kernel_check.run_checked`` (the autotuned ``kernels``' candidates checked
    at the first call per shape ``key`` with ``probe``) and ``run_dropping_new_forms``."""
    return kernel_check.run_checked(kernels, lambda: run_dropping_new_forms(kernels, launch), key, probe, failed_here)


def _rows_f32(fmt: str | None, w: torch.Tensor, d: torch.Tensor | None, r: int, k: int) -> torch.Tensor:
    """Stack row ``r`` of ``w`` (float values, or kept blocks of ``fmt`` with Q8_0 scales ``d``; a
    ``[R, 2, I', ...]`` view of gate and up rows taken as ``[2I', ...]``) as float32 ``[N, k]``,
    decoded by PyTorch where ``w`` lies."""
    def row(t):
        return t[r].reshape(-1, t.shape[-1]) if t.dim() == 4 else t[r]
    if fmt is None:
        return row(w).float()
    return blocks.dequantize(fmt, [row(w), row(d)] if fmt == "q8_0" else [row(w)], k, torch.float32)


def expert_f32(x: torch.Tensor, r: int, fmt: tuple, w13: torch.Tensor, w2: torch.Tensor,
               d13: torch.Tensor | None = None, d2: torch.Tensor | None = None, b13: torch.Tensor | None = None,
               b2: torch.Tensor | None = None, act: tuple = ("silu",)) -> torch.Tensor:
    """Expert row ``r``'s SwiGLU output for ``x [T, H]`` in float32 on ``x``'s device, computed by
    PyTorch from the stacks ``w13 [R, 2I, H]``, ``w2 [R, H, I]`` (gate rows first; ``fmt`` = (gate/up,
    down) formats, None for float values, ``d13``/``d2`` the Q8_0 scales), which may lie on the host
    (the served bus reads them there): the reference of the kernels' checks (``kernel_check``).
    gpt-oss: biases ``b13 [R, 2I]``, ``b2 [R, H]`` and its clamped activation ``act``."""
    from .experts import activate

    H = x.shape[-1]
    i = w13.shape[2] if w13.dim() == 4 else w13.shape[1] // 2
    a = x.float() @ _rows_f32(fmt[0], w13, d13, r, H).to(x.device).T
    if b13 is not None:
        a = a + b13[r].float().to(x.device)
    y = activate(a, act) @ _rows_f32(fmt[1], w2, d2, r, i).to(x.device).T
    return y if b2 is None else y + b2[r].float().to(x.device)


def add_rms_norm(a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token's residual add and the next RMS norm in one kernel: ``a``, ``b [1, H]`` (same dtype),
    ``weight [H]`` -> ``(s = a + b, rms_norm(s) * weight)``, both ``[1, H]`` in ``a``'s dtype, ``s``
    rounded before the norm as two separate ops would round it."""
    H = a.shape[-1]
    s = torch.empty_like(a)
    n = torch.empty_like(a)
    _add_norm_kernel[(1,)](a, b, weight, s, n, H, float(eps), BLOCK=triton.next_power_of_2(H), **pdl_args())
    return s, n


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """One token's attention over cache positions ``0..pos`` (no mask beyond that):
    ``q [nH, hd]`` (or ``[1, nH, hd]``), ``k_cache``/``v_cache [S, nKV, hd]`` contiguous, ``pos [1]``
    int64 on the device -> ``[1, nH * hd]`` in ``q``'s dtype. Grouped-query heads share their key and
    value reads; the keys are split into ``S / 128`` parts (a power of two, 1..64) merged by a second
    kernel. ``hd`` must be a power of two. No host sync; capturable in a CUDA graph."""
    S, n_kv, hd = k_cache.shape
    q = q.reshape(-1, hd)
    n_heads = q.shape[0]
    rep = n_heads // n_kv
    repp = max(16, triton.next_power_of_2(rep))
    split = min(64, triton.next_power_of_2(max(1, S // 128)))
    dev = q.device
    hdp = max(16, hd)
    po = torch.empty((n_kv, split, repp, hdp), dtype=torch.float32, device=dev)
    pm = torch.empty((n_kv, split, repp), dtype=torch.float32, device=dev)
    pl = torch.empty((n_kv, split, repp), dtype=torch.float32, device=dev)
    _decode_attn_kernel[(n_kv, split)](q, k_cache, v_cache, pos, po, pm, pl, n_kv, float(scale), REP=rep, REPP=repp,
                                       HD=hd, HDP=hdp, SPLIT=split, BLOCK_S=64,
                                       F32_DOT=k_cache.dtype == torch.float32 or not q.is_cuda, **pdl_args())
    out = torch.empty((1, n_heads * hd), dtype=q.dtype, device=dev)
    _decode_attn_combine_kernel[(n_heads,)](po, pm, pl, out, REP=rep, REPP=repp, HD=hd, HDP=hdp, SPLIT=split,
                                            **pdl_args())
    return out


def route_softmax_topk(logits: torch.Tensor, k: int, norm: bool, scaling: float, counts: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token's softmax top-k routing: ``logits [1, E]`` -> ``ids [1, k]`` int64 and weights
    ``[1, k]`` (``logits.dtype``; float32 softmax, renormalised over the k when ``norm``, times
    ``scaling``); adds 1 to ``counts [E]`` (int64) per pick."""
    E = logits.shape[-1]
    ids = torch.empty((1, k), dtype=torch.int64, device=logits.device)
    weights = torch.empty((1, k), dtype=logits.dtype, device=logits.device)
    # one warp: the K rounds' reductions by shuffles alone (4 warps: two barriers a round)
    _route_kernel[(1,)](logits, ids, weights, counts, E, float(scaling), K=k,
                        BLOCK_E=triton.next_power_of_2(E), NORM=norm, num_warps=1, **pdl_args())
    return ids, weights


_route_counts: dict[tuple, torch.Tensor] = {}


def fused_routing() -> bool:
    """Whether one token's router product and routing run as one kernel (``router_route``): the
    default; ``WORKBENCH_FUSED_ROUTING=0`` runs the product on the one-pass matvec, then
    ``route_softmax_topk``. With the routing's picks as ``K`` rounds of one max (it had ranked
    every expert against all the others), S1 all on the GPU decoded 530.3 tok/s on an H100 in the
    fused form, 61.1% of its roofline, against 481.5-495.2 tok/s on three earlier H100 hosts in
    the two-kernel form (BENCHMARKS.md, sixteenth stop; on one host, the eighth stop's, the fused
    form with the old picks was 1.5% ahead)."""
    return os.environ.get("WORKBENCH_FUSED_ROUTING", "1") != "0"


def router_route(x: torch.Tensor, router: torch.Tensor, k: int, norm: bool, scaling: float, counts: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token's router product and softmax top-k routing in one kernel (``_router_route_kernel``):
    ``x [1, H]``, ``router [E, H]`` (contiguous, x's dtype) -> ``ids [1, k]`` int64 and weights
    ``[1, k]`` (x's dtype), as ``route_softmax_topk`` of the logits ``x @ router.T`` rounded to x's
    dtype; adds 1 to ``counts [E]`` (int64) per pick. The first call per shape checks the kernel's
    autotuning candidates' logits against PyTorch (``kernel_check``; eager); later calls capturable.
    Each router has its own program count, made at its first call, so routers on other streams
    never share one."""
    E, H = router.shape
    key = (router.data_ptr(), x.device)
    cnt = _route_counts.get(key)
    if cnt is None:
        cnt = _route_counts[key] = torch.zeros(1, dtype=torch.int32, device=x.device)

    def launch(x=x, counts=counts):
        logits = torch.empty((1, E), dtype=x.dtype, device=x.device)
        ids = torch.empty((1, k), dtype=torch.int64, device=x.device)
        weights = torch.empty((1, k), dtype=x.dtype, device=x.device)
        _router_route_kernel[lambda meta: (triton.cdiv(E, meta["BLOCK_N"]),)](
            x, router, logits, cnt, ids, weights, counts, E, H, float(scaling), K=k,
            BLOCK_E=triton.next_power_of_2(E), NORM=norm, **pdl_args())
        return ids, weights, logits

    def probe():  # a random token's logits against PyTorch; its picks counted elsewhere
        g = torch.Generator(device=x.device).manual_seed(0)
        xc = torch.randn(x.shape, generator=g, device=x.device).to(x.dtype)
        return (lambda: launch(xc, torch.zeros_like(counts))[2]), xc.float() @ router.float().T

    ids, weights, _ = run_checked([_router_route_kernel], launch, ("router_route", E, H, k, x.dtype), probe)
    return ids, weights
