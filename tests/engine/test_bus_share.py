"""The bus share of decode steps (``bus.BusShare``): some of a token's CPU-selected experts are copied
into device slots and computed there while the CPU computes the others; tokens stay transformers'.
On CUDA the engine makes the share itself (page-locking the CPU stacks); here, without a GPU, the
same split runs with the slots on the CPU accelerator and the Triton kernels in the interpreter."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.engine.engine_helpers import (
    LOGITS_RTOL,
    N_NEW,
    PROMPT,
    TEST_DEVICE,
    TEST_DTYPE,
    attach_bus_share,
    decode_step_engine,
    greedy_tokens,
    logits_tolerance,
    open_inventory,
    placements,
    reference_logits,
    reference_tokens,
    rel_err,
)
from workbench.engine import bus, gpu_kernels
from workbench.engine import engine as engine_mod
from workbench.engine.experts import COMPUTE

pytestmark = pytest.mark.skipif(not gpu_kernels.available(), reason="needs Triton and CUDA (or TRITON_INTERPRET=1)")


@pytest.mark.parametrize("fraction,n,expect", [(0.45, 1, 0), (0.45, 2, 1), (0.45, 5, 2), (0.45, 8, 4), (1.0, bus.SLOTS + 1, bus.SLOTS),
                                               (0.0, 8, 0)])
def test_share_splits_the_cpu_selected_experts(fraction, n, expect):
    share = bus.BusShare(torch.device("cpu"), torch.float32, 16, (8, 4), (4, 4), fraction)
    assert share.share(n) == expect


@pytest.mark.parametrize("name,read,default,given,value", [
    ("WORKBENCH_BUS_SHARE", bus.fraction_from_env, bus.DEFAULT_FRACTION, "0", 0.0),
    ("WORKBENCH_PREFILL_FETCH_TOKENS", bus.fetch_tokens_from_env, bus.PREFILL_FETCH_TOKENS, "40", 40),
    ("WORKBENCH_PROMPT_PAIR_READS", engine_mod._pair_reads_from_env, None, "0.2", 0.2),
    ("WORKBENCH_BUS_SLOTS", bus.slots_from_env, bus.SLOTS, "24", 24),
    ("WORKBENCH_EARLY_BATCHES", bus.early_batches_from_env, 1, "2", 2),
])
def test_settings_from_the_environment(name, read, default, given, value, monkeypatch):
    monkeypatch.setenv(name, given)
    assert read() == value
    monkeypatch.setenv(name, "nonsense")
    assert read() == default
    monkeypatch.delenv(name)
    assert read() == default


@pytest.mark.parametrize("place,fraction", [("compute", 0.5), ("compute", 1.0), ("mixed", 0.5)])
def test_decode_with_a_bus_share_gives_the_reference_tokens(place, fraction, tiny_model_dir, tiny_hf_model):
    inv = open_inventory(tiny_model_dir("qwen3_moe"))
    engine = decode_step_engine(inv, placements(inv)[place])
    try:
        share = attach_bus_share(engine, fraction)
        tokens = greedy_tokens(engine, PROMPT, N_NEW)
        assert share.copied > 0  # experts did travel
    finally:
        engine.close()
    if TEST_DTYPE == torch.float32:
        assert tokens == reference_tokens(tiny_hf_model("qwen3_moe"), PROMPT, N_NEW)


@pytest.mark.parametrize("fetch_tokens", [1, 4])
def test_prefill_fetches_the_experts_many_tokens_select(fetch_tokens, tiny_model_dir, tiny_hf_model):
    """A prompt's CPU-tier experts selected by ``fetch_tokens`` or more of its tokens are computed on
    the accelerator after one copy (1: all of them; 4: some), the others on the CPU."""
    inv = open_inventory(tiny_model_dir("qwen3_moe"))
    engine = decode_step_engine(inv, placements(inv)["compute"])
    try:
        share = attach_bus_share(engine, 0.0)  # decode keeps its CPU experts on the CPU: only prefill fetches
        share.fetch_tokens = fetch_tokens
        logits = engine.forward(torch.tensor(PROMPT), 0)
        assert share.copied > 0
        if fetch_tokens > 1:
            cpu_only = sum(lx.n_tier[COMPUTE] for lx in engine.experts.values())
            assert share.copied < cpu_only  # some stayed on the CPU
        tokens = greedy_tokens(engine, PROMPT, N_NEW)
    finally:
        engine.close()
    model = tiny_hf_model("qwen3_moe")
    ref = reference_logits(model, PROMPT)
    assert rel_err(logits, ref) < logits_tolerance(model, PROMPT, ref)  # bf16: this model has a near-tie
    if TEST_DTYPE == torch.float32:
        assert tokens == reference_tokens(model, PROMPT, N_NEW)


def test_a_prompts_copies_are_queued_before_the_other_tiers_kernels(tiny_model_dir, tiny_hf_model, monkeypatch):
    """In a prompt step of a layer with resident, streamed and CPU-tier experts, the bus's first copy
    is queued before the resident and streamed tiers' grouped kernels, so the copy engine starts
    right after the routing sync; the logits stay transformers'."""
    from workbench.engine import experts as experts_mod

    events: list[str] = []
    grouped, host_part = experts_mod._grouped_host, experts_mod.LayerExperts.host_part

    def record_grouped(*a, **k):
        events.append("grouped")
        return grouped(*a, **k)

    def record_layer(self, *a, **k):
        events.append("layer")
        return host_part(self, *a, **k)

    monkeypatch.setattr(experts_mod, "_grouped_host", record_grouped)
    monkeypatch.setattr(experts_mod.LayerExperts, "host_part", record_layer)
    inv = open_inventory(tiny_model_dir("qwen3_moe"))
    engine = decode_step_engine(inv, placements(inv)["mixed"])
    try:
        share = attach_bus_share(engine, 1.0)
        share.fetch_tokens = 1  # every CPU-tier expert of the prompt travels
        fetch = share.fetch
        monkeypatch.setattr(share, "fetch", lambda *a, **k: (events.append("bus"), fetch(*a, **k))[1])
        logits = engine.forward(torch.tensor(PROMPT), 0)
    finally:
        engine.close()
    steps = " ".join(events).split("layer")
    both = [s.split() for s in steps if "bus" in s and "grouped" in s]
    assert both  # layers with fetched experts and another tier's grouped kernels
    assert all(s.index("bus") < s.index("grouped") for s in both)
    model = tiny_hf_model("qwen3_moe")
    ref = reference_logits(model, PROMPT)
    assert rel_err(logits, ref) < logits_tolerance(model, PROMPT, ref)


def test_a_cheap_further_token_keeps_more_of_a_prompts_experts_on_the_cpu(tiny_model_dir, tiny_hf_model):
    """``Engine.set_prompt_pair_reads``: the measured cost of a prompt's further token per CPU expert.
    At a tenth of a read the CPU takes experts that at a read per token travel, and the logits stay
    transformers'."""
    inv = open_inventory(tiny_model_dir("qwen3_moe"))
    copied, runs = {}, {}
    for pair in (None, 0.1):
        engine = decode_step_engine(inv, placements(inv)["compute"])
        try:
            engine.set_prompt_pair_reads(pair)
            assert all(lx.prompt_pair_reads == pair for lx in engine.experts.values())
            share = attach_bus_share(engine, 0.5)
            runs[pair] = engine.forward(torch.tensor(PROMPT), 0)
            copied[pair] = share.copied
        finally:
            engine.close()
    assert 0 < copied[0.1] < copied[None]
    model = tiny_hf_model("qwen3_moe")
    ref = reference_logits(model, PROMPT)
    for logits in runs.values():
        assert rel_err(logits, ref) < logits_tolerance(model, PROMPT, ref)


@pytest.mark.parametrize("source", ["float", "MXFP4"])
def test_gpt_oss_experts_travel_with_their_biases(source, tiny_model_dir, tiny_gguf, tiny_hf_model, exact_cpu_dots):
    """gpt-oss's biased, clamped CPU-tier experts over the bus, float stacks and MXFP4 blocks alike:
    a prompt that fetches every CPU expert and decode steps that send every CPU selection give the
    logits and tokens of the same engine without a bus share (and, float, transformers' tokens)."""
    sizes = {"hidden_size": 64, "intermediate_size": 64}
    inv = open_inventory(tiny_model_dir("gpt_oss", **sizes) if source == "float"
                         else tiny_gguf("gpt_oss", "MXFP4", **sizes))
    runs = {}
    for fraction in (None, 1.0):
        engine = decode_step_engine(inv, placements(inv)["compute"])
        try:
            share = None
            if fraction is not None:
                share = attach_bus_share(engine, fraction)
                share.fetch_tokens = 1  # the prompt's CPU experts all travel
                assert all(len(share.slot_stacks(lx.kept_layout(), True)) == len(lx.cpu_stacks()) + 2
                           for lx in engine.experts.values() if lx.bus is not None)
            logits = engine.forward(torch.tensor(PROMPT), 0)
            prompt_copies = share.copied if share else 0
            tokens = greedy_tokens(engine, PROMPT, 6)
            step = engine.forward(torch.tensor([tokens[-1]]), len(PROMPT) + 5)  # a decode step's logits
            runs[fraction] = (logits, step, tokens, prompt_copies, share.copied if share else 0)
        finally:
            engine.close()
    (plain, plain_step, plain_tokens, _, _), (sent, sent_step, sent_tokens, prompt_copies, copies) = runs[None], runs[1.0]
    assert prompt_copies > 0 and copies > prompt_copies  # the prompt's experts and the steps' travelled
    tol = 1e-5 if TEST_DTYPE == torch.float32 else 2e-2
    assert rel_err(sent, plain) < tol and rel_err(sent_step, plain_step) < tol
    if TEST_DTYPE == torch.float32:
        assert sent_tokens == plain_tokens
        if source == "float":
            assert sent_tokens == reference_tokens(tiny_hf_model("gpt_oss", **sizes), PROMPT, 6)


@pytest.mark.parametrize("tensor_type,width", [("Q8_0", 64), ("Q4_K", 256)])
def test_kept_blocks_travel_as_blocks_and_compute_as_their_dequantization(tensor_type, width, tiny_gguf, monkeypatch):
    """CPU experts kept in the file's blocks: the bus carries the blocks into block slots and the
    kernels read them there; logits and tokens match the same experts dequantized at load and
    computed on the CPU."""
    sizes = {"hidden_size": width, "moe_intermediate_size": width // 2 if tensor_type == "Q8_0" else width,
             "intermediate_size": width, "mlp_only_layers": []}
    inv = open_inventory(tiny_gguf("qwen3_moe", tensor_type, **sizes))
    runs = []
    for keep in ("1", "0"):
        monkeypatch.setenv("WORKBENCH_KEEP_QUANTS", keep)
        engine = decode_step_engine(inv, placements(inv)["compute"])
        try:
            share = attach_bus_share(engine, 1.0 if keep == "1" else 0.0)
            share.fetch_tokens = 1 if keep == "1" else 10**9
            logits = engine.forward(torch.tensor(PROMPT), 0)
            # few tokens on the CPU: Triton's interpreter takes ~10 s a K-quant step here
            runs.append((logits, greedy_tokens(engine, PROMPT, 2 if TEST_DEVICE == "cpu" else 4)))
            if keep == "1":
                assert share.copied > 0 and all(lx.kept_cpu is not None for lx in engine.experts.values())
        finally:
            engine.close()
    if TEST_DTYPE == torch.float32:
        assert rel_err(runs[0][0], runs[1][0]) < 1e-5
    else:  # the two paths round differently (GPU bf16 vs the CPU kernel's f32 sums) and a router
        # near-tie may flip an expert at a position or two (29% there on the H200): the median position
        # must agree within what bf16 itself costs this model (the dequantized path against float32)
        from workbench.engine import Engine

        monkeypatch.setenv("WORKBENCH_KEEP_QUANTS", "0")
        engine = Engine.load(inv, placements(inv)["compute"], device=TEST_DEVICE, dtype=torch.float32,
                             max_context=96)
        try:
            exact = engine.forward(torch.tensor(PROMPT), 0)
        finally:
            engine.close()

        def median_error(a, b):
            errors = sorted(rel_err(x, y) for x, y in zip(a, b))
            return errors[len(errors) // 2]

        own = median_error(runs[1][0], exact)
        assert median_error(runs[0][0], runs[1][0]) < max(LOGITS_RTOL, 2.5 * own)
    if TEST_DTYPE == torch.float32:
        assert runs[0][1] == runs[1][1]


@pytest.mark.parametrize("tensor_type,width", [("Q8_0", 64), ("Q4_K+Q6_K", 256), ("F32", 64)])
def test_the_slots_hold_an_expert_as_the_file_stores_it_and_the_load_counts_them(tensor_type, width, tiny_gguf,
                                                                                 monkeypatch):
    """A slot of kept experts is one expert's blocks, as many bytes as the file gives an expert (no
    float slots beside them), and there are as many as fit in the float slots' bytes; the memory the
    engine reserves before loading (``_bus_bytes``) is what the slots take."""
    from workbench.core.units import UnitKey
    from workbench.engine import engine as engine_mod

    monkeypatch.setenv("WORKBENCH_KEEP_QUANTS", "1")
    sizes = {"hidden_size": width, "moe_intermediate_size": width, "intermediate_size": width, "mlp_only_layers": []}
    inv = open_inventory(tiny_gguf("qwen3_moe", tensor_type, **sizes))
    placement = placements(inv)["compute"]
    engine = decode_step_engine(inv, placement)
    try:
        share = attach_bus_share(engine, 1.0)
        a = engine.args
        expected = engine_mod._bus_bytes(inv, a, placement, torch.device("cuda"), engine.dtype, 1.0,
                                          engine._keeps_blocks)
        assert share.nbytes == expected
        layer = a.moe_layers[0]
        if tensor_type == "F32":
            assert engine.experts[layer].kept_cpu is None
            assert expected == bus.SLOTS * 3 * width * width * engine.dtype.itemsize
        else:
            assert engine.experts[layer].kept_cpu is not None
            one = inv.units[UnitKey(layer, "expert", 0)].nbytes
            room = bus.SLOTS * 3 * width * width * engine.dtype.itemsize  # what float slots would take
            n = share.slots_of(engine.experts[layer].kept_layout())
            assert expected == n * one
            assert n > bus.SLOTS and n * one <= room < (n + 1) * one  # as many as fit in the float slots' bytes
    finally:
        engine.close()


@pytest.mark.skipif(TEST_DEVICE == "cpu", reason="page-locking needs CUDA")
def test_the_cpu_stacks_are_page_locked_and_released(tiny_model_dir):
    inv = open_inventory(tiny_model_dir("qwen3_moe"))
    p = placements(inv)
    engine = decode_step_engine(inv, p["compute"])
    lx = next(iter(engine.experts.values()))
    assert lx.bus is engine._bus and lx.w13[COMPUTE].is_pinned()
    assert engine.pinned_bytes() >= lx.w13[COMPUTE].nbytes + lx.w2[COMPUTE].nbytes
    assert engine.memory_breakdown()["gpu:0"]["stream_cache"] >= engine._bus.nbytes
    old = lx.w13[COMPUTE]
    engine.apply_placement(p["resident"])  # the old stacks are released before they go
    assert not old.is_pinned() and engine._bus is None  # no layer shares the bus: slots freed
    engine.close()


@pytest.mark.skipif(TEST_DEVICE == "cpu", reason="page-locking needs CUDA")
def test_a_share_dropped_without_close_releases_its_page_locks():
    """A range left page-locked after its memory is freed breaks later copies from memory mapped there
    ("invalid argument"), so a share that is dropped unclosed still unlocks the stacks before they go."""
    import gc

    stack = torch.randn(4, 64, 32)
    share = bus.BusShare(torch.device(TEST_DEVICE), torch.float32, 4, (64, 32), (32, 32), 0.5)
    assert share.pin(object(), [stack]) and stack.is_pinned()
    del share
    gc.collect()
    assert not stack.is_pinned()
    assert torch.randn(1 << 20).to(TEST_DEVICE).shape == (1 << 20,)  # copies from pageable memory still work


def test_a_prompt_whose_grouped_kernel_fails_is_computed_by_the_loop(tiny_model_dir, tiny_hf_model, monkeypatch):
    """The fetched experts' grouped kernel failing to build at a prompt's first batch turns the
    kernels off and the same prompt is answered by one matrix product per expert."""
    from workbench.engine import prefill_kernels

    monkeypatch.setattr(prefill_kernels, "_disabled", [])

    def broken(*a, **k):
        raise prefill_kernels.triton.CompilationError("x.py", None, "no such instruction")

    monkeypatch.setattr(prefill_kernels._grouped_kernel, "run", broken)
    inv = open_inventory(tiny_model_dir("qwen3_moe"))
    engine = decode_step_engine(inv, placements(inv)["compute"])
    try:
        share = attach_bus_share(engine, 1.0)  # every CPU-tier expert of the prompt travels
        share.fetch_tokens = 1
        logits = engine.forward(torch.tensor(PROMPT), 0)
        assert share.copied > 0 and not prefill_kernels.available()
    finally:
        engine.close()
    model = tiny_hf_model("qwen3_moe")
    ref = reference_logits(model, PROMPT)
    assert rel_err(logits, ref) < logits_tolerance(model, PROMPT, ref)


def test_kept_blocks_whose_grouped_kernel_fails_are_dequantized_in_their_slots(tiny_gguf, monkeypatch):
    """Kept Q8_0 experts fetched for a prompt whose grouped kernel fails to build: their slots are
    dequantized and computed one expert at a time, and the logits are those of the same experts
    dequantized at load."""
    from workbench.engine import prefill_kernels

    sizes = {"hidden_size": 64, "moe_intermediate_size": 32, "intermediate_size": 64, "mlp_only_layers": []}
    inv = open_inventory(tiny_gguf("qwen3_moe", "Q8_0", **sizes))
    runs = {}
    for keep in ("0", "1"):
        monkeypatch.setenv("WORKBENCH_KEEP_QUANTS", keep)
        monkeypatch.setattr(prefill_kernels, "_disabled", [])
        if keep == "1":
            def broken(*a, **k):
                raise prefill_kernels.triton.CompilationError("x.py", None, "no such instruction")

            monkeypatch.setattr(prefill_kernels._grouped_kernel, "run", broken)
        engine = decode_step_engine(inv, placements(inv)["compute"])
        try:
            share = attach_bus_share(engine, 1.0 if keep == "1" else 0.0)
            share.fetch_tokens = 1
            runs[keep] = engine.forward(torch.tensor(PROMPT), 0)
            if keep == "1":
                assert share.copied > 0 and not prefill_kernels.available()
                assert all(lx.kept_cpu is not None for lx in engine.experts.values())
        finally:
            engine.close()
    assert rel_err(runs["1"], runs["0"]) < (1e-5 if TEST_DTYPE == torch.float32 else LOGITS_RTOL)


@pytest.mark.parametrize("rows,expect", [([3, 4, 5, 9, 10, 2], [(0, 3), (3, 5), (5, 6)]), ([7], [(0, 1)]), ([], []),
                                         ([5, 4, 3], [(0, 1), (1, 2), (2, 3)])])
def test_a_batch_of_rows_is_copied_in_runs_of_consecutive_rows(rows, expect):
    assert bus.runs(np.array(rows, dtype=np.int64)) == expect


def test_rows_of_gives_the_address_and_row_size_of_contiguous_stacks():
    from workbench.engine import h2d

    t = torch.zeros(5, 6, 4, dtype=torch.bfloat16)
    assert h2d.rows_of(t) == (t.data_ptr(), 6 * 4 * 2)
    assert h2d.rows_of(t[:, :3]) is None  # not whole rows
    assert h2d.rows_of(t.transpose(1, 2)) is None


@pytest.mark.skipif(TEST_DEVICE == "cpu", reason="the driver's copies need CUDA")
@pytest.mark.parametrize("native", [True, False])
def test_a_prompts_fetch_copies_the_rows_it_is_given(native, monkeypatch):
    """The driver's row copies (``h2d.Copier``) and torch's land the same rows in the same slots, runs
    of consecutive rows and single ones alike, and the slots hold nothing else of the stacks."""
    from workbench.engine import h2d

    if not native:
        monkeypatch.setattr(h2d, "available", lambda: False)
    w13 = torch.randn(12, 64, 32).to(torch.bfloat16)
    w2 = torch.randn(12, 32, 32).to(torch.bfloat16)
    share = bus.BusShare(torch.device(TEST_DEVICE), torch.bfloat16, 12, (64, 32), (32, 32), 0.5, slots=8)
    try:
        assert share.pin(object(), [w13, w2])
        s13, s2 = share.slot_stacks()
        rows = np.array([2, 3, 4, 9])
        base = share.fetch(1, rows, rows, [w13, w2])
        torch.cuda.current_stream().synchronize()
        assert isinstance(share._copier, h2d.Copier) == native
        assert torch.equal(s13[base:base + 4].cpu(), w13[rows]) and torch.equal(s2[base:base + 4].cpu(), w2[rows])
    finally:
        share.close()


def test_a_batch_is_one_copy_per_run_of_rows_and_tensor():
    """The copies a prompt batch queues through the driver: each run of consecutive host rows is one
    copy per tensor, into consecutive slots from ``base``, at each tensor's own row size."""
    native = [((1000, 10), (5000, 10)), ((2000, 3), (9000, 3))]  # (slots, stack): (address, row bytes)
    dst, src, size = bus.copy_table(native, 4, np.array([7, 8, 9, 2, 5, 6]))
    assert dst == [1040, 1070, 1080, 2012, 2021, 2024]
    assert src == [5070, 5020, 5050, 9021, 9006, 9015]
    assert size == [30, 10, 20, 9, 3, 6]


def test_the_host_clock_tells_each_hybrid_prompt_layer_what_it_fetched(tiny_model_dir):
    """With a ``HostClock`` attached, every hybrid layer of a prompt reports its host time and work:
    its fetched experts add up to the bus's count, in batches of at most half the slots, each with a
    copy per tensor at least; the CPU's share shows where it computed experts. Decode steps and
    prompts after ``record_host(None)`` report nothing."""
    from workbench.engine.hostclock import HostClock

    inv = open_inventory(tiny_model_dir("qwen3_moe"))
    engine = decode_step_engine(inv, placements(inv)["compute"])
    try:
        share = attach_bus_share(engine, 0.0)
        share.fetch_tokens = 4  # some travel, some stay with the CPU
        clock = HostClock()
        engine.record_host(clock)
        engine.forward(torch.tensor(PROMPT), 0)
        engine.forward(torch.tensor(PROMPT[:1]), len(PROMPT))  # a decode step: not recorded
        hybrid = [layer for layer, lx in engine.experts.items() if not lx.all_resident]
        assert [r.layer for r in clock.layers] == hybrid
        assert [r.first for r in clock.layers] == [True] + [False] * (len(hybrid) - 1)
        assert sum(r.fetched for r in clock.layers) == share.copied > 0
        for r in clock.layers:
            assert r.busy_s > 0 and r.wait_s >= 0 and r.cpu_wait_s >= 0
            assert r.cpu_run_s >= r.cpu_wait_s and (r.cpu_share or r.cpu_run_s == 0)  # a run only with a share
            assert r.batches == -(-r.fetched // share.half_slots())
            assert r.copies >= 2 * r.batches  # float experts: w13 and w2
        assert any(r.cpu_share for r in clock.layers)
        engine.record_host(None)
        engine.forward(torch.tensor(PROMPT), 0)
        assert len(clock.layers) == len(hybrid)
    finally:
        engine.close()


def test_the_engines_bus_share_comes_from_the_profile_unless_asked_for(monkeypatch, tiny_model_dir):
    """``bus.fraction_for``: the share that balances the profile's bus and CPU read rates (what the
    cost model predicts with); ``WORKBENCH_BUS_SHARE`` wins when set; without a profile or a GPU in
    it, the default."""
    import dataclasses

    from workbench.core.costmodel import BUS_SHARE, model_bus_share
    from workbench.core.hardware import preset

    inv = open_inventory(tiny_model_dir("qwen3_moe"))
    prof = dataclasses.replace(preset("bench-h200"), bus_read_rate=20e9)
    monkeypatch.delenv("WORKBENCH_BUS_SHARE", raising=False)
    assert bus.fraction_for(inv, prof) == model_bus_share(inv, prof) != BUS_SHARE
    assert bus.fraction_for(inv, None) == BUS_SHARE
    assert bus.fraction_for(inv, dataclasses.replace(prof, gpus=())) == BUS_SHARE
    monkeypatch.setenv("WORKBENCH_BUS_SHARE", "0.2")
    assert bus.fraction_for(inv, prof) == 0.2
