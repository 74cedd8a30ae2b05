"""The grouped prefill kernels (``prefill_kernels``): every expert of a layer in two kernels gives
what one matrix product per expert gives. Here under Triton's interpreter; on CUDA with
``WORKBENCH_TEST_DEVICE=cuda``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.engine.engine_helpers import TEST_DEVICE
from workbench.engine import prefill_kernels
from workbench.engine.experts import expert_ffn, grouped

pytestmark = pytest.mark.skipif(not prefill_kernels.available(), reason="needs Triton and CUDA (or TRITON_INTERPRET=1)")


def test_tile_table_cuts_runs_into_block_sized_pieces():
    bm = prefill_kernels.BLOCK_M
    starts = np.array([0, 5, 5 + 2 * bm + 3])
    counts = np.array([5, 2 * bm + 3, 1])
    tiles = prefill_kernels.tile_table(starts, counts, np.array([7, 2, 9]))
    assert tiles.tolist() == [[7, 0, 5], [2, 5, bm], [2, 5 + bm, bm], [2, 5 + 2 * bm, 3], [9, 5 + 2 * bm + 3, 1]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_kernels_match_one_product_per_expert(dtype):
    if dtype == torch.bfloat16 and TEST_DEVICE == "cpu":
        pytest.skip("the interpreter's bf16 is not the GPU's; float32 here")
    g = torch.Generator().manual_seed(0)
    E, H, F = 6, 96, 80  # not multiples of the blocks: masked edges
    w13 = (torch.randn(E, 2 * F, H, generator=g) / H ** 0.5).to(dtype).to(TEST_DEVICE)
    w2 = (torch.randn(E, H, F, generator=g) / F ** 0.5).to(dtype).to(TEST_DEVICE)
    counts = np.array([0, 1, 70, 33, 0, 5])  # one expert over two tiles, empty ones skipped
    rows = np.repeat(np.arange(E), counts)
    xs = torch.randn(len(rows), H, generator=g).to(dtype).to(TEST_DEVICE)
    used = np.nonzero(counts)[0]
    tiles = prefill_kernels.tile_table((np.cumsum(counts) - counts)[used], counts[used], used)
    got = prefill_kernels.swiglu_grouped(xs, tiles, w13, w2)
    ref = torch.cat([expert_ffn(xs[rows == r].float(), w13[r].float(), w2[r].float()) for r in used])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert float((got.float() - ref).abs().max() / ref.abs().max()) < tol


def test_grouped_uses_the_kernels_for_many_pairs_and_matches_the_loop(monkeypatch):
    g = torch.Generator().manual_seed(1)
    E, H, F, n = 8, 64, 48, 300  # more pairs than the gather path takes
    w13 = torch.randn(E, 2 * F, H, generator=g).to(TEST_DEVICE)
    w2 = torch.randn(E, H, F, generator=g).to(TEST_DEVICE)
    x = torch.randn(n, H, generator=g).to(TEST_DEVICE)
    rows = torch.randint(0, E, (n,), generator=g).to(TEST_DEVICE)
    scale = torch.rand(n, generator=g).to(TEST_DEVICE)
    calls = []
    real = prefill_kernels.swiglu_grouped
    monkeypatch.setattr(prefill_kernels, "swiglu_grouped", lambda *a: calls.append(1) or real(*a))
    got = grouped(x, rows, scale, w13, w2, scale_input=False)
    assert calls
    monkeypatch.setattr(prefill_kernels, "_disabled", ["off for the reference"])
    ref = grouped(x, rows, scale, w13, w2, scale_input=False)
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5


def test_a_failing_kernel_turns_the_kernels_off_and_the_loop_answers(monkeypatch):
    monkeypatch.setattr(prefill_kernels, "_disabled", [])

    def broken(*a, **k):
        raise prefill_kernels.triton.CompilationError("x.py", None, "no such instruction")

    monkeypatch.setattr(prefill_kernels._grouped_kernel, "run", broken)
    E, H, F, n = 4, 32, 32, 200
    w13, w2 = torch.randn(E, 2 * F, H).to(TEST_DEVICE), torch.randn(E, H, F).to(TEST_DEVICE)
    x, rows = torch.randn(n, H).to(TEST_DEVICE), torch.randint(0, E, (n,)).to(TEST_DEVICE)
    scale = torch.ones(n).to(TEST_DEVICE)
    out = grouped(x, rows, scale, w13, w2, scale_input=False)
    assert not prefill_kernels.available() and out.shape == (n, H)
    ref = torch.stack([expert_ffn(x[j:j + 1], w13[r], w2[r])[0] for j, r in enumerate(rows.tolist())])
    assert float((out - ref).abs().max() / ref.abs().max()) < 1e-5
