"""Engine: placement changes, routing counts, memory report, and bad input (refused placements,
out-of-memory while loading, cancel, context overflow)."""

from __future__ import annotations

import threading
import weakref

import numpy as np
import pytest
import torch

from tests.engine.engine_helpers import (
    TEST_DEVICE,
    TEST_DTYPE,
    greedy_tokens,
    open_inventory,
    placements,
    reference_logits,
    rel_err,
)
from workbench.core.errors import PlacementError, WorkbenchError
from workbench.core.placement import CPU_COMPUTE, CPU_STREAM, Assignment, Placement
from workbench.core.units import UnitKey
from workbench.engine import AcceleratorMemoryError, Engine, LoadCancelled
from workbench.engine import engine as engine_module

PROMPT = [3, 17, 5, 42, 9, 11, 60, 7, 22, 33, 1, 4]


@pytest.fixture(scope="module")
def qwen3(tiny_model_dir, tiny_hf_model):
    return tiny_hf_model("qwen3_moe"), open_inventory(tiny_model_dir("qwen3_moe"))


def load(inv, placement=None, **kw):
    kw.setdefault("max_context", 64)
    kw.setdefault("dtype", TEST_DTYPE)
    return Engine.load(inv, placement, device=TEST_DEVICE, **kw)


# -- routing statistics --------------------------------------------------------------------------

def test_routing_counts_equal_transformers_router_choices(qwen3):
    model, inv = qwen3
    with torch.no_grad():
        out = model(torch.tensor([PROMPT]), output_router_logits=True)
    cfg = model.config
    engine = load(inv, placements(inv)["mixed"], dtype=torch.float32)  # exact choices need float32
    engine.forward(torch.tensor(PROMPT), 0)
    counts = engine.routing_counts()
    assert counts.dtype == np.int64 and counts.shape == (cfg.num_hidden_layers, cfg.num_experts)
    moe_layers = [i for i in range(cfg.num_hidden_layers) if i not in cfg.mlp_only_layers]
    assert len(out.router_logits) == len(moe_layers)
    for layer, logits in zip(moe_layers, out.router_logits):
        picks = torch.topk(torch.softmax(logits.float(), -1), cfg.num_experts_per_tok, dim=-1).indices
        expected = np.bincount(picks.reshape(-1).numpy(), minlength=cfg.num_experts)
        assert counts[layer].tolist() == expected.tolist()
    for layer in cfg.mlp_only_layers:
        assert not counts[layer].any()
    engine.forward(torch.tensor([5]), len(PROMPT))
    assert engine.routing_counts().sum() == counts.sum() + len(moe_layers) * cfg.num_experts_per_tok
    engine.reset_routing_counts()
    assert not engine.routing_counts().any()
    engine.close()


def test_routing_counts_export_as_expert_stats(qwen3):
    _, inv = qwen3
    engine = load(inv)
    engine.forward(torch.tensor(PROMPT), 0)
    stats = engine.expert_stats()
    assert stats.shape == engine.routing_counts().shape
    assert stats.counts.tolist() == engine.routing_counts().astype(float).tolist()
    assert stats.tokens == len(PROMPT)
    engine.close()


# -- changing the placement of a loaded engine ---------------------------------------------------

def test_apply_placement_moves_experts_and_keeps_results(qwen3):
    model, inv = qwen3
    ref = reference_logits(model, PROMPT)
    engine = load(inv, dtype=torch.float32)  # the same tokens on every tier needs float32
    tokens = greedy_tokens(engine, PROMPT, 8)
    resident = engine.memory_report()
    assert resident["cpu"] == 0
    mixed = placements(inv)["mixed"]
    engine.apply_placement(mixed)
    assert engine.placement == mixed
    moved = engine.memory_report()
    assert moved["cpu"] > 0 and moved["gpu:0"] < resident["gpu:0"]
    assert rel_err(engine.forward(torch.tensor(PROMPT), 0), ref) < 1e-4
    assert greedy_tokens(engine, PROMPT, 8) == tokens
    engine.apply_placement(Placement())
    assert engine.memory_report() == resident
    engine.close()


def test_memory_report_counts_what_each_tier_holds(qwen3):
    _, inv = qwen3
    keys = inv.expert_keys()
    dtype_bytes = torch.empty((), dtype=TEST_DTYPE).element_size()
    engine = load(inv)
    all_gpu = engine.memory_report()
    engine.close()
    p = Placement()
    p.move(keys[:5], CPU_COMPUTE)
    engine = load(inv, p)
    report = engine.memory_report()
    moved = sum(inv.units[k].n_params for k in keys[:5]) * dtype_bytes
    assert report["cpu"] == moved
    bus_slots = engine._bus.nbytes if engine._bus is not None else 0  # CUDA: slots of the bus share
    assert report["gpu:0"] == all_gpu["gpu:0"] - moved + bus_slots
    engine.close()


# -- bad input -----------------------------------------------------------------------------------

@pytest.fixture
def no_allocation(monkeypatch):
    """Fail the test if the engine allocates any weight."""
    def place(self, t, dtype=None):
        raise AssertionError("allocated a weight although the placement was refused")
    monkeypatch.setattr(engine_module._Loader, "place", place)


def test_placement_naming_missing_units_is_refused_before_loading(qwen3, no_allocation):
    _, inv = qwen3
    p = Placement()
    p.set(UnitKey(1, "expert", 0), CPU_COMPUTE)  # layer 1 is a dense layer: no experts
    p.set(UnitKey(0, "expert", 99), CPU_COMPUTE)
    with pytest.raises(PlacementError, match="does not have"):
        load(inv, p)


def test_placement_on_a_missing_gpu_is_refused(qwen3, no_allocation):
    _, inv = qwen3
    p = Placement()
    p.set(inv.expert_keys()[0], Assignment("gpu:1"))
    with pytest.raises(PlacementError, match="gpu:1"):
        load(inv, p)


def test_streaming_without_slots_is_refused(qwen3, no_allocation):
    _, inv = qwen3
    p = Placement(stream_slots=0)
    p.move(inv.expert_keys(0), CPU_STREAM)
    with pytest.raises(PlacementError, match="slots"):
        load(inv, p)


def test_placement_over_the_vram_budget_is_refused_with_the_numbers(qwen3, no_allocation):
    _, inv = qwen3
    with pytest.raises(PlacementError, match=r"needs .* on the accelerator .* budget is"):
        load(inv, vram_budget=100_000)


def test_moving_experts_to_the_cpu_makes_a_placement_fit(qwen3):
    _, inv = qwen3
    p = Placement()
    p.move(inv.expert_keys(), CPU_COMPUTE)
    engine = load(inv, p)
    small = engine.predicted["accelerator"]
    engine.close()
    engine = load(inv)
    budget = (small + engine.predicted["accelerator"]) // 2
    engine.close()
    with pytest.raises(PlacementError):
        load(inv, vram_budget=budget)
    engine = load(inv, p, vram_budget=budget)
    assert engine.memory_report()["gpu:0"] <= budget
    engine.close()


def test_out_of_memory_while_loading_frees_everything_and_names_the_unit(qwen3, monkeypatch):
    """The allocation function fails at the 12th weight: the error names the unit being loaded,
    every weight placed before is freed (no reference survives), and a retry in the same process
    loads normally."""
    _, inv = qwen3
    placed: list[weakref.ref] = []
    real_place = engine_module._Loader.place

    def place(self, t, dtype=None):
        if len(placed) == 11:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (injected)")
        out = real_place(self, t, dtype)
        placed.append(weakref.ref(out))
        return out

    monkeypatch.setattr(engine_module._Loader, "place", place)
    with pytest.raises(AcceleratorMemoryError, match=r"out of memory on .* while loading layer 1 attn"):
        load(inv)
    assert len(placed) == 11 and all(r() is None for r in placed)
    monkeypatch.undo()
    engine = load(inv)
    assert engine.forward(torch.tensor(PROMPT), 0).isfinite().all()
    engine.close()


@pytest.mark.skipif(TEST_DEVICE != "cuda", reason="a real out-of-memory needs a CUDA device")
def test_real_cuda_out_of_memory_frees_everything_and_a_retry_fits(qwen3):
    _, inv = qwen3
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    total = torch.cuda.get_device_properties(0).total_memory
    # ~24 MiB of KV cache per layer at 32k tokens: the limit lets the first layers in, not all.
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + 40 * 2**20) / total)
    try:
        with pytest.raises(AcceleratorMemoryError, match=r"out of memory on cuda.* while loading layer \d"):
            load(inv, max_context=32768 * 12)
        assert torch.cuda.memory_allocated() == before
        engine = load(inv, max_context=256)
        assert engine.forward(torch.tensor(PROMPT), 0).isfinite().all()
        engine.close()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def test_cancel_while_loading_frees_everything(qwen3):
    _, inv = qwen3
    cancel = threading.Event()
    seen = []

    def progress(done, total, what):
        seen.append((done, total, what))
        if len(seen) == 6:
            cancel.set()

    with pytest.raises(LoadCancelled):
        load(inv, progress=progress, cancel=cancel)
    assert len(seen) == 6 and seen[-1][0] <= seen[-1][1]
    done = []
    engine = load(inv, progress=lambda d, t, w: done.append((d, t)))
    assert done[-1][0] == done[-1][1] == sum(u.nbytes for u in inv.units.values())
    engine.close()


def test_prompt_longer_than_the_context_is_a_clear_error(qwen3):
    _, inv = qwen3
    engine = load(inv, max_context=16)
    with pytest.raises(WorkbenchError, match="do not fit the context of 16 tokens"):
        engine.forward(torch.arange(17), 0)
    engine.forward(torch.arange(10), 0)
    with pytest.raises(WorkbenchError, match="do not fit the context"):
        engine.forward(torch.arange(7), 10)
    with pytest.raises(WorkbenchError, match="token ids"):
        engine.forward(torch.tensor([1, 500]), 0)
    engine.close()


@pytest.mark.skipif(TEST_DEVICE != "cpu" or TEST_DTYPE != torch.float32, reason="zero-copy needs the file's dtype and device")
def test_weights_in_the_files_dtype_are_views_of_the_mapped_file(qwen3):
    """fp32 safetensors on a CPU accelerator: non-expert weights are the mmap'd file pages, not copies."""
    _, inv = qwen3
    engine = load(inv)
    (mapping,) = engine._reader._maps.values()
    start = mapping.ctypes.data
    for t in (engine.embed, engine.norm, engine.layers[0].attn.w["q"]):
        assert start <= t.data_ptr() < start + mapping.nbytes
    engine.close()


def test_truncated_weights_file_is_a_clear_error(qwen3, tmp_path):
    import shutil

    from workbench.core.errors import ModelFormatError

    _, inv = qwen3
    folder = tmp_path / "cut"
    shutil.copytree(inv.path, folder)
    cut = open_inventory(folder)
    weights = next(folder.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelFormatError, match="truncated"):
        load(cut)


def test_out_of_memory_while_moving_experts_keeps_a_working_engine(qwen3, monkeypatch):
    """apply_placement runs out of memory at the second layer: the first layer's experts moved, the
    others stayed, ``placement`` says so, and the engine still computes the reference logits."""
    from workbench.engine import experts as experts_module

    model, inv = qwen3
    ref = reference_logits(model, PROMPT)
    engine = load(inv, dtype=torch.float32)
    target = Placement()
    target.move(inv.expert_keys(), CPU_COMPUTE)
    real_alloc = experts_module.LayerExperts.alloc_tier
    layers_seen = set()

    def alloc_tier(self, tier, count, shape13, shape2):
        layers_seen.add(self.layer)
        if len(layers_seen) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real_alloc(self, tier, count, shape13, shape2)

    monkeypatch.setattr(experts_module.LayerExperts, "alloc_tier", alloc_tier)
    with pytest.raises(AcceleratorMemoryError, match="layers 0 moved"):
        engine.apply_placement(target)
    monkeypatch.undo()
    first, *rest = sorted({k.layer for k in inv.expert_keys()})
    assert all(engine.placement.get(k) == CPU_COMPUTE for k in inv.expert_keys(first))
    assert all(engine.placement.get(k).tier == "gpu:0" for layer in rest for k in inv.expert_keys(layer))
    assert 0 < engine.memory_report()["cpu"] < sum(inv.units[k].n_params for k in inv.expert_keys()) * 4
    assert rel_err(engine.forward(torch.tensor(PROMPT), 0), ref) < 1e-4
    engine.apply_placement(target)
    assert engine.placement == target
    assert rel_err(engine.forward(torch.tensor(PROMPT), 0), ref) < 1e-4
    engine.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_a_gpu_is_a_clear_error(qwen3):
    _, inv = qwen3
    with pytest.raises(WorkbenchError, match="CUDA is not available"):
        Engine.load(inv, device="cuda")
    with pytest.raises(WorkbenchError, match="unknown device"):
        Engine.load(inv, device="gpu7")


def test_cpu_format_f32_computes_exactly_what_the_stacks_compute(qwen3):
    """The CPU tier through cpu_formats' kernels (f32) gives the reference logits and tokens."""
    model, inv = qwen3
    p = Placement()
    p.move(inv.expert_keys(), CPU_COMPUTE)
    engine = load(inv, p, dtype=torch.float32, cpu_format="f32")
    assert all(lx.cpu_kernel is not None for lx in engine.experts.values())
    assert rel_err(engine.forward(torch.tensor(PROMPT), 0), reference_logits(model, PROMPT)) < 1e-4
    plain = load(inv, p, dtype=torch.float32)
    assert greedy_tokens(engine, PROMPT, 8) == greedy_tokens(plain, PROMPT, 8)
    assert engine._bus is None  # a CPU format computes its experts alone
    plain_report = plain.memory_report()
    plain_report["gpu:0"] -= plain._bus.nbytes if plain._bus is not None else 0
    assert engine.memory_report() == plain_report
    engine.close()
    plain.close()


def test_cpu_format_int8_holds_a_quarter_of_the_bytes_and_moves_back(qwen3):
    from workbench.engine.cpu_formats import available_formats

    if "int8" not in available_formats():
        pytest.skip("this PyTorch has no int8 weight-only CPU kernel")
    model, inv = qwen3
    ref = reference_logits(model, PROMPT)
    p = Placement()
    p.move(inv.expert_keys(), CPU_COMPUTE)
    engine = load(inv, p, dtype=torch.float32, cpu_format="int8")
    f32_bytes = sum(inv.units[k].n_params for k in inv.expert_keys()) * 4
    assert f32_bytes / 4 <= engine.memory_report()["cpu"] < f32_bytes / 3  # int8 weights + bf16 scales
    assert rel_err(engine.forward(torch.tensor(PROMPT), 0), ref) < 3e-2  # int8 rounding of expert weights
    engine.apply_placement(Placement())
    assert engine.memory_report()["cpu"] == 0
    assert rel_err(engine.forward(torch.tensor(PROMPT), 0), ref) < 3e-2  # carries the int8 rounding
    engine.close()


def test_unknown_cpu_format_is_refused(qwen3):
    _, inv = qwen3
    with pytest.raises(WorkbenchError, match="not available"):
        load(inv, cpu_format="fp3")


def test_memory_breakdown_by_component(qwen3):
    """Per tier and unit kind: expert bytes where the placement puts them, the stream cache and KV cache
    apart; the totals are memory_report's."""
    _, inv = qwen3
    dtype_bytes = torch.empty((), dtype=TEST_DTYPE).element_size()
    p = placements(inv)["mixed"]
    engine = load(inv, p)
    parts = engine.memory_breakdown()
    on_cpu = [k for k in inv.expert_keys() if p.get(k).tier == "cpu"]
    assert parts["cpu"]["weights"]["expert"] == sum(inv.units[k].n_params for k in on_cpu) * dtype_bytes
    assert parts["gpu:0"]["weights"]["expert"] == sum(
        inv.units[k].n_params for k in inv.expert_keys() if k not in on_cpu) * dtype_bytes
    for kind in ("embed", "attn", "router", "dense_mlp", "norm", "lm_head"):
        assert parts["gpu:0"]["weights"][kind] == sum(u.n_params for u in inv.units_of_kind(kind)) * dtype_bytes
    cfg = inv.config
    assert parts["gpu:0"]["kv_cache"] == (cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"]
                                          * 64 * dtype_bytes)
    assert parts["gpu:0"]["stream_cache"] > 0
    report = engine.memory_report()
    for tier, m in parts.items():
        assert report[tier] == sum(m["weights"].values()) + m["kv_cache"] + m["stream_cache"]
    engine.close()


def test_out_of_memory_in_a_forward_step_is_a_clear_error_and_the_engine_goes_on(qwen3, monkeypatch):
    model, inv = qwen3
    engine = load(inv, dtype=torch.float32)
    from workbench.engine import model as model_module

    def boom(self, x, pos, start, rope):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(model_module.Layer, "__call__", boom)
    with pytest.raises(AcceleratorMemoryError, match="computing 12 tokens at once"):
        engine.forward(torch.tensor(PROMPT), 0)
    monkeypatch.undo()
    assert rel_err(engine.forward(torch.tensor(PROMPT), 0), reference_logits(model, PROMPT)) < 1e-4
    engine.close()


def test_out_of_host_memory_while_loading_is_a_clear_error(qwen3, monkeypatch):
    from workbench.engine import HostMemoryError
    from workbench.engine import experts as experts_module

    _, inv = qwen3
    p = Placement()
    p.move(inv.expert_keys(), CPU_COMPUTE)
    real_alloc = experts_module.LayerExperts.alloc_tier

    def alloc_tier(self, tier, count, shape13, shape2):
        if tier == experts_module.COMPUTE and count and self.layer == 2:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:121] DefaultCPUAllocator: can't allocate memory: "
                               "you tried to allocate 1099511627776 bytes.")
        return real_alloc(self, tier, count, shape13, shape2)

    monkeypatch.setattr(experts_module.LayerExperts, "alloc_tier", alloc_tier)
    with pytest.raises(HostMemoryError, match="out of host memory while loading layer 2 expert"):
        load(inv, p)
