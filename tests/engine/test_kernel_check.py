"""The one-token kernels' autotuning candidates are checked against PyTorch before any is timed
(``engine.kernel_check``): a candidate that computes something else, or does not build, is dropped;
with none left the PyTorch path computes. The kernels here are the real ones (on CUDA, or under
Triton's interpreter); a wrong candidate is the real kernel whose output is then scaled by -2."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.engine.engine_helpers import TEST_DEVICE as DEV
from tests.engine.test_packed import close, kept
from workbench.engine import gpu_kernels, kernel_check, packed

pytestmark = pytest.mark.skipif(not gpu_kernels.available(), reason="needs Triton and CUDA (or TRITON_INTERPRET=1)")


class Picky:
    """Stands in for an autotuned kernel: ``configs`` and ``cache`` as Triton's autotuner has them;
    a launch runs the real kernel (its first candidate) and multiplies the output (argument
    ``out_arg``) by -2 when the candidate in use (the first of ``configs``) is one of ``wrong``."""

    def __init__(self, real, out_arg: int, n_good: int, n_wrong: int):
        from triton import Config

        self.real, self.out_arg, self.cache = real, out_arg, {}
        self.wrong = [Config({"BLOCK_N": 8, "WRONG": i}) for i in range(n_wrong)]
        self.configs = self.wrong + [Config({"BLOCK_N": 8, "GOOD": i}) for i in range(n_good)]
        self.launches = 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches += 1
            self.real[grid](*args, **kwargs)
            if self.configs[0] in self.wrong:
                args[self.out_arg].mul_(-2)
        return launch


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(kernel_check, "_checked", set())
    monkeypatch.setattr(kernel_check, "dropped", [])
    monkeypatch.setattr(packed, "_off", {})
    monkeypatch.setattr(gpu_kernels, "_disabled", [])


def test_a_wrong_candidate_of_the_dense_kernel_is_dropped_before_it_is_timed(monkeypatch, caplog):
    picky = Picky(packed._matvec_kernel, 3, n_good=2, n_wrong=1)
    monkeypatch.setattr(packed, "_matvec_kernel", picky)
    w, ref = kept("q4_k", 48, 512, seed=3)
    w.dtype = torch.float32
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(4)).to(DEV)
    with caplog.at_level(logging.WARNING):
        out = packed.linear(x, w)
    assert close(out, x.double() @ ref.T, 1e-5)
    assert picky.configs and not any(c in picky.wrong for c in picky.configs) and len(picky.configs) == 2
    assert "dropped 1 autotuning candidate" in caplog.text and "WRONG=0" in caplog.text
    assert len(kernel_check.dropped) == 1 and "matvec" in kernel_check.dropped[0]  # the bench's JSON reports it
    n = picky.launches
    assert close(packed.linear(x, w), x.double() @ ref.T, 1e-5) and picky.launches == n + 1  # checked once
    assert not packed._off


def test_with_no_right_candidate_the_dense_product_is_computed_by_pytorch(monkeypatch):
    picky = Picky(packed._matvec_kernel, 3, n_good=0, n_wrong=2)
    monkeypatch.setattr(packed, "_matvec_kernel", picky)
    w, ref = kept("q8_0", 40, 96, seed=5)
    w.dtype = torch.float32
    x = torch.randn(1, 96, generator=torch.Generator().manual_seed(6)).to(DEV)
    assert close(packed.linear(x, w), x.double() @ ref.T, 1e-5)
    assert "CandidatesWrong" in packed._off["matvec"] and gpu_kernels.available()
    assert len(picky.configs) == 2  # left as they were: the kernel is off, not pruned to nothing


@pytest.mark.parametrize("fmt", [("q4_k", "q6_k"), ("q8_0", "q8_0"), None])
def test_a_wrong_candidate_of_the_experts_down_kernel_is_dropped(fmt, monkeypatch):
    """The two experts kernels run as one: a wrong candidate of one is found with the other's
    candidates right, whichever comes first."""
    from tests.engine.test_gpu_kernels import _token

    E, H, F_, k = 4, 256, 256, 2
    picky = Picky(gpu_kernels._down_split_kernel, 6, n_good=1, n_wrong=2)
    monkeypatch.setattr(gpu_kernels, "_down_split_kernel", picky)
    g = torch.Generator().manual_seed(7)
    x, ids, scale, rowmap = _token(H, E, k, g)
    f13, f2 = fmt or ("q8_0", "q8_0")
    p13 = [kept(f13, 2 * F_, H, seed=e) for e in range(E)]
    p2 = [kept(f2, H, F_, seed=10 + e) for e in range(E)]
    r13 = torch.stack([r for _, r in p13])
    r2 = torch.stack([r for _, r in p2])
    if fmt is None:  # float stacks
        args = (r13.float(), r2.float())
        kw = {}
    elif f13 == "q8_0":
        args = tuple(torch.stack([w.parts[i] for w, _ in p]) for p, i in ((p13, 0), (p2, 0), (p13, 1), (p2, 1)))
        kw = {}
    else:
        args = (torch.stack([w.parts[0] for w, _ in p13]), torch.stack([w.parts[0] for w, _ in p2]))
        kw = {"fmt": fmt}
    out = gpu_kernels.experts_one_token(x.float(), ids, scale.float(), rowmap, *args, **kw)
    ref = torch.zeros(1, H, dtype=torch.float64, device=DEV)
    for e, s in zip(ids.tolist(), scale.double().tolist()):
        r = int(rowmap[e])
        if r >= 0:
            h = x.double() @ r13[r].T
            ref += s * ((torch.nn.functional.silu(h[:, :F_]) * h[:, F_:]) @ r2[r].T)
    assert close(out, ref, 1e-4)
    assert [c.kwargs.get("GOOD") for c in picky.configs] == [0]


def test_a_candidate_that_does_not_build_is_dropped_and_other_errors_go_up():
    from triton import Config

    class Kernel:
        configs = [Config({"BLOCK_N": 3}), Config({"BLOCK_N": 8})]
        cache = {"another shape": "its checked pick"}

    def fails_in_triton():
        t = torch.zeros(64)
        packed._dequant_kernel[(1, 1)](t, t, t, 1, 32, 32, BLOCK_N=3, BLOCK_K=96, FMT=1)  # 3: no power of two

    def run():
        if Kernel.configs[0].kwargs["BLOCK_N"] == 3:
            fails_in_triton()
        return torch.ones(4)

    assert kernel_check.run_checked([Kernel], run, "shape", lambda: (run, torch.ones(4)), gpu_kernels.failed_here) is not None
    assert [c.kwargs["BLOCK_N"] for c in Kernel.configs] == [8]
    assert Kernel.cache == {"another shape": "its checked pick"}
    Kernel.configs = [Config({"BLOCK_N": 3}), Config({"BLOCK_N": 8})]
    with pytest.raises(ZeroDivisionError):  # not a kernel's failure: up at once, nothing dropped
        kernel_check.run_checked([Kernel], run, "other", lambda: (lambda: 1 / 0, torch.ones(4)), gpu_kernels.failed_here)
    assert len(Kernel.configs) == 2 and "other" not in kernel_check._checked


@pytest.mark.parametrize("placed", [False, True])
def test_a_wrong_candidate_of_the_grouped_prompt_kernel_is_dropped(monkeypatch, placed):
    """Also with each output weighted and stored at its pair's place (``dest``, ``scale``): the probe
    then stores its rows in reverse and weights them, and the right candidate agrees with it."""
    import numpy as np

    from workbench.engine import prefill_kernels
    from workbench.engine.experts import expert_ffn

    picky = Picky(prefill_kernels._grouped_kernel, 4, n_good=1, n_wrong=1)
    monkeypatch.setattr(prefill_kernels, "_grouped_kernel", picky)
    g = torch.Generator().manual_seed(2)
    E, H, F_ = 3, 64, 48
    w13 = (torch.randn(E, 2 * F_, H, generator=g) / H ** 0.5).to(DEV)
    w2 = (torch.randn(E, H, F_, generator=g) / F_ ** 0.5).to(DEV)
    counts = np.array([5, 0, 40])
    rows = np.repeat(np.arange(E), counts)
    xs = torch.randn(len(rows), H, generator=g).to(DEV)
    used = np.nonzero(counts)[0]
    tiles = prefill_kernels.tile_table((np.cumsum(counts) - counts)[used], counts[used], used)
    ref = torch.cat([expert_ffn(xs[rows == r], w13[r], w2[r]) for r in used])
    if placed:
        dest = torch.randperm(len(rows), generator=g).to(DEV)
        scale = torch.rand(len(rows), generator=g).to(DEV)
        got = prefill_kernels.swiglu_grouped(xs, tiles, w13, w2, dest=dest, scale=scale)
        ref = torch.empty_like(ref).index_copy_(0, dest, ref * scale[:, None])
    else:
        got = prefill_kernels.swiglu_grouped(xs, tiles, w13, w2)
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5
    assert [c.kwargs.get("GOOD") for c in picky.configs] == [0]


@pytest.mark.parametrize("tensor_type", ["Q8_0", "BF16"])
def test_an_engine_decodes_through_the_checks_and_computes_the_same(tensor_type, tiny_gguf, monkeypatch):
    """Every autotuned kernel with two right candidates: the engine's own calls (the decode step's
    pieces over resident experts, the mixed placement's tiers with a bus share whose slots start
    unwritten, kept q/k/v, o and head; prompts through the grouped kernel) run the checks' probes
    on their real tensors, keep both candidates and give the logits and tokens of the unchecked
    kernels."""
    from tests.engine.engine_helpers import (
        PROMPT,
        attach_bus_share,
        greedy_tokens,
        open_inventory,
        placements,
        rel_err,
    )
    from tests.engine.test_engine_gguf import QUANT_SIZES
    from workbench.engine import Engine, prefill_kernels

    inv = open_inventory(tiny_gguf("qwen3_moe", tensor_type, **dict(QUANT_SIZES, mlp_only_layers=[])))
    p = placements(inv)

    def run():
        out = {}
        for name in ("resident", "mixed"):
            engine = Engine.load(inv, p[name], device=DEV, dtype=torch.float32, max_context=64)
            if DEV == "cpu":
                engine.decode_mode = "static"  # the decode graphs' pieces, run eagerly
            if name == "mixed":
                attach_bus_share(engine, 0.5)
            out[name] = (engine.forward(torch.tensor(PROMPT), 0), greedy_tokens(engine, PROMPT, 6))
            engine.close()
        return out

    plain = run()
    wrapped = [(gpu_kernels, "_gate_up_kernel", 6), (gpu_kernels, "_down_split_kernel", 6), (packed, "_matvec_kernel", 3),
               (prefill_kernels, "_grouped_kernel", 4)]
    pickies = {}
    for module, name, out_arg in wrapped:
        pickies[name] = Picky(getattr(module, name), out_arg, n_good=2, n_wrong=0)
        monkeypatch.setattr(module, name, pickies[name])
    checked = run()
    for name in plain:
        assert rel_err(checked[name][0], plain[name][0]) < 1e-6 and checked[name][1] == plain[name][1]
    kinds = {key[0] for key in kernel_check._checked}
    assert "experts" in kinds and (("matvec" in kinds) == (tensor_type == "Q8_0"))
    assert all(len(k.configs) == 2 for k in pickies.values()) and not kernel_check.dropped and not packed._off


def test_a_shape_whose_probes_are_not_finite_is_left_unchecked_after_a_few_tries(monkeypatch):
    monkeypatch.setattr(kernel_check, "_unfinite", {})

    class Tuned:  # an autotuned kernel with two candidates
        configs, cache = ["a", "b"], {}

    probes = []

    def probe():
        probes.append(1)
        return (lambda: torch.zeros(1)), torch.tensor([float("nan"), 1.0])

    for _ in range(2 * kernel_check.UNFINITE_TRIES):
        assert kernel_check.run_checked([Tuned()], lambda: 7, "shape", probe, lambda exc: False) == 7
    assert len(probes) == kernel_check.UNFINITE_TRIES  # then no call pays for the probe any more
    assert Tuned.configs == ["a", "b"]  # nothing dropped on a probe that says nothing
