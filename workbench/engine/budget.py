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


def outside_allocator_bytes(device) -> int:
    """Bytes this process holds on CUDA ``device`` outside PyTorch's allocator (the CUDA context,
    loaded kernels): NVML's used memory of this process less the allocator's reserved bytes, and at
    least ``memory.CUDA_CONTEXT_BYTES`` (kernels loaded later add to it); the constant alone where
    NVML does not say."""
    import os

    import torch

    from workbench.core.memory import CUDA_CONTEXT_BYTES
    from workbench.telemetry.nvml import default_nvml

    used = None
    try:
        nvml = default_nvml()
        index = nvml.index_of_uuid(str(getattr(torch.cuda.get_device_properties(device), "uuid", "") or ""))
        if index is not None:
            for p in nvml.gpu(index, processes=True, pcie_throughput=False).processes:
                if p.pid == os.getpid() and p.used_bytes == p.used_bytes:  # NaN: hidden by the driver
                    used = int(p.used_bytes)
    except Exception as exc:  # noqa: BLE001 - NVML is optional here
        log.debug("NVML did not give this process's GPU memory: %s", exc)
    outside = 0 if used is None else used - torch.cuda.memory_reserved(device)
    return max(CUDA_CONTEXT_BYTES, outside)


def cap_reserved(device, vram_budget: int) -> float | None:
    """Keep PyTorch's reserved memory on CUDA ``device`` within ``vram_budget`` bytes less what the
    process holds outside the allocator (``outside_allocator_bytes``), with
    ``torch.cuda.set_per_process_memory_fraction``: at the cap the allocator frees its cached
    blocks before it asks CUDA for more, so the process as NVML sees it stays within the budget
    (without the cap, blocks cached between a prompt's steps took S1 Q8_0 ``n-cpu-moe`` 9 to 12.1 GiB
    under a 12 GiB budget whose allocations peaked at 10.8 GiB). An allocation past the cap raises
    ``torch.OutOfMemoryError``, which the engine reports. Returns the fraction set (None off CUDA)."""
    import torch

    if getattr(device, "type", str(device)) != "cuda" or not torch.cuda.is_available():
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = min(1.0, max(0.0, (vram_budget - outside_allocator_bytes(device)) / total))
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    log.info("PyTorch's GPU memory on %s capped at %.2f GiB (budget %.2f GiB)", device, fraction * total / 2**30,
             vram_budget / 2**30)
    return fraction


def uncap_reserved(device) -> None:
    """Undo ``cap_reserved`` on ``device``."""
    import torch

    if getattr(device, "type", str(device)) == "cuda" and torch.cuda.is_available():
        torch.cuda.set_per_process_memory_fraction(1.0, device)
