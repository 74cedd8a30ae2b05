"""The Triton one-token expert kernels compute the SwiGLU experts they select, and read nothing for
pairs marked inactive (checked on CUDA only: ``WORKBENCH_TEST_DEVICE=cuda`` on the GPU machine)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workbench.engine import gpu_kernels

pytestmark = pytest.mark.skipif(not gpu_kernels.available(), reason="needs CUDA and Triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,I,E,k", [(64, 32, 6, 2), (2048, 768, 16, 8), (200, 72, 5, 3)])
def test_experts_one_token_match_float64(dtype, H, I, E, k):
    g = torch.Generator(device="cuda").manual_seed(H + k)
    w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=g) / H ** 0.5).to(dtype)
    w2 = (torch.randn(E, H, I, device="cuda", generator=g) / I ** 0.5).to(dtype)
    x = torch.randn(1, H, device="cuda", generator=g).to(dtype)
    rows = torch.randint(0, E, (k,), device="cuda", generator=g)
    scale = torch.rand(k, device="cuda", generator=g).to(dtype)
    scale[0] = 0  # an inactive pair (an expert on another tier) adds nothing
    out = gpu_kernels.experts_one_token(x, rows, scale, w13, w2)
    ref = torch.zeros(1, H, dtype=torch.float64, device="cuda")
    for r, s in zip(rows.tolist(), scale.double().tolist()):
        h = x.double() @ w13[r].double().T
        ref += s * ((F.silu(h[:, :I]) * h[:, I:]) @ w2[r].double().T)
    assert out.dtype == dtype and out.shape == (1, H)
    err = float((out.double() - ref).abs().max() / ref.abs().max())
    assert err < (1e-5 if dtype == torch.float32 else 1e-2)
