"""Kept quantized blocks (``engine.blocks``) dequantize exactly as gguf-py dequantizes the same bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from tests.engine.engine_helpers import random_kquant
from workbench.engine import blocks


@pytest.mark.parametrize("fmt,k", [("q8_0", 64), ("q2_k", 512), ("q3_k", 256), ("q4_k", 512), ("q5_k", 512),
                                   ("q6_k", 512), ("iq4_xs", 512), ("mxfp4", 2880)])
def test_dequantize_matches_gguf(fmt, k):
    if fmt == "q8_0":
        w = torch.randn(6, k, generator=torch.Generator().manual_seed(0)).numpy()
        raw = quantize(w, GGMLQuantizationType.Q8_0)
        b = raw.reshape(6, -1, 34)
        parts = [torch.from_numpy(np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(6, k)),
                 torch.from_numpy(np.ascontiguousarray(b[..., :2]).view(np.float16)[..., 0])]
    else:
        parts = [random_kquant(fmt, 6, k, torch.Generator().manual_seed(k))[0]]
        raw = parts[0].numpy()
    ref = dequantize(raw, GGMLQuantizationType[fmt.upper()])
    got = blocks.dequantize(fmt, parts, k, torch.float32).numpy()
    assert np.array_equal(got, ref)
    assert blocks.nbytes(parts) == raw.nbytes


def test_formats_pair_for_the_kernels():
    assert blocks.pairs_well("q8_0", "q8_0") and blocks.pairs_well("q4_k", "q6_k") and blocks.pairs_well("q5_k", "q6_k")
    assert not blocks.pairs_well("q8_0", "q6_k") and not blocks.pairs_well("q4_k", "q8_0")
    assert blocks.pairs_well("mxfp4", "mxfp4") and not blocks.pairs_well("mxfp4", "q4_k")


def test_every_mxfp4_code_and_exponent_dequantizes_as_gguf():
    """All 16 FP4 codes in every byte position under all 256 exponents (the subnormal scales of 0 and
    1, and the infinite products of 255, too) give gguf-py's values, read without a lookup table."""
    raw = np.zeros((256, 17), dtype=np.uint8)
    raw[:, 0] = np.arange(256)
    raw[:, 1:] = (np.arange(16) | (np.arange(16)[::-1] << 4)).astype(np.uint8)
    with np.errstate(over="ignore"):
        ref = dequantize(raw.reshape(1, -1), GGMLQuantizationType.MXFP4)
    got = blocks.dequantize("mxfp4", [torch.from_numpy(raw.reshape(1, -1))], 256 * 32, torch.float32).numpy()
    assert np.array_equal(got, ref, equal_nan=True)


@pytest.mark.parametrize("fmt", ["q8_0", *blocks.RAW])
def test_dequantize_works_where_the_blocks_lie(fmt):
    """Every constant of the PyTorch decoders is made on the blocks' device: on CUDA the kernels' checks
    decode there (a table or ``arange`` left on the CPU failed every Q2_K ... Q5_K and IQ4_XS check on
    the H200). The meta device stands in for CUDA here: mixing it with a CPU tensor fails alike."""
    k = 512
    parts = ([torch.empty(4, k, dtype=torch.int8, device="meta"), torch.empty(4, k // 32, dtype=torch.float16,
                                                                             device="meta")]
             if fmt == "q8_0" else [torch.empty(4, blocks.row_bytes(fmt, k), dtype=torch.uint8, device="meta")])
    out = blocks.dequantize(fmt, parts, k, torch.bfloat16)
    assert out.device.type == "meta" and out.shape == (4, k) and out.dtype == torch.bfloat16
