"""``workbench export PROJECT.json --to llama.cpp|ktransformers|accelerate [-o FILE]``.

Translates a project's placement for another engine: prints it (with what was approximated as ``#``
comments) or writes it to FILE (extra files, such as KTransformers' expert counts, beside it).
Imports neither torch nor Qt.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from workbench.core.costmodel import CostModel
from workbench.core.errors import WorkbenchError
from workbench.core.export import TARGETS, export
from workbench.core.project import load_project, open_project_model, relink


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("project", help="project file (from `workbench plan -o` or the GUI)")
    parser.add_argument("--to", required=True, choices=TARGETS, help="target engine")
    parser.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of printing")
    parser.add_argument("--relink", metavar="MODEL", help="the project's model moved: point the project at "
                        "MODEL (and save it) before exporting")
    parser.add_argument("--accept-changed", action="store_true",
                        help="with --relink: accept a model whose headers differ from the saved fingerprint")


def run(args) -> int:
    project = load_project(args.project)
    if args.relink:
        inv = relink(project, args.relink, accept_changed=args.accept_changed)
        project.save(args.project)
        print(f"# relinked {args.project} to {inv.path}")
    else:
        inv = open_project_model(project)
    cost = None
    if project.hardware is not None and project.hardware.gpus:
        try:
            cost = CostModel(inv, project.hardware, project.stats)
        except ValueError as e:
            raise WorkbenchError(f"the project's hardware or stats do not fit the model: {e}") from None
    out_dir = Path(args.output).resolve().parent if args.output else Path(args.project).resolve().parent
    stem = Path(args.output).stem if args.output else Path(args.project).stem
    result = export(inv, project.placement, args.to, cost=cost, stats=project.stats, name=stem)
    for name, content in result.files.items():
        (out_dir / name).write_text(content)
    if args.output:
        Path(args.output).write_text(result.text + "\n")
        for note in result.notes:
            print(f"# {note}")
        print(f"wrote {args.output}" + "".join(f" and {out_dir / n}" for n in result.files))
    else:
        for note in result.notes:
            print(f"# {note}")
        for name in result.files:
            print(f"# wrote {out_dir / name}")
        print(result.text)
    return 0
