"""Kept quantized blocks (``engine.blocks``) dequantize exactly as gguf-py dequantizes the same bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from workbench.engine import blocks


def _random_kquant(fmt: str, rows: int, k: int) -> np.ndarray:
    size = blocks.KQUANTS[fmt]
    gen = torch.Generator().manual_seed(k)
    raw = torch.randint(0, 256, (rows, k // 256, size), dtype=torch.uint8, generator=gen).numpy()
    d = (np.abs(torch.randn(rows, k // 256, 2, generator=gen).numpy()) * 1e-2 + 1e-3).astype(np.float16)
    at = slice(0, 4) if fmt == "q4_k" else slice(208, 210)  # Q4_K: d, dmin first; Q6_K: d last
    raw[..., at] = d.view(np.uint8).reshape(rows, k // 256, 4)[..., : at.stop - at.start]
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("fmt,k", [("q8_0", 64), ("q4_k", 512), ("q6_k", 512)])
def test_dequantize_matches_gguf(fmt, k):
    if fmt == "q8_0":
        w = torch.randn(6, k, generator=torch.Generator().manual_seed(0)).numpy()
        raw = quantize(w, GGMLQuantizationType.Q8_0)
        b = raw.reshape(6, -1, 34)
        parts = [torch.from_numpy(np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(6, k)),
                 torch.from_numpy(np.ascontiguousarray(b[..., :2]).view(np.float16)[..., 0])]
    else:
        raw = _random_kquant(fmt, 6, k)
        parts = [torch.from_numpy(raw.copy())]
    qtype = {"q8_0": GGMLQuantizationType.Q8_0, "q4_k": GGMLQuantizationType.Q4_K,
             "q6_k": GGMLQuantizationType.Q6_K}[fmt]
    ref = dequantize(raw, qtype)
    got = blocks.dequantize(fmt, parts, k, torch.float32).numpy()
    assert np.array_equal(got, ref)
    assert blocks.nbytes(parts) == raw.nbytes


def test_formats_pair_for_the_kernels():
    assert blocks.pairs_well("q8_0", "q8_0") and blocks.pairs_well("q4_k", "q6_k")
    assert not blocks.pairs_well("q8_0", "q6_k") and not blocks.pairs_well("q4_k", "q8_0")
