"""Shared pieces of the engine tests: tiny models on disk, their Inventory, reference runs."""

from __future__ import annotations

import copy
import os
import random
from pathlib import Path

import torch

from workbench.core.inventory import Inventory
from workbench.core.placement import CPU_COMPUTE, CPU_STREAM, ON_GPU0, Placement

TEST_DEVICE = os.environ.get("WORKBENCH_TEST_DEVICE", "cpu")
"""Accelerator the engine tests use: ``cpu`` in CI, ``cuda`` on a GPU machine."""

TEST_DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16}[
    os.environ.get("WORKBENCH_TEST_DTYPE", "float32" if TEST_DEVICE == "cpu" else "bfloat16")]
"""float32 on the CPU, bfloat16 on CUDA; ``WORKBENCH_TEST_DTYPE`` overrides."""
LOGITS_RTOL = 1e-4 if TEST_DTYPE == torch.float32 else 1e-2

PROMPT = [3, 17, 5, 42, 9, 11, 60, 7, 22, 33, 1, 4, 8, 19, 25, 30, 44, 50, 2, 13]
"""Token ids every engine-vs-transformers comparison feeds (all below the tiny vocabularies)."""
N_NEW = 32
"""Greedy tokens compared with transformers' generate."""


def random_kquant(fmt: str, n: int, k: int, gen: torch.Generator, scale: float = 1e-2
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random GGUF rows of raw-block format ``fmt`` (``q2_k`` ... ``q6_k``, ``iq4_xs``, ``mxfp4``):
    every bit pattern of the quants and sub-scales, with small finite float16 d (and dmin; MXFP4:
    exponents around ``scale``), as uint8 ``[n, blocks.row_bytes(fmt, k)]``, and gguf-py's
    dequantization of those bytes, float64 ``[n, k]``."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from workbench.engine import blocks

    values, size = blocks.RAW[fmt]
    raw = torch.randint(0, 256, (n, k // values, size), dtype=torch.uint8, generator=gen).numpy()
    if fmt == "mxfp4":  # E8M0 exponents: scales 2^(e - 128) from scale / 8 to scale
        top = int(np.log2(scale)) + 128
        raw[..., 0] = torch.randint(top - 3, top + 1, (n, k // values), generator=gen).numpy()
    else:
        d = (np.abs(torch.randn(n, k // 256, 2, generator=gen).numpy()) * scale + scale / 10).astype(np.float16)
        for i, at in enumerate(blocks.KQUANT_HALVES[fmt]):  # d (and dmin)
            raw[..., at:at + 2] = d[..., i:i + 1].view(np.uint8)
    raw = raw.reshape(n, -1)
    ref = dequantize(raw, GGMLQuantizationType[fmt.upper()]).astype(np.float64)
    return torch.from_numpy(raw.copy()), torch.from_numpy(ref)


def open_inventory(path: Path) -> Inventory:
    """The Inventory of a model folder or GGUF file, from the product's reader."""
    from workbench.core.readers import open_model

    return open_model(path)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref|."""
    got, ref = got.float().cpu(), ref.float().cpu()
    return float((got - ref).abs().max() / ref.abs().max())


def logits_tolerance(model, ids: list[int], ref: torch.Tensor) -> float:
    """Allowed ``rel_err`` of the engine's logits against ``ref`` (the fp32 reference): 1e-4 in fp32.
    In bf16, 1e-2, or 1.5x the error transformers itself makes in bf16 on the same prompt, which is
    larger when a router near-tie flips an expert choice (2.6% for the tiny qwen3_moe)."""
    if TEST_DTYPE == torch.float32:
        return LOGITS_RTOL
    own = rel_err(reference_logits(copy.deepcopy(model).to(TEST_DTYPE), ids), ref)
    return max(LOGITS_RTOL, 1.5 * own)


def reference_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def reference_tokens(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def greedy_tokens(engine, ids: list[int], n: int) -> list[int]:
    """``n`` greedy tokens from the engine: prefill the prompt, then decode one token at a time."""
    logits = engine.forward(torch.tensor(ids), 0)
    out = [int(logits[-1].argmax())]
    pos = len(ids)
    while len(out) < n:
        logits = engine.forward(torch.tensor([out[-1]]), pos)
        pos += 1
        out.append(int(logits[-1].argmax()))
    return out


def placements(inv: Inventory, seed: int = 0) -> dict[str, Placement]:
    """The four placements every family is tested under."""
    keys = inv.expert_keys()
    layers = sorted({k.layer for k in keys})
    per_layer = len(keys) // max(1, len(layers))
    out = {"resident": Placement()}
    out["compute"] = Placement()
    out["compute"].move(keys, CPU_COMPUTE)
    p = Placement(ON_GPU0, stream_slots=max(1, per_layer // 2 - 1) if per_layer > 2 else 1)
    p.move(keys, CPU_STREAM)
    out["stream"] = p
    rng = random.Random(seed)
    p = Placement(ON_GPU0, stream_slots=2)
    for k in keys:
        p.set(k, rng.choice([ON_GPU0, CPU_COMPUTE, CPU_STREAM]))
    out["mixed"] = p
    return out



def decode_step_engine(inv: Inventory, placement: Placement, max_context: int = 96):
    """An engine whose one-token steps run the decode graphs' fixed-shape pieces
    (``graphs.DecodeStep``): captured as CUDA graphs on CUDA, run eagerly on the CPU."""
    from workbench.engine import Engine

    engine = Engine.load(inv, placement, device=TEST_DEVICE, dtype=TEST_DTYPE, max_context=max_context)
    engine.decode_mode = "static" if TEST_DEVICE == "cpu" else "auto"
    return engine


def attach_bus_share(engine, fraction: float, units: float = 0.0):
    """The engine's bus share (``bus.BusShare``) at ``fraction``: on CUDA the one the engine made; on a
    CPU accelerator one attached by hand to every layer with CPU experts, as the engine would.
    ``units``: served decode's unit split in every such layer (``LayerExperts.bus_units``)."""
    from workbench.engine import bus
    from workbench.engine.experts import COMPUTE

    if TEST_DEVICE != "cpu":
        assert engine._bus is not None
        engine._bus.fraction = fraction
        for lx in engine.experts.values():
            lx.bus_units = units if lx.bus is not None else 0.0
        return engine._bus
    a = engine.args
    share = bus.BusShare(engine.device, engine.dtype, a.n_experts, (2 * a.expert_ffn, a.hidden),
                         (a.hidden, a.expert_ffn), fraction)
    for lx in engine.experts.values():
        if lx.n_tier[COMPUTE]:
            assert share.pin(lx, lx.bus_stacks(), lx.kept_layout(), lx.bias)
            lx.bus, lx.bus_units = share, units
    return share


def force_kernel_form(monkeypatch, form: str) -> None:
    """Make the autotuned one-token kernels run one form of their row loop (``"tile"``: rows decoded a
    tile at a time into one accumulator, ``"blocks"``: a block or super-block at a time) whatever
    the autotuner would pick, so that tests check each."""
    from triton import Config

    from workbench.engine import gpu_kernels, packed

    tile = form == "tile"
    for kernel in (gpu_kernels._gate_up_kernel, packed._matvec_kernel, gpu_kernels._down_split_kernel):
        monkeypatch.setattr(kernel, "configs", [Config({"BLOCK_N": 8, "BLOCK_K": 128, "TILE": tile}, num_warps=4)])
        monkeypatch.setattr(kernel, "cache", {})
