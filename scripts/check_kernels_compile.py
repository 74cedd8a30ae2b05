"""Compile every Triton kernel the engine launches for a CUDA GPU, without one.

A kernel that does not build on the GPU machine costs a whole call there; this catches that here.
Two steps, two processes:

1. ``record``: run tests (pytest arguments after ``--``) with the kernels in Triton's interpreter,
   writing each kernel launch's signature (the argument types, the ``constexpr`` values and the
   launch options) once to a JSON file.
2. ``compile``: compile each recorded signature with the real compiler for ``--arch`` (90: Hopper),
   every autotuning candidate of the kernel (the interpreter runs only the first), and where the
   kernel takes ``PDL``, with programmatic dependent launch as well, each with the divisibility
   hints Triton's launcher gives the arguments (addresses and integers divisible by 16). It stops at the GPU binary
   (Triton's wheels carry ``ptxas``): a kernel that compiles can still compute wrongly; only the
   CUDA tests (``scripts/bench_device.sh``) say that. The argument types are the tests' (float32
   activations on the CPU, where a GPU run has bf16 ones).

To check against the GPU machine's Triton, install that version beside this one and put it first
on ``PYTHONPATH`` for step 2, e.g.::

    python scripts/check_kernels_compile.py record --out /tmp/sigs.json -- tests/engine/test_gpu_kernels.py
    pip install --target /tmp/t36 --no-deps triton==3.6.0
    PYTHONPATH=/tmp/t36 python scripts/check_kernels_compile.py compile /tmp/sigs.json
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64", "int64": "i64",
         "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1"}
OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "launch_pdl")


def _arg(value, constexpr: bool):
    """(type, value) of one launch argument as ``ASTSource`` takes it: ``("constexpr", v)`` for a
    ``tl.constexpr`` parameter or None, else the pointer or scalar type; None where it has no form."""
    import torch

    if constexpr or value is None:
        return ("constexpr", value) if value is None or isinstance(value, (bool, int, float, str)) else None
    if isinstance(value, torch.Tensor):
        name = str(value.dtype).removeprefix("torch.")
        return ("*" + TYPES[name], None) if name in TYPES else None
    if isinstance(value, bool):
        return ("i1", None)
    if isinstance(value, int):
        return ("i32" if -2**31 <= value < 2**31 else "i64", None)
    if isinstance(value, float):
        return ("fp32", None)
    return None


def _divisible(value) -> bool:
    """Whether Triton's launcher would mark ``value`` divisible by 16 (``tt.divisibility``), as it
    specializes every launch: a tensor whose address is, an integer that is. The compiler's passes
    see those hints, and one of them can fail only with them (the routing kernel's layout pass did
    on Triton 3.6.0: BENCHMARKS.md, sixteenth stop)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.data_ptr() % 16 == 0
    return isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0


def record(out: Path, pytest_args: list[str]) -> int:
    """Run ``pytest_args`` under Triton's interpreter and write each kernel's launch signatures to
    ``out``: ``[{"module", "name", "sig": {arg: type}, "constexprs": {arg: value}, "options": {...}}]``."""
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ.setdefault("WORKBENCH_TEST_DEVICE", "cpu")
    import pytest
    from triton.runtime import interpreter

    seen: dict[str, dict] = {}
    skipped: set[str] = set()  # kernels with an argument of no form here
    run = interpreter.InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        fn = self.fn
        params = inspect.signature(fn).parameters
        bound = inspect.signature(fn).bind_partial(*args, **{k: v for k, v in kwargs.items() if k in params})
        bound.apply_defaults()
        sig, const, divisible = {}, {}, []
        for name, value in bound.arguments.items():
            form = _arg(value, "constexpr" in str(params[name].annotation))
            if form is None:
                skipped.add(f"{fn.__name__} ({name}: {type(value).__name__})")
                break
            sig[name] = form[0]
            if form[0] == "constexpr":
                const[name] = form[1]
            elif _divisible(value):
                divisible.append(name)
        else:
            entry = {"module": fn.__module__, "name": fn.__name__, "sig": sig, "constexprs": const,
                     "options": {k: kwargs[k] for k in OPTIONS if k in kwargs}, "divisible": divisible}
            seen.setdefault(json.dumps(entry, sort_keys=True), entry)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.run = recording_run
    try:
        rc = pytest.main(["-q", "-p", "no:cacheprovider", *pytest_args])
    finally:
        interpreter.InterpretedFunction.run = run
    out.write_text(json.dumps(list(seen.values()), indent=1))
    for what in sorted(skipped):
        print(f"not recorded: {what}")
    print(f"recorded {len(seen)} kernel signatures of "
          f"{len({(e['module'], e['name']) for e in seen.values()})} kernels into {out} (pytest rc {int(rc)})")
    return int(rc)


def _kernel(module: str, name: str):
    """The kernel ``module.name`` as the JIT function and its autotuning candidates (``[None]``: none)."""
    import triton

    obj = getattr(importlib.import_module(module), name)
    configs = None
    while not isinstance(obj, triton.runtime.jit.JITFunction):
        if configs is None and hasattr(obj, "configs"):
            configs = list(obj.configs)
        obj = obj.fn
    return obj, configs or [None]


def compile_all(path: Path, arch: int) -> int:
    """Compile each signature in ``path`` for ``cuda`` compute capability ``arch``, every candidate
    and PDL form; print one line per kernel and return the number of failures."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    entries = json.loads(path.read_text())
    target = GPUTarget("cuda", arch, 32)
    failures = 0
    done: set[str] = set()
    for e in entries:
        fn, configs = _kernel(e["module"], e["name"])
        ok = n = 0
        for config in configs:
            for pdl in (False, True) if "PDL" in fn.arg_names and arch >= 90 else (False,):
                sig, const, opts = dict(e["sig"]), dict(e["constexprs"]), dict(e["options"])
                if config is not None:
                    for k, v in config.all_kwargs().items():
                        (opts if k in OPTIONS else const)[k] = v
                if pdl:
                    const["PDL"], opts["launch_pdl"] = True, True
                for k in const:
                    sig[k] = "constexpr"
                key = json.dumps([e["module"], e["name"], sig, const, opts], sort_keys=True, default=str)
                if key in done:
                    continue
                done.add(key)
                n += 1
                hints = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in e.get("divisible", ())
                         if k not in const}  # as the launcher specializes them on the GPU
                src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()},
                                attrs=hints)
                try:
                    triton.compile(src, target=target, options={k: v for k, v in opts.items() if v is not None})
                    ok += 1
                except Exception as exc:  # a kernel that does not build: report it, go on with the rest
                    failures += 1
                    print(f"FAILED {e['name']} {const} {opts}: {type(exc).__name__}: {str(exc)[:2000]}")
        if n:
            print(f"{e['name']}: {ok} of {n} forms compiled")
    print(f"Triton {triton.__version__}, sm_{arch}: {failures} failed")
    return failures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="run tests under the interpreter, record the kernels' signatures")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("pytest_args", nargs="*", help="after --: pytest's arguments")
    c = sub.add_parser("compile", help="compile the recorded signatures for a CUDA GPU")
    c.add_argument("signatures", type=Path)
    c.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for Hopper")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    os.chdir(ROOT)
    if args.cmd == "record":
        return record(args.out, args.pytest_args)
    return 1 if compile_all(args.signatures, args.arch) else 0


if __name__ == "__main__":
    sys.exit(main())
