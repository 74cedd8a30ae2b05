"""The one-kernel attention input of a static decode step (``gpu_kernels.qkv_rope_cache``: head
norm, RoPE, KV cache write), the flash-decoding attention (``gpu_kernels.decode_attention``) and the
residual adds fused with the next norm (``gpu_kernels.add_rms_norm``) give
transformers' greedy tokens for the families that take it (plain
and ring caches). On CUDA the engine uses it in its decode graphs; here it runs in Triton's
interpreter, with q/k/v fused as on CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.engine.engine_helpers import (
    N_NEW,
    PROMPT,
    TEST_DTYPE,
    decode_step_engine,
    greedy_tokens,
    open_inventory,
    placements,
    reference_tokens,
)
from workbench.engine import gpu_kernels, model, out_norm

pytestmark = pytest.mark.skipif(not gpu_kernels.available(), reason="needs Triton and CUDA (or TRITON_INTERPRET=1)")


def spy(monkeypatch, module, name: str, when=lambda args, kwargs: True) -> list:
    """The calls of ``module.name`` from now on for which ``when(args, kwargs)`` holds (each still
    made): one entry per call."""
    calls, real = [], getattr(module, name)

    def counted(*args, **kwargs):
        if when(args, kwargs):
            calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def decoded(tiny_model_dir, family: str, placement: str) -> list[int]:
    """Greedy tokens of the family's tiny model decoded by static steps under one of ``placements``."""
    inv = open_inventory(tiny_model_dir(family))
    engine = decode_step_engine(inv, placements(inv)[placement])
    try:
        return greedy_tokens(engine, PROMPT, N_NEW)
    finally:
        engine.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss"])
def test_static_decode_with_one_kernel_attention_inputs(family, tiny_model_dir, tiny_hf_model, monkeypatch):
    monkeypatch.setattr(model, "FUSE_QKV", True)
    monkeypatch.setenv("WORKBENCH_OUT_NORM", "1")  # off unless asked for
    calls = spy(monkeypatch, gpu_kernels, "qkv_rope_cache")
    attn_calls = spy(monkeypatch, gpu_kernels, "decode_attention")
    norm_calls = spy(monkeypatch, gpu_kernels, "add_rms_norm")
    out_calls = spy(monkeypatch, out_norm, "out_add_norm")
    tokens = decoded(tiny_model_dir, family, "mixed")
    assert calls  # the kernel ran
    assert norm_calls  # residual adds fused with the next norm
    if family == "qwen3_moe":  # full attention: the flash-decoding kernels too (gpt-oss's sinks and windows: not)
        assert attn_calls
        assert out_calls  # and the output projection, residual add and norm in one kernel
    if TEST_DTYPE == torch.float32:
        assert tokens == reference_tokens(tiny_hf_model(family), PROMPT, N_NEW)


@pytest.mark.parametrize("kernel", ["_route_kernel", "_router_route_kernel", "_add_norm_kernel"])
def test_a_kernel_that_fails_turns_the_kernels_off_and_the_step_still_runs(kernel, tiny_model_dir, tiny_hf_model,
                                                                            monkeypatch):
    """A Triton kernel that does not build on some GPU must not cost the user the decode step. A
    routing kernel's failure (as the unrolled picks' on the GPU's Triton) turns only the routing
    kernels off: PyTorch routes, the attention's kernels stay on."""
    monkeypatch.setattr(gpu_kernels, "_disabled", [])
    monkeypatch.setattr(gpu_kernels, "_routing_off", [])
    monkeypatch.setattr(model, "FUSE_QKV", True)
    monkeypatch.setenv("WORKBENCH_FUSED_ROUTING", "1" if kernel == "_router_route_kernel" else "0")

    class Broken:
        configs: list = []  # an autotuned kernel's candidates, as kernel_check reads them
        cache: dict = {}

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise RuntimeError("PassManager::run failed")
            return launch

    monkeypatch.setattr(gpu_kernels, kernel, Broken())
    attn_calls = spy(monkeypatch, gpu_kernels, "decode_attention")
    tokens = decoded(tiny_model_dir, "qwen3_moe", "mixed")
    if kernel == "_add_norm_kernel":
        assert not gpu_kernels.available() and "PassManager" in gpu_kernels._disabled[0]
    else:
        assert gpu_kernels.available() and "PassManager" in gpu_kernels._routing_off[0] and attn_calls
    if TEST_DTYPE == torch.float32:
        assert tokens == reference_tokens(tiny_hf_model("qwen3_moe"), PROMPT, N_NEW)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_the_trial_fusions_decode_as_transformers(family, tiny_model_dir, tiny_hf_model, monkeypatch):
    """The output projection with the add and norm after it (in trial, off unless asked for) and the
    router with its routing (the default). Every expert resident (the test above decodes a mixed
    placement). gpt-oss takes neither: its router has a bias, its attention sinks."""
    for var in ("WORKBENCH_OUT_NORM", "WORKBENCH_FUSED_ROUTING"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setattr(model, "FUSE_QKV", True)
    out_calls = spy(monkeypatch, out_norm, "out_add_norm")
    route_calls = spy(monkeypatch, gpu_kernels, "router_route")
    tokens = decoded(tiny_model_dir, family, "resident")
    assert route_calls
    if family == "qwen3_moe":  # full attention, where the flash-decoding kernels run (as above)
        assert out_calls
    if TEST_DTYPE == torch.float32:
        assert tokens == reference_tokens(tiny_hf_model(family), PROMPT, N_NEW)
