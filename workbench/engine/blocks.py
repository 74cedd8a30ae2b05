"""Routed experts kept in a GGUF file's quantized blocks instead of being dequantized at load.

A kept matrix ``[N, K]`` is a list of tensors (any device):

- ``q8_0``: ``[q int8 [N, K], d float16 [N, K/32]]`` (value = d * q per 32 values along K);
- ``q4_k``: ``[raw uint8 [N, K/256 * 144]]``, the rows' super-blocks as stored (4.5 bits a value);
- ``q5_k``: ``[raw uint8 [N, K/256 * 176]]`` likewise (5.5 bits a value: Q4_K's layout with a
  fifth bit per value in 32 more bytes);
- ``q2_k``: ``[raw uint8 [N, K/256 * 84]]`` and ``q3_k``: ``[raw uint8 [N, K/256 * 110]]`` likewise
  (2.6 and 3.4 bits a value: Q2_K and Q3_K_M files, the sizes of a Qwen3-235B-A22B that fits 128 GB
  of RAM);
- ``iq4_xs``: ``[raw uint8 [N, K/256 * 136]]`` likewise (4.25 bits a value: 4-bit indices into
  llama.cpp's non-linear table ``IQ4_VALUES``, a 6-bit scale per 32);
- ``q6_k``: ``[raw uint8 [N, K/256 * 210]]`` likewise (6.6 bits a value). Q4_K_M and Q5_K_M files
  store some expert down matrices as Q6_K, so the format is chosen per matrix: gate and up share
  one, down may differ (both k-quants, or both Q8_0);
- ``mxfp4``: ``[raw uint8 [N, K/32 * 17]]``, OCP MXFP4 blocks as GGUF stores them (4.25 bits a
  value: an E8M0 exponent and 32 FP4 values; every gpt-oss GGUF's experts). Its blocks are 32 values,
  so it takes gpt-oss's 2880; it pairs with itself only.

The fused CPU kernels (``cpu_kernel.moe_decode_q8`` / ``moe_decode_q4k``) and the one-token Triton
kernels (``gpu_kernels.experts_one_token``) read them in place; every other step dequantizes the
rows it uses with ``dequantize`` (float32 arithmetic, as gguf-py does).
"""

from __future__ import annotations

import torch

FORMATS = {"Q8_0": "q8_0", "Q2_K": "q2_k", "Q3_K": "q3_k", "Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k",
           "IQ4_XS": "iq4_xs", "MXFP4": "mxfp4"}
"""GGUF storage types the engine keeps -> the format names used here."""
BLOCK = {"q8_0": 32, "q2_k": 256, "q3_k": 256, "q4_k": 256, "q5_k": 256, "q6_k": 256, "iq4_xs": 256, "mxfp4": 32}
"""Values per block along K: a kept matrix needs K to be a multiple."""
KQUANTS = {"q2_k": 84, "q3_k": 110, "q4_k": 144, "q5_k": 176, "q6_k": 210, "iq4_xs": 136}
"""Bytes per 256-value super-block (the k-quants, and IQ4_XS, which pairs with them)."""
KQUANT_HALVES = {"q2_k": (80, 82), "q3_k": (108,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,), "iq4_xs": (0,)}
"""Byte offsets in a super-block of its float16 ``d`` (and ``dmin``)."""
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
"""The values IQ4_XS's 4-bit indices stand for (llama.cpp's ``kvalues_iq4nl``)."""
RAW = {**{f: (256, n) for f, n in KQUANTS.items()}, "mxfp4": (32, 17)}
"""Formats kept as raw blocks -> (values, bytes) per block."""
MX_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
"""MXFP4's FP4 values by index, doubled (llama.cpp's ``kvalues_mxfp4``; a block's scale is halved)."""


def row_bytes(fmt: str, k: int) -> int:
    """Bytes of a raw-block row of ``k`` values (``k`` a multiple of the format's block)."""
    values, size = RAW[fmt]
    return k // values * size


def row_values(fmt: str, nbytes: int) -> int:
    """Values of a raw-block row of ``nbytes`` bytes."""
    values, size = RAW[fmt]
    return nbytes // size * values


def pairs_well(fmt13: str, fmt2: str) -> bool:
    """Whether the kernels take gate/up in ``fmt13`` with down in ``fmt2``: both Q8_0, both MXFP4, or
    both k-quants."""
    return fmt13 == fmt2 in ("q8_0", "mxfp4") or (fmt13 in KQUANTS and fmt2 in KQUANTS)


def expert_formats(gate: str | None, up: str | None, down: str | None) -> tuple[str, str] | None:
    """``(gate/up, down)`` formats of an expert whose three matrices are stored as ``gate``, ``up``,
    ``down`` (``FORMATS`` names; None: not one of them) when the kernels take them kept in their
    blocks: gate and up alike, and ``pairs_well`` with down. Else None (the engine dequantizes)."""
    if gate is None or down is None or gate != up or not pairs_well(gate, down):
        return None
    return gate, down


def alloc(fmt: str, lead: tuple[int, ...], n: int, k: int, device=None, empty=None) -> list[torch.Tensor]:
    """Empty storage of ``fmt`` for matrices ``[*lead, n, k]``; ``empty(shape, dtype)`` makes each
    tensor instead of ``torch.empty`` on ``device`` (e.g. ``hostmem.empty``)."""
    if empty is None:
        empty = lambda shape, dtype: torch.empty(shape, dtype=dtype, device=device)  # noqa: E731
    if fmt == "q8_0":
        return [empty((*lead, n, k), torch.int8), empty((*lead, n, k // 32), torch.float16)]
    return [empty((*lead, n, row_bytes(fmt, k)), torch.uint8)]


def nbytes(parts: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in parts)


def dequantize(fmt: str, parts: list[torch.Tensor], k: int, dtype: torch.dtype) -> torch.Tensor:
    """Kept matrices ``[..., N, K]`` (``k = K``) as ``dtype``, computed in float32."""
    if fmt == "q8_0":
        q, d = parts
        vals = q.reshape(*q.shape[:-1], -1, 32).float() * d.float()[..., None]
        return vals.reshape(q.shape).to(dtype)
    (raw,) = parts
    if fmt == "mxfp4":
        return _mxfp4(raw.reshape(-1, k // 32, 17)).reshape(*raw.shape[:-1], k).to(dtype)
    lead, nb = raw.shape[:-1], k // 256
    if fmt in _SIXTEENS:
        return _SIXTEENS[fmt](raw.reshape(-1, nb, KQUANTS[fmt]), nb).reshape(*lead, k).to(dtype)
    b = raw.reshape(-1, nb, KQUANTS[fmt])
    d = b[..., 0:2].contiguous().view(torch.float16).float()  # [R, nb, 1]
    dmin = b[..., 2:4].contiguous().view(torch.float16).float()
    sc = b[..., 4:16].to(torch.int32).reshape(-1, nb, 3, 4)
    lo, hi, mix = sc[..., 0, :], sc[..., 1, :], sc[..., 2, :]
    scale = torch.cat([lo & 63, (mix & 15) | ((lo >> 2) & 48)], dim=-1)  # [R, nb, 8]
    mins = torch.cat([hi & 63, (mix >> 4) | ((hi >> 2) & 48)], dim=-1)
    qs = b[..., -128:].to(torch.int32).reshape(-1, nb, 4, 1, 32)  # 64-value chunks: low nibbles, then high
    q = torch.cat([qs & 15, qs >> 4], dim=3).reshape(-1, nb, 8, 32)
    if fmt == "q5_k":  # sub-block j's fifth bits: bit j of the 32 bytes before the nibbles
        qh = b[..., 16:48].to(torch.int32).reshape(-1, nb, 1, 32)
        q = q | (((qh >> _arange(8, b.device).reshape(8, 1)) & 1) << 4)
    vals = d[..., None] * scale[..., None].float() * q.float() - dmin[..., None] * mins[..., None].float()
    return vals.reshape(*lead, k).to(dtype)


def _arange(n: int, device) -> torch.Tensor:
    """int32 ``0 .. n-1`` on ``device`` (the blocks' own: CUDA decodes them where they lie)."""
    return torch.arange(n, dtype=torch.int32, device=device)


_IQ4_TABLES: dict[str, torch.Tensor] = {}


def _iq4_table(device) -> torch.Tensor:
    """``IQ4_VALUES`` as float32 on ``device``, made once per device (the first decode there is
    eager: a kernel check's reference, before any CUDA graph captures one)."""
    key = str(device)
    t = _IQ4_TABLES.get(key)
    if t is None:
        t = _IQ4_TABLES[key] = torch.tensor(IQ4_VALUES, dtype=torch.float32).to(device)
    return t


def _q6_k(b: torch.Tensor, nb: int) -> torch.Tensor:
    """Q6_K super-blocks ``[R, nb, 210]`` -> float32 ``[R, nb, 256]``."""
    ql = b[..., :128].to(torch.int32).reshape(-1, nb, 2, 1, 64)
    ql = torch.cat([ql & 15, ql >> 4], dim=3).reshape(-1, nb, 2, 4, 32)  # per half: 4 groups of 32
    qh = b[..., 128:192].to(torch.int32).reshape(-1, nb, 2, 1, 32)
    qh = torch.cat([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=3)  # [R, nb, 2, 4, 32]
    q = ((ql | (qh << 4)) - 32).float().reshape(-1, nb, 16, 16)
    sc = b[..., 192:208].contiguous().view(torch.int8).float()  # [R, nb, 16]
    d = b[..., 208:210].contiguous().view(torch.float16).float()  # [R, nb, 1]
    return (d[..., None] * sc[..., None] * q).reshape(-1, nb, 256)


def _low_bits(b: torch.Tensor, nb: int) -> torch.Tensor:
    """Q2_K / Q3_K's 2-bit parts, 64 bytes ``b [R, nb, 64]`` -> int32 ``[R, nb, 16, 16]``: byte ``32 n + l``
    holds value ``128 n + 32 g + l`` in bits ``2 g``."""
    q = b.to(torch.int32).reshape(-1, nb, 2, 1, 32) >> (2 * _arange(4, b.device)).reshape(4, 1)
    return (q & 3).reshape(-1, nb, 16, 16)


def _q2_k(b: torch.Tensor, nb: int) -> torch.Tensor:
    """Q2_K super-blocks ``[R, nb, 84]`` (16 bytes of 4-bit scale and minimum per 16 values, 64 bytes
    of 2-bit values, float16 d and dmin) -> float32 ``[R, nb, 256]``: ``d * sc * q - dmin * m``."""
    sc = b[..., :16].to(torch.int32)
    d = b[..., 80:82].contiguous().view(torch.float16).float()  # [R, nb, 1]
    dmin = b[..., 82:84].contiguous().view(torch.float16).float()
    q = _low_bits(b[..., 16:80], nb).float()
    vals = (d * (sc & 15).float())[..., None] * q - (dmin * (sc >> 4).float())[..., None]
    return vals.reshape(-1, nb, 256)


def _q3_k(b: torch.Tensor, nb: int) -> torch.Tensor:
    """Q3_K super-blocks ``[R, nb, 110]`` (32 bytes of high bits, 64 of 2-bit values, 12 of 6-bit
    scales, float16 d) -> float32 ``[R, nb, 256]``: ``d * (sc - 32) * (q - 4)`` where value ``32 j + l``
    has ``q``'s bit 2 from bit ``j`` of byte ``l``."""
    hm = b[..., :32].to(torch.int32).reshape(-1, nb, 1, 32) >> _arange(8, b.device).reshape(8, 1)
    q = _low_bits(b[..., 32:96], nb) | ((hm & 1) << 2).reshape(-1, nb, 16, 16)
    s = b[..., 96:108].to(torch.int32)
    low = torch.cat([s[..., :8] & 15, s[..., :8] >> 4], dim=-1)  # [R, nb, 16]
    high = (s[..., 8:12].reshape(-1, nb, 1, 4) >> (2 * _arange(4, b.device)).reshape(4, 1)) & 3
    sc = (low | (high.reshape(-1, nb, 16) << 4)) - 32
    d = b[..., 108:110].contiguous().view(torch.float16).float()
    return ((d * sc.float())[..., None] * (q - 4).float()).reshape(-1, nb, 256)


def _iq4_xs(b: torch.Tensor, nb: int) -> torch.Tensor:
    """IQ4_XS super-blocks ``[R, nb, 136]`` (float16 d, 16 bits of the scales' top 2 bits, 4 bytes of
    their low 4, 128 bytes of indices: sub-block j's 32 in bytes 16 j .. 16 j + 15, low nibbles
    first) -> float32 ``[R, nb, 256]``: ``d * (ls - 32) * IQ4_VALUES[index]``."""
    d = b[..., 0:2].contiguous().view(torch.float16).float()  # [R, nb, 1]
    j = _arange(8, b.device)
    high = ((b[..., 2].to(torch.int32) | (b[..., 3].to(torch.int32) << 8))[..., None] >> (2 * j)) & 3
    low = (b[..., 4:8].to(torch.int32)[..., j // 2] >> (4 * (j % 2))) & 15
    ls = (low | (high << 4)) - 32  # [R, nb, 8]
    qs = b[..., 8:].to(torch.int64).reshape(-1, nb, 8, 16)
    idx = torch.cat([qs & 15, qs >> 4], dim=-1)  # [R, nb, 8, 32]
    vals = _iq4_table(b.device)[idx]
    return ((d * ls.float())[..., None] * vals).reshape(-1, nb, 256)


def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    """MXFP4 blocks ``[R, nb, 17]`` (an E8M0 exponent ``e``, 16 bytes of indices: low nibbles values
    0 .. 15, high ones 16 .. 31) -> float32 ``[R, nb, 32]``: ``MX_VALUES[index] * 2^(e - 128)``."""
    e = b[..., 0].to(torch.int32)
    bits = torch.where(e < 2, torch.full_like(e, 0x00200000) << e, (e - 1) << 23)
    scale = bits.view(torch.float32)  # [R, nb]
    qs = b[..., 1:].to(torch.int32)
    idx = torch.cat([qs & 15, qs >> 4], dim=-1)  # [R, nb, 32]
    # MX_VALUES[idx] by arithmetic (no table to copy to the device, so CUDA graphs can capture it):
    # magnitude m = idx & 7 is m below 4, else (2 or 3) << (m / 2 - 1); bit 3 the sign
    m = idx & 7
    mag = torch.where(m < 4, m, (2 + (m & 1)) << ((m >> 1) - 1))
    return scale[..., None] * (mag * (1 - 2 * (idx >> 3))).float()


_SIXTEENS = {"q2_k": _q2_k, "q3_k": _q3_k, "q6_k": _q6_k, "iq4_xs": _iq4_xs}
"""Super-block formats decoded whole (a scale per 16 values, or IQ4_XS's table)."""


def kernel_args(fmt: tuple[str, str] | None, stacks: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """A tier's stacks as the GPU kernels take them (``gpu_kernels.experts_one_token``,
    ``prefill_kernels.swiglu_grouped``): float ``[w13, w2]`` (``fmt`` None) and k-quant ``[b13, b2]``
    as they are, Q8_0 ``[q13, d13, q2, d2]`` as ``(q13, q2, d13, d2)``."""
    if fmt is not None and fmt[0] == "q8_0":
        q13, d13, q2, d2 = stacks
        return q13, q2, d13, d2
    return tuple(stacks)


def take(parts: list[torch.Tensor], rows) -> list[torch.Tensor]:
    """Rows ``rows`` (an index along axis 0) of every tensor of stacked kept matrices."""
    return [t[rows] for t in parts]


def unit_block(fmt: tuple[str, str] | None) -> int:
    """The experts' intermediate units come in whole multiples of this where a layer's units are split
    between the CPU and the accelerator (``unit_views``): the down rows' block (32 values for Q8_0 and
    MXFP4, 256 for the k-quants) or 32 for float stacks (16-byte aligned views)."""
    return 32 if fmt is None else BLOCK[fmt[1]]


def unit_views(fmt: tuple[str, str] | None, stacks: list[torch.Tensor], units: int) -> list[torch.Tensor]:
    """A tier's stacks as ``LayerExperts.cpu_stacks`` holds them (float ``[w13, w2]``, Q8_0 ``[q13, d13,
    q2, d2]``, k-quants ``[b13, b2]``) cut to each expert's intermediate units ``[units, I)``: views
    (nothing copied) that ``gpu_kernels.experts_one_token`` reads, gate/up ``[R, 2, I - units, ...]``
    (gate rows then up rows) and down ``[R, H, ...]`` starting at column ``units`` (its block for
    blocks). ``units`` is a multiple of ``unit_block(fmt)``."""
    def gate_up(t: torch.Tensor) -> torch.Tensor:
        r, n, w = t.shape
        return t.view(r, 2, n // 2, w)[:, :, units:, :]

    if fmt is not None and fmt[0] == "q8_0":
        q13, d13, q2, d2 = stacks
        return [gate_up(q13), gate_up(d13), q2[:, :, units:], d2[:, :, units // 32:]]
    w13, w2 = stacks
    if fmt is None:
        return [gate_up(w13), w2[:, :, units:]]
    return [gate_up(w13), w2[:, :, row_bytes(fmt[1], units):]]
