"""Text generation on an Engine: prefill, then decode one token at a time with the static KV cache.

    gen = Generator(engine, tokenizer)
    result = gen.generate("Once upon a time", max_new_tokens=64, sampling=SamplingParams(greedy=True),
                          stop=["\\n\\n"], on_token=lambda tok, text: print(text, end=""))
    for event in gen.stream(prompt_ids, max_new_tokens=64): ...     # TokenEvent(token_id, text)

Generation stops on an end-of-sequence id, a stop string (searched in the decoded text, across
token boundaries; the returned text ends before it), ``max_new_tokens``, a full context, or
``cancel()`` from another thread (checked before every forward pass, so it stops within one token).
When a new prompt starts with the tokens already in the KV cache (the next turn of a chat), only
the new tokens are prefilled.

The streamed deltas add up to the result's text, except after a cancel that arrives while the
consumer handles a token: held-back characters (an incomplete character, the start of a possible
stop string) then appear only in ``GenerationResult.text``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from workbench.core.errors import WorkbenchError

from .sampling import Sampler, SamplingParams
from .tokenizer import StreamDecoder, Tokenizer

log = logging.getLogger(__name__)

STOP_REASONS = ("eos", "stop_string", "max_tokens", "context_full", "cancelled")

OnToken = Callable[[int, str], None]
"""``on_token(token_id, text_delta)``: called once per generated token; the delta may be empty."""


@dataclass
class Timings:
    """Where the time went. Seconds; rates in tokens per second (0 when nothing was measured)."""

    prompt_tokens: int = 0  # tokens in the prompt
    reused_tokens: int = 0  # prompt tokens whose KV entries were already in the cache
    generated_tokens: int = 0
    ttft_s: float = 0.0  # from the call to the first token id on the host
    prefill_s: float = 0.0  # the prefill forward passes and the first sampling
    decode_s: float = 0.0  # every later forward + sample

    @property
    def prefill_tokens_per_s(self) -> float:
        n = self.prompt_tokens - self.reused_tokens
        return n / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        n = max(0, self.generated_tokens - 1)
        return n / self.decode_s if self.decode_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "prefill_tokens_per_s": self.prefill_tokens_per_s,
                "decode_tokens_per_s": self.decode_tokens_per_s}


@dataclass
class GenerationResult:
    """``tokens``: generated ids (an EOS that stopped generation included); ``text``: their decoded
    text without the EOS or stop string; ``stop_reason``: one of ``STOP_REASONS``."""

    tokens: list[int]
    text: str
    stop_reason: str
    timings: Timings

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "text": self.text, "stop_reason": self.stop_reason,
                "timings": self.timings.to_dict()}


@dataclass(frozen=True)
class TokenEvent:
    token_id: int
    text: str


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


def default_eos_ids(inventory, tokenizer: Tokenizer | None = None) -> list[int]:
    """End-of-sequence ids of a model: ``generation_config.json``, ``config.json`` (and its text
    config), the GGUF EOS/EOT/EOM ids and the tokenizer's own (turn-end tokens included)."""
    ids: set[int] = set()
    if tokenizer is not None:
        ids.update(tokenizer.eos_ids)
    config = getattr(inventory, "config", None) or {}
    ids.update(_as_ids(config.get("eos_token_id")))
    ids.update(_as_ids((config.get("text_config") or {}).get("eos_token_id")))
    meta = getattr(inventory, "metadata", None) or {}
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        ids.update(_as_ids(meta.get(key)))
    path = Path(getattr(inventory, "path", "") or "")
    gen_config = path / "generation_config.json"
    if path.is_dir() and gen_config.is_file():
        try:
            ids.update(_as_ids(json.loads(gen_config.read_text(encoding="utf-8")).get("eos_token_id")))
        except (OSError, ValueError, AttributeError) as e:
            log.warning("ignoring unreadable %s: %s", gen_config, e)
    return sorted(ids)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class _StopText:
    """Accumulates streamed text, finds stop strings across deltas and holds back what could be the
    start of one, so that no stop string (or part of one) is ever emitted."""

    def __init__(self, stops: Iterable[str]):
        self.stops = [s for s in stops if s]
        self.longest = max((len(s) for s in self.stops), default=0)
        self.text = ""
        self.emitted = 0

    def add(self, delta: str) -> tuple[str, bool]:
        """Append ``delta``; return (text safe to emit now, whether a stop string was found)."""
        searched_from = max(0, len(self.text) - self.longest + 1)
        self.text += delta
        hits = [i for i in (self.text.find(s, searched_from) for s in self.stops) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            return self._emit(len(self.text)), True
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.text)), hold, -1):
                if self.text.endswith(s[:n]):
                    hold = n
                    break
        return self._emit(len(self.text) - hold), False

    def flush(self) -> str:
        return self._emit(len(self.text))

    def _emit(self, end: int) -> str:
        out = self.text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return out


class GenerationStream:
    """Iterate to get ``TokenEvent``s as they are generated; ``result`` is set once it is exhausted."""

    def __init__(self, run: Iterator[TokenEvent]):
        self._run = run
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[TokenEvent]:
        self.result = yield from self._run

    def close(self) -> None:
        """Abandon the generation after a partial iteration (frees the generator for the next one)."""
        self._run.close()


class Generator:
    """Generates text with one Engine (one sequence at a time; the engine's KV cache is its state).

    ``tokenizer`` may be None for id-only use (prompts as ids, empty texts). ``eos_ids`` defaults to
    ``default_eos_ids(engine.inventory, tokenizer)``. The generator remembers which ids sit in the
    engine's KV cache; when something else ran ``engine.forward`` in between (routing profiles),
    it notices from the cache tensors' version counter and prefills the next prompt in full.
    """

    def __init__(self, engine, tokenizer: Tokenizer | None = None, eos_ids: Iterable[int] | None = None,
                 prefill_chunk: int = 512):
        self.engine = engine
        self.tokenizer = tokenizer
        if eos_ids is None:
            eos_ids = default_eos_ids(getattr(engine, "inventory", None), tokenizer)
        self.eos_ids = set(int(i) for i in eos_ids)
        self.prefill_chunk = max(1, int(prefill_chunk))
        self._cached: list[int] = []  # ids whose K/V sit at cache positions 0..len-1
        self._cache_seen: tuple | None = None  # the KV cache's identity and version after our last write
        self._cancel = threading.Event()
        self._busy = threading.Lock()

    # -- control ----------------------------------------------------------------------------------

    def cancel(self) -> None:
        """Stop the running generation (thread-safe); it ends within one token with ``cancelled``."""
        self._cancel.set()

    def reset_cache(self) -> None:
        """Forget the cached prefix (the next prompt is prefilled in full)."""
        self._cached = []

    def _cache_state(self) -> tuple | None:
        """(identity, in-place write count) of the first layer's key cache; None if not visible."""
        caches = getattr(self.engine, "caches", None)
        k = getattr(caches[0], "k", None) if caches else None
        return (id(k), k._version) if isinstance(k, torch.Tensor) else None

    @property
    def cached_tokens(self) -> int:
        return len(self._cached)

    def encode(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """Prompt ids from text (through the tokenizer) or ids as given."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise WorkbenchError("this model has no tokenizer: give the prompt as token ids")
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        return [int(i) for i in prompt]

    # -- running ----------------------------------------------------------------------------------

    def generate(self, prompt: str | list[int], *, max_new_tokens: int = 256, sampling: SamplingParams | None = None,
                 stop: Iterable[str] = (), ignore_eos: bool = False, on_token: OnToken | None = None,
                 cancel: threading.Event | None = None, skip_special_tokens: bool = False) -> GenerationResult:
        """Generate up to ``max_new_tokens`` tokens after ``prompt`` (text or ids); see the module docstring.

        Raises WorkbenchError before running anything when the prompt is empty, has ids outside the
        vocabulary or does not leave room for one new token in the context.
        """
        stream = self.stream(prompt, max_new_tokens=max_new_tokens, sampling=sampling, stop=stop,
                             ignore_eos=ignore_eos, cancel=cancel, skip_special_tokens=skip_special_tokens)
        for event in stream:
            if on_token is not None:
                on_token(event.token_id, event.text)
        assert stream.result is not None
        return stream.result

    def stream(self, prompt: str | list[int], *, max_new_tokens: int = 256, sampling: SamplingParams | None = None,
               stop: Iterable[str] = (), ignore_eos: bool = False, cancel: threading.Event | None = None,
               skip_special_tokens: bool = False) -> GenerationStream:
        """Like ``generate`` but as an iterator of ``TokenEvent``; the prompt is checked right away."""
        ids = self.encode(prompt)
        self._check_prompt(ids)
        if max_new_tokens < 1:
            raise WorkbenchError(f"max new tokens must be at least 1, not {max_new_tokens}")
        stop = [s for s in stop if s]
        if stop and self.tokenizer is None:
            raise WorkbenchError("stop strings need a tokenizer")
        if self._busy.locked():
            raise WorkbenchError("this generator is already generating; cancel it or wait")
        self._cancel.clear()
        run = self._run(ids, max_new_tokens, sampling or SamplingParams(), stop, ignore_eos, cancel,
                        skip_special_tokens)
        return GenerationStream(run)

    def _check_prompt(self, ids: list[int]) -> None:
        ctx = self.engine.max_context
        if not ids:
            raise WorkbenchError("the prompt is empty")
        if len(ids) >= ctx:
            raise WorkbenchError(
                f"the prompt has {len(ids)} tokens but the context holds {ctx} "
                f"(prompt and answer together); shorten the prompt or load with a larger context"
            )
        bad = [i for i in ids if not 0 <= i < self.engine.vocab_size]
        if bad:
            raise WorkbenchError(f"prompt token id {bad[0]} is outside the vocabulary (0..{self.engine.vocab_size - 1})")

    def _cancelled(self, cancel: threading.Event | None) -> bool:
        return self._cancel.is_set() or (cancel is not None and cancel.is_set())

    def _run(self, ids: list[int], max_new: int, params: SamplingParams, stop: list[str], ignore_eos: bool,
             cancel: threading.Event | None, skip_special: bool) -> Iterator[TokenEvent]:
        if not self._busy.acquire(blocking=False):
            raise WorkbenchError("this generator is already generating; cancel it or wait")
        try:
            return (yield from self._decode_loop(ids, max_new, params, stop, ignore_eos, cancel, skip_special))
        except GeneratorExit:  # the consumer stopped iterating: the cache is consistent at a yield
            raise
        except BaseException:
            self._cached = []  # the cache may hold a partly written step
            raise
        finally:
            self._cache_seen = self._cache_state()
            self._cancel.clear()
            self._busy.release()

    def _decode_loop(self, ids, max_new, params, stop, ignore_eos, cancel, skip_special) -> Iterator[TokenEvent]:
        engine = self.engine
        t0 = time.perf_counter()
        timings = Timings(prompt_tokens=len(ids))
        if self._cached and self._cache_state() != self._cache_seen:
            log.info("the KV cache was written outside this generator; prefilling the whole prompt")
            self._cached = []
        reuse = min(_common_prefix(self._cached, ids), len(ids) - 1)
        if reuse and not getattr(engine, "resumable", lambda _: True)(reuse):
            reuse = 0  # sliding-window rings cannot go back: prefill again
        timings.reused_tokens = reuse
        self._cached = self._cached[:reuse]
        sampler = Sampler(params, engine.vocab_size, engine.device)
        sampler.observe(torch.tensor(ids))
        decoder = StreamDecoder(self.tokenizer, skip_special) if self.tokenizer is not None else None
        stop_text = _StopText(stop)
        tokens: list[int] = []

        def finish(reason: str) -> GenerationResult:
            timings.generated_tokens = len(tokens)
            if tokens:
                timings.decode_s = time.perf_counter() - t0 - timings.ttft_s
            return GenerationResult(tokens, stop_text.text, reason, timings)

        logits = None
        for start in range(reuse, len(ids), self.prefill_chunk):
            if self._cancelled(cancel):
                timings.prefill_s = time.perf_counter() - t0
                return finish("cancelled")
            end = min(len(ids), start + self.prefill_chunk)
            logits = engine.forward(torch.tensor(ids[start:end]), start, last_only=True)
            self._cached = ids[:end]
        token = int(sampler.sample(logits[-1]).item())
        timings.ttft_s = timings.prefill_s = time.perf_counter() - t0
        while True:
            tokens.append(token)
            reason = None
            delta = ""
            if token in self.eos_ids and not ignore_eos:
                reason = "eos"
            elif decoder is not None:
                delta, hit = stop_text.add(decoder.push(token))
                if hit:
                    reason = "stop_string"
            if reason is None:
                if len(tokens) >= max_new:
                    reason = "max_tokens"
                elif len(ids) + len(tokens) >= engine.max_context:
                    reason = "context_full"
                elif self._cancelled(cancel):
                    reason = "cancelled"
            if reason is not None and reason != "stop_string" and decoder is not None:
                tail, hit = stop_text.add(decoder.flush())
                delta += tail
                if hit:
                    reason = "stop_string"
                else:
                    delta += stop_text.flush()
            yield TokenEvent(token, delta)
            if reason is not None:
                return finish(reason)
            if self._cancelled(cancel):  # cancelled while the consumer handled this token
                if decoder is not None:
                    stop_text.add(decoder.flush())
                return finish("cancelled")
            pos = len(ids) + len(tokens) - 1
            logits = engine.forward(torch.tensor([token]), pos)
            self._cached.append(token)
            token = int(sampler.sample(logits[-1]).item())


def chat_prompt_ids(tokenizer: Tokenizer, template, messages: list[dict], **kwargs) -> list[int]:
    """Render ``messages`` with a ChatTemplate (generation prompt added) and encode the text as it is
    (the template writes BOS and other special tokens itself, as in transformers)."""
    text = template.render(messages, add_generation_prompt=True, **kwargs)
    return tokenizer.encode(text, add_special_tokens=False)
