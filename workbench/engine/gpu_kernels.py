"""Triton kernels for one-token routed experts on CUDA: each selected expert's rows read once, in place.

At batch 1 the resident experts of a layer are ``k`` matrix-vector products over ``k`` rows of the
stacked weights. Gathering those rows first (``w13[rows]``) copies ~75 MB per layer at the
Qwen3-30B-A3B shape and reads it again; ``expert_gemv`` reads each selected row where it lies, and
pairs whose weight is zero (experts not resident on this step's tier) read nothing at all.

``available()`` is False without Triton or CUDA; the engine then keeps the gather path.
"""

from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger(__name__)

try:  # Triton ships with PyTorch's CUDA wheels; a CPU-only install has none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


@functools.cache
def available() -> bool:
    """Whether the Triton expert kernels can run (Triton importable and CUDA present)."""
    return triton is not None and torch.cuda.is_available()


if triton is not None:

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, rows_ptr, active_ptr, out_ptr, N, K, stride_e, stride_n, x_pair_stride,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pair = tl.program_id(0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row = tl.load(rows_ptr + pair)
        active = tl.load(active_ptr + pair) != 0
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        w_base = w_ptr + row * stride_e + offs_n[:, None] * stride_n
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(x_ptr + pair * x_pair_stride + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
            m = (offs_n[:, None] < N) & (offs_k[None, :] < K) & active
            w = tl.load(w_base + offs_k[None, :], mask=m, other=0.0)
            acc += tl.sum(w.to(tl.float32) * xk[None, :], axis=1)
        tl.store(out_ptr + pair * N + offs_n, acc, mask=offs_n < N)


def expert_gemv(x: torch.Tensor, w: torch.Tensor, rows: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """``out[j] = w[rows[j]] @ x[j]`` for each pair ``j``, in float32; inactive pairs give zeros
    without reading their weights.

    ``x``: ``[n, K]`` (or ``[1, K]``, shared by every pair), any float dtype, contiguous rows.
    ``w``: ``[E, N, K]`` contiguous. ``rows``: ``[n]`` int64 indices into ``E``. ``active``: ``[n]``
    bool. Returns ``[n, N]`` float32. No host sync; capturable in a CUDA graph.
    """
    n = rows.shape[0]
    E, N, K = w.shape
    out = torch.empty((n, N), dtype=torch.float32, device=w.device)
    x_stride = 0 if x.shape[0] == 1 else x.stride(0)
    grid = (n, triton.cdiv(N, 16))
    _gemv_kernel[grid](x, w, rows, active, out, N, K, w.stride(0), w.stride(1), x_stride, BLOCK_N=16, BLOCK_K=256)
    return out


def experts_one_token(x: torch.Tensor, rows: torch.Tensor, scale: torch.Tensor, w13: torch.Tensor,
                      w2: torch.Tensor) -> torch.Tensor:
    """SwiGLU experts of one token: ``x [1, H]``, ``rows``/``scale [k]`` (weight 0: pair skipped)
    -> the weighted sum ``[1, H]`` in ``x.dtype``. ``w13 [E, 2I, H]`` (gate rows first), ``w2 [E, H, I]``."""
    active = scale != 0
    h = expert_gemv(x, w13, rows, active)  # [k, 2I] float32
    i = w2.shape[2]
    a = torch.nn.functional.silu(h[:, :i]) * h[:, i:]  # [k, I]
    y = expert_gemv(a, w2, rows, active)  # [k, H]
    return (y * scale.float()[:, None]).sum(0, keepdim=True).to(x.dtype)
