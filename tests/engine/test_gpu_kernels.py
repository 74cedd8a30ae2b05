"""The Triton one-token MoE kernels: experts computed from rows read in place (inactive pairs add
nothing) and softmax top-k routing with its counts. On CUDA (``WORKBENCH_TEST_DEVICE=cuda`` on the
GPU machine), or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.engine.engine_helpers import force_kernel_form, random_kquant
from workbench.engine import gpu_kernels

pytestmark = pytest.mark.skipif(not gpu_kernels.available(), reason="needs Triton and CUDA (or TRITON_INTERPRET=1)")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,F_,E,k", [(64, 32, 6, 2), (2048, 768, 16, 8), (200, 72, 5, 3)])
def test_experts_one_token_match_float64(dtype, H, F_, E, k):
    if DEV == "cpu" and H > 512:
        pytest.skip("the interpreter is slow at this size")
    g = torch.Generator(device=DEV).manual_seed(H + k)
    w13 = (torch.randn(E, 2 * F_, H, device=DEV, generator=g) / H ** 0.5).to(dtype)
    w2 = (torch.randn(E, H, F_, device=DEV, generator=g) / F_ ** 0.5).to(dtype)
    x = torch.randn(1, H, device=DEV, generator=g).to(dtype)
    ids = torch.randperm(E, device=DEV, generator=g)[:k]
    scale = (torch.rand(k, device=DEV, generator=g) + 0.1).to(dtype)
    rowmap = torch.arange(E, device=DEV).flip(0)  # rows stored in another order than expert ids
    rowmap[ids[0]] = -1  # an expert on another tier adds nothing
    out = gpu_kernels.experts_one_token(x, ids, scale, rowmap, w13, w2)
    ref = torch.zeros(1, H, dtype=torch.float64, device=DEV)
    for e, s in zip(ids.tolist(), scale.double().tolist()):
        r = int(rowmap[e])
        if r >= 0:
            h = x.double() @ w13[r].double().T
            ref += s * ((F.silu(h[:, :F_]) * h[:, F_:]) @ w2[r].double().T)
    assert out.dtype == dtype and out.shape == (1, H)
    err = float((out.double() - ref).abs().max() / ref.abs().max())
    assert err < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("E,k,norm,scaling", [(128, 8, True, 1.0), (60, 4, False, 2.5), (8, 2, True, 1.0)])
def test_route_softmax_topk_matches_torch_and_counts(E, k, norm, scaling):
    logits = torch.randn(1, E, device=DEV, generator=torch.Generator(device=DEV).manual_seed(E))
    counts = torch.zeros(E, dtype=torch.int64, device=DEV)
    counts[3] = 5
    ids, w = gpu_kernels.route_softmax_topk(logits, k, norm, scaling, counts)
    top, ref_ids = torch.topk(F.softmax(logits, dim=-1, dtype=torch.float32), k, dim=-1)
    if norm:
        top = top / top.sum(-1, keepdim=True)
    assert torch.equal(ids, ref_ids)
    assert torch.allclose(w, top * scaling, rtol=1e-5, atol=1e-7)
    expect = torch.zeros(E, dtype=torch.int64, device=DEV)
    expect[3] = 5
    expect[ref_ids[0]] += 1
    assert torch.equal(counts, expect)


def test_route_softmax_topk_takes_the_lowest_index_among_equals_in_order():
    """Ties, as bf16 logits have them: equal probabilities are picked lowest index first, each once,
    and stored in that order after every larger one (what ``sorted`` by (-p, index) gives)."""
    E, k = 128, 8
    logits = torch.zeros(1, E, device=DEV)
    logits[0, [90, 7, 40, 3, 120, 64]] = 2.0  # six equal, then the two largest below them
    logits[0, 100] = 3.0
    logits[0, [77, 5]] = 1.0
    counts = torch.zeros(E, dtype=torch.int64, device=DEV)
    ids, w = gpu_kernels.route_softmax_topk(logits, k, True, 1.0, counts)
    assert ids[0].tolist() == [100, 3, 7, 40, 64, 90, 120, 5]
    p = F.softmax(logits, dim=-1)[0]
    top = p[ids[0]] / p[ids[0]].sum()
    assert torch.allclose(w[0], top, rtol=1e-5, atol=1e-7)
    assert counts.sum() == k and bool((counts[ids[0]] == 1).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("E,H,k,norm,scaling", [(128, 256, 8, True, 1.0), (60, 200, 4, False, 2.5), (8, 64, 2, True, 1.0)])
def test_the_router_and_its_routing_in_one_kernel_match_torch_call_after_call(dtype, E, H, k, norm, scaling):
    """``router_route``: the logits as ``F.linear`` rounds them, then softmax top-k as
    ``route_softmax_topk``; the program count it keeps per router goes back to 0, so each call
    (other tokens) is right and counted once."""
    g = torch.Generator(device=DEV).manual_seed(E + H)
    router = (torch.randn(E, H, device=DEV, generator=g) / H ** 0.5).to(dtype)
    counts = torch.zeros(E, dtype=torch.int64, device=DEV)
    expect = torch.zeros(E, dtype=torch.int64, device=DEV)
    for call in range(3):
        x = torch.randn(1, H, device=DEV, generator=g).to(dtype)
        ids, w = gpu_kernels.router_route(x, router, k, norm, scaling, counts)
        p = F.softmax(F.linear(x.float(), router.float()).to(dtype).float(), dim=-1)[0]
        ref_ids = torch.tensor([sorted(range(E), key=lambda e: (-float(p[e]), e))[:k]], device=DEV)  # equals: lowest first
        top = p[ref_ids]
        if norm:
            top = top / top.sum(-1, keepdim=True)
        assert torch.equal(ids, ref_ids), call
        assert w.dtype == dtype and torch.allclose(w.float(), top * scaling, rtol=3e-2 if dtype == torch.bfloat16 else 1e-5)  # a logit 1 bf16 ulp off: ~1%
        expect[ref_ids[0]] += 1
        assert torch.equal(counts, expect), call


def test_the_split_down_projection_is_right_call_after_call():
    """``_down_split_kernel`` counts its programs per block of outputs in a buffer it sets back to 0:
    a call after another (other experts and inputs) is as right as the first."""
    H, F_, E, k = 96, 64, 6, 3
    g = torch.Generator(device=DEV).manual_seed(7)
    w13 = torch.randn(E, 2 * F_, H, device=DEV, generator=g) / H ** 0.5
    w2 = torch.randn(E, H, F_, device=DEV, generator=g) / F_ ** 0.5
    rowmap = torch.arange(E, device=DEV)
    part, cnt = gpu_kernels._down_workspace(w2, k, H, DEV)
    for call in range(3):
        x = torch.randn(1, H, device=DEV, generator=g)
        ids = torch.randperm(E, device=DEV, generator=g)[:k]
        scale = torch.rand(k, device=DEV, generator=g) + 0.1
        out = gpu_kernels.experts_one_token(x, ids, scale, rowmap, w13, w2)
        ref = sum(s * gpu_kernels.expert_f32(x, int(e), (None, None), w13, w2)
                  for e, s in zip(ids.tolist(), scale.tolist()))
        assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6), call
        assert not cnt.any()  # every block's count back to 0


def test_the_down_projections_buffers_live_where_the_kernel_runs():
    """The served bus runs the expert kernels on the GPU over stacks in page-locked host memory: the
    split down projection's parts and counts must be on the kernel's device, not the stack's (on
    CUDA a host buffer there fails the launch, and the bus falls back to host-driven layers)."""
    w2 = torch.zeros(4, 8, 16)  # a host stack
    part, cnt = gpu_kernels._down_workspace(w2, 2, 8, torch.device("meta"))
    assert part.device.type == cnt.device.type == "meta" and part.shape == (2, 8) and cnt.shape == (8,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_heads,n_kv,hd,S,pos", [(32, 4, 128, 576, 300), (4, 4, 64, 40, 0), (8, 2, 64, 1000, 999),
                                                   (6, 2, 32, 130, 129), (16, 1, 64, 4096, 2050),
                                                   (4, 2, 8, 96, 50)])
def test_decode_attention_matches_float64(dtype, n_heads, n_kv, hd, S, pos):
    """Keys ``0..pos`` attended, every slot after ``pos`` ignored (filled with large values here)."""
    if DEV == "cpu" and S * n_kv > 8192:
        pytest.skip("the interpreter is slow at this size")
    g = torch.Generator(device=DEV).manual_seed(S + pos)
    q = torch.randn(1, n_heads, hd, device=DEV, generator=g).to(dtype)
    k = torch.randn(S, n_kv, hd, device=DEV, generator=g).to(dtype)
    v = torch.randn(S, n_kv, hd, device=DEV, generator=g).to(dtype)
    k[pos + 1:] = 50.0  # stale slots: would dominate the softmax if read
    v[pos + 1:] = 1e4
    scale = hd ** -0.5
    out = gpu_kernels.decode_attention(q, k, v, torch.tensor([pos], device=DEV), scale)
    rep = n_heads // n_kv
    kk = k[:pos + 1].double().repeat_interleave(rep, dim=1)  # [n, nH, hd]
    vv = v[:pos + 1].double().repeat_interleave(rep, dim=1)
    p = torch.softmax(torch.einsum("hd,nhd->hn", q[0].double(), kk) * scale, dim=-1)
    ref = torch.einsum("hn,nhd->hd", p, vv).reshape(1, -1)
    assert out.dtype == dtype and out.shape == (1, n_heads * hd)
    err = float((out.double() - ref).abs().max() / ref.abs().max())
    assert err < (1e-5 if dtype == torch.float32 else 2e-2)


def _token(H: int, E: int, k: int, g: torch.Generator):
    """One bfloat16 token, ``k`` distinct experts of ``E`` with weights, rows stored in reverse and the
    first selected expert on another tier (rowmap -1)."""
    x = torch.randn(1, H, generator=g).to(DEV, torch.bfloat16)
    ids = torch.randperm(E, generator=g)[:k].to(DEV)
    scale = (torch.rand(k, generator=g) + 0.1).to(DEV, torch.bfloat16)
    rowmap = torch.arange(E, device=DEV).flip(0)
    rowmap[ids[0]] = -1
    return x, ids, scale, rowmap


def _check_against(out, x, ids, scale, rowmap, r13, r2) -> None:
    """``out [1, H]`` bfloat16 within 1% of the float64 experts ``r13 [E, 2I, H]``, ``r2 [E, H, I]``."""
    F_ = r2.shape[-1]
    ref = torch.zeros(1, r2.shape[1], dtype=torch.float64, device=DEV)
    for e, s in zip(ids.tolist(), scale.double().tolist()):
        r = int(rowmap[e])
        if r >= 0:
            h = x.double() @ r13[r].T
            ref += s * ((F.silu(h[:, :F_]) * h[:, F_:]) @ r2[r].T)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    assert float((out.double() - ref).abs().max() / ref.abs().max()) < 1e-2


@pytest.mark.parametrize("form", ["tile", "blocks"])
@pytest.mark.parametrize("H,F_,E,k", [(64, 32, 6, 2), (96, 64, 5, 3), (2048, 768, 16, 8)])
def test_experts_one_token_on_q8_0_blocks_match_ggufs_dequantization(H, F_, E, k, form, monkeypatch):
    """Q8_0 stacks (int8 values, a float16 scale per 32) read in place give what gguf-py's dequantized
    weights give."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    if DEV == "cpu" and H > 512:
        pytest.skip("the interpreter is slow at this size")
    force_kernel_form(monkeypatch, form)
    g = torch.Generator().manual_seed(H + k)

    def q8(w):
        rows = w.reshape(-1, w.shape[-1]).numpy().astype(np.float32)
        raw = quantize(rows, GGMLQuantizationType.Q8_0)
        blocks = raw.reshape(rows.shape[0], -1, 34)
        d = torch.from_numpy(np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0]).reshape(*w.shape[:-1], -1)
        q = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:]).view(np.int8)).reshape(w.shape)
        ref = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q8_0).astype(np.float64)).reshape(w.shape)
        return q.to(DEV), d.to(DEV), ref.to(DEV)

    q13, d13, r13 = q8(torch.randn(E, 2 * F_, H, generator=g) / H ** 0.5)
    q2, d2, r2 = q8(torch.randn(E, H, F_, generator=g) / F_ ** 0.5)
    x, ids, scale, rowmap = _token(H, E, k, g)
    out = gpu_kernels.experts_one_token(x, ids, scale, rowmap, q13, q2, d13, d2)
    _check_against(out, x, ids, scale, rowmap, r13, r2)


@pytest.mark.parametrize("H,F_,E,k,fmt", [(256, 256, 4, 2, ("q4_k", "q4_k")), (512, 256, 5, 3, ("q4_k", "q4_k")),
                                          (256, 256, 4, 2, ("q4_k", "q6_k")), (256, 256, 3, 2, ("q6_k", "q6_k")),
                                          (512, 256, 4, 2, ("q5_k", "q5_k")), (256, 256, 3, 2, ("q5_k", "q6_k")),
                                          (256, 512, 3, 2, ("q3_k", "q4_k")), (512, 256, 4, 3, ("q2_k", "q3_k")),
                                          (256, 256, 3, 2, ("iq4_xs", "iq4_xs"))])
@pytest.mark.parametrize("form", ["tile", "blocks"])
def test_experts_one_token_on_q4_k_blocks_match_ggufs_dequantization(H, F_, E, k, fmt, form, monkeypatch):
    """k-quant rows (Q2_K to Q6_K, IQ4_XS) as raw bytes, read in place (inactive pairs read nothing)."""
    if form == "blocks" and {"q2_k", "q3_k", "iq4_xs"} >= set(fmt):
        pytest.skip("Q2_K, Q3_K and IQ4_XS take the tiled form whatever the candidate")
    force_kernel_form(monkeypatch, form)
    g = torch.Generator().manual_seed(H + F_)

    def q4k(n, kk, f):
        return random_kquant(f, n, kk, g, scale=1e-4 if f == "iq4_xs" else 1e-3)  # IQ4_XS's values reach 127 * 31

    b13, r13 = q4k(E * 2 * F_, H, fmt[0])
    b2, r2 = q4k(E * H, F_, fmt[1])
    b13, r13 = b13.reshape(E, 2 * F_, -1).to(DEV), r13.reshape(E, 2 * F_, H).to(DEV)
    b2, r2 = b2.reshape(E, H, -1).to(DEV), r2.reshape(E, H, F_).to(DEV)
    x, ids, scale, rowmap = _token(H, E, k, g)
    out = gpu_kernels.experts_one_token(x, ids, scale, rowmap, b13, b2, fmt=fmt)
    _check_against(out, x, ids, scale, rowmap, r13, r2)


def _cut_units(r13: torch.Tensor, r2: torch.Tensor, units: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float experts ``r13 [E, 2I, H]``, ``r2 [E, H, I]`` cut to their units ``[units, I)``."""
    F_ = r2.shape[-1]
    return torch.cat([r13[:, units:F_], r13[:, F_ + units:]], dim=1), r2[:, :, units:]


@pytest.mark.parametrize("fmt,H,F_,units", [(None, 64, 96, 32), (("q8_0", "q8_0"), 64, 96, 64),
                                            (("q4_k", "q4_k"), 256, 512, 256), (("q4_k", "q6_k"), 256, 512, 256)])
def test_experts_one_token_over_a_part_of_each_experts_units(fmt, H, F_, units):
    """``blocks.unit_views``: the kernels read the units ``[units, I)`` of each expert in place (views
    of the whole stacks, the decode server's unit split) and give those units' experts."""
    from tests.engine.engine_helpers import random_kquant
    from workbench.engine import blocks

    E, k = 4, 3
    g = torch.Generator().manual_seed(F_ + units)
    if fmt is None:
        r13 = torch.randn(E, 2 * F_, H, generator=g) / H ** 0.5
        r2 = torch.randn(E, H, F_, generator=g) / F_ ** 0.5
        stacks = [r13.to(DEV, torch.bfloat16), r2.to(DEV, torch.bfloat16)]
        r13, r2 = (t.double() for t in stacks)
    elif fmt[0] == "q8_0":
        q13 = torch.randint(-127, 128, (E, 2 * F_, H), dtype=torch.int8, generator=g)
        q2 = torch.randint(-127, 128, (E, H, F_), dtype=torch.int8, generator=g)
        d13 = (torch.rand(E, 2 * F_, H // 32, generator=g) * 1e-3 / H ** 0.5).to(torch.float16)
        d2 = (torch.rand(E, H, F_ // 32, generator=g) * 1e-3 / F_ ** 0.5).to(torch.float16)
        stacks = [t.to(DEV) for t in (q13, d13, q2, d2)]
        r13 = (q13.double() * d13.double().repeat_interleave(32, -1)).to(DEV)
        r2 = (q2.double() * d2.double().repeat_interleave(32, -1)).to(DEV)
    else:
        b13, r13 = random_kquant(fmt[0], E * 2 * F_, H, g, scale=1e-3)
        b2, r2 = random_kquant(fmt[1], E * H, F_, g, scale=1e-3)
        stacks = [b13.reshape(E, 2 * F_, -1).to(DEV), b2.reshape(E, H, -1).to(DEV)]
        r13, r2 = r13.reshape(E, 2 * F_, H).to(DEV), r2.reshape(E, H, F_).to(DEV)
    x, ids, scale, rowmap = _token(H, E, k, g)
    views = blocks.unit_views(fmt, stacks, units)
    assert all(v.data_ptr() >= s.data_ptr() for v, s in zip(views, stacks))  # views, nothing copied
    out = gpu_kernels.experts_one_token(x, ids, scale, rowmap, *blocks.kernel_args(fmt, views), fmt=fmt)
    _check_against(out, x, ids, scale, rowmap, *_cut_units(r13, r2, units))


@pytest.mark.parametrize("fmt", [None, ("mxfp4", "mxfp4")])
def test_gpt_oss_experts_one_token_with_biases_and_clamped_swiglu(fmt):
    """gpt-oss's experts (biases on gate/up and down, the clamped SwiGLU between the kernels) read in
    place, float rows and MXFP4 blocks (160 = 5 blocks of 32: a part-filled tile), against float64 on
    gguf-py's dequantization, with both clamps biting; inactive pairs add nothing."""
    from workbench.engine.experts import expert_ffn

    H, F_, E, k, act = 160, 64, 5, 3, ("clamped_swiglu", 1.702, 7.0)
    g = torch.Generator().manual_seed(17)
    if fmt is None:
        r13 = torch.randn(E, 2 * F_, H, generator=g).double() * 0.1
        r2 = torch.randn(E, H, F_, generator=g).double() * 0.1
        w13, w2 = r13.float().to(DEV), r2.float().to(DEV)
    else:
        w13, r13 = random_kquant("mxfp4", E * 2 * F_, H, g, scale=1 / 8)
        w2, r2 = random_kquant("mxfp4", E * H, F_, g, scale=1 / 8)
        w13, r13 = w13.reshape(E, 2 * F_, -1).to(DEV), r13.reshape(E, 2 * F_, H)
        w2, r2 = w2.reshape(E, H, -1).to(DEV), r2.reshape(E, H, F_)
    b13, b2 = torch.randn(E, 2 * F_, generator=g), torch.randn(E, H, generator=g)
    x = torch.randn(1, H, generator=g) * 2
    ids = torch.randperm(E, generator=g)[:k]
    scale = torch.rand(k, generator=g) + 0.1
    rowmap = torch.arange(E).flip(0)
    rowmap[ids[0]] = -1  # an expert on another tier adds nothing
    out = gpu_kernels.experts_one_token(x.to(DEV), ids.to(DEV), scale.to(DEV), rowmap.to(DEV), w13, w2, fmt=fmt,
                                        b13=b13.to(DEV), b2=b2.to(DEV), act=act)
    ref = torch.zeros(1, H, dtype=torch.float64)
    for e, s in zip(ids.tolist(), scale.double().tolist()):
        r = int(rowmap[e])
        if r >= 0:
            ref += s * expert_ffn(x.double(), r13[r], r2[r], b13[r].double(), b2[r].double(), act)
    h13 = torch.einsum("h,eih->ei", x[0].double(), r13) + b13.double()
    assert (h13[:, :F_] > act[2]).any() and (h13[:, F_:].abs() > act[2]).any()  # the clamps bite
    assert float((out.double().cpu() - ref).abs().max() / ref.abs().max()) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H", [64, 2048, 200])
def test_add_rms_norm_is_the_add_then_the_norm(dtype, H):
    g = torch.Generator().manual_seed(H)
    a, b = (torch.randn(1, H, generator=g).to(DEV, dtype) for _ in range(2))
    w = (torch.rand(H, generator=g) + 0.5).to(DEV, dtype)
    s, n = gpu_kernels.add_rms_norm(a, b, w, 1e-6)
    ref_s = a + b
    ref_n = F.rms_norm(ref_s, (H,), w, 1e-6)
    if dtype == torch.float32:
        assert torch.equal(s, ref_s)
    else:  # one bfloat16 step at most (Triton's interpreter rounds bfloat16 towards zero)
        assert bool(((s.float() - ref_s.float()).abs() <= ref_s.float().abs() * 2 ** -7 + 1e-30).all())
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert float((n.float() - ref_n.float()).abs().max()) <= tol * float(ref_n.float().abs().max())


def test_a_newer_kernel_form_that_does_not_build_is_dropped_and_the_others_go_on():
    """A form among the autotuning candidates that fails to build on some GPU (``TILE``, ``UNROLL``)
    is dropped once; the forms that ran before stay, and a failure with none left to drop goes up."""
    from triton import Config

    from workbench.engine import packed

    class Kernel:
        configs = [Config({"BLOCK_N": 8, "TILE": True}), Config({"BLOCK_N": 8, "TILE": False, "UNROLL": False})]
        cache = {"key": "a timed config"}

    def fails_in_triton():
        t = torch.zeros(64)
        packed._dequant_kernel[(1, 1)](t, t, t, 1, 32, 32, BLOCK_N=3, BLOCK_K=96, FMT=1)  # 3: no power of two

    def launch():
        if any(c.kwargs.get("TILE") for c in Kernel.configs):
            fails_in_triton()
        return "ran"

    assert gpu_kernels.run_dropping_new_forms([Kernel], launch) == "ran"
    assert [c.kwargs["TILE"] for c in Kernel.configs] == [False] and Kernel.cache == {}
    with pytest.raises(Exception) as info:
        gpu_kernels.run_dropping_new_forms([Kernel], fails_in_triton)
    assert gpu_kernels.failed_here(info.value)
    with pytest.raises(ZeroDivisionError):  # not a kernel's failure: up at once, nothing dropped
        gpu_kernels.run_dropping_new_forms([Kernel], lambda: 1 / 0)


@pytest.mark.parametrize("env,capability,want", [(None, (9, 0), True), ("1", (9, 0), True), (None, (8, 0), False),
                                                 ("0", (9, 0), False)])
def test_programmatic_dependent_launch_on_hopper_unless_turned_off(monkeypatch, env, capability, want):
    """``gpu_kernels.pdl``: on compute capability 9 or later with a Triton that has ``launch_pdl``,
    unless ``WORKBENCH_PDL=0``; ``pdl_args`` adds the launch arguments only then."""
    if gpu_kernels.triton is None:
        pytest.skip("needs Triton")
    from triton.backends.nvidia.compiler import CUDAOptions

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    if env is None:
        monkeypatch.delenv("WORKBENCH_PDL", raising=False)
    else:
        monkeypatch.setenv("WORKBENCH_PDL", env)
    gpu_kernels.pdl.cache_clear()
    try:
        want = want and "launch_pdl" in CUDAOptions.__dataclass_fields__
        assert gpu_kernels.pdl() is want
        assert gpu_kernels.pdl_args() == ({"PDL": True, "launch_pdl": True} if want else {})
    finally:
        gpu_kernels.pdl.cache_clear()
