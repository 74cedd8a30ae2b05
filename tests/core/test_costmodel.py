import dataclasses
import math
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workbench.core.costmodel import CostModel, EngineShape, cpu_rate, lru_hit_probs, prompt_pair_reads
from workbench.core.memory import estimate_memory, placement_all_gpu, placement_cpu_moe, placement_n_cpu_moe
from workbench.core.placement import CPU_COMPUTE, CPU_STREAM, ON_GPU0, Placement
from workbench.core.stats import ExpertStats
from workbench.core.units import UnitKey

from .profiles import desktop_profile, h200_profile
from .synth_inventory import dirichlet_stats, synth_inventory


def _skewed_stats(inv, seed=0, alpha=0.2):
    return dirichlet_stats(inv, seed, alpha, tokens=1e5)


def test_one_layer_by_hand():
    """1 layer, 2 experts, top-1, no stats: every term of the decode formula checked by hand."""
    inv = synth_inventory(1, 2, top_k=1, hidden=64, expert_ffn=32, vocab=128, n_heads=2, n_kv_heads=1, head_dim=32)
    hw = h200_profile()
    hw = dataclasses.replace(hw, cpu_expert_throughput={**hw.cpu_expert_throughput, "bf16": 1e8})  # CPU > GPU lane
    g = hw.gpus[0]
    eng = EngineShape()
    cm = CostModel(inv, hw, engine=eng)
    p = Placement()
    p.set(UnitKey(0, "expert", 1), CPU_COMPUTE)
    pred = cm.predict(p, ctx=256, prompt_tokens=100)
    c = pred.decode_layers[0]
    eb = inv.units[UnitKey(0, "expert", 0)].nbytes
    attn = inv.units[UnitKey(0, "attn")].nbytes + 100 * 2 * 1 * 32 * 2  # weights + KV of 100 tokens (f16)
    pre = (attn / g.mem_bandwidth + eng.launches_attn * g.launch_s
           + inv.units[UnitKey(0, "router")].nbytes / g.mem_bandwidth + eng.launches_moe * g.launch_s
           + inv.units[UnitKey(0, "norm")].nbytes / g.mem_bandwidth)
    assert c.pre == pytest.approx(pre)
    assert c.gpu == pytest.approx(0.5 * eb / g.expert_bandwidth + eng.launches_cpu_return * g.launch_s)
    # the server's hand-off is on the CPU's way when the token leaves the CPU an expert: half the tokens
    assert c.cpu == pytest.approx(0.5 * (eb / hw.cpu_expert_throughput["bf16"] + hw.sync_s))
    assert c.sync == 0 and c.bus == 0
    # overlap, not the sum, token by token: half the tokens wait for the CPU's whole expert
    one = eb / hw.cpu_expert_throughput["bf16"]
    assert c.total == pytest.approx(c.pre + 0.5 * c.gpu + 0.5 * max(c.gpu, one + hw.sync_s))
    assert c.spread == pytest.approx(c.total - (c.pre + max(c.gpu, c.cpu) + c.sync)) and c.spread > 0
    assert c.gpu_share == pytest.approx(0.5)
    assert 1 / pred.decode_tps == pytest.approx(c.total + pred.decode_other_s)


def test_the_hosts_time_per_step_counts_once_a_decoded_token():
    """``decode_step_s`` (the host's own time per decode step) adds to each token once, whatever the
    layers, and leaves the prompt and the layers' costs as they were."""
    inv = synth_inventory(4, 8)
    hw = h200_profile()
    p = placement_n_cpu_moe(inv, 2)
    base = CostModel(inv, hw).predict(p, ctx=1024, prompt_tokens=256)
    step = 3e-4
    more = CostModel(inv, dataclasses.replace(hw, decode_step_s=step)).predict(p, ctx=1024, prompt_tokens=256)
    assert 1 / more.decode_tps == pytest.approx(1 / base.decode_tps + step)
    assert more.decode_other_s == pytest.approx(base.decode_other_s + step)
    assert more.prefill_tps == base.prefill_tps
    assert [c.total for c in more.decode_layers] == [c.total for c in base.decode_layers]
    assert CostModel(inv, dataclasses.replace(hw, decode_step_s=step)).decode_tps(p, kv_tokens=256) == pytest.approx(
        more.decode_tps)
    assert dataclasses.replace(hw, decode_step_s=-1.0).problems()



def test_routing_over_more_experts_than_picked_costs_each_moe_layer_on_the_gpu():
    """``route_s_per_expert``: each MoE layer whose router sits on a GPU takes that much longer per
    expert beyond its ``top_k``, in its pre-expert part, prompt untouched; nothing where the profile
    has 0 (a profile from before it) or a layer has no more experts than it picks."""
    inv = synth_inventory(4, 8, top_k=2)
    hw = h200_profile()
    p = placement_n_cpu_moe(inv, 1)
    base = CostModel(inv, hw).predict(p, ctx=512, prompt_tokens=128)
    c = 9e-8
    wide = dataclasses.replace(hw, gpus=(dataclasses.replace(hw.gpus[0], route_s_per_expert=c),) + hw.gpus[1:])
    more = CostModel(inv, wide).predict(p, ctx=512, prompt_tokens=128)
    assert [m.pre - b.pre for m, b in zip(more.decode_layers, base.decode_layers)] == pytest.approx([c * 6] * 4)
    assert 1 / more.decode_tps == pytest.approx(1 / base.decode_tps + 4 * c * 6)
    assert more.prefill_tps == base.prefill_tps
    narrow = synth_inventory(4, 2, top_k=2)
    assert CostModel(narrow, wide).decode_tps(placement_all_gpu(narrow), kv_tokens=256) == pytest.approx(
        CostModel(narrow, hw).decode_tps(placement_all_gpu(narrow), kv_tokens=256))
    bad = dataclasses.replace(hw, gpus=(dataclasses.replace(hw.gpus[0], route_s_per_expert=1e-3),))
    assert any("route_s_per_expert" in m for m in bad.problems())


def test_the_cpu_and_the_bus_together_read_no_faster_than_ram_and_the_hand_off_adds_to_that():
    """Served decode with a bus share: the CPU's lane is at least all of a token's CPU-tier experts
    read at the host's RAM rate (the bus reads the same RAM), plus the hand-off, which moves the
    packet and the result and reads no weights."""
    inv = synth_inventory(1, 8, top_k=8, hidden=64, expert_ffn=32, vocab=128, n_heads=2, n_kv_heads=1, head_dim=32)
    one = inv.units[UnitKey(0, "expert", 0)].nbytes
    hw = h200_profile()
    # a CPU as fast as the RAM alone and a bus at a third of it: the share sends 2 of 8 to the bus
    hw = dataclasses.replace(hw, host_read_bandwidth=1e9, cpu_expert_throughput={"bf16": 1e9}, bus_read_rate=0.5e9,
                             h2d_pinned=1e10, sync_s=1e-3, sync_by_format={})
    p = placement_cpu_moe(inv)
    lane = CostModel(inv, hw, engine=EngineShape(bus_share=0.25)).predict(p, ctx=64, prompt_tokens=8).decode_layers[0]
    assert lane.cpu == pytest.approx(8 * one / 1e9 + 1e-3)


def test_a_layers_hand_off_is_its_cpu_experts_formats():
    """``sync_by_format``: a layer of bf16 experts takes the bf16 hand-off where the profile has one,
    and ``sync_s`` where it has one for another format only."""
    inv = synth_inventory(1, 2, top_k=1, hidden=64, expert_ffn=32, vocab=128, n_heads=2, n_kv_heads=1, head_dim=32)
    hw = h200_profile()
    hw = dataclasses.replace(hw, cpu_expert_throughput={**hw.cpu_expert_throughput, "bf16": 1e8})
    p = Placement()
    p.set(UnitKey(0, "expert", 1), CPU_COMPUTE)
    one = inv.units[UnitKey(0, "expert", 0)].nbytes / 1e8

    def cpu_lane(prof):
        return CostModel(inv, prof, engine=EngineShape()).predict(p, ctx=256, prompt_tokens=100).decode_layers[0].cpu

    assert cpu_lane(dataclasses.replace(hw, sync_by_format={"bf16": 7e-4})) == pytest.approx(0.5 * (one + 7e-4))
    assert cpu_lane(dataclasses.replace(hw, sync_by_format={"q8_0": 7e-4})) == pytest.approx(0.5 * (one + hw.sync_s))
    assert hw.sync_s != 7e-4

def test_a_layer_waits_for_the_cpu_token_by_token():
    """A decode layer's time is the mean over the tokens' CPU selection counts (binomial over the
    top-k picks) of its slowest lane (the CPU's with the hand-off), not the slowest mean lane: with one of four
    experts on a slow CPU and top-2, 7/16 of the tokens wait for one or two whole CPU experts."""
    inv = synth_inventory(1, 4, top_k=2, hidden=64, expert_ffn=32, vocab=128, n_heads=2, n_kv_heads=1, head_dim=32)
    hw = h200_profile()
    hw = dataclasses.replace(hw, cpu_expert_throughput={**hw.cpu_expert_throughput, "bf16": 1e8})
    cm = CostModel(inv, hw, engine=EngineShape(bus_share=0.0))
    p = Placement()
    p.set(UnitKey(0, "expert", 3), CPU_COMPUTE)
    pred = cm.predict(p, ctx=256, prompt_tokens=100)
    c = pred.decode_layers[0]
    assert "spread µs" in pred.table(per_layer=True) and f"{c.spread * 1e6:9.1f}" in pred.table(per_layer=True)
    one = inv.units[UnitKey(0, "expert", 3)].nbytes / 1e8
    probs = {0: 0.75 ** 2, 1: 2 * 0.25 * 0.75, 2: 0.25 ** 2}  # CPU selections of a token
    # the hand-off is on the CPU's way, paid by the tokens that give the CPU an expert
    assert c.cpu == pytest.approx(0.5 * one + (1 - probs[0]) * hw.sync_s) and c.sync == 0
    want = sum(q * max(c.gpu, n * one + (hw.sync_s if n else 0.0)) for n, q in probs.items())
    assert c.total == pytest.approx(c.pre + want)
    assert c.total > c.pre + max(c.gpu, c.cpu) + c.sync  # the mean lane alone would be too fast
    curves, _ = cm.layer_curves(p, np.array([[0, 1, 2, 3]]), kv_tokens=100)  # three on the GPU: the same layer
    assert curves[0, 3] == pytest.approx(c.total)


def test_memory_is_the_memory_estimate():
    inv = synth_inventory(4, 8)
    p = placement_n_cpu_moe(inv, 2)
    pred = CostModel(inv, h200_profile()).predict(p, ctx=2048)
    assert pred.memory.to_json() == estimate_memory(inv, p, 2048).to_json()


def test_layer_shaped_placements_are_ordered():
    inv = synth_inventory(6, 16, hidden=512, expert_ffn=256)
    cm = CostModel(inv, desktop_profile())
    speeds = [cm.predict(placement_n_cpu_moe(inv, n)).decode_tps for n in range(7)]
    assert all(a > b for a, b in zip(speeds, speeds[1:]))
    assert speeds[0] == pytest.approx(cm.predict(placement_all_gpu(inv)).decode_tps)
    assert speeds[-1] == pytest.approx(cm.predict(placement_cpu_moe(inv)).decode_tps)
    pre = [cm.predict(placement_n_cpu_moe(inv, n)).prefill_tps for n in (0, 6)]
    assert pre[0] > pre[1]


def test_hot_experts_on_gpu_beat_cold_ones():
    inv = synth_inventory(4, 32, hidden=512, expert_ffn=256, top_k=4)
    stats = _skewed_stats(inv)
    cm = CostModel(inv, desktop_profile(), stats)
    hot, cold = Placement(default=CPU_COMPUTE), Placement(default=CPU_COMPUTE)
    for u in inv.units:
        if u.kind != "expert":
            hot.set(u, ON_GPU0)
            cold.set(u, ON_GPU0)
    for layer in range(4):
        order = stats.hottest(layer)
        hot.move([UnitKey(layer, "expert", int(e)) for e in order[:8]], ON_GPU0)
        cold.move([UnitKey(layer, "expert", int(e)) for e in order[-8:]], ON_GPU0)
    assert cm.predict(hot).decode_tps > 1.3 * cm.predict(cold).decode_tps
    assert cm.predict(hot).gpu_share > cm.predict(cold).gpu_share


def test_stats_of_another_shape_are_refused():
    inv = synth_inventory(4, 8)
    with pytest.raises(ValueError, match="do not fit"):
        CostModel(inv, h200_profile(), ExpertStats(4, 16, 2))


def test_cpu_rate_lookup():
    hw = h200_profile()
    assert cpu_rate(hw, "BF16") == 50e9
    assert cpu_rate(hw, "F16") == 50e9
    assert cpu_rate(hw, "Q8_0") == 44e9
    assert cpu_rate(hw, "Q4_K") == 36e9
    assert cpu_rate(hw, "MXFP4") == 36e9
    assert cpu_rate(desktop_profile(), "Q4_K") == 20e9  # falls back to bf16


def _simulate_lru(q, slots, tokens, rng):
    """Token-level LRU as the engine runs it: a step's selected experts are looked up against the cache
    as it was before the step, then all of them become most recent; the least recent are evicted."""
    cache: list[int] = []
    hits = reqs = 0
    for _ in range(tokens):
        req = list(np.flatnonzero(rng.random(q.size) < q))
        reqs += len(req)
        hits += sum(e in cache for e in req)
        cache = ([c for c in cache if c not in req] + req)[-slots:]
    return hits / reqs


def test_lru_hit_rate_matches_simulation():
    rng = np.random.default_rng(1)
    for slots, alpha in ((4, 0.3), (8, 1.0), (16, 0.3), (32, 0.5)):
        q = np.minimum(1, 4 * rng.dirichlet(np.full(64, alpha)))
        h = lru_hit_probs(q[None, :], slots)[0]
        predicted = (q * h).sum() / q.sum()
        measured = _simulate_lru(q, slots, 3000, rng)
        assert predicted == pytest.approx(measured, abs=0.04), (slots, alpha)
    assert np.all(lru_hit_probs(np.array([[0.5, 0.5, 0.0]]), 2) == [[1, 1, 0]])
    assert np.all(lru_hit_probs(np.array([[0.5, 0.5]]), 0) == 0)


def test_streaming_cost_falls_with_slots():
    inv = synth_inventory(2, 16, hidden=512, expert_ffn=256)
    stats = _skewed_stats(inv, alpha=0.3)
    cm = CostModel(inv, h200_profile(), stats)
    base = Placement()
    base.move(inv.expert_keys(), CPU_STREAM)
    times = []
    for slots in (1, 4, 12, 16):
        base.stream_slots = slots
        pred = cm.predict(base)
        times.append(pred.decode_s)
        assert all(0 <= c.stream_hit_rate <= 1 for c in pred.decode_layers)
    assert times == sorted(times, reverse=True)
    assert pred.decode_layers[0].stream_hit_rate == 1.0


def test_prefill_fetches_busy_experts_and_computes_rare_ones():
    inv = synth_inventory(1, 8, hidden=1024, expert_ffn=512, top_k=2)
    cm = CostModel(inv, h200_profile())
    p = placement_cpu_moe(inv)
    short = cm.predict(p, prompt_tokens=2).prefill_layers[0]  # one token per expert: the CPU and the bus
    assert short.cpu > 0 and short.bus > 0
    p_stream = Placement(stream_slots=1)
    p_stream.move(inv.expert_keys(), CPU_STREAM)
    long = cm.predict(p_stream, prompt_tokens=512).prefill_layers[0]
    assert long.bus > 0 and long.cpu == 0  # 128 tokens per expert: cheaper to copy it over pinned memory
    fetched = cm.predict(p, prompt_tokens=512).prefill_layers[0]  # CPU-compute experts, the bus share's rule
    assert fetched.bus > 0 and fetched.cpu == 0
    few = cm.predict(p, prompt_tokens=40).prefill_layers[0]  # 10 tokens per expert: below the rule's 16,
    assert few.bus > 0 and few.cpu > 0  # a GEMM's time on the CPU against a copy: most travel, not all
    cm.engine = dataclasses.replace(cm.engine, bus_share=0.0)  # no bus share: the CPU computes them
    alone = cm.predict(p, prompt_tokens=40).prefill_layers[0]
    assert alone.cpu > 0 and alone.bus == 0


def test_prefill_counts_the_experts_a_prompts_actual_counts_send():
    """The engine sends a CPU-compute expert that 16 or more of a chunk's tokens select, judged on the
    chunk's own counts: at 15 tokens per expert on average some chunks reach 16 and those experts
    travel even where the bus is too slow to take any other; at 5 on average none do."""
    inv = synth_inventory(1, 8, hidden=1024, expert_ffn=512, top_k=2)
    cm = CostModel(inv, h200_profile())
    cm.engine = dataclasses.replace(cm.engine, bus_share=0.01)  # a copy costs 99 reads: only the rule sends
    p = placement_cpu_moe(inv)
    near = cm.predict(p, prompt_tokens=60).prefill_layers[0]  # 60 tokens x 2 / 8 experts: 15 each
    assert near.bus > 0 and near.cpu > 0
    below = cm.predict(p, prompt_tokens=20).prefill_layers[0]  # 5 each
    assert below.bus == 0 and below.cpu > 0


def test_a_prompts_host_time_per_hybrid_layer_counts_once_per_hybrid_layer_and_chunk():
    """``prompt_sync_s`` lengthens each prompt chunk's layers that hold CPU-tier experts by itself, and
    leaves all-resident layers and decode alone."""
    inv = synth_inventory(4, 8, hidden=1024, expert_ffn=512, top_k=2)
    base = h200_profile()
    slow = dataclasses.replace(base, prompt_sync_s=1e-3)
    p = placement_n_cpu_moe(inv, 2)  # two layers' experts on the CPU
    a, b = CostModel(inv, base).predict(p, prompt_tokens=1024), CostModel(inv, slow).predict(p, prompt_tokens=1024)
    assert b.decode_tps == a.decode_tps
    added = [y.total - x.total for x, y in zip(a.prefill_layers, b.prefill_layers)]
    assert added == pytest.approx([1e-3, 1e-3, 0, 0])
    assert 1024 / b.prefill_tps - 1024 / a.prefill_tps == pytest.approx(2 * 2 * 1e-3)  # two chunks of 512


def test_a_prompts_host_time_with_a_cpu_share_counts_where_the_cpu_computes_experts():
    """``prompt_cpu_sync_s`` lengthens a hybrid prompt layer by itself times the chance that the CPU
    computes a share there: each time in a short chunk (every expert picked by a few tokens, the split
    keeps some on the CPU), never in a long one (every expert picked by many: all travel)."""
    inv = synth_inventory(4, 8, hidden=1024, expert_ffn=512, top_k=2)
    base = h200_profile()
    slow = dataclasses.replace(base, prompt_cpu_sync_s=1e-3)
    p = placement_n_cpu_moe(inv, 2)

    def added(tokens: int) -> list[float]:
        a, b = CostModel(inv, base).predict(p, prompt_tokens=tokens), CostModel(inv, slow).predict(p, prompt_tokens=tokens)
        assert b.decode_tps == a.decode_tps
        return [y.total - x.total for x, y in zip(a.prefill_layers, b.prefill_layers)]

    assert added(8) == pytest.approx([1e-3, 1e-3, 0, 0])  # 2 tokens an expert: the CPU keeps the coldest
    assert added(512) == pytest.approx([0, 0, 0, 0])  # 128 tokens an expert: all travel


def test_a_prompt_layer_lasts_at_least_its_host_lane():
    """The engine thread's work for a hybrid prompt layer (``prompt_host_*``) is a lane of its own: a
    fixed cost per hybrid layer, more with a CPU share, and a cost per fetched batch and per copy. A
    layer takes the longer of it and the old sum, and says it is host-bound then. In a long chunk
    every CPU-tier expert travels: 8 bf16 experts a batch, two copies per run of consecutive rows, and
    all of a layer's rows are one run per batch."""
    inv = synth_inventory(4, 32, hidden=1024, expert_ffn=512, top_k=2)
    base = h200_profile()
    p = placement_n_cpu_moe(inv, 2)
    costs = dict(prompt_host_layer_s=1e-3, prompt_host_cpu_s=0.0, prompt_host_batch_s=2e-3, prompt_host_copy_s=1e-4)
    a = CostModel(inv, base).predict(p, prompt_tokens=4096)
    b = CostModel(inv, dataclasses.replace(base, **costs)).predict(p, prompt_tokens=4096)
    lanes = [1e-3 + 4 * 2e-3 + 4 * 2 * 1e-4] * 2 + [0, 0]  # 32 experts: 4 batches, 2 tensors, one run each
    assert [c.host for c in b.prefill_layers] == pytest.approx(lanes)
    for x, y, lane in zip(a.prefill_layers, b.prefill_layers, lanes):
        assert y.total == pytest.approx(max(x.total, lane))
        assert (y.bound == "host") == (lane > x.total)
    assert b.prefill_layers[0].bound == "host" and b.prefill_tps < a.prefill_tps
    assert b.decode_tps == a.decode_tps


def test_a_resident_prompt_layer_lasts_at_least_its_fitted_time():
    """``prompt_resident_layer_s`` bounds a prompt's MoE layers whose experts are all on the GPU, and
    neither its hybrid layers nor decode."""
    inv = synth_inventory(4, 32, hidden=1024, expert_ffn=512, top_k=2)
    base = h200_profile()
    p = placement_n_cpu_moe(inv, 2)  # layers 0 and 1 hybrid, 2 and 3 resident
    a = CostModel(inv, base).predict(p, prompt_tokens=512)
    b = CostModel(inv, dataclasses.replace(base, prompt_resident_layer_s=5e-3)).predict(p, prompt_tokens=512)
    assert [c.host for c in b.prefill_layers] == [0, 0, 5e-3, 5e-3]
    for x, y in zip(a.prefill_layers, b.prefill_layers):
        assert y.total == pytest.approx(max(x.total, y.host))
    assert b.prefill_layers[2].bound == "host" and b.prefill_tps < a.prefill_tps and b.decode_tps == a.decode_tps


def test_a_resident_prompt_layer_takes_the_floor_of_its_experts_format():
    """``prompt_resident_layer_by_format`` bounds a resident prompt layer by its experts' format
    (kept Q8_0 blocks: longer than bf16), and ``prompt_resident_layer_s`` bounds formats it lacks."""
    inv = synth_inventory(4, 32, hidden=1024, expert_ffn=512, top_k=2)
    base = dataclasses.replace(h200_profile(), prompt_resident_layer_s=5e-3)
    p = placement_n_cpu_moe(inv, 2)
    own = CostModel(inv, dataclasses.replace(base, prompt_resident_layer_by_format={"BF16": 7e-3, "q8_0": 9e-3}))
    assert [c.host for c in own.predict(p, prompt_tokens=512).prefill_layers][2:] == [7e-3, 7e-3]
    other = CostModel(inv, dataclasses.replace(base, prompt_resident_layer_by_format={"q8_0": 9e-3}))
    assert [c.host for c in other.predict(p, prompt_tokens=512).prefill_layers][2:] == [5e-3, 5e-3]


def test_a_prompts_cpu_share_takes_longer_by_its_fitted_factor():
    """``prompt_cpu_scale`` lengthens the CPU lane of a hybrid prompt layer where the CPU computes a
    share (a short chunk: each expert picked by a few tokens), and nothing where all travel or in
    decode."""
    inv = synth_inventory(4, 8, hidden=1024, expert_ffn=512, top_k=2)
    base = h200_profile()
    p = placement_n_cpu_moe(inv, 2)

    def lanes(scale: float, tokens: int):  # at the fixed bus share this case was built for (no lane on the RAM floor)
        return CostModel(inv, dataclasses.replace(base, prompt_cpu_scale=scale),
                         engine=EngineShape()).predict(p, prompt_tokens=tokens)

    a, b = lanes(1.0, 8), lanes(2.0, 8)
    assert a.prefill_layers[0].cpu > 0
    assert [y.cpu for y in b.prefill_layers] == pytest.approx([2 * x.cpu for x in a.prefill_layers])
    assert b.decode_tps == a.decode_tps
    assert [c.cpu for c in lanes(2.0, 512).prefill_layers] == [c.cpu for c in lanes(1.0, 512).prefill_layers]


def test_a_prompts_experts_travel_in_batches_by_bytes_as_their_tensors():
    """Batches hold half of ``BUS_SLOTS`` bf16 experts' bytes: 8 bf16 experts, 15 Q8_0 ones (four tensors
    each: values and scales of both matrices), 28 Q4_K ones (two block arrays)."""
    from workbench.core.costmodel import BUS_SLOTS

    got = {}
    for fmt in ("BF16", "Q8_0", "Q4_K"):
        inv = synth_inventory(2, 8, hidden=2048, expert_ffn=768, top_k=2, expert_dtype=fmt)
        got[fmt] = CostModel(inv, h200_profile())._prompt_batch(0, 0)
    assert BUS_SLOTS == 16
    assert got == {"BF16": (8, 2), "Q8_0": (15, 4), "Q4_K": (28, 2)}


def test_predict_is_fast_for_94_layers_by_256_experts():
    inv = synth_inventory(94, 256, hidden=4096, expert_ffn=1536, top_k=8, vocab=151936, n_heads=64, n_kv_heads=4,
                          head_dim=128)
    stats = _skewed_stats(inv)
    t0 = time.perf_counter()
    cm = CostModel(inv, h200_profile(), stats)  # once per model, profile and stats
    built = time.perf_counter() - t0
    p = placement_n_cpu_moe(inv, 47)
    t0 = time.perf_counter()
    pred = cm.predict(p)
    predicted = time.perf_counter() - t0
    t0 = time.perf_counter()
    cm.decode_tps(p)
    dragged = time.perf_counter() - t0
    assert built < 2.0 and predicted < 0.6 and dragged < 0.2, (built, predicted, dragged)
    assert len(pred.decode_layers) == 94 and pred.decode_tps > 0
    assert "decode" in pred.table(per_layer=True)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32 - 1), st.floats(0.05, 3.0), st.integers(1, 8))
def test_moving_an_expert_to_the_gpu_never_slows_a_cpu_bound_layer(seed, alpha, n_moves):
    """CPU -> GPU moves that fit never lower the predicted decode speed while the layer's CPU lane is
    the longest, and emptying a layer of CPU experts never does either. (Where the GPU lane is already
    the longest, the overlap model predicts a slowdown of at most the moved expert's GPU read time:
    the CPU work it removes was hidden.)"""
    rng = np.random.default_rng(seed)
    inv = synth_inventory(3, 8, hidden=256, expert_ffn=128, top_k=2)
    stats = _skewed_stats(inv, seed=seed % 1000, alpha=alpha)
    hw = desktop_profile()
    cm = CostModel(inv, hw, stats)
    p = placement_cpu_moe(inv)
    cpu_keys = list(inv.expert_keys())
    rng.shuffle(cpu_keys)
    before = cm.predict(p)
    for key in cpu_keys[:n_moves]:
        layer = before.decode_layers[key.layer]
        q = p.copy()
        q.set(key, ON_GPU0)
        after = cm.predict(q)
        gpu_read = cm.p_sel[key.layer, key.expert] * cm.expert_bytes[key.layer, key.expert] / hw.gpus[0].mem_bandwidth
        if layer.cpu >= layer.gpu or not any(q.get(k) == CPU_COMPUTE for k in inv.expert_keys(key.layer)):
            assert after.decode_tps >= before.decode_tps * (1 - 1e-12)
        else:
            assert after.decode_s <= before.decode_s + gpu_read + 1e-12
        p, before = q, after
    assert cm.predict(placement_all_gpu(inv)).decode_tps >= before.decode_tps


def test_no_stats_means_uniform_selection():
    inv = synth_inventory(2, 8, top_k=2)
    cm = CostModel(inv, h200_profile())
    assert np.allclose(cm.p_sel, 0.25)
    pred = cm.predict(placement_cpu_moe(inv))
    assert all(c.gpu_share == 0 for c in pred.decode_layers)
    assert not math.isnan(pred.prefill_tps)


def test_layer_curves_agree_with_predict():
    inv = synth_inventory(3, 8, hidden=256, expert_ffn=128, top_k=2, dense_layers=(0,), shared_ffn=64)
    stats = _skewed_stats(inv, seed=3)
    cm = CostModel(inv, desktop_profile(), stats)
    base = placement_cpu_moe(inv)
    order = np.stack([stats.hottest(layer) for layer in range(3)])
    curves, nbytes = cm.layer_curves(base, order, kv_tokens=300)
    for k in (0, 1, 3, 8):
        p = base.copy()
        for layer in inv.spec.moe_layers:
            p.move([UnitKey(layer, "expert", int(e)) for e in order[layer, :k]], ON_GPU0)
        pred = cm.predict(p, prompt_tokens=300)
        for layer in range(3):
            assert curves[layer, k] == pytest.approx(pred.decode_layers[layer].total, rel=1e-12)
        gpu_experts = sum(inv.units[key].nbytes for key in inv.expert_keys() if p.get(key) == ON_GPU0)
        assert nbytes[list(inv.spec.moe_layers), k].sum() == gpu_experts


def test_prefill_choices_follow_the_engine_shape():
    inv = synth_inventory(1, 8, hidden=1024, expert_ffn=512, top_k=2)
    hw = h200_profile()
    p = Placement(stream_slots=1)
    p.move(inv.expert_keys()[:4], CPU_STREAM)
    p.move(inv.expert_keys()[4:], CPU_COMPUTE)
    free = CostModel(inv, hw).predict(p, prompt_tokens=512).prefill_layers[0]
    fixed = CostModel(inv, hw, engine=EngineShape(prefill_fetch_compute=False, prefill_cpu_stream=False))
    today = fixed.predict(p, prompt_tokens=512).prefill_layers[0]
    # the engine of today: compute experts on the CPU, streamed ones over the bus, whatever is cheaper
    eb = inv.units[inv.expert_keys()[0]].nbytes
    used = 1 - (1 - 0.25) ** 512
    assert today.bus == pytest.approx(4 * (eb * used / hw.h2d_pinned + 2 * inv.units[inv.expert_keys()[0]].n_params
                                          * 0.25 * 512 / hw.gpus[0].bf16_flops))
    assert today.cpu > 0
    assert max(free.cpu, free.bus) <= max(today.cpu, today.bus) + 1e-12


def test_roofline_is_a_floor_under_the_prediction():
    inv = synth_inventory(4, 16, hidden=512, expert_ffn=256, top_k=2)
    stats = _skewed_stats(inv, seed=5)
    cm = CostModel(inv, h200_profile(), stats)
    for p in (placement_all_gpu(inv), placement_n_cpu_moe(inv, 2), placement_cpu_moe(inv)):
        roof = cm.roofline(p, kv_tokens=256)
        pred = cm.predict(p, prompt_tokens=256)
        assert max(s for _, s in roof.values()) <= pred.decode_s
        gpu_bytes = roof["gpu:0"][0]
        weights = sum(u.nbytes for k, u in inv.units.items() if k.kind not in ("expert", "embed") and p.get(k).tier == "gpu:0")
        assert gpu_bytes > weights  # plus KV and the expected expert bytes
    all_gpu = cm.roofline(placement_all_gpu(inv))
    expected = float((cm.p_sel * cm.expert_bytes).sum())
    cpu = cm.roofline(placement_cpu_moe(inv))["cpu"][0]
    assert cpu == pytest.approx(expected)
    assert "cpu" not in all_gpu


def test_tied_embeddings_pay_the_output_projection():
    from dataclasses import replace

    inv = synth_inventory(2, 4, vocab=50000)
    untied = CostModel(inv, h200_profile()).predict(Placement())
    tied_inv = synth_inventory(2, 4, vocab=50000)
    del tied_inv.units[UnitKey(None, "lm_head")]
    del tied_inv.tensors["output.weight"]
    tied_inv.spec = replace(tied_inv.spec, tie_word_embeddings=True)
    cm = CostModel(tied_inv, h200_profile())
    tied = cm.predict(Placement())
    assert tied.decode_other_s == pytest.approx(untied.decode_other_s, rel=1e-6)
    assert cm.roofline(Placement())["gpu:0"][0] == pytest.approx(CostModel(inv, h200_profile()).roofline(Placement())["gpu:0"][0])


def test_with_stats_equals_a_fresh_model():
    inv = synth_inventory(3, 8, top_k=2)
    stats = _skewed_stats(inv, seed=9)
    base = CostModel(inv, desktop_profile())
    p = placement_n_cpu_moe(inv, 2)
    assert base.with_stats(stats).predict(p).to_json() == CostModel(inv, desktop_profile(), stats).predict(p).to_json()
    assert base.predict(p).to_json() == CostModel(inv, desktop_profile()).predict(p).to_json()  # base unchanged
    with pytest.raises(ValueError):
        base.with_stats(ExpertStats(3, 9, 2))


def _bus_split(lam, top_k, fraction, slots):
    """Expected selections left to the CPU and sent over the bus, and P(any is sent)."""
    from workbench.core.costmodel import split_counts

    n, pn, m = split_counts(lam, top_k, fraction, slots)
    return (pn * (n - m)).sum(axis=-1), (pn * m).sum(axis=-1), (pn * (m > 0)).sum(axis=-1)


def _cpu_busy(lam, top_k, fraction, slots):
    """P(the token leaves the CPU at least one of its CPU-compute selections)."""
    from workbench.core.costmodel import split_counts

    n, pn, m = split_counts(lam, top_k, fraction, slots)
    return (pn * (n - m > 0)).sum(axis=-1)


def test_bus_split_counts():
    cpu, bus, p_any = _bus_split(np.array([0.0, 100.0]), 8, 0.45, 4)
    assert cpu == pytest.approx([0.0, 4.0]) and bus == pytest.approx([0.0, 4.0]) and p_any == pytest.approx([0.0, 1.0])
    cpu, bus, _ = _bus_split(np.array([2.0]), 8, 0.45, 4)  # n = 1 stays on the CPU, n = 2 sends one, ...
    assert 0 < bus[0] < cpu[0] and cpu[0] + bus[0] == pytest.approx(2.0, abs=1e-3)


@pytest.mark.parametrize("fraction", [0.1, 0.18, 0.25, 0.45, 0.5, 0.6, 0.75, 1.0])
def test_the_bus_takes_the_count_that_ends_the_slower_lane_first(fraction):
    """Of ``n`` CPU-tier selections the bus takes floor(n * fraction) or one more, whichever makes
    the longer of the two lanes shortest (the bus taking (1 - f) / f times the CPU's time per
    expert); never more than ``slots``; none at a share of 0."""
    from workbench.core.costmodel import bus_count

    r = (1 - fraction) / fraction
    for n in range(0, 17):
        m = bus_count(n, fraction, 16)
        assert m in (math.floor(n * fraction), math.floor(n * fraction) + 1) and 0 <= m <= n
        best = min(max(n - j, j * r) for j in range(n + 1))
        assert max(n - m, m * r) == pytest.approx(best)
    assert bus_count(1, 0.5, 4) == 0  # a tie stays with the CPU
    assert bus_count(3, 0.18, 4) == 0  # rounding 0.54 up sent one expert to a lane 4.6 times as slow
    assert bus_count(7, 0.18, 4) == 1
    assert bus_count(8, 0.75, 2) == 2 and bus_count(5, 0.0, 4) == 0
    assert list(bus_count(np.arange(6), 0.45, 8)) == [bus_count(n, 0.45, 8) for n in range(6)]


def test_the_cpu_is_waited_for_when_it_keeps_any_selection():
    lam = np.array([0.0, 0.7, 2.0, 100.0])
    # with a bus share of 0.45, one selection stays on the CPU and two send one: n >= 1 keeps the CPU busy
    # (n binomial over the 8 picks, mean lam)
    assert _cpu_busy(lam, 8, 0.45, 4) == pytest.approx([0.0, 1 - (1 - 0.7 / 8) ** 8, 1 - (1 - 2.0 / 8) ** 8, 1.0])
    # a bus share of 1 sends every selection up to the slots: the CPU keeps those beyond 4
    busy = _cpu_busy(lam, 8, 1.0, 4)
    assert busy[0] == 0 and busy[1] < 1e-3 and busy[3] == pytest.approx(1.0)


def test_the_bus_share_speeds_up_cpu_experts_up_to_the_ram_bound():
    inv = synth_inventory(4, 32, hidden=2048, expert_ffn=768, top_k=8)
    hw = h200_profile()
    p = placement_cpu_moe(inv)
    off = CostModel(inv, hw, engine=EngineShape(bus_share=0.0)).predict(p, ctx=512)
    on = CostModel(inv, hw).predict(p, ctx=512)
    assert on.decode_tps > 1.2 * off.decode_tps
    assert all(c.bus > 0 for c in on.decode_layers) and all(c.bus == 0 for c in off.decode_layers)
    cm = CostModel(inv, hw)
    cpu_bytes = sum(cm.roofline(p)["cpu"][0] for _ in [0])
    expert_bytes = cpu_bytes - sum(nb for k, nb, _ in cm.other_units if p.get(k).tier == "cpu")
    assert sum(c.cpu for c in on.decode_layers) >= expert_bytes / hw.host_read_bandwidth * 0.999


def test_a_served_bus_reads_in_place_and_shares_the_ram_with_the_cpu():
    """Served decode: the bus lane is its experts' bytes at ``bus_read`` of the pinned copy rate (no
    copy-then-compute), and the CPU's and the bus's reads together stay under ``shared_read`` of the
    host's read bandwidth; the host-driven engine copies, then computes on the GPU."""
    inv = synth_inventory(4, 32, hidden=2048, expert_ffn=768, top_k=8)
    hw = h200_profile()
    p = placement_cpu_moe(inv)
    served = CostModel(inv, hw, engine=EngineShape(bus_read=0.5, shared_read=0.5))
    hosted = CostModel(inv, hw, engine=EngineShape(served=False))
    all_bus = CostModel(inv, hw, engine=EngineShape(bus_share=1.0, bus_read=0.5))
    s, h, b = (m.predict(p, ctx=512).decode_layers for m in (served, hosted, all_bus))
    expert_bytes = 8 * 3 * 2048 * 768 * 2  # all eight selections of a layer, bf16
    assert b[0].bus == pytest.approx(expert_bytes / (0.5 * hw.h2d_pinned), rel=0.02)
    assert h[0].bus > expert_bytes / 2 / hw.h2d_pinned  # copies of half of them, then their compute
    assert s[0].cpu >= expert_bytes / (0.5 * hw.host_read_bandwidth) * 0.999
    assert h[0].cpu < s[0].cpu


def test_prefill_fetch_splits_where_the_cpu_and_the_bus_finish_together():
    from workbench.core.costmodel import prefill_fetch

    counts = np.array([1, 1, 1, 1, 3, 40, 2, 1])
    sent = prefill_fetch(counts, fetch_tokens=16, bus_share=0.5)  # a copy costs one read
    assert sent[5]  # 40 tokens: always fetched
    assert not sent[[0, 1, 2, 3]].all() and sent[4]  # the coldest stay, the hottest travel
    cpu, bus = counts[~sent].sum(), sent.sum()
    assert abs(cpu - bus) <= 1
    assert not prefill_fetch(counts, 16, 0.0)[:5].any() and prefill_fetch(counts, 16, 1.0).all()
    assert not prefill_fetch(counts, 10**9, 0.0).any()


def test_a_measured_cost_per_further_token_gives_the_cpu_the_experts_it_computes_in_time():
    """With the fused kernel's cost per further token measured (``prompt_pair_reads``), an expert of
    ``t`` tokens costs the CPU ``1 + (t - 1) * pair`` reads instead of ``t``: the split gives the CPU
    more experts, the GEMM takes over later, and the CPU's share of the prompt's time grows."""
    from workbench.core.costmodel import cpu_prompt_reads, fused_prompt_limit, prefill_fetch

    assert list(cpu_prompt_reads([1, 4, 20])) == [1, 4, 8]  # not measured: a read per token, a GEMM's 8
    assert list(cpu_prompt_reads([1, 4, 20], 0.25)) == [1, 1.75, 5.75]
    assert list(cpu_prompt_reads([1, 4, 20], [np.nan, 0.25, 0.0])) == [1, 1.75, 1]
    assert fused_prompt_limit(None) == 8 and fused_prompt_limit(0.25) == 29 and fused_prompt_limit(0.0) == math.inf
    assert list(cpu_prompt_reads([1, 20], None, gemm=False)) == [1, 20]  # kept blocks: no GEMM to cap it
    assert list(cpu_prompt_reads([20, 20], 0.5, gemm=[True, False])) == [8, 10.5]
    assert fused_prompt_limit(None, gemm=False) == math.inf
    busy = np.full(40, 12)  # unmeasured: 12 reads each on the kernel, 8 where a GEMM may take them
    assert prefill_fetch(busy, 16, 0.5, gemm=False).sum() > prefill_fetch(busy, 16, 0.5).sum()
    counts = np.array([2, 3, 4, 5, 6, 7, 8, 9, 10, 12])
    slow, cheap = prefill_fetch(counts, 16, 0.5), prefill_fetch(counts, 16, 0.5, pair_reads=0.1)
    assert cheap.sum() < slow.sum() and not (cheap & ~slow).any()  # the CPU keeps all it kept, and more
    cpu = cpu_prompt_reads(counts[~cheap], 0.1).sum()
    assert abs(cpu - cheap.sum()) <= cpu_prompt_reads(counts.max(), 0.1)  # the lanes finish together

    inv = synth_inventory(1, 8, hidden=1024, expert_ffn=512, top_k=2)
    p = placement_cpu_moe(inv)
    hw = h200_profile()
    plain = CostModel(inv, hw).predict(p, prompt_tokens=40).prefill_layers[0]
    measured = dataclasses.replace(hw, cpu_prompt_flops={"bf16": 4e12})
    cm = CostModel(inv, measured)
    assert np.allclose(cm.pair_reads[0], prompt_pair_reads(measured, "BF16", 3 * 1024 * 512, 3 * 1024 * 512 * 2))
    fast = cm.predict(p, prompt_tokens=40).prefill_layers[0]
    assert fast.bus < plain.bus  # fewer experts travel: the CPU computes them, each in less time
    assert max(fast.cpu, fast.bus) < max(plain.cpu, plain.bus)


def _all_gpu_at(inv, hw, rated, rate: float):
    """Predictions with every expert resident under ``hw`` and under ``rated`` (whose kept format reads
    at ``rate`` B/s), and the seconds that ``rate`` adds to layer 0's GPU time over ``hw``'s expert
    bandwidth (8 of 32 experts a token)."""
    p = placement_all_gpu(inv)
    base = CostModel(inv, hw).predict(p, ctx=512)
    kept = CostModel(inv, rated).predict(p, ctx=512)
    expert_bytes = sum(u.nbytes for k, u in inv.units.items() if k.kind == "expert" and k.layer == 0) * 8 / 32
    return base, kept, expert_bytes / rate - expert_bytes / hw.gpus[0].expert_bandwidth


def test_experts_kept_in_blocks_read_at_their_formats_gpu_rate():
    """Resident Q8_0 experts go at the GPU's ``expert_throughput["q8_0"]`` when the profile has it (the
    engine's block kernels), else at ``expert_bandwidth``; the JSON keeps the table."""
    from workbench.core.hardware import HardwareProfile

    inv = synth_inventory(4, 32, hidden=2048, expert_ffn=768, top_k=8, expert_dtype="Q8_0")
    hw = h200_profile()
    slow = dataclasses.replace(hw, gpus=(dataclasses.replace(hw.gpus[0], expert_throughput={"q8_0": 0.1e12}),))
    base, kept, extra = _all_gpu_at(inv, hw, slow, 0.1e12)
    assert kept.decode_layers[0].gpu == pytest.approx(base.decode_layers[0].gpu + extra, rel=0.01)
    assert kept.decode_tps < base.decode_tps
    back = HardwareProfile.from_json(slow.to_json())
    assert back.gpus[0].expert_throughput == {"q8_0": 0.1e12} and not back.problems()
    bad = dataclasses.replace(slow, gpus=(dataclasses.replace(hw.gpus[0], expert_throughput={"q4_k": -1.0}),))
    assert any("expert_throughput[q4_k]" in msg for msg in bad.problems())


def test_k_quants_calibration_does_not_time_take_q4_ks_rates():
    """Calibration times Q4_K's kernels, not Q5_K's or Q6_K's (the same super-blocks a few bits
    wider): experts kept in those formats are rated at Q4_K's GPU and CPU rates, bytes for bytes, and
    at their own where a profile has them."""
    inv = synth_inventory(4, 32, hidden=2048, expert_ffn=768, top_k=8, expert_dtype="Q5_K")
    hw = h200_profile()
    table = {"q4_k": 0.2e12}
    rated = dataclasses.replace(hw, gpus=(dataclasses.replace(hw.gpus[0], expert_throughput=table),),
                                cpu_expert_throughput={**hw.cpu_expert_throughput, "q4_k": 30e9})
    assert cpu_rate(rated, "Q5_K") == cpu_rate(rated, "Q6_K") == 30e9
    assert cpu_rate(dataclasses.replace(rated, cpu_expert_throughput={**rated.cpu_expert_throughput,
                                                                       "q5_k": 40e9}), "Q5_K") == 40e9
    base, kept, extra = _all_gpu_at(inv, hw, rated, 0.2e12)
    assert kept.decode_layers[0].gpu == pytest.approx(base.decode_layers[0].gpu + extra, rel=0.01)


def test_decodes_bus_share_balances_the_bus_and_the_cpu_reads():
    """The bus share sends the CPU-selected experts over the bus in the ratio of the two read rates
    (the calibrated in-place rate when measured, else a share of the pinned copy rate), so a host
    with a fast CPU sends fewer; the cost model predicts with that share, and its bus lane runs at
    the measured rate."""
    from workbench.core.costmodel import BUS_READ, BUS_SHARE, balanced_bus_share, bus_rate, model_bus_share

    unmeasured = h200_profile()
    assert bus_rate(unmeasured) == pytest.approx(BUS_READ * unmeasured.h2d_pinned)
    assert balanced_bus_share(unmeasured, "BF16") == BUS_SHARE  # a profile from before the bus was timed
    base = dataclasses.replace(unmeasured, bus_read_rate=48e9)
    cpu = cpu_rate(base, "BF16")
    assert balanced_bus_share(base, "BF16") == pytest.approx(48e9 / (48e9 + cpu))
    fast_cpu = dataclasses.replace(base, cpu_expert_throughput={**base.cpu_expert_throughput, "bf16": 130e9})
    measured = dataclasses.replace(base, bus_read_rate=30e9)
    assert bus_rate(measured) == 30e9
    assert balanced_bus_share(fast_cpu, "BF16") < balanced_bus_share(base, "BF16")
    assert balanced_bus_share(measured, "BF16") == pytest.approx(30e9 / (30e9 + cpu))
    assert balanced_bus_share(dataclasses.replace(base, bus_read_rate=1e13)) == 0.75  # guard rails
    assert balanced_bus_share(dataclasses.replace(base, bus_read_rate=1e6)) == 0.1
    no_bus = dataclasses.replace(unmeasured, h2d_pinned=float("nan"))
    assert bus_rate(no_bus) == 0 and balanced_bus_share(no_bus) == BUS_SHARE
    inv = synth_inventory(4, 32, hidden=1024, expert_ffn=512, top_k=8)
    assert CostModel(inv, measured).engine.bus_share == model_bus_share(inv, measured) == pytest.approx(
        balanced_bus_share(measured, "BF16"))
    p = placement_n_cpu_moe(inv, 2)
    same_share = EngineShape(bus_share=0.45)  # the same split: only the bus lane's rate differs
    slow = CostModel(inv, measured, engine=same_share).predict(p, prompt_tokens=16)
    fast = CostModel(inv, dataclasses.replace(base, bus_read_rate=60e9), engine=same_share).predict(p, prompt_tokens=16)
    assert 1.8 * fast.decode_layers[0].bus < slow.decode_layers[0].bus < 2 * fast.decode_layers[0].bus  # + launches
    assert slow.decode_tps < fast.decode_tps


def test_a_unit_split_shares_each_pair_and_the_model_takes_it_where_it_is_faster():
    """Served decode's unit split: a layer whose tokens give the CPU tier one or two experts is
    faster with each pair's units split between the CPU and the bus than with whole experts (a lone
    expert leaves the bus idle), and the model takes it (``unit_shares``, which ``predict`` assumes);
    no layer takes a split slower than whole experts. ``units_for`` rounds to the experts' blocks,
    and leaves experts whole where a split would leave either side nothing."""
    from workbench.core.costmodel import unit_block, units_for

    assert units_for(768, 0.5, 32) == 384 and units_for(768, 0.6, 256) == 256 and units_for(768, 0.3, 256) == 512
    assert units_for(256, 0.5, 256) == 256 and units_for(768, 0.0, 32) == 768
    assert units_for(64, 0.6, 32) == 32 and units_for(64, 0.9, 32) == 64
    assert unit_block("bf16") == unit_block("q8_0") == 32 and unit_block("q4_k") == unit_block("q6_k") == 256
    inv = synth_inventory(4, 32, hidden=2048, expert_ffn=768, top_k=8)
    hw = dataclasses.replace(h200_profile(), bus_read_rate=50e9)
    p = placement_cpu_moe(inv)
    for layer in (0, 1):  # two layers with a few cold experts on the CPU, two with all of them
        for e in range(28):
            p.set(UnitKey(layer, "expert", e), ON_GPU0)
    whole = CostModel(inv, hw, engine=EngineShape(bus_share=0.4))  # whole experts: the default
    model = CostModel(inv, hw, engine=EngineShape(bus_share=0.4, unit_share=None))
    shares = model.unit_shares(p)
    assert shares[0] > 0 and shares[1] > 0
    split, kept = model.predict(p, ctx=512).decode_layers, whole.predict(p, ctx=512).decode_layers
    assert split[0].total < 0.9 * kept[0].total
    assert all(a.total <= b.total * (1 + 1e-9) for a, b in zip(split, kept))
    assert [c.bus_units for c in split] == pytest.approx(shares.tolist())
    fixed = CostModel(inv, hw, engine=EngineShape(bus_share=0.4, unit_share=0.5)).unit_shares(p)
    assert fixed[0] == 0.5  # a share given: weighed against whole experts alone
    hosted = CostModel(inv, hw, engine=EngineShape(bus_share=0.4, served=False, unit_share=None))
    assert not hosted.unit_shares(p).any()  # the host-driven step copies whole experts


def test_a_unit_split_that_gains_less_than_its_margin_is_not_taken():
    """Where the host's RAM bounds the CPU's and the bus's reads together, a unit split ends a layer
    no sooner than whole experts: the model keeps whole experts unless a split gains ``UNIT_GAIN``."""
    from workbench.core.costmodel import UNIT_GAIN

    inv = synth_inventory(4, 32, hidden=2048, expert_ffn=768, top_k=8)
    fast = dataclasses.replace(h200_profile(), bus_read_rate=50e9)
    slow_ram = dataclasses.replace(fast, host_read_bandwidth=0.5 * cpu_rate(fast, "BF16"))
    p = placement_cpu_moe(inv)
    for layer in range(4):
        for e in range(28):
            p.set(UnitKey(layer, "expert", e), ON_GPU0)
    for hw, split in ((fast, True), (slow_ram, False)):
        model = CostModel(inv, hw, engine=EngineShape(bus_share=0.4, unit_share=None))
        whole = CostModel(inv, hw, engine=EngineShape(bus_share=0.4)).predict(p, ctx=512).decode_layers
        took = model.predict(p, ctx=512).decode_layers
        assert bool(model.unit_shares(p).any()) == split
        if split:
            assert took[0].total < (1 - UNIT_GAIN) * whole[0].total
        else:
            assert [c.total for c in took] == pytest.approx([c.total for c in whole])
