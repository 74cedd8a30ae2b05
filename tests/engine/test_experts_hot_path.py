"""The CUDA-only paths of ``LayerExperts`` (masked decode gather of resident experts before the host
sync, pinned staging buffers, the all-resident decode sum) run here on the CPU by giving the layers a
staging object that says it is CUDA; they must compute what the host paths compute."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.engine.engine_helpers import open_inventory, placements, rel_err
from workbench.engine import Engine, experts

PROMPT = [3, 17, 5, 42, 9, 11, 60, 7, 22, 33, 1, 4]


class CpuStagingAsCuda(experts.HostStaging):
    """HostStaging that takes the CUDA branches of ``LayerExperts.__call__`` with plain CPU copies."""

    def __init__(self, device):
        super().__init__(device)
        self.cuda = True
        self.syncs = 0

    def buffer(self, name, shape, dtype):
        n = int(np.prod(shape))
        buf = self._bufs.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < n:
            buf = torch.empty(n, dtype=dtype)
            self._bufs[name] = buf
        return buf[:n].view(shape)

    def to_host(self, tensors):
        outs = []
        for i, t in enumerate(tensors):
            h = self.buffer(f"in{i}", tuple(t.shape), t.dtype)
            h.copy_(t)
            outs.append(h)
        return outs

    def record(self):
        pass

    def wait(self):
        self.syncs += 1

    def to_device(self, t):
        return t.clone()


def _run(inv, placement) -> tuple[torch.Tensor, list[torch.Tensor], Engine]:
    engine = Engine.load(inv, placement, device="cpu", dtype=torch.float32, max_context=64)
    prompt = engine.forward(torch.tensor(PROMPT), 0)
    steps, tok, pos = [], int(prompt[-1].argmax()), len(PROMPT)
    for _ in range(4):
        logits = engine.forward(torch.tensor([tok]), pos)
        steps.append(logits)
        tok, pos = int(logits[-1].argmax()), pos + 1
    return prompt, steps, engine


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "llama4_text", "gpt_oss"])
def test_cuda_branches_compute_what_the_host_branches_compute(family, tiny_model_dir, monkeypatch):
    """Shared experts (qwen2_moe), input-scaled routing (llama4), expert biases (gpt-oss)."""
    torch.set_num_threads(1)
    inv = open_inventory(tiny_model_dir(family))
    for name in ("mixed", "resident", "compute"):
        p = placements(inv)[name]
        ref_prompt, ref_steps, engine = _run(inv, p)
        engine.close()
        with monkeypatch.context() as m:
            m.setattr(experts, "HostStaging", CpuStagingAsCuda)
            prompt, steps, engine = _run(inv, p)
        try:
            assert rel_err(prompt, ref_prompt) < 1e-5, name
            for got, ref in zip(steps, ref_steps):
                assert rel_err(got, ref) < 1e-5, name
            hybrid = [lx for lx in engine.experts.values() if not lx.all_resident]
            n_calls = 1 + len(steps)  # prompt + decode steps
            # at most one host sync per hybrid layer and forward call; none for all-resident layers
            assert all(lx.staging.syncs == n_calls for lx in hybrid), name
            assert all(lx.staging.syncs == 0 for lx in engine.experts.values() if lx.all_resident), name
        finally:
            engine.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss"])
def test_fused_qkv_attention_equals_separate_projections(family, tiny_model_dir, monkeypatch):
    """On CUDA q/k/v are one projection with one head norm and one RoPE for q and k (qwen3: head
    norms, qwen2: biases, gpt-oss: biases and sinks; olmoe's full-width norm keeps them apart)."""
    from workbench.engine import model

    torch.set_num_threads(1)
    inv = open_inventory(tiny_model_dir(family))
    p = placements(inv)["mixed"]
    ref_prompt, ref_steps, engine = _run(inv, p)
    assert all(layer.attn.fused is None for layer in engine.layers)
    engine.close()
    monkeypatch.setattr(model, "FUSE_QKV", True)
    prompt, steps, engine = _run(inv, p)
    try:
        assert all((layer.attn.fused is None) == (family == "olmoe") for layer in engine.layers)
        assert rel_err(prompt, ref_prompt) < 1e-5
        for got, ref in zip(steps, ref_steps):
            assert rel_err(got, ref) < 1e-5
        for layer in engine.layers:  # q, k, v are views of the fused tensor: no second copy
            if layer.attn.fused is not None:
                w = layer.attn.w
                ptrs = {w[r].untyped_storage().data_ptr() for r in "qkv"}
                assert ptrs == {layer.attn.fused[0].untyped_storage().data_ptr()}
    finally:
        engine.close()
