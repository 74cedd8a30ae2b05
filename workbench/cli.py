"""The ``workbench`` command. No sub-command opens the window; sub-commands serve scripts and tests.

Each sub-command lives in ``workbench/commands/<name>.py`` with ``add_arguments(parser)`` and
``run(args) -> int``; it is imported only when used, so ``inspect`` and ``plan`` never load torch
or Qt.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from workbench.core.errors import WorkbenchError

COMMANDS = {
    "inspect": "Show what a model holds and what each device would need",
    "plan": "Plan a placement under a VRAM budget and predict its speed",
    "export": "Translate a project's placement for llama.cpp, KTransformers or accelerate",
    "generate": "Generate text with the hybrid engine under a placement",
    "hw": "Show this machine's GPUs and host memory, live",
    "calibrate": "Measure this machine's bandwidths and expert throughput",
    "bench": "Benchmark placements (and llama.cpp) on a synthetic MoE model",
    "gui": "Open the workbench window (the default)",
}


def _build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="workbench", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = next((a for a in argv if a in COMMANDS), None)
    for name, help_text in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == wanted:
            _module(name).add_arguments(p)
    return parser


def _module(name: str):
    return importlib.import_module(f"workbench.commands.{name}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # PyTorch's CUDA allocator grows its segments in place instead of caching blocks of every size a
    # prompt step asks for: 0.3 GiB less GPU memory at the same placement on S1 (BENCHMARKS.md
    # 2026-12-04, run 4); read when CUDA first allocates, so it must be set before that.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if not argv or (argv[0] not in COMMANDS and not argv[0].startswith("-")):
        argv = ["gui", *argv]
    parser = _build_parser(argv)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s: %(message)s",
    )
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return int(_module(args.command).run(args) or 0)
    except WorkbenchError as e:
        print(f"workbench {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
