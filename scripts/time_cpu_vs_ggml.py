#!/usr/bin/env python3
"""Our fused CPU experts against llama.cpp's (ggml) on this machine's CPU, one token's experts.

Both sides compute a decode step's ``k`` routed experts (gate, up, SwiGLU, down) of a pool of
``--experts`` stacked experts larger than the caches, ``k`` distinct experts drawn at random per
call, on the same number of threads: ggml through ``scripts/csrc/ggml_experts.c`` (MUL_MAT_ID with
its persistent thread pool, built here against ggml's static CPU libraries:
``scripts/build_llamacpp.sh ggml-cpu``, or a ``cpu`` / ``build`` build), ours through ``cpu_kernel`` as the engine calls it,
for quantized formats with the int8 dots and with the exact float ones. Medians after a tenth of
the calls, in ms per call and GB/s of expert weights.

    scripts/build_llamacpp.sh ggml-cpu && python scripts/time_cpu_vs_ggml.py --threads 1,2
    python scripts/time_cpu_vs_ggml.py --formats q4_k,q5_k,q8_0 --threads 15 --json out.json
    # both sides' AVX2 code (a CPU without AVX-512):
    GGML_AVX2_ONLY=1 scripts/build_llamacpp.sh ggml-cpu && WORKBENCH_CPU_KERNEL_MARCH=haswell \
        python scripts/time_cpu_vs_ggml.py --ggml-build .llamacpp/build-ggml-avx2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from workbench.engine import cpu_kernel  # noqa: E402
from workbench.engine.calibrate import random_stacks, run_fused  # noqa: E402


def build_ggml_side(build: Path, out: Path) -> Path:
    """``ggml_experts`` compiled against ``build``'s libggml-cpu.a and libggml-base.a."""
    libs = [next(build.rglob(name), None) for name in ("libggml-cpu.a", "libggml-base.a")]
    if None in libs:
        raise SystemExit(f"no static ggml libraries under {build}: run scripts/build_llamacpp.sh ggml-cpu first")
    include = ROOT / ".llamacpp" / "llama.cpp" / "ggml" / "include"
    exe = out / "ggml_experts"
    subprocess.run(["gcc", "-O2", "-o", str(exe), str(ROOT / "scripts" / "csrc" / "ggml_experts.c"), f"-I{include}",
                    *map(str, libs), "-lstdc++", "-lm", "-lpthread", "-fopenmp"], check=True)
    return exe


def time_ggml(exe: Path, fmt: str, experts: int, threads: int, calls: int, hidden: int, ffn: int, k: int) -> dict:
    line = subprocess.run([str(exe), fmt, str(experts), str(threads), str(calls), str(hidden), str(ffn), str(k)],
                          check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
    return json.loads(line)


def time_ours(fmt: str, stacks: list[torch.Tensor], experts: int, threads: int, calls: int, hidden: int,
              k: int, int8: bool) -> float:
    """Median seconds per call of the fused kernel (``int8``: the int8 dots for quantized formats)."""
    torch.set_num_threads(threads)
    cpu_kernel.int8_dots(int8)
    g = torch.Generator().manual_seed(threads)
    x = torch.randn(hidden, generator=g).to(torch.bfloat16)
    w = torch.full((k,), 1.0 / k)
    took = []
    for _ in range(calls):
        rows = torch.randperm(experts, generator=g)[:k]
        t = time.perf_counter()
        run_fused(fmt, stacks, x, rows, w)
        took.append(time.perf_counter() - t)
    return statistics.median(took[calls // 10:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="bf16,q8_0,q4_k")
    ap.add_argument("--threads", default=str(max(1, (os.cpu_count() or 2) - 1)), help="comma-separated counts")
    ap.add_argument("--experts", type=int, default=96, help="pool size (Qwen3-30B-A3B shape: 96 bf16 = 0.9 GB)")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("-k", type=int, default=8, help="experts per call")
    ap.add_argument("--ggml-build", type=Path, help="a ggml or llama.cpp build directory (default: the first of "
                                                     ".llamacpp/build-ggml, build-cpu, build-cuda)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if os.environ.get(cpu_kernel.ENV_MARCH):
        print(f"our kernel built with -march={os.environ[cpu_kernel.ENV_MARCH]}")
    if not cpu_kernel.available():
        raise SystemExit(f"fused CPU kernel unavailable: {cpu_kernel.unavailable_reason()}")
    dirs = [ROOT / ".llamacpp" / d for d in ("build-ggml", "build-cpu", "build-cuda")]
    build = a.ggml_build or next((d for d in dirs if d.is_dir()), dirs[0])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        exe = build_ggml_side(build, Path(tmp))
        for fmt in a.formats.split(","):
            stacks = random_stacks(fmt, a.experts, a.hidden, a.ffn)
            nbytes = a.k * sum(t.numel() * t.element_size() for t in stacks) / a.experts
            for threads in (int(t) for t in a.threads.split(",")):
                ggml = time_ggml(exe, fmt, a.experts, threads, a.calls, a.hidden, a.ffn, a.k)
                row = {"format": fmt, "threads": threads, "bytes_per_call": nbytes, "ggml_s": ggml["median_s"],
                       "ggml_bytes_per_call": ggml["bytes_per_call"]}
                row["ours_s"] = time_ours(fmt, stacks, a.experts, threads, a.calls, a.hidden, a.k, True)
                if fmt != "bf16" and cpu_kernel.int8_dots():
                    row["ours_exact_s"] = time_ours(fmt, stacks, a.experts, threads, a.calls, a.hidden, a.k, False)
                    row["ours_int8_dots"] = True
                rows.append(row)
                exact = f", exact dots {1e3 * row['ours_exact_s']:.3f} ms" if "ours_exact_s" in row else ""
                print(f"{fmt:5s} {threads:3d} threads: ggml {1e3 * row['ggml_s']:.3f} ms "
                      f"({nbytes / row['ggml_s'] / 1e9:.1f} GB/s), ours {1e3 * row['ours_s']:.3f} ms "
                      f"({nbytes / row['ours_s'] / 1e9:.1f} GB/s){exact}; ggml / ours {row['ggml_s'] / row['ours_s']:.2f}",
                      flush=True)
    cpu_kernel.int8_dots(True)
    if a.json:
        a.json.write_text(json.dumps({"experts": a.experts, "k": a.k, "hidden": a.hidden, "ffn": a.ffn,
                                      "calls": a.calls, "march": os.environ.get(cpu_kernel.ENV_MARCH, "native"),
                                      "ggml_build": str(build), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
