"""Tensor names -> units: Hugging Face (safetensors) and llama.cpp (GGUF) names, every family.

``hf_role(name)`` and ``gguf_role(name)`` say which unit a tensor belongs to: its layer, its kind
(``embed``, ``attn``, ``router``, ``shared``, ``expert``, ``dense_mlp``, ``norm``, ``lm_head``) and,
for routed experts, either the expert index (per-expert tensors such as
``model.layers.3.mlp.experts.17.up_proj.weight``) or ``stacked=True`` (one tensor whose axis 0 stacks
every expert of the layer: HF fused ``experts.gate_up_proj`` [E, ...], GGUF ``blk.3.ffn_up_exps``).
A layer's input and post-attention norms form the unit ``(layer, "norm")``; the final norm is
``(None, "norm")``. ``assign_units`` shares the tensors out; a tensor no rule knows is an error that
names it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import ModelFormatError
from .units import TensorInfo, TensorRef, Unit, UnitKey


@dataclass(frozen=True)
class TensorRole:
    """Where one tensor goes: ``layer`` (None: model-wide), unit ``kind``, ``expert`` for a
    per-expert tensor, ``stacked`` for a tensor that holds every expert of the layer on axis 0."""

    layer: int | None
    kind: str
    expert: int | None = None
    stacked: bool = False


# Per-layer HF rules, matched against the name after "layers.{l}." with any weight suffix kept.
_HF_LAYER_RULES: list[tuple[re.Pattern, str]] = [
    (re.compile(r"(input_layernorm|post_attention_layernorm|pre_feedforward_layernorm|"
                r"post_feedforward_layernorm)\.weight"), "norm"),
    (re.compile(r"self_attn\..+"), "attn"),
    (re.compile(r"(mlp|block_sparse_moe|feed_forward)\.(gate|router)\.(weight|bias|e_score_correction_bias)"),
     "router"),
    (re.compile(r"(mlp|feed_forward)\.(shared_expert|shared_experts)\..+"), "shared"),
    (re.compile(r"(mlp|feed_forward)\.shared_expert_gate\.weight"), "shared"),
    (re.compile(r"(mlp|feed_forward)\.(gate_proj|up_proj|down_proj)\.(weight|bias|weight_scale_inv)"),
     "dense_mlp"),
]
_HF_EXPERT = re.compile(
    r"(?:mlp|block_sparse_moe|feed_forward)\.experts\.(\d+)\."
    r"(?:gate_proj|up_proj|down_proj|w1|w2|w3)\.(?:weight|bias|weight_scale_inv)"
)
_HF_STACKED = re.compile(
    r"(?:mlp|block_sparse_moe|feed_forward)\.experts\.(?:gate_up_proj|gate_proj|up_proj|down_proj)"
    r"(?:_bias|_blocks|_scales)?(?:\.weight)?"
)
_HF_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
_HF_LAYER = re.compile(r"layers\.(\d+)\.(.+)")


_HF_EXPERT_FAST = re.compile(
    r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
    r"(?:gate_proj|up_proj|down_proj|w1|w2|w3)\.(?:weight|weight_scale_inv)"
)


def hf_role(name: str) -> TensorRole | None:
    """The unit of a Hugging Face tensor name, or None when no rule knows the name."""
    if m := _HF_EXPERT_FAST.fullmatch(name):  # most tensors of a big MoE: skip the general rules
        return TensorRole(int(m.group(1)), "expert", int(m.group(2)))
    if name in ("lm_head.weight", "language_model.lm_head.weight"):
        return TensorRole(None, "lm_head")
    rest = name
    for prefix in _HF_PREFIXES:
        if rest.startswith(prefix):
            rest = rest[len(prefix):]
            break
    if rest == "embed_tokens.weight":
        return TensorRole(None, "embed")
    if rest == "norm.weight":
        return TensorRole(None, "norm")
    m = _HF_LAYER.fullmatch(rest)
    if not m:
        return None
    layer, tail = int(m.group(1)), m.group(2)
    if em := _HF_EXPERT.fullmatch(tail):
        return TensorRole(layer, "expert", int(em.group(1)))
    if _HF_STACKED.fullmatch(tail):
        return TensorRole(layer, "expert", stacked=True)
    for pattern, kind in _HF_LAYER_RULES:
        if pattern.fullmatch(tail):
            return TensorRole(layer, kind)
    return None


_GGUF_GLOBAL = {
    "token_embd": "embed",
    "token_embd_norm": "embed",
    "rope_freqs": "embed",
    "output_norm": "norm",
    "output": "lm_head",
}
_GGUF_LAYER_RULES: list[tuple[re.Pattern, str, bool]] = [
    (re.compile(r"ffn_(gate|up|down|gate_up)_exps"), "expert", True),
    (re.compile(r"ffn_(gate|up|down)_shexp|ffn_gate_inp_shexp"), "shared", False),
    (re.compile(r"ffn_gate_inp|exp_probs_b"), "router", False),
    (re.compile(r"ffn_(gate|up|down)"), "dense_mlp", False),
    (re.compile(r"attn_norm|ffn_norm|post_attention_norm|post_ffw_norm|layer_output_norm"), "norm", False),
    (re.compile(r"attn_\w+"), "attn", False),
]
_GGUF_LEGACY_EXPERT = re.compile(r"blk\.(\d+)\.ffn_(?:gate|up|down)\.(\d+)\.weight")
_GGUF_LAYER = re.compile(r"blk\.(\d+)\.(\w+?)(?:\.(weight|bias|scale))?")


def gguf_role(name: str) -> TensorRole | None:
    """The unit of a llama.cpp GGUF tensor name (``blk.3.ffn_up_exps.weight``), or None."""
    base, _, suffix = name.rpartition(".")
    if suffix in ("weight", "bias") and base in _GGUF_GLOBAL:
        return TensorRole(None, _GGUF_GLOBAL[base])
    m = _GGUF_LAYER.fullmatch(name)
    if not m:
        if em := _GGUF_LEGACY_EXPERT.fullmatch(name):  # Mixtral GGUFs of 2023: one tensor per expert
            return TensorRole(int(em.group(1)), "expert", int(em.group(2)))
        return None
    layer, stem = int(m.group(1)), m.group(2)
    for pattern, kind, stacked in _GGUF_LAYER_RULES:
        if pattern.fullmatch(stem):
            return TensorRole(layer, kind, stacked=stacked)
    return None


_NOT_LANGUAGE = re.compile(r"(?:model\.)?(?:vision_model|vision_tower|multi_modal_projector|audio_tower)\.")


def is_non_text(name: str) -> bool:
    """True for the vision tower / projector tensors of a multimodal HF checkpoint."""
    return bool(_NOT_LANGUAGE.match(name))

_ANY_LAYER = re.compile(r"(?:^|\.)(?:layers|blk)\.(\d+)\.")


def assign_units(
    tensors: dict[str, TensorInfo], fmt: str, n_layers: int, n_experts: int
) -> tuple[dict[UnitKey, Unit], list[str]]:
    """Share every tensor out to its unit. Returns ``(units, skipped)``: ``skipped`` names the tensors
    that text inference does not use, which the caller drops: layers at or past ``n_layers``
    (DeepSeek's multi-token-prediction layer) and the vision tower / projector of a multimodal
    checkpoint. A name no rule knows, or a stacked tensor whose axis 0 is
    not ``n_experts``, is a ModelFormatError naming the tensor."""
    role_of = hf_role if fmt == "safetensors" else gguf_role
    by_tuple: dict[tuple, Unit] = {}  # UnitKeys are validated dataclasses: make each one once
    skipped: list[str] = []

    def add(layer: int | None, kind: str, expert: int | None, ref: TensorRef) -> None:
        unit = by_tuple.get((layer, kind, expert))
        if unit is None:
            unit = by_tuple[(layer, kind, expert)] = Unit(UnitKey(layer, kind, expert))
        unit.tensors.append(ref)

    for name, info in tensors.items():
        role = role_of(name)
        if role is None and _NOT_LANGUAGE.match(name):
            skipped.append(name)  # vision tower / projector of a multimodal checkpoint (Llama 4)
            continue
        if role is None and (m := _ANY_LAYER.search(name)) and int(m.group(1)) >= n_layers:
            skipped.append(name)  # e.g. DeepSeek-V3's MTP layer: enorm, hnorm, eh_proj, shared_head
            continue
        if role is None:
            raise ModelFormatError(f"tensor {name!r} belongs to no unit: the workbench does not know this name")
        if role.layer is not None and role.layer >= n_layers:
            skipped.append(name)
            continue
        if role.stacked:
            if not info.shape or info.shape[0] != n_experts:
                raise ModelFormatError(
                    f"tensor {name!r} of shape {list(info.shape)} should stack {n_experts} experts on axis 0"
                )
            for e in range(n_experts):
                add(role.layer, "expert", e, TensorRef(info, e))
        elif role.kind == "expert":
            if role.expert is None or role.expert >= n_experts:
                raise ModelFormatError(f"tensor {name!r} names expert {role.expert}, the model has {n_experts}")
            add(role.layer, "expert", role.expert, TensorRef(info))
        else:
            add(role.layer, role.kind, None, TensorRef(info))
    return {unit.key: unit for unit in by_tuple.values()}, skipped
