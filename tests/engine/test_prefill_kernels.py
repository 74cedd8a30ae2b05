"""The grouped prefill kernels (``prefill_kernels``): every expert of a layer in two kernels gives
what one matrix product per expert gives. Here under Triton's interpreter; on CUDA with
``WORKBENCH_TEST_DEVICE=cuda``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.engine.engine_helpers import TEST_DEVICE
from workbench.engine import kernel_check, prefill_kernels
from workbench.engine.experts import GATHER_MAX_ROWS, expert_ffn, grouped, grouped_tokens

pytestmark = pytest.mark.skipif(not prefill_kernels.available(), reason="needs Triton and CUDA (or TRITON_INTERPRET=1)")


def test_tile_table_cuts_runs_into_block_sized_pieces():
    bm = prefill_kernels.BLOCK_M
    starts = np.array([0, 5, 5 + 2 * bm + 3])
    counts = np.array([5, 2 * bm + 3, 1])
    tiles = prefill_kernels.tile_table(starts, counts, np.array([7, 2, 9]))
    assert tiles.tolist() == [[7, 0, 5], [2, 5, bm], [2, 5 + bm, bm], [2, 5 + 2 * bm, 3], [9, 5 + 2 * bm + 3, 1]]


@pytest.mark.parametrize("counts", [[5, 0, 2 * 32 + 3, 1, 0], [0, 0, 7], [32, 64, 1, 31, 33], [1] * 9, [0, 300]])
def test_the_device_tile_table_is_the_host_table_then_empty_tiles(counts):
    """Built from the counts where they lie (no read-back), the table holds the host table's tiles
    first, then empty ones up to the bound of tiles that many pairs can make over that many rows."""
    c = np.array(counts)
    used = np.nonzero(c)[0]
    host = prefill_kernels.tile_table((np.cumsum(c) - c)[used], c[used], used)
    dev = prefill_kernels.device_tile_table(torch.tensor(c, device=TEST_DEVICE), int(c.sum())).cpu().numpy()
    assert dev.dtype == np.int32 and dev.shape == (prefill_kernels.tile_bound(int(c.sum()), len(c)), 3)
    assert dev[:len(host)].tolist() == host.tolist()
    assert (dev[len(host):, 2] == 0).all()


@pytest.mark.parametrize("rows,pairs,seed", [(5, 40, 0), (128, 4096, 1), (256, 16384, 2), (300, 900, 3), (1, 70, 4)])
def test_the_tile_table_kernel_builds_what_pytorchs_operations_build(rows, pairs, seed):
    """One kernel launch, the same table as the ~20 operations it replaces: skewed counts (some rows
    with many tiles, many with none), a row count off the powers of two, one row."""
    g = np.random.default_rng(seed)
    p = g.dirichlet(np.full(rows, 0.3))
    counts = torch.tensor(np.bincount(g.choice(rows, size=pairs, p=p), minlength=rows), device=TEST_DEVICE)
    assert int((counts == 0).sum()) > 0 or rows < 10
    by_kernel = prefill_kernels._tile_table_by_kernel(counts, pairs)
    assert by_kernel.tolist() == prefill_kernels._tile_table_by_torch(counts, pairs).tolist()
    assert prefill_kernels.device_tile_table(counts, pairs).tolist() == by_kernel.tolist()
    assert "table" not in prefill_kernels._off


def test_the_grouped_kernels_skip_the_device_tables_empty_tiles():
    """Over a device table (real tiles, then empty ones), the kernels give each pair its expert's
    output and write nothing for the empty tiles."""
    g = torch.Generator().manual_seed(4)
    E, H, F = 5, 64, 48
    w13 = (torch.randn(E, 2 * F, H, generator=g) / H ** 0.5).to(TEST_DEVICE)
    w2 = (torch.randn(E, H, F, generator=g) / F ** 0.5).to(TEST_DEVICE)
    counts = np.array([2, 0, 40, 1, 3])
    rows = np.repeat(np.arange(E), counts)
    xs = torch.randn(len(rows), H, generator=g).to(TEST_DEVICE)
    tiles = prefill_kernels.device_tile_table(torch.tensor(counts, device=TEST_DEVICE), len(rows))
    assert int((tiles[:, 2] == 0).sum()) > 0  # some padding to skip
    got = prefill_kernels.swiglu_grouped(xs, tiles, w13, w2)
    ref = torch.cat([expert_ffn(xs[rows == r], w13[r], w2[r]) for r in np.nonzero(counts)[0]])
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5


@pytest.mark.skipif(TEST_DEVICE != "cuda", reason="a host sync is a CUDA matter")
def test_many_pairs_on_resident_experts_are_queued_without_a_host_sync():
    """A prompt layer with every expert on the GPU: ``grouped`` builds its tiles on the device and
    never waits on the GPU (after the first call per shape, which checks the kernels)."""
    g = torch.Generator().manual_seed(5)
    E, H, F, n = 16, 64, 48, 400
    w13 = (torch.randn(E, 2 * F, H, generator=g) / H ** 0.5).to(TEST_DEVICE)
    w2 = (torch.randn(E, H, F, generator=g) / F ** 0.5).to(TEST_DEVICE)
    x = torch.randn(n, H, generator=g).to(TEST_DEVICE)
    rows = torch.randint(0, E, (n,), generator=g).to(TEST_DEVICE)
    scale = torch.rand(n, generator=g).to(TEST_DEVICE)
    grouped(x, rows, scale, w13, w2, scale_input=False)  # the first call per shape checks the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = grouped(x, rows, scale, w13, w2, scale_input=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = torch.stack([expert_ffn(x[j:j + 1], w13[r], w2[r])[0] for j, r in enumerate(rows.tolist())]) * scale[:, None]
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-4


def _grouped_case(seed: int, E: int, T: int, k: int, bias: bool):
    g = torch.Generator().manual_seed(seed)
    H, F = 64, 48
    w13 = (torch.randn(E, 2 * F, H, generator=g) / H ** 0.5).to(TEST_DEVICE)
    w2 = (torch.randn(E, H, F, generator=g) / F ** 0.5).to(TEST_DEVICE)
    b13, b2 = ((torch.randn(E, 2 * F, generator=g).to(TEST_DEVICE), torch.randn(E, H, generator=g).to(TEST_DEVICE))
               if bias else (None, None))
    x = torch.randn(T, H, generator=g).to(TEST_DEVICE)
    rows = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).reshape(-1).to(TEST_DEVICE)
    scale = torch.rand(T * k, generator=g).to(TEST_DEVICE)
    return x, rows, scale, w13, w2, b13, b2


@pytest.mark.parametrize("scale_input,bias,T", [(False, False, 60), (True, False, 60), (False, True, 60),
                                                (True, True, 60), (False, False, 3)])
def test_grouped_tokens_sum_what_grouped_gives_each_pair(scale_input, bias, T, monkeypatch):
    """Each token's sum over its pairs, taken straight from the sorted pairs (many pairs), or from
    ``grouped`` over copies of the tokens (a few): what ``grouped`` gives each pair, summed."""
    k = 4
    x, rows, scale, w13, w2, b13, b2 = _grouped_case(6, 10, T, k, bias)
    launches = []
    real = prefill_kernels.swiglu_grouped
    monkeypatch.setattr(prefill_kernels, "swiglu_grouped", lambda *a, **kw: launches.append(kw) or real(*a, **kw))
    got = grouped_tokens(x, k, rows, scale, w13, w2, scale_input, b13, b2)
    # many pairs: the kernels weight each output (unless the input was scaled) and put it in its pair's place
    assert [(kw["dest"] is not None, kw["scale"] is not None) for kw in launches] == (
        [(True, not scale_input)] if T * k > GATHER_MAX_ROWS else [])
    token = torch.arange(T, device=x.device).repeat_interleave(k)
    ref = torch.zeros_like(x).index_add_(0, token, grouped(x[token], rows, scale, w13, w2, scale_input, b13, b2))
    assert got.shape == (T, x.shape[1])
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5


@pytest.mark.skipif(TEST_DEVICE != "cuda", reason="a host sync is a CUDA matter")
def test_a_prompts_tokens_on_resident_experts_are_summed_without_a_host_sync():
    """``grouped_tokens`` over many pairs (the all-resident prompt layer's path) queues its sort, its
    tile table (one kernel), the grouped kernels and the sum without waiting on the GPU."""
    x, rows, scale, w13, w2, _, _ = _grouped_case(7, 16, 100, 4, False)
    grouped_tokens(x, 4, rows, scale, w13, w2, False)  # the first call per shape checks the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = grouped_tokens(x, 4, rows, scale, w13, w2, False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    token = torch.arange(100, device=x.device).repeat_interleave(4)
    ref = torch.zeros_like(x).index_add_(0, token, grouped(x[token], rows, scale, w13, w2, False))
    assert "table" not in prefill_kernels._off
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-4


def test_a_placing_form_that_fails_leaves_the_sums_to_index_add_and_the_kernels_on(monkeypatch):
    """The down kernel's weighted, placed store fails here (build, launch or check): the grouped
    kernels go on in sorted order for the rest of the process and the sums stay right."""
    monkeypatch.setattr(prefill_kernels, "_off", {})
    real = prefill_kernels.swiglu_grouped
    placed_calls = []

    def no_placing(*a, dest=None, scale=None, **kw):
        if dest is not None:
            placed_calls.append(1)
            raise kernel_check.CandidatesWrong("no candidate placed the rows right here")
        return real(*a, **kw)

    monkeypatch.setattr(prefill_kernels, "swiglu_grouped", no_placing)
    x, rows, scale, w13, w2, _, _ = _grouped_case(8, 10, 60, 4, False)
    token = torch.arange(60, device=x.device).repeat_interleave(4)
    ref = torch.zeros_like(x).index_add_(0, token, grouped(x[token], rows, scale, w13, w2, False))
    for _ in range(2):
        got = grouped_tokens(x, 4, rows, scale, w13, w2, False)
        assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5
    assert placed_calls == [1] and "placed" in prefill_kernels._off and prefill_kernels.available()


def test_a_tile_table_kernel_that_fails_leaves_the_table_to_pytorch(monkeypatch):
    """A build failure of the table's kernel: PyTorch's operations build the same table from then on,
    and the grouped kernels still run."""
    monkeypatch.setattr(prefill_kernels, "_off", {})

    def broken(*a, **k):
        raise prefill_kernels.triton.CompilationError("x.py", None, "no such instruction")

    monkeypatch.setattr(prefill_kernels._tile_table_kernel, "run", broken)
    counts = torch.tensor([3, 0, 70, 1], device=TEST_DEVICE)
    got = prefill_kernels.device_tile_table(counts, 74)
    assert "table" in prefill_kernels._off and prefill_kernels.available()
    assert got.tolist() == prefill_kernels._tile_table_by_torch(counts, 74).tolist()


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


def test_gpt_oss_experts_grouped_with_biases_and_clamped_swiglu():
    """gpt-oss's experts (biases on both matrices, the clamped SwiGLU in the first kernel's epilogue)
    against one ``expert_ffn`` per expert, with both clamps biting (float32)."""
    g = torch.Generator().manual_seed(3)
    E, H, F, act = 5, 96, 80, ("clamped_swiglu", 1.702, 7.0)
    w13 = (torch.randn(E, 2 * F, H, generator=g) * 0.4).to(TEST_DEVICE)
    w2 = (torch.randn(E, H, F, generator=g) / F ** 0.5).to(TEST_DEVICE)
    b13, b2 = torch.randn(E, 2 * F, generator=g).to(TEST_DEVICE), torch.randn(E, H, generator=g).to(TEST_DEVICE)
    counts = np.array([3, 0, 40, 1, 9])
    rows = np.repeat(np.arange(E), counts)
    xs = torch.randn(len(rows), H, generator=g).to(TEST_DEVICE)
    used = np.nonzero(counts)[0]
    tiles = prefill_kernels.tile_table((np.cumsum(counts) - counts)[used], counts[used], used)
    got = prefill_kernels.swiglu_grouped(xs, tiles, w13, w2, b13=b13, b2=b2, act=act)
    ref = torch.cat([expert_ffn(xs[rows == r], w13[r], w2[r], b13[r], b2[r], act) for r in used])
    h = torch.cat([xs[rows == r] @ w13[r].T + b13[r] for r in used])
    assert (h[:, :F] > act[2]).any() and (h[:, F:].abs() > act[2]).any()  # the clamps bite
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5


@pytest.mark.parametrize("device_tiles", ["1", "0"])
def test_grouped_uses_the_kernels_for_many_pairs_and_matches_the_loop(monkeypatch, device_tiles):
    """With the tile table built on the device (the default) and on the host (``WORKBENCH_DEVICE_TILES=0``)."""
    monkeypatch.setenv("WORKBENCH_DEVICE_TILES", device_tiles)
    g = torch.Generator().manual_seed(1)
    E, H, F, n = 8, 64, 48, 300  # more pairs than the gather path takes
    w13 = torch.randn(E, 2 * F, H, generator=g).to(TEST_DEVICE)
    w2 = torch.randn(E, H, F, generator=g).to(TEST_DEVICE)
    x = torch.randn(n, H, generator=g).to(TEST_DEVICE)
    rows = torch.randint(0, E, (n,), generator=g).to(TEST_DEVICE)
    scale = torch.rand(n, generator=g).to(TEST_DEVICE)
    calls = []
    real = prefill_kernels.swiglu_grouped
    monkeypatch.setattr(prefill_kernels, "swiglu_grouped", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    got = grouped(x, rows, scale, w13, w2, scale_input=False)
    assert len(calls) == 1 and isinstance(calls[0], torch.Tensor if device_tiles == "1" else np.ndarray)
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


@pytest.mark.parametrize("fmt", [("q8_0", "q8_0"), ("q4_k", "q4_k"), ("q4_k", "q6_k"), ("q5_k", "q6_k"),
                                 ("q3_k", "q2_k"), ("iq4_xs", "q6_k"), ("mxfp4", "mxfp4")])
def test_blocks_are_read_in_place_like_their_dequantized_stacks(fmt):
    """Experts kept as GGUF blocks give what their dequantized stacks give (no stack is made); MXFP4
    at 160 = 5 blocks of 32 (tiles part-filled)."""
    from tests.engine.engine_helpers import random_kquant
    from tests.engine.test_cpu_kernel import _q8_0
    from workbench.engine import blocks

    g = torch.Generator().manual_seed(2)
    E, H, F = (3, 160, 96) if fmt[0] == "mxfp4" else (3, 256, 256)

    def kept(f: str, n: int, k: int) -> list[torch.Tensor]:  # [E, n, k] as the engine keeps it
        if f == "q8_0":
            return list(_q8_0(torch.randn(E, n, k, generator=g) / k ** 0.5)[:2])
        return [random_kquant(f, E * n, k, torch.Generator().manual_seed(k))[0].reshape(E, n, -1)]

    p13, p2 = kept(fmt[0], 2 * F, H), kept(fmt[1], H, F)
    d13 = blocks.dequantize(fmt[0], p13, H, torch.float32)
    d2 = blocks.dequantize(fmt[1], p2, F, torch.float32)
    counts = np.array([40, 0, 7])
    rows = np.repeat(np.arange(E), counts)
    xs = (torch.randn(len(rows), H, generator=g) * (1 if fmt[0] == "q8_0" else 1e-2)).to(TEST_DEVICE)
    used = np.nonzero(counts)[0]
    tiles = prefill_kernels.tile_table((np.cumsum(counts) - counts)[used], counts[used], used)
    dev = lambda ts: [t.to(TEST_DEVICE) for t in ts]  # noqa: E731
    if fmt[0] == "q8_0":
        got = prefill_kernels.swiglu_grouped(xs, tiles, dev(p13)[0], dev(p2)[0], dev(p13)[1], dev(p2)[1], fmt=fmt)
    else:
        got = prefill_kernels.swiglu_grouped(xs, tiles, dev(p13)[0], dev(p2)[0], fmt=fmt)
    ref = prefill_kernels.swiglu_grouped(xs, tiles, d13.to(TEST_DEVICE), d2.to(TEST_DEVICE))
    assert float((got.float() - ref.float()).abs().max() / ref.float().abs().max()) < 1e-5


def test_a_prompt_reads_resident_blocks_in_place(tiny_gguf, monkeypatch):
    """A prompt over experts kept as Q8_0 blocks on the accelerator dequantizes no stack (a whole
    layer's would cost ~1.2 GB of GPU memory at the Qwen3-30B-A3B shape) and gives the logits of the
    same experts dequantized at load."""
    from tests.engine.engine_helpers import PROMPT, open_inventory, placements, rel_err
    from workbench.engine import Engine
    from workbench.engine.experts import LayerExperts

    sizes = {"hidden_size": 64, "moe_intermediate_size": 32, "intermediate_size": 64, "mlp_only_layers": []}
    inv = open_inventory(tiny_gguf("qwen3_moe", "Q8_0", **sizes))
    logits = {}
    for keep in ("1", "0"):
        monkeypatch.setenv("WORKBENCH_KEEP_QUANTS", keep)
        engine = Engine.load(inv, placements(inv)["resident"], device=TEST_DEVICE, dtype=torch.float32, max_context=64)
        try:
            if keep == "1":
                assert all(lx.kept_res is not None for lx in engine.experts.values())
                monkeypatch.setattr(LayerExperts, "_dequant", lambda *a: pytest.fail("a stack was dequantized"))
            logits[keep] = engine.forward(torch.tensor(PROMPT), 0)
            monkeypatch.undo()
        finally:
            engine.close()
    assert rel_err(logits["1"], logits["0"]) < 1e-5


@pytest.mark.parametrize("n", [5, 40])
def test_grouped_over_kept_blocks_dequantizes_at_most_the_rows_it_uses(n):
    """A few pairs (the gather path) dequantize only their rows; many go through the kernels, which
    read the blocks in place. Both give what the dequantized stacks give."""
    from tests.engine.test_cpu_kernel import _q8_0
    from workbench.engine import blocks
    from workbench.engine.experts import KeptStacks

    g = torch.Generator().manual_seed(3)
    E, H, F = 6, 64, 32
    q13, d13, _ = _q8_0(torch.randn(E, 2 * F, H, generator=g) / H ** 0.5)
    q2, d2, _ = _q8_0(torch.randn(E, H, F, generator=g) / F ** 0.5)
    q13, d13, q2, d2 = (t.to(TEST_DEVICE) for t in (q13, d13, q2, d2))
    asked = []

    def dequant(rows=None):
        asked.append(E if rows is None else len(rows))
        take = (lambda ts: ts) if rows is None else (lambda ts: blocks.take(ts, rows))
        return (blocks.dequantize("q8_0", take([q13, d13]), H, torch.float32),
                blocks.dequantize("q8_0", take([q2, d2]), F, torch.float32))

    kept = KeptStacks((q13, q2, d13, d2), ("q8_0", "q8_0"), dequant)
    x = torch.randn(n, H, generator=g).to(TEST_DEVICE)
    rows = torch.randint(0, E, (n,), generator=g).to(TEST_DEVICE)
    scale = torch.rand(n, generator=g).to(TEST_DEVICE)
    got = grouped(x, rows, scale, None, None, scale_input=False, kept=kept)
    assert asked == ([n] if n <= 16 else [])
    ref = grouped(x, rows, scale, *dequant(), scale_input=False)
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5
