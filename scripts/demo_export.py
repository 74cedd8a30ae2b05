"""Finish the demo model after ``scripts/train_demo.py``: GGUF copy, routing report, sample texts.

    python scripts/demo_export.py [--demo resources/demo]

Writes ``demo-moe.gguf`` (llama.cpp names, F16 matrices, F32 norms and routers, through
``workbench.core.gguf_writer``) and ``report.json`` (held-out perplexity from training.json, per-layer
routing on ``resources/prompts/calibration.json`` through the workbench engine, greedy and sampled
continuations), and prints a Markdown summary for the model card.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import numpy as np
import torch

from workbench.core.gguf_writer import write_gguf
from workbench.core.readers import open_model
from workbench.engine.chat_template import load_chat_template
from workbench.engine.engine import Engine
from workbench.engine.generate import Generator, chat_prompt_ids
from workbench.engine.sampling import SamplingParams
from workbench.engine.tokenizer import tokenizer_for

log = logging.getLogger("demo_export")

ROOT = Path(__file__).resolve().parents[1]
GGUF_NAME = "demo-moe.gguf"
SAMPLE_PROMPTS = (
    "It is a truth universally acknowledged, that",
    "\"My dear Emma,\" said Mr. Knightley,",
    "The weather was so fine that the whole party",
)
CHAT_SAMPLE = [{"role": "user", "content": "Will you walk with me to the village this morning?"}]


def export_gguf(demo: Path) -> Path:
    """Write ``demo/demo-moe.gguf`` from the HF copy in ``demo``; returns its path."""
    (path,) = write_gguf(demo, demo / GGUF_NAME, "F16", name="demo-moe")
    return path


def load_prompts(path: Path) -> list[dict]:
    """The calibration prompts (``resources/prompts/calibration.json``): ``[{id, kind, text}, ...]``."""
    return json.loads(path.read_text(encoding="utf-8"))["prompts"]


def routing_counts(engine: Engine, tokenizer, prompts: list[dict]) -> np.ndarray:
    """Expert selections over all prompt tokens (prefill only): ``[n_layers, n_experts]`` int64."""
    engine.reset_routing_counts()
    for prompt in prompts:
        ids = tokenizer.encode(prompt["text"], add_special_tokens=False)
        engine.forward(torch.tensor(ids), 0)
    return engine.routing_counts()


def top_quarter_coverage(counts: np.ndarray) -> list[float]:
    """Per layer: share of the layer's selections served by its busiest 25% of experts."""
    n_top = max(1, counts.shape[1] // 4)
    ranked = -np.sort(-counts, axis=1)
    return [float(row[:n_top].sum() / max(1, row.sum())) for row in ranked]


def samples(engine: Engine, tokenizer, folder: Path) -> dict:
    """Greedy and seeded-sampled continuations of ``SAMPLE_PROMPTS`` and one chat reply."""
    gen = Generator(engine, tokenizer)
    out = {"greedy": [], "sampled": []}
    greedy = SamplingParams(greedy=True)
    sampled = SamplingParams(temperature=0.8, top_p=0.95, repetition_penalty=1.1, seed=7)
    for prompt in SAMPLE_PROMPTS:
        gen.reset_cache()
        out["greedy"].append(prompt + gen.generate(prompt, max_new_tokens=48, sampling=greedy).text)
        gen.reset_cache()
        out["sampled"].append(prompt + gen.generate(prompt, max_new_tokens=48, sampling=sampled).text)
    template = load_chat_template(folder, tokenizer.special_tokens)
    gen.reset_cache()
    ids = chat_prompt_ids(tokenizer, template, CHAT_SAMPLE)
    reply = gen.generate(ids, max_new_tokens=64, sampling=greedy, skip_special_tokens=True)
    out["chat"] = {"user": CHAT_SAMPLE[0]["content"], "assistant": reply.text, "stop": reply.stop_reason}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", type=Path, default=ROOT / "resources" / "demo")
    parser.add_argument("--prompts", type=Path, default=ROOT / "resources" / "prompts" / "calibration.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    gguf_path = export_gguf(args.demo)
    log.info("wrote %s (%.1f MB)", gguf_path, gguf_path.stat().st_size / 1e6)

    inventory = open_model(args.demo)
    engine = Engine.load(inventory, device="cpu", dtype=torch.float32, max_context=1024)
    tokenizer = tokenizer_for(inventory)
    counts = routing_counts(engine, tokenizer, load_prompts(args.prompts))
    coverage = top_quarter_coverage(counts)
    training = json.loads((args.demo / "training.json").read_text())
    report = {
        "heldout_perplexity": training["heldout_perplexity"],
        "train_seconds": training["train_seconds"],
        "calibration_tokens": int(counts[0].sum() // max(1, inventory.spec.n_experts_active)),
        "top25_coverage_per_layer": [round(c, 3) for c in coverage],
        "routing_counts": counts.tolist(),
        "samples": samples(engine, tokenizer, args.demo),
    }
    (args.demo / "report.json").write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    print(f"held-out perplexity: {report['heldout_perplexity']}")
    print("top-25% expert coverage per layer: " + ", ".join(f"L{i} {c:.1%}" for i, c in enumerate(coverage)))
    for kind in ("greedy", "sampled"):
        for text in report["samples"][kind]:
            print(f"[{kind}] {text!r}")
    print(f"[chat] {report['samples']['chat']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
