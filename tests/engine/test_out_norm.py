"""The attention's output projection, residual add and RMS norm of one token in one kernel
(``out_norm``), against PyTorch; on CUDA or under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workbench.engine import gpu_kernels, out_norm

pytestmark = pytest.mark.skipif(not gpu_kernels.available(), reason="needs Triton and CUDA (or TRITON_INTERPRET=1)")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,K", [(64, 128), (200, 72), (96, 1100)])
def test_the_output_projection_add_and_norm_match_torch_call_after_call(dtype, N, K):
    """Row blocks and input parts that do not divide the shape; the counts the kernel keeps go back
    to 0, so each call (another token and residual) is right."""
    g = torch.Generator(device=DEV).manual_seed(N + K)
    w = (torch.randn(N, K, device=DEV, generator=g) / K ** 0.5).to(dtype)
    nw = (torch.rand(N, device=DEV, generator=g) + 0.5).to(dtype)
    for call in range(3):
        x = torch.randn(1, K, device=DEV, generator=g).to(dtype)
        r = torch.randn(1, N, device=DEV, generator=g).to(dtype)
        assert out_norm.usable(x, w, r, nw)
        h, hn = out_norm.out_add_norm(x, w, r, nw, 1e-6)
        ref_h = (r.float() + F.linear(x.float(), w.float()).to(dtype).float()).to(dtype)
        ref_hn = (ref_h.float() * torch.rsqrt(ref_h.float().pow(2).mean(-1, keepdim=True) + 1e-6) * nw.float())
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert h.dtype == dtype and h.shape == (1, N)
        assert torch.allclose(h.float(), ref_h.float(), rtol=tol, atol=tol), call
        assert torch.allclose(hn.float(), ref_hn, rtol=tol, atol=tol), call


def test_what_the_fused_kernel_does_not_take_goes_the_separate_way():
    x = torch.randn(1, 64, device=DEV)
    w = torch.randn(32, 64, device=DEV)
    r = torch.randn(1, 32, device=DEV)
    nw = torch.ones(32, device=DEV)
    assert out_norm.usable(x, w, r, nw)
    assert not out_norm.usable(torch.randn(2, 64, device=DEV), w, r, nw)  # a prompt
    assert not out_norm.usable(x, w.to(torch.bfloat16), r, nw)  # another dtype
    assert not out_norm.usable(x, torch.randn(64, 32, device=DEV).t(), r, nw)  # not contiguous
    assert not out_norm.usable(x, w, r, None)  # no plain norm weight
