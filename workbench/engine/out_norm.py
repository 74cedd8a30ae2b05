"""One token's attention output projection, residual add and the RMS norm after it, in one kernel.

In a decode step the attention's output projection (``o``, 2048 x 4096 at S1's shape) ran as
cuBLAS's split-K product and its reduce (two kernels), then ``gpu_kernels.add_rms_norm`` added the
residual and normed the sum for the MoE block (a third). Here the rows are split in blocks and the
inputs in ``SPLIT`` parts, one program each, so that every SM reads at once; each block's last
program sums its parts in part order, and the last block to finish adds the residual and norms the
whole row. ``out_add_norm`` is what a static decode step calls where the layer allows it.
"""

from __future__ import annotations

import os

import torch

from . import gpu_kernels

triton = gpu_kernels.triton

if triton is not None:
    import triton.language as tl

    _row_dots = gpu_kernels._row_dots
    _after_inputs = gpu_kernels._after_inputs
    _part_done = gpu_kernels._part_done

    def _split(n: int) -> dict:
        return {"SPLIT": n}

    @triton.autotune(configs=gpu_kernels._configs([(16, 256, 4, _split(4)), (8, 256, 4, _split(4)),
                                                   (16, 256, 4, _split(2)), (16, 512, 4, _split(2)),
                                                   (32, 256, 4, _split(4)), (8, 256, 4, _split(8)),
                                                   (16, 128, 4, _split(8)), (4, 512, 4, _split(2))]),
                     key=["N", "K"])
    @triton.jit
    def _out_add_norm_kernel(x_ptr, w_ptr, a_ptr, nw_ptr, part_ptr, cnt_ptr, o_ptr, sum_ptr, norm_ptr, N,
                             K: tl.constexpr, eps, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr = False):
        """``o = w @ x`` (``w [N, K]`` float rows, float32 sums rounded to o's dtype), then
        ``s = a + o`` (rounded to the sum's dtype) and ``rms_norm(s) * nw``. Program ``(b, j)``:
        rows of block ``b`` over part ``j`` of the inputs, into ``part [SPLIT, N]`` (float32);
        ``cnt [blocks + 1]`` (int32, 0 between calls) counts each block's parts, then the blocks."""
        blk = tl.program_id(0)
        j = tl.program_id(1)
        KS: tl.constexpr = ((K + SPLIT - 1) // SPLIT + BLOCK_K - 1) // BLOCK_K * BLOCK_K
        k0 = j * KS
        offs_n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = offs_n < N
        _after_inputs(PDL)
        acc = _row_dots(w_ptr + offs_n.to(tl.int64) * K + k0, w_ptr, x_ptr + k0, tl.minimum(KS, K - k0), nm, 0,
                        False, BLOCK_N, BLOCK_K, False)
        _part_done(acc, j, blk, offs_n, nm, N, part_ptr, cnt_ptr, o_ptr, SPLIT, BLOCK_N, True, a_ptr, nw_ptr, sum_ptr,
                   norm_ptr, eps, BLOCK_H)


def wanted() -> bool:
    """Whether decode steps fuse the output projection with the add and norm after it: only with
    ``WORKBENCH_OUT_NORM=1`` (against cuBLAS's split-K product and ``gpu_kernels.add_rms_norm``,
    8.3 + 1.7 + 1.95 µs per S1 layer on the H100, fifth stop). In the engine's graph on an H100,
    S1 all on the GPU decoded 490.5 tok/s with it against 490.2 without (one run of two repeats each): no
    clear gain."""
    return os.environ.get("WORKBENCH_OUT_NORM", "0") == "1"


MAX_SPLIT = 8
"""Most input parts of any candidate (the parts buffer's rows)."""

_workspaces: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def usable(x: torch.Tensor, w, residual: torch.Tensor, norm_w: torch.Tensor | None) -> bool:
    """Whether ``out_add_norm`` takes these: one token, the kernels on, ``w`` a contiguous float
    matrix in x's dtype on x's device, a residual ``[1, N]`` and a norm weight ``[N]`` of that dtype."""
    return (isinstance(w, torch.Tensor) and gpu_kernels.usable(x) and x.dim() == 2 and x.shape[0] == 1
            and w.dim() == 2 and w.dtype == x.dtype and w.device == x.device and w.is_contiguous()
            and x.is_contiguous() and residual.shape == (1, w.shape[0]) and residual.dtype == x.dtype
            and residual.is_contiguous() and norm_w is not None and norm_w.shape == (w.shape[0],)
            and norm_w.dtype == x.dtype)


def _workspace(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Parts ``[MAX_SPLIT, N]`` float32, counts ``[N + 1]`` int32 (0 between calls) and the product
    ``[N]`` (w's dtype), one set per matrix, made at its first call (eager, before any graph capture)."""
    key = (w.data_ptr(), w.device, w.shape[0], w.dtype)  # a later matrix at a freed one's address: its own
    ws = _workspaces.get(key)
    if ws is None:
        n = w.shape[0]
        ws = _workspaces[key] = (torch.empty((MAX_SPLIT, n), dtype=torch.float32, device=w.device),
                                 torch.zeros(n + 1, dtype=torch.int32, device=w.device),
                                 torch.empty(n, dtype=w.dtype, device=w.device))
    return ws


def out_add_norm(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, norm_w: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = residual + x @ w.T`` and ``rms_norm(h) * norm_w`` for one token: ``x [1, K]``,
    ``w [N, K]``, ``residual [1, N]``, ``norm_w [N]`` -> ``(h, hn)``, both ``[1, N]`` in x's dtype,
    rounded as ``F.linear`` then ``gpu_kernels.add_rms_norm`` round them. The first call per shape
    checks the kernel's autotuning candidates against PyTorch (``kernel_check``; eager); later calls
    capturable in a CUDA graph."""
    n, k = w.shape
    part, cnt, o = _workspace(w)

    def launch(x=x, residual=residual):
        h = torch.empty_like(residual)
        hn = torch.empty_like(residual)
        _out_add_norm_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT"])](
            x, w, residual, norm_w, part, cnt, o, h, hn, n, k, float(eps), BLOCK_H=triton.next_power_of_2(n),
            **gpu_kernels.pdl_args())
        return h, hn

    def probe():  # a random token and residual, against PyTorch
        g = torch.Generator(device=x.device).manual_seed(0)
        xc = torch.randn(x.shape, generator=g, device=x.device).to(x.dtype)
        rc = torch.randn(residual.shape, generator=g, device=x.device).to(x.dtype)
        h = (rc.float() + (xc.float() @ w.float().T).to(x.dtype).float()).to(x.dtype).float()
        hn = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * norm_w.float()
        return (lambda: torch.cat(launch(xc, rc), dim=-1)), torch.cat([h, hn], dim=-1)

    return gpu_kernels.run_checked([_out_add_norm_kernel], launch, ("out_add_norm", n, k, x.dtype), probe)
