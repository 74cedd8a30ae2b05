"""CPU expert formats: every format computes x @ W.T of the weight it holds, packed from floats or GGUF blocks."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from workbench.core.errors import WorkbenchError
from workbench.engine import cpu_formats as ce

torch.set_num_threads(1)
FORMATS = ce.FORMATS


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def _q4_k_bytes(n, k, rng):
    raw = rng.integers(0, 256, (n, k // 256, 144), dtype=np.uint8)
    d = (rng.random((n, k // 256)) * 1e-3 + 1e-4).astype(np.float16)
    raw[..., 0:2] = d.view(np.uint8).reshape(n, k // 256, 2)
    raw[..., 2:4] = (d * np.float16(4)).view(np.uint8).reshape(n, k // 256, 2)
    return raw.reshape(n, -1)


def test_q4_k_decoding_matches_gguf_py():
    rng = np.random.default_rng(2)
    raw = _q4_k_bytes(8, 512, rng)
    q, scale, mins = ce.q4_k_values(raw, 8, 512)
    mine = (q.reshape(8, -1, 32) * scale[..., None] - mins[..., None]).reshape(8, 512)
    np.testing.assert_allclose(mine, quants.dequantize(raw, GGMLQuantizationType.Q4_K), rtol=1e-5, atol=1e-7)


def test_q8_0_decoding_matches_gguf_py():
    rng = np.random.default_rng(3)
    raw = quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), GGMLQuantizationType.Q8_0)
    q, d = ce.q8_0_values(raw, 4, 64)
    np.testing.assert_allclose((q * d[..., None]).reshape(4, 64), quants.dequantize(raw, GGMLQuantizationType.Q8_0))


@pytest.mark.parametrize("fmt", ["int4", "int8", "bf16"])
def test_pack_q4_k(fmt):
    rng = np.random.default_rng(3)
    raw = _q4_k_bytes(64, 512, rng)
    ref_w = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q4_K).copy())
    p = ce.pack_gguf([raw], "q4_k", [64], 512, fmt)
    x = torch.from_numpy(rng.standard_normal((2, 512)).astype(np.float32)).to(p.act_dtype)
    # int4 holds Q4_K exactly (up to bf16 scale/zero); int8 re-quantizes
    assert _rel(p(x), x.double() @ ref_w.double().T) < (1e-2 if fmt != "int8" else 2e-2)


@pytest.mark.parametrize("fmt", ["int8", "int4", "f32"])
def test_pack_q8_0(fmt):
    rng = np.random.default_rng(4)
    raw = quants.quantize((rng.standard_normal((48, 256)) * 0.03).astype(np.float32), GGMLQuantizationType.Q8_0)
    ref_w = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q8_0).copy())
    p = ce.pack_gguf([raw], "q8_0", [48], 256, fmt)
    x = torch.from_numpy(rng.standard_normal((1, 256)).astype(np.float32)).to(p.act_dtype)
    assert _rel(p(x), x.double() @ ref_w.double().T) < (0.15 if fmt == "int4" else 1e-2)


def test_stacked_gguf_matrices_equal_separate_ones():
    rng = np.random.default_rng(6)
    a, b = _q4_k_bytes(32, 256, rng), _q4_k_bytes(32, 256, rng)
    both = ce.pack_gguf([a, b], "q4_k", [32, 32], 256, "int4")
    x = torch.randn(1, 256).to(torch.bfloat16)
    sep = torch.cat([ce.pack_gguf([m], "q4_k", [32], 256, "int4")(x) for m in (a, b)], dim=1)
    torch.testing.assert_close(both(x), sep)


def test_bad_input_is_refused():
    with pytest.raises(WorkbenchError, match="does not hold"):
        ce.pack_gguf([np.zeros(100, np.uint8)], "q8_0", [4], 64, "int8")
    with pytest.raises(WorkbenchError, match="does not take"):
        ce.pack(torch.randn(4, 48), "int4")
    with pytest.raises(WorkbenchError, match="unknown CPU weight format"):
        ce.pack(torch.randn(4, 64), "fp8")
    with pytest.raises(WorkbenchError, match="no CPU packing"):
        ce.pack_gguf([np.zeros(10, np.uint8)], "q6_k", [1], 256, "int8")


def _ffn_ref(x, gu, dn, i):
    return (torch.nn.functional.silu(x @ gu[:i].T) * (x @ gu[i:].T)) @ dn.T


@pytest.mark.parametrize("fmt", FORMATS)
def test_expert_ffn_fused_gate_up(fmt):
    g = torch.Generator().manual_seed(5)
    h, i = 128, 64
    gate, up = torch.randn(i, h, generator=g) * 0.1, torch.randn(i, h, generator=g) * 0.1
    down = torch.randn(h, i, generator=g) * 0.1
    e = ce.ExpertFFN.from_float(gate, up, down, fmt)
    x = torch.randn(2, h, generator=g)
    # float64 on the weights the format holds (its own quantization error excluded)
    xr = x.to(e.gate_up.act_dtype).double()
    ref = _ffn_ref(xr, e.gate_up.dequantize().double(), e.down.dequantize().double(), i)
    assert _rel(e(x), ref) < 2e-2
    full = _ffn_ref(x.double(), torch.cat([gate, up]).double(), down.double(), i)
    assert _rel(e(x), full) < {"bf16": 2e-2, "f32": 1e-5, "int8": 3e-2, "int4": 0.3}[fmt]
    assert e.nbytes > 0


def test_expert_from_gguf_bf16_and_q4_k():
    rng = np.random.default_rng(7)
    h, i = 256, 256
    w = [(rng.standard_normal(s) * 0.05).astype(np.float32) for s in ((i, h), (i, h), (h, i))]
    bits = [torch.from_numpy(a).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16) for a in w]
    e = ce.ExpertFFN.from_gguf(*bits, "bf16", h, i, "bf16")
    x = torch.from_numpy(rng.standard_normal((1, h)).astype(np.float32))
    ref = _ffn_ref(x.double(), torch.from_numpy(np.concatenate(w[:2])).double(), torch.from_numpy(w[2]).double(), i)
    assert _rel(e(x), ref) < 2e-2
    raws = [_q4_k_bytes(i, h, rng), _q4_k_bytes(i, h, rng), _q4_k_bytes(h, i, rng)]
    deq = [torch.from_numpy(quants.dequantize(r, GGMLQuantizationType.Q4_K).copy()).double() for r in raws]
    e4 = ce.ExpertFFN.from_gguf(*raws, "q4_k", h, i, "int4")
    xr = x.to(torch.bfloat16).double()
    assert _rel(e4(x), _ffn_ref(xr, torch.cat(deq[:2]), deq[2], i)) < 2e-2


def test_formats_and_sizes():
    assert set(ce.available_formats()) == set(ce.FORMATS)
    assert "int4" not in ce.available_formats(8, 64)
    w = torch.randn(64, 256)
    sizes = {f: ce.pack(w, f).nbytes for f in ce.FORMATS}
    assert sizes["f32"] == 64 * 256 * 4 and sizes["bf16"] == 64 * 256 * 2
    assert 64 * 256 < sizes["int8"] < sizes["bf16"] and 64 * 128 < sizes["int4"] < sizes["int8"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_pack_matches_its_dequantized_weight(fmt):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 256, generator=g) * 0.05
    p = ce.pack(w, fmt)
    x = torch.randn(3, 256, generator=g).to(p.act_dtype)
    assert _rel(p(x), x.double() @ p.dequantize().double().T) < 1e-2
    assert _rel(p.dequantize(), w) < {"bf16": 1e-2, "f32": 1e-6, "int8": 1e-2, "int4": 0.1}[fmt]


def test_throughput_reports_bytes_and_time():
    r = ce.throughput("int8", 64, 128, n_mats=4, repeats=2)
    assert r["bytes_per_matrix"] == 64 * 128 + 64 * 2
    assert r["us_per_matrix"] > 0 and r["gbps"] > 0 and len(r["spread_us"]) == 2


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_expert_pool_equals_the_weighted_sum(workers):
    g = torch.Generator().manual_seed(8)
    h, i = 64, 32
    experts = [ce.ExpertFFN.from_float(*(torch.randn(s, generator=g) * 0.1 for s in ((i, h), (i, h), (h, i))), "int8")
               for _ in range(5)]
    x = torch.randn(1, h, generator=g)
    w = torch.rand(5, generator=g)
    ref = sum(w[j] * experts[j](x).float() for j in range(5))
    before = torch.get_num_threads()
    with ce.ExpertPool(workers, 1) as pool:
        torch.testing.assert_close(pool(experts, x, w), ref, rtol=1e-5, atol=1e-6)
        assert pool([], x).abs().sum() == 0
    assert torch.get_num_threads() == before
    with pytest.raises(WorkbenchError, match="at least one worker"):
        ce.ExpertPool(0)


@pytest.mark.parametrize("scale_input", [False, True])
@pytest.mark.parametrize("workers", [1, 3])
def test_cpu_experts_match_the_engines_grouped(scale_input, workers):
    from workbench.engine.experts import grouped  # the engine's own reference path

    g = torch.Generator().manual_seed(9)
    e, h, i = 6, 64, 32
    w13 = (torch.randn(e, 2 * i, h, generator=g) * 0.1).to(torch.bfloat16)
    w2 = (torch.randn(e, h, i, generator=g) * 0.1).to(torch.bfloat16)
    with ce.ExpertPool(workers, 1) as pool:
        cpu = ce.CpuExperts.from_stacked(w13, w2, "bf16", pool)
        assert cpu.experts[2].gate_up.data.data_ptr() == w13[2].data_ptr()  # used in place
        for n in (3, 40):  # decode-sized and prefill-sized
            x = torch.randn(n, h, generator=g).to(torch.bfloat16)
            rows = torch.randint(0, e, (n,), generator=g)
            scale = torch.rand(n, generator=g)
            ref = grouped(x.double(), rows, scale.double(), w13.double(), w2.double(), scale_input)
            got = cpu(x, rows, scale, scale_input)
            assert got.dtype == x.dtype and got.shape == (n, h)
            assert _rel(got, ref) < 2e-2


def test_cpu_experts_refuse_bad_shapes():
    with pytest.raises(WorkbenchError, match="stacked experts"):
        ce.CpuExperts.from_stacked(torch.zeros(2, 8, 4), torch.zeros(2, 4, 3))
