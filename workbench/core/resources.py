"""Where the data shipped with the workbench lives: the demo model, calibration prompts, presets."""

from __future__ import annotations

import os
from pathlib import Path


def resources_dir() -> Path:
    """The ``resources/`` folder: ``$WORKBENCH_RESOURCES`` if set, else the one beside the package
    (a source checkout or an editable install)."""
    override = os.environ.get("WORKBENCH_RESOURCES")
    return Path(override) if override else Path(__file__).resolve().parents[2] / "resources"


def resource(*parts: str) -> Path:
    """``resource("demo")`` -> ``.../resources/demo``."""
    return resources_dir().joinpath(*parts)
