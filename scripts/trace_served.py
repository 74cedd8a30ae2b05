#!/usr/bin/env python3
"""Where does a served hybrid layer's decode time go? The decode server's own clock, packet by packet.

Loads a GGUF under a saved placement (``bench run --save-placements``) or an ``n-cpu-moe``-like one,
decodes ``--steps`` tokens with the decode server recording every packet (``WORKBENCH_SERVER_TRACE``:
the steady clock when its thread saw a layer's packet and when it stored the result's flag, and the
packet's CPU pairs), and splits each step (microseconds, medians over steps):

- ``cpu``: seen to done, by the packet's CPU pairs (0: an empty packet, the thread only reads it;
  ``bus``: layers where the bus also took pairs, whatever the CPU's);
- ``span``: one served layer's packet to the next layer's (the layer's whole time as the CPU sees it),
  for layers whose next layer is served too, by the layer's CPU pairs;
- ``after``: the CPU's result stored to the next layer's packet seen: what the accelerator does after
  the CPU's part (poll, add, the layer's tail, the next attention and router, publish, the copies);
- ``lead``: the step's launch to its first packet, ``tail``: the last packet's result to the token.

An engaged layer's ``span`` less an empty one's is what the CPU's part adds to a layer; less the
``cpu`` of its packets, what the hand-off adds beyond the CPU's work (``hand-off`` in the table).

    python scripts/trace_served.py --model /dev/shm/s1_q8.gguf --device cuda --placement frequency.json
    python scripts/trace_served.py            # locally: a small synthetic model, CPU accelerator

Prints a table and writes the raw records and the summary with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from profile_decode import n_cpu_moe_placement, small_model, timed_steps  # noqa: E402

from workbench.core.project import load_project  # noqa: E402
from workbench.core.readers import open_model  # noqa: E402
from workbench.engine import Engine  # noqa: E402

BUCKETS = ("0", "1", "2", "3+", "bus")
"""The rows of the split: the CPU's pairs of layers where the bus took none, then those where it did."""


def _med(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(records: np.ndarray, steps: list[tuple[int, int]]) -> dict:
    """The split of ``records`` (``DecodeServer.trace``: int64 ``[n, 6]`` layer, step, seen ns, done ns,
    CPU pairs, bus pairs; ``[n, 5]`` records, from before the bus's column, count none) over the timed
    ``steps`` (``(launch ns, token ns)`` per step, on the same clock, in order).

    Returns medians in µs: ``cpu`` / ``span`` / ``after`` by the CPU's pairs of layers where the bus
    took none (keys ``"0"``, ``"1"``, ``"2"``, ``"3+"``) and of those where it took some (``"bus"``:
    the accelerator also read experts over the bus), with their counts, ``lead``, ``tail``, ``step``
    (ms), ``engaged`` (layers with CPU pairs per step, mean) and ``handoff`` by pairs: ``span`` less
    the empty layers' ``span`` less ``cpu``."""
    def bucket(p: int, b: int) -> str:
        return "bus" if b > 0 else str(p) if p < 3 else "3+"

    if len(records) and records.shape[1] < 6:
        records = np.hstack([records, np.zeros((len(records), 1), dtype=records.dtype)])

    cpu, span, after = defaultdict(list), defaultdict(list), defaultdict(list)
    lead, tail, step_ms, engaged = [], [], [], []
    for t0, t1 in steps:
        rows = records[(records[:, 2] >= t0) & (records[:, 2] <= t1)]
        if not len(rows):
            continue
        rows = rows[np.argsort(rows[:, 0], kind="stable")]
        step_ms.append((t1 - t0) / 1e6)
        engaged.append(int((rows[:, 4] > 0).sum()))
        lead.append((rows[0, 2] - t0) / 1e3)
        tail.append((t1 - rows[-1, 3]) / 1e3)
        for i, (layer, _, seen, done, pairs, on_bus) in enumerate(rows.tolist()):
            b = bucket(pairs, on_bus)
            cpu[b].append((done - seen) / 1e3)
            if i + 1 < len(rows) and rows[i + 1, 0] == layer + 1:
                span[b].append((rows[i + 1, 2] - seen) / 1e3)
                after[b].append((rows[i + 1, 2] - done) / 1e3)
    out = {"step_ms": _med(step_ms), "engaged": float(np.mean(engaged)) if engaged else None,
           "lead_us": _med(lead), "tail_us": _med(tail), "cpu": {}, "span": {}, "after": {}, "n": {}, "handoff": {}}
    for b in BUCKETS:
        out["cpu"][b], out["span"][b], out["after"][b] = _med(cpu[b]), _med(span[b]), _med(after[b])
        out["n"][b] = len(cpu[b])
    empty = out["span"]["0"]
    for b in BUCKETS[1:]:
        s, c = out["span"][b], out["cpu"][b]
        out["handoff"][b] = None if None in (s, c, empty) else s - empty - c
    return out


def _fmt(v: float | None) -> str:
    return "—" if v is None else f"{v:.1f}"


def report(s: dict) -> str:
    """``summarize``'s dict as a markdown table and a line of step totals."""
    lines = [f"step {_fmt(s['step_ms'])} ms, {_fmt(s['engaged'])} layers a step gave the CPU pairs; "
             f"launch to first packet {_fmt(s['lead_us'])} us, last result to token {_fmt(s['tail_us'])} us",
             "", "| CPU pairs | packets | cpu us | span us | after us | hand-off us |", "| --- | --- | --- | --- | --- | --- |"]
    for b in BUCKETS:
        lines.append(f"| {b} | {s['n'][b]} | {_fmt(s['cpu'][b])} | {_fmt(s['span'][b])} | {_fmt(s['after'][b])} "
                     f"| {_fmt(s['handoff'].get(b))} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF file (default: a small synthetic model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--placement", default=None, help="a project file's placement (else n-cpu-moe on 2/3 of layers)")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    inv = open_model(str(small_model(args.model)))
    if args.placement:
        placement = load_project(args.placement).placement
    else:
        placement = n_cpu_moe_placement(inv, (2 * len(inv.spec.moe_layers)) // 3)
    os.environ["WORKBENCH_SERVER_TRACE"] = str((args.steps + 16) * len(inv.spec.moe_layers))
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    engine = Engine.load(inv, placement, device=args.device, dtype=dtype, max_context=args.prompt + args.steps + 16)
    if args.device != "cuda":
        engine.decode_mode, engine.served_mode = "static", "on"  # the decode graphs' pieces, run eagerly
    try:
        steps = timed_steps(engine, args.prompt, args.steps)
        srv = engine._decoder.server if engine._decoder is not None else None
        if srv is None:
            print("no decode server ran: nothing to trace", file=sys.stderr)
            return 1
        records = srv.trace()
    finally:
        engine.close()
    s = summarize(records, steps)
    print(f"{inv.path.name}: {len(steps)} steps, {len(records)} packets")
    print(report(s))
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": s, "steps": steps, "records": records.tolist()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
