"""Routed experts kept in a GGUF file's quantized blocks instead of being dequantized at load.

A kept matrix ``[N, K]`` is a list of tensors (any device):

- ``q8_0``: ``[q int8 [N, K], d float16 [N, K/32]]`` (value = d * q per 32 values along K);
- ``q4_k``: ``[raw uint8 [N, K/256 * 144]]``, the rows' super-blocks as stored (4.5 bits a value).

The fused CPU kernels (``cpu_kernel.moe_decode_q8`` / ``moe_decode_q4k``) and the one-token Triton
kernels (``gpu_kernels.experts_one_token``) read them in place; every other step dequantizes the
rows it uses with ``dequantize`` (float32 arithmetic, as gguf-py does).
"""

from __future__ import annotations

import torch

FORMATS = {"Q8_0": "q8_0", "Q4_K": "q4_k"}
"""GGUF storage types the engine keeps -> the format names used here."""
BLOCK = {"q8_0": 32, "q4_k": 256}
"""Values per block along K: a kept matrix needs K to be a multiple."""


def alloc(fmt: str, lead: tuple[int, ...], n: int, k: int, device=None) -> list[torch.Tensor]:
    """Empty storage of ``fmt`` for matrices ``[*lead, n, k]``."""
    if fmt == "q8_0":
        return [torch.empty((*lead, n, k), dtype=torch.int8, device=device),
                torch.empty((*lead, n, k // 32), dtype=torch.float16, device=device)]
    return [torch.empty((*lead, n, k // 256 * 144), dtype=torch.uint8, device=device)]


def nbytes(parts: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in parts)


def dequantize(fmt: str, parts: list[torch.Tensor], k: int, dtype: torch.dtype) -> torch.Tensor:
    """Kept matrices ``[..., N, K]`` (``k = K``) as ``dtype``, computed in float32."""
    if fmt == "q8_0":
        q, d = parts
        vals = q.reshape(*q.shape[:-1], -1, 32).float() * d.float()[..., None]
        return vals.reshape(q.shape).to(dtype)
    (raw,) = parts
    lead, nb = raw.shape[:-1], k // 256
    b = raw.reshape(-1, nb, 144)
    d = b[..., 0:2].contiguous().view(torch.float16).float()  # [R, nb, 1]
    dmin = b[..., 2:4].contiguous().view(torch.float16).float()
    sc = b[..., 4:16].to(torch.int32).reshape(-1, nb, 3, 4)
    lo, hi, mix = sc[..., 0, :], sc[..., 1, :], sc[..., 2, :]
    scale = torch.cat([lo & 63, (mix & 15) | ((lo >> 2) & 48)], dim=-1)  # [R, nb, 8]
    mins = torch.cat([hi & 63, (mix >> 4) | ((hi >> 2) & 48)], dim=-1)
    qs = b[..., 16:].to(torch.int32).reshape(-1, nb, 4, 1, 32)  # 64-value chunks: low nibbles, then high
    q = torch.cat([qs & 15, qs >> 4], dim=3).reshape(-1, nb, 8, 32).float()
    vals = d[..., None] * scale[..., None].float() * q - dmin[..., None] * mins[..., None].float()
    return vals.reshape(*lead, k).to(dtype)


def take(parts: list[torch.Tensor], rows) -> list[torch.Tensor]:
    """Rows ``rows`` (an index along axis 0) of every tensor of stacked kept matrices."""
    return [t[rows] for t in parts]
