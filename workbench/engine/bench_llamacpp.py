"""Run llama.cpp's ``llama-bench`` on a GGUF file under given placements and measure its peak memory.

Each configuration runs in its own ``llama-bench`` process (prompt ``-p`` and generation ``-n``
tests, ``-r`` repeats, JSON output) while :class:`PeakSampler` records the peak GPU memory NVML
reports for that process and its peak resident host memory, so the budget is checked the same way
as for our engine.
"""

from __future__ import annotations

import json
import logging
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from workbench.core.errors import WorkbenchError
from workbench.engine.bench_measure import PeakSampler

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LlamaConfig:
    """One llama.cpp placement: ``label`` and the extra ``llama-bench`` arguments."""

    label: str
    args: tuple[str, ...]


def n_cpu_moe(n: int) -> LlamaConfig:
    """All layers on the GPU except the routed experts of the first ``n`` layers (in RAM)."""
    return LlamaConfig(f"--n-cpu-moe {n}", ("-ngl", "99", "--n-cpu-moe", str(n)))


def all_gpu() -> LlamaConfig:
    return LlamaConfig("all on GPU", ("-ngl", "99"))


def override(label: str, pattern: str) -> LlamaConfig:
    """``-ngl 99 -ot PATTERN`` (``PATTERN`` like ``blk\\.(0|1)\\.ffn_.*_exps=CPU``)."""
    return LlamaConfig(label, ("-ngl", "99", "-ot", pattern))


def layers_regex(layers: list[int]) -> str:
    """A regex alternative matching exactly these layer numbers, e.g. ``(0|1|2)``."""
    return "(" + "|".join(str(i) for i in layers) + ")"


def ot_variants(around: int) -> list[LlamaConfig]:
    """``-ot`` placements finer than ``--n-cpu-moe``: the routed experts of layers
    ``0..around-2`` in RAM plus the up+down (or only the down) experts of layer ``around-1``."""
    full = list(range(around - 1))
    if not full:
        return []
    part = around - 1
    base = rf"blk\.{layers_regex(full)}\.ffn_.*_exps=CPU"
    return [
        override(f"-ot {len(full)} layers + up/down of layer {part}", f"{base};blk\\.{part}\\.ffn_(up|down)_exps=CPU"),
        override(f"-ot {len(full)} layers + down of layer {part}", f"{base};blk\\.{part}\\.ffn_down_exps=CPU"),
    ]


@dataclass
class LlamaResult:
    """One configuration's outcome: tokens/s (mean and sd over repeats, as llama-bench reports),
    peak GPU/host memory (bytes) and whether it ran."""

    label: str
    args: list[str]
    ok: bool
    prefill_tps: float | None = None
    prefill_sd: float | None = None
    decode_tps: float | None = None
    decode_sd: float | None = None
    prefill_samples: list[float] = field(default_factory=list)
    decode_samples: list[float] = field(default_factory=list)
    peak_gpu_bytes: float | None = None
    peak_gpu_device_bytes: float | None = None
    peak_host_bytes: float | None = None
    seconds: float = 0.0
    error: str = ""
    raw: list = field(default_factory=list)

    def to_json(self) -> dict:
        return dict(self.__dict__)


def parse_output(text: str) -> list[dict]:
    """The JSON array ``llama-bench -o json`` prints (log lines around it are skipped)."""
    start, end = text.find("["), text.rfind("]")
    if start < 0 or end < start:
        raise WorkbenchError("llama-bench printed no JSON results")
    return json.loads(text[start:end + 1])


def run_config(binary: str | Path, model: str | Path, cfg: LlamaConfig, *, prompt: int = 512,
               gen: int = 128, repeats: int = 3, threads: int = 16, timeout: float = 300.0,
               extra: tuple[str, ...] = ()) -> LlamaResult:
    """Run one ``llama-bench`` process for ``cfg`` and measure it."""
    cmd = [str(binary), "-m", str(model), "-p", str(prompt), "-n", str(gen), "-r", str(repeats),
           "-t", str(threads), "-o", "json", *cfg.args, *extra]
    log.info("running %s", " ".join(cmd))
    t0 = time.perf_counter()
    res = LlamaResult(cfg.label, list(cfg.args), ok=False)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with PeakSampler(proc.pid) as sampler:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            res.error = f"timed out after {timeout:.0f} s"
    res.seconds = time.perf_counter() - t0
    pk = sampler.peaks
    res.peak_gpu_bytes, res.peak_gpu_device_bytes, res.peak_host_bytes = pk.gpu, pk.gpu_device, pk.host_rss
    if proc.returncode != 0 or res.error:
        res.error = res.error or f"exit {proc.returncode}: {err.strip().splitlines()[-3:] if err else ''}"
        return res
    try:
        res.raw = parse_output(out)
    except (WorkbenchError, json.JSONDecodeError) as e:
        res.error = f"{e}; stderr tail: {err[-500:]}"
        return res
    for t in res.raw:
        samples = [float(x) for x in t.get("samples_ts", [])]
        if int(t.get("n_gen", 0)) > 0:
            res.decode_tps, res.decode_sd, res.decode_samples = t.get("avg_ts"), t.get("stddev_ts"), samples
        elif int(t.get("n_prompt", 0)) > 0:
            res.prefill_tps, res.prefill_sd, res.prefill_samples = t.get("avg_ts"), t.get("stddev_ts"), samples
    res.ok = res.decode_tps is not None or res.prefill_tps is not None
    return res


def run_configs(binary, model, configs: list[LlamaConfig], *, deadline: float | None = None,
                est_seconds: float = 40.0, **kw) -> list[LlamaResult]:
    """Run ``configs`` in order; skip the rest once fewer than ``est_seconds`` remain before
    ``deadline`` (a ``time.monotonic()`` value)."""
    out = []
    for cfg in configs:
        if deadline is not None and deadline - time.monotonic() < est_seconds:
            log.warning("skipping %s: out of time", cfg.label)
            out.append(LlamaResult(cfg.label, list(cfg.args), ok=False, error="skipped: out of time"))
            continue
        r = run_config(binary, model, cfg, **kw)
        log.info("%s: pp %s tg %s peak GPU %s", cfg.label, r.prefill_tps, r.decode_tps, r.peak_gpu_bytes)
        out.append(r)
    return out


def best_within(results: list[LlamaResult], budget_bytes: float) -> LlamaResult | None:
    """The fastest-decoding configuration whose measured peak GPU memory fits the budget."""
    fits = [r for r in results if r.ok and r.decode_tps and r.peak_gpu_bytes is not None
            and r.peak_gpu_bytes <= budget_bytes]
    return max(fits, key=lambda r: r.decode_tps, default=None)
