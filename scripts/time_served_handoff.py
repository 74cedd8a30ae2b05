#!/usr/bin/env python3
"""What does the decode server's hand-off cost per hybrid layer, beyond the CPU experts' own time?

Drives the native decode server (``cpu_kernel.server``, as ``served.DecodeServer`` does) from the
host instead of from a CUDA graph: for each of ``--layers`` layers per step, the host writes the
layer's packet (``--picks`` of the token's selections are the CPU's, the rest -1), stores the step
number in its ``flag_in`` and spins until ``flag_out`` holds it. It times, per layer (medians over
``--steps`` steps, microseconds):

- ``round trip``: packet written to result seen, with the CPU experts of the packet;
- ``kernel``: the same experts through the fused kernel called on this thread (``moe_decode``,
  ``moe_decode_q8``), on as many threads, once the server has stopped: what the CPU would take
  without the server;
- ``hand-off``: ``round trip - kernel``; with ``--picks 0`` the round trip is the hand-off alone.
  Across ``--picks`` the round trip's growth per pick is the weights' read, the rest is fixed: with
  two or more pick counts above 0 it prints that line's fixed cost per packet and cost per pick.

``--team spin,omp``: the server's passes on its own spinning threads, then on torch's OpenMP pool.

The experts come from one ``[E, ...]`` stack shared by every layer, ``E`` large enough that the
picks read RAM, not the caches (``--experts``, default 128 at the Qwen3-30B-A3B shape: 1.2 GB in
bf16). Packets live in page-locked memory where CUDA is present, as in the engine.

    python scripts/time_served_handoff.py --format bf16 --picks 0,1,2
    python scripts/time_served_handoff.py --format q8_0 --picks 0,1 --json out.json
    python scripts/time_served_handoff.py --format bf16 --picks 1,4 --every 1,0.4 --gap-us 70 --cpu-only

``--every 1,0.4``: the same with every layer's packet giving the CPU its picks, then 40% of them (the
rest empty, as in calibration's sixteenth run and a ``frequency`` placement's layers), to see
whether a sparse layer's round trip costs more than a busy one's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workbench.engine import cpu_kernel, served  # noqa: E402
from workbench.engine.calibrate import random_stacks, run_fused  # noqa: E402


def add_layers(srv, fmt: str, w: list[torch.Tensor], ffn: int, k: int, hidden: int, layers: int,
               pin: bool) -> list[tuple[torch.Tensor, ...]]:
    """``layers`` layers of ``srv`` over the stacks ``w``, each with its ``(packet, flag_in, out,
    flag_out)`` (page-locked with ``pin``), as ``served.DecodeServer`` gives them."""
    out = []
    for _ in range(layers):
        bufs = (torch.zeros(2 * k + hidden, dtype=torch.float32, pin_memory=pin),
                torch.zeros(1, dtype=torch.int64, pin_memory=pin),
                torch.zeros(hidden, dtype=torch.float32, pin_memory=pin),
                torch.zeros(1, dtype=torch.int64, pin_memory=pin))
        srv.add_layer(0 if fmt == "bf16" else 1, w, 0, 0, ffn, k, *bufs, *cpu_kernel.act_args(("silu",)))
        out.append(bufs)
    return out


def measure(fmt: str, layers: int, experts: int, hidden: int, ffn: int, k: int, picks: int, steps: int,
            threads: int, w: list[torch.Tensor], own_team: bool = True, every: float = 1.0, gap_s: float = 0.0) -> dict:
    """Per-layer medians (s) of the round trip through the server and of the direct kernel call.
    ``every``: the share of the layers whose packet gives the CPU its ``picks`` (drawn at random; the
    others' packets are empty, as a sparse placement's layers often are); the round trip is the
    median over the packets with picks, ``empty_trip_s`` over the others. ``gap_s``: the host waits
    that long between two layers' packets (the accelerator's own work of a layer)."""
    pin = torch.cuda.is_available()
    srv = cpu_kernel.server(threads, own_team=own_team, chunks=served.server_chunks())
    slots = [(packet.numpy(), flag_in.numpy(), flag_out.numpy())
             for packet, flag_in, _, flag_out in add_layers(srv, fmt, w, ffn, k, hidden, layers, pin)]
    srv.start()
    rng = np.random.default_rng(0)
    x = rng.standard_normal(hidden).astype(np.float32)
    trips, empty, kernels = [], [], []
    try:
        for step in range(1, steps + 1):
            for packet, flag_in, flag_out in slots:
                rows = np.full(k, -1.0, np.float32)
                busy = picks > 0 and rng.random() < every
                if busy:
                    rows[:picks] = rng.choice(experts, size=picks, replace=False)
                packet[:k] = rows
                packet[k:2 * k] = 1.0 / k
                packet[2 * k:] = x
                t = time.perf_counter()
                flag_in[0] = step
                while flag_out[0] != step:
                    pass
                done = time.perf_counter()
                (trips if busy or picks == 0 else empty).append((step, done - t))
                while time.perf_counter() - done < gap_s:
                    pass
        served_errors = srv.errors()
    finally:
        srv.stop()
    # the same work on this thread, for the kernel's own time: after the server has stopped, as its
    # team spins for a while after each packet and would share the cores with torch's pool (timed
    # between steps, the kernel alone came out slower than the round trip: 2,267 against 429 us)
    xt = torch.from_numpy(x)
    for _ in range(steps if picks else 0):
        chosen = rng.choice(experts, size=picks, replace=False)
        t = time.perf_counter()
        run_fused(fmt, w, xt, chosen, np.full(picks, 1.0 / k, np.float32))
        kernels.append(time.perf_counter() - t)
    trip = statistics.median([t for s, t in trips if s > 1] or [t for _, t in trips])  # the first step warms up
    kernel = statistics.median(kernels[1:]) if len(kernels) > 1 else 0.0
    return {"format": fmt, "picks": picks, "layers": layers, "threads": threads, "own_team": own_team,
            "every": every, "gap_s": gap_s, "round_trip_s": trip,
            "empty_trip_s": statistics.median([t for s, t in empty if s > 1]) if len(empty) > layers else None,
            "kernel_s": kernel, "handoff_s": trip - kernel, "errors": int(served_errors)}


def measure_cuda(layers: int, hidden: int, ffn: int, k: int, steps: int, threads: int, w: list[torch.Tensor],
                 fmt: str, own_team: bool = False) -> dict:
    """Per-layer seconds of the accelerator's side of the hand-off, as a decode step's CUDA graph has
    it, with packets that give the CPU nothing to compute: the packet's and the step number's copies
    into page-locked memory, then ``served._wait_add_kernel`` polling the result flag and adding the
    result. Against the same graph without them (one small kernel per layer). ``skipped``: the same
    graph when the publishing kernel has told the wait that the packet holds no CPU pairs (the
    decode server's case for such packets: it adds nothing and does not poll)."""
    dev = torch.device("cuda")
    srv = cpu_kernel.server(threads, own_team=own_team, chunks=served.server_chunks())
    step = torch.zeros(1, dtype=torch.int64, device=dev)
    status = torch.zeros(1, dtype=torch.int32, device=dev)
    host = torch.ones(1, dtype=torch.int32, device=dev)  # the CPU's pairs as the publishing kernel counted them
    acc = torch.zeros(hidden, dtype=torch.bfloat16, device=dev)
    pieces = [(torch.full((2 * k + hidden,), -1.0, dtype=torch.float32, device=dev), *bufs)
              for bufs in add_layers(srv, fmt, w, ffn, k, hidden, layers, pin=True)]
    block = min(1024, 1 << (hidden - 1).bit_length())

    def handoff() -> None:
        step.add_(1)
        for packet_dev, packet, flag_in, out, flag_out in pieces:
            acc.mul_(1.0)  # the layer's own work, here one small kernel
            packet.copy_(packet_dev, non_blocking=True)
            flag_in.copy_(step, non_blocking=True)
            served._wait_add_kernel[(1,)](flag_out, step, out, acc, status, host, hidden, int(10e9), BLOCK_H=block)

    def plain() -> None:
        step.add_(1)
        for _ in pieces:
            acc.mul_(1.0)

    srv.start()
    try:
        out = {}
        for name, body, pairs in (("with", handoff, 1), ("skipped", handoff, 0), ("without", plain, 1)):
            host.fill_(pairs)
            body()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                body()
            times = []
            for _ in range(steps):
                t = time.perf_counter()
                g.replay()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
            out[name] = statistics.median(times[2:]) / layers
        if int(status[0]):
            raise RuntimeError("a wait timed out")
    finally:
        srv.stop()
    return {"gpu_handoff_s": out["with"] - out["without"], "gpu_skipped_s": out["skipped"] - out["without"],
            "graph_layer_s": out["without"]}


def per_pick_fit(rows: list[dict]) -> tuple[float, float] | None:
    """``(fixed s, s per pick)``: the least-squares line through the round trips of ``rows`` (two or
    more pick counts above 0) against their picks, or None."""
    picks = np.array([r["picks"] for r in rows], dtype=float)
    if np.unique(picks).size < 2:
        return None
    slope, fixed = np.polyfit(picks, np.array([r["round_trip_s"] for r in rows]), 1)
    return float(fixed), float(slope)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--format", default="bf16", choices=["bf16", "q8_0"])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--picks", default="0,1,2", help="CPU selections per packet, a list (0,1,2)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=None, help="server threads (default: as the engine's)")
    ap.add_argument("--team", default="spin,omp",
                    help="the server's passes on its own spinning threads (spin), on torch's OpenMP pool (omp), or both")
    ap.add_argument("--every", default="1",
                    help="shares of the layers whose packet gives the CPU its picks, a list (1,0.4: every layer, "
                         "then 40%% of them at random, the rest empty: a sparse placement's layers)")
    ap.add_argument("--gap-us", type=float, default=0.0,
                    help="the host waits this long between two layers' packets (a layer's own GPU work, ~70 us)")
    ap.add_argument("--cpu-only", action="store_true", help="skip the accelerator's side of the hand-off")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    try:
        shares = [float(v) for v in args.every.split(",")]
    except ValueError:
        shares = []
    if not shares or not all(0 < v <= 1 for v in shares):
        ap.error(f"--every takes shares above 0 and at most 1, not {args.every!r}")
    if not cpu_kernel.available():
        print(f"the fused CPU kernel is unavailable: {cpu_kernel.unavailable_reason()}")
        return 1
    threads = args.threads or served.server_threads()
    torch.set_num_threads(threads)
    w = random_stacks(args.format, args.experts, args.hidden, args.ffn)
    rows = []
    for team in args.team.split(","):
        for every in shares:
            for picks in (int(p) for p in args.picks.split(",")):
                r = measure(args.format, args.layers, args.experts, args.hidden, args.ffn, args.top_k, picks,
                            args.steps, threads, w, own_team=team == "spin", every=every, gap_s=args.gap_us * 1e-6)
                rows.append(r)
                sparse = "" if every >= 1 or picks == 0 else (
                    f" (picks in {every:.0%} of the layers; the empty ones {r['empty_trip_s'] * 1e6:.1f} us)"
                    if r["empty_trip_s"] is not None else f" (picks in {every:.0%} of the layers)")
                print(f"{args.format} {team} picks {picks}: round trip {r['round_trip_s'] * 1e6:8.1f} us, kernel "
                      f"{r['kernel_s'] * 1e6:8.1f} us, hand-off {r['handoff_s'] * 1e6:7.1f} us per layer "
                      f"({threads} threads, {r['errors']} errors){sparse}", flush=True)
        fit = per_pick_fit([r for r in rows if r.get("own_team") == (team == "spin") and r.get("picks", 0) > 0
                            and r.get("every") == shares[0]])
        if fit is not None:
            rows.append({"format": args.format, "team": team, "fixed_s": fit[0], "per_pick_s": fit[1]})
            per = sum(t.numel() * t.element_size() for t in w) / args.experts  # bytes of one expert
            print(f"{args.format} {team} round trips over picks: {fit[0] * 1e6:.1f} us fixed per packet, "
                  f"{fit[1] * 1e6:.1f} us per pick ({per / fit[1] / 1e9:.1f} GB/s)", flush=True)
    if torch.cuda.is_available() and served.triton is not None and not args.cpu_only:
        r = measure_cuda(args.layers, args.hidden, args.ffn, args.top_k, args.steps, threads, w, args.format,
                         own_team=args.team.split(",")[0] == "spin")
        rows.append(r)
        print(f"accelerator side, nothing for the CPU: {r['gpu_handoff_s'] * 1e6:.1f} us per layer beyond "
              f"a graph's {r['graph_layer_s'] * 1e6:.1f} us when it waits, {r['gpu_skipped_s'] * 1e6:.1f} us when "
              f"the packet says so", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
