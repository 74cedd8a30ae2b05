"""Decode steps served by the native thread (``served.DecodeServer``): the CPU experts of hybrid
layers computed from packets in (page-locked) memory, no host point per layer. Tokens stay
transformers'; the host-driven steps are the other reference. On a CPU accelerator the server runs
with ``served_mode = "on"`` and the host polls where CUDA runs a kernel."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tests.engine.engine_helpers import (
    PROMPT,
    TEST_DTYPE,
    attach_bus_share,
    decode_step_engine,
    greedy_tokens,
    open_inventory,
    placements,
    reference_tokens,
    rel_err,
)
from workbench.core.placement import CPU_COMPUTE, ON_GPU0, Placement
from workbench.engine import cpu_kernel, served

pytestmark = pytest.mark.skipif(not cpu_kernel.available(), reason="needs the fused CPU kernel (a C++ compiler)")

N_NEW = 12


def hybrid(inv, seed: int = 1) -> Placement:
    """Each expert resident or on the CPU at random: every layer hybrid, nothing streamed."""
    rng = random.Random(seed)
    p = Placement(ON_GPU0)
    for k in inv.expert_keys():
        p.set(k, rng.choice([ON_GPU0, CPU_COMPUTE]))
    return p


def run(inv, placement, mode: str, fraction: float | None = None, steps: int = N_NEW,
        forced: list[int] | None = None):
    """``(tokens, last decode logits, server)`` of greedy decoding with ``served_mode = mode``; a bus
    share of ``fraction`` attached as the engine does on CUDA. ``forced``: decode these tokens instead
    of the greedy ones (two runs in bf16 then compare logits of the same inputs: a near tie between a
    tiny random model's logits can pick another token in either)."""
    engine = decode_step_engine(inv, placement)
    engine.served_mode = mode
    try:
        if fraction is not None:
            attach_bus_share(engine, fraction)
        if forced is None:
            tokens = greedy_tokens(engine, PROMPT, steps)
        else:
            tokens = list(forced)
            engine.forward(torch.tensor(PROMPT), 0)
            for i, t in enumerate(tokens[:-1]):
                engine.forward(torch.tensor([t]), len(PROMPT) + i)
        last = engine.forward(torch.tensor([tokens[-1]]), len(PROMPT) + steps - 1)
        server = engine._decoder.server if engine._decoder is not None else None
        counts = (server.served, server.bus_pairs, server.trace()) if server is not None else None
        return tokens, last, counts
    finally:
        engine.close()


def host_run(inv, placement, tokens: list[int], **kw):
    """The host-driven run to set beside a served one's ``tokens``: greedy in float32 (the tokens must
    agree), the served run's tokens decoded again in bf16 (its logits then compare on the same inputs)."""
    return run(inv, placement, "off", forced=None if TEST_DTYPE == torch.float32 else tokens, **kw)


@pytest.mark.parametrize("direct", [False, pytest.param(True, marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the publish kernel writes to page-locked memory itself only on CUDA"))])
@pytest.mark.parametrize("place", ["hybrid", "compute"])
def test_served_steps_give_the_reference_tokens(place, direct, tiny_model_dir, tiny_hf_model, monkeypatch):
    """``direct``: the packets and their flags written by the publish kernel (``WORKBENCH_SERVED_DIRECT``)."""
    monkeypatch.setenv("WORKBENCH_SERVED_DIRECT", "1" if direct else "0")
    inv = open_inventory(tiny_model_dir("qwen3_moe"))
    placement = hybrid(inv) if place == "hybrid" else placements(inv)["compute"]
    tokens, logits, (packets, _, _) = run(inv, placement, "on")
    _, host_logits, none = host_run(inv, placement, tokens)
    assert none is None
    layers = len(inv.spec.moe_layers)
    assert packets >= layers * (N_NEW - 1)  # every hybrid layer of every decode step went to the thread
    assert rel_err(logits, host_logits) < (1e-5 if TEST_DTYPE == torch.float32 else 2e-2)
    if TEST_DTYPE == torch.float32:
        assert tokens == reference_tokens(tiny_hf_model("qwen3_moe"), PROMPT, N_NEW)


@pytest.mark.skipif(not served.gpu_kernels.available(), reason="needs Triton and CUDA (or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_a_bus_share_reads_the_cpu_stacks_in_place(fraction, tiny_model_dir, tiny_hf_model, monkeypatch):
    """The bus's pairs computed by the accelerator from the CPU tier's stacks, the rest by the thread;
    the packets mark the bus's pairs, which the server's trace counts."""
    monkeypatch.setenv("WORKBENCH_SERVER_TRACE", "10000")
    inv = open_inventory(tiny_model_dir("qwen3_moe"))
    placement = placements(inv)["compute"]
    tokens, logits, (_, bus_pairs, trace) = run(inv, placement, "on", fraction)
    _, host_logits, _ = host_run(inv, placement, tokens, fraction=0.0)
    assert bus_pairs > 0
    assert 0 < trace[:, 5].sum() <= bus_pairs  # the last step's packets may still be on their way
    assert rel_err(logits, host_logits) < (1e-5 if TEST_DTYPE == torch.float32 else 2e-2)
    if TEST_DTYPE == torch.float32:
        assert tokens == reference_tokens(tiny_hf_model("qwen3_moe"), PROMPT, N_NEW)


@pytest.mark.skipif(not served.gpu_kernels.available(), reason="needs Triton and CUDA (or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("source", ["float", "Q8_0"])
def test_a_unit_split_shares_every_cpu_pair_between_the_cpu_and_the_bus(source, tiny_model_dir, tiny_gguf,
                                                                      monkeypatch, exact_cpu_dots):
    """Served decode's unit split: the thread computes each CPU-tier pair's first units, the
    accelerator the others from the same page-locked stacks in place, and the step adds both; the
    host-driven steps' logits (the CPU's exact dots: the int8 ones round inputs the bus does not)."""
    sizes = {"hidden_size": 64, "moe_intermediate_size": 64, "intermediate_size": 64, "mlp_only_layers": []}
    inv = open_inventory(tiny_model_dir("qwen3_moe", **sizes) if source == "float"
                         else tiny_gguf("qwen3_moe", "Q8_0", **sizes))
    monkeypatch.setenv("WORKBENCH_KEEP_QUANTS", "1")
    placement = hybrid(inv)
    engine = decode_step_engine(inv, placement)
    engine.served_mode = "on"
    try:
        attach_bus_share(engine, 0.5, units=0.5)
        tokens = greedy_tokens(engine, PROMPT, 4)
        logits = engine.forward(torch.tensor([tokens[-1]]), len(PROMPT) + 3)
        server = engine._decoder.server
        split = {layer: (s.units, s.ffn) for layer, s in server.layers.items() if s.bus_stacks is not None}
        pairs = server.bus_pairs
    finally:
        engine.close()
    _, host_logits, _ = host_run(inv, placement, tokens, steps=4)
    assert split and set(split) == set(server.layers) and all(v == (32, 64) for v in split.values())
    assert pairs > 0  # the bus's part of every CPU-tier pair
    assert rel_err(logits, host_logits) < (1e-5 if TEST_DTYPE == torch.float32 else 2e-2)


@pytest.mark.parametrize("raw,shares", [("", [0.5, 0.25]), ("0", None), ("0.375", [0.375, 0.375]), ("x", [0.5, 0.25])])
def test_the_unit_split_setting(raw, shares, monkeypatch):
    """``WORKBENCH_BUS_UNITS`` overrides the cost model's unit split per layer (0: none)."""
    from workbench.engine import bus

    monkeypatch.setenv("WORKBENCH_BUS_UNITS", raw)
    got = bus.unit_shares_from_env([0.5, 0.25], 2)
    assert (got is None) == (shares is None)
    if shares is not None:
        assert got.tolist() == shares


@pytest.mark.parametrize("tensor_type,width", [("Q8_0", 64), ("Q4_K", 256)])
def test_kept_blocks_are_served_as_blocks(tensor_type, width, tiny_gguf, monkeypatch):
    """CPU experts kept in the file's blocks: the thread reads the blocks as the host-driven step does."""
    sizes = {"hidden_size": width, "moe_intermediate_size": width // 2 if tensor_type == "Q8_0" else width,
             "intermediate_size": width, "mlp_only_layers": []}
    inv = open_inventory(tiny_gguf("qwen3_moe", tensor_type, **sizes))
    monkeypatch.setenv("WORKBENCH_KEEP_QUANTS", "1")
    placement = placements(inv)["compute"]  # (resident k-quant rows run slowly in Triton's interpreter)
    tokens, logits, (packets, _, _) = run(inv, placement, "on", steps=4)
    host_tokens, host_logits, _ = host_run(inv, placement, tokens, steps=4)
    assert packets > 0
    assert rel_err(logits, host_logits) < (1e-5 if TEST_DTYPE == torch.float32 else 2e-2)
    if TEST_DTYPE == torch.float32:
        assert tokens == host_tokens


@pytest.mark.parametrize("source", ["float", "MXFP4"])
def test_gpt_oss_experts_are_served_with_their_biases(source, tiny_model_dir, tiny_gguf, tiny_hf_model,
                                                     exact_cpu_dots, monkeypatch):
    """gpt-oss's biased, clamped experts on the CPU tier: the thread computes them as the host-driven
    step does, float stacks and MXFP4 blocks alike (and, float, with transformers' tokens); the
    resident ones go through the one-token kernels with their biases."""
    biased = []
    real = served.gpu_kernels.experts_one_token
    monkeypatch.setattr(served.gpu_kernels, "experts_one_token",
                        lambda *a, **kw: biased.append(kw.get("b13") is not None) or real(*a, **kw))
    sizes = {"hidden_size": 64, "intermediate_size": 64}
    inv = open_inventory(tiny_model_dir("gpt_oss", **sizes) if source == "float"
                         else tiny_gguf("gpt_oss", "MXFP4", **sizes))
    placement = hybrid(inv)
    tokens, logits, (packets, _, _) = run(inv, placement, "on", steps=6)
    host_tokens, host_logits, _ = host_run(inv, placement, tokens, steps=6)
    assert packets > 0
    assert biased and all(biased)
    assert rel_err(logits, host_logits) < (1e-5 if TEST_DTYPE == torch.float32 else 2e-2)
    if TEST_DTYPE == torch.float32:
        assert tokens == host_tokens
        if source == "float":
            assert tokens == reference_tokens(tiny_hf_model("gpt_oss", **sizes), PROMPT, 6)


@pytest.mark.skipif(not served.gpu_kernels.available(), reason="needs Triton and CUDA (or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("source", ["float", "MXFP4"])
def test_gpt_oss_bus_pairs_read_their_biases_in_place(source, tiny_model_dir, tiny_gguf, exact_cpu_dots):
    """With a bus share, the accelerator computes gpt-oss's CPU-tier pairs from the page-locked stacks
    and biases in place: the served steps give the host-driven steps' logits and tokens."""
    sizes = {"hidden_size": 64, "intermediate_size": 64}
    inv = open_inventory(tiny_model_dir("gpt_oss", **sizes) if source == "float"
                         else tiny_gguf("gpt_oss", "MXFP4", **sizes))
    placement = placements(inv)["compute"]
    tokens, logits, (_, bus_pairs, _) = run(inv, placement, "on", 0.5, steps=6)
    host_tokens, host_logits, _ = host_run(inv, placement, tokens, steps=6)
    assert bus_pairs > 0
    assert rel_err(logits, host_logits) < (1e-5 if TEST_DTYPE == torch.float32 else 2e-2)
    if TEST_DTYPE == torch.float32:
        assert tokens == host_tokens


def test_a_thread_that_does_not_answer_ends_the_server_not_the_step(tiny_model_dir, tiny_hf_model, monkeypatch):
    """A layer whose packet is not served in time: the step runs again host-driven, tokens unchanged."""
    monkeypatch.setattr(served, "TIMEOUT_S", 0.2)
    inv = open_inventory(tiny_model_dir("qwen3_moe"))
    placement = placements(inv)["compute"]
    engine = decode_step_engine(inv, placement)
    engine.served_mode = "on"
    try:
        logits = engine.forward(torch.tensor(PROMPT), 0)
        out = [int(logits[-1].argmax())]
        engine.forward(torch.tensor([out[-1]]), len(PROMPT))  # makes the decode step and its server
        server = engine._decoder.server
        assert server is not None
        from workbench.engine.bench import EngineRun, engine_paths, path_warnings

        assert engine_paths(engine)["decode_server_off"] is None
        server.native.stop()  # the thread is gone: nothing answers
        tokens = greedy_tokens(engine, PROMPT, N_NEW)
        assert engine._decoder.server is None  # the step went on host-driven
        paths = engine_paths(engine)  # and a bench run says so beside its figures
        assert paths["served_layers"] == [] and "did not answer" in paths["decode_server_off"]
        run = EngineRun(label="frequency", strategy="frequency", engine_paths=paths)
        assert path_warnings([run]) and "decode server went off" in path_warnings([run])[0]
    finally:
        engine.close()
    if TEST_DTYPE == torch.float32:
        assert tokens == reference_tokens(tiny_hf_model("qwen3_moe"), PROMPT, N_NEW)


def test_a_step_that_leaves_the_cpu_nothing_does_not_wait_for_it(tiny_model_dir, monkeypatch):
    """A packet whose selections are all resident: ``wait_add`` adds nothing and returns without the
    thread's answer (it is stopped here); one with a CPU expert waits, and times out."""
    from workbench.engine.experts import COMPUTE, RESIDENT

    monkeypatch.setattr(served, "TIMEOUT_S", 0.2)
    inv = open_inventory(tiny_model_dir("qwen3_moe"))
    engine = decode_step_engine(inv, hybrid(inv))
    engine.served_mode = "on"
    try:
        engine.forward(torch.tensor(PROMPT), 0)
        engine.forward(torch.tensor([PROMPT[-1]]), len(PROMPT))  # makes the decode step and its server
        server = engine._decoder.server
        slot = next(s for s in server.layers.values()
                    if (s.lx.tier == RESIDENT).sum() >= server.k and (s.lx.tier == COMPUTE).any())
        lx = slot.lx
        server.native.stop()
        dev = engine.device
        resident = torch.tensor((lx.tier == RESIDENT).nonzero()[0][:server.k], device=dev).reshape(1, -1)
        with torch.inference_mode():  # as the engine's steps run
            x = torch.randn(1, server.hidden, dtype=TEST_DTYPE, device=dev)
            w = torch.full((1, server.k), 1.0 / server.k, device=dev)
            out = torch.zeros(1, server.hidden, dtype=TEST_DTYPE, device=dev)
            server.begin()
            server.publish(lx, x, resident, w)
            server.wait_add(lx, out)
            assert int(slot.host[0]) == 0 and not out.any()
            server.check()  # no time-out
            with_cpu = resident.clone()
            with_cpu[0, 0] = int((lx.tier == COMPUTE).nonzero()[0][0])
            server.begin()
            server.publish(lx, x, with_cpu, w)
            server.wait_add(lx, out)
            assert int(slot.host[0]) == 1
            with pytest.raises(served.ServedError):
                server.check()
    finally:
        engine.close()


def test_closing_the_engine_stops_the_thread(tiny_model_dir):
    inv = open_inventory(tiny_model_dir("qwen3_moe"))
    engine = decode_step_engine(inv, hybrid(inv))
    engine.served_mode = "on"
    greedy_tokens(engine, PROMPT, 3)
    server = engine._decoder.server
    assert server.native.running()
    from workbench.engine.bench import engine_paths

    assert engine_paths(engine)["served_layers"] == sorted(server.layers)  # what a bench run reports
    engine.close()
    assert not server.native.running()


@pytest.mark.parametrize("raw,mode", [("", "auto"), ("auto", "auto"), ("0", "off"), ("OFF", "off"), ("1", "on"),
                                      ("yes", "on"), ("sometimes", "auto")])
def test_the_setting_from_the_environment(raw, mode):
    from workbench.engine.engine import _served_mode

    assert _served_mode(raw) == mode


@pytest.mark.parametrize("raw,on", [("", True), ("0", False), (" 0 ", False), ("1", True), ("yes", True)])
def test_the_direct_publish_setting(raw, on, monkeypatch):
    monkeypatch.setenv("WORKBENCH_SERVED_DIRECT", raw)
    assert served.direct_publish() is on


def test_closing_the_engine_while_another_thread_decodes(tiny_model_dir):
    """The chat pane decodes on a worker thread while the user closes the model: the step in progress
    finishes, the next one says the engine was closed, and the server's thread is gone."""
    import threading

    from workbench.core.errors import WorkbenchError

    inv = open_inventory(tiny_model_dir("qwen3_moe"))
    engine = decode_step_engine(inv, hybrid(inv))
    engine.served_mode = "on"
    engine.forward(torch.tensor(PROMPT), 0)
    started, outcome = threading.Event(), []

    def decode():
        pos = len(PROMPT)
        try:
            while True:
                engine.forward(torch.tensor([5]), pos)
                pos = len(PROMPT) + (pos + 1 - len(PROMPT)) % 40
                started.set()
        except WorkbenchError as exc:
            outcome.append(exc)
        except Exception as exc:  # noqa: BLE001 - the test reports it
            outcome.append(exc)

    worker = threading.Thread(target=decode)
    worker.start()
    assert started.wait(60)
    server = engine._decoder.server
    engine.close()
    worker.join(60)
    assert not worker.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], WorkbenchError), outcome
    assert not server.native.running()


@pytest.mark.parametrize("fraction", [0.0, 0.18, 0.45, 0.5, 0.75])
def test_the_publish_kernel_splits_the_cpu_tier_as_the_model_counts(fraction):
    """The decode step's publish kernel (Triton; its interpreter here) and its torch form send the
    bus ``costmodel.bus_count`` of a token's ``n`` CPU-tier selections, the first of them by rank."""
    from types import SimpleNamespace

    from workbench.core.costmodel import bus_count
    from workbench.engine import gpu_kernels
    from workbench.engine.experts import COMPUTE, RESIDENT

    k, hidden, experts, slots = 8, 16, 32, 4
    tier = torch.full((experts,), RESIDENT, dtype=torch.int8)
    tier[16:] = COMPUTE
    local = torch.where(tier == COMPUTE, torch.arange(experts) - 16, torch.arange(experts)).long()
    lx = SimpleNamespace(tier_dev=tier, local_dev=local)
    for n in range(k + 1):
        ids = torch.cat([torch.arange(16, 16 + n), torch.arange(0, k - n)]).long()[torch.randperm(k)]
        w, x = torch.rand(k), torch.randn(hidden)
        forms = []
        s = SimpleNamespace(packet_dev=torch.zeros(2 * k + hidden), bus_rows=torch.zeros(k, dtype=torch.long),
                            host=torch.zeros(1, dtype=torch.int32))
        forms.append((served._publish_torch(ids, w, x, lx, s, fraction, slots), s))
        if gpu_kernels.usable(x) and served.triton is not None:
            t = SimpleNamespace(packet_dev=torch.zeros(2 * k + hidden), bus_rows=torch.zeros(k, dtype=torch.long),
                                host=torch.zeros(1, dtype=torch.int32))
            count = torch.zeros(1, dtype=torch.long)
            served._publish_kernel[(1,)](ids, w, x, tier, local, t.packet_dev, t.bus_rows, count, t.host, hidden,
                                         float(fraction), served.bus_ratio(fraction), slots,
                                         torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.long),
                                         K=k, KP=k, BLOCK_H=16)
            forms.append((int(count[0]), t))
        want = bus_count(n, fraction, slots)
        for m, out in forms:
            assert m == want and int(out.host[0]) == n - want
            assert int((out.bus_rows >= 0).sum()) == want and int((out.packet_dev[:k] >= 0).sum()) == n - want


def test_the_server_records_each_layers_packet_when_asked(tiny_model_dir, monkeypatch):
    """``WORKBENCH_SERVER_TRACE``: each packet the thread served, in layer order within a step, its
    pairs those the publish left the CPU, seen before done; off by default."""
    inv = open_inventory(tiny_model_dir("qwen3_moe"))
    for capacity in ("", "1000"):
        monkeypatch.setenv("WORKBENCH_SERVER_TRACE", capacity)
        engine = decode_step_engine(inv, hybrid(inv))
        engine.served_mode = "on"
        try:
            greedy_tokens(engine, PROMPT, 4)
            server = engine._decoder.server
        finally:
            engine.close()  # the thread has served every packet (a step waits only for those with CPU pairs)
        rec, served_packets = server.trace(), server.served
        if not capacity:
            assert rec.shape == (0, 6)
            continue
        layers = sorted(server.layers)
        assert len(rec) == served_packets and len(rec) >= len(layers)
        assert (rec[:, 3] >= rec[:, 2]).all() and (rec[:, 4] >= 0).all() and (rec[:, 4] <= inv.spec.n_experts_active).all()
        assert set(rec[:, 0].tolist()) <= set(layers)
        for step in np.unique(rec[:, 1]):
            one = rec[rec[:, 1] == step]
            # served layers in order, each once (a packet without CPU pairs that the next step's
            # overwrote before the thread saw it is not served, as nothing waits for it)
            assert (np.diff(one[:, 0]) > 0).all() and (np.diff(one[:, 2]) > 0).all()
        assert rec[:, 4].sum() > 0
