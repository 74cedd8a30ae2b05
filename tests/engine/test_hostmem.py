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
