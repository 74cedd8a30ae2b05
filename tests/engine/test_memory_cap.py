"""A VRAM budget given to the engine caps what PyTorch may reserve on the GPU until the engine
closes, so that the process stays within the budget as NVML counts it (on CUDA; run with
``WORKBENCH_TEST_DEVICE=cuda``). On the CPU there is nothing to cap."""

from __future__ import annotations

import pytest
import torch

from tests.engine.engine_helpers import TEST_DEVICE, TEST_DTYPE
from workbench.core import synth
from workbench.core.memory import CUDA_CONTEXT_BYTES
from workbench.core.readers import open_model
from workbench.engine import Engine

TOKENS = torch.tensor([3, 17, 5, 42, 9, 11])


@pytest.fixture(scope="module")
def inv(tmp_path_factory):
    path = tmp_path_factory.mktemp("cap") / "tiny.gguf"
    synth.write_gguf(path, synth.shape("tiny"), coverage_target=0.5)
    return open_model(path)


def load(inv, **kw):
    return Engine.load(inv, device=TEST_DEVICE, dtype=TEST_DTYPE, max_context=64, **kw)


def test_a_given_budget_caps_what_the_allocator_may_reserve_until_close(inv):
    budget = 2 * 2**30
    engine = load(inv, vram_budget=budget)
    if TEST_DEVICE != "cuda":
        assert engine.memory_cap is None  # the CPU has no allocator to cap
        assert engine.forward(TOKENS, 0).isfinite().all()
        engine.close()
        return
    total = torch.cuda.get_device_properties(0).total_memory
    assert 0 < engine.memory_cap * total <= budget - CUDA_CONTEXT_BYTES
    with pytest.raises(torch.OutOfMemoryError):  # past the cap, though the GPU has room
        torch.empty(budget, dtype=torch.uint8, device="cuda")
    assert engine.forward(TOKENS, 0).isfinite().all()
    engine.close()
    x = torch.empty(budget, dtype=torch.uint8, device="cuda")  # the cap went with the engine
    del x
    plain = load(inv)
    assert plain.memory_cap is None  # no budget given: no cap
    plain.close()


@pytest.mark.skipif(TEST_DEVICE != "cuda", reason="PyTorch's allocator retries exist on CUDA")
def test_a_prompt_that_makes_the_allocator_free_its_cache_at_the_cap_is_warned_once(inv, caplog, monkeypatch):
    engine = load(inv, vram_budget=2 * 2**30)
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.empty_cache()
    room = int(engine.memory_cap * total - torch.cuda.memory_reserved())
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # cached for another stream: the prompt's allocations cannot reuse it
        hog = torch.empty(room - 2**20, dtype=torch.uint8, device="cuda")  # the cap 1 MiB away
        del hog
    torch.cuda.synchronize()
    # The tiny model's prompt fits the free space of segments the allocator already holds, so a
    # prompt of a large model is played by one allocation as large as its activations would be:
    # it needs a new segment, which the cap refuses until the allocator frees the cached hog.
    forward = engine._forward

    def large_prompt(*args, **kwargs):
        out = forward(*args, **kwargs)
        torch.empty(room // 2, dtype=torch.uint8, device="cuda")
        return out

    monkeypatch.setattr(engine, "_forward", large_prompt)
    with caplog.at_level("WARNING"):
        for _ in range(2):
            assert engine.forward(torch.arange(40), 0).isfinite().all()
    assert caplog.text.count("the VRAM budget is tight") == 1
    engine.close()
