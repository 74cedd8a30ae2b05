"""Train the bundled demo MoE model (resources/demo) from scratch on Jane Austen's six novels.

What it makes, in ``--out`` (default resources/demo):
  config.json, model.safetensors (float16), generation_config.json   -- a Qwen3-MoE (``qwen3_moe``)
  tokenizer.json, tokenizer_config.json, chat_template.jinja           -- byte-level BPE, ChatML template
  heldout.txt                                                          -- a slice of the held-out text
  training.json                                                        -- settings, loss curve, figures
then, with ``scripts/demo_export.py``, the GGUF copy and the routing report.

Data: Debian's ``r-cran-janeaustenr`` (public-domain novels, MIT-licensed package); the script runs
``apt-get download r-cran-janeaustenr`` itself when the package is neither installed nor cached
(needs ``apt-get update`` once on a fresh machine). See ``scripts/demo_data.py``.

Everything is seeded; a run is a fixed number of optimizer steps (1000), so the same torch build on
the same CPU gives byte-identical weights. One step costs about 1 s of CPU time, so the default run
takes ~17 minutes on an idle 2-core machine (the committed weights took 36 minutes on one shared
with other jobs). One thread is the default: on a busy 2-core machine two threads ran 6x slower.

    apt-get update                              # once, on a fresh machine
    nice -n 5 python scripts/train_demo.py
    python scripts/demo_export.py               # GGUF copy, routing report, samples
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import time
from pathlib import Path

import torch
from demo_data import NOVELS, load_novels
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

log = logging.getLogger("train_demo")

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""ChatML, as Qwen models use it (no default system message, no thinking blocks)."""

MODEL_CONFIG = dict(
    hidden_size=192, num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=2, head_dim=32,
    num_experts=16, num_experts_per_tok=2, moe_intermediate_size=96, intermediate_size=384,
    decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, max_position_embeddings=1024,
    rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, router_aux_loss_coef=0.001,
    hidden_act="silu", attention_bias=False, initializer_range=0.02,
)
"""Qwen3-MoE shape of the demo: 4 layers x 16 routed experts, top-2, no shared expert."""

HELDOUT_FRACTION = 0.03
"""Share of each novel's paragraphs (its last ones) kept out of training."""


def split_corpus(novels: dict[str, list[str]]) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """Split each novel into training paragraphs and held-out paragraphs (the novel's last 3%)."""
    train, heldout = {}, {}
    for name, paragraphs in novels.items():
        cut = len(paragraphs) - max(1, int(len(paragraphs) * HELDOUT_FRACTION))
        train[name], heldout[name] = paragraphs[:cut], paragraphs[cut:]
    return train, heldout


def render_chat(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """Render ``messages`` with the demo's chat template in a sandboxed jinja environment."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=add_generation_prompt)


def build_documents(train: dict[str, list[str]], rng: random.Random) -> list[str]:
    """Training documents: passages of 12 paragraphs, plus ChatML exchanges made of quoted speech.

    Consecutive paragraphs that both open with a quotation mark become a user turn and an assistant
    turn (2-4 turns), so the model learns the chat format and answers in kind.
    """
    docs: list[str] = []
    for paragraphs in train.values():
        for start in range(0, len(paragraphs), 12):
            docs.append("\n\n".join(paragraphs[start : start + 12]))
        run: list[str] = []
        for paragraph in [*paragraphs, ""]:
            if paragraph.startswith('"') and len(paragraph) < 600:
                run.append(paragraph.strip('"').replace('"', ""))
                continue
            while len(run) >= 2:
                turns = min(len(run), rng.choice((2, 2, 4)))
                messages = [
                    {"role": "user" if i % 2 == 0 else "assistant", "content": text}
                    for i, text in enumerate(run[:turns])
                ]
                if rng.random() < 0.3:
                    messages.insert(0, {"role": "system", "content": "You are a character in a novel."})
                docs.append(render_chat(messages).rstrip("\n"))
                run = run[turns:]
            run = []
    rng.shuffle(docs)
    return docs


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE (GPT-2 pre-tokenizer regex) with the three chat special tokens first (ids 0-2)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, out: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json (with the chat template) and chat_template.jinja."""
    tokenizer.save(str(out / "tokenizer.json"))
    added = {
        str(tokenizer.token_to_id(tok)): {
            "content": tok, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": True,
        }
        for tok in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "added_tokens_decoder": added, "bos_token": None,
        "eos_token": IM_END, "pad_token": ENDOFTEXT, "unk_token": None, "model_max_length": 1024,
        "clean_up_tokenization_spaces": False, "add_prefix_space": False, "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE + "\n")


def token_stream(tokenizer: Tokenizer, docs: list[str]) -> torch.Tensor:
    """All documents' token ids, each followed by <|endoftext|>, as one int64 tensor [N]."""
    eot = tokenizer.token_to_id(ENDOFTEXT)
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(docs):
        ids.extend(encoding.ids)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.long)


def build_model(vocab_size: int, tokenizer: Tokenizer):
    """A freshly initialised Qwen3MoeForCausalLM of the demo shape (float32)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=vocab_size, bos_token_id=None, eos_token_id=tokenizer.token_to_id(IM_END),
        pad_token_id=tokenizer.token_to_id(ENDOFTEXT), **MODEL_CONFIG,
    )
    return Qwen3MoeForCausalLM(config)


def write_portable_config(path: Path) -> None:
    """Add the key names that Qwen3-MoE checkpoints on the hub carry (``num_experts``, ``rope_theta``).

    transformers 5 writes ``num_local_experts`` and ``rope_parameters`` only; older readers, llama.cpp's
    converter among them, look for the hub names. transformers reads the file the same either way.
    """
    config = json.loads(path.read_text())
    config.setdefault("num_experts", config.get("num_local_experts"))
    config.setdefault("rope_theta", config.get("rope_parameters", {}).get("rope_theta", 10000.0))
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up for ``warmup`` steps, then cosine decay to 10% of ``peak``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, seq_len: int) -> float:
    """Token perplexity of ``ids`` [N] in non-overlapping windows of ``seq_len`` tokens."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, seq_len):
        window = ids[start : start + seq_len + 1]
        if len(window) < 2:
            break
        logits = model(window[None, :-1]).logits.float()
        total += torch.nn.functional.cross_entropy(logits[0], window[1:], reduction="sum").item()
        count += len(window) - 1
    return math.exp(total / count)


def train(model, stream: torch.Tensor, args: argparse.Namespace) -> list[dict]:
    """AdamW on random windows of ``stream``; returns the logged loss curve."""
    gen = torch.Generator().manual_seed(args.seed)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "norm" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95),
    )
    curve, started, running = [], time.monotonic(), 0.0
    model.train()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        starts = torch.randint(0, len(stream) - args.seq_len - 1, (args.batch,), generator=gen)
        batch = torch.stack([stream[s : s + args.seq_len + 1] for s in starts.tolist()])  # [B, T+1]
        out = model(batch[:, :-1], output_router_logits=True, use_cache=False)
        loss = torch.nn.functional.cross_entropy(
            out.logits.flatten(0, 1).float(), batch[:, 1:].flatten()
        ) + model.router_aux_loss_coef * out.aux_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        running += loss.item()
        if (step + 1) % args.log_every == 0:
            elapsed = time.monotonic() - started
            curve.append({"step": step + 1, "loss": round(running / args.log_every, 4), "s": round(elapsed, 1)})
            log.info("step %d/%d loss %.3f (%.0f s)", step + 1, args.steps, running / args.log_every, elapsed)
            running = 0.0
            if elapsed > args.max_minutes * 60:
                log.warning("stopping early at step %d: over --max-minutes", step + 1)
                break
    return curve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "resources" / "demo")
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "moe-workbench-demo")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--threads", type=int, default=1, help="1 is fastest on a shared machine")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--max-minutes", type=float, default=26.0, help="safety stop for the training loop")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    t0 = time.monotonic()

    train_pars, heldout_pars = split_corpus(load_novels(args.cache))
    docs = build_documents(train_pars, random.Random(args.seed))
    tokenizer = train_tokenizer(docs, args.vocab)
    args.out.mkdir(parents=True, exist_ok=True)
    save_tokenizer(tokenizer, args.out)
    stream = token_stream(tokenizer, docs)
    heldout_text = "\n\n".join(p for name in NOVELS for p in heldout_pars[name])
    heldout_ids = torch.tensor(tokenizer.encode(heldout_text).ids)
    (args.out / "heldout.txt").write_text("\n\n".join(heldout_pars["persuasion"]) + "\n")
    log.info("%d documents, %d training tokens, %d held-out tokens", len(docs), len(stream), len(heldout_ids))

    model = build_model(tokenizer.get_vocab_size(), tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    log.info("model: %.2f M parameters", n_params / 1e6)
    t_train = time.monotonic()
    curve = train(model, stream, args)
    train_s = time.monotonic() - t_train

    model = model.half().float()  # the shipped weights are float16: measure those
    ppl = perplexity(model, heldout_ids, args.seq_len)
    log.info("held-out perplexity %.2f over %d tokens", ppl, len(heldout_ids))
    model.half().save_pretrained(args.out)
    write_portable_config(args.out / "config.json")
    model.generation_config.eos_token_id = [tokenizer.token_to_id(IM_END), tokenizer.token_to_id(ENDOFTEXT)]
    model.generation_config.pad_token_id = tokenizer.token_to_id(ENDOFTEXT)
    model.generation_config.do_sample = False
    model.generation_config.save_pretrained(args.out)
    summary = {
        "seed": args.seed, "steps": len(curve) * args.log_every, "batch": args.batch, "seq_len": args.seq_len,
        "lr": args.lr, "vocab_size": tokenizer.get_vocab_size(), "parameters": n_params,
        "training_tokens": len(stream), "heldout_tokens": len(heldout_ids), "heldout_perplexity": round(ppl, 3),
        "train_seconds": round(train_s, 1), "total_seconds": round(time.monotonic() - t0, 1),
        "threads": args.threads, "torch": torch.__version__, "loss_curve": curve,
    }
    (args.out / "training.json").write_text(json.dumps(summary, indent=1) + "\n")
    log.info("done in %.0f s (training %.0f s)", time.monotonic() - t0, train_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
