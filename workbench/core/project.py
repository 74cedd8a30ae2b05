"""Project files: a model reference, a hardware profile, a placement, expert stats and settings, as JSON.

```
{"schema_version": 1, "app": "moe-workbench 0.1.0", "saved_at": "2026-12-02T10:00:00+00:00",
 "model": {"path": "/models/qwen3", "relative_path": "../models/qwen3", "fingerprint": "...",
           "format": "safetensors", "family": "qwen3_moe", "n_layers": 48, "n_experts": 128},
 "hardware": {...HardwareProfile...} | null, "placement": {...Placement...},
 "stats": {...ExpertStats...} | null, "settings": {...opaque: chat, sampling, ctx...}}
```

Saving is atomic (a temporary file in the same folder, fsync, rename) and keeps one backup
(``NAME.bak``) of the previous good file; a corrupt file is never rotated into the backup. Opening
refuses unknown (newer) schema versions, migrates older ones through ``MIGRATIONS``, and says so
clearly when the file is corrupt (the backup is left as it is). The model is referenced by path and
by the fingerprint of its headers: ``open_project_model`` finds a model that moved together with the
project (relative path), and otherwise raises a ProjectFileError that says how to ``relink``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from .errors import ProjectFileError, WorkbenchError
from .hardware import HardwareProfile
from .inventory import Inventory
from .placement import Placement, validate
from .stats import ExpertStats

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
APP = "moe-workbench"

MIGRATIONS: dict[int, Callable[[dict], dict]] = {}
"""``MIGRATIONS[n]`` turns a schema-``n`` document into schema ``n + 1``. Register with ``@migration(n)``."""


def migration(from_version: int):
    """Register a function that upgrades a project document from ``from_version`` to the next."""

    def register(fn: Callable[[dict], dict]) -> Callable[[dict], dict]:
        MIGRATIONS[from_version] = fn
        return fn

    return register


@dataclass
class Project:
    """One project. ``settings`` is opaque to the core (the GUI keeps chat and sampling settings,
    context length, KV dtype, margin there)."""

    model_path: Path
    fingerprint: str
    placement: Placement
    hardware: HardwareProfile | None = None
    stats: ExpertStats | None = None
    settings: dict = field(default_factory=dict)
    model_info: dict = field(default_factory=dict)
    """format, family, n_layers, n_experts of the model when saved (for messages)."""
    path: Path | None = None
    """Where the project was read from or last saved."""
    relative_path: str | None = None

    @classmethod
    def for_model(cls, inventory: Inventory, placement: Placement, hardware: HardwareProfile | None = None,
                  stats: ExpertStats | None = None, settings: dict | None = None) -> Project:
        spec = inventory.spec
        return cls(Path(inventory.path).resolve(), inventory.fingerprint, placement, hardware, stats,
                   dict(settings or {}),
                   {"format": inventory.format, "family": inventory.family, "n_layers": spec.n_layers,
                    "n_experts": spec.n_experts})

    # -- JSON ------------------------------------------------------------------------------------

    def to_json(self, project_path: Path | None = None) -> dict:
        model = {"path": str(self.model_path), "fingerprint": self.fingerprint, **self.model_info}
        if project_path is not None:
            try:
                model["relative_path"] = os.path.relpath(self.model_path, Path(project_path).resolve().parent)
            except ValueError:  # another drive on Windows
                pass
        return {
            "schema_version": SCHEMA_VERSION,
            "app": f"{APP} {_version()}",
            "saved_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "model": model,
            "hardware": None if self.hardware is None else self.hardware.to_json(),
            "placement": self.placement.to_json(),
            "stats": None if self.stats is None else self.stats.to_json(),
            "settings": self.settings,
        }

    @classmethod
    def from_json(cls, obj: dict, path: Path | None = None) -> Project:
        """A Project from a current-schema document; ProjectFileError names what is malformed."""
        where = f"{path}" if path else "the project"
        try:
            model = obj["model"]
            p = cls(
                model_path=Path(model["path"]),
                fingerprint=str(model.get("fingerprint", "")),
                placement=Placement.from_json(obj.get("placement") or {}),
                hardware=None if obj.get("hardware") is None else HardwareProfile.from_json(obj["hardware"]),
                stats=None if obj.get("stats") is None else ExpertStats.from_json(obj["stats"]),
                settings=dict(obj.get("settings") or {}),
                model_info={k: model[k] for k in ("format", "family", "n_layers", "n_experts") if k in model},
                path=path,
                relative_path=model.get("relative_path"),
            )
        except WorkbenchError as e:
            raise ProjectFileError(f"{where} is malformed: {e}") from None
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ProjectFileError(f"{where} is malformed: missing or invalid {e}") from None
        return p

    # -- files -----------------------------------------------------------------------------------

    def save(self, path: str | Path) -> Path:
        """Write atomically to ``path``, keeping the previous good file as ``path.bak``."""
        path = Path(path)
        text = json.dumps(self.to_json(path), indent=1)
        _atomic_write(path, text)
        self.path = path
        return path


def backup_path(path: str | Path) -> Path:
    path = Path(path)
    return path.with_name(path.name + ".bak")


def _atomic_write(path: Path, text: str) -> None:
    folder = path.resolve().parent
    if not folder.is_dir():
        raise ProjectFileError(f"cannot save {path}: the folder {folder} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if path.exists() and _is_good_project(path):
            bak = backup_path(path)
            fd2, tmp_bak = tempfile.mkstemp(prefix=f".{bak.name}.", suffix=".tmp", dir=folder)
            os.close(fd2)
            shutil.copy2(path, tmp_bak)
            os.replace(tmp_bak, bak)
        os.replace(tmp, path)
    except OSError as e:
        raise ProjectFileError(f"cannot save {path}: {e.strerror or e}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _is_good_project(path: Path) -> bool:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(obj, dict) and "schema_version" in obj and "model" in obj


def migrate(obj: dict, path: Path | None = None) -> dict:
    """Bring a project document to ``SCHEMA_VERSION`` through the registered migrations."""
    where = str(path) if path else "the project"
    version = obj.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise ProjectFileError(f"{where} has no valid schema_version: it is not a workbench project file")
    if version > SCHEMA_VERSION:
        raise ProjectFileError(f"{where} was written by a newer workbench (schema {version}; this version "
                               f"reads up to {SCHEMA_VERSION}): update the workbench to open it")
    while version < SCHEMA_VERSION:
        step = MIGRATIONS.get(version)
        if step is None:
            raise ProjectFileError(f"{where} uses schema {version}, which this workbench cannot upgrade")
        obj = step(dict(obj))
        version += 1
        obj["schema_version"] = version
        log.info("migrated %s to schema %d", where, version)
    return obj


def load_project(path: str | Path) -> Project:
    """Read a project file (no model is opened). ProjectFileError with one clear sentence when the
    file is missing, corrupt, of an unknown version or malformed; a backup is never touched."""
    path = Path(path)
    bak = backup_path(path)
    hint = f"; the backup {bak} is intact" if bak.exists() else ""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ProjectFileError(f"no project file at {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ProjectFileError(f"cannot read {path}: {e}{hint}") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ProjectFileError(f"{path} is corrupt (not JSON: {e.msg} at line {e.lineno}){hint}") from None
    if not isinstance(obj, dict):
        raise ProjectFileError(f"{path} is not a workbench project file{hint}")
    obj = migrate(obj, path)
    return Project.from_json(obj, path)


def save_project(path: str | Path, inventory: Inventory | None = None, placement: Placement | None = None,
                 hardware: HardwareProfile | None = None, stats: ExpertStats | None = None,
                 settings: dict | None = None, project: Project | None = None) -> Project:
    """Save ``project``, or a new one for ``inventory`` + ``placement``; returns what was saved."""
    if project is None:
        if inventory is None or placement is None:
            raise ValueError("save_project needs a project, or an inventory and a placement")
        project = Project.for_model(inventory, placement, hardware, stats, settings)
    project.save(path)
    return project


def _candidates(project: Project) -> list[Path]:
    out = [project.model_path]
    if project.relative_path and project.path is not None:
        out.append((Path(project.path).resolve().parent / project.relative_path).resolve())
    return out


def open_project_model(project: Project) -> Inventory:
    """Open the project's model and check it is the one the project was made for.

    Tries the saved absolute path, then the path relative to the project file (a folder moved as a
    whole). ProjectFileError when the model is gone or its headers changed, saying how to relink.
    """
    from .readers import open_model

    for candidate in _candidates(project):
        if candidate.exists():
            inv = open_model(candidate)
            if project.fingerprint and inv.fingerprint != project.fingerprint:
                raise ProjectFileError(
                    f"the model at {candidate} changed since the project was saved (its headers differ); "
                    f"to keep the placement for it, relink: `workbench export PROJECT --relink {candidate} "
                    "--accept-changed --to ...` (or relink(project, path, accept_changed=True)), which "
                    "checks the placement against the new model")
            if candidate != project.model_path:
                log.info("model found at %s (moved with the project)", candidate)
                project.model_path = candidate
            return inv
    raise ProjectFileError(
        f"the model {project.model_path} was moved or deleted; relink the project to its new location: "
        "`workbench export PROJECT --relink NEW_PATH --to ...` (or relink(project, NEW_PATH))")


def relink(project: Project, new_path: str | Path, accept_changed: bool = False) -> Inventory:
    """Point ``project`` at the model now at ``new_path``.

    The same model (same fingerprint) is accepted as it is. A different one is refused unless
    ``accept_changed``; then the placement must fit the new model (its units), the fingerprint is
    updated and stats of another shape are dropped. Returns the model's Inventory.
    """
    from .readers import open_model

    inv = open_model(new_path)
    if project.fingerprint and inv.fingerprint != project.fingerprint:
        if not accept_changed:
            raise ProjectFileError(
                f"{new_path} is not the model this project was made for (its headers differ); "
                "accept it explicitly (--accept-changed, or accept_changed=True) to use it anyway")
        problems = validate(project.placement, inv)
        if problems:
            raise ProjectFileError(f"the project's placement does not fit {new_path}: {'; '.join(problems)}")
        if project.stats is not None and project.stats.shape != (inv.spec.n_layers, max(1, inv.spec.n_experts)):
            log.warning("dropping expert stats of shape %s: the new model differs", project.stats.shape)
            project.stats = None
    project.model_path = Path(inv.path).resolve()
    project.fingerprint = inv.fingerprint
    project.relative_path = None
    spec = inv.spec
    project.model_info = {"format": inv.format, "family": inv.family, "n_layers": spec.n_layers,
                          "n_experts": spec.n_experts}
    return inv


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("moe-workbench")
    except Exception:  # not installed as a distribution
        return "dev"
