"""The fused CPU kernel over a prompt's (token, expert) pairs: ``x [T, H]`` with a token per pair,
against a float64 reference from the same values (and gguf-py's dequantization for blocks)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.engine.engine_helpers import random_kquant
from workbench.engine import cpu_kernel

from .test_cpu_kernel import _q8_0, int8_rounded, random_experts, relative_error


@pytest.fixture(scope="module")
def kernel():
    if not cpu_kernel.available():
        pytest.skip(f"fused CPU kernel unavailable here: {cpu_kernel.unavailable_reason()}")
    return cpu_kernel


def reference(x, w13, w2, tokens, rows, weights, int8: bool = False) -> torch.Tensor:
    """``out[t] += weights[j] * w2[rows[j]] @ (silu(g) * u)`` for each pair ``j`` of token ``t``, float64;
    with ``int8``, the tokens and activations rounded as the k-quant int8 dots round them."""
    i = w2.shape[2]
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for t, r, wt in zip(tokens.tolist(), rows.tolist(), weights.tolist()):
        h = w13[r].double() @ (int8_rounded(x[t]) if int8 else x[t]).double()
        a = F.silu(h[:i]) * h[i:]
        out[t] += wt * (w2[r].double() @ (int8_rounded(a.float()).double() if int8 else a))
    return out


def prompt_pairs(T: int, k: int, e: int, gen: torch.Generator):
    """Each of ``T`` tokens picks ``k`` distinct experts of ``e`` (a skewed choice: low rows more often);
    the pairs come in token order, as a router gives them: ``(tokens, rows, weights)``."""
    p = torch.linspace(2.0, 0.2, e)
    rows = torch.stack([torch.multinomial(p, k, generator=gen) for _ in range(T)]).reshape(-1)
    tokens = torch.arange(T).repeat_interleave(k)
    return tokens, rows, torch.rand(T * k, generator=gen) + 0.1


@pytest.mark.parametrize("dtype,T,k,h,i", [
    (torch.bfloat16, 5, 3, 64, 32), (torch.float32, 17, 4, 192, 96), (torch.float16, 9, 2, 100, 36),
    (torch.bfloat16, 64, 8, 256, 128), (torch.float16, 40, 4, 100, 36),  # experts of 4+ tokens, odd widths
])
def test_prompt_pairs_match_float64_reference(kernel, dtype, T, k, h, i):
    gen = torch.Generator().manual_seed(T * k + h)
    e = 16
    w13, w2 = random_experts(e, h, i, dtype, gen)
    x = torch.randn(T, h, generator=gen).to(dtype)
    tokens, rows, weights = prompt_pairs(T, k, e, gen)
    y = kernel.moe_decode(x, w13, w2, rows, weights, tokens=tokens)
    assert y.shape == (T, h) and y.dtype == torch.float32
    assert relative_error(y, reference(x, w13, w2, tokens, rows, weights)) < 1e-5


def test_a_subset_of_pairs_leaves_other_tokens_zero(kernel):
    """The engine passes only the CPU's pairs: tokens none of them belong to get zeros."""
    gen = torch.Generator().manual_seed(3)
    w13, w2 = random_experts(8, 64, 32, torch.float32, gen)
    x = torch.randn(6, 64, generator=gen)
    tokens, rows, weights = torch.tensor([4, 1, 4]), torch.tensor([7, 7, 2]), torch.tensor([0.5, 2.0, 1.0])
    y = kernel.moe_decode(x, w13, w2, rows, weights, tokens=tokens)
    assert torch.count_nonzero(y[[0, 2, 3, 5]]) == 0
    assert relative_error(y, reference(x, w13, w2, tokens, rows, weights)) < 1e-5


def test_one_token_as_a_row_equals_the_decode_call(kernel):
    gen = torch.Generator().manual_seed(4)
    w13, w2 = random_experts(8, 192, 96, torch.bfloat16, gen)
    x = torch.randn(192, generator=gen).to(torch.bfloat16)
    rows, weights = torch.tensor([3, 0, 5]), torch.rand(3, generator=gen)
    one = kernel.moe_decode(x, w13, w2, rows, weights)
    as_prompt = kernel.moe_decode(x[None], w13, w2, rows, weights, tokens=torch.zeros(3, dtype=torch.int64))
    assert torch.equal(as_prompt[0], one)


@pytest.mark.parametrize("fmt,h,i", [("bf16", 256, 96), ("f32", 100, 36), ("f16", 192, 64), ("q8_0", 128, 64),
                                     ("q4_k", 256, 256), ("q4_k+q6_k", 256, 256), ("q5_k+q6_k", 256, 256),
                                     ("q3_k+q4_k", 256, 256), ("q2_k+q3_k", 256, 256), ("iq4_xs", 256, 256)])
@pytest.mark.parametrize("T,per_token", [(11, 2), (3, 1)])
def test_each_token_of_a_prompt_matches_its_own_decode_call(kernel, quant_dots, fmt, h, i, T, per_token):
    """A prompt's expert picked by several tokens dots each weight vector with up to four tokens at
    once (k-quant values decoded once for them), and with four or more takes four float or Q8_0
    weight rows at a time. A token's row matches its own one-token call: bit for bit while its
    experts have fewer than four tokens, for k-quants and for the int8 dots (the same sums in the
    same order), to float32 rounding otherwise (other orders), for 1 to 11 tokens per expert."""
    kquant = fmt.split("+")[0] in ("q2_k", "q3_k", "q4_k", "q5_k", "iq4_xs")
    if quant_dots and fmt != "q8_0" and not kquant:
        pytest.skip("the int8 dots are for experts kept in GGUF blocks")
    gen = torch.Generator().manual_seed(7)
    e = 4
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16}.get(fmt, torch.float32)
    w13, w2 = random_experts(e, h, i, dtype, gen)
    if fmt == "q8_0":
        q13, d13, _ = _q8_0(w13)
        q2, d2, _ = _q8_0(w2)

        def call(x, rows, weights, tokens=None):
            return kernel.moe_decode_q8(x, q13, d13, q2, d2, rows, weights, tokens=tokens)
    elif kquant:
        fmt13, _, fmt2 = fmt.partition("+")
        fmt2 = fmt2 or fmt13
        b13 = random_kquant(fmt13, e * 2 * i, h, gen)[0].reshape(e, 2 * i, -1)
        b2 = random_kquant(fmt2, e * h, i, gen)[0].reshape(e, h, -1)

        def call(x, rows, weights, tokens=None):
            return kernel.moe_decode_q4k(x, b13, b2, rows, weights, fmt13, fmt2, tokens=tokens)
    else:
        def call(x, rows, weights, tokens=None):
            return kernel.moe_decode(x, w13, w2, rows, weights, tokens=tokens)
    x = torch.randn(T, h, generator=gen).to(dtype if fmt in ("f32", "f16") else torch.bfloat16)
    # T = 11: token t picks expert 0 (11 tokens) and expert 1 + t % 3 (3 or 4 tokens each);
    # T = 3: token t picks expert t alone (one token each)
    tokens = torch.arange(T).repeat_interleave(per_token)
    rows = (torch.stack([torch.zeros(T, dtype=torch.int64), 1 + torch.arange(T) % 3], dim=1).reshape(-1)
            if per_token == 2 else torch.arange(T))
    weights = torch.rand(per_token * T, generator=gen) + 0.1
    y = call(x, rows, weights, tokens)
    for t in range(T):
        pick = slice(per_token * t, per_token * (t + 1))
        own = call(x[t], rows[pick], weights[pick])
        if per_token == 1 or kquant or (quant_dots and fmt == "q8_0"):
            assert torch.equal(y[t], own), t
        else:
            assert relative_error(y[t], own) < 1e-6, t


@pytest.mark.parametrize("inference", [False, True])
def test_a_prompt_runs_in_the_background(kernel, inference):
    """The background run makes x's float copy and its zeroed result on its own thread, also for the
    engine's inference-mode tensors, and returns what the inline call does."""
    gen = torch.Generator().manual_seed(5)
    w13, w2 = random_experts(8, 256, 128, torch.bfloat16, gen)
    tokens, rows, weights = prompt_pairs(32, 4, 8, gen)
    with torch.inference_mode(inference):
        x = torch.randn(32, 256, generator=gen).to(torch.bfloat16)
        inline = kernel.moe_decode(x, w13, w2, rows, weights, tokens=tokens)
        pending = kernel.moe_decode(x, w13, w2, rows, weights, background=1, tokens=tokens)
        kernel.wait()
    assert torch.equal(pending, inline)


@pytest.mark.parametrize("background", [0, 1])
@pytest.mark.parametrize("fmt", ["bf16", "q8_0", "q4_k"])
def test_the_result_goes_where_it_is_asked(kernel, fmt, background):
    """``out``: the result is written there (stale values overwritten, also on the background thread)
    and that very tensor comes back, equal to a call that makes its own."""
    gen = torch.Generator().manual_seed(8)
    H, ffn, e, T = 256, 256, 4, 9
    tokens, rows, weights = prompt_pairs(T, 2, e, gen)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    if fmt == "bf16":
        w13, w2 = random_experts(e, H, ffn, torch.bfloat16, gen)
        call = lambda **kw: kernel.moe_decode(x, w13, w2, rows, weights, tokens=tokens, **kw)  # noqa: E731
    elif fmt == "q8_0":
        w13, w2 = random_experts(e, H, ffn, torch.float32, gen)
        q13, d13, _ = _q8_0(w13)
        q2, d2, _ = _q8_0(w2)
        call = lambda **kw: kernel.moe_decode_q8(x, q13, d13, q2, d2, rows, weights, tokens=tokens, **kw)  # noqa: E731
    else:
        b13, _ = random_kquant(fmt, e * 2 * ffn, H, gen)
        b2, _ = random_kquant(fmt, e * H, ffn, gen)
        b13, b2 = b13.reshape(e, 2 * ffn, -1), b2.reshape(e, H, -1)
        call = lambda **kw: kernel.moe_decode_q4k(x, b13, b2, rows, weights, tokens=tokens, **kw)  # noqa: E731
    own = call()
    dest = torch.full((T, H), 7.0)
    got = call(out=dest, background=background)
    if background:
        kernel.wait()
    assert got.data_ptr() == dest.data_ptr()
    assert torch.equal(dest, own)


@pytest.mark.parametrize("dest", [torch.zeros(9, 255), torch.zeros(9, 256, dtype=torch.bfloat16),
                                  torch.zeros(256, 9).t()])
def test_a_wrong_destination_is_refused(kernel, dest):
    """Refused before the extension runs, by each entry point, with nothing started in the background
    (an error raised inside the extension crashed the process on the GPU machine's PyTorch)."""
    gen = torch.Generator().manual_seed(9)
    H, ffn, e = 256, 256, 4
    tokens, rows, weights = prompt_pairs(9, 2, e, gen)
    x = torch.randn(9, H, generator=gen).to(torch.bfloat16)
    w13, w2 = random_experts(e, H, ffn, torch.float32, gen)
    q13, d13, _ = _q8_0(w13)
    q2, d2, _ = _q8_0(w2)
    b13, _ = random_kquant("q4_k", e * 2 * ffn, H, gen)
    b2, _ = random_kquant("q4_k", e * H, ffn, gen)
    calls = [lambda **kw: kernel.moe_decode(x, w13.to(torch.bfloat16), w2.to(torch.bfloat16), rows, weights, **kw),
             lambda **kw: kernel.moe_decode_q8(x, q13, d13, q2, d2, rows, weights, **kw),
             lambda **kw: kernel.moe_decode_q4k(x, b13.reshape(e, 2 * ffn, -1), b2.reshape(e, H, -1), rows,
                                                weights, **kw)]
    for call in calls:
        with pytest.raises(RuntimeError, match="out must be float32, contiguous"):
            call(tokens=tokens, out=dest, background=1)
        kernel.wait()  # nothing started: returns at once


def test_q8_0_prompt_matches_ggufs_dequantization(kernel, quant_dots):
    gen = torch.Generator().manual_seed(6)
    H, ffn, e, T = 64, 64, 6, 12
    w13, w2 = random_experts(e, H, ffn, torch.float32, gen)
    q13, d13, r13 = _q8_0(w13)
    q2, d2, r2 = _q8_0(w2)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    tokens, rows, weights = prompt_pairs(T, 3, e, gen)
    y = kernel.moe_decode_q8(x, q13, d13, q2, d2, rows, weights, tokens=tokens)
    assert relative_error(y, reference(x, r13, r2, tokens, rows, weights, quant_dots)) < (5e-4 if quant_dots else 1e-5)


@pytest.mark.parametrize("fmt13,fmt2", [("q4_k", "q4_k"), ("q4_k", "q6_k"), ("q5_k", "q5_k"), ("q5_k", "q6_k"),
                                        ("q3_k", "q4_k"), ("q2_k", "q3_k"), ("iq4_xs", "q5_k"), ("mxfp4", "mxfp4")])
def test_k_quant_prompt_matches_ggufs_dequantization(kernel, quant_dots, fmt13, fmt2):
    gen = torch.Generator().manual_seed(7)
    H, ffn, e, T = 256, 256, 4, 10
    b13, r13 = random_kquant(fmt13, e * 2 * ffn, H, gen)
    b2, r2 = random_kquant(fmt2, e * H, ffn, gen)
    b13, r13 = b13.reshape(e, 2 * ffn, -1), r13.reshape(e, 2 * ffn, H)
    b2, r2 = b2.reshape(e, H, -1), r2.reshape(e, H, ffn)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    tokens, rows, weights = prompt_pairs(T, 2, e, gen)
    y = kernel.moe_decode_q4k(x, b13, b2, rows, weights, fmt13, fmt2, tokens=tokens)
    # the int8 dots: as in test_q4_k_matches_ggufs_dequantization; an activation the kernel's float32
    # and the reference's float64 round to int8 on either side of a boundary moves a token by ~7e-4
    assert relative_error(y, reference(x, r13, r2, tokens, rows, weights, quant_dots)) < (1.5e-3 if quant_dots else 1e-5)


@pytest.mark.parametrize("tokens,match", [
    (None, "needs tokens"),
    (torch.tensor([0, 3]), r"tokens must lie in \[0, 3\)"),
    (torch.tensor([0]), "tokens must be int64 \\[n\\]"),
])
def test_bad_tokens_are_refused(kernel, tokens, match):
    w13, w2 = torch.ones(4, 64, 64), torch.ones(4, 64, 32)
    with pytest.raises(RuntimeError, match=match):
        kernel.moe_decode(torch.ones(3, 64), w13, w2, torch.tensor([0, 1]), torch.ones(2), tokens=tokens)
    with pytest.raises(RuntimeError, match="tokens are for a 2-D x"):
        kernel.moe_decode(torch.ones(64), w13, w2, torch.tensor([0, 1]), torch.ones(2), tokens=torch.tensor([0, 0]))


PROMPT = [3, 17, 5, 42, 9, 11, 60, 7, 22, 33, 1, 4, 8, 19, 27, 31, 2, 50, 12, 14, 6, 45, 38, 29]


def test_a_prompt_on_the_cpu_tier_splits_between_the_kernel_and_torch_gemms(kernel, tiny_model_dir, tiny_hf_model,
                                                                              monkeypatch):
    """Experts few of a prompt's tokens pick go through the fused kernel, those many pick through torch's
    GEMMs (past ``costmodel.fused_prompt_limit``: 8 tokens unmeasured, more the cheaper a further token
    is measured to be); both together, either alone, and transformers give the same logits (float32)."""
    from tests.engine.engine_helpers import open_inventory, placements, reference_logits, rel_err
    from workbench.engine import Engine, experts

    inv = open_inventory(tiny_model_dir("qwen3_moe"))
    calls = {"fused": 0, "gemm": 0}
    fused, gemm = cpu_kernel.moe_decode, experts.LayerExperts._grouped_cpu

    def count_fused(x, *a, **k):
        calls["fused"] += x.dim() == 2
        return fused(x, *a, **k)

    def count_gemm(self, *a, **k):
        calls["gemm"] += 1
        return gemm(self, *a, **k)

    monkeypatch.setattr(cpu_kernel, "moe_decode", count_fused)
    monkeypatch.setattr(experts.LayerExperts, "_grouped_cpu", count_gemm)
    runs = {}
    limit_of = experts.fused_prompt_limit
    for case in ("measured cost", "default", "gemm only"):
        monkeypatch.setattr(experts, "fused_prompt_limit", (lambda pr, gemm=True: 0) if case == "gemm only" else limit_of)
        engine = Engine.load(inv, placements(inv)["compute"], device="cpu", dtype=torch.float32, max_context=64)
        try:
            assert all(lx.fused_cpu for lx in engine.experts.values())
            if case == "measured cost":  # further tokens cost nothing: the kernel takes every expert
                engine.set_prompt_pair_reads(0.0)
            before = dict(calls)
            runs[case] = engine.forward(torch.tensor(PROMPT), 0)
            used = {k: calls[k] - before[k] for k in calls}
        finally:
            engine.close()
        if case == "gemm only":
            assert used["fused"] == 0 and used["gemm"] > 0
        elif case == "measured cost":
            assert used["fused"] > 0 and used["gemm"] == 0
        else:
            assert used["fused"] > 0 and used["gemm"] > 0  # this prompt has both kinds of experts
    ref = reference_logits(tiny_hf_model("qwen3_moe"), PROMPT)
    for logits in runs.values():
        assert rel_err(logits, ref) < 1e-4


def test_experts_kept_in_blocks_stay_with_the_kernel_however_many_tokens_pick_them(kernel, tiny_gguf, monkeypatch,
                                                                                  exact_cpu_dots):
    """A GEMM would first dequantize a kept expert (hundreds of reads' time), so a prompt's kept
    Q8_0 experts go through the fused kernel at any token count; the logits are those of the same
    experts dequantized at load."""
    import numpy as np

    from tests.engine.engine_helpers import open_inventory, placements, rel_err
    from workbench.engine import Engine, experts

    sizes = {"hidden_size": 64, "moe_intermediate_size": 32, "intermediate_size": 64, "mlp_only_layers": []}
    inv = open_inventory(tiny_gguf("qwen3_moe", "Q8_0", **sizes))
    prompt = (PROMPT * 3)[:64]
    calls = {"gemm": 0, "most": 0}
    gemm, fused = experts.LayerExperts._grouped_cpu, cpu_kernel.moe_decode_q8

    def count_gemm(self, *a, **k):
        calls["gemm"] += 1
        return gemm(self, *a, **k)

    def count_fused(x, q13, d13, q2, d2, rows, *a, **k):
        calls["most"] = max(calls["most"], int(np.bincount(np.asarray(rows)).max()))
        return fused(x, q13, d13, q2, d2, rows, *a, **k)

    monkeypatch.setattr(experts.LayerExperts, "_grouped_cpu", count_gemm)
    monkeypatch.setattr(cpu_kernel, "moe_decode_q8", count_fused)
    runs = {}
    for keep in ("1", "0"):
        monkeypatch.setenv("WORKBENCH_KEEP_QUANTS", keep)
        engine = Engine.load(inv, placements(inv)["compute"], device="cpu", dtype=torch.float32, max_context=80)
        try:
            runs[keep] = engine.forward(torch.tensor(prompt), 0)
            if keep == "1":
                assert all(lx.kept_cpu is not None for lx in engine.experts.values())
                assert calls["gemm"] == 0 and calls["most"] > experts.fused_prompt_limit(None)
        finally:
            engine.close()
    assert rel_err(runs["1"], runs["0"]) < 1e-5


@pytest.mark.parametrize("act", [("silu",), ("clamped_swiglu", 1.702, 7.0)])
@pytest.mark.parametrize("T", [1, 9])
def test_gpt_oss_experts_with_their_biases_and_clamped_swiglu(kernel, act, T):
    """gpt-oss's experts (biases on gate/up and down; the clamped SwiGLU ``(up + 1) * gate *
    sigmoid(alpha gate)``) match ``experts.expert_ffn`` in float64, one token and a prompt, with
    inputs large enough that both clamps bite."""
    from workbench.engine.experts import expert_ffn

    gen = torch.Generator().manual_seed(11 + T)
    e, h, i = 6, 96, 64
    w13, w2 = random_experts(e, h, i, torch.bfloat16, gen)
    b13, b2 = torch.randn(e, 2 * i, generator=gen), torch.randn(e, h, generator=gen)
    x = (torch.randn(T, h, generator=gen) * 6).to(torch.bfloat16)
    tokens, rows, weights = prompt_pairs(T, 3, e, gen)
    y = kernel.moe_decode(x if T > 1 else x[0], w13, w2, rows, weights, tokens=tokens if T > 1 else None,
                          b13=b13, b2=b2, act=act)
    ref = torch.zeros(T, h, dtype=torch.float64)
    for t, r, wt in zip(tokens.tolist(), rows.tolist(), weights.tolist()):
        ref[t] += wt * expert_ffn(x[t:t + 1].double(), w13[r].double(), w2[r].double(), b13[r].double(),
                                  b2[r].double(), act)[0]
    h13 = torch.einsum("th,eih->tei", x.double(), w13.double()) + b13.double()
    if act[0] != "silu":
        assert (h13[..., :i] > act[2]).any() and (h13[..., i:].abs() > act[2]).any()  # the clamps bite
    assert relative_error(y.reshape(T, h), ref) < 1e-5
    with pytest.raises(RuntimeError, match="unknown activation"):
        kernel.moe_decode(x[0], w13, w2, rows[:1], weights[:1], act=("gelu",))
    with pytest.raises(RuntimeError, match="both biases or neither"):
        kernel.moe_decode(x[0], w13, w2, rows[:1], weights[:1], b13=b13)


@pytest.mark.parametrize("T", [1, 9])
def test_gpt_oss_mxfp4_experts_kept_in_their_blocks(kernel, quant_dots, T):
    """gpt-oss's experts as its GGUF files store them (MXFP4, 2880 = 22.5 x 128 values a row), with
    their biases and clamped SwiGLU, read in place: they match ``experts.expert_ffn`` on gguf-py's
    dequantization in float64 (the int8 dots: within their inputs' rounding)."""
    from workbench.engine.experts import expert_ffn

    gen = torch.Generator().manual_seed(5 + T)
    e, h, i, act = 4, 2880, 64, ("clamped_swiglu", 1.702, 7.0)
    b13, r13 = random_kquant("mxfp4", e * 2 * i, h, gen, scale=1 / 32)
    b2, r2 = random_kquant("mxfp4", e * h, i, gen, scale=1 / 32)
    b13, r13, b2, r2 = b13.reshape(e, 2 * i, -1), r13.reshape(e, 2 * i, h), b2.reshape(e, h, -1), r2.reshape(e, h, i)
    bias13, bias2 = torch.randn(e, 2 * i, generator=gen), torch.randn(e, h, generator=gen)
    x = (torch.randn(T, h, generator=gen) * 3).to(torch.bfloat16)
    tokens, rows, weights = prompt_pairs(T, 2, e, gen)
    y = kernel.moe_decode_q4k(x if T > 1 else x[0], b13, b2, rows, weights, "mxfp4", "mxfp4",
                              tokens=tokens if T > 1 else None, bias13=bias13, bias2=bias2, act=act)
    ref = torch.zeros(T, h, dtype=torch.float64)
    for t, r, wt in zip(tokens.tolist(), rows.tolist(), weights.tolist()):
        ref[t] += wt * expert_ffn(x[t:t + 1].double(), r13[r], r2[r], bias13[r].double(), bias2[r].double(), act)[0]
    h13 = torch.einsum("th,eih->tei", x.double(), r13) + bias13.double()
    assert (h13[..., :i] > act[2]).any() and (h13[..., i:].abs() > act[2]).any()  # the clamps bite
    assert relative_error(y.reshape(T, h), ref) < (3e-2 if quant_dots else 1e-5)
