#!/usr/bin/env python3
"""Do the bus's copies and the CPU's expert reads slow each other down when they run at once?

A hybrid prompt splits a layer's CPU-tier experts between the two lanes: the hottest are copied to
the accelerator (pinned host memory, the copy engine) while the CPU computes the coldest with the
fused kernel. The cost model overlaps the two lanes, each at its calibrated rate. Both lanes read
host RAM, so this measures, on one stack of ``--experts`` experts at S1's shape (huge pages and
page-locked in place, as the engine holds the CPU tier):

- the bus alone: every expert of the stack's second half copied to a device slot, one copy per
  tensor, as a prompt's fetch does (GB/s);
- the CPU alone: the fused kernel over the first half (one token, every expert once), on each of
  ``--threads`` thread counts (GB/s);
- both at once: the copies queued for about as long as the CPU's loop runs, each lane's rate over
  the time they overlapped.

    python scripts/time_bus_contention.py --threads 4,8,15 --json $OUT/contention.json
    python scripts/time_bus_contention.py --experts 16            # locally without CUDA: the CPU lane only
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workbench.engine import bus, cpu_kernel, hostmem  # noqa: E402


def stack(n: int, shape: tuple[int, int]) -> torch.Tensor:
    """``[n, *shape]`` bf16 on huge pages, every expert a copy of one random expert (filled in place;
    the lanes' rates do not depend on the values)."""
    t = hostmem.empty((n, *shape), torch.bfloat16)
    t[0].normal_(0, 0.02)
    for i in range(1, n):
        t[i].copy_(t[0])
    return t


def cpu_pass(x, w13, w2, rows, weights) -> float:
    """Seconds of one fused-kernel call over ``rows`` on this thread's intra-op threads."""
    t0 = time.perf_counter()
    cpu_kernel.moe_decode(x, w13, w2, rows, weights)
    return time.perf_counter() - t0


def cpu_alone(x, w13, w2, rows, weights, nbytes: float, seconds: float) -> float:
    """GB/s of the fused kernel over ``rows`` (``nbytes`` read per call), for about ``seconds``."""
    cpu_pass(x, w13, w2, rows, weights)
    done, spent = 0, 0.0
    while spent < seconds:
        spent += cpu_pass(x, w13, w2, rows, weights)
        done += 1
    return done * nbytes / spent / 1e9


def queue_copies(pairs, slots, stream, passes: int) -> list:
    """Queue ``passes`` passes of every ``(w13, w2)`` in ``pairs`` into ``slots`` on ``stream``; CUDA
    events before the first and after each pass."""
    events = [torch.cuda.Event(enable_timing=True)]
    with torch.cuda.stream(stream):
        events[0].record(stream)
        for _ in range(passes):
            for j, (a, b) in enumerate(pairs):
                s13, s2 = slots[j % len(slots)]
                s13.copy_(a, non_blocking=True)
                s2.copy_(b, non_blocking=True)
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(stream)
            events.append(ev)
    return events


def bus_rate(events, nbytes: float) -> float:
    """GB/s over the passes between ``events`` (``nbytes`` copied per pass)."""
    torch.cuda.synchronize()
    ms = events[0].elapsed_time(events[-1])
    return (len(events) - 1) * nbytes / (ms / 1e3) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=128, help="experts in the stack (half to each lane)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--threads", default="4,8,15", help="CPU thread counts, comma-separated")
    ap.add_argument("--seconds", type=float, default=1.5, help="per measurement")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not cpu_kernel.available():
        sys.exit(f"the fused CPU kernel is unavailable: {cpu_kernel.unavailable_reason()}")
    E, H, ffn = args.experts, args.hidden, args.ffn
    half = E // 2
    w13, w2 = stack(E, (2 * ffn, H)), stack(E, (H, ffn))
    per_expert = (w13[0].numel() + w2[0].numel()) * 2
    cuda = torch.cuda.is_available()
    if cuda:
        for t in (w13, w2):
            if not bus.register(t):
                sys.exit("could not page-lock the stacks")
    x = torch.randn(H, dtype=torch.bfloat16)
    rows = torch.arange(half)
    weights = torch.full((half,), 1.0 / half)
    cpu_bytes = half * per_expert
    out: dict = {"experts": E, "hidden": H, "ffn": ffn, "bytes_per_expert": per_expert,
                 "huge_pages": hostmem.huge_bytes(w13) > 0, "runs": []}
    bus_bytes = (E - half) * per_expert
    if cuda:
        dev = torch.device("cuda")
        pairs = [(w13[i], w2[i]) for i in range(half, E)]
        slots = [(torch.empty_like(w13[0], device=dev), torch.empty_like(w2[0], device=dev)) for _ in range(8)]
        stream = torch.cuda.Stream()
        bus_rate(queue_copies(pairs, slots, stream, 1), bus_bytes)  # warm
        t0 = time.perf_counter()
        alone = bus_rate(queue_copies(pairs, slots, stream, 5), bus_bytes)
        pass_s = (time.perf_counter() - t0) / 5
        out["bus_alone_gbs"] = alone
        print(f"bus alone: {alone:.1f} GB/s ({bus_bytes / 1e6:.0f} MB a pass, {len(pairs) * 2} copies)")
    for n in [int(v) for v in args.threads.split(",") if v.strip()]:
        torch.set_num_threads(n)
        cpu = cpu_alone(x, w13, w2, rows, weights, cpu_bytes, args.seconds)
        run = {"threads": n, "cpu_alone_gbs": cpu}
        line = f"threads {n:2d}: CPU alone {cpu:5.1f} GB/s"
        if cuda:
            passes = max(2, round(args.seconds / pass_s))
            events = queue_copies(pairs, slots, stream, passes)  # the copy engine runs on while the CPU reads
            spent, calls = 0.0, 0
            while not events[-1].query() or calls < 2:
                spent += cpu_pass(x, w13, w2, rows, weights)
                calls += 1
            both_bus = bus_rate(events, bus_bytes)
            both_cpu = calls * cpu_bytes / spent / 1e9
            run.update(bus_with_cpu_gbs=both_bus, cpu_with_bus_gbs=both_cpu)
            line += (f"; together: bus {both_bus:5.1f} GB/s ({both_bus / out['bus_alone_gbs']:.2f}x alone), "
                     f"CPU {both_cpu:5.1f} GB/s ({both_cpu / cpu:.2f}x alone), sum {both_bus + both_cpu:5.1f}")
        print(line, flush=True)
        out["runs"].append(run)
    if cuda:
        torch.cuda.synchronize()
        for t in (w13, w2):
            bus.unregister(t)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
