"""Session fixtures shared by every test package: tiny real models, built once per test session.

``tiny_model_dir(model_type, **overrides) -> Path``
    A folder saved by ``save_pretrained`` holding a random-init fp32 transformers model of
    ``model_type`` (a key of ``tests.tiny_models.FAMILY_CONFIGS``: ``mixtral``, ``qwen2_moe``,
    ``qwen3_moe``, ``olmoe``, ``llama4_text``, ``deepseek_v2``, ``deepseek_v3``, ``gpt_oss``) or of
    ``tests.tiny_models.DENSE_CONFIGS`` (``llama`` with tied embeddings, ``qwen3``), seed 0.
    ``overrides`` change config values (e.g. ``hidden_size=256``); each distinct call is built once
    and cached for the session. Treat the folder as read-only.

``tiny_gguf(model_type, tensor_type="F32", **overrides) -> Path``
    A GGUF copy of ``tiny_model_dir(model_type, **overrides)`` written by
    ``workbench.core.gguf_writer.write_gguf`` with llama.cpp's names, stacked experts, metadata and
    per-architecture transforms (see that module's docstring). ``tensor_type`` is one of
    ``gguf_writer.TENSOR_TYPES`` (``F32``, ``F16``, ``BF16``, ``Q8_0``, ``Q4_0``...). Cached too.

``tiny_hf_model(model_type, **overrides)``
    The transformers model object that was saved to ``tiny_model_dir`` (eval mode), for comparisons.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

if importlib.util.find_spec("triton") is not None and os.environ.get("WORKBENCH_TEST_DEVICE", "cpu") == "cpu":
    # No GPU: the engine's Triton kernels (workbench/engine/gpu_kernels.py) run in Triton's CPU
    # interpreter, so their decode paths are checked against transformers here too. Set before any
    # module defines a kernel.
    os.environ.setdefault("TRITON_INTERPRET", "1")
# One autotuning candidate per kernel (``gpu_kernels.ONE_CONFIG``): on CUDA every candidate would
# compile for every shape the tests use; the tests that check the other forms pin them
# (``engine_helpers.force_kernel_form``).
os.environ.setdefault("WORKBENCH_AUTOTUNE", "0")


def _key(model_type: str, overrides: dict) -> str:
    return model_type + "".join(f"-{k}={overrides[k]}" for k in sorted(overrides))


@pytest.fixture(scope="session")
def _tiny_cache(tmp_path_factory):
    return {"dirs": {}, "models": {}, "ggufs": {}, "root": tmp_path_factory.mktemp("tiny_models")}


@pytest.fixture(scope="session")
def tiny_model_dir(_tiny_cache):
    def make(model_type: str, **overrides) -> Path:
        key = _key(model_type, overrides)
        if key not in _tiny_cache["dirs"]:
            from tests.tiny_models import build_hf_model

            out = _tiny_cache["root"] / key
            _tiny_cache["models"][key] = build_hf_model(model_type, out, **overrides)
            _tiny_cache["dirs"][key] = out
        return _tiny_cache["dirs"][key]

    return make


@pytest.fixture(scope="session")
def tiny_hf_model(_tiny_cache, tiny_model_dir):
    def get(model_type: str, **overrides):
        tiny_model_dir(model_type, **overrides)
        return _tiny_cache["models"][_key(model_type, overrides)]

    return get


@pytest.fixture(scope="session")
def tiny_gguf(_tiny_cache, tiny_model_dir):
    def make(model_type: str, tensor_type: str = "F32", **overrides) -> Path:
        key = (_key(model_type, overrides), tensor_type)
        if key not in _tiny_cache["ggufs"]:
            from workbench.core.gguf_writer import write_gguf

            src = tiny_model_dir(model_type, **overrides)
            out = _tiny_cache["root"] / f"{key[0]}-{tensor_type}.gguf"
            main, _, down = tensor_type.partition("+")  # "Q4_K+Q6_K": expert down matrices in Q6_K
            if main == "MXFP4":  # gpt-oss's files: experts in MXFP4, the rest float
                _tiny_cache["ggufs"][key] = write_gguf(src, out, "F32", expert_type="MXFP4")[0]
            else:
                _tiny_cache["ggufs"][key] = write_gguf(src, out, main, expert_down_type=down or None)[0]
        return _tiny_cache["ggufs"][key]

    return make


@pytest.fixture
def one_torch_thread():
    """PyTorch on one thread during one test (the engine's own worker threads beside it), restored after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def exact_cpu_dots():
    """The fused CPU kernel's exact float dots for k-quant experts during one test (the int8 dots,
    the default where the CPU has AVX512-VNNI, round the inputs: ``cpu_kernel.int8_dots``)."""
    from workbench.engine import cpu_kernel

    was = cpu_kernel.int8_dots()
    cpu_kernel.int8_dots(False)
    yield
    cpu_kernel.int8_dots(was)


@pytest.fixture(params=["f32 dots", "int8 dots"])
def quant_dots(request):
    """The fused CPU kernel's dots for k-quant experts during one test: the exact float ones (False),
    or the int8 ones (True; skipped where the build has neither AVX512-VNNI nor AVX2). The setting is restored after."""
    from workbench.engine import cpu_kernel

    if not cpu_kernel.available():
        pytest.skip(f"fused CPU kernel unavailable here: {cpu_kernel.unavailable_reason()}")
    was = cpu_kernel.int8_dots()
    int8 = request.param == "int8 dots"
    if cpu_kernel.int8_dots(int8) != int8:
        cpu_kernel.int8_dots(was)
        pytest.skip("the int8 dots need AVX-512 with VNNI, or AVX2")
    yield int8
    cpu_kernel.int8_dots(was)
