"""``workbench [PATH]`` / ``workbench gui [PATH]``: open the window.

With no PATH it opens the bundled demo model (resources/demo/) when it is there."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from workbench.core.resources import resource

DEMO_MODEL = resource("demo")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", nargs="?", help="model folder, .gguf file or project .json (default: the demo model)")


def run(args: argparse.Namespace) -> int:
    from workbench.core.errors import WorkbenchError

    path = Path(args.path) if args.path else (DEMO_MODEL if (DEMO_MODEL / "config.json").is_file() else None)
    if path is not None and not path.exists():
        raise WorkbenchError(f"{path} does not exist")
    if sys.platform.startswith("linux") and not any(
        os.environ.get(v) for v in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM")
    ):
        raise WorkbenchError(
            "no display to open the window on (DISPLAY is not set); run it on a desktop, under "
            "`xvfb-run -a workbench`, or use the sub-commands (workbench inspect / plan / generate)"
        )
    from workbench.ui.app import run as run_app

    return run_app(path)
