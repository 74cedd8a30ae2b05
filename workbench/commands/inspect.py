"""``workbench inspect PATH``: what a model holds and what each device would need.

Reads headers only and imports neither torch nor Qt, so it runs anywhere in a fraction of a second.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from workbench.core.errors import WorkbenchError
from workbench.core.fmt import bytes2human, params2human
from workbench.core.inventory import Inventory
from workbench.core.memory import (
    KV_DTYPES,
    MemoryEstimate,
    default_ctx,
    estimate_memory,
    experts_as_stored,
    placement_all_gpu,
    placement_cpu_moe,
    placement_n_cpu_moe,
)
from workbench.core.readers import open_model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="Hugging Face model folder or GGUF file (any part of a split GGUF)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--ctx", type=int, default=None, metavar="N",
                        help="context length for the KV cache (default: 4096 or the model's own, if shorter)")
    parser.add_argument("--kv-dtype", default="f16", choices=sorted(KV_DTYPES), help="KV cache type (f16)")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--cpu-moe", action="store_true", help="estimate with every routed expert in RAM")
    group.add_argument("--n-cpu-moe", type=int, metavar="N", help="estimate with the routed experts of layers 0..N-1 in RAM")


def params_active(inv: Inventory) -> int:
    """Parameters one token reads: all but the routed experts it does not select (per MoE layer,
    ``n_experts - n_experts_active`` experts of average size)."""
    s = inv.spec
    inactive = 0
    for layer in s.moe_layers:
        keys = inv.expert_keys(layer)
        if keys:
            mean = sum(inv.units[k].n_params for k in keys) / len(keys)
            inactive += (len(keys) - s.n_experts_active) * mean
    return int(round(inv.params_total - inactive))


def _placement(inv: Inventory, args):
    if args.cpu_moe:
        return placement_cpu_moe(inv), "--cpu-moe"
    if args.n_cpu_moe is not None:
        return placement_n_cpu_moe(inv, args.n_cpu_moe), f"--n-cpu-moe {args.n_cpu_moe}"
    return placement_all_gpu(inv), "all on gpu:0"


def _layer_rows(inv: Inventory) -> list[dict]:
    rows: dict[int, dict] = {}
    for key, unit in inv.units.items():
        if key.layer is None:
            continue
        row = rows.setdefault(key.layer, {"layer": key.layer, "experts": 0, "expert_bytes": [], "bytes": 0,
                                          "expert_types": set()})
        row["bytes"] += unit.nbytes
        if key.kind == "expert":
            row["experts"] += 1
            row["expert_bytes"].append(unit.nbytes)
            row["expert_types"] |= {r.tensor.dtype for r in unit.tensors if r.tensor.name.endswith("weight")} or unit.dtypes
        else:
            row[key.kind] = row.get(key.kind, 0) + unit.nbytes
    return [rows[i] for i in sorted(rows)]


def to_json(inv: Inventory, est: MemoryEstimate, placement_name: str) -> dict:
    """The ``--json`` object."""
    s = inv.spec
    return {
        "path": str(inv.path),
        "format": inv.format,
        "family": inv.family,
        "fingerprint": inv.fingerprint,
        "n_layers": s.n_layers,
        "moe_layers": list(s.moe_layers),
        "dense_layers": list(s.dense_layers),
        "n_experts": s.n_experts,
        "n_experts_active": s.n_experts_active,
        "n_shared_experts": s.n_shared_experts,
        "params_total": inv.params_total,
        "params_active": params_active(inv),
        "total_bytes": inv.total_bytes,
        "dtype_mix": inv.dtype_mix(),
        "spec": s.to_json(),
        "memory": {"placement": placement_name, **est.to_json()},
        "units": [{"layer": k.layer, "kind": k.kind, "expert": k.expert, "bytes": inv.units[k].nbytes}
                  for k in sorted(inv.units)],
    }


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    return "\n".join(lines)


def to_text(inv: Inventory, est: MemoryEstimate, placement_name: str) -> str:
    """The readable summary."""
    s = inv.spec
    out = [f"{inv.path}  ({inv.format}, {len(inv.files)} file{'s' if len(inv.files) > 1 else ''}, "
           f"{bytes2human(inv.total_bytes)})"]
    out.append(f"family      {inv.family}")
    out.append(f"layers      {s.n_layers}: {len(s.moe_layers)} MoE, {len(s.dense_layers)} dense"
               + (f" ({_ranges(s.dense_layers)})" if s.dense_layers else ""))
    if s.is_moe:
        out.append(f"experts     {s.n_experts} routed per layer, {s.n_experts_active} active per token, "
                   f"{s.n_shared_experts} shared")
        sizes = [inv.units[k].nbytes for k in inv.expert_keys()]
        lo, hi = min(sizes), max(sizes)
        out.append("expert size " + (bytes2human(lo) if lo == hi else f"{bytes2human(lo)} .. {bytes2human(hi)}")
                   + f" ({inv.units[inv.expert_keys()[0]].n_params:,} parameters)")
    attn = f"heads {s.n_heads}, kv heads {s.n_kv_heads}, head dim {s.head_dim}"
    if s.kv_lora_rank is not None:
        attn += f", MLA latent {s.kv_lora_rank} + rope {s.qk_rope_head_dim}"
    windows = {w for w in s.layer_window if w is not None}
    if windows:
        attn += f", windowed layers: {sum(w is not None for w in s.layer_window)} (window {', '.join(map(str, sorted(windows)))})"
    out.append(f"attention   {attn}")
    out.append(f"model       hidden {s.hidden_size}, vocab {s.vocab_size}, context {s.max_context}")
    total = inv.total_bytes
    mix = ", ".join(f"{t} {100 * b / total:.1f}%" for t, b in inv.dtype_mix().items())
    out.append(f"storage     {mix}")
    out.append(f"parameters  {params2human(inv.params_total)} total, {params2human(params_active(inv))} active per token")
    out.append("")
    rows = [["layer", "type", "attn", "router", "shared", "experts", "per expert", "expert type", "dense mlp",
             "norm", "total"]]
    for r in _layer_rows(inv):
        eb = r["expert_bytes"]
        rows.append([str(r["layer"]), "moe" if r["experts"] else "dense", bytes2human(r.get("attn", 0)),
                     bytes2human(r.get("router", 0)), bytes2human(r.get("shared", 0)), str(r["experts"]),
                     bytes2human(max(eb)) if eb else "-", "+".join(sorted(r["expert_types"])) or "-",
                     bytes2human(r.get("dense_mlp", 0)), bytes2human(r.get("norm", 0)), bytes2human(r["bytes"])])
    model_wide = {k.kind: inv.units[k].nbytes for k in inv.units if k.layer is None}
    out.append(_table(rows))
    out.append("model-wide  " + ", ".join(f"{k} {bytes2human(b)}" for k, b in model_wide.items()))
    out.append("")
    out.append(f"memory estimate: {placement_name}, context {est.ctx}, KV {est.kv_dtype}")
    rows = [["tier", "weights", "kv cache", "stream cache", "overhead", "total"]]
    for name, t in est.tiers.items():
        rows.append([name, bytes2human(t.weights_total), bytes2human(t.kv_cache), bytes2human(t.stream_cache),
                     bytes2human(t.overhead), bytes2human(t.total)])
    out.append(_table(rows))
    if placement_name == "all on gpu:0" and s.is_moe:
        alt = estimate_memory(inv, placement_cpu_moe(inv), ctx=est.ctx, kv_dtype=est.kv_dtype)
        out.append(f"with --cpu-moe: gpu:0 {bytes2human(alt.total('gpu:0'))}, cpu {bytes2human(alt.total('cpu'))}")
    if est.ctx > s.max_context:
        out.append(f"note: context {est.ctx} is longer than the model's {s.max_context}")
    if s.is_moe and not experts_as_stored(inv):
        held = sum(2 * inv.units[k].n_params for k in inv.expert_keys())
        stored = sum(inv.units[k].nbytes for k in inv.expert_keys())
        types = "+".join(sorted({t.tensor.dtype for k in inv.expert_keys() for t in inv.units[k].tensors}))
        out.append(f"note: the engine dequantizes the routed experts ({types}) to bf16 at load: "
                   f"{bytes2human(held)} instead of the file's {bytes2human(stored)} (the estimate counts bf16)")
    skipped = inv.metadata.get("workbench.skipped_tensors") or []
    if skipped:
        out.append(f"note: {len(skipped)} tensors not used for text generation are left out (e.g. {skipped[0]})")
    out.append("overhead (CUDA context, activation buffers, host baseline) is an approximation")
    return "\n".join(out)


def _ranges(ix) -> str:
    """``(0, 1, 2, 5) -> "0-2,5"``."""
    ix, parts = sorted(ix), []
    start = None
    for i, e in enumerate(ix):
        start = e if start is None else start
        if i + 1 == len(ix) or ix[i + 1] != e + 1:
            parts.append(str(start) if start == e else f"{start}-{e}")
            start = None
    return ",".join(parts)


def run(args) -> int:
    if args.ctx is not None and args.ctx < 1:
        raise WorkbenchError(f"--ctx must be at least 1, got {args.ctx}")
    if args.n_cpu_moe is not None and args.n_cpu_moe < 0:
        raise WorkbenchError(f"--n-cpu-moe takes a layer count >= 0, got {args.n_cpu_moe}")
    inv = open_model(args.path)
    placement, name = _placement(inv, args)
    ctx = args.ctx if args.ctx is not None else default_ctx(inv.spec)
    est = estimate_memory(inv, placement, ctx=ctx, kv_dtype=args.kv_dtype)
    text = json.dumps(to_json(inv, est, name)) if args.json else to_text(inv, est, name)
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:  # `workbench inspect ... | head`: the reader left, nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
