"""The CPU tier's stacks on transparent huge pages (``hostmem``)."""

import gc
import mmap
from pathlib import Path

import pytest
import torch

from workbench.engine import hostmem
from workbench.engine.experts import COMPUTE, RESIDENT, LayerExperts

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
needs_thp = pytest.mark.skipif(
    not hasattr(mmap, "MADV_HUGEPAGE") or not THP.exists() or "[never]" in THP.read_text(),
    reason="transparent huge pages are off or missing here")


@needs_thp
def test_large_stacks_are_aligned_advised_and_freed():
    t = hostmem.empty((3, 1536, 1024), torch.bfloat16)  # 9 MiB
    assert t.shape == (3, 1536, 1024) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % hostmem.HUGE_PAGE == 0
    assert hostmem.advised(t) and hostmem.owns(t)
    t.copy_(torch.arange(t.numel(), dtype=torch.float32).reshape(t.shape))
    assert t[2, 1535, 1023].item() == float(torch.tensor(t.numel() - 1.0).to(torch.bfloat16))
    address = t.data_ptr()
    del t
    gc.collect()
    assert not hostmem._smaps_entry(address)  # unmapped with the tensor
    assert address not in hostmem._live


@needs_thp
def test_small_tensors_and_the_switch_use_torchs_allocator(monkeypatch):
    assert not hostmem.owns(hostmem.empty((16, 16), torch.float32))
    assert hostmem.owns(hostmem.empty((4, 2**20), torch.float32))
    monkeypatch.setenv("WORKBENCH_HUGE_PAGES", "0")
    assert not hostmem.owns(hostmem.empty((4, 2**20), torch.float32))


@needs_thp
@pytest.mark.parametrize("kept", [None, ("q8_0", "q8_0"), ("q4_k", "q6_k")])
def test_the_cpu_tiers_stacks_are_advised_the_resident_ones_not(kept):
    lx = LayerExperts(0, 8, torch.device("cpu"), torch.bfloat16, None)
    for tier in (COMPUTE, RESIDENT):
        if kept is None:
            lx.alloc_tier(tier, 4, (1536, 1024), (1024, 768))
        else:
            lx.alloc_kept(kept, tier, 4, (1536, 1024), (1024, 768))
    cpu = lx.kept_cpu if kept else [lx.w13[COMPUTE], lx.w2[COMPUTE]]
    res = lx.kept_res if kept else [lx.w13[RESIDENT], lx.w2[RESIDENT]]
    big = [t for t in cpu if t.numel() * t.element_size() >= hostmem.HUGE_PAGE]
    assert big and all(hostmem.owns(t) and hostmem.advised(t) for t in big)
    assert not any(hostmem.owns(t) for t in res)


@needs_thp
def test_the_bench_reports_the_cpu_tiers_share_on_huge_pages():
    """``bench.huge_page_share``: the CPU tier's stack bytes the OS backs with huge pages, over all
    of them (a run's ``engine_paths["cpu_huge_pages"]``); None without a CPU tier."""
    from types import SimpleNamespace

    from workbench.engine.bench import huge_page_share

    lx = LayerExperts(0, 8, torch.device("cpu"), torch.bfloat16, None)
    lx.alloc_tier(COMPUTE, 4, (1536, 1024), (1024, 768))  # 12 MiB and 6 MiB: mappings of their own
    lx.alloc_tier(RESIDENT, 4, (1536, 1024), (1024, 768))
    plain = LayerExperts(1, 8, torch.device("cpu"), torch.bfloat16, None)
    plain.alloc_tier(RESIDENT, 8, (1536, 1024), (1024, 768))
    assert huge_page_share(SimpleNamespace(experts={1: plain})) is None
    untouched = huge_page_share(SimpleNamespace(experts={0: lx, 1: plain}))
    for t in lx.cpu_stacks():
        t.fill_(1.0)  # first touch: the kernel backs the advised mapping now
    stacks = lx.cpu_stacks()
    total = sum(t.numel() * t.element_size() for t in stacks)
    share = huge_page_share(SimpleNamespace(experts={0: lx, 1: plain}))
    assert untouched == 0.0 and 0.0 <= share <= 1.0
    assert share == pytest.approx(sum(min(hostmem.huge_bytes(t), t.numel() * t.element_size()) for t in stacks) / total)


def test_numa_maps_lines_give_each_mappings_bytes_by_node():
    text = ("7f0000000000 default anon=1024 dirty=1024 active=0 N0=512 N1=512 kernelpagesize_kB=4\n"
            "7f4000000000 bind:1 anon=8 dirty=8 N1=8 kernelpagesize_kB=2048\n"
            "55d261aa2000 default file=/usr/bin/head mapped=2 N0=2 kernelpagesize_kB=4\n"
            "7fff00000000 default stack anon=3 dirty=3 N0=3\n"  # no page size: 4 KiB
            "not a mapping line\n")
    nodes = hostmem.parse_numa_maps(text)
    assert nodes[0x7f0000000000] == {0: 512 * 4096, 1: 512 * 4096}
    assert nodes[0x7f4000000000] == {1: 8 * 2 * 2**20}
    assert nodes[0x7fff00000000] == {0: 3 * 4096} and len(nodes) == 4


@pytest.mark.skipif(not Path("/proc/self/numa_maps").exists(), reason="no /proc/self/numa_maps here")
def test_the_bench_reports_the_cpu_tiers_bytes_by_numa_node():
    """``bench.numa_shares``: the CPU tier's stack bytes by node once the loader has touched them (a
    run's ``engine_paths["cpu_numa"]``); the shares add up to 1 and name only nodes online."""
    from types import SimpleNamespace

    from workbench.engine.bench import _count_nodes, numa_shares

    lx = LayerExperts(0, 8, torch.device("cpu"), torch.bfloat16, None)
    lx.alloc_tier(COMPUTE, 4, (1536, 1024), (1024, 768))
    for t in lx.cpu_stacks():
        t.fill_(1.0)
    placed = hostmem.node_bytes_each(lx.cpu_stacks())
    for t, nodes in zip(lx.cpu_stacks(), placed):
        assert sum(nodes.values()) >= t.numel() * t.element_size()  # every page touched is placed somewhere
    shares = numa_shares(SimpleNamespace(experts={0: lx}))
    online = _count_nodes(Path("/sys/devices/system/node/online").read_text())
    assert shares["nodes"] == online >= 1
    named = {k: v for k, v in shares.items() if k != "nodes"}
    assert sum(named.values()) == pytest.approx(1.0, abs=1e-3) and all(int(k[1:]) < 64 for k in named)
    plain = LayerExperts(1, 8, torch.device("cpu"), torch.bfloat16, None)
    plain.alloc_tier(RESIDENT, 8, (1536, 1024), (1024, 768))
    assert numa_shares(SimpleNamespace(experts={1: plain})) is None
    assert _count_nodes("0-1,3\n") == 3 and _count_nodes("0") == 1


def test_a_stack_with_no_pages_placed_counts_for_no_node(monkeypatch):
    """A mapping that numa_maps lists without pages on any node adds nothing (and divides by nothing)."""
    from types import SimpleNamespace

    from workbench.engine.bench import numa_shares

    lx = LayerExperts(0, 8, torch.device("cpu"), torch.bfloat16, None)
    lx.alloc_tier(COMPUTE, 4, (1536, 1024), (1024, 768))
    monkeypatch.setattr(hostmem, "node_bytes_each", lambda ts: [{0: 0} for _ in ts])
    assert numa_shares(SimpleNamespace(experts={0: lx})) is None
    monkeypatch.setattr(hostmem, "node_bytes_each", lambda ts: [{0: 0}] + [{1: 4096} for _ in ts[1:]])
    assert numa_shares(SimpleNamespace(experts={0: lx}))["N1"] == 1.0
