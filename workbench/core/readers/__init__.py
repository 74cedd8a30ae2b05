"""Model readers: an Inventory from a Hugging Face safetensors folder or a GGUF file, headers only.

``open_model(path)`` takes a folder with ``config.json`` (one ``model.safetensors`` or shards with
``model.safetensors.index.json``), a ``.gguf`` file, or any part of a split ``*-0000K-of-0000N.gguf``.
Nothing but headers is read: a 100 GB checkpoint opens in well under a second.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path

from ..errors import ModelFormatError
from ..inventory import Inventory
from ..naming import assign_units
from ..units import TensorInfo
from .gguf import GGUFStringArray, read_gguf
from .gguf_config import config_from_gguf
from .hf_config import family_of, spec_from_config
from .safetensors import read_safetensors_folder

__all__ = ["open_model", "read_hf_folder", "read_gguf_model", "GGUFStringArray"]

log = logging.getLogger(__name__)

_SPLIT_PART = re.compile(r"-(?!00001)\d{5}-of-\d{5}\.gguf$")
"""Parts 2..N of a split GGUF (part 1 stands for the set)."""


def open_model(path: str | Path) -> Inventory:
    """The Inventory of the model at ``path`` (an HF folder or a GGUF file). User errors raise
    ModelFormatError with one clear sentence."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelFormatError(f"{path} does not exist")
    if path.is_dir():
        if not (path / "config.json").is_file():
            ggufs = sorted(p for p in path.glob("*.gguf") if not _SPLIT_PART.search(p.name))
            if len(ggufs) == 1:
                return read_gguf_model(ggufs[0])
            if len(ggufs) > 1:
                names = ", ".join(p.name for p in ggufs[:5])
                raise ModelFormatError(f"{path} holds several GGUF models ({names}): open one of the files")
        return read_hf_folder(path)
    if path.name == "config.json" or path.name.endswith(".safetensors.index.json"):
        return read_hf_folder(path.parent)
    if path.suffix.lower() == ".gguf":
        return read_gguf_model(path)
    if path.suffix == ".safetensors":
        return read_hf_folder(path.parent)
    with open(path, "rb") as f:
        if f.read(4) == b"GGUF":
            return read_gguf_model(path)
    raise ModelFormatError(f"{path.name} is neither a model folder nor a GGUF file")


def read_hf_folder(folder: Path) -> Inventory:
    """Inventory of a Hugging Face folder: ``config.json`` plus safetensors headers."""
    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ModelFormatError(f"{folder} has no config.json: not a Hugging Face model folder")
    try:
        config = json.loads(cfg_path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        raise ModelFormatError(f"{cfg_path} is not valid JSON") from None
    if not isinstance(config, dict):
        raise ModelFormatError(f"{cfg_path} is not a JSON object")
    family = family_of(config)
    spec = spec_from_config(config)
    tensors, files = read_safetensors_folder(folder)
    return _build(folder, "safetensors", family, spec, config, tensors, files, {})


def read_gguf_model(path: Path) -> Inventory:
    """Inventory of a GGUF file (or split set): metadata, a synthesised HF config, tensor infos.

    ``metadata`` holds every key/value; arrays of strings (tokens, merges) are ``GGUFStringArray``
    objects (sequences) that decode on first access; numeric arrays are lists.
    """
    meta, tensors, files = read_gguf(Path(path))
    config = config_from_gguf(meta, tensors)
    family = family_of(config)
    spec = spec_from_config(config)
    return _build(files[0], "gguf", family, spec, config, tensors, files, meta)


def _build(path, fmt, family, spec, config, tensors, files, meta) -> Inventory:
    units, skipped = assign_units(tensors, fmt, spec.n_layers, spec.n_experts)
    if skipped:
        log.info("%d tensors of layers past %d left out (multi-token prediction): %s",
                 len(skipped), spec.n_layers, skipped[:3])
        dropped = set(skipped)
        tensors = {n: t for n, t in tensors.items() if n not in dropped}
        meta = {**meta, "workbench.skipped_tensors": skipped}
    inv = Inventory(Path(path), fmt, family, spec, config, tensors, units, list(files), meta)
    inv.fingerprint = fingerprint(fmt, config, tensors)
    return inv


def fingerprint(fmt: str, config: dict, tensors: dict[str, TensorInfo]) -> str:
    """A hash of what the headers say (format, config, every tensor's name, type, shape and size):
    equal for the same checkpoint wherever it lives, different when any tensor changes."""
    h = hashlib.sha256(fmt.encode())
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    lines = [f"{name}|{t.dtype}|{t.shape}|{t.nbytes}\n" for name in sorted(tensors) for t in (tensors[name],)]
    h.update("".join(lines).encode())
    return h.hexdigest()[:32]
