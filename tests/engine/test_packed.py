"""Dense weights kept in GGUF blocks (``engine.packed``): the one-token kernel, the dequantizing
kernel, the prompt path and the embedding rows give what gguf-py's dequantized matrix gives. On the
GPU machine (``WORKBENCH_TEST_DEVICE=cuda``) they run on CUDA; here under Triton's interpreter."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from tests.engine.engine_helpers import TEST_DEVICE as DEV
from tests.engine.engine_helpers import force_kernel_form, random_kquant
from workbench.engine import gpu_kernels, packed
from workbench.engine.packed import Packed

needs_kernels = pytest.mark.skipif(not gpu_kernels.available(), reason="needs Triton and CUDA (or TRITON_INTERPRET=1)")


def kept(fmt: str, n: int, k: int, seed: int) -> tuple[Packed, torch.Tensor]:
    """A random ``[n, k]`` matrix stored as ``fmt`` the way a GGUF file stores it, and gguf-py's
    dequantization of those bytes (float64)."""
    g = torch.Generator().manual_seed(seed)
    if fmt == "q8_0":
        w = (torch.randn(n, k, generator=g) / k ** 0.5).numpy()
        raw = quantize(w, GGMLQuantizationType.Q8_0).reshape(n, -1, 34)
        d = torch.from_numpy(np.ascontiguousarray(raw[..., :2]).view(np.float16)[..., 0].copy())
        q = torch.from_numpy(np.ascontiguousarray(raw[..., 2:]).view(np.int8).reshape(n, k).copy())
        ref = dequantize(raw.reshape(n, -1), GGMLQuantizationType.Q8_0)
        parts = [q, d]
    else:  # random bytes with small float16 scales: every bit pattern of the quants and sub-scales
        raw, ref = random_kquant(fmt, n, k, torch.Generator().manual_seed(k))
        ref, parts = ref.numpy(), [raw]
    return Packed(fmt, [p.to(DEV) for p in parts], k), torch.from_numpy(ref.astype(np.float64)).to(DEV)


def close(out: torch.Tensor, ref: torch.Tensor, tol: float) -> bool:
    return float((out.double() - ref).abs().max() / ref.abs().max()) < tol


@needs_kernels
@pytest.mark.parametrize("fmt,n,k", [("q8_0", 40, 96), ("q2_k", 19, 256), ("q3_k", 22, 512), ("q4_k", 37, 512), ("q5_k", 21, 512),
                                   ("q6_k", 24, 256), ("iq4_xs", 17, 512)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", ["tile", "blocks"])
def test_one_token_kernel_reads_the_blocks_in_place(fmt, n, k, dtype, form, monkeypatch):
    force_kernel_form(monkeypatch, form)
    w, ref = kept(fmt, n, k, seed=n + k)
    w.dtype = dtype
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(1)).to(DEV, dtype)
    out = packed.linear(x, w)
    assert out.shape == (1, n) and out.dtype == dtype
    assert close(out, x.double() @ ref.T, 1e-5 if dtype == torch.float32 else 1e-2)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2)).to(DEV, dtype)
    assert close(packed.linear(x, w, bias), x.double() @ ref.T + bias.double(), 1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("fmt,n,k", [("q8_0", 40, 96), ("q2_k", 19, 256), ("q3_k", 22, 512), ("q4_k", 37, 512), ("q5_k", 21, 512),
                                   ("q6_k", 24, 256), ("iq4_xs", 17, 512)])
def test_prompt_rows_are_the_dequantized_matrix_in_chunks(fmt, n, k, monkeypatch):
    w, ref = kept(fmt, n, k, seed=3 * n + k)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(4)).to(DEV)
    whole = packed.linear(x, w)
    monkeypatch.setattr(packed, "CHUNK_BYTES", 7 * k * 4)  # 7 rows a piece: the last one shorter
    assert close(packed.linear(x, w), whole.double(), 1e-6)
    assert close(whole, x.double() @ ref.T, 1e-5)
    assert torch.equal(w.dequantize(), torch.cat([w.dequantize(0, 10), w.dequantize(10)]))


@needs_kernels
@pytest.mark.parametrize("fmt,n,k", [("q8_0", 33, 288), ("q3_k", 10, 256), ("q4_k", 40, 512), ("q5_k", 12, 256),
                                   ("q6_k", 9, 256)])
def test_dequantizing_kernel_is_gguf_py_dequantization(fmt, n, k):
    w, ref = kept(fmt, n, k, seed=5 * n + k)
    w.dtype = torch.float32
    assert torch.allclose(w._dequantize_kernel().double(), ref, rtol=1e-6, atol=1e-7)
    w.dtype = torch.bfloat16
    out, want = w._dequantize_kernel(), ref.float().to(torch.bfloat16)
    if DEV == "cuda":  # rounded to nearest, as a dequantized copy is
        assert torch.equal(out, want)
    else:  # the interpreter's bfloat16 conversion truncates: within one unit in the last place
        assert bool(((out.double() - ref).abs() <= ref.abs() * 2.0 ** -7 + 1e-30).all())


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k"])
def test_embedding_rows_and_fused_rows(fmt):
    w, ref = kept(fmt, 20, 256, seed=7)
    ids = torch.tensor([[3, 0, 19], [3, 7, 7]], device=DEV)
    rows = packed.embedding(ids, w)
    assert rows.shape == (2, 3, 256)
    assert torch.allclose(rows.double(), ref[ids], rtol=1e-6, atol=1e-7)
    other, _ = kept("q6_k" if fmt == "q4_k" else "q8_0", 6, 256, seed=8)
    fused, views = packed.cat_rows([w, other])
    assert fused.shape == (26, 256)
    assert [v.shape for v in views] == [(20, 256), (6, 256)]
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(9)).to(DEV)
    both = packed.linear(x, fused)
    assert torch.allclose(both[:, :20], packed.linear(x, w), rtol=1e-5, atol=1e-6)
    assert packed.nbytes(fused) == packed.nbytes(w) + packed.nbytes(other)
    with pytest.raises(ValueError, match="cannot keep"):
        Packed("q4_k", w.parts, 100)


@needs_kernels
@pytest.mark.parametrize("fmt,k", [("q8_0", 64), ("q4_k", 256)])
def test_stacks_dequantized_by_the_kernel_are_the_pytorch_decoders(fmt, k):
    """Stacked kept experts ``[E, N, bytes]`` (the bus's staging, the rows a prompt gathers): one
    kernel over all rows gives PyTorch's decoding, in float32."""
    from workbench.engine import blocks

    w, _ = kept(fmt, 3 * 10, k, seed=11)
    parts = [p.reshape(3, 10, -1) for p in w.parts]
    out = packed.dequantize_blocks(fmt, parts, k, torch.float32, kernel=True)
    assert out.shape == (3, 10, k)
    assert torch.allclose(out, blocks.dequantize(fmt, parts, k, torch.float32), rtol=1e-6, atol=1e-8)


@needs_kernels
def test_a_dense_kernel_that_fails_turns_only_itself_off(monkeypatch):
    """The matrix-vector kernel failing to build: dequantized rows instead, the other Triton kernels
    stay on."""
    monkeypatch.setattr(packed, "_off", {})
    monkeypatch.setattr(gpu_kernels, "_disabled", [])

    class Broken:
        configs: list = []
        cache: dict = {}

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                packed._dequant_kernel[(1, 1)](*args[:3], 1, 32, 32, BLOCK_N=3, BLOCK_K=96, FMT=1)
            return launch

    monkeypatch.setattr(packed, "_matvec_kernel", Broken())
    w, ref = kept("q8_0", 16, 64, seed=5)
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(6)).to(DEV)
    assert close(packed.linear(x, w), x.double() @ ref.T, 1e-5)
    assert "matvec" in packed._off and gpu_kernels.available()
    assert close(packed.linear(x, w), x.double() @ ref.T, 1e-5)  # and stays off without trying again


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n,k", [(128, 2048), (60, 200), (7, 1000)])
def test_a_routers_one_token_product_matches_torch(dtype, n, k):
    """``packed.float_matvec`` (a MoE router's product at one token) on float rows."""
    if not gpu_kernels.usable(torch.empty(0, device=DEV)):
        pytest.skip("needs Triton and CUDA (or TRITON_INTERPRET=1)")
    if DEV == "cpu" and k > 1024 and dtype == torch.float32:
        pytest.skip("the interpreter is slow at this size")
    g = torch.Generator(device=DEV).manual_seed(n + k)
    w = (torch.randn(n, k, device=DEV, generator=g) / k ** 0.5).to(dtype)
    x = torch.randn(1, k, device=DEV, generator=g).to(dtype)
    out = packed.float_matvec(x, w)
    ref = x.double() @ w.double().T
    assert out.dtype == dtype and out.shape == (1, n)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(out.double(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("n,k", [(64, 300), (40, 1024), (16, 96)])
def test_the_matvec_that_reads_its_first_weights_early_is_right(n, k):
    """``_matvec_kernel``'s ``PRELOAD`` form (float rows: the first ``BLOCK_K`` values loaded before
    the input, as it runs with programmatic dependent launch) against PyTorch, with the rest of a
    row in further blocks, a single partial block, and rows past ``N`` masked."""
    if not gpu_kernels.usable(torch.empty(0, device=DEV)):
        pytest.skip("needs Triton and CUDA (or TRITON_INTERPRET=1)")
    g = torch.Generator(device=DEV).manual_seed(n + k)
    w = (torch.randn(n, k, device=DEV, generator=g) / k ** 0.5).to(torch.bfloat16)
    x = torch.randn(1, k, device=DEV, generator=g).to(torch.bfloat16)
    out = torch.full((1, n), 7.0, dtype=torch.bfloat16, device=DEV)
    packed._matvec_kernel.fn[((n + 15) // 16,)](x, w, w, out, n, k, w.stride(0), BLOCK_N=16, BLOCK_K=256, FMT=0,
                                                TILE=False, PRELOAD=True)
    ref = x.double() @ w.double().T
    assert torch.allclose(out.double(), ref, rtol=1e-2, atol=1e-2)


def test_a_float_projection_of_one_token_runs_on_the_matvec_where_asked(monkeypatch):
    """``WORKBENCH_DENSE_MATVEC=1``: ``linear`` gives a float matrix's one-token product (with its bias)
    to the Triton matvec, which agrees with ``F.linear``; prompts, other dtypes and ``=0`` keep
    ``F.linear``. On CUDA this runs with programmatic dependent launch where the GPU has it."""
    if not gpu_kernels.usable(torch.empty(0, device=DEV)):
        pytest.skip("needs Triton and CUDA (or TRITON_INTERPRET=1)")
    g = torch.Generator(device=DEV).manual_seed(3)
    w = (torch.randn(256, 128, device=DEV, generator=g) / 128 ** 0.5).to(torch.bfloat16)
    b = torch.randn(256, device=DEV, generator=g).to(torch.bfloat16)
    x = torch.randn(2, 128, device=DEV, generator=g).to(torch.bfloat16)
    monkeypatch.setenv("WORKBENCH_DENSE_MATVEC", "1")
    assert packed.dense_matvec(x[:1], w) and not packed.dense_matvec(x, w)
    assert not packed.dense_matvec(x[:1], w.float())
    assert not packed.dense_matvec(torch.ones(1, 256, dtype=w.dtype, device=DEV), w.T.contiguous())  # more inputs than rows
    calls, plain = [], packed.float_matvec
    monkeypatch.setattr(packed, "float_matvec", lambda *a: calls.append(a) or plain(*a))
    out = packed.linear(x[:1], w, b)
    assert calls and out.shape == (1, 256) and out.dtype == torch.bfloat16
    ref = x[:1].double() @ w.double().T + b.double()
    assert torch.allclose(out.double(), ref, rtol=2e-2, atol=2e-2)
    monkeypatch.setenv("WORKBENCH_DENSE_MATVEC", "0")
    assert not packed.dense_matvec(x[:1], w)
