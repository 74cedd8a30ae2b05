"""Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and IQ4_XS encoders in numpy (gguf-py only decodes them).

Blocks of 256 values (ggml's ``QK_K``), laid out byte for byte as ggml's ``block_q2_K`` ...
``block_q6_K``. Scales are chosen from each sub-block's range (no search for
the error-optimal scale as llama.cpp's ``make_qkx2_quants`` does): the files are valid and
dequantize within a quantization step, which is what test models need.
"""

from __future__ import annotations

import numpy as np

QK_K = 256
KQUANT_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")
"""The GGUF types these encoders write."""


def quantize_k(data: np.ndarray, ttype: str) -> np.ndarray:
    """Encode float ``data`` (last axis a multiple of 256) as ``ttype``; returns uint8 bytes of shape
    ``data.shape[:-1] + (bytes per row,)``, as ``gguf.quants.quantize`` does for other types."""
    x = np.asarray(data, dtype=np.float32)
    if x.shape[-1] % QK_K:
        raise ValueError(f"{ttype} needs rows that are a multiple of {QK_K} values, got {x.shape[-1]}")
    blocks = x.reshape(-1, QK_K)
    encode = {"Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "IQ4_XS": _iq4_xs}[ttype]
    out = encode(blocks)
    return out.reshape(*x.shape[:-1], x.shape[-1] // QK_K * out.shape[-1])


def _f16(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float16 bytes and the float32 value they hold."""
    h = v.astype(np.float16)
    return h.view(np.uint8).reshape(*v.shape, 2), h.astype(np.float32)


def _scales_mins(blocks: np.ndarray, qmax: int):
    """Affine 6-bit scales and mins per 32-value sub-block: x ~ d*sc*q - dmin*m, q in [0, qmax]."""
    sub = blocks.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(axis=2), 0.0)
    hi = sub.max(axis=2)
    scale = (hi - lo) / qmax  # [n, 8]
    mins = -lo
    d_bytes, d = _f16(scale.max(axis=1) / 63)
    m_bytes, dmin = _f16(mins.max(axis=1) / 63)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(scale / d[:, None]), 0).clip(0, 63).astype(np.uint8)
        m = np.where(dmin[:, None] > 0, np.rint(mins / dmin[:, None]), 0).clip(0, 63).astype(np.uint8)
        step = d[:, None] * sc
        offset = dmin[:, None] * m
        q = np.where(step[..., None] > 0, np.rint((sub + offset[..., None]) / step[..., None]), 0)
    q = q.clip(0, qmax).astype(np.uint8)  # [n, 8, 32]
    packed = np.zeros((blocks.shape[0], 12), np.uint8)
    packed[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    return d_bytes, m_bytes, packed, q


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, scales, q = _scales_mins(blocks, 15)
    q = q.reshape(-1, 4, 2, 32)  # chunks of 64: sub-block 2c in low nibbles, 2c+1 in high nibbles
    qs = (q[:, :, 0, :] | (q[:, :, 1, :] << 4)).reshape(-1, 128)
    return np.concatenate([d, dmin, scales, qs], axis=1)


def _q5_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, scales, q = _scales_mins(blocks, 31)
    low, high = q & 0xF, q >> 4  # [n, 8, 32]
    qh = np.zeros((blocks.shape[0], 32), np.uint8)
    for s in range(8):
        qh |= high[:, s, :] << s
    low = low.reshape(-1, 4, 2, 32)
    qs = (low[:, :, 0, :] | (low[:, :, 1, :] << 4)).reshape(-1, 128)
    return np.concatenate([d, dmin, scales, qh, qs], axis=1)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    sub = blocks.reshape(-1, 16, 16)
    scale = np.abs(sub).max(axis=2) / 31  # [n, 16]
    d_bytes, d = _f16(scale.max(axis=1) / 127)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(scale / d[:, None]), 0).clip(0, 127).astype(np.int8)
        step = d[:, None] * sc
        q = np.where(step[..., None] > 0, np.rint(sub / step[..., None]), 0)
    q = (q.clip(-32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # halves of 128: y[l + 32k]
    ql = np.empty((blocks.shape[0], 2, 64), np.uint8)
    ql[:, :, 0:32] = (q[:, :, 0] & 0xF) | ((q[:, :, 2] & 0xF) << 4)
    ql[:, :, 32:64] = (q[:, :, 1] & 0xF) | ((q[:, :, 3] & 0xF) << 4)
    qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), d_bytes], axis=1)


def _two_bits(q: np.ndarray) -> np.ndarray:
    """2-bit values ``q [n, 256]`` -> 64 bytes per block: byte ``32 h + l`` holds value ``128 h + 32 g + l``
    in bits ``2 g``."""
    q = q.reshape(-1, 2, 4, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)).reshape(-1, 64)


def _q2_k(blocks: np.ndarray) -> np.ndarray:
    """Affine 4-bit scales and mins per 16 values: x ~ d*sc*q - dmin*m, q in [0, 3]."""
    sub = blocks.reshape(-1, 16, 16)
    lo = np.minimum(sub.min(axis=2), 0.0)
    scale = (sub.max(axis=2) - lo) / 3  # [n, 16]
    d_bytes, d = _f16(scale.max(axis=1) / 15)
    m_bytes, dmin = _f16(-lo.min(axis=1) / 15)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(scale / d[:, None]), 0).clip(0, 15).astype(np.uint8)
        m = np.where(dmin[:, None] > 0, np.rint(-lo / dmin[:, None]), 0).clip(0, 15).astype(np.uint8)
        step = d[:, None] * sc
        q = np.where(step[..., None] > 0, np.rint((sub + (dmin[:, None] * m)[..., None]) / step[..., None]), 0)
    q = q.clip(0, 3).astype(np.uint8).reshape(-1, 256)
    return np.concatenate([sc | (m << 4), _two_bits(q), d_bytes, m_bytes], axis=1)


def _signed_scales(sub: np.ndarray, lowest: float):
    """Signed 6-bit scales of sub-blocks ``sub [n, S, L]`` such that each one's value of largest
    magnitude lands on ``lowest`` (the side with room), as llama.cpp's ``make_q3_quants`` and
    ``quantize_row_iq4_nl`` do: float16 ``d`` bytes, scales ``sc [n, S]`` int32 in [-31, 31], and
    each value over its step ``d * sc`` (0 where the step is)."""
    far = np.take_along_axis(sub, np.abs(sub).argmax(axis=2)[..., None], axis=2)[..., 0]  # [n, S], signed
    scale = far / lowest
    d_bytes, d = _f16(np.abs(scale).max(axis=1) / 31)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(scale / d[:, None]), 0).clip(-31, 31).astype(np.int32)
        step = d[:, None] * sc
        ratio = np.where(step[..., None] != 0, sub / step[..., None], 0)
    return d_bytes, sc, ratio


def _q3_k(blocks: np.ndarray) -> np.ndarray:
    """Signed 6-bit scales per 16 values: x ~ d*(sc - 32)*(q - 4), q in [0, 7]; each sub-block's value
    of largest magnitude on -4."""
    d_bytes, sc, ratio = _signed_scales(blocks.reshape(-1, 16, 16), -4.0)
    q = (np.rint(ratio).clip(-4, 3) + 4).astype(np.uint8).reshape(-1, 256)
    hmask = np.zeros((blocks.shape[0], 32), np.uint8)
    for j in range(8):  # bit j of byte l: bit 2 of value 32 j + l
        hmask |= ((q[:, 32 * j:32 * j + 32] >> 2) & 1) << j
    s = (sc + 32).astype(np.uint8)  # [n, 16]: low 4 bits in bytes u % 8 (high nibble for u >= 8), top 2 in 8 + u % 4
    packed = np.zeros((blocks.shape[0], 12), np.uint8)
    packed[:, 0:8] = (s[:, 0:8] & 0xF) | ((s[:, 8:16] & 0xF) << 4)
    for u in range(16):
        packed[:, 8 + u % 4] |= ((s[:, u] >> 4) & 3) << (2 * (u // 4))
    return np.concatenate([hmask, _two_bits(q & 3), packed, d_bytes], axis=1)


IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)
"""The values IQ4_XS's 4-bit indices stand for (llama.cpp's ``kvalues_iq4nl``)."""


def _iq4_xs(blocks: np.ndarray) -> np.ndarray:
    """Signed 6-bit scales per 32 values, each value the nearest of ``d * (ls - 32) * IQ4_VALUES``; a
    sub-block's value of largest magnitude on -127."""
    d_bytes, ls, ratio = _signed_scales(blocks.reshape(-1, 8, 32), -127.0)
    idx = np.abs(ratio[..., None] - IQ4_VALUES).argmin(axis=-1).astype(np.uint8)  # [n, 8, 32]
    qs = (idx[:, :, :16] | (idx[:, :, 16:] << 4)).reshape(-1, 128)
    s = (ls + 32).astype(np.uint16)  # [n, 8]
    high = np.zeros(blocks.shape[0], np.uint16)
    for j in range(8):
        high |= ((s[:, j] >> 4) & 3) << (2 * j)
    low = ((s[:, 0::2] & 15) | ((s[:, 1::2] & 15) << 4)).astype(np.uint8)  # [n, 4]
    return np.concatenate([d_bytes, high.view(np.uint8).reshape(-1, 2), low, qs], axis=1)
