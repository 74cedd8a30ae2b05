"""The session's one door to the layers below: readers, memory model, cost model, planner, project
files, exporters, hardware presets, telemetry and the engine.

Each function imports its module when first used, so that opening the window does not pay for
torch until the engine is needed. A module that is not installed (``_optional``) turns the feature
off with a reason instead of failing the whole window.
"""

from __future__ import annotations

import importlib
import logging
import math
from pathlib import Path

from workbench.core.errors import WorkbenchError
from workbench.core.inventory import Inventory
from workbench.core.placement import Placement
from workbench.core.resources import resource

log = logging.getLogger(__name__)
_missing_logged: set[str] = set()


def _optional(name: str):
    """``importlib.import_module(name)``, or None if that module itself does not exist."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is not None and name.startswith(e.name) or e.name == name:
            if name not in _missing_logged:
                _missing_logged.add(name)
                log.warning("%s is not available: %s", name, e)
            return None
        raise


# -- reading --------------------------------------------------------------------------------------


def is_project_file(path: Path) -> bool:
    return Path(path).suffix.lower() == ".json" and Path(path).is_file()


def open_model(path: str | Path) -> Inventory:
    """Inventory of a model folder or GGUF file, from headers only (blocking, < 2 s)."""
    readers = _optional("workbench.core.readers")
    if readers is None:
        raise WorkbenchError("this build has no model readers (workbench.core.readers is missing)")
    return readers.open_model(Path(path))


_unit_sizes: dict[int, dict] = {}


def unit_sizes(inv: Inventory) -> dict:
    """``{UnitKey: (bytes, params, dtypes)}`` of every unit, computed once per inventory (a
    94 x 256 model has 24k units: do it in the worker that opened the model). A routed expert's
    bytes are those the engine holds (bfloat16 where it dequantizes the file's type at load:
    ``memory.experts_as_stored``), every other unit's the file's."""
    key = id(inv)
    if key not in _unit_sizes:
        _unit_sizes.clear()
        memory = _optional("workbench.core.memory")
        kept = memory is None or memory.experts_as_stored(inv)

        def size(k, u) -> int:
            return u.nbytes if kept or k.kind != "expert" else memory.held_bytes(k, u, kept)

        _unit_sizes[key] = {k: (size(k, u), u.n_params, u.dtypes) for k, u in inv.units.items()}
    return _unit_sizes[key]


def prepare(inv: Inventory, hardware) -> None:
    """The slow per-model work the GUI thread should not do: unit sizes and the cost model for
    ``hardware`` (cached for when the model becomes the session's)."""
    unit_sizes(inv)
    if hardware is not None and hardware.gpus:
        costmodel = _optional("workbench.core.costmodel")
        if costmodel is not None:
            _cost_models.clear()
            _cost_models[(id(inv), id(hardware), id(None))] = costmodel.CostModel(inv, hardware, None)


def default_placement(inv: Inventory) -> Placement:
    """Everything on GPU 0: the starting point the user edits or plans from."""
    memory = _optional("workbench.core.memory")
    if memory is not None and hasattr(memory, "placement_all_gpu"):
        return memory.placement_all_gpu(inv)
    return Placement()


# -- prediction -----------------------------------------------------------------------------------


_cost_models: dict = {}


def cost_model(session):
    """The CostModel of the session's (inventory, hardware, stats), built once and reused (its
    ``predict`` then takes milliseconds); None without a profile that has a GPU."""
    costmodel = _optional("workbench.core.costmodel")
    hw, inv, stats = session.hardware, session.inventory, session.stats
    if costmodel is None or hw is None or inv is None or not hw.gpus:
        return None
    key = (id(inv), id(hw), id(stats))
    if key not in _cost_models:
        _cost_models.clear()
        _cost_models[key] = costmodel.CostModel(inv, hw, stats)
    return _cost_models[key]


def predict(session, placement: Placement) -> tuple[object | None, float, float]:
    """(MemoryEstimate, decode tokens/s, prefill tokens/s) of ``placement``; the speeds are NaN
    without a cost model, the estimate None without a memory model."""
    model = cost_model(session)
    if model is not None:
        pred = model.predict(placement, ctx=session.ctx, kv_dtype=session.kv_dtype)
        return pred.memory, float(pred.decode_tps), float(pred.prefill_tps)
    memory = _optional("workbench.core.memory")
    est = None if memory is None else memory.estimate_memory(session.inventory, placement, session.ctx,
                                                              session.kv_dtype)
    return est, math.nan, math.nan


def decode_tps(session, placement: Placement) -> float:
    """Decode tokens/s alone (milliseconds even at 94 x 256): what drag feedback shows."""
    model = cost_model(session)
    if model is None:
        return math.nan
    return float(model.decode_tps(placement, kv_tokens=min(session.ctx, 512), kv_dtype=session.kv_dtype))


def expert_stats(session):
    """The session's ExpertStats, or None before any profile."""
    return session.stats


# -- planning and files ---------------------------------------------------------------------------

STRATEGIES = ("all-gpu", "cpu-moe", "n-cpu-moe", "uniform", "frequency", "balanced")


def plan(session, strategy: str) -> Placement:
    """The planner's placement for ``strategy`` under the session's budgets (margin already taken
    off), with its cost model; raises PlacementError when that strategy cannot fit."""
    planner = _optional("workbench.core.planner")
    if planner is None:
        raise WorkbenchError("the planner is not available in this build")
    from workbench.core.placement import Budget

    model = cost_model(session)
    if model is None:
        raise WorkbenchError("planning needs a hardware profile with a GPU (Hardware menu)")
    budgets = session.budgets()
    gpus = [t for t in session.tiers() if t != "cpu"]
    if any(t not in budgets for t in gpus):
        raise WorkbenchError("the GPU memory is unknown: pick a hardware preset (Hardware menu)")
    budget = Budget(tuple(budgets[t] for t in gpus), 0, budgets.get("cpu"))
    result = planner.plan(strategy, model, budget, ctx=session.ctx, kv_dtype=session.kv_dtype)
    return result.placement


def save_project(session, path: Path) -> None:
    project = _optional("workbench.core.project")
    if project is None:
        raise WorkbenchError("project files are not available in this build")
    project.save_project(
        path,
        inventory=session.inventory,
        placement=session.placement,
        hardware=session.hardware,
        stats=expert_stats(session),
        settings={"chat": session.chat.to_json(), "ctx": session.ctx, "kv_dtype": session.kv_dtype,
                  "margin": session.margin},
    )


def load_project(path: Path):
    """Read a project file and open its model (blocking). Returns what
    :meth:`Session.apply_project` takes: (inventory, placement, hardware, stats, settings)."""
    project = _optional("workbench.core.project")
    if project is None:
        raise WorkbenchError("project files are not available in this build")
    p = project.load_project(path)
    inv = project.open_project_model(p)
    return inv, p.placement, p.hardware, p.stats, p.settings or {}


def export(session, target: str):
    """``core.export.Export`` of the session's placement for ``target`` (llama.cpp, ktransformers,
    accelerate), with the cost model's view of any approximation."""
    exp = _optional("workbench.core.export")
    if exp is None:
        raise WorkbenchError("exporters are not available in this build")
    name = session.project_path.stem if session.project_path else "placement"
    return exp.export(session.inventory, session.placement, target, cost=cost_model(session),
                      stats=session.stats, name=name)


# -- hardware -------------------------------------------------------------------------------------


DEFAULT_PRESET = "rtx4090+ddr5-2ch"
"""What the window plans for when this machine has no GPU it can see (changed in the Hardware menu)."""


def presets():
    """The presets file (``core.hardware.Presets``): machines, GPUs and hosts by name."""
    from workbench.core.hardware import load_presets

    return load_presets()


def preset(name: str):
    from workbench.core.hardware import preset as _preset

    return _preset(name)


# -- engine ---------------------------------------------------------------------------------------


GUI_CORES = 0
"""CPU cores the engine leaves free for a window's GUI thread (the window sets 1)."""


def byte_progress(progress, verb: str = "loading"):
    """Adapt ``progress(fraction, message)`` to the engine's ``(done_bytes, total_bytes, what)``."""

    def report(done: int, total: int, what: str) -> None:
        if progress is not None:
            progress(done / total if total else 1.0, f"{verb} {what} ({done * 100 // max(total, 1)}%)")

    return report


def load_engine(inv: Inventory, placement: Placement, progress=None, cancel=None, force: bool = False,
                hardware=None):
    """Load the engine on CUDA when there is one (bf16), else on the CPU (fp32). ``force``: no
    VRAM check (the user chose to load anyway). ``hardware``: the machine's profile, whose bus and
    CPU read rates set decode's bus share (``bus.fraction_for``; None: the engine's default) and its
    unit split per layer (``CostModel.unit_shares``)."""
    engine_mod = _optional("workbench.engine.engine")
    if engine_mod is None:
        raise WorkbenchError("the inference engine is not available in this build")
    import os

    import torch

    if GUI_CORES:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        torch.set_num_threads(max(1, cores - GUI_CORES))

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    ctx = min(int(inv.spec.max_context or 4096), 8192)
    bus_mod = _optional("workbench.engine.bus") if device == "cuda" and hardware is not None else None
    bus_share = bus_mod.fraction_for(inv, hardware) if bus_mod is not None else None
    units = None  # decode's unit split per layer, as the cost model predicts it fastest for this placement
    costmodel = _optional("workbench.core.costmodel") if bus_mod is not None and hardware.gpus else None
    if costmodel is not None:  # the model prepare() cached for this (inventory, hardware), else a new one
        model = _cost_models.get((id(inv), id(hardware), id(None))) or costmodel.CostModel(inv, hardware, None)
        units = model.unit_shares(placement, kv_tokens=min(ctx, 4096))
    return engine_mod.Engine.load(inv, placement, device=device, dtype=dtype, max_context=ctx,
                                  progress=byte_progress(progress), cancel=cancel,
                                  vram_budget=(1 << 62) if force else None, bus_share=bus_share, unit_shares=units)


def profile(engine, tokenizer, prompts: list[str], progress=None, cancel=None):
    """Routing counts ``[n_layers, n_experts]`` (float64) of ``prompts`` run through ``engine``
    (prefill only, each prompt from position 0)."""
    import numpy as np
    import torch

    before = np.asarray(engine.routing_counts(), dtype=np.float64)
    for i, text in enumerate(prompts):
        if cancel is not None and cancel.is_set():
            raise WorkbenchError("profiling cancelled")
        ids = tokenizer.encode(text)[: engine.max_context]
        with torch.inference_mode():
            for start in range(0, len(ids), 512):
                engine.forward(torch.tensor(ids[start : start + 512]), start, last_only=True)
        if progress is not None:
            progress((i + 1) / len(prompts), f"profiled {i + 1} of {len(prompts)} prompts")
    return np.asarray(engine.routing_counts(), dtype=np.float64) - before


def calibration_prompts() -> list[str]:
    """The bundled calibration prompts (resources/prompts/calibration.json)."""
    import json

    path = resource("prompts", "calibration.json")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise WorkbenchError(f"cannot read the calibration prompts {path}: {e}") from None
    return [p["text"] for p in data.get("prompts", []) if p.get("text")]


def engine_device(engine) -> str:
    return str(getattr(engine, "device", "?"))


# -- telemetry ------------------------------------------------------------------------------------


def start_sampler(rate_hz: float):
    from workbench.telemetry.sampler import Sampler

    sampler = Sampler(rate_hz=rate_hz)
    sampler.start()
    return sampler


def _preset_key_for(gpu_name: str, presets) -> str | None:
    """The GPU preset whose datasheet name is ``gpu_name`` (e.g. "NVIDIA H200" -> "h200")."""
    for key, entry in presets.gpus.items():
        if str(entry.get("name", "")).lower() == gpu_name.lower():
            return key
    return None


def profile_for_this_machine(sampler) -> tuple[object | None, str]:
    """(HardwareProfile, note). With GPUs visible: their presets composed with a host preset
    (speeds from datasheets until calibrated; free memory is measured live). Without: the default
    preset and a note saying why."""
    nvml = sampler.nvml
    presets = globals()["presets"]()
    if nvml.available and sampler.n_gpus:
        sample = sampler.latest() or sampler.sample_once()
        keys = [_preset_key_for(g.name, presets) for g in sample.gpus]
        if all(keys) and len(set(keys)) == 1:
            name = f"{len(keys)}x {keys[0]}+ddr5-2ch" if len(keys) > 1 else f"{keys[0]}+ddr5-2ch"
            return presets.get(name).validate(), f"speeds from the {name} preset until calibrated"
        note = (f"GPUs {', '.join(g.name for g in sample.gpus)} have no preset: planning for "
                f"{DEFAULT_PRESET}; pick one in the Hardware menu")
        return presets.get(DEFAULT_PRESET).validate(), note
    note = (f"{nvml.message or 'No NVIDIA GPU visible.'} The engine runs on the CPU; planning uses the "
            f"{DEFAULT_PRESET} preset (Hardware menu to pick another).")
    return presets.get(DEFAULT_PRESET).validate(), note


def measured_memory(sample) -> dict[str, tuple[int, int]]:
    """tier -> (total, free) bytes from a telemetry Sample; unknown (NaN) values are left out."""
    out: dict[str, tuple[int, int]] = {}
    for g in sample.gpus:
        if not (math.isnan(g.memory_total) or math.isnan(g.memory_free)):
            out[f"gpu:{g.index}"] = (int(g.memory_total), int(g.memory_free))
    h = sample.host
    total = h.ram_total if math.isnan(h.ram_limit) else min(h.ram_total, h.ram_limit)
    if not (math.isnan(total) or math.isnan(h.ram_available)):
        out["cpu"] = (int(total), int(min(h.ram_available, total)))
    return out
