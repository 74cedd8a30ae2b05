"""``workbench generate MODEL``: load a model under a placement and generate text, streaming it.

    workbench generate ./Qwen3-30B-A3B --n-cpu-moe 30 --chat "Why is the sky blue?" --max-new 200
    workbench generate model.gguf --placement project.json --prompt "Once upon a time" --json
    workbench generate ./tiny --prompt-ids 1,2,3 --greedy --ignore-eos --json

Text goes to stdout as it is generated; a one-line summary (stop reason, time to first token,
prefill and decode tokens/s) goes to stderr. With ``--json`` one object ``{tokens, text,
stop_reason, timings}`` is printed at the end instead. Ctrl-C stops generation (stop reason
``cancelled``) and still prints what was generated.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
from pathlib import Path

from workbench.core.errors import WorkbenchError

log = logging.getLogger(__name__)

# llama.cpp's sampling defaults, used where the model's generation_config.json says nothing.
FALLBACK_SAMPLING = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.0}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="Hugging Face model folder or GGUF file")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--placement", metavar="PROJECT.json", help="use the placement saved in a project file")
    where.add_argument("--cpu-moe", action="store_true", help="every routed expert in host RAM")
    where.add_argument("--n-cpu-moe", type=int, metavar="N", help="the routed experts of layers 0..N-1 in host RAM")
    parser.add_argument("--expert-mode", choices=("compute", "stream"), default="compute",
                        help="for --cpu-moe/--n-cpu-moe: experts in RAM are computed by the CPU (compute) "
                             "or fetched into accelerator slots on demand (stream)")
    parser.add_argument("--stream-slots", type=int, metavar="N",
                        help="accelerator cache slots per layer for streamed experts")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--prompt", metavar="TEXT", help="plain text prompt (the tokenizer adds BOS if the model wants it)")
    what.add_argument("--chat", metavar="TEXT", help="a user message, formatted with the model's chat template")
    what.add_argument("--prompt-ids", metavar="1,2,3", help="prompt as comma-separated token ids")
    parser.add_argument("--system", metavar="TEXT", help="system message for --chat")
    parser.add_argument("--max-new", type=int, default=256, metavar="N", help="most tokens to generate (256)")
    parser.add_argument("--greedy", action="store_true", help="always take the most likely token")
    parser.add_argument("--temperature", type=float, metavar="T", help="sampling temperature (0 = greedy)")
    parser.add_argument("--top-k", type=int, metavar="K", help="keep the K most likely tokens (0 = off)")
    parser.add_argument("--top-p", type=float, metavar="P", help="nucleus: keep tokens up to mass P (1 = off)")
    parser.add_argument("--min-p", type=float, metavar="P", help="drop tokens below P x the top probability (0 = off)")
    parser.add_argument("--repeat-penalty", type=float, metavar="R", help="penalise tokens already seen (1 = off)")
    parser.add_argument("--seed", type=int, help="random seed for reproducible sampling")
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop at this text (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="accelerator: cuda when available (auto), or the CPU for everything")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                        help="weight type on the accelerator (auto: bfloat16 on cuda, float32 on cpu)")
    parser.add_argument("--ctx", type=int, metavar="N", help="context length in tokens (default: 4096 or the model's)")
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end instead of streaming")


def run(args: argparse.Namespace) -> int:
    import torch

    from workbench.core.readers import open_model
    from workbench.engine.engine import Engine
    from workbench.engine.generate import Generator
    from workbench.engine.tokenizer import tokenizer_for

    if args.max_new < 1:
        raise WorkbenchError(f"--max-new must be at least 1, not {args.max_new}")
    if args.prompt is None and args.chat is None and args.prompt_ids is None:
        raise WorkbenchError("give a prompt: --prompt TEXT, --chat TEXT or --prompt-ids 1,2,3")
    inventory = open_model(args.model)
    tokenizer = tokenizer_for(inventory)
    prompt_ids = _prompt_ids(args, inventory, tokenizer)
    sampling = _sampling(args, inventory)
    placement = _placement(args, inventory)
    device = _device(args.device, torch)
    dtype = _dtype(args.dtype, device, torch)
    ctx = args.ctx or min(4096, inventory.spec.max_context or 4096)
    if ctx < 2:
        raise WorkbenchError(f"--ctx must be at least 2 tokens, not {ctx}")
    if len(prompt_ids) >= ctx:
        raise WorkbenchError(f"the prompt has {len(prompt_ids)} tokens but the context holds {ctx}; "
                             "shorten the prompt or raise --ctx")

    engine = Engine.load(inventory, placement, device=device, dtype=dtype, max_context=ctx,
                         progress=_load_progress() if sys.stderr.isatty() else None)
    try:
        gen = Generator(engine, tokenizer)
        result = _generate(gen, prompt_ids, args, sampling)
    finally:
        engine.close()
    if args.json:
        print(json.dumps(result.to_dict(), ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        t = result.timings
        print(f"[{result.stop_reason}: {t.generated_tokens} tokens; prompt {t.prompt_tokens} tokens; "
              f"time to first token {t.ttft_s * 1000:.0f} ms; prefill {t.prefill_tokens_per_s:.1f} tok/s; "
              f"decode {t.decode_tokens_per_s:.1f} tok/s]", file=sys.stderr)
    return 0


def _load_progress():
    """A progress callback that redraws one stderr line at most every 0.2 s while loading."""
    import time

    from workbench.core.fmt import bytes2human

    last = [0.0]

    def progress(done: int, total: int, what: str) -> None:
        now = time.monotonic()
        if now - last[0] < 0.2 and done < total:
            return
        last[0] = now
        pct = 100.0 * done / total if total else 100.0
        end = "\n" if done >= total else ""
        sys.stderr.write(f"\rloading {pct:5.1f}% ({bytes2human(done)} of {bytes2human(total)}) {what:<24}{end}")
        sys.stderr.flush()

    return progress


def _generate(gen, prompt_ids: list[int], args, sampling):
    """Generate on a worker thread so that Ctrl-C in the main thread becomes a clean cancel."""
    out: dict = {}

    def on_token(token_id: int, text: str) -> None:
        if text and not args.json:
            sys.stdout.write(text)
            sys.stdout.flush()

    def work() -> None:
        try:
            out["result"] = gen.generate(prompt_ids, max_new_tokens=args.max_new, sampling=sampling,
                                         stop=args.stop, ignore_eos=args.ignore_eos, on_token=on_token)
        except BaseException as e:  # handed to the main thread
            out["error"] = e

    worker = threading.Thread(target=work, name="generate", daemon=True)
    worker.start()
    while worker.is_alive():
        try:
            worker.join(0.1)
        except KeyboardInterrupt:
            gen.cancel()
    if "error" in out:
        raise out["error"]
    return out["result"]


def _prompt_ids(args, inventory, tokenizer) -> list[int]:
    if args.prompt_ids is not None:
        try:
            ids = [int(x) for x in args.prompt_ids.replace(" ", "").split(",") if x]
        except ValueError:
            raise WorkbenchError(f"--prompt-ids takes comma-separated integers, not {args.prompt_ids!r}") from None
        if not ids:
            raise WorkbenchError("--prompt-ids is empty")
        return ids
    if tokenizer is None:
        raise WorkbenchError(f"{inventory.path.name} has no tokenizer; give the prompt as --prompt-ids")
    if args.prompt is not None:
        return tokenizer.encode(args.prompt)
    from workbench.engine.chat_template import load_chat_template
    from workbench.engine.generate import chat_prompt_ids

    template = load_chat_template(inventory.path, tokenizer.special_tokens,
                                  gguf_fields=inventory.metadata if inventory.format == "gguf" else None)
    if template is None:
        raise WorkbenchError(f"{inventory.path.name} has no chat template; use --prompt instead of --chat")
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.chat}]
    return chat_prompt_ids(tokenizer, template, messages)


def _generation_config(inventory) -> dict:
    path = Path(inventory.path) / "generation_config.json"
    if not (Path(inventory.path).is_dir() and path.is_file()):
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        log.warning("ignoring unreadable %s: %s", path, e)
        return {}
    return data if isinstance(data, dict) else {}


def _sampling(args, inventory):
    """Flags first, then the model's generation_config.json, then llama.cpp's defaults."""
    from workbench.engine.sampling import SamplingParams

    gc = _generation_config(inventory)
    model_greedy = gc.get("do_sample") is False
    values = {}
    for name, flag in (("temperature", args.temperature), ("top_k", args.top_k), ("top_p", args.top_p),
                       ("min_p", args.min_p), ("repetition_penalty", args.repeat_penalty)):
        if flag is not None:
            values[name] = flag
        elif gc.get(name) is not None and not isinstance(gc.get(name), bool):
            values[name] = type(FALLBACK_SAMPLING[name])(gc[name])
        else:
            values[name] = FALLBACK_SAMPLING[name]
    greedy = args.greedy or (model_greedy and args.temperature is None)
    return SamplingParams(greedy=greedy, seed=args.seed, **values)


def _placement(args, inventory):
    from workbench.core.memory import placement_cpu_moe, placement_n_cpu_moe
    from workbench.core.placement import CPU_COMPUTE, CPU_STREAM, Placement

    if args.placement:
        placement = load_placement(Path(args.placement), inventory)
    elif args.cpu_moe or args.n_cpu_moe is not None:
        if args.n_cpu_moe is not None and args.n_cpu_moe < 0:
            raise WorkbenchError(f"--n-cpu-moe takes a layer count >= 0, not {args.n_cpu_moe}")
        placement = placement_cpu_moe(inventory) if args.cpu_moe else placement_n_cpu_moe(inventory, args.n_cpu_moe)
        if args.expert_mode == "stream":
            moved = [k for k in inventory.expert_keys() if placement.get(k) == CPU_COMPUTE]
            placement.move(moved, CPU_STREAM)
            if args.stream_slots is None:
                placement.stream_slots = max(1, inventory.spec.n_experts_active)
    else:
        placement = Placement()
    if args.stream_slots is not None:
        if args.stream_slots < 0:
            raise WorkbenchError(f"--stream-slots must be >= 0, not {args.stream_slots}")
        placement.stream_slots = args.stream_slots
    return placement


def load_placement(path: Path, inventory=None):
    """The placement saved in a project file; warns when the project was made for another model."""
    from workbench.core.project import load_project

    project = load_project(path)
    if inventory is not None and project.fingerprint and project.fingerprint != inventory.fingerprint:
        log.warning("%s was made for %s, a different model than %s; using its placement anyway",
                    path, project.model_path, inventory.path)
    return project.placement


def _device(choice: str, torch):
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise WorkbenchError("--device cuda: no CUDA GPU is available to PyTorch here")
    return choice


def _dtype(choice: str, device: str, torch):
    if choice == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    return getattr(torch, choice)
