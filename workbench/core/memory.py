"""Memory estimate: what each tier (GPU or host RAM) needs for a placement, before loading anything.

Weights come from the inventory (exact bytes as stored). The KV cache is computed from the spec for
a context length and a KV dtype: grouped-query heads, the MLA latent for DeepSeek, and sliding or
chunked attention layers bounded by their window. Runtime overhead (CUDA context, activation and
logit buffers, host baseline) is an approximation and is reported separately from weights and KV.

All sizes are bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .inventory import Inventory
from .placement import CPU, CPU_COMPUTE, ON_GPU0, Assignment, Placement, gpu, is_gpu
from .spec import ModelSpec
from .units import KINDS, UnitKey

KV_DTYPES: dict[str, tuple[int, int]] = {
    "f32": (1, 4),
    "f16": (1, 2),
    "bf16": (1, 2),
    "q8_0": (32, 34),
    "q4_0": (32, 18),
}
"""KV cache dtype -> (values per block, bytes per block), as llama.cpp's ``--cache-type-k/v``."""

CUDA_CONTEXT_BYTES = 768 * 2**20
"""CUDA context, loaded kernels and the PyTorch allocator's reserve per GPU in use: what NVML counts
beyond PyTorch's allocations (0.73 GiB on an H200 with the engine's Triton kernels loaded,
BENCHMARKS.md 2026-12-04; 400-600 MiB for a bare context on recent cards)."""

HOST_BASELINE_BYTES = 512 * 2**20
"""Host RAM of the process itself (Python, PyTorch, tokenizer) before any weight is loaded."""

PREFILL_CHUNK = 512
"""Tokens per prefill step the activation buffers are sized for (llama.cpp's default ubatch)."""


@dataclass
class TierMemory:
    """Bytes one tier needs. ``weights`` maps each unit kind (``embed``, ``attn``, ``router``,
    ``shared``, ``expert``, ``dense_mlp``, ``norm``, ``lm_head``) to the bytes of that kind here."""

    weights: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    kv_cache: int = 0
    stream_cache: int = 0
    overhead: int = 0

    @property
    def weights_total(self) -> int:
        return sum(self.weights.values())

    @property
    def total(self) -> int:
        """Weights + KV cache + stream cache + runtime overhead (bytes)."""
        return self.weights_total + self.kv_cache + self.stream_cache + self.overhead

    def to_json(self) -> dict:
        return {
            "weights": dict(self.weights),
            "weights_total": self.weights_total,
            "kv_cache": self.kv_cache,
            "stream_cache": self.stream_cache,
            "overhead": self.overhead,
            "total": self.total,
        }


@dataclass
class MemoryEstimate:
    """Bytes per tier (``"gpu:0"``, ``"gpu:1"``, ``"cpu"``) for a context of ``ctx`` tokens with a KV
    cache of ``kv_dtype``. The ``cpu`` tier is always present (at least the host baseline)."""

    tiers: dict[str, TierMemory]
    ctx: int
    kv_dtype: str

    def total(self, tier: str) -> int:
        """Bytes ``tier`` needs; 0 for a tier the placement does not use."""
        t = self.tiers.get(tier)
        return t.total if t else 0

    @property
    def gpu_tiers(self) -> list[str]:
        return sorted((t for t in self.tiers if is_gpu(t)), key=lambda t: int(t[4:]))

    def to_json(self) -> dict:
        return {
            "ctx": self.ctx,
            "kv_dtype": self.kv_dtype,
            "tiers": {name: tier.to_json() for name, tier in self.tiers.items()},
        }


def kv_bytes_per_token(inv: Inventory, layer: int, kv_dtype: str = "f16") -> int:
    """Bytes one token adds to layer ``layer``'s KV cache (K and V, or the MLA latent)."""
    block, size = _kv_type(kv_dtype)
    values = inv.spec.kv_values_per_token(layer)
    return math.ceil(values / block) * size


FLOAT_DTYPES = frozenset({"F32", "F16", "BF16", "F64"})

KEPT_TYPES = frozenset({"Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"})
"""GGUF storage types the engine reads in place on the GPU instead of dequantizing them."""
KEPT_EXPERT_TYPES = KEPT_TYPES | {"MXFP4"}
"""Those of routed experts: also MXFP4 (gpt-oss), which the CPU kernel reads in place."""

KEPT_DENSE = frozenset({
    "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "attn_q_a.weight", "attn_q_b.weight",
    "attn_kv_a_mqa.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight", "ffn_gate_shexp.weight",
    "ffn_up_shexp.weight", "ffn_down_shexp.weight", "token_embd.weight", "output.weight",
})
"""GGUF tensors besides the routed experts that the engine keeps in their blocks on the GPU (the
projections it runs as plain matrix products, the embeddings and the head), named without the
``blk.N.`` prefix. DeepSeek's ``attn_kv_b`` (split and absorbed), routers and norms are not."""


def kept_in_blocks(tensor) -> bool:
    """Whether the engine holds GGUF tensor ``tensor`` (a ``TensorInfo``) of a unit other than the
    routed experts as the file stores it: a ``KEPT_TYPES`` type and a ``KEPT_DENSE`` name."""
    name = tensor.name.split(".", 2)[2] if tensor.name.startswith("blk.") else tensor.name
    return tensor.dtype.upper() in KEPT_TYPES and name in KEPT_DENSE


def engine_bytes(key: UnitKey, unit, dtype_bytes: int = 2, experts_as_stored: bool = True,
                 dense_as_stored: bool = True) -> int:
    """Bytes the engine holds for ``unit`` when it computes in a ``dtype_bytes``-byte float type.

    A routed expert: its file bytes with ``experts_as_stored`` (GGUF blocks kept, or float weights of
    that width), else ``dtype_bytes`` a parameter. Any other unit, tensor by tensor: a ``kept_in_blocks``
    tensor as stored with ``dense_as_stored``; a float tensor as stored when it has the engine's
    width; everything else ``dtype_bytes`` a parameter (converted or dequantized at load).
    """
    if key.kind == "expert":
        return unit.nbytes if experts_as_stored else unit.n_params * dtype_bytes
    total = 0
    for t in unit.tensors:
        dtype = t.tensor.dtype.upper()
        as_stored = (dense_as_stored and kept_in_blocks(t.tensor)) or (
            dtype in FLOAT_DTYPES and t.nbytes == t.n_params * dtype_bytes)
        total += t.nbytes if as_stored else t.n_params * dtype_bytes
    return total


def expert_weight_types(inv) -> set[str]:
    """Storage types (upper case) of the routed experts' weight matrices: their biases (gpt-oss's,
    float) left out; a gpt-oss checkpoint's ``*_blocks`` / ``*_scales`` pairs as ``MXFP4``."""
    out = set()
    for k, u in inv.units.items():
        if k.kind != "expert":
            continue
        for t in u.tensors:
            name = t.tensor.name
            if name.endswith("bias") or name.endswith("_scales"):
                continue
            out.add("MXFP4" if name.endswith("_blocks") else t.tensor.dtype.upper())
    return out


def experts_as_stored(inv) -> bool:
    """Whether the engine holds ``inv``'s routed experts as the file stores them: float weights, or
    GGUF blocks its kernels read in place, as ``engine.keeps_blocks`` decides (every expert tensor
    Q8_0, or every one MXFP4, or every one a k-quant / IQ4_XS; rows of whole blocks; experts the
    in-place kernels compute: not Llama 4's input-scaled ones, and gpt-oss's biased, clamped ones
    only in MXFP4 or k-quants; a gpt-oss checkpoint's MXFP4 too). Otherwise (other IQ quants, FP8
    safetensors...) each expert is dequantized to bfloat16 at load."""
    types = expert_weight_types(inv)
    if types <= FLOAT_DTYPES:
        return True
    if ((inv.format != "gguf" and types != {"MXFP4"}) or not types <= KEPT_EXPERT_TYPES
            or (types & {"Q8_0", "MXFP4"} and len(types) > 1)):
        return False
    if inv.spec.family == "llama4" or (inv.spec.family == "gpt_oss" and "Q8_0" in types):
        return False
    block = 32 if types <= {"Q8_0", "MXFP4"} else 256
    return inv.spec.expert_ffn % block == 0 and inv.spec.hidden_size % block == 0


def held_bytes(key: UnitKey, unit, experts_kept: bool = True) -> int:
    """Bytes the engine holds on the GPU (and a decode step reads) for ``unit`` computing in
    bfloat16: a routed expert as the file stores it with ``experts_kept`` (``experts_as_stored``:
    float, or GGUF blocks kept in place), else 2 bytes a parameter; the
    attention projections, embeddings, head and dense / shared MLPs of a GGUF file kept in their
    Q8_0 / Q2_K ... Q6_K / IQ4_XS blocks too (``kept_in_blocks``); any other quantized tensor dequantized to
    bfloat16 (2 bytes a parameter); a float one as stored."""
    if key.kind == "expert":
        return unit.nbytes if experts_kept else unit.n_params * 2
    return sum(t.nbytes if t.tensor.dtype.upper() in FLOAT_DTYPES or kept_in_blocks(t.tensor) else t.n_params * 2
               for t in unit.tensors)


def kv_cache_bytes(inv: Inventory, layer: int, ctx: int, kv_dtype: str = "f16") -> int:
    """KV cache bytes of layer ``layer`` for ``ctx`` tokens; a windowed layer keeps at most its window."""
    windows = inv.spec.layer_window
    window = windows[layer] if layer < len(windows) else None
    tokens = ctx if window is None else min(ctx, window)
    return tokens * kv_bytes_per_token(inv, layer, kv_dtype)


def gpu_runtime_overhead(inv: Inventory, ctx: int) -> int:
    """Approximate GPU bytes besides weights and KV: CUDA context plus activation and logit buffers
    for one prefill chunk of ``min(ctx, PREFILL_CHUNK)`` tokens in fp32 (hidden states and residual
    copies, the widest MLP intermediate, logits over the vocabulary)."""
    s = inv.spec
    tokens = max(1, min(ctx, PREFILL_CHUNK))
    widest_mlp = max(
        s.dense_ffn,
        s.shared_ffn * max(1, s.n_shared_experts),
        s.expert_ffn * max(1, s.n_experts_active),
    )
    qkv = (s.n_heads + 2 * s.n_kv_heads) * s.head_dim
    per_token = 8 * s.hidden_size + 3 * widest_mlp + 2 * qkv + s.vocab_size
    return CUDA_CONTEXT_BYTES + tokens * per_token * 4


def estimate_memory(
    inv: Inventory, placement: Placement | None = None, ctx: int = 4096, kv_dtype: str = "f16"
) -> MemoryEstimate:
    """Bytes each tier needs to run ``inv`` under ``placement`` (default: everything on ``gpu:0``)
    with a context of ``ctx`` tokens.

    - weights: every unit's bytes on its tier as the engine holds them (``held_bytes``: a GGUF
      file's Q8_0 / Q2_K ... Q6_K / IQ4_XS projections kept in their blocks, other quantized types
      dequantized to bfloat16; experts as ``experts_as_stored`` says); a streamed expert's weights live
      in host RAM.
    - KV cache: on the tier of each layer's ``attn`` unit, ``min(ctx, window)`` tokens per layer.
    - stream cache: ``stream_slots`` x the largest expert of the layer, for each layer with streamed
      experts, on ``gpu:0``.
    - overhead: ``gpu_runtime_overhead`` on each GPU in use; ``HOST_BASELINE_BYTES`` on the CPU.
    """
    if ctx < 1:
        raise ValueError(f"context length must be at least 1 token, got {ctx}")
    _kv_type(kv_dtype)
    placement = placement or placement_all_gpu(inv)
    tiers: dict[str, TierMemory] = {CPU: TierMemory()}

    def tier(name: str) -> TierMemory:
        return tiers.setdefault(name, TierMemory())

    streamed_layers: dict[int, int] = {}
    kept = experts_as_stored(inv)
    for key, unit in inv.units.items():
        a = placement.get(key)
        held = held_bytes(key, unit, kept)
        tier(a.tier).weights[key.kind] += held
        if a.mode == "stream" and key.layer is not None:
            streamed_layers[key.layer] = max(streamed_layers.get(key.layer, 0), held)

    for layer in range(inv.spec.n_layers):
        a = placement.get(UnitKey(layer, "attn"))
        tier(a.tier).kv_cache += kv_cache_bytes(inv, layer, ctx, kv_dtype)

    if streamed_layers and placement.stream_slots > 0:
        tier(gpu(0)).stream_cache += placement.stream_slots * sum(streamed_layers.values())

    for name, t in tiers.items():
        t.overhead = gpu_runtime_overhead(inv, ctx) if is_gpu(name) else HOST_BASELINE_BYTES

    order = sorted(tiers, key=lambda n: (not is_gpu(n), int(n[4:]) if is_gpu(n) else 0))
    return MemoryEstimate({n: tiers[n] for n in order}, ctx, kv_dtype)


def placement_all_gpu(inv: Inventory, device: int = 0) -> Placement:
    """Every unit on ``gpu:device`` (llama.cpp ``-ngl 99``)."""
    return Placement(default=Assignment(gpu(device)) if device else ON_GPU0)


def placement_cpu_moe(inv: Inventory) -> Placement:
    """All routed experts in host RAM, computed by the CPU; the rest on ``gpu:0`` (``--cpu-moe``)."""
    return placement_n_cpu_moe(inv, inv.spec.n_layers)


def placement_n_cpu_moe(inv: Inventory, n: int) -> Placement:
    """The routed experts of layers ``0 .. n-1`` in host RAM (CPU compute), the rest on ``gpu:0``.

    Same semantics as llama.cpp's ``--n-cpu-moe N``: it counts decoder layers, dense ones included
    (a dense layer has no routed experts to move). Shared experts and routers stay on the GPU.
    """
    if n < 0:
        raise ValueError(f"--n-cpu-moe takes a layer count >= 0, got {n}")
    p = placement_all_gpu(inv)
    p.move((k for k in inv.expert_keys() if k.layer is not None and k.layer < n), CPU_COMPUTE)
    return p


def _kv_type(kv_dtype: str) -> tuple[int, int]:
    try:
        return KV_DTYPES[kv_dtype.lower()]
    except KeyError:
        raise ValueError(f"unknown KV cache dtype {kv_dtype!r}: choose one of {', '.join(KV_DTYPES)}") from None


def default_ctx(spec: ModelSpec) -> int:
    """The context (tokens) budgeted for when the user names none: 4096, or the model's own if shorter."""
    return min(4096, spec.max_context) if spec.max_context > 0 else 4096
