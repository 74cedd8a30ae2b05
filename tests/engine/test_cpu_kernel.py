"""The fused CPU decode kernel against a float64 torch reference on the same weights."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.engine.engine_helpers import random_kquant
from workbench.engine import cpu_kernel


@pytest.fixture(scope="module")
def kernel():
    if not cpu_kernel.available():
        pytest.skip(f"fused CPU decode kernel unavailable here: {cpu_kernel.unavailable_reason()}")
    return cpu_kernel


def reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, rows: torch.Tensor,
              weights: torch.Tensor) -> torch.Tensor:
    """``sum_j weights[j] * w2[rows[j]] @ (silu(g) * u)`` in float64 from the same values."""
    i = w2.shape[2]
    out = torch.zeros(w2.shape[1], dtype=torch.float64)
    for r, wt in zip(rows.tolist(), weights.tolist()):
        h = w13[r].double() @ x.double()
        out += wt * (w2[r].double() @ (F.silu(h[:i]) * h[i:]))
    return out


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).abs().max() / ref.abs().max()).item()


def random_experts(e: int, h: int, i: int, dtype: torch.dtype, gen: torch.Generator):
    w13 = (torch.randn(e, 2 * i, h, generator=gen) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=gen) / i**0.5).to(dtype)
    return w13, w2


CASES = [(dtype, n, h, i) for dtype in (torch.bfloat16, torch.float32) for n in (1, 2, 8)
         for h, i in ((64, 32), (192, 96))]
CASES += [(torch.float32, n, 2048, 768) for n in (1, 2, 8)]
CASES += [(torch.bfloat16, 3, 100, 36)]  # lengths that are not a multiple of the vector width
CASES += [(torch.float16, n, 192, 96) for n in (1, 8)] + [(torch.float16, 3, 100, 36)]


@pytest.mark.parametrize("dtype,n,h,i", CASES)
def test_matches_float64_reference(kernel, dtype, n, h, i):
    gen = torch.Generator().manual_seed(1000 * n + h + i)
    e = 8
    w13, w2 = random_experts(e, h, i, dtype, gen)
    x = torch.randn(h, generator=gen).to(dtype)
    rows = torch.randint(0, e, (n,), generator=gen)  # repeats allowed
    weights = torch.randn(n, generator=gen) * 2  # any sum, any sign
    y = kernel.moe_decode(x, w13, w2, rows, weights)
    assert y.shape == (h,) and y.dtype == torch.float32
    # f32 accumulation throughout: bf16 inputs get f32 accuracy too (the brief asks < 1e-2 for them)
    assert relative_error(y, reference(x, w13, w2, rows, weights)) < 1e-5


def test_uses_torch_intra_op_threads(kernel):
    """at::parallel_for runs in parallel inside the extension (it is serial without OpenMP) and
    follows torch.set_num_threads."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert kernel._module.parallel_threads() == 2
        torch.set_num_threads(1)
        assert kernel._module.parallel_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_repeated_rows_add_up(kernel):
    gen = torch.Generator().manual_seed(7)
    w13, w2 = random_experts(4, 64, 32, torch.float32, gen)
    x = torch.randn(64, generator=gen)
    once = kernel.moe_decode(x, w13, w2, torch.tensor([2]), torch.tensor([1.5]))
    twice = kernel.moe_decode(x, w13, w2, torch.tensor([2, 2]), torch.tensor([1.0, 0.5]))
    torch.testing.assert_close(twice, once, rtol=1e-5, atol=1e-6)


def test_matches_the_engine_decode_ops(kernel):
    """Same result as the five torch ops the engine's CPU tier runs per expert today (bf16)."""
    gen = torch.Generator().manual_seed(3)
    h, i = 256, 128
    w13, w2 = random_experts(6, h, i, torch.bfloat16, gen)
    x = torch.randn(1, h, generator=gen).to(torch.bfloat16)
    rows, weights = torch.tensor([5, 0, 3]), torch.tensor([0.5, 0.3, 0.2])
    out = torch.zeros(1, h, dtype=torch.float32)
    for r, wt in zip(rows.tolist(), weights.tolist()):
        g = F.linear(x, w13[r])
        out.add_(F.linear(F.silu(g[:, :i]).mul_(g[:, i:]), w2[r]).float(), alpha=wt)
    y = kernel.moe_decode(x[0], w13, w2, rows, weights)
    assert relative_error(y, out[0].double()) < 2e-2  # the torch ops round to bf16 after each op


def test_numpy_rows_and_bf16_weights(kernel):
    gen = torch.Generator().manual_seed(4)
    w13, w2 = random_experts(3, 64, 32, torch.float32, gen)
    x = torch.randn(64, generator=gen)
    y = kernel.moe_decode(x, w13, w2, torch.tensor([1, 2]).numpy(), torch.tensor([0.25, 0.75]).to(torch.bfloat16))
    ref = reference(x, w13, w2, torch.tensor([1, 2]), torch.tensor([0.25, 0.75]))
    assert relative_error(y, ref) < 1e-5


def test_no_rows_gives_zeros(kernel):
    w13, w2 = torch.ones(2, 64, 64), torch.ones(2, 64, 32)
    y = kernel.moe_decode(torch.ones(64), w13, w2, torch.empty(0, dtype=torch.int64), torch.empty(0))
    assert torch.equal(y, torch.zeros(64))


@pytest.mark.parametrize("bad,match", [
    (dict(rows=torch.tensor([0, 4])), r"rows\[1\] = 4 is outside \[0, 4\)"),
    (dict(rows=torch.tensor([1, -1])), r"rows\[1\] = -1 is outside"),
    (dict(x=torch.ones(32)), "x must be"),
    (dict(w2=torch.ones(4, 64, 32, dtype=torch.bfloat16)), "both be bfloat16, float16 or float32"),
    (dict(w13=torch.ones(4, 64, 64, dtype=torch.float64), w2=torch.ones(4, 64, 32, dtype=torch.float64)),
     "both be bfloat16, float16 or float32"),
    (dict(w2=torch.ones(4, 64, 16)), "w2 must be"),
    (dict(w13=torch.ones(4, 64, 64).transpose(1, 2)), "contiguous"),
    (dict(weights=torch.ones(3)), "weights must be"),
])
def test_bad_input_is_refused_before_reading(kernel, bad, match):
    args = dict(x=torch.ones(64), w13=torch.ones(4, 64, 64), w2=torch.ones(4, 64, 32), rows=torch.tensor([0, 1]),
                weights=torch.ones(2))
    args.update(bad)
    with pytest.raises(RuntimeError, match=match):
        kernel.moe_decode(**args)


def test_runs_without_the_gil(kernel):
    """Another Python thread keeps running while one kernel call computes."""
    gen = torch.Generator().manual_seed(5)
    w13, w2 = random_experts(4, 2048, 768, torch.float32, gen)
    x, weights = torch.randn(2048, generator=gen), torch.ones(64)
    rows = torch.arange(4).repeat(16)  # 1.2 GB of weight reads: tens of ms
    ticks = []
    done = threading.Event()

    def tick():
        while not done.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.0005)

    t = threading.Thread(target=tick)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # leave a core to the ticking thread
    t.start()
    try:
        time.sleep(0.01)
        start = time.perf_counter()
        kernel.moe_decode(x, w13, w2, rows, weights)
        end = time.perf_counter()
    finally:
        done.set()
        t.join()
        torch.set_num_threads(threads)
    during = [s for s in ticks if start < s < end]
    assert len(during) >= 5, f"{len(during)} ticks in {1000 * (end - start):.0f} ms of kernel call"


@pytest.mark.parametrize("fmt", ["bf16", "q8_0"])
def test_a_background_run_returns_at_once_and_gives_the_same_result(kernel, fmt):
    """The run starts on the extension's thread; this thread goes on (no GIL needed there) and
    ``wait`` hands over the same sum as a call on this thread."""
    gen = torch.Generator().manual_seed(6)
    w13, w2 = random_experts(4, 2048, 768, torch.bfloat16, gen)
    x, weights = torch.randn(2048, generator=gen), torch.rand(1024, generator=gen)
    rows = torch.arange(4).repeat(256)  # 1024 dots per weight row: tens of ms on the int8 dots too
    if fmt == "q8_0":
        def q8(w):  # symmetric int8 per 32 values, as GGUF Q8_0 stores them
            b = w.float().reshape(*w.shape[:-1], -1, 32)
            d = (b.abs().amax(-1) / 127).clamp_min(1e-8).half()
            return (b / d.float()[..., None]).round().to(torch.int8).reshape(w.shape), d
        args = (*q8(w13), *q8(w2))
        run = lambda bg: kernel.moe_decode_q8(x, *args, rows, weights, background=bg)  # noqa: E731
    else:
        run = lambda bg: kernel.moe_decode(x, w13, w2, rows, weights, background=bg)  # noqa: E731
    inline = run(0)
    start = time.perf_counter()
    pending = run(1)
    returned = time.perf_counter() - start
    kernel.wait()
    took = time.perf_counter() - start
    assert returned < took / 4, f"returned after {1e3 * returned:.1f} ms of {1e3 * took:.1f}"
    assert torch.equal(pending, inline)
    kernel.wait()  # nothing running: returns at once


def test_background_runs_of_two_threads_do_not_replace_each_other(kernel):
    """The extension holds one background job: a second thread's start waits for the first's
    ``wait`` instead of replacing its job (two engines decoding at once)."""
    gen = torch.Generator().manual_seed(7)
    w13, w2 = random_experts(4, 256, 128, torch.float32, gen)
    xs = [torch.randn(256, generator=gen) for _ in range(2)]
    rows, weights = torch.tensor([0, 3, 1]), torch.rand(3, generator=gen)
    expect = [kernel.moe_decode(x, w13, w2, rows, weights) for x in xs]
    bad = []

    def decode(j):
        for _ in range(50):
            y = kernel.moe_decode(xs[j], w13, w2, rows, weights, background=1)
            time.sleep(0.0002)  # other work while it runs
            kernel.wait()
            if not torch.equal(y, expect[j]):
                bad.append(j)

    threads = [threading.Thread(target=decode, args=(j,)) for j in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad


def test_takes_says_which_weights_the_kernel_accepts():
    w13, w2 = torch.ones(4, 64, 32, dtype=torch.bfloat16), torch.ones(4, 32, 32, dtype=torch.bfloat16)
    assert cpu_kernel.takes(w13, w2)
    assert cpu_kernel.takes(w13.half(), w2.half()) and cpu_kernel.takes(w13.float(), w2.float())
    assert not cpu_kernel.takes(w13.double(), w2.double())
    assert not cpu_kernel.takes(w13, w2.float())
    assert not cpu_kernel.takes(w13, torch.ones(4, 32, 16, dtype=torch.bfloat16))
    assert not cpu_kernel.takes(w13.transpose(0, 1), w2)


def _fresh_python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def test_env_var_disables_without_building(tmp_path):
    code = ("import logging, sys; logging.basicConfig(level=logging.WARNING)\n"
            "from workbench.engine import cpu_kernel\n"
            "assert cpu_kernel.available() is False and cpu_kernel.available() is False\n"
            "assert 'torch.utils.cpp_extension' not in sys.modules\n"
            "print(cpu_kernel.unavailable_reason())\n")
    proc = _fresh_python(code, WORKBENCH_CPU_KERNEL="0", WORKBENCH_CPU_KERNEL_DIR=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "WORKBENCH_CPU_KERNEL=0" in proc.stdout
    assert proc.stderr.count("WARNING") == 1  # one line, even when asked twice
    assert not any(tmp_path.iterdir())


def test_missing_compiler_is_one_warning_not_an_error(tmp_path):
    code = ("import logging; logging.basicConfig(level=logging.WARNING)\n"
            "from workbench.engine import cpu_kernel\n"
            "assert not cpu_kernel.available() and not cpu_kernel.available()\n"
            "try:\n"
            "    cpu_kernel.moe_decode(None, None, None, [], [])\n"
            "except RuntimeError as exc:\n"
            "    print('refused:', exc)\n")
    proc = _fresh_python(code, CXX=str(tmp_path / "no-such-c++"), WORKBENCH_CPU_KERNEL_DIR=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "WARNING" in line]
    assert len(warnings) == 1 and "no C++ compiler" in warnings[0], proc.stderr
    assert "refused: the fused CPU decode kernel is unavailable: no C++ compiler" in proc.stdout


def test_a_build_lock_left_by_a_killed_build_does_not_hang(kernel, tmp_path):
    """torch waits forever on the lock file of an interrupted build; ours removes it under an flock.
    (The fresh process also checks that importing the engine's modules builds nothing.) On a copy of
    the build, so that other processes using the kernel meanwhile cannot touch its lock."""
    built = cpu_kernel.build_dir()
    copy = tmp_path / built.name
    shutil.copytree(built, copy, ignore=shutil.ignore_patterns("lock", "*.lock"))  # keeps times: no rebuild
    stale = copy / "lock"
    stale.touch()
    proc = _fresh_python("import sys\nfrom workbench.engine import cpu_kernel, experts\n"
                         "assert cpu_kernel._module is None and cpu_kernel._failed is None\n"
                         "assert 'torch.utils.cpp_extension' not in sys.modules\n"
                         "assert cpu_kernel.available()\n", WORKBENCH_CPU_KERNEL_DIR=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert not stale.exists()


def test_a_compile_error_is_one_warning_with_the_compiler_message(kernel, tmp_path):
    """(Needs a working toolchain, hence the fixture.)"""
    broken = tmp_path / "broken.cpp"
    broken.write_text("#error this source does not compile\n")
    code = ("import logging; logging.basicConfig(level=logging.WARNING)\n"
            "from pathlib import Path\n"
            "from workbench.engine import cpu_kernel\n"
            f"cpu_kernel.SOURCE = Path({str(broken)!r})\n"
            "assert not cpu_kernel.available() and not cpu_kernel.available()\n"
            "print(cpu_kernel.unavailable_reason())\n")
    proc = _fresh_python(code, WORKBENCH_CPU_KERNEL_DIR=str(tmp_path / "build"))
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "WARNING" in line]
    assert len(warnings) == 1, proc.stderr
    assert "error: #error this source does not compile" in warnings[0]


def _q8_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w [..., N, K]`` quantized by gguf-py to Q8_0 -> ``(q int8 [..., N, K], d float16 [..., N, K/32],
    gguf's own dequantization float64)``."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    rows = w.reshape(-1, w.shape[-1]).numpy().astype(np.float32)
    raw = quantize(rows, GGMLQuantizationType.Q8_0)  # [rows, K/32 * 34] uint8
    blocks = raw.reshape(rows.shape[0], -1, 34)
    d = torch.from_numpy(np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0]).reshape(*w.shape[:-1], -1)
    q = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:]).view(np.int8)).reshape(w.shape)
    ref = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q8_0).astype(np.float64)).reshape(w.shape)
    return q, d, ref


@pytest.mark.parametrize("H,ffn,rows", [(64, 32, [0, 2, 2]), (2048, 768, [5, 1, 7, 3, 0, 6, 2, 4]), (96, 64, [1])])
def test_q8_0_matches_ggufs_dequantization(kernel, quant_dots, H, ffn, rows):
    """The f32 dots match gguf-py's dequantization to float32 precision; the int8 dots compute it
    against the inputs rounded to int8 per 32 values (``check_block_dots``), for rows of 32 + 64 m
    values too (the integer dot's last block alone)."""
    gen = torch.Generator().manual_seed(H + ffn)
    w13, w2 = random_experts(8, H, ffn, torch.float32, gen)
    q13, d13, r13 = _q8_0(w13)
    q2, d2, r2 = _q8_0(w2)
    x = torch.randn(H, generator=gen).to(torch.bfloat16)
    weights = torch.rand(len(rows), generator=gen) + 0.5
    y = kernel.moe_decode_q8(x, q13, d13, q2, d2, torch.tensor(rows), weights)
    assert y.dtype == torch.float32
    check_block_dots(y, x, r13, r2, rows, weights, quant_dots)


@pytest.mark.parametrize("bad,match", [
    (dict(q13=torch.ones(4, 64, 64)), "q13 must be int8"),
    (dict(d2=torch.ones(4, 64, 2, dtype=torch.float16)), "d13 must be float16"),
    (dict(rows=torch.tensor([0, 4])), r"rows\[1\] = 4 is outside \[0, 4\)"),
    (dict(x=torch.ones(32)), "x must be"),
])
def test_q8_0_bad_input_is_refused(kernel, bad, match):
    args = dict(x=torch.ones(64), q13=torch.ones(4, 64, 64, dtype=torch.int8),
                d13=torch.ones(4, 64, 2, dtype=torch.float16), q2=torch.ones(4, 64, 32, dtype=torch.int8),
                d2=torch.ones(4, 64, 1, dtype=torch.float16), rows=torch.tensor([0, 1]), weights=torch.ones(2))
    args.update(bad)
    with pytest.raises(RuntimeError, match=match):
        kernel.moe_decode_q8(**args)


def int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """``x [..., K]`` as the int8 dots see it: per 32 values ``dx * round(x / dx)``, ``dx = max|x| / 127``
    in float32 (round half to even, as the CPU rounds)."""
    shape = x.shape
    x = x.float().reshape(-1, 32)
    dx = x.abs().amax(1, keepdim=True) / 127
    q = torch.where(dx > 0, torch.round(x / torch.where(dx > 0, dx, torch.ones_like(dx))), torch.zeros_like(x))
    return (q * dx).reshape(shape)


def block_reference(x, r13, r2, rows, weights, int8: bool) -> torch.Tensor:
    """The experts of dequantized ``r13 [E, 2I, H]``, ``r2 [E, H, I]`` in float64, with the inputs and the
    activations rounded as the int8 dots round them when ``int8``."""
    ffn = r2.shape[2]
    ref = torch.zeros(r2.shape[1], dtype=torch.float64)
    xin = int8_rounded(x) if int8 else x
    for r, wt in zip(rows, weights.double().tolist()):
        h = r13[r] @ xin.double()
        a = torch.nn.functional.silu(h[:ffn]) * h[ffn:]
        ref += wt * (r2[r] @ (int8_rounded(a.float()).double() if int8 else a))
    return ref


def check_block_dots(y, x, r13, r2, rows, weights, int8: bool) -> None:
    """``y`` of experts kept in blocks against their dequantization ``r13``, ``r2`` (float64): to float32
    precision for the f32 dots; for the int8 dots, to float32 precision against the inputs rounded as
    the kernel rounds them (allowing a value rounded the other way where the kernel's f32 activations
    and the float64 ones straddle a rounding boundary), within about 1% of the unrounded inputs'."""
    exact = block_reference(x, r13, r2, rows, weights, int8=False)
    if not int8:
        assert relative_error(y, exact) < 1e-5
        return
    assert relative_error(y, block_reference(x, r13, r2, rows, weights, int8=True)) < 5e-4
    assert relative_error(y, exact) < 3e-2


@pytest.mark.parametrize("H,ffn,rows,fmt13,fmt2", [
    (256, 256, [0, 2, 2], "q4_k", "q4_k"), (2048, 768, [3, 1, 0, 2], "q4_k", "q4_k"), (512, 256, [1], "q4_k", "q4_k"),
    (256, 256, [0, 3], "q4_k", "q6_k"), (512, 256, [2, 1], "q6_k", "q6_k"),  # Q4_K_M: some down matrices in Q6_K
    (512, 256, [2, 0, 3], "q5_k", "q5_k"), (256, 512, [1, 1], "q5_k", "q6_k"),  # Q5_K_M likewise
    (512, 256, [3, 1], "q3_k", "q4_k"), (256, 512, [0, 2, 1], "q2_k", "q3_k"),  # Q3_K_M, Q2_K
    (256, 256, [1], "q3_k", "q3_k"), (256, 256, [2], "q2_k", "q2_k"),
    (512, 256, [0, 3, 1], "iq4_xs", "iq4_xs"), (256, 512, [2], "iq4_xs", "q6_k"),  # IQ4_XS
    (2880, 96, [0, 3, 1], "mxfp4", "mxfp4"), (160, 64, [2, 2], "mxfp4", "mxfp4"),  # MXFP4: gpt-oss's 2880 = 22.5 x 128
])
@pytest.mark.parametrize("x_type", ["bf16", "f32 bf16-exact", "f32"])
def test_q4_k_matches_ggufs_dequantization(kernel, quant_dots, H, ffn, rows, fmt13, fmt2, x_type):
    """The f32 dots: inputs a bfloat16 holds exactly (as bf16, or as the f32 the decode server's
    packet carries) take the bf16 dot products on CPUs with AVX512-BF16, other f32 inputs the f32
    ones: both match gguf-py's dequantization to float32 precision. The int8 dots: see
    ``check_block_dots``."""
    gen = torch.Generator().manual_seed(H + ffn)
    E = 4
    b13, r13 = random_kquant(fmt13, E * 2 * ffn, H, gen)
    b2, r2 = random_kquant(fmt2, E * H, ffn, gen)
    b13, r13 = b13.reshape(E, 2 * ffn, -1), r13.reshape(E, 2 * ffn, H)
    b2, r2 = b2.reshape(E, H, -1), r2.reshape(E, H, ffn)
    x = torch.randn(H, generator=gen).to(torch.bfloat16)
    if x_type != "bf16":
        x = x.float() if x_type == "f32 bf16-exact" else x.float() + torch.randn(H, generator=gen) * 1e-4
    weights = torch.rand(len(rows), generator=gen) + 0.5
    y = kernel.moe_decode_q4k(x, b13, b2, torch.tensor(rows), weights, fmt13, fmt2)
    check_block_dots(y, x, r13, r2, rows, weights, quant_dots)


def test_q4_k_bad_input_is_refused(kernel):
    b13, b2 = torch.zeros(2, 512, 144, dtype=torch.uint8), torch.zeros(2, 256, 144, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match=r"rows\[0\] = 2 is outside"):
        kernel.moe_decode_q4k(torch.ones(256), b13, b2, torch.tensor([2]), torch.ones(1))
    with pytest.raises(RuntimeError, match="H a multiple of 256"):
        kernel.moe_decode_q4k(torch.ones(128), b13, b2, torch.tensor([0]), torch.ones(1))


_Q4K_CALL = ("b13 = torch.randint(0, 256, (3, 512, 1152), dtype=torch.uint8, generator=g)\n"
             "b2 = torch.randint(0, 256, (3, 2048, 144), dtype=torch.uint8, generator=g)\n"
             "for b in (b13, b2):\n"  # small positive float16 scales d, dmin
             "    v = b.view(-1, 144)\n"
             "    v[:, :4] = torch.from_numpy(np.full((v.shape[0], 2), 1e-3, np.float16).view(np.uint8))\n"
             "y = cpu_kernel.moe_decode_q4k(x, b13, b2, rows, wts, tokens=tok)\n")
_BF16_CALL = ("w13 = (torch.randn(3, 512, 2048, generator=g) * 0.02).to(torch.bfloat16)\n"
              "w2 = (torch.randn(3, 2048, 256, generator=g) * 0.02).to(torch.bfloat16)\n"
              "y = cpu_kernel.moe_decode(x, w13, w2, rows, wts, tokens=tok)\n")


@pytest.mark.parametrize("call", [_Q4K_CALL, _BF16_CALL], ids=["q4_k", "bf16"])
def test_bf16_dots_can_be_turned_off_and_agree_with_the_f32_ones(kernel, tmp_path, call):
    """``WORKBENCH_CPU_BF16_DOT=0`` keeps bf16 inputs on the f32 dot products (Q4_K and bf16 gate/up
    rows); both give the same sums up to their order (same products, f32 additions)."""
    code = ("import sys, numpy as np, torch\n"
            "from workbench.engine import cpu_kernel\n"
            "g = torch.Generator().manual_seed(3)\n"
            "x = torch.randn(2, 2048, generator=g).to(torch.bfloat16)\n"
            "rows, wts, tok = torch.tensor([0, 2, 1]), torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0, 0, 1])\n"
            + call +
            f"np.save({str(tmp_path)!r} + '/y' + sys.argv[-1] + '.npy', y.numpy())\n")
    for name, env in (("on", {}), ("off", {"WORKBENCH_CPU_BF16_DOT": "0"})):
        env = {**env, "WORKBENCH_CPU_INT8_DOT": "0"}  # the Q4_K rows' float dots, not the integer ones
        proc = subprocess.run([sys.executable, "-c", code, name], capture_output=True, text=True, timeout=300,
                              env={**os.environ, **env})
        assert proc.returncode == 0, proc.stderr
    on, off = np.load(tmp_path / "yon.npy"), np.load(tmp_path / "yoff.npy")
    assert np.abs(off).max() > 0
    assert np.abs(on - off).max() <= 1e-5 * np.abs(off).max()


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {f for line in text.splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split()}


def test_the_avx2_build_passes_the_block_formats_tests(kernel, tmp_path):
    """CPUs without AVX-512 (most desktop Intel parts, Zen 3 and older) get the kernel's AVX2 code: built
    here with ``-march=haswell`` (``WORKBENCH_CPU_KERNEL_MARCH``) in a fresh directory, its f32 and
    int8 dots pass the Q8_0, k-quant (Q2_K to Q6_K) and IQ4_XS tests, decode and prompts, none skipped."""
    if not {"avx2", "fma", "f16c"} <= _cpu_flags():
        pytest.skip("needs an x86 CPU with AVX2, FMA and F16C")
    here = Path(__file__)
    tests = [f"{here}::test_q8_0_matches_ggufs_dequantization", f"{here}::test_q4_k_matches_ggufs_dequantization",
             f"{here.parent / 'test_cpu_kernel_prompt.py'}::test_k_quant_prompt_matches_ggufs_dequantization",
             f"{here.parent / 'test_cpu_kernel_prompt.py'}::test_q8_0_prompt_matches_ggufs_dequantization",
             f"{here.parent / 'test_cpu_kernel_prompt.py'}::test_each_token_of_a_prompt_matches_its_own_decode_call"]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *tests],
                          capture_output=True, text=True, timeout=900, cwd=here.parents[2],
                          env={**os.environ, cpu_kernel.ENV_MARCH: "haswell", cpu_kernel.ENV_BUILD_DIR: str(tmp_path)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "the int8 dots need" not in proc.stdout  # the int8 dots ran
    assert list(tmp_path.iterdir()), "built in the fresh directory"


def test_the_read_ahead_settings_change_no_result(kernel):
    """``WORKBENCH_CPU_PREFETCH_BYTES`` / ``_HINT`` (read once at load) move only where the integer
    dots' prefetches land: Q8_0 and Q4_K experts give the same bits under each setting."""
    code = ("import hashlib, torch\n"
            "from workbench.engine import cpu_kernel\n"
            "from workbench.engine.calibrate import random_stacks, run_fused\n"
            "assert cpu_kernel.available(), cpu_kernel.unavailable_reason()\n"
            "x = torch.randn(256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)\n"
            "for f in ('q8_0', 'q4_k'):\n"
            "    y = run_fused(f, random_stacks(f, 6, 256, 256), x, torch.tensor([4, 0, 5]), torch.tensor([0.5, 0.3, 0.2]))\n"
            "    assert y.abs().sum() > 0\n"
            "    print(f, hashlib.sha256(y.numpy().tobytes()).hexdigest())\n")
    outs = []
    for env in ({}, {"WORKBENCH_CPU_PREFETCH_BYTES": "0"},
                {"WORKBENCH_CPU_PREFETCH_BYTES": "8192", "WORKBENCH_CPU_PREFETCH_HINT": "1"},
                {"WORKBENCH_CPU_PREFETCH_BYTES": "100", "WORKBENCH_CPU_PREFETCH_HINT": "3"}):
        proc = _fresh_python(code, **env)
        assert proc.returncode == 0, proc.stderr
        outs.append(proc.stdout)
    assert outs[0].count("\n") == 2 and all(o == outs[0] for o in outs)
