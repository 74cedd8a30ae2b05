"""Every autotuning candidate of the one-token kernels checked against PyTorch before it is timed.

Triton's autotuner times each candidate form (block sizes, warps, how a row of blocks is decoded)
at the first call per shape and keeps the fastest, whatever it computes. On the H200 with Triton
3.6 some candidates that are right under Triton's interpreter computed wrong sums at some shapes
(``scripts/check_kernel_candidates.py``, BENCHMARKS.md 2026-12-04): the fastest of them was the
autotuner's pick. So at the first call per shape ``run_checked`` runs each candidate alone on probe
inputs, compares it with a PyTorch computation of the same output, drops the ones that disagree or
do not build (a warning names them), and only then lets the autotuner time the others. Where no
candidate agrees it raises ``CandidatesWrong``, which the callers treat as a kernel that does not
build here: their PyTorch paths take over.

Under Triton's interpreter with one candidate per kernel (the test suite) there is nothing to choose
and no check; during CUDA graph capture there is none either (the eager warm-up before capture
meets every shape first).
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

CHECK_TOL = 6e-2
"""Largest error of a candidate's output, relative to the largest value of the reference, that
passes: bfloat16 rounding gives up to ~5e-3 at one token and ~2.5e-2 for the prompt kernel (its
weights and activations rounded to bfloat16, the largest of 64 x 2048 errors); the wrong candidates
seen on the H200 were off by 0.18 to 1.5."""

MAX_TRIES = 64
"""Combinations of the kernels' candidates tried for a first one that agrees."""

_checked: set = set()
_unfinite: dict = {}  # shape key -> probes that were not finite
UNFINITE_TRIES = 3
"""Probes of one shape that may come out not finite (e.g. a random model's overflowing activations)
before its candidates are left unchecked; each try costs a reference computation."""
"""Shape keys whose candidates were checked in this process."""

dropped: list[str] = []
"""What the checks of this process dropped, one ``"<shape key>: <candidate>"`` each (the bench's
JSON reports them with each run)."""


class CandidatesWrong(RuntimeError):
    """No combination of the kernels' autotuning candidates computed the reference on this GPU."""


def _name(config) -> str:
    return " ".join(f"{k}={v}" for k, v in config.kwargs.items()) + f" warps={config.num_warps}"


def needs_check(kernels: list, key) -> bool:
    """Whether ``key``'s candidates are still to be checked: not yet in this process, not while a
    CUDA graph is being captured, and not under the interpreter with one candidate per kernel."""
    if key in _checked:
        return False
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return False
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    return not (interpreted and all(len(k.configs) <= 1 for k in kernels))


def run_checked(kernels: list, launch: Callable, key, probe: Callable, failed_here: Callable) -> object:
    """``launch()``, after the first call per shape ``key`` checked the candidates of the autotuned
    ``kernels`` (those one ``launch`` runs) with ``probe() -> (run, reference)``: ``run()`` runs the
    kernels on probe inputs and returns their output, ``reference`` is that output computed by
    PyTorch (any shape, float). Candidates whose output is off by more than ``CHECK_TOL`` or that
    raise a Triton failure (``failed_here``) are dropped from ``kernel.configs``; the autotuner's
    earlier picks for other shapes stay (each was checked at its own shape). Raises
    ``CandidatesWrong`` if no combination agrees."""
    if needs_check(kernels, key):
        _check(kernels, key, probe, failed_here)
    return launch()


def _check(kernels: list, key, probe: Callable, failed_here: Callable) -> None:
    run, ref = probe()
    ref = ref.float()
    if not bool(torch.isfinite(ref).all()):  # activations or weights that are not numbers: nothing to compare
        _unfinite[key] = _unfinite.get(key, 0) + 1
        if _unfinite[key] >= UNFINITE_TRIES:  # the next calls would pay for the probe again and again
            _checked.add(key)
            log.warning("the probes of %s were not finite %d times: its kernels' candidates stay unchecked",
                        key, UNFINITE_TRIES)
        return
    bound = CHECK_TOL * max(float(ref.abs().max()), 1e-30)
    lists = [list(k.configs) for k in kernels]
    caches = [k.cache for k in kernels]

    def agrees(combo: tuple) -> bool:
        for k, c in zip(kernels, combo):
            k.configs, k.cache = [c], {}
        try:
            out = run()
        except Exception as exc:  # a candidate that does not build or launch here
            if not failed_here(exc):
                raise
            log.info("candidate %s failed here: %s", [_name(c) for c in combo], str(exc)[:200])
            return False
        return bool(float((out.float() - ref).abs().max()) <= bound)  # NaN fails

    try:
        base = next((c for c in itertools.islice(itertools.product(*lists), MAX_TRIES) if agrees(c)), None)
        if base is None:
            raise CandidatesWrong(f"no autotuning candidate of the one-token kernels computed {key} right here")
        keep = [[c for c in options if c is base[i] or agrees(base[:i] + (c,) + base[i + 1:])]
                for i, options in enumerate(lists)]
    finally:
        for k, configs, cache in zip(kernels, lists, caches):
            k.configs, k.cache = configs, cache
    for k, options, kept in zip(kernels, lists, keep):
        k.configs = kept
        wrong = [_name(c) for c in options if c not in kept]
        dropped.extend(f"{key}: {w}" for w in wrong)
        if wrong:
            log.warning("dropped %d autotuning candidate(s) that computed %s wrong or failed on this GPU: %s",
                        len(wrong), key, "; ".join(wrong))
    _checked.add(key)
