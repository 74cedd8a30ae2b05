"""Export a placement to other engines: llama.cpp arguments, KTransformers (SGLang kt-kernel) expert
placement, and a Hugging Face accelerate ``device_map``.

Neither llama.cpp nor accelerate can place single experts: llama.cpp overrides whole tensors, and a
GGUF stacks every expert of a layer into one tensor per projection; transformers (>= 5) fuses a
layer's experts into one module. So both get a per-layer approximation: whole layers of experts go
to the GPU in the order of how many GPU expert bytes the placement gives them, as long as the total
stays within the placement's own GPU expert bytes (so it fits the same budget). The export says
which layers it approximated and, with a cost model, what the approximation is predicted to cost.
KTransformers places single experts (a GPU expert mask per layer), so its export is exact.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import numpy as np

from .errors import WorkbenchError
from .inventory import Inventory
from .placement import (
    TIER_CPU_COMPUTE,
    Placement,
    expert_grid,
    gpu_index,
    is_gpu,
    with_expert_grid,
)

TARGETS = ("llama.cpp", "ktransformers", "accelerate")


@dataclass
class Export:
    """What an exporter produced. ``text``: what to print or write (arguments or JSON); ``files``: extra
    files to write beside it (name -> content); ``notes``: what was approximated and why;
    ``approximation``: the placement the target will actually run (None when exact)."""

    target: str
    text: str
    files: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    approximation: Placement | None = None

    def __str__(self) -> str:
        """The text with the notes as ``#`` comments and the extra files listed."""
        lines = [f"# {n}" for n in self.notes]
        lines += [f"# writes {name} beside it" for name in self.files]
        return "\n".join([*lines, self.text])


def export(inventory: Inventory, placement: Placement, target: str, cost=None, stats=None,
           name: str = "placement") -> Export:
    """Translate ``placement`` for ``target`` (one of ``TARGETS``). ``cost``: a CostModel to predict
    the approximation's speed; ``stats``: ExpertStats (KTransformers' frequency file keeps them as
    tie-breakers); ``name``: stem of extra files."""
    if target == "llama.cpp":
        return export_llama_cpp(inventory, placement, cost)
    if target == "ktransformers":
        return export_ktransformers(inventory, placement, stats, name)
    if target == "accelerate":
        return export_accelerate(inventory, placement, cost)
    raise WorkbenchError(f"unknown export target {target!r}: choose one of {', '.join(TARGETS)}")


# -- per-layer approximation ---------------------------------------------------------------------

def layer_approximation(inventory: Inventory, placement: Placement) -> tuple[Placement, dict[int, int]]:
    """Whole-layer placement of the routed experts closest to ``placement`` within its GPU bytes.

    Each MoE layer's experts all go to one tier: layers are taken in decreasing order of the GPU
    expert bytes ``placement`` gives them (ties: earlier layer first) and put on the GPU holding most
    of them while that GPU's allowance (the expert bytes ``placement`` puts there) lasts; the rest
    go to the CPU. Returns the approximated placement and ``{layer: gpu index or -1}``.
    """
    spec = inventory.spec
    L, E = spec.n_layers, max(1, spec.n_experts)
    grid = expert_grid(placement, L, E)
    nbytes = np.zeros((L, E))
    for key in inventory.expert_keys():
        nbytes[key.layer, key.expert] = inventory.units[key].nbytes
    present = nbytes > 0
    n_gpus = int(grid.max()) + 1 if (grid >= 0).any() else 0
    allowance = [float((nbytes * (grid == g)).sum()) for g in range(n_gpus)]
    gpu_bytes = (nbytes * (grid >= 0)).sum(axis=1)
    layers = [layer for layer in range(L) if present[layer].any()]
    layers.sort(key=lambda layer: (-gpu_bytes[layer], layer))
    choice: dict[int, int] = {}
    for layer in layers:
        choice[layer] = -1
        if gpu_bytes[layer] <= 0:
            continue
        per_gpu = [(nbytes[layer] * (grid[layer] == g)).sum() for g in range(n_gpus)]
        for g in sorted(range(n_gpus), key=lambda g: -per_gpu[g]):
            need = nbytes[layer].sum()
            if need <= allowance[g] + 1e-6:
                allowance[g] -= need
                choice[layer] = g
                break
    new = grid.copy()
    for layer, g in choice.items():
        if g >= 0:
            new[layer, present[layer]] = g
        else:  # experts already in RAM keep their mode; GPU ones come to RAM as CPU-compute
            new[layer, present[layer] & (grid[layer] >= 0)] = TIER_CPU_COMPUTE
    approx = with_expert_grid(placement, new, inventory.expert_keys())
    return approx, choice


def _cost_note(cost, placement: Placement, approx: Placement, what: str) -> list[str]:
    if cost is None:
        return []
    exact = cost.decode_tps(placement)
    shaped = cost.decode_tps(approx)
    return [f"predicted decode: {shaped:.2f} tokens/s for the {what} vs {exact:.2f} tokens/s for the "
            f"per-expert placement ({100 * (shaped / exact - 1):+.1f}%)"]


# -- llama.cpp -----------------------------------------------------------------------------------

def _buffer(tier: str) -> str:
    return f"CUDA{gpu_index(tier)}" if is_gpu(tier) else "CPU"


def _expert_pattern(inventory: Inventory, layers: list[int]) -> str:
    """Regex selecting the stacked expert tensors of ``layers`` among llama.cpp GGUF names."""
    stems, suffixes = set(), set()
    if inventory.format == "gguf":
        for layer in layers:
            for key in inventory.expert_keys(layer):
                for ref in inventory.units[key].tensors:
                    m = re.fullmatch(r"blk\.\d+\.ffn_(\w+?)_exps\.(\w+)", ref.tensor.name)
                    if m:
                        stems.add(m.group(1))
                        suffixes.add(m.group(2))
                break
    if not stems:  # llama.cpp's converter names (for a Hugging Face source)
        stems, suffixes = {"gate", "up", "down"}, {"weight"}
        if any(ref.tensor.name.endswith("_bias") or ref.tensor.name.endswith(".bias")
               for key in inventory.expert_keys(layers[0]) for ref in inventory.units[key].tensors):
            suffixes.add("bias")
    alt = "|".join(str(layer) for layer in sorted(layers))
    stem = "|".join(sorted(stems))
    suffix = "|".join(sorted(suffixes))
    return (rf"blk\.({alt})\.ffn_({stem})_exps\."
            + (suffix if len(suffixes) == 1 else f"({suffix})"))


def export_llama_cpp(inventory: Inventory, placement: Placement, cost=None) -> Export:
    """llama.cpp arguments: ``-ngl 99`` plus ``--n-cpu-moe N`` when the experts are layer-shaped that
    way, else ``-ot`` overrides (``blk\\.(3|7)\\.ffn_(down|gate|up)_exps\\.weight=CPU``) over the GGUF
    tensor names; non-expert units in RAM get ``-ot`` patterns of their exact GGUF names."""
    spec = inventory.spec
    approx, choice = layer_approximation(inventory, placement)
    notes: list[str] = []
    exact = approx == placement
    if any(placement.get(k).mode == "stream" for k in inventory.expert_keys()):
        notes.append("llama.cpp does not stream experts: streamed experts are exported as experts in RAM "
                     "(llama.cpp copies them to the GPU for large prompt batches on its own)")
    if not exact:
        moved = sorted(layer for layer, g in choice.items() if g >= 0)
        notes.append(
            "llama.cpp places whole tensors and a GGUF stacks each layer's experts in one tensor, so "
            f"single experts cannot be placed: exported a per-layer approximation with the experts of "
            f"{len(moved)} of {len(choice)} MoE layers on the GPU ({_ranges_text(moved) or 'none'}), "
            "taking layers by how many GPU expert bytes the placement gives them, within the same bytes")
        notes += _cost_note(cost, placement, approx, "per-layer approximation")
    args = [f"-ngl {max(99, spec.n_layers + 1)}"]
    cpu_layers = sorted(layer for layer, g in choice.items() if g < 0)
    gpu_layers: dict[int, list[int]] = {}
    for layer, g in choice.items():
        if g >= 0:
            gpu_layers.setdefault(g, []).append(layer)
    moe_layers = sorted(choice)
    prefix = next((k for k in range(spec.n_layers + 1)
                   if set(cpu_layers) == {m for m in moe_layers if m < k}), None)
    if cpu_layers and prefix is not None and set(gpu_layers) <= {0}:
        args.append(f"--n-cpu-moe {prefix}")
    elif cpu_layers:
        args.append(f'-ot "{_expert_pattern(inventory, cpu_layers)}=CPU"')
    for g, layers in sorted(gpu_layers.items()):
        if g > 0:
            args.append(f'-ot "{_expert_pattern(inventory, layers)}=CUDA{g}"')
    n_gpus = 1 + max([0, *gpu_layers, *(gpu_index(t) for t in placement.tiers() if is_gpu(t))])
    if n_gpus > 1:
        args.insert(1, "-ts " + ",".join(["1"] + ["0"] * (n_gpus - 1)))
        notes.append("-ts 1,0... keeps every layer on CUDA0 as the placement does; only the overridden "
                     "tensors go to the other GPUs")
    others: dict[str, list[str]] = {}
    for key, unit in sorted(inventory.units.items()):
        if key.kind == "expert":
            continue
        tier = placement.get(key).tier
        if tier != "gpu:0" and key.kind != "embed":
            if inventory.format != "gguf":
                notes.append(f"{key} is on {tier}: without GGUF tensor names it is left to -ngl")
                continue
            others.setdefault(_buffer(tier), []).extend(re.escape(ref.tensor.name) for ref in unit.tensors)
    for buf, names in sorted(others.items()):
        args.append(f'-ot "^({"|".join(names)})$={buf}"')
    text = " ".join(args)
    model = inventory.path if inventory.format == "gguf" else "MODEL.gguf (convert the folder with convert_hf_to_gguf.py)"
    notes.append(f"use as: llama-server -m {model} {text}")
    return Export("llama.cpp", text, {}, notes, None if exact else approx)


def _ranges_text(ix: list[int]) -> str:
    from .placement import _ranges

    return _ranges(ix).replace(",", ", ") if ix else ""


def llama_cpp_overrides(args: str) -> list[tuple[re.Pattern, str]]:
    """The ``-ot PATTERN=BUFFER`` pairs of an argument string, compiled (for checks and tests)."""
    return [(re.compile(m.group(1)), m.group(2)) for m in re.finditer(r'-ot "([^"]+)=(\w+)"', args)]


# -- KTransformers -------------------------------------------------------------------------------

def export_ktransformers(inventory: Inventory, placement: Placement, stats=None,
                         name: str = "placement") -> Export:
    """SGLang + kt-kernel arguments for KTransformers' ``frequency`` placement, and its frequency file.

    KTransformers (``--kt-expert-placement-strategy frequency``) puts on the GPU the ``N`` experts with
    the highest activation counts across all layers, ``N`` from ``--kt-gpu-experts-ratio`` (of all
    MoE layers x experts) and the counts from ``--init-expert-location FILE.pt`` holding
    ``{"logical_count": tensor [1, layers, experts]}``. The exported counts encode this placement
    exactly: every GPU expert counts more than every CPU expert (the real routing counts, when
    known, order experts within each group). KTransformers reads ``.pt`` (torch) files only, so the
    counts are written as JSON with the one-line conversion to run where torch is installed.
    """
    spec = inventory.spec
    L, E = spec.n_layers, max(1, spec.n_experts)
    grid = expert_grid(placement, L, E)
    present = np.zeros((L, E), dtype=bool)
    for key in inventory.expert_keys():
        present[key.layer, key.expert] = True
    on_gpu = (grid >= 0) & present
    n_gpu = int(on_gpu.sum())
    moe_layers = [layer for layer in range(L) if present[layer].any()]
    total = len(moe_layers) * E
    counts = np.zeros((L, E))
    if stats is not None and stats.shape == (L, E):
        counts = np.array(stats.counts, dtype=np.float64)
    counts = np.where(present, counts, 0.0)
    offset = float(counts.max()) + 1.0
    encoded = np.where(on_gpu, counts + offset, counts)
    # KTransformers takes int(total * ratio) experts: aim half an expert above n to survive rounding.
    ratio = 1.0 if n_gpu >= total else (n_gpu + 0.5) / total
    text_ratio = f"{ratio:.12g}"
    assert int(total * float(text_ratio)) == n_gpu
    file_json = f"{name}.kt-frequency.json"
    file_pt = f"{name}.kt-frequency.pt"
    per_layer = {int(on_gpu[layer].sum()) for layer in moe_layers}
    notes = [
        f"{n_gpu} of {total} routed experts on the GPU ({100 * n_gpu / max(total, 1):.1f}%); the frequency "
        "file ranks exactly these experts first, so KTransformers reproduces this placement",
        f"convert the counts once where torch is installed: python -c \"import json, torch; "
        f"d = json.load(open('{file_json}')); torch.save({{'logical_count': torch.tensor(d['logical_count'])}}, "
        f"'{file_pt}')\"",
    ]
    notes.append("use as: python -m sglang.launch_server --model MODEL --kt-weight-path CPU_WEIGHTS "
                 "--kt-method ... ARGUMENTS (KTransformers' kt-kernel SGLang integration), ARGUMENTS below")
    if len(per_layer) == 1:
        notes.append(f"equivalently --kt-num-gpu-experts {per_layer.pop()} (the same count in every MoE layer)")
    if any(grid[layer, e] > 0 for layer, e in zip(*np.nonzero(on_gpu))):
        notes.append("KTransformers spreads GPU experts by tensor parallelism, not by our GPU indices: "
                     "the exported set is the union of every GPU's experts")
    if spec.dense_layers and spec.family not in ("deepseek_v2", "deepseek_v3"):
        notes.append("KTransformers counts MoE layers from first_k_dense_replace / moe_layer_freq; check that "
                     f"it finds {len(moe_layers)} MoE layers for this model")
    text = (f"--kt-expert-placement-strategy frequency --kt-gpu-experts-ratio {text_ratio} "
            f"--init-expert-location {file_pt}")
    payload = {"logical_count": [[[float(v) for v in row] for row in encoded]],
               "workbench": {"gpu_experts": n_gpu, "moe_layers": moe_layers, "n_experts": E}}
    return Export("ktransformers", text, {file_json: json.dumps(payload)}, notes, None)


def kt_gpu_mask(counts: np.ndarray, ratio: float, n_moe_layers: int) -> np.ndarray:
    """What KTransformers' ``frequency`` strategy selects: the top ``int(total * ratio)`` of the summed
    counts ``[buffer, layers, experts]`` across all layers (``total`` = MoE layers x experts).
    Used to check the export."""
    freq = np.asarray(counts, dtype=np.float64).sum(axis=0)
    n = int(n_moe_layers * freq.shape[1] * ratio)
    flat = freq.ravel()
    top = np.argsort(-flat, kind="stable")[:n]
    mask = np.zeros(flat.size, dtype=bool)
    mask[top] = True
    return mask.reshape(freq.shape)


# -- accelerate ----------------------------------------------------------------------------------

_EXPERTS = re.compile(r"^(.*\.experts)(\.\d+)?\..*$|^(.*\.experts)\.[^.]+$")


def _module(name: str) -> str:
    """Module of a checkpoint tensor in a transformers >= 5 model (experts fused per layer)."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    m = _EXPERTS.match(name)
    if m:
        return m.group(1) or m.group(3)
    return name.rpartition(".")[0]


def export_accelerate(inventory: Inventory, placement: Placement, cost=None) -> Export:
    """A ``device_map`` (``{"module": 0 | 1 | "cpu"}``) for ``from_pretrained(device_map=...)``.

    Module names are those of the transformers >= 5 model built from the checkpoint (a layer's
    experts are one module, Mixtral's ``block_sparse_moe`` is ``mlp``), so experts are placed per
    layer (see ``layer_approximation``). accelerate runs a CPU module's weights by moving them to
    the GPU for each forward (its offload), not by computing on the CPU.
    """
    if inventory.format != "safetensors":
        raise WorkbenchError("the accelerate export needs the model's Hugging Face folder (module names); "
                             "this project's model is a GGUF file")
    approx, choice = layer_approximation(inventory, placement)
    exact = approx == placement
    dmap: dict[str, int | str] = {}
    for key, unit in sorted(inventory.units.items()):
        tier = approx.get(key).tier
        device: int | str = gpu_index(tier) if is_gpu(tier) else "cpu"
        for ref in unit.tensors:
            dmap[_module(ref.tensor.name)] = device
    if "lm_head" not in dmap:  # tied embeddings: the lm_head module shares the embedding's weight
        embed = [_module(ref.tensor.name) for key, unit in inventory.units.items() if key.kind == "embed"
                 for ref in unit.tensors]
        if embed:
            dmap["lm_head"] = dmap[embed[0]]
    # A module with its own parameters (gpt-oss attention sinks) covers its children: keep one key.
    for name in sorted(dmap, key=len):
        parent = name.rpartition(".")[0]
        while parent:
            if parent in dmap and dmap[parent] == dmap[name]:
                del dmap[name]
                break
            parent = parent.rpartition(".")[0]
    notes = []
    if not exact:
        moved = sorted(layer for layer, g in choice.items() if g >= 0)
        notes.append("transformers holds each layer's experts in one module, so single experts cannot be placed: "
                     f"exported the experts of {len(moved)} of {len(choice)} MoE layers on the GPU "
                     f"({_ranges_text(moved) or 'none'})")
        notes += _cost_note(cost, placement, approx, "per-layer approximation")
    notes.append("accelerate offload copies CPU modules to the GPU at every forward; expect it to be much "
                 "slower than the prediction for an engine that computes experts on the CPU")
    return Export("accelerate", json.dumps(dmap, indent=1), {}, notes, None if exact else approx)


__all__ = ["TARGETS", "Export", "export", "layer_approximation", "export_llama_cpp", "export_ktransformers",
           "export_accelerate", "llama_cpp_overrides", "kt_gpu_mask"]
