"""Chat with the loaded engine: render the conversation with the model's chat template (or the
user's override), generate with streaming, and measure each reply.

Blocking functions, meant for a worker thread; they emit ``generation_token`` from that thread and
return the reply without touching the conversation (the GUI thread appends it).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from workbench.core.errors import WorkbenchError

log = logging.getLogger(__name__)


@dataclass
class ChatMessage:
    role: str  # "system" | "user" | "assistant"
    content: str
    stats: dict = field(default_factory=dict)  # ttft_s, prefill_tps, decode_tps, tokens, stop_reason


@dataclass
class ChatState:
    """The conversation and its settings; saved with the project."""

    messages: list[ChatMessage] = field(default_factory=list)
    system_prompt: str = "You are a helpful assistant."
    sampling: dict = field(
        default_factory=lambda: {"temperature": 0.7, "top_k": 40, "top_p": 0.95, "min_p": 0.0,
                                 "repeat_penalty": 1.1, "max_new": 256, "seed": None, "ignore_eos": False}
    )
    template_override: str = ""
    context_used: int = 0

    def to_json(self) -> dict:
        return {
            "messages": [{"role": m.role, "content": m.content, "stats": m.stats} for m in self.messages],
            "system_prompt": self.system_prompt,
            "sampling": dict(self.sampling),
            "template_override": self.template_override,
        }

    @classmethod
    def from_json(cls, d: dict) -> ChatState:
        c = cls()
        c.messages = [ChatMessage(m["role"], m["content"], dict(m.get("stats", {}))) for m in d.get("messages", [])]
        c.system_prompt = d.get("system_prompt", c.system_prompt)
        c.sampling.update(d.get("sampling", {}))
        c.template_override = d.get("template_override", "")
        return c


class ChatMixin:
    """The Session's chat methods (the conversation lives in ``self.chat``, a ChatState)."""

    def chat_runtime(self):
        """Tokenizer, chat template and Generator of the loaded engine (made once per engine)."""
        if self.engine is None:
            raise WorkbenchError("load the model first (Run ▸ Apply placement)")
        if self._chat_runtime is None or self._chat_runtime.engine is not self.engine:
            self._chat_runtime = ChatRuntime(self.engine, self.inventory)
        return self._chat_runtime

    def note_tokens_per_s(self, tps: float) -> None:
        """Record a measured decode rate (tokens/s) for the performance plot (any thread)."""
        with self._lock:
            self.tps_times.append(time.monotonic())
            self.tps_values.append(float(tps))

    def tokens_per_s_series(self) -> tuple[np.ndarray, np.ndarray]:
        """(monotonic seconds, tokens/s) measured while generating, oldest first."""
        with self._lock:
            return np.array(self.tps_times), np.array(self.tps_values)

    def add_message(self, role: str, content: str) -> None:
        self.chat.messages.append(ChatMessage(role, content))
        self._chat_edited()

    def edit_message(self, index: int, content: str) -> None:
        """Change message ``index`` and drop every later one (edit and resend)."""
        self.chat.messages[index] = ChatMessage(self.chat.messages[index].role, content)
        del self.chat.messages[index + 1 :]
        self._chat_edited()

    def drop_last_reply(self) -> None:
        """Remove the last assistant message (Regenerate)."""
        if self.chat.messages and self.chat.messages[-1].role == "assistant":
            self.chat.messages.pop()
            self._chat_edited()

    def finish_reply(self, message: ChatMessage) -> None:
        """Append a reply made by :meth:`generate_reply` (GUI thread)."""
        self.chat.messages.append(message)
        self.chat.context_used = int(message.stats.get("context_used", 0))
        self._chat_edited()
        self.events.generation_finished.emit(message)

    def set_chat_settings(self, system_prompt: str | None = None, sampling: dict | None = None,
                          template_override: str | None = None) -> None:
        if system_prompt is not None:
            self.chat.system_prompt = system_prompt
        if sampling:
            self.chat.sampling.update(sampling)
        if template_override is not None:
            self.chat.template_override = template_override
        self.dirty = self.inventory is not None
        self._project_changed()
        self.events.chat_changed.emit()

    def clear_chat(self) -> None:
        self.chat.messages.clear()
        self.chat.context_used = 0
        self._chat_edited()

    def _chat_edited(self) -> None:
        self.dirty = True
        self.events.chat_changed.emit()
        self._project_changed()

    def generate_reply(self, cancel: threading.Event) -> ChatMessage:
        """Answer the conversation's last user message. Blocking: run in a worker; emits
        ``generation_token`` per piece of text from that thread. Returns the reply; the caller
        appends it with :meth:`finish_reply` on the GUI thread."""
        return generate_reply(self, cancel)


class ChatRuntime:
    """What generating needs besides the engine: tokenizer, template, Generator (one per engine)."""

    def __init__(self, engine, inventory):
        from workbench.engine.chat_template import load_chat_template
        from workbench.engine.generate import Generator
        from workbench.engine.tokenizer import tokenizer_for

        self.engine = engine
        self.tokenizer = tokenizer_for(inventory)
        if self.tokenizer is None:
            raise WorkbenchError(f"{inventory.path.name} has no tokenizer: chat needs one")
        self.model_template = load_chat_template(
            inventory.path, self.tokenizer.special_tokens,
            gguf_fields=inventory.metadata if inventory.format == "gguf" else None,
        )
        self.generator = Generator(engine, self.tokenizer)

    def template(self, override: str):
        from workbench.engine.chat_template import ChatTemplate

        if override.strip():
            return ChatTemplate(override, self.tokenizer.special_tokens, "override")
        return self.model_template

    def prompt_ids(self, messages: list[dict], override: str = "") -> list[int]:
        """Token ids of the conversation with the assistant's turn opened."""
        template = self.template(override)
        if template is None:  # no template anywhere: plain "role: text" lines
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
            return self.tokenizer.encode(text)
        return self.tokenizer.encode(template.render(messages, add_generation_prompt=True), add_special_tokens=False)


def conversation(chat) -> list[dict]:
    """The messages the template sees: the system prompt (if any) then every turn."""
    out = [{"role": "system", "content": chat.system_prompt}] if chat.system_prompt.strip() else []
    out += [{"role": m.role, "content": m.content} for m in chat.messages if m.role != "system"]
    return out


def sampling_params(settings: dict):
    from workbench.engine.sampling import SamplingParams

    temperature = float(settings.get("temperature", 0.7))
    return SamplingParams(
        temperature=temperature,
        top_k=int(settings.get("top_k", 0)),
        top_p=float(settings.get("top_p", 1.0)),
        min_p=float(settings.get("min_p", 0.0)),
        repetition_penalty=float(settings.get("repeat_penalty", 1.0)),
        seed=settings.get("seed"),
        greedy=temperature == 0,
    )


def generate_reply(session, cancel: threading.Event):
    """The assistant's answer to the conversation (a ChatMessage with its stats). Blocking."""
    if session.engine is None:
        session.load_engine(cancel=cancel)
    engine = session.engine
    runtime = session.chat_runtime()
    chat = session.chat
    ids = runtime.prompt_ids(conversation(chat), chat.template_override)
    room = engine.max_context - len(ids) - 1
    if room < 1:
        raise WorkbenchError(
            f"the conversation has {len(ids)} tokens and the context holds {engine.max_context}: "
            "start a new chat or delete earlier messages"
        )
    max_new = max(1, min(int(chat.sampling.get("max_new", 256)), room))
    params = sampling_params(chat.sampling)
    state = {"n": 0, "first": None}
    session.events.generation_started.emit()

    def on_token(_token_id: int, delta: str) -> None:
        now = time.perf_counter()
        state["n"] += 1
        if state["first"] is None:
            state["first"] = now
        elapsed = now - state["first"]
        tps = (state["n"] - 1) / elapsed if elapsed > 0 else 0.0
        session.note_tokens_per_s(tps)
        session.events.generation_token.emit(delta, tps)

    result = runtime.generator.generate(ids, max_new_tokens=max_new, sampling=params, on_token=on_token,
                                        cancel=cancel, ignore_eos=bool(chat.sampling.get("ignore_eos", False)))
    t = result.timings
    stats = {
        "ttft_s": t.ttft_s,
        "prefill_tps": t.prefill_tokens_per_s,
        "decode_tps": t.decode_tokens_per_s,
        "prompt_tokens": t.prompt_tokens,
        "tokens": t.generated_tokens,
        "stop_reason": result.stop_reason,
        "context_used": len(ids) + t.generated_tokens,
        "context_max": engine.max_context,
    }
    return ChatMessage("assistant", result.text, stats)
