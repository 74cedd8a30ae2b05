"""Refuse a placement before loading anything: unknown units, missing GPUs, no stream slots, or more
accelerator memory than the budget. Sizes are what the engine allocates (its dtype), not file bytes."""

from __future__ import annotations

import logging

from workbench.core.errors import PlacementError
from workbench.core.fmt import bytes2human
from workbench.core.inventory import Inventory
from workbench.core.memory import engine_bytes
from workbench.core.placement import CPU, Placement, is_gpu, validate

from .families import ModelArgs

log = logging.getLogger(__name__)


def check_placement(inventory: Inventory, args: ModelArgs, placement: Placement, n_accelerators: int,
                    dtype_bytes: int, max_context: int, vram_budget: int | None, extra_bytes: int = 0,
                    experts_as_stored: bool = False, dense_as_stored: bool = False) -> dict[str, int]:
    """Validate ``placement`` for ``inventory``; return the predicted bytes ``{"accelerator", "cpu"}``.

    Raises PlacementError naming the first problem: a unit the model lacks, a ``gpu:N`` beyond the
    ``n_accelerators`` present, streamed experts with ``stream_slots == 0``, or an accelerator need
    (weights in the engine's dtype + KV cache for ``max_context`` + stream cache + ``extra_bytes``, the
    bus share's slots) over ``vram_budget``. ``experts_as_stored``: routed experts keep the file's
    bytes (kept GGUF Q8_0 / Q4_K blocks) instead of the engine's dtype; ``dense_as_stored``: so do
    the other units' GGUF projections, embeddings and head the engine keeps in their blocks
    (``memory.kept_in_blocks``).
    """
    problems = validate(placement, inventory, n_accelerators)
    if problems:
        raise PlacementError("; ".join(problems))
    acc = cpu = 0
    streamed_layers: set[int] = set()
    expert_params = 0
    kept = []
    for key, unit in inventory.units.items():
        nbytes = engine_bytes(key, unit, dtype_bytes, experts_as_stored, dense_as_stored)
        a = placement.get(key)
        if key.kind == "expert":
            expert_params = max(expert_params, unit.n_params)
            if is_gpu(a.tier):
                acc += nbytes
            else:
                cpu += nbytes
                if a.mode == "stream":
                    streamed_layers.add(key.layer)
        else:
            acc += nbytes
            if a.tier == CPU:
                kept.append(key)
    if kept:
        log.warning("the engine runs attention, router, shared experts, dense layers, embeddings and lm_head "
                    "on the accelerator; %d such units the placement puts on the CPU are loaded on the accelerator", len(kept))
    acc += len(streamed_layers) * max(1, placement.stream_slots) * expert_params * dtype_bytes
    per_token = (args.mla["kv_lora_rank"] + args.mla["rope"]) if args.mla else 2 * args.n_kv_heads * args.head_dim
    kv = args.n_layers * per_token * max_context * dtype_bytes
    acc += kv + extra_bytes
    if vram_budget is not None and acc > vram_budget:
        raise PlacementError(
            f"the placement needs {bytes2human(acc)} on the accelerator (weights, {bytes2human(kv)} of KV cache "
            f"for {max_context} tokens, stream cache and bus slots) but the budget is {bytes2human(vram_budget)}"
        )
    return {"accelerator": acc, "cpu": cpu}
